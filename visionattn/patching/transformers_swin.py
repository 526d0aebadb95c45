"""Patchers for transformers' Swin and Swin-v2 window attention: one module-level subclass per exact class.

transformers' Swin-v2 computes its cosine window attention inline, and its Swin either inline
(``SwinSelfAttention``, early transformers 5 releases) or through the attention interface
with the relative position bias and the shift mask added into one [B*nW, H, N, N] mask
(``SwinAttention``, later releases). Each patcher below follows transformers' forward step by
step and replaces only the attention core by :func:`visionattn.window_attention`, with the
relative position bias [H, N, N] and the shift mask [nW, N, N] passed separately (never
expanded over the windows; the bias, derived from parameters alone, is kept between eager
inference forwards by :func:`visionattn.patching.core.inference_cached`):

* ``SwinAttention`` (q_proj / k_proj / v_proj / o_proj, ``relative_position_bias`` module) or,
  where transformers has it, ``SwinSelfAttention`` (query / key / value, bias table):
  ``softmax(q k^T / sqrt(d) + bias[h] + mask[w]) v``;
* ``Swinv2SelfAttention``: cosine attention with ``exp(min(logit_scale, log 100))`` per head
  and the continuous position bias ``16 * sigmoid(cpb_mlp(...))``, as
  :class:`visionattn.patching.timm.VisionattnSwinV2WindowAttention` maps timm's Swin-v2.

Where transformers' forward is asked for what visionattn does not compute, the original
forward runs (warned once): ``output_attentions=True`` (visionattn never materialises the
attention probabilities) and training with attention dropout > 0 (visionattn does not drop
probabilities). transformers 5 has no ``head_mask`` on these modules; under transformers 4
(whose forwards take one) every instance is reported as skipped.

Written against transformers 5.0 (``SwinSelfAttention``) and 5.23 (``SwinAttention``); the
Swin layout is told apart by which of the two classes ``modeling_swin`` defines.
"""
from __future__ import annotations

from typing import Optional

import torch
import transformers
from transformers.models.swin import modeling_swin as _swin
from transformers.models.swinv2 import modeling_swinv2 as _swinv2

from ..dispatch import warn_once
from ..window import window_attention
from .core import PatchSpec, attention_kwargs, gathered_bias, inference_cached

_LEGACY_SWIN = hasattr(_swin, "SwinSelfAttention")  # the layout of early transformers 5 releases

__all__ = ["PATCHES", "VisionattnSwinSelfAttention" if _LEGACY_SWIN else "VisionattnSwinAttention",
           "VisionattnSwinv2SelfAttention"]


def _original_forward_reason(module: torch.nn.Module, dropout_p: float, output_attentions: bool) -> str | None:
    """Why ``module`` must run transformers' forward for this call (None: visionattn runs it)."""
    if output_attentions:
        return "output_attentions=True asks for the attention probabilities, which visionattn does not materialise"
    if module.training and dropout_p > 0:
        return (f"training with attention dropout p={dropout_p}; visionattn does not apply dropout to attention "
                f"probabilities (call model.eval() or set attention_probs_dropout_prob=0 to use visionattn)")
    return None


def _runs_original(module: torch.nn.Module, dropout_p: float, output_attentions) -> bool:
    reason = _original_forward_reason(module, dropout_p, bool(output_attentions))
    if reason is None:
        return False
    original = type(module).__mro__[1]
    warn_once(f"transformers-swin:{original.__name__}:{reason}",
              f"visionattn: {original.__module__}.{original.__qualname__} runs transformers' own forward: {reason}")
    return True


def _window(module, q, k, v, attention_mask: Optional[torch.Tensor], **kw) -> torch.Tensor:
    """q, k, v [B*nW, H, N, D], shift mask [nW, N, N] or None -> [B*nW, H, N, D] by
    :func:`visionattn.window_attention`."""
    opts = attention_kwargs(module)
    opts.pop("num_splits", None)  # a window is one tile: window_attention has no split-KV
    return window_attention(q, k, v, shift_mask=attention_mask,
                            num_windows=1 if attention_mask is None else int(attention_mask.shape[0]), **kw, **opts)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B*nW, N, H * D] -> [B*nW, H, N, D] (a view)."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def _gathered(module, table: torch.Tensor) -> torch.Tensor:
    """The relative position bias [H, N, N] from a per-head table [(2 Wh - 1) (2 Ww - 1), H], looked up by the
    module's ``relative_position_index`` [N, N] (:func:`.core.gathered_bias`: transformers' values)."""
    return gathered_bias(table, module.relative_position_index, module.relative_position_index.shape[0])


