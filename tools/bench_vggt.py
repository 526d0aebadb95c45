"""Time and peak memory of VGGT / FastVGGT inference per attention mode vs PyTorch SDPA.

Random-weight VGGT-1B (camera, depth and point heads; FastVGGT additionally
with token merging), images 392x518 (1,041 tokens per frame), layout of the
ELSA supplement's Tables 3-4 (Method | Frames | Time (s) | Mem (GB) | Speedup).
Speedup is against the SDPA row of the same arithmetic: FP32 / TF32 rows vs
``SDPA-FP32`` (PyTorch picks its memory-efficient kernel for FP32 CUDA inputs),
BF16 rows vs ``SDPA-BF16`` (flash). BF16 rows run the model under bf16 autocast
as the official demo does (weights FP32, heads FP32).

The ``official-*`` rows are the official model's equivalent: PyTorch SDPA
(``attn_mode=None``) with all 24 aggregator layers held until the heads finish
(``keep_all_layers=True``); every other row keeps only the layers the heads read.
``--long`` runs the long-sequence table: frames from 10 up to the most that fit
(each row stops at its first out-of-memory, recorded as OOM), with the memory
model's estimate (:meth:`VGGT.estimate_memory`) beside the measured peak and a
PNG of time and peak memory vs frames. Times are eager (one forward, synchronised).

The ``free-*`` rows (not run unless named) time the SDPA rows' model with every SDPA call answering a copy of
its value rows (:func:`_harness.attention_free`): the forward without its attention. Their speedup
is the most any attention kernel can give that row (Amdahl's law).

``--train-step`` times one training step instead (train mode, forward + a loss over depth, points
and pose + backward; no optimiser) with activation checkpointing off and on
(:meth:`VGGT.set_grad_checkpointing`): time and peak memory (weights and gradients included).

Results merge into ``<out>.json`` (so a sweep can be split over several calls:
``--models``, ``--rows``, ``--frames``) and ``<out>.md`` / ``<out>.png`` are rewritten from it.

    python tools/bench_vggt.py --quick                       # smoke test, a minute
    python tools/bench_vggt.py --models vggt --frames 10 50 100
    python tools/bench_vggt.py --models fastvggt --rows bf16 sdpa-bf16 --frames 200 500
    python tools/bench_vggt.py --long --out docs/benchmarks/vggt_long   # 10 .. OOM, both models, all rows
    python tools/bench_vggt.py --tiny --device cpu --long --max-frames 8 --out /tmp/vggt_tiny  # CPU check
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
from _harness import (OutputFiles, ToolParser, attention_free, check_device, check_output, default_out,  # noqa: E402
                      environment, figure, output_files, positive_int)

ROWS = {  # name: (attn_mode, autocast dtype or None, baseline row, all layers kept)
    "official-fp32": (None, None, "official-fp32", True),
    "sdpa-fp32": (None, None, "sdpa-fp32", False),
    "fp32": ("fp32", None, "sdpa-fp32", False),
    "tf32": ("tf32", None, "sdpa-fp32", False),
    "official-bf16": (None, torch.bfloat16, "official-bf16", True),
    "sdpa-bf16": (None, torch.bfloat16, "sdpa-bf16", False),
    "bf16": ("bf16", torch.bfloat16, "sdpa-bf16", False),
    "free-fp32": (None, None, "sdpa-fp32", False),
    "free-bf16": (None, torch.bfloat16, "sdpa-bf16", False),
}
FREE_ROWS = ("free-fp32", "free-bf16")  # SDPA answering without attention: the Amdahl bound of the row's speedup
LABELS = {"official-fp32": "official-equivalent FP32 (SDPA, all layers)", "sdpa-fp32": "SDPA-FP32 (efficient)",
          "fp32": "visionattn fp32", "tf32": "visionattn tf32",
          "official-bf16": "official-equivalent BF16 (SDPA, all layers)", "sdpa-bf16": "SDPA-BF16 (autocast)",
          "bf16": "visionattn bf16 (autocast)", "free-fp32": "attention-free FP32 (bound)",
          "free-bf16": "attention-free BF16 (bound)"}
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
                    help="skip the untimed forward at each point's frame count (faster; the first timed run then "
                         "includes kernel builds for new sequence lengths)")
parser.add_argument("--quick", action="store_true",
                    help="smoke test: frames 2 and 8 only (output prefix gets _quick when --out is default)")
parser.add_argument("--max-seconds", type=float, default=None,
                    help="skip larger frame counts of a row once one run took longer than this")
parser.add_argument("--out", default=default_out("vggt_bench"), help="output prefix (.json, .md and .png) "
                    "(default: %(default)s)")
parser.add_argument("--seed", type=int, default=0, help="seed of weights and images")
parser.add_argument("--device", default="cuda", help="cuda (peak = torch.cuda.max_memory_allocated) or cpu (peak = "
                    "live tensor bytes, visionattn.models.LiveBytes)")
parser.add_argument("--tiny", action="store_true", help="tiny random config (vggt_tiny_config, 56x70 images by "
                    "default) instead of VGGT-1B: a quick CPU check of the tool")
parser.add_argument("--long", action="store_true", help="long-sequence table: frames from 10 upwards (%s) up to "
                    "--max-frames, each row until its first OOM" % ", ".join(map(str, LONG_FRAMES)))
parser.add_argument("--max-frames", type=positive_int, default=None, help="largest frame count of --long")
parser.add_argument("--train-step", action="store_true", help="time and peak memory of one training step "
                    "(forward + backward) per row and frame count, activation checkpointing off and on")


def tool_environment() -> dict:
    """:func:`_harness.environment` plus this tool's keys (gpu, process TF32 flags, date)."""
    return environment({
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")})


def build(model: str, seed: int, device: str = "cuda", tiny: bool = False):
    """Random-weight VGGT-1B (no track head; ``tiny``: the tiny config) on ``device``; FastVGGT with merging."""
    from visionattn.models import FASTVGGT_MERGING, VGGT, vggt_tiny_config

    torch.manual_seed(seed)
    cfg = vggt_tiny_config() if tiny else {}
    with torch.device(device):
        m = VGGT(**{**cfg, "enable_track": False}, merging=FASTVGGT_MERGING if model == "fastvggt" else None)
    return m.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_point(model, row: str, frames: int, H: int, W: int, repeats: int, seed: int, warmup: bool = False,
              measure: bool = True) -> dict:
    """One timed point: ``repeats`` forwards of ``frames`` random images; median time, peak memory. ``warmup``:
    one untimed forward first (kernels built for these sequence lengths: the Hopper fp16 / bf16 kernel has one
    build per size of the last key tile, cuDNN one plan per shape). Peak: CUDA max allocated, or on the CPU the
    live tensor bytes (weights included; ``measure=False`` skips that slow count). ``est_gb``:
    :meth:`VGGT.estimate_memory` for the same point."""
    from visionattn.models import LiveBytes
    from visionattn.models.vggt import autocast

    mode, dt, _, keep_all = ROWS[row]
    model.set_attn_mode(mode)
    model.keep_all_layers = keep_all
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed + frames)
    images = torch.rand(frames, 3, H, W, device=dev, generator=g)
    times = []
    free = attention_free() if row in FREE_ROWS else contextlib.nullcontext()
    if warmup:
        with torch.no_grad(), autocast(dev.type, dt), free:
            model(images)
    if row in FREE_ROWS:
        free.calls = 0  # count the timed forwards' calls only
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        base = weights + images.numel() * images.element_size()
    peak = 0
    for _ in range(repeats):
        _sync(dev)
        meter = LiveBytes(base) if dev.type != "cuda" and measure else contextlib.nullcontext()
        t0 = time.perf_counter()
        with torch.no_grad(), autocast(dev.type, dt), meter, free:
            out = model(images)
        _sync(dev)
        times.append(time.perf_counter() - t0)
        finite = bool(torch.isfinite(out["depth"]).all())
        del out
        if dev.type != "cuda" and measure:
            peak = max(peak, meter.peak)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
    model.keep_all_layers = False
    times.sort()
    est = model.estimate_memory(frames, H, W, "fp32" if dt is None else "bf16", keep_all_layers=keep_all)
    point = {"time_s": times[len(times) // 2], "time_per_frame_s": times[len(times) // 2] / frames,
             "peak_gb": peak / 2 ** 30, "extra_gb": (peak - base) / 2 ** 30, "est_gb": est / 2 ** 30,
             "finite": finite, "tokens_per_frame": 5 + (H // 14) * (W // 14)}
    if row in FREE_ROWS:
        point["sdpa_calls_per_forward"] = free.calls // repeats
    return point


def train_loss(out: dict) -> torch.Tensor:
    """The benchmark's training loss: mean log-depth + mean squared points + mean squared pose encoding."""
    return out["depth"].log().mean() + out["world_points"].square().mean() + out["pose_enc"].square().mean()


def run_train_point(model, row: str, frames: int, H: int, W: int, repeats: int, seed: int, ckpt: bool) -> dict:
    """One training-step point: ``repeats`` timed steps (forward + :func:`train_loss` + backward) after one
    untimed step; median time, peak memory (CUDA max allocated: weights, gradients, activations; None on
    the CPU, where it is not measured)."""
    from visionattn.models.vggt import autocast

    mode, dt, _, keep_all = ROWS[row]
    model.train().set_attn_mode(mode).set_grad_checkpointing(ckpt)
    model.keep_all_layers = keep_all
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed + frames)
    images = torch.rand(frames, 3, H, W, device=dev, generator=g)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        with autocast(dev.type, dt):
            loss = train_loss(model(images))
        loss.backward()
        return float(loss.detach())

    try:
        step()  # kernel builds for these sequence lengths, cuDNN plans
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        times = []
        for _ in range(repeats):
            _sync(dev)
            t0 = time.perf_counter()
            loss = step()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else None
    finally:
        model.zero_grad(set_to_none=True)
        model.eval().set_grad_checkpointing(False)
        model.keep_all_layers = False
    times.sort()
    return {"time_s": times[len(times) // 2], "peak_gb": peak, "loss": loss,
            "finite": bool(torch.isfinite(torch.tensor(loss)))}


def to_markdown(res: dict) -> str:
    env = res.get("environment", {})
    what = " and ".join(w for w, key in (("inference", "points"), ("training step", "train")) if res.get(key))
    lines = [f"# VGGT / FastVGGT {what or 'inference'}: visionattn modes vs PyTorch SDPA", "",
             f"GPU: {env.get('gpu')}; torch {env.get('torch')}, triton {env.get('triton')}, timm {env.get('timm')}; "
             f"{env.get('date')}.", f"Command (last run): `{env.get('command')}`", "",
             ("Tiny random config (tool check, not a result). " if res.get("tiny") else "") +
             "Random weights, camera + depth + point heads, images "
             f"{res.get('height')}x{res.get('width')} ({res.get('tokens_per_frame')} tokens per frame). "
             f"Process TF32 flags left at defaults (matmul {env.get('allow_tf32_matmul')}, cudnn "
             f"{env.get('allow_tf32_cudnn')}).", ""]
    if res.get("points"):
        lines += ["Inference time: one forward (median of repeats) after a 2-frame warm-up and, unless "
                  "`--no-point-warmup`, one untimed forward at the same frame count; Mem: peak allocated (weights "
                  "included; on the CPU live tensor bytes); Est.: VGGT.estimate_memory. Official-equivalent rows: SDPA "
                  "with all 24 layer outputs held. Speedup vs the SDPA row of the same arithmetic (FP32/TF32 vs "
                  "SDPA-FP32, BF16 vs SDPA-BF16).", ""]
    for model in MODELS:
        pts = res.get("points", {}).get(model)
        if not pts:
            continue
        title = "VGGT baseline (cf. ELSA supplement Table 3)" if model == "vggt" else \
            "FastVGGT, token merging (cf. ELSA supplement Table 4)"
        lines += [f"## {title}", "", "| Method | Frames | Time (s) | s / frame | Mem (GB) | Est. (GB) | Speedup |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for row in ROWS:
            if row not in pts:
                continue
            for fr in sorted(pts[row], key=int):
                p = pts[row][fr]
                if p.get("oom"):
                    est = f"{p['est_gb']:.2f}" if "est_gb" in p else "–"
                    lines.append(f"| {LABELS[row]} | {fr} | OOM | – | OOM | {est} | – |")
                    continue
                base = pts.get(ROWS[row][2], {}).get(fr)
                sp = f"{base['time_s'] / p['time_s']:.2f}x" if base and not base.get("oom") else "–"
                flag = "" if p.get("finite", True) else " (non-finite!)"
                est = f"{p['est_gb']:.2f}" if "est_gb" in p else "–"
                lines.append(f"| {LABELS[row]} | {fr} | {p['time_s']:.2f} | {p['time_s'] / int(fr):.3f} | "
                             f"{p['peak_gb']:.2f} | {est} | {sp}{flag} |")
        lines.append("")
    for model, rows in res.get("train", {}).items():
        lines += [f"## {model}: one training step (forward + backward), activation checkpointing off / on", "",
                  "Train mode, loss = mean log-depth + mean squared points + mean squared pose, backward; no optimiser "
                  "step. Time: median of repeats after one untimed step. Mem: peak allocated (weights and gradients "
                  "included).", "",
                  "| Method | Frames | Time (s) | Mem (GB) | Time, ckpt (s) | Mem, ckpt (GB) | Mem ratio |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for row in ROWS:
            for fr in sorted(rows.get(row, {}), key=int):
                off, on = rows[row][fr].get("off"), rows[row][fr].get("on")
                ok = [p is not None and not p.get("oom") for p in (off, on)]
                cells = [(f"{p['time_s']:.2f}", "–" if p["peak_gb"] is None else f"{p['peak_gb']:.2f}") if good
                         else ("OOM", "OOM") for p, good in zip((off, on), ok)]
                ratio = f"{on['peak_gb'] / off['peak_gb']:.2f}" if all(ok) and off["peak_gb"] else "–"
                lines.append(f"| {LABELS[row]} | {fr} | {cells[0][0]} | {cells[0][1]} | {cells[1][0]} | "
                             f"{cells[1][1]} | {ratio} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str, outputs: OutputFiles | None = None) -> None:
    """PNG: time (s) and peak memory (GB) vs frames, one line per model and row (OOM points left out)."""
    with figure(path, outputs, 1, 2, figsize=(12, 4.5), tool="bench_vggt") as (fig, (ax_t, ax_m)):
        for model, rows in res.get("points", {}).items():
            for row, pts in rows.items():
                fr = sorted((int(f), p) for f, p in pts.items() if not p.get("oom"))
                if not fr:
                    continue
                style = "--" if row.startswith("official") else "-"
                label = f"{model} {LABELS.get(row, row)}"
                ax_t.plot([f for f, _ in fr], [p["time_s"] for _, p in fr], style, marker="o", label=label)
                ax_m.plot([f for f, _ in fr], [p["peak_gb"] for _, p in fr], style, marker="o", label=label)
        env = res.get("environment", {})
        for ax, name in ((ax_t, "time per forward (s)"), (ax_m, "peak memory (GB)")):
            ax.set_xlabel("frames")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        ax_m.legend(fontsize=7)
        fig.suptitle(f"VGGT / FastVGGT inference vs frames, {res.get('height')}x{res.get('width')}, {env.get('gpu')}")


def main(args) -> dict:
    if args.height % 14 or args.width % 14:
        parser.error(f"--height {args.height} / --width {args.width} must be multiples of 14 (the patch size)")
    check_output(parser, args.out)
    dev = check_device(parser, args.device)
    from tqdm import tqdm

    if args.tiny and args.height == parser.get_default("height") and args.width == parser.get_default("width"):
        args.height, args.width = 56, 70
    if args.long:
        frames = [f for f in LONG_FRAMES if args.max_frames is None or f <= args.max_frames]
        if args.max_frames is not None and args.max_frames not in frames and args.max_frames < LONG_FRAMES[0]:
            frames = [args.max_frames]
    else:
        frames = [2, 8] if args.quick else args.frames
    if args.quick and args.out == parser.get_default("out"):
        args.out += "_quick"
    path = args.out + ".json"
    # before reading an earlier result to extend: the files must be this tool's (exit 2 otherwise)
    outputs = output_files(parser, [path, args.out + ".md", args.out + ".png"], tool="bench_vggt")
    res = json.load(open(path)) if os.path.isfile(path) else {}
    res.update({"environment": tool_environment(), "height": args.height, "width": args.width, "tiny": args.tiny,
                "tokens_per_frame": 5 + (args.height // 14) * (args.width // 14)})
    res.setdefault("points", {})
    print(json.dumps(res["environment"]), flush=True)

    def save():
        outputs.write_json(path, res, indent=1)
        outputs.write_text(args.out + ".md", to_markdown(res))
        if res["points"]:  # the PNG plots inference points
            plot(res, args.out + ".png", outputs)

    if args.train_step:
        for name in args.models:
            model = build(name, args.seed, args.device, args.tiny)
            pts = res.setdefault("train", {}).setdefault(name, {})
            for row in args.rows:
                for fr in frames:
                    for ckpt in (False, True):
                        try:
                            p = run_train_point(model, row, fr, args.height, args.width, args.repeats, args.seed, ckpt)
                        except (torch.cuda.OutOfMemoryError, MemoryError):
                            p = {"oom": True}
                            if dev.type == "cuda":
                                torch.cuda.empty_cache()
                        pts.setdefault(row, {}).setdefault(str(fr), {})["on" if ckpt else "off"] = p
                        print(name, row, fr, "ckpt" if ckpt else "no-ckpt", json.dumps(p), flush=True)
                        save()
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        return res

    for name in args.models:
        model = build(name, args.seed, args.device, args.tiny)
        pts = res["points"].setdefault(name, {})
        for row in args.rows:
            run_point(model, row, 2, args.height, args.width, 1, args.seed, measure=False)  # warm-up / autotune
            skip = False
            for fr in tqdm(frames, desc=f"{name} {row}"):
                if skip:  # a smaller count ran out of memory or over --max-seconds
                    continue
                try:
                    p = run_point(model, row, fr, args.height, args.width, args.repeats, args.seed,
                                  warmup=not args.no_point_warmup)
                except (torch.cuda.OutOfMemoryError, MemoryError):
                    model.keep_all_layers = False
                    est = model.estimate_memory(fr, args.height, args.width,
                                                "fp32" if ROWS[row][1] is None else "bf16",
                                                keep_all_layers=ROWS[row][3])
                    p = {"oom": True, "est_gb": est / 2 ** 30}
                    skip = True
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                pts.setdefault(row, {})[str(fr)] = p
                print(name, row, fr, json.dumps(p), flush=True)
                if args.max_seconds and p.get("time_s", 0) > args.max_seconds:
                    skip = True
                save()
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save()
    return res


if __name__ == "__main__":
    main(parser.parse_args())
