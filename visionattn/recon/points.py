"""Point clouds from per-pixel point maps: confidence filtering and the coloured PLY (trimesh).

trimesh (PLY and GLB writing) and open3d (reading clouds for the evaluation metrics) are optional (the
``[recon]`` extra): :func:`require_trimesh` / :func:`require_open3d` import them or raise
:class:`MissingDependencyError` naming the fix.
"""
from __future__ import annotations

import numpy as np

__all__ = ["MissingDependencyError", "require_open3d", "require_trimesh", "rgba8", "select_points",
           "confidence_threshold", "subsample", "write_ply"]


class MissingDependencyError(ImportError):
    """An optional dependency of the reconstruction outputs is missing or cannot load."""


def require_trimesh():
    """Import and return trimesh (points.ply and scene.glb), or raise :class:`MissingDependencyError` naming the
    fix."""
    try:
        import trimesh
    except ImportError as exc:
        raise MissingDependencyError(
            f"the reconstruction outputs need trimesh, which failed to import ({exc}). Install it with "
            "`pip install \"visionattn[recon]\"` (or `pip install trimesh`).") from exc
    return trimesh


def require_open3d():
    """Import and return open3d, or raise :class:`MissingDependencyError` naming the fix.

    open3d is the ``[recon]`` extra; its Linux wheels also need the system library
    libusb-1.0 (Debian/Ubuntu: ``apt-get install libusb-1.0-0``).
    """
    try:
        import open3d
    except ImportError as exc:
        raise MissingDependencyError(
            f"the reconstruction outputs need open3d, which failed to import ({exc}). Install it with "
            "`pip install \"visionattn[recon]\"`; on Debian/Ubuntu open3d also needs "
            "`apt-get install libusb-1.0-0`.") from exc
    return open3d


def select_points(points: np.ndarray, colors: np.ndarray, conf: np.ndarray,
                  conf_percentile: float = 50.0, max_points: int | None = None, seed: int = 0):
    """Confidence-filter a per-pixel point map.

    Args:
        points: [S, H, W, 3] world points.
        colors: [S, H, W, 3] colours in [0, 1].
        conf: [S, H, W] confidence (larger is better).
        conf_percentile: drop points whose confidence is below this percentile (0..100)
            of the finite confidences; 0 keeps every finite point.
        max_points: if set, keep a random subset of at most this many (seeded).

    Returns:
        (xyz float32 [N, 3], rgb float32 [N, 3], frame index int32 [N], pixel index int64 [N]).

    Raises:
        ValueError: shapes disagree or ``conf_percentile`` outside [0, 100].
    """
    if not 0.0 <= conf_percentile <= 100.0:
        raise ValueError(f"conf_percentile={conf_percentile} must be in [0, 100]")
    if points.shape[:-1] != conf.shape or colors.shape != points.shape:
        raise ValueError(f"shapes disagree: points {points.shape}, colors {colors.shape}, conf {conf.shape}")
    finite = _finite_points(points) & np.isfinite(conf)
    keep = finite & (conf >= _threshold(conf, finite, conf_percentile))
    idx = np.flatnonzero(keep.reshape(-1))
    sub = subsample(idx.size, max_points, seed)
    if sub is not None:
        idx = idx[sub]
    hw = conf.shape[1] * conf.shape[2]
    # np.take of whole rows: about 3x faster than fancy indexing [idx] on a 10M-point cloud; no second copy
    # where the arrays are float32 already; colours clipped in place
    xyz = np.take(points.reshape(-1, 3), idx, axis=0).astype(np.float32, copy=False)
    rgb = np.take(colors.reshape(-1, 3), idx, axis=0).astype(np.float32, copy=False)
    np.clip(rgb, 0.0, 1.0, out=rgb)
    frame, pixel = np.divmod(idx, hw)
    return xyz, rgb, frame.astype(np.int32), pixel


def _finite_points(points: np.ndarray) -> np.ndarray:
    """``np.isfinite(points).all(-1)``, one coordinate at a time (a reduction over a last axis of 3 is slow:
    about 5x slower on a [S, H, W, 3] map)."""
    out = np.isfinite(points[..., 0])
    for k in range(1, points.shape[-1]):
        out &= np.isfinite(points[..., k])
    return out


def confidence_threshold(points: np.ndarray, conf: np.ndarray, conf_percentile: float) -> float:
    """The confidence :func:`select_points` keeps from: the ``conf_percentile`` percentile of the confidences
    [S, H, W] of finite points [S, H, W, 3] (-inf when it is 0 or none is finite)."""
    return _threshold(conf, _finite_points(points) & np.isfinite(conf), conf_percentile)


def _threshold(conf: np.ndarray, finite: np.ndarray, conf_percentile: float) -> float:
    if conf_percentile <= 0 or not finite.any():
        return -np.inf
    return float(np.percentile(conf[finite], conf_percentile))


def rgba8(rgb: np.ndarray) -> np.ndarray:
    """[N, 3] colours in [0, 1] -> [N, 4] uint8 RGBA (opaque), as trimesh's point clouds take them.

    Rounds half to even in the input's own float precision (float32 stays float32: no float64 copy of a large
    cloud).
    """
    rgb = np.asarray(rgb).reshape(-1, 3)
    if not np.issubdtype(rgb.dtype, np.floating):
        rgb = rgb.astype(np.float64)
    out = np.empty((len(rgb), 4), np.uint8)
    out[:, :3] = np.rint(np.clip(rgb, 0.0, 1.0) * 255)
    out[:, 3] = 255
    return out


def subsample(n: int, max_points: int | None, seed: int = 0) -> np.ndarray | None:
    """Sorted indices of a seeded random subset of ``max_points`` of ``n`` points, or None when all fit."""
    if max_points is None or n <= max_points:
        return None
    return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


def write_ply(path: str, xyz: np.ndarray, rgb: np.ndarray) -> None:
    """Write a coloured point cloud as a binary little-endian PLY (trimesh): float32 x, y, z and uint8 RGBA
    per vertex, which open3d, MeshLab, CloudCompare and Blender read.

    Args:
        xyz: [N, 3] points (any float dtype).
        rgb: [N, 3] colours in [0, 1] (clipped, rounded to 8 bits).

    Raises:
        MissingDependencyError: see :func:`require_trimesh`.
    """
    trimesh = require_trimesh()
    data = trimesh.PointCloud(np.asarray(xyz).reshape(-1, 3), colors=rgba8(rgb)).export(file_type="ply",
                                                                                       encoding="binary")
    with open(path, "wb") as f:
        f.write(data)
