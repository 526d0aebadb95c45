#!/usr/bin/env python
"""Few-query and ragged calls: the split-KV plan, Flash-Decoding's fixed split and the stream-K schedule, same process.

Calls that leave SMs idle in one pass — one or a few queries against long keys (class attention, attention-pooling
heads), and ragged batches of one long and many short sequences — split the keys into P partitions merged by the
(m, S, W) monoid, or share the key-tile iterations equally between programs (stream-K, :mod:`visionattn.kernels.
stream_k`). Each case is timed under every schedule: ``auto`` (:func:`visionattn.kernels.elsa_fwd.choose_num_splits`,
the split-KV plan's choice), ``flash-decoding`` (P = ceil(2 x SMs / programs) up to 64 and half the key tiles, from
the average sequence: Flash-Decoding's rule, which the library used before), each fixed P of ``--splits``, and
``stream-k`` (the same data packed, with the lengths on the host; with ``--job-costs``, also at each of those start-up
costs per job, ``stream-k cost=C``); the first call's milliseconds apart, eager and CUDA-graph milliseconds
(:func:`_harness.eager_graph_ms`), the rel error vs a float64 softmax, auto's speed-up over flash-decoding, stream-K's
over auto and the keys' and values' bytes per second (each read once: how near a call runs to the memory's peak).
Ragged calls hand the kernels their lengths on the host, as list calls do. Dense cases: B x H heads of ``--queries``
queries against ``--keys`` keys; ragged cases: H = 16 heads, ``--sequences`` sequences, one of ``--longest`` keys and
the others drawn so that mean / max length is each ``--ratios`` value; ``--self-lengths``: self-attention over
sequences of those lengths. Head dim 64. Writes OUT.md, OUT.json and OUT.png; on CUDA the report ends with the
stream-K bar's cells (:func:`targets`: >= 1.5x the split-KV plan where mean / max <= 0.25 or the query tiles fill
under a quarter of the SMs), each met or not and why.

  python tools/bench_split_kv.py --modes bf16,fp32 --out docs/benchmarks/split_kv_h200
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, bars, call_ms, check_device, comma_ints, comma_list, comma_pairs,  # noqa: E402
                      default_out, eager_graph_ms, environment, figure, markdown_table, md_header, positive_int,
                      prefix_outputs, write_results)

from visionattn.kernels import stream_k  # noqa: E402
from visionattn.kernels._launch import cdiv, sm_count  # noqa: E402
from visionattn.kernels.elsa_fwd import _precision, choose_num_splits, elsa_attention, get_config  # noqa: E402
from visionattn.kernels.varlen_fwd import varlen_forward  # noqa: E402
from visionattn.modes import MODES  # noqa: E402
from visionattn.reference import oracle_attention  # noqa: E402

HEAD_DIM, SCALE = 64, 0.125
RAGGED_HEADS = 16  # heads of the ragged and self-attention cases
SPLIT_MODES = ("fp32", "tf32", "fp16", "bf16")


def flash_decoding_splits(programs: int, n_k: int, cfg, device: torch.device) -> int:
    """Flash-Decoding's split count: about two programs per SM, at least two key tiles per partition, at most 64
    partitions; no split once the programs fill the SMs (or off CUDA)."""
    if device.type != "cuda" or programs >= sm_count(device):
        return 1
    return max(1, min(cdiv(2 * sm_count(device), programs), cdiv(n_k, cfg.block_n) // 2, 64))


def _oracle(q, k, v):
    return oracle_attention(q, k, v, scale=SCALE)


def ragged_lengths(sequences: int, ratio: float, longest: int, generator: torch.Generator) -> list[int]:
    """One sequence of ``longest`` keys and ``sequences - 1`` drawn uniformly around the length that makes
    mean / max = ``ratio`` (clipped to [16, longest]); all ``longest`` at ratio 1 (the draw still advances
    ``generator``, so every case's lengths depend on the case grid alone)."""
    others = sequences - 1
    mean_other = (ratio * sequences * longest - longest) / max(1, others)
    draws = (torch.rand(others, generator=generator) * 2 * mean_other).tolist()
    if ratio >= 1:
        return [longest] * sequences
    return [longest] + [int(min(longest, max(16, x))) for x in draws]


def cases(args, mode: str, device: torch.device):
    """``(label, run(P), reference, auto P, flash-decoding P, stream-K call, K / V bytes)`` per case; ragged calls
    pass their lengths on the host, as list calls and packed calls whose offsets are read do (the grid then visits
    the sequences longest first)."""
    dtype = MODES[mode].compute_dtype
    precision = _precision(mode, None)
    kv_bytes = lambda keys, heads: 2 * keys * heads * HEAD_DIM * dtype.itemsize  # noqa: E731
    for b, h in args.batch_heads:
        for nq in args.queries:
            for nk in args.keys:
                g = torch.Generator(device="cpu").manual_seed(args.seed)
                q, k, v = (torch.randn(b, h, n, HEAD_DIM, generator=g).to(device, dtype) for n in (nq, nk, nk))
                cfg = get_config(mode, HEAD_DIM, HEAD_DIM, nk)
                packed = [t.transpose(1, 2).reshape(b * t.shape[2], h, HEAD_DIM) for t in (q, k, v)]
                yield (f"B={b} H={h} q={nq} k={nk}",
                       lambda p, q=q, k=k, v=v: elsa_attention(q, k, v, None, None, False, SCALE, mode, num_splits=p),
                       _oracle(q, k, v), choose_num_splits(b * h, nq, nk, cfg, device, precision),
                       flash_decoding_splits(b * h * cdiv(nq, cfg.block_m), nk, cfg, device),
                       _stream_call(packed, [nq] * b, [nk] * b, mode, device,
                                    lambda out, b=b, nq=nq, h=h: out.view(b, nq, h, HEAD_DIM).transpose(1, 2)),
                       kv_bytes(b * nk, h))
    heads = RAGGED_HEADS
    lengths = torch.Generator(device="cpu").manual_seed(args.seed)
    for n_seq in args.sequences:
        for ratio in args.ratios:
            for nq in args.queries:
                g = torch.Generator(device="cpu").manual_seed(args.seed)
                lens = ragged_lengths(n_seq, ratio, args.longest, lengths)
                total = sum(lens)
                cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
                cu_q = torch.arange(0, (n_seq + 1) * nq, nq, dtype=torch.int32, device=device)
                q, k, v = (torch.randn(n, heads, HEAD_DIM, generator=g).to(device, dtype)
                           for n in (n_seq * nq, total, total))
                ref = torch.cat([_oracle(q[i * nq:(i + 1) * nq].transpose(0, 1), k[cu_k[i]:cu_k[i + 1]].transpose(0, 1),
                                         v[cu_k[i]:cu_k[i + 1]].transpose(0, 1)).transpose(0, 1)
                                 for i in range(n_seq)])
                cfg = get_config(mode, HEAD_DIM, HEAD_DIM, args.longest)
                on_host = ((nq,) * n_seq, tuple(lens))
                yield (f"ragged n={n_seq} mean/max={total / n_seq / args.longest:.2f} q={nq}",
                       lambda p, q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, nq=nq, on_host=on_host: varlen_forward(
                           q, k, v, cu_q, cu_k, nq, args.longest, False, SCALE, mode, num_splits=p,
                           lengths=on_host, schedule="split-kv")[0],
                       ref, choose_num_splits(heads * n_seq, nq, args.longest, cfg, device, precision, (n_seq, total)),
                       flash_decoding_splits(heads * n_seq * cdiv(nq, cfg.block_m), args.longest, cfg, device),
                       _stream_call((q, k, v), [nq] * n_seq, lens, mode, device, lambda out: out),
                       kv_bytes(total, heads))
    if args.self_lengths:  # self-attention over sequences of these lengths (the ELSA supplement's Table 2)
        lens = args.self_lengths
        g = torch.Generator(device="cpu").manual_seed(args.seed)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q, k, v = (torch.randn(sum(lens), heads, HEAD_DIM, generator=g).to(device, dtype) for _ in range(3))
        ref = torch.cat([_oracle(*(t[cu[i]:cu[i + 1]].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
                         for i in range(len(lens))])
        cfg = get_config(mode, HEAD_DIM, HEAD_DIM, max(lens))
        yield (f"self-attention n={len(lens)} longest={max(lens)} tokens={sum(lens)}",
               lambda p, q=q, k=k, v=v: varlen_forward(q, k, v, cu, cu, max(lens), max(lens), False, SCALE, mode,
                                                       num_splits=p, lengths=(tuple(lens), tuple(lens)),
                                                       schedule="split-kv")[0],
               ref, choose_num_splits(heads * len(lens), cdiv(sum(lens), len(lens)), max(lens), cfg, device,
                                      precision, (len(lens), sum(lens))),
               flash_decoding_splits(heads * len(lens) * cdiv(max(lens), cfg.block_m), max(lens), cfg, device),
               _stream_call((q, k, v), lens, lens, mode, device, lambda out: out), kv_bytes(sum(lens), heads))


def _stream_call(packed, lens_q, lens_k, mode, device, shape):
    """``call(job_cost=None)``: the stream-K schedule's call on packed q / k / v [total, H, D] of these lengths, output
    shaped by ``shape`` like the case's reference; the library's call (its plan built once and cached) or, with a
    ``job_cost``, a plan of that start-up cost per job (built once per cost)."""
    q, k, v = packed
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for x in (lens_q, lens_k))
    lengths = (tuple(lens_q), tuple(lens_k))
    plans = {}

    def call(job_cost=None):
        if job_cost is None:
            return shape(varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), False, SCALE, mode,
                                        lengths=lengths, schedule="stream-k")[0])
        if job_cost not in plans:
            plans[job_cost] = stream_k.stream_plan(q, k, v, lens_q, lens_k, sum(lens_q), False, mode, q.dtype, False,
                                                   False, job_cost=job_cost)
        return shape(plans[job_cost](q, k, v, cu_q, cu_k, SCALE)[0])

    return call


