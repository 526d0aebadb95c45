"""The op layer: one torch custom op per kernel family, and the eager path beside it.

Three layers per call (docs/design.md, "How a call reaches a kernel"): the public function
(:func:`visionattn.attention`, :func:`visionattn.window_attention`) validates and picks an op
here; the op looks up the cached launch plan of its call signature; the plan launches.

* In eager PyTorch the public functions call :func:`dense`, :func:`pasa` and :func:`window`,
  which go to the kernels' launchers without a trip through the torch dispatcher (that trip
  costs about as much as a whole SDPA call).
* Under ``torch.compile`` (and ``torch.jit.trace``, which records them) they call the custom ops below
  instead, which the compiler sees as opaque nodes with fake (meta) implementations: ``visionattn::attention``
  (dense ELSA), ``visionattn::attention_lse`` (dense, also returning the per-row log-sum-exp: the node the
  backward attaches to), ``visionattn::pasa_attention`` and ``visionattn::window_attention``.

Autograd: a call whose inputs need gradients runs through :class:`_DenseFunction` in eager mode
and ``visionattn::attention_lse`` (with its registered autograd formula) under compile, when the
mode has backward kernels (:data:`BACKWARD_MODES`); otherwise the public function runs the
differentiable PyTorch reference and warns once. :func:`dense_packed` (behind
:func:`visionattn.attention_qkvpacked`) is the eager training path over one packed [B, N, 3, H, D]
tensor, whose backward returns one packed gradient.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import dispatch
from .kernels import elsa_fwd, pasa_fwd, window_fwd
from .kernels import l2norm as _l2norm
from .kernels._host import unit_last_stride
from .kernels._launch import interpreting
from .kernels.modes import MODES

__all__ = ["dense", "dense_packed", "pasa", "window", "window_packed", "dense_plan", "pasa_plan", "window_plan",
           "BACKWARD_MODES", "has_backward"]

# modes whose dense backward kernels exist (kernels/elsa_bwd.py); empty until they are importable
try:
    from .kernels import elsa_bwd as _elsa_bwd
except ImportError:  # the module is optional: without it every dense mode is forward-only
    _elsa_bwd = None
BACKWARD_MODES: frozenset = frozenset(
    name for name, m in MODES.items() if "dense" in m.kernels) if _elsa_bwd is not None else frozenset()


def relaid_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``((q, k, v), relaid)``: the three with unit last strides, the only layout the kernels take
    (:func:`.kernels._host.unit_last_stride`: one copy of a tensor whose head dim is not of unit stride), and
    whether one was laid out, in which case the API keeps no cached runner for the call signature (its runner
    would pass the caller's layout on)."""
    if q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
        return (q, k, v), False
    return tuple(unit_last_stride(t) for t in (q, k, v)), True

def first_order_only(what: str) -> None:
    """Raise where autograd asks a kernel backward for a graph of its own (``create_graph=True``: a double
    backward, e.g. a gradient penalty): the backward kernels return first-order gradients only, which would
    silently be constants in the second differentiation. Inside a backward, grad mode is on exactly then.

    Raises:
        RuntimeError: naming ``what`` and the fix (the reference backend differentiates twice).
    """
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what}: double backward (create_graph=True, e.g. a gradient penalty) through the "
                           f"attention kernels is not supported: their backward is first-order only; run this "
                           f"call with backend='reference' (pure PyTorch, differentiable twice)")


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
    return _elsa_bwd.elsa_backward(q, k, v, out, grad_out, lse, _elsa_bwd.autograd_bias(bias, bias_grad), attn_mask,
                                   is_causal, scale, mode, bias_requires_grad=bias_grad)


