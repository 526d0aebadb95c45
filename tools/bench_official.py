"""π³ / Pi3X / FastVGGT inference against the official code: same random weights, same process, same frames.

``--official`` names a local checkout (no dependency): π³ (yyfz/Pi3, holding ``pi3/``) or FastVGGT
(mystorm16/FastVGGT, holding ``vggt/`` and ``merging/``). Its model is built with seed 0 (π³'s LayerScale gammas and
Pi3X's ray / depth embeddings drawn from N(0, 0.1)) and its weights loaded into visionattn's (strict). Rows, TF32
off: π³ official and ours on SDPA or visionattn attention, FP32 and bf16 autocast (Pi3X ``--conditions``: intrinsics
and poses on every frame); FastVGGT under bf16 autocast: official, ours on SDPA / bf16 attention (bf16 heads), and
attention-free (:func:`_harness.attention_free`, the Amdahl bound). Per frame count each row alone on the GPU: one
untimed forward, the median of ``--repeats`` (:func:`_harness.sample_ms`), peak allocated, out of memory recorded;
rel L2 of each output against the official row(s) of the same precision at the smallest count.
Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (time per frame, peak memory, speed-up vs frames).

    python tools/bench_official.py --model pi3 --official ~/src/Pi3 --images demos/data/kitchen --frames 25 100
    python tools/bench_official.py --model fastvggt --official ~/src/FastVGGT --frames 100 200 500
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, attention_free, check_device, default_out, environment, figure,  # noqa: E402
                      markdown_table, md_header, positive_int, prefix_outputs, sample_ms, tf32_flags, write_results)

from visionattn.metrics import rel_l2  # noqa: E402

BF16 = torch.bfloat16


def _row(label, mode=None, dtype=None, official=False, heads=None, free=False, agree=(), base=None):
    return dict(label=label, mode=mode, dtype=dtype, official=official, heads=heads, free=free, agree=agree,
                base=base)


PI3_ROWS = {
    "official-fp32": _row("official code, FP32", official=True),
    "official-bf16": _row("official code, bf16 autocast", dtype=BF16, official=True),
    "sdpa-fp32": _row("visionattn model, PyTorch SDPA, FP32", agree=("official-fp32",), base="official-fp32"),
    "fp32": _row("visionattn model, visionattn fp32 attention", "fp32", agree=("official-fp32",),
                 base="official-fp32"),
    "sdpa-bf16": _row("visionattn model, PyTorch SDPA, bf16 autocast", None, BF16,
                      agree=("official-fp32", "official-bf16"), base="official-bf16"),
    "bf16": _row("visionattn model, visionattn bf16 attention, bf16 autocast", "bf16", BF16,
                 agree=("official-fp32", "official-bf16"), base="official-bf16"),
}
FAST_ROWS = {
    "official": _row("official FastVGGT code (heads under the bf16 autocast)", dtype=BF16, official=True),
    "sdpa": _row("visionattn FastVGGT, PyTorch SDPA attention, bf16 heads", None, BF16, heads="bf16",
                 agree=("official",), base="official"),
    "bf16": _row("visionattn FastVGGT, visionattn bf16 attention, bf16 heads", "bf16", BF16, heads="bf16",
                 agree=("official",), base="official"),
    "free": _row("visionattn FastVGGT, attention-free (bound), bf16 heads", None, BF16, heads="bf16", free=True,
                 base="official"),
    "bf16-fp32-heads": _row("visionattn FastVGGT, visionattn bf16 attention, FP32 heads", "bf16", BF16, heads="fp32",
                            agree=("official",), base="official"),
}
MODELS = {  # name: (title, rows, outputs compared, default frames, files the checkout must hold, goal)
    "pi3": ("π³", PI3_ROWS, ("points", "local_points", "conf", "camera_poses"), [25, 100, 200],
            ("pi3/models/pi3.py",), "fp32 exact and >= 2x the official FP32 speed; bf16 no slower than the official "
            "bf16; peak memory <= the official code's at every point, and more frames than it fits."),
    "pi3x": ("Pi3X", PI3_ROWS, ("points", "local_points", "conf", "camera_poses", "metric"), [25, 100, 200],
             ("pi3/models/pi3x.py",), "as π³'s: fp32 exact and >= 2x the official FP32 speed; bf16 no slower; "
             "peak memory <= the official code's."),
    "fastvggt": ("FastVGGT", FAST_ROWS, ("depth",), [100, 200, 500], ("vggt/models/vggt.py", "merging/merge.py"),
                 "visionattn's FastVGGT >= 1.3x the official code at every frame count."),
}
TARGET = {"fastvggt": 1.3}  # speed-up goal drawn in the plot

parser = ToolParser(prog="bench_official.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
parser.add_argument("--official", required=True, help="local checkout of the official code (see above)")
parser.add_argument("--model", choices=tuple(MODELS), default="pi3", help="which model (default: %(default)s)")
parser.add_argument("--conditions", action="store_true", help="Pi3X: intrinsics and poses on every frame")
parser.add_argument("--frames", nargs="+", type=positive_int, default=None,
                    help="frame counts (default: π³ 25 100 200, FastVGGT 100 200 500)")
parser.add_argument("--images", default=None, help="folder of frames (cycled to the frame count); default random")
parser.add_argument("--height", type=positive_int, default=392, help="frame height, a multiple of 14")
parser.add_argument("--width", type=positive_int, default=518, help="frame width, a multiple of 14")
parser.add_argument("--repeats", type=positive_int, default=1, help="timed forwards per point (median)")
parser.add_argument("--warmup-frames", type=positive_int, default=None, metavar="K",
                    help="the untimed forward before a count above K runs on its first K frames (kernels built, "
                         "cuDNN plans made, not the minutes of a second long forward); default: the count itself")
parser.add_argument("--rows", nargs="+", choices=list(dict.fromkeys([*PI3_ROWS, *FAST_ROWS])), default=None,
                    help="rows to run (default: all of the model's, FastVGGT's bf16-fp32-heads with --fp32-heads)")
parser.add_argument("--fp32-heads", action="store_true", help="FastVGGT: add the bf16 row with VGGT's FP32 heads")
parser.add_argument("--tiny", action="store_true",
                    help="the tiny config on both sides, passed to the checkout's classes as keywords (a stand-in "
                         "checkout that accepts them; a tool check, not a result)")
parser.add_argument("--device", default="cuda", help="cuda, or cpu for a tool check (default: %(default)s)")
parser.add_argument("--out", default=None, help="output prefix (.json, .md, .png) (default: out/<model>_official)")


def import_official(path: str, model: str):
    """The official class from the checkout at ``path``; exits 2 naming what is missing."""
    path = os.path.abspath(os.path.expanduser(path))
    for part in MODELS[model][4]:
        if not os.path.isfile(os.path.join(path, part)):
            parser.error(f"--official {path}: no {part} there (pass the {MODELS[model][0]} checkout's root folder)")
    sys.path.insert(0, path)
    try:
        if model == "fastvggt":
            from vggt.models.vggt import VGGT as cls
        elif model == "pi3":
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


def build(args):
    """(official model, ours): the official one built with seed 0, its weights loaded into ours (strict)."""
    Official = import_official(args.official, args.model)
    from visionattn.models import (FASTVGGT_MERGING, VGGT, Pi3, Pi3X, pi3_tiny_config, pi3x_tiny_config,
                                   vggt_tiny_config)

    torch.manual_seed(0)
    if args.model == "fastvggt":
        cfg = vggt_tiny_config() if args.tiny else {}
        official = Official(merging=0, enable_point=False, enable_track=False, **cfg).eval()
        official.update_patch_dimensions(args.width // 14, args.height // 14)
        ours = VGGT(**{**cfg, "enable_point": False, "enable_track": False}, merging=FASTVGGT_MERGING)
    else:
        cfg = (pi3_tiny_config() if args.model == "pi3" else pi3x_tiny_config()) if args.tiny else {}
        official = Official(**cfg).eval()
        with torch.no_grad():  # LayerScale gammas (and Pi3X's zero-initialised embeddings) get signal
            for n, prm in official.named_parameters():
                if n.endswith("gamma") or "ray_embed" in n or n == "depth_emb":
                    prm.normal_(0, 0.1)
        ours = (Pi3 if args.model == "pi3" else Pi3X)(**cfg)
    ours.eval().load_state_dict(official.state_dict(), strict=True)
    return official, ours


def run_row(model, spec: dict, x: torch.Tensor, cond: dict, keys, repeats: int, device: torch.device,
            warmup_frames: int | None = None):
    """Time one row at one frame count (the model moved to ``device`` and back): ``(point, outputs on CPU)``.
    The untimed forward runs on the first ``warmup_frames`` frames where the count is larger."""
    if not spec["official"]:
        model.set_attn_mode(spec["mode"])
        if spec["heads"] is not None:
            model.heads_dtype = spec["heads"]
    model.to(device)
    x, kw, last = x.to(device), {k: v.to(device) for k, v in cond.items()}, {}

    def forward(n=None):
        last.clear()  # the previous output goes before the next forward, as in a loop over scenes
        if n is None:
            last["out"] = model(x, **kw)
        else:  # frames are dim -4 of the input and dim 1 of every condition
            last["out"] = model(x[..., :n, :, :, :], **{k: v[:, :n] for k, v in kw.items()})

    autocast = torch.autocast(device.type, dtype=spec["dtype"], enabled=spec["dtype"] is not None)
    try:
        with torch.no_grad(), autocast, (attention_free() if spec["free"] else contextlib.nullcontext()):
            forward(warmup_frames if warmup_frames and warmup_frames < x.shape[-4] else None)  # untimed
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times = sorted(ms / 1e3 for ms in sample_ms(forward, device, warmup=0, reps=repeats))
        out = {k: v.float().cpu() for k, v in last.pop("out").items() if torch.is_tensor(v) and k in keys}
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    finally:
        model.to("cpu")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    t, n = times[len(times) // 2], x.shape[-4]
    return {"frames": n, "time_s": t, "s_per_frame": t / n, "times_s": times, "peak_gb": peak,
            "finite": all(bool(torch.isfinite(v).all()) for v in out.values())}, out


def speedups(res: dict) -> dict:
    """``(frames, row) -> official time / row time`` against the row's baseline of the same precision."""
    rows, t = MODELS[res["model"]][1], {(p["frames"], p["row"]): p["time_s"] for p in res["points"] if "time_s" in p}
    return {(f, r): t[(f, rows[r]["base"])] / s for (f, r), s in t.items() if (f, rows[r]["base"]) in t}


