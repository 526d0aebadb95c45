"""Write a reconstruction to disk: point cloud, cameras, COLMAP text model, depth, confidence.

Layout of an output folder (written into a temporary sibling folder, then
renamed into place, so a crash never leaves a half-written ``OUT_DIR``)::

    points.ply              coloured, confidence-filtered point cloud (open3d)
    cameras.json            per frame: extrinsic 3x4 (OpenCV camera-from-world),
                            intrinsic 3x3 for the preprocessed frame and for the
                            original image, sizes, depth PNG scale
    sparse/cameras.txt      COLMAP text model (PINHOLE per image, original-image pixels)
    sparse/images.txt
    sparse/points3D.txt
    depth/NAME.png          16-bit depth, metres-free units: depth = png / depth_scale
    depth/NAME.npy          float32 [H, W] depth
    confidence/NAME.npy     float32 [H, W] depth confidence
    preview.png             (written by :mod:`visionattn.recon.preview`)

World frame: VGGT's, i.e. the first camera's frame (up to an unknown scale).
"""
from __future__ import annotations

import json
import os
import numpy as np

from .outdir import OutputDirError, atomic_output_dir, check_output_dir

__all__ = [
    "OutputDirError", "MissingDependencyError", "require_open3d", "check_output_dir", "atomic_output_dir",
    "select_points", "write_ply", "rotmat_to_quat", "quat_to_rotmat", "original_intrinsics",
    "write_cameras_json", "write_colmap_text", "write_depth", "write_reconstruction",
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


def original_intrinsics(K: np.ndarray, affine) -> np.ndarray:
    """Intrinsics [3, 3] of the preprocessed frame -> intrinsics of the original image.

    ``affine`` = (sx, sy, ox, oy) maps original pixel centres to preprocessed ones
    (see :class:`visionattn.recon.images.LoadedImages`): K_orig = A^-1 K.
    """
    sx, sy, ox, oy = affine
    A = np.array([[sx, 0.0, ox], [0.0, sy, oy], [0.0, 0.0, 1.0]])
    return np.linalg.solve(A, np.asarray(K, dtype=np.float64))


def _finite_list(a) -> list:
    """Nested list of Python floats with non-finite values as None (strict JSON has no inf/NaN)."""
    a = np.asarray(a, dtype=np.float64)
    out = a.astype(object)
    out[~np.isfinite(a)] = None
    return out.tolist()


def write_cameras_json(path: str, names, files, extrinsics, intrinsics, image_hw, original_sizes=None,
                       affines=None, depth_scales=None, fallback=None, extra=None, image_files=None) -> dict:
    """Write ``cameras.json`` and return its content.

    Args:
        names / files: per-frame output name and source file name.
        extrinsics: [S, 3, 4] OpenCV camera-from-world (x_cam = R x_world + t).
        intrinsics: [S, 3, 3] for the preprocessed frame of size ``image_hw`` = (H, W).
        original_sizes: per frame (width, height) of the source image (optional).
        affines: per frame (sx, sy, ox, oy) original -> preprocessed pixels (optional).
        depth_scales: per frame, ``depth = png16 / scale`` for ``depth/NAME.png`` (optional).
        fallback: per frame bool, intrinsics replaced because the prediction was unusable (optional).
        image_files: per frame, the stored frame's path relative to the output folder (optional).
        extra: extra top-level keys (model, mode, ...).
    """
    frames = []
    for i, name in enumerate(names):
        fr = {
            "name": name, "file": os.path.basename(files[i]),
            "extrinsic": _finite_list(extrinsics[i]),
            "intrinsic": _finite_list(intrinsics[i]),
            "width": int(image_hw[1]), "height": int(image_hw[0]),
        }
        if image_files:
            fr["image"] = image_files[i]
        if original_sizes is not None:
            fr["original_width"], fr["original_height"] = (int(v) for v in original_sizes[i])
        if affines is not None:
            fr["intrinsic_original"] = _finite_list(original_intrinsics(intrinsics[i], affines[i]))
        if depth_scales is not None:
            fr["depth_png_scale"] = float(depth_scales[i])
        if fallback is not None:
            fr["intrinsic_fallback"] = bool(fallback[i])
        frames.append(fr)
    doc = {"convention": "OpenCV camera-from-world extrinsic [R|t]: x_cam = R @ x_world + t; "
                         "world = first camera's frame; intrinsic in pixels of the preprocessed frame "
                         "(intrinsic_original: pixels of the source image)",
           "frames": frames}
    doc.update(extra or {})
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
    return doc


def write_colmap_text(folder: str, files, extrinsics, intrinsics, sizes, xyz, rgb) -> None:
    """Write a COLMAP text model (``cameras.txt``, ``images.txt``, ``points3D.txt``).

    One PINHOLE camera per image (``fx fy cx cy``); ``sizes`` are (width, height)
    matching ``intrinsics`` (pass the source-image sizes with
    :func:`original_intrinsics` so COLMAP / nerfstudio / gsplat can use the
    original files named in ``images.txt``). Poses are world-to-camera
    quaternion (w, x, y, z) + translation, as COLMAP stores them. Points carry
    colour and an empty track (no 2D observations are written); at most
    200,000 points (a seeded random subset).
    """
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cameras.txt"), "w") as f:
        f.write("# Camera list with one line of data per camera:\n")
        f.write("#   CAMERA_ID, MODEL, WIDTH, HEIGHT, PARAMS[]\n")
        f.write(f"# Number of cameras: {len(files)}\n")
        for i, K in enumerate(intrinsics):
            w, h = sizes[i]
            f.write(f"{i + 1} PINHOLE {int(w)} {int(h)} {K[0][0]:.10g} {K[1][1]:.10g} {K[0][2]:.10g} {K[1][2]:.10g}\n")
    with open(os.path.join(folder, "images.txt"), "w") as f:
        f.write("# Image list with two lines of data per image:\n")
        f.write("#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME\n")
        f.write("#   POINTS2D[] as (X, Y, POINT3D_ID)\n")
        f.write(f"# Number of images: {len(files)}, mean observations per image: 0\n")
        for i, E in enumerate(extrinsics):
            E = np.asarray(E, dtype=np.float64)
            q = rotmat_to_quat(E[:, :3])
            t = E[:, 3]
            f.write(f"{i + 1} {q[0]:.12g} {q[1]:.12g} {q[2]:.12g} {q[3]:.12g} "
                    f"{t[0]:.12g} {t[1]:.12g} {t[2]:.12g} {i + 1} {os.path.basename(files[i])}\n\n")
    xyz = np.asarray(xyz).reshape(-1, 3)
    rgb = np.asarray(rgb).reshape(-1, 3)
    if len(xyz) > _MAX_COLMAP_POINTS:
        idx = np.sort(np.random.default_rng(0).choice(len(xyz), _MAX_COLMAP_POINTS, replace=False))
        xyz, rgb = xyz[idx], rgb[idx]
    rgb8 = np.clip(np.round(rgb * 255.0), 0, 255).astype(np.int64)
    with open(os.path.join(folder, "points3D.txt"), "w") as f:
        f.write("# 3D point list with one line of data per point:\n")
        f.write("#   POINT3D_ID, X, Y, Z, R, G, B, ERROR, TRACK[] as (IMAGE_ID, POINT2D_IDX)\n")
        f.write(f"# Number of points: {len(xyz)}, mean track length: 0\n")
        lines = [f"{n + 1} {p[0]:.7g} {p[1]:.7g} {p[2]:.7g} {c[0]} {c[1]} {c[2]} 0\n"
                 for n, (p, c) in enumerate(zip(xyz.tolist(), rgb8.tolist()))]
        f.writelines(lines)


def write_depth(folder_depth: str, folder_conf: str, name: str, depth: np.ndarray,
                conf: np.ndarray | None) -> float:
    """Write ``depth/NAME.npy`` (float32), ``depth/NAME.png`` (uint16) and ``confidence/NAME.npy``.

    The PNG stores ``round(depth * scale)`` with ``scale = 65535 / max finite depth``
    (non-finite or negative depth -> 0); the scale is returned (also stored in the
    PNG's ``depth_scale`` text chunk and in cameras.json). ``depth`` is [H, W].
    """
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    depth = np.asarray(depth, dtype=np.float32)
    np.save(os.path.join(folder_depth, f"{name}.npy"), depth)
    if conf is not None:
        np.save(os.path.join(folder_conf, f"{name}.npy"), np.asarray(conf, dtype=np.float32))
    valid = np.isfinite(depth) & (depth > 0)
    dmax = float(depth[valid].max()) if valid.any() else 1.0
    scale = 65535.0 / dmax
    png = np.where(valid, np.round(np.where(valid, depth, 0) * scale), 0).clip(0, 65535).astype(np.uint16)
    info = PngInfo()
    info.add_text("depth_scale", repr(scale))
    info.add_text("description", "depth = value / depth_scale (0 = invalid)")
    Image.fromarray(png).save(os.path.join(folder_depth, f"{name}.png"), pnginfo=info)
    return scale


def write_reconstruction(folder: str, pred: dict, loaded, conf_percentile: float = 50.0,
                         point_source: str = "depth", progress: bool = True, extra=None) -> dict:
    """Write every output except the preview into ``folder`` (which must exist).

    Args:
        folder: destination (normally the temp folder of :func:`atomic_output_dir`).
        pred: numpy predictions from :func:`visionattn.recon.pipeline.run_model`
            (``extrinsic`` [S,3,4], ``intrinsic`` [S,3,3], ``depth`` [S,H,W],
            ``depth_conf`` [S,H,W], ``world_points`` [S,H,W,3], ``world_points_conf``,
            ``world_points_from_depth`` [S,H,W,3], ``images`` [S,H,W,3]).
        loaded: the :class:`~visionattn.recon.images.LoadedImages` the predictions came from.
        conf_percentile: confidence percentile under which points are dropped.
        point_source: ``"depth"`` (depth + cameras unprojected; VGGT's recommended
            source) or ``"pointmap"`` (the point head).

    Returns:
        dict with ``points`` (kept), ``xyz``, ``rgb`` (arrays, for the preview).
    """
    from tqdm.auto import tqdm

    if point_source == "depth":
        pts, conf = pred["world_points_from_depth"], pred["depth_conf"]
    elif point_source == "pointmap":
        pts, conf = pred["world_points"], pred["world_points_conf"]
    else:
        raise ValueError(f"point_source={point_source!r} must be 'depth' or 'pointmap'")
    steps = tqdm(total=4, desc="exporting", unit="step", disable=not progress)
    xyz, rgb, _, _ = select_points(pts, pred["images"], conf, conf_percentile)
    write_ply(os.path.join(folder, "points.ply"), xyz, rgb)
    steps.update()
    depth_dir, conf_dir = os.path.join(folder, "depth"), os.path.join(folder, "confidence")
    os.makedirs(depth_dir)
    os.makedirs(conf_dir)
    scales = [write_depth(depth_dir, conf_dir, name, pred["depth"][i], pred["depth_conf"][i])
              for i, name in enumerate(loaded.names)]
    steps.update()
    write_cameras_json(os.path.join(folder, "cameras.json"), loaded.names, loaded.paths,
                       pred["extrinsic"], pred["intrinsic"], loaded.shape_hw, loaded.original_sizes,
                       loaded.affines, scales, pred.get("intrinsic_fallback"),
                       extra={"point_source": point_source, "conf_percentile": conf_percentile,
                              "points_kept": int(len(xyz)), **(extra or {})},
                       image_files=[f"images/{f}" for f in loaded.image_files])
    steps.update()
    k_orig = [original_intrinsics(K, a) for K, a in zip(pred["intrinsic"], loaded.affines)]
    write_colmap_text(os.path.join(folder, "sparse"), loaded.paths, pred["extrinsic"], k_orig,
                      loaded.original_sizes, xyz, rgb)
    steps.update()
    steps.close()
    return {"points": int(len(xyz)), "xyz": xyz, "rgb": rgb}
