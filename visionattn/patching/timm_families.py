"""Patchers for more timm attention families: BEiT, CaiT / XCiT class attention, MaxViT / CoAtNet,
Hiera, MViTv2 and XCiT's cross-covariance attention.

Each ``Visionattn*`` class below subclasses one timm class and overrides only ``forward``,
following timm's forward step by step and replacing only the attention core

    softmax(scale * q k^T + bias) v

by :func:`visionattn.attention` through the same dense core as :mod:`visionattn.patching.timm`
(so ``override_cores`` applies to these families too). Where timm's module has attention
dropout, training with ``attn_drop.p > 0`` runs timm's own forward (warned once).

What each family passes to the kernel:

* BEiT / BEiT-v2 (``beit.Attention``): the relative position bias [1, H, N, N] (class token
  included) plus the model's shared relative position bias when one is passed in, as ``bias``;
  the q / v bias concatenation as timm does it.
* CaiT / XCiT class attention (``cait.ClassAttn``): one query (the class token) over all N
  tokens: Nq = 1, Nk = N.
* MaxViT / CoAtNet (``maxxvit.AttentionCl``, ``maxxvit.Attention2d``): the relative position
  module's ``get_bias()`` [1, H, N, N] (RelPosBias, RelPosMlp, RelPosBiasTf) or the shared
  bias as ``bias``; Attention2d's channel-first q / k / v [B, H, D, N] are read transposed, in place.
  MaxViT's block and grid partitions of at most 64 tokens (7 x 7) run on
  :func:`visionattn.window_attention` with that bias as its ``relative_position_bias`` and one
  window per image: the same sum, with several small windows packed per program.
* Hiera (``hiera.MaskUnitAttention``): mask-unit attention is plain attention per (head, mask
  unit) pair: heads x units become the kernel's head axis ([B, H * nW, T, D]); q pooling (max
  over the q stride) is applied to q first, as timm does, so Nq = Nk / q_stride.
* MViTv2 (``mvitv2.MultiScaleAttention``): pooled q / k / v as timm computes them; the
  decomposed relative position terms depend on q, so they are computed by timm's own
  ``cal_rel_pos_type`` into a zero [B, H, Nq, Nk] tensor (zero rows / columns for the class
  token) and passed as ``bias`` — exact, at the memory cost of one logits-sized bias.
* XCiT (``xcit.XCA``): cross-covariance attention is softmax attention with the roles of
  tokens and channels swapped: q, k, v are [B, H, C', N] (C' = channels per head as the
  sequence, N tokens as the head dim), q and k L2-normalised over tokens, the per-head
  temperature folded into q and ``scale=1`` (timm's fused path). The kernels take head dims
  up to 256 (``kernels.elsa_fwd.MAX_HEAD_DIM``): for more tokens (XCiT ``p8`` at 224,
  N = 784) :func:`visionattn.attention` runs its exact PyTorch reference instead, with a
  one-time warning naming the head dim.

Left as they are (:data:`SKIPPED`, reported by :func:`visionattn.patch_model` with these reasons):

* ``cait.TalkingHeadAttn``: talking heads mix the heads' logits before the softmax and the
  probabilities after it (``proj_l``, ``proj_w``); the second mix is not a softmax of one
  head's logits, so it is not ``softmax(q k^T + bias) v`` per head.
* ``mvitv2.MultiScaleAttentionPoolFirst``: timm's own forward multiplies q by an
  untransposed k ([B, N, H, D]) and fails for every configuration tried; there is no
  working forward to reproduce.

Written against timm 1.0.29 and 1.0.31 (the forwards patched here are the same in both).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from timm.models import beit as _beit
from timm.models import cait as _cait
from timm.models import hiera as _hiera
from timm.models import maxxvit as _maxxvit
from timm.models import mvitv2 as _mvitv2
from timm.models import xcit as _xcit

from .core import PatchSpec, attention_kwargs, dropout_fallback
from .timm import _cores, _dense, _window_kwargs

# MaxViT partitions of at most this many tokens run on the window kernel (one bias [H, N, N] for all): the
# windows its forward packs several to a program and its backward runs in one fused launch
# (kernels.window_bwd.FUSED_MAX_TOKENS; not imported here, so patching needs no Triton)
WINDOW_KERNEL_MAX_TOKENS = 64

__all__ = ["PATCHES", "VisionattnBeitAttention", "VisionattnClassAttn", "VisionattnAttention2d",
           "VisionattnAttentionCl", "VisionattnMaskUnitAttention", "VisionattnMultiScaleAttention",
           "VisionattnXCA"]


# --- BEiT / BEiT-v2: timm.models.beit.Attention ------------------------------------------------------

class VisionattnBeitAttention(_beit.Attention):
    """``timm.models.beit.Attention`` whose attention core runs :func:`visionattn.attention`.

    ``forward(x [B, N, C], shared_rel_pos_bias [1, H, N, N] or None) -> [B, N, C]``; the
    module's relative position bias and the shared one are added and passed as ``bias``.
    """

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if dropout_fallback(self):
            return super().forward(x, shared_rel_pos_bias=shared_rel_pos_bias)
        B, N, _ = x.shape
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
            if getattr(self, "qkv_bias_separate", False):  # added in timm 1.0.x; absent means False, as timm
                qkv = self.qkv(x) + qkv_bias
            else:
                qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = shared_rel_pos_bias
        if self.relative_position_bias_table is not None:
            bias = self._get_rel_pos_bias() if bias is None else self._get_rel_pos_bias() + bias
        x = _dense(self, q, k, v, bias)
        x = x.transpose(1, 2).reshape(B, N, -1)
        return self.proj_drop(self.proj(x))


# --- CaiT / XCiT class attention: timm.models.cait.ClassAttn ----------------------------------------

class VisionattnClassAttn(_cait.ClassAttn):
    """``timm.models.cait.ClassAttn`` (class token attends to all tokens) running :func:`visionattn.attention`.

    ``forward(x [B, N, C]) -> [B, 1, C]``: q [B, H, 1, D] from ``x[:, 0]``, k / v [B, H, N, D].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dropout_fallback(self):
            return super().forward(x)
        B, N, C = x.shape
        D = C // self.num_heads
        q = self.q(x[:, 0]).reshape(B, 1, self.num_heads, D).transpose(1, 2)
        k = self.k(x).reshape(B, N, self.num_heads, D).transpose(1, 2)
        v = self.v(x).reshape(B, N, self.num_heads, D).transpose(1, 2)
        x_cls = _dense(self, q, k, v).transpose(1, 2).reshape(B, 1, C)
        return self.proj_drop(self.proj(x_cls))


