"""Ragged batches without padding: packed ``cu_seqlens`` attention (ELSA supplement, Sec. E).

Images of different sizes give token sequences of different lengths. Instead of padding them to the
longest with a key mask, the sequences are packed along one token axis (FlashAttention's varlen
convention) and each attends only to its own keys:

    y_i = sum_{j in seq(i), j visible} exp(s_ij - m_i) v_j / sum_{j in seq(i), j visible} exp(s_ij - m_i),
    s_ij = scale q_i . k_j,   m_i = max_j s_ij,

the ELSA fold of ``(m, S, W)`` over each sequence's keys. A list of per-sequence tensors is read where each
tensor lies (the supplement's zero-copy processing): the kernel takes each sequence's row offset from one small
table instead of a packed copy of the batch. On CUDA (or ``TRITON_INTERPRET=1``) one launch
of :mod:`visionattn.kernels.varlen_fwd` covers every sequence and head (and, when an input needs grad, the
backward launches of :mod:`visionattn.kernels.varlen_bwd`); elsewhere the PyTorch monoid reference runs per
sequence on views (:func:`visionattn.reference.blocked_attention`).

This module holds the varlen family whole: the public function and its checks; the custom ops
``visionattn::varlen_attention`` and ``visionattn::varlen_attention_lse`` (its registered autograd formula calls
``visionattn::varlen_attention_backward``) with fake implementations, recorded by ``torch.compile``; eager calls
run the same implementations without the torch dispatcher (about 18 us of host time per op call, measured on CPU,
against 0.8 us for the direct call) through :class:`_VarlenFunction`, whose backward is the same kernel call;
:data:`BACKENDS` (the varlen kernel, then the reference), read by :func:`visionattn.dispatch.choose`;
:data:`CALLS`, the cache of in-place plans of lists of sequences, and :data:`RUNS`, the runners of packed calls
without gradients, both keyed at the public call. Kernel modules are imported inside the functions that launch
them (importing Triton is slow; CPU calls never need it).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import dispatch
from .checks import (BACKWARD_MODES, KERNEL_DTYPES, cast_checked, check_dense, check_devices, check_flags,
                     check_float16_range, check_tensor, first_order_only, has_backward)
from .kernels._launch import PlanCache, device_table, qkv_key, recording, tensor_key, unit_last_stride
from .modes import Mode, get_mode
from .reference import blocked_attention, cpu_block_size

__all__ = ["varlen_attention", "validate_varlen_inputs", "varlen_kernel", "varlen_kernel_lse", "BACKENDS", "CALLS",
           "RUNS"]


def _check_offsets(name: str, cu, total: int, device: torch.device, values: bool = True) -> list[int] | int:
    """Validate ``cu`` (int32 [n_seq + 1], on ``device`` or, for a CUDA ``device``, on the CPU (host offsets); with
    ``values``: 0 .. total, non-decreasing, read on the host: one synchronisation for offsets on CUDA). Returns the
    offsets as a list where read, else n_seq."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 offsets, got {type(cu).__name__}")
    check_dense(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {cu.dtype}; expected torch.int32 (FlashAttention's convention)")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D [n_seq + 1] with at least one entry, got shape {tuple(cu.shape)}")
    if cu.device != device and not (cu.device.type == "cpu" and device.type == "cuda"):
        raise ValueError(f"{name} is on {cu.device}, the packed tensors on {device}; pass the offsets on {device} "
                         f"(or on the CPU)")
    if not values:
        return cu.shape[0] - 1
    host = cu.tolist()
    if host[0] != 0:
        raise ValueError(f"{name}[0] = {host[0]}; offsets must start at 0")
    if host[-1] != total:
        raise ValueError(f"{name}[-1] = {host[-1]}, but the packed tensor has {total} rows")
    if any(b < a for a, b in zip(host, host[1:])):
        raise ValueError(f"{name} must be non-decreasing (offsets of consecutive sequences), got {host[:16]}"
                         f"{' ...' if len(host) > 16 else ''}")
    return host


# (host offsets, device) -> (int32 device copy, its pinned host source): offsets given on the CPU for CUDA tensors,
# copied once per distinct offsets; the entries a CUDA graph captured are never dropped (graph_safe)
_DEVICE_OFFSETS = PlanCache(max_size=4096, graph_safe=True)


def _on_device(cu: torch.Tensor, host: list[int], device: torch.device) -> torch.Tensor:
    """``cu`` on ``device``: itself, or for host offsets a cached copy, made once per distinct offsets
    (asynchronously, from pinned memory)."""
    if cu.device == device:
        return cu
    key = (tuple(host), device)
    kept = _DEVICE_OFFSETS.get(key)
    if kept is None:
        kept = _DEVICE_OFFSETS.put(key, device_table(cu.clone(), device))  # a copy: the caller's tensor may change
    return kept[0]


# (public call signature, offsets, maxima) -> run(q, k, v, cu_seqlens_q, cu_seqlens_k, scale): packed calls without
# gradients that the kernels ran, launched again from their plan without the checks and planning of a first call
# (most of an eager few-query call's host time); the runners of host offsets hold their device copies, so a CUDA
# graph that captured one is kept (graph_safe)
RUNS = PlanCache(max_size=1024, graph_safe=True)


def _run_key(q, k, v, cu_q, cu_k, max_q, max_k, mode, backend, is_causal) -> tuple:
    """The :data:`RUNS` key of a packed call: everything its runner depends on. Offsets on the CPU enter by value
    (each call reads them on the host anyway: new values are a new key, checked as a first call); offsets on CUDA
    only with both maxima given, their values trusted as :func:`validate_varlen_inputs` trusts them. Raises
    TypeError where no runner applies (a :class:`Mode` object, inputs that need gradients, a ``torch.func``
    transform, CUDA offsets without both maxima): the call then takes the checked path."""
    if (type(mode) is not str or torch._C._functorch.peek_interpreter_stack() is not None
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        raise TypeError("no runner")
    if cu_q.device.type == "cpu" and cu_k.device.type == "cpu":
        offsets = (tuple(cu_q.tolist()), tuple(cu_k.tolist()))
    elif (type(max_q) is int and type(max_k) is int and q.device.type == "cuda" and cu_q.device.type == "cuda"
          and cu_k.device.type == "cuda"):
        offsets = None
    else:
        raise TypeError("no runner")
    return (mode, backend, dispatch._backend, is_causal is True, is_causal is False, qkv_key(q, k, v),
            tensor_key(cu_q), tensor_key(cu_k), offsets, max_q, max_k)


def validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None):
    """Check packed q / k / v and their offsets; return ``(max_seqlen_q, max_seqlen_k)`` as ints.

    Offsets on the CPU (for CUDA tensors too), or with a maximum missing, are read on the host (one
    synchronisation for offsets on CUDA) and their values checked; the given maxima must bound the true lengths,
    missing ones are computed. With both maxima given for CUDA tensors and offsets on CUDA, the offsets' values are
    trusted, as FlashAttention trusts them (no synchronisation, so eager calls queue back to back and CUDA graphs
    can capture them): only their dtype, shape and device are checked, and a maximum below a true length leaves
    that sequence's later rows unwritten.

    Raises:
        TypeError: a non-tensor, a nested or sparse tensor, non-float q / k / v, mixed q / k / v dtypes, offsets
            not int32, a non-integer maximum.
        ValueError: wrong ranks, mismatched heads / head dims / key and value rows, a head dim of 0, mixed
            devices, meta tensors (no data), offsets not 1-D, not starting at 0, not ending at the packed total,
            decreasing, with different sequence counts for q and k, a maximum below the longest sequence.
    """
    return _validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)[:2]


def _validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """:func:`validate_varlen_inputs`' checks: ``(max_seqlen_q, max_seqlen_k, lengths, (cu_seqlens_q,
    cu_seqlens_k))``, ``lengths`` the per-sequence ``(lens_q, lens_k)`` tuples where the offsets were read on the
    host, else None; the offsets on q's device (host offsets of CUDA tensors: cached copies)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3, "[total, H, D] (packed sequences)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "meta":
        check_devices({"q": q, "k": k, "v": v})
    H, D = q.shape[1], q.shape[2]
    if k.shape[1] != H or v.shape[1] != H:
        raise ValueError(f"heads mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         f"expected k / v [total_k, H={H}, D]")
    if k.shape[2] != D:
        raise ValueError(f"head_dim mismatch: q has D={D}, k has D={k.shape[2]}")
    if D == 0:
        raise ValueError("q and k have head_dim 0; attention needs head_dim >= 1")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k has {k.shape[0]} rows but v has {v.shape[0]}")
    values = (q.device.type == "cpu" or max_seqlen_q is None or max_seqlen_k is None
              or getattr(cu_seqlens_q, "device", q.device).type == "cpu"
              or getattr(cu_seqlens_k, "device", q.device).type == "cpu")
    host_q = _check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, values)
    host_k = _check_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, values)
    if not values:
        if host_q != host_k:
            raise ValueError(f"cu_seqlens_q describes {host_q} sequences, cu_seqlens_k {host_k}")
        for which, given in (("q", max_seqlen_q), ("k", max_seqlen_k)):
            if isinstance(given, bool) or not isinstance(given, int) or given < 0:
                raise TypeError(f"max_seqlen_{which} must be an int >= 0 or None, got {given!r}")
        return max_seqlen_q, max_seqlen_k, None, (cu_seqlens_q, cu_seqlens_k)
    if len(host_q) != len(host_k):
        raise ValueError(f"cu_seqlens_q describes {len(host_q) - 1} sequences, cu_seqlens_k {len(host_k) - 1}")
    lens = {"q": [b - a for a, b in zip(host_q, host_q[1:])], "k": [b - a for a, b in zip(host_k, host_k[1:])]}
    out = []
    for which, given in (("q", max_seqlen_q), ("k", max_seqlen_k)):
        longest = max(lens[which], default=0)
        if given is None:
            out.append(longest)
            continue
        if isinstance(given, bool) or not isinstance(given, int):
            raise TypeError(f"max_seqlen_{which} must be an int or None, got {type(given).__name__}")
        if given < longest:
            raise ValueError(f"max_seqlen_{which}={given} is below the longest sequence ({longest} rows)")
        out.append(given)
    offsets = (_on_device(cu_seqlens_q, host_q, q.device), _on_device(cu_seqlens_k, host_k, q.device))
    return out[0], out[1], (tuple(lens["q"]), tuple(lens["k"])), offsets


def _unpack_jagged(q, k, v):
    """Jagged nested q / k / v ([B, j, H, D], or the [B, H, j, D] transpose) -> packed values, int32 offsets,
    the maxima torch caches (or None), and a function wrapping a packed output like q."""
    transposed = q._ragged_idx == 2
    parts = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not (isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged):
            raise TypeError(f"{name}: q is a jagged nested tensor, so k and v must be too")
        if t.dim() != 4 or t._ragged_idx != (2 if transposed else 1):
            raise ValueError(f"{name} must be a jagged [B, j, H, D] tensor (or its [B, H, j, D] transpose), "
                             f"got {t.dim()} dims ragged at dim {t._ragged_idx}")
        if transposed:
            t = t.transpose(1, 2)
        parts.append(t)
    q, k, v = parts
    off_q, off_k = q.offsets(), k.offsets()

    def wrap(out):
        res = torch.nested.nested_tensor_from_jagged(out, off_q)
        return res.transpose(1, 2) if transposed else res

    max_q = getattr(q, "_maybe_max_seqlen", None)
    max_k = getattr(k, "_maybe_max_seqlen", None)
    return (q.values(), k.values(), v.values(), off_q.to(torch.int32), off_k.to(torch.int32),
            None if max_q is None else int(max_q), None if max_k is None else int(max_k), wrap)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    *, mode: str | Mode = "fp32", scale: float | None = None, is_causal: bool = False, backend: str | None = None,
) -> torch.Tensor:
    """Exact softmax attention over packed sequences of different lengths, without padding.

    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key / value rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; its queries attend only to its keys:
    ``y_i = softmax_j(scale q_i . k_j) v_j`` over ``j`` in the sequence (ELSA supplement, Sec. E).

    Args:
        q: [total_q, H, D] float16 / bfloat16 / float32 / float64, any strides (not copied), or a jagged
            nested tensor [B, j, H, D] (``layout=torch.jagged``; also its [B, H, j, D] transpose), in which
            case k, v are jagged too and the offsets come from them, or a list (tuple) of per-sequence tensors
            [n_s, H, D], in which case k, v are lists [m_s, H, D] / [m_s, H, Dv] of the same length and the
            offsets come from their lengths. Listed sequences in the mode's compute dtype that share one layout
            and start at multiples of 16 elements from each other are read in place (no packed copy: only their
            row offsets travel to the GPU); others, and calls that need gradients, are packed with ``torch.cat``
            first. Their lengths being on the host, few-query calls (up to 64 queries a sequence) whose longest
            sequence leaves SMs idle run the stream-K schedule (:mod:`visionattn.kernels.stream_k`); so do packed
            calls without gradients whose offsets are read on the host (a maximum not given).
        k: [total_k, H, D], same dtype and device; v: [total_k, H, Dv].
        cu_seqlens_q, cu_seqlens_k: int32 [n_seq + 1] on q's device, from 0 to total_q / total_k,
            non-decreasing (FlashAttention's convention). Sequences of 0 queries contribute nothing; a
            sequence with 0 keys gives zero output rows. For CUDA tensors the offsets may also be given on the
            CPU: their values are then read without a synchronisation (the lengths reach the kernels, as when a
            maximum is left out) and copied to the GPU once per distinct offsets. A call without gradients that
            repeats an earlier one's layouts, mode and offsets (their values when on the CPU; on the GPU, with both
            maxima given) launches from that call's plan without its checks and planning (:data:`RUNS`).
        max_seqlen_q, max_seqlen_k: bounds of the per-sequence lengths (ints), as FlashAttention takes them;
            None = computed from the offsets on the host (one synchronisation on CUDA). With both given on
            CUDA the offsets' values are trusted, not read (see :func:`validate_varlen_inputs`).
        mode: ``fp32``, ``fp32-ieee``, ``tf32``, ``fp16``, ``bf16`` (:data:`visionattn.modes.MODES`);
            inputs are cast to the mode's dtype and the output back to q's dtype.
        scale: logit scale, default ``1 / sqrt(D)``.
        is_causal: top-left aligned causal mask within each sequence (key j visible to query i iff j <= i,
            both counted from the sequence's first row).
        backend: ``auto`` / ``triton`` / ``reference``, as :func:`visionattn.attention`.

    Returns:
        [total_q, H, Dv] in q's dtype (a jagged [B, j, H, Dv] tensor for jagged input, sharing q's offsets; for
        list input a list of [n_s, H, Dv] views of one packed output).
        Differentiable in q, k, v (packed or jagged): the kernel path records the deterministic varlen backward
        (:mod:`visionattn.kernels.varlen_bwd`, FlashAttention-2 Alg. 2 per sequence) when an input needs grad;
        the reference path is differentiated by autograd.

    Raises:
        TypeError / ValueError: see :func:`validate_varlen_inputs` and :func:`visionattn.api.check_flags`;
            an unknown mode or a PASA mode (no varlen kernel nor reference); jagged or list input with
            explicit offsets; lists of different lengths or with mismatched heads / head dims / dtypes / devices;
            float16 modes on values beyond float16's range.
    """
    md = get_mode(mode)
    if md.half_scores:
        raise ValueError(f"mode={md.name!r} has no varlen path; expected one of fp32, fp32-ieee, tf32, fp16, bf16")
    wrap = key = None
    if isinstance(q, (list, tuple)):
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("lists of sequences carry their lengths; pass cu_seqlens_q / cu_seqlens_k = None")
        return _sequences(q, k, v, max_seqlen_q, max_seqlen_k, md, scale, is_causal, backend)
    if isinstance(q, torch.Tensor) and q.is_nested:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("jagged nested inputs carry their offsets; pass cu_seqlens_q / cu_seqlens_k = None")
        q, k, v, cu_seqlens_q, cu_seqlens_k, mq, mk, wrap = _unpack_jagged(q, k, v)
        max_seqlen_q = max_seqlen_q if max_seqlen_q is not None else mq
        max_seqlen_k = max_seqlen_k if max_seqlen_k is not None else mk
    elif cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k are required for packed [total, H, D] inputs")
    else:  # a packed call seen before was checked and planned then: launch from its plan
        key, run = RUNS.lookup(_run_key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mode, backend,
                               is_causal)
        if run is not None and (scale is None or (type(scale) is float and math.isfinite(scale))):
            return run(q, k, v, cu_seqlens_q, cu_seqlens_k, q.shape[-1] ** -0.5 if scale is None else scale)
    max_seqlen_q, max_seqlen_k, lengths, offsets = _validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                              max_seqlen_k)
    cu_seqlens_q, cu_seqlens_k = offsets
    scale = check_flags(is_causal, scale, q.shape[-1])
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, md, lengths, key)
    out = dispatch.choose(BACKENDS, dispatch.preferred(backend, q.device.type, "varlen_attention"), *args).plan(*args)
    return wrap(out) if wrap is not None else out


def _check_sequences(qs, ks, vs) -> None:
    """Lists of per-sequence q / k / v: same count, 3-D tensors, one dtype and device, matching heads and head
    dims, as many value rows as key rows."""
    for name, t in (("k", ks), ("v", vs)):
        if not isinstance(t, (list, tuple)):
            raise TypeError(f"q is a list of sequences, so {name} must be one too, got {type(t).__name__}")
    if not (len(qs) == len(ks) == len(vs)):
        raise ValueError(f"q, k, v list {len(qs)}, {len(ks)}, {len(vs)} sequences; expected the same number")
    for i, (a, b, c) in enumerate(zip(qs, ks, vs)):
        for name, t in ((f"q[{i}]", a), (f"k[{i}]", b), (f"v[{i}]", c)):
            check_tensor(name, t, 3, "[n, H, D] (one sequence)")
        first = qs[0]  # checked as a tensor in the first step
        H, D, Dv = first.shape[1], first.shape[2], vs[0].shape[2]
        if not (a.dtype == b.dtype == c.dtype == first.dtype):
            raise TypeError(f"sequence {i}: q, k, v dtypes {a.dtype}, {b.dtype}, {c.dtype}; every sequence must "
                            f"share q[0]'s dtype {first.dtype}")
        if not (a.device == b.device == c.device == first.device):
            raise ValueError(f"sequence {i} is on {a.device} / {b.device} / {c.device}, q[0] on {first.device}")
        if first.device.type == "meta":
            check_devices({f"q[{i}]": a, f"k[{i}]": b, f"v[{i}]": c})
        if a.shape[1:] != (H, D) or b.shape[1:] != (H, D) or c.shape[1] != H or c.shape[2] != Dv:
            raise ValueError(f"sequence {i}: q {tuple(a.shape)}, k {tuple(b.shape)}, v {tuple(c.shape)}; expected "
                             f"[n, {H}, {D}], [m, {H}, {D}], [m, {H}, {Dv}] as sequence 0")
        if b.shape[0] != c.shape[0]:
            raise ValueError(f"sequence {i}: k has {b.shape[0]} rows but v has {c.shape[0]}")
    if qs and qs[0].shape[2] == 0:
        raise ValueError("q and k have head_dim 0; attention needs head_dim >= 1")


def _row_offsets(ts) -> tuple[int, tuple[int, ...], list[int]] | None:
    """``(base, strides, offsets)``: the index of the tensor of ``ts`` at the lowest address, the strides every
    tensor shares (of the dims with more than one entry), and each tensor's element offset from the base, when
    there are such strides and the offsets are multiples of 16 elements (the kernel's aligned loads); else None.
    Empty tensors get offset 0."""
    live = [i for i, t in enumerate(ts) if t.numel()]
    if not live:
        return 0, ts[0].stride(), [0] * len(ts)
    base = min(live, key=lambda i: ts[i].data_ptr())
    ref = max((ts[i] for i in live), key=lambda t: t.shape[0]).stride()
    if ref[-1] != 1 or any(ts[i].stride()[1:] != ref[1:] or (ts[i].shape[0] > 1 and ts[i].stride(0) != ref[0])
                           for i in live):
        return None  # (the kernels take unit last strides only: visionattn.kernels._launch.unit_last_stride)
    size, at = ts[base].element_size(), ts[base].data_ptr()
    if any((ts[i].data_ptr() - at) % (16 * size) for i in live):
        return None
    return base, ref, [(t.data_ptr() - at) // size if t.numel() else 0 for t in ts]


# (mode, device, every sequence's address, shape, strides and dtype) -> how the kernel reads them in place:
# (indices of the q / k / v base tensors and their strides, the device offsets — int32 cu_seqlens_q / _k, int64
# row offsets —, query and key lengths, the kernel's runner (varlen_fwd.forward_runner) per causal flag, the
# sequences' order, the tables' pinned host source); see _sequences. Holds no caller tensor; the caching allocator
# hands a loop the same addresses call after call.
CALLS = PlanCache(max_size=256, graph_safe=True)


def _in_place_plan(qs, ks, vs, first, md: Mode):
    """How the kernel reads these sequences where they lie (see :data:`CALLS`), or None when they must be
    packed: not in the mode's compute dtype, a backend other than the kernels, or no common layout."""
    if first.dtype != md.compute_dtype:
        return None
    from .kernels import varlen_fwd  # lazy: importing triton is slow

    if varlen_fwd.varlen_unsupported_reason(first, vs[0], md.name) is not None:
        return None
    placed = [_row_offsets(ts) for ts in (qs, ks, vs)]
    if any(p is None for p in placed):
        return None
    lens_q, lens_k = [t.shape[0] for t in qs], [t.shape[0] for t in ks]
    n = len(qs)
    # the kernel visits the sequences in table order: longest first (varlen_fwd.longest_first), the output packed
    # in that order too
    order = varlen_fwd.longest_first(lens_q, lens_k) or tuple(range(n))
    lens_q, lens_k = [lens_q[s] for s in order], [lens_k[s] for s in order]
    placed = [(base, strides, [offsets[s] for s in order]) for base, strides, offsets in placed]
    cu = [0] * (2 * n + 2 + (2 * n + 2) % 2)  # int32 cu_seqlens_q, cu_seqlens_k (an even count: 8-byte aligned)
    for i in range(n):
        cu[i + 1] = cu[i] + lens_q[i]
        cu[n + 2 + i] = cu[n + 1 + i] + lens_k[i]
    offsets = [x for row in zip(placed[0][2], placed[1][2], placed[2][2]) for x in row]  # int64 [n, 3]
    # one host-to-device copy of both; the pinned source stays with the plan
    table, host = device_table(torch.cat([torch.tensor(cu, dtype=torch.int32).view(torch.uint8),
                                          torch.tensor(offsets, dtype=torch.int64).view(torch.uint8)]), first.device)
    cu_dev, off_dev = table[:4 * len(cu)].view(torch.int32), table[4 * len(cu):].view(torch.int64)
    bases = tuple(p[:2] for p in placed)
    return bases, (cu_dev[:n + 1], cu_dev[n + 1:2 * n + 2], off_dev), lens_q, lens_k, {}, order, host


def _sequences(qs, ks, vs, max_seqlen_q, max_seqlen_k, md: Mode, scale, is_causal: bool, backend):
    """:func:`varlen_attention` of lists of sequences: ``[n_s, H, Dv]`` outputs, views of one packed output."""
    key = None
    # torch.jit.trace, a torch.func transform: no key, so the packed path (no direct launch they cannot see)
    if not torch._C._is_tracing() and torch._C._functorch.peek_interpreter_stack() is None:
        try:  # a list seen before (same addresses and layouts) was checked then: read it as planned
            key = (md.name, backend, dispatch._backend, qs[0].device,  # device addresses are unique across devices
                   *[(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (*qs, *ks, *vs)])
        except (AttributeError, TypeError, IndexError, RuntimeError):  # not tensors (or sparse), or none: the checks
            pass  # below say why
    plan = CALLS.get(key) if key is not None else None
    first = qs[0] if qs else None
    if plan is None:
        _check_sequences(qs, ks, vs)
        if not qs:
            return []
    scale = check_flags(is_causal, scale, first.shape[-1])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*qs, *ks, *vs))
    if (plan is None and not grad and key is not None
            and dispatch.resolve_backend(backend, first.device.type) == "triton"):
        plan = _in_place_plan(qs, ks, vs, first, md)
        if plan is not None and key is not None:
            CALLS.put(key, plan)
    if plan is None or grad:  # packed: one copy of each (differentiable), then the packed path
        lens_q, lens_k = [t.shape[0] for t in qs], [t.shape[0] for t in ks]
        offsets = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        offsets_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out = varlen_attention(torch.cat(list(qs)), torch.cat(list(ks)), torch.cat(list(vs)),
                               offsets.to(first.device), offsets_k.to(first.device),
                               max(lens_q) if max_seqlen_q is None else max_seqlen_q,
                               max(lens_k) if max_seqlen_k is None else max_seqlen_k,
                               mode=md, scale=scale, is_causal=is_causal, backend=backend)
        return list(out.split_with_sizes(lens_q))
    bases, (cu_q, cu_k, row_offsets), lens_q, lens_k, launches, order, _ = plan
    max_k = max(lens_k)
    for which, given, longest in (("q", max_seqlen_q, max(lens_q)), ("k", max_seqlen_k, max_k)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < longest):
            raise ValueError(f"max_seqlen_{which}={given!r}; expected None or an int >= the longest sequence "
                             f"({longest} rows)")
    q, k, v = (ts[i] if ts[i].stride() == st else ts[i].as_strided(ts[i].shape, st)
               for ts, (i, st) in zip((qs, ks, vs), bases))
    run = launches.get(bool(is_causal))  # the kernel's runner, found once per (list layout, causal)
    if run is not None:
        out = run(q, k, v, cu_q, cu_k, float(scale))
    else:
        from .kernels import varlen_fwd

        out_dtype = first.dtype if first.dtype in KERNEL_DTYPES else torch.float32
        run, out = varlen_fwd.forward_runner(q, k, v, cu_q, cu_k, max(lens_q), max_k, bool(is_causal), float(scale),
                                             md.name, out_dtype, (tuple(lens_q), tuple(lens_k)), row_offsets,
                                             sum(lens_q))
        if run is not None:
            launches[bool(is_causal)] = run
    outs = [None] * len(order)
    for s, piece in zip(order, out.split_with_sizes(lens_q)):
        outs[s] = piece
    return outs


def _triton_unsupported(q, k, v, cu_q, cu_k, max_q: int, max_k: int, is_causal: bool, scale: float,
                        md: Mode, lengths=None, key=None) -> str | None:
    """Why the varlen kernel cannot run this call (device, head dims, mode; gradients in a mode without a backward),
    or None."""
    from .kernels.varlen_fwd import varlen_unsupported_reason  # imports Triton: only on the kernel path

    reason = varlen_unsupported_reason(q, v, md.name)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if reason is None and grad and not has_backward(md.name):
        reason = f"autograd: mode {md.name!r} has no backward kernel"
    return reason


def _triton(q, k, v, cu_q, cu_k, max_q: int, max_k: int, is_causal: bool, scale: float, md: Mode, lengths=None,
            key=None):
    """The varlen kernel's output in q's dtype (``lengths``: host-side ``(lens_q, lens_k)`` where the offsets were
    read, which let an eager call without gradients take the stream-K schedule). ``key``: the call's :data:`RUNS` key
    (None: keep no runner); an eager call without gradients whose q / k / v the kernels read as they are keeps its
    runner there."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    dtype = md.compute_dtype
    # the kernels take unit last strides only (visionattn.kernels._launch.unit_last_stride)
    qc, kc, vc = (unit_last_stride(cast_checked(t, dtype, n, md.name)) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    out_dtype = q.dtype if q.dtype in KERNEL_DTYPES else torch.float32
    if key is not None and not grad and not recording() and qc is q and kc is k and vc is v:
        from .kernels import varlen_fwd

        run, out = varlen_fwd.forward_runner(q, k, v, cu_q, cu_k, max_q, max_k, bool(is_causal), float(scale),
                                             md.name, out_dtype, lengths)
        if run is not None:  # CUDA tensors with host lengths: the key holds the CPU offsets' values (_run_key)
            RUNS.put(key, _packed_runner(run, cu_q, cu_k, held=lengths is not None and q.device.type == "cuda"))
        return out
    out = varlen_kernel(qc, kc, vc, cu_q, cu_k, max_q, max_k, bool(is_causal), float(scale), md.name, out_dtype, grad,
                        lengths)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _packed_runner(run, cu_q: torch.Tensor, cu_k: torch.Tensor, held: bool):
    """The :data:`RUNS` runner of a packed call: ``run`` (:func:`.kernels.varlen_fwd.forward_runner`) on each call's
    own offsets, or with ``held`` (offsets given on the CPU for CUDA tensors, which entered the key by value) on the
    device copies ``cu_q`` / ``cu_k`` the first call made, which it holds (copies of the library's own: a caller's
    tensor may change after the call)."""
    if not held:
        return run

    def from_host(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
        return run(q, k, v, cu_q, cu_k, scale)

    return from_host


def _reference(q, k, v, cu_q, cu_k, max_q: int, max_k: int, is_causal: bool, scale: float, md: Mode,
               lengths=None, key=None) -> torch.Tensor:
    """Per-sequence :func:`visionattn.reference.blocked_attention` on views: [total_q, H, Dv] in q's dtype."""
    check_float16_range(md, q=q, k=k, v=v)
    with torch.autocast(q.device.type, enabled=False):  # the mode fixes the arithmetic, not an autocast
        return _reference_views(q, k, v, cu_q, cu_k, is_causal, scale, md)


def _reference_views(q, k, v, cu_q, cu_k, is_causal: bool, scale: float, md: Mode) -> torch.Tensor:
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for s in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[s], bq[s + 1], bk[s], bk[s + 1]
        if q1 == q0 or k1 == k0:
            continue  # no rows, or no keys (zero output)
        view = lambda t, a, b: t[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731  [1, H, n, D]
        y = blocked_attention(view(q, q0, q1), view(k, k0, k1), view(v, k0, k1), is_causal=is_causal, scale=scale,
                              mode=md, block_size=cpu_block_size(k1 - k0))
        out[q0:q1] = y[0].transpose(0, 1).to(out.dtype)
    return out


# backends of varlen_attention() in priority order; dispatch.choose reads it
BACKENDS = dispatch.BackendTable("varlen", (
    dispatch.Backend("triton", _triton_unsupported, _triton),
    dispatch.Backend("reference", lambda *args: None, _reference),
), "visionattn: the varlen kernel does not cover this call ({reason}); running the exact PyTorch reference instead")


# ----------------------------------------------------------------------------- custom ops and autograd
@torch.library.custom_op("visionattn::varlen_attention", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
               mode: str, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    from .kernels import varlen_fwd

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
    from .kernels import varlen_fwd

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
    from .kernels import varlen_bwd

    return varlen_bwd.varlen_backward(q, k, v, out, grad_out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
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


_varlen_lse_op.register_autograd(_varlen_op_backward, setup_context=_varlen_setup_context)


class _VarlenFunction(torch.autograd.Function):
    """Eager autograd for the varlen kernels: the forward writes the per-row LSE and saves (q, k, v, out, lse,
    offsets); the backward recomputes the probabilities tile by tile (FlashAttention-2, Alg. 2). The offsets
    and maxima get no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, mode, out_dtype):
        from .kernels import varlen_fwd

        out, lse = varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, mode, out_dtype,
                                             with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, is_causal, scale, mode)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        first_order_only("visionattn.varlen_attention")
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        from .kernels import varlen_bwd

        dq, dk, dv = varlen_bwd.varlen_backward(q, k, v, out, grad_out, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def varlen_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
           scale: float, mode: str, out_dtype: torch.dtype | None, grad: bool = False,
           lengths: tuple | None = None) -> torch.Tensor:
    """Packed ragged attention on the varlen kernels, inputs validated and cast to the mode's dtype:
    q [total_q, H, D], k [total_k, H, D], v [total_k, H, Dv], int32 offsets [n_seq + 1] -> [total_q, H, Dv] in
    ``out_dtype``. ``grad``: the inputs need gradients (``mode`` in :data:`BACKWARD_MODES`): eager calls run
    :class:`_VarlenFunction`, compiled ones ``visionattn::varlen_attention_lse`` with its autograd formula;
    otherwise ``visionattn::varlen_attention`` under ``torch.compile``. ``lengths``: host-side ``(lens_q, lens_k)``,
    handed to the kernel layer by eager calls without gradients (the stream-K schedule's partition).

    Raises:
        ValueError: ``grad`` in a mode without backward kernels.
    """
    if grad:
        if mode not in BACKWARD_MODES:
            raise ValueError(f"mode={mode!r} has no varlen backward kernel; expected one of {sorted(BACKWARD_MODES)}")
        if recording():
            return _varlen_lse_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                                  mode, out_dtype)[0]
        return _VarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                     scale, mode, out_dtype)
    if recording():
        return _varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                          mode, out_dtype)
    from .kernels import varlen_fwd

    return varlen_fwd.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                     scale, mode, out_dtype, lengths=lengths)[0]


def varlen_kernel_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
               scale: float, mode: str, out_dtype: torch.dtype | None):
    """:func:`varlen_kernel` and the per-row log-sum-exp [H, total_q] float32 (natural log, -inf without keys)."""
    from .kernels import varlen_fwd

    return varlen_fwd.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                     scale, mode, out_dtype, with_lse=True)
