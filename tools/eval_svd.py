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

``--attention-bench`` instead times the attention modules of SVD's UNet at real
shapes (levels 320/640/1280/1280 channels, 5/10/20/20 heads of 64, 9216 spatial
tokens at 576x1024, 25 frames, CFG batch 2): spatial and temporal self / cross
attention, each mode vs diffusers' default processor, random weights.
``--unet-bench`` times one forward of the full-size SVD UNet (random weights).

Usage:
  python tools/eval_svd.py --image tests/data/photos/squirrel_cls.jpg --out out/svd \\
      --model stabilityai/stable-video-diffusion-img2vid-xt --frames 25 --modes native-fp16,fp16,pasa,fp32
  python tools/eval_svd.py --model tiny-random --image tests/data/photos/apple.jpg --frames 4 --steps 2 \\
      --height 64 --width 64 --out /tmp/svd_tiny
  python tools/eval_svd.py --attention-bench --out out/svd_attention_h100   # GPU
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
from _cli import (ToolParser, check_device, check_output, default_out, nonnegative_int, positive_int,  # noqa: E402
                  nonnegative_float)

from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import get_mode, mode_names  # noqa: E402
from visionattn.patching.diffusers import (  # noqa: E402
    ELSAAttnProcessor, overflow_counts, patch_diffusers,
                                           reset_overflow_counts, unpatch_diffusers)
from visionattn.reporting import (Stopwatch, atomic_path, environment, markdown_table, sample_ms,  # noqa: E402
                                  tf32_disabled, write_json_atomic, write_text_atomic)

MODEL_IDS = ("stabilityai/stable-video-diffusion-img2vid", "stabilityai/stable-video-diffusion-img2vid-xt")
NATIVE = {"native": None, "native-fp32": torch.float32, "native-fp16": torch.float16, "native-bf16": torch.bfloat16}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# SVD UNet (UNetSpatioTemporalConditionModel defaults = the released config).
SVD_LEVELS = ((320, 5), (640, 10), (1280, 20), (1280, 20))
SVD_CROSS_DIM = 1024


# ------------------------------------------------------------------------------------------------
# pipelines
# ------------------------------------------------------------------------------------------------
def build_tiny_pipeline(seed: int = 0, num_frames: int = 4):
    """The full SVD pipeline from small configs with random weights (float32, CPU).

    UNetSpatioTemporalConditionModel (channels 32/64, 2/4 heads, spatial and temporal
    self + cross attention), AutoencoderKLTemporalDecoder (mid-block attention),
    CLIPVisionModelWithProjection (224 px input as the pipeline resizes to it),
    EulerDiscreteScheduler (SVD's settings), CLIPImageProcessor. Deterministic in ``seed``.
    """
    from diffusers import (AutoencoderKLTemporalDecoder, EulerDiscreteScheduler, StableVideoDiffusionPipeline,
                           UNetSpatioTemporalConditionModel)
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNetSpatioTemporalConditionModel(
            sample_size=8, in_channels=8, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
            up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
            cross_attention_dim=32, num_attention_heads=(2, 4), addition_time_embed_dim=32,
            projection_class_embeddings_input_dim=96, num_frames=num_frames)
        vae = AutoencoderKLTemporalDecoder(
            in_channels=3, out_channels=3, block_out_channels=(32, 32, 32, 32), layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 4, latent_channels=4)  # 8x downsampling as SVD
        image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=32, projection_dim=32, num_hidden_layers=2, num_attention_heads=4, image_size=224,
            patch_size=32, intermediate_size=37))
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="v_prediction", interpolation_type="linear", use_karras_sigmas=True, sigma_min=0.002,
        sigma_max=700.0, timestep_spacing="leading", timestep_type="continuous", steps_offset=1)
    return StableVideoDiffusionPipeline(vae=vae, image_encoder=image_encoder, unet=unet, scheduler=scheduler,
                                        feature_extractor=CLIPImageProcessor(crop_size=224, size=224))


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _offline_message(model: str, err: Exception) -> str:
    return (f"could not load the SVD pipeline '{model}' ({type(err).__name__}: {err}). No network or no cached "
            f"copy: on a machine that reaches huggingface.co run `hf download {model} --local-dir DIR` (the "
            f"repository is gated: accept its licence and log in first), copy DIR here and pass --model DIR; or "
            f"pre-fill the Hugging Face cache (HF_HOME) and keep HF_HUB_OFFLINE=1. For a weight-free run use "
            f"--model tiny-random.")