# --- MaxViT / CoAtNet: timm.models.maxxvit.Attention2d / AttentionCl --------------------------------

def _maxxvit_bias(module, shared_rel_pos: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # Both of timm's paths use the module's own relative position bias when it has one (its forward
    # ignores shared_rel_pos) and the shared bias otherwise.
    return module.rel_pos.get_bias() if module.rel_pos is not None else shared_rel_pos


class VisionattnAttention2d(_maxxvit.Attention2d):
    """``timm.models.maxxvit.Attention2d`` (NCHW, CoAtNet) running :func:`visionattn.attention`.

    ``forward(x [B, C, H, W], shared_rel_pos [1, h, N, N] or None) -> [B, C_out, H, W]``, N = H * W;
    q / k / v [B, h, D, N] are passed transposed ([B, h, N, D] views, no copy).
    """

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        if dropout_fallback(self):
            return super().forward(x, shared_rel_pos=shared_rel_pos)
        B, _, H, W = x.shape
        if self.head_first:
            q, k, v = self.qkv(x).view(B, self.num_heads, self.dim_head * 3, -1).chunk(3, dim=2)
        else:
            q, k, v = self.qkv(x).reshape(B, 3, self.num_heads, self.dim_head, -1).unbind(1)
        x = _dense(self, q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2),
                   _maxxvit_bias(self, shared_rel_pos))
        x = x.transpose(-1, -2).reshape(B, -1, H, W)
        return self.proj_drop(self.proj(x))


class VisionattnAttentionCl(_maxxvit.AttentionCl):
    """``timm.models.maxxvit.AttentionCl`` (channels last, MaxViT) running :func:`visionattn.attention`.

    ``forward(x [B, ..., C], shared_rel_pos [1, h, N, N] or None) -> [B, ..., C_out]``, N = prod(...).
    """

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        if dropout_fallback(self):
            return super().forward(x, shared_rel_pos=shared_rel_pos)
        B = x.shape[0]
        restore_shape = x.shape[:-1]
        if self.head_first:
            q, k, v = self.qkv(x).view(B, -1, self.num_heads, self.dim_head * 3).transpose(1, 2).chunk(3, dim=3)
        else:
            q, k, v = self.qkv(x).reshape(B, -1, 3, self.num_heads, self.dim_head).transpose(1, 3).unbind(2)
        bias = _maxxvit_bias(self, shared_rel_pos)
        if q.shape[2] <= WINDOW_KERNEL_MAX_TOKENS and (bias is None or bias.dim() == 3 or bias.shape[0] == 1):
            # block / grid partitions (7 x 7 = 49 tokens): the window kernel packs several windows per
            # program where the dense kernel pads each to a full tile
            x = _cores["window"](q, k, v, relative_position_bias=bias, num_windows=1, scale=self.scale,
                                 **_window_kwargs(self))
        else:
            x = _dense(self, q, k, v, bias)
        x = x.transpose(1, 2).reshape(restore_shape + (-1,))
        return self.proj_drop(self.proj(x))


# --- Hiera: timm.models.hiera.MaskUnitAttention -----------------------------------------------------

