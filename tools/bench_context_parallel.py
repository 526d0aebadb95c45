"""Context-parallel attention (ring, Ulysses) at VGGT's global-attention shape, and whole models split by frames,
against one GPU.

Attention (default): B=1, H=16, D=64, N = frames x 1041 split across the ranks as evenly as possible; per (N, mode,
``--scheme``) one :func:`visionattn.distributed.context_parallel_attention` forward on every rank (the slowest
rank's time; JSON keys ``ring_*`` for every scheme) against :func:`visionattn.attention` of the whole sequence on
rank 0 (:func:`_harness.per_call_ms`). ``--vggt FRAMES``: random-weight VGGT-1B (``--model pi3``: π³) with every rank
running its chunk of one scene inside :func:`visionattn.models.context_parallel.split_frames` against rank 0 alone
(median of ``--repeats`` forwards after one untimed). Both report speed-up, peak memory and rank 0's rel L2. NVLink
multicast is left off. Rank 0 writes ``<out>.md``, ``<out>.json`` (``--vggt``: and ``<out>.png``).

    torchrun --nproc-per-node 4 tools/bench_context_parallel.py --seq 208200 --scheme ring ulysses auto --out OUT
    torchrun --nproc-per-node 2 tools/bench_context_parallel.py --vggt 200,400 --mode bf16 --out out/cp_vggt_2gpu
    torchrun --nproc-per-node 2 tools/bench_context_parallel.py --device cpu --tiny --vggt 3,8 --mode fp32  # gloo
"""
from __future__ import annotations

import os

NVLS_VARIABLES = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in NVLS_VARIABLES.items():
    os.environ.setdefault(_name, _value)  # before torch.distributed starts NCCL

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, add_common, check_device, comma_ints, comma_list, default_out,  # noqa: E402
                      environment, figure, markdown_table, peak_memory, per_call_ms, positive_int, prefix_outputs,
                      tf32_flags, write_results)
from bench_vggt import ROWS, _timed, build  # noqa: E402

import visionattn  # noqa: E402
from visionattn.distributed import SCHEMES, _context_parallel, pick_scheme  # noqa: E402
from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import MODES, mode_names  # noqa: E402

TOKENS_PER_FRAME = 1041  # VGGT at 518x392: 37 x 28 patches + camera + 4 registers
VGGT_MODES = ("fp32", "tf32", "bf16")  # --vggt: bench_vggt.py's rows of these names (bf16: under bf16 autocast)
# --vggt --model: the outputs compared with the single-process model
MODEL_KEYS = {"vggt": ("depth", "world_points", "pose_enc"), "pi3": ("points", "local_points", "camera_poses")}
MODEL_NAMES = {"vggt": ("VGGT-1B", "tiny VGGT (vggt_tiny_config"), "pi3": ("π³", "tiny π³ (pi3_tiny_config")}

