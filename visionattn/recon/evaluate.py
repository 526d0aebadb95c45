"""Evaluation loops behind ``tools/eval_reconstruction.py``.

(a) + (b) :func:`evaluate_scenes`: run the model on each scene with ground-truth
cameras; pose errors / AUC over all pairs (VGGT protocol, see
:mod:`visionattn.recon.metrics`) and, where the scene has a ground-truth point
cloud, accuracy / completeness / Chamfer after a Sim(3) alignment of the
predicted cameras onto the ground-truth ones.

(c) :func:`mode_agreement`: the same scene and weights in each attention mode;
differences of cameras, depth and points to the ``fp32`` run.
"""
from __future__ import annotations

import numpy as np
import torch

from . import metrics as M
from .datasets import Scene, check_point_clouds, read_ply_points
from .images import load_images
from .pipeline import build_model, default_weights, run_model
from .points import select_points

__all__ = ["evaluate_scene", "evaluate_scenes", "compare_predictions", "mode_agreement"]

_MAX_CLOUD = 200_000


def _subsample(x: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    if len(x) <= n:
        return x
    return x[np.sort(np.random.default_rng(seed).choice(len(x), n, replace=False))]


def evaluate_scene(net, scene: Scene, device="cpu", size: int = 518, conf_percentile: float = 50.0,
                   cloud_threshold: float | None = None, progress: bool = False) -> dict:
    """Pose metrics (and cloud metrics when ``scene.points_path`` is set) for one scene.

    Returns:
        dict with ``scene``, ``frames``, ``seconds``, ``pose`` (see :func:`metrics.pose_metrics`)
        and, with a ground-truth cloud, ``cloud`` (see :func:`metrics.cloud_metrics`, in
        ground-truth units, after :func:`metrics.align_cameras_sim3`) and ``sim3_scale``.
    """
    loaded = load_images(scene.image_paths, size=size, progress=progress)
    pred = run_model(net, loaded.images, device, progress=progress)
    res = {"scene": scene.name, "frames": len(scene.image_paths), "seconds": pred["seconds"],
           "pose": M.pose_metrics(pred["extrinsic"], scene.extrinsics)}
    if scene.points_path is not None:
        xyz, _, _, _ = select_points(pred["world_points_from_depth"], pred["images"], pred["depth_conf"],
                                     conf_percentile, max_points=_MAX_CLOUD)
        s, R, t = M.align_cameras_sim3(pred["extrinsic"], scene.extrinsics)
        gt = _subsample(read_ply_points(scene.points_path), _MAX_CLOUD)
        res["cloud"] = M.cloud_metrics(M.apply_sim3(xyz, s, R, t), gt, cloud_threshold)
        res["sim3_scale"] = s
    return res


def evaluate_scenes(scenes, model: str = "vggt", weights: str | None = None, mode: str = "fp32",
                    device="cpu", size: int = 518, conf_percentile: float = 50.0,
                    cloud_threshold: float | None = None, seed: int = 0, progress: bool = True) -> dict:
    """(a) + (b) over a list of :class:`Scene`; returns per-scene results and their means.

    ``model``: any of :data:`~visionattn.recon.pipeline.MODELS` (π³ / Pi3X in VGGT's camera conventions, see
    :mod:`visionattn.recon.pi3`); ``weights`` None: the model's released weights.

    Every ground-truth point cloud is read once before the model is built, so a corrupt one fails first.

    Raises:
        ValueError: ``scenes`` is empty.
        GroundTruthError: a ground-truth point cloud cannot be read (see :func:`datasets.read_ply_points`).
    """
    from tqdm.auto import tqdm

    scenes = list(scenes)
    if not scenes:
        raise ValueError("no scene to evaluate")
    check_point_clouds(scenes)
    weights = default_weights(model) if weights is None else weights
    net = build_model(model, weights, mode, device, seed)
    per = [evaluate_scene(net, sc, device, size, conf_percentile, cloud_threshold)
           for sc in tqdm(scenes, desc="scenes", unit="scene", disable=not progress)]
    mean = {}
    for key in per[0]["pose"]:
        mean[f"pose.{key}"] = float(np.mean([r["pose"][key] for r in per]))
    with_cloud = [r for r in per if "cloud" in r]
    for key in (with_cloud[0]["cloud"] if with_cloud else {}):
        mean[f"cloud.{key}"] = float(np.mean([r["cloud"][key] for r in with_cloud]))
    return {"scenes": per, "mean": mean, "model": model, "weights": weights, "mode": mode,
            "size": size, "conf_percentile": conf_percentile}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def compare_predictions(pred: dict, ref: dict) -> dict:
    """Differences of one run's predictions to a reference run's (same images).

    Returns:
        rot_max_deg / rot_mean_deg: per-frame camera rotation angle to the reference;
        center_rel_l2: relative L2 of camera centres; focal_rel_max: max relative
        focal difference; pair_rot_max_deg / pair_trans_max_deg / auc@30, auc@3: the
        pose protocol with the reference as ground truth (S >= 2); depth_rel_l2,
        depth_max_rel (max |dd| / d_ref), points_rel_l2 (point head),
        points_from_depth_rel_l2, depth_conf_rel_l2, nonfinite (count of inf/NaN).
    """
    Ep, Er = pred["extrinsic"], ref["extrinsic"]
    rot = M.rotation_angle_deg(Ep[:, :, :3], Er[:, :, :3])
    fp = np.stack([pred["intrinsic"][:, 0, 0], pred["intrinsic"][:, 1, 1]], -1)
    fr = np.stack([ref["intrinsic"][:, 0, 0], ref["intrinsic"][:, 1, 1]], -1)
    d, dr = pred["depth"].astype(np.float64), ref["depth"].astype(np.float64)
    out = {
        "rot_max_deg": float(rot.max()), "rot_mean_deg": float(rot.mean()),
        "center_rel_l2": _rel(M.camera_centers(Ep), M.camera_centers(Er)),
        "focal_rel_max": float(np.max(np.abs(fp - fr) / np.maximum(np.abs(fr), 1e-300))),
        "depth_rel_l2": _rel(d, dr),
        "depth_max_rel": float(np.max(np.abs(d - dr) / np.maximum(np.abs(dr), 1e-12))),
        "depth_conf_rel_l2": _rel(pred["depth_conf"], ref["depth_conf"]),
        "points_rel_l2": _rel(pred["world_points"], ref["world_points"]),
        "points_from_depth_rel_l2": _rel(pred["world_points_from_depth"], ref["world_points_from_depth"]),
        "nonfinite": int(sum((~np.isfinite(pred[k])).sum() for k in
                             ("depth", "world_points", "extrinsic", "depth_conf"))),
    }
    if Ep.shape[0] >= 2:
        r_err, t_err = M.relative_pose_errors(Ep, Er)
        out.update(pair_rot_max_deg=float(r_err.max()), pair_trans_max_deg=float(t_err.max()),
                   **{"auc@30": M.pose_auc(r_err, t_err, 30), "auc@3": M.pose_auc(r_err, t_err, 3)})
    return out


def mode_agreement(images: torch.Tensor, modes=("fp32", "tf32", "fp16", "bf16", "pasa"),
                   model: str = "vggt", weights: str | None = None, device="cpu", seed: int = 0,
                   reference: str = "fp32", warmup: int = 0, progress: bool = True) -> dict:
    """(c) Run one scene in each attention mode with the same weights; compare with ``reference``.

    Args:
        images: float32 [S, 3, H, W] in [0, 1] (from :func:`load_images`).
        modes: attention modes (visionattn modes or ``"sdpa"``); ``reference`` is run first
            whether listed or not.
        warmup: untimed passes per mode before the timed one (Triton compiles on the first call).

    Returns:
        ``{"reference": mode, "runs": {mode: {"seconds", "peak_memory_bytes", **compare_predictions}}}``.
    """
    from tqdm.auto import tqdm

    weights = default_weights(model) if weights is None else weights
    net = build_model(model, weights, reference, device, seed)
    order = [reference] + [m for m in modes if m != reference]
    preds, runs = {}, {}
    for m in tqdm(order, desc="modes", unit="mode", disable=not progress):
        net.set_attn_mode(None if m == "sdpa" else m)
        preds[m] = run_model(net, images, device, progress=False, warmup=warmup)
        runs[m] = {"seconds": preds[m]["seconds"], "peak_memory_bytes": preds[m]["peak_memory_bytes"],
                   "peak_memory_kind": preds[m]["peak_memory_kind"],
                   **compare_predictions(preds[m], preds[reference])}
    return {"reference": reference, "model": model, "weights": weights, "frames": int(images.shape[0]),
            "image_hw": list(images.shape[-2:]), "runs": runs}
