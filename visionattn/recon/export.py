"""Write a reconstruction to disk: the files people load next.

Layout of an output folder (written into a temporary sibling folder, then
renamed into place, so a crash never leaves a half-written ``OUT_DIR``; see
:mod:`visionattn.recon.outdir`)::

    points.ply                  coloured, confidence-filtered point cloud (open3d, MeshLab, CloudCompare)
    cameras.json                per frame: name, source, stored image, extrinsic 3x4 (OpenCV
                                camera-from-world), intrinsic 3x3 of the model's frame and of the
                                source image; the global depth PNG scale
    images/NAME.EXT             the frames under the names every other file uses (source-image pixels)
    sparse/0/{cameras,images,points3D}.txt   COLMAP text model (PINHOLE per image, source pixels,
                                points with tracks); the same model as .bin (plus rigs/frames.bin)
                                when pycolmap is installed. COLMAP, nerfstudio, gsplat, pycolmap
    transforms.json             nerfstudio: OpenGL camera-to-world, per-frame intrinsics,
                                depth_file_path, one depth_unit_scale_factor
    scene.glb                   point cloud + camera frusta for any glTF viewer (trimesh)
    depth/NAME.png              16-bit depth in source-image pixels: depth = value * depth_unit_scale_factor
                                (one scale for all frames; 0 = no depth)
    depth/NAME.npy              float32 [H, W] depth of the model's frame
    confidence/NAME.npy         float32 [H, W] depth confidence
    preview.png, summary.json   (written by :mod:`visionattn.recon.pipeline`)

World frame: VGGT's, i.e. the first camera's frame (up to an unknown scale).
Pixel convention of every intrinsic matrix: continuous coordinates, the image
spanning [0, W] x [0, H] (pixel (i, j) centred at (i + 0.5, j + 0.5)), as COLMAP
and nerfstudio use.
"""
from __future__ import annotations

import json
import os
import numpy as np

from .outdir import OutputDirError, atomic_output_dir, check_output_dir

__all__ = [
    "OutputDirError", "MissingDependencyError", "require_open3d", "check_output_dir", "atomic_output_dir",
    "select_points", "write_ply", "rotmat_to_quat", "quat_to_rotmat", "continuous_affine", "original_intrinsics",
    "write_cameras_json", "point_tracks", "write_colmap_model", "depth_to_source_pixels", "depth_png_scale",
    "write_depth", "OPENCV_TO_OPENGL", "camera_to_world_opengl", "write_transforms_json", "write_glb",
    "write_reconstruction",
]

_MAX_COLMAP_POINTS = 200_000