def to_markdown(res: dict) -> str:
    title, rows, keys, _, _, goal = MODELS[res["model"]]
    env, fast = res["environment"], res["model"] == "fastvggt"
    notes = [f"official code: {res['official']}",
             "protocol: both models in one process, the official one built with seed 0, its weights loaded into "
             "visionattn's (strict)" + ("; point and track heads off, merging from global block 0; bf16 autocast "
             "with FP32 weights" if fast else "") + "; TF32 off for matmuls and convolutions; per frame count each "
             "row alone on the GPU: one untimed forward" + (f" (on {res['warmup_frames']} frames above that count)"
             if res.get("warmup_frames") else "") + ", then the median of the timed ones (CUDA events); "
             f"{res['height']}x{res['width']} frames from {res['images'] or 'random pixels'}; peak = max allocated "
             "of the timed forwards" + ("; intrinsics and poses on every frame" if res["conditions"] else "")]
    if fast:
        notes.append("attention-free: the SDPA row with every SDPA call answering its value rows: the time without "
                     "attention, the most any attention kernel can give (Amdahl's law)")
    lines = md_header(f"{title}: visionattn vs the official code, same random weights: {env['device']}", env, *notes)
    if res.get("agreement"):
        lines += [f"Agreement at {res['agreement_frames']} frames (rel L2 per output):", "",
                  markdown_table([[pair] + [f"{e[k]:.2e}" if k in e else "" for k in keys]
                                  for pair, e in res["agreement"].items()], ["rows", *keys])]
    up, table = speedups(res), []
    for p in res["points"]:
        if "error" in p:
            table.append([rows[p["row"]]["label"], p["frames"], p["error"], "", "", ""])
            continue
        ratio, peak = up.get((p["frames"], p["row"])), p["peak_gb"]
        table.append([rows[p["row"]]["label"], p["frames"], f"{p['time_s']:.3f}", f"{p['s_per_frame']:.4f}",
                      "-" if peak is None else f"{peak:.2f}", "-" if ratio is None else f"{ratio:.2f}x"])
    header = ["row", "frames", "time s", "s / frame", "peak GB", "vs official (same precision)"]
    lines += [markdown_table(table, header), f"Goal: {goal}", ""]
    return "\n".join(lines)