def run(args, device: torch.device) -> list[dict]:
    rows = []
    for mode in args.modes:
        for label, call, ref, auto, flash, stream, kv in cases(args, mode, device):
            schedules = {"auto": auto, "flash-decoding": flash, **{f"P={p}": p for p in args.splits},
                         "stream-k": "stream-k", **{f"stream-k cost={c}": f"cost={c}" for c in args.job_costs}}
            timed: dict = {}
            for name, p in schedules.items():
                if p == "stream-k":
                    fn = lambda _, stream=stream: stream()  # noqa: E731
                elif isinstance(p, str):  # "cost=C": stream-K at that start-up cost per job
                    fn = lambda p, stream=stream: stream(int(p.split("=")[1]))  # noqa: E731
                else:
                    fn = call
                if p not in timed:
                    held = []
                    first = call_ms(lambda fn=fn, p=p: held.append(fn(p)), device)
                    out = held[0]
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    if device.type == "cuda":
                        eager, graph, _ = eager_graph_ms(lambda fn=fn, p=p: (lambda: fn(p)), calls=args.calls,
                                                         repeats=args.repeats)
                    else:
                        eager, graph = None, None
                    timed[p] = dict(first_ms=first, eager_ms=eager, graph_ms=graph, max_rel_err=err,
                                    kv_gb_per_s=kv / graph / 1e6 if graph else None)
                rows.append(dict(case=label, mode=mode, schedule=name, splits=p, **timed[p]))
            print(f"{mode} {label}: auto P={auto}, flash-decoding P={flash}, stream-k vs auto "
                  f"{_ratio(timed[auto], timed['stream-k'])}", flush=True)
    return rows


