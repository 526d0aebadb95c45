"""The public attention function: validation, mode casting, backend dispatch."""
from __future__ import annotations

import math
import numbers

import torch

from . import dispatch
from .kernels._launch import PlanCache
from .modes import MODES, Mode, get_mode
from .reference import blocked_attention, no_keys_output

__all__ = ["attention", "attention_qkvpacked", "validate_attention_inputs", "check_flags", "cast_checked",
           "check_float16_range", "check_devices", "CALLS",
           "qkv_key", "tensor_key"]

# public call signature -> a runner that launches from the call's cached plan without validating again (the
# signature was validated when the runner was built); see attention()
CALLS = PlanCache()
_HALF_OR_FP32 = (torch.float16, torch.bfloat16, torch.float32)


def qkv_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What a plan depends on of query, key and value: shapes, strides, dtypes, devices (each one's: a key on
    another device, or on ``meta``, must not reach a runner built for one device), the 16-byte alignment of each data
    pointer."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15)


def tensor_key(t: torch.Tensor | None):
    """What a plan depends on of an optional tensor argument: shape, strides, dtype, device, the 16-byte
    alignment of its data pointer, whether it needs gradients."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15, t.requires_grad

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, t, rank: int = 4, layout: str = "[B, H, N, D]") -> None:
    """Raise naming ``name`` where ``t`` is not a dense float tensor of ``rank`` dims (the first check that fails:
    not a tensor, a nested or sparse tensor, the rank, the dtype)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_dense(name, t)
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of float16, bfloat16, float32, float64")


def _check_dense(name: str, t: torch.Tensor) -> None:
    """Raise a TypeError naming ``name`` for a nested or sparse (non-strided) tensor: the kernels and the reference
    read dense strided memory."""
    if t.is_nested:
        raise TypeError(f"{name} is a nested tensor; attention takes dense [B, H, N, D] tensors: for ragged "
                        f"batches use visionattn.varlen_attention (it takes jagged nested tensors)")
    if t.layout is not torch.strided:
        raise TypeError(f"{name} is a {t.layout} tensor; attention takes dense (strided) tensors: pass "
                        f"{name}.to_dense()")