@torch.library.custom_op("visionattn::attention_backward", mutates_args=())
def _attention_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                      attn_mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                      is_causal: bool, scale: float, mode: str,
                      bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense backward as an opaque node of ``torch.compile``'s backward graph: (dq, dk, dv, dbias), an
    empty tensor standing for a bias gradient not asked for (custom ops return tensors only)."""
    dq, dk, dv, dbias = _dense_backward(q, k, v, bias, attn_mask, out, lse, grad_out, is_causal, scale, mode,
                                        bias_grad)
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


@_attention_bwd_op.register_fake
def _(q, k, v, bias, attn_mask, out, lse, grad_out, is_causal, scale, mode, bias_grad):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            bias.new_empty(bias.shape) if bias_grad else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, attn_mask, out, lse)
    ctx.args = (is_causal, scale, mode)


def _backward(ctx, grad_out, grad_lse):
    first_order_only("visionattn.attention")
    q, k, v, bias, attn_mask, out, lse = ctx.saved_tensors
    is_causal, scale, mode = ctx.args
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _attention_bwd_op(q, k, v, bias, attn_mask, out, lse, grad_out.contiguous(), is_causal,
                                          scale, mode, bias_grad)
    return dq, dk, dv, dbias if bias_grad else None, None, None, None, None, None, None


if _elsa_bwd is not None:
    _attention_lse_op.register_autograd(_backward, setup_context=_setup_context)


class _DenseFunction(torch.autograd.Function):
    """Eager autograd for the dense kernels: forward saves (q, k, v, bias, mask, out, lse); backward runs
    the recomputing backward kernels (FlashAttention-2, Alg. 2)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype, held):
        out, lse, plan = _forward_with_lse(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype,
                                           held)
        ctx.save_for_backward(q, k, v, bias, attn_mask, out, lse)
        ctx.args = (is_causal, scale, mode, plan)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        first_order_only("visionattn.attention")
        q, k, v, bias, attn_mask, out, lse = ctx.saved_tensors
        is_causal, scale, mode, plan = ctx.args
        # the backward plan found through the forward's (every forward has one): no second validation
        dq, dk, dv, dbias = _elsa_bwd.backward_after_forward(plan, q, k, v, out, grad_out, lse, bias, attn_mask,
                                                             is_causal, scale, mode,
                                                             bias is not None and ctx.needs_input_grad[3])
        return dq, dk, dv, dbias, None, None, None, None, None, None, None


def _forward_with_lse(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype, held):
    """(out, lse, plan) of a training forward. ``held``: a one-element list its caller keeps per call signature;
    the signature's plan goes there on the first call and later calls launch from it, without building the plan
    key (a plan reads the bias / mask through their data pointers: their view strides are in the plan)."""
    plan = held[0] if held is not None else None
    if plan is None:
        plan, (out, lse) = elsa_fwd.plan_for(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode,
                                             num_splits, out_dtype, with_lse=True)
        if held is not None:
            held[0] = plan
        return out, lse, plan
    out, lse = plan(q, k, v, bias, attn_mask, scale)
    return out, lse, plan


