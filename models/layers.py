"""Transformer layers of VGGT: attention with qk-norm and 2-D RoPE, blocks, DINOv2 patch embed.

Parameter names follow the official VGGT-1B checkpoint (facebookresearch/vggt),
so ``load_state_dict`` works key for key. Every attention call goes through
:func:`visionattn.attention` (or PyTorch SDPA when the module's
``visionattn_mode`` is ``None``); the attention classes carry the class
attribute ``_visionattn_native = True`` so :func:`visionattn.patch_model` can
switch their precision by setting ``visionattn_mode``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from visionattn.api import attention as _va_attention
from visionattn.modes import get_mode

from .merging import plan_merge

__all__ = [
    "AUTO_MODE", "DTYPE_MODES", "resolve_attn_mode", "attend", "checkpointed", "LayerScale", "Mlp", "RopeTables",
    "rope_tables", "apply_rope", "Attention", "Block", "MHAttention", "AttnBlock", "CrossAttnBlock", "PatchEmbed",
    "DinoV2", "check_attn_mode", "AttnModeMixin", "normal_", "randn_scaled",
]

AUTO_MODE = "auto"
DTYPE_MODES = ("fp32", "bf16", "fp16")
"""The modes named after the dtype they compute in: what ``"auto"`` picks from q's dtype."""
_AUTO = {get_mode(m).compute_dtype: m for m in DTYPE_MODES} | {torch.float64: "fp32"}  # float64 q: FP32 mode


def normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """``nn.init.normal_(t, std=std)``, skipped on the meta device: there is nothing to draw, and PyTorch's Python meta
    kernel of ``normal_`` imports ``torch._dynamo`` on its first use (seconds of a model load built on meta)."""
    return t if t.is_meta else nn.init.normal_(t, std=std)


def trunc_normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    """``nn.init.trunc_normal_(t, std=std)``, skipped on the meta device as :func:`normal_` (its Python meta kernels
    of ``erfinv_`` / ``mul_`` / ``clamp_`` import ``torch._dynamo`` on some PyTorch releases, 2.11 among them)."""
    return t if t.is_meta else nn.init.trunc_normal_(t, std=std)


def randn_scaled(*shape: int, scale: float = 1.0) -> torch.Tensor:
    """``torch.randn(shape) * scale`` on the current default device; on the meta device an empty tensor (as
    :func:`normal_`: no meta arithmetic)."""
    t = torch.empty(shape)
    return t if t.is_meta else torch.randn(shape) * scale


def check_attn_mode(mode: str | None) -> str | None:
    """``mode`` unchanged when it is None (PyTorch SDPA) or :data:`AUTO_MODE`, else its visionattn mode name.

    Raises:
        ValueError: an unknown mode (the message lists the valid ones).
    """
    if mode is None or mode == AUTO_MODE:
        return mode
    return get_mode(mode).name


class AttnModeMixin:
    """``set_attn_mode`` / ``attn_mode`` for a model built of visionattn's native attention modules."""

    def set_attn_mode(self, mode: str | None):
        """Set ``visionattn_mode`` of every attention module (a mode, ``"auto"`` or None = SDPA); returns self.

        Raises:
            ValueError: an unknown mode.
        """
        mode = check_attn_mode(mode)
        for m in self.modules():
            if getattr(type(m), "_visionattn_native", False):
                m.visionattn_mode = mode
        return self

    @property
    def attn_mode(self):
        """The attention mode of the first attention module (all share one unless patched per module)."""
        return next(m.visionattn_mode for m in self.modules() if getattr(type(m), "_visionattn_native", False))


