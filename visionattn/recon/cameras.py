"""Camera conventions and ``cameras.json``.

Extrinsics are OpenCV camera-from-world [3, 4] (x_cam = R x_world + t); intrinsics
use continuous pixel coordinates, the image spanning [0, W] x [0, H] (pixel (i, j)
centred at (i + 0.5, j + 0.5)), as COLMAP and nerfstudio use. Here: the map from the
model's frame back to the source image, the OpenCV -> OpenGL camera axes, and the
per-frame ``cameras.json`` the reconstruction writes.
"""
from __future__ import annotations

import json

import numpy as np

__all__ = ["continuous_affine", "original_intrinsics", "write_cameras_json", "OPENCV_TO_OPENGL",
           "camera_to_world_opengl"]


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
                         "world = the first camera's frame as the model predicts it (frame 0's extrinsic is the "
                         "model's output: VGGT's is the identity with trained weights only; pi3 / pi3x poses are "
                         "re-based so that it is exactly the identity); intrinsic in continuous pixels of the "
                         "model's frame (intrinsic_original: of the source image, as in images/)",
           "frames": frames}
    if depth_scale is not None:
        doc["depth_png_scale"] = float(depth_scale)
        doc["depth_png"] = ("depth/NAME.png: uint16 in source-image pixels, depth = value / depth_png_scale "
                            "(one scale for every frame; 0 = no depth)")
    doc.update(extra or {})
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
    return doc


OPENCV_TO_OPENGL = np.diag([1.0, -1.0, -1.0])  # camera axes: x right, y down, z forward -> y up, z back


def camera_to_world_opengl(extrinsic: np.ndarray) -> np.ndarray:
    """OpenCV camera-from-world [3, 4] -> OpenGL camera-to-world [4, 4] (nerfstudio's transform_matrix)."""
    E = np.asarray(extrinsic, np.float64)
    R, t = E[:, :3], E[:, 3]
    M = np.eye(4)
    M[:3, :3] = R.T @ OPENCV_TO_OPENGL
    M[:3, 3] = -R.T @ t
    return M
