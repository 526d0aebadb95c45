"""Layers of π³ and Pi3X: RoPE grids, head decoders, camera / point / convolutional heads, PRoPE pose injection.

Parameter names follow the official checkpoints (github.com/yyfz/Pi3, ``yyfz233/Pi3`` and ``yyfz233/Pi3X``), so
``load_state_dict`` works key for key. Every attention goes through :func:`visionattn.models.layers.attend`
(:func:`visionattn.attention` with the module's ``visionattn_mode``, or PyTorch SDPA for ``None``); the
attention classes carry ``_visionattn_native = True`` so :meth:`Pi3.set_attn_mode` and
:func:`visionattn.patch_model` reach them.

Paper: Wang et al., "π³: Permutation-Equivariant Visual Geometry Learning", arXiv:2507.13347 (2025).
PRoPE: Li et al., "Cameras as Relative Positional Encoding" (projective positional encoding, 2025).
The convolutional head follows MoGe (Wang et al., CVPR 2025).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import AUTO_MODE, Block, LayerScale, check_attn_mode, Mlp, RopeTables, apply_rope, attend, rope_tables

__all__ = [
    "check_attn_mode", "RopeGrid", "decoder_block", "TransformerDecoder", "CrossAttention", "CrossOnlyBlock",
    "ContextOnlyTransformerDecoder", "CameraHead", "LinearPts3d", "ResidualConvBlock", "ConvHead",
    "PRoPEAttention", "PoseInjectBlock", "svd_orthogonalize", "se3_inverse", "view_plane_uv",
]


# ----------------------------------------------------------------------------- 2-D RoPE over the token grid
class RopeGrid:
    """RoPE tables of one forward: ``special`` tokens at (0, 0), then an ``h`` x ``w`` patch grid at (y+1, x+1).

    The tables are built once per head dim for one frame ([1, special + h*w, D/2]) and broadcast over the
    frames of the frame layout; :meth:`global_` repeats them over ``frames`` for the global layout
    [B, frames * (special + h*w)] (broadcast over B, no per-scene copy).

    Args:
        frames: frames per scene (N).
        h, w: patch grid (H / patch, W / patch).
        special: register tokens in front of each frame's patches (5).
        base: RoPE base frequency (100, the official ``rope100``).
        dtype: table dtype (the residual stream's: float32, or float64 for an oracle run).
        device: where the tables live.
    """

    def __init__(self, frames: int, h: int, w: int, special: int, base: float, dtype: torch.dtype, device):
        self.frames, self.h, self.w, self.special, self.base = frames, h, w, special, base
        self.dtype, self.device = dtype, device
        self._frame: dict[int, RopeTables] = {}
        self._global: dict[int, RopeTables] = {}

    def positions(self) -> torch.Tensor:
        """[1, special + h*w, 2] long (y, x) positions of one frame's tokens."""
        y, x = torch.meshgrid(torch.arange(self.h, device=self.device), torch.arange(self.w, device=self.device),
                              indexing="ij")
        patches = torch.stack([y.reshape(-1), x.reshape(-1)], dim=-1) + 1
        special = torch.zeros(self.special, 2, dtype=torch.long, device=self.device)
        return torch.cat([special, patches])[None]

    def frame(self, head_dim: int) -> RopeTables:
        """Tables for the frame layout [B*N, special + h*w] (each [1, special + h*w, head_dim / 2])."""
        if head_dim not in self._frame:
            self._frame[head_dim] = rope_tables(self.positions(), head_dim, self.base, self.dtype)
        return self._frame[head_dim]

    def global_(self, head_dim: int) -> RopeTables:
        """Tables for the global layout [B, N * (special + h*w)] (each [1, N * (special + h*w), head_dim / 2])."""
        if head_dim not in self._global:
            t = self.frame(head_dim)
            self._global[head_dim] = RopeTables(*(a.repeat(1, self.frames, 1)
                                                  for a in (t.cos_y, t.sin_y, t.cos_x, t.sin_x)))
        return self._global[head_dim]


# ----------------------------------------------------------------------------- transformer decoders
def decoder_block(dim: int, num_heads: int, mlp_ratio: float, init_values: float | None, qk_norm: bool,
                  attn_mode: str | None) -> Block:
    """A pre-norm RoPE block (LayerNorm eps 1e-6): LayerScale ``init_values``, or none for None (the head decoders).

    Returns :class:`visionattn.models.layers.Block`, whose ``ls1`` / ``ls2`` become ``nn.Identity`` without
    LayerScale, so the parameter names are the official ``BlockRope``'s.
    """
    blk = Block(dim, num_heads, mlp_ratio, 1.0 if init_values is None else init_values, qk_norm=qk_norm,
                norm_eps=1e-6, attn_mode=attn_mode)
    if init_values is None:
        blk.ls1, blk.ls2 = nn.Identity(), nn.Identity()
    return blk


class TransformerDecoder(nn.Module):
    """Frame-wise head decoder: ``linear_out(blocks(projects(x)))``, [B*N, T, in_dim] -> [B*N, T, out_dim].

    Args:
        in_dim: input width (2 x decoder width: the last two decoder layers concatenated).
        out_dim: output width (1024 for points / confidence, 512 for the camera).
        dim, depth, num_heads, mlp_ratio: 1024, 5, 16, 4 in the official heads; no LayerScale, no qk-norm.
        attn_mode: initial ``visionattn_mode``.
    """

    def __init__(self, in_dim: int, out_dim: int, dim: int = 1024, depth: int = 5, num_heads: int = 16,
                 mlp_ratio: float = 4.0, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.num_heads = num_heads
        self.projects = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(decoder_block(dim, num_heads, mlp_ratio, None, False, attn_mode)
                                    for _ in range(depth))
        self.linear_out = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, grid: RopeGrid) -> torch.Tensor:
        x = self.projects(x)
        rope = grid.frame(x.shape[-1] // self.num_heads)
        for blk in self.blocks:
            x = blk(x, rope)
        return self.linear_out(x)


class CrossAttention(nn.Module):
    """Multi-head cross-attention with separate q / k / v projections and optional RoPE on the keys.

    forward(x [B, Nq, C], context [B, Nk, C], k_rope: RopeTables over Nk or None) -> [B, Nq, C]. Queries get
    no rotation: the metric token sits at position (0, 0), where RoPE is the identity.
    """

    _visionattn_native = True

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.visionattn_mode = attn_mode

    def forward(self, x: torch.Tensor, context: torch.Tensor, k_rope: RopeTables | None = None) -> torch.Tensor:
        B, Nq, C = x.shape
        H, D = self.num_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).reshape(B, Nq, H, D).transpose(1, 2))
        k = self.k_norm(self.k_proj(context).reshape(B, -1, H, D).transpose(1, 2))
        v = self.v_proj(context).reshape(B, -1, H, D).transpose(1, 2)
        if k_rope is not None:
            k = apply_rope(k, k_rope)
        o = attend(q, k, v, self.visionattn_mode)
        return self.proj(o.transpose(1, 2).reshape(B, Nq, C))


