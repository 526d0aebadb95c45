"""Whole timm models (random weights) patched with visionattn vs the same models unpatched, same dtype.

For each case of ``configs/bench_models.yaml`` (model, image size, batch) and mode: median latency of per-call
timings pooled over interleaved rounds (unpatched, no-attention, each mode, repeated), img/s, peak memory, speed-up,
logits' rel L2 and top-1 agreement against the unpatched model; the attention share ``1 - t(no attention core) /
t(model)`` (the core replaced by a stand-in returning v) and the config's targets with their Amdahl bound.
``--cuda-graph`` times graph replays, ``--compile MODE`` torch.compile'd forwards, instead of eager calls.
TF32 is off for matmuls and cuDNN while it runs (written to the output).

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
import warnings

import torch
import yaml
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers

from _harness import (REPO, ToolParser, add_common, captured_graph, check_device, comma_list, default_out,  # noqa: E402
                      environment, failure_text, figure, markdown_table, md_header, peak_memory, positive_float,
                      positive_int, prefix_outputs, sample_ms, tf32_flags, write_results)
from _timm_models import create_timm_model  # noqa: E402

from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import MODES, get_mode  # noqa: E402

MEM_SLACK_MIB = 1.0  # memory targets allow this much over ratio * unpatched peak (allocator granularity)


def parse_cases(text: str) -> list[dict]:
    """``"name:img:batch,..."`` -> case dicts. Raises ValueError naming the bad item."""
    cases = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"--cases item {item!r}: expected model:img:batch, e.g. vit_base_patch16_224:224:64")
        cases.append({"model": parts[0], "img": int(parts[1]), "batch": int(parts[2])})
    return cases


def _arg(parse):
    """An argparse type from a parser raising ValueError (its message becomes the one-line error)."""
    def check(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return check


def _slice(text: str) -> slice:
    try:
        start, stop = (int(p) if p else None for p in text.split(":"))
        return slice(start, stop)
    except ValueError:
        raise ValueError(f"expected start:stop, e.g. 0:5, got {text!r}") from None


parser = ToolParser(prog="bench_models.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
parser.add_argument("--config", default=os.path.join(REPO, "configs", "bench_models.yaml"),
                    help="YAML sweep definition (cases, modes, timing, targets, quick subset)")
parser.add_argument("--quick", action="store_true", help="run the config's small 'quick' subset with short timing")
parser.add_argument("--cases", type=_arg(parse_cases),
                    help="comma-separated model:img:batch cases replacing the config's "
                         "(e.g. vit_base_patch16_224:1024:8)")
parser.add_argument("--modes", help="comma-separated visionattn modes replacing every case's")
add_common(parser, out=default_out("models_bench"), device=(None, "cuda (default when available) or cpu"),
           warmup=(None, "untimed calls before each measurement (default: config)"))
parser.add_argument("--rep-ms", type=positive_float, help="timed milliseconds per measurement (default: config)")
parser.add_argument("--rounds", type=positive_int,
                    help="interleaved timing rounds per case; the timed budget is split across them (default: config "
                         "'rounds', else 3)")
parser.add_argument("--cuda-graph", action="store_true",
                    help="time replays of each variant's forward captured in a CUDA graph (GPU time, no launch path)")
parser.add_argument("--compile", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"), metavar="MODE",
                    help="time each variant's forward under torch.compile(mode=MODE) (default, reduce-overhead or "
                         "max-autotune-no-cudagraphs), compiled outside the timing; forces --rounds 1")
parser.add_argument("--no-share", action="store_true", help="skip the attention-share measurement")
parser.add_argument("--case-slice", type=_arg(_slice),
                    help="python-style start:stop over the case list, to split a sweep over several runs (e.g. 0:5)")


# ----------------------------------------------------------------------------- measurement
def graphed(fn):
    """``fn``'s GPU work captured once in a CUDA graph (after two warm-up calls, on a side stream:
    :func:`_harness.captured_graph`); returns the graph's replay, which holds the graph and its memory pool. Raises
    what the capture raised where ``fn`` cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph, error = captured_graph(fn, side, warmup=2, calls=1)
    torch.cuda.current_stream().wait_stream(side)
    if graph is None:
        raise error
    return graph.replay