def _unpack(qkv: torch.Tensor):
    """q, k, v [B, H, N, D] as views of a packed [B, N, 3, H, D] tensor (no copy; two view ops)."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


class _DensePackedFunction(torch.autograd.Function):
    """Eager autograd for the dense kernels over one packed [B, N, 3, H, D] query / key / value tensor (the layout
    of a fused qkv projection; FlashAttention's qkv-packed call). The backward writes dQ, dK and dV into one
    [B, N, 3, H, D] gradient: autograd then needs neither the stack of three gradients that ``unbind``'s backward
    makes nor the copy of it back into the projection's layout."""

    @staticmethod
    def forward(ctx, qkv, bias, attn_mask, is_causal, scale, mode, out_dtype, held):
        q, k, v = _unpack(qkv)
        out, lse, plan = _forward_with_lse(q, k, v, bias, attn_mask, is_causal, scale, mode, 0, out_dtype, held)
        ctx.save_for_backward(q, k, v, bias, attn_mask, out, lse)
        ctx.args = (is_causal, scale, mode, plan, qkv.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        first_order_only("visionattn.attention_qkvpacked")
        q, k, v, bias, attn_mask, out, lse = ctx.saved_tensors
        is_causal, scale, mode, plan, shape = ctx.args
        dqkv = torch.empty(shape, dtype=q.dtype, device=q.device)
        dbias = _elsa_bwd.backward_after_forward(plan, q, k, v, out, grad_out, lse, bias, attn_mask, is_causal,
                                                 scale, mode, bias is not None and ctx.needs_input_grad[1],
                                                 _unpack(dqkv))[3]
        return dqkv, dbias, None, None, None, None, None, None


def dense_packed(qkv, bias, attn_mask, is_causal: bool, scale: float, mode: str, out_dtype: torch.dtype | None,
                 held: list | None = None) -> torch.Tensor:
    """Dense ELSA attention with gradients over a packed qkv [B, N, 3, H, D] in the mode's compute dtype (validated,
    a mode of :data:`BACKWARD_MODES`, eager): out [B, H, N, D] (a view of a [B, N, H, D] buffer), and in the
    backward one packed [B, N, 3, H, D] gradient. ``bias`` / ``attn_mask`` as for :func:`dense`. ``held``: a
    one-element list a caller keeps per call signature: the forward plan goes there on the first call and is
    launched from there on later ones (no plan key built per call)."""
    return _DensePackedFunction.apply(qkv, bias, attn_mask, is_causal, scale, mode, out_dtype, held)


def dense(q, k, v, bias, attn_mask, is_causal: bool, scale: float, mode: str, num_splits: int,
          out_dtype: torch.dtype | None, grad: bool, held: list | None = None) -> torch.Tensor:
    """Dense ELSA attention on the kernels, inputs validated and cast to the mode's dtype.

    ``bias`` / ``attn_mask``: as the caller passed them (broadcastable to [B, H, Nq, Nk]; viewed, never
    copied), so a bias gradient comes back in the bias's own shape. ``grad``: the inputs need gradients (the
    mode must be in :data:`BACKWARD_MODES`). ``held``: with ``grad`` in eager mode, a one-element list the caller
    keeps per call signature, where the forward plan is kept between calls (see :func:`_forward_with_lse`).
    """
    if dispatch.recording():
        if grad:
            return _attention_lse_op(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype)[0]
        return _attention_op(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype)
    if grad:
        return _DenseFunction.apply(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype, held)
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
    if dispatch.recording():
        return _pasa_op(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)
    return pasa_fwd.pasa_forward(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)


# ----------------------------------------------------------------------------- window
# The window kernels' backward (kernels/window_bwd.py) runs on the dense backward kernels: present with them.
_window_bwd = None
if _elsa_bwd is not None:
    from .kernels import window_bwd as _window_bwd
_LOG_100 = 4.605170185988092  # log(100): Swin-v2's cap on the logit scale


@torch.library.custom_op("visionattn::window_attention", mutates_args=())
def _window_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
               mask: Optional[torch.Tensor], logit_scale: Optional[torch.Tensor], num_windows: int, cosine: bool,
               scale: float, mode: str) -> torch.Tensor:
    return window_fwd.window_forward(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)


@_window_op.register_fake
def _(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode):
    return _heads_inner_like(q, v, q.dtype)


@torch.library.custom_op("visionattn::window_attention_lse", mutates_args=())
def _window_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                   mask: Optional[torch.Tensor], logit_scale: Optional[torch.Tensor],
                   head_scale: Optional[torch.Tensor], num_windows: int, cosine: bool, scale: float,
                   mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [B*nW, H, N] float32) of the training path. With ``cosine``, q and k come L2-normalised already
    (used as given) and ``logit_scale`` [H] (no gradient) sets the kernel's ``exp(min(logit_scale, log 100))``;
    ``head_scale`` [H], that same factor computed by autograd, is only saved for the backward (its gradient)."""
    return window_fwd.window_forward(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode,
                                     with_lse=True, normalized=True)


@_window_lse_op.register_fake
def _(q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode):
    return _heads_inner_like(q, v, q.dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


def _window_backward(q, k, v, bias, mask, head_scale, out, lse, grad_out, num_windows, scale, mode, needs):
    """(dq, dk, dv, dbias, dhead_scale) by the window backward kernels from the saved LSE; q / k / v cast to the
    mode's compute dtype for the kernels, their gradients cast back to the callers' dtypes. ``needs``: the
    autograd ``needs_input_grad`` of (q, k, v, bias, mask, logit_scale, head_scale, ...); dbias [H, N, N] in the
    bias's dtype, dhead_scale [H] in its dtype, None where not needed."""
    dtype = MODES[mode].compute_dtype
    dq, dk, dv, dbias, dhs = _window_bwd.window_backward(
        q.to(dtype), k.to(dtype), v.to(dtype), out, grad_out, lse, bias, mask, num_windows, scale, mode, head_scale,
        bias is not None and needs[3], head_scale is not None and needs[6])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, dhs


