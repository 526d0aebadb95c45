"""The public attention function: validation, mode casting, backend dispatch."""
from __future__ import annotations

import torch

from . import dispatch
from .modes import Mode, get_mode
from .reference import blocked_attention

__all__ = ["attention", "validate_attention_inputs"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, t, rank: int = 4) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims [B, H, N, D], got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of float16, bfloat16, float32, float64")


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
        TypeError: a non-tensor, an integer/bool q/k/v, mixed q/k/v dtypes, a
            non-float bias or a non-bool attn_mask.
        ValueError: wrong ranks, mismatched batch/heads/head_dim/key counts, a
            bias or mask not broadcastable to [B, H, Nq, Nk], mixed devices.
    """
    for name, t in (("query", q), ("key", k), ("value", v)):
        _check_tensor(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key, value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for t in (q, k, v)}
    for name, t in (("bias", bias), ("attn_mask", attn_mask)):
        if t is not None:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
            devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")
    B, H, Nq, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(f"batch/heads mismatch: query {tuple(q.shape)}, key {tuple(k.shape)}, "
                         f"value {tuple(v.shape)}; expected key/value [B={B}, H={H}, Nk, D]")
    if k.shape[-1] != D:
        raise ValueError(f"head_dim mismatch: query has D={D}, key has D={k.shape[-1]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"key has Nk={k.shape[2]} tokens but value has {v.shape[2]}")
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


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
    mode: str | Mode = "fp32", backend: str | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Exact softmax attention ``softmax(scale * q k^T + bias, masked) v``.

    Computed as the ELSA (m, S, W) fold over KV tiles (ELSA supplement, Alg. 1);
    on CUDA by the Triton kernels of :mod:`visionattn.kernels`, on CPU by
    :func:`visionattn.reference.blocked_attention` (PASA modes by
    :mod:`visionattn.pasa`). Semantics follow
    ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q: query [B, H, Nq, D]; float16 / bfloat16 / float32 / float64; any strides.
        k: key [B, H, Nk, D], same dtype and device.
        v: value [B, H, Nk, Dv].
        bias: additive float bias broadcastable to [B, H, Nq, Nk] (e.g. a
            relative position bias [H, Nq, Nk] or [1, H, Nq, Nk]); never expanded in memory.
        attn_mask: boolean mask broadcastable to [B, H, Nq, Nk]; True = attend.
        is_causal: causal mask, top-left aligned (key j visible to query i iff j <= i).
        scale: logit scale; default ``1 / sqrt(D)``.
        mode: precision mode (:data:`visionattn.modes.MODES`): ``fp32``, ``fp32-ieee``,
            ``tf32``, ``fp16``, ``bf16``, ``pasa`` (or the ``fp16-acc16`` baseline).
            Inputs are cast to the mode's dtype; the output is cast back.
        backend: ``auto`` / ``triton`` / ``reference``; default from
            :func:`visionattn.dispatch.get_backend`.
        num_splits: force the number of KV partitions of the split-KV kernel
            (1 = single pass, the memory-lean variant); default chosen by shape.

    Returns:
        [B, H, Nq, Dv] in q's dtype. A query row whose keys are all masked
        returns zeros (not NaN).

    Raises:
        TypeError / ValueError: see :func:`validate_attention_inputs`; unknown mode;
            ``num_splits`` < 1.
    """
    md = get_mode(mode)
    bias, attn_mask = validate_attention_inputs(q, k, v, bias, attn_mask)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scale = float(scale)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}; expected a positive int or None")
    which = dispatch.resolve_backend(backend, q.device.type)
    out = _run(q, k, v, bias, attn_mask, bool(is_causal), scale, md, which, num_splits)
    return out.to(q.dtype)


def _run(q, k, v, bias, attn_mask, is_causal, scale, md: Mode, which: str, num_splits):
    if which == "triton":
        from . import kernels  # lazy: triton import is slow and optional on CPU

        if md.half_scores:
            reason = kernels.pasa_unsupported_reason(q, k, v, bias, attn_mask)
        else:
            reason = kernels.unsupported_reason(q, k, v, bias, attn_mask, md.name)
        if reason is None:
            qc, kc, vc = (t.to(md.compute_dtype) for t in (q, k, v))
            # the kernels write the caller's dtype straight from their FP32 state (no half rounding of
            # the output of an FP32 caller in a half mode, as the CPU references)
            out_dtype = q.dtype if q.dtype in kernels.OUT_DTYPES else None
            if md.half_scores:
                return kernels.pasa_attention(qc, kc, vc, bias, attn_mask, is_causal, scale,
                                              shift=md.name == "pasa", out_dtype=out_dtype)
            return kernels.elsa_attention(qc, kc, vc, bias, attn_mask, is_causal, scale, md.name, num_splits,
                                          out_dtype=out_dtype)
        dispatch.warn_once(f"fallback:{reason}", f"visionattn: Triton kernels do not cover this call ({reason}); "
                                                 f"running the exact PyTorch monoid reference instead")
    if md.half_scores:
        from .pasa import pasa_attention_reference

        return pasa_attention_reference(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal,
                                        scale=scale, shift=md.name == "pasa")
    return blocked_attention(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                             mode=md, block_size=_cpu_block(k.shape[-2]))


def _cpu_block(nk: int) -> int:
    # Large blocks are faster on CPU (fewer Python steps); memory stays O(Nq * block).
    return min(max(nk, 1), 1024)
