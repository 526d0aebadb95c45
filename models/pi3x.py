"""Pi3X: π³ with optional geometric conditions, a convolutional head and a metric scale (github.com/yyfz/Pi3).

The official "engineering update" of π³ (Wang et al., arXiv:2507.13347, README of yyfz/Pi3, Dec. 2025), in the
same repository as π³ (``pi3/models/pi3x.py``), weights ``yyfz233/Pi3X``. Same encoder and alternating
decoder as :class:`~visionattn.models.pi3.Pi3`, plus:

* conditions, each optional and per frame: camera intrinsics (or ray directions) through ``ray_embed`` (a 2-channel
  patch embedding of the normalised image-plane coordinates); depth maps through ``depth_encoder`` (a second
  DINOv2 over [normalised depth, validity]); camera poses through five ``pose_inject_blk`` blocks (PRoPE
  attention among the posed frames after decoder layers 1, 9, 17, 25, 33);
* convolutional point and confidence heads (MoGe style, no patch-grid artefacts);
* a metric decoder: one token cross-attending to the whole scene predicts the scale that makes points, local
  points and camera translations approximately metric.

Parameter names and shapes are those of the official checkpoint (1,873 keys, 1,360,032,439 values;
``tests/data/pi3x_state_dict.tsv``).

    model = Pi3X.from_pretrained("yyfz233/Pi3X").cuda().eval()
    out = model.infer(images, intrinsics=K, poses=c2w, depths=d)   # every condition optional
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import AUTO_MODE, DinoV2, PatchEmbed, normal_
from .pi3 import _homogeneous_apply, _Pi3Base
from .pi3_layers import (CameraHead, ContextOnlyTransformerDecoder, ConvHead, PoseInjectBlock, TransformerDecoder,
                         check_attn_mode, se3_inverse)

__all__ = ["Pi3X", "pi3x_tiny_config", "PI3X_REPO", "MULTIMODAL_PREFIXES"]

PI3X_REPO = "yyfz233/Pi3X"
MULTIMODAL_PREFIXES = ("depth_encoder.", "depth_emb", "ray_embed.", "pose_inject_blk.")
"""Checkpoint keys of the condition branch (absent with ``use_multimodal=False``)."""

_STATIC_POSES = 2e-2  # scenes whose cameras all lie this close to the first (relative units) keep their scale


def _batched(t, name: str, tail: tuple, B: int, N: int) -> torch.Tensor:
    """``t`` as a float tensor [B, N, *tail] (a missing leading B of 1 is added); ValueError naming ``name``."""
    t = torch.as_tensor(t)
    if t.dim() == len(tail) + 1:
        t = t[None]
    if tuple(t.shape) != (B, N, *tail):
        dims = ", ".join(["B", "N", *map(str, tail)])
        raise ValueError(f"{name} must be [{dims}] = {(B, N, *tail)} for these images, got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} has NaN or inf entries" + (" (use 0 for unknown depth)" if name == "depths" else ""))
    return t


def _mask(m, name: str, B: int, N: int, default: bool, device) -> torch.Tensor:
    if m is None:
        return torch.full((B, N), default, dtype=torch.bool, device=device)
    m = torch.as_tensor(m, device=device)
    if m.dim() == 1:
        m = m[None]
    if tuple(m.shape) != (B, N) or m.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor [B, N] = {(B, N)}, got {m.dtype} {tuple(m.shape)}")
    return m


class Pi3X(_Pi3Base):
    """Pi3X: π³ with optional intrinsics / pose / depth conditions, convolutional heads and a metric scale.

    Args:
        img_size ... camera_dim, rope_base, attn_mode, encoder_chunk_size, tokens_chunk_size: as
            :class:`~visionattn.models.pi3.Pi3` (same defaults).
        metric_dim, metric_depth, metric_num_heads: the metric decoder (512, 5 cross-attention blocks, 8 heads).
        conv_dims, conv_res_blocks, conv_last_channels: convolutional heads ((256, 128, 64), 2, 32).
        use_multimodal: build the condition branch (depth encoder, ray embedding, pose injection); False builds
            the image-only model (the official ``disable_multimodal()``; see :meth:`disable_multimodal`).
        pose_inject_layers: decoder layers after which the pose-injection blocks run ((1, 9, 17, 25, 33)).
        frames_chunk_size: frames per chunk of the convolutional heads (64, as the official code; None = all).

    forward(images, intrinsics=None, poses=None, depths=None, rays=None, with_prior=True,
    mask_add_depth=None, mask_add_ray=None, mask_add_pose=None) -> dict. B scenes of N frames, H x W pixels
    (multiples of 14); each condition may drop its leading B when B = 1:

        images: [N, 3, H, W] or [B, N, 3, H, W], float RGB in [0, 1].
        intrinsics: [B, N, 3, 3] pinhole matrices in pixels of the H x W input images (fx, fy > 0, principal
            point near the image centre; pixel centres at +0.5).
        rays: [B, N, H, W, 3] camera-frame ray directions (z > 0), instead of ``intrinsics``.
        poses: [B, N, 4, 4] camera-to-world rigid transforms, OpenCV convention (x right, y down, z forward);
            any translation unit (the model normalises the scene). Relative poses need two posed frames: a scene
            with a single posed frame ignores the pose condition, as the official model does.
        depths: [B, N, H, W] depth along z (any unit, normalised per scene by the mean valid depth), 0 = unknown.
        with_prior: False ignores every condition given (the official switch).
        mask_add_depth, mask_add_ray, mask_add_pose: [B, N] bool, which frames use that condition (default:
            every frame, when the condition is given). Deterministic: the official random masks of training
            are not drawn.

    Returns:
        ``points`` [B, N, H, W, 3] world points, ``local_points`` [B, N, H, W, 3] camera-frame points,
        ``camera_poses`` [B, N, 4, 4] camera-to-world (OpenCV), all in approximate metres (times ``metric``);
        ``metric`` [B] the predicted scale (> 0); ``rays`` [B, N, H, W, 3] unit ray directions in the camera
        frame; ``conf`` [B, N, H, W, 1] confidence logits (``sigmoid`` for [0, 1]).

    Raises (forward):
        ValueError: a bad image layout or size, a condition with the wrong shape, NaN / inf entries, intrinsics
            that look normalised or non-positive focal lengths, poses that are not rigid, negative depths, rays
            with z <= 0, both ``intrinsics`` and ``rays``, a mask that is not [B, N] bool or comes without its
            condition, or a condition given to a model built with ``use_multimodal=False``.
    """

    default_repo = PI3X_REPO

    def __init__(self, img_size: int = 518, patch_size: int = 14, embed_dim: int = 1024, encoder_depth: int = 24,
                 encoder_heads: int = 16, depth: int = 36, num_heads: int = 16, mlp_ratio: float = 4.0,
                 num_register_tokens: int = 5, head_embed_dim: int = 1024, head_depth: int = 5,
                 head_num_heads: int = 16, camera_dim: int = 512, metric_dim: int = 512, metric_depth: int = 5,
                 metric_num_heads: int = 8, conv_dims=(256, 128, 64), conv_res_blocks: int = 2,
                 conv_last_channels: int = 32, use_multimodal: bool = True, pose_inject_layers=(1, 9, 17, 25, 33),
                 rope_base: float = 100.0, attn_mode: str | None = AUTO_MODE, encoder_chunk_size: int | None = 32,
                 tokens_chunk_size: int | None = 65536, frames_chunk_size: int | None = 64):
        args = dict(locals())
        super().__init__()
        attn_mode = check_attn_mode(attn_mode)
        layers = tuple(int(i) for i in pose_inject_layers)
        if any(not 0 <= i < depth for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"pose_inject_layers={layers} must be distinct layers in [0, depth={depth})")
        if frames_chunk_size is not None and (not isinstance(frames_chunk_size, int) or frames_chunk_size < 1):
            raise ValueError(f"frames_chunk_size={frames_chunk_size!r} must be a positive int or None")
        self.config = {k: v for k, v in args.items() if k not in ("self", "__class__", "attn_mode")}
        self.config.update(conv_dims=list(conv_dims), pose_inject_layers=list(layers))
        self.pose_inject_layers = layers
        self.frames_chunk_size = frames_chunk_size
        self._build_trunk(img_size, patch_size, embed_dim, encoder_depth, encoder_heads, depth, num_heads,
                          mlp_ratio, num_register_tokens, rope_base, attn_mode)
        self.use_multimodal = use_multimodal
        if use_multimodal:
            self.depth_encoder = DinoV2(img_size, patch_size, embed_dim, encoder_depth, encoder_heads, mlp_ratio,
                                        num_register_tokens=4, init_values=1.0, attn_mode=attn_mode)
            del self.depth_encoder.mask_token
            self.depth_encoder.patch_embed = PatchEmbed(patch_size, embed_dim, in_chans=2)
            self.depth_emb = nn.Parameter(torch.zeros(1, 1, embed_dim))
            self.ray_embed = PatchEmbed(patch_size, embed_dim, in_chans=2)
            nn.init.zeros_(self.ray_embed.proj.weight)
            nn.init.zeros_(self.ray_embed.proj.bias)
            self.pose_inject_blk = nn.ModuleList(PoseInjectBlock(embed_dim, num_heads, mlp_ratio, 0.01, attn_mode)
                                                 for _ in layers)
        dec = dict(dim=head_embed_dim, depth=head_depth, num_heads=head_num_heads, mlp_ratio=mlp_ratio,
                   attn_mode=attn_mode)
        conv = dict(dim_in=head_embed_dim, dim_upsample=tuple(conv_dims), num_res_blocks=conv_res_blocks,
                    last_conv_channels=conv_last_channels, patch_size=patch_size)
        self.point_decoder = TransformerDecoder(2 * embed_dim, head_embed_dim, **dec)
        self.point_head = ConvHead(dim_out=(2, 1), **conv)
        self.camera_decoder = TransformerDecoder(2 * embed_dim, camera_dim, **dec)
        self.camera_head = CameraHead(camera_dim)
        self.metric_token = nn.Parameter(torch.zeros(1, 1, 2 * embed_dim))
        normal_(self.metric_token, std=1e-6)
        self.metric_decoder = ContextOnlyTransformerDecoder(2 * embed_dim, metric_dim, metric_dim, metric_depth,
                                                            metric_num_heads, mlp_ratio, attn_mode)
        self.metric_head = nn.Linear(metric_dim, 1)
        self.conf_decoder = TransformerDecoder(2 * embed_dim, head_embed_dim, **dec)
        self.conf_head = ConvHead(dim_out=(1,), **conv)
        self.set_chunking(encoder_chunk_size, tokens_chunk_size)

    def disable_multimodal(self) -> Pi3X:
        """Drop the condition branch (its parameters are freed); image-only inference is unchanged. Returns self."""
        for name in ("depth_encoder", "depth_emb", "ray_embed", "pose_inject_blk"):
            if hasattr(self, name):
                delattr(self, name)
        self.use_multimodal = False
        self.config["use_multimodal"] = False
        return self

    @classmethod
    def _filter_state_dict(cls, sd: dict, model: nn.Module) -> dict:
        if model.use_multimodal:
            return sd
        return {k: v for k, v in sd.items() if not k.startswith(MULTIMODAL_PREFIXES)}

    # ------------------------------------------------------------------ conditions
    def _conditions(self, images, intrinsics, poses, depths, rays, with_prior, mask_add_depth, mask_add_ray,
                    mask_add_pose) -> dict | None:
        """Checked, normalised conditions, or None when nothing is conditioned (called with autocast off).

        Returns {"ray": ([B*N, 2, H, W], mask [B, N]) or None, "depth": ([B*N, 2, H, W], mask) or None,
        "pose": (relative normalised camera-to-world [B, N, 4, 4], mask) or None}, in the parameters' dtype.
        """
        B, N, _, H, W = images.shape
        given = {"intrinsics": intrinsics, "poses": poses, "depths": depths, "rays": rays}
        masks = {"mask_add_depth": (mask_add_depth, depths), "mask_add_ray": (mask_add_ray,
                 rays if rays is not None else intrinsics), "mask_add_pose": (mask_add_pose, poses)}
        for name, (m, cond) in masks.items():
            if m is not None and cond is None:
                raise ValueError(f"{name} is given without its condition")
        if all(v is None for v in given.values()):
            return None
        if not self.use_multimodal:
            names = [k for k, v in given.items() if v is not None]
            raise ValueError(f"{names} given, but this Pi3X has no condition branch (use_multimodal=False)")
        if intrinsics is not None and rays is not None:
            raise ValueError("pass intrinsics or rays, not both")
        dev, dt = images.device, self.register_token.dtype
        if intrinsics is not None:
            K = _batched(intrinsics, "intrinsics", (3, 3), B, N).to(dev, dt)
            if (K[..., 0, 0] <= 0).any() or (K[..., 1, 1] <= 0).any():
                raise ValueError("intrinsics must have positive focal lengths fx = K[0, 0], fy = K[1, 1] (pixels)")
            if not torch.allclose(K[..., 2, :], torch.tensor([0.0, 0.0, 1.0], device=dev, dtype=dt)):
                raise ValueError("intrinsics must be pinhole matrices with last row (0, 0, 1)")
            if max(H, W) > 4 and (K[..., 0, 2] <= 1.5).all() and (K[..., 1, 2] <= 1.5).all():
                raise ValueError(f"intrinsics look normalised (principal point <= 1.5); pass them in pixels of the "
                                 f"{H}x{W} input images (cx near {W / 2:g}, cy near {H / 2:g})")
        if rays is not None:
            rays = _batched(rays, "rays", (H, W, 3), B, N).to(dev, dt)
            if (rays[..., 2] <= 0).any():
                raise ValueError("rays must point forward (z > 0) in the camera frame")
        if poses is not None:
            poses = _batched(poses, "poses", (4, 4), B, N).to(dev, dt)
            R = poses[..., :3, :3]
            eye = torch.eye(3, device=dev, dtype=dt)
            rigid = (torch.allclose(poses[..., 3, :], torch.tensor([0.0, 0.0, 0.0, 1.0], device=dev, dtype=dt),
                                    atol=1e-4)
                     and torch.allclose(R.transpose(-1, -2) @ R, eye.expand_as(R), atol=1e-3)
                     and bool((torch.linalg.det(R) > 0).all()))
            if not rigid:
                raise ValueError("poses must be camera-to-world rigid transforms [R t; 0 0 0 1] with R a rotation "
                                 "(OpenCV convention)")
        if depths is not None:
            depths = _batched(depths, "depths", (H, W), B, N).to(dev, dt)
            if (depths < 0).any():
                raise ValueError("depths must be >= 0 (0 = unknown)")
        ray_m = _mask(mask_add_ray, "mask_add_ray", B, N, with_prior and (rays is not None or intrinsics is not None),
                      dev)
        depth_m = _mask(mask_add_depth, "mask_add_depth", B, N, with_prior and depths is not None, dev)
        pose_m = _mask(mask_add_pose, "mask_add_pose", B, N, with_prior and poses is not None, dev)
        pose_m = pose_m & (pose_m.sum(dim=1, keepdim=True) != 1)  # one posed frame carries no relative pose
        out = {"ray": None, "depth": None, "pose": None}
        if ray_m.any():
            if rays is not None:
                xy = rays[..., :2] / (rays[..., 2:3] + 1e-6)
            else:
                v, u = torch.meshgrid(torch.arange(H, device=dev, dtype=dt), torch.arange(W, device=dev, dtype=dt),
                                      indexing="ij")
                pix = torch.stack([u + 0.5, v + 0.5, torch.ones_like(u)], dim=-1)
                xy = torch.einsum("bnij,hwj->bnhwi", torch.linalg.inv(K), pix)[..., :2]
            out["ray"] = (xy.reshape(B * N, H, W, 2).permute(0, 3, 1, 2), ray_m)
        if depths is None:
            scale = torch.ones(B, device=dev, dtype=dt)
        else:  # the mean of the valid depths of each scene (1 where none is valid)
            valid = depths > 0
            count = valid.flatten(1).sum(1)
            scale = torch.where(count > 0, (depths * valid).flatten(1).sum(1) / count.clamp_min(1), 1.0)
            if depth_m.any():
                d = depths / (scale.view(B, 1, 1, 1) + 1e-8)
                d_in = torch.stack([d, (d > 0).to(dt)], dim=2).reshape(B * N, 2, H, W)
                out["depth"] = (d_in, depth_m)
        if pose_m.any():
            rel = torch.einsum("bij,bnjk->bnik", se3_inverse(poses[:, 0]), poses)
            t = rel[..., :3, 3] / scale.view(B, 1, 1)
            if N > 1:  # scenes without depth: translations in units of the mean camera distance
                dist = t[:, 1:].norm(dim=-1)
                moving = (depth_m.sum(1) == 0) & (dist.max(dim=1).values >= _STATIC_POSES)
                t = torch.where(moving.view(B, 1, 1), t / (dist.mean(dim=1).view(B, 1, 1) + 1e-8), t)
            rel = torch.cat([torch.cat([rel[..., :3, :3], t[..., None]], dim=-1), rel[..., 3:, :]], dim=-2)
            out["pose"] = (rel, pose_m)
        return out

    def _add_embeddings(self, hidden: torch.Tensor, cond: dict) -> torch.Tensor:
        """hidden [B*N, h*w, C] plus the ray, then the depth embedding of each conditioned frame."""
        if cond["ray"] is not None:
            x, m = cond["ray"]
            idx = m.flatten().nonzero().squeeze(1)
            hidden = hidden.index_add(0, idx, self.ray_embed(x[idx]).to(hidden.dtype))
        if cond["depth"] is not None:
            x, m = cond["depth"]
            idx = m.flatten().nonzero().squeeze(1)
            emb = self._encode(self.depth_encoder, x[idx]) + self.depth_emb
            hidden = hidden.index_add(0, idx, emb.to(hidden.dtype))
        return hidden

    def _pose_injector(self, cond: dict, B: int, N: int, h: int, w: int):
        """``inject(i, x)`` for :meth:`_decode`: after the listed layers, add the pose-injection output to the patch
        tokens of the posed frames (attention among the posed frames of each scene only)."""
        rel, mask = cond["pose"]
        slot = {layer: k for k, layer in enumerate(self.pose_inject_layers)}
        R, everyone = self.patch_start_idx, bool(mask.all())
        frames = [mask[b].nonzero().squeeze(1) for b in range(B)]

        def inject(i: int, x: torch.Tensor) -> torch.Tensor:
            if i not in slot:
                return x
            blk = self.pose_inject_blk[slot[i]]
            xs = x.view(B, N, -1, x.shape[-1])
            C, P = xs.shape[-1], h * w
            if everyone:
                xs[:, :, R:] += blk(xs[:, :, R:].reshape(B, N * P, C), rel, h, w).view(B, N, P, C)
                return x
            for b, idx in enumerate(frames):
                if idx.numel():
                    sel = xs[b, idx, R:].reshape(1, -1, C)
                    xs[b, idx, R:] += blk(sel, rel[b, idx][None], h, w).view(-1, P, C)
            return x

        return inject

    # ------------------------------------------------------------------ forward
    def _conv(self, head: ConvHead, feat: torch.Tensor, h: int, w: int) -> list[torch.Tensor]:
        step = self.frames_chunk_size or feat.shape[0]
        if feat.shape[0] <= step:
            return head(feat, h, w)
        parts = [head(feat[i:i + step], h, w) for i in range(0, feat.shape[0], step)]
        return [torch.cat(p) for p in zip(*parts)]

    def forward(self, images: torch.Tensor, intrinsics=None, poses=None, depths=None, rays=None,
                with_prior: bool = True, mask_add_depth=None, mask_add_ray=None, mask_add_pose=None) -> dict:
        images = self._as_scenes(images, self.patch_size)
        B, N, _, H, W = images.shape
        h, w = H // self.patch_size, W // self.patch_size
        with torch.autocast(images.device.type, enabled=False):  # conditions are checked and normalised in FP32
            cond = self._conditions(images, intrinsics, poses, depths, rays, with_prior, mask_add_depth,
                                    mask_add_ray, mask_add_pose)
        hidden, grid = self._trunk(images)
        inject = None
        if cond is not None:
            hidden = self._add_embeddings(hidden, cond)
            if cond["pose"] is not None:
                inject = self._pose_injector(cond, B, N, h, w)
        feats = self._decode(hidden, B, N, grid, inject)
        del hidden
        R, T = self.patch_start_idx, feats.shape[1]
        point = self.point_decoder(feats, grid)[:, R:]
        camera = self.camera_decoder(feats, grid)[:, R:]
        metric = self.metric_decoder(self.metric_token.expand(B, -1, -1), feats.reshape(B, N * T, -1), grid)
        conf = self.conf_decoder(feats, grid)[:, R:]
        del feats
        dt = self.register_token.dtype
        with torch.autocast(images.device.type, enabled=False):
            xy, z = (t.permute(0, 2, 3, 1).reshape(B, N, H, W, -1) for t in self._conv(self.point_head, point.to(dt),
                                                                                     h, w))
            z = torch.exp(z.clamp(max=15.0))
            local_points = torch.cat([xy * z, z], dim=-1)
            rays_out = F.normalize(torch.cat([xy, torch.ones_like(z)], dim=-1), dim=-1)
            camera_poses = self.camera_head(camera.to(dt)).reshape(B, N, 4, 4)
            metric = self.metric_head(metric.to(dt)).reshape(B).exp()
            conf = self._conv(self.conf_head, conf.to(dt), h, w)[0].permute(0, 2, 3, 1).reshape(B, N, H, W, 1)
            s = metric.view(B, 1, 1, 1, 1)
            points = _homogeneous_apply(camera_poses, local_points) * s
            scale_t = torch.ones(B, 1, 4, 4, dtype=dt, device=images.device)
            scale_t[..., :3, 3] = metric.view(B, 1, 1)
            camera_poses = camera_poses * scale_t
            local_points = local_points * s
        return dict(points=points, local_points=local_points, rays=rays_out, conf=conf, camera_poses=camera_poses,
                    metric=metric)


def pi3x_tiny_config(**overrides) -> dict:
    """A tiny Pi3X config for CPU tests (width 64, 2 encoder + 4 decoder blocks, img 56): ``Pi3X(**cfg)``.

    Same architecture as the official model, scaled down; pose injection after decoder layers 1 and 3.
    """
    cfg = dict(img_size=56, patch_size=14, embed_dim=64, encoder_depth=2, encoder_heads=4, depth=4, num_heads=4,
               mlp_ratio=2.0, head_embed_dim=32, head_depth=1, head_num_heads=4, camera_dim=32, metric_dim=32,
               metric_depth=1, metric_num_heads=4, conv_dims=(32, 16, 16), conv_res_blocks=1,
               conv_last_channels=8, pose_inject_layers=(1, 3))
    cfg.update(overrides)
    return cfg