@torch.library.custom_op("visionattn::window_attention_backward", mutates_args=())
def _window_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                   mask: Optional[torch.Tensor], head_scale: Optional[torch.Tensor], out: torch.Tensor,
                   lse: torch.Tensor, grad_out: torch.Tensor, num_windows: int, scale: float, mode: str,
                   bias_grad: bool, head_scale_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor]:
    """The window backward as an opaque node for ``torch.compile``'s backward graph: (dq, dk, dv, dbias,
    dhead_scale), an empty tensor standing for a gradient not asked for (custom ops return tensors only)."""
    needs = (True, True, True, bias_grad, False, False, head_scale_grad)
    grads = _window_backward(q, k, v, bias, mask, head_scale, out, lse, grad_out, num_windows, scale, mode, needs)
    return tuple(q.new_empty(0) if g is None else g for g in grads)


@_window_bwd_op.register_fake
def _(q, k, v, bias, mask, head_scale, out, lse, grad_out, num_windows, scale, mode, bias_grad, head_scale_grad):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            bias.new_empty(bias.shape) if bias_grad else q.new_empty(0),
            head_scale.new_empty(head_scale.shape) if head_scale_grad else q.new_empty(0))


def _window_setup_context(ctx, inputs, output):
    q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, mask, head_scale, out, lse)
    ctx.args = (num_windows, scale, mode)


def _window_op_backward(ctx, grad_out, grad_lse):
    first_order_only("visionattn.window_attention")
    q, k, v, bias, mask, head_scale, out, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad
    bias_grad, hs_grad = bias is not None and needs[3], head_scale is not None and needs[6]
    dq, dk, dv, dbias, dhs = _window_bwd_op(q, k, v, bias, mask, head_scale, out, lse, grad_out, *ctx.args,
                                            bias_grad, hs_grad)
    return dq, dk, dv, dbias if bias_grad else None, None, None, dhs if hs_grad else None, None, None, None, None


