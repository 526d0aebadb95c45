"""Small I/O helpers shared by tools: environment record, atomic writes, the output-file rule, markdown tables."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

__all__ = ["environment", "command_line", "atomic_path", "write_text_atomic", "write_json_atomic",
           "save_figure_atomic", "OutputFiles", "STORAGE_ERRNOS", "markdown_table", "tf32_disabled", "Stopwatch",
           "call_ms", "sample_ms", "kernel_ms", "eager_ms", "eager_graph_ms", "host_us", "per_call_ms", "peak_extra_mb",
           "AttentionFree", "attention_free"]


def command_line() -> str:
    """The command that started this process, shell-quoted."""
    return " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv)


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions and hardware every committed result must name (GPU, torch, triton, timm, Python).

    Args:
        extra: tool-specific entries merged in last (they win over the standard keys).
    """
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                   else f"CPU ({platform.processor() or platform.machine()})"),
        "command": command_line(),
    }
    for name in ("triton", "timm", "diffusers"):
        env[name] = _version(name)
    if extra:
        env.update(extra)
    return env


def _version(name: str) -> str | None:
    """A package's version without importing it (importing diffusers and timm takes seconds): the loaded
    module's own ``__version__`` when it is imported already, else its installed distribution's; None if
    neither."""
    from importlib import metadata

    if name in sys.modules:
        return getattr(sys.modules[name], "__version__", None)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temp path next to ``path`` (same name ending, so writers that go by the extension work);
    rename it to ``path`` when the block succeeds, delete it otherwise (no partial files)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; outputs get the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and a rename (no partial files)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def write_json_atomic(path: str, obj: Any, indent: int = 2) -> None:
    """JSON-dump ``obj`` (``indent``, default 2) atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent, default=str) + "\n")


def save_figure_atomic(fig: Any, path: str, **savefig_kwargs: Any) -> None:
    """``fig.savefig(path, **savefig_kwargs)`` atomically; the figure is left open (close it yourself)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, **savefig_kwargs)


# errors of a full or limited disk (disk full, quota, file-size limit): one line naming the folder, as the demo
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _checksum(path: str) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of the file at ``path``."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


