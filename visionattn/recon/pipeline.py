"""Image folder -> VGGT / FastVGGT / π³ / Pi3X predictions -> reconstruction on disk.

:func:`build_model` makes the network (released weights, a local checkpoint, or
random weights in the full or a tiny configuration), :func:`run_model` runs it
on a preprocessed batch and returns numpy predictions with cameras decoded (π³ and
Pi3X converted to VGGT's conventions by :mod:`visionattn.recon.pi3`), and
:func:`reconstruct` is the whole demo: load, infer, export, preview, summary.
:func:`estimate_seconds` says beforehand how long the forward will take (:func:`forward_flops` over the
throughputs of :data:`THROUGHPUT`: an order of magnitude).
Every anticipated user error (bad folder, corrupt image, unusable ``out_dir``,
weights not available offline) raises :class:`ReconstructionError` subclasses
(all ``ValueError``) before anything is written.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import tempfile
import time

import numpy as np
import torch

from visionattn.provenance import environment

from .colmap import require_pycolmap
from .images import DecodeStopped, ImageFolderError, LoadedImages, load_images
from .pi3 import PI3_MODELS, decode_pi3
from .priors import CameraFileError, match_cameras, read_camera_file
from .export import (MissingDependencyError, OutputDirError, atomic_output_dir, check_output_dir,
                     write_reconstruction)
from .points import check_trimesh, require_trimesh

__all__ = [
    "DEFAULT_WEIGHTS", "MODELS", "MODEL_WEIGHTS", "default_weights", "ATTN_MODES", "WeightsError", "DeviceError",
    "USER_ERRORS",
    "check_checkpoint", "resolve_device", "load_source", "build_model",
    "run_model", "demo_autocast_dtype", "count_tokens", "reconstruct", "PIXEL_ARRAYS", "HOST_MEMORY",
    "prediction_bytes",
    "available_host_memory", "prediction_store", "start_compile_ahead", "Stages", "STAGES",
    "forward_flops", "estimate_seconds", "THROUGHPUT", "format_seconds", "frames_within", "slow_cpu_warning",
    "SLOW_CPU_SECONDS", "TARGET_CPU_SECONDS",
]

DEFAULT_WEIGHTS = "facebook/VGGT-1B"
MODELS = ("vggt", "fastvggt", *PI3_MODELS)
HEADS = ("fp32", "bf16", "fp16")  # VGGT / FastVGGT heads' precision (build_model(heads=...))
MODEL_WEIGHTS = {"vggt": DEFAULT_WEIGHTS, "fastvggt": DEFAULT_WEIGHTS, "pi3": "yyfz233/Pi3",
                 "pi3x": "yyfz233/Pi3X"}
"""Each model's released weights (the hub id ``weights=None`` stands for)."""
# visionattn precision modes the demo offers, plus "sdpa" (PyTorch's own attention, as a baseline)
ATTN_MODES = ("fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa", "sdpa")


class WeightsError(ValueError):
    """The requested weights cannot be loaded (offline hub, missing or corrupt file)."""


class DeviceError(ValueError):
    """The requested device does not exist or is not available here."""


# errors a CLI reports as a message + exit code 2 (nothing has been written when they are raised)
USER_ERRORS = (ImageFolderError, OutputDirError, WeightsError, DeviceError, MissingDependencyError, CameraFileError)


def default_weights(model: str) -> str:
    """The hub id of ``model``'s released weights (:data:`MODEL_WEIGHTS`).

    Raises:
        ValueError: unknown ``model``.
    """
    if model not in MODEL_WEIGHTS:
        raise ValueError(f"model={model!r} is not known; expected one of {MODELS}")
    return MODEL_WEIGHTS[model]


def _models_api():
    try:
        from visionattn.models import FASTVGGT_MERGING, VGGT, vggt_tiny_config
        from visionattn.models.geometry import pose_encoding_to_extri_intri, unproject_depth_map_to_point_map
    except ImportError as exc:  # the model package is a separate install unit; say exactly what failed
        raise ImportError(f"the reconstruction pipeline needs visionattn.models (VGGT): {exc}") from exc
    return VGGT, vggt_tiny_config, FASTVGGT_MERGING, pose_encoding_to_extri_intri, unproject_depth_map_to_point_map


def demo_autocast_dtype(mode: str, device) -> torch.dtype | None:
    """The autocast dtype of the demo's forward: on a GPU the half dtype a half-precision ``mode`` computes attention
    in (``bf16``: bfloat16; ``fp16``, ``pasa``: float16), so the linear layers run in it too, as the official VGGT
    and π³ demos run the model (bf16 autocast, FP32 weights); None (everything FP32) for the FP32-accurate modes,
    ``sdpa`` and on the CPU."""
    from visionattn.kernels.modes import get_mode

    if torch.device(device).type != "cuda" or _check_mode(mode) is None:
        return None
    dtype = get_mode(mode).compute_dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def _check_mode(mode: str) -> str | None:
    if mode not in ATTN_MODES:
        raise ValueError(f"mode={mode!r} is not known; expected one of {ATTN_MODES}")
    return None if mode == "sdpa" else mode


_HUB_HELP = ("Without network access pass a local checkpoint with `--weights PATH` (a folder or a "
             ".safetensors/.pt file of the hub checkpoint: facebook/VGGT-1B, yyfz233/Pi3 or yyfz233/Pi3X), or run "
             "with random weights: `--weights random` (full model) or `--weights random-tiny` (tiny, CPU).")


def _reachable_weights(weights: str, timeout: float = 3.0) -> str:
    """``weights`` itself if it is a local path, offline mode is on, or the hub answers; else the cached file.

    huggingface_hub retries an unreachable host for about a minute before it gives
    up; one TCP connect with a short timeout tells the same in seconds. When the
    hub is unreachable, a cached ``model.safetensors`` / ``model.pt`` of the repo
    is used directly; without one, :class:`WeightsError` is raised at once.
    """
    import socket
    from urllib.parse import urlparse

    if os.path.exists(weights):
        return weights
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        return weights  # huggingface_hub resolves from its cache without touching the network
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return weights
    except OSError as exc:
        reason = f"cannot reach {url.hostname} ({exc})"
    try:
        for fname in ("model.safetensors", "model.pt"):
            cached = try_to_load_from_cache(weights, fname)
            if isinstance(cached, str):
                return cached
    except ValueError as exc:  # not a valid repo id either
        raise WeightsError(f"--weights {weights!r} is neither an existing path nor a hub repo id ({exc}). "
                           + _HUB_HELP) from exc
    raise WeightsError(f"cannot load weights {weights!r}: {reason} and it is not in the Hugging Face cache "
                       f"({constants.HF_HUB_CACHE}). " + _HUB_HELP)


def build_model(model: str = "vggt", weights: str | None = None, mode: str = "fp32",
                device: str | torch.device = "cpu", seed: int = 0, heads: str | None = None) -> torch.nn.Module:
    """Build VGGT, FastVGGT, π³ or Pi3X in eval mode on ``device``.

    Args:
        model: ``"vggt"``, ``"fastvggt"`` (token merging in global attention), ``"pi3"``
            (:class:`~visionattn.models.Pi3`) or ``"pi3x"`` (:class:`~visionattn.models.Pi3X`).
        weights: a hub id, a local checkpoint path, ``"random"`` (the released configuration, random init)
            or ``"random-tiny"`` (tiny configuration for CPU / CI: ``vggt_tiny_config``, ``pi3_tiny_config``,
            ``pi3x_tiny_config``); None: the model's released weights (:data:`MODEL_WEIGHTS`).
        mode: attention precision, one of :data:`ATTN_MODES` (``"sdpa"``: PyTorch SDPA).
        seed: seed for random weights (same seed -> same model).
        heads: VGGT / FastVGGT: the precision of the camera, depth and point heads, one of :data:`HEADS`
            (None: ``"fp32"``, VGGT's FP32 heads; the official FastVGGT code runs them in ``"bf16"``). π³ / Pi3X
            run their heads as their code does: only None is accepted.

    Raises:
        ValueError: unknown ``model`` / ``mode``.
        WeightsError: hub weights unavailable (offline) or a path that does not exist.
    """
    VGGT, tiny_config, merging_cfg, _, _ = _models_api()
    weights = default_weights(model) if weights is None else weights
    cls = VGGT
    if model in PI3_MODELS:
        from visionattn.models import Pi3, Pi3X, pi3_tiny_config, pi3x_tiny_config

        cls, tiny_config = (Pi3, pi3_tiny_config) if model == "pi3" else (Pi3X, pi3x_tiny_config)
    elif model not in MODELS:
        raise ValueError(f"model={model!r} is not known; expected one of {MODELS}")
    attn_mode = _check_mode(mode)
    kwargs = {"attn_mode": attn_mode}
    if heads is not None:
        if heads not in HEADS:
            raise ValueError(f"heads={heads!r}; expected one of {HEADS}")
        if model in PI3_MODELS:
            raise ValueError(f"heads={heads!r} applies to vggt / fastvggt; model={model!r} runs its own heads")
        kwargs["heads_dtype"] = heads
    if model == "fastvggt":
        kwargs["merging"] = merging_cfg
    dev = torch.device(device)
    if weights in ("random", "random-tiny"):
        if weights == "random-tiny":
            kwargs = {**tiny_config(), **kwargs}
        # built on the device itself: the device's RNG fills the parameters in place, with no host init and copy
        # (the CPU's serial RNG is what takes VGGT-1B's 1.26 B parameters ~20 s); one seed, one model per device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), dev:
            torch.manual_seed(seed)
            net = cls(**kwargs)
    else:
        source = _reachable_weights(weights)
        try:  # built on the meta device, the weights read from the file straight onto the device (no init)
            net = cls.from_pretrained(source, device=dev, **kwargs)
        except Exception as exc:  # hub offline / not cached / bad file: one line naming the fix
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise WeightsError(f"cannot load weights {weights!r}: {why}. " + _HUB_HELP) from exc
    return net.to(dev).eval()


