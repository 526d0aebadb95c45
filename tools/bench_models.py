"""Benchmark whole timm models patched with visionattn vs the same models unpatched.

For each case of ``configs/bench_models.yaml`` (timm model with random weights,
image size, batch) and each mode: median latency (CUDA events, warm-up, many
reps), throughput (img/s) and peak memory, for the model patched with
:func:`visionattn.patch_model` and for the unpatched model in the same precision
(fp32 / fp32-ieee / tf32 modes: float32 model; fp16 / pasa: float16; bf16:
bfloat16). The baseline is timm's default attention path (SDPA for ViT / DeiT,
eager for Swin and Swin-v2; the ``fused_attn`` flags are recorded).

Attention share: the patched model is also timed with its attention core replaced
by a zero-cost stand-in (returns v; :func:`visionattn.patching.timm.override_cores`),
so ``share = 1 - t_rest / t_model`` for both the unpatched and the patched model.
Each patched run also reports the logits' relative L2 difference to the unpatched
model and the top-1 agreement (random inputs).

Process-wide settings made by this tool (and written to the output): TF32 off for
PyTorch matmuls and cuDNN (``allow_tf32 = False``), so "fp32" means FP32 on both sides.

    python tools/bench_models.py --out out/models_h100                        # full sweep
    python tools/bench_models.py --quick --out /tmp/models_quick              # ~1 min smoke run
    python tools/bench_models.py --cases vit_base_patch16_224:1024:8 --modes fp32,fp16
    python tools/bench_models.py --quick --device cpu --modes fp32 --cases vit_tiny_patch16_224:64:2
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys

import torch
import yaml
from tqdm import tqdm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers

from _harness import (ToolParser, check_output, default_out, failure_text, figure, markdown_table,  # noqa: E402
                      output_files, sample_ms)
from _timm_models import create_timm_model  # noqa: E402

from visionattn.modes import MODES  # noqa: E402


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
parser = ToolParser(prog="bench_models.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
parser.add_argument("--config", default=os.path.join(REPO, "configs", "bench_models.yaml"),
                    help="YAML sweep definition (cases, modes, timing, targets, quick subset)")
parser.add_argument("--out", default=default_out("models_bench"),
                    help="output prefix: writes <out>.md, <out>.json and <out>.png (default: %(default)s)")
parser.add_argument("--quick", action="store_true", help="run the config's small 'quick' subset with short timing")
parser.add_argument("--cases", default=None,
                    help="comma-separated model:img:batch cases replacing the config's "
                         "(e.g. vit_base_patch16_224:1024:8)")
parser.add_argument("--modes", default=None, help="comma-separated visionattn modes replacing every case's modes")
parser.add_argument("--device", default=None,
                    help="cuda (default when available) or cpu (smoke runs; wall-clock timing)")
parser.add_argument("--rep-ms", type=float, default=None, help="timed milliseconds per measurement (default: config)")
parser.add_argument("--warmup", type=int, default=None, help="untimed calls before each measurement (default: config)")
parser.add_argument("--rounds", type=int, default=None,
                    help="interleaved timing rounds per case (unpatched, no-attention, each mode, repeated); "
                         "the timed budget is split across rounds (default: config 'rounds', else 3)")
parser.add_argument("--cuda-graph", action="store_true",
                    help="time replays of each variant's forward captured in a CUDA graph (no Python / launch "
                         "overhead on either side: the GPU time of a host-bound model)")
parser.add_argument("--compile", default=None, choices=COMPILE_MODES, metavar="MODE",
                    help="time each variant's forward under torch.compile(mode=MODE) (default, reduce-overhead or "
                         "max-autotune-no-cudagraphs), unpatched included; one compile per variant, outside the timing "
                         "(forces --rounds 1: a compile takes tens of seconds)")
parser.add_argument("--no-share", action="store_true",
                    help="skip the attention-share measurement (one timing less per dtype)")
parser.add_argument("--max-cases", type=int, default=None, help="stop after this many cases")
parser.add_argument("--case-slice", default=None,
                    help="python-style start:stop over the case list, to split a long sweep over several runs "
                         "(e.g. 0:5)")



# ----------------------------------------------------------------------------- measurement
def graphed(fn):
    """``fn``'s GPU work captured once in a CUDA graph (after two warm-up calls on a side stream, as
    ``torch.cuda.graphs`` asks); returns the graph's replay, which holds the graph and its memory pool."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def compiled(fn, mode: str):
    """``fn`` under ``torch.compile(mode=mode)`` and its output, compiled by three calls here (outside any timing;
    ``reduce-overhead`` records its CUDA graphs on the later ones). Dynamo's caches are reset first, so the
    variant's modules (patched or not) are traced afresh."""
    torch._dynamo.reset()
    fn_c = torch.compile(fn, mode=mode)
    for _ in range(3):
        out = fn_c()
    return fn_c, out