parser = ToolParser(prog="bench_context_parallel.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
parser.add_argument("--seq", default=f"{32 * TOKENS_PER_FRAME},{100 * TOKENS_PER_FRAME}",
                    help="comma-separated total sequence lengths N (default: 32 and 100 frames, %(default)s)")
parser.add_argument("--mode", default="fp32,bf16", help=f"comma-separated modes, some of {','.join(mode_names())} "
                    "(default: %(default)s)")
parser.add_argument("--scheme", nargs="+", default=None, metavar="SCHEME",
                    help=f"context-parallel schemes, one row each per (N, mode): some of {', '.join(SCHEMES)} "
                         "(space- or comma-separated; default: ring). Not with --vggt (split_frames: auto)")
parser.add_argument("--batch", type=positive_int, default=1, help="batch B (default: %(default)s)")
parser.add_argument("--heads", type=positive_int, default=16, help="attention heads H (default: %(default)s)")
parser.add_argument("--head-dim", type=positive_int, default=64, help="head dim D (default: %(default)s)")
add_common(parser, calls=5, repeats=(3, "timing windows (--vggt: timed forwards); the median is reported"),
           warmup=(2, "untimed calls before timing (--vggt: one untimed forward unless 0)"),
           seed=(0, "seed of the N(0, 1) inputs (--vggt: of the weights and images)"),
           device=("cuda", "cuda (NCCL, one GPU per rank: LOCAL_RANK) or cpu (gloo, wall clock)"),
           out=(default_out("context_parallel_bench"), "output prefix: rank 0 writes <out>.md, <out>.json (--vggt: "
                "and <out>.png)"))
parser.add_argument("--no-single", action="store_true", help="skip the single-GPU baseline (and the error check)")
parser.add_argument("--quiet", action="store_true", help="do not print the table")
parser.add_argument("--vggt", metavar="FRAMES", default=None,
                    help="comma-separated frame counts, each >= the ranks: time the whole model with its frames split "
                         f"across the ranks against one GPU; --mode some of {','.join(VGGT_MODES)}")
parser.add_argument("--model", choices=tuple(MODEL_KEYS), default="vggt",
                    help="--vggt: VGGT-1B or π³ (random weights) (default: %(default)s)")
parser.add_argument("--tiny", action="store_true", help="--vggt: the tiny config, 56x70 images by default")
parser.add_argument("--height", type=positive_int, default=392, help="--vggt: image height, a multiple of 14")
parser.add_argument("--width", type=positive_int, default=518, help="--vggt: image width, a multiple of 14")


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s shard of ``n`` tokens: as even as possible, the first ``n mod world`` ranks
    one token longer."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _init(device: torch.device) -> tuple[int, int, str | None]:
    """Join the torchrun group (``RANK`` / ``WORLD_SIZE`` in the environment) or make a group of one process;
    returns (rank, world size, temp file of a one-process group)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group(backend)
        return dist.get_rank(), dist.get_world_size(), None
    fd, store = tempfile.mkstemp(prefix="bench_cp_")
    os.close(fd)
    os.unlink(store)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return 0, 1, store


def bench(seqs: list[int], modes: list[str], schemes: list[str], args, device: torch.device, rank: int,
          world: int) -> list[dict]:
    """One row per (sequence length, mode, scheme), on rank 0 (other ranks return their rows' parallel times
    only): the schemes of one (N, mode) share the inputs and the single-GPU baseline."""
    timer = per_call_ms(device, args.calls, args.repeats, args.warmup)
    B, H, D = args.batch, args.heads, args.head_dim
    rows = []
    for n in seqs:
        s, e = shard_bounds(n, world, rank)
        for mode in modes:
            dtype = MODES[mode].compute_dtype
            g = torch.Generator(device=device).manual_seed(args.seed)
            full = [torch.randn(B, H, n, D, generator=g, device=device, dtype=dtype) for _ in range(3)]
            mine = [t[:, :, s:e].clone() for t in full]
            single_ms = single_peak = ref = None
            with torch.no_grad():
                if rank == 0 and not args.no_single:
                    def single():
                        return visionattn.attention(*full, mode=mode)
                    ref = single()[:, :, s:e]
                    single_ms = timer(single)
                    single_peak = peak_memory(single, device)["peak_extra_mib"]
                full = None  # freed before the parallel calls (not del: single() closes over it)
                dist.barrier()
                for scheme in schemes:
                    def parallel():
                        return _context_parallel(*mine, None, mode, None, None, False, None, scheme)

                    out = parallel()
                    dist.barrier()
                    ms = timer(parallel)
                    peak = peak_memory(parallel, device)["peak_extra_mib"]
                    err = None if ref is None else rel_l2(out, ref)
                    out = None
                    dist.barrier()
                    per_rank = [None] * world
                    dist.all_gather_object(per_rank, dict(ring_ms=ms, peak_mb=peak, tokens=e - s))
                    slowest = max(p["ring_ms"] for p in per_rank)
                    taken = pick_scheme(scheme, H, world)
                    rows.append(dict(seq=n, frames=n / TOKENS_PER_FRAME, mode=mode, scheme=scheme, scheme_taken=taken,
                                     world_size=world, shard_tokens=[p["tokens"] for p in per_rank],
                                     ring_ms=slowest, ring_ms_per_rank=[p["ring_ms"] for p in per_rank],
                                     ring_peak_mb=None if peak is None else max(p["peak_mb"] for p in per_rank),
                                     single_ms=single_ms, single_peak_mb=single_peak,
                                     speedup=None if single_ms is None else single_ms / slowest, rel_l2_rank0=err))
                    if rank == 0 and not args.quiet:
                        name = scheme if taken == scheme else f"{scheme}->{taken}"
                        extra = "" if single_ms is None else \
                            f"  single {single_ms:.3f} ms  x{single_ms / slowest:.2f}  rel L2 {err:.2e}"
                        print(f"N={n:7d} {mode:9s} {name:13s} {slowest:.3f} ms (ranks {world}){extra}", flush=True)
            mine = ref = None  # freed (not del: parallel() closes over mine)
    return rows


def vggt_rows(frame_counts: list[int], modes: list[str], args, device: torch.device, rank: int,
              world: int) -> list[dict]:
    """One row per (frames, mode) of ``--vggt`` on every rank (module docstring): the split forward's median
    time and peak memory on every rank (gathered), rank 0's single-process forward of all frames and the
    largest relative L2 error over the model's :data:`MODEL_KEYS` of rank 0's frames against it."""
    from visionattn.models.context_parallel import split_frames
    from visionattn.models.vggt import autocast

    keys = MODEL_KEYS[args.model]
    if args.model == "pi3":
        from visionattn.recon.pipeline import build_model

        model = build_model("pi3", "random-tiny" if args.tiny else "random", device=device, seed=args.seed)
    else:
        model = build("vggt", args.seed, device, args.tiny)
    cuda = device.type == "cuda"

    def images(n: int) -> torch.Tensor:  # the same scene on every rank
        g = torch.Generator(device=device).manual_seed(args.seed + n)
        return torch.rand(n, 3, args.height, args.width, generator=g, device=device)

    def forwards(x: torch.Tensor, dtype, keep: slice, barrier: bool, exact: bool):
        """(median seconds of ``--repeats`` timed forwards, peak GB after the warm-up or None on the CPU,
        the last forward's ``keys`` outputs of frames ``keep`` on the CPU). ``exact``: TF32 off for the matmuls
        and cuDNN's convolutions (on by default for convolutions), so an FP32 row compares FP32 with FP32."""
        with torch.no_grad(), autocast(device.type, dtype), (tf32_flags() if exact else contextlib.nullcontext()):
            if args.warmup:
                model(x)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times, out = [], {}
            for _ in range(args.repeats):
                out.clear()  # the last outputs are freed before the next forward
                if barrier:
                    dist.barrier()
                times.append(_timed(lambda: out.update(model(x)), device))
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None
        return sorted(times)[len(times) // 2], peak, {k: out[k][:, keep].float().cpu() for k in keys}

    rows = []
    for n in frame_counts:
        start, stop = shard_bounds(n, world, rank)
        for mode in modes:
            attn_mode, dtype = ROWS[mode][:2]
            model.set_attn_mode(attn_mode)
            mine = images(n)[start:stop].clone()
            with split_frames(model):
                keep = slice(None if rank == 0 and not args.no_single else 0)  # only rank 0's frames are compared
                split_s, split_peak, split_out = forwards(mine, dtype, keep, barrier=True, exact=mode == "fp32")
            del mine
            per_rank = [None] * world
            dist.all_gather_object(per_rank, dict(s=split_s, peak_gb=split_peak, frames=stop - start))
            single_s = single_peak = err = None
            if rank == 0 and not args.no_single:
                try:
                    single_s, single_peak, single_out = forwards(images(n), dtype, slice(start, stop), barrier=False,
                                                                 exact=mode == "fp32")
                    err = max(rel_l2(split_out[k], single_out[k]) for k in keys)
                except torch.cuda.OutOfMemoryError:
                    single_s = single_peak = "OOM"
                if cuda:
                    torch.cuda.empty_cache()
            dist.barrier()
            split_max = max(p["s"] for p in per_rank)
            row = dict(frames=n, mode=mode, world_size=world, frames_per_rank=[p["frames"] for p in per_rank],
                       split_s=split_max, split_s_per_rank=[p["s"] for p in per_rank],
                       split_peak_gb=None if split_peak is None else max(p["peak_gb"] for p in per_rank),
                       single_s=single_s, single_peak_gb=single_peak,
                       speedup=single_s / split_max if isinstance(single_s, float) else None, rel_l2_rank0=err)
            rows.append(row)
            if rank == 0 and not args.quiet:
                extra = "" if single_s is None else " single OOM" if single_s == "OOM" else \
                    f"  single {single_s:.3f} s  x{single_s / split_max:.2f}  rel L2 {err:.2e}"
                print(f"frames={n:5d} {mode:5s} split {split_max:.3f} s (ranks {world}){extra}", flush=True)
    return rows


def render(result: dict, args) -> str:
    """The markdown report: one row per (N, mode, scheme), or per (frames, mode) of ``--vggt``."""
    def opt(x, fmt="{:.4g}"):
        return "-" if x is None else x if isinstance(x, str) else fmt.format(x)

    rows, env, world = result["rows"], result["environment"], result["world_size"]
    if "model" not in result:
        title = f"Context-parallel attention: B={args.batch}, H={args.heads}, D={args.head_dim}, {world} ranks"
        note = ("Eager timing (CUDA events around back-to-back calls; the median window). parallel = "
                "visionattn.distributed.context_parallel_attention's forward with the scheme (ring: KV shards around "
                "a ring; ulysses: all-to-alls to whole heads of all tokens and back; auto (taken): the library's "
                "rule), the slowest rank; single = visionattn.attention of the whole sequence on rank 0's GPU alone.")
        header = ["N", "frames (x1041)", "mode", "scheme", "ranks", "parallel ms (slowest rank)", "single-GPU ms",
                  "speed-up", "parallel peak MB / rank", "single peak MB", "rel L2 rank 0 vs single"]
        table = [[r["seq"], f"{r['frames']:.1f}", r["mode"],
                  r["scheme"] if r["scheme"] == r["scheme_taken"] else f"{r['scheme']} ({r['scheme_taken']})",
                  world, r["ring_ms"], opt(r["single_ms"]), opt(r["speedup"], "{:.2f}x"), opt(r["ring_peak_mb"]),
                  opt(r["single_peak_mb"]), opt(r["rel_l2_rank0"], "{:.2e}")] for r in rows]
    else:
        full, tiny = MODEL_NAMES[result["model"]]
        title = (f"{full} with its frames split across {world} ranks vs one GPU: {result['height']}x"
                 f"{result['width']} images")
        note = ("Random-weight " + (tiny + "; a check of the tool, not a result)" if result["tiny"] else full) +
                " with its heads; bf16 runs under bf16 autocast, fp32 with TF32 off for matmuls and cuDNN's "
                "convolutions. split = every rank runs its contiguous chunk of frames inside "
                "models.context_parallel.split_frames (global attention context-parallel, scheme auto: Ulysses "
                "where the heads split evenly over the ranks, else the ring), the slowest rank's time; single = the "
                "same model on all frames on rank 0's GPU alone. Time: median of the timed forwards (wall clock "
                f"between synchronisations) after {'one untimed forward' if args.warmup else 'no warm-up'}; peak: "
                "CUDA max allocated after the warm-up, weights included (the largest rank's for split). rel L2: the "
                f"largest over {', '.join(MODEL_KEYS[result['model']])} of rank 0's frames.")
        header = ["frames", "mode", "ranks", "frames / rank", "split s (slowest rank)", "split s per rank",
                  "split peak GB / GPU", "single-GPU s", "single peak GB", "speed-up", "rel L2 rank 0 vs single"]
        table = [[r["frames"], r["mode"], world, "+".join(map(str, r["frames_per_rank"])), r["split_s"],
                  " / ".join(f"{t:.4g}" for t in r["split_s_per_rank"]), opt(r["split_peak_gb"], "{:.2f}"),
                  opt(r["single_s"]), opt(r["single_peak_gb"], "{:.2f}"), opt(r["speedup"], "{:.2f}x"),
                  opt(r["rel_l2_rank0"], "{:.2e}")] for r in rows]
    return "\n".join([f"# {title}", "", note + " Ideal speed-up = the number of ranks.", "",
                      markdown_table(table, header), "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()),
                      ""])


def plot_vggt(result: dict, path: str, outputs) -> None:
    """PNG of ``--vggt``: time and peak memory per GPU vs frames, split (solid) and single (dashed) per mode."""
    with figure(path, outputs, 1, 2, figsize=(12, 4.5)) as (fig, axes):
        for mode in dict.fromkeys(r["mode"] for r in result["rows"]):
            rows = sorted((r for r in result["rows"] if r["mode"] == mode), key=lambda r: r["frames"])
            for ax, key in zip(axes, ("s", "peak_gb")):
                for run, style in (("split", "-"), ("single", "--")):
                    pts = [(r["frames"], r[f"{run}_{key}"]) for r in rows if isinstance(r[f"{run}_{key}"], float)]
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", label=f"{mode} {run}" +
                                (f" ({result['world_size']} ranks)" if run == "split" else ""))
        for ax, name in zip(axes, ("time per forward (s)", "peak memory per GPU (GB)")):
            ax.set(xlabel="frames", ylabel=name)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "not measured (CPU)", ha="center", va="center", transform=ax.transAxes)
        fig.suptitle(f"{MODEL_NAMES[result['model']][0]}, frames split across {result['world_size']} ranks vs one "
                     f"GPU, {result['height']}x{result['width']}, {result['environment'].get('device')}")


def main(argv: list[str] | None = None) -> dict:
    args = parser.parse_args(argv)
    seqs = comma_ints(parser, "--seq", args.seq)
    modes = comma_list(parser, "--mode", args.mode, VGGT_MODES if args.vggt is not None else list(MODES))
    frame_counts = None
    if args.vggt is not None and args.scheme is not None:
        parser.error(f"--scheme {' '.join(args.scheme)!r}: not with --vggt (the model runs split_frames, whose "
                     f"global attention takes the library's default scheme, auto)")
    schemes = comma_list(parser, "--scheme", ",".join(args.scheme or ["ring"]), SCHEMES)
    if args.vggt is not None:
        frame_counts = comma_ints(parser, "--vggt", args.vggt)
        world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else 1
        if min(frame_counts) < world:
            parser.error(f"--vggt {args.vggt!r}: every frame count must be >= the number of ranks ({world}): "
                         f"each rank runs at least one frame")
        if args.tiny:  # the tiny config's own image size where --height / --width are not given
            args.height = 56 if args.height == parser.get_default("height") else args.height
            args.width = 70 if args.width == parser.get_default("width") else args.width
        if args.height % 14 or args.width % 14:
            parser.error(f"--height {args.height} / --width {args.width}: must be multiples of 14 (the patch size)")
    device = check_device(parser, args.device)
    outputs = prefix_outputs(parser, args.out, (".md", ".json") + ((".png",) if frame_counts else ()),
                             tool="bench_context_parallel")  # every rank checks; rank 0 writes
    out = os.path.abspath(args.out)
    rank, world, store = _init(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        env = environment({"world_size": world, "backend": dist.get_backend(),
                           **{k: os.environ.get(k) for k in NVLS_VARIABLES}})
        if rank == 0 and not args.quiet:
            print(", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
        if frame_counts is None:
            result = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim, world_size=world,
                          rows=bench(seqs, modes, schemes, args, device, rank, world), environment=env)
        else:
            result = dict(model=args.model, tiny=args.tiny, height=args.height, width=args.width, world_size=world,
                          rows=vggt_rows(frame_counts, modes, args, device, rank, world), environment=env)
        if rank == 0:
            text = render(result, args)
            write_results(outputs, out, result, text, plot_vggt if frame_counts is not None else None)
            if not args.quiet:
                print(text)
        dist.barrier()
    finally:
        # Gloo's p2p works can sit in reference cycles; freed at interpreter exit, after the group is gone, their
        # worker threads abort the process ("terminate called without an active exception"): free them now.
        gc.collect()
        dist.destroy_process_group()
        if store is not None and os.path.exists(store):
            os.unlink(store)
    return result if rank == 0 else {}


if __name__ == "__main__":
    main()