def plot(res: dict, path: str, outputs) -> None:
    up = speedups(res)
    with figure(path, outputs, 1, 3, figsize=(15, 4.2)) as (fig, (ax_t, ax_m, ax_s)):
        for row in res["rows"]:
            pts = sorted((p["frames"], p["time_s"], p["peak_gb"]) for p in res["points"]
                         if p["row"] == row and "time_s" in p)
            if pts:
                ax_t.plot([f for f, _, _ in pts], [t / f for f, t, _ in pts], marker="o", label=row)
                if pts[0][2] is not None:
                    ax_m.plot([f for f, _, _ in pts], [m for _, _, m in pts], marker="o", label=row)
                ups = [(f, up[(f, row)]) for f, _, _ in pts if (f, row) in up]
                if ups:
                    ax_s.plot(*zip(*ups), marker="o", label=row)
        if res["model"] in TARGET:
            ax_s.axhline(TARGET[res["model"]], color="k", lw=1, ls="--", label=f"target {TARGET[res['model']]}x")
        ax_s.axhline(1.0, color="grey", lw=0.8, ls=":")
        for ax, name in ((ax_t, "s per frame"), (ax_m, "peak GB"), (ax_s, "speed-up vs the official code")):
            ax.set(xlabel="frames", ylabel=name)
            ax.grid(alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=7)
        fig.suptitle(f"{MODELS[res['model']][0]} vs the official code, {res['height']}x{res['width']}, "
                     f"{res['environment']['device']}")


