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
  ``state_dtype=torch.float64``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import dispatch
from .api import (CALLS, _check_dense, _check_operand, check_devices, check_flags, check_float16_range, qkv_key,
                  tensor_key)
from .modes import Mode, get_mode

__all__ = ["window_attention", "window_attention_qkvpacked", "window_attention_reference", "validate_window_inputs"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_KERNEL_HEAD_DIM = 256
_LOG_100 = math.log(100.0)


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
        _check_dense(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B*nW, H, N, D], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
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
    for name, t in (("relative_position_bias", relative_position_bias), ("shift_mask", shift_mask),
                    ("logit_scale", logit_scale)):
        if t is not None:
            _check_operand(name, t, "pass a torch tensor, e.g. torch.from_numpy(...)")
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
    kernels (:data:`visionattn.ops.BACKWARD_MODES`: fp32, fp32-ieee, tf32, fp16, bf16) save each row's
    log-sum-exp and run the window backward kernels (gradients of q, k, v, of the bias in its own shape and,
    through PyTorch autograd, of ``logit_scale`` and whatever computed the bias; the shift mask gets none);
    ``pasa`` / ``fp16-acc16`` are forward-only there and run the differentiable PyTorch reference (with a
    one-time warning), as do calls inside a ``torch.func`` transform. Under ``torch.jit.trace`` the kernels run as
    custom ops, which the traced graph records.
    """
    key = None
    if not dispatch.recording():
        # a signature seen before was validated then: launch from its plan (same checks, done once); not while
        # torch.compile or torch.jit.trace records the call (a direct launch would be invisible to the graph)
        try:
            key = (mode, backend, dispatch._backend, num_windows, cosine is True, cosine is False, qkv_key(q, k, v),
                   tensor_key(relative_position_bias), tensor_key(shift_mask), tensor_key(logit_scale),
                   torch.is_grad_enabled()
                   and (q.requires_grad or k.requires_grad or v.requires_grad
                        or _needs_grad(relative_position_bias, logit_scale)))
            run = CALLS.get(key)
        except (AttributeError, TypeError, RuntimeError):  # not tensors, unhashable: the checks below say why
            key = run = None
        if run is not None and (scale is None or (type(scale) is float and math.isfinite(scale))):
            return run(q, k, v, relative_position_bias, shift_mask, logit_scale, scale)
    md = get_mode(mode)
    bias, mask, ls = validate_window_inputs(q, k, v, relative_position_bias, shift_mask, num_windows, cosine,
                                            logit_scale)
    scale = check_flags(False, scale, q.shape[-1])
    if md.compute_dtype == torch.float16 and q.dtype != torch.float16:
        # both paths cast to float16 inside (the kernels, the reference): overflow raises as the dense call's
        # cast does, on every call (no cached runner for the signature, which would skip the check)
        check_float16_range(md, q=q, k=k, v=v)
        key = None
    which = dispatch.resolve_backend(backend, q.device.type)
    if which == "triton" and not dispatch.functorch_fallback("window_attention"):
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                            or _needs_grad(bias, ls))
        reason = _kernel_unsupported(q, v, md, grad)
        if reason is None:
            from . import ops  # lazy: importing triton is slow and not needed on CPU

            (q, k, v), relaid = ops.relaid_inputs(q, k, v)
            if relaid:
                key = None

            if grad:  # the backward kernels, from the LSE the forward saves
                if key is not None and mask is shift_mask:  # later calls: straight to the autograd function
                    CALLS.put(key, _training_runner(ops, q, bias is not relative_position_bias, bool(cosine),
                                                    num_windows, md.name))
                return ops.window(q, k, v, bias, mask, ls, num_windows, bool(cosine), float(scale), md.name,
                                  grad=True)
            # the runner reads the caller's bias / mask / logit_scale by data pointer: only where validation
            # made views of them (a bool mask becomes a new float tensor; a strided one is copied)
            if key is not None and mask is shift_mask and all(
                    t is None or (t.stride(-1) == 1 and t.data_ptr() == raw.data_ptr())
                    for t, raw in ((bias, relative_position_bias), (mask, shift_mask), (ls, logit_scale))):
                plan, out = ops.window_plan(q, k, v, bias, mask, ls, num_windows, bool(cosine), float(scale),
                                            md.name)
                default = q.shape[-1] ** -0.5
                CALLS.put(key, lambda q, k, v, b, m, ls, s: plan(q, k, v, b, m, ls, default if s is None else s))
                return out
            return ops.window(q, k, v, bias, mask, ls, num_windows, bool(cosine), float(scale), md.name)
        dispatch.warn_once(f"window-fallback:{reason}",
                           f"visionattn.window_attention: the Triton window kernel does not cover this call "
                           f"({reason}); running the exact PyTorch reference instead")
    with torch.autocast(q.device.type, enabled=False):  # the mode fixes the arithmetic, not an enclosing autocast
        out = window_attention_reference(q, k, v, relative_position_bias=bias, shift_mask=mask,
                                         num_windows=num_windows, cosine=bool(cosine), logit_scale=ls, scale=scale,
                                         mode=md)
    return out.to(q.dtype)


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
        _check_dense("qkv", qkv)
        raise ValueError(f"qkv must be [B*nW, N, 3, H, D] (query, key, value stacked in dim 2), got shape "
                         f"{tuple(qkv.shape)}")
    bias, ls = relative_position_bias, logit_scale
    if torch.is_grad_enabled() and not dispatch.recording() and (
            qkv.requires_grad or _needs_grad(*(t if isinstance(t, torch.Tensor) else None for t in (bias, ls)))):
        run = None
        try:
            key = ("window-qkvpacked", mode, backend, dispatch._backend, num_windows, cosine is True,
                   cosine is False, qkv.shape, qkv.stride(), qkv.dtype, qkv.device, qkv.data_ptr() & 15,
                   tensor_key(bias), tensor_key(shift_mask), tensor_key(ls))
            run = CALLS.get(key)
            if run is None:
                run = CALLS.put(key, _packed_runner(qkv, bias, shift_mask, num_windows, cosine, ls, mode, backend))
        except (TypeError, RuntimeError):  # an unhashable mode, a non-tensor bias: the unpacked call says why
            run = None
        if run and (scale is None or (type(scale) is float and math.isfinite(scale))):
            return run(qkv, bias, shift_mask, ls, scale).transpose(1, 2)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return window_attention(q, k, v, relative_position_bias=bias, shift_mask=shift_mask, num_windows=num_windows,
                            cosine=cosine, logit_scale=ls, scale=scale, mode=mode, backend=backend).transpose(1, 2)


def _packed_runner(qkv, relative_position_bias, shift_mask, num_windows, cosine, logit_scale, mode, backend):
    """The runner of a packed window call signature that needs gradients, for :data:`CALLS`: ``run(qkv, bias,
    mask, logit_scale, scale)`` on :func:`visionattn.ops.window_packed`, or False where that does not take the
    signature (the unpacked :func:`window_attention` call then runs, with its checks, warnings and fallbacks).
    Checks as :func:`window_attention`."""
    md = get_mode(mode)
    q, k, v = qkv.detach().permute(2, 0, 3, 1, 4).unbind(0)
    bias, mask, ls = validate_window_inputs(q, k, v, relative_position_bias, shift_mask, num_windows, cosine,
                                            logit_scale)
    check_flags(False, None, q.shape[-1])
    from . import ops  # lazy: importing triton is slow and not needed on CPU

    if (dispatch.resolve_backend(backend, q.device.type) != "triton" or mask is not shift_mask
            or qkv.dtype != md.compute_dtype or _kernel_unsupported(q, v, md, True) is not None
            or q.shape[2] > ops._window_bwd.FUSED_MAX_TOKENS or qkv.stride(-1) != 1):
        return False  # (a head dim not of unit stride: the unpacked call lays it out)
    H, squeeze_bias, cosine = q.shape[1], bias is not relative_position_bias, bool(cosine)
    default, name = q.shape[-1] ** -0.5, md.name

    def run(qkv, bias, mask, logit_scale, scale):
        bias, logit_scale = _validated_views(bias, logit_scale, squeeze_bias, H)
        return ops.window_packed(qkv, bias, mask, logit_scale, num_windows, cosine,
                                 default if scale is None else scale, name)

    return run


def _training_runner(ops, q, squeeze_bias: bool, cosine: bool, num_windows: int, mode: str):
    """The runner of a window call that needs gradients, for :data:`CALLS`: :func:`_validated_views` of the caller's
    bias and ``logit_scale``, then :func:`visionattn.ops.window`; the signature's checks ran when it was first seen.
    Kept only for float (or no) shift masks, which validation passes through as given."""
    H = q.shape[1]
    default = q.shape[-1] ** -0.5

    def run(q, k, v, bias, mask, logit_scale, scale):
        bias, logit_scale = _validated_views(bias, logit_scale, squeeze_bias, H)
        return ops.window(q, k, v, bias, mask, logit_scale, num_windows, cosine, default if scale is None else scale,
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
    if q.dtype not in _KERNEL_DTYPES:
        return f"dtype {q.dtype}"
    if max(q.shape[-1], v.shape[-1]) > _MAX_KERNEL_HEAD_DIM:
        return f"head dim > {_MAX_KERNEL_HEAD_DIM}"
    if grad:
        from .ops import BACKWARD_MODES  # lazy: importing triton is slow and not needed on CPU

        if md.name not in BACKWARD_MODES:
            return f"gradients requested; mode {md.name!r} is forward-only on the window kernel"
    return None