class MissingDependencyError(ImportError):
    """An optional dependency of the reconstruction outputs is missing or cannot load."""


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
    finite = np.isfinite(points).all(-1) & np.isfinite(conf)
    keep = finite.copy()
    if conf_percentile > 0 and finite.any():
        thr = np.percentile(conf[finite], conf_percentile)
        keep &= conf >= thr
    idx = np.flatnonzero(keep.reshape(-1))
    if max_points is not None and idx.size > max_points:
        idx = np.sort(np.random.default_rng(seed).choice(idx, size=max_points, replace=False))
    hw = conf.shape[1] * conf.shape[2]
    xyz = points.reshape(-1, 3)[idx].astype(np.float32)
    rgb = np.clip(colors.reshape(-1, 3)[idx], 0.0, 1.0).astype(np.float32)
    return xyz, rgb, (idx // hw).astype(np.int32), (idx % hw).astype(np.int64)


def write_ply(path: str, xyz: np.ndarray, rgb: np.ndarray) -> None:
    """Write a coloured point cloud with open3d (binary PLY).

    Raises:
        MissingDependencyError: see :func:`require_open3d`.
        OSError: open3d reported a failed write.
    """
    o3d = require_open3d()
    pcd = o3d.geometry.PointCloud()
    pcd.points = o3d.utility.Vector3dVector(np.asarray(xyz, dtype=np.float64).reshape(-1, 3))
    pcd.colors = o3d.utility.Vector3dVector(np.asarray(rgb, dtype=np.float64).reshape(-1, 3))
    if not o3d.io.write_point_cloud(path, pcd, write_ascii=False):
        raise OSError(f"open3d could not write {path!r}")


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


def continuous_affine(affine) -> np.ndarray:
    """3x3 matrix A mapping continuous source-image coordinates to the model's frame.

    ``affine`` = (sx, sy, ox, oy) maps pixel *indices* (pixel centres at integers; see
    :class:`visionattn.recon.images.LoadedImages`); in continuous coordinates (centres
    at +0.5) the same map has offsets ``o + 0.5 - 0.5 s``.
    """
    sx, sy, ox, oy = (float(v) for v in affine)
    return np.array([[sx, 0.0, ox + 0.5 - 0.5 * sx], [0.0, sy, oy + 0.5 - 0.5 * sy], [0.0, 0.0, 1.0]])


def original_intrinsics(K: np.ndarray, affine) -> np.ndarray:
    """Intrinsics [3, 3] of the model's frame -> intrinsics of the source image (K_src = A^-1 K).

    Both in continuous pixel coordinates (see :func:`continuous_affine`), so a
    principal point at the centre of the model's frame maps to the centre of the
    source image.
    """
    return np.linalg.solve(continuous_affine(affine), np.asarray(K, dtype=np.float64))


def _finite_list(a) -> list:
    """Nested list of Python floats with non-finite values as None (strict JSON has no inf/NaN)."""
    a = np.asarray(a, dtype=np.float64)
    out = a.astype(object)
    out[~np.isfinite(a)] = None
    return out.tolist()


def write_cameras_json(path: str, names, sources, extrinsics, intrinsics, image_hw, original_sizes=None,
                       affines=None, depth_scale=None, fallback=None, extra=None, image_files=None) -> dict:
    """Write ``cameras.json`` and return its content.

    Args:
        names / sources: per-frame output name and source (file name, or ``VIDEO#frame=N``).
        extrinsics: [S, 3, 4] OpenCV camera-from-world (x_cam = R x_world + t).
        intrinsics: [S, 3, 3] for the model's frame of size ``image_hw`` = (H, W).
        original_sizes: per frame (width, height) of the source image (optional).
        affines: per frame (sx, sy, ox, oy) source -> model pixels (optional; gives ``intrinsic_original``).
        depth_scale: the one scale of every ``depth/NAME.png``: depth = value / depth_scale (optional).
        fallback: per frame bool, intrinsics replaced because the prediction was unusable (optional).
        extra: extra top-level keys (model, mode, ...).
        image_files: per frame, the stored frame's path relative to the output folder (optional).
    """
    frames = []
    for i, name in enumerate(names):
        fr = {"name": name, "file": sources[i],
              "extrinsic": _finite_list(extrinsics[i]), "intrinsic": _finite_list(intrinsics[i]),
              "width": int(image_hw[1]), "height": int(image_hw[0])}
        if image_files:
            fr["image"] = image_files[i]
        if original_sizes is not None:
            fr["original_width"], fr["original_height"] = (int(v) for v in original_sizes[i])
        if affines is not None:
            fr["intrinsic_original"] = _finite_list(original_intrinsics(intrinsics[i], affines[i]))
        if fallback is not None:
            fr["intrinsic_fallback"] = bool(fallback[i])
        frames.append(fr)
    doc = {"convention": "OpenCV camera-from-world extrinsic [R|t]: x_cam = R @ x_world + t; "
                         "world = first camera's frame; intrinsic in continuous pixels of the model's frame "
                         "(intrinsic_original: of the source image, as in images/)",
           "frames": frames}
    if depth_scale is not None:
        doc["depth_png_scale"] = float(depth_scale)
        doc["depth_png"] = ("depth/NAME.png: uint16 in source-image pixels, depth = value / depth_png_scale "
                            "(one scale for every frame; 0 = no depth)")
    doc.update(extra or {})
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
    return doc


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


def depth_to_source_pixels(depth: np.ndarray, affine, size) -> np.ndarray:
    """Resample a depth map of the model's frame [H, W] onto the source image's pixel grid.

    Each source pixel takes the depth of the model pixel its centre maps to
    (nearest; ``affine`` as in :class:`~visionattn.recon.images.LoadedImages`);
    pixels outside the model's frame (cropped away) get NaN.

    Returns:
        float32 [height, width] for ``size`` = (width, height).
    """
    sx, sy, ox, oy = affine
    w, h = size
    H, W = depth.shape
    u = np.round(sx * np.arange(w) + ox).astype(np.int64)
    v = np.round(sy * np.arange(h) + oy).astype(np.int64)
    out = np.full((h, w), np.nan, np.float32)
    ku, kv = (u >= 0) & (u < W), (v >= 0) & (v < H)
    out[np.ix_(kv, ku)] = depth[np.ix_(v[kv], u[ku])]
    return out


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
    """
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    depth = np.asarray(depth, dtype=np.float32)
    np.save(os.path.join(folder_depth, f"{name}.npy"), depth)
    if conf is not None:
        np.save(os.path.join(folder_conf, f"{name}.npy"), np.asarray(conf, dtype=np.float32))
    d = depth_to_source_pixels(depth, affine, size) if affine is not None else depth
    valid = np.isfinite(d) & (d > 0)
    png = np.round(np.where(valid, d, 0.0).astype(np.float64) * scale).clip(0, 65535).astype(np.uint16)
    info = PngInfo()
    info.add_text("depth_scale", repr(scale))
    info.add_text("description", "depth = value / depth_scale (0 = invalid)")
    Image.fromarray(png).save(os.path.join(folder_depth, f"{name}.png"), pnginfo=info)


OPENCV_TO_OPENGL = np.diag([1.0, -1.0, -1.0])  # camera axes: x right, y down, z forward -> y up, z back


def camera_to_world_opengl(extrinsic: np.ndarray) -> np.ndarray:
    """OpenCV camera-from-world [3, 4] -> OpenGL camera-to-world [4, 4] (nerfstudio's transform_matrix)."""
    E = np.asarray(extrinsic, np.float64)
    R, t = E[:, :3], E[:, 3]
    M = np.eye(4)
    M[:3, :3] = R.T @ OPENCV_TO_OPENGL
    M[:3, 3] = -R.T @ t
    return M


def write_transforms_json(path: str, image_files, depth_files, extrinsics, intrinsics_src, sizes,
                          depth_unit_scale_factor: float, ply_file: str | None = None) -> dict:
    """Write nerfstudio's ``transforms.json`` and return it.

    Per frame: ``file_path``, ``depth_file_path``, ``transform_matrix`` (OpenGL
    camera-to-world, 4x4), ``fl_x fl_y cx cy w h`` (source pixels, PINHOLE:
    ``camera_model`` OPENCV with zero distortion). ``depth_unit_scale_factor``
    turns a depth PNG value into scene units (one for all frames).
    """
    frames = []
    for i, file in enumerate(image_files):
        K = np.asarray(intrinsics_src[i], np.float64)
        w, h = sizes[i]
        frames.append({"file_path": file, "depth_file_path": depth_files[i],
                       "transform_matrix": camera_to_world_opengl(extrinsics[i]).tolist(),
                       "fl_x": float(K[0, 0]), "fl_y": float(K[1, 1]), "cx": float(K[0, 2]), "cy": float(K[1, 2]),
                       "w": int(w), "h": int(h), "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0})
    doc = {"camera_model": "OPENCV", "depth_unit_scale_factor": float(depth_unit_scale_factor), "frames": frames}
    if ply_file:
        doc["ply_file_path"] = ply_file
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
    return doc


def write_glb(path: str, xyz, rgb, extrinsics, intrinsics, image_hw, max_points: int = 2_000_000,
              frustum_scale: float | None = None, seed: int = 0) -> dict:
    """A glTF binary scene: the point cloud (POINTS) and one frustum (LINES) per camera, via trimesh.

    glTF is y-up with the viewer looking down -z, so the world is turned by
    :data:`OPENCV_TO_OPENGL` (x, -y, -z): the first camera looks into the screen,
    upright. Frusta have the shape of each camera's field of view (``intrinsics``
    for the model's frame ``image_hw``), depth ``frustum_scale`` (default: 5 % of
    the cloud's extent). At most ``max_points`` points (a seeded random subset).

    Returns:
        dict with ``points`` (written) and ``cameras``.
    """
    import trimesh

    xyz = np.asarray(xyz, np.float64).reshape(-1, 3)
    rgb = np.asarray(rgb, np.float64).reshape(-1, 3)
    if len(xyz) > max_points:
        idx = np.sort(np.random.default_rng(seed).choice(len(xyz), max_points, replace=False))
        xyz, rgb = xyz[idx], rgb[idx]
    H, W = image_hw
    centers = [-np.asarray(E)[:, :3].T @ np.asarray(E)[:, 3] for E in extrinsics]
    if frustum_scale is None:
        span = np.ptp(np.concatenate([xyz, np.array(centers)]), axis=0).max() if len(xyz) else 1.0
        frustum_scale = 0.05 * float(span) if span > 0 else 0.1
    scene = trimesh.Scene()
    colors = np.concatenate([np.clip(np.round(rgb * 255), 0, 255), np.full((len(rgb), 1), 255)], 1).astype(np.uint8)
    if len(xyz):
        scene.add_geometry(trimesh.PointCloud(xyz @ OPENCV_TO_OPENGL.T, colors=colors), geom_name="points")
    for i, E in enumerate(extrinsics):
        E, K = np.asarray(E, np.float64), np.asarray(intrinsics[i], np.float64)
        corners_px = np.array([[0, 0, 1], [W, 0, 1], [W, H, 1], [0, H, 1]], np.float64)
        rays = corners_px @ np.linalg.inv(K).T
        corners_cam = rays / rays[:, 2:3] * frustum_scale
        world = (corners_cam - E[:, 3]) @ E[:, :3]  # R^T (x - t)
        c = centers[i]
        segs = [[c, world[k]] for k in range(4)] + [[world[k], world[(k + 1) % 4]] for k in range(4)]
        path3d = trimesh.load_path(np.asarray(segs) @ OPENCV_TO_OPENGL.T)
        path3d.colors = np.tile([255, 64, 32, 255] if i == 0 else [40, 120, 255, 255], (len(path3d.entities), 1))
        scene.add_geometry(path3d, geom_name=f"camera_{i:04d}")
    with open(path, "wb") as f:
        f.write(scene.export(file_type="glb"))
    return {"points": int(len(xyz)), "cameras": len(extrinsics)}


def write_reconstruction(folder: str, pred: dict, loaded, conf_percentile: float = 50.0,
                         point_source: str = "depth", progress: bool = True, extra=None, warn=None) -> dict:
    """Write every output except the preview and summary into ``folder`` (which must exist).

    Args:
        folder: destination (normally the temp folder of :func:`atomic_output_dir`), with
            ``images/`` already filled by the loader (``loaded.image_files``).
        pred: numpy predictions from :func:`visionattn.recon.pipeline.run_model`
            (``extrinsic`` [S,3,4], ``intrinsic`` [S,3,3], ``depth`` [S,H,W],
            ``depth_conf`` [S,H,W], ``world_points`` [S,H,W,3], ``world_points_conf``,
            ``world_points_from_depth`` [S,H,W,3], ``images`` [S,H,W,3]).
        loaded: the :class:`~visionattn.recon.images.LoadedImages` the predictions came from.
        conf_percentile: confidence percentile under which points are dropped.
        point_source: ``"depth"`` (depth + cameras unprojected; VGGT's recommended
            source) or ``"pointmap"`` (the point head).
        warn: callable(str) for notes (pycolmap missing).

    Returns:
        dict with ``points`` (kept), ``xyz``, ``rgb`` (arrays, for the preview),
        ``colmap`` (points, observations, binary), ``depth_png_scale``.
    """
    from tqdm.auto import tqdm

    if point_source == "depth":
        pts, conf = pred["world_points_from_depth"], pred["depth_conf"]
    elif point_source == "pointmap":
        pts, conf = pred["world_points"], pred["world_points_conf"]
    else:
        raise ValueError(f"point_source={point_source!r} must be 'depth' or 'pointmap'")
    steps = tqdm(total=6, desc="exporting", unit="step", disable=not progress)
    xyz, rgb, fidx, _ = select_points(pts, pred["images"], conf, conf_percentile)
    write_ply(os.path.join(folder, "points.ply"), xyz, rgb)
    steps.update()
    depth_dir, conf_dir = os.path.join(folder, "depth"), os.path.join(folder, "confidence")
    os.makedirs(depth_dir)
    os.makedirs(conf_dir)
    scale = depth_png_scale(pred["depth"])
    for i, name in enumerate(loaded.names):
        write_depth(depth_dir, conf_dir, name, pred["depth"][i], pred["depth_conf"][i], scale,
                    loaded.affines[i], loaded.original_sizes[i])
    steps.update()
    image_files = [f"images/{f}" for f in loaded.image_files]
    write_cameras_json(os.path.join(folder, "cameras.json"), loaded.names, loaded.sources or
                       [os.path.basename(p) for p in loaded.paths], pred["extrinsic"], pred["intrinsic"],
                       loaded.shape_hw, loaded.original_sizes, loaded.affines, scale, pred.get("intrinsic_fallback"),
                       extra={"point_source": point_source, "conf_percentile": conf_percentile,
                              "points_kept": int(len(xyz)), **(extra or {})},
                       image_files=image_files)
    steps.update()
    k_src = [original_intrinsics(K, a) for K, a in zip(pred["intrinsic"], loaded.affines)]
    if len(xyz) > _MAX_COLMAP_POINTS:
        sub = np.sort(np.random.default_rng(0).choice(len(xyz), _MAX_COLMAP_POINTS, replace=False))
    else:
        sub = np.arange(len(xyz))
    seen = point_tracks(xyz[sub], fidx[sub], pred["extrinsic"], pred["intrinsic"], pred["depth"])
    colmap = write_colmap_model(os.path.join(folder, "sparse", "0"), loaded.image_files, pred["extrinsic"],
                                k_src, loaded.original_sizes, xyz[sub], rgb[sub], seen, warn=warn)
    steps.update()
    write_transforms_json(os.path.join(folder, "transforms.json"), image_files,
                          [f"depth/{n}.png" for n in loaded.names], pred["extrinsic"], k_src,
                          loaded.original_sizes, 1.0 / scale, ply_file="points.ply")
    steps.update()
    write_glb(os.path.join(folder, "scene.glb"), xyz, rgb, pred["extrinsic"], pred["intrinsic"], loaded.shape_hw)
    steps.update()
    steps.close()
    return {"points": int(len(xyz)), "xyz": xyz, "rgb": rgb, "colmap": colmap, "depth_png_scale": scale}
