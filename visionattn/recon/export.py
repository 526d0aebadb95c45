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

Each format has its module: :mod:`~visionattn.recon.points` (points.ply),
:mod:`~visionattn.recon.cameras` (cameras.json, camera conventions),
:mod:`~visionattn.recon.colmap` (sparse/0), :mod:`~visionattn.recon.nerfstudio`
(transforms.json), :mod:`~visionattn.recon.scene` (scene.glb) and
:mod:`~visionattn.recon.depth` (depth/, confidence/); :func:`write_reconstruction`
writes them all, and their names are importable from here too.
"""
from __future__ import annotations

import os

import numpy as np

from .cameras import (OPENCV_TO_OPENGL, camera_to_world_opengl, continuous_affine, original_intrinsics,
                      write_cameras_json)
from .colmap import point_tracks, quat_to_rotmat, rotmat_to_quat, write_colmap_model
from .depth import depth_png_scale, depth_to_source_pixels, write_depth
from .nerfstudio import write_transforms_json
from .outdir import OutputDirError, atomic_output_dir, check_output_dir
from .points import MissingDependencyError, require_open3d, require_trimesh, select_points, write_ply
from .scene import write_glb

__all__ = [
    "OutputDirError", "MissingDependencyError", "require_open3d", "require_trimesh", "check_output_dir",
    "atomic_output_dir", "select_points", "write_ply", "rotmat_to_quat", "quat_to_rotmat", "continuous_affine", "original_intrinsics",
    "write_cameras_json", "point_tracks", "write_colmap_model", "depth_to_source_pixels", "depth_png_scale",
    "write_depth", "OPENCV_TO_OPENGL", "camera_to_world_opengl", "write_transforms_json", "write_glb",
    "write_reconstruction",
]

_MAX_COLMAP_POINTS = 200_000


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
