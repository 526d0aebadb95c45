"""Multi-view reconstruction metrics: pose errors / AUC, Sim(3) alignment, point-cloud distances.

Pose accuracy follows VGGT's evaluation protocol (Wang et al., "VGGT: Visual
Geometry Grounded Transformer", CVPR 2025, Sec. 4.1, after PoseDiffusion /
RelPose++): for every unordered pair of frames (i, j) compare the relative pose
``T_j T_i^-1`` of the prediction with the ground truth; the rotation error is
the angle of ``R_gt^T R_pred`` and the translation error the angle between the
two relative translation directions, folded as ``min(e, 180 - e)`` (direction
sign ambiguity). AUC@T is the area under the accuracy-threshold curve of
``max(rot err, trans err)`` on integer thresholds 1..T degrees, normalised to
[0, 1] (``mean_t frac(err < t)``, histogram bins as in the reference code).

Point clouds: Umeyama (1991) closed-form similarity alignment; accuracy =
mean distance from predicted points to their nearest ground-truth point,
completeness = mean distance from ground-truth points to the nearest predicted
point, Chamfer = their mean (DTU / DUSt3R convention).

All functions take and return numpy float64 arrays; extrinsics are OpenCV
camera-from-world [S, 3, 4] (``x_cam = R x_world + t``).
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "AUC_THRESHOLDS", "rotation_angle_deg", "pair_indices", "relative_pose_errors", "pose_auc",
    "pose_metrics", "umeyama", "apply_sim3", "transform_extrinsics", "camera_centers",
    "align_cameras_sim3", "nearest_distances", "cloud_metrics",
]

AUC_THRESHOLDS = (30, 15, 5, 3)


def _as_extrinsics(E, name: str) -> np.ndarray:
    E = np.asarray(E, dtype=np.float64)
    if E.ndim != 3 or E.shape[1:] not in ((3, 4), (4, 4)):
        raise ValueError(f"{name} must have shape [S, 3, 4] or [S, 4, 4], got {E.shape}")
    return E[:, :3, :4]


def rotation_angle_deg(Ra: np.ndarray, Rb: np.ndarray) -> np.ndarray:
    """Geodesic angle in degrees between rotations ``Ra`` and ``Rb`` ([..., 3, 3]) -> [...].

    ``atan2(|v|, (tr R - 1) / 2)`` on ``R = Ra^T Rb`` with ``v`` the axis vector
    (``sin(theta) * axis``): accurate near 0 too, where ``arccos`` of the trace
    alone loses ~sqrt(eps) (0.05 degrees on float32-rounded rotations).
    """
    Ra, Rb = np.asarray(Ra, dtype=np.float64), np.asarray(Rb, dtype=np.float64)
    R = np.swapaxes(Ra, -1, -2) @ Rb
    v = 0.5 * np.stack([R[..., 2, 1] - R[..., 1, 2], R[..., 0, 2] - R[..., 2, 0], R[..., 1, 0] - R[..., 0, 1]], -1)
    c = 0.5 * (np.trace(R, axis1=-2, axis2=-1) - 1.0)
    return np.degrees(np.arctan2(np.linalg.norm(v, axis=-1), c))


def pair_indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """All unordered pairs i < j of ``n`` frames (``n (n-1) / 2`` of them)."""
    i, j = np.triu_indices(n, k=1)
    return i, j


def _relative(E: np.ndarray, i: np.ndarray, j: np.ndarray):
    R, t = E[:, :, :3], E[:, :, 3]
    R_rel = R[j] @ np.swapaxes(R[i], -1, -2)
    t_rel = t[j] - np.einsum("pab,pb->pa", R_rel, t[i])
    return R_rel, t_rel


def relative_pose_errors(pred_extrinsics, gt_extrinsics):
    """Relative rotation and translation-direction errors over all frame pairs.

    Args:
        pred_extrinsics, gt_extrinsics: [S, 3, 4] (or [S, 4, 4]) camera-from-world, S >= 2.

    Returns:
        (rot_err_deg [P], trans_err_deg [P]) with P = S (S-1) / 2, pairs in
        ``pair_indices(S)`` order. Translation errors are folded to [0, 90]
        (``min(e, 180 - e)``) as in VGGT's protocol. Both are invariant to a
        similarity transform of either world frame. A pair whose relative
        translation is exactly zero in either pose has no direction and is
        scored 90 degrees (a failure), as the reference code's epsilon does.

    Raises:
        ValueError: shapes differ or S < 2.
    """
    P, G = _as_extrinsics(pred_extrinsics, "pred_extrinsics"), _as_extrinsics(gt_extrinsics, "gt_extrinsics")
    if P.shape != G.shape:
        raise ValueError(f"pred_extrinsics {P.shape} and gt_extrinsics {G.shape} must match")
    if P.shape[0] < 2:
        raise ValueError("relative pose errors need at least 2 frames")
    i, j = pair_indices(P.shape[0])
    Rp, tp = _relative(P, i, j)
    Rg, tg = _relative(G, i, j)
    rot = rotation_angle_deg(Rg, Rp)
    # atan2(|a x b|, a . b): accurate for small angles too (arccos loses ~sqrt(eps))
    ang = np.degrees(np.arctan2(np.linalg.norm(np.cross(tp, tg), axis=-1), np.einsum("pa,pa->p", tp, tg)))
    degenerate = (np.linalg.norm(tp, axis=-1) == 0) | (np.linalg.norm(tg, axis=-1) == 0)
    ang = np.where(degenerate, 90.0, ang)
    return rot, np.minimum(ang, np.abs(180.0 - ang))


def pose_auc(rot_err, trans_err, max_threshold: int) -> float:
    """AUC of ``max(rot_err, trans_err)`` on integer thresholds 1..``max_threshold`` degrees.

    ``mean_{k=0..T-1} (cumulative histogram of errors on bins [0,1), [1,2), ..., [T-1, T])``,
    i.e. the mean over t = 1..T of the fraction of pairs with error < t (the last
    bin also counts an error of exactly T), in [0, 1].
    """
    err = np.maximum(np.asarray(rot_err, dtype=np.float64), np.asarray(trans_err, dtype=np.float64))
    if err.size == 0:
        raise ValueError("pose_auc needs at least one pair")
    err = np.where(np.isfinite(err), err, np.inf)
    hist, _ = np.histogram(err, bins=np.arange(max_threshold + 1))
    return float(np.mean(np.cumsum(hist / err.size)))


def pose_metrics(pred_extrinsics, gt_extrinsics, thresholds=AUC_THRESHOLDS) -> dict:
    """Pair errors summarised: AUC@T for each T, RRA@T / RTA@T (fraction under T), means / medians."""
    rot, trans = relative_pose_errors(pred_extrinsics, gt_extrinsics)
    out = {"pairs": int(rot.size),
           "rot_err_mean_deg": float(rot.mean()), "rot_err_median_deg": float(np.median(rot)),
           "trans_err_mean_deg": float(trans.mean()), "trans_err_median_deg": float(np.median(trans))}
    for T in thresholds:
        out[f"auc@{T}"] = pose_auc(rot, trans, T)
        out[f"rra@{T}"] = float(np.mean(rot < T))
        out[f"rta@{T}"] = float(np.mean(trans < T))
    return out


def umeyama(src, dst, with_scale: bool = True):
    """Least-squares similarity ``dst ~ s R src + t`` (Umeyama 1991, Eq. 40-42).

    Args:
        src, dst: [N, 3] corresponding points, N >= 3 (not all collinear for a unique R).
        with_scale: estimate s (else s = 1, a rigid fit).

    Returns:
        (s float, R [3, 3] proper rotation, t [3]).

    Raises:
        ValueError: shapes differ, N < 3, or ``src`` has zero spread.
    """
    src, dst = np.asarray(src, dtype=np.float64), np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 3:
        raise ValueError(f"src {src.shape} and dst {dst.shape} must both be [N, 3]")
    if src.shape[0] < 3:
        raise ValueError(f"umeyama needs N >= 3 correspondences, got {src.shape[0]}")
    mu_s, mu_d = src.mean(0), dst.mean(0)
    xs, xd = src - mu_s, dst - mu_d
    var_s = (xs ** 2).sum() / len(src)
    if var_s <= 0:
        raise ValueError("umeyama: source points have zero spread")
    cov = xd.T @ xs / len(src)
    U, D, Vt = np.linalg.svd(cov)
    S = np.eye(3)
    if np.linalg.det(U) * np.linalg.det(Vt) < 0:
        S[2, 2] = -1.0
    R = U @ S @ Vt
    s = float(np.trace(np.diag(D) @ S) / var_s) if with_scale else 1.0
    t = mu_d - s * R @ mu_s
    return s, R, t


def apply_sim3(points, s: float, R, t) -> np.ndarray:
    """``s R x + t`` for points [..., 3]."""
    return s * np.asarray(points, dtype=np.float64) @ np.asarray(R).T + np.asarray(t)


def transform_extrinsics(extrinsics, s: float, R, t) -> np.ndarray:
    """Camera-from-world extrinsics [S, 3, 4] re-expressed in the world ``x' = s R x + t``.

    The camera frame is scaled with the world, so ``[Rc R^T | s tc - Rc R^T t]``.
    """
    E = _as_extrinsics(extrinsics, "extrinsics")
    Rc, tc = E[:, :, :3], E[:, :, 3]
    Rn = Rc @ np.asarray(R).T
    tn = s * tc - np.einsum("sab,b->sa", Rn, np.asarray(t, dtype=np.float64))
    return np.concatenate([Rn, tn[:, :, None]], axis=-1)


def camera_centers(extrinsics) -> np.ndarray:
    """Camera centres in world coordinates, ``-R^T t`` -> [S, 3]."""
    E = _as_extrinsics(extrinsics, "extrinsics")
    return -np.einsum("sba,sb->sa", E[:, :, :3], E[:, :, 3])


def align_cameras_sim3(pred_extrinsics, gt_extrinsics):
    """Similarity (s, R, t) mapping the predicted world onto the ground-truth world.

    Umeyama on camera centres plus, for each camera, three points one "spread"
    along its axes (the spread being the RMS distance of the centres to their
    mean, in each world's own units), so orientation is used too and two
    cameras suffice. With one camera the scale is fixed to 1.

    Returns:
        (s, R [3, 3], t [3]) with ``x_gt ~ s R x_pred + t``.
    """
    P = _as_extrinsics(pred_extrinsics, "pred_extrinsics")
    G = _as_extrinsics(gt_extrinsics, "gt_extrinsics")
    if P.shape != G.shape:
        raise ValueError(f"pred_extrinsics {P.shape} and gt_extrinsics {G.shape} must match")

    def anchors(E):
        c = camera_centers(E)
        spread = np.sqrt(((c - c.mean(0)) ** 2).sum(-1).mean()) if len(c) > 1 else 1.0
        spread = spread if spread > 0 else 1.0
        axes = np.swapaxes(E[:, :, :3], -1, -2)  # columns: camera axes in world coords
        pts = [c] + [c + spread * axes[:, :, k] for k in range(3)]
        return np.concatenate(pts, axis=0)

    return umeyama(anchors(P), anchors(G), with_scale=True)


def nearest_distances(query, reference) -> np.ndarray:
    """Distance from each ``query`` point [N, 3] to its nearest ``reference`` point [M, 3] -> [N].

    Uses open3d's KD-tree (``PointCloud.compute_point_cloud_distance``).
    """
    from .points import require_open3d

    o3d = require_open3d()
    q, r = o3d.geometry.PointCloud(), o3d.geometry.PointCloud()
    q.points = o3d.utility.Vector3dVector(np.asarray(query, dtype=np.float64).reshape(-1, 3))
    r.points = o3d.utility.Vector3dVector(np.asarray(reference, dtype=np.float64).reshape(-1, 3))
    return np.asarray(q.compute_point_cloud_distance(r), dtype=np.float64)


def cloud_metrics(pred_points, gt_points, threshold: float | None = None) -> dict:
    """Accuracy, completeness and Chamfer distance between two (already aligned) clouds.

    Args:
        pred_points: [N, 3]; gt_points: [M, 3] (non-empty, finite).
        threshold: if given, also precision / recall / F-score at this distance.

    Returns:
        dict: ``accuracy`` (mean pred->gt NN distance), ``completeness`` (mean
        gt->pred), ``chamfer`` ((acc + comp) / 2), medians, point counts.
    """
    p = np.asarray(pred_points, dtype=np.float64).reshape(-1, 3)
    g = np.asarray(gt_points, dtype=np.float64).reshape(-1, 3)
    if len(p) == 0 or len(g) == 0:
        raise ValueError(f"cloud_metrics needs non-empty clouds (pred {len(p)}, gt {len(g)} points)")
    d_pg, d_gp = nearest_distances(p, g), nearest_distances(g, p)
    out = {"accuracy": float(d_pg.mean()), "completeness": float(d_gp.mean()),
           "accuracy_median": float(np.median(d_pg)), "completeness_median": float(np.median(d_gp)),
           "pred_points": int(len(p)), "gt_points": int(len(g))}
    out["chamfer"] = 0.5 * (out["accuracy"] + out["completeness"])
    if threshold is not None:
        prec, rec = float(np.mean(d_pg < threshold)), float(np.mean(d_gp < threshold))
        out.update({"threshold": float(threshold), "precision": prec, "recall": rec,
                    "fscore": 0.0 if prec + rec == 0 else 2 * prec * rec / (prec + rec)})
    return out
