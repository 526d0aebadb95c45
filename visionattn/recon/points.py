"""Point clouds from per-pixel point maps: confidence filtering and the coloured PLY (numpy, in trimesh's layout).

trimesh (GLB writing, reading clouds back) and open3d (reading clouds for the evaluation metrics) are optional (the
``[recon]`` extra): :func:`require_trimesh` / :func:`require_open3d` import them or raise
:class:`MissingDependencyError` naming the fix.
"""
from __future__ import annotations

import os

import numpy as np

__all__ = ["MissingDependencyError", "import_optional", "require_open3d", "require_trimesh", "check_trimesh",
           "rgba8", "select_points", "confidence_threshold", "subsample", "write_ply", "worker_count", "thread_map",
           "thread_imap"]


class MissingDependencyError(ImportError):
    """An optional dependency of the reconstruction outputs is missing or cannot load."""


def _trimesh_missing(why) -> MissingDependencyError:
    return MissingDependencyError(f"the reconstruction outputs need trimesh, which failed to import ({why}). "
                                  "Install it with `pip install \"visionattn[recon]\"` (or `pip install trimesh`).")


def import_optional(name: str, missing):
    """Import and return module ``name`` (an optional dependency), or raise ``missing(exc)`` (a
    :class:`MissingDependencyError` naming the fix) from the ``ImportError``. A stop signal (Ctrl-C, SIGTERM,
    SIGHUP) during the import is acted on once it ends (:func:`~visionattn.recon.outdir.stop_signals_deferred`):
    a library's optional-import guards that catch ``BaseException`` (trimesh's do) would otherwise swallow the
    stop exception raised inside them, and the run would go on."""
    import importlib

    from .outdir import stop_signals_deferred

    try:
        with stop_signals_deferred():
            return importlib.import_module(name)
    except ImportError as exc:
        raise missing(exc) from exc


def require_trimesh():
    """Import and return trimesh (points.ply and scene.glb), or raise :class:`MissingDependencyError` naming the
    fix (:func:`import_optional`)."""
    return import_optional("trimesh", _trimesh_missing)


def check_trimesh() -> None:
    """Raise :class:`MissingDependencyError` naming the fix unless trimesh is installed, without importing it: the
    import takes a second or two, which the writers of points.ply and scene.glb pay when they run, beside the
    other outputs; a caller checks here before any long work."""
    import importlib.util

    try:
        found = importlib.util.find_spec("trimesh") is not None
    except (ImportError, ValueError) as exc:  # ValueError: a module entry without a spec (e.g. set to None)
        raise _trimesh_missing(exc) from exc
    if not found:
        raise _trimesh_missing("No module named 'trimesh'")


def require_open3d():
    """Import and return open3d, or raise :class:`MissingDependencyError` naming the fix (:func:`import_optional`).

    open3d is the ``[recon]`` extra; its Linux wheels also need the system library
    libusb-1.0 (Debian/Ubuntu: ``apt-get install libusb-1.0-0``).
    """
    return import_optional("open3d", lambda exc: MissingDependencyError(
        f"the reconstruction outputs need open3d, which failed to import ({exc}). Install it with "
        "`pip install \"visionattn[recon]\"`; on Debian/Ubuntu open3d also needs `apt-get install libusb-1.0-0`."))


