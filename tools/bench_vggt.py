"""Time and peak memory of VGGT / FastVGGT inference per attention mode vs PyTorch SDPA.

Random-weight VGGT-1B (camera, depth and point heads; FastVGGT with token merging), 392x518 images (1,041 tokens
per frame), in the layout of the ELSA supplement's Tables 3-4. Speedup is against the SDPA row of the same
arithmetic (FP32 / TF32 rows vs ``sdpa-fp32``, PyTorch's memory-efficient kernel; BF16 rows vs ``sdpa-bf16``,
flash); BF16 rows run under bf16 autocast (FP32 weights and heads) as the official demo does. ``official-*`` rows:
SDPA with all 24 aggregator layers held until the heads finish (``keep_all_layers``); ``free-*`` rows (run only when
named): SDPA answering its value rows (:func:`_harness.attention_free`), the Amdahl bound of any kernel.
Times are eager: a forward between synchronisations, wall clock, the median of ``--repeats``. ``--long``: frames
from 10 until each row's first out-of-memory, with :meth:`VGGT.estimate_memory` beside the measured peak.
``--train-step``: one training step (forward, a loss over depth, points and pose, backward; no optimiser) with
activation checkpointing off and on. Results merge into ``<out>.json`` (a sweep may be split over calls);
``<out>.md`` / ``<out>.png`` are rewritten from it.

    python tools/bench_vggt.py --models fastvggt --rows bf16 sdpa-bf16 --frames 200 500
    python tools/bench_vggt.py --long --out docs/benchmarks/vggt_long   # 10 .. OOM, both models, all rows
    python tools/bench_vggt.py --train-step --models vggt --rows sdpa-fp32 fp32 bf16 --frames 2 4 8
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, add_common, attention_free, check_device, default_out, environment,  # noqa: E402
                      figure, markdown_table, md_header, positive_int, prefix_outputs)

ROWS = {  # name: (attn_mode, autocast dtype or None, baseline row, all layers kept, label)
    "official-fp32": (None, None, "official-fp32", True, "official-equivalent FP32 (SDPA, all layers)"),
    "sdpa-fp32": (None, None, "sdpa-fp32", False, "SDPA-FP32 (efficient)"),
    "fp32": ("fp32", None, "sdpa-fp32", False, "visionattn fp32"),
    "tf32": ("tf32", None, "sdpa-fp32", False, "visionattn tf32"),
    "official-bf16": (None, torch.bfloat16, "official-bf16", True, "official-equivalent BF16 (SDPA, all layers)"),
    "sdpa-bf16": (None, torch.bfloat16, "sdpa-bf16", False, "SDPA-BF16 (autocast)"),
    "bf16": ("bf16", torch.bfloat16, "sdpa-bf16", False, "visionattn bf16 (autocast)"),
    "free-fp32": (None, None, "sdpa-fp32", False, "attention-free FP32 (bound)"),
    "free-bf16": (None, torch.bfloat16, "sdpa-bf16", False, "attention-free BF16 (bound)"),
}
FREE_ROWS = ("free-fp32", "free-bf16")
LABELS = {name: row[4] for name, row in ROWS.items()}
LONG_FRAMES = (10, 20, 50, 100, 200, 300, 400, 500, 600, 800, 1000, 1200, 1500, 2000)
MODELS = ("vggt", "fastvggt")

parser = ToolParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="models to run")
parser.add_argument("--rows", nargs="+", default=[r for r in ROWS if r not in FREE_ROWS], choices=list(ROWS),
                    help="attention rows: SDPA baselines and visionattn modes (default: all but the free-* rows)")
parser.add_argument("--frames", nargs="+", type=positive_int, default=[10, 50, 100, 200], help="frame counts")
parser.add_argument("--height", type=positive_int, default=392, help="image height (multiple of 14)")
parser.add_argument("--width", type=positive_int, default=518, help="image width (multiple of 14)")
parser.add_argument("--repeats", type=positive_int, default=1, help="timed runs per point (median reported)")
parser.add_argument("--no-point-warmup", action="store_true",
                    help="skip the untimed forward at each point's frame count (the first timed run then includes "
                         "kernel builds for new sequence lengths)")
parser.add_argument("--quick", action="store_true",
                    help="smoke test: frames 2 and 8 only (output prefix gets _quick when --out is default)")
parser.add_argument("--max-seconds", type=float, default=None,
                    help="skip larger frame counts of a row once one run took longer than this")
add_common(parser, out=default_out("vggt_bench"), seed=(0, "seed of weights and images"),
           device=("cuda", "cuda (peak = torch.cuda.max_memory_allocated) or cpu (peak = live tensor bytes)"))
parser.add_argument("--tiny", action="store_true", help="tiny random config (vggt_tiny_config, 56x70 images by "
                    "default) instead of VGGT-1B: a quick CPU check of the tool")
parser.add_argument("--long", action="store_true", help="long-sequence table: frames from 10 upwards (%s) up to "
                    "--max-frames, each row until its first OOM" % ", ".join(map(str, LONG_FRAMES)))
parser.add_argument("--max-frames", type=positive_int, default=None, help="largest frame count of --long")
parser.add_argument("--train-step", action="store_true", help="time and peak memory of one training step "
                    "(forward + backward) per row and frame count, activation checkpointing off and on")


def build(model: str, seed: int, device: str = "cuda", tiny: bool = False):
    """Random-weight VGGT-1B (no track head; ``tiny``: the tiny config) on ``device``; FastVGGT with merging."""
    from visionattn.models import FASTVGGT_MERGING, VGGT, vggt_tiny_config

    torch.manual_seed(seed)
    with torch.device(device):
        m = VGGT(**{**(vggt_tiny_config() if tiny else {}), "enable_track": False},
                 merging=FASTVGGT_MERGING if model == "fastvggt" else None)
    return m.eval()


def _setup(model, row: str, frames: int, H: int, W: int, seed: int):
    """Put ``model`` in ``row``'s mode; returns (device, the row's autocast, ``frames`` seeded random images)."""
    from visionattn.models.vggt import autocast

    mode, dt, _, keep_all, _ = ROWS[row]
    model.set_attn_mode(mode)
    model.keep_all_layers = keep_all
    dev = next(model.parameters()).device
    images = torch.rand(frames, 3, H, W, device=dev, generator=torch.Generator(device=dev).manual_seed(seed + frames))
    return dev, (lambda: autocast(dev.type, dt)), images


def _timed(fn, dev: torch.device) -> float:
    """Wall seconds of ``fn()`` between synchronisations."""
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def run_point(model, row: str, frames: int, H: int, W: int, repeats: int, seed: int, warmup: bool = False,
              measure: bool = True) -> dict:
    """``repeats`` forwards of ``frames`` random images: median time, peak memory (CUDA max allocated, or on the CPU
    the live tensor bytes, weights included; ``measure=False`` skips that slow count) and ``est_gb``
    (:meth:`VGGT.estimate_memory`). ``warmup``: one untimed forward first (kernels built for these lengths)."""
    from visionattn.models import LiveBytes

    dev, cast, images = _setup(model, row, frames, H, W, seed)
    free = attention_free() if row in FREE_ROWS else contextlib.nullcontext()
    if warmup:
        with torch.no_grad(), cast(), free:
            model(images)
    if row in FREE_ROWS:
        free.calls = 0  # count the timed forwards' calls only
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        base = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers(), images])
    peak, times, out = 0, [], {}

    def forward():
        with torch.no_grad(), cast(), meter, free:
            out["y"] = model(images)
    for _ in range(repeats):
        meter = LiveBytes(base) if dev.type != "cuda" and measure else contextlib.nullcontext()
        times.append(_timed(forward, dev))
        finite = bool(torch.isfinite(out.pop("y")["depth"]).all())
        peak = max(peak, meter.peak) if dev.type != "cuda" and measure else peak
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
    model.keep_all_layers = False
    t, gb = sorted(times)[len(times) // 2], 2 ** 30
    est = model.estimate_memory(frames, H, W, "fp32" if ROWS[row][1] is None else "bf16", keep_all_layers=ROWS[row][3])
    point = {"time_s": t, "time_per_frame_s": t / frames, "peak_gb": peak / gb, "extra_gb": (peak - base) / gb,
             "est_gb": est / gb, "finite": finite, "tokens_per_frame": 5 + (H // 14) * (W // 14)}
    if row in FREE_ROWS:
        point["sdpa_calls_per_forward"] = free.calls // repeats
    return point


def train_loss(out: dict) -> torch.Tensor:
    """The benchmark's training loss: mean log-depth + mean squared points + mean squared pose encoding."""
    return out["depth"].log().mean() + out["world_points"].square().mean() + out["pose_enc"].square().mean()


