#!/usr/bin/env python
"""Stable Video Diffusion img2vid with visionattn attention: generation and fidelity per precision mode.

Runs the diffusers ``StableVideoDiffusionPipeline`` once per mode with the same
seed and the same initial latents, the UNet's attention replaced by
:class:`visionattn.patching.diffusers.ELSAAttnProcessor` (``native*`` runs keep
diffusers' default processor, i.e. PyTorch SDPA). Per mode it writes the video
(mp4) and a frame-grid PNG and reports: latency (pipeline and UNet), peak GPU
memory, NaN/inf frames, denoising steps with non-finite latents, attention
overflow events counted in the processor, and PSNR / SSIM / max-abs difference
of every frame against the reference run (``--reference``, default ``fp32``).
The PASA paper (Sec. 4) saw FP16 attention overflow in SVD at Q/K [50, 5, 9216, 64].

Modes: any visionattn mode (``fp32 fp32-ieee tf32 fp16 bf16 pasa fp16-acc16``) or
``native`` / ``native-fp16`` / ``native-bf16`` / ``native-fp32`` (diffusers' own
processor). Pipeline dtype (``--dtype auto``): ``native-X`` runs in X; other runs
in the mode's compute dtype on CUDA (fp32 modes in float32, fp16/pasa in float16,
bf16 in bfloat16) and in float32 on CPU (half convolutions on CPU are ~10x slower;
the attention still runs the mode's arithmetic). Each run records its dtype.

Models: a hub id (``stabilityai/stable-video-diffusion-img2vid`` 14 frames,
``...-img2vid-xt`` 25 frames), a local directory with the diffusers layout, or
``tiny-random`` (the whole pipeline from small configs with random weights, for CI).

Benchmarks of SVD's attention modules and UNet at real shapes: tools/bench_svd_attention.py.

Usage:
  python tools/eval_svd.py --image tests/data/photos/squirrel_cls.jpg --out out/svd \\
      --model stabilityai/stable-video-diffusion-img2vid-xt --frames 25 --modes native-fp16,fp16,pasa,fp32
  python tools/eval_svd.py --model tiny-random --image tests/data/photos/apple.jpg --frames 4 --steps 2 \\
      --height 64 --width 64 --out /tmp/svd_tiny
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (Stopwatch, ToolParser, atomic_path, check_image, check_output_folder, default_out,  # noqa: E402
                      environment, markdown_table, nonnegative_float, nonnegative_int, output_folder, positive_int,
                      tf32_disabled, write_json_atomic, write_text_atomic)
from _svd_common import (DTYPE_NAMES, MODEL_IDS, NATIVE, PipelineUnavailable, add_run_args,  # noqa: E402
                         check_model, check_run_args, jsonable, load_pipeline, parse_modes, run_dtype)

from visionattn.patching.diffusers import (overflow_counts, patch_diffusers, reset_overflow_counts,  # noqa: E402
                                           unpatch_diffusers)

# whose manifest the output folder holds (visionattn.recon.outdir): a later run replaces only such a folder
TOOL_ID = "visionattn.eval_svd"


# ------------------------------------------------------------------------------------------------
# runs
# ------------------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def _timed_module(module, device: str):
    """Time ``module``'s forward calls (a :class:`_harness.Stopwatch`, yielded)."""
    watch = Stopwatch(device)
    hooks = [module.register_forward_pre_hook(lambda _m, _a: watch.start()),
             module.register_forward_hook(lambda _m, _a, _o: watch.stop())]
    try:
        yield watch
    finally:
        for h in hooks:
            h.remove()


