"""π³ / Pi3X inference against the official code: same random weights, same process, same frames.

The official code (github.com/yyfz/Pi3) is not a dependency and is not shipped here: pass a local checkout with
``--official`` (the folder holding its ``pi3/`` package). Protocol:

* the official ``Pi3()`` / ``Pi3X()`` is built with seed 0 (LayerScale gammas and Pi3X's ray / depth embeddings
  drawn from N(0, 0.1) so that every branch carries signal) and its weights are loaded into
  ``visionattn.models.Pi3`` / ``Pi3X`` (strict);
* rows: ``official-fp32`` (FP32, TF32 off), ``official-bf16`` (under bf16 autocast, as its example runs);
  ours: ``sdpa-fp32`` (PyTorch SDPA, FP32), ``fp32`` (visionattn fp32 attention), ``sdpa-bf16`` and ``bf16``
  (bf16 autocast, SDPA / visionattn bf16 attention);
* Pi3X with ``--conditions``: pinhole intrinsics (focal 0.9 x width, pixels) and camera-to-world poses on a
  slow arc, on every frame, on both sides;
* per frame count, each row on the GPU alone (the others wait on the CPU): one untimed forward, then
  ``--repeats`` timed forwards (:func:`_harness.sample_ms`: CUDA events, median); peak = max allocated of the
  timed forwards; an out-of-memory row is recorded as such (how many frames fit);
* frames: the images of ``--images`` (cycled to the frame count, resized to ``--height`` x ``--width``) or
  random frames in [0, 1];
* agreement at the smallest frame count: rel L2 of each output (points, local_points, conf, camera_poses and
  Pi3X's metric) of each of our rows against ``official-fp32``, and of the bf16 rows against
  ``official-bf16``.

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (time per frame and peak memory vs frames).

    python tools/bench_pi3_official.py --official ~/src/Pi3 --model pi3 --images demos/data/kitchen \\
        --frames 25 100 200 500 --out out/pi3_official
"""
from __future__ import annotations

import argparse
import gc
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers

from _harness import (OutputFiles, ToolParser, check_device, check_output, default_out,  # noqa: E402
                      environment, figure, output_files, positive_int, sample_ms, tf32_disabled)

from visionattn.metrics import rel_l2  # noqa: E402

ROWS = {  # name: (label, official, visionattn attn_mode, autocast dtype)
    "official-fp32": ("official code, FP32", True, None, None),
    "official-bf16": ("official code, bf16 autocast", True, None, torch.bfloat16),
    "sdpa-fp32": ("visionattn model, PyTorch SDPA, FP32", False, None, None),
    "fp32": ("visionattn model, visionattn fp32 attention", False, "fp32", None),
    "sdpa-bf16": ("visionattn model, PyTorch SDPA, bf16 autocast", False, None, torch.bfloat16),
    "bf16": ("visionattn model, visionattn bf16 attention, bf16 autocast", False, "bf16", torch.bfloat16),
}
OUTPUTS = ("points", "local_points", "conf", "camera_poses", "metric")

parser = ToolParser(prog="bench_pi3_official.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
parser.add_argument("--official", required=True, help="local checkout of the official π³ code (holds pi3/)")
parser.add_argument("--model", choices=("pi3", "pi3x"), default="pi3", help="which model (default: %(default)s)")
parser.add_argument("--conditions", action="store_true", help="Pi3X: intrinsics and poses on every frame")
parser.add_argument("--frames", nargs="+", type=positive_int, default=[25, 100, 200], help="frame counts")
parser.add_argument("--images", default=None, help="folder of frames (cycled to the frame count); default random")
parser.add_argument("--height", type=positive_int, default=392, help="frame height, a multiple of 14")
parser.add_argument("--width", type=positive_int, default=518, help="frame width, a multiple of 14")
parser.add_argument("--repeats", type=positive_int, default=1, help="timed forwards per point (median)")
parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="rows to run (all)")
parser.add_argument("--tiny", action="store_true",
                    help="the tiny config on both sides, passed to the checkout's classes as keywords (a stand-in "
                         "checkout that accepts them; a tool check, not a result)")
parser.add_argument("--device", default="cuda", help="cuda, or cpu for a tool check (default: %(default)s)")
parser.add_argument("--out", default=default_out("pi3_official"), help="output prefix (.json, .md, .png)")


def import_official(path: str, model: str):
    """The official class (``Pi3`` or ``Pi3X``) from the checkout at ``path``; exits 2 naming what is missing."""
    path = os.path.abspath(os.path.expanduser(path))
    module = f"pi3/models/{model}.py"
    if not os.path.isfile(os.path.join(path, module)):
        parser.error(f"--official {path}: no {module} there (pass the π³ checkout's root folder)")
    sys.path.insert(0, path)
    try:
        if model == "pi3":
            from pi3.models.pi3 import Pi3 as cls
        else:
            from pi3.models.pi3x import Pi3X as cls
    except ImportError as err:
        parser.error(f"--official {path}: its code does not import here ({err})")
    return cls


