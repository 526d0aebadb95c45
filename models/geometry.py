"""Camera and depth post-processing for VGGT outputs (official demo conventions).

* Pose encoding ``absT_quaR_FoV`` [..., 9] = [t (3), quaternion xyzw (4), fov_h, fov_w].
* Extrinsics [..., 3, 4] = [R | t], camera-from-world, OpenCV axes (x right, y
  down, z forward); world = first camera.
* Intrinsics [..., 3, 3]: fy = (H/2) / tan(fov_h/2), fx = (W/2) / tan(fov_w/2),
  principal point (W/2, H/2).
* Depth unprojection uses pixel coordinates u = 0..W-1, v = 0..H-1 (no +0.5).
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["quat_to_mat", "mat_to_quat", "pose_encoding_to_extri_intri", "extri_intri_to_pose_encoding",
           "closed_form_inverse_se3", "depth_to_cam_points", "unproject_depth_map_to_point_map",
           "confidence_mask"]


def quat_to_mat(quat: torch.Tensor) -> torch.Tensor:
    """Unit (or not) quaternions xyzw [..., 4] -> rotation matrices [..., 3, 3]."""
    x, y, z, w = quat.unbind(-1)
    s = 2.0 / (quat * quat).sum(-1)
    m = torch.stack([
        1 - s * (y * y + z * z), s * (x * y - z * w), s * (x * z + y * w),
        s * (x * y + z * w), 1 - s * (x * x + z * z), s * (y * z - x * w),
        s * (x * z - y * w), s * (y * z + x * w), 1 - s * (x * x + y * y),
    ], dim=-1)
    return m.reshape(*quat.shape[:-1], 3, 3)


def mat_to_quat(R: torch.Tensor) -> torch.Tensor:
    """Rotation matrices [..., 3, 3] -> quaternions xyzw [..., 4] with w >= 0.

    Uses the numerically best of the four candidate formulas per matrix (largest
    diagonal term), so it is stable for rotations near 180 degrees.
    """
    m = R.reshape(-1, 3, 3)
    m00, m11, m22 = m[:, 0, 0], m[:, 1, 1], m[:, 2, 2]
    # 4 * (w^2, x^2, y^2, z^2)
    cand = torch.stack([1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22], -1)
    best = cand.argmax(-1)
    r = torch.sqrt(cand.clamp_min(1e-12).gather(1, best[:, None]))[:, 0]  # 2 * |largest component|
    d21, d02, d10 = m[:, 2, 1] - m[:, 1, 2], m[:, 0, 2] - m[:, 2, 0], m[:, 1, 0] - m[:, 0, 1]
    s01, s02, s12 = m[:, 0, 1] + m[:, 1, 0], m[:, 0, 2] + m[:, 2, 0], m[:, 1, 2] + m[:, 2, 1]
    h, r2 = r / 2, 2 * r  # the largest component is r / 2, the others (difference or sum) / (2 r)
    q = torch.stack([
        torch.stack([d21 / r2, d02 / r2, d10 / r2, h], -1),  # w largest
        torch.stack([h, s01 / r2, s02 / r2, d21 / r2], -1),  # x largest
        torch.stack([s01 / r2, h, s12 / r2, d02 / r2], -1),  # y largest
        torch.stack([s02 / r2, s12 / r2, h, d10 / r2], -1),  # z largest
    ], 1)
    q = q[torch.arange(q.shape[0], device=q.device), best]
    q = torch.where(q[:, 3:4] < 0, -q, q)
    return q.reshape(*R.shape[:-2], 4)


def pose_encoding_to_extri_intri(pose_encoding: torch.Tensor, image_size_hw) -> tuple[torch.Tensor, torch.Tensor]:
    """Pose encodings -> (extrinsics [..., 3, 4] camera-from-world, intrinsics [..., 3, 3]).

    Args:
        pose_encoding: [..., 9] (usually [B, S, 9]) ``absT_quaR_FoV``.
        image_size_hw: (H, W) of the images the model saw.

    Raises:
        ValueError: last dim is not 9.
    """
    if pose_encoding.shape[-1] != 9:
        raise ValueError(f"pose_encoding must end in 9 values (absT_quaR_FoV), got {tuple(pose_encoding.shape)}")
    H, W = image_size_hw
    t, quat = pose_encoding[..., :3], pose_encoding[..., 3:7]
    fov_h, fov_w = pose_encoding[..., 7], pose_encoding[..., 8]
    extrinsics = torch.cat([quat_to_mat(quat), t[..., None]], dim=-1)
    K = torch.zeros(*pose_encoding.shape[:-1], 3, 3, dtype=pose_encoding.dtype, device=pose_encoding.device)
    K[..., 0, 0] = (W / 2.0) / torch.tan(fov_w / 2.0)
    K[..., 1, 1] = (H / 2.0) / torch.tan(fov_h / 2.0)
    K[..., 0, 2] = W / 2.0
    K[..., 1, 2] = H / 2.0
    K[..., 2, 2] = 1.0
    return extrinsics, K


def extri_intri_to_pose_encoding(extrinsics: torch.Tensor, intrinsics: torch.Tensor, image_size_hw) -> torch.Tensor:
    """Inverse of :func:`pose_encoding_to_extri_intri`: ([..., 3, 4], [..., 3, 3]) -> [..., 9]."""
    H, W = image_size_hw
    fov_h = 2 * torch.atan((H / 2.0) / intrinsics[..., 1, 1])
    fov_w = 2 * torch.atan((W / 2.0) / intrinsics[..., 0, 0])
    return torch.cat([extrinsics[..., :3, 3], mat_to_quat(extrinsics[..., :3, :3]), fov_h[..., None],
                      fov_w[..., None]], dim=-1)


def closed_form_inverse_se3(se3):
    """Invert [..., 3, 4] or [..., 4, 4] rigid transforms: [R | t] -> [R^T | -R^T t] ([..., 4, 4]).

    Works on torch tensors and numpy arrays (returns the same type).
    """
    is_np = isinstance(se3, np.ndarray)
    T = torch.from_numpy(se3) if is_np else se3
    R, t = T[..., :3, :3], T[..., :3, 3:]
    Rt = R.transpose(-1, -2)
    out = torch.zeros(*T.shape[:-2], 4, 4, dtype=T.dtype, device=T.device)
    out[..., :3, :3] = Rt
    out[..., :3, 3:] = -Rt @ t
    out[..., 3, 3] = 1
    return out.numpy() if is_np else out


def depth_to_cam_points(depth: torch.Tensor, intrinsics: torch.Tensor) -> torch.Tensor:
    """Depth [S, H, W] + intrinsics [S, 3, 3] -> camera-frame points [S, H, W, 3] (pixel grid u, v from 0)."""
    S, H, W = depth.shape
    v, u = torch.meshgrid(torch.arange(H, device=depth.device, dtype=depth.dtype),
                          torch.arange(W, device=depth.device, dtype=depth.dtype), indexing="ij")
    fx, fy = intrinsics[:, 0, 0, None, None], intrinsics[:, 1, 1, None, None]
    cx, cy = intrinsics[:, 0, 2, None, None], intrinsics[:, 1, 2, None, None]
    return torch.stack([(u - cx) * depth / fx, (v - cy) * depth / fy, depth], dim=-1)


def unproject_depth_map_to_point_map(depth, extrinsics, intrinsics, frames_chunk_size: int | None = None):
    """Depth maps -> world points with the (predicted) cameras.

    Args:
        depth: [S, H, W, 1] or [S, H, W] (torch or numpy).
        extrinsics: [S, 3, 4] camera-from-world (OpenCV).
        intrinsics: [S, 3, 3].
        frames_chunk_size: frames per chunk (None = all at once); each chunk's points are
            written into the preallocated result, so the temporaries stay one chunk large.
            Frames are independent: the result does not depend on it.

    Returns:
        world points [S, H, W, 3], same array type (torch / numpy) and float dtype as ``depth``.

    Raises:
        ValueError: shapes do not match.
    """
    is_np = isinstance(depth, np.ndarray)
    to_t = lambda a: torch.from_numpy(np.asarray(a)) if isinstance(a, np.ndarray) else a  # noqa: E731
    d, E, K = to_t(depth), to_t(extrinsics), to_t(intrinsics)
    if d.dim() == 4:
        if d.shape[-1] != 1:
            raise ValueError(f"depth must be [S, H, W, 1] or [S, H, W], got {tuple(d.shape)}")
        d = d[..., 0]
    if d.dim() != 3 or E.shape != (d.shape[0], 3, 4) or K.shape != (d.shape[0], 3, 3):
        raise ValueError(f"expected depth [S, H, W(, 1)], extrinsics [S, 3, 4], intrinsics [S, 3, 3]; got "
                         f"{tuple(d.shape)}, {tuple(E.shape)}, {tuple(K.shape)}")
    work = torch.float64 if d.dtype == torch.float64 else torch.float32
    step = frames_chunk_size or max(d.shape[0], 1)
    if step >= d.shape[0]:
        world = _unproject(d, E, K, work)
    else:
        world = torch.empty(*d.shape, 3, dtype=d.dtype, device=d.device)
        for s0 in range(0, d.shape[0], step):
            world[s0:s0 + step] = _unproject(d[s0:s0 + step], E[s0:s0 + step], K[s0:s0 + step], work)
    return world.numpy() if is_np else world


def _unproject(d, E, K, work):
    """[s, H, W] depth, [s, 3, 4], [s, 3, 3] -> [s, H, W, 3] world points in d's dtype."""
    cam = depth_to_cam_points(d.to(work), K.to(work).to(d.device))
    E = E.to(work).to(d.device)
    R, t = E[:, :3, :3], E[:, :3, 3]
    world = torch.einsum("sji,shwj->shwi", R, cam - t[:, None, None, :])  # R^T (x - t)
    return world.to(d.dtype)


