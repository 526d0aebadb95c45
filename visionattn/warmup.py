"""Compile the kernels a model family uses into Triton's on-disk cache before the first real call.

    python -m visionattn.warmup                                  # fp32, tf32, fp16, bf16 at head dims 64, 128
    python -m visionattn.warmup --modes fp32,bf16 --head-dims 64 --lengths 197,1041 --training
    python -m visionattn.warmup --jobs 8                         # 8 processes compile side by side

Kernels are specialised on what changes their code (mode, head dim, bias / mask / causal, tile config, the
split-KV and log-sum-exp variants, and for the Hopper fp16 / bf16 kernel the cut of a last key tile up to 2048
keys), never on sequence lengths: a few calls per mode and head dim at short (<= 512 keys) and long lengths,
with and without a bias, build every variant a model of that family meets, and a later process finds them in
Triton's cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``). ``--lengths`` adds the lengths of your
model below 2048 keys (ViT-B/16 at 224 px: 197). ``--training`` also builds the backward kernels.
``--jobs N`` splits the work by mode and head dim (and the window kernels by mode) over N processes: a
kernel compiles on the CPU, largely in one thread, so N cores build about N variants at once.

Exit codes: 0 done; 1 a ``--jobs`` process failed (its last error line is printed); 2 bad arguments or no CUDA
GPU.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
import warnings

import torch

__all__ = ["warm_up", "main", "job_arguments", "proxy_shapes", "warm_up_shapes", "CompileAhead"]

DEFAULT_MODES = ("fp32", "tf32", "fp16", "bf16")
DEFAULT_HEAD_DIMS = (64, 128)
# a short (<= 512 keys) length and long ones: each tile-config bucket, the Gluon cut / uncut tails, split-KV
DEFAULT_LENGTHS = (197, 1041, 4096)
# proxy_shapes: a call with this many query tiles of 128 rows (B * H * tiles) or more fills any GPU, so its plan
# has no KV split, as the real call's has none; and a length past this many keys builds what any longer one does
_FULL_PROGRAMS = 1024
_PROXY_MAX_KEYS = 16384


def warm_up(modes=DEFAULT_MODES, head_dims=DEFAULT_HEAD_DIMS, lengths=DEFAULT_LENGTHS, *, training: bool = False,
            window: bool = True, device: str = "cuda", progress=print, dense: bool = True) -> dict:
    """Run one small call of every kernel variant the given modes, head dims and lengths use.

    Args:
        modes: :data:`visionattn.modes.MODES` names.
        head_dims: head dims D (= Dv).
        lengths: sequence lengths (queries = keys); lengths up to 2048 each build their own last-key-tile cut of
            the Hopper fp16 / bf16 kernel, longer ones share one build.
        training: also run a forward + backward per variant (the backward kernels and the LSE-writing forward).
        window: also Swin (49-token windows, D = 32) and Swin-v2 (64 / 256-token windows) window kernels.
        device: a CUDA device.
        dense: the dense kernels (False: the window kernels alone).

    Returns:
        ``{"calls": n, "seconds": s}``.

    Raises:
        ValueError: an unknown mode; a non-positive head dim or length.
        RuntimeError: ``device`` is not a CUDA device.
    """
    import visionattn as va

    for m in modes:
        va.get_mode(m)
    if any(int(d) < 1 for d in head_dims) or any(int(n) < 1 for n in lengths):
        raise ValueError(f"head dims {list(head_dims)} and lengths {list(lengths)} must be positive")
    if torch.device(device).type != "cuda":
        raise RuntimeError(f"device={device!r}: warming up needs a CUDA GPU (the kernels compile for it)")
    t0, calls = time.perf_counter(), 0
    for mode in modes:
        dtype = va.get_mode(mode).compute_dtype
        for d in (head_dims if dense else ()):
            for n in lengths:
                # B * H large enough for a single pass, and B = H = 1 for the split-KV path of long sequences
                grad = training and mode in _backward_modes()
                for b, h in ((8, 16), (1, 1)):
                    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=grad)
                               for _ in range(3))
                    for bias in (None, torch.randn(h, n, n, device=device, dtype=dtype) if n <= 4096 else None):
                        out = va.attention(q, k, v, bias=bias, mode=mode)
                        if grad:
                            out.sum().backward()
                        calls += 1
            progress(f"warm-up: {mode} D={d} done ({time.perf_counter() - t0:.0f} s)")
        if window:
            grad = training and mode in _backward_modes()
            for n, d, cosine in ((49, 32, False), (64, 32, True), (256, 32, True)):
                q = torch.randn(16, 4, n, d, device=device, dtype=dtype, requires_grad=grad)
                kw = dict(logit_scale=torch.zeros(4, 1, 1, device=device, requires_grad=grad)) if cosine else {}
                mask = torch.zeros(4, n, n, device=device)
                rpb = torch.randn(4, n, n, device=device, requires_grad=grad)
                for shift in (None, mask):
                    out = va.window_attention(q, q, q, relative_position_bias=rpb, shift_mask=shift, num_windows=4,
                                              cosine=cosine, mode=mode, **kw)
                    if grad:
                        out.sum().backward()
                    calls += 1
    torch.cuda.synchronize()
    return {"calls": calls, "seconds": time.perf_counter() - t0}


def proxy_shapes(shapes) -> list[tuple]:
    """Small self-attention shapes that build the kernel variants the given calls build, without their cost.

    A variant depends on the mode, the head dim, the length bucket (and for the Hopper fp16 / bf16 kernel the
    cut of a last key tile up to 2048 keys) and on whether the call splits its keys over programs, which it
    does only when ``B * H`` times its query tiles leaves SMs idle. A shape with fewer than 1024 query tiles
    of 128 rows is kept as it is (it is small); a larger one keeps its length up to 16384 keys (or the fewest that
    make 1024 tiles over all its batch entries) and takes the fewest batch entries that still make 1024 tiles,
    so neither it nor the real call splits.

    Args:
        shapes: ``(batch, num_heads, seq_len, head_dim)`` per attention call (queries = keys), or with a fifth
            element, the inputs' ``torch.dtype`` where it is not the mode's (kept as it is in the proxy).

    Returns:
        the distinct proxy shapes, in first-seen order.
    """
    out = []
    for shape in shapes:
        b, h, n, d = (int(x) for x in shape[:4])
        if min(b, h, n, d) < 1:
            raise ValueError(f"shape {(b, h, n, d)}: batch, num_heads, seq_len and head_dim must be positive")
        if b * h * math.ceil(n / 128) >= _FULL_PROGRAMS:
            n = min(n, max(_PROXY_MAX_KEYS, 128 * math.ceil(_FULL_PROGRAMS / (b * h))))
            b = min(b, max(1, math.ceil(_FULL_PROGRAMS / (h * math.ceil(n / 128)))))
        proxy = (b, h, n, d, *shape[4:5])
        if proxy not in out:
            out.append(proxy)
    return out


def warm_up_shapes(mode: str, shapes, *, device: str = "cuda") -> dict:
    """Run one forward call per :func:`proxy_shapes` shape in ``mode``: the kernels a model's forward uses are
    then compiled (in this process and in Triton's on-disk cache).

    Args:
        mode: a :data:`visionattn.modes.MODES` name.
        shapes: ``(batch, num_heads, seq_len, head_dim)`` of the model's attention calls, inputs in the mode's
            dtype; a fifth element names another input dtype (e.g. ``torch.float32`` for a model's FP32 heads
            in a half mode: the kernel then writes an FP32 output, a variant of its own).
        device: a CUDA device.

    Returns:
        ``{"calls": n, "seconds": s}``.

    Raises:
        ValueError: an unknown mode or a non-positive size.
        RuntimeError: ``device`` is not a CUDA device.
    """
    import visionattn as va

    dtype = va.get_mode(mode).compute_dtype
    if torch.device(device).type != "cuda":
        raise RuntimeError(f"device={device!r}: warming up needs a CUDA GPU (the kernels compile for it)")
    t0, calls = time.perf_counter(), 0
    with torch.no_grad():
        for b, h, n, d, *given in proxy_shapes(shapes):
            q = torch.randn(b, h, n, d, device=device, dtype=given[0] if given else dtype)
            va.attention(q, q, q, mode=mode)
            calls += 1
    torch.cuda.current_stream(torch.device(device)).synchronize()
    return {"calls": calls, "seconds": time.perf_counter() - t0}


class CompileAhead:
    """:func:`warm_up_shapes` in a background thread, so the kernels compile while the caller does other work
    (loading a model's weights, decoding images); :meth:`wait` before the first real attention call.

    Triton hands the code generation's slow parts (``ptxas``, the launcher's C compiler) to child processes
    and PyTorch lets go of the GIL while it copies weights, so most of the compile time overlaps. A failed
    warm-up costs nothing but time: :meth:`wait` warns once, and the first real call compiles as it would
    have. Start it before the caller itself uses CUDA kernels of this library: the two threads would
    otherwise compile the same variant side by side.

    Args:
        mode, shapes, device: as :func:`warm_up_shapes`.

    Raises:
        ValueError: an unknown mode or a non-positive size (at once, in the caller's thread).
    """

    def __init__(self, mode: str, shapes, device: str = "cuda"):
        import visionattn as va

        va.get_mode(mode)
        self.mode, self.shapes, self.device = mode, list(shapes), device
        proxy_shapes(self.shapes)
        self._result: dict | None = None
        self._warned = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="visionattn-compile-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = warm_up_shapes(self.mode, self.shapes, device=self.device)
        except BaseException as exc:  # reported by wait(), in the caller's thread
            self._error = exc

    def wait(self) -> dict:
        """Block until the warm-up ends. Returns ``{"calls", "seconds", "waited"}`` (``waited``: seconds this
        call blocked), or ``{"error": message, "waited"}`` when the warm-up failed (a warning on the first wait)."""
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        if self._error is not None:
            if not self._warned:
                self._warned = True
                warnings.warn(f"visionattn: compiling the {self.mode} attention kernels ahead failed "
                              f"({type(self._error).__name__}: {self._error}); they compile on the first call "
                              "instead", RuntimeWarning, stacklevel=2)
            return {"error": f"{type(self._error).__name__}: {self._error}", "waited": waited}
        return {**self._result, "waited": waited}


def job_arguments(modes, head_dims, lengths, *, training: bool = False, window: bool = True, dense: bool = True,
                  device: str = "cuda") -> list[list[str]]:
    """The command-line arguments of the processes ``--jobs`` runs: one per (mode, head dim) for the dense
    kernels (unless ``dense`` is False) and one per mode for the window kernels, each a
    ``python -m visionattn.warmup`` of that part alone. Together they make the same calls as one
    :func:`warm_up` with the same ``window`` and ``dense``."""
    common = ["--lengths", ",".join(str(n) for n in lengths), "--device", device] + (["--training"] if training
                                                                                   else [])
    jobs = [["--modes", m, "--head-dims", str(d), "--no-window"] + common for m in modes
            for d in (head_dims if dense else ())]
    if window:
        jobs += [["--modes", m, "--no-dense"] + common for m in modes]
    return jobs


def _run_jobs(jobs: list[list[str]], workers: int) -> tuple[int, list[str]]:
    """Run ``python -m visionattn.warmup`` once per argument list, ``workers`` at a time; ``(calls, failures)``."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def run(args):
        proc = subprocess.run([sys.executable, "-m", "visionattn.warmup", *args], capture_output=True, text=True)
        return args, proc

    calls, failures = 0, []
    with ThreadPoolExecutor(workers) as pool:
        for args, proc in pool.map(run, jobs):
            part = " ".join(args[:4])
            if proc.returncode != 0:
                failures.append(f"{part}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
                continue
            done = [line for line in proc.stdout.splitlines() if " calls in " in line]
            calls += int(done[-1].split()[1]) if done else 0
            print(f"visionattn.warmup: {part} done", flush=True)
    return calls, failures


def _backward_modes():
    from .checks import BACKWARD_MODES

    return BACKWARD_MODES


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{name} must be positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m visionattn.warmup", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma-separated precision modes (default: %(default)s)")
    p.add_argument("--head-dims", type=lambda t: _ints(t, "--head-dims"), default=DEFAULT_HEAD_DIMS,
                   help="comma-separated head dims (default: 64,128)")
    p.add_argument("--lengths", type=lambda t: _ints(t, "--lengths"), default=DEFAULT_LENGTHS,
                   help="comma-separated sequence lengths (default: 197,1041,4096)")
    p.add_argument("--training", action="store_true", help="also build the backward kernels")
    p.add_argument("--no-window", action="store_true", help="skip the Swin / Swin-v2 window kernels")
    p.add_argument("--no-dense", action="store_true", help="skip the dense kernels (the window kernels alone)")
    p.add_argument("--jobs", type=lambda t: _ints(t, "--jobs")[0], default=1,
                   help="processes compiling side by side, split by mode and head dim (default: 1)")
    p.add_argument("--device", default="cuda", help="CUDA device (default: %(default)s)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .modes import mode_names

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in mode_names()]
    if unknown or not modes:
        parser.error(f"--modes {args.modes!r}: unknown {unknown}; expected some of {mode_names()}")
    if not torch.cuda.is_available() or torch.device(args.device).type != "cuda":
        print("visionattn.warmup: needs a CUDA GPU (the kernels compile for it); none is visible", file=sys.stderr)
        return 2
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    print(f"visionattn.warmup: building kernels into the Triton cache at {cache}")
    if args.jobs > 1:
        t0 = time.perf_counter()
        jobs = job_arguments(modes, args.head_dims, args.lengths, training=args.training,
                             window=not args.no_window, dense=not args.no_dense, device=args.device)
        calls, failures = _run_jobs(jobs, args.jobs)
        print(f"visionattn.warmup: {calls} calls in {time.perf_counter() - t0:.1f} s ({len(jobs)} processes, "
              f"{args.jobs} at a time)")
        for line in failures:
            print(f"visionattn.warmup: failed: {line}", file=sys.stderr)
        return 1 if failures else 0
    result = warm_up(modes, args.head_dims, args.lengths, training=args.training, window=not args.no_window,
                     device=args.device, dense=not args.no_dense)
    print(f"visionattn.warmup: {result['calls']} calls in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