def _ratio(base: dict, new: dict) -> str:
    """``base``'s graph ms over ``new``'s, formatted (n/a off CUDA)."""
    return f"{base['graph_ms'] / new['graph_ms']:.2f}x" if base["graph_ms"] and new["graph_ms"] else "n/a"


def _speedups(rows: list[dict]) -> dict[tuple[str, str], float | None]:
    by = {(r["case"], r["mode"], r["schedule"]): r for r in rows}
    out = {}
    for (case, mode, schedule), r in by.items():
        if schedule == "auto":
            flash = by[(case, mode, "flash-decoding")]
            out[(case, mode)] = (flash["graph_ms"] / r["graph_ms"]) if r["graph_ms"] and flash["graph_ms"] else None
    return out


def _plot(result: dict, path: str, outputs) -> None:
    speed = _speedups(result["rows"])
    labels = list(dict.fromkeys(case for case, _ in speed))
    with figure(path, outputs, figsize=(max(8, 0.45 * len(labels)), 4.5)) as (_, ax):
        bars(ax, labels, {mode: [speed.get((c, mode)) for c in labels] for mode in result["modes"]}, fontsize=6)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("auto vs flash-decoding (graph ms ratio)")
        ax.tick_params(axis="x", labelrotation=90)
        ax.legend(fontsize=8)