def load_pipeline(model: str, dtype: torch.dtype, device: str, *, variant: str = "auto", seed: int = 0,
                  num_frames: int = 14, offline: bool | None = None):
    """Load (or build) a ``StableVideoDiffusionPipeline`` in ``dtype`` on ``device``.

    Args:
        model: ``tiny-random``, a local diffusers directory, or a hub id.
        dtype: float32 / float16 / bfloat16.
        device: ``cuda`` / ``cpu``.
        variant: weight variant; ``auto`` = ``fp16`` for hub ids (the files SVD ships), none for local dirs.
        seed: weights seed for ``tiny-random``.
        num_frames: ``tiny-random`` UNet's default frame count.
        offline: never touch the network; default ``huggingface_hub.constants.HF_HUB_OFFLINE``.

    Raises:
        FileNotFoundError: ``model`` looks like a path but is not a directory.
        RuntimeError: the hub model is neither cached nor downloadable; the message names the model id
            and how to pass a local directory.
    """
    from diffusers import StableVideoDiffusionPipeline

    if model == "tiny-random":
        return build_tiny_pipeline(seed, num_frames).to(device=device, dtype=dtype)
    if os.path.isdir(model):
        var = None if variant in ("auto", "none") else variant
        return StableVideoDiffusionPipeline.from_pretrained(model, torch_dtype=dtype, variant=var,
                                                            local_files_only=True).to(device)
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").split("/", 1)[-1]:
        raise FileNotFoundError(f"--model {model!r} is not a directory; pass a local diffusers folder of "
                                f"{MODEL_IDS[0]} (or -xt), a hub id, or tiny-random")
    var = "fp16" if variant == "auto" else (None if variant == "none" else variant)
    offline = _hub_offline() if offline is None else offline
    try:  # the local cache first: no network, fast
        return StableVideoDiffusionPipeline.from_pretrained(model, torch_dtype=dtype, variant=var,
                                                            local_files_only=True).to(device)
    except Exception as e:  # noqa: BLE001 - diffusers raises OSError / EnvironmentError / hub errors
        if offline:
            raise RuntimeError(_offline_message(model, e)) from e
    try:
        return StableVideoDiffusionPipeline.from_pretrained(model, torch_dtype=dtype, variant=var).to(device)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(_offline_message(model, e)) from e


# ------------------------------------------------------------------------------------------------
# runs
# ------------------------------------------------------------------------------------------------
def parse_modes(text: str, reference: str) -> list[str]:
    """Comma list -> run names, reference first, duplicates removed.

    Raises:
        ValueError: a name that is neither a visionattn mode nor ``native[-fp32|-fp16|-bf16]``.
    """
    names = [m.strip() for m in text.split(",") if m.strip()]
    allowed = set(mode_names()) | set(NATIVE)
    for m in names + [reference]:
        if m not in allowed:
            raise ValueError(f"--modes / --reference: {m!r} is not known; expected visionattn modes "
                             f"{mode_names()} or {list(NATIVE)}")
    out = [reference] + [m for m in names if m != reference]
    return list(dict.fromkeys(out))


def run_dtype(name: str, dtype_arg: str, device: str) -> torch.dtype:
    """Pipeline dtype of run ``name`` (see the module docstring)."""
    if NATIVE.get(name) is not None:
        return NATIVE[name]
    if dtype_arg != "auto":
        return DTYPES[dtype_arg]
    if device == "cpu" or name == "native":
        return torch.float32
    cd = get_mode(name).compute_dtype
    return cd if cd in (torch.float16, torch.bfloat16) else torch.float32


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def _timed_module(module, device: str):
    """Time ``module``'s forward calls (a :class:`~visionattn.reporting.Stopwatch`, yielded)."""
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


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


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
def evaluate(args) -> dict:
    """Generate once per mode, compare with the reference run, write videos / grids / markdown / JSON."""
    from PIL import Image

    device = args.device
    runs = parse_modes(args.modes, args.reference)
    image = Image.open(args.image).convert("RGB").resize((args.width, args.height), Image.BICUBIC)
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
        write_video(os.path.join(args.out, f"{name}.mp4"), frames, args.fps)
        write_png(os.path.join(args.out, f"{name}_grid.png"), frame_grid([frames], [name], args.grid_cols))
    res["runs"] = {name: res["runs"][name] for name in runs}  # report in the order asked
    ref = outputs[args.reference]
    for name in runs:
        m = frame_metrics(outputs[name], ref)
        e = res["runs"][name]
        e["per_frame"] = m
        e["min_psnr_db"] = _summary(m["psnr_db"], min)
        e["min_ssim"] = _summary(m["ssim"], min)
        e["max_abs"] = _summary(m["max_abs"], max)
    write_png(os.path.join(args.out, "compare.png"),
              frame_grid([outputs[n] for n in runs], runs, args.grid_cols))
    res["files"] = sorted(os.listdir(args.out))
    res = _jsonable(res)
    write_json_atomic(os.path.join(args.out, "results.json"), res)
    write_text_atomic(os.path.join(args.out, "results.md"), to_markdown(res))
    return res