def _check_operand(name: str, t, hint: str) -> None:
    """Raise naming ``name`` where an optional tensor argument (bias, mask) is not a dense tensor; ``hint`` says
    what to pass instead of an array of another library."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}"
                        + (f"; {hint}" if hasattr(t, "__array__") else ""))
    _check_dense(name, t)


def check_devices(named: dict) -> None:
    """Raise where the tensors of ``named`` ({argument name: tensor or None}) are not on one device, or are on the
    ``meta`` device (shapes without data: nothing to compute from).

    Raises:
        ValueError: naming each argument's device, or the meta tensors.
    """
    devices = {name: t.device for name, t in named.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{name} on {d}" for name, d in devices.items())
        hint = (" (a meta tensor is a shape without data: materialise it first)"
                if any(d.type == "meta" for d in devices.values()) else "")
        raise ValueError(f"all inputs must be on one device, got {listed}{hint}")
    if first.type == "meta":
        name, *others = devices
        also = f", and so are {', '.join(others)}" if others else ""
        raise ValueError(f"{name} is a meta tensor (a shape without data: no values to compute attention from{also}); "
                         f"pass tensors on a real device (a model built on 'meta' needs .to_empty(device=...) and its "
                         f"weights loaded first)")


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


def validate_attention_inputs(q, k, v, bias=None, attn_mask=None):
    """Check q, k, v, bias and attn_mask; return bias/mask as [B, H, Nq, Nk] views.

    Raises:
        TypeError: a non-tensor (a numpy array included: the message says to convert it with
            ``torch.from_numpy``), a nested or sparse tensor, an integer/bool q/k/v, mixed q/k/v dtypes,
            a non-float bias or a non-bool attn_mask.
        ValueError: wrong ranks, mismatched batch/heads/head_dim/key counts, a head dim of 0, a
            bias or mask not broadcastable to [B, H, Nq, Nk], mixed devices (naming each argument's), meta
            tensors (shapes without data).
    """
    for name, t in (("query", q), ("key", k), ("value", v)):
        if (not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_nested or t.dim() != 4
                or t.dtype not in _FLOAT_DTYPES):
            _check_tensor(name, t)
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.layout is not torch.strided):
        _check_operand("bias", bias, "pass a torch float tensor, e.g. torch.from_numpy(bias)")
    if attn_mask is not None and (not isinstance(attn_mask, torch.Tensor) or attn_mask.layout is not torch.strided):
        _check_operand("attn_mask", attn_mask, "pass a torch.bool tensor (True = keep), e.g. "
                                               "torch.from_numpy(mask).to(torch.bool)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key, value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    if (k.device != device or v.device != device or device.type == "meta"
            or (bias is not None and bias.device != device) or (attn_mask is not None and attn_mask.device != device)):
        check_devices({"query": q, "key": k, "value": v, "bias": bias, "attn_mask": attn_mask})
    B, H, Nq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(f"batch/heads mismatch: query {tuple(q.shape)}, key {tuple(k.shape)}, "
                         f"value {tuple(v.shape)}; expected key/value [B={B}, H={H}, Nk, D]")
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


def check_flags(is_causal, scale, head_dim: int) -> float:
    """Check ``is_causal`` (a bool, as SDPA requires) and ``scale`` (None or a finite real number); return the
    logit scale as a float (``head_dim ** -0.5`` for None).

    Raises:
        TypeError: ``is_causal`` not a bool; ``scale`` not a real number (a string, a tensor of more than
            one element, a complex number).
        ValueError: ``scale`` not finite; a tensor ``scale`` that requires grad (it would get none) or is a
            meta tensor.
    """
    if is_causal is not True and is_causal is not False:
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__} {is_causal!r}")
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.is_complex():
            raise TypeError(f"scale must be a real number, got a tensor of shape {tuple(scale.shape)}")
        if scale.requires_grad and torch.is_grad_enabled():
            raise ValueError("scale is a tensor that requires grad, but the logit scale is taken as a number and gets "
                             "no gradient (SDPA refuses a tensor scale); to learn it, multiply q by it and pass "
                             "scale=1.0, or pass float(scale) to train without its gradient")
        if scale.is_meta:
            raise ValueError("scale is a meta tensor (no value); pass a number")
        scale = scale.item()
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale={scale!r}; expected a finite number (default 1/sqrt(head_dim))")
    return scale


def cast_checked(t: torch.Tensor, dtype: torch.dtype, name: str, mode: str) -> torch.Tensor:
    """``t`` cast to the mode's ``dtype``; a cast to float16 that overflows (|x| > 65504) raises instead of
    returning inf / NaN silently.

    The check reads the cast tensor back (one device synchronisation), so it runs only where a cast to
    float16 happens outside CUDA-graph capture and compilation.

    Raises:
        ValueError: finite inputs that float16 cannot hold.
    """
    if t.dtype == dtype:
        return t
    c = t.to(dtype)
    if dtype == torch.float16 and not torch.compiler.is_compiling() and not (
            c.is_cuda and torch.cuda.is_current_stream_capturing()):
        u = _functorch_unwrapped(t)  # under vmap a batched tensor cannot be read as one bool: its values can
        if bool(torch.isinf(u.to(dtype)).any()) and bool(torch.isfinite(u).all()):
            raise ValueError(f"{name} has values beyond float16's range (|x| > 65504) and mode={mode!r} computes "
                             f"in float16; use mode='fp32', 'tf32' or 'bf16', or rescale the inputs")
    return c


def _functorch_unwrapped(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values under every ``torch.func`` transform level (``t`` itself outside the transforms): a batched
    tensor of ``vmap`` unwrapped to the tensor holding every batch entry."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return t
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def check_float16_range(md: Mode, **tensors: torch.Tensor) -> None:
    """Raise :func:`cast_checked`'s ValueError where a mode computing in float16 (``fp16``, ``pasa``,
    ``fp16-acc16``) is given finite float32 / float64 tensors that float16 cannot hold: the paths that do not cast
    through :func:`cast_checked` themselves (the CPU references, the window kernels, which cast inside) keep the
    kernel path's promise instead of returning inf / NaN. Keyword names name the tensors in the error."""
    if md.compute_dtype == torch.float16:
        for name, t in tensors.items():
            if t is not None and t.dtype in (torch.float32, torch.float64):
                cast_checked(t, torch.float16, name, md.name)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
    mode: str | Mode = "fp32", backend: str | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Exact softmax attention ``softmax(scale * q k^T + bias, masked) v``.

    Computed as the ELSA (m, S, W) fold over KV tiles (ELSA supplement, Alg. 1);
    on CUDA by the Triton kernels of :mod:`visionattn.kernels` through the ops of
    :mod:`visionattn.ops` (a cached launch plan per call signature), on CPU by
    :func:`visionattn.reference.blocked_attention` (PASA modes by
    :mod:`visionattn.pasa`). Semantics follow
    ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q: query [B, H, Nq, D]; float16 / bfloat16 / float32 / float64; any strides; D >= 1.
        k: key [B, H, Nk, D], same dtype and device.
        v: value [B, H, Nk, Dv].
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

    Returns:
        [B, H, Nq, Dv] in q's dtype. A query row whose keys are all masked
        returns zeros (not NaN); so do all rows when Nk = 0 (with zero gradients); an empty batch gives an
        empty output. Differentiable: with inputs that need gradients the dense
        modes run the backward kernels (:data:`visionattn.ops.BACKWARD_MODES`); other calls
        needing gradients run the differentiable reference (warned once), and so does a call inside a
        ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...: the kernels have no functorch rules).
        Under ``torch.jit.trace`` the kernels run as custom ops, which the traced graph records.

    Raises:
        TypeError / ValueError: see :func:`validate_attention_inputs` and :func:`check_flags`;
            unknown mode; ``num_splits`` < 1; FP32 / FP64 inputs beyond float16's range in a
            float16 mode (``fp16``, ``pasa``, ``fp16-acc16``).
    """
    key = None
    if num_splits is None and not dispatch.recording():
        # a signature seen before was validated then: launch from its plan (same checks, done once); not while
        # torch.compile or torch.jit.trace records the call (a direct launch would be invisible to the graph)
        try:
            key = (mode, backend, dispatch._backend, is_causal is True, is_causal is False, qkv_key(q, k, v),
                   tensor_key(bias), tensor_key(attn_mask),
                   torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                or (bias is not None and bias.requires_grad)))
            run = CALLS.get(key)
        except (AttributeError, TypeError, RuntimeError):  # not tensors, unhashable: the checks below say why
            key = run = None
        if run is not None and (scale is None or (type(scale) is float and math.isfinite(scale))):
            return run(q, k, v, bias, attn_mask, scale)
    md = _mode_of(mode)
    raw_bias = bias
    bias, attn_mask = validate_attention_inputs(q, k, v, bias, attn_mask)
    scale = check_flags(is_causal, scale, q.shape[-1])
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}; expected a positive int or None")
    if _backend_of(q, backend) == "triton" and not dispatch.functorch_fallback("attention"):
        out = _kernels(q, k, v, bias, attn_mask, is_causal, scale, md, num_splits, key, raw_bias)
        if out is not None:
            return out
    check_float16_range(md, query=q, key=k, value=v)
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
                                    mode=md, block_size=_cpu_block(k.shape[-2]))
    return out.to(q.dtype)


_ops = None


def _ops_module():
    """:mod:`visionattn.ops`, imported on first use (importing triton is slow and not needed on CPU)."""
    global _ops
    if _ops is None:
        from . import ops as ops_module

        _ops = ops_module
    return _ops


def _mode_of(mode: str | Mode) -> Mode:
    """The :class:`Mode` of ``mode`` (a name looked up directly, else :func:`get_mode`, which raises for an unknown
    one)."""
    md = MODES.get(mode) if isinstance(mode, str) else None
    return md if md is not None else get_mode(mode)


def _unpack_qkv(qkv: torch.Tensor):
    """q, k, v [B, H, N, D] as views of a packed [B, N, 3, H, D] tensor (no copy)."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def _backend_of(q: torch.Tensor, backend: str | None) -> str:
    """``triton`` or ``reference`` for a call on ``q``'s device (:func:`visionattn.dispatch.resolve_backend`;
    CUDA tensors under the default ``auto`` skip the lookup)."""
    if q.is_cuda and backend is None and dispatch._backend == "auto":
        return "triton"
    return dispatch.resolve_backend(backend, q.device.type)


