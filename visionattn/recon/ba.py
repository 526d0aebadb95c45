"""Bundle adjustment of VGGT's cameras and points (the demo's ``--ba``): tracks from VGGT's track head, solved by
pycolmap.

1. Query points (:func:`query_plan`): ``points_per_frame`` seeded random pixels in each of up to ``query_frames``
   frames spread evenly over the scene, frame 0 first. VGGT's track head follows points of the first frame of
   its input; :func:`track_from_features` puts another query frame first in a reordered copy of the track
   features the forward computed, so the aggregator runs once for all query frames.
2. Observations (:func:`track_observations`): a track's 3D point is the query pixel's point (depth unprojected
   with the predicted camera, or the point map), kept when its depth confidence passes the cloud's threshold.
   Frame j observes it where the track head says visible and confident (vis > :data:`VIS_THRESHOLD`, conf >
   :data:`CONF_THRESHOLD`, the thresholds of the official VGGT demo), the tracked pixel lies inside the frame,
   the point is in front of camera j and projects within :data:`MAX_REPROJ_ERROR` pixels of the tracked pixel
   (the official demo's ``max_reproj_error``); the query frame always observes it. Tracks with fewer than
   :data:`MIN_TRACK_LENGTH` observations are dropped.
3. A pycolmap ``Reconstruction`` of these (:func:`build_reconstruction`: one PINHOLE camera per image in
   source-image pixels, as ``sparse/0``), refined by ``pycolmap.bundle_adjustment`` (poses, focal lengths and
   points; :func:`bundle_adjust`), which reports the mean reprojection error before and after.

pycolmap is optional (the ``[recon]`` extra): :func:`~visionattn.recon.colmap.require_pycolmap` says the install
line.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import numpy as np
import torch

from .cameras import continuous_affine, original_intrinsics
from .colmap import require_pycolmap, write_colmap_binary

__all__ = ["VIS_THRESHOLD", "CONF_THRESHOLD", "MAX_REPROJ_ERROR", "MIN_TRACK_LENGTH", "query_plan",
           "track_from_features", "track_observations", "build_reconstruction", "bundle_adjust",
           "reconstruction_cameras", "refine"]

VIS_THRESHOLD = 0.2  # track head visibility (a sigmoid) an observation needs, as the official demo's vis_thresh
CONF_THRESHOLD = 0.2  # track head confidence (a sigmoid) an observation needs
MAX_REPROJ_ERROR = 8.0  # pixels of the model's frame between a tracked pixel and its point's projection
MIN_TRACK_LENGTH = 2  # observations a point needs (one is the query frame's own)


def query_plan(frames: int, hw: tuple[int, int], query_frames: int = 8, points_per_frame: int = 512,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Which pixels of which frames the track head follows.

    Returns:
        (query frame indices int64 [Q], frame 0 first then evenly spaced; pixel (x, y) coordinates float32
        [Q, N, 2] at pixel centres (integers, VGGT's convention), N = min(points_per_frame, H * W) distinct
        seeded random pixels per frame).
    """
    H, W = hw
    q = np.unique(np.round(np.linspace(0, frames - 1, max(1, min(query_frames, frames)))).astype(np.int64))
    rng = np.random.default_rng(seed)
    n = min(points_per_frame, H * W)
    flat = np.stack([rng.choice(H * W, size=n, replace=False) for _ in q])
    return q, np.stack([flat % W, flat // W], -1).astype(np.float32)


def track_from_features(track_head, fmaps: torch.Tensor, points: torch.Tensor, query_frame: int):
    """Track ``points`` [N, 2] (x, y pixels of frame ``query_frame``) through every frame with VGGT's tracker.

    Args:
        track_head: the model's ``track_head``.
        fmaps: its feature extractor's output for the scene, [1, S, C, h, w].

    Returns:
        (tracks [S, N, 2] pixels, vis [S, N], conf [S, N]) in the scene's frame order: the tracker runs on the
        features with ``query_frame`` moved first (the frame it takes the queries from) and the result is put
        back in order.
    """
    S = fmaps.shape[1]
    order = [query_frame] + [j for j in range(S) if j != query_frame]
    back = torch.as_tensor(np.argsort(order), device=fmaps.device)
    tracks, vis, conf = track_head.tracker(points[None], fmaps[:, order], track_head.iters)
    return tracks[-1][0, back], vis[0, back], conf[0, back]


def track_observations(tracks, vis, conf, query_frames, points, world_points, point_conf, colors, extrinsics,
                       intrinsics, conf_threshold: float, max_error: float = MAX_REPROJ_ERROR) -> dict:
    """Filter tracks into 3D points and their observations (the thresholds of the module docstring).

    Args:
        tracks: [Q, S, N, 2] tracked pixels (x, y) of the model's frame; vis, conf: [Q, S, N] (sigmoids).
        query_frames: [Q] frame of each query set; points: [Q, N, 2] the query pixels (integers).
        world_points: [S, H, W, 3] per-pixel world points; point_conf: [S, H, W] their confidence;
            colors: [S, H, W, 3] in [0, 1].
        extrinsics: [S, 3, 4] camera-from-world; intrinsics: [S, 3, 3] of the model's frame.
        conf_threshold: the least ``point_conf`` a query pixel needs (the point cloud's threshold).
        max_error: the largest distance in pixels between a tracked pixel and the projection of its point.

    Returns:
        dict: ``xyz`` [P, 3] float64, ``rgb`` [P, 3], ``obs_point`` / ``obs_image`` int64 [M] and ``obs_xy``
        [M, 2] (model pixels), ordered by image then point.
    """
    tracks, vis, conf = (np.asarray(a, np.float64) for a in (tracks, vis, conf))
    Q, S, N = vis.shape
    H, W = point_conf.shape[1:]
    frames = np.asarray(query_frames, np.int64)
    q = frames[:, None]
    x, y = np.asarray(points, np.int64)[..., 0], np.asarray(points, np.int64)[..., 1]  # [Q, N]
    xyz = np.asarray(world_points[q, y, x], np.float64)  # [Q, N, 3]
    good = np.isfinite(xyz).all(-1) & (np.asarray(point_conf[q, y, x]) >= conf_threshold)
    E, K = np.asarray(extrinsics, np.float64), np.asarray(intrinsics, np.float64)
    cam = np.einsum("sij,qnj->qsni", E[:, :, :3], xyz) + E[None, :, None, :, 3]  # [Q, S, N, 3]
    z = cam[..., 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        uv = np.einsum("sij,qsnj->qsni", K[:, :2], cam / z[..., None])
        err = np.linalg.norm(uv - tracks, axis=-1)
    u, v = tracks[..., 0], tracks[..., 1]
    obs = ((vis > VIS_THRESHOLD) & (conf > CONF_THRESHOLD) & (z > 0) & (err < max_error)
           & (u >= -0.5) & (u < W - 0.5) & (v >= -0.5) & (v < H - 0.5))
    obs[np.arange(Q), frames] = True  # the query pixel itself
    obs &= good[:, None]
    keep = good & (obs.sum(1) >= MIN_TRACK_LENGTH)  # [Q, N]
    point_id = np.full((Q, N), -1, np.int64)
    point_id[keep] = np.arange(int(keep.sum()))
    qi, j, n = np.nonzero(obs & keep[:, None])
    xy = tracks[qi, j, n]
    at_query = j == frames[qi]
    xy[at_query] = np.asarray(points, np.float64)[qi[at_query], n[at_query]]  # exact, not the tracker's copy
    pid = point_id[qi, n]
    order = np.lexsort((pid, j))
    return {"xyz": xyz[keep], "rgb": np.asarray(colors[q, y, x], np.float64)[keep], "obs_point": pid[order],
            "obs_image": j[order].astype(np.int64), "obs_xy": xy[order]}


def build_reconstruction(image_names, extrinsics, intrinsics, affines, sizes, xyz, rgb, obs_point, obs_image,
                         obs_xy):
    """A ``pycolmap.Reconstruction`` of the tracked points, in source-image pixels (as ``sparse/0``).

    The model's-frame intrinsics [S, 3, 3] and observations [M, 2] go to source pixels through each frame's
    ``affines`` (:func:`~visionattn.recon.cameras.original_intrinsics`: the same map for both, so a point that
    projects onto its observation in the model's frame does so in the source image). The arrays go in through
    COLMAP's binary files (:func:`~visionattn.recon.colmap.write_colmap_binary`, read by pycolmap), not one
    Python call per point and observation.

    Raises:
        MissingDependencyError: pycolmap is not installed.
    """
    pycolmap = require_pycolmap()
    S = len(image_names)
    k_src = np.stack([original_intrinsics(K, a) for K, a in zip(intrinsics, affines)])
    a_inv = np.stack([np.linalg.inv(continuous_affine(a)) for a in affines])  # model pixels -> source pixels
    obs_image = np.asarray(obs_image, np.int64)
    h = np.concatenate([np.asarray(obs_xy, np.float64), np.ones((len(obs_image), 1))], 1)
    xy_src = np.einsum("mij,mj->mi", a_inv[obs_image], h)[:, :2]
    rgb8 = np.clip(np.rint(np.asarray(rgb) * 255.0), 0, 255).astype(np.uint8)
    with tempfile.TemporaryDirectory(prefix="visionattn-ba-") as tmp:
        write_colmap_binary(tmp, list(image_names), np.asarray(extrinsics, np.float64).reshape(S, 3, 4), k_src,
                            sizes, np.asarray(xyz, np.float64), rgb8, obs_point, obs_image, xy_src)
        return pycolmap.Reconstruction(tmp)


@contextlib.contextmanager
def _stderr_to_devnull():
    """File descriptor 2 to /dev/null: COLMAP logs from C++ through glog, which ``sys.stderr`` does not reach and
    pycolmap's log-level settings do not silence."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def bundle_adjust(rec, max_iterations: int = 100, quiet: bool = False):
    """Refine a copy of ``rec`` with ``pycolmap.bundle_adjustment`` (camera poses, focal lengths and points; the
    principal points stay; the first camera fixes the gauge) and say the mean reprojection error in pixels
    before and after. A solve that ends with a larger or non-finite error (tracks too wrong to fit, e.g. of
    random weights) is dropped: ``rec`` itself comes back and ``reverted`` says so. ``quiet``: COLMAP's log
    lines are dropped.

    Returns:
        (the refined reconstruction or ``rec``, dict with ``reprojection_error_before``,
        ``reprojection_error_after`` (pixels), ``reverted``, ``points``, ``observations``).
    """
    pycolmap = require_pycolmap()
    rec.update_point_3d_errors()
    before = float(rec.compute_mean_reprojection_error())
    refined = pycolmap.Reconstruction(rec)
    options = pycolmap.BundleAdjustmentOptions()
    options.print_summary = False
    options.ceres.solver_options.max_num_iterations = int(max_iterations)
    with _stderr_to_devnull() if quiet else contextlib.nullcontext():
        pycolmap.bundle_adjustment(refined, options)
    refined.update_point_3d_errors()
    after = float(refined.compute_mean_reprojection_error())
    reverted = not after <= before
    out = rec if reverted else refined
    return out, {"reprojection_error_before": before, "reprojection_error_after": before if reverted else after,
                 "reverted": reverted, "points": int(out.num_points3D()),
                 "observations": int(out.compute_num_observations())}


def reconstruction_cameras(rec) -> tuple[np.ndarray, np.ndarray]:
    """(camera-from-world [S, 3, 4], intrinsics [S, 3, 3]) of ``rec``'s images in image-id order."""
    ids = sorted(rec.images)
    E = np.stack([rec.images[i].cam_from_world().matrix() for i in ids])
    K = np.stack([rec.cameras[rec.images[i].camera_id].calibration_matrix() for i in ids])
    return E, K


def refine(pred: dict, loaded, conf_threshold: float, point_source: str = "depth",
           max_error: float = MAX_REPROJ_ERROR, max_iterations: int = 100, quiet: bool = False):
    """``--ba`` on :func:`~visionattn.recon.pipeline.run_model`'s predictions (with its ``track_*`` entries).

    Returns:
        (the refined ``pycolmap.Reconstruction`` for ``sparse/0``, or None when no track passed the thresholds;
        a dict for the summary: thresholds, query frames and points, tracks kept, observations and the mean
        reprojection errors before / after in source-image pixels).
    """
    pts, pconf = ((pred["world_points_from_depth"], pred["depth_conf"]) if point_source == "depth"
                  else (pred["world_points"], pred["world_points_conf"]))
    obs = track_observations(pred["track"], pred["track_vis"], pred["track_conf"], pred["track_frames"],
                             pred["track_points"], pts, pconf, pred["images"], pred["extrinsic"], pred["intrinsic"],
                             conf_threshold, max_error)
    info = {"query_frames": [int(q) for q in pred["track_frames"]],
            "points_per_frame": int(pred["track_points"].shape[1]),
            "thresholds": {"vis": VIS_THRESHOLD, "conf": CONF_THRESHOLD, "max_reprojection_error_px": max_error,
                           "min_track_length": MIN_TRACK_LENGTH, "depth_conf": float(conf_threshold)},
            "tracks": int(len(obs["xyz"])), "observations": int(len(obs["obs_point"]))}
    if not len(obs["xyz"]):
        return None, {**info, "skipped": "no track passed the thresholds"}
    rec = build_reconstruction(loaded.image_files, pred["extrinsic"], pred["intrinsic"], loaded.affines,
                               loaded.original_sizes, obs["xyz"], obs["rgb"], obs["obs_point"], obs["obs_image"],
                               obs["obs_xy"])
    rec, result = bundle_adjust(rec, max_iterations, quiet)
    info.update(result)
    return rec, info
