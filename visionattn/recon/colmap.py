"""COLMAP sparse model: ``sparse/0/{cameras,images,points3D}.txt`` (and ``.bin`` with pycolmap).

One PINHOLE camera per image in source-image pixels, world-to-camera poses as
quaternion (w, x, y, z) + translation, and points with tracks: the frames that see
each point (:func:`point_tracks`).
"""
from __future__ import annotations

import os

import numpy as np

from .points import MissingDependencyError

__all__ = ["rotmat_to_quat", "quat_to_rotmat", "point_tracks", "write_colmap_model"]


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


def point_tracks(xyz: np.ndarray, frame_idx: np.ndarray, extrinsics: np.ndarray, intrinsics: np.ndarray,
                 depth: np.ndarray, rel_tol: float = 0.05) -> list[np.ndarray]:
    """The frames that see each point: in front, inside the frame, and not hidden.

    A point is seen by frame j when it projects (with ``extrinsics[j]``,
    ``intrinsics[j]``, pixel centres at integers as VGGT unprojects) inside frame
    j and its camera depth is within ``rel_tol`` of frame j's depth map at that
    pixel. The frame a point was unprojected from always sees it.

    Args:
        xyz: float [N, 3] world points; frame_idx: int [N], the frame each came from.
        extrinsics: [S, 3, 4]; intrinsics: [S, 3, 3] (model's frame); depth: [S, H, W].

    Returns:
        per frame j, a bool array [N]: which points frame j sees.
    """
    S, H, W = depth.shape
    seen = []
    for j in range(S):
        E, K = np.asarray(extrinsics[j], np.float64), np.asarray(intrinsics[j], np.float64)
        cam = xyz.astype(np.float64) @ E[:, :3].T + E[:, 3]
        z = cam[:, 2]
        front = z > 1e-9
        uvw = cam @ K.T
        with np.errstate(divide="ignore", invalid="ignore"):
            u = np.round(uvw[:, 0] / uvw[:, 2])
            v = np.round(uvw[:, 1] / uvw[:, 2])
        inside = front & (u >= 0) & (u < W) & (v >= 0) & (v < H)
        ok = np.zeros(len(xyz), bool)
        ui, vi = u[inside].astype(np.int64), v[inside].astype(np.int64)
        d = depth[j][vi, ui]
        ok[inside] = np.isfinite(d) & (np.abs(z[inside] - d) <= rel_tol * np.abs(d))
        ok |= frame_idx == j
        seen.append(ok)
    return seen


