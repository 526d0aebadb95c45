#!/usr/bin/env python
"""Benchmark whole training steps of timm models, visionattn-patched vs unpatched, in the same precision.

A step is ``tools/finetune.py``'s ``TrainStep``: forward, cross-entropy on random labels, backward, AdamW. Per case
(timm model, random weights, image size, batch) and mode, one model and optimiser step unpatched and patched
(``visionattn.patch_model``), switched in place, timed in interleaved rounds: median ms per step (CUDA events around
each step; CPU: wall time), img/s, peak memory of one step, the first step apart, speedup and memory ratio, targets.
``--attention-free`` adds the step with every attention answering a copy of V (``_harness.attention_free``; Swin-v2,
whose attention never calls SDPA: patched, its cores answering): unpatched / attention-free is the Amdahl bound.

Precision per mode, both sides alike: fp32 / fp32-ieee: TF32 OFF; tf32: TF32 ON; bf16: autocast; fp16: autocast with
a GradScaler; the process-wide TF32 flags are set per mode, restored after and recorded.

``--loss-curve N`` instead trains N steps unpatched and patched from the same weights on the same batches (plus an
unpatched FP32 reference for tf32 / bf16 / fp16): FP32 modes pass at a max relative gap <= 1e-4, the others when the
patched gap to FP32 is at most twice the unpatched one (+1e-4).

Writes ``<out>.md/.json/.png`` (``<out>_loss.*`` with --loss-curve).

    python tools/bench_train.py --out out/train_h100          # the four cases below, fp32,tf32,bf16,fp16
    python tools/bench_train.py --cases vit_base_patch16_224:1024:8 --modes fp32 --out out/train_vit1024
    python tools/bench_train.py --attention-free --cases vit_base_patch16_224:224:64 --modes fp32,bf16
    python tools/bench_train.py --loss-curve 50 --cases vit_base_patch16_224:224:64 --modes fp32,bf16
    python tools/bench_train.py --device cpu --cases vit_tiny_patch16_224:32:4 --modes fp32 --steps 3
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers

from _harness import (AttentionFree, OutputFiles, ToolParser, bars, call_ms, check_device, check_output,  # noqa: E402
                      default_out, environment, failure_text, figure, json_object, markdown_table, md_header,
                      nonnegative_int, output_files, peak_memory, positive_float, positive_int, sample_ms, tf32_flags,
                      write_results)
from _timm_models import create_timm_model, model_problem  # noqa: E402
from bench_models import MEM_SLACK_MIB, parse_cases, summarize_times  # noqa: E402
from finetune import TRAIN_MODES, TrainStep, precision  # noqa: E402


DEFAULT_CASES = ("vit_base_patch16_224:224:64,swin_base_patch4_window7_224:224:64,"
                 "swinv2_base_window8_256:256:32,vit_base_patch16_224:1024:8")
DEFAULT_MODES = "fp32,tf32,bf16,fp16"
TOOL = "bench_train"  # its output manifest: .visionattn-bench_train.json (_harness.output_files)
VARIANTS = ("unpatched", "visionattn")
FREE = "attention-free"  # the --attention-free side: the step with every attention call answering a copy of V
# Whole-step targets: patched vs unpatched, same precision. anchor_ms: the unpatched step measured on an
# H100 (torch 2.11), for orientation beside this run's own unpatched time.
TARGETS = [
    {"model": "vit_base_patch16_224", "img": 224, "batch": 64, "mode": "fp32", "min_speedup": 1.1, "anchor_ms": 170.7},
    {"model": "vit_base_patch16_224", "img": 224, "batch": 64, "mode": "bf16", "min_speedup": 1.05, "anchor_ms": 30.5,
     "max_mem_ratio": 1.0},
    {"model": "vit_base_patch16_224", "img": 1024, "batch": 8, "mode": "fp32", "min_speedup": 1.8,
     "max_mem_ratio": 1.0},
    {"model": "vit_base_patch16_224", "img": 1024, "batch": 8, "mode": "bf16", "min_speedup": 1.15,
     "max_mem_ratio": 1.0},
    {"model": "swin_base_patch4_window7_224", "img": 224, "batch": 64, "mode": "bf16", "min_speedup": 1.3,
     "anchor_ms": 78.8, "max_mem_ratio": 1.0},
    {"model": "swin_base_patch4_window7_224", "img": 224, "batch": 64, "mode": "fp32", "min_speedup": 1.1,
     "anchor_ms": 188.7},
    {"model": "swinv2_base_window8_256", "img": 256, "batch": 32, "mode": "bf16", "min_speedup": 1.5,
     "anchor_ms": 100.4},
    {"model": "swinv2_base_window8_256", "img": 256, "batch": 32, "mode": "fp32", "min_speedup": 1.2,
     "anchor_ms": 146.6},
]
FP32_LOSS_TOL = 1e-4  # max relative loss gap, patched vs unpatched, of the FP32 modes


def build_parser() -> ToolParser:
    p = ToolParser(prog="bench_train.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help="comma-separated model:img:batch cases (timm names, random weights; default: %(default)s)")
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help=f"comma-separated training modes, from {', '.join(TRAIN_MODES)} (default: %(default)s)")
    p.add_argument("--model-kwargs", type=json_object, default={},
                   help='JSON dict of extra timm.create_model arguments for every case, e.g. \'{"depth": 2}\'')
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default when available) or cpu (smoke runs: wall-clock timing, no memory)")
    p.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps per side before timing (default 3)")
    p.add_argument("--steps", type=positive_int, default=20, help="timed steps per side (default 20)")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="interleaved rounds (unpatched, visionattn, ...) the timed steps are split over (default 2)")
    p.add_argument("--attention-free", action="store_true",
                   help="also time the unpatched step with SDPA computing no attention: the Amdahl bound of the "
                        "speedup (the bound column)")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--loss-curve", type=positive_int, default=None, metavar="N",
                   help="instead of timing: N steps patched and unpatched from the same init on the same batches")
    p.add_argument("--loss-pool", type=positive_int, default=4,
                   help="distinct random batches the --loss-curve steps cycle through (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default 0)")
    p.add_argument("--out", default=default_out("bench_train"),
                   help="output prefix: <out>.md/.json/.png, or <out>_loss.* with --loss-curve (default: %(default)s)")
    return p


def check_args(parser: ToolParser, args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """Every check that can fail, before any work (exit 2, one line). Returns (cases, modes)."""
    try:
        cases = parse_cases(args.cases)
    except ValueError as e:
        parser.error(str(e))
    if not cases:
        parser.error("--cases is empty; pass model:img:batch items, e.g. vit_base_patch16_224:224:64")
    for c in cases:
        if c["img"] < 1 or c["batch"] < 1:
            parser.error(f"--cases {c['model']}:{c['img']}:{c['batch']}: image size and batch must be >= 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes or [""]:
        try:
            precision(m)
        except ValueError as e:
            parser.error(f"--modes: {e}")
    device = check_device(parser, args.device)
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device}: expected cuda or cpu")
    for name, img in dict.fromkeys((c["model"], c["img"]) for c in cases):
        problem = model_problem(name, img, **args.model_kwargs)
        if problem:
            parser.error(f"--cases {name}:{img}: {problem[1]}")
    check_output(parser, args.out + ("_loss" if args.loss_curve else ""))
    return cases, modes


# ----------------------------------------------------------------------------- measurement
def _model(case: dict, device: torch.device, seed: int, model_kwargs: dict) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return create_timm_model(case["model"], pretrained=False, img_size=case["img"], **model_kwargs).train()


def _batch(case: dict, num_classes: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(case["batch"], 3, case["img"], case["img"], generator=g, device=device)
    return x, torch.randint(0, num_classes, (case["batch"],), generator=g, device=device)


def _set_attention(model: torch.nn.Module, variant: str, mode: str) -> None:
    """Patch ``model`` for the visionattn side; any other side (unpatched, attention-free) runs timm's modules."""
    import visionattn as va

    if variant == "visionattn":
        va.patch_model(model, mode)
    else:
        va.unpatch_model(model)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _stepper(step: TrainStep, variant: str, x: torch.Tensor, y: torch.Tensor, free: AttentionFree):
    """One training step of ``variant`` (the attention-free side runs inside ``free``, and patched modules' attention
    cores answer through ``free.core``)."""
    if variant != FREE:
        return lambda: step(x, y)
    from visionattn.patching.timm import override_cores

    switches = [m for m in step.model.modules() if isinstance(getattr(m, "fused_attn", None), bool)]

    def run():
        saved = [m.fused_attn for m in switches]
        for m in switches:  # timm's SDPA branch, so that the attention reaches the attention-free SDPA
            m.fused_attn = True
        try:
            with free, override_cores(dense=free.core, window=free.core):
                return step(x, y)
        finally:
            for m, s in zip(switches, saved):
                m.fused_attn = s
    return run


