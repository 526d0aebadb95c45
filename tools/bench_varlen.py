"""Benchmark ragged batches: visionattn varlen vs SDPA padded + key mask, SDPA per sequence, nested tensors.

The ELSA supplement's Table 2 (Sec. E): a batch of sequences of different lengths (default the 8 lengths
785, 500, 708, 542, 1732, 262, 1039, 557 — 6125 tokens —, 16 heads, D = 64), self-attention, starting
from what a model holds: one [n_i, H, D] q / k / v tensor per sequence. Each way of attending them is
timed three times, eagerly (CUDA events around back-to-back calls, :func:`visionattn.reporting.eager_ms`;
the Python launch path counts):

* **conversion**: from the per-sequence tensors to the method's input (packing with ``torch.cat`` and
  offsets, padding and a key mask, a jagged nested tensor; nothing for per-sequence calls);
* **kernel**: the attention call alone on converted inputs;
* **total**: conversion and attention together, one call after another, as a model runs them.

Methods: ``visionattn`` (:func:`visionattn.varlen_attention` on packed tensors and int32 ``cu_seqlens``,
maxima given), ``visionattn-jagged`` (the same on jagged nested tensors), ``sdpa-padded``
(``F.scaled_dot_product_attention`` on a [B, H, Lmax, D] padded batch with a boolean key mask),
``sdpa-per-seq`` (one SDPA call per sequence), ``nested`` (SDPA on jagged nested tensors). SDPA runs with
PyTorch's defaults: its own backend choice, FP32 matmuls without TF32 (this tool sets no global flags).
Peak memory: the most allocated during one total call beyond what was allocated before it. Mtokens/s:
total tokens per total latency. Accuracy: relative L2 error of each method's output against a float64
per-sequence oracle. Writes ``<out>.md`` and ``<out>.json``.

    python tools/bench_varlen.py --out out/varlen_h100
    python tools/bench_varlen.py --modes fp16,bf16 --lengths 256,1792,1024 --methods visionattn,sdpa-per-seq
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _cli import ToolParser, check_device, check_output, default_out, positive_int  # noqa: E402

import visionattn  # noqa: E402
from visionattn import reporting  # noqa: E402
from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import MODES  # noqa: E402
from visionattn.reference import oracle_attention  # noqa: E402

METHODS = ("visionattn", "visionattn-jagged", "sdpa-padded", "sdpa-per-seq", "nested")
BENCH_MODES = ("fp32", "fp32-ieee", "tf32", "fp16", "bf16")
ISSUE_LENGTHS = "785,500,708,542,1732,262,1039,557"

parser = ToolParser(prog="bench_varlen.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
parser.add_argument("--lengths", default=ISSUE_LENGTHS,
                    help="comma-separated sequence lengths (>= 0; default: the supplement's batch %(default)s)")
parser.add_argument("--heads", type=positive_int, default=16, help="attention heads H (default: %(default)s)")
parser.add_argument("--head-dim", type=positive_int, default=64, help="head dim D (default: %(default)s)")
parser.add_argument("--modes", default="fp32,fp16",
                    help=f"comma-separated visionattn modes, a subset of {','.join(BENCH_MODES)}; the PyTorch "
                         f"methods run in each mode's dtype (default: %(default)s)")
parser.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
parser.add_argument("--calls", type=positive_int, default=50,
                    help="back-to-back calls per timing window (default: %(default)s)")
parser.add_argument("--repeats", type=positive_int, default=5,
                    help="timing windows; the median is reported (default: %(default)s)")
parser.add_argument("--seed", type=int, default=0, help="random seed of the N(0, 1) inputs (default: %(default)s)")
parser.add_argument("--device", default="cuda", help="torch device; cpu times with a wall clock (default: cuda)")
parser.add_argument("--out", default=default_out("varlen_bench"),
                    help="output prefix: writes <out>.md and <out>.json (default: %(default)s)")
parser.add_argument("--quiet", action="store_true", help="do not print the table")


def _subset(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if not items or bad:
        parser.error(f"{flag} {text!r}: expected a comma-separated subset of {','.join(allowed)}")
    return items


def _lengths(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths {text!r}: expected comma-separated integers")
    if not lens or min(lens) < 0 or max(lens) == 0:
        parser.error(f"--lengths {text!r}: expected integers >= 0, at least one > 0")
    return lens


def _timer(device: torch.device, calls: int, repeats: int):
    """Milliseconds per call: CUDA events around back-to-back calls, or a wall clock on the CPU."""
    if device.type == "cuda":
        return lambda fn: reporting.eager_ms(fn, calls=calls, warmup=3, repeats=repeats)

    def wall(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
        return sorted(times)[len(times) // 2]
    return wall


def _peak_mb(fn, device: torch.device) -> float | None:
    """Most memory allocated during one ``fn()`` beyond what was allocated before it (MB); None on CPU."""
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


def method_calls(method: str, seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], mode: str):
    """``(convert, attend, to_packed)`` of one method: ``convert()`` builds its inputs from the per-sequence
    [n_i, H, D] tensors, ``attend(inputs)`` runs attention, ``to_packed(out)`` gives [total, H, D] (for the
    accuracy check; not timed)."""
    device = seqs[0][0].device
    lens = [q.shape[0] for q, _, _ in seqs]
    lmax = max(lens)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    cu_host = torch.tensor(offsets, dtype=torch.int32)

    def packed():
        cat = [torch.cat([s[i] for s in seqs]) for i in range(3)]
        return (*cat, cu_host.to(device, non_blocking=True))

    def jagged():
        return [torch.nested.nested_tensor([s[i] for s in seqs], layout=torch.jagged) for i in range(3)]

    if method == "visionattn":
        def attend(x):
            q, k, v, cu = x
            return visionattn.varlen_attention(q, k, v, cu, cu, lmax, lmax, mode=mode)
        return packed, attend, lambda out: out
    if method == "visionattn-jagged":
        return jagged, lambda x: visionattn.varlen_attention(*x, mode=mode), lambda out: out.values()
    if method == "nested":
        def attend(x):
            q, k, v = (t.transpose(1, 2) for t in x)
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return jagged, attend, lambda out: out.values()
    if method == "sdpa-padded":
        keep = torch.arange(lmax, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        mask = keep[:, None, None, :]  # [B, 1, 1, Lmax]: True = attend

        def convert():
            pad = [torch.nn.utils.rnn.pad_sequence([s[i] for s in seqs], batch_first=True).transpose(1, 2)
                   for i in range(3)]
            return (*pad, mask)

        def attend(x):
            q, k, v, m = x
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return convert, attend, lambda out: torch.cat([out[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])
    if method == "sdpa-per-seq":
        def attend(x):
            return [F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
                    for q, k, v in x]
        return (lambda: seqs), attend, lambda out: torch.cat([o.transpose(0, 1) for o in out])
    raise ValueError(f"method={method!r}; expected one of {METHODS}")


def bench(lens: list[int], heads: int, head_dim: int, modes: list[str], methods: list[str], device: torch.device,
          calls: int, repeats: int, seed: int, quiet: bool = False) -> list[dict]:
    """One row per (mode, method): conversion / kernel / total ms, peak MB, Mtokens/s, rel L2 vs the oracle."""
    g = torch.Generator().manual_seed(seed)
    base = [tuple(torch.randn(n, heads, head_dim, generator=g).to(device) for _ in range(3)) for n in lens]
    oracle = torch.cat([oracle_attention(*(t.transpose(0, 1)[None] for t in s))[0].transpose(0, 1) if n else
                        s[0].double() for s, n in zip(base, lens)])
    timer = _timer(device, calls, repeats)
    total_tokens = sum(lens)
    rows = []
    for mode in modes:
        dtype = MODES[mode].compute_dtype
        seqs = [tuple(t.to(dtype) for t in s) for s in base]
        for method in methods:
            convert, attend, to_packed = method_calls(method, seqs, mode)
            x = convert()
            out = to_packed(attend(x))
            err = rel_l2(out.double(), oracle)
            conv_ms = timer(convert)
            kern_ms = timer(lambda: attend(x))
            total_ms = timer(lambda: attend(convert()))
            del x
            peak = _peak_mb(lambda: attend(convert()), device)
            rows.append(dict(mode=mode, method=method, total_ms=total_ms, kernel_ms=kern_ms, conversion_ms=conv_ms,
                             peak_mb=peak, mtokens_per_s=total_tokens / total_ms / 1e3, rel_l2=err))
            if not quiet:
                print(f"{mode:9s} {method:18s} total {total_ms:.4f} ms  kernel {kern_ms:.4f} ms  "
                      f"conversion {conv_ms:.4f} ms  rel L2 {err:.2e}", flush=True)
    return rows


def render(rows: list[dict], env: dict, lens: list[int], heads: int, head_dim: int) -> str:
    """The markdown report: one table row per (mode, method), speed-up against the mode's fastest PyTorch way."""
    best: dict[str, float] = {}
    for r in rows:
        if not r["method"].startswith("visionattn"):
            best[r["mode"]] = min(best.get(r["mode"], float("inf")), r["total_ms"])
    table = []
    for r in rows:
        speedup = f"{best[r['mode']] / r['total_ms']:.2f}x" if r["mode"] in best else "-"
        table.append([r["mode"], r["method"], r["total_ms"], r["kernel_ms"], r["conversion_ms"],
                      "-" if r["peak_mb"] is None else r["peak_mb"], r["mtokens_per_s"], speedup,
                      f"{r['rel_l2']:.2e}"])
    header = ["mode", "method", "total ms", "kernel ms", "conversion ms", "peak MB", "Mtokens/s",
              "vs best PyTorch", "rel L2 vs float64"]
    lines = [f"# Ragged batch: {len(lens)} sequences (lengths {','.join(map(str, lens))}; {sum(lens)} tokens), "
             f"H={heads}, D={head_dim}", "",
             "Eager timing (CUDA events around back-to-back calls); conversion = from per-sequence tensors to the "
             "method's input; total = conversion + attention.", "", reporting.markdown_table(table, header),
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parser.parse_args(argv)
    lens = _lengths(args.lengths)
    modes = _subset(args.modes, BENCH_MODES, "--modes")
    methods = _subset(args.methods, METHODS, "--methods")
    device = check_device(parser, args.device)
    out = check_output(parser, args.out)
    env = reporting.environment({"tf32_matmul": torch.backends.cuda.matmul.allow_tf32})
    if not args.quiet:
        print(", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    rows = bench(lens, args.heads, args.head_dim, modes, methods, device, args.calls, args.repeats, args.seed,
                 args.quiet)
    result = dict(lengths=lens, heads=args.heads, head_dim=args.head_dim, rows=rows, environment=env)
    text = render(rows, env, lens, args.heads, args.head_dim)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    reporting.write_text_atomic(out + ".md", text)
    reporting.write_json_atomic(out + ".json", result)
    if not args.quiet:
        print(text)
    return result


if __name__ == "__main__":
    main()