def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="bench_split_kv.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="bf16,fp32", help=f"comma-separated subset of {','.join(SPLIT_MODES)}")
    p.add_argument("--batch-heads", default="1x1,1x16,4x16",
                   help="dense cases: comma-separated BxH (default %(default)s)")
    p.add_argument("--queries", default="1,16", help="queries per sequence (default %(default)s)")
    p.add_argument("--keys", default="1024,4096,16384,65536", help="dense cases' keys (default %(default)s)")
    p.add_argument("--sequences", default="8,16,32,64", help="ragged cases' sequence counts (default %(default)s)")
    p.add_argument("--ratios", default="0.1,0.25,0.5,1.0",
                   help="ragged cases' mean / max lengths (default %(default)s)")
    p.add_argument("--longest", type=positive_int, default=8192, help="ragged cases' longest sequence (default 8192)")
    p.add_argument("--self-lengths", default="785,500,708,542,1732,262,1039,557",
                   help="a self-attention ragged case of these sequence lengths, H = 16 (default: the ELSA "
                        "supplement's Table 2 batch; '' for none)")
    p.add_argument("--splits", default="", help="fixed split counts timed beside auto and flash-decoding, e.g. 2,4")
    p.add_argument("--job-costs", default="",
                   help="stream-K start-up costs per job (key-tile iterations) timed beside the default, e.g. 0,2,4")
    p.add_argument("--calls", type=positive_int, default=20, help="calls per timing window (default 20)")
    p.add_argument("--repeats", type=positive_int, default=7, help="timing windows, median reported (default 7)")
    p.add_argument("--seed", type=int, default=7, help="seed of inputs and ragged lengths (default 7)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter, untimed: for tests)")
    p.add_argument("--out", default=default_out("split_kv"), help="output prefix: OUT.md, OUT.json, OUT.png")
    return p


def _parse(parser, args):
    args.modes = comma_list(parser, "--modes", args.modes, SPLIT_MODES)
    args.batch_heads = comma_pairs(parser, "--batch-heads", args.batch_heads, "BxH")
    args.queries = comma_ints(parser, "--queries", args.queries)
    args.keys = comma_ints(parser, "--keys", args.keys)
    args.sequences = comma_ints(parser, "--sequences", args.sequences)
    try:
        args.ratios = [float(x) for x in args.ratios.split(",") if x.strip()]
    except ValueError:
        args.ratios = []
    if not args.ratios or not all(0 < r <= 1 for r in args.ratios):
        parser.error(f"--ratios {args.ratios!r}: expected comma-separated numbers in (0, 1]")
    args.splits = comma_ints(parser, "--splits", args.splits) if args.splits.strip() else []
    args.job_costs = (comma_ints(parser, "--job-costs", args.job_costs, low=0) if args.job_costs.strip()
                      else [])
    args.self_lengths = (comma_ints(parser, "--self-lengths", args.self_lengths) if args.self_lengths.strip()
                         else [])


# the stream-K schedule's bar: >= TARGET_SPEEDUP x the split-KV plan where a ragged batch's mean / max length is at
# most TARGET_RATIO or a dense call's query tiles fill under TARGET_SM_SHARE of the SMs (LeanAttention's regime)
TARGET_SPEEDUP, TARGET_RATIO, TARGET_SM_SHARE = 1.5, 0.25, 0.25