class CrossOnlyBlock(nn.Module):
    """``x += cross_attn(norm2(x), norm_y(y)); x += mlp(norm3(x))`` (no self-attention, no LayerScale)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.norm_y = nn.LayerNorm(dim, eps=1e-6)
        self.cross_attn = CrossAttention(dim, num_heads, attn_mode=attn_mode)
        self.norm3 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, y: torch.Tensor, y_rope: RopeTables | None) -> torch.Tensor:
        x = x + self.cross_attn(self.norm2(x), self.norm_y(y), y_rope)
        return x + self.mlp(self.norm3(x))


class ContextOnlyTransformerDecoder(nn.Module):
    """Pi3X metric decoder: query tokens [B, Nq, in_dim] read a context [B, Nk, in_dim] -> [B, Nq, out_dim].

    ``projects_x`` / ``projects_y`` map both to ``dim``; ``depth`` :class:`CrossOnlyBlock`; ``linear_out``.
    Official size: in 2048, dim 512, depth 5, 8 heads, out 512.
    """

    def __init__(self, in_dim: int, out_dim: int, dim: int = 512, depth: int = 5, num_heads: int = 8,
                 mlp_ratio: float = 4.0, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.num_heads = num_heads
        self.projects_x = nn.Linear(in_dim, dim)
        self.projects_y = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(CrossOnlyBlock(dim, num_heads, mlp_ratio, attn_mode) for _ in range(depth))
        self.linear_out = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor, grid: RopeGrid) -> torch.Tensor:
        x, context = self.projects_x(x), self.projects_y(context)
        rope = grid.global_(x.shape[-1] // self.num_heads)
        for blk in self.blocks:
            x = blk(x, context, rope)
        return self.linear_out(x)


# ----------------------------------------------------------------------------- camera and point heads
def svd_orthogonalize(m: torch.Tensor) -> torch.Tensor:
    """Nearest rotation to a 3 x 3 matrix with unit-normalised rows (special orthogonal Procrustes).

    Args:
        m: [M, 9] or [M, 3, 3].

    Returns:
        [M, 3, 3] rotations (det +1): ``V diag(1, 1, det(V U^T)) U^T`` for ``normalize(m)^T = U S V^T``.
    """
    m = F.normalize(m.reshape(-1, 3, 3), p=2, dim=-1).transpose(-1, -2)
    u, _, vh = torch.linalg.svd(m)
    v = vh.transpose(-1, -2)
    det = torch.det(v @ u.transpose(-1, -2))
    return torch.cat([v[..., :2], v[..., 2:] * det[:, None, None]], dim=-1) @ u.transpose(-1, -2)


def se3_inverse(T: torch.Tensor) -> torch.Tensor:
    """Inverse of rigid transforms [..., 4, 4]: ``[R^T, -R^T t; 0, 1]``."""
    R, t = T[..., :3, :3], T[..., :3, 3:]
    Ri = R.transpose(-1, -2)
    top = torch.cat([Ri, -(Ri @ t)], dim=-1)
    bottom = torch.zeros_like(T[..., 3:, :])
    bottom[..., 3] = 1
    return torch.cat([top, bottom], dim=-2)


class _ResLinearBlock(nn.Module):
    """``x + relu(res_conv3(relu(res_conv2(relu(res_conv1(x))))))`` over channels (per token)."""

    def __init__(self, dim: int):
        super().__init__()
        self.res_conv1 = nn.Linear(dim, dim)
        self.res_conv2 = nn.Linear(dim, dim)
        self.res_conv3 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.res_conv1(x))
        y = F.relu(self.res_conv2(y))
        return x + F.relu(self.res_conv3(y))


class CameraHead(nn.Module):
    """Camera pose from one frame's patch features: [B*N, P, dim] -> [B*N, 4, 4] camera-to-world.

    Two residual MLP blocks per token, the mean over the P patches, two Linear + ReLU, then ``fc_t``
    (translation, scene units) and ``fc_rot`` (9 numbers, orthogonalised by :func:`svd_orthogonalize`).
    """

    def __init__(self, dim: int = 512):
        super().__init__()
        self.res_conv = nn.ModuleList(_ResLinearBlock(dim) for _ in range(2))
        self.more_mlps = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())
        self.fc_t = nn.Linear(dim, 3)
        self.fc_rot = nn.Linear(dim, 9)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        for blk in self.res_conv:
            feat = blk(feat)
        feat = self.more_mlps(feat.mean(dim=1))
        t, r = self.fc_t(feat), svd_orthogonalize(self.fc_rot(feat))
        pose = torch.zeros(feat.shape[0], 4, 4, dtype=feat.dtype, device=feat.device)
        pose[:, :3, :3] = r
        pose[:, :3, 3] = t
        pose[:, 3, 3] = 1
        return pose


class LinearPts3d(nn.Module):
    """π³ linear pixel head: each patch token -> a patch x patch block of ``output_dim`` values.

    forward(tokens [B*N, h*w, C], h, w) -> [B*N, h*patch, w*patch, output_dim] (pixel shuffle).
    """

    def __init__(self, patch_size: int, dim: int, output_dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Linear(dim, output_dim * patch_size ** 2)

    def forward(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        feat = self.proj(tokens).transpose(-1, -2).reshape(tokens.shape[0], -1, h, w)
        return F.pixel_shuffle(feat, self.patch_size).permute(0, 2, 3, 1)


def view_plane_uv(width: int, height: int, aspect_ratio: float, dtype: torch.dtype, device) -> torch.Tensor:
    """Pixel-centre coordinates on the image plane normalised by the half diagonal (MoGe): [height, width, 2].

    The corners are at (±ar / sqrt(1 + ar²), ±1 / sqrt(1 + ar²)) times (n - 1) / n; u grows along the width.
    """
    span_x = aspect_ratio / (1 + aspect_ratio ** 2) ** 0.5
    span_y = 1 / (1 + aspect_ratio ** 2) ** 0.5
    u = torch.linspace(-span_x * (width - 1) / width, span_x * (width - 1) / width, width, dtype=dtype, device=device)
    v = torch.linspace(-span_y * (height - 1) / height, span_y * (height - 1) / height, height, dtype=dtype,
                       device=device)
    return torch.stack([u[None, :].expand(height, width), v[:, None].expand(height, width)], dim=-1)


class ResidualConvBlock(nn.Module):
    """``x + conv(relu(gn(conv(relu(gn(x))))))`` with 3 x 3 replicate-padded convolutions (MoGe).

    GroupNorm groups: 1 on the input, ``hidden // 32`` (at least 1) on the hidden channels.
    """

    def __init__(self, channels: int, hidden: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.GroupNorm(1, channels), nn.ReLU(),
            nn.Conv2d(channels, hidden, 3, padding=1, padding_mode="replicate"),
            nn.GroupNorm(max(1, hidden // 32), hidden), nn.ReLU(),
            nn.Conv2d(hidden, channels, 3, padding=1, padding_mode="replicate"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


class ConvHead(nn.Module):
    """Pi3X convolutional head (MoGe): patch features -> full-resolution maps without the patch grid pattern.

    Three x2 upsamplers (ConvTranspose 2 x 2 + 3 x 3 conv, then residual blocks), each fed the view-plane UV
    (:func:`view_plane_uv`) as 2 extra channels; bilinear resize to H x W, UV again, then one output block per
    entry of ``dim_out`` (3 x 3 conv, ReLU, 1 x 1 conv).

    Args:
        dim_in: feature width (1024).
        dim_out: channels of each output (``[2, 1]`` points: xy and log-depth; ``[1]`` confidence).
        dim_upsample: upsampler widths ((256, 128, 64)).
        hidden_ratio, num_res_blocks, last_conv_channels: 2, 2, 32 in Pi3X.
        patch_size: image pixels per patch (14).

    forward(tokens [M, h*w, dim_in], h, w) -> list of [M, c, h*patch, w*patch] (one per ``dim_out``).
    """

    def __init__(self, dim_in: int = 1024, dim_out=(2, 1), dim_upsample=(256, 128, 64), hidden_ratio: int = 2,
                 num_res_blocks: int = 2, last_conv_channels: int = 32, patch_size: int = 14):
        super().__init__()
        self.patch_size = patch_size
        widths = [dim_in, *dim_upsample]
        self.upsample_blocks = nn.ModuleList(
            nn.Sequential(
                nn.Sequential(nn.ConvTranspose2d(cin + 2, cout, kernel_size=2, stride=2),
                              nn.Conv2d(cout, cout, 3, padding=1, padding_mode="replicate")),
                *(ResidualConvBlock(cout, hidden_ratio * cout) for _ in range(num_res_blocks)))
            for cin, cout in zip(widths[:-1], widths[1:]))
        self.output_block = nn.ModuleList(
            nn.Sequential(nn.Conv2d(widths[-1] + 2, last_conv_channels, 3, padding=1, padding_mode="replicate"),
                          nn.ReLU(), nn.Conv2d(last_conv_channels, c, 1))
            for c in dim_out)

    @staticmethod
    def _with_uv(x: torch.Tensor, aspect: float) -> torch.Tensor:
        uv = view_plane_uv(x.shape[-1], x.shape[-2], aspect, x.dtype, x.device)
        return torch.cat([x, uv.permute(2, 0, 1)[None].expand(x.shape[0], -1, -1, -1)], dim=1)

    def forward(self, tokens: torch.Tensor, h: int, w: int) -> list[torch.Tensor]:
        H, W = h * self.patch_size, w * self.patch_size
        x = tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)
        for block in self.upsample_blocks:
            x = block(self._with_uv(x, W / H))
        x = F.interpolate(x, (H, W), mode="bilinear", align_corners=False)
        x = self._with_uv(x, W / H)
        return [block(x) for block in self.output_block]


# ----------------------------------------------------------------------------- PRoPE pose injection (Pi3X)
def _rope_split(x: torch.Tensor, pos: torch.Tensor, base: float, inverse: bool) -> torch.Tensor:
    """Rotate the halves (a, b) of ``x`` [..., T, d] by angles ``pos * base^(-i / (d/2))``: (a cos + b sin,
    b cos - a sin); ``inverse`` rotates back. ``pos``: [T] positions."""
    n = x.shape[-1] // 2
    freqs = base ** (-torch.arange(n, device=x.device) / n)
    ang = pos[:, None] * freqs
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :n], x[..., n:]
    if inverse:
        return torch.cat([cos * a - sin * b, sin * a + cos * b], dim=-1)
    return torch.cat([cos * a + sin * b, cos * b - sin * a], dim=-1)


def _prope(x: torch.Tensor, mats: torch.Tensor, py: torch.Tensor, px: torch.Tensor, base: float,
           inverse: bool) -> torch.Tensor:
    """PRoPE transform of q / k / v / o [B, H, M*P, D]: channels [0, D/2) as 4-vectors times the frame's 4 x 4
    matrix ``mats`` [B, M, 4, 4]; [D/2, 3D/4) rotated by the patch column ``px`` [M*P], [3D/4, D) by the row
    ``py`` (split-half RoPE, base ``base``)."""
    B, H, T, D = x.shape
    M = mats.shape[1]
    proj, rx, ry = x.split([D // 2, D // 4, D // 4], dim=-1)
    proj = proj.reshape(B, H, M, T // M, D // 8, 4) @ mats[:, None, :, None].transpose(-1, -2)
    return torch.cat([proj.reshape(B, H, T, D // 2), _rope_split(rx, px, base, inverse),
                      _rope_split(ry, py, base, inverse)], dim=-1)


class PRoPEAttention(nn.Module):
    """Self-attention over the patch tokens of M posed frames with projective positional encoding (PRoPE, GTA form).

    With world-to-camera matrices V_m (no intrinsics): q's first half of channels is multiplied per 4-vector by
    V^T, k's and v's by V^-1, the output's by V; the other half carries a 2-D RoPE of the patch (x, y) position
    (base 100). Attention between two frames then depends on their relative pose only.

    forward(x [B, M*h*w, C], viewmats [B, M, 4, 4], h, w) -> [B, M*h*w, C]. qk-norm before the transforms.
    """

    _visionattn_native = True

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, base: float = 100.0,
                 attn_mode: str | None = AUTO_MODE):
        super().__init__()
        if dim % num_heads or (dim // num_heads) % 8:
            raise ValueError(f"dim={dim} / num_heads={num_heads} must give a head dim divisible by 8 for PRoPE")
        self.num_heads, self.head_dim, self.base = num_heads, dim // num_heads, base
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.visionattn_mode = attn_mode

    def forward(self, x: torch.Tensor, viewmats: torch.Tensor, h: int, w: int) -> torch.Tensor:
        B, T, C = x.shape
        M = viewmats.shape[1]
        q, k, v = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        py = torch.arange(h, device=x.device).repeat_interleave(w).repeat(M)
        px = torch.arange(w, device=x.device).repeat(h * M)
        inv = se3_inverse(viewmats)
        q = _prope(q, viewmats.transpose(-1, -2), py, px, self.base, False)
        k = _prope(k, inv, py, px, self.base, False)
        v = _prope(v, inv, py, px, self.base, False)
        o = _prope(attend(q, k, v, self.visionattn_mode), viewmats, py, px, self.base, True)
        return self.proj(o.transpose(1, 2).reshape(B, T, C))


class PoseInjectBlock(nn.Module):
    """Pi3X pose-injection block: ``ls1(attn(norm1(x))) + ls2(mlp(norm2(x)))`` (parallel, no residual).

    The caller adds the result to the patch tokens of the posed frames. ``poses`` are camera-to-world
    [B, M, 4, 4] (normalised, relative to the scene's first frame); the attention sees their inverses.

    forward(x [B, M*h*w, C], poses [B, M, 4, 4], h, w) -> [B, M*h*w, C].
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, init_values: float = 0.01,
                 attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = PRoPEAttention(dim, num_heads, qk_norm=True, attn_mode=attn_mode)
        self.ls1 = LayerScale(dim, init_values)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim, init_values)

    def forward(self, x: torch.Tensor, poses: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return self.ls1(self.attn(self.norm1(x), se3_inverse(poses), h, w)) + self.ls2(self.mlp(self.norm2(x)))