def time_case(case: dict, mode: str, device: torch.device, args: argparse.Namespace, model_kwargs: dict) -> list[dict]:
    """The unpatched and visionattn rows (and with ``args.attention_free`` the attention-free row) of one case in
    one mode (one model, one optimiser, switched in place)."""
    prec = precision(mode)
    variants = VARIANTS + ((FREE,) if args.attention_free else ())
    base = {"model": case["model"], "img": case["img"], "batch": case["batch"], "mode": mode}
    try:
        model = _model(case, device, args.seed, model_kwargs)
    except Exception as err:  # noqa: BLE001 - OOM or a refused size: record it, keep the sweep going
        return [{**base, "variant": v, "error": f"build: {failure_text(err, device)}"} for v in variants]
    x, y = _batch(case, model.num_classes, device, args.seed)
    step = TrainStep(model, prec, lr=args.lr)
    free = AttentionFree()
    rows = {v: {**base, "variant": v, "params_m": sum(p.numel() for p in model.parameters()) / 1e6} for v in variants}
    samples: dict[str, list[float]] = {v: [] for v in variants}
    runs = {v: _stepper(step, v, x, y, free) for v in variants}
    per_round = -(-args.steps // args.rounds)
    free_patched = False  # the attention-free side runs patched (its cores answering) once SDPA answered nothing

    def switch(v: str) -> None:
        _set_attention(model, "visionattn" if v == FREE and free_patched else v, mode)

    def prime(v: str) -> None:
        """First step (compilation), warm-up and the peak memory of one step of side ``v``."""
        switch(v)
        rows[v]["first_step_ms"] = call_ms(runs[v], device)
        for _ in range(args.warmup):
            runs[v]()
        rows[v]["peak_mib"] = peak_memory(runs[v], device.type)["peak_mib"]

    def answered_per_step() -> tuple[int, int]:
        """(SDPA calls, core calls) the attention-free side answers in one step."""
        free.calls = free.core_calls = 0
        runs[FREE]()
        return free.calls, free.core_calls

    with tf32_flags(prec.tf32) as flags:
        for v in variants:
            rows[v]["process_settings"] = flags
            try:
                prime(v)
                if v == "visionattn":
                    rows[v]["patched"] = dict(model.visionattn_report.patched)
                if v == FREE:
                    rows[v]["sdpa_calls_per_step"] = answered_per_step()[0]
                    if not rows[v]["sdpa_calls_per_step"]:  # timm's attention never reached SDPA: patched
                        free_patched = True
                        prime(v)
                        rows[v]["sdpa_calls_per_step"], rows[v]["core_calls_per_step"] = answered_per_step()
            except Exception as err:  # noqa: BLE001
                rows[v]["error"] = failure_text(err, device)
        for _ in range(args.rounds):
            for v in variants:
                if "error" in rows[v]:
                    continue
                try:
                    switch(v)
                    samples[v] += sample_ms(runs[v], device, warmup=1, reps=per_round)
                except Exception as err:  # noqa: BLE001
                    rows[v]["error"] = failure_text(err, device)
    for v in variants:
        if "error" not in rows[v]:
            t = summarize_times(samples[v])
            rows[v].update(ms=t["median_ms"], p10_ms=t["p10_ms"], p90_ms=t["p90_ms"], timed_steps=t["reps"],
                           img_per_s=case["batch"] / (t["median_ms"] / 1e3))
    un, ours = rows["unpatched"], rows["visionattn"]
    if "ms" in un and "ms" in ours:
        ours["speedup"] = un["ms"] / ours["ms"]
        if ours.get("peak_mib") is not None:
            ours["mem_ratio"] = ours["peak_mib"] / un["peak_mib"]
    bound = rows.get(FREE, {})
    if "ms" in un and "ms" in bound and (bound.get("sdpa_calls_per_step") or bound.get("core_calls_per_step")):
        bound["speedup"] = ours["bound"] = un["ms"] / bound["ms"]
    del model, step, x, y
    _free(device)
    return [rows[v] for v in variants]


def check_targets(rows: list[dict]) -> list[dict]:
    """Every target of :data:`TARGETS`, with its measured speedup / memory ratio and whether it is met."""
    out = []
    for t in TARGETS:
        res = {**t, "measured": False}
        match = {r["variant"]: r for r in rows if all(r[k] == t[k] for k in ("model", "img", "batch", "mode"))}
        ours, un = match.get("visionattn"), match.get("unpatched")
        if ours is not None and "speedup" in ours:
            res.update(measured=True, speedup=ours["speedup"], ms=ours["ms"], unpatched_ms=un["ms"],
                       mem_ratio=ours.get("mem_ratio"), bound=ours.get("bound"))
            ok = ours["speedup"] >= t["min_speedup"]
            if t.get("max_mem_ratio") is not None and ours.get("peak_mib") is not None:
                ok = ok and ours["peak_mib"] <= t["max_mem_ratio"] * un["peak_mib"] + MEM_SLACK_MIB
            res["met"] = ok
        out.append(res)
    return out


# ----------------------------------------------------------------------------- loss curves
def loss_curves(case: dict, mode: str, device: torch.device, args: argparse.Namespace,
                model_kwargs: dict) -> dict[str, Any]:
    """``args.loss_curve`` steps of one case, unpatched and patched (and an unpatched FP32 reference for the
    non-FP32 modes) from the same initial weights on the same batches; the gaps and the verdict."""
    fp32 = mode in ("fp32", "fp32-ieee")
    model = _model(case, device, args.seed, model_kwargs)
    init = {k: t.detach().clone() for k, t in model.state_dict().items()}
    batches = [_batch(case, model.num_classes, device, args.seed + 1 + i) for i in range(args.loss_pool)]

    patched: dict[str, int] = {}

    def run(variant: str, prec_mode: str) -> list[float]:
        model.load_state_dict(init)
        torch.manual_seed(args.seed)  # the same stochastic-depth draws on every run
        _set_attention(model, variant, mode)
        if variant == "visionattn":
            patched.update(model.visionattn_report.patched)
        step = TrainStep(model, precision(prec_mode), lr=args.lr)
        with tf32_flags(step.prec.tf32):
            losses = [step(*batches[i % len(batches)]) for i in range(args.loss_curve)]
        return [float(v) for v in losses]

    curves = {"unpatched": run("unpatched", mode), "visionattn": run("visionattn", mode)}
    if not fp32:
        curves["unpatched fp32"] = run("unpatched", "fp32")
    del model, init, batches
    res = {"model": case["model"], "img": case["img"], "batch": case["batch"], "mode": mode,
           "steps": args.loss_curve, "patched": patched, "curves": curves,
           "max_rel_gap": max_rel_gap(curves["visionattn"], curves["unpatched"])}
    if fp32:
        res.update(rule=f"max rel gap <= {FP32_LOSS_TOL:g}", tolerance=FP32_LOSS_TOL)
    else:
        own = max_rel_gap(curves["unpatched"], curves["unpatched fp32"])
        res.update(rule="gap to the FP32 run <= 2 x the unpatched run's own + "
                        f"{FP32_LOSS_TOL:g}", unpatched_gap_to_fp32=own,
                   visionattn_gap_to_fp32=max_rel_gap(curves["visionattn"], curves["unpatched fp32"]),
                   tolerance=2 * own + FP32_LOSS_TOL)
    gap = res["max_rel_gap"] if fp32 else res["visionattn_gap_to_fp32"]
    res["met"] = bool(gap <= res["tolerance"])  # NaN never meets
    return res


def max_rel_gap(a: Sequence[float], b: Sequence[float]) -> float:
    """max over steps of |a - b| / |b| (NaN if any loss is not finite)."""
    t, r = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if not (torch.isfinite(t).all() and torch.isfinite(r).all()):
        return float("nan")
    return float(((t - r).abs() / r.abs().clamp_min(1e-30)).max())


# ----------------------------------------------------------------------------- report
def _header(res: dict, title: str) -> list[str]:
    return md_header(title, res["environment"],
                     "process-wide (per mode, both sides, restored after): TF32 matmul and cuDNN OFF for fp32 / "
                     "fp32-ieee / bf16 / fp16, ON for tf32; bf16 / fp16 under torch.autocast, fp16 with a GradScaler",
                     f"settings: {json.dumps(res['settings'])}")


def _fmt(x: Any, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def render_markdown(res: dict) -> str:
    lines = _header(res, "Training steps, visionattn vs unpatched")
    lines += [f"Step = forward, cross-entropy, backward, AdamW step; ms = median of the timed steps ({res['timing']}); "
              "peak = max_memory_allocated during one step after warm-up.", ""]
    rows = []
    for r in res["rows"]:
        name = {"visionattn": "**visionattn**",
                FREE: "attention-free (" + ("patched, its cores answer V)" if "core_calls_per_step" in r
                                            else "SDPA answers V)")}.get(r["variant"], r["variant"])
        if "error" in r:
            rows.append([r["model"], r["img"], r["batch"], r["mode"], name] + ["-"] * 6 + [r["error"]])
            continue
        speedup = r.get("speedup")
        if r["variant"] == FREE and not (r.get("sdpa_calls_per_step") or r.get("core_calls_per_step")):
            speedup = "no bound: 0 attention calls"
        rows.append([r["model"], r["img"], r["batch"], r["mode"], name, _fmt(r["ms"]),
                     f"{r['p10_ms']:.4g}-{r['p90_ms']:.4g}", _fmt(r["img_per_s"], ".1f"),
                     _fmt(r.get("peak_mib"), ".0f"),
                     _fmt(speedup, ".3f"), _fmt(r.get("mem_ratio"), ".3f"), _fmt(r["first_step_ms"], ".0f")])
    lines.append(markdown_table(rows, ["model", "img", "batch", "mode", "attention", "ms/step", "p10-p90",
                                       "img/s", "peak MiB", "speedup", "mem ratio", "first step ms"]))
    if any(r["variant"] == FREE for r in res["rows"]):
        lines += ["", "The attention-free row's speedup is the bound: unpatched / attention-free, the most any "
                  "attention kernel can give this step (Amdahl's law).", ""]
    lines += ["## Targets", ""]
    trows = []
    for t in res["targets"]:
        need = f">= {t['min_speedup']}x" + (f", peak <= {t['max_mem_ratio']}x unpatched (+{MEM_SLACK_MIB:g} MiB)"
                                            if t.get("max_mem_ratio") is not None else "")
        status = "not measured" if not t["measured"] else "met" if t["met"] else "NOT met"
        if t["measured"] and not t["met"] and t.get("bound") is not None and t["bound"] < t["min_speedup"]:
            status += " (target above the attention-free bound)"
        trows.append([f"{t['model']} {t['img']} px bs{t['batch']}", t["mode"], need,
                      _fmt(t.get("speedup"), ".3f") + ("x" if t["measured"] else ""),
                      _fmt(t.get("bound"), ".3f") + ("x" if t.get("bound") is not None else ""),
                      _fmt(t.get("mem_ratio"), ".3f"), _fmt(t.get("unpatched_ms"), ".1f"), _fmt(t.get("anchor_ms")),
                      status])
    lines.append(markdown_table(trows, ["case", "mode", "target", "speedup", "attention-free bound", "mem ratio",
                                        "unpatched ms here", "unpatched ms, H100 anchor", "status"]))
    return "\n".join(lines)


def render_png(res: dict, path: str, outputs: OutputFiles | None = None) -> None:
    groups = list(dict.fromkeys((r["model"], r["img"], r["batch"], r["mode"]) for r in res["rows"]))
    labels = [f"{m.split('_patch')[0].split('_window')[0]}\n{img}px bs{b}\n{mode}" for m, img, b, mode in groups]
    with figure(path, outputs, 1, 2, figsize=(max(8.0, 1.6 * len(groups) + 3), 4.2), tool=TOOL, dpi=110) as (fig, axes):
        for ax, key, ylabel in ((axes[0], "ms", "ms / step"), (axes[1], "peak_mib", "peak MiB")):
            if not any(r.get(key) for r in res["rows"]):
                ax.text(0.5, 0.5, f"{ylabel}: not measured here", ha="center", transform=ax.transAxes)
            variants = [v for v in VARIANTS + (FREE,) if any(r["variant"] == v for r in res["rows"])]
            bars(ax, labels, {v: [next((r.get(key) or 0.0 for r in res["rows"] if r["variant"] == v and
                                        (r["model"], r["img"], r["batch"], r["mode"]) == g), 0.0) for g in groups]
                              for v in variants}, fontsize=7)
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"training step, visionattn vs unpatched ({res['environment']['device']})")


def render_loss_markdown(res: dict) -> str:
    lines = _header(res, "Loss curves, visionattn vs unpatched")
    lines += ["Same initial weights, same batches, AdamW; gap = max over steps of |loss - reference| / |reference|.",
              ""]
    rows = [[f"{c['model']} {c['img']} px bs{c['batch']}", c["mode"], c["steps"], f"{c['max_rel_gap']:.3g}",
             _fmt(c.get("visionattn_gap_to_fp32"), ".3g"), _fmt(c.get("unpatched_gap_to_fp32"), ".3g"),
             f"{c['tolerance']:.3g}", c["rule"], "met" if c["met"] else "NOT met",
             f"{c['curves']['unpatched'][0]:.4g} -> {c['curves']['unpatched'][-1]:.4g}"] for c in res["curves"]]
    lines.append(markdown_table(rows, ["case", "mode", "steps", "gap vs unpatched", "visionattn gap to FP32",
                                       "unpatched gap to FP32", "tolerance", "rule", "status", "unpatched loss"]))
    return "\n".join(lines)


def render_loss_png(res: dict, path: str, outputs: OutputFiles | None = None) -> None:
    n = len(res["curves"])
    with figure(path, outputs, 2, n, figsize=(4.5 * n, 6.5), squeeze=False, sharex="col", tool=TOOL,
                dpi=110) as (fig, axes):
        for j, c in enumerate(res["curves"]):
            steps = range(1, c["steps"] + 1)
            for label, losses in c["curves"].items():
                axes[0][j].plot(steps, losses, lw=2.2 if label == "visionattn" else 1.2,
                                ls="--" if label == "visionattn" else "-", label=label)
            axes[0][j].set_title(f"{c['model'].split('_patch')[0]} {c['img']}px bs{c['batch']} {c['mode']}", fontsize=9)
            axes[0][j].set_ylabel("loss")
            axes[0][j].legend(fontsize=7)
            un, ours = c["curves"]["unpatched"], c["curves"]["visionattn"]
            gaps = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours, un)]
            axes[1][j].semilogy(steps, [max(g, 1e-12) for g in gaps], label="|visionattn - unpatched| / |unpatched|")
            axes[1][j].axhline(c["tolerance"], color="k", lw=0.8, ls=":", label="tolerance")
            axes[1][j].set_xlabel("step")
            axes[1][j].legend(fontsize=7)
            for ax in (axes[0][j], axes[1][j]):
                ax.grid(alpha=0.3)
        fig.suptitle(f"loss curves ({res['environment']['device']})")


