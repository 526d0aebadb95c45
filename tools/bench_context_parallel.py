"""Benchmark context-parallel (ring) attention at VGGT's global-attention shape against one GPU.

VGGT's global attention attends over all S*P tokens of a scene: B = 1, H = 16, D = 64 and P = 1041
tokens per frame at 518x392 (1036 patches, a camera token and 4 registers), so N = frames * 1041. With
the sequence split across the ranks (as :func:`visionattn.models.context_parallel.split_frames` splits
frames), each rank computes its queries against every KV shard passing around the ring
(:func:`visionattn.distributed.context_parallel_attention`). Per (sequence length, mode) this tool times,
eagerly (CUDA events around back-to-back calls, :func:`visionattn.reporting.eager_ms`; a wall clock on the
CPU):

* **ring**: one context-parallel forward on every rank (the ring machinery is timed even with one rank:
  the length exchange, the kernel with LSE and the merges); the slowest rank's time is the step's;
* **single**: :func:`visionattn.attention` of the whole sequence on rank 0's GPU alone (what one GPU
  does without context parallelism);

and reports the speed-up (single / ring; ideal = the number of ranks), the peak memory of each, and the
relative L2 error of rank 0's ring rows against the single-GPU rows. Shards are as even as possible (the
first ``N mod W`` ranks hold one token more). Inputs: N(0, 1) in the mode's compute dtype, the same on
every rank (a seeded generator on the device). NVLink multicast is left off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1`` unless set already). Rank 0 writes
``<out>.md`` and ``<out>.json``.

    torchrun --nproc-per-node 2 tools/bench_context_parallel.py --seq 104100 --mode fp32,bf16 --out out/cp_2gpu
    python tools/bench_context_parallel.py --seq 20820 --out out/cp_1gpu     # one process: a group of one rank
    torchrun --nproc-per-node 2 tools/bench_context_parallel.py --device cpu --seq 64 --heads 2   # gloo
"""
from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)  # before torch.distributed starts NCCL

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _cli import ToolParser, check_device, check_output, default_out, nonnegative_int, positive_int  # noqa: E402

import visionattn  # noqa: E402
from visionattn import reporting  # noqa: E402
from visionattn.distributed import _context_parallel  # noqa: E402
from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import MODES, mode_names  # noqa: E402

TOKENS_PER_FRAME = 1041  # VGGT at 518x392: 37 x 28 patches + camera + 4 registers
NVLS_VARIABLES = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")

