"""nerfstudio's ``transforms.json``: OpenGL camera-to-world, per-frame intrinsics, depth files."""
from __future__ import annotations

import json

import numpy as np

from .cameras import camera_to_world_opengl

__all__ = ["write_transforms_json"]


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
