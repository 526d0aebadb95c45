"""COLMAP sparse model: ``sparse/0/{cameras,images,points3D}.bin`` (and ``.txt`` on request, with pycolmap).

One PINHOLE camera per image in source-image pixels, world-to-camera poses as
quaternion (w, x, y, z) + translation, and points with tracks: the frames that see
each point (:func:`point_tracks`). The binary files are written from numpy
structured arrays in COLMAP's little-endian binary layout (the layout of
``colmap/scene/reconstruction_io_binary.cc``), so a model of 200k points takes a
fraction of a second; COLMAP >= 3.12 and pycolmap >= 3.12 give each camera its
trivial rig and each image its trivial frame when ``rigs.bin`` / ``frames.bin``
are absent, as here.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .points import MissingDependencyError, import_optional, thread_map

__all__ = ["rotmat_to_quat", "quat_to_rotmat", "point_tracks", "colmap_observations", "write_colmap_binary",
           "write_colmap_text", "write_colmap_model", "require_pycolmap"]

PINHOLE = 1  # COLMAP's model id of PINHOLE (fx, fy, cx, cy)
_CAMERA = np.dtype([("camera_id", "<u4"), ("model_id", "<i4"), ("width", "<u8"), ("height", "<u8"),
                    ("params", "<f8", (4,))])
_IMAGE = np.dtype([("image_id", "<u4"), ("qvec", "<f8", (4,)), ("tvec", "<f8", (3,)), ("camera_id", "<u4")])
_POINT2D = np.dtype([("xy", "<f8", (2,)), ("point3D_id", "<u8")])
_POINT3D = np.dtype([("point3D_id", "<u8"), ("xyz", "<f8", (3,)), ("rgb", "u1", (3,)), ("error", "<f8"),
                     ("track_length", "<u8")])
_TRACK = np.dtype([("image_id", "<u4"), ("point2D_idx", "<u4")])


def require_pycolmap():
    """Import and return pycolmap, or raise :class:`MissingDependencyError` naming the install line
    (:func:`~visionattn.recon.points.import_optional`)."""
    return import_optional("pycolmap", lambda exc: MissingDependencyError(
        f"this needs pycolmap, which failed to import ({exc}): pip install pycolmap"))


def rotmat_to_quat(R: np.ndarray) -> np.ndarray:
    """Rotation matrix [3, 3] -> unit quaternion (w, x, y, z) with w >= 0 (COLMAP's order).

    Uses the largest-diagonal branch (Shepperd) for numerical stability.
    """
    R = np.asarray(R, dtype=np.float64)
    tr = np.trace(R)
    if tr > 0:
        s = 2.0 * np.sqrt(1.0 + tr)
        q = np.array([0.25 * s, (R[2, 1] - R[1, 2]) / s, (R[0, 2] - R[2, 0]) / s, (R[1, 0] - R[0, 1]) / s])
    else:
        i = int(np.argmax(np.diag(R)))
        j, k = (i + 1) % 3, (i + 2) % 3
        s = 2.0 * np.sqrt(max(1.0 + R[i, i] - R[j, j] - R[k, k], 1e-300))
        q = np.empty(4)
        q[0] = (R[k, j] - R[j, k]) / s
        q[1 + i] = 0.25 * s
        q[1 + j] = (R[j, i] + R[i, j]) / s
        q[1 + k] = (R[k, i] + R[i, k]) / s
    q /= np.linalg.norm(q)
    return -q if q[0] < 0 else q


def quat_to_rotmat(q) -> np.ndarray:
    """Unit quaternion (w, x, y, z) -> rotation matrix [3, 3]."""
    w, x, y, z = np.asarray(q, dtype=np.float64) / np.linalg.norm(q)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


# The per-frame workers below take turns at their one matrix product: OpenBLAS's threaded GEMM has given wrong
# results when several threads call it at once (numpy issues 11046, 29391, 31618); it threads each product itself.
_BLAS = threading.Lock()


def point_tracks(xyz: np.ndarray, frame_idx: np.ndarray, extrinsics: np.ndarray, intrinsics: np.ndarray,
                 depth: np.ndarray, rel_tol: float = 0.05, workers: int | None = None) -> list[np.ndarray]:
    """The frames that see each point: in front, inside the frame, and not hidden.

    A point is seen by frame j when it projects (with ``extrinsics[j]``,
    ``intrinsics[j]``, pixel centres at integers as VGGT unprojects) inside frame
    j and its camera depth is within ``rel_tol`` of frame j's depth map at that
    pixel. The frame a point was unprojected from always sees it.

    Args:
        xyz: float [N, 3] world points; frame_idx: int [N], the frame each came from.
        extrinsics: [S, 3, 4]; intrinsics: [S, 3, 3] (model's frame); depth: [S, H, W].
        workers: threads the frames are spread over (default: the CPU count, at most 8; 1: this thread).

    Returns:
        per frame j, a bool array [N]: which points frame j sees.
    """
    S, H, W = depth.shape
    xyz_t = np.ascontiguousarray(np.asarray(xyz, np.float64).reshape(-1, 3).T)  # [3, N]: rows for each product
    frame_idx = np.asarray(frame_idx)

    def frame(j: int) -> np.ndarray:
        E, K = np.asarray(extrinsics[j], np.float64), np.asarray(intrinsics[j], np.float64)
        with _BLAS:
            P = K @ E
            uvw = P[:, :3] @ xyz_t  # the last row is the camera depth (K's last row is 0 0 1)
        uvw += P[:, 3:]
        z = uvw[2]
        with np.errstate(divide="ignore", invalid="ignore"):
            uv = np.divide(uvw[:2], z)
        u, v = np.rint(uv, out=uv)
        inside = np.flatnonzero((z > 1e-9) & (u >= 0) & (u < W) & (v >= 0) & (v < H))
        # one flat gather of the depth at those pixels (a 2-index fancy gather is ~2x slower)
        pix = v[inside].astype(np.intp)
        pix *= W
        pix += u[inside].astype(np.intp)
        d = np.take(depth[j].reshape(-1), pix)
        ok = frame_idx == j
        ok[inside] |= np.isfinite(d) & (np.abs(z[inside] - d) <= rel_tol * np.abs(d))
        return ok

    return thread_map(frame, range(S), workers, "recon-colmap")


def colmap_observations(xyz, extrinsics, intrinsics_src, seen, workers: int | None = None):
    """Observations of ``xyz`` [N, 3] by each image: the images that see each point (``seen``, per image a bool
    [N]), at the point's projection by that image's camera (source pixels, continuous).

    ``workers``: threads the images are spread over (default: the CPU count, at most 8; 1: this thread).

    Returns:
        (point index int64 [M], image index int64 [M] (0-based), xy float64 [M, 2]) ordered by image, then by
        point: COLMAP's POINT2D_IDX of an observation is its rank among its image's observations.
    """
    xyz_t = np.ascontiguousarray(np.asarray(xyz, np.float64).reshape(-1, 3).T)  # [3, N]

    def image(j: int):
        ids = np.flatnonzero(seen[j])
        E, K = np.asarray(extrinsics[j], np.float64), np.asarray(intrinsics_src[j], np.float64)
        sel = xyz_t[:, ids]
        with _BLAS:
            P = K @ E
            uvw = P[:, :3] @ sel
        uvw += P[:, 3:]
        return ids, (uvw[:2] / uvw[2]).T

    per = thread_map(image, range(len(seen)), workers, "recon-colmap")
    if not per:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 2))
    counts = [len(ids) for ids, _ in per]
    return (np.concatenate([ids for ids, _ in per]), np.repeat(np.arange(len(per), dtype=np.int64), counts),
            np.concatenate([xy for _, xy in per]))


def _write(path: str, *parts) -> None:
    with open(path, "wb") as f:
        for p in parts:
            f.write(np.ascontiguousarray(p).view(np.uint8) if isinstance(p, np.ndarray) else p)  # no copy


def write_colmap_binary(folder: str, image_names, extrinsics, intrinsics_src, sizes, xyz, rgb8, obs_point,
                        obs_image, obs_xy, errors=None) -> None:
    """Write ``cameras.bin``, ``images.bin`` and ``points3D.bin`` from arrays, in COLMAP's binary layout.

    Args:
        folder: existing destination (``.../sparse/0``).
        image_names: S file names under ``images/``; image j gets IMAGE_ID = CAMERA_ID = j + 1.
        extrinsics: [S, 3, 4] camera-from-world; intrinsics_src: [S, 3, 3] PINHOLE, source pixels;
            sizes: S (width, height) of the source images.
        xyz: [N, 3] points (POINT3D_ID = index + 1); rgb8: [N, 3] uint8 colours.
        obs_point, obs_image, obs_xy: the M observations (see :func:`colmap_observations`): point index,
            image index (0-based) and 2D position [M, 2], ordered by image then point.
        errors: [N] mean reprojection error per point in pixels (default 0).
    """
    S, N = len(image_names), len(xyz)
    cams = np.zeros(S, _CAMERA)
    cams["camera_id"] = np.arange(1, S + 1)
    cams["model_id"] = PINHOLE
    cams["width"], cams["height"] = np.asarray(sizes, np.int64).reshape(S, 2).T
    K = np.asarray(intrinsics_src, np.float64).reshape(S, 3, 3)
    cams["params"] = np.stack([K[:, 0, 0], K[:, 1, 1], K[:, 0, 2], K[:, 1, 2]], -1)
    _write(os.path.join(folder, "cameras.bin"), np.uint64(S), cams)

    obs_point, obs_image = np.asarray(obs_point, np.int64), np.asarray(obs_image, np.int64)
    M = len(obs_point)
    per_image = np.bincount(obs_image, minlength=S)
    starts = np.concatenate([[0], np.cumsum(per_image)])
    # a POINT2D is 3 x 8 bytes (x, y float64, POINT3D_ID uint64): filled as the columns of an [M, 3] array (a
    # structured array's (2,)-field is filled element by element, ~30x slower)
    p2d = np.empty((M, 3), np.float64)
    p2d[:, :2] = obs_xy
    np.add(obs_point, 1, out=p2d.view(np.uint64)[:, 2], casting="unsafe")
    p2d = p2d.reshape(-1).view(_POINT2D)
    heads = np.zeros(S, _IMAGE)
    E = np.asarray(extrinsics, np.float64).reshape(S, 3, 4)
    heads["image_id"] = heads["camera_id"] = np.arange(1, S + 1)
    heads["qvec"], heads["tvec"] = [rotmat_to_quat(R) for R in E[:, :, :3]], E[:, :, 3]
    with open(os.path.join(folder, "images.bin"), "wb") as f:  # the 2D points go out as one array slice each
        f.write(np.uint64(S).tobytes())
        for j in range(S):
            f.write(heads[j:j + 1].tobytes() + os.fsencode(image_names[j]) + b"\0" + np.uint64(per_image[j]).tobytes())
            f.write(p2d[starts[j]:starts[j + 1]].view(np.uint8))

    # tracks grouped by point, images in order within each: the observations are ordered by image, and within an
    # image each point occurs once, so one vectorised step per image places them (no sort of all M)
    length = np.bincount(obs_point, minlength=N)
    first = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)  # each point's first track element
    nxt = first.copy()
    track = np.empty((M, 2), np.uint32)  # a track element: IMAGE_ID, POINT2D_IDX
    for j in range(S):
        ids = obs_point[starts[j]:starts[j + 1]]
        at = nxt[ids]
        track[at, 0] = j + 1
        track[at, 1] = np.arange(per_image[j], dtype=np.uint32)
        nxt[ids] += 1
    head = np.zeros(N, _POINT3D)
    head["point3D_id"] = np.arange(1, N + 1)
    head["xyz"], head["rgb"], head["track_length"] = xyz, rgb8, length
    if errors is not None:
        head["error"] = errors
    # points3D.bin interleaves a fixed header per point with its variable-length track: a mask of the header
    # bytes (runs of header and track lengths) takes the headers' bytes, the rest the tracks' (already in order):
    # two bulk assignments, no loop over points
    hs, ts = _POINT3D.itemsize, _TRACK.itemsize
    total = N * hs + M * ts
    runs = np.empty(2 * N, np.int64)  # per point: its header's bytes, then its track's
    runs[0::2], runs[1::2] = hs, ts * length
    is_head = np.repeat(np.tile(np.array([True, False]), N), runs)
    buf = np.empty(total, np.uint8)
    buf[is_head] = head.view(np.uint8)
    buf[~is_head] = track.reshape(-1).view(np.uint8)
    _write(os.path.join(folder, "points3D.bin"), np.uint64(N), buf)


def write_colmap_text(folder: str) -> None:
    """Add COLMAP's text files (``cameras.txt``, ``images.txt``, ``points3D.txt``, ...) beside the binary model
    in ``folder``: pycolmap reads the binary model and writes them (COLMAP's own writer).

    Raises:
        MissingDependencyError: pycolmap is not installed.
    """
    rec = require_pycolmap().Reconstruction(folder)
    rec.write_text(folder)


def write_colmap_model(folder: str, image_names, extrinsics, intrinsics_src, sizes, xyz, rgb, seen,
                       text: bool = False, workers: int | None = None) -> dict:
    """Write a COLMAP model of a point cloud: binary always (numpy, :func:`write_colmap_binary`), text too with
    ``text`` (pycolmap, :func:`write_colmap_text`).

    Args:
        folder: ``.../sparse/0`` (created).
        image_names: per image, the file name under ``images/``.
        extrinsics: [S, 3, 4] camera-from-world; intrinsics_src: [S, 3, 3] in source pixels
            (continuous, as COLMAP); sizes: per image (width, height) of the source image.
        xyz, rgb: [N, 3] points and colours in [0, 1].
        seen: per image a bool [N] (see :func:`point_tracks`): the point's track.
        workers: threads of :func:`colmap_observations`.

    One PINHOLE camera per image (``fx fy cx cy``). Each observation's 2D point
    is the point projected by that image's COLMAP camera (reprojection error 0);
    images list them in point order. Poses are world-to-camera quaternion
    (w, x, y, z) + translation.

    Returns:
        dict with ``points``, ``observations``, ``binary`` (True) and ``text``.

    Raises:
        MissingDependencyError: ``text`` without pycolmap.
    """
    os.makedirs(folder, exist_ok=True)
    xyz = np.asarray(xyz, np.float64).reshape(-1, 3)
    rgb8 = np.clip(np.rint(np.asarray(rgb).reshape(-1, 3) * 255.0), 0, 255).astype(np.uint8)
    obs_point, obs_image, obs_xy = colmap_observations(xyz, extrinsics, intrinsics_src, seen, workers)
    write_colmap_binary(folder, image_names, extrinsics, intrinsics_src, sizes, xyz, rgb8, obs_point, obs_image,
                        obs_xy)
    if text:
        write_colmap_text(folder)
    return {"points": len(xyz), "observations": len(obs_point), "binary": True, "text": bool(text)}