def select_points(points: np.ndarray, colors: np.ndarray, conf: np.ndarray,
                  conf_percentile: float = 50.0, max_points: int | None = None, seed: int = 0,
                  workers: int | None = None):
    """Confidence-filter a per-pixel point map.

    Args:
        points: [S, H, W, 3] world points.
        colors: [S, H, W, 3] colours in [0, 1].
        conf: [S, H, W] confidence (larger is better).
        conf_percentile: drop points whose confidence is below this percentile (0..100)
            of the finite confidences; 0 keeps every finite point.
        max_points: if set, keep a random subset of at most this many (seeded).
        workers: threads the per-pixel work (finite test, gathers) is split over, in contiguous ranges (numpy
            releases the GIL on them); default the CPU count, at most 8; 1: this thread. The percentile is one
            partition in this thread.

    Returns:
        (xyz float32 [N, 3], rgb float32 [N, 3], frame index int32 [N], pixel index int64 [N]).

    Raises:
        ValueError: shapes disagree or ``conf_percentile`` outside [0, 100].
    """
    if not 0.0 <= conf_percentile <= 100.0:
        raise ValueError(f"conf_percentile={conf_percentile} must be in [0, 100]")
    if points.shape[:-1] != conf.shape or colors.shape != points.shape:
        raise ValueError(f"shapes disagree: points {points.shape}, colors {colors.shape}, conf {conf.shape}")
    S, hw = conf.shape[0], conf.shape[1] * conf.shape[2]
    finite = np.empty(conf.shape, bool)

    def finite_frames(a: int, b: int) -> None:
        finite[a:b] = _finite_points(points[a:b])
        finite[a:b] &= np.isfinite(conf[a:b])

    _split(finite_frames, S, workers)
    keep = finite & (conf >= _threshold(conf, finite, conf_percentile))
    idx = np.flatnonzero(keep.reshape(-1))
    # each point's frame from the per-frame counts (idx is sorted): no [N] int64 division
    counts = np.diff(np.searchsorted(idx, np.arange(S + 1, dtype=np.int64) * hw))
    frame = np.repeat(np.arange(S, dtype=np.int32), counts)
    pixel = idx - np.repeat(np.arange(S, dtype=np.int64) * hw, counts)
    sub = subsample(idx.size, max_points, seed)
    if sub is not None:
        idx, frame, pixel = idx[sub], frame[sub], pixel[sub]
    # np.take of whole rows: about 3x faster than fancy indexing [idx] on a 10M-point cloud; into the outputs
    # (mode "clip": unbuffered; the indices are in range), a range of points per thread; colours clipped in place
    xyz = np.empty((idx.size, 3), points.dtype)
    rgb = np.empty((idx.size, 3), colors.dtype)
    flat_points, flat_colors = points.reshape(-1, 3), colors.reshape(-1, 3)

    def gather(a: int, b: int) -> None:
        np.take(flat_points, idx[a:b], axis=0, out=xyz[a:b], mode="clip")
        np.take(flat_colors, idx[a:b], axis=0, out=rgb[a:b], mode="clip")
        np.clip(rgb[a:b], 0.0, 1.0, out=rgb[a:b])

    _split(gather, idx.size, workers)
    return xyz.astype(np.float32, copy=False), rgb.astype(np.float32, copy=False), frame, pixel


def worker_count(workers: int | None, tasks: int | None = None) -> int:
    """Threads for the export's parallel numpy work: ``workers``, by default the CPU count, at most 8; no more than
    ``tasks`` pieces of work when given, at least 1."""
    n = workers or min(8, os.cpu_count() or 1)
    return max(1, n if tasks is None else min(n, tasks))


def thread_map(fn, items, workers: int | None, name: str) -> list:
    """``[fn(x) for x in items]`` on up to :func:`worker_count` threads (named ``name``), in this thread when one
    is all there is; numpy releases the GIL on the per-item work, so items run side by side."""
    from concurrent.futures import ThreadPoolExecutor

    items = list(items)
    workers = worker_count(workers, len(items))
    if workers == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        return list(pool.map(fn, items))


