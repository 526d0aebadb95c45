"""Patchers for timm attention modules: one module-level subclass per exact class.

Each ``Visionattn*`` class below subclasses one timm class and overrides only
``forward``; :func:`visionattn.patch_model` swaps an instance's ``__class__`` to
it (see :mod:`visionattn.patching.core`). The forwards follow timm's own
forwards step by step (projections, q/k norm, rope, gate, output norm,
projection, dropout) and replace only the attention core

    softmax(scale * q k^T + bias, masked) v

by :func:`visionattn.attention` (dense: ViT / DeiT / EVA / rope models) or
:func:`visionattn.window_attention` (Swin, Swin-v2: relative position bias
[H, N, N] and shift mask [nW, N, N] passed separately, never expanded).

Semantics kept from timm: the module's ``scale``; ``attn_mask`` (bool = keep
mask, float = additive bias) and ``is_causal``; ``q_norm`` / ``k_norm``; rope on
non-prefix tokens; grouped-query K/V heads; the output gate and ``norm``; while
training with ``attn_drop.p > 0`` the original timm forward runs (warned once),
since visionattn does not drop attention probabilities. ``fused_attn`` only
chooses between two PyTorch implementations of the same math in timm and is
left untouched (it applies again after ``unpatch_model``).

Supported timm: 1.0.17 .. 1.0.x (``timm.layers.attention`` appeared in 1.0.17);
attributes added in later 1.0 releases (``gate``, ``rotate_half``, ``num_kv_heads``,
``is_causal``) are optional. Tested with 1.0.17, 1.0.29 and 1.0.31.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import Attention
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from timm.models import eva as _eva
from timm.models import swin_transformer as _swin
from timm.models import swin_transformer_v2 as _swinv2

from ..api import attention, attention_qkvpacked
from .core import PatchSpec, attention_kwargs, dropout_fallback, gathered_bias, inference_cached
from .naflex import key_padding_attention, key_padding_of

__all__ = ["PATCHES", "VisionattnAttention", "VisionattnAttentionRope", "VisionattnEvaAttention",
           "VisionattnSwinWindowAttention", "VisionattnSwinV2WindowAttention"]

from timm.layers.attention import AttentionRope


# --- the attention cores (module-level so tools/bench_models.py can time them) ---------------------

def _dense_core(q, k, v, *, bias=None, attn_mask=None, is_causal=False, scale=None, **kw):
    """q, k, v [B, H, N, D] -> [B, H, N, D] via :func:`visionattn.attention`."""
    return attention(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **kw)


def _window_core(q, k, v, **kw):
    """q, k, v [B*nW, H, N, D] -> [B*nW, H, N, D] via :func:`visionattn.window_attention`."""
    from ..window import window_attention

    return window_attention(q, k, v, **kw)


def _window(module, qkv: torch.Tensor, **kw) -> torch.Tensor:
    """Swin / Swin-v2 window attention of a patched module on ``qkv`` [B*nW, N, 3, H, D] -> [B*nW, N, H*D]: with
    gradients, :func:`visionattn.window_attention_qkvpacked` (one packed gradient in the projection's layout);
    otherwise, or while :func:`override_cores` times a stand-in, the window core on the unpacked views."""
    B_, N = qkv.shape[:2]
    kw.update(_window_kwargs(module))
    if torch.is_grad_enabled() and _cores["window"] is _window_core:
        from ..window import window_attention_qkvpacked

        return window_attention_qkvpacked(qkv, **kw).reshape(B_, N, -1)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return _cores["window"](q, k, v, **kw).transpose(1, 2).reshape(B_, N, -1)


_cores = {"dense": _dense_core, "window": _window_core}


@contextlib.contextmanager
def override_cores(dense=None, window=None):
    """Replace the attention cores of all patched timm modules for a block (benchmarking only).

    ``tools/bench_models.py`` uses it to time a model with the attention core
    replaced by a zero-cost stand-in and so measure the attention share.
    """
    previous = dict(_cores)
    if dense is not None:
        _cores["dense"] = dense
    if window is not None:
        _cores["window"] = window
    try:
        yield
    finally:
        _cores.update(previous)


def _dense(module, q, k, v, attn_mask=None, is_causal=False):
    # A padded NaFlexViT batch: the mask a patched NaFlexVit built from its patch validity runs as ragged
    # attention over the valid tokens (visionattn.patching.naflex says why and what padded rows get); not
    # while override_cores times a stand-in core.
    kp = key_padding_of(attn_mask) if _cores["dense"] is _dense_core else None
    if kp is not None and not is_causal:
        out = key_padding_attention(q, k, v, kp, scale=module.scale, **attention_kwargs(module))
        if out is not None:
            return out
    bias = mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        elif attn_mask.is_floating_point():
            bias = attn_mask  # timm / SDPA semantics: a float mask is added to the logits
        else:  # SDPA refuses it too
            raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; timm's attention takes a bool mask (True = "
                            f"attend) or a float one (added to the logits)")
    return _cores["dense"](q, k, v, bias=bias, attn_mask=mask, is_causal=is_causal, scale=module.scale,
                           **attention_kwargs(module))


def _window_kwargs(module):
    # window_attention has no split-KV (a window is one tile): num_splits does not apply.
    kw = attention_kwargs(module)
    kw.pop("num_splits", None)
    return kw


def _finish(module, x, gate):
    # Shared tail of timm's Attention / AttentionRope / EvaAttention: norm, gate, proj, dropout.
    x = module.norm(x)
    if gate is not None:
        x = x * gate
    return module.proj_drop(module.proj(x))


def _gate(module, x):
    # `gate` exists from timm 1.0.20 on; older modules have none.
    g = getattr(module, "gate", None)
    return g(x).sigmoid() if g is not None else None


def _rope(module, q, k, v, rope):
    npt = module.num_prefix_tokens
    # rotate_half (and apply_rot_embed_cat's `half`) exist from timm 1.0.20 on; as timm, absent means False.
    kw = {"half": True} if getattr(module, "rotate_half", False) else {}
    q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], rope, **kw)], dim=2).type_as(v)
    k = torch.cat([k[:, :, :npt, :], apply_rot_embed_cat(k[:, :, npt:, :], rope, **kw)], dim=2).type_as(v)
    return q, k


def _causal_kw(is_causal):
    # timm < 1.0.20 forwards have no is_causal argument; pass it only when set.
    return {"is_causal": True} if is_causal else {}


# --- ViT / DeiT / ... : timm.layers.Attention --------------------------------------------------------

class VisionattnAttention(Attention):
    """``timm.layers.Attention`` whose attention core runs :func:`visionattn.attention`.

    ``forward(x [B, N, C], attn_mask=None, is_causal=False) -> [B, N, dim_out]``.
    """

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if dropout_fallback(self):
            return super().forward(x, attn_mask=attn_mask, **_causal_kw(is_causal))
        B, N, _ = x.shape
        gate = _gate(self, x)
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, -1)
        if (attn_mask is None and qkv.requires_grad and torch.is_grad_enabled() and _cores["dense"] is _dense_core
                and isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)
                and self.visionattn_options["num_splits"] is None):
            # training: the backward writes one packed dQKV in the projection's layout (no stack, no copy)
            x = attention_qkvpacked(qkv, is_causal=is_causal, scale=self.scale, mode=self.visionattn_mode,
                                    backend=self.visionattn_options["backend"])
            return _finish(self, x.reshape(B, N, -1), gate)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = _dense(self, q, k, v, attn_mask, is_causal)
        x = x.transpose(1, 2).reshape(B, N, -1)
        return _finish(self, x, gate)


# --- rope models (PE, ...): timm.layers.AttentionRope ------------------------------------------------

class VisionattnAttentionRope(AttentionRope):
    """``timm.layers.AttentionRope`` whose attention core runs :func:`visionattn.attention`.

    ``forward(x [B, N, C], rope=None, attn_mask=None, is_causal=False) -> [B, N, dim_out]``;
    grouped-query K/V heads are repeated as timm does.
    """

    def forward(self, x, rope: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False):
        if dropout_fallback(self):
            return super().forward(x, rope=rope, attn_mask=attn_mask, **_causal_kw(is_causal))
        B, N, _ = x.shape
        gate = _gate(self, x)
        kv_heads = getattr(self, "num_kv_heads", self.num_heads)  # GQA in recent timm releases only
        if self.qkv is not None:
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
        else:
            q = self.q_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
            k = self.k_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = _rope(self, q, k, v, rope)
        if kv_heads != self.num_heads:
            groups = self.num_heads // kv_heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        x = _dense(self, q, k, v, attn_mask, is_causal)
        x = x.transpose(1, 2).reshape(B, N, -1)
        return _finish(self, x, gate)


# --- EVA / EVA-02: timm.models.eva.EvaAttention ------------------------------------------------------

class VisionattnEvaAttention(_eva.EvaAttention):
    """``timm.models.eva.EvaAttention`` whose attention core runs :func:`visionattn.attention`.

    ``forward(x [B, N, C], rope=None, attn_mask=None, is_causal=False) -> [B, N, C]``.
    """

    def forward(self, x, rope: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False):
        if dropout_fallback(self):
            return super().forward(x, rope=rope, attn_mask=attn_mask, **_causal_kw(is_causal))
        B, N, C = x.shape
        gate = _gate(self, x)
        if self.qkv is not None:
            if self.q_bias is None:
                qkv = self.qkv(x)
            else:
                qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                if self.qkv_bias_separate:
                    qkv = self.qkv(x) + qkv_bias
                else:
                    qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
            q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q = self.q_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
            k = self.k_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = _rope(self, q, k, v, rope)
        x = _dense(self, q, k, v, attn_mask, is_causal)
        x = x.transpose(1, 2).reshape(B, N, C)
        return _finish(self, x, gate)


# --- Swin: timm.models.swin_transformer.WindowAttention ---------------------------------------------

class VisionattnSwinWindowAttention(_swin.WindowAttention):
    """Swin window attention running :func:`visionattn.window_attention`.

    ``forward(x [B*nW, N, C], mask [nW, N, N] additive or None) -> [B*nW, N, C]``; the
    relative position bias [H, N, N] and the shift mask go to the kernel separately; the bias,
    gathered from its table every forward in training or with gradients, is gathered once per
    parameter state in inference (:func:`visionattn.patching.core.inference_cached`).
    """

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if dropout_fallback(self):
            return super().forward(x, mask=mask)
        B_, N, _ = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1)
        rel_bias = inference_cached(self, "rel_pos_bias", (self.relative_position_bias_table,
                                                          self.relative_position_index),
                                    lambda: self._relative_position_bias(N))
        x = _window(self, qkv, relative_position_bias=rel_bias, shift_mask=mask,
                    num_windows=1 if mask is None else int(mask.shape[0]), scale=self.scale)
        return self.proj_drop(self.proj(x))

    def _relative_position_bias(self, N: int) -> torch.Tensor:
        """timm's ``_get_rel_pos_bias()`` values as [H, N, N] (:func:`.core.gathered_bias`)."""
        return gathered_bias(self.relative_position_bias_table, self.relative_position_index, N)


# --- Swin-v2: timm.models.swin_transformer_v2.WindowAttention ----------------------------------------

class VisionattnSwinV2WindowAttention(_swinv2.WindowAttention):
    """Swin-v2 cosine window attention running :func:`visionattn.window_attention`.

    ``forward(x [B*nW, N, C], mask [nW, N, N] or None) -> [B*nW, N, C]``. The kernel
    normalizes q and k, applies ``exp(min(logit_scale, log 100))`` per head and adds the
    continuous position bias ``16 * sigmoid(cpb_mlp(...))`` [H, N, N], computed here as timm
    does: every forward in training or with gradients, once per parameter state in inference
    (:func:`visionattn.patching.core.inference_cached`).
    """

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if dropout_fallback(self):
            return super().forward(x, mask=mask)
        B_, N, C = x.shape
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            qkv_bias = inference_cached(self, "qkv_bias", (self.q_bias, self.k_bias, self.v_bias),
                                        lambda: torch.cat((self.q_bias, self.k_bias, self.v_bias)))
            if getattr(self, "qkv_bias_separate", False):  # added in timm 1.0.x
                qkv = self.qkv(x) + qkv_bias
            else:
                qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        rel_bias = inference_cached(self, "cpb_bias", (*self.cpb_mlp.parameters(), self.relative_coords_table,
                                                       self.relative_position_index),
                                    lambda: self._continuous_position_bias(N))
        x = _window(self, qkv.reshape(B_, N, 3, self.num_heads, -1), relative_position_bias=rel_bias,
                    shift_mask=mask, num_windows=1 if mask is None else int(mask.shape[0]), cosine=True,
                    logit_scale=self.logit_scale)
        return self.proj_drop(self.proj(x))

    def _continuous_position_bias(self, N: int) -> torch.Tensor:
        """``16 * sigmoid(cpb_mlp(relative_coords_table))`` gathered to [H, N, N]: timm's values (the elementwise
        ``16 * sigmoid`` taken on the [T, H] table before :func:`.core.gathered_bias`, not on the gathered copy)."""
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        return gathered_bias(16 * torch.sigmoid(table), self.relative_position_index, N)


PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec("vit", Attention, VisionattnAttention),
    PatchSpec("rope", AttentionRope, VisionattnAttentionRope),
    PatchSpec("eva", _eva.EvaAttention, VisionattnEvaAttention),
    PatchSpec("swin", _swin.WindowAttention, VisionattnSwinWindowAttention),
    PatchSpec("swinv2", _swinv2.WindowAttention, VisionattnSwinV2WindowAttention),
)