class VisionattnMaskUnitAttention(_hiera.MaskUnitAttention):
    """``timm.models.hiera.MaskUnitAttention`` running :func:`visionattn.attention`.

    ``forward(x [B, N, C]) -> [B, N / q_stride, dim_out]``. Mask-unit attention: q [B, h, nW, T / q_stride, D],
    k / v [B, h, nW, T, D] reshaped to [B, h * nW, ., D] (one kernel head per head and mask unit);
    global attention: q [B, h, N / q_stride, D], k / v [B, h, N, D].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        heads, D = self.heads, self.head_dim
        if self.use_mask_unit_attn:
            num_windows = N // (self.q_stride * self.window_size)
            qkv = self.qkv(x).reshape(B, -1, num_windows, 3, heads, D).permute(3, 0, 4, 2, 1, 5)
            q, k, v = qkv.unbind(0)  # [B, heads, nW, T, D]
            if self.q_stride > 1:
                # timm's max pool over the q stride (see hiera.Unroll for the token order)
                q = q.view(B, heads, num_windows, self.q_stride, -1, D).amax(dim=3)
            x = _dense(self, *(t.reshape(B, heads * num_windows, -1, D) for t in (q, k, v)))
            x = x.view(B, heads, num_windows, -1, D).transpose(1, 3).reshape(B, -1, self.dim_out)
        else:
            q, k, v = self.qkv(x).reshape(B, N, 3, heads, D).permute(2, 0, 3, 1, 4).unbind(0)
            if self.q_stride > 1:
                q = q.view(B, heads, self.q_stride, -1, D).amax(dim=2)
            x = _dense(self, q, k, v).transpose(1, 2).reshape(B, -1, self.dim_out)
        return self.proj(x)


# --- MViTv2: timm.models.mvitv2.MultiScaleAttention -------------------------------------------------

def _pool(module, t: torch.Tensor, pool, norm, feat_size: List[int]):
    """timm's pooling of q, k or v [B, h, N, D] -> ([B, h, N', D], pooled feature size)."""
    size = feat_size
    if pool is not None:
        t, tok = _mvitv2.reshape_pre_pool(t, feat_size, module.has_cls_token)
        t, size = _mvitv2.reshape_post_pool(pool(t), module.num_heads, tok)
    if norm is not None:
        t = norm(t)
    return t, size


class VisionattnMultiScaleAttention(_mvitv2.MultiScaleAttention):
    """``timm.models.mvitv2.MultiScaleAttention`` running :func:`visionattn.attention`.

    ``forward(x [B, N, C], feat_size [h, w]) -> ([B, Nq, dim_out], q feature size)``. The decomposed
    relative position terms (q-dependent) reach the kernel as a [B, H, Nq, Nk] additive bias.
    """

    def forward(self, x: torch.Tensor, feat_size: List[int]):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(dim=0)
        q, q_size = _pool(self, q, self.pool_q, self.norm_q, feat_size)
        k, k_size = _pool(self, k, self.pool_k, self.norm_k, feat_size)
        v, _ = _pool(self, v, self.pool_v, self.norm_v, feat_size)
        bias = None
        if self.rel_pos_type == "spatial":
            # timm adds the terms into the logits in place; into zeros they are the bias itself
            bias = _mvitv2.cal_rel_pos_type(q.new_zeros(B, self.num_heads, q.shape[2], k.shape[2]), q,
                                            self.has_cls_token, q_size, k_size, self.rel_pos_h, self.rel_pos_w)
        x = _dense(self, q, k, v, bias)
        if self.residual_pooling:
            x = x + q
        x = x.transpose(1, 2).reshape(B, -1, self.dim_out)
        return self.proj(x), q_size


# --- XCiT: timm.models.xcit.XCA ----------------------------------------------------------------------

class VisionattnXCA(_xcit.XCA):
    """``timm.models.xcit.XCA`` (cross-covariance attention) running :func:`visionattn.attention`.

    ``forward(x [B, N, C]) -> [B, N, C]``: q, k, v [B, H, C / H, N] (channels as the sequence, tokens
    as the head dim), q and k L2-normalised over tokens, ``temperature`` [H, 1, 1] folded into q,
    ``scale=1``. Head dim N > 256 runs the PyTorch reference (warned once by :func:`visionattn.attention`).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dropout_fallback(self):
            return super().forward(x)
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 4, 1)
        q, k, v = qkv.unbind(0)
        q = F.normalize(q, dim=-1) * self.temperature
        k = F.normalize(k, dim=-1)
        x = _cores["dense"](q, k, v, scale=1.0, **attention_kwargs(self))
        x = x.permute(0, 3, 1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec("beit", _beit.Attention, VisionattnBeitAttention),
    PatchSpec("cait-class-attn", _cait.ClassAttn, VisionattnClassAttn),
    PatchSpec("coatnet", _maxxvit.Attention2d, VisionattnAttention2d),
    PatchSpec("maxvit", _maxxvit.AttentionCl, VisionattnAttentionCl),
    PatchSpec("hiera", _hiera.MaskUnitAttention, VisionattnMaskUnitAttention),
    PatchSpec("mvitv2", _mvitv2.MultiScaleAttention, VisionattnMultiScaleAttention),
    PatchSpec("xcit", _xcit.XCA, VisionattnXCA),
)

SKIPPED: dict[type, str] = {
    _cait.TalkingHeadAttn: "talking heads mix the heads' probabilities after the softmax: not one softmax per head, "
                           "so no exact attention kernel applies",
    _mvitv2.MultiScaleAttentionPoolFirst: "timm's own forward fails (q times an untransposed k); there is no "
                                          "working forward to reproduce",
}
