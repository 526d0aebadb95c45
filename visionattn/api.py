"""The dense attention family: :func:`attention`, :func:`attention_qkvpacked`, their checks, custom ops and
autograd, backend table and call cache.

A call goes public function -> call cache -> backend table -> kernel launch (docs/design.md, "How a call reaches
a kernel"):

* :data:`CALLS`, keyed at the public call (:func:`_signature`: shapes, strides, dtypes, devices, alignment, bias
  and mask metadata, flags, mode, backend, whether anything needs gradients), holds a runner per signature seen
  before: it launches from the signature's plan without validating again.
* A new signature is validated here, then :func:`visionattn.dispatch.choose` reads :data:`BACKENDS` (Triton
  kernels — the dense ELSA kernel, or the PASA kernel of :mod:`visionattn.pasa` in the PASA modes — then the
  PyTorch reference) and the chosen row runs the call and keeps its runner.
* Custom ops ``visionattn::attention``, ``visionattn::attention_lse`` (its registered autograd formula calls
  ``visionattn::attention_backward``) with fake implementations: what ``torch.compile`` and ``torch.jit.trace``
  record. Eager calls run the same implementations without the torch dispatcher, and their gradients go
  through :class:`_DenseFunction` / :class:`_DensePackedFunction`, whose backward is the same formula
  (:func:`_dense_backward` from the saved LSE). Why an eager Function beside the registered formula: a custom op
  call costs about 18 us of host time on the dispatcher (0.8 us for the same Python call made directly, measured
  on CPU), about a whole SDPA call, and the Function keeps the forward's plan, from which the backward finds its
  own plan without building a key.

Kernel modules are imported inside the functions that launch them: importing Triton is slow, and CPU calls
never need it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import dispatch
from .checks import (BACKWARD_MODES, FLOAT_DTYPES, KERNEL_DTYPES, cast_checked, caster, check_dense, check_devices,
                     check_flags, check_float16_range, check_operand, check_tensor, first_order_only, has_backward,
                     mode_of)
from .kernels._launch import PlanCache, recording, unit_last_stride
from .modes import MODES, Mode
from .reference import blocked_attention, cpu_block_size, no_keys_output

__all__ = ["attention", "attention_qkvpacked", "validate_attention_inputs", "dense", "dense_packed",
           "dense_forward_lse", "dense_backward", "BACKENDS", "CALLS",
           # shared checks, kept importable from here
           "check_flags", "cast_checked", "check_float16_range", "check_devices", "qkv_key", "tensor_key"]

from .kernels._launch import qkv_key, tensor_key  # noqa: E402  (re-exported: the signature keys' home)

# public call signature -> a runner that launches from the call's cached plan without validating again (the
# signature was validated when the runner was built); see attention()
CALLS = PlanCache()


# ----------------------------------------------------------------------------- checks
def _broadcast_to(name: str, t: torch.Tensor, target: tuple[int, ...]) -> torch.Tensor:
    """View ``t`` as ``target`` (stride-0 broadcast, no copy), or raise naming ``name``."""
    if t.dim() > 4:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected at most 4 dims broadcastable to "
                         f"[B, H, Nq, Nk] = {list(target)}")
    try:
        if torch.broadcast_shapes(t.shape, target) != torch.Size(target):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, not broadcastable to [B, H, Nq, Nk] = "
                         f"{list(target)}") from None
    return t.expand(target)


def validate_attention_inputs(q, k, v, bias=None, attn_mask=None, enable_gqa: bool = False):
    """Check q, k, v, bias and attn_mask; return bias/mask as [B, H, Nq, Nk] views.

    ``enable_gqa``: key / value may have ``Hkv`` heads dividing the query's H (grouped-query / multi-query
    attention, SDPA's ``enable_gqa=True``); without it they need H heads.

    Raises:
        TypeError: a non-tensor (a numpy array included: the message says to convert it with
            ``torch.from_numpy``), a nested or sparse tensor, an integer/bool q/k/v, mixed q/k/v dtypes,
            a non-float bias or a non-bool attn_mask.
        ValueError: wrong ranks, mismatched batch/heads/head_dim/key counts, a head dim of 0, a
            bias or mask not broadcastable to [B, H, Nq, Nk], mixed devices (naming each argument's), meta
            tensors (shapes without data); with ``enable_gqa``, key / value heads that differ from each other or
            do not divide the query's heads; without it, key / value heads other than the query's.
    """
    for name, t in (("query", q), ("key", k), ("value", v)):
        if (not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_nested or t.dim() != 4
                or t.dtype not in FLOAT_DTYPES):
            check_tensor(name, t)
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.layout is not torch.strided):
        check_operand("bias", bias, "pass a torch float tensor, e.g. torch.from_numpy(bias)")
    if attn_mask is not None and (not isinstance(attn_mask, torch.Tensor) or attn_mask.layout is not torch.strided):
        check_operand("attn_mask", attn_mask, "pass a torch.bool tensor (True = keep), e.g. "
                                               "torch.from_numpy(mask).to(torch.bool)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key, value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    if (k.device != device or v.device != device or device.type == "meta"
            or (bias is not None and bias.device != device) or (attn_mask is not None and attn_mask.device != device)):
        check_devices({"query": q, "key": k, "value": v, "bias": bias, "attn_mask": attn_mask})
    B, H, Nq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        _check_heads(q, k, v, enable_gqa)
    if k.shape[-1] != D:
        raise ValueError(f"head_dim mismatch: query has D={D}, key has D={k.shape[-1]}")
    if D == 0:
        raise ValueError("query and key have head_dim 0; attention needs head_dim >= 1 (the last dim of "
                         "[B, H, N, D])")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"key has Nk={k.shape[2]} tokens but value has {v.shape[2]}")
    if bias is None and attn_mask is None:
        return None, None
    target = (B, H, Nq, k.shape[2])
    if bias is not None:
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a floating tensor (additive), got {bias.dtype}; "
                            f"pass boolean masks as attn_mask")
        bias = _broadcast_to("bias", bias, target)
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise TypeError(f"attn_mask must be torch.bool (True = keep), got {attn_mask.dtype}; "
                            f"pass additive float masks as bias")
        attn_mask = _broadcast_to("attn_mask", attn_mask, target)
    return bias, attn_mask



def _check_heads(q, k, v, enable_gqa) -> None:
    """Raise for key / value batch or head counts that do not fit q [B, H, Nq, D]: with ``enable_gqa`` key and
    value need one head count ``Hkv`` dividing H (SDPA: "Number of heads in key and value must divide the number
    of heads in query"), without it H heads."""
    B, H = q.shape[:2]
    Hk, Hv = k.shape[1], v.shape[1]
    if k.shape[0] != B or v.shape[0] != B or not enable_gqa:
        hint = ("; for grouped-query attention (fewer key / value heads dividing H) pass enable_gqa=True"
                if not enable_gqa and k.shape[0] == v.shape[0] == B and Hk != H else "")
        raise ValueError(f"batch/heads mismatch: query {tuple(q.shape)}, key {tuple(k.shape)}, "
                         f"value {tuple(v.shape)}; expected key/value [B={B}, H={H}, Nk, D]{hint}")
    if Hk != Hv:
        raise ValueError(f"enable_gqa=True: key has {Hk} heads and value {Hv}; grouped-query attention here needs "
                         f"one K / V head count (SDPA's separate key and value groups are not supported)")
    if Hk == 0 or H % Hk:
        raise ValueError(f"enable_gqa=True: number of heads in key and value ({Hk}) must divide the number of "
                         f"heads in query ({H})")


# ----------------------------------------------------------------------------- custom ops and autograd
def _views(q: torch.Tensor, k: torch.Tensor, bias, attn_mask):
    """``bias`` / ``attn_mask`` as [B, H, Nq, Nk] views (stride-0 broadcast, no copy) of what the caller passed."""
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return (None if bias is None else bias.expand(shape)), (None if attn_mask is None else attn_mask.expand(shape))


@torch.library.custom_op("visionattn::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                  attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float, mode: str, num_splits: int,
                  out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    from .kernels import elsa_fwd

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
    from .kernels import elsa_fwd

    return elsa_fwd.dense_forward(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode, num_splits,
                                  out_dtype, with_lse=True)


@_attention_lse_op.register_fake
def _(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype):
    return _heads_inner_like(q, v, out_dtype or q.dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


def _dense_backward(q, k, v, bias, attn_mask, out, lse, grad_out, is_causal, scale, mode, bias_grad: bool):
    """(dq, dk, dv, dbias) by the backward kernels (FlashAttention-2's recomputation from the saved LSE);
    ``bias`` as the caller passed it, so dbias comes back in its own shape (broadcast dims summed)."""
    from .kernels import elsa_bwd

    return elsa_bwd.elsa_backward(q, k, v, out, grad_out, lse, elsa_bwd.autograd_bias(bias, bias_grad), attn_mask,
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
        from .kernels import elsa_bwd

        dq, dk, dv, dbias = elsa_bwd.backward_after_forward(plan, q, k, v, out, grad_out, lse, bias, attn_mask,
                                                             is_causal, scale, mode,
                                                             bias is not None and ctx.needs_input_grad[3])
        return dq, dk, dv, dbias, None, None, None, None, None, None, None


def _forward_with_lse(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype, held):
    """(out, lse, plan) of a training forward. ``held``: a one-element list its caller keeps per call signature;
    the signature's plan goes there on the first call and later calls launch from it, without building the plan
    key (a plan reads the bias / mask through their data pointers: their view strides are in the plan)."""
    plan = held[0] if held is not None else None
    if plan is None:
        from .kernels import elsa_fwd

        plan, (out, lse) = elsa_fwd.plan_for(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode,
                                             num_splits, out_dtype, with_lse=True)
        if held is not None:
            held[0] = plan
        return out, lse, plan
    out, lse = plan(q, k, v, bias, attn_mask, scale)
    return out, lse, plan



def _unpack_qkv(qkv: torch.Tensor):
    """q, k, v [B, H, N, D] as views of a packed [B, N, 3, H, D] tensor (no copy; two view ops)."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


class _DensePackedFunction(torch.autograd.Function):
    """Eager autograd for the dense kernels over one packed [B, N, 3, H, D] query / key / value tensor (the layout
    of a fused qkv projection; FlashAttention's qkv-packed call). The backward writes dQ, dK and dV into one
    [B, N, 3, H, D] gradient: autograd then needs neither the stack of three gradients that ``unbind``'s backward
    makes nor the copy of it back into the projection's layout."""

    @staticmethod
    def forward(ctx, qkv, bias, attn_mask, is_causal, scale, mode, out_dtype, held):
        q, k, v = _unpack_qkv(qkv)
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
        from .kernels import elsa_bwd

        dbias = elsa_bwd.backward_after_forward(plan, q, k, v, out, grad_out, lse, bias, attn_mask, is_causal,
                                                 scale, mode, bias is not None and ctx.needs_input_grad[1],
                                                 _unpack_qkv(dqkv))[3]
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
    if recording():
        if grad:
            return _attention_lse_op(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype)[0]
        return _attention_op(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype)
    if grad:
        return _DenseFunction.apply(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype, held)
    from .kernels import elsa_fwd

    return elsa_fwd.dense_forward(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode, num_splits,
                                  out_dtype)[0]



def dense_forward_lse(q, k, v, bias, attn_mask, is_causal: bool, scale: float, mode: str):
    """``(out, lse)`` float32 of the dense kernel on validated inputs in the mode's compute dtype (bias / mask
    [B, H, Nq, Nk] views or None): ``visionattn::attention_lse`` while a graph is recorded, else the kernel's plan
    directly. out [B, H, Nq, Dv], lse [B, H, Nq] (-inf for a row with no visible key). The context-parallel ring
    merges these partial results."""
    if recording():
        return _attention_lse_op(q, k, v, bias, attn_mask, is_causal, scale, mode, 0, torch.float32)
    from .kernels import elsa_fwd

    return elsa_fwd.dense_forward(q, k, v, *_views(q, k, bias, attn_mask), is_causal, scale, mode, 0, torch.float32,
                                  with_lse=True)


def dense_backward(q, k, v, out, grad_out, lse, bias, attn_mask, is_causal: bool, scale: float, mode: str):
    """``(dq, dk, dv)`` of the dense backward kernels (FlashAttention-2, Alg. 2) from a saved ``lse``; arguments
    as :func:`dense_forward_lse` returned and took them, ``mode`` in :data:`visionattn.checks.BACKWARD_MODES`."""
    from .kernels import elsa_bwd

    return elsa_bwd.elsa_backward(q, k, v, out, grad_out, lse, bias, attn_mask, is_causal, scale, mode)[:3]


# ----------------------------------------------------------------------------- backend table
def _triton_unsupported(q, k, v, bias, attn_mask, is_causal, scale, md: Mode, num_splits, key, raw_bias):
    """Why the kernels cannot run this call (the dense ELSA kernel, or the PASA kernel in the PASA modes), or
    None."""
    if md.half_scores and k.shape[1] != q.shape[1]:
        reason = (f"grouped-query attention ({k.shape[1]} key / value heads for {q.shape[1]} query heads) in mode "
                  f"{md.name!r}: the PASA kernel takes equal heads")
    elif md.half_scores:
        from .pasa import kernel_unsupported_reason

        reason = kernel_unsupported_reason(q, k, v, bias, attn_mask)
    else:
        from .kernels.elsa_fwd import unsupported_reason

        reason = unsupported_reason(q, k, v, bias, attn_mask, md.name)
    if reason is None and _needs_grad(q, k, v, bias) and not has_backward(md.name):
        reason = (f"autograd: mode {md.name!r} has no backward kernel" if not md.half_scores
                  else f"autograd: mode {md.name!r} is forward-only on the kernels")
    return reason


def _triton(q, k, v, bias, attn_mask, is_causal, scale, md: Mode, num_splits, key, raw_bias):
    """Run the call on the kernels. With a ``key`` (an eager call of a cacheable signature) on a float16 /
    bfloat16 / float32 input, also keep its runner in :data:`CALLS` (a training call's runner goes straight to
    :class:`_DenseFunction`)."""
    grad = _needs_grad(q, k, v, bias)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (unit_last_stride(t) for t in (q, k, v))  # the only layout the kernels take
        key = None  # the runner would pass the caller's layout on
    if key is not None and not grad and q.dtype in KERNEL_DTYPES:
        return _planned(key, q, k, v, bias, attn_mask, is_causal, scale, md)
    if key is not None and grad and q.dtype in KERNEL_DTYPES and not md.half_scores:
        CALLS.put(key, _training_runner(q, is_causal, md))
    qc, kc, vc = caster(md, q.dtype)(q, k, v)
    # the kernels write the caller's dtype straight from their FP32 state (no half rounding of the output of
    # an FP32 caller in a half mode); float64 callers get FP32 and one cast
    out_dtype = q.dtype if q.dtype != torch.float64 else torch.float32
    if md.half_scores:
        from .pasa import pasa_kernel

        out = pasa_kernel(qc, kc, vc, bias, attn_mask, is_causal, scale, md.pasa_shift, out_dtype)
    else:
        # the caller's own bias tensor (its gradient comes back in its shape); the mask as validated
        out = dense(qc, kc, vc, raw_bias if raw_bias is not None else bias, attn_mask, is_causal, scale, md.name,
                    num_splits or 0, out_dtype, grad)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, N, D] -> [B, heads, N, D], K / V head ``j`` repeated for query heads ``j * G .. j * G + G - 1``
    (G = heads / Hkv), SDPA's ``repeat_interleave`` for ``enable_gqa=True``."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _reference(q, k, v, bias, attn_mask, is_causal, scale, md: Mode, num_splits, key, raw_bias):
    """The exact PyTorch reference in the mode's arithmetic (:func:`visionattn.reference.blocked_attention`;
    PASA modes :func:`visionattn.pasa.pasa_attention_reference`); differentiable."""
    check_float16_range(md, query=q, key=k, value=v)
    if k.shape[1] != q.shape[1]:
        # grouped-query attention: each K / V head repeated for its query heads (a copy in the reference only;
        # autograd sums the copies' gradients back onto the K / V heads)
        k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    # the mode fixes the arithmetic: an enclosing autocast must not turn the reference's FP32 products into half
    with torch.autocast(q.device.type, enabled=False):
        if md.half_scores and k.shape[2] == 0:  # no keys: zeros, in the graph (see no_keys_output)
            out = no_keys_output(q.float(), k.float(), v.float(), bias)
        elif md.half_scores:
            from .pasa import pasa_attention_reference

            out = pasa_attention_reference(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal,
                                           scale=scale, shift=md.pasa_shift)
        else:
            out = blocked_attention(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                    mode=md, block_size=cpu_block_size(k.shape[-2]))
    return out.to(q.dtype)


# backends of attention() in priority order; dispatch.choose reads it
BACKENDS = dispatch.BackendTable("attention", (
    dispatch.Backend("triton", _triton_unsupported, _triton),
    dispatch.Backend("reference", lambda *args: None, _reference),
), "visionattn: Triton kernels do not cover this call ({reason}); running the exact PyTorch monoid reference "
   "instead")


# ----------------------------------------------------------------------------- public functions
def _needs_grad(q, k, v, bias) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (bias is not None and bias.requires_grad))


def _signature(q, k, v, bias, attn_mask, mode, backend, is_causal, enable_gqa) -> tuple:
    """The :data:`CALLS` key of a dense call: everything its runner depends on (``enable_gqa`` too: a call with
    unequal heads and without it must reach the checks and raise)."""
    return (mode, backend, dispatch._backend, is_causal is True, is_causal is False, enable_gqa is True,
            enable_gqa is False, qkv_key(q, k, v),
            tensor_key(bias), tensor_key(attn_mask),
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (bias is not None and bias.requires_grad)))


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
    mode: str | Mode = "fp32", backend: str | None = None, num_splits: int | None = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """Exact softmax attention ``softmax(scale * q k^T + bias, masked) v``.

    Computed as the ELSA (m, S, W) fold over KV tiles (ELSA supplement, Alg. 1);
    on CUDA by the Triton kernels of :mod:`visionattn.kernels` through the ops of
    the custom ops of this module (a cached runner per call signature), on CPU by
    :func:`visionattn.reference.blocked_attention` (PASA modes by
    :mod:`visionattn.pasa`). Semantics follow
    ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q: query [B, H, Nq, D]; float16 / bfloat16 / float32 / float64; any strides; D >= 1.
        k: key [B, H, Nk, D], same dtype and device; with ``enable_gqa`` [B, Hkv, Nk, D], Hkv dividing H.
        v: value [B, H, Nk, Dv] ([B, Hkv, Nk, Dv] with ``enable_gqa``).
        bias: additive float bias broadcastable to [B, H, Nq, Nk] (e.g. a
            relative position bias [H, Nq, Nk] or [1, H, Nq, Nk]); never expanded in memory.
        attn_mask: boolean mask broadcastable to [B, H, Nq, Nk]; True = attend. A torch tensor: a numpy array
            raises a TypeError (convert it with ``torch.from_numpy(mask)``), as does a sparse or nested tensor.
        is_causal: causal mask (a bool), top-left aligned (key j visible to query i iff j <= i).
        scale: logit scale, a real number; default ``1 / sqrt(D)``.
        mode: precision mode (:data:`visionattn.modes.MODES`): ``fp32``, ``fp32-ieee``,
            ``tf32``, ``fp16``, ``bf16``, ``pasa`` (or the ``fp16-acc16`` baseline).
            Inputs are cast to the mode's dtype; the output is cast back.
        backend: ``auto`` / ``triton`` / ``reference``; default from
            :func:`visionattn.dispatch.get_backend`.
        num_splits: force the number of KV partitions of the split-KV kernel
            (1 = single pass, the memory-lean variant); default chosen by shape.
        enable_gqa: grouped-query / multi-query attention (SDPA's ``enable_gqa``; FlashAttention-2's GQA /
            MQA): query head ``h`` attends with K / V head ``h // (H / Hkv)``, i.e. ``softmax(scale q_h
            k_{h // G}^T + bias_h) v_{h // G}`` with G = H / Hkv, as SDPA's ``repeat_interleave`` of the K / V
            heads. The kernels read the Hkv heads in place (no repeated copy); the backward returns dK / dV of
            the Hkv heads, each summed over its G query heads in a fixed order (reproducible). With equal heads
            it changes nothing. PASA modes (``pasa``, ``fp16-acc16``) run such calls on the reference (warned
            once), which repeats K / V.

    Returns:
        [B, H, Nq, Dv] in q's dtype. A query row whose keys are all masked
        returns zeros (not NaN); so do all rows when Nk = 0 (with zero gradients); an empty batch gives an
        empty output. Differentiable: with inputs that need gradients the dense
        modes run the backward kernels (:data:`visionattn.checks.BACKWARD_MODES`); other calls
        needing gradients run the differentiable reference (warned once), and so does a call inside a
        ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...: the kernels have no functorch rules).
        Under ``torch.jit.trace`` the kernels run as custom ops, which the traced graph records.

    Raises:
        TypeError / ValueError: see :func:`validate_attention_inputs` and :func:`check_flags`;
            unknown mode; ``num_splits`` < 1; FP32 / FP64 inputs beyond float16's range in a
            float16 mode (``fp16``, ``pasa``, ``fp16-acc16``); ``enable_gqa`` not a bool; key / value heads
            other than H without ``enable_gqa``, or not dividing H with it (ValueError, as SDPA raises).
    """
    plain_scale = scale is None or (type(scale) is float and math.isfinite(scale))
    if num_splits is None:
        # a signature seen before was validated then: launch from its plan (same checks, done once)
        key, run = CALLS.lookup(_signature, q, k, v, bias, attn_mask, mode, backend, is_causal, enable_gqa)
        if run is not None and plain_scale:
            return run(q, k, v, bias, attn_mask, scale)
    else:
        key = None
    md = MODES.get(mode) if type(mode) is str else None  # a mode's name: read from the table
    if md is None:
        md = mode_of(mode)  # a Mode, or an unknown name (raises)
    raw_bias = bias
    if enable_gqa is not True and enable_gqa is not False:
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__} {enable_gqa!r}")
    bias, attn_mask = validate_attention_inputs(q, k, v, bias, attn_mask, enable_gqa)
    if plain_scale and (is_causal is True or is_causal is False):  # what check_flags passes through unchanged
        scale = q.shape[-1] ** -0.5 if scale is None else scale
    else:
        scale = check_flags(is_causal, scale, q.shape[-1])
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}; expected a positive int or None")
    args = (q, k, v, bias, attn_mask, is_causal, scale, md, num_splits, key, raw_bias)
    return dispatch.choose(BACKENDS, dispatch.preferred(backend, q.device.type, "attention"), *args).plan(*args)


def _planned(key, q, k, v, bias, attn_mask, is_causal, scale, md: Mode):
    """Run an eager call without gradients from its plan and keep a runner for its signature in :data:`CALLS`.
    The runner takes the caller's raw bias / mask (the plan reads them by data pointer, with the strides of
    their [B, H, Nq, Nk] views) and casts q / k / v when the mode computes in another dtype."""
    out_dtype = q.dtype
    prepare = None if q.dtype == md.compute_dtype else caster(md, q.dtype)
    qc, kc, vc = (q, k, v) if prepare is None else prepare(q, k, v)
    if md.half_scores:
        from .pasa import pasa_kernel_plan

        plan, out = pasa_kernel_plan(qc, kc, vc, bias, attn_mask, is_causal, scale, md.pasa_shift, out_dtype)
        first = False
    else:
        from .kernels.elsa_fwd import plan_for  # (a submodule import: the package's lazy attributes are not asked)

        plan, (out, _) = plan_for(qc, kc, vc, bias, attn_mask, is_causal, scale, md.name, 0, out_dtype)
        first = True  # the dense plan returns (out, lse)
    if plan is not None:
        default = q.shape[-1] ** -0.5
        if prepare is None and first:
            def run(q, k, v, bias, attn_mask, scale):
                return plan(q, k, v, bias, attn_mask, default if scale is None else scale)[0]
        elif prepare is None:
            def run(q, k, v, bias, attn_mask, scale):
                return plan(q, k, v, bias, attn_mask, default if scale is None else scale)
        else:
            def run(q, k, v, bias, attn_mask, scale):
                out = plan(*prepare(q, k, v), bias, attn_mask, default if scale is None else scale)
                return out[0] if first else out

        CALLS.put(key, run)
    return out


def _training_runner(q, is_causal, md: Mode):
    """The runner of an eager call that needs gradients, for :data:`CALLS`: casts as the mode wants and calls
    :class:`_DenseFunction` with the caller's own bias and mask (a bias gradient comes back in the bias's
    shape), the checks of the signature done once, when it was first seen. ``held``: the runner's forward plan,
    kept on its first call."""
    name, default, out_dtype, held = md.name, q.shape[-1] ** -0.5, q.dtype, [None]
    prepare = caster(md, q.dtype)

    def run(q, k, v, bias, attn_mask, scale):
        return dense(*prepare(q, k, v), bias, attn_mask, is_causal, default if scale is None else scale, name,
                     0, out_dtype, True, held)

    return run


def attention_qkvpacked(
    qkv: torch.Tensor, *, bias: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    is_causal: bool = False, scale: float | None = None, mode: str | Mode = "fp32", backend: str | None = None,
) -> torch.Tensor:
    """:func:`attention` over one packed query / key / value tensor, as a fused qkv projection lays it out
    (FlashAttention's ``flash_attn_qkvpacked_func``).

    Same result as ``attention(q, k, v, ...)`` with ``q, k, v = qkv.unbind(2)`` viewed as [B, H, N, D]. When
    gradients are needed and the backward kernels take the call (a mode of
    :data:`visionattn.checks.BACKWARD_MODES` whose compute dtype is ``qkv``'s, the Triton backend, eager), the
    backward writes dQ, dK and dV into one [B, N, 3, H, D] gradient, bit-identical to the unpacked call's: the
    stack of three gradients that ``unbind``'s backward makes, and the copy of it back into the projection's
    layout, are skipped (as flash-attn's packed call returns one ``dqkv``). Every other call runs
    :func:`attention` on the unpacked views.

    Args:
        qkv: [B, N, 3, H, D]: query, key, value stacked in dim 2 (``qkv_proj(x).reshape(B, N, 3, H, D)``); any
            strides.
        bias, attn_mask, is_causal, scale, mode, backend: as :func:`attention`.

    Returns:
        [B, N, H, D] in qkv's dtype (``.reshape(B, N, H * D)`` is free on the kernels' output).

    Raises:
        TypeError: ``qkv`` not a tensor. ValueError: ``qkv`` not [B, N, 3, H, D]. Otherwise as :func:`attention`.
    """
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor [B, N, 3, H, D], got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.layout is not torch.strided:
        check_dense("qkv", qkv)
        raise ValueError(f"qkv must be [B, N, 3, H, D] (query, key, value stacked in dim 2), got shape "
                         f"{tuple(qkv.shape)}")
    if torch.is_grad_enabled() and (qkv.requires_grad or (bias is not None and getattr(bias, "requires_grad", False))):
        key, run = CALLS.lookup(_packed_signature, qkv, bias, attn_mask, mode, backend, is_causal)
        if key is not None and run is None:
            try:
                run = CALLS.put(key, _packed_runner(qkv, bias, attn_mask, is_causal, mode, backend))
            except (TypeError, RuntimeError):  # an unhashable mode, a non-tensor bias: the unpacked call says why
                run = None
        if run and (scale is None or (type(scale) is float and math.isfinite(scale))):
            return run(qkv, bias, attn_mask, scale).transpose(1, 2)
    q, k, v = _unpack_qkv(qkv)
    return attention(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal, scale=scale, mode=mode,
                     backend=backend).transpose(1, 2)


def _packed_signature(qkv, bias, attn_mask, mode, backend, is_causal) -> tuple:
    """The :data:`CALLS` key of a packed call that needs gradients."""
    return ("qkvpacked", mode, backend, dispatch._backend, is_causal is True, is_causal is False, qkv.shape,
            qkv.stride(), qkv.dtype, qkv.device, qkv.data_ptr() & 15, tensor_key(bias), tensor_key(attn_mask))


def _packed_runner(qkv, bias, attn_mask, is_causal, mode, backend):
    """The runner of a packed call signature that needs gradients, for :data:`CALLS`: ``run(qkv, bias, attn_mask,
    scale)`` on :class:`_DensePackedFunction`, or False when that does not take the signature (the unpacked
    :func:`attention` call then runs, with its checks, warnings and fallbacks). Checks as :func:`attention`."""
    md = mode_of(mode)
    q, k, v = _unpack_qkv(qkv.detach())
    views = validate_attention_inputs(q, k, v, bias, attn_mask)
    check_flags(is_causal, None, q.shape[-1])
    if (dispatch.resolve_backend(backend, q.device.type) != "triton" or md.half_scores
            or qkv.dtype != md.compute_dtype or qkv.stride(-1) != 1):  # a head dim not of unit stride: the
        return False  # unpacked call lays it out
    if _triton_unsupported(q, k, v, *views, False, 1.0, md, None, None, None) is not None or not has_backward(md.name):
        return False
    name, default, dtype, held = md.name, q.shape[-1] ** -0.5, qkv.dtype, [None]  # held: the forward plan

    def run(qkv, bias, attn_mask, scale):
        return dense_packed(qkv, bias, attn_mask, is_causal, default if scale is None else scale, name, dtype, held)

    return run