def _case_fields(label: str) -> dict:
    """The numbers a case label holds (``B=1 H=16 q=1 k=65536``, ``ragged n=8 mean/max=0.13 q=1``,
    ``self-attention n=8 longest=1732 tokens=6125``), by name, and its kind."""
    fields = {k: float(v) if "." in v else int(v) for k, v in re.findall(r"([A-Za-z/]+)=([0-9.]+)", label)}
    kind = "ragged" if label.startswith("ragged") else "self" if label.startswith("self") else "dense"
    return dict(fields, kind=kind)


def library_schedule(label: str, mode: str, auto_splits: int, sms: int, longest: int) -> str:
    """``"stream-k"`` where the library's default call takes the stream-K schedule for this case, else
    ``"split-kv"``: dense calls where the split-KV plan splits (``auto_splits`` > 1) and
    :func:`.stream_k.dense_prefers` holds; ragged and self-attention calls (:data:`RAGGED_HEADS` heads, lengths on
    the host) where :func:`.stream_k.ragged_prefers` holds for their query lengths (``longest``: the ragged cases'
    longest sequence)."""
    f = _case_fields(label)
    precision = _precision(mode, None)
    if f["kind"] == "dense":
        cfg = get_config(mode, HEAD_DIM, HEAD_DIM, f["k"])
        jobs = f["B"] * f["H"] * cdiv(f["q"], stream_k.query_block(f["q"], cfg.block_m))
        routed = auto_splits > 1 and stream_k.dense_prefers(jobs, f["q"], f["k"], precision)
        return "stream-k" if routed else "split-kv"
    n_q = f["longest"] if f["kind"] == "self" else f["q"]
    cfg = get_config(mode, HEAD_DIM, HEAD_DIM, f["longest"] if f["kind"] == "self" else longest)
    routed = stream_k.ragged_prefers([n_q] * f["n"], [1] * f["n"], RAGGED_HEADS, cfg.block_m, cfg.block_n, sms)
    return "stream-k" if routed else "split-kv"


def targets(result: dict) -> list[dict]:
    """The bar's cells (:data:`TARGET_SPEEDUP` x the split-KV plan, graph replay): ragged cases at mean / max <=
    :data:`TARGET_RATIO`, dense cases whose B x H x query tiles fill under :data:`TARGET_SM_SHARE` of the SMs. Per
    cell: the schedule the library runs, its speed-up over the split-KV plan (1.0 where that plan runs) and over
    Flash-Decoding's split count, the split-KV plan's K / V bandwidth, the bandwidth the bar needs and the run's best
    (any schedule, same mode): a bar past the best any call reaches is out of reach for a schedule alone. A cell
    without graph timings is left out; empty without an SM count (CPU runs)."""
    sms, longest = result.get("sms"), result.get("longest", 8192)
    if not sms:
        return []
    by = {(r["case"], r["mode"], r["schedule"]): r for r in result["rows"]}
    best: dict[str, float] = {}
    for r in result["rows"]:
        best[r["mode"]] = max(best.get(r["mode"], 0.0), r["kv_gb_per_s"] or 0.0)
    out = []
    for (case, mode, schedule), auto in by.items():
        if schedule != "auto" or (case, mode, "stream-k") not in by:
            continue
        f = _case_fields(case)
        if f["kind"] == "ragged":
            if f["mean/max"] > TARGET_RATIO:
                continue
        elif f["kind"] != "dense" or f["B"] * f["H"] * cdiv(f["q"], stream_k.MAX_QUERY_ROWS) >= TARGET_SM_SHARE * sms:
            continue
        runs = library_schedule(case, mode, auto["splits"], sms, longest)
        ours = by[(case, mode, "stream-k")] if runs == "stream-k" else auto
        flash = by.get((case, mode, "flash-decoding"), auto)
        if not (auto["graph_ms"] and ours["graph_ms"] and flash["graph_ms"]):
            continue
        speedup = auto["graph_ms"] / ours["graph_ms"]
        need = TARGET_SPEEDUP * auto["kv_gb_per_s"]
        if speedup >= TARGET_SPEEDUP:
            status = "met"
        elif need > best[mode]:
            status = "NOT met (needs K / V read faster than any call of this run reads them)"
        elif runs == "split-kv":
            status = "NOT met (the split-KV plan runs: stream-K not routed)"
        else:
            status = "NOT met"
        out.append(dict(case=case, mode=mode, runs=runs, speedup=speedup,
                        vs_flash_decoding=flash["graph_ms"] / ours["graph_ms"], split_kv_gb_per_s=auto["kv_gb_per_s"],
                        need_gb_per_s=need, best_gb_per_s=best[mode], met=speedup >= TARGET_SPEEDUP, status=status))
    return out