def count_tokens(model: torch.nn.Module, frames: int, hw: tuple[int, int], patch: int = 14) -> int:
    """Tokens in one global-attention sequence: frames x (special tokens + patches) (VGGT: camera + 4 registers;
    π³ / Pi3X: 5 registers)."""
    holder = getattr(model, "aggregator", model)  # VGGT keeps it on its aggregator, π³ on the model
    special = int(holder.patch_start_idx)
    return frames * (special + (hw[0] // patch) * (hw[1] // patch))


# run_model's per-pixel float32 arrays and their trailing dims ([S, H, W, *dims])
PIXEL_ARRAYS = {"depth": (), "depth_conf": (), "world_points": (3,), "world_points_conf": (),
                "world_points_from_depth": (3,), "images": (3,)}
_COPY_FRAMES = 16  # frames per device-to-host copy of the per-pixel arrays


def prediction_bytes(frames: int, height: int, width: int) -> int:
    """Host bytes of :func:`run_model`'s per-pixel arrays (:data:`PIXEL_ARRAYS`, float32) for ``frames`` frames of
    ``height`` x ``width`` pixels (48 bytes per pixel)."""
    per_pixel = sum(4 * int(np.prod(dims)) for dims in PIXEL_ARRAYS.values())
    return int(frames) * int(height) * int(width) * per_pixel


def available_host_memory() -> int:
    """Bytes of host memory available to new allocations without swapping (``psutil.virtual_memory().available``:
    Linux's ``MemAvailable``, the platform's equivalent elsewhere)."""
    import psutil

    return int(psutil.virtual_memory().available)


def _blocks(model: torch.nn.Module) -> list:
    """The model's transformer blocks (:class:`visionattn.models.layers.Block`), encoder and decoder."""
    from visionattn.models.layers import Block

    return [m for m in model.modules() if isinstance(m, Block)]


@contextlib.contextmanager
def _block_progress(model: torch.nn.Module, bar):
    """Advance ``bar`` by one as each transformer block (:class:`visionattn.models.layers.Block`, encoder and
    decoder) first runs in a forward, so a long forward shows where it is and tqdm's rate estimates the time
    left; a block that a frame-chunked stage runs several times counts once. Yields a callable that closes one
    forward (the bar moves to its end, the next forward counts afresh)."""
    blocks = _blocks(model)
    seen: set[int] = set()
    done = [0]

    def hook(module, args, output):
        if id(module) not in seen:
            seen.add(id(module))
            bar.update()

    def end_forward():
        done[0] += max(1, len(blocks))
        seen.clear()
        bar.update(done[0] - bar.n)

    handles = [b.register_forward_hook(hook) for b in blocks]
    try:
        yield end_forward
    finally:
        for h in handles:
            h.remove()


def _is_pi3(model: torch.nn.Module) -> bool:
    from visionattn.models import Pi3, Pi3X

    return isinstance(model, (Pi3, Pi3X))


def run_model(model: torch.nn.Module, images: torch.Tensor, device: str | torch.device = "cpu",
              progress: bool = True, warmup: int = 0, store: str | None = None, track_queries=None,
              conditions: dict | None = None, autocast_dtype: torch.dtype | None = None) -> dict:
    """Run VGGT, FastVGGT, π³ or Pi3X on one scene and decode cameras.

    π³ / Pi3X outputs are converted to VGGT's conventions by :func:`visionattn.recon.pi3.decode_pi3`
    (world = first camera, depth = local points' z, confidence = sigmoid of the logits, intrinsics fitted to
    the local points unless given).

    Args:
        model: from :func:`build_model`.
        images: float32 [S, 3, H, W] in [0, 1], H and W multiples of 14.
        warmup: untimed forward passes first (the first call compiles Triton kernels).
        store: an existing folder: the per-pixel arrays (:data:`PIXEL_ARRAYS`) are then ``.npy`` files there,
            returned as ``np.memmap`` views and filled a few frames at a time, so host memory holds only the
            pages in use (for reconstructions larger than the host memory; :func:`prediction_bytes` says how
            large). None: in host memory.
        track_queries: ``(query frames int [Q], frame 0 first; pixels (x, y) float [Q, N, 2])``
            (:func:`visionattn.recon.ba.query_plan`): also track these pixels of each query frame through the
            scene with VGGT's track head. The timed forward tracks frame 0's; the track features it computes
            ([S, C, H/2, W/2] floats, kept until the tracks are done) serve the other query frames
            (:func:`visionattn.recon.ba.track_from_features`). VGGT only.
        conditions: Pi3X only: ``{"intrinsics": [S, 3, 3] pixels of the model's frame, "poses": [S, 4, 4]
            camera-to-world OpenCV}``, either optional (:func:`visionattn.recon.priors.match_cameras`); given
            intrinsics are also the returned ones.
        autocast_dtype: the forward runs under ``torch.autocast`` of this dtype (the weights stay FP32; VGGT's
            heads keep their own precision, ``heads_dtype``), as the official demos run in half precision
            (:func:`demo_autocast_dtype`); None: no autocast. The outputs are decoded in FP32 either way.

    Returns:
        dict of numpy arrays: ``extrinsic`` [S, 3, 4] (OpenCV camera-from-world),
        ``intrinsic`` [S, 3, 3], ``depth`` [S, H, W], ``depth_conf`` [S, H, W],
        ``world_points`` [S, H, W, 3], ``world_points_conf`` [S, H, W],
        ``world_points_from_depth`` [S, H, W, 3], ``images`` [S, H, W, 3] (colours),
        ``intrinsic_fallback`` [S] bool (see :func:`_usable_intrinsics`);
        plus ``seconds`` (forward time, synchronised), ``warmup_seconds``, ``peak_memory_bytes``
        (CUDA max allocated, or process peak RSS on CPU) and ``peak_memory_kind``. With ``track_queries``:
        ``track`` [Q, S, N, 2] pixels, ``track_vis``, ``track_conf`` [Q, S, N], ``track_frames`` [Q],
        ``track_points`` [Q, N, 2] and ``track_seconds`` (the query frames after the first).
    """
    from tqdm.auto import tqdm

    from visionattn.models.vggt import autocast

    *_, to_extri_intri, unproject = _models_api()
    dev = torch.device(device)
    x = images.to(dev, torch.float32)
    H, W = x.shape[-2:]
    pi3 = _is_pi3(model)
    cond = {k: torch.as_tensor(v, dtype=torch.float32, device=dev)[None] for k, v in (conditions or {}).items()}
    if cond and not hasattr(model, "metric_head"):
        raise ValueError("conditions (known intrinsics / poses) need Pi3X (model='pi3x')")
    bar = tqdm(total=max(1, len(_blocks(model))) * (1 + warmup), desc="inference", unit="block", disable=not progress)

    def forward(*args, **kwargs):
        with autocast(dev.type, autocast_dtype):
            out = model(*args, **kwargs)
        return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in out.items()}

    with contextlib.ExitStack() as stack:  # the block hooks come off whatever the forward raises
        end_forward = stack.enter_context(_block_progress(model, bar)) if progress else (lambda: None)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in range(warmup):
                forward(x, **cond)
                end_forward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        warmup_seconds = time.perf_counter() - t0
        queries, features = None, {}
        if track_queries is not None:
            if pi3 or getattr(model, "track_head", None) is None:
                raise ValueError("tracking needs a model with a track head (enable_track=True)")
            frames_q, points_q = np.asarray(track_queries[0], np.int64), np.asarray(track_queries[1], np.float32)
            if frames_q[0] != 0:
                raise ValueError(f"track_queries: the first query frame must be 0, got {frames_q.tolist()}")
            queries = torch.as_tensor(points_q[0], device=dev)[None]
            hook = model.track_head.feature_extractor.register_forward_hook(
                lambda module, args, output: features.update(fmaps=output))
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                if pi3:
                    out = forward(x, **cond)
                    given = (conditions or {}).get("intrinsics")  # float64, as the file gave them
                    given = None if given is None else torch.as_tensor(given, dtype=torch.float64)
                    extr, intr, pixels = decode_pi3(out, given)
                else:
                    out = forward(x, query_points=queries)
                    extr, intr = to_extri_intri(out["pose_enc"], (H, W))
                    extr, intr = extr[0], intr[0]

                    def pixels(f):
                        return {"depth": out["depth"][0, f, ..., 0], "depth_conf": out["depth_conf"][0, f],
                                "world_points": out["world_points"][0, f],
                                "world_points_conf": out["world_points_conf"][0, f]}
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
        finally:
            if queries is not None:
                hook.remove()
        seconds = time.perf_counter() - t0
        end_forward()
    bar.close()
    if dev.type == "cuda":
        peak, kind = int(torch.cuda.max_memory_allocated(dev)), "cuda_max_allocated"
    else:
        peak, kind = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process_peak_rss"

    def np32(t):
        return t.detach().float().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float32)

    intr, fixed = _usable_intrinsics(intr, (H, W))
    pred = {"extrinsic": extr.detach().double().cpu().numpy(), "intrinsic": intr.detach().double().cpu().numpy(),
            "intrinsic_fallback": fixed}
    S = images.shape[0]
    for name, dims in PIXEL_ARRAYS.items():
        shape = (S, H, W, *dims)
        pred[name] = np.empty(shape, np.float32) if store is None else np.lib.format.open_memmap(
            os.path.join(store, f"{name}.npy"), mode="w+", dtype=np.float32, shape=shape)
    with torch.inference_mode():
        for i in range(0, S, _COPY_FRAMES):  # a few frames at a time: host and device temporaries stay small
            f = slice(i, min(S, i + _COPY_FRAMES))
            maps = pixels(f)
            for name in ("depth", "depth_conf", "world_points", "world_points_conf"):
                pred[name][f] = np32(maps[name])
            pred["world_points_from_depth"][f] = np32(unproject(maps["depth"], extr[f], intr[f]))
            pred["images"][f] = np32(images[f].permute(0, 2, 3, 1))
    pred.update(seconds=seconds, warmup_seconds=warmup_seconds, peak_memory_bytes=peak, peak_memory_kind=kind)
    if queries is not None:
        pred.update(_track_query_frames(model, out, features.pop("fmaps"), frames_q, points_q, progress))
    return pred


