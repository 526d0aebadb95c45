"""VGGT predictions -> numpy, frame chunk by frame chunk (host memory bounded by the outputs themselves).

``tensor.float().cpu().numpy()`` on a whole prediction first makes a full-size
float copy on the device (for bf16 or non-contiguous outputs) and then a
full-size host copy; at 1000 frames of 392x518 the point map alone is 2.4 GB.
:func:`predictions_to_numpy` copies ``frames_chunk_size`` frames at a time into
preallocated arrays, optionally memory-mapped ``.npy`` files on disk when the
reconstruction would not fit in host memory.
"""
from __future__ import annotations

import os

import numpy as np
import torch

__all__ = ["predictions_to_numpy", "FRAME_KEYS"]

FRAME_KEYS = ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf", "images", "track", "vis",
              "conf")
"""Prediction keys with layout [B, S, ...] (frames on dim 1)."""


def predictions_to_numpy(predictions: dict, keys=None, batch_index: int = 0, frames_chunk_size: int = 8,
                         out_dir: str | os.PathLike | None = None, dtype=np.float32) -> dict[str, np.ndarray]:
    """Copy one sample's predictions to numpy arrays, ``frames_chunk_size`` frames at a time.

    Args:
        predictions: the dict :meth:`VGGT.forward` returns (tensors [B, S, ...] on any device).
        keys: which keys (default: every key of :data:`FRAME_KEYS` present; ``pose_enc_list``
            is skipped).
        batch_index: the sample b of [B, S, ...] to convert.
        frames_chunk_size: frames per device-to-host copy (bounds the extra device memory
            to one chunk in float32).
        out_dir: None -> arrays in host memory; a folder -> each array is a memory-mapped
            ``<out_dir>/<key>.npy`` (readable later with ``np.load(path, mmap_mode="r")``),
            so the reconstruction streams to disk.
        dtype: numpy dtype of the arrays (float32).

    Returns:
        {key: array [S, ...]} (e.g. ``depth`` [S, H, W, 1], ``world_points`` [S, H, W, 3],
        ``pose_enc`` [S, 9]); values equal ``t[batch_index].to(float32).cpu().numpy()``.

    Raises:
        KeyError: a requested key is missing.
        ValueError: ``frames_chunk_size`` < 1 or a tensor without a frame dimension.
    """
    if frames_chunk_size < 1:
        raise ValueError(f"frames_chunk_size={frames_chunk_size} must be >= 1")
    keys = [k for k in FRAME_KEYS if k in predictions] if keys is None else list(keys)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
    result = {}
    for key in keys:
        t = predictions[key]
        if not torch.is_tensor(t) or t.dim() < 2:
            raise ValueError(f"predictions[{key!r}] must be a tensor [B, S, ...], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        t = t.detach()[batch_index]
        shape = tuple(t.shape)
        if out_dir is None:
            arr = np.empty(shape, dtype=dtype)
        else:
            arr = np.lib.format.open_memmap(os.path.join(os.fspath(out_dir), f"{key}.npy"), mode="w+", dtype=dtype,
                                            shape=shape)
        for s0 in range(0, shape[0], frames_chunk_size):
            arr[s0:s0 + frames_chunk_size] = t[s0:s0 + frames_chunk_size].to(torch.float32).cpu().numpy()
        if out_dir is not None:
            arr.flush()
        result[key] = arr
    return result