def thread_imap(fn, items, workers: int | None = None, name: str = "recon", window: int | None = None):
    """Yield ``fn(x)`` for each ``x`` of ``items`` in order, computed on up to :func:`worker_count` daemon threads
    with at most ``window`` (default twice the threads) items in flight: ``items`` is drawn lazily, in the
    consuming thread, so memory holds a bounded number of them (full-resolution frames, say). An error of ``fn``
    is raised where its result is taken. When the generator ends, fails or is closed, the items not started are
    dropped and the running ones waited for: nothing of it runs on afterwards.

    ``fn`` must not import (have every module it needs imported before): a stop signal's exception raised in the
    main thread during an import can leave the import system's lock held, and a worker's import would then wait
    forever. Daemon threads, so that an interpreter that exits does not wait for them."""
    workers = worker_count(workers)
    if workers == 1:
        for x in items:
            yield fn(x)
        return
    import queue
    import threading
    from collections import deque

    window = window or 2 * workers
    tasks = queue.SimpleQueue()

    def work():
        while (job := tasks.get()) is not None:
            x, box, done = job
            try:
                box[:] = [True, fn(x)]
            except BaseException as exc:  # raised where the result is taken
                box[:] = [False, exc]
            finally:
                done.set()

    threads = [threading.Thread(target=work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    pending = deque()

    def take():
        box, done = pending.popleft()
        done.wait()
        ok, value = box
        if not ok:
            raise value
        return value

    try:
        for x in items:
            box, done = [], threading.Event()
            pending.append((box, done))
            tasks.put((x, box, done))
            if len(pending) >= window:
                yield take()
        while pending:
            yield take()
    finally:
        while True:  # the items not started: dropped
            try:
                job = tasks.get_nowait()
            except queue.Empty:
                break
            job[2].set()
        for _ in threads:
            tasks.put(None)
        for _, done in pending:  # the running ones: waited for
            done.wait()


def _split(fn, n: int, workers: int | None) -> None:
    """``fn(a, b)`` over contiguous ranges covering [0, n), one per thread of :func:`thread_map`."""
    bounds = np.linspace(0, n, worker_count(workers, n) + 1).astype(np.int64)
    thread_map(lambda ab: fn(*ab), zip(bounds[:-1].tolist(), bounds[1:].tolist()), workers, "recon-select")


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
    return float(np.percentile(conf[finite], conf_percentile, overwrite_input=True))  # partitions its own copy


def rgba8(rgb: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """[N, 3] colours in [0, 1] -> [N, 4] uint8 RGBA (opaque), as trimesh's point clouds take them.

    Rounds half to even in the input's own float precision (float32 stays float32: no float64 copy of a large
    cloud), through one temporary. ``out``: a [N, 4] uint8 array (or view, e.g. a field of a structured array)
    to fill instead of a new one.
    """
    rgb = np.asarray(rgb).reshape(-1, 3)
    if not np.issubdtype(rgb.dtype, np.floating):
        rgb = rgb.astype(np.float64)
    if out is None:
        out = np.empty((len(rgb), 4), np.uint8)
    t = np.clip(rgb, 0.0, 1.0)
    t *= 255
    out[:, :3] = np.rint(t, out=t)
    out[:, 3] = 255
    return out


def subsample(n: int, max_points: int | None, seed: int = 0) -> np.ndarray | None:
    """Sorted indices of a seeded random subset of ``max_points`` of ``n`` points, or None when all fit."""
    if max_points is None or n <= max_points:
        return None
    return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


_PLY_VERTEX = np.dtype([("xyz", "<f4", (3,)), ("rgba", "u1", (4,))])
_PLY_CHUNK = 1 << 20  # points per write: a 16 MiB buffer


def write_ply(path: str, xyz: np.ndarray, rgb: np.ndarray) -> None:
    """Write a coloured point cloud as a binary little-endian PLY: float32 x, y, z and uint8 RGBA per vertex
    (trimesh's layout for a point cloud), which open3d, trimesh, MeshLab, CloudCompare and Blender read.

    The vertices go out from numpy in chunks of a structured array: the bytes trimesh's exporter writes after
    its header, without its copies (about 10x faster on a 10M-point cloud, and no second copy of it in memory).

    Args:
        xyz: [N, 3] points (any float dtype; stored as float32).
        rgb: [N, 3] colours in [0, 1] (clipped, rounded half to even to 8 bits; alpha 255).
    """
    xyz = np.asarray(xyz).reshape(-1, 3)
    rgb = np.asarray(rgb).reshape(-1, 3)
    n = len(xyz)
    if len(rgb) != n:
        raise ValueError(f"{n} points but {len(rgb)} colours")
    header = ("ply\nformat binary_little_endian 1.0\ncomment written by visionattn\n"
              f"element vertex {n}\nproperty float x\nproperty float y\nproperty float z\n"
              "property uchar red\nproperty uchar green\nproperty uchar blue\nproperty uchar alpha\nend_header\n")
    buf = np.empty(min(n, _PLY_CHUNK), _PLY_VERTEX)
    with open(path, "wb") as f:
        f.write(header.encode("ascii"))
        for a in range(0, n, _PLY_CHUNK):
            b = min(a + _PLY_CHUNK, n)
            v = buf[:b - a]
            v["xyz"] = xyz[a:b]
            rgba8(rgb[a:b], out=v["rgba"])
            f.write(v.view(np.uint8))
