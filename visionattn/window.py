"""Window attention for Swin and Swin-v2: relative position bias and shift mask fused, never expanded.

Swin (Liu et al. 2021) attends inside non-overlapping windows of N = ws*ws
tokens; every window adds the same relative position bias [H, N, N] and, in
shifted blocks, one of nW shift masks [nW, N, N] (window ``b`` uses
``mask[b % nW]``). timm expands both to [B*nW, H, N, N] for its SDPA path;
here they are indexed per window inside the kernel (docs/design.md, "How a call reaches a kernel").
Swin-v2 (Liu et al. 2022) adds cosine attention: q and k are L2-normalized and
the logits multiplied by a per-head ``exp(min(logit_scale, log 100))``, with the
bias ``16 * sigmoid(cpb_mlp(...))`` computed once per forward by the caller.

* :func:`window_attention` — the public function (validation, dispatch);
* :func:`window_attention_qkvpacked` — the same over one packed qkv (timm's fused projection), whose training
  backward writes one packed gradient;
* :func:`window_attention_reference` — the PyTorch reference in a mode's
  arithmetic (CPU path, differentiable fallback, float64 oracle with
  ``state_dtype=torch.float64``);
* the custom ops ``visionattn::window_attention``, ``visionattn::window_attention_lse`` (its registered autograd
  formula calls ``visionattn::window_attention_backward``) with fake implementations, recorded by
  ``torch.compile`` / ``torch.jit.trace``; eager calls run the same implementations without the torch dispatcher
  (about 18 us of host time per op call, measured on CPU, against 0.8 us for the direct call), through
  :class:`_WindowFunction`, :class:`_CosineWindowFunction` (the kernels normalise Swin-v2's q and k) and
  :class:`_WindowPackedFunction` (one packed gradient), whose backward is the same formula;
* :data:`BACKENDS` (the window kernels, then the reference), read by :func:`visionattn.dispatch.choose`, and
  :data:`CALLS`, this family's cache of runners keyed at the public call.

Kernel modules are imported inside the functions that launch them: importing Triton is slow, and CPU calls never
need it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import dispatch
from .checks import (BACKWARD_MODES, FLOAT_DTYPES, KERNEL_DTYPES, check_dense, check_devices, check_flags,
                     check_float16_range, check_operand, first_order_only)
from .kernels._launch import PlanCache, interpreting, qkv_key, recording, tensor_key, unit_last_stride
from .modes import MODES, Mode, get_mode

__all__ = ["window_attention", "window_attention_qkvpacked", "window_attention_reference", "validate_window_inputs",
           "window_kernel", "window_packed", "BACKENDS", "CALLS"]

_MAX_KERNEL_HEAD_DIM = 256
_LOG_100 = math.log(100.0)

# public call signature -> a runner that launches from the call's plan (or goes straight to the autograd function)
# without validating again; see window_attention()
CALLS = PlanCache()


def validate_window_inputs(q, k, v, relative_position_bias, shift_mask, num_windows, cosine, logit_scale):
    """Check window attention inputs; return ``(bias [H, N, N] | None, mask [nW, N, N] float | None,
    logit_scale [H] | None)``.

    A bias of shape [1, H, N, N] (timm's ``_get_rel_pos_bias()``) is accepted and
    viewed as [H, N, N]; a boolean mask (True = attend) is turned into an additive
    float mask (0 / -inf) of the same [nW, N, N] size.

    Raises:
        TypeError: non-tensors (numpy arrays included), nested or sparse tensors, non-float
            q/k/v/bias/logit_scale, mixed q/k/v dtypes, a ``cosine`` that is not a bool.
        ValueError: wrong ranks or shapes, a head dim of 0, ``num_windows`` not a positive int dividing the
            window batch, mask windows != ``num_windows``, ``cosine`` without ``logit_scale``
            (or ``logit_scale`` without ``cosine``), mixed devices, meta tensors (no data).
    """
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested or t.layout is not torch.strided:
            check_dense(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B*nW, H, N, D], got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key, value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    BW, H, N, D = q.shape
    if tuple(k.shape) != (BW, H, N, D):
        raise ValueError(f"key shape {tuple(k.shape)} must equal query shape {tuple(q.shape)} "
                         f"(window attention is self-attention inside a window)")
    if tuple(v.shape[:3]) != (BW, H, N):
        raise ValueError(f"value shape {tuple(v.shape)} must be [B*nW={BW}, H={H}, N={N}, Dv]")
    if D == 0:
        raise ValueError("query and key have head_dim 0; window attention needs head_dim >= 1 (the last dim of "
                         "[B*nW, H, N, D])")
    if isinstance(num_windows, bool) or not isinstance(num_windows, int) or num_windows < 1:
        raise ValueError(f"num_windows={num_windows!r}; expected a positive int (windows per image, nW)")
    if BW % num_windows:
        raise ValueError(f"num_windows={num_windows} does not divide the window batch B*nW={BW}")
    if cosine is not True and cosine is not False:
        raise TypeError(f"cosine must be a bool, got {type(cosine).__name__} {cosine!r}")
    operands = (relative_position_bias, shift_mask, logit_scale)
    for name, t in zip(("relative_position_bias", "shift_mask", "logit_scale"), operands):
        if t is not None and (not isinstance(t, torch.Tensor) or t.is_nested or t.layout is not torch.strided):
            check_operand(name, t, "pass a torch tensor, e.g. torch.from_numpy(...)")
    device = q.device
    if device.type == "meta" or any(t is not None and t.device != device for t in (k, v, *operands)):
        check_devices({"query": q, "key": k, "value": v, "relative_position_bias": relative_position_bias,
                       "shift_mask": shift_mask, "logit_scale": logit_scale})
    bias = relative_position_bias
    if bias is not None:
        if not bias.is_floating_point():
            raise TypeError(f"relative_position_bias must be a float tensor, got {bias.dtype}")
        if bias.dim() == 4 and bias.shape[0] == 1:
            bias = bias[0]
        if tuple(bias.shape) != (H, N, N):
            raise ValueError(f"relative_position_bias has shape {tuple(relative_position_bias.shape)}; "
                             f"expected [H, N, N] = [{H}, {N}, {N}] (shared by all windows)")
    mask = shift_mask
    if mask is not None:
        if mask.dim() != 3 or tuple(mask.shape) != (num_windows, N, N):
            raise ValueError(f"shift_mask has shape {tuple(mask.shape)}; expected [nW, N, N] = "
                             f"[{num_windows}, {N}, {N}] with nW = num_windows")
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill_(~mask, float("-inf"))
        elif not mask.is_floating_point():
            raise TypeError(f"shift_mask must be an additive float mask (0 / -inf or -100) or bool, got {mask.dtype}")
    if cosine:
        if logit_scale is None:
            raise ValueError("cosine=True (Swin-v2) needs logit_scale, the per-head [H, 1, 1] parameter")
        if not logit_scale.is_floating_point():
            raise TypeError(f"logit_scale must be a float tensor (timm's per-head [H, 1, 1] parameter), got "
                            f"{logit_scale.dtype}")
        if logit_scale.numel() != H:
            raise ValueError(f"logit_scale must be a float tensor with H={H} elements ([H, 1, 1] or [H]), "
                             f"got {logit_scale.dtype} {tuple(logit_scale.shape)}")
        logit_scale = logit_scale.reshape(H)
    elif logit_scale is not None:
        raise ValueError("logit_scale is only used with cosine=True (Swin-v2); pass cosine=True or drop it")
    return bias, mask, logit_scale


def window_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, relative_position_bias: torch.Tensor | None = None,
    shift_mask: torch.Tensor | None = None, num_windows: int = 1, cosine: bool = False,
    logit_scale: torch.Tensor | None = None, scale: float | None = None, mode: str | Mode = "fp32",
    state_dtype: torch.dtype = torch.float32, max_chunk_elems: int = 1 << 24,
) -> torch.Tensor:
    """Window attention in PyTorch, emulating a mode's arithmetic (the CPU path).

    Same arguments as :func:`window_attention` (already validated; ``shift_mask``
    additive float). Windows are processed in chunks of whole images, scores
    viewed as [images, nW, H, N, N] so bias and mask broadcast per group: the bias
    is never expanded over B*nW. The arithmetic mirrors the kernel: inputs
    rounded to the mode's compute dtype, cosine normalization in ``state_dtype``
    then rounded again, FP32 scores and state, P rounded to half before ``P @ V``
    in half modes; ``pasa`` / ``fp16-acc16`` round the (pre-scaled, for pasa
    mean-shifted) scores to FP16 (an emulation of FP16 accumulation). ``tf32``
    runs FP32 (inside its contract). ``state_dtype=torch.float64`` skips all
    rounding: the float64 oracle.

    Returns:
        [B*nW, H, N, Dv] in ``state_dtype``. Differentiable.
    """
    md = get_mode(mode)
    BW, H, N, D = q.shape
    oracle = state_dtype == torch.float64
    rnd = (lambda t: t) if oracle else (lambda t: t.to(md.compute_dtype).to(state_dtype))
    qc, kc, vc = (rnd(t.to(state_dtype)) if oracle else rnd(t) for t in (q, k, v))
    if q.numel() == 0 or v.numel() == 0:  # no windows, heads, tokens or value dims: empty, kept in the graph
        out = (qc @ kc.transpose(-1, -2)) @ vc
        for t in (relative_position_bias, logit_scale):
            if t is not None:
                out = out + t.sum().to(state_dtype)  # added to no element: only joins the graph
        return out
    if cosine:
        qc = rnd(F.normalize(qc, dim=-1, eps=1e-12))
        kc = rnd(F.normalize(kc, dim=-1, eps=1e-12))
        mult = torch.exp(torch.clamp(logit_scale.reshape(H).to(state_dtype), max=_LOG_100)).view(1, H, 1, 1)
    else:
        mult = D ** -0.5 if scale is None else float(scale)
    n_slot = num_windows if shift_mask is not None else 1
    bias = None if relative_position_bias is None else relative_position_bias.reshape(H, N, N).to(state_dtype)
    mask = None if shift_mask is None else shift_mask.to(state_dtype)
    half_p = (not oracle) and md.compute_dtype in (torch.float16, torch.bfloat16)
    imgs_per_chunk = max(1, max_chunk_elems // max(1, n_slot * H * N * N))
    outs = []
    for start in range(0, BW, imgs_per_chunk * n_slot):
        stop = min(BW, start + imgs_per_chunk * n_slot)
        qb, kb, vb = qc[start:stop], kc[start:stop], vc[start:stop]
        if md.half_scores and not oracle:
            ks = kb - kb.mean(dim=-2, keepdim=True) if md.name == "pasa" else kb
            s = (rnd(qb * mult) @ rnd(ks).transpose(-1, -2)).to(torch.float16).to(state_dtype)
        else:
            s = (qb @ kb.transpose(-1, -2)) * mult
        s = s.view(-1, n_slot, H, N, N)
        if bias is not None:
            s = s + bias
        if mask is not None:
            s = s + mask.unsqueeze(1)
        s = s.view(-1, H, N, N)
        m = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
        l = e.sum(dim=-1, keepdim=True)
        pe = e.to(md.compute_dtype).to(state_dtype) if half_p else e
        outs.append((pe @ vb) / torch.where(l > 0, l, torch.ones_like(l)))
    return torch.cat(outs, dim=0)


# ----------------------------------------------------------------------------- custom ops and autograd
def _heads_inner_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An empty [B*nW, H, N, Dv] output in q's dtype, a view of a [B*nW, N, H, Dv] buffer (the kernels' layout)."""
    B, H, N = q.shape[:3]
    return q.new_empty((B, N, H, v.shape[3])).transpose(1, 2)


@torch.library.custom_op("visionattn::window_attention", mutates_args=())
def _window_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
               mask: Optional[torch.Tensor], logit_scale: Optional[torch.Tensor], num_windows: int, cosine: bool,
               scale: float, mode: str) -> torch.Tensor:
    from .kernels import window_fwd

    from .kernels import window_fwd

    return window_fwd.window_forward(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)


