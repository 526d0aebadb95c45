"""Image folder -> VGGT / FastVGGT predictions -> reconstruction on disk.

:func:`build_model` makes the network (released weights, a local checkpoint, or
random weights in the full or a tiny configuration), :func:`run_model` runs it
on a preprocessed batch and returns numpy predictions with cameras decoded, and
:func:`reconstruct` is the whole demo: load, infer, export, preview, summary.
Every anticipated user error (bad folder, corrupt image, unusable ``out_dir``,
weights not available offline) raises :class:`ReconstructionError` subclasses
(all ``ValueError``) before anything is written.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import tempfile
import time

import numpy as np
import torch

from visionattn.reporting import environment

from .images import ImageFolderError, LoadedImages, load_images
from .export import (MissingDependencyError, OutputDirError, atomic_output_dir, check_output_dir,
                     require_trimesh, write_reconstruction)

__all__ = [
    "DEFAULT_WEIGHTS", "MODELS", "ATTN_MODES", "WeightsError", "DeviceError", "USER_ERRORS",
    "check_checkpoint", "resolve_device", "load_source", "build_model",
    "run_model", "count_tokens", "reconstruct", "PIXEL_ARRAYS", "HOST_MEMORY", "prediction_bytes",
    "available_host_memory", "prediction_store", "start_compile_ahead",
]

DEFAULT_WEIGHTS = "facebook/VGGT-1B"
MODELS = ("vggt", "fastvggt")
# visionattn precision modes the demo offers, plus "sdpa" (PyTorch's own attention, as a baseline)
ATTN_MODES = ("fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa", "sdpa")


class WeightsError(ValueError):
    """The requested weights cannot be loaded (offline hub, missing or corrupt file)."""


class DeviceError(ValueError):
    """The requested device does not exist or is not available here."""


# errors a CLI reports as a message + exit code 2 (nothing has been written when they are raised)
USER_ERRORS = (ImageFolderError, OutputDirError, WeightsError, DeviceError, MissingDependencyError)


def _models_api():
    try:
        from visionattn.models import FASTVGGT_MERGING, VGGT, vggt_tiny_config
        from visionattn.models.geometry import pose_encoding_to_extri_intri, unproject_depth_map_to_point_map
    except ImportError as exc:  # the model package is a separate install unit; say exactly what failed
        raise ImportError(f"the reconstruction pipeline needs visionattn.models (VGGT): {exc}") from exc
    return VGGT, vggt_tiny_config, FASTVGGT_MERGING, pose_encoding_to_extri_intri, unproject_depth_map_to_point_map


def _check_mode(mode: str) -> str | None:
    if mode not in ATTN_MODES:
        raise ValueError(f"mode={mode!r} is not known; expected one of {ATTN_MODES}")
    return None if mode == "sdpa" else mode


_HUB_HELP = ("Without network access pass a local checkpoint with `--weights PATH` (a folder or a "
             ".safetensors/.pt file of facebook/VGGT-1B), or run with random weights: `--weights random` "
             "(full model) or `--weights random-tiny` (tiny, CPU).")


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


def build_model(model: str = "vggt", weights: str = DEFAULT_WEIGHTS, mode: str = "fp32",
                device: str | torch.device = "cpu", seed: int = 0) -> torch.nn.Module:
    """Build VGGT or FastVGGT in eval mode on ``device``.

    Args:
        model: ``"vggt"`` or ``"fastvggt"`` (token merging in global attention).
        weights: a hub id (``facebook/VGGT-1B``), a local checkpoint path,
            ``"random"`` (full VGGT-1B configuration, random init) or
            ``"random-tiny"`` (tiny configuration for CPU / CI).
        mode: attention precision, one of :data:`ATTN_MODES` (``"sdpa"``: PyTorch SDPA).
        seed: seed for random weights (same seed -> same model).

    Raises:
        ValueError: unknown ``model`` / ``mode``.
        WeightsError: hub weights unavailable (offline) or a path that does not exist.
    """
    VGGT, tiny_config, merging_cfg, _, _ = _models_api()
    if model not in MODELS:
        raise ValueError(f"model={model!r} is not known; expected one of {MODELS}")
    attn_mode = _check_mode(mode)
    kwargs = {"attn_mode": attn_mode}
    if model == "fastvggt":
        kwargs["merging"] = merging_cfg
    if weights in ("random", "random-tiny"):
        if weights == "random-tiny":
            kwargs = {**tiny_config(), **kwargs}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = VGGT(**kwargs)
    else:
        source = _reachable_weights(weights)
        try:
            net = VGGT.from_pretrained(source, **kwargs)
        except Exception as exc:  # hub offline / not cached / bad file: one line naming the fix
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise WeightsError(f"cannot load weights {weights!r}: {why}. " + _HUB_HELP) from exc
    return net.to(device).eval()


def count_tokens(model: torch.nn.Module, frames: int, hw: tuple[int, int], patch: int = 14) -> int:
    """Tokens in one global-attention sequence: frames x (special tokens + patches)."""
    special = int(model.aggregator.patch_start_idx)
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


def run_model(model: torch.nn.Module, images: torch.Tensor, device: str | torch.device = "cpu",
              progress: bool = True, warmup: int = 0, store: str | None = None) -> dict:
    """Run VGGT on one scene and decode cameras.

    Args:
        model: from :func:`build_model`.
        images: float32 [S, 3, H, W] in [0, 1], H and W multiples of 14.
        warmup: untimed forward passes first (the first call compiles Triton kernels).
        store: an existing folder: the per-pixel arrays (:data:`PIXEL_ARRAYS`) are then ``.npy`` files there,
            returned as ``np.memmap`` views and filled a few frames at a time, so host memory holds only the
            pages in use (for reconstructions larger than the host memory; :func:`prediction_bytes` says how
            large). None: in host memory.

    Returns:
        dict of numpy arrays: ``extrinsic`` [S, 3, 4] (OpenCV camera-from-world),
        ``intrinsic`` [S, 3, 3], ``depth`` [S, H, W], ``depth_conf`` [S, H, W],
        ``world_points`` [S, H, W, 3], ``world_points_conf`` [S, H, W],
        ``world_points_from_depth`` [S, H, W, 3], ``images`` [S, H, W, 3] (colours),
        ``intrinsic_fallback`` [S] bool (see :func:`_usable_intrinsics`);
        plus ``seconds`` (forward time, synchronised) and ``peak_memory_bytes``
        (CUDA max allocated, or process peak RSS on CPU) and ``peak_memory_kind``.
    """
    from tqdm.auto import tqdm

    *_, to_extri_intri, unproject = _models_api()
    dev = torch.device(device)
    x = images.to(dev, torch.float32)
    H, W = x.shape[-2:]
    bar = tqdm(total=1 + warmup, desc="inference", unit="pass", disable=not progress)
    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
            bar.update()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model(x)
        extr, intr = to_extri_intri(out["pose_enc"], (H, W))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    bar.update()
    bar.close()
    if dev.type == "cuda":
        peak, kind = int(torch.cuda.max_memory_allocated(dev)), "cuda_max_allocated"
    else:
        peak, kind = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process_peak_rss"

    def np32(t):
        return t.detach().float().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float32)

    intr, fixed = _usable_intrinsics(intr[0], (H, W))
    extr = extr[0]
    pred = {"extrinsic": np32(extr).astype(np.float64), "intrinsic": np32(intr).astype(np.float64),
            "intrinsic_fallback": fixed}
    S = images.shape[0]
    for name, dims in PIXEL_ARRAYS.items():
        shape = (S, H, W, *dims)
        pred[name] = np.empty(shape, np.float32) if store is None else np.lib.format.open_memmap(
            os.path.join(store, f"{name}.npy"), mode="w+", dtype=np.float32, shape=shape)
    with torch.inference_mode():
        for i in range(0, S, _COPY_FRAMES):  # a few frames at a time: host and device temporaries stay small
            f = slice(i, min(S, i + _COPY_FRAMES))
            pred["depth"][f] = np32(out["depth"][0, f, ..., 0])
            pred["depth_conf"][f] = np32(out["depth_conf"][0, f])
            pred["world_points"][f] = np32(out["world_points"][0, f])
            pred["world_points_conf"][f] = np32(out["world_points_conf"][0, f])
            pred["world_points_from_depth"][f] = np32(unproject(out["depth"][0, f], extr[f], intr[f]))
            pred["images"][f] = np32(images[f].permute(0, 2, 3, 1))
    pred.update(seconds=seconds, peak_memory_bytes=peak, peak_memory_kind=kind)
    return pred


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
                frames_dir: str | None = None) -> LoadedImages:
    """Load a folder of images or a video file (see :func:`~visionattn.recon.video.load_video`).

    Raises:
        ImageFolderError: unusable input; ``--fps`` / ``--every`` given for a folder.
    """
    from .video import is_video, load_video

    if is_video(source):
        return load_video(source, size=size, mode=preprocess, fps=fps, every=every, max_frames=max_frames,
                          progress=progress, frames_dir=frames_dir)
    if fps is not None or every is not None:
        raise ImageFolderError(f"--fps / --every sample videos; {source!r} is not a video file "
                               "(for a folder use --max-frames)")
    return load_images(source, size=size, mode=preprocess, max_frames=max_frames, progress=progress,
                       frames_dir=frames_dir)


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
                weights: str = DEFAULT_WEIGHTS, device: str | None = None, conf_percentile: float = 50.0,
                max_frames: int | str | None = None, size: int = 518, preprocess: str = "crop",
                point_source: str = "depth", seed: int = 0, preview: bool = True,
                progress: bool = True, warmup: int = 0, log=print, fps: float | None = None,
                every: int | None = None, host_memory: str = "auto", compile_ahead: bool = True) -> dict:
    """The whole demo: folder of images or video -> ``out_dir`` with points, cameras, depth, preview.

    Outputs are described in :mod:`visionattn.recon.export`; they are written to
    a temporary folder (created before any decoding, so an unwritable ``out_dir``
    fails at once) and renamed to ``out_dir`` at the end. Nothing is left behind
    if loading the input or the weights fails, or on Ctrl-C / SIGTERM / SIGHUP (see
    :func:`~visionattn.recon.outdir.handle_sigterm`).

    Args:
        source: a folder of images or a video file.
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

    Returns:
        summary dict: frames, tokens, points kept, seconds (model build and weight load, with any wait for
        ``compile_ahead`` / inference / total),
        peak memory (inference: CUDA max allocated or host RSS; plus the process's
        peak host RSS), mode, model, weights, image size, skipped files, out_dir.

    Raises:
        ImageFolderError, OutputDirError, WeightsError, DeviceError, MissingDependencyError:
            user errors (no output written).
        ValueError: bad arguments.
    """
    t_start = time.perf_counter()
    if not 0.0 <= conf_percentile <= 100.0:
        raise ValueError(f"conf_percentile={conf_percentile} must be in [0, 100]")
    if max_frames is not None and max_frames != "auto" and (not isinstance(max_frames, int) or max_frames < 1):
        raise ValueError(f"max_frames={max_frames!r}; expected a positive int, 'auto' or None")
    _check_mode(mode)
    if host_memory not in HOST_MEMORY:
        raise ValueError(f"host_memory={host_memory!r}; expected one of {HOST_MEMORY}")
    dev = resolve_device(device)
    check_output_dir(out_dir, inputs=[source])
    require_trimesh()  # points.ply and scene.glb need it: fail now, not after inference
    if weights not in ("random", "random-tiny"):
        if os.path.exists(weights):
            check_checkpoint(weights)  # a corrupt file fails now, in one line, not after decoding
        else:
            _reachable_weights(weights)  # fail in seconds when offline, before decoding any image
    opts = dict(source=source, out_dir=out_dir, model=model, mode=mode, weights=weights, dev=dev,
                conf_percentile=conf_percentile, max_frames=max_frames, size=size, preprocess=preprocess,
                point_source=point_source, seed=seed, preview=preview, progress=progress, warmup=warmup,
                log=log, fps=fps, every=every, host_memory=host_memory, compile_ahead=compile_ahead)
    # the temporary output folder exists from here on: an unwritable --out fails before any decoding; the
    # prediction store (if any) is removed before that folder is renamed into place
    with atomic_output_dir(out_dir, inputs=[source], warn=log) as tmp, contextlib.ExitStack() as stack:
        return _reconstruct_into(tmp, t_start, stack=stack, **opts)


def start_compile_ahead(mode: str, weights: str, device, images_shape: tuple[int, ...]):
    """A :class:`visionattn.warmup.CompileAhead` of the kernels VGGT's forward in ``mode`` uses on ``images_shape``
    ([S, 3, H, W] frames; :func:`visionattn.models.vggt_attention_shapes`), or ``None`` where nothing compiles
    (the CPU, ``mode="sdpa"``). Start it before the model's first forward; FastVGGT uses the same kernels."""
    if torch.device(device).type != "cuda" or _check_mode(mode) is None:
        return None
    _, tiny_config, _, _, _ = _models_api()  # a missing model package fails here, with the clear message
    from ..models import vggt_attention_shapes
    from ..warmup import CompileAhead

    config = tiny_config() if weights == "random-tiny" else {}
    S, _, H, W = images_shape
    return CompileAhead(mode, vggt_attention_shapes(S, H, W, **config), device=str(device))


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