def compiled(fn, mode: str):
    """``fn`` under ``torch.compile(mode=mode)`` (Dynamo reset first: the variant is traced afresh) and its output,
    compiled by three calls here, outside any timing (``reduce-overhead`` records its graphs on the later ones)."""
    torch._dynamo.reset()
    fn_c = torch.compile(fn, mode=mode)
    for _ in range(3):
        out = fn_c()
    return fn_c, out


def round_timing(timing: dict, rounds: int) -> dict:
    """``timing`` (warmup, rep_ms, min_reps, max_reps) for one of ``rounds`` rounds: at least one warm-up call, the
    timed budget and the repetition bounds split across the rounds (at least one each)."""
    return dict(timing, warmup=max(timing["warmup"], 1), rep_ms=timing["rep_ms"] / rounds,
                min_reps=max(1, -(-timing["min_reps"] // rounds)), max_reps=max(1, -(-timing["max_reps"] // rounds)))


def summarize_times(times: list[float]) -> dict:
    """Median / p10 / p90 milliseconds and the sample count."""
    times = sorted(times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"median_ms": statistics.median(times), "p10_ms": q(0.1), "p90_ms": q(0.9), "reps": len(times)}


def measure(forward, variants, device, timing: dict, rounds: int, cuda_graph: bool = False,
            compile_mode: str | None = None) -> tuple[dict, dict]:
    """Rows and outputs of the ``variants`` of one forward: ``(label, enter)`` pairs, ``enter()`` a context manager
    that switches the model to that variant and yields facts for its row.

    The eager output (a tuple flattened into one tensor) and peak memory of every variant come first, before any
    CUDA graph holds a pool; then ``rounds`` interleaved rounds (A B C A B C ...: clock or thermal drift hits every
    variant alike) of per-call timings (:func:`_harness.sample_ms`), pooled: eager calls, replays of a CUDA graph
    captured anew each round (``cuda_graph``) or ``torch.compile``'d calls (``compile_mode``; ``compiled_rel_l2``:
    the compiled output against the eager one). A failing variant's row gets ``error`` (one line) and the sweep goes
    on. Returns ``({label: row}, {label: output or None})``."""
    rows, outs, samples = {}, {}, {label: [] for label, _ in variants}
    for label, enter in variants:
        rows[label], outs[label] = {}, None
        try:
            with enter() as facts:
                rows[label].update(facts or {})
                out = forward()
                outs[label] = torch.cat([t.flatten() for t in out]) if isinstance(out, tuple) else out
                del out
                rows[label].update(peak_memory(forward, device))
        except Exception as err:  # noqa: BLE001 - OOM or a failing path: record it, keep the sweep going
            rows[label]["error"], outs[label] = failure_text(err, device), None
    per_round = round_timing(timing, rounds)
    for _ in range(rounds):
        for label, enter in variants:
            if "error" in rows[label]:
                continue
            try:
                with enter():
                    timed = forward
                    if cuda_graph:
                        timed = graphed(forward)
                    elif compile_mode:
                        timed, out_c = compiled(forward, compile_mode)
                        rows[label]["compiled_rel_l2"] = rel_l2(out_c.float(), outs[label].float())
                        del out_c
                    samples[label] += sample_ms(timed, device, **per_round)
                    del timed  # frees the graph's memory pool before the next variant
            except Exception as err:  # noqa: BLE001
                rows[label]["error"] = failure_text(err, device)
    for label, row in rows.items():
        if "error" not in row:
            row.update(summarize_times(samples[label]), rounds=rounds)
    return rows, outs


# ----------------------------------------------------------------------------- one case
def _fused_flags(model) -> dict:
    flags = {}
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            flags.setdefault(f"{type(m).__module__}.{type(m).__name__}", set()).add(bool(m.fused_attn))
    return {k: sorted(v) for k, v in flags.items()}


def bench_case(case: dict, modes: list[str], device: str, timing: dict, share: bool, rounds: int = 1,
               cuda_graph: bool = False, compile_mode: str | None = None) -> list[dict]:
    """All rows (unpatched baseline, attention-free reference, each mode) of one model/img/batch case, one group of
    variants per compute dtype (:func:`measure`)."""
    import visionattn as va
    from visionattn.patching import timm as vt

    rows = []
    base = {"model": case["model"], "img": case["img"], "batch": case["batch"]}
    try:
        with torch.device(device):  # random weights; all-zero LayerNorm weights set to 1 (see _timm_models)
            model = create_timm_model(case["model"], pretrained=False, img_size=case["img"])
    except Exception as err:  # noqa: BLE001 - record and go on: one bad name must not stop a sweep
        return [{**base, "mode": "-", "error": f"build failed: {type(err).__name__}: {err}"}]
    base["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    base["baseline_fused_attn"] = _fused_flags(model)
    x32 = torch.randn(case["batch"], 3, case["img"], case["img"], generator=torch.Generator(device).manual_seed(0),
                      device=device)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for mode in modes:
        by_dtype.setdefault(MODES[mode].compute_dtype, []).append(mode)
    for dtype, dmodes in by_dtype.items():
        model.to(dtype)
        x = x32.to(dtype)

        def run():
            with torch.no_grad():
                return model(x)

        @contextlib.contextmanager
        def unpatched():
            va.unpatch_model(model)
            yield {}

        @contextlib.contextmanager
        def patched(mode):
            va.patch_model(model, mode)
            yield {"patched": dict(model.visionattn_report.patched)}

        @contextlib.contextmanager
        def no_attention():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                va.patch_model(model, dmodes[0])
            with vt.override_cores(dense=lambda q, k, v, **kw: v, window=lambda q, k, v, **kw: v):
                yield {}

        variants = [("unpatched", unpatched)] + [("no-attention", no_attention)] * share
        variants += [(mode, lambda mode=mode: patched(mode)) for mode in dmodes]
        by, outs = measure(run, variants, device, timing, rounds, cuda_graph, compile_mode)
        common = {**base, "dtype": str(dtype).removeprefix("torch.")}
        for label in by:
            by[label] = {**common, "mode": label, **by[label]}
            if "median_ms" in by[label]:
                by[label]["img_per_s"] = case["batch"] / (by[label]["median_ms"] / 1e3)
        base_row, base_out, rest = by["unpatched"], outs["unpatched"], by.get("no-attention")
        timed = lambda r: r is not None and "error" not in r  # noqa: E731
        if timed(rest) and timed(base_row):
            base_row["attn_share"] = 1 - rest["median_ms"] / base_row["median_ms"]
        for mode in dmodes:
            row, out = by[mode], outs[mode]
            if out is not None and base_out is not None:
                row["logits_rel_l2_vs_unpatched"] = rel_l2(out.float(), base_out.float())
                row["top1_agree"] = float((out.argmax(-1) == base_out.argmax(-1)).float().mean())
            if timed(row) and timed(base_row):
                row["speedup"] = base_row["median_ms"] / row["median_ms"]
                if row["peak_mib"] is not None:
                    row["mem_ratio"] = row["peak_mib"] / base_row["peak_mib"]
                if timed(rest):
                    row["attn_share"] = 1 - rest["median_ms"] / row["median_ms"]
        rows += by.values()
        va.unpatch_model(model)
        del base_out, outs
    del model, x32
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- targets / report
def check_targets(rows: list[dict], targets: list[dict]) -> list[dict]:
    """Evaluate the config's targets against the measured rows."""
    out = []
    key = lambda r: (r["model"], r["img"], r["batch"])  # noqa: E731
    for t in targets:
        match = [r for r in rows if r.get("mode") == t["mode"] and key(r) == key(t)]
        res = {**t, "measured": bool(match) and "speedup" in match[0]}
        if res["measured"]:
            r = match[0]
            res["speedup"], res["mem_ratio"], res["attn_share_unpatched"] = r["speedup"], r.get("mem_ratio"), None
            base = [b for b in rows if b.get("mode") == "unpatched" and key(b) == key(r) and b["dtype"] == r["dtype"]]
            if base:
                res["attn_share_unpatched"] = share = base[0].get("attn_share")
                if share is not None and 0.0 <= share < 1.0:
                    res["amdahl_bound"] = 1.0 / (1.0 - share)  # even a zero-cost attention core cannot beat it
            ok = r["speedup"] >= t.get("min_speedup", 0)
            if t.get("max_mem_ratio") is not None and r.get("mem_ratio") is not None and base:
                # judged in MiB with MEM_SLACK_MIB of slack: 63 KiB of small buffers on a 1.6 GiB peak is "1"
                ok = ok and r["peak_mib"] <= t["max_mem_ratio"] * base[0]["peak_mib"] + MEM_SLACK_MIB
            res["met"] = ok
        out.append(res)
    return out


def _met(t: dict) -> str:
    if not t["measured"]:
        return "not measured"
    if t.get("met"):
        return "yes"
    bound = t.get("amdahl_bound")
    return "NO (target above the bound)" if bound is not None and t.get("min_speedup", 0) > bound else "NO"


def _fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def render_markdown(result: dict) -> str:
    settings, rows = result["settings"], result["rows"]
    lines = md_header("Whole-model benchmark: visionattn.patch_model vs unpatched timm", result["environment"],
                      f"settings: {settings}",
                      "random weights; latency = median of per-call timings pooled over the interleaved rounds "
                      "(A B C A B C ...; CUDA events on GPU, wall clock on CPU); throughput = batch / median; peak = "
                      "max allocated during one forward (MiB); attention share = 1 - t(no attention core) / t(model); "
                      "speedup = t(unpatched) / t(patched) in the same dtype.")
    if settings.get("compile"):
        lines.insert(-1, f"* **torch.compile timing** (`--compile {settings['compile']}`): every variant's forward "
                     "(unpatched included) is compiled with that mode before it is timed; compiled vs eager output "
                     "(rel L2) per row: "
                     + ", ".join(f"{r['mode']} {r['compiled_rel_l2']:.1e}" for r in rows if "compiled_rel_l2" in r))
    if settings.get("cuda_graph"):
        lines.insert(-1, "* **CUDA-graph timing** (`--cuda-graph`): every variant's forward (unpatched included) is "
                     "replayed from a CUDA graph: the models' GPU time, not what an eager caller waits.")
    if result["targets"]:
        lines += ["## Targets", "", markdown_table(
            [[t["model"], t["img"], t["batch"], t["mode"], _fmt(t.get("speedup")), f">= {t.get('min_speedup', '-')}",
              _fmt(t.get("mem_ratio")),
              "-" if t.get("max_mem_ratio") is None else f"<= {t['max_mem_ratio']} (+{MEM_SLACK_MIB:g} MiB)",
              _fmt(t.get("attn_share_unpatched"), 2), _fmt(t.get("amdahl_bound")), _met(t)]
             for t in result["targets"]],
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
    shares = {(r["model"], r["img"], r["batch"]): r.get("attn_share") for r in result["rows"]
              if r.get("mode") == "unpatched" and r.get("dtype") == "float32"}
    modes = sorted({r["mode"] for r in rows}, key=list(MODES).index)
    cases = list(dict.fromkeys((r["model"], r["img"], r["batch"]) for r in rows))
    speed = {(r["model"], r["img"], r["batch"], r["mode"]): r["speedup"] for r in reversed(rows)}
    width = 0.8 / len(modes)
    with figure(path, outputs, figsize=(max(8, 0.6 * len(cases) * len(modes) + 3), 5), tool="bench_models") as (_, ax):
        for i, mode in enumerate(modes):
            hits = [(j + i * width, speed[(*c, mode)]) for j, c in enumerate(cases) if (*c, mode) in speed]
            ax.bar([x for x, _ in hits], [y for _, y in hits], width, label=mode)
        labels = [f"{c[0].replace('_patch', '/').replace('_window', '/w')}\n{c[1]}px b{c[2]}"
                  + (f"\nattn {shares[c]:.0%}" if shares.get(c) is not None else "") for c in cases]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], labels, rotation=45, ha="right", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("speedup vs unpatched (same dtype)")
        ax.set_title(f"visionattn.patch_model, {result['environment'].get('device')}")
        ax.legend()
    return True


# ----------------------------------------------------------------------------- main
def main(args) -> dict:
    """Run the sweep described by ``args``; write <out>.md/.json/.png; return the result dict."""
    if not os.path.isfile(args.config):
        parser.error(f"--config {args.config!r} is not a file; pass a YAML like configs/bench_models.yaml")
    device = check_device(parser, args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    if args.compile and args.cuda_graph:
        parser.error("--compile and --cuda-graph: pick one (--compile reduce-overhead uses CUDA graphs)")
    if args.cuda_graph and device != "cuda":
        parser.error(f"--cuda-graph needs a CUDA device, got --device {device}")
    chosen_modes = args.modes and comma_list(parser, "--modes", args.modes, list(MODES))
    outputs = prefix_outputs(parser, args.out, tool="bench_models")
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    section = cfg["quick"] if args.quick else cfg
    cases = args.cases or section["cases"]
    cases = cases[args.case_slice or slice(None)]
    timing = {"warmup": args.warmup if args.warmup is not None else cfg.get("warmup", 3),
              "rep_ms": args.rep_ms if args.rep_ms is not None else section.get("rep_ms", cfg.get("rep_ms", 400)),
              "min_reps": cfg.get("min_reps", 5), "max_reps": cfg.get("max_reps", 50)}
    rounds = 1 if args.compile else args.rounds or cfg.get("rounds", 3)
    if args.quick and device == "cpu":
        timing.update(warmup=1, min_reps=2, max_reps=3)
    env = environment()
    rows: list[dict] = []
    with tf32_flags():  # FP32 really FP32 on both sides
        settings = {"device": device, "allow_tf32_matmul": False, "allow_tf32_cudnn": False, **timing,
                    "rounds": rounds, "quick": bool(args.quick), "attention_share": not args.no_share,
                    "cuda_graph": bool(args.cuda_graph), "compile": args.compile}
        print(f"[bench_models] {env['device']} torch {env['torch']} triton {env.get('triton')} timm {env.get('timm')}; "
              "TF32 off", flush=True)
        for case in tqdm(cases, desc="cases"):
            modes = chosen_modes or case.get("modes") or cfg.get("modes", ["fp32", "fp16"])
            for m in modes:
                get_mode(m)
            case_rows = bench_case(case, modes, device, timing, share=not args.no_share, rounds=rounds,
                                   cuda_graph=args.cuda_graph, compile_mode=args.compile)
            for r in case_rows:
                what = f"  {r['model']} {r['img']}px b{r['batch']} {r['mode']}"
                if "error" in r:
                    tqdm.write(f"{what}: {r['error']}")
                elif r["mode"] not in ("unpatched", "no-attention"):
                    nan = float("nan")
                    tqdm.write(f"{what} {r['median_ms']:8.2f} ms x{r.get('speedup', nan):.3f}  mem "
                               f"x{r.get('mem_ratio') or nan:.3f}  share {r.get('attn_share', nan):.2f}")
            rows.extend(case_rows)
    result = {"environment": env, "settings": settings, "rows": rows,
              "targets": check_targets(rows, cfg.get("targets", []))}
    if args.quick or args.cases or args.case_slice:  # partial run: only what was measured
        result["targets"] = [t for t in result["targets"] if t["measured"]]
    md = render_markdown(result)
    write_results(outputs, args.out, result, md)
    result["png"] = render_png(result, args.out + ".png", outputs)
    print(md)
    return result


if __name__ == "__main__":
    main(parser.parse_args())