parser = ToolParser(prog="bench_context_parallel.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
parser.add_argument("--seq", default=f"{32 * TOKENS_PER_FRAME},{100 * TOKENS_PER_FRAME}",
                    help=f"comma-separated total sequence lengths N (VGGT: frames x {TOKENS_PER_FRAME}; default: "
                         f"32 and 100 frames, %(default)s)")
parser.add_argument("--mode", default="fp32,bf16",
                    help=f"comma-separated visionattn modes, a subset of {','.join(mode_names())} "
                         f"(default: %(default)s)")
parser.add_argument("--batch", type=positive_int, default=1, help="batch B (default: %(default)s)")
parser.add_argument("--heads", type=positive_int, default=16, help="attention heads H (default: %(default)s)")
parser.add_argument("--head-dim", type=positive_int, default=64, help="head dim D (default: %(default)s)")
parser.add_argument("--calls", type=positive_int, default=5,
                    help="back-to-back calls per timing window (default: %(default)s)")
parser.add_argument("--repeats", type=positive_int, default=3,
                    help="timing windows; the median is reported (default: %(default)s)")
parser.add_argument("--warmup", type=nonnegative_int, default=2,
                    help="untimed calls before timing (default: %(default)s)")
parser.add_argument("--no-single", action="store_true",
                    help="skip the single-GPU baseline (and the error check) on rank 0")
parser.add_argument("--seed", type=int, default=0, help="seed of the N(0, 1) inputs (default: %(default)s)")
parser.add_argument("--device", default="cuda",
                    help="cuda (NCCL, one GPU per rank: LOCAL_RANK) or cpu (gloo, wall clock) (default: cuda)")
parser.add_argument("--out", default=default_out("context_parallel_bench"),
                    help="output prefix: rank 0 writes <out>.md and <out>.json (default: %(default)s)")
parser.add_argument("--quiet", action="store_true", help="do not print the table")


def _lengths(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--seq {text!r}: expected comma-separated integers")
    if not lens or min(lens) < 1:
        parser.error(f"--seq {text!r}: expected integers >= 1")
    return lens


def _modes(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in MODES]
    if not items or bad:
        parser.error(f"--mode {text!r}: expected a comma-separated subset of {','.join(mode_names())}")
    return items


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


def bench(seqs: list[int], modes: list[str], args, device: torch.device, rank: int, world: int) -> list[dict]:
    """One row per (sequence length, mode), on rank 0 (other ranks return their rows' ring times only)."""
    timer = reporting.per_call_ms(device, args.calls, args.repeats, args.warmup)
    B, H, D = args.batch, args.heads, args.head_dim
    rows = []
    for n in seqs:
        s, e = shard_bounds(n, world, rank)
        for mode in modes:
            dtype = MODES[mode].compute_dtype
            g = torch.Generator(device=device).manual_seed(args.seed)
            full = [torch.randn(B, H, n, D, generator=g, device=device, dtype=dtype) for _ in range(3)]
            mine = [t[:, :, s:e].clone() for t in full]
            if rank != 0 or args.no_single:
                del full

            def ring():
                return _context_parallel(*mine, None, mode, None, None, False, None)

            with torch.no_grad():
                out = ring()
                dist.barrier()
                ring_ms = timer(ring)
                ring_peak = reporting.peak_extra_mb(ring, device)
                dist.barrier()
                single_ms = single_peak = err = None
                if rank == 0 and not args.no_single:
                    def single():
                        return visionattn.attention(*full, mode=mode)
                    err = rel_l2(out, single()[:, :, s:e])
                    single_ms = timer(single)
                    single_peak = reporting.peak_extra_mb(single, device)
                    del full
                dist.barrier()
            per_rank = [None] * world
            dist.all_gather_object(per_rank, dict(ring_ms=ring_ms, peak_mb=ring_peak, tokens=e - s))
            del out, mine
            ring_max = max(p["ring_ms"] for p in per_rank)
            row = dict(seq=n, frames=n / TOKENS_PER_FRAME, mode=mode, world_size=world,
                       shard_tokens=[p["tokens"] for p in per_rank], ring_ms=ring_max,
                       ring_ms_per_rank=[p["ring_ms"] for p in per_rank],
                       ring_peak_mb=None if ring_peak is None else max(p["peak_mb"] for p in per_rank),
                       single_ms=single_ms, single_peak_mb=single_peak,
                       speedup=None if single_ms is None else single_ms / ring_max,
                       rel_l2_rank0=err)
            rows.append(row)
            if rank == 0 and not args.quiet:
                extra = "" if single_ms is None else f"  single {single_ms:.3f} ms  x{single_ms / ring_max:.2f}  " \
                                                     f"rel L2 {err:.2e}"
                print(f"N={n:7d} {mode:9s} ring {ring_max:.3f} ms (ranks {world}){extra}", flush=True)
    return rows


def render(rows: list[dict], env: dict, args) -> str:
    """The markdown report: one row per (N, mode)."""
    def opt(x, fmt="{:.4g}"):
        return "-" if x is None else fmt.format(x)

    table = [[r["seq"], f"{r['frames']:.1f}", r["mode"], r["world_size"], r["ring_ms"], opt(r["single_ms"]),
              opt(r["speedup"], "{:.2f}x"), opt(r["ring_peak_mb"]), opt(r["single_peak_mb"]),
              opt(r["rel_l2_rank0"], "{:.2e}")] for r in rows]
    header = ["N", "frames (x1041)", "mode", "ranks", "ring ms (slowest rank)", "single-GPU ms", "speed-up",
              "ring peak MB / rank", "single peak MB", "rel L2 rank 0 vs single"]
    lines = [f"# Context-parallel attention: B={args.batch}, H={args.heads}, D={args.head_dim}, "
             f"{rows[0]['world_size'] if rows else '?'} ranks", "",
             "Eager timing (CUDA events around back-to-back calls; the median window). ring = "
             "visionattn.distributed's ring forward, the slowest rank; single = visionattn.attention of the whole "
             "sequence on rank 0's GPU alone. Ideal speed-up = the number of ranks.", "",
             reporting.markdown_table(table, header),
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parser.parse_args(argv)
    seqs = _lengths(args.seq)
    modes = _modes(args.mode)
    device = check_device(parser, args.device)
    out = check_output(parser, args.out)
    rank, world, store = _init(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        env = reporting.environment({"world_size": world, "backend": dist.get_backend(),
                                     **{k: os.environ.get(k) for k in NVLS_VARIABLES}})
        if rank == 0 and not args.quiet:
            print(", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
        rows = bench(seqs, modes, args, device, rank, world)
        result = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim, world_size=world, rows=rows,
                      environment=env)
        if rank == 0:
            text = render(rows, env, args)
            reporting.write_text_atomic(out + ".md", text)
            reporting.write_json_atomic(out + ".json", result)
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