# ------------------------------------------------------------------------------------------------
# attention / UNet benchmarks at real SVD shapes
# ------------------------------------------------------------------------------------------------
def svd_attention_cases(height: int, width: int, frames: int, levels: int, batch: int = 2) -> list[dict]:
    """SVD UNet attention shapes per level: spatial self/cross over H*W tokens, temporal self/cross over frames.

    Level l has latent (height/8/2^l) x (width/8/2^l) tokens; spatial attention runs on
    batch*frames sequences, temporal attention on batch*tokens sequences; cross attention
    attends to one CLIP image token of 1024 channels (SVD_CROSS_DIM).
    """
    cases = []
    for lvl, (ch, heads) in enumerate(SVD_LEVELS[:levels]):
        n = (height // 8 >> lvl) * (width // 8 >> lvl)
        for kind, seqs, tokens, cross in (("spatial-self", batch * frames, n, False),
                                          ("spatial-cross", batch * frames, n, True),
                                          ("temporal-self", batch * n, frames, False),
                                          ("temporal-cross", batch * n, frames, True)):
            cases.append({"level": lvl, "kind": kind, "channels": ch, "heads": heads, "head_dim": ch // heads,
                          "sequences": seqs, "tokens": tokens, "kv_tokens": 1 if cross else tokens, "cross": cross})
    return cases


def _time_call(fn, device: str, reps: int, warmup: int) -> tuple[float, float | None]:
    """Median ms of ``fn()`` and its peak extra GiB (CUDA) — CUDA events on GPU, perf_counter on CPU."""
    cuda = device.startswith("cuda")
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = sample_ms(fn, device, warmup=0, reps=reps)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    return float(np.median(times)), peak


def attention_bench(args) -> dict:
    """Per-mode time / peak memory / error of SVD's attention modules at real shapes vs diffusers' default."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    device = args.device
    runs = parse_modes(args.modes, "native-fp32")
    cases = svd_attention_cases(args.height, args.width, args.frames, args.bench_levels)
    res = {"environment": environment(), "config": vars(args), "cases": []}
    g = torch.Generator("cpu").manual_seed(args.seed)
    for case in tqdm(cases, desc="attention cases", disable=args.quiet):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            attn = Attention(query_dim=case["channels"], heads=case["heads"], dim_head=case["head_dim"],
                             cross_attention_dim=SVD_CROSS_DIM if case["cross"] else None).eval()
        x = torch.randn(case["sequences"], case["tokens"], case["channels"], generator=g)
        enc = torch.randn(case["sequences"], 1, SVD_CROSS_DIM, generator=g) if case["cross"] else None
        row = dict(case, runs={})
        ref = None
        for name in runs:
            dtype = run_dtype(name, args.dtype, device)
            attn.to(device=device, dtype=dtype)
            attn.set_processor(AttnProcessor2_0() if name in NATIVE else ELSAAttnProcessor(name, count_overflow=False))
            xi = x.to(device, dtype)
            ei = enc.to(device, dtype) if enc is not None else None
            with torch.no_grad():
                fn = lambda: attn(xi, encoder_hidden_states=ei)  # noqa: E731
                y = fn().float().cpu()
                ms, gib = _time_call(fn, device, args.bench_reps, args.bench_warmup)
            ref = y if ref is None else ref
            row["runs"][name] = {"dtype": DTYPE_NAMES[dtype], "ms": ms, "peak_extra_gib": gib,
                                 "rel_l2_vs_native_fp32": rel_l2(y, ref), "finite": bool(torch.isfinite(y).all())}
            del xi, ei
        attn.to("cpu")
        res["cases"].append(row)
    res = _jsonable(res)
    header = ["level", "kind", "seqs x heads x N x d -> M"] + [f"{r} ms" for r in runs] + \
             [f"{r} GiB" for r in runs] + [f"{r} rel err" for r in runs[1:]]
    rows = []
    for c in res["cases"]:
        r = c["runs"]
        rows.append([c["level"], c["kind"], f"{c['sequences']}x{c['heads']}x{c['tokens']}x{c['head_dim']} -> {c['kv_tokens']}"]
                    + [r[n]["ms"] for n in runs] + ["-" if r[n]["peak_extra_gib"] is None else r[n]["peak_extra_gib"]
                                                     for n in runs] + [r[n]["rel_l2_vs_native_fp32"] for n in runs[1:]])
    env = res["environment"]
    md = [f"# SVD attention at real shapes ({args.height}x{args.width}, {args.frames} frames, CFG batch 2)\n",
          f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}, diffusers {env['diffusers']}; "
          f"command: `{env['command']}`\n",
          "Whole diffusers `Attention` module forward (projections + attention), random weights, median of "
          f"{args.bench_reps} after {args.bench_warmup} warm-up; `native*` = diffusers' AttnProcessor2_0 (SDPA); "
          "peak extra memory over the inputs; rel err = relative L2 vs native-fp32.\n",
          markdown_table(rows, header)]
    os.makedirs(os.path.dirname(os.path.abspath(args.out + ".json")), exist_ok=True)
    write_json_atomic(args.out + ".json", res)
    write_text_atomic(args.out + ".md", "\n".join(md))
    return res


def unet_bench(args) -> dict:
    """One full-size SVD UNet forward (random weights, CFG batch 2) per mode: time, peak memory, NaN, error."""
    from diffusers import UNetSpatioTemporalConditionModel

    device = args.device
    runs = parse_modes(args.modes, "native-fp32")
    h, w = args.height // 8, args.width // 8
    g = torch.Generator("cpu").manual_seed(args.seed)
    x = torch.randn(2, args.frames, 8, h, w, generator=g)
    enc = torch.randn(2, 1, SVD_CROSS_DIM if args.unet_config == "svd" else 32, generator=g)
    t = torch.tensor([1.0])
    ids = torch.tensor([[6.0, 127.0, 0.02]]).repeat(2, 1)
    res = {"environment": environment(), "config": vars(args), "runs": {}}
    plan = [(name, run_dtype(name, args.dtype, device)) for name in runs]
    order = sorted(range(len(plan)), key=lambda i: (DTYPE_NAMES[plan[i][1]] != "fp32", DTYPE_NAMES[plan[i][1]], i))
    outputs, unet, unet_dtype = {}, None, None
    for i in tqdm(order, desc="unet modes", disable=args.quiet):
        name, dtype = plan[i]
        if dtype != unet_dtype:  # rebuild from the seed per dtype: the same float32 weights, rounded once
            unet = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            torch.manual_seed(args.seed)  # a tool: process-wide RNG use is fine here
            with torch.device(device):
                unet = (UNetSpatioTemporalConditionModel(num_frames=args.frames) if args.unet_config == "svd"
                        else build_tiny_pipeline(args.seed, args.frames).unet).eval()
            unet.to(device=device, dtype=dtype)
            unet_dtype = dtype
        if name not in NATIVE:
            patch_diffusers(unet, name, count_overflow=True)
        inputs = [a.to(device, dtype) for a in (x, t, enc, ids)]
        try:
            with torch.no_grad():
                fn = lambda: unet(*inputs).sample  # noqa: E731
                y = fn().float().cpu()
                ms, gib = _time_call(fn, device, args.bench_reps, args.bench_warmup)
            ov = overflow_counts(unet) if name not in NATIVE else None
        finally:
            if name not in NATIVE:
                unpatch_diffusers(unet)
        outputs[name] = y
        res["runs"][name] = {"dtype": DTYPE_NAMES[dtype], "ms": ms, "peak_extra_gib": gib,
                             "finite": bool(torch.isfinite(y).all()), "overflow": ov}
        del inputs
    res["runs"] = {name: res["runs"][name] for name in runs}
    for name in runs:
        res["runs"][name]["rel_l2_vs_native_fp32"] = rel_l2(outputs[name], outputs["native-fp32"])
    res = _jsonable(res)
    env = res["environment"]
    rows = [[n, r["dtype"], r["ms"], "-" if r["peak_extra_gib"] is None else r["peak_extra_gib"], r["finite"],
             r["rel_l2_vs_native_fp32"], "-" if r["overflow"] is None else r["overflow"]["overflow_events"]]
            for n, r in res["runs"].items()]
    md = [f"# Full-size SVD UNet forward ({args.height}x{args.width}, {args.frames} frames, CFG batch 2, random weights)\n",
          f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}, diffusers {env['diffusers']}; "
          f"command: `{env['command']}`\n",
          markdown_table(rows, ["run", "dtype", "ms", "peak extra GiB", "finite", "rel err vs native-fp32",
                                "overflow events"])]
    write_json_atomic(args.out + ".json", res)
    write_text_atomic(args.out + ".md", "\n".join(md))
    return res


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="eval_svd.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", help="conditioning photo (jpg/png); resized to --width x --height")
    p.add_argument("--model", default=MODEL_IDS[0],
                   help=f"hub id ({', '.join(MODEL_IDS)}), a local diffusers directory, or tiny-random")
    p.add_argument("--variant", default="auto", help="weight variant: auto (fp16 for hub ids), none, or a name")
    p.add_argument("--modes", default="native-fp16,fp16,pasa,fp32",
                   help=f"comma list of runs: visionattn modes {mode_names()} or {list(NATIVE)}")
    p.add_argument("--reference", default="fp32", help="run every other run is compared with (added if missing)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="pipeline dtype for non-native runs; auto: the mode's dtype on CUDA, fp32 on CPU")
    p.add_argument("--frames", type=positive_int, default=14, help="video frames (14 for img2vid, 25 for img2vid-xt)")
    p.add_argument("--steps", type=positive_int, default=25, help="denoising steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the latents, noise augmentation and tiny weights")
    p.add_argument("--height", type=positive_int, default=576, help="video height in pixels (multiple of 8)")
    p.add_argument("--width", type=positive_int, default=1024, help="video width in pixels (multiple of 8)")
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
                   help="output folder (generation; default out/eval_svd) or path without extension "
                        "(--attention-bench / --unet-bench; default out/svd_attention, out/svd_unet)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--attention-bench", action="store_true",
                   help="time SVD's attention modules at real shapes per mode instead of generating")
    p.add_argument("--unet-bench", action="store_true",
                   help="time one full-size SVD UNet forward (random weights) per mode instead of generating")
    p.add_argument("--unet-config", default="svd", choices=["svd", "tiny"],
                   help="--unet-bench UNet: the released SVD config (1.5B parameters) or the tiny-random one (tests)")
    p.add_argument("--bench-levels", type=int, default=4, choices=[1, 2, 3, 4], help="UNet levels in --attention-bench")
    p.add_argument("--bench-reps", type=positive_int, default=10, help="timed repetitions per benchmark case")
    p.add_argument("--bench-warmup", type=nonnegative_int, default=2, help="untimed repetitions per benchmark case")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def check_args(parser: ToolParser, args) -> None:
    """Every argument checked (exit 2 with one line) and the defaults resolved, before any work."""
    if args.attention_bench and args.unet_bench:
        parser.error("--attention-bench / --unet-bench: pass one of them per call")
    bench = args.attention_bench or args.unet_bench
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = check_device(parser, args.device)
    if args.warmup is None:
        args.warmup = 1 if device.type == "cuda" else 0
    if args.height % 8 or args.width % 8:
        parser.error(f"--height {args.height} / --width {args.width}: both must be multiples of 8")
    if bench and args.modes == parser.get_default("modes"):
        args.modes = "native-fp32,native-fp16,fp32,tf32,fp16,pasa"
    try:
        parse_modes(args.modes, args.reference)
    except ValueError as e:
        parser.error(str(e))
    if not bench:
        if args.image is None or not os.path.isfile(args.image):
            parser.error(f"--image {args.image!r} is not a file; pass a photo (e.g. tests/data/photos/apple.jpg)")
        local = args.model.startswith((".", "/", "~")) or os.sep in args.model.strip("/").split("/", 1)[-1]
        if args.model != "tiny-random" and local and not os.path.isdir(args.model):
            parser.error(f"--model {args.model!r} is not a directory; pass a local diffusers folder of "
                         f"{MODEL_IDS[0]} (or -xt), a hub id, or tiny-random")
    if args.out is None:
        args.out = default_out("svd_attention" if args.attention_bench else "svd_unet" if args.unet_bench
                               else "eval_svd")
    check_output(parser, args.out, folder=not bench)


def main(argv=None) -> dict:
    """Parse ``argv``, check it, and run the generation study or a benchmark; returns the results dict.

    TF32 is off for PyTorch matmuls and cuDNN convolutions while it runs (said in
    the output), so fp32 runs compare FP32 with FP32.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    with tf32_disabled() as settings:
        print(f"process-wide settings for this run: {settings}")
        return _main(args)


def _main(args) -> dict:
    if args.attention_bench or args.unet_bench:
        res = attention_bench(args) if args.attention_bench else unet_bench(args)
        print(open(args.out + ".md").read())
        return res
    res = evaluate(args)
    print(open(os.path.join(args.out, "results.md")).read())
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