def _kernels(q, k, v, bias, attn_mask, is_causal, scale, md: Mode, num_splits, key=None, raw_bias=None):
    """Run the call on the kernels, or return None (after a one-time warning naming why) when they do not
    cover it and the reference must run. With a ``key`` (an eager call of a cacheable signature), an eager
    call on a float16 / bfloat16 / float32 input also stores its runner in :data:`CALLS` (a training call's
    runner goes straight to the autograd function of :func:`visionattn.ops.dense`)."""
    ops = _ops_module()
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (bias is not None and bias.requires_grad))
    (q, k, v), relaid = ops.relaid_inputs(q, k, v)
    if relaid:
        key = None
    if md.half_scores:
        reason = ops.pasa_fwd.pasa_unsupported_reason(q, k, v, bias, attn_mask)
    else:
        reason = ops.elsa_fwd.unsupported_reason(q, k, v, bias, attn_mask, md.name)
    if reason is None and grad and not ops.has_backward(md.name):
        reason = (f"autograd: mode {md.name!r} has no backward kernel" if not md.half_scores
                  else f"autograd: mode {md.name!r} is forward-only on the kernels")
    if reason is not None:
        dispatch.warn_once(f"fallback:{reason}", f"visionattn: Triton kernels do not cover this call ({reason}); "
                                                 f"running the exact PyTorch monoid reference instead")
        return None
    if key is not None and not grad and q.dtype in _HALF_OR_FP32:
        return _planned(key, q, k, v, bias, attn_mask, is_causal, scale, md)
    if key is not None and grad and q.dtype in _HALF_OR_FP32 and not md.half_scores:
        CALLS.put(key, _training_runner(ops, q, is_causal, md))
    qc, kc, vc = _caster(md, q.dtype)(q, k, v)
    # the kernels write the caller's dtype straight from their FP32 state (no half rounding of the output of
    # an FP32 caller in a half mode); float64 callers get FP32 and one cast
    out_dtype = q.dtype if q.dtype != torch.float64 else torch.float32
    if md.half_scores:
        out = ops.pasa(qc, kc, vc, bias, attn_mask, is_causal, scale, md.pasa_shift, out_dtype)
    else:
        # the caller's own bias tensor (its gradient comes back in its shape); the mask as validated
        out = ops.dense(qc, kc, vc, raw_bias if raw_bias is not None else bias, attn_mask, is_causal, scale,
                        md.name, num_splits or 0, out_dtype, grad)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _planned(key, q, k, v, bias, attn_mask, is_causal, scale, md: Mode):
    """Run an eager call without gradients from its plan and keep a runner for its signature in :data:`CALLS`.
    The runner takes the caller's raw bias / mask (the plan reads them by data pointer, with the strides of
    their [B, H, Nq, Nk] views) and casts q / k / v when the mode computes in another dtype."""
    name, out_dtype = md.name, q.dtype
    prepare = _caster(md, q.dtype)
    if md.half_scores:
        plan, out = _ops.pasa_plan(*prepare(q, k, v), bias, attn_mask, is_causal, scale, md.pasa_shift, out_dtype)
    else:
        plan, out = _ops.dense_plan(*prepare(q, k, v), bias, attn_mask, is_causal, scale, name, out_dtype)
    if plan is not None:
        default = q.shape[-1] ** -0.5

        def run(q, k, v, bias, attn_mask, scale):
            return plan(*prepare(q, k, v), bias, attn_mask, default if scale is None else scale)

        CALLS.put(key, run)
    return out


