#!/usr/bin/env python
"""Stable Video Diffusion img2vid with visionattn attention: generation and fidelity per precision mode.

Runs diffusers' ``StableVideoDiffusionPipeline`` once per run with the same seed and initial latents, the UNet's
attention replaced by :class:`visionattn.patching.diffusers.ELSAAttnProcessor` (``native*`` runs keep diffusers'
processor, PyTorch SDPA). Per run: the video (mp4) and a frame-grid PNG; pipeline and UNet latency, peak memory,
NaN/inf frames and latent steps, attention overflow events counted in the processor, PSNR / SSIM / max-abs of every
frame against ``--reference``. Runs: visionattn modes or ``native[-fp32|-fp16|-bf16]``; ``--dtype auto`` runs
``native-X`` in X, other runs in the mode's compute dtype on CUDA and float32 on CPU (half convolutions on CPU are
~10x slower; the attention still runs the mode's arithmetic). Models: a hub id, a local diffusers folder, or
``tiny-random`` (small configs, random weights). The SVD pieces tools/bench_svd_attention.py shares live here.

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

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (Stopwatch, ToolParser, atomic_path, check_device, check_image,  # noqa: E402
                      check_output_folder, default_out, environment, markdown_table, md_header, nonnegative_float,
                      nonnegative_int, output_folder, positive_int, read_rgb, tf32_flags, write_json_atomic,
                      write_text_atomic)

from visionattn.metrics import psnr, ssim  # noqa: E402
from visionattn.modes import MODES, get_mode, mode_names  # noqa: E402
from visionattn.patching.diffusers import (overflow_counts, patch_diffusers, reset_overflow_counts,  # noqa: E402
                                           unpatch_diffusers)

TOOL_ID = "visionattn.eval_svd"  # whose manifest the output folder holds (visionattn.recon.outdir)
MODEL_IDS = ("stabilityai/stable-video-diffusion-img2vid", "stabilityai/stable-video-diffusion-img2vid-xt")
DTYPES = {m: MODES[m].compute_dtype for m in ("fp32", "fp16", "bf16")}  # the modes' dtypes, by mode name
NATIVE = {"native": None, **{f"native-{m}": dtype for m, dtype in DTYPES.items()}}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


# ------------------------------------------------------------------------------------------------ pipelines
class PipelineUnavailable(RuntimeError):
    """The SVD pipeline cannot be loaded (not cached, no network, an incomplete local folder); says how to fix it."""


def _is_path(model: str) -> bool:
    return model.startswith((".", "/", "~")) or os.sep in model.strip("/").split("/", 1)[-1]


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def check_model(parser: ToolParser, model: str, flag: str = "--model") -> None:
    """Exit 2 with one line unless ``model`` is ``tiny-random``, a hub id, or a folder holding a diffusers
    ``StableVideoDiffusionPipeline`` with every component its ``model_index.json`` names."""
    if model == "tiny-random" or not (os.path.isdir(model) or _is_path(model)):
        return
    fix = f"pass a folder made by `hf download {MODEL_IDS[0]} --local-dir DIR` (or -xt), a hub id, or tiny-random"
    if not os.path.isdir(model):
        parser.error(f"{flag} {model!r} is not a directory; {fix}")
    from diffusers import StableVideoDiffusionPipeline as Pipe

    try:
        config = Pipe.load_config(model, local_files_only=True)
    except (OSError, ValueError) as e:
        parser.error(f"{flag} {model!r} is not a diffusers pipeline folder ({_first_line(e)}); {fix}")
    if config.get("_class_name") != Pipe.__name__:
        parser.error(f"{flag} {model!r} holds a {config.get('_class_name') or 'unnamed'} pipeline, not "
                     f"{Pipe.__name__}; {fix}")
    missing = [k for k, v in config.items() if not k.startswith("_") and isinstance(v, (list, tuple)) and v and v[0]
               and not os.path.isdir(os.path.join(model, k))]  # an interrupted download lacks some
    if missing:
        parser.error(f"{flag} {model!r} lacks the sub-folder(s) {', '.join(missing)} its model_index.json names "
                     f"(an incomplete download?); {fix}")


def build_tiny_pipeline(seed: int = 0, num_frames: int = 4):
    """The full SVD pipeline from small configs with random weights (float32, CPU), deterministic in ``seed``: UNet
    (channels 32/64, 2/4 heads, spatial and temporal self + cross attention), temporal VAE (8x downsampling, mid-block
    attention), CLIP image encoder (224 px), SVD's Euler scheduler."""
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
            down_block_types=("DownEncoderBlock2D",) * 4, latent_channels=4)
        image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=32, projection_dim=32, num_hidden_layers=2, num_attention_heads=4, image_size=224,
            patch_size=32, intermediate_size=37))
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="v_prediction", interpolation_type="linear", use_karras_sigmas=True, sigma_min=0.002,
        sigma_max=700.0, timestep_spacing="leading", timestep_type="continuous", steps_offset=1)
    return StableVideoDiffusionPipeline(vae=vae, image_encoder=image_encoder, unet=unet, scheduler=scheduler,
                                        feature_extractor=CLIPImageProcessor(crop_size=224, size=224))