# ----------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> dict:
    """Time the training steps (or compare loss curves); returns the record also written as JSON."""
    from tqdm import tqdm

    parser = build_parser()
    args = parser.parse_args(argv)
    cases, modes = check_args(parser, args)
    prefix = args.out + ("_loss" if args.loss_curve else "")
    outputs = output_files(parser, [prefix + ".json", prefix + ".md", prefix + ".png"], tool=TOOL)
    model_kwargs = args.model_kwargs
    device = torch.device(args.device)
    env = environment()
    print(f"[bench_train] {env['device']} torch {env['torch']} triton {env.get('triton')} timm {env.get('timm')}; "
          "process-wide TF32 flags (torch.backends.cuda.matmul / cudnn .allow_tf32) set per mode: OFF for fp32, "
          "fp32-ieee, bf16, fp16; ON for tf32", flush=True)
    settings = {"device": str(device), "modes": modes, "lr": args.lr, "seed": args.seed, "model_kwargs": model_kwargs}
    jobs = [(c, m) for c in cases for m in modes]
    if args.loss_curve:
        settings.update(loss_steps=args.loss_curve, loss_pool=args.loss_pool)
        res: dict[str, Any] = {"environment": env, "settings": settings, "curves": []}
        for case, mode in tqdm(jobs, desc="loss curves"):
            c = loss_curves(case, mode, device, args, model_kwargs)
            tqdm.write(f"  {case['model']} {case['img']}px bs{case['batch']} {mode}: "
                       f"max rel gap {c['max_rel_gap']:.3g} "
                       f"(tolerance {c['tolerance']:.3g}: {'met' if c['met'] else 'NOT met'})")
            res["curves"].append(c)
        markdown, png = render_loss_markdown, render_loss_png
    else:
        settings.update(warmup=args.warmup, steps=args.steps, rounds=args.rounds)
        res = {"environment": env, "settings": settings, "rows": [],
               "timing": "CUDA events around each step, eager" if device.type == "cuda" else "wall time, CPU"}
        for case, mode in tqdm(jobs, desc="cases x modes"):
            rows = time_case(case, mode, device, args, model_kwargs)
            un, ours = rows[:2]
            tqdm.write(f"  {case['model']} {case['img']}px bs{case['batch']} {mode}: " + (
                f"{un['ms']:.2f} -> {ours['ms']:.2f} ms/step x{ours['speedup']:.3f}" if "speedup" in ours
                else f"{un.get('error') or ours.get('error')}")
                + (f" (attention-free bound x{ours['bound']:.3f})" if "bound" in ours else ""))
            res["rows"] += rows
        res["targets"] = check_targets(res["rows"])
        markdown, png = render_markdown, render_png
    write_results(outputs, prefix, res, markdown(res), png)
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