def _training_runner(ops, q, is_causal, md: Mode):
    """The runner of an eager call that needs gradients, for :data:`CALLS`: casts as the mode wants and calls
    the dense autograd function with the caller's own bias and mask (a bias gradient comes back in the bias's
    shape), the checks of the signature done once, when it was first seen."""
    name, default, out_dtype, held = md.name, q.shape[-1] ** -0.5, q.dtype, [None]  # held: the forward plan
    prepare = _caster(md, q.dtype)

    def run(q, k, v, bias, attn_mask, scale):
        return ops.dense(*prepare(q, k, v), bias, attn_mask, is_causal, default if scale is None else scale, name,
                         0, out_dtype, True, held)

    return run


def _caster(md: Mode, dtype_in: torch.dtype):
    """``prepare(q, k, v)`` for inputs of ``dtype_in``: the three cast to the mode's compute dtype by
    :func:`cast_checked` (a float16 overflow raises), or passed through when they already are in it."""
    dtype, name = md.compute_dtype, md.name
    if dtype_in == dtype:
        return lambda q, k, v: (q, k, v)

    def prepare(q, k, v):
        return (cast_checked(q, dtype, "query", name), cast_checked(k, dtype, "key", name),
                cast_checked(v, dtype, "value", name))

    return prepare


