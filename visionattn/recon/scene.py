"""``scene.glb``: the point cloud and the camera frusta as one glTF binary scene (trimesh)."""
from __future__ import annotations

import numpy as np

from .cameras import OPENCV_TO_OPENGL
from .points import rgba8, subsample

__all__ = ["write_glb"]


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

    xyz = np.asarray(xyz).reshape(-1, 3)
    rgb = np.asarray(rgb).reshape(-1, 3)
    idx = subsample(len(xyz), max_points, seed)
    if idx is not None:
        xyz, rgb = xyz[idx], rgb[idx]
    H, W = image_hw
    centers = [-np.asarray(E)[:, :3].T @ np.asarray(E)[:, 3] for E in extrinsics]
    if frustum_scale is None:
        box = np.concatenate([xyz.min(0, keepdims=True), xyz.max(0, keepdims=True)]) if len(xyz) else np.zeros((0, 3))
        span = np.ptp(np.concatenate([box, np.array(centers)]), axis=0).max() if len(xyz) else 1.0
        frustum_scale = 0.05 * float(span) if span > 0 else 0.1
    scene = trimesh.Scene()
    colors = rgba8(rgb)
    if len(xyz):
        # OPENCV_TO_OPENGL is diagonal: a per-axis sign flip, no [N, 3] matrix product
        scene.add_geometry(trimesh.PointCloud(xyz * np.diag(OPENCV_TO_OPENGL).astype(xyz.dtype), colors=colors),
                           geom_name="points")
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
