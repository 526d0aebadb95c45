"""The op layer: one torch custom op per kernel family, and the eager path beside it.

Three layers per call (docs/design.md, "How a call reaches a kernel"): the public function
(:func:`visionattn.attention`, :func:`visionattn.window_attention`) validates and picks an op
here; the op looks up the cached launch plan of its call signature; the plan launches.

* In eager PyTorch the public functions call :func:`dense`, :func:`pasa` and :func:`window`,
  which go to the kernels' launchers without a trip through the torch dispatcher (that trip
  costs about as much as a whole SDPA call).
* Under ``torch.compile`` they call the custom ops below instead, which the compiler sees as
  opaque nodes with fake (meta) implementations: ``visionattn::attention`` (dense ELSA),
  ``visionattn::attention_lse`` (dense, also returning the per-row log-sum-exp: the node the
  backward attaches to), ``visionattn::pasa_attention`` and ``visionattn::window_attention``.

Autograd: a call whose inputs need gradients runs through :class:`_DenseFunction` in eager mode
and ``visionattn::attention_lse`` (with its registered autograd formula) under compile, when the
mode has backward kernels (:data:`BACKWARD_MODES`); otherwise the public function runs the
differentiable PyTorch reference and warns once.
"""
from __future__ import annotations

from typing import Optional

import torch

from .kernels import elsa_fwd, pasa_fwd, window_fwd
from .kernels.modes import MODES

__all__ = ["dense", "pasa", "window", "dense_plan", "pasa_plan", "window_plan", "BACKWARD_MODES", "has_backward"]

# modes whose dense backward kernels exist (kernels/elsa_bwd.py); empty until they are importable
try:
    from .kernels import elsa_bwd as _elsa_bwd
except ImportError:  # the module is optional: without it every dense mode is forward-only
    _elsa_bwd = None
BACKWARD_MODES: frozenset = frozenset(
    name for name, m in MODES.items() if "dense" in m.kernels) if _elsa_bwd is not None else frozenset()


def has_backward(mode: str) -> bool:
    """Whether the dense kernels of ``mode`` have a backward (else gradients need the reference path)."""
    return mode in BACKWARD_MODES


# ----------------------------------------------------------------------------- dense
def _views(q: torch.Tensor, k: torch.Tensor, bias, attn_mask):
    """``bias`` / ``attn_mask`` as [B, H, Nq, Nk] views (stride-0 broadcast, no copy) of what the caller passed."""
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return (None if bias is None else bias.expand(shape)), (None if attn_mask is None else attn_mask.expand(shape))