def resolve_attn_mode(mode: str | None, dtype: torch.dtype) -> str | None:
    """Map the module's ``visionattn_mode`` to a concrete visionattn mode.

    ``"auto"`` follows q's dtype: float32 -> ``"fp32"``, bfloat16 -> ``"bf16"``,
    float16 -> ``"fp16"`` (so bf16 autocast runs the bf16 kernel and an FP32 model
    the FP32-accurate one). ``None`` means PyTorch SDPA; any other string is passed on.
    """
    if mode == AUTO_MODE:
        return _AUTO[dtype]
    return mode


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str | None, fn=None) -> torch.Tensor:
    """Softmax attention ``softmax(q k^T / sqrt(D)) v`` with the given precision mode.

    Under autocast, q, k, v are first cast to the autocast dtype (what SDPA does
    under autocast), so ``"auto"`` then picks the bf16 / fp16 mode.

    Args:
        q, k, v: [B, H, N, D] (any strides; views are passed on without copies).
        mode: a visionattn mode, ``"auto"``, or ``None`` for
            ``torch.nn.functional.scaled_dot_product_attention``.
        fn: None, or ``fn(q, k, v, mode=...)`` called instead of :func:`visionattn.attention` with a
            visionattn mode (for ``None``, the one ``"auto"`` picks): the hook through which
            :func:`~visionattn.models.context_parallel.split_frames` makes attention context-parallel.

    Returns:
        [B, H, Nq, D] in q's dtype.
    """
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        # as SDPA under autocast: q, k (fp32 after qk-norm) and v (autocast dtype) meet in the autocast dtype
        dt = torch.get_autocast_dtype(dev)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    mode = resolve_attn_mode(mode, q.dtype)
    if fn is not None:
        return fn(q, k, v, mode=mode or _AUTO[q.dtype])
    if mode is None:
        return F.scaled_dot_product_attention(q, k, v)
    return _va_attention(q, k, v, mode=mode)