def _reconstruct_into(tmp, t_start, source, out_dir, model, mode, weights, dev, conf_percentile, max_frames,
                      size, preprocess, point_source, seed, preview, progress, warmup, log, fps, every, host_memory,
                      compile_ahead, stack) -> dict:
    frames_dir = os.path.join(tmp, "images")
    os.makedirs(frames_dir)
    net, model_seconds = None, 0.0
    if max_frames == "auto":  # the model first: the frame count depends on the memory left next to it
        t0 = time.perf_counter()
        net = build_model(model, weights, mode, dev, seed)
        model_seconds = time.perf_counter() - t0
        max_frames = auto_max_frames(net, dev, size)
        log(f"--max-frames auto: {max_frames} frames fit on {dev}" if max_frames is not None
            else f"--max-frames auto: no limit on {dev}")
    loaded = load_source(source, size=size, preprocess=preprocess, max_frames=max_frames, fps=fps, every=every,
                         progress=progress, frames_dir=frames_dir)
    for name, why in loaded.skipped:
        log(f"note: skipped {name!r} ({why})")
    store = prediction_store(host_memory, loaded.images.shape[0], tuple(loaded.images.shape[-2:]), out_dir, stack,
                             log)
    ahead, t0 = None, time.perf_counter()
    if net is None and compile_ahead:  # the model is built next: compile the kernels meanwhile
        ahead = start_compile_ahead(mode, weights, dev, tuple(loaded.images.shape))
    if net is None:
        net = build_model(model, weights, mode, dev, seed)
    ahead_info = ahead.wait() if ahead is not None else None
    model_seconds += time.perf_counter() - t0
    if ahead_info is not None and "error" not in ahead_info:
        log(f"attention kernels compiled beside the model load in {ahead_info['seconds']:.1f} s "
            f"(inference waited {ahead_info['waited']:.1f} s for them)")
    pred = run_model(net, loaded.images, dev, progress=progress, warmup=warmup, store=store)
    S, H, W = pred["depth"].shape
    tokens = count_tokens(net, S, (H, W))
    summary = {"frames": S, "image_hw": [H, W], "tokens": tokens, "model": model, "mode": mode,
               "weights": weights, "device": dev, "inference_seconds": pred["seconds"], "warmup": warmup,
               "model_seconds": model_seconds,
               "peak_memory_bytes": pred["peak_memory_bytes"], "peak_memory_kind": pred["peak_memory_kind"],
               "predictions_on_disk": store is not None, "compile_ahead": ahead_info,
               "conf_percentile": conf_percentile, "point_source": point_source,
               "skipped": [n for n, _ in loaded.skipped], "input": os.path.abspath(source),
               "sources": dict(zip(loaded.names, loaded.sources)),
               "intrinsic_fallback_frames": [int(i) for i in np.flatnonzero(pred["intrinsic_fallback"])],
               "environment": environment()}
    if loaded.extra:
        summary["video"] = loaded.extra
    res = write_reconstruction(tmp, pred, loaded, conf_percentile, point_source, progress,
                               extra={"model": model, "mode": mode, "weights": weights}, warn=log)
    summary["points_kept"] = res["points"]
    summary["colmap"] = res["colmap"]
    summary["depth_png_scale"] = res["depth_png_scale"]
    if preview:
        from .preview import render_preview
        title = (f"{model} {mode} weights={weights} | {S} frames, {tokens} tokens, "
                 f"{res['points']:,} points, {pred['seconds']:.2f} s")
        render_preview(os.path.join(tmp, "preview.png"), res["xyz"], res["rgb"], pred["extrinsic"],
                       pred["intrinsic"], pred["depth"], loaded.names, title)
    summary["total_seconds"] = time.perf_counter() - t_start
    summary["peak_host_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    if torch.device(dev).type == "cuda":
        summary["peak_cuda_allocated_bytes"] = int(torch.cuda.max_memory_allocated(torch.device(dev)))
    summary["out_dir"] = os.path.abspath(out_dir)
    with open(os.path.join(tmp, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, allow_nan=False)
    return summary