def initial_latents(pipe, frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """Unit-variance noise [1, F, C, H/f, W/f] in float32 from a CPU generator: identical for every run."""
    c = pipe.unet.config.in_channels // 2
    f = pipe.vae_scale_factor
    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randn((1, frames, c, height // f, width // f), generator=g, dtype=torch.float32)


def generate(pipe, image, args, device: str) -> dict:
    """One pipeline call with fixed seed and latents; frames as float32 [F, H, W, 3] in [0, 1] + stats."""
    dtype = pipe.unet.dtype
    latents = initial_latents(pipe, args.frames, args.height, args.width, args.seed).to(device, dtype)
    bad_steps = []

    def on_step(_pipe, i, _t, kw):
        if not bool(torch.isfinite(kw["latents"]).all()):
            bad_steps.append(int(i))
        return kw

    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with _timed_module(pipe.unet, device) as unet_time:
        _sync(device)
        t0 = time.perf_counter()
        frames = pipe(image, height=args.height, width=args.width, num_frames=args.frames,
                      num_inference_steps=args.steps, decode_chunk_size=args.decode_chunk_size,
                      motion_bucket_id=args.motion_bucket_id, fps=args.fps, noise_aug_strength=args.noise_aug,
                      generator=torch.Generator("cpu").manual_seed(args.seed), latents=latents,
                      output_type="np", callback_on_step_end=on_step).frames[0]
        _sync(device)
        seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    frames = np.asarray(frames, dtype=np.float32)
    return {"frames": frames, "latency_s": seconds, "unet_s": unet_time.seconds, "unet_calls": unet_time.count,
            "peak_memory_gib": peak, "nonfinite_latent_steps": bad_steps}


# ------------------------------------------------------------------------------------------------
# fidelity metrics
# ------------------------------------------------------------------------------------------------
def _ssim_gaussian(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> float:
    """SSIM (Wang et al. 2004): 11x11 Gaussian window sigma 1.5, K1 0.01, K2 0.03, channel mean.

    The same statistic as ``skimage.metrics.structural_similarity(gaussian_weights=True,
    sigma=1.5, use_sample_covariance=False)``: local moments by OpenCV Gaussian blurs, the
    5-pixel border (half window) cropped before averaging. a, b: [H, W, C] float.
    """
    import cv2

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    blur = lambda x: cv2.GaussianBlur(x, (11, 11), 1.5, borderType=cv2.BORDER_REFLECT)  # noqa: E731
    vals = []
    for ch in range(a.shape[-1]):
        x, y = a[..., ch].astype(np.float64), b[..., ch].astype(np.float64)
        mx, my = blur(x), blur(y)
        vx, vy, cxy = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
        s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
        vals.append(s[5:-5, 5:-5].mean())
    return float(np.mean(vals))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM of two [H, W, 3] frames in [0, 1]: scikit-image when installed, else :func:`_ssim_gaussian`."""
    try:
        from skimage.metrics import structural_similarity
    except ImportError:
        return _ssim_gaussian(a, b)
    return float(structural_similarity(a, b, channel_axis=-1, data_range=1.0, gaussian_weights=True, sigma=1.5,
                                       use_sample_covariance=False))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of frames in [0, 1] (inf when identical)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def frame_metrics(frames: np.ndarray, ref: np.ndarray) -> dict:
    """Per-frame PSNR / SSIM / max-abs of ``frames`` vs ``ref`` ([F, H, W, 3]); frames with NaN/inf get None."""
    out = {"psnr_db": [], "ssim": [], "max_abs": []}
    for f, r in zip(frames, ref):
        if not (np.isfinite(f).all() and np.isfinite(r).all()):
            for key in out:
                out[key].append(None)
            continue
        out["psnr_db"].append(psnr(f, r))
        out["ssim"].append(ssim(f, r))
        out["max_abs"].append(float(np.abs(f - r).max()))
    return out


def _summary(values: list, worst) -> float | None:
    vals = [v for v in values if v is not None]
    return worst(vals) if vals else None


# ------------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------------
def _to_uint8(frames: np.ndarray) -> np.ndarray:
    return (np.nan_to_num(frames, nan=0.0, posinf=1.0, neginf=0.0).clip(0, 1) * 255).round().astype(np.uint8)


def frame_grid(rows: list[np.ndarray], labels: list[str], max_cols: int = 8):
    """PIL image: one row per entry of ``rows`` ([F, H, W, 3] float), up to ``max_cols`` evenly spaced frames."""
    from PIL import Image, ImageDraw

    f, h, w = rows[0].shape[:3]
    idx = np.unique(np.linspace(0, f - 1, min(f, max_cols)).round().astype(int))
    pad = 14
    grid = Image.new("RGB", (len(idx) * w, len(rows) * (h + pad)), "white")
    draw = ImageDraw.Draw(grid)
    for r, (frames, label) in enumerate(zip(rows, labels)):
        u8 = _to_uint8(frames)
        draw.text((2, r * (h + pad) + 1), label, fill="black")
        for c, i in enumerate(idx):
            grid.paste(Image.fromarray(u8[i]), (c * w, r * (h + pad) + pad))
    return grid


def write_video(path: str, frames: np.ndarray, fps: int) -> None:
    """mp4 via diffusers.utils.export_to_video (imageio-ffmpeg), written atomically."""
    from diffusers.utils import export_to_video

    with atomic_path(path) as tmp:
        export_to_video(list(_to_uint8(frames)), tmp, fps=fps)


def write_png(path: str, image) -> None:
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG")


def to_markdown(res: dict) -> str:
    env, cfg = res["environment"], res["config"]
    lines = [f"# SVD img2vid per attention mode ({cfg['model']})\n",
             f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}, diffusers {env['diffusers']}; "
             f"command: `{env['command']}`\n",
             f"Image `{cfg['image']}`, {cfg['frames']} frames at {cfg['height']}x{cfg['width']}, {cfg['steps']} steps, "
             f"seed {cfg['seed']}. Reference run: `{cfg['reference']}` (metrics are per frame vs it: PSNR / SSIM "
             f"worst frame, max-abs over all frames, pixels in [0, 1]). Column `dtype` is the pipeline's dtype "
             f"(the attention runs the mode's own arithmetic); {cfg['warmup']} untimed warm-up generation(s) per run."
             + (" CPU run: a smoke test of the path, timings are not representative." if cfg["device"] == "cpu"
                else "") + "\n"]
    rows = []
    for name, r in res["runs"].items():
        rows.append([name, r["pipeline_dtype"], r["processor"], r["latency_s"], r["unet_s"],
                     "-" if r["peak_memory_gib"] is None else r["peak_memory_gib"], r["nonfinite_frames"],
                     len(r["nonfinite_latent_steps"]), r["overflow"]["overflow_events"],
                     r["overflow"]["nonfinite_outputs"],
                     "ref" if name == cfg["reference"] else r["min_psnr_db"],
                     "ref" if name == cfg["reference"] else r["min_ssim"],
                     "ref" if name == cfg["reference"] else r["max_abs"]])
    lines.append(markdown_table(rows, ["run", "dtype", "attention", "latency s", "UNet s", "peak GiB",
                                       "NaN/inf frames", "NaN latent steps", "overflow events",
                                       "non-finite attn outputs", "min PSNR dB", "min SSIM", "max abs"]))
    lines.append("\n`overflow events`: attention calls whose output held NaN/inf although q, k, v were finite; "
                 "`non-finite attn outputs` also counts calls fed NaN by an earlier layer.\n")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# generation study
# ------------------------------------------------------------------------------------------------
def evaluate(args, folder: str | None = None) -> dict:
    """Generate once per mode, compare with the reference run, write videos / grids / markdown / JSON into
    ``folder`` (default ``args.out``)."""
    from PIL import Image

    from _harness import read_rgb

    folder = args.out if folder is None else folder
    device = args.device
    if args.quiet:  # also diffusers' own bar while it loads a pipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
    runs = parse_modes(args.modes, args.reference)
    image = read_rgb(args.image).resize((args.width, args.height), Image.BICUBIC)
    plan = [(name, run_dtype(name, args.dtype, device)) for name in runs]
    order = sorted(range(len(plan)), key=lambda i: (DTYPE_NAMES[plan[i][1]], i))  # one load per dtype
    res = {"environment": environment(), "config": {k: v for k, v in vars(args).items()}, "runs": {}}
    outputs, pipe, pipe_dtype = {}, None, None
    for i in tqdm(order, desc="modes", disable=args.quiet):
        name, dtype = plan[i]
        if dtype != pipe_dtype:
            pipe = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            pipe = load_pipeline(args.model, dtype, device, variant=args.variant, seed=args.seed,
                                 num_frames=args.frames)
            pipe.set_progress_bar_config(disable=True)
            pipe_dtype = dtype
        report = None
        if name not in NATIVE:
            report = patch_diffusers(pipe.unet, name, count_overflow=not args.no_count_overflow)
            if args.patch_vae:
                report["vae"] = patch_diffusers(pipe.vae, name, count_overflow=not args.no_count_overflow)
        try:
            for _ in range(args.warmup):
                w = argparse.Namespace(**{**vars(args), "steps": 1})
                generate(pipe, image, w, device)
            if report is not None:  # count the measured run only
                reset_overflow_counts(pipe.unet)
            out = generate(pipe, image, args, device)
            overflow = overflow_counts(pipe.unet) if report is not None else \
                {"calls": 0, "nonfinite_outputs": 0, "overflow_events": 0, "layers": {}}
        finally:
            if report is not None:
                unpatch_diffusers(pipe.unet)
                if args.patch_vae:
                    unpatch_diffusers(pipe.vae)
        frames = out.pop("frames")
        outputs[name] = frames
        entry = {"pipeline_dtype": DTYPE_NAMES[dtype], "processor": "diffusers default" if report is None
                 else f"ELSAAttnProcessor({name})", "patch_report": report, **out, "overflow": overflow,
                 "nonfinite_frames": int((~np.isfinite(frames).reshape(len(frames), -1).all(1)).sum())}
        res["runs"][name] = entry
        write_video(os.path.join(folder, f"{name}.mp4"), frames, args.fps)
        write_png(os.path.join(folder, f"{name}_grid.png"), frame_grid([frames], [name], args.grid_cols))
    res["runs"] = {name: res["runs"][name] for name in runs}  # report in the order asked
    ref = outputs[args.reference]
    for name in runs:
        m = frame_metrics(outputs[name], ref)
        e = res["runs"][name]
        e["per_frame"] = m
        e["min_psnr_db"] = _summary(m["psnr_db"], min)
        e["min_ssim"] = _summary(m["ssim"], min)
        e["max_abs"] = _summary(m["max_abs"], max)
    write_png(os.path.join(folder, "compare.png"),
              frame_grid([outputs[n] for n in runs], runs, args.grid_cols))
    res["files"] = sorted(os.listdir(folder))
    res = jsonable(res)
    write_json_atomic(os.path.join(folder, "results.json"), res)
    write_text_atomic(os.path.join(folder, "results.md"), to_markdown(res))
    return res


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="eval_svd.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", help="conditioning photo (jpg/png); resized to --width x --height (decoded first: "
                                   "a corrupt file stops the tool at once)")
    p.add_argument("--model", default=MODEL_IDS[0],
                   help=f"hub id ({', '.join(MODEL_IDS)}), a local diffusers directory, or tiny-random")
    p.add_argument("--variant", default="auto", help="weight variant: auto (fp16 for hub ids), none, or a name")
    add_run_args(p, "native-fp16,fp16,pasa,fp32")
    p.add_argument("--reference", default="fp32", help="run every other run is compared with (added if missing)")
    p.add_argument("--steps", type=positive_int, default=25, help="denoising steps")
    p.add_argument("--fps", type=positive_int, default=7, help="fps conditioning and mp4 frame rate")
    p.add_argument("--motion-bucket-id", type=nonnegative_int, default=127, help="SVD motion conditioning")
    p.add_argument("--noise-aug", type=nonnegative_float, default=0.02, help="noise augmentation strength of the image")
    p.add_argument("--decode-chunk-size", type=positive_int, default=8, help="frames decoded by the VAE at once")
    p.add_argument("--patch-vae", action="store_true", help="also run the VAE's mid-block attention in the mode")
    p.add_argument("--no-count-overflow", action="store_true",
                   help="skip the processor's NaN/inf counters (three isfinite reductions per attention call)")
    p.add_argument("--warmup", type=nonnegative_int, default=None,
                   help="untimed 1-step generations per run before the measured one (default 1 on CUDA, 0 on CPU)")
    p.add_argument("--grid-cols", type=positive_int, default=8, help="frames per row in the PNG grids")
    p.add_argument("--out", default=None,
                   help="output folder (default out/eval_svd): new, empty or an earlier output of this tool "
                        "(then replaced); written into a temporary folder renamed into place at the end")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def check_args(parser: ToolParser, args) -> None:
    """Every argument checked (exit 2 with one line) and the defaults resolved, before any work."""
    device = check_run_args(parser, args, args.reference)
    if args.warmup is None:
        args.warmup = 1 if device.type == "cuda" else 0
    check_image(parser, "--image", args.image, example="tests/data/photos/apple.jpg")
    check_model(parser, args.model)
    if args.out is None:
        args.out = default_out("eval_svd")
    check_output_folder(parser, args.out, tool=TOOL_ID, inputs=[args.image])


def main(argv=None) -> dict:
    """Parse ``argv``, check it, and run the generation study; returns the results dict.

    TF32 is off for PyTorch matmuls and cuDNN convolutions while it runs (said in
    the output), so fp32 runs compare FP32 with FP32.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    with tf32_disabled() as settings, output_folder(parser, args.out, tool=TOOL_ID, inputs=[args.image]) as tmp:
        print(f"process-wide settings for this run: {settings}")
        try:
            res = evaluate(args, tmp)
        except PipelineUnavailable as e:  # nothing is kept: the temporary folder is removed
            parser.error(f"--model: {e}")
        text = to_markdown(res)
    print(text)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
