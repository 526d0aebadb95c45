"""Time and peak memory of VGGT / FastVGGT inference per attention mode vs PyTorch SDPA.

Random-weight VGGT-1B (camera, depth and point heads; FastVGGT additionally
with token merging), images 392x518 (1,041 tokens per frame), layout of the
ELSA supplement's Tables 3-4 (Method | Frames | Time (s) | Mem (GB) | Speedup).
Speedup is against the SDPA row of the same arithmetic: FP32 / TF32 rows vs
``SDPA-FP32`` (PyTorch picks its memory-efficient kernel for FP32 CUDA inputs),
BF16 rows vs ``SDPA-BF16`` (flash). BF16 rows run the model under bf16 autocast
as the official demo does (weights FP32, heads FP32).

Results merge into ``<out>.json`` (so a sweep can be split over several calls:
``--models``, ``--rows``, ``--frames``) and ``<out>.md`` is rewritten from it.

    python tools/bench_vggt.py --quick                       # smoke test, a minute
    python tools/bench_vggt.py --models vggt --frames 10 50 100
    python tools/bench_vggt.py --models fastvggt --rows bf16 sdpa-bf16 --frames 200 500
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from visionattn import reporting

ROWS = {  # name: (attn_mode, autocast dtype or None, baseline row)
    "sdpa-fp32": (None, None, "sdpa-fp32"),
    "fp32": ("fp32", None, "sdpa-fp32"),
    "tf32": ("tf32", None, "sdpa-fp32"),
    "sdpa-bf16": (None, torch.bfloat16, "sdpa-bf16"),
    "bf16": ("bf16", torch.bfloat16, "sdpa-bf16"),
}
LABELS = {"sdpa-fp32": "SDPA-FP32 (efficient)", "fp32": "visionattn fp32", "tf32": "visionattn tf32",
          "sdpa-bf16": "SDPA-BF16 (autocast)", "bf16": "visionattn bf16 (autocast)"}
MODELS = ("vggt", "fastvggt")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="models to run")
parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                    help="attention rows: SDPA baselines and visionattn modes")
parser.add_argument("--frames", nargs="+", type=int, default=[10, 50, 100, 200], help="frame counts")
parser.add_argument("--height", type=int, default=392, help="image height (multiple of 14)")
parser.add_argument("--width", type=int, default=518, help="image width (multiple of 14)")
parser.add_argument("--repeats", type=int, default=1, help="timed runs per point (median reported)")
parser.add_argument("--no-point-warmup", action="store_true",
                    help="skip the untimed forward at each point's frame count (faster; the first timed run then "
                         "includes kernel builds for new sequence lengths)")
parser.add_argument("--quick", action="store_true", help="smoke test: frames 2 and 8 only (output prefix gets _quick when --out is default)")
parser.add_argument("--max-seconds", type=float, default=None,
                    help="skip larger frame counts of a row once one run took longer than this")
parser.add_argument("--out", default="docs/benchmarks/vggt_bench", help="output prefix (.json and .md)")
parser.add_argument("--seed", type=int, default=0, help="seed of weights and images")


def environment() -> dict:
    """visionattn.reporting.environment() plus this tool's keys (gpu, process TF32 flags, date)."""
    return reporting.environment({
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")})


def build(model: str, seed: int):
    """Random-weight VGGT-1B (no track head) on the GPU; FastVGGT with default merging."""
    from visionattn.models import FASTVGGT_MERGING, VGGT

    torch.manual_seed(seed)
    with torch.device("cuda"):
        m = VGGT(enable_track=False, merging=FASTVGGT_MERGING if model == "fastvggt" else None)
    return m.eval()


def run_point(model, row: str, frames: int, H: int, W: int, repeats: int, seed: int, warmup: bool = False) -> dict:
    """One timed point: ``repeats`` forwards of ``frames`` random images; median time, peak memory. ``warmup``:
    one untimed forward first (kernels built for these sequence lengths: the Hopper fp16 / bf16 kernel has one
    build per size of the last key tile, cuDNN one plan per shape)."""
    from visionattn.models.vggt import autocast

    mode, dt, _ = ROWS[row]
    model.set_attn_mode(mode)
    g = torch.Generator(device="cuda").manual_seed(seed + frames)
    images = torch.rand(frames, 3, H, W, device="cuda", generator=g)
    times = []
    if warmup:
        with torch.no_grad(), autocast("cuda", dt):
            model(images)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), autocast("cuda", dt):
            out = model(images)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        finite = bool(torch.isfinite(out["depth"]).all())
        del out
    peak = torch.cuda.max_memory_allocated()
    times.sort()
    return {"time_s": times[len(times) // 2], "peak_gb": peak / 2 ** 30, "extra_gb": (peak - base) / 2 ** 30,
            "finite": finite, "tokens_per_frame": 5 + (H // 14) * (W // 14)}


def to_markdown(res: dict) -> str:
    env = res.get("environment", {})
    lines = ["# VGGT / FastVGGT inference: visionattn modes vs PyTorch SDPA", "",
             f"GPU: {env.get('gpu')}; torch {env.get('torch')}, triton {env.get('triton')}, timm {env.get('timm')}; "
             f"{env.get('date')}.", f"Command (last run): `{env.get('command')}`", "",
             "Random weights, camera + depth + point heads, images "
             f"{res.get('height')}x{res.get('width')} ({res.get('tokens_per_frame')} tokens per frame). Time: one "
             "forward (median of repeats) after a 2-frame warm-up and, unless `--no-point-warmup`, one untimed forward "
             "at the same frame count; Mem: peak allocated (weights included). "
             "Speedup vs the SDPA row of the same arithmetic (FP32/TF32 vs SDPA-FP32, BF16 vs SDPA-BF16). "
             f"Process TF32 flags left at defaults (matmul {env.get('allow_tf32_matmul')}, cudnn "
             f"{env.get('allow_tf32_cudnn')}).", ""]
    for model in MODELS:
        pts = res.get("points", {}).get(model)
        if not pts:
            continue
        title = "VGGT baseline (cf. ELSA supplement Table 3)" if model == "vggt" else \
            "FastVGGT, token merging (cf. ELSA supplement Table 4)"
        lines += [f"## {title}", "", "| Method | Frames | Time (s) | Mem (GB) | Speedup |", "|---|---:|---:|---:|---:|"]
        for row in ROWS:
            if row not in pts:
                continue
            for fr in sorted(pts[row], key=int):
                p = pts[row][fr]
                if p.get("oom"):
                    lines.append(f"| {LABELS[row]} | {fr} | OOM | OOM | – |")
                    continue
                base = pts.get(ROWS[row][2], {}).get(fr)
                sp = f"{base['time_s'] / p['time_s']:.2f}x" if base and not base.get("oom") else "–"
                flag = "" if p.get("finite", True) else " (non-finite!)"
                lines.append(f"| {LABELS[row]} | {fr} | {p['time_s']:.2f} | {p['peak_gb']:.2f} | {sp}{flag} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench_vggt.py needs a CUDA GPU")
    from tqdm import tqdm

    frames = [2, 8] if args.quick else args.frames
    if args.quick and args.out == parser.get_default("out"):
        args.out += "_quick"
    path = args.out + ".json"
    res = json.load(open(path)) if os.path.isfile(path) else {}
    res.update({"environment": environment(), "height": args.height, "width": args.width,
                "tokens_per_frame": 5 + (args.height // 14) * (args.width // 14)})
    res.setdefault("points", {})
    print(json.dumps(res["environment"]), flush=True)
    for name in args.models:
        model = build(name, args.seed)
        pts = res["points"].setdefault(name, {})
        for row in args.rows:
            run_point(model, row, 2, args.height, args.width, 1, args.seed)  # warm-up / autotune
            skip = False
            for fr in tqdm(frames, desc=f"{name} {row}"):
                if skip:  # a smaller count ran out of memory or over --max-seconds
                    continue
                try:
                    p = run_point(model, row, fr, args.height, args.width, args.repeats, args.seed,
                                  warmup=not args.no_point_warmup)
                except torch.cuda.OutOfMemoryError:
                    p = {"oom": True}
                    skip = True
                    torch.cuda.empty_cache()
                pts.setdefault(row, {})[str(fr)] = p
                print(name, row, fr, json.dumps(p), flush=True)
                if args.max_seconds and p.get("time_s", 0) > args.max_seconds:
                    skip = True
                reporting.write_json_atomic(path, res, indent=1)
                reporting.write_text_atomic(args.out + ".md", to_markdown(res))
        del model
        torch.cuda.empty_cache()
    reporting.write_json_atomic(path, res, indent=1)
    reporting.write_text_atomic(args.out + ".md", to_markdown(res))
    return res


if __name__ == "__main__":
    main(parser.parse_args())