def run_train_point(model, row: str, frames: int, H: int, W: int, repeats: int, seed: int, ckpt: bool) -> dict:
    """``repeats`` timed training steps (forward + :func:`train_loss` + backward) after one untimed step: median
    time, peak memory (CUDA max allocated: weights, gradients, activations; None on the CPU)."""
    model.train().set_grad_checkpointing(ckpt)
    dev, cast, images = _setup(model, row, frames, H, W, seed)
    loss = []

    def step():
        model.zero_grad(set_to_none=True)
        with cast():
            value = train_loss(model(images))
        value.backward()
        loss[:] = [float(value.detach())]

    try:
        step()  # kernel builds for these sequence lengths, cuDNN plans
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        times = sorted(_timed(step, dev) for _ in range(repeats))
        peak = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else None
    finally:
        model.zero_grad(set_to_none=True)
        model.eval().set_grad_checkpointing(False)
        model.keep_all_layers = False
    return {"time_s": times[len(times) // 2], "peak_gb": peak, "loss": loss[0],
            "finite": bool(torch.isfinite(torch.tensor(loss[0])))}


def _f(x, fmt=".2f"):
    return "–" if x is None else format(x, fmt)


def to_markdown(res: dict) -> str:
    env = res.get("environment", {})
    what = " and ".join(w for w, key in (("inference", "points"), ("training step", "train")) if res.get(key))
    lines = md_header(f"VGGT / FastVGGT {what or 'inference'}: visionattn modes vs PyTorch SDPA", env,
                      f"GPU: {env.get('gpu')}; {env.get('date')}; the command: the last run's (runs merge into one "
                      "file)",
                      ("Tiny random config (tool check, not a result). " if res.get("tiny") else "") +
                      f"Random weights, camera + depth + point heads, images {res.get('height')}x{res.get('width')} "
                      f"({res.get('tokens_per_frame')} tokens per frame). Process TF32 flags left at defaults (matmul "
                      f"{env.get('allow_tf32_matmul')}, cudnn {env.get('allow_tf32_cudnn')}).")
    if res.get("points"):
        lines += ["Inference time: one forward (median of repeats) after a 2-frame warm-up and, unless "
                  "`--no-point-warmup`, one untimed forward at the same frame count; Mem: peak allocated (weights "
                  "included; on the CPU live tensor bytes); Est.: VGGT.estimate_memory. Official-equivalent rows: "
                  "SDPA with all 24 layer outputs held. Speedup vs the SDPA row of the same arithmetic (FP32/TF32 vs "
                  "SDPA-FP32, BF16 vs SDPA-BF16).", ""]
    for model, pts in ((m, res.get("points", {}).get(m)) for m in MODELS):
        if not pts:
            continue
        table = []
        for row in (r for r in ROWS if r in pts):
            for fr in sorted(pts[row], key=int):
                p, base = pts[row][fr], pts.get(ROWS[row][2], {}).get(fr)
                if p.get("oom"):
                    table.append([LABELS[row], fr, "OOM", "–", "OOM", _f(p.get("est_gb")), "–"])
                    continue
                sp = f"{base['time_s'] / p['time_s']:.2f}x" if base and not base.get("oom") else "–"
                table.append([LABELS[row], fr, _f(p["time_s"]), _f(p["time_s"] / int(fr), ".3f"), _f(p["peak_gb"]),
                              _f(p.get("est_gb")), sp + ("" if p.get("finite", True) else " (non-finite!)")])
        title = ("VGGT baseline (cf. ELSA supplement Table 3)" if model == "vggt"
                 else "FastVGGT, token merging (cf. ELSA supplement Table 4)")
        lines += [f"## {title}", "", markdown_table(table, ["Method", "Frames", "Time (s)", "s / frame", "Mem (GB)",
                                                            "Est. (GB)", "Speedup"])]
    for model, rows in res.get("train", {}).items():
        table = []
        for row in (r for r in ROWS if r in rows):
            for fr in sorted(rows[row], key=int):
                off, on = rows[row][fr].get("off"), rows[row][fr].get("on")
                ok = [p is not None and not p.get("oom") for p in (off, on)]
                cells = [c for p, good in zip((off, on), ok) for c in
                         ((_f(p["time_s"]), _f(p["peak_gb"])) if good else ("OOM", "OOM"))]
                ratio = f"{on['peak_gb'] / off['peak_gb']:.2f}" if all(ok) and off["peak_gb"] else "–"
                table.append([LABELS[row], fr, *cells, ratio])
        lines += [f"## {model}: one training step (forward + backward), activation checkpointing off / on", "",
                  "Train mode, loss = mean log-depth + mean squared points + mean squared pose, backward; no optimiser "
                  "step. Time: median of repeats after one untimed step. Mem: peak allocated (weights and gradients "
                  "included).", "", markdown_table(table, ["Method", "Frames", "Time (s)", "Mem (GB)", "Time, ckpt (s)",
                                                           "Mem, ckpt (GB)", "Mem ratio"])]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str, outputs) -> None:
    """PNG: time (s) and peak memory (GB) vs frames, one line per model and row (OOM points left out)."""
    with figure(path, outputs, 1, 2, figsize=(12, 4.5)) as (fig, (ax_t, ax_m)):
        for model, rows in res.get("points", {}).items():
            for row, pts in rows.items():
                fr = sorted((int(f), p) for f, p in pts.items() if not p.get("oom"))
                for ax, key in ((ax_t, "time_s"), (ax_m, "peak_gb")):
                    if fr:
                        ax.plot([f for f, _ in fr], [p[key] for _, p in fr], "--" if row.startswith("official")
                                else "-", marker="o", label=f"{model} {LABELS.get(row, row)}")
        for ax, name in ((ax_t, "time per forward (s)"), (ax_m, "peak memory (GB)")):
            ax.set(xlabel="frames", ylabel=name)
            ax.grid(alpha=0.3)
        ax_m.legend(fontsize=7)
        fig.suptitle(f"VGGT / FastVGGT inference vs frames, {res.get('height')}x{res.get('width')}, "
                     f"{res.get('environment', {}).get('gpu')}")