@_window_op.register_fake
def _(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode):
    return _heads_inner_like(q, v)


@torch.library.custom_op("visionattn::window_attention_lse", mutates_args=())
def _window_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                   mask: Optional[torch.Tensor], logit_scale: Optional[torch.Tensor],
                   head_scale: Optional[torch.Tensor], num_windows: int, cosine: bool, scale: float,
                   mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [B*nW, H, N] float32) of the training path. With ``cosine``, q and k come L2-normalised already
    (used as given) and ``logit_scale`` [H] (no gradient) sets the kernel's ``exp(min(logit_scale, log 100))``;
    ``head_scale`` [H], that same factor computed by autograd, is only saved for the backward (its gradient)."""
    from .kernels import window_fwd

    return window_fwd.window_forward(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode,
                                     with_lse=True, normalized=True)


@_window_lse_op.register_fake
def _(q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode):
    return _heads_inner_like(q, v), q.new_empty(q.shape[:3], dtype=torch.float32)


def _window_backward(q, k, v, bias, mask, head_scale, out, lse, grad_out, num_windows, scale, mode, needs):
    """(dq, dk, dv, dbias, dhead_scale) by the window backward kernels from the saved LSE; q / k / v cast to the
    mode's compute dtype for the kernels, their gradients cast back to the callers' dtypes. ``needs``: the
    autograd ``needs_input_grad`` of (q, k, v, bias, mask, logit_scale, head_scale, ...); dbias [H, N, N] in the
    bias's dtype, dhead_scale [H] in its dtype, None where not needed."""
    from .kernels import window_bwd

    dtype = MODES[mode].compute_dtype
    dq, dk, dv, dbias, dhs = window_bwd.window_backward(
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


_window_lse_op.register_autograd(_window_op_backward, setup_context=_window_setup_context)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=1e-12)`` for the cosine training path: eagerly one kernel each way
    (:func:`visionattn.kernels.l2norm.l2_normalize`; PyTorch autograd takes ~8 kernels per tensor and direction
    on timm's strided views), under ``torch.compile`` PyTorch's, which the compiler fuses itself (and so under
    ``torch.jit.trace``, whose graph cannot hold the kernel's direct launch)."""
    from .kernels import l2norm

    if (not recording() and x.stride(-1) == 1
            and x.shape[-1] <= l2norm.MAX_HEAD_DIM and x.numel() and (x.is_cuda or interpreting())):
        # F.normalize's result dtype: under autocast its norm is FP32, and the division promotes to it
        autocast = torch.is_autocast_enabled(x.device.type)
        return l2norm.l2_normalize(x, 1e-12, torch.float32 if autocast else x.dtype)
    return torch.nn.functional.normalize(x, dim=-1, eps=1e-12)


class _WindowFunction(torch.autograd.Function):
    """Eager autograd for the window kernels: the forward writes the per-row LSE and saves (q, k, v, bias, mask,
    head scale, out, lse); the backward recomputes the probabilities tile by tile (FlashAttention-2, Alg. 2).
    Arguments as ``visionattn::window_attention_lse`` (with ``cosine``, q and k L2-normalised already: the kernel
    uses them as given, so its LSE belongs to exactly the logits the backward recomputes); the mask never gets a
    gradient."""

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode):
        from .kernels import window_fwd

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
        from .kernels import window_bwd

        dq, dk, dv, dbias, dhs = window_bwd.backward_after_forward(
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
        from .kernels import window_fwd

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
        from .kernels import window_bwd

        dq, dk, dv, dbias, dls = window_bwd.backward_after_forward(
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
        from .kernels import window_fwd

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
        from .kernels import window_bwd

        dbias, dls = window_bwd.backward_after_forward(
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
    :func:`window_kernel` takes them (``cosine``: q and k as given, normalised by the kernels)."""
    return _WindowPackedFunction.apply(qkv, bias, mask, logit_scale, num_windows, cosine, scale, mode)


def window_kernel(q, k, v, bias, mask, logit_scale, num_windows: int, cosine: bool, scale: float, mode: str,
           grad: bool = False) -> torch.Tensor:
    """Window attention on the kernels; inputs validated (:func:`validate_window_inputs`).

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
        from .kernels.window_bwd import FUSED_MAX_TOKENS

        head_scale = None
        if (cosine and q.shape[2] <= FUSED_MAX_TOKENS and MODES[mode].compute_dtype != torch.float32
                and not recording()):
            # half modes; with FP32 products the normalising kernels spill more than the two row kernels cost
            # (docs/tuning.md)
            return _CosineWindowFunction.apply(q, k, v, bias, mask, logit_scale, num_windows, mode)
        if cosine:
            q, k = _normalize(q), _normalize(k)
            # in FP32 like the kernel's own exp(min(logit_scale, log 100)): a half-precision c would differ
            # from the forward's by up to half an ulp, shifting the recomputed logits by up to ~0.03 at c = 100
            head_scale = torch.exp(torch.clamp(logit_scale.float(), max=_LOG_100))
            logit_scale = logit_scale.detach()
        if recording():
            return _window_lse_op(q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode)[0]
        return _WindowFunction.apply(q, k, v, bias, mask, logit_scale, head_scale, num_windows, cosine, scale, mode)
    if recording():
        return _window_op(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)
    from .kernels import window_fwd

    from .kernels import window_fwd

    return window_fwd.window_forward(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)


def window_plan(q, k, v, bias, mask, logit_scale, num_windows: int, cosine: bool, scale: float, mode: str):
    """Eager: ``(plan, out)`` of a window call (:func:`visionattn.kernels.window_fwd.plan_for`); bias / mask
    with a unit last stride, ``logit_scale`` [H]."""
    from .kernels.window_fwd import plan_for  # (a submodule import: the package's lazy attributes are not asked)

    return plan_for(q, k, v, bias, mask, logit_scale, num_windows, cosine, scale, mode)


def window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, relative_position_bias: torch.Tensor | None = None,
    shift_mask: torch.Tensor | None = None, num_windows: int, cosine: bool = False,
    logit_scale: torch.Tensor | None = None, scale: float | None = None, mode: str | Mode = "fp32",
    backend: str | None = None,
) -> torch.Tensor:
    """Swin / Swin-v2 window attention with fused relative position bias and shift mask.

    ``y[b, h] = softmax(c * q[b, h] k[b, h]^T + bias[h] + shift_mask[b % nW]) v[b, h]``
    where ``c = scale`` (Swin) or, with ``cosine=True`` (Swin-v2), q and k are
    L2-normalized (``F.normalize``, eps 1e-12) and ``c = exp(min(logit_scale[h], log 100))``.
    Computed per window as one ELSA (m, S, W) fold (ELSA supplement, Alg. 1); the
    bias and mask are read per window, never expanded to [B*nW, H, N, N].

    Args:
        q, k: [B*nW, H, N, D] (N = window area: 49, 64, 144, 256, 576, ...); float16 /
            bfloat16 / float32 / float64; any strides (timm's ``qkv.unbind`` views).
        v: [B*nW, H, N, Dv].
        relative_position_bias: float [H, N, N] (or [1, H, N, N]) shared by all windows;
            Swin-v2 callers pass ``16 * sigmoid(cpb)`` already computed.
        shift_mask: [nW, N, N], additive float (0 / -inf, or timm's -100) or bool
            (True = attend); window ``b`` uses ``shift_mask[b % nW]``.
        num_windows: nW, windows per image (must divide B*nW).
        cosine: Swin-v2 cosine attention.
        logit_scale: timm's per-head parameter [H, 1, 1] (required iff ``cosine``).
        scale: logit scale for non-cosine attention, default ``D ** -0.5``; ignored when ``cosine``.
        mode: precision mode (:data:`visionattn.modes.MODES`); inputs are cast to the mode's
            dtype inside the kernel, the output has q's dtype.
        backend: ``auto`` / ``triton`` / ``reference`` (default :func:`visionattn.get_backend`).

    Returns:
        [B*nW, H, N, Dv] in q's dtype. On the Triton path it is a view of a contiguous
        [B*nW, N, H, Dv] buffer, so ``y.transpose(1, 2).reshape(B*nW, N, H*Dv)`` is free.
        Rows whose keys are all masked return zeros. No windows (B*nW = 0) or no tokens (N = 0): an empty
        output of that shape (zero gradients), as SDPA gives for an empty batch; ``num_windows`` stays >= 1.

    Raises:
        TypeError / ValueError: see :func:`validate_window_inputs`; unknown mode or backend.
        RuntimeError: ``backend='triton'`` on CPU tensors without ``TRITON_INTERPRET=1``.

    Differentiable. When q, k, v, the bias or ``logit_scale`` need gradients, the modes with backward
    kernels (:data:`visionattn.checks.BACKWARD_MODES`: fp32, fp32-ieee, tf32, fp16, bf16) save each row's
    log-sum-exp and run the window backward kernels (gradients of q, k, v, of the bias in its own shape and,
    through PyTorch autograd, of ``logit_scale`` and whatever computed the bias; the shift mask gets none);
    ``pasa`` / ``fp16-acc16`` are forward-only there and run the differentiable PyTorch reference (with a
    one-time warning), as do calls inside a ``torch.func`` transform. Under ``torch.jit.trace`` the kernels run as
    custom ops, which the traced graph records.
    """
    # a signature seen before was validated then: launch from its plan (same checks, done once)
    key, run = CALLS.lookup(_signature, q, k, v, relative_position_bias, shift_mask, logit_scale, num_windows, cosine,
                            mode, backend)
    plain_scale = scale is None or (type(scale) is float and math.isfinite(scale))
    if run is not None and plain_scale:
        return run(q, k, v, relative_position_bias, shift_mask, logit_scale, scale)
    md = MODES.get(mode) if type(mode) is str else None  # a mode's name: read from the table
    if md is None:
        md = get_mode(mode)  # a Mode, or an unknown name (raises)
    bias, mask, ls = validate_window_inputs(q, k, v, relative_position_bias, shift_mask, num_windows, cosine,
                                            logit_scale)
    if plain_scale:  # what check_flags passes through unchanged
        scale = q.shape[-1] ** -0.5 if scale is None else scale
    else:
        scale = check_flags(False, scale, q.shape[-1])
    if md.compute_dtype == torch.float16 and q.dtype != torch.float16:
        # both paths cast to float16 inside (the kernels, the reference): overflow raises as the dense call's
        # cast does, on every call (no cached runner for the signature, which would skip the check)
        check_float16_range(md, q=q, k=k, v=v)
        key = None
    args = (q, k, v, bias, mask, ls, num_windows, bool(cosine), scale, md, key,
            (relative_position_bias, shift_mask, logit_scale))
    return dispatch.choose(BACKENDS, dispatch.preferred(backend, q.device.type, "window_attention"), *args).plan(*args)


def _signature(q, k, v, bias, mask, logit_scale, num_windows, cosine, mode, backend) -> tuple:
    """The :data:`CALLS` key of a window call: everything its runner depends on."""
    return (mode, backend, dispatch._backend, num_windows, cosine is True, cosine is False, qkv_key(q, k, v),
            tensor_key(bias), tensor_key(mask), tensor_key(logit_scale),
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or _needs_grad(bias, logit_scale)))


# ----------------------------------------------------------------------------- backend table
def _triton_unsupported(q, k, v, bias, mask, ls, num_windows, cosine, scale, md: Mode, key, raw) -> str | None:
    """Why the window kernels cannot run this call (None when they can): a dtype or head dim they do not take,
    or gradients in a mode whose window kernels are forward-only (``pasa``, ``fp16-acc16``)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or _needs_grad(bias, ls))
    return _kernel_unsupported(q, v, md, grad)


def _triton(q, k, v, bias, mask, ls, num_windows, cosine, scale, md: Mode, key, raw):
    """Run the call on the window kernels and, with a ``key``, keep its runner in :data:`CALLS`. ``raw``: the
    caller's (relative_position_bias, shift_mask, logit_scale), which a runner reads where validation passed
    them through."""
    relative_position_bias, shift_mask, logit_scale = raw
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or _needs_grad(bias, ls))
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (unit_last_stride(t) for t in (q, k, v))  # the only layout the kernels take
        key = None  # the runner would pass the caller's layout on
    scale = float(scale)
    if grad:  # the backward kernels, from the LSE the forward saves
        if key is not None and mask is shift_mask:  # later calls: straight to the autograd function
            CALLS.put(key, _training_runner(q, bias is not relative_position_bias, cosine, num_windows, md.name))
        return window_kernel(q, k, v, bias, mask, ls, num_windows, cosine, scale, md.name, grad=True)
    # the runner reads the caller's bias / mask / logit_scale by data pointer: only where validation
    # made views of them (a bool mask becomes a new float tensor; a strided one is copied)
    if key is not None and mask is shift_mask and all(
            t is None or (t.stride(-1) == 1 and t.data_ptr() == r.data_ptr())
            for t, r in ((bias, relative_position_bias), (mask, shift_mask), (ls, logit_scale))):
        plan, out = window_plan(q, k, v, bias, mask, ls, num_windows, cosine, scale, md.name)
        default = q.shape[-1] ** -0.5
        CALLS.put(key, lambda q, k, v, b, m, ls, s: plan(q, k, v, b, m, ls, default if s is None else s))
        return out
    return window_kernel(q, k, v, bias, mask, ls, num_windows, cosine, scale, md.name)


def _reference(q, k, v, bias, mask, ls, num_windows, cosine, scale, md: Mode, key, raw):
    """:func:`window_attention_reference` in the mode's arithmetic, in q's dtype; differentiable."""
    with torch.autocast(q.device.type, enabled=False):  # the mode fixes the arithmetic, not an enclosing autocast
        out = window_attention_reference(q, k, v, relative_position_bias=bias, shift_mask=mask,
                                         num_windows=num_windows, cosine=cosine, logit_scale=ls, scale=scale,
                                         mode=md)
    return out.to(q.dtype)


# backends of window_attention() in priority order; dispatch.choose reads it
BACKENDS = dispatch.BackendTable("window", (
    dispatch.Backend("triton", _triton_unsupported, _triton),
    dispatch.Backend("reference", lambda *args: None, _reference),
), "visionattn.window_attention: the Triton window kernel does not cover this call ({reason}); running the exact "
   "PyTorch reference instead")


def window_attention_qkvpacked(
    qkv: torch.Tensor, *, relative_position_bias: torch.Tensor | None = None,
    shift_mask: torch.Tensor | None = None, num_windows: int, cosine: bool = False,
    logit_scale: torch.Tensor | None = None, scale: float | None = None, mode: str | Mode = "fp32",
    backend: str | None = None,
) -> torch.Tensor:
    """:func:`window_attention` over one packed query / key / value tensor, as timm's fused qkv projection lays it
    out (``qkv(x).reshape(B*nW, N, 3, H, D)``).

    Same result as ``window_attention(q, k, v, ...)`` with ``q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)``.
    When gradients are needed and the fused window backward takes the call (windows of at most 64 tokens, a mode
    with backward kernels whose compute dtype is ``qkv``'s, a float or no shift mask, the Triton backend, eager),
    the backward writes dQ, dK and dV into one [B*nW, N, 3, H, D] gradient, bit-identical to the unpacked call's:
    the stack of three gradients that ``unbind``'s backward makes, and the copy of it back into the projection's
    layout, are skipped (two passes over the whole qkv gradient). Every other call runs :func:`window_attention`
    on the unpacked views.

    Args:
        qkv: [B*nW, N, 3, H, D]: query, key, value stacked in dim 2; any strides.
        relative_position_bias, shift_mask, num_windows, cosine, logit_scale, scale, mode, backend: as
            :func:`window_attention`.

    Returns:
        [B*nW, N, H, D] in qkv's dtype (``.reshape(B*nW, N, H * D)`` is free on the kernels' output).

    Raises:
        TypeError: ``qkv`` not a tensor. ValueError: ``qkv`` not [B*nW, N, 3, H, D]. Otherwise as
        :func:`window_attention`.
    """
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor [B*nW, N, 3, H, D], got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.layout is not torch.strided:
        check_dense("qkv", qkv)
        raise ValueError(f"qkv must be [B*nW, N, 3, H, D] (query, key, value stacked in dim 2), got shape "
                         f"{tuple(qkv.shape)}")
    bias, ls = relative_position_bias, logit_scale
    if torch.is_grad_enabled() and (
            qkv.requires_grad or _needs_grad(*(t if isinstance(t, torch.Tensor) else None for t in (bias, ls)))):
        key, run = CALLS.lookup(_packed_signature, qkv, bias, shift_mask, ls, num_windows, cosine, mode, backend)
        if key is not None and run is None:
            try:
                run = CALLS.put(key, _packed_runner(qkv, bias, shift_mask, num_windows, cosine, ls, mode, backend))
            except (TypeError, RuntimeError):  # an unhashable mode, a non-tensor bias: the unpacked call says why
                run = None
        if run and (scale is None or (type(scale) is float and math.isfinite(scale))):
            return run(qkv, bias, shift_mask, ls, scale).transpose(1, 2)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return window_attention(q, k, v, relative_position_bias=bias, shift_mask=shift_mask, num_windows=num_windows,
                            cosine=cosine, logit_scale=ls, scale=scale, mode=mode, backend=backend).transpose(1, 2)


def _packed_signature(qkv, bias, shift_mask, logit_scale, num_windows, cosine, mode, backend) -> tuple:
    """The :data:`CALLS` key of a packed window call that needs gradients."""
    return ("window-qkvpacked", mode, backend, dispatch._backend, num_windows, cosine is True, cosine is False,
            qkv.shape, qkv.stride(), qkv.dtype, qkv.device, qkv.data_ptr() & 15, tensor_key(bias),
            tensor_key(shift_mask), tensor_key(logit_scale))


def _packed_runner(qkv, relative_position_bias, shift_mask, num_windows, cosine, logit_scale, mode, backend):
    """The runner of a packed window call signature that needs gradients, for :data:`CALLS`: ``run(qkv, bias,
    mask, logit_scale, scale)`` on :func:`window_packed`, or False where that does not take the
    signature (the unpacked :func:`window_attention` call then runs, with its checks, warnings and fallbacks).
    Checks as :func:`window_attention`."""
    md = get_mode(mode)
    q, k, v = qkv.detach().permute(2, 0, 3, 1, 4).unbind(0)
    bias, mask, ls = validate_window_inputs(q, k, v, relative_position_bias, shift_mask, num_windows, cosine,
                                            logit_scale)
    check_flags(False, None, q.shape[-1])
    if (dispatch.resolve_backend(backend, q.device.type) != "triton" or mask is not shift_mask
            or qkv.dtype != md.compute_dtype or _kernel_unsupported(q, v, md, True) is not None
            or qkv.stride(-1) != 1):
        return False  # (a head dim not of unit stride: the unpacked call lays it out)
    from .kernels.window_bwd import FUSED_MAX_TOKENS  # imports Triton: only on the kernel path

    if q.shape[2] > FUSED_MAX_TOKENS:
        return False  # windows the fused backward kernel does not take: the unpacked call runs them
    H, squeeze_bias, cosine = q.shape[1], bias is not relative_position_bias, bool(cosine)
    default, name = q.shape[-1] ** -0.5, md.name

    def run(qkv, bias, mask, logit_scale, scale):
        bias, logit_scale = _validated_views(bias, logit_scale, squeeze_bias, H)
        return window_packed(qkv, bias, mask, logit_scale, num_windows, cosine,
                                 default if scale is None else scale, name)

    return run


def _training_runner(q, squeeze_bias: bool, cosine: bool, num_windows: int, mode: str):
    """The runner of a window call that needs gradients, for :data:`CALLS`: :func:`_validated_views` of the caller's
    bias and ``logit_scale``, then :func:`window_kernel`; the signature's checks ran when it was first seen.
    Kept only for float (or no) shift masks, which validation passes through as given."""
    H = q.shape[1]
    default = q.shape[-1] ** -0.5

    def run(q, k, v, bias, mask, logit_scale, scale):
        bias, logit_scale = _validated_views(bias, logit_scale, squeeze_bias, H)
        return window_kernel(q, k, v, bias, mask, logit_scale, num_windows, cosine, default if scale is None else scale,
                          mode, grad=True)

    return run


def _validated_views(bias, logit_scale, squeeze_bias: bool, H: int):
    """The views :func:`validate_window_inputs` makes of a caller's bias ([1, H, N, N] -> [H, N, N] where
    ``squeeze_bias``) and ``logit_scale`` (-> [H]), taken again for a signature it already checked; autograd carries
    their gradients back through them."""
    if squeeze_bias:
        bias = bias[0]
    return bias, None if logit_scale is None else logit_scale.reshape(H)


def _needs_grad(bias, logit_scale) -> bool:
    """Whether the relative position bias or ``logit_scale`` (tensors or None) requires gradients; the shift
    mask never gets one."""
    return (bias is not None and bias.requires_grad) or (logit_scale is not None and logit_scale.requires_grad)


def _kernel_unsupported(q, v, md: Mode, grad: bool) -> str | None:
    """Why the window kernels cannot run this call (None when they can): a dtype or head dim they do not take,
    or gradients in a mode whose window kernels are forward-only (``pasa``, ``fp16-acc16``)."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}"
    if max(q.shape[-1], v.shape[-1]) > _MAX_KERNEL_HEAD_DIM:
        return f"head dim > {_MAX_KERNEL_HEAD_DIM}"
    if grad and md.name not in BACKWARD_MODES:
        return f"gradients requested; mode {md.name!r} is forward-only on the window kernel"
    return None
