"""Depth maps on disk: ``depth/NAME.png`` (16-bit, one scale for all frames), ``depth/NAME.npy``
and ``confidence/NAME.npy``.
"""
from __future__ import annotations

import os
import struct

import numpy as np

__all__ = ["depth_to_source_pixels", "depth_png_scale", "write_depth", "write_png16"]


def depth_to_source_pixels(depth: np.ndarray, affine, size) -> np.ndarray:
    """Resample a depth map of the model's frame [H, W] onto the source image's pixel grid.

    Each source pixel takes the depth of the model pixel its centre maps to
    (nearest; ``affine`` as in :class:`~visionattn.recon.images.LoadedImages`);
    pixels outside the model's frame (cropped away) get NaN.

    Returns:
        float32 [height, width] for ``size`` = (width, height).
    """
    return _resample(np.asarray(depth, np.float32), affine, size, np.nan)


def _resample(image: np.ndarray, affine, size, fill) -> np.ndarray:
    """``image`` [H, W] on the source image's pixel grid (``size`` = (width, height)): each source pixel takes
    the value of the model pixel its centre maps to (nearest), ``fill`` outside the model's frame; [height,
    width], ``image``'s dtype. Two whole-axis gathers from a copy padded by one row and column of ``fill``."""
    sx, sy, ox, oy = affine
    w, h = size
    H, W = image.shape
    u = np.round(sx * np.arange(w) + ox).astype(np.int64)
    v = np.round(sy * np.arange(h) + oy).astype(np.int64)
    u[(u < 0) | (u >= W)] = W  # the padding
    v[(v < 0) | (v >= H)] = H
    padded = np.full((H + 1, W + 1), fill, image.dtype)
    padded[:H, :W] = image
    return padded.take(v, axis=0).take(u, axis=1)


def depth_png_scale(depth: np.ndarray) -> float:
    """The one uint16 scale for every depth PNG: 65535 / the largest finite positive depth of all frames."""
    d = np.asarray(depth)
    valid = np.isfinite(d) & (d > 0)
    return 65535.0 / float(d[valid].max()) if valid.any() else 1.0


def write_depth(folder_depth: str, folder_conf: str, name: str, depth: np.ndarray, conf: np.ndarray | None,
                scale: float, affine=None, size=None) -> None:
    """Write ``depth/NAME.npy`` (float32), ``depth/NAME.png`` (uint16) and ``confidence/NAME.npy``.

    The PNG stores ``round(depth * scale)`` (0 where depth is non-finite, <= 0 or
    cropped away), in source-image pixels when ``affine`` and ``size`` (width,
    height) are given, else in the model's pixels. ``scale`` is shared by all
    frames (see :func:`depth_png_scale`) and also stored in the PNG's
    ``depth_scale`` text chunk. ``depth`` and ``conf`` are [H, W].

    OpenCV encodes the PNG (libpng; zlib level 1 with its run-length strategy and libpng's fast filter
    heuristic: on depth maps about 1.5x faster than Pillow at the same settings, files of the same size, and the
    GIL is released while it encodes, so frames written from several threads encode side by side); the text
    chunks, which OpenCV cannot write, go in after the header chunk.
    """
    depth = np.asarray(depth, dtype=np.float32)
    np.save(os.path.join(folder_depth, f"{name}.npy"), depth)
    if conf is not None:
        np.save(os.path.join(folder_conf, f"{name}.npy"), np.asarray(conf, dtype=np.float32))
    # quantised in the model's frame, then resampled (nearest: the same values as quantising the resampled map,
    # on the model's pixels only)
    valid = np.isfinite(depth) & (depth > 0)
    png = np.round(np.where(valid, depth, 0.0).astype(np.float64) * scale).clip(0, 65535).astype(np.uint16)
    if affine is not None:
        png = _resample(png, affine, size, 0)
    write_png16(os.path.join(folder_depth, f"{name}.png"), png,
                {"depth_scale": repr(scale), "description": "depth = value / depth_scale (0 = invalid)"})


def write_png16(path: str, image: np.ndarray, text: dict[str, str] | None = None) -> None:
    """Write a uint16 [H, W] image as a 16-bit greyscale PNG (OpenCV: zlib level 1, run-length strategy, libpng's
    fast filters where OpenCV has the option), with Latin-1 ``text`` as tEXt chunks right after IHDR."""
    import cv2

    image = np.asarray(image)
    if image.dtype != np.uint16 or image.ndim != 2:
        raise ValueError(f"a 16-bit PNG needs a uint16 [H, W] image, not {image.dtype} {image.shape}")
    params = [cv2.IMWRITE_PNG_COMPRESSION, 1, cv2.IMWRITE_PNG_STRATEGY, cv2.IMWRITE_PNG_STRATEGY_RLE]
    if hasattr(cv2, "IMWRITE_PNG_FAST_FILTERS"):  # OpenCV >= 4.11
        params += [cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FAST_FILTERS]
    ok, data = cv2.imencode(".png", image, params)
    if not ok:
        raise OSError(f"OpenCV could not encode {path}")
    data = data.reshape(-1)
    ihdr_end = 8 + 4 + 4 + 13 + 4  # the signature, then IHDR: length, type, 13 bytes, CRC
    if bytes(data[12:16]) != b"IHDR":
        raise OSError(f"OpenCV's PNG of {path} does not start with IHDR")
    with open(path, "wb") as f:
        f.write(data[:ihdr_end])
        for key, value in (text or {}).items():
            f.write(_png_chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1")))
        f.write(data[ihdr_end:])


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk: length, type, payload, CRC-32 of type and payload (all big-endian)."""
    import zlib

    return (struct.pack(">I", len(payload)) + kind + payload
            + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF))