def _offline_message(model: str, err: Exception) -> str:
    return (f"could not load the SVD pipeline '{model}' ({type(err).__name__}: {_first_line(err)}). No network or no "
            f"cached copy: on a machine that reaches huggingface.co run `hf download {model} --local-dir DIR` (the "
            f"repository is gated: accept its licence and log in first), copy DIR here and pass --model DIR; or "
            f"pre-fill the Hugging Face cache (HF_HOME) and keep HF_HUB_OFFLINE=1. For a weight-free run use "
            f"--model tiny-random.")


def load_pipeline(model: str, dtype: torch.dtype, device: str, *, variant: str = "auto", seed: int = 0,
                  num_frames: int = 14, offline: bool | None = None):
    """A ``StableVideoDiffusionPipeline`` in ``dtype`` on ``device``: ``tiny-random`` (built from ``seed``,
    ``num_frames``), a local diffusers folder or a hub id (the local cache first; never the network when
    ``offline``, default ``HF_HUB_OFFLINE``). ``variant``: ``auto`` = ``fp16`` for hub ids, none for folders.

    Raises:
        FileNotFoundError: ``model`` looks like a path but is not a directory.
        PipelineUnavailable: not cached and not downloadable, or an incomplete folder; one line naming the fix.
    """
    from diffusers import StableVideoDiffusionPipeline as Pipe

    if model == "tiny-random":
        return build_tiny_pipeline(seed, num_frames).to(device=device, dtype=dtype)
    if os.path.isdir(model):
        try:
            return Pipe.from_pretrained(model, torch_dtype=dtype, variant=None if variant in ("auto", "none")
                                        else variant, local_files_only=True).to(device)
        except (OSError, ValueError) as e:  # a missing component, weight file or variant
            raise PipelineUnavailable(f"the folder {model!r} does not hold a complete {Pipe.__name__} "
                                      f"({_first_line(e)}); download it again with `hf download {MODEL_IDS[0]} "
                                      f"--local-dir DIR` or pass --variant") from e
    if _is_path(model):
        raise FileNotFoundError(f"--model {model!r} is not a directory; pass a local diffusers folder of "
                                f"{MODEL_IDS[0]} (or -xt), a hub id, or tiny-random")
    var = "fp16" if variant == "auto" else (None if variant == "none" else variant)
    if offline is None:
        from huggingface_hub import constants

        offline = bool(constants.HF_HUB_OFFLINE)
    for local in (True, False) if not offline else (True,):  # the local cache first: no network, fast
        try:
            return Pipe.from_pretrained(model, torch_dtype=dtype, variant=var, local_files_only=local).to(device)
        except Exception as e:  # noqa: BLE001 - diffusers raises OSError / EnvironmentError / hub errors
            error = e
    raise PipelineUnavailable(_offline_message(model, error)) from error


