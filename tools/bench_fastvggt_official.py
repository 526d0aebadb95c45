"""FastVGGT inference against the official FastVGGT code: same random weights, same process, same frames.

The official code (mystorm16/FastVGGT) is not a dependency and is not shipped here: pass a local checkout with
``--official`` (the folder holding its ``vggt/`` and ``merging/`` packages; it needs matplotlib, Pillow and
tqdm). Protocol:

* the official ``VGGT(merging=0, enable_point=False, enable_track=False)`` is built with seed 0 (merging from
  global block 0, as its demos run), and its weights are loaded into
  ``visionattn.models.VGGT(enable_point=False, enable_track=False, merging=FASTVGGT_MERGING)`` (strict);
* every row runs under bf16 autocast with FP32 weights, TF32 off for matmuls and convolutions (the issue's
  protocol; the official demos also cast the weights to bf16, which neither side does here);
* rows: ``official`` (its heads run under the autocast: it drops VGGT's FP32 guard around them);
  ``sdpa`` (visionattn's FastVGGT on PyTorch SDPA, heads in bf16 as the official code runs them);
  ``bf16`` (the same with visionattn's bf16 attention); ``free`` (the ``sdpa`` row with every SDPA call
  answering its value rows, :func:`_harness.attention_free`: the model without its attention, the
  bound of any attention kernel); ``--fp32-heads`` adds the ``bf16`` row with VGGT's FP32 heads;
* per frame count, in that order, each row on the GPU alone (the others wait on the CPU): one untimed forward,
  then ``--repeats`` timed forwards (:func:`_harness.call_ms`: CUDA events, median); peak = max
  allocated of the timed forwards; random frames in [0, 1] of ``--height`` x ``--width`` (FastVGGT's merging is
  data-dependent; both sides see the same frames);
* agreement: depth rel L2 of each visionattn row against the official one at the smallest frame count.

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (time per frame and speed-up vs frames).

    python tools/bench_fastvggt_official.py --official ~/src/FastVGGT --frames 100 200 500 --out out/fastvggt_official
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers

from _harness import (OutputFiles, ToolParser, attention_free, check_device, check_output, default_out,  # noqa: E402
                      environment, figure, output_files, positive_int, sample_ms, tf32_disabled)

from visionattn.metrics import rel_l2  # noqa: E402

ROWS = {  # name: (label, visionattn attn_mode, heads_dtype, attention-free)
    "official": ("official FastVGGT code (heads under the bf16 autocast)", None, None, False),
    "sdpa": ("visionattn FastVGGT, PyTorch SDPA attention, bf16 heads", None, "bf16", False),
    "bf16": ("visionattn FastVGGT, visionattn bf16 attention, bf16 heads", "bf16", "bf16", False),
    "free": ("visionattn FastVGGT, attention-free (bound), bf16 heads", None, "bf16", True),
    "bf16-fp32-heads": ("visionattn FastVGGT, visionattn bf16 attention, FP32 heads", "bf16", "fp32", False),
}
TARGET = 1.3  # visionattn's FastVGGT vs the official code, at every frame count

parser = ToolParser(prog="bench_fastvggt_official.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
parser.add_argument("--official", required=True,
                    help="local checkout of the official FastVGGT code (holds vggt/ and merging/)")
parser.add_argument("--frames", nargs="+", type=positive_int, default=[100, 200, 500], help="frame counts")
parser.add_argument("--height", type=positive_int, default=392, help="frame height, a multiple of 14")
parser.add_argument("--width", type=positive_int, default=518, help="frame width, a multiple of 14")
parser.add_argument("--repeats", type=positive_int, default=1, help="timed forwards per point (median)")
parser.add_argument("--fp32-heads", action="store_true", help="add the bf16 row with VGGT's FP32 heads")
parser.add_argument("--tiny", action="store_true",
                    help="visionattn's tiny VGGT config on both sides, passed to the checkout's VGGT as keywords "
                         "(a stand-in checkout that accepts them; a tool check, not a result)")
parser.add_argument("--device", default="cuda", help="cuda, or cpu for a tool check (default: %(default)s)")
parser.add_argument("--out", default=default_out("fastvggt_official"), help="output prefix (.json, .md, .png)")


def import_official(path: str):
    """The official ``VGGT`` class from the checkout at ``path``; exits 2 naming what is missing."""
    path = os.path.abspath(os.path.expanduser(path))
    for part in ("vggt/models/vggt.py", "merging/merge.py"):
        if not os.path.isfile(os.path.join(path, part)):
            parser.error(f"--official {path}: no {part} there (pass the FastVGGT checkout's root folder)")
    sys.path.insert(0, path)
    try:
        from vggt.models.vggt import VGGT
    except ImportError as err:
        parser.error(f"--official {path}: its code does not import here ({err}); it needs matplotlib, Pillow, tqdm")
    return VGGT


def run_row(model, row: str, images: torch.Tensor, repeats: int, device: torch.device) -> tuple[dict, torch.Tensor]:
    """Time one row at one frame count (the model moved to ``device`` and back); returns (point, depth)."""
    from visionattn.models.vggt import autocast

    _, mode, heads, free = ROWS[row]
    if row != "official":
        model.set_attn_mode(mode)
        model.heads_dtype = heads
    model.to(device)
    context = attention_free if free else contextlib.nullcontext
    last: dict = {}

    def forward():
        last.clear()  # the previous output goes before the next forward, as in a loop over batches
        last["out"] = model(images)

    try:
        with torch.no_grad(), autocast(device.type, torch.bfloat16), context():
            forward()  # untimed: kernel builds, cuDNN plans
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times = [ms / 1e3 for ms in sample_ms(forward, device, warmup=0, reps=repeats)]
        depth = last.pop("out")["depth"].float().cpu()
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    finally:
        model.to("cpu")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    times.sort()
    t = times[len(times) // 2]
    return {"row": row, "frames": images.shape[0], "time_s": t, "s_per_frame": t / images.shape[0],
            "times_s": times, "peak_gb": peak, "finite": bool(torch.isfinite(depth).all())}, depth


def to_markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"# FastVGGT: visionattn vs the official FastVGGT code, same random weights: {env['device']}", "",
             f"* command: `{env['command']}`",
             f"* torch {env['torch']}, triton {env.get('triton')}, python {env['python']}; official code: "
             f"{res['official']}",
             "* protocol: both models in one process, the official one built with seed 0 (point and track heads "
             "off, merging from global block 0), its weights loaded into visionattn's FastVGGT (strict); bf16 "
             "autocast with FP32 weights, TF32 off for matmuls and convolutions; per frame count each row alone "
             "on the GPU: one untimed forward, then the median of the timed ones (CUDA events); "
             f"{res['height']}x{res['width']} random frames; peak = max allocated of the timed forwards",
             "* attention-free: the SDPA row with every SDPA call answering its value rows: the time without "
             "attention, the most any attention kernel can give (Amdahl's law)", ""]
    if res.get("agreement"):
        lines += ["Depth rel L2 against the official row at "
                  f"{res['agreement']['frames']} frames: " + ", ".join(
                      f"{row} {err:.2e}" for row, err in res["agreement"]["depth_rel_l2"].items()), ""]
    lines += ["| implementation | frames | time s | s / frame | peak GB | vs official |",
              "|---|---:|---:|---:|---:|---:|"]
    official = {p["frames"]: p for p in res["points"] if p["row"] == "official" and "time_s" in p}
    for p in res["points"]:
        label = ROWS[p["row"]][0]
        if "error" in p:
            lines.append(f"| {label} | {p['frames']} | {p['error']} | | | |")
            continue
        base = official.get(p["frames"])
        ratio = "-" if p["row"] == "official" or base is None else f"{base['time_s'] / p['time_s']:.2f}x"
        peak = "-" if p["peak_gb"] is None else f"{p['peak_gb']:.2f}"
        lines.append(f"| {label} | {p['frames']} | {p['time_s']:.3f} | {p['s_per_frame']:.4f} | {peak} | {ratio} |")
    lines += ["", f"Target: visionattn's FastVGGT >= {TARGET}x the official code at every frame count.", ""]
    return "\n".join(lines)


def plot(res: dict, path: str, outputs: OutputFiles | None = None) -> None:
    with figure(path, outputs, 1, 2, figsize=(11, 4.2), tool="bench_fastvggt_official") as (fig, (ax_t, ax_s)):
        official = {p["frames"]: p["time_s"] for p in res["points"] if p["row"] == "official" and "time_s" in p}
        for row in ROWS:
            pts = sorted((p["frames"], p["time_s"]) for p in res["points"] if p["row"] == row and "time_s" in p)
            if not pts:
                continue
            ax_t.plot([f for f, _ in pts], [t / f for f, t in pts], marker="o", label=row)
            if row != "official":
                ax_s.plot([f for f, _ in pts if f in official], [official[f] / t for f, t in pts if f in official],
                          marker="o", label=row)
        ax_s.axhline(TARGET, color="k", lw=1, ls="--", label=f"target {TARGET}x")
        ax_s.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax_t.set(xlabel="frames", ylabel="s per frame")
        ax_s.set(xlabel="frames", ylabel="speed-up vs the official code")
        for ax in (ax_t, ax_s):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"FastVGGT vs the official code, {res['height']}x{res['width']}, {res['environment']['device']}")


def main(argv: list[str] | None = None) -> dict:
    args = parser.parse_args(argv)
    if args.height % 14 or args.width % 14:
        parser.error(f"--height {args.height} / --width {args.width} must be multiples of 14 (the patch size)")
    device = check_device(parser, args.device)
    out = check_output(parser, args.out)
    outputs = output_files(parser, [out + ".json", out + ".md", out + ".png"], tool="bench_fastvggt_official")
    OfficialVGGT = import_official(args.official)
    from visionattn.models import FASTVGGT_MERGING, VGGT, vggt_tiny_config

    rows = ["official", "sdpa", "bf16", "free"] + (["bf16-fp32-heads"] if args.fp32_heads else [])
    cfg = vggt_tiny_config() if args.tiny else {}
    torch.manual_seed(0)
    official = OfficialVGGT(merging=0, enable_point=False, enable_track=False, **cfg).eval()
    official.update_patch_dimensions(args.width // 14, args.height // 14)
    ours = VGGT(**{**cfg, "enable_point": False, "enable_track": False}, merging=FASTVGGT_MERGING).eval()
    ours.load_state_dict(official.state_dict(), strict=True)
    res = {"environment": environment(), "official": os.path.abspath(args.official),
           "height": args.height, "width": args.width, "rows": rows, "points": []}
    with tf32_disabled() as flags:
        res["settings"] = flags
        for frames in sorted(args.frames):
            g = torch.Generator().manual_seed(frames)
            images = torch.rand(frames, 3, args.height, args.width, generator=g).to(device)
            depths = {}
            for row in rows:
                model = official if row == "official" else ours
                try:
                    point, depths[row] = run_row(model, row, images, args.repeats, device)
                except torch.cuda.OutOfMemoryError:
                    point = {"row": row, "frames": frames, "error": "out of memory"}
                    torch.cuda.empty_cache()
                res["points"].append(point)
                print(f"[fastvggt_official] {frames} frames {row}: {point.get('time_s', point.get('error'))}",
                      flush=True)
            if "agreement" not in res and "official" in depths:
                res["agreement"] = {"frames": frames, "depth_rel_l2": {
                    row: rel_l2(d.double(), depths["official"].double()) for row, d in depths.items()
                    if row not in ("official", "free")}}
            del images, depths
            outputs.write_json(out + ".json", res)
    outputs.write_text(out + ".md", to_markdown(res))
    plot(res, out + ".png", outputs)
    print(to_markdown(res))
    return res


if __name__ == "__main__":
    main()