def load_frames(folder: str | None, frames: int, height: int, width: int) -> torch.Tensor:
    """[frames, 3, height, width] in [0, 1]: the folder's images cycled, or random frames (seed = frames)."""
    if folder is None:
        return torch.rand(frames, 3, height, width, generator=torch.Generator().manual_seed(frames))
    import numpy as np
    from PIL import Image

    files = sorted(f for ext in ("jpg", "jpeg", "png") for f in glob.glob(os.path.join(folder, f"*.{ext}")))
    if not files:
        parser.error(f"--images {folder}: no .jpg / .png files there")
    arr = [np.asarray(Image.open(files[i % len(files)]).convert("RGB").resize((width, height), Image.BICUBIC),
                      dtype=np.float32) / 255 for i in range(frames)]
    return torch.from_numpy(np.stack(arr)).permute(0, 3, 1, 2).contiguous()


def conditions(frames: int, height: int, width: int) -> dict:
    """Pinhole intrinsics [1, N, 3, 3] (pixels) and camera-to-world poses [1, N, 4, 4] (OpenCV) on a slow arc."""
    f = 0.9 * width
    intrinsics = torch.tensor([[f, 0, width / 2], [0, f, height / 2], [0, 0, 1.0]]).expand(1, frames, 3, 3)
    angle = torch.linspace(0, 0.3, frames)
    poses = torch.eye(4).repeat(1, frames, 1, 1)
    poses[..., 0, 0], poses[..., 0, 2], poses[..., 2, 0], poses[..., 2, 2] = angle.cos(), angle.sin(), \
        -angle.sin(), angle.cos()
    poses[..., 0, 3] = torch.linspace(0, 0.5, frames)
    return {"intrinsics": intrinsics.contiguous(), "poses": poses}