# ------------------------------------------------------------------------------------------------ runs, arguments
def parse_modes(text: str, reference: str) -> list[str]:
    """Comma list -> run names, reference first, duplicates removed; ValueError for an unknown name."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    for m in names + [reference]:
        if m not in set(mode_names()) | set(NATIVE):
            raise ValueError(f"--modes / --reference: {m!r} is not known; expected visionattn modes "
                             f"{mode_names()} or {list(NATIVE)}")
    return list(dict.fromkeys([reference] + names))


def run_dtype(name: str, dtype_arg: str, device: str) -> torch.dtype:
    """Pipeline dtype of run ``name``: ``native-X`` in X; otherwise ``dtype_arg`` unless ``auto``: then the mode's
    half compute dtype on CUDA (fp16 / bf16), else float32."""
    if NATIVE.get(name) is not None:
        return NATIVE[name]
    if dtype_arg != "auto":
        return DTYPES[dtype_arg]
    if device == "cpu" or name == "native":
        return torch.float32
    cd = get_mode(name).compute_dtype
    return cd if cd in (torch.float16, torch.bfloat16) else torch.float32


def add_run_args(p: argparse.ArgumentParser, modes: str) -> None:
    """The arguments of both SVD tools: runs (``modes`` by default), dtype, video shape, seed, device."""
    p.add_argument("--modes", default=modes, help=f"comma list of runs: visionattn modes {mode_names()} or "
                   f"{list(NATIVE)} (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="pipeline (or module) dtype for non-native runs; auto: the mode's dtype on CUDA, fp32 on CPU")
    p.add_argument("--frames", type=positive_int, default=14, help="video frames (14 for img2vid, 25 for img2vid-xt)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of every random draw: latents, noise augmentation, inputs, random weights")
    p.add_argument("--height", type=positive_int, default=576, help="video height in pixels (multiple of 8)")
    p.add_argument("--width", type=positive_int, default=1024, help="video width in pixels (multiple of 8)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def check_run_args(parser: ToolParser, args, reference: str):
    """Resolve and check ``--device`` (default: cuda when available), the shape and the runs (exit 2 if bad);
    returns the ``torch.device``."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = check_device(parser, args.device)
    if args.height % 8 or args.width % 8:
        parser.error(f"--height {args.height} / --width {args.width}: both must be multiples of 8")
    try:
        parse_modes(args.modes, reference)
    except ValueError as e:
        parser.error(str(e))
    return device