def _cpu_block(nk: int) -> int:
    # Large blocks are faster on CPU (fewer Python steps); memory stays O(Nq * block).
    return min(max(nk, 1), 1024)


def attention_qkvpacked(
    qkv: torch.Tensor, *, bias: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
    is_causal: bool = False, scale: float | None = None, mode: str | Mode = "fp32", backend: str | None = None,
) -> torch.Tensor:
    """:func:`attention` over one packed query / key / value tensor, as a fused qkv projection lays it out
    (FlashAttention's ``flash_attn_qkvpacked_func``).

    Same result as ``attention(q, k, v, ...)`` with ``q, k, v = qkv.unbind(2)`` viewed as [B, H, N, D]. When
    gradients are needed and the backward kernels take the call (a mode of
    :data:`visionattn.ops.BACKWARD_MODES` whose compute dtype is ``qkv``'s, the Triton backend, eager), the
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
        _check_dense("qkv", qkv)
        raise ValueError(f"qkv must be [B, N, 3, H, D] (query, key, value stacked in dim 2), got shape "
                         f"{tuple(qkv.shape)}")
    if torch.is_grad_enabled() and not dispatch.recording() and (
            qkv.requires_grad or (bias is not None and getattr(bias, "requires_grad", False))):
        run = None
        try:
            key = ("qkvpacked", mode, backend, dispatch._backend, is_causal is True, is_causal is False, qkv.shape,
                   qkv.stride(), qkv.dtype, qkv.device, qkv.data_ptr() & 15, tensor_key(bias), tensor_key(attn_mask))
            run = CALLS.get(key)
            if run is None:
                run = CALLS.put(key, _packed_runner(qkv, bias, attn_mask, is_causal, mode, backend))
        except (TypeError, RuntimeError):  # an unhashable mode, a non-tensor bias: the unpacked call says why
            run = None
        if run and (scale is None or (type(scale) is float and math.isfinite(scale))):
            return run(qkv, bias, attn_mask, scale).transpose(1, 2)
    q, k, v = _unpack_qkv(qkv)
    return attention(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal, scale=scale, mode=mode,
                     backend=backend).transpose(1, 2)


def _packed_runner(qkv, bias, attn_mask, is_causal, mode, backend):
    """The runner of a packed call signature that needs gradients, for :data:`CALLS`: ``run(qkv, bias, attn_mask,
    scale)`` on the packed autograd function, or False when that does not take the signature (the unpacked
    :func:`attention` call then runs, with its checks, warnings and fallbacks). Checks as :func:`attention`."""
    md = _mode_of(mode)
    q, k, v = _unpack_qkv(qkv.detach())
    views = validate_attention_inputs(q, k, v, bias, attn_mask)
    check_flags(is_causal, None, q.shape[-1])
    if (_backend_of(q, backend) != "triton" or md.half_scores or qkv.dtype != md.compute_dtype
            or qkv.stride(-1) != 1):  # a head dim not of unit stride: the unpacked call lays it out
        return False
    ops = _ops_module()
    if not ops.has_backward(md.name) or ops.elsa_fwd.unsupported_reason(q, k, v, *views, md.name) is not None:
        return False
    name, default, dtype, held = md.name, q.shape[-1] ** -0.5, qkv.dtype, [None]  # held: the forward plan

    def run(qkv, bias, attn_mask, scale):
        return ops.dense_packed(qkv, bias, attn_mask, is_causal, default if scale is None else scale, name, dtype,
                                held)

    return run