def confidence_mask(conf, percentile: float | None = 50.0, threshold: float | None = None):
    """Boolean mask of confident pixels.

    Args:
        conf: confidence maps (>= 1 for VGGT) of any shape, torch or numpy.
        percentile: keep values at or above this percentile over all of ``conf``
            (50 keeps the top half); None to skip.
        threshold: keep values >= threshold (e.g. 3 or 5); None to skip. With both
            given, a pixel must pass both.

    Raises:
        ValueError: neither given, or percentile outside [0, 100].
    """
    if percentile is None and threshold is None:
        raise ValueError("give percentile and/or threshold")
    is_np = isinstance(conf, np.ndarray)
    c = torch.from_numpy(conf) if is_np else conf
    keep = torch.ones_like(c, dtype=torch.bool)
    if percentile is not None:
        if not 0 <= percentile <= 100:
            raise ValueError(f"percentile={percentile} must be in [0, 100]")
        flat = c.reshape(-1).float()
        # kthvalue (lower nearest rank) instead of torch.quantile, which refuses > 2**24 elements
        k = int(round(percentile / 100.0 * (flat.numel() - 1))) + 1
        cut = flat.kthvalue(k).values if flat.numel() else 0.0
        keep &= c >= cut
    if threshold is not None:
        keep &= c >= threshold
    return keep.numpy() if is_np else keep