def _track_query_frames(model, out: dict, fmaps: torch.Tensor, frames_q, points_q, progress: bool) -> dict:
    """Tracks of every query frame: frame 0's from the forward ``out``, the others' from its track features."""
    from tqdm.auto import tqdm

    from .ba import track_from_features

    t0 = time.perf_counter()
    got = [(out["track"][0], out["vis"][0], out["conf"][0])]
    with torch.inference_mode():
        for q, pts in zip(tqdm(frames_q[1:], desc="tracking", unit="frame", disable=not progress or len(frames_q) < 2),
                          points_q[1:]):
            got.append(track_from_features(model.track_head, fmaps, torch.as_tensor(pts, device=fmaps.device),
                                           int(q)))
    tracks, vis, conf = (torch.stack(t).float().cpu().numpy() for t in zip(*got))
    return {"track": tracks, "track_vis": vis, "track_conf": conf, "track_frames": frames_q, "track_points": points_q,
            "track_seconds": time.perf_counter() - t0}


FALLBACK_HFOV_DEG = 60.0


def _usable_intrinsics(K: torch.Tensor, hw) -> tuple[torch.Tensor, np.ndarray]:
    """Replace unusable predicted intrinsics [S, 3, 3] (non-finite or non-positive focal length).

    A predicted field of view of 0 (the camera head's ReLU, typical of random
    weights) gives an infinite focal length, which would collapse the depth
    unprojection onto the optical axis. Such frames get a pinhole with a 60 degree
    horizontal field of view instead; a warning names them and the returned mask
    marks them (also recorded in cameras.json as ``intrinsic_fallback``).
    """
    from visionattn.dispatch import warn_once

    K = K.clone()
    f = torch.stack([K[:, 0, 0], K[:, 1, 1]], -1)
    bad = ~(torch.isfinite(K).all(-1).all(-1) & (f > 0).all(-1))
    if bool(bad.any()):
        H, W = hw
        focal = (W / 2.0) / np.tan(np.radians(FALLBACK_HFOV_DEG) / 2.0)
        K[bad] = torch.tensor([[focal, 0.0, W / 2.0], [0.0, focal, H / 2.0], [0.0, 0.0, 1.0]],
                              dtype=K.dtype, device=K.device)
        warn_once("recon-fallback-intrinsics",
                  f"predicted focal length unusable (inf/NaN/<=0, e.g. random weights) in frames "
                  f"{bad.nonzero().flatten().tolist()}: using a {FALLBACK_HFOV_DEG:g} degree horizontal "
                  "field of view for them (marked intrinsic_fallback in cameras.json)")
    return K, bad.cpu().numpy()