def markdown(result: dict) -> str:
    """The report of a run (:func:`main`'s result, or its JSON read back): every case and schedule, then the bar's
    cells (:func:`targets`)."""
    rows = result["rows"]
    speed = _speedups(rows)
    by = {(r["case"], r["mode"], r["schedule"]): r for r in rows}
    table = [[r["case"], r["mode"], r["schedule"], r["splits"], r["first_ms"], r["eager_ms"], r["graph_ms"],
              "" if r["schedule"] != "auto" or speed.get((r["case"], r["mode"])) is None
              else f"{speed[(r['case'], r['mode'])]:.2f}x",
              _ratio(by[(r["case"], r["mode"], "auto")], r) if r["schedule"].startswith("stream-k") else "",
              r["kv_gb_per_s"] or "", f"{r['max_rel_err']:.1e}"] for r in rows]
    lines = md_header("Split-KV schedules on few-query and ragged calls", result["environment"],
                      "first call: the schedule's first call on the case in the process, wall clock to its "
                      "completion (compiles with the Triton cache as found, the plan built); a schedule "
                      "sharing a kernel variant with an earlier case or schedule finds it compiled",
                      "eager: CUDA events around back-to-back calls; graph: the same calls replayed from a "
                      "CUDA graph, in alternating windows; median of the windows",
                      "auto vs flash-decoding: flash-decoding's graph ms over auto's",
                      "auto: the split-KV plan's automatic P (elsa_fwd.choose_num_splits); stream-k: the "
                      "stream-K schedule (kernels/stream_k.py) on the same data, packed; stream-k vs auto: "
                      "auto's graph ms over stream-k's",
                      "K/V GB/s: the keys' and values' bytes, each counted once, over the graph time; a call "
                      "near the memory's peak (4.8 TB/s on an H200) has little left for any schedule to gain")
    lines.append(markdown_table(table, ["case", "mode", "schedule", "P", "first call ms", "eager ms", "graph ms",
                                        "auto vs flash-decoding", "stream-k vs auto", "K/V GB/s",
                                        "max rel err vs float64"]))
    cells = targets(result)
    if cells:
        lines += [f"## Targets: >= {TARGET_SPEEDUP}x the split-KV plan where mean / max <= {TARGET_RATIO} or the "
                  f"query tiles fill under {TARGET_SM_SHARE:.0%} of the SMs", "",
                  "runs: the schedule the library's default call takes (stream-k where its rule routes the case); "
                  "speed-ups by graph replay; need: the split-KV plan's K / V bandwidth times the bar; best: the "
                  "highest K / V bandwidth of any call of this mode in the run", ""]
        for mode in result["modes"]:
            mine = [c for c in cells if c["mode"] == mode]
            if mine:
                lines.append(f"* {mode}: {sum(c['met'] for c in mine)} of {len(mine)} cells met")
        lines += ["", markdown_table([[c["case"], c["mode"], c["runs"], f"{c['speedup']:.2f}x",
                                       f"{c['vs_flash_decoding']:.2f}x", c["split_kv_gb_per_s"],
                                       c["need_gb_per_s"], c["best_gb_per_s"], c["status"]] for c in cells],
                                     ["case", "mode", "runs", "vs split-KV plan", "vs flash-decoding",
                                      "split-KV K/V GB/s", "need GB/s", "best GB/s", "status"])]
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Parse and check ``argv`` (exit 2 with one line before any work), run every case, write the reports."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _parse(parser, args)
    device = check_device(parser, args.device)
    files = prefix_outputs(parser, args.out, tool="bench_split_kv")
    rows = run(args, device)
    env = environment()
    result = dict(environment=env, modes=args.modes, rows=rows,
                  sms=sm_count(device) if device.type == "cuda" else None, longest=args.longest)
    md = markdown(result)
    write_results(files, args.out, result, md, _plot if device.type == "cuda" else None)
    print(md)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