def write_colmap_model(folder: str, image_names, extrinsics, intrinsics_src, sizes, xyz, rgb, seen,
                       affines=None, binary: bool | None = None, warn=None) -> dict:
    """Write a COLMAP model: text always, binary too when pycolmap is installed.

    Args:
        folder: ``.../sparse/0`` (created).
        image_names: per image, the file name under ``images/``.
        extrinsics: [S, 3, 4] camera-from-world; intrinsics_src: [S, 3, 3] in source pixels
            (continuous, as COLMAP); sizes: per image (width, height) of the source image.
        xyz, rgb: [N, 3] points and colours in [0, 1].
        seen: per image a bool [N] (see :func:`point_tracks`): the point's track.
        binary: write ``*.bin`` with pycolmap (None: when pycolmap imports).
        warn: callable(str) for the note when pycolmap is missing.

    One PINHOLE camera per image (``fx fy cx cy``). Each observation's 2D point
    is the point projected by that image's COLMAP camera; images list them in
    point order. Poses are world-to-camera quaternion (w, x, y, z) + translation.

    Returns:
        dict with ``points``, ``observations``, ``binary`` (bool).
    """
    os.makedirs(folder, exist_ok=True)
    xyz = np.asarray(xyz, np.float64).reshape(-1, 3)
    rgb8 = np.clip(np.round(np.asarray(rgb).reshape(-1, 3) * 255.0), 0, 255).astype(np.int64)
    S, N = len(image_names), len(xyz)
    # per image: the observed point indices and their 2D positions (projected by that image's camera)
    obs_pts, obs_xy = [], []
    for j in range(S):
        ids = np.flatnonzero(seen[j])
        E, K = np.asarray(extrinsics[j], np.float64), np.asarray(intrinsics_src[j], np.float64)
        uvw = (xyz[ids] @ E[:, :3].T + E[:, 3]) @ K.T
        obs_pts.append(ids)
        obs_xy.append(uvw[:, :2] / uvw[:, 2:3])
    # per point: its track as "IMAGE_ID POINT2D_IDX" pairs, grouped by point (stable sort keeps image order)
    all_pid = np.concatenate(obs_pts) if S else np.zeros(0, np.int64)
    all_img = np.concatenate([np.full(len(ids), j + 1) for j, ids in enumerate(obs_pts)]) if S else all_pid
    all_k = np.concatenate([np.arange(len(ids)) for ids in obs_pts]) if S else all_pid
    order = np.argsort(all_pid, kind="stable")
    pairs = [f"{i} {k}" for i, k in zip(all_img[order].tolist(), all_k[order].tolist())]
    ends = np.cumsum(np.bincount(all_pid, minlength=N)).tolist()
    starts = [0] + ends[:-1]
    with open(os.path.join(folder, "cameras.txt"), "w") as f:
        f.write("# Camera list with one line of data per camera:\n#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]\n")
        f.write(f"# Number of cameras: {S}\n")
        for i, K in enumerate(intrinsics_src):
            w, h = sizes[i]
            f.write(f"{i + 1} PINHOLE {int(w)} {int(h)} {K[0][0]:.17g} {K[1][1]:.17g} {K[0][2]:.17g} {K[1][2]:.17g}\n")
    n_obs = sum(len(ids) for ids in obs_pts)
    with open(os.path.join(folder, "images.txt"), "w") as f:
        f.write("# Image list with two lines of data per image:\n")
        f.write("#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME\n#   POINTS2D[] as (X, Y, POINT3D_ID)\n")
        f.write(f"# Number of images: {S}, mean observations per image: {n_obs / max(S, 1):.3f}\n")
        for j in range(S):
            E = np.asarray(extrinsics[j], dtype=np.float64)
            q, t = rotmat_to_quat(E[:, :3]), E[:, 3]
            f.write(f"{j + 1} {q[0]:.17g} {q[1]:.17g} {q[2]:.17g} {q[3]:.17g} "
                    f"{t[0]:.17g} {t[1]:.17g} {t[2]:.17g} {j + 1} {image_names[j]}\n")
            f.write(" ".join(f"{x:.9g} {y:.9g} {pid + 1}" for (x, y), pid in zip(obs_xy[j].tolist(),
                                                                                 obs_pts[j].tolist())) + "\n")
    with open(os.path.join(folder, "points3D.txt"), "w") as f:
        f.write("# 3D point list with one line of data per point:\n")
        f.write("#   POINT3D_ID, X, Y, Z, R, G, B, ERROR, TRACK[] as (IMAGE_ID, POINT2D_IDX)\n")
        f.write(f"# Number of points: {N}, mean track length: {n_obs / max(N, 1):.3f}\n")
        f.writelines(f"{n + 1} {p[0]:.9g} {p[1]:.9g} {p[2]:.9g} {c[0]} {c[1]} {c[2]} 0 "
                     + " ".join(pairs[a:b]) + "\n"
                     for n, (p, c, a, b) in enumerate(zip(xyz.tolist(), rgb8.tolist(), starts, ends)))
    wrote_binary = False
    if binary is None or binary:
        try:
            import pycolmap
        except ImportError:
            if binary:
                raise MissingDependencyError("binary COLMAP output needs pycolmap: pip install pycolmap")
            if warn is not None:
                warn("note: pycolmap is not installed, so the COLMAP model is written as text only "
                     "(pip install pycolmap for cameras.bin / images.bin / points3D.bin)")
        else:
            rec = pycolmap.Reconstruction()
            rec.read_text(folder)  # COLMAP's own reader and writer: the .bin files match the text exactly
            rec.write_binary(folder)
            wrote_binary = True
    return {"points": N, "observations": n_obs, "binary": wrote_binary}
