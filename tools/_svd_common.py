"""Stable Video Diffusion pieces shared by tools/eval_svd.py and tools/bench_svd_attention.py.

Not part of the library: the run names (visionattn modes and ``native[-fp32|-fp16|-bf16]``,
diffusers' own processor) and the dtype each runs in, the SVD pipeline built from
small configs (``tiny-random``) or loaded from a folder or the hub, the arguments both
tools take, and JSON-safe floats.
"""
from __future__ import annotations

import argparse
import math
import os

import torch

from _harness import ToolParser, check_device, positive_int

from visionattn.modes import MODES, get_mode, mode_names

__all__ = ["MODEL_IDS", "NATIVE", "DTYPES", "DTYPE_NAMES", "PipelineUnavailable", "build_tiny_pipeline",
           "load_pipeline", "check_model", "parse_modes", "run_dtype", "add_run_args", "check_run_args", "jsonable"]

MODEL_IDS = ("stabilityai/stable-video-diffusion-img2vid", "stabilityai/stable-video-diffusion-img2vid-xt")
DTYPES = {m: MODES[m].compute_dtype for m in ("fp32", "fp16", "bf16")}  # the modes' dtypes, by mode name
NATIVE = {"native": None, **{f"native-{m}": dtype for m, dtype in DTYPES.items()}}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


# ------------------------------------------------------------------------------------------------
# pipelines
# ------------------------------------------------------------------------------------------------
class PipelineUnavailable(RuntimeError):
    """The SVD pipeline cannot be loaded (not cached, no network, an incomplete local folder); says how to fix it."""


def _is_path(model: str) -> bool:
    return model.startswith((".", "/", "~")) or os.sep in model.strip("/").split("/", 1)[-1]


def check_model(parser: ToolParser, model: str, flag: str = "--model") -> None:
    """Exit 2 with one line unless ``model`` is ``tiny-random``, a hub id, or a folder holding a diffusers
    ``StableVideoDiffusionPipeline`` (its ``model_index.json``, read by diffusers' ``load_config``)."""
    if model == "tiny-random" or not (os.path.isdir(model) or _is_path(model)):
        return
    fix = f"pass a folder made by `hf download {MODEL_IDS[0]} --local-dir DIR` (or -xt), a hub id, or tiny-random"
    if not os.path.isdir(model):
        parser.error(f"{flag} {model!r} is not a directory; {fix}")
    from diffusers import StableVideoDiffusionPipeline

    try:
        config = StableVideoDiffusionPipeline.load_config(model, local_files_only=True)
    except (OSError, ValueError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        parser.error(f"{flag} {model!r} is not a diffusers pipeline folder ({why}); {fix}")
    name, want = config.get("_class_name"), StableVideoDiffusionPipeline.__name__
    if name != want:
        parser.error(f"{flag} {model!r} holds a {name or 'unnamed'} pipeline, not {want}; {fix}")
    # the components model_index.json names, each a sub-folder (an interrupted download lacks some)
    parts = [k for k, v in config.items() if not k.startswith("_") and isinstance(v, (list, tuple)) and v and v[0]]
    missing = [k for k in parts if not os.path.isdir(os.path.join(model, k))]
    if missing:
        parser.error(f"{flag} {model!r} lacks the sub-folder(s) {', '.join(missing)} its model_index.json names "
                     f"(an incomplete download?); {fix}")


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
    why = (str(err).splitlines() or [""])[0]
    return (f"could not load the SVD pipeline '{model}' ({type(err).__name__}: {why}). No network or no cached "
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
        PipelineUnavailable (a ``RuntimeError``): the hub model is neither cached nor downloadable, or the local
            folder lacks a part of the pipeline; the message (one line) names the model and the fix.
    """
    from diffusers import StableVideoDiffusionPipeline

    if model == "tiny-random":
        return build_tiny_pipeline(seed, num_frames).to(device=device, dtype=dtype)
    if os.path.isdir(model):
        var = None if variant in ("auto", "none") else variant
        try:
            pipe = StableVideoDiffusionPipeline.from_pretrained(model, torch_dtype=dtype, variant=var,
                                                                local_files_only=True)
        except (OSError, ValueError) as e:  # a missing component, weight file or variant
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise PipelineUnavailable(f"the folder {model!r} does not hold a complete "
                                      f"{StableVideoDiffusionPipeline.__name__} ({why}); download it again with "
                                      f"`hf download {MODEL_IDS[0]} --local-dir DIR` or pass --variant") from e
        return pipe.to(device)
    if _is_path(model):
        raise FileNotFoundError(f"--model {model!r} is not a directory; pass a local diffusers folder of "
                                f"{MODEL_IDS[0]} (or -xt), a hub id, or tiny-random")
    var = "fp16" if variant == "auto" else (None if variant == "none" else variant)
    offline = _hub_offline() if offline is None else offline
    try:  # the local cache first: no network, fast
        return StableVideoDiffusionPipeline.from_pretrained(model, torch_dtype=dtype, variant=var,
                                                            local_files_only=True).to(device)
    except Exception as e:  # noqa: BLE001 - diffusers raises OSError / EnvironmentError / hub errors
        if offline:
            raise PipelineUnavailable(_offline_message(model, e)) from e
    try:
        return StableVideoDiffusionPipeline.from_pretrained(model, torch_dtype=dtype, variant=var).to(device)
    except Exception as e:  # noqa: BLE001
        raise PipelineUnavailable(_offline_message(model, e)) from e


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
    """Pipeline dtype of run ``name``.

    ``native-X`` runs in X; any other run in ``dtype_arg`` unless it is ``auto``: then in
    the mode's compute dtype on CUDA (fp32 modes in float32, fp16/pasa in float16, bf16
    in bfloat16) and in float32 on CPU (half convolutions on CPU are ~10x slower; the
    attention still runs the mode's arithmetic).
    """
    if NATIVE.get(name) is not None:
        return NATIVE[name]
    if dtype_arg != "auto":
        return DTYPES[dtype_arg]
    if device == "cpu" or name == "native":
        return torch.float32
    cd = get_mode(name).compute_dtype
    return cd if cd in (torch.float16, torch.bfloat16) else torch.float32


# ------------------------------------------------------------------------------------------------
# arguments and JSON
# ------------------------------------------------------------------------------------------------
def add_run_args(p: argparse.ArgumentParser, modes: str) -> None:
    """The arguments of both tools: runs (``modes`` by default), dtype, video shape, seed."""
    p.add_argument("--modes", default=modes,
                   help=f"comma list of runs: visionattn modes {mode_names()} or {list(NATIVE)}")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="pipeline (or module) dtype for non-native runs; auto: the mode's dtype on CUDA, fp32 on CPU")
    p.add_argument("--frames", type=positive_int, default=14, help="video frames (14 for img2vid, 25 for img2vid-xt)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of every random draw: latents, noise augmentation, inputs, random weights")
    p.add_argument("--height", type=positive_int, default=576, help="video height in pixels (multiple of 8)")
    p.add_argument("--width", type=positive_int, default=1024, help="video width in pixels (multiple of 8)")


def check_run_args(parser: ToolParser, args, reference: str):
    """Resolve ``--device`` (default: cuda when available) and check it, the shape and the runs; exit 2 if bad.

    Returns:
        the ``torch.device``.
    """
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
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