def main(argv: list[str] | None = None) -> dict:
    args = parser.parse_args(argv)
    title, model_rows, keys, frames, _, _ = MODELS[args.model]
    if args.height % 14 or args.width % 14:
        parser.error(f"--height {args.height} / --width {args.width} must be multiples of 14 (the patch size)")
    if args.conditions and args.model != "pi3x":
        parser.error("--conditions needs --model pi3x (π³ takes no conditions)")
    rows = args.rows or [r for r in model_rows if r != "bf16-fp32-heads" or args.fp32_heads]
    if set(rows) - set(model_rows):
        bad = ", ".join(r for r in rows if r not in model_rows)
        parser.error(f"--rows: {title} has the rows {', '.join(model_rows)}, not {bad}")
    device = check_device(parser, args.device)
    out = args.out or default_out(f"{args.model}_official")
    outputs = prefix_outputs(parser, out, tool="bench_official")
    official, ours = build(args)
    res = {"environment": environment(), "official": os.path.abspath(args.official), "model": args.model,
           "conditions": args.conditions, "images": args.images, "height": args.height, "width": args.width,
           "rows": rows, "warmup_frames": args.warmup_frames, "points": []}
    with tf32_flags() as flags:
        res["settings"] = flags
        for n in sorted(args.frames or frames):
            images = load_frames(args.images, n, args.height, args.width)
            x = images if args.model == "fastvggt" else images[None]
            cond = conditions(n, args.height, args.width) if args.conditions else {}
            outs = {}
            for row in rows:
                try:
                    point, outs[row] = run_row(official if model_rows[row]["official"] else ours, model_rows[row],
                                               x, cond, keys, args.repeats, device, args.warmup_frames)
                except torch.cuda.OutOfMemoryError:
                    point = {"frames": n, "error": "out of memory"}
                    gc.collect()
                    torch.cuda.empty_cache()
                res["points"].append({"row": row, **point})
                print(f"[{args.model}_official] {n} frames {row}: {point.get('time_s', point.get('error'))}",
                      flush=True)
            if "agreement" not in res:
                res["agreement_frames"], res["agreement"] = n, {
                    f"{row} vs {base}": {k: rel_l2(out[k].double(), outs[base][k].double()) for k in out
                                         if k in outs[base]}
                    for row, out in outs.items() for base in model_rows[row]["agree"] if base in outs}
            del images, x, outs
            outputs.write_json(out + ".json", res)
    write_results(outputs, out, res, to_markdown(res), plot)
    print(to_markdown(res))
    return res


if __name__ == "__main__":
    main()