def main(args) -> dict:
    if args.height % 14 or args.width % 14:
        parser.error(f"--height {args.height} / --width {args.width} must be multiples of 14 (the patch size)")
    if args.quick and args.out == parser.get_default("out"):
        args.out += "_quick"
    # before reading an earlier result to extend: the files must be this tool's (exit 2 otherwise)
    outputs = prefix_outputs(parser, args.out, tool="bench_vggt")
    dev = check_device(parser, args.device)
    from tqdm import tqdm

    if args.tiny and args.height == parser.get_default("height") and args.width == parser.get_default("width"):
        args.height, args.width = 56, 70
    frames = [2, 8] if args.quick else args.frames
    if args.long:
        frames = [f for f in LONG_FRAMES if args.max_frames is None or f <= args.max_frames]
        if args.max_frames is not None and args.max_frames < LONG_FRAMES[0]:
            frames = [args.max_frames]
    path, H, W = args.out + ".json", args.height, args.width
    res = json.load(open(path)) if os.path.isfile(path) else {}
    res.update({"environment": environment({
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}), "height": H, "width": W, "tiny": args.tiny,
        "tokens_per_frame": 5 + (H // 14) * (W // 14)})
    res.setdefault("points", {})
    print(json.dumps(res["environment"]), flush=True)

    def save():
        outputs.write_json(path, res, indent=1)
        outputs.write_text(args.out + ".md", to_markdown(res))
        if res["points"]:  # the PNG plots inference points
            plot(res, args.out + ".png", outputs)

    for name in args.models:
        model = build(name, args.seed, args.device, args.tiny)
        pts = res.setdefault("train" if args.train_step else "points", {}).setdefault(name, {})
        for row in args.rows:
            if not args.train_step:
                run_point(model, row, 2, H, W, 1, args.seed, measure=False)  # warm-up / autotune
            skip = False
            for fr in frames if args.train_step else tqdm(frames, desc=f"{name} {row}"):
                for ckpt in ((False, True) if args.train_step else (None,)):
                    if skip:  # a smaller count ran out of memory or over --max-seconds
                        continue
                    try:
                        p = (run_train_point(model, row, fr, H, W, args.repeats, args.seed, ckpt) if args.train_step
                             else run_point(model, row, fr, H, W, args.repeats, args.seed, not args.no_point_warmup))
                    except (torch.cuda.OutOfMemoryError, MemoryError):
                        model.keep_all_layers = False
                        p = {"oom": True}
                        if not args.train_step:
                            p["est_gb"] = model.estimate_memory(fr, H, W, "fp32" if ROWS[row][1] is None else
                                                                "bf16", keep_all_layers=ROWS[row][3]) / 2 ** 30
                            skip = True
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()
                    if args.train_step:
                        pts.setdefault(row, {}).setdefault(str(fr), {})["on" if ckpt else "off"] = p
                    else:
                        pts.setdefault(row, {})[str(fr)] = p
                        skip = skip or bool(args.max_seconds and p.get("time_s", 0) > args.max_seconds)
                    print(name, row, fr, {None: "", False: "no-ckpt", True: "ckpt"}[ckpt], json.dumps(p), flush=True)
                    save()
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save()
    return res


if __name__ == "__main__":
    main(parser.parse_args())