class OutputFiles:
    """The files a tool writes, under the rule every tool that writes follows: never replace a file it did not write.

    The rule of the reconstruction demo's output folder (:mod:`visionattn.recon.outdir`), file by file: each folder
    a tool writes into keeps the tool's manifest, ``.visionattn-<tool>.json`` (the demo's manifest format, ``tool``
    ``"visionattn.<tool>"``), listing the files it wrote there with their size and SHA-256. An existing file is
    replaced only when that manifest lists it and it is unchanged since; anything else (a user's file, a link, a
    folder, an output edited since, a manifest that is not this tool's) is refused with one line naming the file
    and the fix, before the tool works (:meth:`check` of the paths it will write) and again at each write. Each
    write goes to a temporary file in the same folder renamed into place (:func:`atomic_path`); when a full disk,
    a quota or the file-size limit stops it the temporary file is removed and the line names the folder. Other
    tools' manifests and files in the same folder are left alone.

    Args:
        tool: the tool's name (``"drift_table"``): manifest ``.visionattn-drift_table.json``.
        flag: the argument that chose the paths, for the messages.
        on_error: called with the one-line message of a refusal or a full disk (a CLI passes ``parser.error``:
            exit 2); without it (or when it returns) :class:`visionattn.recon.outdir.OutputDirError` is raised
            (:class:`~visionattn.recon.outdir.OutputWriteError` for a full disk).

    Attributes:
        written: absolute paths written so far, in order (a path written twice appears twice).
    """

    def __init__(self, tool: str, flag: str = "--out", on_error: Callable[[str], Any] | None = None):
        from visionattn.recon.outdir import manifest_name

        self.tool = tool
        self.tool_id = f"visionattn.{tool}"
        self.manifest = manifest_name(self.tool_id)
        self.flag = flag
        self.written: list[str] = []
        self._on_error = on_error

    def _fail(self, exc: Exception) -> None:
        if self._on_error is not None:
            self._on_error(str(exc))
        raise exc

    def _read_manifest(self, folder: str) -> tuple[dict | None, str | None]:
        """(this tool's manifest in ``folder`` or None, why it cannot be used or None)."""
        from visionattn.recon.outdir import read_manifest

        path = os.path.join(folder, self.manifest)
        if not os.path.lexists(path):
            return None, None
        doc = None if os.path.islink(path) else read_manifest(folder, self.tool_id)
        if doc is None:
            return None, (f"{self.flag}: {path!r} is not a manifest of {self.tool} (it names the files {self.tool} "
                          f"wrote there); refusing to replace it: pass another {self.flag} or remove the file")
        return doc, None

    def refusal(self, path: str) -> str | None:
        """Why ``path`` may not be written now (one line naming it and the fix), or None when it may."""
        path = os.path.abspath(path)
        folder, name = os.path.split(path)
        if name == self.manifest:
            return f"{self.flag}: {path!r} is the name of {self.tool}'s manifest; pass another {self.flag}"
        manifest, why = self._read_manifest(folder)
        if why is not None:
            return why
        if not os.path.lexists(path):
            return None
        if os.path.islink(path) or not os.path.isfile(path):
            return (f"{self.flag}: {path!r} exists and is not a file {self.tool} wrote; refusing to replace it: "
                    f"pass another {self.flag} or remove it")
        entry = (manifest or {}).get("checksums", {}).get(name) if name in (manifest or {}).get("files", ()) else None
        if not isinstance(entry, dict):
            return (f"{self.flag}: {path!r} exists and {self.tool} did not write it (it is not in {self.manifest} "
                    f"there); refusing to replace it: pass another {self.flag} or remove the file")
        try:
            same = os.stat(path).st_size == entry.get("bytes") and _checksum(path) == entry
        except OSError:
            same = False
        if not same:
            return (f"{self.flag}: {path!r} was written by {self.tool} but has changed since; refusing to replace "
                    f"it: pass another {self.flag} or remove the file")
        return None

    def check(self, *paths: str) -> None:
        """Refuse (``on_error``, else raise) if any of ``paths`` may not be written (:meth:`refusal`); writes
        nothing."""
        from visionattn.recon.outdir import OutputDirError

        for p in paths:
            why = self.refusal(p)
            if why is not None:
                self._fail(OutputDirError(why))

    def _record(self, path: str, checksum: dict[str, Any]) -> None:
        folder, name = os.path.split(path)
        manifest, _ = self._read_manifest(folder)
        sums = {f: c for f, c in ((manifest or {}).get("checksums") or {}).items()
                if f in manifest["files"] and os.path.lexists(os.path.join(folder, f))}
        sums[name] = checksum
        doc = {"tool": self.tool_id,
               "note": f"the files {self.tool} wrote in this folder (bytes, SHA-256); a later run replaces only these, "
                       "and only while they are unchanged",
               "files": sorted(sums), "dirs": [], "checksums": dict(sorted(sums.items()))}
        write_text_atomic(os.path.join(folder, self.manifest), json.dumps(doc, indent=1) + "\n")

    @contextlib.contextmanager
    def path(self, path: str) -> Iterator[str]:
        """Yield a temporary path for ``path`` (same name ending), renamed to ``path`` and recorded in the manifest
        when the block succeeds; refused (:meth:`refusal`) before the block and again before the rename; on an
        error, a refusal or a full disk the temporary file is removed (no partial file)."""
        from visionattn.recon.outdir import OutputDirError, OutputWriteError

        path = os.path.abspath(path)
        folder = os.path.dirname(path)
        self.check(path)
        try:
            with atomic_path(path) as tmp:
                yield tmp
                checksum = _checksum(tmp)
                why = self.refusal(path)  # again: the file may have appeared while the tool worked
                if why is not None:
                    raise OutputDirError(why)
            self._record(path, checksum)
        except OutputDirError as exc:
            self._fail(exc)
        except OSError as exc:
            if exc.errno not in STORAGE_ERRNOS:
                raise
            self._fail(OutputWriteError(
                f"{self.flag}: could not write {path!r}: {exc.strerror or exc} in the folder {folder!r}; no partial "
                f"file was left: free space there or pass another {self.flag} on another disk"))
        self.written.append(path)

    def write_text(self, path: str, text: str) -> None:
        """Write ``text`` to ``path`` under the rule (:meth:`path`)."""
        with self.path(path) as tmp, open(tmp, "w") as f:
            f.write(text)

    def write_json(self, path: str, obj: Any, indent: int = 2) -> None:
        """JSON-dump ``obj`` (``indent``, default 2; non-JSON values as ``str``) to ``path`` under the rule."""
        self.write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")

    def save_figure(self, fig: Any, path: str, **savefig_kwargs: Any) -> None:
        """``fig.savefig(path, **savefig_kwargs)`` under the rule; the figure is left open (close it yourself)."""
        with self.path(path) as tmp:
            fig.savefig(tmp, **savefig_kwargs)