def checkpointed(fn, *args, enabled: bool):
    """``fn(*args)``, under activation checkpointing when ``enabled`` and autograd is recording.

    Checkpointing is ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``: the
    forward keeps only ``args`` (what they reference stays alive until backward) and backward
    recomputes ``fn`` with the autocast and RNG state of the first run, so gradients equal the
    plain run's. ``args`` are passed by reference to the recomputation: the caller must not mutate
    them (a list it empties later, say) before backward. With grad disabled (``torch.no_grad``,
    ``torch.inference_mode``) nothing is recorded and ``fn`` runs plainly.
    """
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class LayerScale(nn.Module):
    """Per-channel scale ``x * gamma`` (CaiT); ``gamma`` [dim] initialised to ``init_values``."""

    def __init__(self, dim: int, init_values: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Mlp(nn.Module):
    """``fc2(GELU(fc1(x)))`` (exact GELU), [..., in] -> [..., out]."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None):
        super().__init__()
        hidden_features = hidden_features or in_features
        out_features = out_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


# ----------------------------------------------------------------------------- 2-D RoPE
class RopeTables:
    """cos/sin of the 2-D rotary embedding gathered at each token's (y, x) position.

    ``cos_y, sin_y, cos_x, sin_x``: [B', N, D/2] each, for a token layout [B', N]
    (frame layout B*S x P). :meth:`view` reshapes them to another layout of the
    same tokens (global layout B x S*P) without copying.
    """

    def __init__(self, cos_y, sin_y, cos_x, sin_x):
        self.cos_y, self.sin_y, self.cos_x, self.sin_x = cos_y, sin_y, cos_x, sin_x

    def view(self, b: int, n: int) -> "RopeTables":
        return RopeTables(*(t.reshape(b, n, t.shape[-1]) for t in (self.cos_y, self.sin_y, self.cos_x, self.sin_x)))


def rope_tables(pos: torch.Tensor, head_dim: int, base: float = 100.0, dtype=torch.float32) -> RopeTables:
    """Build the 2-D RoPE tables for integer positions.

    The head dim is split in halves: the first half is rotated by the y
    coordinate, the second by x. Within a half of size d, ``inv_freq =
    base^(-arange(0, d, 2) / d)`` and the angles are concatenated with themselves
    (rotate-half convention, not interleaved) -- VGGT's RotaryPositionEmbedding2D.

    Args:
        pos: [B', N, 2] integer (y, x) positions (long).
        head_dim: D, divisible by 4.
        base: RoPE base frequency (100 in VGGT).
        dtype: dtype of the tables (the q/k dtype).

    Returns:
        :class:`RopeTables` with [B', N, D/2] tensors.
    """
    if head_dim % 4:
        raise ValueError(f"head_dim={head_dim} must be divisible by 4 for 2-D RoPE")
    d = head_dim // 2
    n_pos = int(pos.max()) + 1 if pos.numel() else 1
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d))
    ang = torch.arange(n_pos, device=pos.device, dtype=torch.float32)[:, None] * inv_freq[None]
    ang = torch.cat([ang, ang], dim=-1).to(dtype)
    cos, sin = ang.cos(), ang.sin()
    return RopeTables(cos[pos[..., 0]], sin[pos[..., 0]], cos[pos[..., 1]], sin[pos[..., 1]])


def _rotate_1d(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = t.shape[-1] // 2
    rot = torch.cat([-t[..., h:], t[..., :h]], dim=-1)
    return t * cos + rot * sin


def apply_rope(t: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate q or k [B, H, N, D] by the tables of :func:`rope_tables` ([B, N, D/2])."""
    d, dt = t.shape[-1] // 2, t.dtype
    y = _rotate_1d(t[..., :d], rope.cos_y[:, None].to(dt), rope.sin_y[:, None].to(dt))
    x = _rotate_1d(t[..., d:], rope.cos_x[:, None].to(dt), rope.sin_x[:, None].to(dt))
    return torch.cat([y, x], dim=-1)


# ----------------------------------------------------------------------------- attention + blocks
class Attention(nn.Module):
    """Multi-head self-attention with optional qk-norm and 2-D RoPE ([B, N, C] -> [B, N, C]).

    ``qkv`` linear -> [B, N, 3, H, D] -> q, k, v views [B, H, N, D] -> LayerNorm of
    q and k over D (qk-norm) -> RoPE -> softmax attention (default scale) ->
    merge heads -> ``proj``. With a FastVGGT merge plan (``plan``), q, k, v are
    merged after RoPE, attention runs over the merged set and the projected
    output is copied back to all N tokens (see :mod:`visionattn.models.merging`).
    Attribute ``attend_fn`` (None): the ``fn`` of :func:`attend` (context parallelism).
    """

    _visionattn_native = True
    attend_fn = None

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.visionattn_mode = attn_mode

    def forward(self, x: torch.Tensor, rope: RopeTables | None = None, plan=None) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        # q, then k, is normed, rotated and cast to the autocast dtype, one at a time: CUDA autocast runs the
        # qk-norm, and so the rotation, in FP32, and holding both FP32 q and k through the rotations and the
        # attention sets the peak of π³'s decoder blocks. The cast is the one attend() makes, so the values are
        # the same. With a merge plan the cast stays in attend(), after the merge's FP32 averages.
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if plan is None and torch.is_autocast_enabled(dev) else None
        q = self._norm_rope(q, self.q_norm, rope, dt)
        k = self._norm_rope(k, self.k_norm, rope, dt)
        if plan is not None:
            q, k, v = plan.merge(q), plan.merge(k), plan.merge(v)
        o = attend(q, k, v, self.visionattn_mode, self.attend_fn)
        del q, k, v, qkv
        o = self.proj(o.transpose(1, 2).reshape(B, o.shape[2], C))
        if plan is not None:
            o = plan.unmerge(o)
        return o

    @staticmethod
    def _norm_rope(t: torch.Tensor, norm: nn.Module, rope: RopeTables | None, dt: torch.dtype | None) -> torch.Tensor:
        """``norm`` then the rotation of q or k [B, H, N, D], cast to ``dt`` (None: left as it is)."""
        t = norm(t)
        if rope is not None:
            t = apply_rope(t, rope)
        return t if dt is None else t.to(dt)


class Block(nn.Module):
    """Pre-norm transformer block: ``x += ls1(attn(norm1(x))); x += ls2(mlp(norm2(x)))``.

    Args:
        dim, num_heads, mlp_ratio: width, heads, MLP hidden = dim * mlp_ratio.
        init_values: LayerScale init (1.0 DINOv2, 0.01 VGGT aggregator / camera head).
        qk_norm: LayerNorm q and k per head.
        norm_eps: LayerNorm eps (1e-6 DINOv2, 1e-5 VGGT).
        attn_mode: initial ``visionattn_mode`` of the attention.

    Attribute ``tokens_chunk_size`` (None = off): with grad disabled, the MLP half runs over
    at most this many of the B*N token rows at a time and adds its output into the
    attention half's result in place, so the MLP hidden activations [rows, mlp_ratio * dim]
    stay bounded (2 x 3.4 GB at 200 VGGT frames in FP32 otherwise). Rows are independent,
    so the result equals the unchunked block to FP rounding: a GEMM over another row count
    may block its K reduction differently (CPU and CUDA alike), so it is not bit for bit.
    """

    tokens_chunk_size: int | None = None

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, init_values: float = 0.01,
                 qk_norm: bool = False, norm_eps: float = 1e-5, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qk_norm=qk_norm, attn_mode=attn_mode)
        self.ls1 = LayerScale(dim, init_values)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim, init_values)

    def forward(self, x: torch.Tensor, rope: RopeTables | None = None, merging=None, grid=None) -> torch.Tensor:
        """x [B, N, C] -> [B, N, C]; ``merging`` (a TokenMerging) with ``grid`` = (S, h, w) enables FastVGGT."""
        h = self.norm1(x)
        plan = None
        if merging is not None:
            plan = plan_merge(h, *grid, merging)
        x = x + self.ls1(self.attn(h, rope, plan))
        del h, plan
        step = self.tokens_chunk_size
        if not step or x.shape[0] * x.shape[1] <= step or torch.is_grad_enabled():
            return x + self.ls2(self.mlp(self.norm2(x)))
        flat = x.view(-1, x.shape[-1])  # x is this block's own fresh sum: safe to update in place
        for i in range(0, flat.shape[0], step):
            part = flat[i:i + step]
            y = self.ls2(self.mlp(self.norm2(part)))
            if torch.promote_types(part.dtype, y.dtype) != part.dtype:  # x + y would widen x: no in-place
                return torch.cat([flat[:i], part + y] + [r + self.ls2(self.mlp(self.norm2(r)))
                                                           for r in flat[i + step:].split(step)]).view_as(x)
            part += y
        return x


class MHAttention(nn.Module):
    """Multi-head attention with the parameter names of ``torch.nn.MultiheadAttention``.

    (``in_proj_weight`` [3C, C], ``in_proj_bias`` [3C], ``out_proj``), batch-first,
    no masks, computed through :func:`visionattn.attention`. Used by the track
    head's update transformer (CoTracker style).
    """

    _visionattn_native = True

    def __init__(self, embed_dim: int, num_heads: int, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        nn.init.xavier_uniform_(self.in_proj_weight)
        self.visionattn_mode = attn_mode

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, Nq, C], context [B, Nk, C] (default x) -> [B, Nq, C]."""
        B, Nq, C = x.shape
        H, D = self.num_heads, C // self.num_heads
        if context is None:
            q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).reshape(B, Nq, 3, H, D).permute(
                2, 0, 3, 1, 4).unbind(0)
        else:
            wq, wkv = self.in_proj_weight.split([C, 2 * C])
            bq, bkv = self.in_proj_bias.split([C, 2 * C])
            q = F.linear(x, wq, bq).reshape(B, Nq, H, D).transpose(1, 2)
            k, v = F.linear(context, wkv, bkv).reshape(B, -1, 2, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        o = attend(q, k, v, self.visionattn_mode)
        return self.out_proj(o.transpose(1, 2).reshape(B, Nq, C))


class AttnBlock(nn.Module):
    """CoTracker self-attention block: ``x = norm1(x); x += attn(x); x += mlp(norm2(x))``.

    (The residual starts from the normalised input, as in the official tracker.)
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn = MHAttention(dim, num_heads, attn_mode)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x)
        x = x + self.attn(x)
        return x + self.mlp(self.norm2(x))