@torch.library.custom_op("visionattn::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                  attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float, mode: str, num_splits: int,
                  out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return elsa_fwd.dense_forward(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode, num_splits,
                                  out_dtype)[0]


def _heads_inner_like(q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    B, H, Nq = q.shape[:3]
    Dv = v.shape[3]
    return q.new_empty((B, Nq, H, Dv), dtype=dtype).transpose(1, 2)


@_attention_op.register_fake
def _(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype):
    return _heads_inner_like(q, v, out_dtype or q.dtype)


@torch.library.custom_op("visionattn::attention_lse", mutates_args=())
def _attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                      attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float, mode: str, num_splits: int,
                      out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    return elsa_fwd.dense_forward(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode, num_splits,
                                  out_dtype, with_lse=True)


@_attention_lse_op.register_fake
def _(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype):
    return _heads_inner_like(q, v, out_dtype or q.dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


def _dense_backward(q, k, v, bias, attn_mask, out, lse, grad_out, is_causal, scale, mode, bias_grad: bool):
    """(dq, dk, dv, dbias) by the backward kernels (FlashAttention-2's recomputation from the saved LSE);
    ``bias`` as the caller passed it, so dbias comes back in its own shape (broadcast dims summed)."""
    return _elsa_bwd.elsa_backward(q, k, v, out, grad_out, lse, bias, attn_mask, is_causal, scale, mode,
                                   bias_requires_grad=bias_grad)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, attn_mask, out, lse)
    ctx.args = (is_causal, scale, mode)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, bias, attn_mask, out, lse = ctx.saved_tensors
    is_causal, scale, mode = ctx.args
    dq, dk, dv, dbias = _dense_backward(q, k, v, bias, attn_mask, out, lse, grad_out, is_causal, scale, mode,
                                        bias is not None and ctx.needs_input_grad[3])
    return dq, dk, dv, dbias, None, None, None, None, None, None


if _elsa_bwd is not None:
    _attention_lse_op.register_autograd(_backward, setup_context=_setup_context)


class _DenseFunction(torch.autograd.Function):
    """Eager autograd for the dense kernels: forward saves (q, k, v, bias, mask, out, lse); backward runs
    the recomputing backward kernels (FlashAttention-2, Alg. 2)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype):
        out, lse = elsa_fwd.dense_forward(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode,
                                          num_splits, out_dtype, with_lse=True)
        ctx.save_for_backward(q, k, v, bias, attn_mask, out, lse)
        ctx.args = (is_causal, scale, mode)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, attn_mask, out, lse = ctx.saved_tensors
        is_causal, scale, mode = ctx.args
        dq, dk, dv, dbias = _dense_backward(q, k, v, bias, attn_mask, out, lse, grad_out, is_causal, scale, mode,
                                            bias is not None and ctx.needs_input_grad[3])
        return dq, dk, dv, dbias, None, None, None, None, None, None


def dense(q, k, v, bias, attn_mask, is_causal: bool, scale: float, mode: str, num_splits: int,
          out_dtype: torch.dtype | None, grad: bool) -> torch.Tensor:
    """Dense ELSA attention on the kernels, inputs validated and cast to the mode's dtype.

    ``bias`` / ``attn_mask``: as the caller passed them (broadcastable to [B, H, Nq, Nk]; viewed, never
    copied), so a bias gradient comes back in the bias's own shape. ``grad``: the inputs need gradients (the
    mode must be in :data:`BACKWARD_MODES`).
    """
    if torch.compiler.is_compiling():
        if grad:
            return _attention_lse_op(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype)[0]
        return _attention_op(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype)
    if grad:
        return _DenseFunction.apply(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype)
    return elsa_fwd.dense_forward(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode, num_splits,
                                  out_dtype)[0]


# ----------------------------------------------------------------------------- PASA
@torch.library.custom_op("visionattn::pasa_attention", mutates_args=())
def _pasa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
             attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float, shift: bool,
             out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return pasa_fwd.pasa_forward(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)


@_pasa_op.register_fake
def _(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype):
    return _heads_inner_like(q, v, out_dtype or torch.float16)


def pasa(q, k, v, bias, attn_mask, is_causal: bool, scale: float, shift: bool,
         out_dtype: torch.dtype | None) -> torch.Tensor:
    """PASA (``shift``) / FP16-accumulation forward on the kernel; inputs validated, float16."""
    if torch.compiler.is_compiling():
        return _pasa_op(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)
    return pasa_fwd.pasa_forward(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)


# ----------------------------------------------------------------------------- window
@torch.library.custom_op("visionattn::window_attention", mutates_args=())
def _window_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
               mask: Optional[torch.Tensor], logit_scale: Optional[torch.Tensor], num_windows: int, cosine: bool,
               scale: float, mode: str) -> torch.Tensor:
    return window_fwd.window_forward(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)


@_window_op.register_fake
def _(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode):
    return _heads_inner_like(q, v, q.dtype)


def window(q, k, v, bias, mask, logit_scale, num_windows: int, cosine: bool, scale: float, mode: str) -> torch.Tensor:
    """Window attention forward on the kernel; inputs validated (:func:`visionattn.window.validate_window_inputs`)."""
    if torch.compiler.is_compiling():
        return _window_op(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)
    return window_fwd.window_forward(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)


# ----------------------------------------------------------------------------- eager plans
def dense_plan(q, k, v, bias, attn_mask, is_causal: bool, scale: float, mode: str, out_dtype: torch.dtype):
    """Eager, no gradients: ``(plan, out)`` of a dense call (:func:`visionattn.kernels.elsa_fwd.plan_for`); the
    public function keeps the plan for later calls of the same signature."""
    plan, (out, _) = elsa_fwd.plan_for(q, k, v, bias, attn_mask, is_causal, scale, mode, 0, out_dtype)
    return (lambda q, k, v, b, m, s: plan(q, k, v, b, m, s)[0]), out


def pasa_plan(q, k, v, bias, attn_mask, is_causal: bool, scale: float, shift: bool, out_dtype: torch.dtype):
    """Eager: ``(plan, out)`` of a PASA call (:func:`visionattn.kernels.pasa_fwd.plan_for`; plan None when empty)."""
    return pasa_fwd.plan_for(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)


def window_plan(q, k, v, bias, mask, logit_scale, num_windows: int, cosine: bool, scale: float, mode: str):
    """Eager: ``(plan, out)`` of a window call (:func:`visionattn.kernels.window_fwd.plan_for`); bias / mask
    with a unit last stride, ``logit_scale`` [H]."""
    return window_fwd.plan_for(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)