def run_row(model, row: str, images: torch.Tensor, cond: dict, repeats: int, device: torch.device):
    """Time one row at one frame count (the model moved to ``device`` and back): ``(point, outputs on CPU)``."""
    _, official, mode, dtype = ROWS[row]
    if not official:
        model.set_attn_mode(mode)
    model.to(device)
    x = images[None].to(device)
    kw = {k: v.to(device) for k, v in cond.items()}
    last: dict = {}

    def forward():
        last.clear()  # the previous output goes before the next forward, as in a loop over scenes
        last["out"] = model(x, **kw)

    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    try:
        with torch.no_grad(), autocast:
            forward()  # untimed: kernel builds, cuDNN plans
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times = sorted(ms / 1e3 for ms in sample_ms(forward, device, warmup=0, reps=repeats))
        out = {k: v.float().cpu() for k, v in last.pop("out").items() if torch.is_tensor(v) and k in OUTPUTS}
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    finally:
        model.to("cpu")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    t = times[len(times) // 2]
    finite = all(bool(torch.isfinite(v).all()) for v in out.values())
    return {"row": row, "frames": images.shape[0], "time_s": t, "s_per_frame": t / images.shape[0], "times_s": times,
            "peak_gb": peak, "finite": finite}, out


def agreement(outs: dict) -> dict:
    """Rel L2 of each output of our rows against the official rows (FP32 and, for bf16 rows, bf16 too)."""
    res = {}
    for row, out in outs.items():
        if ROWS[row][1]:
            continue
        for base in ("official-fp32",) + (("official-bf16",) if ROWS[row][3] is not None else ()):
            if base in outs:
                res[f"{row} vs {base}"] = {k: rel_l2(out[k].double(), outs[base][k].double())
                                           for k in out if k in outs[base]}
    return res


def to_markdown(res: dict) -> str:
    env = res["environment"]
    name = {"pi3": "π³", "pi3x": "Pi3X"}[res["model"]]
    lines = [f"# {name}: visionattn vs the official code, same random weights: {env['device']}", "",
             f"* command: `{env['command']}`",
             f"* torch {env['torch']}, triton {env.get('triton')}, python {env['python']}; official code: "
             f"{res['official']}",
             "* protocol: both models in one process, the official one built with seed 0, its weights loaded into "
             "visionattn's (strict); TF32 off for matmuls and convolutions; per frame count each row alone on the "
             "GPU: one untimed forward, then the median of the timed ones (CUDA events); "
             f"{res['height']}x{res['width']} frames from {res['images'] or 'random pixels'}; peak = max allocated "
             "of the timed forwards" + ("; intrinsics and poses on every frame" if res["conditions"] else ""), ""]
    if res.get("agreement"):
        lines += [f"Agreement at {res['agreement_frames']} frames (rel L2 per output):", "",
                  "| rows | " + " | ".join(OUTPUTS) + " |", "|---|" + "---:|" * len(OUTPUTS)]
        for pair, errs in res["agreement"].items():
            lines.append(f"| {pair} | " + " | ".join(f"{errs[k]:.2e}" if k in errs else "" for k in OUTPUTS) + " |")
        lines.append("")
    lines += ["| row | frames | time s | s / frame | peak GB | vs official (same precision) |",
              "|---|---:|---:|---:|---:|---:|"]
    base = {(p["frames"], p["row"]): p for p in res["points"] if "time_s" in p}
    for p in res["points"]:
        label = ROWS[p["row"]][0]
        if "error" in p:
            lines.append(f"| {label} | {p['frames']} | {p['error']} | | | |")
            continue
        ref = base.get((p["frames"], "official-bf16" if ROWS[p["row"]][3] is not None else "official-fp32"))
        ratio = "-" if ROWS[p["row"]][1] or ref is None else f"{ref['time_s'] / p['time_s']:.2f}x"
        peak = "-" if p["peak_gb"] is None else f"{p['peak_gb']:.2f}"
        lines.append(f"| {label} | {p['frames']} | {p['time_s']:.3f} | {p['s_per_frame']:.4f} | {peak} | {ratio} |")
    lines += ["", "Goals: fp32 exact and >= 2x the official FP32 speed; bf16 no slower than the official bf16; peak "
              "memory <= the official code's at every point, and more frames than it fits.", ""]
    return "\n".join(lines)


def plot(res: dict, path: str, outputs: OutputFiles | None = None) -> None:
    with figure(path, outputs, 1, 2, figsize=(11, 4.2), tool="bench_pi3_official") as (fig, (ax_t, ax_m)):
        for row in ROWS:
            pts = sorted((p["frames"], p["time_s"], p["peak_gb"]) for p in res["points"]
                         if p["row"] == row and "time_s" in p)
            if not pts:
                continue
            ax_t.plot([f for f, _, _ in pts], [t / f for f, t, _ in pts], marker="o", label=row)
            if pts[0][2] is not None:
                ax_m.plot([f for f, _, _ in pts], [m for _, _, m in pts], marker="o", label=row)
        ax_t.set(xlabel="frames", ylabel="s per frame")
        ax_m.set(xlabel="frames", ylabel="peak GB")
        for ax in (ax_t, ax_m):
            ax.grid(alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=7)
        fig.suptitle(f"{res['model']} vs the official code, {res['height']}x{res['width']}, "
                     f"{res['environment']['device']}")


def main(argv: list[str] | None = None) -> dict:
    args = parser.parse_args(argv)
    if args.height % 14 or args.width % 14:
        parser.error(f"--height {args.height} / --width {args.width} must be multiples of 14 (the patch size)")
    if args.conditions and args.model != "pi3x":
        parser.error("--conditions needs --model pi3x (π³ takes no conditions)")
    device = check_device(parser, args.device)
    out = check_output(parser, args.out)
    outputs = output_files(parser, [out + ".json", out + ".md", out + ".png"], tool="bench_pi3_official")
    Official = import_official(args.official, args.model)
    from visionattn.models import Pi3, Pi3X, pi3_tiny_config, pi3x_tiny_config

    Ours = Pi3 if args.model == "pi3" else Pi3X
    cfg = (pi3_tiny_config() if args.model == "pi3" else pi3x_tiny_config()) if args.tiny else {}
    torch.manual_seed(0)
    official = Official(**cfg).eval()
    with torch.no_grad():  # LayerScale gammas (and Pi3X's zero-initialised embeddings) get signal
        for n, prm in official.named_parameters():
            if n.endswith("gamma") or "ray_embed" in n or n == "depth_emb":
                prm.normal_(0, 0.1)
    ours = Ours(**cfg).eval()
    ours.load_state_dict(official.state_dict(), strict=True)
    res = {"environment": environment(), "official": os.path.abspath(args.official), "model": args.model,
           "conditions": args.conditions, "images": args.images, "height": args.height, "width": args.width,
           "rows": args.rows, "points": []}
    with tf32_disabled() as flags:
        res["settings"] = flags
        for frames in sorted(args.frames):
            images = load_frames(args.images, frames, args.height, args.width)
            cond = conditions(frames, args.height, args.width) if args.conditions else {}
            outs = {}
            for row in args.rows:
                model = official if ROWS[row][1] else ours
                try:
                    point, outs[row] = run_row(model, row, images, cond, args.repeats, device)
                except torch.cuda.OutOfMemoryError:
                    point = {"row": row, "frames": frames, "error": "out of memory"}
                    gc.collect()
                    torch.cuda.empty_cache()
                res["points"].append(point)
                print(f"[pi3_official] {frames} frames {row}: {point.get('time_s', point.get('error'))}", flush=True)
            if "agreement" not in res:
                res["agreement"], res["agreement_frames"] = agreement(outs), frames
            del images, outs
            outputs.write_json(out + ".json", res)
    outputs.write_text(out + ".md", to_markdown(res))
    plot(res, out + ".png", outputs)
    print(to_markdown(res))
    return res


if __name__ == "__main__":
    main()