def jsonable(x):
    """``x`` with non-finite floats as strings (strict JSON), through dicts, lists and tuples."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    return [jsonable(v) for v in x] if isinstance(x, (list, tuple)) else x


def free_memory(device: str) -> None:
    """Return the CUDA allocator's cached blocks (between two models: one load per dtype)."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ generation
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
    f = pipe.vae_scale_factor
    return torch.randn((1, frames, pipe.unet.config.in_channels // 2, height // f, width // f),
                       generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)


def generate(pipe, image, args, device: str) -> dict:
    """One pipeline call with fixed seed and latents; frames as float32 [F, H, W, 3] in [0, 1] + stats."""
    latents = initial_latents(pipe, args.frames, args.height, args.width, args.seed).to(device, pipe.unet.dtype)
    bad_steps, cuda = [], device.startswith("cuda")

    def on_step(_pipe, i, _t, kw):
        if not bool(torch.isfinite(kw["latents"]).all()):
            bad_steps.append(int(i))
        return kw

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with _timed_module(pipe.unet, device) as unet_time, Stopwatch("cpu") as wall:
        if cuda:
            torch.cuda.synchronize()
        frames = pipe(image, height=args.height, width=args.width, num_frames=args.frames,
                      num_inference_steps=args.steps, decode_chunk_size=args.decode_chunk_size,
                      motion_bucket_id=args.motion_bucket_id, fps=args.fps, noise_aug_strength=args.noise_aug,
                      generator=torch.Generator("cpu").manual_seed(args.seed), latents=latents,
                      output_type="np", callback_on_step_end=on_step).frames[0]
        if cuda:
            torch.cuda.synchronize()
    return {"frames": np.asarray(frames, dtype=np.float32), "latency_s": wall.seconds, "unet_s": unet_time.seconds,
            "unet_calls": unet_time.count, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda
            else None, "nonfinite_latent_steps": bad_steps}


# ------------------------------------------------------------------------------------------------ fidelity
def frame_metrics(frames: np.ndarray, ref: np.ndarray) -> dict:
    """Per-frame PSNR / SSIM / max-abs of ``frames`` vs ``ref`` ([F, H, W, 3]); frames with NaN/inf get None."""
    out = {"psnr_db": [], "ssim": [], "max_abs": []}
    for f, r in zip(frames, ref):
        ok = np.isfinite(f).all() and np.isfinite(r).all()
        for key, fn in (("psnr_db", psnr), ("ssim", ssim), ("max_abs", lambda f, r: float(np.abs(f - r).max()))):
            out[key].append(fn(f, r) if ok else None)
    return out


# ------------------------------------------------------------------------------------------------ outputs
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


def write_png(path: str, image) -> None:
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG")


def to_markdown(res: dict) -> str:
    cfg = res["config"]
    lines = md_header(f"SVD img2vid per attention mode ({cfg['model']})", res["environment"],
                      f"diffusers {res['environment'].get('diffusers')}; image `{cfg['image']}`, {cfg['frames']} "
                      f"frames at {cfg['height']}x{cfg['width']}, "
                      f"{cfg['steps']} steps, seed {cfg['seed']}; {cfg['warmup']} untimed warm-up generation(s) per run"
                      + ("; CPU run: a smoke test of the path, timings are not representative" if cfg["device"] == "cpu"
                         else ""),
                      f"reference run `{cfg['reference']}`: metrics per frame vs it (PSNR / SSIM worst frame, max-abs "
                      "over all frames, pixels in [0, 1]); `dtype` is the pipeline's (the attention runs the mode's "
                      "own arithmetic)")
    ref = lambda name, v: "ref" if name == cfg["reference"] else v  # noqa: E731
    rows = [[name, r["pipeline_dtype"], r["processor"], r["latency_s"], r["unet_s"],
             "-" if r["peak_memory_gib"] is None else r["peak_memory_gib"], r["nonfinite_frames"],
             len(r["nonfinite_latent_steps"]), r["overflow"]["overflow_events"], r["overflow"]["nonfinite_outputs"],
             ref(name, r["min_psnr_db"]), ref(name, r["min_ssim"]), ref(name, r["max_abs"])]
            for name, r in res["runs"].items()]
    lines.append(markdown_table(rows, ["run", "dtype", "attention", "latency s", "UNet s", "peak GiB",
                                       "NaN/inf frames", "NaN latent steps", "overflow events",
                                       "non-finite attn outputs", "min PSNR dB", "min SSIM", "max abs"]))
    lines.append("\n`overflow events`: attention calls whose output held NaN/inf although q, k, v were finite; "
                 "`non-finite attn outputs` also counts calls fed NaN by an earlier layer.\n")
    return "\n".join(lines)


def evaluate(args, folder: str | None = None) -> dict:
    """Generate once per run, compare with the reference run, write videos / grids / markdown / JSON into
    ``folder`` (default ``args.out``)."""
    from diffusers.utils import export_to_video
    from PIL import Image

    folder, device = args.out if folder is None else folder, args.device
    if args.quiet:  # also diffusers' own bar while it loads a pipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
    runs = parse_modes(args.modes, args.reference)
    image = read_rgb(args.image).resize((args.width, args.height), Image.BICUBIC)
    plan = [(name, run_dtype(name, args.dtype, device)) for name in runs]
    res = {"environment": environment(), "config": dict(vars(args)), "runs": {}}
    outputs, (pipe, dtype) = {}, (None, None)

    def load(dtype):
        p = load_pipeline(args.model, dtype, device, variant=args.variant, seed=args.seed, num_frames=args.frames)
        p.set_progress_bar_config(disable=True)
        return p

    for i in tqdm(sorted(range(len(plan)), key=lambda i: (DTYPE_NAMES[plan[i][1]], i)), desc="modes",
                  disable=args.quiet):
        name = plan[i][0]
        if plan[i][1] != dtype:
            pipe = None
            free_memory(device)
            pipe, dtype = load(plan[i][1]), plan[i][1]
        report = None
        if name not in NATIVE:
            report = patch_diffusers(pipe.unet, name, count_overflow=not args.no_count_overflow)
            if args.patch_vae:
                report["vae"] = patch_diffusers(pipe.vae, name, count_overflow=not args.no_count_overflow)
        try:
            for _ in range(args.warmup):
                generate(pipe, image, argparse.Namespace(**{**vars(args), "steps": 1}), device)
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
        outputs[name] = frames = out.pop("frames")
        res["runs"][name] = {"pipeline_dtype": DTYPE_NAMES[dtype], "processor": "diffusers default" if report is None
                             else f"ELSAAttnProcessor({name})", "patch_report": report, **out, "overflow": overflow,
                             "nonfinite_frames": int((~np.isfinite(frames).reshape(len(frames), -1).all(1)).sum())}
        with atomic_path(os.path.join(folder, f"{name}.mp4")) as tmp:  # imageio-ffmpeg
            export_to_video(list(_to_uint8(frames)), tmp, fps=args.fps)
        write_png(os.path.join(folder, f"{name}_grid.png"), frame_grid([frames], [name], args.grid_cols))
    res["runs"] = {name: res["runs"][name] for name in runs}  # report in the order asked
    for name in runs:
        m = frame_metrics(outputs[name], outputs[args.reference])
        worst = {k: [v for v in m[k] if v is not None] for k in m}
        res["runs"][name].update(per_frame=m, min_psnr_db=min(worst["psnr_db"], default=None),
                                 min_ssim=min(worst["ssim"], default=None), max_abs=max(worst["max_abs"], default=None))
    write_png(os.path.join(folder, "compare.png"), frame_grid([outputs[n] for n in runs], runs, args.grid_cols))
    res["files"] = sorted(os.listdir(folder))
    res = jsonable(res)
    write_json_atomic(os.path.join(folder, "results.json"), res)
    write_text_atomic(os.path.join(folder, "results.md"), to_markdown(res))
    return res


# ------------------------------------------------------------------------------------------------ CLI
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
    p.add_argument("--out", default=default_out("eval_svd"),
                   help="output folder: new, empty or an earlier output of this tool (then replaced); written into a "
                        "temporary folder renamed into place at the end (default: %(default)s)")
    return p


def main(argv=None) -> dict:
    """Parse and check ``argv`` (exit 2 with one line before any work), then run the generation study with TF32
    off for PyTorch matmuls and cuDNN convolutions (said in the output); returns the results dict."""
    parser = build_parser()
    args = parser.parse_args(argv)
    device = check_run_args(parser, args, args.reference)
    if args.warmup is None:
        args.warmup = 1 if device.type == "cuda" else 0
    check_image(parser, "--image", args.image, example="tests/data/photos/apple.jpg")
    check_model(parser, args.model)
    check_output_folder(parser, args.out, tool=TOOL_ID, inputs=[args.image])
    with tf32_flags() as settings, output_folder(parser, args.out, tool=TOOL_ID, inputs=[args.image]) as tmp:
        print(f"process-wide settings for this run: {settings}")
        try:
            res = evaluate(args, tmp)
        except PipelineUnavailable as e:  # nothing is kept: the temporary folder is removed
            parser.error(f"--model: {e}")
    print(to_markdown(res))
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
