"""π³ / Pi3X predictions in the reconstruction's camera conventions.

π³ (:class:`visionattn.models.Pi3`) and Pi3X predict, per frame, a camera-to-world pose (OpenCV axes: x right,
y down, z forward) with no reference frame, and a point per pixel in that camera's frame (``local_points``);
they predict no intrinsics. Every output of the reconstruction (``cameras.json``, ``sparse/0``,
``transforms.json``, ``scene.glb``) follows VGGT's conventions instead, so :func:`decode_pi3` converts:

* world frame: the first camera's, as VGGT's. With ``T_i`` the predicted camera-to-world of frame i, the
  cameras become ``T_0^-1 T_i`` and the world points ``T_0^-1 X``; the extrinsic is the rigid inverse
  ``[R|t] = (T_0^-1 T_i)^-1 = T_i^-1 T_0`` (OpenCV camera-from-world, x_cam = R x_world + t), so frame 0's is
  ``[I|0]``. Lengths keep the model's unit (π³: a free scene scale; Pi3X: approximate metres, ``metric``
  applied).
* depth: the z of ``local_points`` (z-depth along the optical axis, > 0).
* confidence: ``sigmoid(conf)`` in (0, 1), for depth and points alike (VGGT's are >= 1; the outputs only
  compare confidences with each other, through a percentile).
* intrinsics: a pinhole per frame with the principal point at the frame centre (W/2, H/2), as VGGT's decoded
  intrinsics, and focal lengths fitted by confidence-weighted least squares to the local points:
  ``fx = sum(w a b) / sum(w a^2)`` with ``a = X / Z``, ``b = u - W/2`` over pixel indices u (the grid of
  :func:`visionattn.models.geometry.depth_to_cam_points`, so unprojecting the depth with these intrinsics
  reproduces ``local_points`` wherever they follow a pinhole), ``fy`` alike with v. Pi3X run with
  ``intrinsics`` keeps the given matrices.
"""
from __future__ import annotations

import torch

__all__ = ["PI3_MODELS", "rigid_inverse", "relative_to_first", "fit_focal", "decode_pi3"]

PI3_MODELS = ("pi3", "pi3x")
"""The demo's model names of the π³ family (no track head, no predicted intrinsics)."""

_FIT_FRAMES = 16  # frames per chunk of the focal fit (float64 temporaries of a chunk only)


def rigid_inverse(T: torch.Tensor) -> torch.Tensor:
    """Inverse of rigid transforms [..., 4, 4] ([R t; 0 1] -> [R^T, -R^T t; 0 1]), in T's dtype."""
    R, t = T[..., :3, :3], T[..., :3, 3:]
    out = torch.zeros_like(T)
    out[..., :3, :3] = R.transpose(-1, -2)
    out[..., :3, 3:] = -R.transpose(-1, -2) @ t
    out[..., 3, 3] = 1
    return out


def relative_to_first(c2w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Camera-to-world poses [S, 4, 4] (any world) -> (extrinsics [S, 3, 4] OpenCV camera-from-world in the first
    camera's frame, ``T_0^-1`` [4, 4]: the map from the predicted world to that frame), float64."""
    T = c2w.double()
    to_first = rigid_inverse(T[0])
    extr = rigid_inverse(to_first @ T)[:, :3]
    return extr, to_first


def fit_focal(local_points: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Pinhole intrinsics [S, 3, 3] (float64) fitted to camera-frame points [S, H, W, 3].

    Principal point (W/2, H/2); ``fx``, ``fy`` minimise ``sum w (f X/Z - (u - c))^2`` over pixel indices (u, v)
    per frame. ``weights`` [S, H, W] >= 0 (None: all 1); pixels with Z <= 0 or non-finite points get weight 0.
    A frame with no usable pixel, or whose points run against the pixel grid, gets a non-positive or
    non-finite focal length (the pipeline's fallback then replaces it).
    """
    S, H, W, _ = local_points.shape
    dev = local_points.device
    u = torch.arange(W, device=dev, dtype=torch.float64) - W / 2.0
    v = torch.arange(H, device=dev, dtype=torch.float64) - H / 2.0
    K = torch.zeros(S, 3, 3, dtype=torch.float64, device=dev)
    for s0 in range(0, S, _FIT_FRAMES):
        p = local_points[s0:s0 + _FIT_FRAMES].double()
        w = torch.ones(p.shape[:-1], dtype=torch.float64, device=dev) if weights is None else \
            weights[s0:s0 + _FIT_FRAMES].double().clone()
        z = p[..., 2]
        ok = torch.isfinite(p).all(-1) & (z > 0) & torch.isfinite(w)
        w = torch.where(ok, w, 0.0)
        z = torch.where(ok, z, 1.0)
        a, c = torch.where(ok, p[..., 0] / z, 0.0), torch.where(ok, p[..., 1] / z, 0.0)
        fx = (w * a * u).sum((1, 2)) / (w * a * a).sum((1, 2))
        fy = (w * c * v[:, None]).sum((1, 2)) / (w * c * c).sum((1, 2))
        k = K[s0:s0 + _FIT_FRAMES]
        k[:, 0, 0], k[:, 1, 1], k[:, 0, 2], k[:, 1, 2], k[:, 2, 2] = fx, fy, W / 2.0, H / 2.0, 1.0
    return K


def decode_pi3(out: dict, intrinsics: torch.Tensor | None = None):
    """A π³ / Pi3X forward's output (one scene, B = 1) in the reconstruction's conventions (module docstring).

    Args:
        out: ``model(images)`` of :class:`~visionattn.models.Pi3` / :class:`~visionattn.models.Pi3X`.
        intrinsics: [S, 3, 3] pixels of the model's frame (Pi3X's condition); None: fitted (:func:`fit_focal`).

    Returns:
        ``(extrinsic [S, 3, 4], intrinsic [S, 3, 3], pixels)``: float64 cameras, and ``pixels(f)`` -> the
        per-pixel maps of frames ``f`` (a slice) as float tensors on the model's device: ``depth`` [s, H, W],
        ``depth_conf`` [s, H, W], ``world_points`` [s, H, W, 3] (in the first camera's frame),
        ``world_points_conf`` [s, H, W].
    """
    if out["camera_poses"].shape[0] != 1:
        raise ValueError(f"expected one scene (B = 1), got B = {out['camera_poses'].shape[0]}")
    local, conf = out["local_points"][0], out["conf"][0, ..., 0]
    extr, to_first = relative_to_first(out["camera_poses"][0])
    K = fit_focal(local, torch.sigmoid(conf.float())) if intrinsics is None else \
        intrinsics.to(local.device, torch.float64)
    R, t = to_first[:3, :3].float(), to_first[:3, 3].float()

    def pixels(f: slice) -> dict:
        c = torch.sigmoid(conf[f].float())
        world = out["points"][0, f].float() @ R.T + t
        return {"depth": local[f, ..., 2], "depth_conf": c, "world_points": world, "world_points_conf": c}

    return extr, K, pixels