if _window_bwd is not None:
    _window_lse_op.register_autograd(_window_op_backward, setup_context=_window_setup_context)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=1e-12)`` for the cosine training path: eagerly one kernel each way
    (:func:`visionattn.kernels.l2norm.l2_normalize`; PyTorch autograd takes ~8 kernels per tensor and direction
    on timm's strided views), under ``torch.compile`` PyTorch's, which the compiler fuses itself (and so under
    ``torch.jit.trace``, whose graph cannot hold the kernel's direct launch)."""
    if (not dispatch.recording() and x.stride(-1) == 1
            and x.shape[-1] <= _l2norm.MAX_HEAD_DIM and x.numel() and (x.is_cuda or interpreting())):
        # F.normalize's result dtype: under autocast its norm is FP32, and the division promotes to it
        autocast = torch.is_autocast_enabled(x.device.type)
        return _l2norm.l2_normalize(x, 1e-12, torch.float32 if autocast else x.dtype)
    return torch.nn.functional.normalize(x, dim=-1, eps=1e-12)


class _WindowFunction(torch.autograd.Function):
    """Eager autograd for the window kernels: the forward writes the per-row LSE and saves (q, k, v, bias, mask,
    head scale, out, lse); the backward recomputes the probabilities tile by tile (FlashAttention-2, Alg. 2).
    Arguments as ``visionattn::window_attention_lse`` (with ``cosine``, q and k L2-normalised already: the kernel
    uses them as given, so its LSE belongs to exactly the logits the backward recomputes); the mask never gets a
    gradient."""

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode):
        plan, (out, lse) = window_fwd.window_forward_planned(q, k, v, bias, mask, logit_scale, num_windows, cosine,
                                                             scale, mode, with_lse=True, normalized=True)
        ctx.save_for_backward(q, k, v, bias, mask, head_scale, out, lse)
        ctx.args = (num_windows, scale, mode, plan)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        first_order_only("visionattn.window_attention")
        q, k, v, bias, mask, head_scale, out, lse = ctx.saved_tensors
        num_windows, scale, mode, plan = ctx.args
        needs = ctx.needs_input_grad
        dtype = MODES[mode].compute_dtype
        dq, dk, dv, dbias, dhs = _window_bwd.backward_after_forward(
            plan, q.to(dtype), k.to(dtype), v.to(dtype), out, grad_out, lse, bias, mask, num_windows, scale, mode,
            head_scale=head_scale, bias_requires_grad=bias is not None and needs[3],
            scale_requires_grad=head_scale is not None and needs[6])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, None, None, dhs, None, None, None, None


class _CosineWindowFunction(torch.autograd.Function):
    """Eager autograd for Swin-v2's cosine window attention in half modes on windows the fused backward kernel takes
    (at most ``window_bwd.FUSED_MAX_TOKENS`` tokens): q and k arrive as the caller has them, both kernels normalise
    their rows and form ``c = exp(min(logit_scale, log 100))`` themselves (the same code, so the LSE the forward saves
    belongs to exactly the logits the backward recomputes), and the backward returns the raw q and k's gradients
    and d logit_scale. One autograd node and two launches, where normalising outside takes three nodes (two
    normalisations, the logit scale's exp and clamp) and six more launches, and saves the normalised copies."""

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, logit_scale, num_windows, mode):
        plan, (out, lse) = window_fwd.window_forward_planned(q, k, v, bias, mask, logit_scale, num_windows, True, 1.0,
                                                             mode, with_lse=True)
        ctx.save_for_backward(q, k, v, bias, mask, logit_scale, out, lse)
        ctx.args = (num_windows, mode, plan)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        first_order_only("visionattn.window_attention")
        q, k, v, bias, mask, logit_scale, out, lse = ctx.saved_tensors
        num_windows, mode, plan = ctx.args
        needs = ctx.needs_input_grad
        dtype = MODES[mode].compute_dtype
        dq, dk, dv, dbias, dls = _window_bwd.backward_after_forward(
            plan, q.to(dtype), k.to(dtype), v.to(dtype), out, grad_out, lse, bias, mask, num_windows, 1.0, mode,
            logit_scale=logit_scale, bias_requires_grad=bias is not None and needs[3], scale_requires_grad=needs[5])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, None, dls, None, None


