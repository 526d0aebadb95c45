"""Write a reconstruction to disk: the files people load next.

Layout of an output folder (written into a temporary sibling folder, then
renamed into place, so a crash never leaves a half-written ``OUT_DIR``; see
:mod:`visionattn.recon.outdir`)::

    points.ply                  coloured, confidence-filtered point cloud (open3d, MeshLab, CloudCompare); with
                                ``max_points`` a seeded random subset of at most that many points
    points_full.ply             the whole confidence-filtered cloud, only when ``max_points`` dropped points
    cameras.json                per frame: name, source, stored image, extrinsic 3x4 (OpenCV
                                camera-from-world), intrinsic 3x3 of the model's frame and of the
                                source image; the global depth PNG scale
    images/NAME.EXT             the frames under the names every other file uses (source-image pixels)
    sparse/0/{cameras,images,points3D}.bin   COLMAP binary model (PINHOLE per image, source pixels,
                                points with tracks; written from numpy arrays); the same model as .txt too
                                with ``colmap_text`` (pycolmap). COLMAP, nerfstudio, gsplat, pycolmap
    transforms.json             nerfstudio: OpenGL camera-to-world, per-frame intrinsics,
                                depth_file_path, one depth_unit_scale_factor
    scene.glb                   point cloud (the points of points.ply, at most 2M) + camera frusta for any
                                glTF viewer (trimesh)
    depth/NAME.png              16-bit depth in source-image pixels: depth = value * depth_unit_scale_factor
                                (one scale for all frames; 0 = no depth)
    depth/NAME.npy              float32 [H, W] depth of the model's frame
    confidence/NAME.npy         float32 [H, W] depth confidence
    preview.png, summary.json   (made by :mod:`visionattn.recon.pipeline`)

The outputs are independent: :func:`write_reconstruction` writes them side by side in a thread pool (PNG and
zlib encoding, numpy and file writes release the GIL), one task per output and one per frame's depth; the depth
maps start at once, the writers of the point cloud once the confidence filter has made it. The confidence filter
(:func:`~visionattn.recon.points.select_points`) and the COLMAP tracks (:func:`~visionattn.recon.colmap.point_tracks`,
the longest writer) spread their per-pixel / per-frame numpy work over threads of their own as well.

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
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from .cameras import (OPENCV_TO_OPENGL, camera_to_world_opengl, continuous_affine, original_intrinsics,
                      write_cameras_json)
from .colmap import point_tracks, quat_to_rotmat, rotmat_to_quat, write_colmap_model
from .depth import depth_png_scale, depth_to_source_pixels, write_depth
from .nerfstudio import write_transforms_json
from .outdir import OutputDirError, atomic_output_dir, check_output_dir
from .points import (MissingDependencyError, require_open3d, require_trimesh, select_points, subsample,
                     worker_count, write_ply)
from .scene import write_glb

__all__ = [
    "OutputDirError", "MissingDependencyError", "require_open3d", "require_trimesh", "check_output_dir",
    "atomic_output_dir", "select_points", "write_ply", "rotmat_to_quat", "quat_to_rotmat", "continuous_affine",
    "original_intrinsics",
    "write_cameras_json", "point_tracks", "write_colmap_model", "depth_to_source_pixels", "depth_png_scale",
    "write_depth", "OPENCV_TO_OPENGL", "camera_to_world_opengl", "write_transforms_json", "write_glb",
    "write_reconstruction", "write_outputs",
]

_MAX_COLMAP_POINTS = 200_000


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def write_outputs(tasks, workers: int | None = None, progress: bool = True, desc: str = "exporting",
                  then=None) -> dict:
    """Run independent writers side by side in a thread pool, with a progress bar over them.

    Args:
        tasks: ``(output name, callable)`` pairs; several may share a name (e.g. one per depth frame).
        workers: threads (default: the CPU count, at most 8).
        then: a callable run in the calling thread once ``tasks`` are submitted (while they run), returning
            further ``(output name, callable)`` pairs, submitted after them: work the other writers need first.

    Returns:
        {output name: seconds its callables ran, summed}: they overlap, so together they exceed the wall time.

    Raises:
        whatever a task (or ``then``) raised first; the tasks not started yet are cancelled and the running ones
        finish before it propagates (so the caller can remove the folder they write into).
    """
    from tqdm.auto import tqdm

    seconds = {name: 0.0 for name, _ in tasks}
    workers = worker_count(workers)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="recon-export") as pool, \
            tqdm(total=len(tasks), desc=desc, unit="file", disable=not progress) as bar:
        futures = {pool.submit(_timed, fn): name for name, fn in tasks}
        try:
            if then is not None:
                more = list(then())
                for name, _ in more:
                    seconds.setdefault(name, 0.0)
                futures.update({pool.submit(_timed, fn): name for name, fn in more})
                bar.total += len(more)
                bar.refresh()
            for fut in as_completed(futures):
                seconds[futures[fut]] += fut.result()
                bar.update()
        except BaseException:  # an error, Ctrl-C or SIGTERM: start nothing more
            for fut in futures:
                fut.cancel()
            _finish_running(pool)
            raise
    return seconds


def _finish_running(pool: ThreadPoolExecutor) -> None:
    """Wait for the writers already running, through any further signal (a second SIGHUP / Ctrl-C raises in this
    thread while it waits): a writer still running when the caller removes the folder would leave a file there and
    the folder with it."""
    while True:
        try:
            pool.shutdown(wait=True, cancel_futures=True)
            return
        except BaseException:  # noqa: B012 -- the first exception is the one the caller sees
            continue


def write_reconstruction(folder: str, pred: dict, loaded, conf_percentile: float = 50.0,
                         point_source: str = "depth", progress: bool = True, extra=None, max_points: int | None = None,
                         colmap_text: bool = False, sparse_model=None, preview=None,
                         workers: int | None = None) -> dict:
    """Write every output except the summary into ``folder`` (which must exist), the outputs side by side.

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
        max_points: cap ``points.ply`` and ``scene.glb`` at this many points (a seeded random subset, the same
            in both); the whole cloud then goes to ``points_full.ply``. None: no cap (``scene.glb`` keeps its
            own cap of 2M points).
        colmap_text: also write ``sparse/0/*.txt`` (needs pycolmap).
        sparse_model: a ``pycolmap.Reconstruction`` to write as ``sparse/0`` (the bundle-adjusted model of
            :mod:`visionattn.recon.ba`) instead of the model made from the point cloud.
        preview: ``callable(xyz, rgb)`` run as one more output beside the others (``preview.png``), given the
            whole kept cloud.
        workers: threads of the pool (default: the CPU count, at most 8).

    Returns:
        dict with ``points`` (kept by confidence), ``points_ply`` (in points.ply), ``xyz``, ``rgb`` (the whole
        kept cloud), ``colmap`` (points, observations, binary, text), ``depth_png_scale``, ``seconds`` ({output:
        seconds its writer ran; ``select``: the confidence filter, which runs while the depth maps are written,
        before the writers that need the cloud}) and ``wall_seconds``.
    """
    t0 = time.perf_counter()
    if point_source == "depth":
        pts, conf = pred["world_points_from_depth"], pred["depth_conf"]
    elif point_source == "pointmap":
        pts, conf = pred["world_points"], pred["world_points_conf"]
    else:
        raise ValueError(f"point_source={point_source!r} must be 'depth' or 'pointmap'")
    scale = depth_png_scale(pred["depth"])
    depth_dir, conf_dir = os.path.join(folder, "depth"), os.path.join(folder, "confidence")
    os.makedirs(depth_dir)
    os.makedirs(conf_dir)
    image_files = [f"images/{f}" for f in loaded.image_files]
    k_src = [original_intrinsics(K, a) for K, a in zip(pred["intrinsic"], loaded.affines)]
    sparse_dir = os.path.join(folder, "sparse", "0")
    colmap, cloud = {}, {}

    def depth(i, name):
        return lambda: write_depth(depth_dir, conf_dir, name, pred["depth"][i], pred["depth_conf"][i], scale,
                                   loaded.affines[i], loaded.original_sizes[i])

    # the outputs that need no point cloud start at once: the per-frame depth maps run while the confidence
    # filter (select, in this thread) makes the cloud the other writers need
    first = [("depth/", depth(i, name)) for i, name in enumerate(loaded.names)]
    first.append(("transforms.json", lambda: write_transforms_json(
        os.path.join(folder, "transforms.json"), image_files, [f"depth/{n}.png" for n in loaded.names],
        pred["extrinsic"], k_src, loaded.original_sizes, 1.0 / scale, ply_file="points.ply")))

    def select() -> list:
        t1 = time.perf_counter()
        xyz, rgb, fidx, _ = select_points(pts, pred["images"], conf, conf_percentile, workers=workers)
        sub = subsample(len(xyz), max_points)
        xyz_ply, rgb_ply = (xyz, rgb) if sub is None else (xyz[sub], rgb[sub])
        cloud.update(xyz=xyz, rgb=rgb, points_ply=len(xyz_ply), seconds=time.perf_counter() - t1)

        def sparse():
            if sparse_model is not None:
                os.makedirs(sparse_dir)
                sparse_model.write_binary(sparse_dir)
                if colmap_text:
                    sparse_model.write_text(sparse_dir)
                colmap.update(points=sparse_model.num_points3D(),
                              observations=sparse_model.compute_num_observations(), binary=True,
                              text=bool(colmap_text), bundle_adjusted=True)
                return
            c = subsample(len(xyz), _MAX_COLMAP_POINTS)
            c = slice(None) if c is None else c
            # the critical path of the export: its per-frame projections spread over threads of their own
            seen = point_tracks(xyz[c], fidx[c], pred["extrinsic"], pred["intrinsic"], pred["depth"],
                                workers=workers)
            colmap.update(write_colmap_model(sparse_dir, loaded.image_files, pred["extrinsic"], k_src,
                                             loaded.original_sizes, xyz[c], rgb[c], seen, text=colmap_text,
                                             workers=workers))

        # the longest writers first
        tasks = [("points.ply", lambda: write_ply(os.path.join(folder, "points.ply"), xyz_ply, rgb_ply)),
                 ("sparse/0", sparse),
                 ("scene.glb", lambda: write_glb(os.path.join(folder, "scene.glb"), xyz_ply, rgb_ply,
                                                 pred["extrinsic"], pred["intrinsic"], loaded.shape_hw))]
        if sub is not None:
            tasks.append(("points_full.ply", lambda: write_ply(os.path.join(folder, "points_full.ply"), xyz, rgb)))
        if preview is not None:
            tasks.append(("preview.png", lambda: preview(xyz, rgb)))
        sources = loaded.sources or [os.path.basename(p) for p in loaded.paths]
        tasks.append(("cameras.json", lambda: write_cameras_json(
            os.path.join(folder, "cameras.json"), loaded.names, sources, pred["extrinsic"], pred["intrinsic"],
            loaded.shape_hw, loaded.original_sizes, loaded.affines, scale, pred.get("intrinsic_fallback"),
            image_files=image_files,
            extra={"point_source": point_source, "conf_percentile": conf_percentile, "points_kept": int(len(xyz)),
                   "points_ply": int(len(xyz_ply)), **(extra or {})})))
        return tasks

    written = write_outputs(first, workers, progress, then=select)
    seconds = {"select": cloud["seconds"], **written}
    xyz, rgb = cloud["xyz"], cloud["rgb"]
    return {"points": int(len(xyz)), "points_ply": int(cloud["points_ply"]), "xyz": xyz, "rgb": rgb, "colmap": colmap,
            "depth_png_scale": scale, "seconds": seconds, "wall_seconds": time.perf_counter() - t0}