def _inline_window(module, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   bias: torch.Tensor, **kw) -> tuple[torch.Tensor]:
    """transformers' inline window attention (``query`` / ``key`` / ``value`` layers; SwinSelfAttention,
    Swinv2SelfAttention) on :func:`visionattn.window_attention`.

    Args:
        hidden_states: [B*nW, N, C].
        attention_mask: shift mask [nW, N, N] (additive) or None.
        bias: the relative position bias [H, N, N] (:func:`_gathered`).
        **kw: ``scale`` or ``cosine`` / ``logit_scale`` for :func:`visionattn.window_attention`.

    Returns:
        ``(context [B*nW, N, C],)`` as transformers' forward returns it without attention probabilities.
    """
    q, k, v = (_heads(proj(hidden_states), module.attention_head_size)
               for proj in (module.query, module.key, module.value))
    out = _window(module, q, k, v, attention_mask, relative_position_bias=bias, **kw)
    return (out.transpose(1, 2).reshape(*hidden_states.shape[:-1], module.all_head_size),)


def _check_transformers_5(module: torch.nn.Module) -> str | None:
    if int(transformers.__version__.split(".")[0]) < 5:
        return (f"transformers {transformers.__version__}: visionattn's Swin patchers follow the transformers 5 "
                f"forwards (no head_mask); install transformers>=5.0 to patch this module")
    return None


# --- Swin (later transformers 5 releases): SwinAttention through the attention interface -----------

if not _LEGACY_SWIN:
    class VisionattnSwinAttention(_swin.SwinAttention):
        """transformers' ``SwinAttention`` running :func:`visionattn.window_attention`.

        ``forward(hidden_states [B*nW, N, C], attention_mask [nW, N, N] or None, **kwargs)
        -> (output [B*nW, N, C], None)``.
        """

        def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **kwargs):
            if _runs_original(self, self.attention_dropout, kwargs.get("output_attentions")):
                return super().forward(hidden_states, attention_mask, **kwargs)
            q, k, v = (_heads(proj(hidden_states), self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
            bias_module = self.relative_position_bias
            bias = inference_cached(self, "rel_pos_bias", (*bias_module.parameters(), *bias_module.buffers()),
                                    bias_module)
            out = _window(self, q, k, v, attention_mask, relative_position_bias=bias, scale=self.scaling)
            out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
            return self.o_proj(out), None
else:
    class VisionattnSwinSelfAttention(_swin.SwinSelfAttention):
        """transformers' ``SwinSelfAttention`` (early transformers 5) running :func:`visionattn.window_attention`;
        shapes as :class:`VisionattnSwinv2SelfAttention`, logits ``q k^T / sqrt(d) + bias[h] + mask[w]``."""

        def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                    output_attentions: Optional[bool] = False):
            if _runs_original(self, self.dropout.p, output_attentions):
                return super().forward(hidden_states, attention_mask, output_attentions)
            bias = inference_cached(self, "rel_pos_bias", (self.relative_position_bias_table,
                                                           self.relative_position_index),
                                    lambda: _gathered(self, self.relative_position_bias_table))
            return _inline_window(self, hidden_states, attention_mask, bias, scale=self.attention_head_size ** -0.5)


# --- Swin-v2: Swinv2SelfAttention (cosine attention, continuous position bias) ---------------------

class VisionattnSwinv2SelfAttention(_swinv2.Swinv2SelfAttention):
    """transformers' ``Swinv2SelfAttention`` running :func:`visionattn.window_attention` with ``cosine=True``.

    ``forward(hidden_states [B*nW, N, C], attention_mask [nW, N, N] or None, output_attentions=False)
    -> (context [B*nW, N, C],)``.
    """

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                output_attentions: Optional[bool] = False):
        if _runs_original(self, self.dropout.p, output_attentions):
            return super().forward(hidden_states, attention_mask, output_attentions)
        if attention_mask is not None:
            # transformers' forward adds the shift mask to the logits twice; the kernel gets the same sum
            attention_mask = attention_mask + attention_mask
        mlp = self.continuous_position_bias_mlp
        bias = inference_cached(self, "cpb_bias", (*mlp.parameters(), self.relative_coords_table,
                                                   self.relative_position_index), self._continuous_position_bias)
        return _inline_window(self, hidden_states, attention_mask, bias, cosine=True, logit_scale=self.logit_scale)

    def _continuous_position_bias(self) -> torch.Tensor:
        """``16 * sigmoid(cpb_mlp(relative_coords_table))`` gathered to [H, N, N] (16 * sigmoid is elementwise:
        applied to the table it gives the same values as applied after the lookup)."""
        table = self.continuous_position_bias_mlp(self.relative_coords_table).view(-1, self.num_attention_heads)
        return _gathered(self, 16 * torch.sigmoid(table))


PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec("hf-swin", _swin.SwinSelfAttention, VisionattnSwinSelfAttention, _check_transformers_5)
    if _LEGACY_SWIN else PatchSpec("hf-swin", _swin.SwinAttention, VisionattnSwinAttention, _check_transformers_5),
    PatchSpec("hf-swinv2", _swinv2.Swinv2SelfAttention, VisionattnSwinv2SelfAttention, _check_transformers_5),
)