def round_timing(timing: dict, rounds: int) -> dict:
    """``timing`` (warmup, rep_ms, min_reps, max_reps) for one of ``rounds`` interleaved rounds: at least one
    warm-up call, the timed budget and the repetition bounds split across the rounds (at least one each)."""
    return dict(timing, warmup=max(timing["warmup"], 1), rep_ms=timing["rep_ms"] / rounds,
                min_reps=max(1, -(-timing["min_reps"] // rounds)), max_reps=max(1, -(-timing["max_reps"] // rounds)))


def summarize_times(times: list[float]) -> dict:
    """Median / p10 / p90 milliseconds and the sample count."""
    times = sorted(times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"median_ms": statistics.median(times), "p10_ms": q(0.1), "p90_ms": q(0.9), "reps": len(times)}


MEM_SLACK_MIB = 1.0  # memory targets allow this much over ratio * unpatched peak (allocator granularity)


def _met(t: dict) -> str:
    if not t["measured"]:
        return "not measured"
    if t.get("met"):
        return "yes"
    bound = t.get("amdahl_bound")
    beyond = bound is not None and t.get("min_speedup", 0) > bound
    return "NO (target above the bound)" if beyond else "NO"


def _mem_target(t: dict) -> str:
    return "-" if t.get("max_mem_ratio") is None else f"<= {t['max_mem_ratio']} (+{MEM_SLACK_MIB:g} MiB)"


def peak_memory(fn, device: str) -> dict:
    """Peak allocated memory (MiB) during one ``fn()`` call, total and beyond what was allocated before."""
    if device != "cuda":
        return {"peak_mib": None, "peak_extra_mib": None}
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"peak_mib": peak / 2**20, "peak_extra_mib": (peak - before) / 2**20}


def _stub_dense(q, k, v, **kw):
    return v


def _stub_window(q, k, v, **kw):
    return v


# ----------------------------------------------------------------------------- one case
def build_model(name: str, img: int, device: str):
    """A random-weight timm model (no download) for ``img`` px inputs, in eval mode on ``device``.

    All-zero LayerNorm weights (Swin-v2's post-norm init) are set to 1 so that the
    logits comparison sees the attention branch; timing is unaffected.
    """
    with torch.device(device):
        return create_timm_model(name, pretrained=False, img_size=img)


def _fused_flags(model) -> dict:
    flags = {}
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            key = f"{type(m).__module__}.{type(m).__name__}"
            flags.setdefault(key, set()).add(bool(m.fused_attn))
    return {k: sorted(v) for k, v in flags.items()}


def bench_case(case: dict, modes: list[str], device: str, timing: dict, share: bool,
               rounds: int = 1, cuda_graph: bool = False, compile_mode: str | None = None) -> list[dict]:
    """All rows (unpatched baseline, attention-free reference, each mode) of one model/img/batch case.

    ``cuda_graph``: time replays of a CUDA graph of each variant's forward (captured anew each round)
    instead of eager calls; ``compile_mode``: time the variant's forward under ``torch.compile`` (compiled
    anew each round; the row's ``compiled_rel_l2`` is the compiled output against the eager one). Outputs
    and peak memory come from eager calls either way.
    """
    import visionattn as va
    from visionattn.patching import timm as vt

    rows = []
    base = {"model": case["model"], "img": case["img"], "batch": case["batch"]}
    try:
        model = build_model(case["model"], case["img"], device)
    except Exception as err:  # noqa: BLE001 - record and go on: one bad name must not stop a sweep
        return [{**base, "mode": "-", "error": f"build failed: {type(err).__name__}: {err}"}]
    base["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    base["baseline_fused_attn"] = _fused_flags(model)
    g = torch.Generator(device=device).manual_seed(0)
    x32 = torch.randn(case["batch"], 3, case["img"], case["img"], generator=g, device=device)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for mode in modes:
        by_dtype.setdefault(MODES[mode].compute_dtype, []).append(mode)
    for dtype, dmodes in by_dtype.items():
        model.to(dtype)
        x = x32.to(dtype)
        common = {**base, "dtype": str(dtype).removeprefix("torch.")}

        def run():
            with torch.no_grad():
                return model(x)

        # Variants of this dtype, timed in `rounds` interleaved rounds (A B C A B C ...) so that clock or
        # thermal drift during the case hits every variant alike; the pooled samples give the median.
        def unpatched():
            va.unpatch_model(model)
            return contextlib.nullcontext()

        def patched(mode):
            va.patch_model(model, mode)
            return contextlib.nullcontext()

        variants = [("unpatched", unpatched)]
        if share:
            def no_attention():
                with warnings_silenced():
                    va.patch_model(model, dmodes[0])
                return vt.override_cores(dense=_stub_dense, window=_stub_window)
            variants.append(("no-attention", no_attention))
        for mode in dmodes:
            variants.append((mode, lambda mode=mode: patched(mode)))
        per_round = round_timing(timing, rounds)
        rows_by, outs, samples = {}, {}, {label: [] for label, _ in variants}

        def record_error(label, err):
            rows_by[label] = {**common, "mode": label, "error": failure_text(err, device)}
            outs[label] = None

        # outputs and peak memory of every variant first (eager), before any CUDA graph holds a pool
        for label, configure in variants:
            try:
                with configure():
                    outs[label] = run()
                    rows_by[label] = {**common, "mode": label, **peak_memory(run, device)}
                    if label in dmodes:
                        rows_by[label]["patched"] = dict(model.visionattn_report.patched)
            except Exception as err:  # noqa: BLE001 - OOM or a failing path: record it, keep the sweep going
                record_error(label, err)
        for _ in range(rounds):
            for label, configure in variants:
                if "error" in rows_by[label]:
                    continue
                try:
                    with configure():
                        if cuda_graph:
                            timed = graphed(run)
                        elif compile_mode:
                            timed, out_c = compiled(run, compile_mode)
                            if outs[label] is not None:
                                rows_by[label]["compiled_rel_l2"] = va.metrics.rel_l2(out_c.float(),
                                                                                     outs[label].float())
                            del out_c
                        else:
                            timed = run
                        samples[label] += sample_ms(timed, device, **per_round)
                        del timed  # frees the graph's memory pool before the next variant
                except Exception as err:  # noqa: BLE001
                    record_error(label, err)
        for label, row in rows_by.items():
            if "error" not in row:
                row.update(summarize_times(samples[label]), rounds=rounds)
                row["img_per_s"] = case["batch"] / (row["median_ms"] / 1e3)
        base_row, base_out = rows_by["unpatched"], outs["unpatched"]
        rows.append(base_row)
        rest_row = rows_by.get("no-attention")
        if rest_row is not None:
            rows.append(rest_row)
            if "error" not in rest_row and "error" not in base_row:
                base_row["attn_share"] = 1 - rest_row["median_ms"] / base_row["median_ms"]
        for mode in dmodes:
            row, out = rows_by[mode], outs[mode]
            if out is not None and base_out is not None:
                row["logits_rel_l2_vs_unpatched"] = va.metrics.rel_l2(out.float(), base_out.float())
                row["top1_agree"] = float((out.argmax(-1) == base_out.argmax(-1)).float().mean())
            if "error" not in row and "error" not in base_row:
                row["speedup"] = base_row["median_ms"] / row["median_ms"]
                if row["peak_mib"] is not None:
                    row["mem_ratio"] = row["peak_mib"] / base_row["peak_mib"]
                if rest_row is not None and "error" not in rest_row:
                    row["attn_share"] = 1 - rest_row["median_ms"] / row["median_ms"]
            rows.append(row)
        va.unpatch_model(model)
        del base_out
    del model, x32
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def warnings_silenced():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ----------------------------------------------------------------------------- config / report
def parse_cases(text: str) -> list[dict]:
    """``"name:img:batch,..."`` -> case dicts. Raises ValueError naming the bad item."""
    cases = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"--cases item {item!r}: expected model:img:batch, e.g. vit_base_patch16_224:224:64")
        cases.append({"model": parts[0], "img": int(parts[1]), "batch": int(parts[2])})
    return cases


def check_targets(rows: list[dict], targets: list[dict]) -> list[dict]:
    """Evaluate the config's targets against the measured rows."""
    out = []
    for t in targets:
        match = [r for r in rows if r.get("mode") == t["mode"] and r["model"] == t["model"]
                 and r["img"] == t["img"] and r["batch"] == t["batch"]]
        res = {**t, "measured": bool(match) and "speedup" in match[0]}
        if res["measured"]:
            r = match[0]
            res["speedup"], res["mem_ratio"], res["attn_share_unpatched"] = r["speedup"], r.get("mem_ratio"), None
            base = [b for b in rows if b.get("mode") == "unpatched" and b["model"] == r["model"]
                    and b["img"] == r["img"] and b["batch"] == r["batch"] and b["dtype"] == r["dtype"]]
            if base:
                res["attn_share_unpatched"] = share = base[0].get("attn_share")
                if share is not None and 0.0 <= share < 1.0:
                    # Amdahl: even a zero-cost attention core cannot beat 1 / (1 - share)
                    res["amdahl_bound"] = 1.0 / (1.0 - share)
            ok = r["speedup"] >= t.get("min_speedup", 0)
            if t.get("max_mem_ratio") is not None and r.get("mem_ratio") is not None and base:
                # judged in MiB with MEM_SLACK_MIB of slack: a ratio of 1.00004 (63 KiB of small
                # persistent buffers on a 1.6 GiB peak) printed as "1" yet read as "NO"
                allowed = t["max_mem_ratio"] * base[0]["peak_mib"] + MEM_SLACK_MIB
                ok = ok and r["peak_mib"] <= allowed
            res["met"] = ok
        out.append(res)
    return out


def _fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def render_markdown(result: dict) -> str:
    env, rows = result["environment"], result["rows"]
    lines = ["# Whole-model benchmark: visionattn.patch_model vs unpatched timm", "",
             f"* device: {env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"timm {env.get('timm')}, CUDA {env.get('cuda')}",
             f"* command: `{env.get('command')}`",
             f"* settings: {result['settings']}",
             "* random weights; latency = median of per-call timings pooled over the interleaved rounds (every "
             "variant of a case timed once per round, A B C A B C ...; CUDA events on GPU, wall clock on CPU); "
             "throughput = batch / median; "
             "peak = max allocated during one forward (MiB); attention share = 1 - t(no attention core) / t(model); "
             "speedup = t(unpatched) / t(patched) in the same dtype."]
    if result["settings"].get("compile"):
        lines.append(f"* **torch.compile timing** (`--compile {result['settings']['compile']}`): every variant's "
                     "forward (unpatched included) is compiled with that mode before it is timed; "
                     "compiled vs eager output (rel L2) per row: "
                     + ", ".join(f"{r['mode']} {r['compiled_rel_l2']:.1e}" for r in rows if "compiled_rel_l2" in r))
    if result["settings"].get("cuda_graph"):
        lines.append("* **CUDA-graph timing** (`--cuda-graph`): every variant's forward (unpatched included) is "
                     "captured in a CUDA graph and its replays are timed, so host-side Python and launch overhead "
                     "drop out on both sides: this is the models' GPU time, not what an eager caller waits.")
    lines.append("")
    if result["targets"]:
        lines += ["## Targets", "", markdown_table(
            [[t["model"], t["img"], t["batch"], t["mode"], _fmt(t.get("speedup")), f">= {t.get('min_speedup', '-')}",
              _fmt(t.get("mem_ratio")), _mem_target(t), _fmt(t.get("attn_share_unpatched"), 2),
              _fmt(t.get("amdahl_bound")), _met(t)] for t in result["targets"]],
            ["model", "img", "batch", "mode", "speedup", "target", "mem ratio", "target", "attn share (unpatched)",
             "bound 1/(1-share)", "met"])]
    cells = []
    for r in rows:
        case = [r["model"], r["img"], r["batch"], r.get("dtype", "-"), r["mode"]]
        cells.append(case + [r["error"]] + [""] * 7 if "error" in r else case + [
            _fmt(r["median_ms"], 4), _fmt(r["img_per_s"], 4), _fmt(r["peak_mib"], 5), _fmt(r.get("attn_share"), 2),
            _fmt(r.get("speedup")), _fmt(r.get("mem_ratio")), _fmt(r.get("logits_rel_l2_vs_unpatched"), 2),
            _fmt(r.get("top1_agree"), 3)])
    lines += ["## All cases", "", markdown_table(cells, [
        "model", "img", "batch", "dtype", "mode", "ms (median)", "img/s", "peak MiB", "attn share", "speedup",
        "mem ratio", "logits rel L2", "top-1 agree"]).rstrip("\n")]
    return "\n".join(lines) + "\n"


def render_png(result: dict, path: str, outputs=None) -> bool:
    """Bar chart of speedups per case and mode, unpatched attention share in the labels. False if no data."""
    rows = [r for r in result["rows"] if "speedup" in r]
    if not rows:
        return False
    shares = {(r["model"], r["img"], r["batch"], r["dtype"]): r.get("attn_share") for r in result["rows"]
              if r.get("mode") == "unpatched"}
    modes = sorted({r["mode"] for r in rows}, key=list(MODES).index)
    cases = list(dict.fromkeys((r["model"], r["img"], r["batch"]) for r in rows))
    width = 0.8 / len(modes)
    size = (max(8, 0.6 * len(cases) * len(modes) + 3), 5)
    with figure(path, outputs, figsize=size, tool="bench_models") as (fig, ax):
        for i, mode in enumerate(modes):
            xs, ys = [], []
            for j, c in enumerate(cases):
                hit = [r for r in rows if (r["model"], r["img"], r["batch"]) == c and r["mode"] == mode]
                if hit:
                    xs.append(j + i * width)
                    ys.append(hit[0]["speedup"])
            ax.bar(xs, ys, width, label=mode)
        labels = []
        for c in cases:
            s = shares.get((*c, "float32"))
            labels.append(f"{c[0].replace('_patch', '/').replace('_window', '/w')}\n{c[1]}px b{c[2]}"
                          + (f"\nattn {s:.0%}" if s is not None else ""))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], labels, rotation=45, ha="right", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("speedup vs unpatched (same dtype)")
        ax.set_title(f"visionattn.patch_model, {result['environment'].get('device')}")
        ax.legend()
    return True


# ----------------------------------------------------------------------------- main
def main(args) -> dict:
    """Run the sweep described by ``args``; write <out>.md/.json/.png; return the result dict."""
    from visionattn.modes import get_mode
    from _harness import environment

    if not os.path.isfile(args.config):
        parser.error(f"--config {args.config!r} is not a file; pass a YAML like configs/bench_models.yaml")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        parser.error(f"--device {device!r}: expected cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; use --device cpu for a smoke run")
    check_output(parser, args.out)
    outputs = output_files(parser, [args.out + ext for ext in (".json", ".md", ".png")], tool="bench_models")
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    section = cfg["quick"] if args.quick else cfg
    cases = parse_cases(args.cases) if args.cases else section["cases"]
    if args.case_slice:
        try:
            start, stop = (int(p) if p else None for p in args.case_slice.split(":"))
        except ValueError:
            raise ValueError(f"--case-slice {args.case_slice!r}: expected start:stop, e.g. 0:5") from None
        cases = cases[start:stop]
    if args.max_cases is not None:
        cases = cases[:args.max_cases]
    default_modes = cfg.get("modes", ["fp32", "fp16"])
    forced_modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
    for m in forced_modes or []:
        get_mode(m)  # ValueError naming the mode
    timing = {"warmup": args.warmup if args.warmup is not None else cfg.get("warmup", 3),
              "rep_ms": args.rep_ms if args.rep_ms is not None else section.get("rep_ms", cfg.get("rep_ms", 400)),
              "min_reps": cfg.get("min_reps", 5), "max_reps": cfg.get("max_reps", 50)}
    rounds = args.rounds if args.rounds is not None else cfg.get("rounds", 3)
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: expected >= 1")
    if args.compile:
        rounds = 1
        if args.cuda_graph:
            raise ValueError("--compile and --cuda-graph: pick one (--compile reduce-overhead uses CUDA graphs)")
    if args.cuda_graph and device != "cuda":
        raise ValueError(f"--cuda-graph needs a CUDA device, got --device {device}")
    if args.quick and device == "cpu":
        timing.update(warmup=1, min_reps=2, max_reps=3)

    # Process-wide: compare like with like (FP32 really FP32 on both sides).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    settings = {"device": device, "allow_tf32_matmul": False, "allow_tf32_cudnn": False, **timing, "rounds": rounds,
                "quick": bool(args.quick), "attention_share": not args.no_share, "cuda_graph": bool(args.cuda_graph),
                "compile": args.compile}
    env = environment()
    print(f"[bench_models] {env['device']} torch {env['torch']} triton {env.get('triton')} timm {env.get('timm')}; "
          f"TF32 off (torch.backends.cuda.matmul.allow_tf32 = cudnn.allow_tf32 = False)", flush=True)

    rows: list[dict] = []
    for case in tqdm(cases, desc="cases"):
        modes = forced_modes or case.get("modes") or default_modes
        for m in modes:
            get_mode(m)
        case_rows = bench_case(case, modes, device, timing, share=not args.no_share, rounds=rounds,
                               cuda_graph=args.cuda_graph, compile_mode=args.compile)
        for r in case_rows:
            if "error" in r:
                tqdm.write(f"  {r['model']} {r['img']}px b{r['batch']} {r['mode']}: {r['error']}")
            elif r["mode"] not in ("unpatched", "no-attention"):
                tqdm.write(f"  {r['model']} {r['img']}px b{r['batch']} {r['mode']:9s} {r['median_ms']:8.2f} ms "
                           f"x{r.get('speedup', float('nan')):.3f}  mem x{r.get('mem_ratio') or float('nan'):.3f}  "
                           f"share {r.get('attn_share', float('nan')):.2f}")
        rows.extend(case_rows)

    result = {"environment": env, "settings": settings, "rows": rows,
              "targets": check_targets(rows, cfg.get("targets", []))}
    if args.quick or args.cases or args.case_slice or args.max_cases:  # partial run: only what was measured
        result["targets"] = [t for t in result["targets"] if t["measured"]]
    outputs.write_json(args.out + ".json", result)
    outputs.write_text(args.out + ".md", render_markdown(result))
    result["png"] = render_png(result, args.out + ".png", outputs)
    print(render_markdown(result))
    return result


if __name__ == "__main__":
    main(parser.parse_args())