class CrossAttnBlock(nn.Module):
    """CoTracker cross-attention block: ``x = norm1(x); x += attn(x, norm_context(c)); x += mlp(norm2(x))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.norm_context = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.cross_attn = MHAttention(dim, num_heads, attn_mode)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x)
        x = x + self.cross_attn(x, self.norm_context(context))
        return x + self.mlp(self.norm2(x))


# ----------------------------------------------------------------------------- DINOv2 patch embed
class PatchEmbed(nn.Module):
    """Conv patchify: [B, 3, H, W] -> [B, (H/p)(W/p), C]."""

    def __init__(self, patch_size: int, embed_dim: int, in_chans: int = 3):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class DinoV2(nn.Module):
    """DINOv2 ViT with register tokens, as VGGT's patch embed (ViT-L/14 reg4 at full size).

    Tokens: [cls, 4 registers, patches]; learned ``pos_embed`` [1, 1 + M*M, C]
    (M = img_size / patch_size, 37 for 518) added to cls + patches before the
    registers are inserted, bicubically interpolated (antialias, by output size)
    when the patch grid is not M x M. Blocks: LayerNorm eps 1e-6, LayerScale,
    no qk-norm, no RoPE. ``mask_token`` is unused at inference (kept for the checkpoint).

    Attribute ``grad_checkpointing`` (False): run each block under :func:`checkpointed` when
    autograd records (set by :meth:`VGGT.set_grad_checkpointing`).

    forward: images [B, 3, H, W] (normalised) -> final-normed patch tokens [B, (H/p)(W/p), C].
    """

    grad_checkpointing: bool = False

    def __init__(self, img_size: int = 518, patch_size: int = 14, embed_dim: int = 1024, depth: int = 24,
                 num_heads: int = 16, mlp_ratio: float = 4.0, num_register_tokens: int = 4,
                 init_values: float = 1.0, attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.patch_size = patch_size
        self.grid = img_size // patch_size
        self.num_register_tokens = num_register_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.grid * self.grid, embed_dim))
        self.register_tokens = nn.Parameter(torch.zeros(1, num_register_tokens, embed_dim))
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim))
        self.patch_embed = PatchEmbed(patch_size, embed_dim)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, init_values, qk_norm=False,
                                          norm_eps=1e-6, attn_mode=attn_mode) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        trunc_normal_(self.pos_embed, std=0.02)
        normal_(self.cls_token, std=1e-6)
        normal_(self.register_tokens, std=1e-6)

    def interpolate_pos_embed(self, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
        """Position embedding [1, 1 + h*w, C] for an h x w patch grid (bicubic, antialias, in fp32)."""
        if h == self.grid and w == self.grid:
            return self.pos_embed.to(dtype)
        pe = self.pos_embed.float()
        C = pe.shape[-1]
        grid = pe[:, 1:].reshape(1, self.grid, self.grid, C).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(h, w), mode="bicubic", antialias=True)
        grid = grid.permute(0, 2, 3, 1).reshape(1, h * w, C)
        return torch.cat([pe[:, :1], grid], dim=1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, H, W = x.shape
        h, w = H // self.patch_size, W // self.patch_size
        t = self.patch_embed(x)
        # cat promotes (under autocast the bf16 patch tokens meet the fp32 cls token: the stream stays fp32,
        # as in DINOv2)
        t = torch.cat([self.cls_token.expand(B, -1, -1), t], dim=1)
        t = t + self.interpolate_pos_embed(h, w, t.dtype)
        t = torch.cat([t[:, :1], self.register_tokens.expand(B, -1, -1), t[:, 1:]], dim=1)
        for blk in self.blocks:
            t = checkpointed(blk, t, enabled=self.grad_checkpointing)
        return self.norm(t)[:, 1 + self.num_register_tokens:]