def _unpack_windows(qkv: torch.Tensor):
    """q, k, v [B*nW, H, N, D] as views of a packed [B*nW, N, 3, H, D] tensor (no copy)."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


class _WindowPackedFunction(torch.autograd.Function):
    """Eager autograd for window attention over one packed [B*nW, N, 3, H, D] qkv (the layout of timm's fused qkv
    projection) on windows the fused backward kernel takes: the backward writes dQ, dK and dV into one packed
    gradient in that layout, so autograd needs neither the stack of three gradients that ``unbind``'s backward
    makes nor the copy of it back into the projection's layout (two passes over the whole qkv gradient).
    ``cosine``: Swin-v2, the kernels normalise q and k and form the logit scale (as :class:`_CosineWindowFunction`),
    the backward also returns d logit_scale."""

    @staticmethod
    def forward(ctx, qkv, bias, mask, logit_scale, num_windows, cosine, scale, mode):
        q, k, v = _unpack_windows(qkv)
        plan, (out, lse) = window_fwd.window_forward_planned(q, k, v, bias, mask, logit_scale, num_windows, cosine,
                                                             scale, mode, with_lse=True)
        ctx.save_for_backward(qkv, bias, mask, logit_scale, out, lse)
        ctx.args = (num_windows, cosine, scale, mode, plan)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        first_order_only("visionattn.window_attention_qkvpacked")
        qkv, bias, mask, logit_scale, out, lse = ctx.saved_tensors
        num_windows, cosine, scale, mode, plan = ctx.args
        needs = ctx.needs_input_grad
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        dbias, dls = _window_bwd.backward_after_forward(
            plan, *_unpack_windows(qkv), out, grad_out, lse, bias, mask, num_windows, scale, mode,
            logit_scale=logit_scale if cosine else None, bias_requires_grad=bias is not None and needs[1],
            scale_requires_grad=cosine and needs[3], grads=_unpack_windows(dqkv))[3:]
        return dqkv, dbias, None, dls, None, None, None, None


def window_packed(qkv, bias, mask, logit_scale, num_windows: int, cosine: bool, scale: float,
                  mode: str) -> torch.Tensor:
    """Window attention with gradients over a packed qkv [B*nW, N, 3, H, D] in the mode's compute dtype (validated,
    eager, a mode of :data:`BACKWARD_MODES`, windows of at most ``window_bwd.FUSED_MAX_TOKENS`` tokens): out
    [B*nW, H, N, D] (a view of a [B*nW, N, H, D] buffer), and in the backward one packed [B*nW, N, 3, H, D] gradient
    (:class:`_WindowPackedFunction`). ``bias`` [H, N, N] / ``mask`` [nW, N, N] / ``logit_scale`` [H] as
    :func:`window` takes them (``cosine``: q and k as given, normalised by the kernels)."""
    return _WindowPackedFunction.apply(qkv, bias, mask, logit_scale, num_windows, cosine, scale, mode)


def window(q, k, v, bias, mask, logit_scale, num_windows: int, cosine: bool, scale: float, mode: str,
           grad: bool = False) -> torch.Tensor:
    """Window attention on the kernels; inputs validated (:func:`visionattn.window.validate_window_inputs`).

    Args:
        q, k: [B*nW, H, N, D]; v: [B*nW, H, N, Dv]; float16 / bfloat16 / float32 (cast to the mode's compute
            dtype inside the kernels; the output has q's dtype).
        bias: float [H, N, N] or None; mask: additive float [nW, N, N] or None (window b reads mask[b % nW]);
            logit_scale: [H] when ``cosine`` (Swin-v2), else None.
        grad: the inputs need gradients (``mode`` must be in :data:`BACKWARD_MODES`). The call then runs through
            :class:`_WindowFunction` (eager) or ``visionattn::window_attention_lse`` with its registered autograd
            formula (``torch.compile``). Cosine, eager, half modes, windows of at most ``FUSED_MAX_TOKENS``:
            :class:`_CosineWindowFunction` (the kernels normalise). Other cosine calls: q and k are
            L2-normalised (``F.normalize``, eps 1e-12) and
            ``c = exp(min(logit_scale, log 100))`` computed here in PyTorch, so autograd carries the
            normalisation's and ``logit_scale``'s gradients (the CPB bias chain arrives through ``bias``); the
            forward kernel takes the normalised q, k as given (no second normalisation, which in half precision
            would round them differently from what the backward recomputes with) and the backward ``c``.
            Gradients: q, k, v in their dtypes, bias [H, N, N] (the sum over every window; a [1, H, N, N]
            caller's view reduces it to its shape), none for the mask.

    Returns:
        [B*nW, H, N, Dv] in q's dtype, a view of a contiguous [B*nW, N, H, Dv] buffer.

    Raises:
        ValueError: ``grad`` in a mode without backward kernels (``pasa``, ``fp16-acc16``).
    """
    if grad:
        if mode not in BACKWARD_MODES:
            raise ValueError(f"mode={mode!r} has no window backward kernel; expected one of "
                             f"{sorted(BACKWARD_MODES)}")
        head_scale = None
        if (cosine and q.shape[2] <= _window_bwd.FUSED_MAX_TOKENS and MODES[mode].compute_dtype != torch.float32
                and not dispatch.recording()):
            # half modes; with FP32 products the normalising kernels spill more than the two row kernels cost
            # (docs/tuning.md)
            return _CosineWindowFunction.apply(q, k, v, bias, mask, logit_scale, num_windows, mode)
        if cosine:
            q, k = _normalize(q), _normalize(k)
            # in FP32 like the kernel's own exp(min(logit_scale, log 100)): a half-precision c would differ
            # from the forward's by up to half an ulp, shifting the recomputed logits by up to ~0.03 at c = 100
            head_scale = torch.exp(torch.clamp(logit_scale.float(), max=_LOG_100))
            logit_scale = logit_scale.detach()
        if dispatch.recording():
            return _window_lse_op(q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode)[0]
        return _WindowFunction.apply(q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode)
    if dispatch.recording():
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



# ----------------------------------------------------------------------------- ragged (varlen)
# Packed cu_seqlens attention (FlashAttention's varlen layout): the forward op, the forward with LSE (the node the
# backward attaches to under torch.compile), the backward op, and the eager autograd Function beside them.
from .kernels import varlen_fwd  # noqa: E402

_varlen_bwd = None
if _elsa_bwd is not None:  # the varlen backward runs the dense backward's tile helpers: present with them
    from .kernels import varlen_bwd as _varlen_bwd

__all__ += ["varlen", "varlen_lse"]


@torch.library.custom_op("visionattn::varlen_attention", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
               mode: str, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return varlen_fwd.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                     scale, mode, out_dtype)[0]


@_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, mode, out_dtype):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=out_dtype or q.dtype)


@torch.library.custom_op("visionattn::varlen_attention_lse", mutates_args=())
def _varlen_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
                   mode: str, out_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [total_q, H, Dv], lse [H, total_q] float32) of the training path."""
    out, lse = varlen_fwd.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         is_causal, scale, mode, out_dtype, with_lse=True)
    return out, lse


@_varlen_lse_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, mode, out_dtype):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[2]), dtype=out_dtype or q.dtype),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("visionattn::varlen_attention_backward", mutates_args=())
def _varlen_bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, is_causal: bool, scale: float,
                   mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The varlen backward (:func:`visionattn.kernels.varlen_bwd.varlen_backward`) as an opaque node of
    ``torch.compile``'s backward graph: (dq, dk, dv) in q's dtype."""
    return _varlen_bwd.varlen_backward(q, k, v, out, grad_out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, is_causal, scale, mode)


@_varlen_bwd_op.register_fake
def _(q, k, v, out, lse, grad_out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, mode):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, mode, out_dtype = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, is_causal, scale, mode)


def _varlen_op_backward(ctx, grad_out, grad_lse):
    first_order_only("visionattn.varlen_attention")
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd_op(q, k, v, out, lse, grad_out.contiguous(), cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None


if _varlen_bwd is not None:
    _varlen_lse_op.register_autograd(_varlen_op_backward, setup_context=_varlen_setup_context)


class _VarlenFunction(torch.autograd.Function):
    """Eager autograd for the varlen kernels: the forward writes the per-row LSE and saves (q, k, v, out, lse,
    offsets); the backward recomputes the probabilities tile by tile (FlashAttention-2, Alg. 2). The offsets
    and maxima get no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, mode, out_dtype):
        out, lse = varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, mode, out_dtype,
                                             with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, is_causal, scale, mode)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        first_order_only("visionattn.varlen_attention")
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _varlen_bwd.varlen_backward(q, k, v, out, grad_out, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
           scale: float, mode: str, out_dtype: torch.dtype | None, grad: bool = False) -> torch.Tensor:
    """Packed ragged attention on the varlen kernels, inputs validated and cast to the mode's dtype:
    q [total_q, H, D], k [total_k, H, D], v [total_k, H, Dv], int32 offsets [n_seq + 1] -> [total_q, H, Dv] in
    ``out_dtype``. ``grad``: the inputs need gradients (``mode`` in :data:`BACKWARD_MODES`): eager calls run
    :class:`_VarlenFunction`, compiled ones ``visionattn::varlen_attention_lse`` with its autograd formula;
    otherwise ``visionattn::varlen_attention`` under ``torch.compile``.

    Raises:
        ValueError: ``grad`` in a mode without backward kernels.
    """
    if grad:
        if mode not in BACKWARD_MODES:
            raise ValueError(f"mode={mode!r} has no varlen backward kernel; expected one of {sorted(BACKWARD_MODES)}")
        if dispatch.recording():
            return _varlen_lse_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                                  mode, out_dtype)[0]
        return _VarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                     scale, mode, out_dtype)
    if dispatch.recording():
        return _varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                          mode, out_dtype)
    return varlen_fwd.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                     scale, mode, out_dtype)[0]


def varlen_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
               scale: float, mode: str, out_dtype: torch.dtype | None):
    """:func:`varlen` and the per-row log-sum-exp [H, total_q] float32 (natural log, -inf without keys)."""
    return varlen_fwd.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                     scale, mode, out_dtype, with_lse=True)