def markdown_table(rows: Iterable[Sequence[Any]], header: Sequence[str]) -> str:
    """A GitHub markdown table; floats shown with 4 significant digits."""
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.4g}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def tf32_disabled():
    """Turn TF32 off for PyTorch matmuls and cuDNN convolutions, restoring the old settings after.

    Process-wide: for tools and tests only (library code never flips global
    precision). Without it, cuDNN convolutions run in TF32 by default, and FP32
    comparisons measure the convolutions, not attention.

    Yields:
        The settings in force, for the tool's record.
    """
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield {"torch.backends.cuda.matmul.allow_tf32": False, "torch.backends.cudnn.allow_tf32": False}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class AttentionFree:
    """While active, ``torch.nn.functional.scaled_dot_product_attention`` computes no attention: it returns a copy
    of the value rows (``value[..., :Nq, :]``, or zeros of the output's shape, without a gradient, when there are
    fewer key rows than query rows or the leading dims differ). A model timed inside runs everything but its
    attention, so ``t(model) / t(model inside)`` bounds the speed-up that any attention kernel can give it
    (Amdahl's law): the "attention-free" rows of the tools. Gradients flow to ``value``, and zeros to a float
    ``attn_mask`` (SDPA) or ``relative_position_bias`` / ``bias`` (:meth:`core`) that requires them, so a training
    step still runs every other backward, the position-bias tables' included (timm's Swin gathers its bias from a
    table, Swin-v2 computes it with an MLP, every training forward). For benchmarks only; the outputs are meaningless.

    :meth:`core` answers the same way for an attention core that is not SDPA (e.g. visionattn's cores of a patched
    model, through ``visionattn.patching.timm.override_cores``): the bound of a model whose own attention never calls
    SDPA (timm's Swin-v2 computes its cosine attention itself).

    Attributes:
        calls: SDPA calls answered so far. 0 after a forward means the model does not reach SDPA and its time is no
            bound.
        core_calls: :meth:`core` calls answered so far.

    Raises:
        RuntimeError: entered again while active (not re-entrant).
    """

    def __init__(self):
        self.calls = 0
        self.core_calls = 0
        self._saved = None

    def _sdpa(self, query, key, value, attn_mask=None, *args, **kwargs):
        self.calls += 1
        return self._value_rows(query, value, attn_mask)

    def core(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        """An attention core ``(query [..., Nq, D], key, value [..., Nk, Dv], **options) -> [..., Nq, Dv]`` that
        computes no attention: a copy of the value rows, as the SDPA stand-in (a ``relative_position_bias`` or
        ``bias`` option that requires a gradient gets zeros; other options ignored)."""
        self.core_calls += 1
        return self._value_rows(query, value, kwargs.get("relative_position_bias", kwargs.get("bias")))

    @staticmethod
    def _value_rows(query, value, bias=None):
        n = query.shape[-2]
        if value.shape[:-2] == query.shape[:-2] and value.shape[-2] >= n:
            out = value[..., :n, :].clone()
        else:
            out = value.new_zeros(query.shape[:-1] + value.shape[-1:])
        if isinstance(bias, torch.Tensor) and bias.requires_grad and bias.is_floating_point():
            out = _ZeroGradTo.apply(out, bias)
        return out

    def __enter__(self) -> "AttentionFree":
        if self._saved is not None:
            raise RuntimeError("AttentionFree is not re-entrant")
        self._saved = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.functional.scaled_dot_product_attention = self._saved
        self._saved = None


class _ZeroGradTo(torch.autograd.Function):
    """``out`` unchanged; in the backward, zeros for ``tied`` (its producers' backward still runs)."""

    @staticmethod
    def forward(ctx, out, tied):
        ctx.tied = (tied.shape, tied.dtype, tied.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.tied
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def attention_free() -> AttentionFree:
    """Context manager: :class:`AttentionFree` (SDPA calls inside return a copy of the value rows; the time of a
    model without its attention, the Amdahl bound of any attention kernel's speed-up on it).

    ::

        with reporting.attention_free() as free:
            t_floor = call_ms(lambda: model(x), device)
        assert free.calls > 0, "the model never called SDPA: no bound"
    """
    return AttentionFree()


class Stopwatch:
    """Total time of the regions between :meth:`start` and :meth:`stop` (or ``with stopwatch:``).

    On a CUDA ``device`` the regions are timed with CUDA events (the GPU time of the work queued
    inside them, with no synchronization inside the loop); elsewhere with ``perf_counter`` (wall
    time). :attr:`seconds` waits for the last event.

    Attributes:
        kind: ``"cuda-events"`` or ``"wall"``, for the record of a result.
        count: regions timed so far.
    """

    def __init__(self, device: str | torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.kind = "cuda-events" if self.cuda else "wall"
        self.count = 0
        self._events: list[tuple[Any, Any]] = []
        self._wall = 0.0
        self._open: Any = None

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("Stopwatch.stop() without a start()")
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._open, end))
        else:
            self._wall += time.perf_counter() - self._open
        self._open = None
        self.count += 1

    def __enter__(self) -> "Stopwatch":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def seconds(self) -> float:
        """Total seconds of the timed regions."""
        if self.cuda:
            if self._events:
                self._events[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        return self._wall


def call_ms(fn: Callable[[], Any], device: str | torch.device) -> float:
    """Milliseconds of one ``fn()`` (:class:`Stopwatch`: CUDA events on CUDA, ``perf_counter`` otherwise).

    The CUDA path waits for the end event, so the GPU work ``fn`` queued is inside the time.
    """
    watch = Stopwatch(device)
    with watch:
        fn()
    return watch.seconds * 1e3


def sample_ms(fn: Callable[[], Any], device: str | torch.device, *, warmup: int = 1, reps: int | None = None,
              rep_ms: float | None = None, min_reps: int = 1, max_reps: int = 1000) -> list[float]:
    """Per-call milliseconds of ``fn()`` (each timed by :func:`call_ms`) after ``warmup`` untimed calls.

    ``reps`` calls when given; otherwise as many as fit in ``rep_ms`` (estimated from one more
    untimed call), clamped to ``[min_reps, max_reps]``.
    """
    if (reps is None) == (rep_ms is None):
        raise ValueError("pass exactly one of reps or rep_ms")
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if reps is None:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        est_ms = (time.perf_counter() - t0) * 1e3
        reps = int(min(max_reps, max(min_reps, math.ceil(rep_ms / max(est_ms, 1e-3)))))
    return [call_ms(fn, device) for _ in range(reps)]


def kernel_ms(fn: Callable[[], Any], warmup: float, rep: float, cuda_graph: bool = False) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device.

    ``cuda_graph=False``: ``triton.testing.do_bench`` (CUDA events around each call, L2 flushed
    between calls); a call whose Python launch path outlasts its GPU work reads as the launch time.
    ``cuda_graph=True``: ``triton.testing.do_bench_cudagraph`` (the calls replayed from a CUDA graph:
    GPU time without launch overhead, L2 not flushed). ``warmup`` / ``rep`` are milliseconds
    (``warmup`` unused with a graph: the capture runs ``fn`` first).
    """
    import triton.testing

    if cuda_graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def eager_ms(fn: Callable[[], Any], calls: int = 50, warmup: int = 5, repeats: int = 5) -> float:
    """Milliseconds per call of ``fn()`` run back to back in eager PyTorch on the current CUDA device: CUDA events
    around ``calls`` consecutive calls (no synchronisation between them), the median over ``repeats`` such
    windows. The Python launch path counts: a call whose host work outlasts its GPU work reads as the host
    time, which is what an eager model sees."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return float(sorted(times)[len(times) // 2])


def eager_graph_ms(make: Callable[[], Callable[[], Any]], calls: int = 50, repeats: int = 5,
                   warmup: int = 3) -> tuple[float, float | None, BaseException | None]:
    """Milliseconds per call of ``fn = make()`` in eager PyTorch and replayed from a CUDA graph, timed in
    alternating windows so that both readings see the same GPU state (clocks and caches drift over a run, and
    two readings taken one after the other differ by up to ~15 % for ~0.1 ms kernels on an H100).

    ``make`` runs on a side stream, where everything here runs (autograd runs a backward on the stream of its
    forward); ``fn`` is called ``warmup`` times (compiles and caches settle outside the capture), then ``calls``
    back-to-back calls are captured in one graph (its own memory pool, freed on return). Each of ``repeats``
    rounds times ``calls`` eager calls between CUDA events (the Python launch path counts, as
    :func:`eager_ms`), then one replay of the graph (GPU time without the launch path).

    Returns:
        (eager ms, graph ms, None), the medians over the rounds; (eager ms, None, the exception) when the calls
        cannot be captured (the eager windows still run).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = error = None
    try:
        with torch.cuda.stream(stream):
            fn = make()
            for _ in range(warmup):
                fn()
            stream.synchronize()
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(calls):
                        fn()
                graph.replay()  # untimed: the first replay uploads the graph
            except Exception as exc:  # a launch path that cannot be captured: eager timing still stands
                graph, error = None, exc
                torch.cuda.synchronize()

            def window(run: Callable[[], Any]) -> float:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / calls

            def burst() -> None:
                for _ in range(calls):
                    fn()

            eager, replay = [], []
            for _ in range(repeats):
                eager.append(window(burst))
                if graph is not None:
                    replay.append(window(graph.replay))
    finally:
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    median = lambda xs: float(sorted(xs)[len(xs) // 2])  # noqa: E731
    return median(eager), (median(replay) if replay else None), error


def host_us(fn: Callable[[], Any], calls: int = 200, warmup: int = 20, repeats: int = 5) -> float:
    """Host microseconds per call of ``fn()``: wall time of ``calls`` back-to-back calls without synchronising,
    median over ``repeats`` windows (the GPU work of a tiny call finishes long before the next launch, so this
    is the Python + dispatch + launch path alone)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return float(sorted(times)[len(times) // 2])


def per_call_ms(device: torch.device, calls: int, repeats: int,
                warmup: int = 3) -> Callable[[Callable[[], Any]], float]:
    """A timer ``timer(fn) -> ms per call``: :func:`eager_ms` on CUDA; on the CPU the wall clock around ``calls``
    back-to-back calls, median over ``repeats`` windows after ``warmup`` untimed calls."""
    if device.type == "cuda":
        return lambda fn: eager_ms(fn, calls=calls, warmup=warmup, repeats=repeats)

    def wall(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
        return float(sorted(times)[len(times) // 2])
    return wall


def peak_extra_mb(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Most CUDA memory allocated during one ``fn()`` beyond what was allocated before it (MiB); None on the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20