def resolve_device(device: str | None) -> str:
    """``"auto"`` / None -> ``"cuda"`` if available else ``"cpu"``; anything else validated.

    Raises:
        DeviceError: not a device name torch knows (``--device foo``), CUDA / MPS not
            available, or a CUDA index beyond the devices present.
    """
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(f"--device {device!r} is not a device: use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise DeviceError(f"--device {device!r}: no CUDA device is available here; use --device cpu")
        if dev.index is not None and dev.index >= n:
            raise DeviceError(f"--device {device!r}: only {n} CUDA device(s) here (cuda:0..cuda:{n - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"--device {device!r}: MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise DeviceError(f"--device {device!r}: only cpu, cuda[:N] and mps are supported")
    return device


_CHECKPOINT_FILES = ("model.safetensors", "model.pt")


def check_checkpoint(path: str) -> str:
    """Open a local checkpoint's header (no tensor data read) and return the file to load.

    A folder must hold ``model.safetensors`` or ``model.pt``. A ``.safetensors``
    header is parsed; a ``.pt`` / ``.pth`` / ``.bin`` is memory-mapped with
    ``torch.load(weights_only=True, mmap=True)``, which reads its index only.

    Raises:
        WeightsError: no checkpoint file in the folder, an unknown extension, or a
            file that is truncated / not a checkpoint (one line naming the file).
    """
    file = path
    if os.path.isdir(path):
        found = [os.path.join(path, f) for f in _CHECKPOINT_FILES if os.path.isfile(os.path.join(path, f))]
        if not found:
            raise WeightsError(f"--weights {path!r} is a folder without {' or '.join(_CHECKPOINT_FILES)}")
        file = found[0]
    try:
        if file.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(file, framework="pt") as f:
                if not list(f.keys()):
                    raise ValueError("no tensors in it")
        elif file.endswith((".pt", ".pth", ".bin")):
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        else:
            raise WeightsError(f"--weights {file!r}: unknown checkpoint format; expected .safetensors or .pt")
    except WeightsError:
        raise
    except Exception as exc:  # safetensors, pickle and zip errors share no base class beyond Exception
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise WeightsError(f"--weights {file!r} is not a readable checkpoint ({why}); re-download it or pass "
                           "another file") from exc
    return file


def load_source(source: str, size: int = 518, preprocess: str = "crop", max_frames: int | None = None,
                fps: float | None = None, every: int | None = None, progress: bool = True,
                frames_dir: str | None = None, stop=None, on_first_frame=None) -> LoadedImages:
    """Load a folder of images or a video file (see :func:`~visionattn.recon.video.load_video`).

    ``stop``: a :class:`threading.Event` that stops the decoding before the next frame once set
    (:class:`~visionattn.recon.images.DecodeStopped`). ``on_first_frame(frames, H, W)``: called once with the
    predicted frame count and the first frame's size as soon as they are known (before the decode ends).

    Raises:
        ImageFolderError: unusable input; ``--fps`` / ``--every`` given for a folder.
    """
    from .video import VIDEO_EXTS, is_video, load_video

    if os.path.isfile(source) and not is_video(source):
        raise ImageFolderError(f"{source!r} is a file but not a video; pass a folder of images or a video file "
                               f"({', '.join(sorted(VIDEO_EXTS))})")
    if is_video(source):
        return load_video(source, size=size, mode=preprocess, fps=fps, every=every, max_frames=max_frames,
                          progress=progress, frames_dir=frames_dir, stop=stop, on_first_frame=on_first_frame)
    if fps is not None or every is not None:
        raise ImageFolderError(f"--fps / --every sample videos; {source!r} is not a video file "
                               "(for a folder use --max-frames)")
    return load_images(source, size=size, mode=preprocess, max_frames=max_frames, progress=progress,
                       frames_dir=frames_dir, stop=stop, on_first_frame=on_first_frame)


# where reconstruct keeps run_model's per-pixel arrays until they are exported (see prediction_store)
HOST_MEMORY = ("auto", "ram", "disk")


def prediction_store(host_memory: str, frames: int, hw: tuple[int, int], out_dir: str, stack: contextlib.ExitStack,
                     log=print) -> str | None:
    """The folder for :func:`run_model`'s ``store`` (None: host memory) under ``host_memory``: ``"ram"``: None;
    ``"disk"``: a new temporary folder beside ``out_dir`` that ``stack`` removes on exit; ``"auto"``: that folder
    only when the predictions (:func:`prediction_bytes`) would take over half the available host memory
    (:func:`available_host_memory`), said through ``log``.

    Raises:
        ValueError: an unknown ``host_memory``.
        OutputDirError: the folder beside ``out_dir`` has too little free disk for the predictions.
    """
    if host_memory not in HOST_MEMORY:
        raise ValueError(f"host_memory={host_memory!r}; expected one of {HOST_MEMORY}")
    need = prediction_bytes(frames, *hw)
    if host_memory == "ram":
        return None
    if host_memory == "auto":
        avail = available_host_memory()
        if need <= avail // 2:
            return None
        log(f"note: the predictions take {need / 2**30:.1f} GiB, over half the {avail / 2**30:.1f} GiB of free host "
            "memory: they wait for the export on disk beside the output folder")
    parent = os.path.dirname(os.path.abspath(out_dir))
    free = shutil.disk_usage(parent).free
    if free < need:
        raise OutputDirError(f"the predictions of {frames} frames take {need / 2**30:.1f} GiB on disk and "
                             f"{parent!r} has {free / 2**30:.1f} GiB free; free space there, or use fewer frames "
                             "(--max-frames)")
    return stack.enter_context(tempfile.TemporaryDirectory(prefix=".visionattn-predictions-", dir=parent))


def reconstruct(source: str, out_dir: str, model: str = "vggt", mode: str = "fp32",
                weights: str | None = None, device: str | None = None, conf_percentile: float = 50.0,
                max_frames: int | str | None = None, size: int = 518, preprocess: str = "crop",
                point_source: str = "depth", seed: int = 0, preview: bool = True,
                progress: bool = True, warmup: int = 0, log=print, fps: float | None = None,
                every: int | None = None, host_memory: str = "auto", compile_ahead: bool = True,
                max_points: int | None = None, colmap_text: bool = False, ba: bool = False,
                ba_query_frames: int = 8, ba_points: int = 512, ba_max_error: float = 8.0,
                intrinsics_file: str | None = None, poses_file: str | None = None, heads: str | None = None,
                warn=None, started: float | None = None) -> dict:
    """The whole demo: folder of images or video -> ``out_dir`` with points, cameras, depth, preview.

    Outputs are described in :mod:`visionattn.recon.export`; they are written to
    a temporary folder (created before any decoding, so an unwritable ``out_dir``
    fails at once) and renamed to ``out_dir`` at the end. Nothing is left behind
    if loading the input or the weights fails, or on Ctrl-C / SIGTERM / SIGHUP (see
    :func:`~visionattn.recon.outdir.handle_sigterm`).

    Args:
        source: a folder of images or a video file.
        model: ``"vggt"``, ``"fastvggt"``, ``"pi3"`` or ``"pi3x"`` (see :func:`build_model`).
        weights: as :func:`build_model` (None: the model's released weights).
        max_frames: use at most this many frames; ``"auto"``: the most that fit the free GPU memory
            (:func:`auto_max_frames`; no limit on the CPU), said in the log.
        fps, every: video sampling (see :func:`~visionattn.recon.video.frame_selector`).
        host_memory: where the per-pixel predictions wait for the export (:func:`prediction_store`): ``"auto"``
            (on disk, in a temporary folder beside ``out_dir``, when they would take over half the free host
            memory), ``"ram"`` or ``"disk"``.
        compile_ahead: on CUDA, compile the attention kernels of this mode and frame size in a background thread
            (:class:`visionattn.warmup.CompileAhead`) while the model is built and its weights load, instead of
            in the first forward; the summary's ``compile_ahead`` says how long it took and how long inference
            waited for it. (With ``max_frames="auto"`` the model is built first, and the first forward compiles.)
        max_points: cap ``points.ply`` and ``scene.glb`` at this many points (seeded random subset); the whole
            cloud then goes to ``points_full.ply``.
        colmap_text: write ``sparse/0`` as text too (pycolmap).
        ba: bundle-adjust the predicted cameras and points with pycolmap over tracks of VGGT's track head
            (:mod:`visionattn.recon.ba`): ``ba_points`` pixels in each of ``ba_query_frames`` frames, observations
            within ``ba_max_error`` pixels of their point's projection; ``sparse/0`` is then the refined model
            of the tracked points (the other outputs keep the network's cameras). VGGT / FastVGGT only.
        intrinsics_file, poses_file: Pi3X only: a COLMAP model folder or a ``transforms.json`` whose cameras
            condition the model (:mod:`visionattn.recon.priors`; matched to the frames by image file name):
            read before any decoding, matched once the frames are loaded; the summary's ``conditions`` names them.
        heads: VGGT / FastVGGT heads' precision (:func:`build_model`); the summary's ``heads`` states it.
            On a GPU a half-precision ``mode`` also runs the rest of the model under autocast of its dtype
            (:func:`demo_autocast_dtype`); the summary's ``autocast`` states it.
        log: called with each progress note (one line).
        warn: called with each warning the user should see even when ``log`` is silenced (one line): a forward
            estimated to take over :data:`SLOW_CPU_SECONDS` on a CPU (:func:`slow_cpu_warning`). None:
            :func:`warnings.warn` (``RuntimeWarning``).
        started: a ``time.perf_counter()`` reading from which the summary's ``setup`` and ``total`` count (the
            demo script passes the one it takes before its imports, so that the stages add up to the process's
            wall time but for the interpreter's start and exit); None: this call.

    Returns:
        summary dict: frames, tokens, points kept, ``inference_seconds`` (one forward, measured) and ``estimate_s``
        (:func:`estimate_seconds`, logged before it), ``seconds`` (wall seconds per stage: setup (the imports,
        the export's library among them, and the checks), decode_build, compile (what is left of the kernel
        compile that starts at the first decoded frame), warmup, inference, tracks, bundle_adjustment, export
        and other, which add up to total;
        ``decode_build`` is the wall of the frame decode and the model build, which run side by side, a thread
        decoding while the model is built, unless ``max_frames="auto"`` needs the model first; ``decode_build``
        also names each one's own seconds, ``{"decode", "build", "side_by_side"}``; ``export_outputs``: seconds
        each output's writer ran, side by side, so they overlap), peak memory
        (inference: CUDA max allocated or host RSS; plus the process's peak host RSS), mode, model, weights,
        image size, skipped files, out_dir; with ``ba`` also ``bundle_adjustment`` (thresholds, tracks kept,
        reprojection error before / after).

    Raises:
        ImageFolderError, OutputDirError, WeightsError, DeviceError, MissingDependencyError, CameraFileError:
            user errors (no output written).
        ValueError: bad arguments (also ``ba`` with π³ / Pi3X, camera files with another model than Pi3X).
    """
    t_start = time.perf_counter() if started is None else started
    weights = default_weights(model) if weights is None else weights
    if (intrinsics_file is not None or poses_file is not None) and model != "pi3x":
        raise ValueError(f"known intrinsics / poses condition Pi3X only (model='pi3x'), not model={model!r}")
    if ba and model in PI3_MODELS:
        raise ValueError(f"bundle adjustment tracks with VGGT's track head; model={model!r} has none")
    if not 0.0 <= conf_percentile <= 100.0:
        raise ValueError(f"conf_percentile={conf_percentile} must be in [0, 100]")
    if max_frames is not None and max_frames != "auto" and (not isinstance(max_frames, int) or max_frames < 1):
        raise ValueError(f"max_frames={max_frames!r}; expected a positive int, 'auto' or None")
    _check_mode(mode)
    if heads is not None and (heads not in HEADS or model in PI3_MODELS):
        raise ValueError(f"heads={heads!r}: expected one of {HEADS}, with model 'vggt' or 'fastvggt' "
                         f"(model={model!r})")
    if host_memory not in HOST_MEMORY:
        raise ValueError(f"host_memory={host_memory!r}; expected one of {HOST_MEMORY}")
    if max_points is not None and (not isinstance(max_points, int) or max_points < 1):
        raise ValueError(f"max_points={max_points!r}; expected a positive int or None")
    dev = resolve_device(device)
    check_output_dir(out_dir, inputs=[source])
    check_trimesh()  # points.ply and scene.glb need it: fail now, not after inference
    if ba or colmap_text:
        require_pycolmap()  # --ba and --colmap-text need it: fail now, with the install line
    if weights not in ("random", "random-tiny"):
        if os.path.exists(weights):
            check_checkpoint(weights)  # a corrupt file fails now, in one line, not after decoding
        else:
            _reachable_weights(weights)  # fail in seconds when offline, before decoding any image
    # camera files: read (and a bad one refused) before any decoding; matched to the frames once they are loaded
    cameras = {key: (path, read_camera_file(path)) for key, path in (("intrinsics", intrinsics_file),
                                                                     ("poses", poses_file)) if path is not None}
    opts = dict(source=source, out_dir=out_dir, model=model, mode=mode, weights=weights, dev=dev, cameras=cameras,
                conf_percentile=conf_percentile, max_frames=max_frames, size=size, preprocess=preprocess,
                point_source=point_source, seed=seed, preview=preview, progress=progress, warmup=warmup,
                log=log, fps=fps, every=every, host_memory=host_memory, compile_ahead=compile_ahead,
                max_points=max_points, colmap_text=colmap_text, ba=ba, ba_query_frames=ba_query_frames,
                ba_points=ba_points, ba_max_error=ba_max_error, heads=heads, warn=warn)
    stages = Stages()
    stages.add("setup", time.perf_counter() - t_start)  # imports (from started), argument and output folder checks
    # the temporary output folder exists from here on: an unwritable --out fails before any decoding; the
    # prediction store (if any) is removed before that folder is renamed into place
    with atomic_output_dir(out_dir, inputs=[source], warn=log) as tmp, contextlib.ExitStack() as stack:
        return _reconstruct_into(tmp, t_start, stages, stack=stack, **opts)


class Stages:
    """Wall seconds per stage of a run (``time.perf_counter``), in the order the stages first ran.

    ``with stages("export"): ...`` times a block; :meth:`add` adds seconds measured elsewhere; :meth:`report`
    adds ``other`` (the time in no stage) so that the stages add up to ``total``.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def report(self, total: float, names=()) -> dict:
        """``{stage: seconds}`` with every name of ``names`` (0 if it did not run), ``other`` and ``total``."""
        out = {n: 0.0 for n in names}
        out.update(self.seconds)
        out["other"] = max(0.0, total - sum(out.values()))
        out["total"] = total
        return out


def start_compile_ahead(mode: str, weights: str, device, images_shape: tuple[int, ...], model: str = "vggt",
                        heads: str | None = None):
    """A :class:`visionattn.warmup.CompileAhead` of the kernels VGGT's forward in ``mode`` uses on ``images_shape``
    ([S, 3, H, W] frames; :func:`visionattn.models.vggt_attention_shapes`, with the heads' precision ``heads`` as
    :func:`build_model` takes it), or ``None`` where nothing compiles ahead (the CPU, ``mode="sdpa"``, and π³ /
    Pi3X, whose kernels compile in their first forward). Start it before the model's first forward; FastVGGT uses
    the same kernels."""
    if torch.device(device).type != "cuda" or _check_mode(mode) is None or model in PI3_MODELS:
        return None
    _, tiny_config, _, _, _ = _models_api()  # a missing model package fails here, with the clear message
    from ..models import vggt_attention_shapes
    from ..warmup import CompileAhead

    config = {**(tiny_config() if weights == "random-tiny" else {}), "heads_dtype": heads}
    S, _, H, W = images_shape
    return CompileAhead(mode, vggt_attention_shapes(S, H, W, **config), device=str(device))


# ----------------------------------------------------------------------------- how long the forward takes
def _model_config(model: str, config: dict | None) -> dict:
    """The full constructor config of ``model`` (:data:`MODELS`): the class's defaults (the released
    configuration) updated with ``config`` (e.g. ``vggt_tiny_config()``).

    Raises:
        ValueError: unknown ``model``.
    """
    import inspect

    from visionattn.models import VGGT, Pi3, Pi3X

    if model not in MODELS:
        raise ValueError(f"model={model!r} is not known; expected one of {MODELS}")
    cls = {"pi3": Pi3, "pi3x": Pi3X}.get(model, VGGT)
    cfg = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
           if p.default is not inspect.Parameter.empty}
    cfg.update(config or {})
    return cfg


def _blocks_flops(rows: int, keys: int, dim: int, mlp_ratio: float) -> tuple[float, float]:
    """(dense, attention) FLOPs of one transformer block over ``rows`` query tokens that each attend to ``keys``
    tokens, width ``dim``: qkv + projection + MLP (2 x (4 + 2 r) dim^2 per row) and q k^T + p v
    (4 x keys x dim per row)."""
    return 2.0 * rows * dim * dim * (4 + 2 * mlp_ratio), 4.0 * rows * keys * dim


def _dpt_flops(cfg: dict, h: int, w: int) -> float:
    """FLOPs of one VGGT DPT head on one frame (patch grid h x w): 1x1 projections of the four layers, their
    resampling to 4x, 2x, 1x and 1/2x the grid, the 3x3 ``layer_rn`` convolutions, the fusion blocks (two 3x3
    residual units each, one in the coarsest) and the output convolutions at 8x the grid and at full resolution."""
    F, oc, p = cfg["dpt_features"], cfg["dpt_out_channels"], cfg["patch_size"]
    g = h * w
    pix = (16 * g, 4 * g, g, g / 4)  # the four branches' pixels after resampling
    fl = sum(2.0 * g * 2 * cfg["embed_dim"] * c for c in oc)  # projections from the 2C-wide tokens
    fl += 2.0 * (16 * g * oc[0] ** 2 + 4 * g * oc[1] ** 2 + 9 * g / 4 * oc[3] ** 2)  # transposed convs, stride 2
    fl += sum(18.0 * n * c * F for n, c in zip(pix, oc))  # layer_rn: 3x3, oc -> F
    rcu = 36.0 * F * F  # one residual unit per pixel: two 3x3 F -> F convolutions
    fl += rcu * g / 4 + 2.0 * F * F * g  # refinenet4 (one unit), out_conv after the upsampling
    fl += sum(2 * rcu * n + 2.0 * F * F * 4 * n for n in pix[2::-1])  # refinenet3..1
    fl += 18.0 * F * (F // 2) * 64 * g  # output_conv1 at 8x the grid
    fl += 2.0 * h * p * w * p * (9 * (F // 2) * 32 + 32 * 4)  # output_conv2 at full resolution
    return fl


def _conv_head_flops(cfg: dict, h: int, w: int, outputs: int) -> float:
    """FLOPs of one Pi3X convolutional head on one frame: x2 upsamplers (transposed 2x2 + 3x3 conv, residual blocks
    of two 3x3 convolutions through twice the width) and ``outputs`` output blocks at full resolution."""
    dims, n, fl = [cfg["head_embed_dim"], *cfg["conv_dims"]], h * w, 0.0
    for cin, cout in zip(dims[:-1], dims[1:]):
        n *= 4
        fl += 2.0 * n * (cin + 2) * cout + 18.0 * n * cout * cout + cfg["conv_res_blocks"] * 72.0 * n * cout * cout
    last = cfg["conv_last_channels"]
    return fl + outputs * 2.0 * h * cfg["patch_size"] * w * cfg["patch_size"] * (9 * (dims[-1] + 2) * last + 3 * last)


def forward_flops(model: str, frames: int, height: int, width: int, config: dict | None = None) -> dict[str, float]:
    """FLOPs of one inference forward of the demo's network (no track queries, no Pi3X conditions), analytic.

    Counts the matrix products only (2 FLOPs per multiply-add; norms, activations, RoPE and resampling are left
    out): the DINOv2 encoder and every transformer block (per-frame attention over one frame's tokens: linear in
    ``frames``; global attention over all frames' tokens: quadratic in ``frames``; FastVGGT's global attention over
    its merged sequence, plus the merge's similarity products), the head decoders and the convolutional heads (VGGT's
    DPT depth and point heads, Pi3X's convolutional heads: linear in ``frames`` and in pixels).

    Args:
        model: one of :data:`MODELS` (``"fastvggt"``: VGGT with :data:`~visionattn.models.FASTVGGT_MERGING`).
        frames: S >= 1.
        height, width: the preprocessed frame size in pixels (multiples of the patch size, 14).
        config: constructor arguments that differ from the released configuration (e.g.
            :func:`~visionattn.models.vggt_tiny_config` ``()``); None: the released model.

    Returns:
        ``{"dense": FLOPs, "attention": FLOPs}``: the products the network's own precision runs (linear layers,
        convolutions) and those of attention proper (q k^T and p v, in the attention ``mode``).

    Raises:
        ValueError: unknown ``model``, ``frames`` < 1 or a size that is not a positive multiple of the patch size.
    """
    cfg = _model_config(model, config)
    p, C, r = cfg["patch_size"], cfg["embed_dim"], cfg["mlp_ratio"]
    if frames < 1:
        raise ValueError(f"frames={frames} must be >= 1")
    if height < p or width < p or height % p or width % p:
        raise ValueError(f"image size {height}x{width} must be a positive multiple of patch_size={p}")
    S, h, w = int(frames), height // p, width // p
    dense = attn = 0.0

    def add(blocks: int, rows: float, keys: float, dim: int) -> None:
        nonlocal dense, attn
        d, a = _blocks_flops(rows, keys, dim, r)
        dense, attn = dense + blocks * d, attn + blocks * a

    # DINOv2 encoder (patch embed): 1 class + 4 register tokens, per frame
    dense += 2.0 * S * h * w * 3 * p * p * C
    encoder_depth = cfg["encoder_depth"] if model in PI3_MODELS else cfg["patch_embed_depth"]
    add(encoder_depth, S * (5 + h * w), 5 + h * w, C)
    if model in PI3_MODELS:
        T = cfg["num_register_tokens"] + h * w
        add(cfg["depth"] // 2, S * T, T, C)  # frame blocks
        add(cfg["depth"] // 2, S * T, S * T, C)  # global blocks
        D = cfg["head_embed_dim"]
        for out in (D, D, cfg["camera_dim"]):  # point, confidence and camera decoders: per frame
            dense += 2.0 * S * T * (2 * C * D + D * out)
            add(cfg["head_depth"], S * T, T, D)
        if model == "pi3":  # linear heads: a patch of points (3) and of confidence (1) per token
            dense += 2.0 * S * h * w * D * p * p * 4
        else:  # convolutional heads, and the metric decoder: one token reading the projected context
            dense += S * (_conv_head_flops(cfg, h, w, 2) + _conv_head_flops(cfg, h, w, 1))
            md = cfg["metric_dim"]
            dense += 2.0 * S * T * 2 * C * md + cfg["metric_depth"] * 4.0 * S * T * md * md
            attn += cfg["metric_depth"] * 4.0 * S * T * md
        return {"dense": dense, "attention": attn}
    P = 1 + cfg["num_register_tokens"] + h * w
    N = S * P
    add(cfg["depth"], N, P, C)  # frame blocks
    if model == "fastvggt" and S > 1:
        from visionattn.models import FASTVGGT_MERGING as m

        sy, sx = m.region
        dest = P + (S - 1) * (1 + cfg["num_register_tokens"] + -(-h // sy) * -(-w // sx))
        merged = min(N - dest, int(m.ratio * N))
        L = N - merged + int(m.protect * N)  # the merged sequence: kept sources, destinations, protected
        plain = min(m.start_block, cfg["depth"])
        add(plain, N, N, C)
        d, _ = _blocks_flops(N, 0, C, r)
        blocks = cfg["depth"] - plain
        dense += blocks * d
        attn += blocks * (4.0 * L * L * C + 2.0 * (N - dest) * dest * C)  # merged attention + similarities
    else:
        add(cfg["depth"], N, N, C)  # global blocks
    if cfg["enable_camera"]:  # the camera trunk over one token per frame, 4 iterations
        add(4 * cfg["camera_trunk_depth"], S, S, 2 * C)
    dense += S * _dpt_flops(cfg, h, w) * (int(bool(cfg["enable_depth"])) + int(bool(cfg["enable_point"])))
    return {"dense": dense, "attention": attn}


# Sustained FLOP/s of the demo's forward, per device kind and precision: "dense" is the network's linear layers and
# convolutions at the FP32 rate, "dense-half" the same under the half modes' autocast on a GPU
# (demo_autocast_dtype); the attention modes are attention's q k^T and p v products in that mode. The one table the
# estimate divides by.
#
# cpu: measured. On a 2-core x86 CPU (PyTorch's default 2 threads), forwards of VGGT's tiny configuration, of a
#   mid-size one (width 256 with 64-wide heads as VGGT-1B's, 4 + 4 blocks, DPT width 64) and of a wide one (width
#   1024, 2 + 2 blocks, VGGT-1B's DPT heads) at 1 to 16 frames of 224x224 to 392x518 were timed (best of 2-3) and
#   seconds = dense / dense_rate + attention / attention_rate fitted: about 160 GFLOP/s in FP32 matmul and
#   convolution (the mid-size fit 200, the wide runs 150-175), attention 44 GFLOP/s in fp32 mode (visionattn's CPU
#   path, the blocked scan of visionattn.reference) and 150 with PyTorch's SDPA; the other modes, emulated on the
#   CPU, 12-16 GFLOP/s (pasa 6) at 8 frames of 392x518. The released VGGT-1B itself (random weights, 1, 2 and 4
#   frames of 294x518, fp32 and SDPA, 12 runs of 16-138 s that varied up to 2x between repeats) took a median 1.8x
#   as long as those rates predict: its 5 GB of weights and the activations do not stay in the caches. The table
#   holds the fitted rates / 1.8, those of the released models, whose CPU runs are the long ones; the mid-size and
#   wide configurations then run about 1.8x faster than estimated, the tiny one (16-wide heads, small products that
#   pay overheads) as estimated to 2x slower. Other CPUs scale with their cores, vector units and memory.
# cuda: an H100 / H200 (SXM: the same 132 SMs) at published dense peaks times an efficiency: the network at the FP32
#   CUDA-core peak of 67 TFLOP/s x 0.6; attention on the FP16 tensor cores (989 TFLOP/s dense) x 0.43 for the half
#   modes, x 0.23 for tf32 (one FP16 product of split FP32 operands) and x 0.11 for fp32 (three FP16 products);
#   fp32-ieee and SDPA in FP32 on the CUDA cores x 0.5. With forward_flops these reproduce this repository's H100
#   runs of VGGT-1B at 392x518 within 10 % (docs/benchmarks/vggt100_h100.md, vggt_h100.md, vggt_long_h100.md: fp32
#   16.2 s at 100 frames, 54.9 s at 200 and 256 s at 500; tf32 30.7 s and SDPA-FP32 147.5 s at 200). Other GPUs:
#   scaled by their SM count against 132, and by 0.35 before Hopper (an A100's published peaks are about a third of
#   an H100's). dense-half: the demo's bf16 forwards of VGGT-1B on an H200 at 392x518 (inference 5.35 s at 100
#   frames with a warm kernel cache, 30.15 s at 300, docs/benchmarks/demo_video_h200.md) solved for the two rates
#   give attention 453 TFLOP/s (the table's 425 within 7 %) and the network 79 TFLOP/s, 0.08 of the FP16 tensor
#   cores' peak (its layer norms, GELUs and FP32 heads are memory-bound); the first forward of a process at 100
#   frames took 6.54 s, 1.2x.
THROUGHPUT = {
    "cpu": {k: v / 1.8 for k, v in {"dense": 160e9, "fp32": 44e9, "fp32-ieee": 16e9, "tf32": 12e9, "fp16": 15e9,
                                    "bf16": 14e9, "pasa": 6e9, "sdpa": 150e9}.items()},
    "cuda": {"dense": 67e12 * 0.6, "dense-half": 989e12 * 0.08, "fp32": 989e12 * 0.11, "fp32-ieee": 67e12 * 0.5,
             "tf32": 989e12 * 0.23, "fp16": 989e12 * 0.43, "bf16": 989e12 * 0.43, "pasa": 989e12 * 0.43,
             "sdpa": 67e12 * 0.5},
}
"""FLOP/s by device kind (``"cpu"``, ``"cuda"``) and by ``"dense"`` (the FP32 network), ``"dense-half"`` (the network
under a half mode's autocast, CUDA only) or attention mode (:data:`ATTN_MODES`); how each was obtained is said
beside it in the source."""


def _cuda_scale(device) -> float:
    """The CUDA device's throughput against an H100's: SM count / 132, x 0.35 before Hopper (1.0 without CUDA)."""
    if not torch.cuda.is_available():
        return 1.0
    props = torch.cuda.get_device_properties(torch.device(device))
    return props.multi_processor_count / 132 * (1.0 if props.major >= 9 else 0.35)


def estimate_seconds(model: str, frames: int, height: int, width: int, device="cpu", mode: str = "fp32",
                     config: dict | None = None) -> float:
    """Seconds one inference forward of the demo's network will take: a rough order of magnitude, not a timing.

    :func:`forward_flops` divided by the sustained throughput of :data:`THROUGHPUT` (the network's products at the
    FP32 rate, or on a GPU in a half mode at the rate of its autocast, attention at its ``mode``'s rate). The
    constants are of one 2-core x86 CPU and of an H100 / H200;
    another machine may be several times faster or slower (the CPU rates are those of the released models; smaller
    configurations can run up to about 2x faster or slower than estimated), and forwards of well under a second
    are mostly overheads the estimate leaves out. Not counted: model build, Triton compilation (the first forward
    on a GPU), track queries (``--ba``), Pi3X conditions, and ``--heads`` in half precision.

    Args:
        model: one of :data:`MODELS`.
        frames: S >= 1.
        height, width: preprocessed frame size in pixels (multiples of 14).
        device: where the forward runs (``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device``); other device
            types (``"mps"``) are estimated as the CPU. On CUDA the throughput is scaled to the device's SM count
            and generation (:func:`torch.cuda.get_device_properties`, read only when CUDA is available).
        mode: attention mode, one of :data:`ATTN_MODES`.
        config: constructor arguments differing from the released model (e.g. the tiny config of
            ``weights="random-tiny"``).

    Returns:
        seconds (float > 0).

    Raises:
        ValueError: unknown ``model`` or ``mode``, ``frames`` < 1, or a size not a multiple of the patch size.
    """
    _check_mode(mode)
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    flops = forward_flops(model, frames, height, width, config)
    rate = THROUGHPUT[kind]
    scale = _cuda_scale(device) if kind == "cuda" else 1.0
    dense = "dense-half" if kind == "cuda" and demo_autocast_dtype(mode, device) is not None else "dense"
    return (flops["dense"] / rate[dense] + flops["attention"] / rate[mode]) / scale


def format_seconds(seconds: float) -> str:
    """``seconds`` for people: ``"0.5 s"`` (0.1 s at least), ``"40 s"``, ``"12 min"``, ``"2.5 h"``, ``"19 h"``."""
    if seconds < 60:  # at least 0.1 s: below that the estimate is all overheads it leaves out
        return f"{max(seconds, 0.1):.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.2g} h" if seconds < 10 * 3600 else f"{seconds / 3600:.0f} h"


def frames_within(seconds: float, model: str, height: int, width: int, device="cpu", mode: str = "fp32",
                  config: dict | None = None, limit: int = 100_000) -> int:
    """The most frames whose :func:`estimate_seconds` is at most ``seconds`` (at least 1; at most ``limit``)."""
    def fits(s: int) -> bool:
        return estimate_seconds(model, s, height, width, device, mode, config) <= seconds

    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # the estimate grows with frames: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


SLOW_CPU_SECONDS = 120.0
"""A forward estimated (:func:`estimate_seconds`) to take longer than this on a CPU gets a warning."""
TARGET_CPU_SECONDS = 60.0
"""The forward the slow-CPU warning's ``--max-frames`` / ``--fps`` suggestion aims at (seconds)."""


def _estimate_config(model: str, weights: str | None) -> dict | None:
    """The config :func:`estimate_seconds` gets for ``model`` with ``weights``: the tiny one of ``"random-tiny"``,
    else None (the released configuration)."""
    if weights != "random-tiny":
        return None
    from visionattn.models import pi3_tiny_config, pi3x_tiny_config, vggt_tiny_config

    return {"pi3": pi3_tiny_config, "pi3x": pi3x_tiny_config}.get(model, vggt_tiny_config)()


def _device_label(device) -> str:
    """``"cpu"``, or ``"cuda:0 (NVIDIA H100 80GB HBM3)"``: the CUDA device's name when CUDA is available."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(dev)})"


def slow_cpu_warning(model: str, frames: int, height: int, width: int, device="cpu", mode: str = "fp32",
                     config: dict | None = None, video: dict | None = None) -> str | None:
    """One line warning that the forward will take long on a CPU, naming the fix; None when it will not.

    Fires when ``device`` is a CPU and :func:`estimate_seconds` exceeds :data:`SLOW_CPU_SECONDS`. The line
    names ``--max-frames N`` with the most frames estimated to take at most :data:`TARGET_CPU_SECONDS`
    (:func:`frames_within`) and, for a video, ``--fps F``: about N frames spread over the whole video (F from its
    ``video_frames`` / ``video_fps``; a placeholder where the container does not state them).

    Args:
        model, frames, height, width, device, mode, config: as :func:`estimate_seconds`.
        video: the video's metadata (:attr:`LoadedImages.extra <visionattn.recon.images.LoadedImages.extra>` of
            :func:`~visionattn.recon.video.load_video`), or None for images.
    """
    if torch.device(device).type != "cpu":
        return None
    seconds = estimate_seconds(model, frames, height, width, device, mode, config)
    if seconds <= SLOW_CPU_SECONDS:
        return None
    n = frames_within(TARGET_CPU_SECONDS, model, height, width, device, mode, config)
    fix = f"--max-frames {n}"
    if video is not None:
        rate, total = video.get("video_fps") or 0.0, video.get("video_frames") or 0
        if rate > 0 and total > 0:
            f = n / (total / rate)  # n frames over the whole video, rounded down to 2 significant digits
            digits = max(0, 1 - math.floor(math.log10(f)))
            f = math.floor(f * 10 ** digits) / 10 ** digits
            fix = f"--fps {f:g} (about {n} frames spread over the {total / rate:.0f} s video) or {fix}"
        else:
            fix = f"--fps F (about {n} frames over the video) or {fix}"
    return (f"inference of {frames} frames of {height}x{width} on the CPU will take about {format_seconds(seconds)}; "
            f"for about {format_seconds(TARGET_CPU_SECONDS)} use {fix}, or run on a GPU (--device cuda)")


def auto_max_frames(net: torch.nn.Module, device, size: int) -> int | None:
    """The most frames of at most ``size`` x ``size`` pixels whose forward (weights included) fits the free
    memory of CUDA ``device`` (:func:`visionattn.models.max_frames_that_fit`, FP32 network as the demo runs
    it); ``None`` on the CPU (no limit).

    Raises:
        ValueError: not even one frame fits.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    from ..models import max_frames_that_fit

    # the estimate counts the weights, which are allocated already: add them back to the free bytes
    free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_allocated(dev)
    n = max_frames_that_fit(free, size, size, "fp32", model=net)
    if n < 1:
        raise ValueError(f"--max-frames auto: not even one {size}x{size} frame fits the {free / 2**30:.1f} GiB "
                         f"free on {dev}; free GPU memory or use a smaller --size")
    return n


# the stages every summary lists (0 s where one did not run), in the order they run
STAGES = ("setup", "decode_build", "compile", "warmup", "inference", "tracks", "bundle_adjustment", "export")


def _beside(background, foreground):
    """Run ``background(stop)`` in a thread while this thread runs ``foreground()``; return
    ``(foreground's result, its seconds, background's result)`` once both are done.

    ``stop`` is a :class:`threading.Event` set when ``foreground`` fails (an error, Ctrl-C, SIGTERM): the
    background work stops at its next check and is waited for (through further signals) before the error
    leaves, so nothing still writes into the output folder that the caller then removes. An error of the
    background work is raised here once ``foreground`` is done (a note on the foreground's error if both fail).
    """
    import threading

    stop, done, box = threading.Event(), threading.Event(), {}

    def run():
        try:
            box["result"] = background(stop)
        except BaseException as exc:  # re-raised in the calling thread
            box["error"] = exc
        finally:
            done.set()

    # waited for through done, not Thread.join: a signal that interrupts join() can leave the thread marked as
    # stopped while it still runs (CPython 3.11), and the error would then leave with the decode still writing
    threading.Thread(target=run, name="recon-decode", daemon=True).start()
    t0 = time.perf_counter()
    try:
        result = foreground()
        seconds = time.perf_counter() - t0
        done.wait()
    except BaseException as exc:
        while True:  # a second stop signal (its handler raises again) cuts neither the stop nor the wait short
            try:
                stop.set()
                while not done.is_set():
                    done.wait()
                break
            except BaseException:  # noqa: B012 -- keep stopping and waiting, raise the first
                continue
        other = box.get("error")
        if other is not None and not isinstance(other, DecodeStopped) and hasattr(exc, "add_note"):
            exc.add_note(f"meanwhile the frames failed too: {type(other).__name__}: {other}")
        raise
    if "error" in box:
        raise box["error"]
    return result, seconds, box["result"]


def _reconstruct_into(tmp, t_start, stages, source, out_dir, model, mode, weights, dev, cameras, conf_percentile,
                      max_frames, size, preprocess, point_source, seed, preview, progress, warmup, log, fps, every,
                      host_memory, compile_ahead, max_points, colmap_text, ba, ba_query_frames, ba_points,
                      ba_max_error, heads, warn, stack) -> dict:
    frames_dir = os.path.join(tmp, "images")
    os.makedirs(frames_dir)

    def decode(stop=None) -> dict:
        """The frames, and what depends on them only: the kernels' compile started at the first frame (while the
        model is still being built and the other frames decode), the estimate said, the cameras matched, the
        prediction store made."""
        t0 = time.perf_counter()
        got = {"ahead": None}

        def first_frame(frames, height, width):
            # the kernels depend on the frame size, the mode and the head dims, and on the frame count only through
            # whether the global attention splits its keys (a few frames): the predicted count serves, and a video
            # that states no frame count is taken as a long one
            if stop is not None and compile_ahead:
                got["ahead"] = start_compile_ahead(mode, weights, dev, (frames or 64, 3, height, width), model,
                                                   heads)

        loaded = load_source(source, size=size, preprocess=preprocess, max_frames=max_frames, fps=fps, every=every,
                             progress=progress, frames_dir=frames_dir, stop=stop, on_first_frame=first_frame)
        got.update(loaded=loaded, seconds=time.perf_counter() - t0)
        for name, why in loaded.skipped:
            log(f"note: skipped {name!r} ({why})")
        S, H, W = loaded.images.shape[0], *loaded.shape_hw
        # how long the forward will take, said before it (while the model is built, unless --max-frames auto
        # built it first); a long CPU run gets a warning naming its fix
        config = _estimate_config(model, weights)
        got["estimate"] = estimate_seconds(model, S, H, W, dev, mode, config)
        log(f"inference: about {format_seconds(got['estimate'])} ({S} frames of {H}x{W}, {mode}, "
            f"{_device_label(dev)})")
        advice = slow_cpu_warning(model, S, H, W, dev, mode, config, video=loaded.extra or None)
        if advice is not None:
            if warn is None:
                import warnings

                warnings.warn(advice, RuntimeWarning, stacklevel=2)
            else:
                warn(advice)
        got["conditions"] = {}
        if cameras:
            got["conditions"] = match_cameras(loaded, **{f"{k}_file": p for k, (p, _) in cameras.items()},
                                              **{f"{k}_entries": e for k, (_, e) in cameras.items()})
            if "poses" in got["conditions"] and len(got["conditions"]["poses"]) < 2:
                log("note: Pi3X ignores poses with a single frame (they are relative: it needs two posed frames)")
        got["store"] = prediction_store(host_memory, S, (H, W), out_dir, stack, log)
        return got

    t0, side_by_side = time.perf_counter(), max_frames != "auto"
    if not side_by_side:  # the model first: the frame count depends on the memory left next to it
        net = build_model(model, weights, mode, dev, seed, heads)
        build_seconds = time.perf_counter() - t0
        max_frames = auto_max_frames(net, dev, size)
        log(f"--max-frames auto: {max_frames} frames fit on {dev}" if max_frames is not None
            else f"--max-frames auto: no limit on {dev}")
        got = decode()
    else:  # independent: the frames decode in a thread while this one builds the model
        net, build_seconds, got = _beside(decode, lambda: build_model(model, weights, mode, dev, seed, heads))
    stages.add("decode_build", time.perf_counter() - t0)
    # the export's library (points.ply, scene.glb), imported here in the main thread while the kernels may still
    # compile, rather than by a writer on the export's critical path: part of the setup, as the other imports
    # (stop signals wait for the import's end, see require_trimesh)
    t0 = time.perf_counter()
    require_trimesh()
    stages.add("setup", time.perf_counter() - t0)
    decode_build = {"decode": got["seconds"], "build": build_seconds, "side_by_side": side_by_side}
    loaded, estimate, conditions, store, ahead = (got[k] for k in ("loaded", "estimate", "conditions", "store",
                                                                   "ahead"))
    S, H, W = loaded.images.shape[0], *loaded.shape_hw
    with stages("compile"):  # what is left of the kernel compile once the model is built
        ahead_info = ahead.wait() if ahead is not None else None
    model_seconds = build_seconds + stages.seconds["compile"]
    if ahead_info is not None and "error" not in ahead_info:
        log(f"attention kernels compiled beside the model load in {ahead_info['seconds']:.1f} s "
            f"(inference waited {ahead_info['waited']:.1f} s for them)")
    queries = None
    if ba:
        from .ba import query_plan

        queries = query_plan(S, (H, W), ba_query_frames, ba_points, seed)
    t0 = time.perf_counter()
    amp = demo_autocast_dtype(mode, dev)
    pred = run_model(net, loaded.images, dev, progress=progress, warmup=warmup, store=store, track_queries=queries,
                     conditions=conditions, autocast_dtype=amp)
    extra_seconds = pred["warmup_seconds"] + pred.get("track_seconds", 0.0)
    stages.add("warmup", pred["warmup_seconds"])
    stages.add("tracks", pred.get("track_seconds", 0.0))
    stages.add("inference", time.perf_counter() - t0 - extra_seconds)
    tokens = count_tokens(net, S, (H, W))
    summary = {"frames": S, "image_hw": [H, W], "tokens": tokens, "model": model, "mode": mode,
               "heads": None if model in PI3_MODELS else (net.heads_dtype or "fp32"),
               "autocast": None if amp is None else str(amp).removeprefix("torch."),
               "weights": weights, "device": dev, "inference_seconds": pred["seconds"], "estimate_s": estimate,
               "warmup": warmup,
               "model_seconds": model_seconds, "decode_build": decode_build,
               "peak_memory_bytes": pred["peak_memory_bytes"], "peak_memory_kind": pred["peak_memory_kind"],
               "predictions_on_disk": store is not None, "compile_ahead": ahead_info,
               "conf_percentile": conf_percentile, "point_source": point_source, "max_points": max_points,
               "skipped": [n for n, _ in loaded.skipped], "input": os.path.abspath(source),
               "sources": dict(zip(loaded.names, loaded.sources)),
               "intrinsic_fallback_frames": [int(i) for i in np.flatnonzero(pred["intrinsic_fallback"])],
               "conditions": {k: os.path.abspath(p) for k, (p, _) in cameras.items()},
               "environment": environment()}
    if loaded.extra:
        summary["video"] = loaded.extra
    sparse_model = None
    if ba:
        from .ba import refine
        from .points import confidence_threshold

        with stages("bundle_adjustment"):
            pts, conf = ((pred["world_points_from_depth"], pred["depth_conf"]) if point_source == "depth"
                         else (pred["world_points"], pred["world_points_conf"]))
            sparse_model, summary["bundle_adjustment"] = refine(
                pred, loaded, confidence_threshold(pts, conf, conf_percentile), point_source, ba_max_error,
                quiet=not progress)
        info = summary["bundle_adjustment"]
        if sparse_model is None:
            log(f"note: bundle adjustment skipped ({info['skipped']}): sparse/0 holds the predicted cameras")
        elif info["reverted"]:
            log(f"note: bundle adjustment did not lower the mean reprojection error "
                f"({info['reprojection_error_before']:.2f} px), so sparse/0 holds the tracked points with the "
                "predicted cameras")
        else:
            log(f"bundle adjustment: {info['tracks']:,} tracks, {info['observations']:,} observations, mean "
                f"reprojection error {info['reprojection_error_before']:.2f} -> "
                f"{info['reprojection_error_after']:.2f} px")

    def render(xyz, rgb):
        from .preview import render_preview

        title = (f"{model} {mode} weights={weights} | {S} frames, {tokens} tokens, "
                 f"{len(xyz):,} points, {pred['seconds']:.2f} s")
        render_preview(os.path.join(tmp, "preview.png"), xyz, rgb, pred["extrinsic"], pred["intrinsic"],
                       pred["depth"], loaded.names, title)

    with stages("export"):
        res = write_reconstruction(tmp, pred, loaded, conf_percentile, point_source, progress,
                                   extra={"model": model, "mode": mode, "weights": weights}, max_points=max_points,
                                   colmap_text=colmap_text, sparse_model=sparse_model,
                                   preview=render if preview else None)
    summary["points_kept"] = res["points"]
    summary["points_ply"] = res["points_ply"]
    summary["colmap"] = res["colmap"]
    summary["depth_png_scale"] = res["depth_png_scale"]
    summary["export_outputs"] = res["seconds"]
    summary["peak_host_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    if torch.device(dev).type == "cuda":
        summary["peak_cuda_allocated_bytes"] = int(torch.cuda.max_memory_allocated(torch.device(dev)))
    summary["out_dir"] = os.path.abspath(out_dir)
    summary["total_seconds"] = time.perf_counter() - t_start
    summary["seconds"] = stages.report(summary["total_seconds"], STAGES)
    with open(os.path.join(tmp, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, allow_nan=False)
    return summary
