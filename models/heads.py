"""VGGT prediction heads: camera (iterative pose refinement), DPT (depth / points), track.

Parameter names follow the official VGGT-1B checkpoint. The heads run in FP32:
the top model calls them with autocast disabled and they cast the aggregator
tokens to FP32 (VGGT, Sec. 3.3) -- unless ``VGGT.heads_dtype`` asks for half
autocast, where activations and the running pose are still computed in FP32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import AUTO_MODE, AttnBlock, Block, CrossAttnBlock, Mlp, checkpointed, randn_scaled, trunc_normal_

__all__ = ["CameraHead", "DPTHead", "TrackHead", "Tracker", "UpdateFormer", "activate_pose", "activate_head",
           "inverse_log_transform"]


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision tokens -> FP32 (heads run in FP32); FP32 / FP64 pass unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# ----------------------------------------------------------------------------- activations
def inverse_log_transform(y: torch.Tensor) -> torch.Tensor:
    """``sign(y) * (exp(|y|) - 1)``."""
    return torch.sign(y) * torch.expm1(torch.abs(y))


def activate_pose(enc: torch.Tensor) -> torch.Tensor:
    """Pose encoding activation ``absT_quaR_FoV``: translation, quaternion linear; FoV ReLU. [..., 9]."""
    return torch.cat([enc[..., :7], F.relu(enc[..., 7:])], dim=-1)


def activate_head(out: torch.Tensor, activation: str, conf_activation: str = "expp1"):
    """DPT output [N, C, H, W] -> (values [N, H, W, C-1], confidence [N, H, W]).

    activation: ``exp`` (depth), ``inv_log`` (points), ``linear``; confidence ``expp1`` = 1 + exp(c).
    """
    fmap = out.permute(0, 2, 3, 1)
    val, conf = fmap[..., :-1], fmap[..., -1]
    if activation == "exp":
        val = torch.exp(val)
    elif activation == "inv_log":
        val = inverse_log_transform(val)
    elif activation != "linear":
        raise ValueError(f"activation={activation!r}; expected 'exp', 'inv_log' or 'linear'")
    if conf_activation != "expp1":
        raise ValueError(f"conf_activation={conf_activation!r}; only 'expp1' is implemented")
    return val, 1 + conf.exp()


# ----------------------------------------------------------------------------- camera head
class CameraHead(nn.Module):
    """Camera head: last-layer camera tokens [B, S, 2C] -> 4 refined pose encodings [B, S, 9].

    Each iteration embeds the current pose (``empty_pose_tokens`` first, then the
    detached running prediction), modulates the normalised tokens with adaLN
    (shift, scale, gate from ``poseLN_modulation``), runs the ``trunk`` (attention
    across the S camera tokens) and adds ``pose_branch``'s delta to the running pose.
    Its activations are a few [B, S, 2C] tensors (one token per frame: 8 MB per tensor
    at 1000 frames in FP32), so it runs over all frames at once; the trunk's attention
    needs them together anyway.
    """

    def __init__(self, dim_in: int = 2048, trunk_depth: int = 4, num_heads: int = 16, mlp_ratio: float = 4.0,
                 init_values: float = 0.01, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.target_dim = 9
        self.trunk = nn.Sequential(*(Block(dim_in, num_heads, mlp_ratio, init_values, attn_mode=attn_mode)
                                     for _ in range(trunk_depth)))
        self.token_norm = nn.LayerNorm(dim_in)
        self.trunk_norm = nn.LayerNorm(dim_in)
        self.empty_pose_tokens = nn.Parameter(torch.zeros(1, 1, self.target_dim))
        self.embed_pose = nn.Linear(self.target_dim, dim_in)
        self.poseLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim_in, 3 * dim_in))
        self.adaln_norm = nn.LayerNorm(dim_in, elementwise_affine=False, eps=1e-6)
        self.pose_branch = Mlp(dim_in, dim_in // 2, self.target_dim)

    def forward(self, tokens_list: list, num_iterations: int = 4) -> list[torch.Tensor]:
        """tokens_list[-1] [B, S, P, 2C] -> list of ``num_iterations`` pose encodings [B, S, 9] (FP32)."""
        tokens = self.token_norm(_fp32(tokens_list[-1][:, :, 0]))
        B, S, _ = tokens.shape
        pred = None
        preds = []
        for _ in range(num_iterations):
            cond = self.empty_pose_tokens.expand(B, S, -1) if pred is None else pred.detach()
            shift, scale, gate = self.poseLN_modulation(self.embed_pose(cond)).chunk(3, dim=-1)
            x = gate * (self.adaln_norm(tokens) * (1 + scale) + shift) + tokens
            for blk in self.trunk:
                x = blk(x)
            delta = _fp32(self.pose_branch(self.trunk_norm(x)))  # the running pose stays FP32 (half heads)
            pred = delta if pred is None else pred + delta
            preds.append(activate_pose(pred))
        return preds


# ----------------------------------------------------------------------------- DPT head
def _uv_grid(w: int, h: int, aspect: float, dtype, device) -> torch.Tensor:
    """[h, w, 2] normalised view-plane UV (MoGe): corners at +-(w, h)/diagonal, pixel centres."""
    span_x = aspect / (1 + aspect ** 2) ** 0.5
    span_y = 1 / (1 + aspect ** 2) ** 0.5
    u = torch.linspace(-span_x * (w - 1) / w, span_x * (w - 1) / w, w, dtype=dtype, device=device)
    v = torch.linspace(-span_y * (h - 1) / h, span_y * (h - 1) / h, h, dtype=dtype, device=device)
    vv, uu = torch.meshgrid(v, u, indexing="ij")
    return torch.stack([uu, vv], dim=-1)


def _sincos(dim: int, pos: torch.Tensor, omega_0: float) -> torch.Tensor:
    """[M] -> [M, dim] = (sin | cos) of pos * omega_0^(-i/(dim/2)), computed in float64, returned FP32."""
    omega = torch.arange(dim // 2, dtype=torch.float64, device=pos.device) / (dim / 2.0)
    out = pos.reshape(-1).double()[:, None] * (1.0 / omega_0 ** omega)[None]
    return torch.cat([out.sin(), out.cos()], dim=1).float()


def _uv_embed(x: torch.Tensor, W: int, H: int, ratio: float = 0.1) -> torch.Tensor:
    """x [N, C, h, w] + ratio * sin/cos embedding of the UV grid (x half, then y half, base 100)."""
    N, C, h, w = x.shape
    uv = _uv_grid(w, h, W / H, x.dtype, x.device).reshape(-1, 2)
    emb = torch.cat([_sincos(C // 2, uv[:, 0], 100.0), _sincos(C // 2, uv[:, 1], 100.0)], dim=-1)
    emb = emb.to(x.dtype).reshape(h, w, C).permute(2, 0, 1)[None] * ratio
    return x + emb


def _interpolate(x: torch.Tensor, size) -> torch.Tensor:
    """Bilinear, align_corners=True, split along the batch when the output passes int32 indexing."""
    limit = 1_610_612_736
    n = size[0] * size[1] * x.shape[0] * x.shape[1]
    if n > limit:
        return torch.cat([F.interpolate(c, size=size, mode="bilinear", align_corners=True)
                          for c in x.chunk(n // limit + 1, dim=0)], dim=0)
    return F.interpolate(x, size=size, mode="bilinear", align_corners=True)


class ResidualConvUnit(nn.Module):
    """``r = relu(x); r + conv2(relu(conv1(r)))`` (the official unit's in-place ReLU also rectifies the skip)."""

    def __init__(self, features: int):
        super().__init__()
        self.conv1 = nn.Conv2d(features, features, 3, padding=1)
        self.conv2 = nn.Conv2d(features, features, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(x)
        return x + self.conv2(F.relu(self.conv1(x)))


class FusionBlock(nn.Module):
    """DPT fusion: ``out_conv(upsample(rcu2(x + rcu1(skip))))``; refinenet4 has no skip unit."""

    def __init__(self, features: int, has_residual: bool = True):
        super().__init__()
        self.out_conv = nn.Conv2d(features, features, 1)
        if has_residual:
            self.resConfUnit1 = ResidualConvUnit(features)
        self.has_residual = has_residual
        self.resConfUnit2 = ResidualConvUnit(features)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None, size=None) -> torch.Tensor:
        if self.has_residual:
            x = x + self.resConfUnit1(skip)
        x = self.resConfUnit2(x)
        size = size if size is not None else (x.shape[-2] * 2, x.shape[-1] * 2)
        return self.out_conv(_interpolate(x, size))


class DPTHead(nn.Module):
    """DPT head over 4 aggregator layers: tokens -> dense map at (H / down_ratio, W / down_ratio).

    Args:
        dim_in: token width (2C).
        patch_size: 14.
        output_dim: channels before activation (depth 2, points 4); the last one is confidence.
        activation: ``exp`` (depth) or ``inv_log`` (points).
        features: fusion width (256; track feature extractor 128).
        out_channels: per-layer projection widths (256, 512, 1024, 1024).
        intermediate_layer_idx: aggregator layers used (4, 11, 17, 23).
        pos_embed: add the UV sin/cos embedding (ratio 0.1).
        feature_only: return features [B, S, features, H/d, W/d] (track head) instead of (values, conf).
        down_ratio: output downsampling (track head: 2).
        frames_chunk_size: frames per chunk (8) to bound memory.

    Attribute ``grad_checkpointing`` (False): when autograd records, run each frame chunk under
    activation checkpointing (:func:`~visionattn.models.layers.checkpointed`): the forward keeps
    only the chunk's output, backward recomputes the chunk (its full-resolution feature maps
    are the head's largest activations).
    """

    grad_checkpointing: bool = False

    def __init__(self, dim_in: int, patch_size: int = 14, output_dim: int = 4, activation: str = "inv_log",
                 features: int = 256, out_channels=(256, 512, 1024, 1024), intermediate_layer_idx=(4, 11, 17, 23),
                 pos_embed: bool = True, feature_only: bool = False, down_ratio: int = 1,
                 frames_chunk_size: int | None = 8):
        super().__init__()
        self.patch_size = patch_size
        self.activation = activation
        self.intermediate_layer_idx = tuple(intermediate_layer_idx)
        self.pos_embed = pos_embed
        self.feature_only = feature_only
        self.down_ratio = down_ratio
        self.frames_chunk_size = frames_chunk_size
        oc = list(out_channels)
        self.norm = nn.LayerNorm(dim_in)
        self.projects = nn.ModuleList(nn.Conv2d(dim_in, c, 1) for c in oc)
        self.resize_layers = nn.ModuleList([
            nn.ConvTranspose2d(oc[0], oc[0], kernel_size=4, stride=4),
            nn.ConvTranspose2d(oc[1], oc[1], kernel_size=2, stride=2),
            nn.Identity(),
            nn.Conv2d(oc[3], oc[3], kernel_size=3, stride=2, padding=1),
        ])
        self.scratch = nn.Module()
        for i, c in enumerate(oc, start=1):
            setattr(self.scratch, f"layer{i}_rn", nn.Conv2d(c, features, 3, padding=1, bias=False))
        self.scratch.refinenet1 = FusionBlock(features)
        self.scratch.refinenet2 = FusionBlock(features)
        self.scratch.refinenet3 = FusionBlock(features)
        self.scratch.refinenet4 = FusionBlock(features, has_residual=False)
        if feature_only:
            self.scratch.output_conv1 = nn.Conv2d(features, features, 3, padding=1)
        else:
            self.scratch.output_conv1 = nn.Conv2d(features, features // 2, 3, padding=1)
            self.scratch.output_conv2 = nn.Sequential(nn.Conv2d(features // 2, 32, 3, padding=1), nn.ReLU(),
                                                      nn.Conv2d(32, output_dim, 1))

    def forward(self, tokens_list: list, images: torch.Tensor, patch_start_idx: int):
        """tokens_list: aggregator outputs [B, S, P, 2C]; images [B, S, 3, H, W].

        Returns:
            feature_only: [B, S, features, H/d, W/d]; else (values [B, S, H, W, output_dim-1], conf [B, S, H, W]).
        """
        S = images.shape[1]
        step = self.frames_chunk_size or S
        # the layers this head reads, taken out of the caller's list (which drops entries after the last
        # reader, before a checkpointed chunk is recomputed in backward)
        layers = tuple(tokens_list[i] for i in self.intermediate_layer_idx)
        if step >= S:
            return self._chunk(layers, images, patch_start_idx, 0, S)
        outs = None  # preallocated full outputs; each chunk is written in (no list of parts + concatenation)
        for s0 in range(0, S, step):
            part = self._chunk(layers, images, patch_start_idx, s0, min(s0 + step, S))
            part = (part,) if self.feature_only else part
            if outs is None:
                outs = tuple(p.new_empty(p.shape[:1] + (S,) + p.shape[2:]) for p in part)
            for o, p in zip(outs, part):
                o[:, s0:s0 + step] = p
            del part
        return outs[0] if self.feature_only else outs

    def _chunk(self, layers, images, patch_start_idx, s0, s1):
        """Frames s0:s1 of the head's output, checkpointed when ``grad_checkpointing`` is set."""
        return checkpointed(self._forward, layers, images, patch_start_idx, s0, s1, enabled=self.grad_checkpointing)

    def _forward(self, layers, images, patch_start_idx, s0, s1):
        """layers: the ``intermediate_layer_idx`` outputs [B, S, P, 2C], in that order."""
        B, _, _, H, W = images.shape
        S = s1 - s0
        ph, pw = H // self.patch_size, W // self.patch_size
        feats = []
        for j, tokens in enumerate(layers):
            x = _fp32(tokens[:, s0:s1, patch_start_idx:])
            x = self.norm(x.reshape(B * S, ph * pw, -1))
            x = x.permute(0, 2, 1).reshape(B * S, -1, ph, pw)
            x = self.projects[j](x)
            if self.pos_embed:
                x = _uv_embed(x, W, H)
            feats.append(self.resize_layers[j](x))
        l1, l2, l3, l4 = (getattr(self.scratch, f"layer{i + 1}_rn")(f) for i, f in enumerate(feats))
        del feats
        out = self.scratch.refinenet4(l4, size=l3.shape[2:])
        out = self.scratch.refinenet3(out, l3, size=l2.shape[2:])
        out = self.scratch.refinenet2(out, l2, size=l1.shape[2:])
        out = self.scratch.refinenet1(out, l1)
        out = self.scratch.output_conv1(out)
        scale = self.patch_size / self.down_ratio
        out = _interpolate(out, (int(ph * scale), int(pw * scale)))
        if self.pos_embed:
            out = _uv_embed(out, W, H)
        if self.feature_only:
            return out.reshape(B, S, *out.shape[1:])
        val, conf = activate_head(_fp32(self.scratch.output_conv2(out)), self.activation)  # FP32 activations
        return val.reshape(B, S, *val.shape[1:]), conf.reshape(B, S, *conf.shape[1:])


# ----------------------------------------------------------------------------- track head
def _grid_sample_px(inp: torch.Tensor, coords: torch.Tensor, padding_mode: str) -> torch.Tensor:
    """grid_sample with pixel coordinates (x, y), align_corners=True. inp [N, C, H, W], coords [N, h, w, 2]."""
    H, W = inp.shape[-2:]
    scale = torch.tensor([2 / max(W - 1, 1), 2 / max(H - 1, 1)], device=coords.device, dtype=coords.dtype)
    return F.grid_sample(inp, coords * scale - 1, align_corners=True, padding_mode=padding_mode)


def _sample_points(fmap: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """Bilinear features at points (border padding): fmap [B, C, H, W], coords [B, N, 2] (x, y) -> [B, N, C]."""
    return _grid_sample_px(fmap, coords[:, :, None], "border")[..., 0].permute(0, 2, 1)


def _sincos_2d_grid(dim: int, h: int, w: int, device) -> torch.Tensor:
    """[1, dim, h, w] sin/cos embedding of the integer grid (x half then y half, base 10000)."""
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                            indexing="ij")
    emb = torch.cat([_sincos(dim // 2, xs, 10000.0), _sincos(dim // 2, ys, 10000.0)], dim=-1)
    return emb.reshape(1, h, w, dim).permute(0, 3, 1, 2).to(device)


def _flow_embed(xy: torch.Tensor, C: int) -> torch.Tensor:
    """[..., 2] -> [..., 2C]: interleaved sin/cos of x then y with frequencies arange(0, C, 2) * 1000 / C."""
    freq = torch.arange(0, C, 2, device=xy.device, dtype=torch.float32) * (1000.0 / C)
    out = []
    for a in (xy[..., 0:1], xy[..., 1:2]):
        ang = a * freq
        out.append(torch.stack([ang.sin(), ang.cos()], dim=-1).reshape(*ang.shape[:-1], C))
    return torch.cat(out, dim=-1)


class UpdateFormer(nn.Module):
    """CoTracker-style update transformer: time attention per track, space attention via virtual tracks.

    forward: [B, N, T, input_dim] -> [B, N, T, output_dim].
    """

    def __init__(self, depth: int = 6, input_dim: int = 388, hidden_size: int = 384, num_heads: int = 8,
                 output_dim: int = 130, mlp_ratio: float = 4.0, num_virtual_tracks: int = 64,
                 attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.num_virtual_tracks = num_virtual_tracks
        self.virual_tracks = nn.Parameter(randn_scaled(1, num_virtual_tracks, 1, hidden_size))  # sic (checkpoint)
        self.input_norm = nn.LayerNorm(input_dim)
        self.input_transform = nn.Linear(input_dim, hidden_size)
        self.output_norm = nn.LayerNorm(hidden_size)
        self.flow_head = nn.Linear(hidden_size, output_dim)
        def mk(cls):
            return nn.ModuleList(cls(hidden_size, num_heads, mlp_ratio, attn_mode) for _ in range(depth))

        self.time_blocks = mk(AttnBlock)
        self.space_virtual_blocks = mk(AttnBlock)
        self.space_point2virtual_blocks = mk(CrossAttnBlock)
        self.space_virtual2point_blocks = mk(CrossAttnBlock)
        trunc_normal_(self.flow_head.weight, std=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.input_transform(self.input_norm(x))
        init = tokens
        B, _, T, C = tokens.shape
        V = self.num_virtual_tracks
        tokens = torch.cat([tokens, self.virual_tracks.repeat(B, 1, T, 1).to(tokens.dtype)], dim=1)
        N = tokens.shape[1]
        every = len(self.time_blocks) // len(self.space_virtual_blocks)
        j = 0
        for i, tblk in enumerate(self.time_blocks):
            tokens = tblk(tokens.reshape(B * N, T, C)).reshape(B, N, T, C)
            if i % every == 0:
                sp = tokens.permute(0, 2, 1, 3).reshape(B * T, N, C)
                pts, virt = sp[:, :N - V], sp[:, N - V:]
                virt = self.space_virtual2point_blocks[j](virt, pts)
                virt = self.space_virtual_blocks[j](virt)
                pts = self.space_point2virtual_blocks[j](pts, virt)
                tokens = torch.cat([pts, virt], dim=1).reshape(B, T, N, C).permute(0, 2, 1, 3)
                j += 1
        tokens = tokens[:, :N - V] + init
        return self.flow_head(self.output_norm(tokens))


class Tracker(nn.Module):
    """Iterative point tracker (VGGSfM / CoTracker style) over feature maps [B, S, C, h, w].

    Correlation pyramid of ``corr_levels`` levels (2x average pooling), windows of
    radius ``corr_radius``; ``iters`` updates of coordinates and track features. The
    correlation volumes are built ``frames_chunk_size`` frames at a time (None = all).
    """

    def __init__(self, latent_dim: int = 128, stride: int = 2, corr_levels: int = 7, corr_radius: int = 4,
                 hidden_size: int = 384, depth: int = 6, num_heads: int = 8, num_virtual_tracks: int = 64,
                 max_scale: int = 518, attn_mode: str | None = AUTO_MODE, frames_chunk_size: int | None = 8):
        super().__init__()
        self.stride = stride
        self.latent_dim = latent_dim
        self.corr_levels = corr_levels
        self.corr_radius = corr_radius
        self.max_scale = max_scale
        self.transformer_dim = 3 * latent_dim + 4
        self.query_ref_token = nn.Parameter(randn_scaled(1, 2, self.transformer_dim))
        self.corr_mlp = Mlp(corr_levels * (2 * corr_radius + 1) ** 2, hidden_size, latent_dim)
        self.updateformer = UpdateFormer(depth, self.transformer_dim, hidden_size, num_heads, latent_dim + 2,
                                         num_virtual_tracks=num_virtual_tracks, attn_mode=attn_mode)
        self.fmap_norm = nn.LayerNorm(latent_dim)
        self.ffeat_norm = nn.GroupNorm(1, latent_dim)
        self.ffeat_updater = nn.Sequential(nn.Linear(latent_dim, latent_dim), nn.GELU())
        self.vis_predictor = nn.Sequential(nn.Linear(latent_dim, 1))
        self.conf_predictor = nn.Sequential(nn.Linear(latent_dim, 1))
        self.frames_chunk_size = frames_chunk_size

    def _corr(self, pyramid, feats, coords):
        """feats [B, S, N, C], coords [B, S, N, 2] (x, y) -> [B, S, N, levels * (2r+1)^2].

        Frames are independent here; ``frames_chunk_size`` frames at a time bound the
        correlation volume [B, s, N, h*w] (N query points times the level-0 feature map).
        """
        S = feats.shape[1]
        step = self.frames_chunk_size or S
        if step >= S:
            return self._corr_frames(pyramid, feats, coords)
        return torch.cat([self._corr_frames([fm[:, s0:s0 + step] for fm in pyramid], feats[:, s0:s0 + step],
                                            coords[:, s0:s0 + step]) for s0 in range(0, S, step)], dim=1)

    def _corr_frames(self, pyramid, feats, coords):
        B, S, N, C = feats.shape
        r = self.corr_radius
        d = torch.linspace(-r, r, 2 * r + 1, device=coords.device, dtype=coords.dtype)
        delta = torch.stack(torch.meshgrid(d, d, indexing="ij"), dim=-1)  # [(2r+1), (2r+1), 2], (dy, dx) order
        out = []
        for i, fm in enumerate(pyramid):
            h, w = fm.shape[-2:]
            corr = torch.matmul(feats, fm.reshape(B, S, C, h * w)) / math.sqrt(C)
            grid = coords.reshape(B * S * N, 1, 1, 2) / 2 ** i + delta[None]
            out.append(_grid_sample_px(corr.reshape(B * S * N, 1, h, w), grid, "zeros").reshape(B, S, N, -1))
        return torch.cat(out, dim=-1)

    def forward(self, query_points: torch.Tensor, fmaps: torch.Tensor, iters: int = 4):
        """query_points [B, N, 2] pixels (x, y) in frame 0; fmaps [B, S, C, h, w] at 1/stride.

        Returns:
            (list of ``iters`` tracks [B, S, N, 2] in pixels, vis [B, S, N], conf [B, S, N]) (sigmoids).
        """
        B, N, _ = query_points.shape
        _, S, C, h, w = fmaps.shape
        fmaps = self.fmap_norm(fmaps.permute(0, 1, 3, 4, 2)).permute(0, 1, 4, 2, 3)
        work = torch.promote_types(fmaps.dtype, torch.float32)  # coordinates never in half precision
        fmaps = fmaps.to(work)
        q = query_points.to(work) / float(self.stride)
        coords = q.reshape(B, 1, N, 2).repeat(1, S, 1, 1)
        query_feat = _sample_points(fmaps[:, 0], coords[:, 0])
        track_feats = query_feat[:, None].repeat(1, S, 1, 1)
        pyramid = [fmaps]
        for _ in range(self.corr_levels - 1):
            cur = pyramid[-1]
            cur = F.avg_pool2d(cur.reshape(B * S, C, *cur.shape[-2:]), 2, stride=2)
            pyramid.append(cur.reshape(B, S, C, *cur.shape[-2:]))
        pos = _sincos_2d_grid(self.transformer_dim, h, w, fmaps.device).to(work)
        pos = _sample_points(pos.expand(B, -1, -1, -1), coords[:, 0]).reshape(B * N, 1, -1)
        ref = torch.cat([self.query_ref_token[:, :1], self.query_ref_token[:, 1:].expand(-1, S - 1, -1)], dim=1)
        preds = []
        for _ in range(iters):
            coords = coords.detach()
            corr = self.corr_mlp(self._corr(pyramid, track_feats, coords).permute(0, 2, 1, 3).reshape(B * N, S, -1))
            flows = (coords - coords[:, :1]).permute(0, 2, 1, 3).reshape(B * N, S, 2)
            flow_emb = torch.cat([_flow_embed(flows, self.latent_dim // 2), flows / self.max_scale,
                                  flows / self.max_scale], dim=-1)
            feats_ = track_feats.permute(0, 2, 1, 3).reshape(B * N, S, self.latent_dim)
            x = torch.cat([flow_emb, corr, feats_], dim=2) + pos + ref
            delta = self.updateformer(x.reshape(B, N, S, -1)).reshape(B * N, S, -1)
            dfeat = delta[..., 2:].reshape(B * N * S, self.latent_dim)
            feats_ = self.ffeat_updater(self.ffeat_norm(dfeat)) + feats_.reshape(B * N * S, self.latent_dim)
            track_feats = feats_.reshape(B, N, S, self.latent_dim).permute(0, 2, 1, 3)
            coords = coords + delta[..., :2].reshape(B, N, S, 2).permute(0, 2, 1, 3)
            coords[:, 0] = q
            preds.append(coords * self.stride)
        flat = track_feats.reshape(B * S * N, self.latent_dim)
        vis = torch.sigmoid(self.vis_predictor(flat).reshape(B, S, N))
        conf = torch.sigmoid(self.conf_predictor(flat).reshape(B, S, N))
        return preds, vis, conf


class TrackHead(nn.Module):
    """Track head: DPT feature extractor (features 128, 1/2 resolution, no pos-embed) + :class:`Tracker`."""

    def __init__(self, dim_in: int, patch_size: int = 14, features: int = 128, iters: int = 4,
                 out_channels=(256, 512, 1024, 1024), intermediate_layer_idx=(4, 11, 17, 23), stride: int = 2,
                 corr_levels: int = 7, corr_radius: int = 4, hidden_size: int = 384, depth: int = 6,
                 num_heads: int = 8, num_virtual_tracks: int = 64, max_scale: int = 518,
                 frames_chunk_size: int | None = 8, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.feature_extractor = DPTHead(dim_in, patch_size, features=features, out_channels=out_channels,
                                         intermediate_layer_idx=intermediate_layer_idx, pos_embed=False,
                                         feature_only=True, down_ratio=2, frames_chunk_size=frames_chunk_size)
        self.tracker = Tracker(features, stride, corr_levels, corr_radius, hidden_size, depth, num_heads,
                               num_virtual_tracks, max_scale, attn_mode, frames_chunk_size)
        self.iters = iters

    def forward(self, tokens_list: list, images: torch.Tensor, patch_start_idx: int, query_points: torch.Tensor,
                iters: int | None = None):
        """query_points [B, N, 2] (x, y) pixels in frame 0 -> (tracks list [B, S, N, 2], vis, conf [B, S, N])."""
        fmaps = self.feature_extractor(tokens_list, images, patch_start_idx)
        return self.tracker(query_points, fmaps, iters or self.iters)
