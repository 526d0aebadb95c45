"""What the Gluon kernels (:mod:`.ieee_gluon`, :mod:`.half_gluon`, :mod:`.half_gluon_bwd`) share: the scope check
(with its Hopper TMA form), the NVMMA shared layouts of the TMA descriptors and the online-softmax step of the
(m, S, W) fold.

Gluon is Triton's explicit-layout dialect (``triton.experimental.gluon``); it is experimental and its
API moves between releases, so every import is guarded and a missing piece becomes a reason string
(the dense launcher then warns once and keeps its Triton kernel).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ._launch import allocate_output

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

    # a barrier of the calling warps (the CTA's, or a warp-specialized partition's): renamed from thread_barrier to
    # barrier after triton 3.6
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the installed Triton
    IMPORT_ERROR = f"Gluon unavailable in this Triton ({exc})"

__all__ = ["scope_reason", "hopper_tma_scope_reason", "hopper_copies_scope_reason", "kv_heads_reason",
           "strides_aligned",
           "nvmma_layout", "checked_call", "cta_barrier", "IMPORT_ERROR"]


def strides_aligned(t: torch.Tensor, stride_elems: int) -> bool:
    """Whether ``t`` has a unit last stride and every other stride, and its base address, a multiple of
    ``stride_elems`` elements."""
    return (t.stride(-1) == 1 and not any(s % stride_elems for s in t.stride()[:-1])
            and not t.data_ptr() % (stride_elems * t.element_size()))


def scope_reason(q, k, v, bias, attn_mask, is_causal: bool, scale: float, num_splits: int, *,
                 dtypes: tuple[torch.dtype, ...], head_dims: tuple[int, ...], stride_elems: int, stride_text: str,
                 capable: Callable[[tuple[int, int]], bool], capable_text: str, import_error: str | None) -> str | None:
    """Why a Gluon kernel cannot run a call, or ``None``; the import error is reported last, so a call
    that names it is one the kernel would have taken (the launcher warns only for those).

    Args:
        q, k, v, bias, attn_mask, is_causal, scale, num_splits: the call as the dense launcher sees it
            (q [B, H, Nq, D], k [B, H, Nk, D], v [B, H, Nk, Dv]; ``num_splits`` 0 = automatic).
        dtypes: input dtypes the kernel takes (q, k and v must share one).
        head_dims: head dims it takes (D = Dv).
        stride_elems: every stride but the head dim's, and the base address, must be a multiple of this
            many elements (16 bytes: cp.async vectors / TMA); ``stride_text`` says why in the reason.
        capable: predicate on the CUDA compute capability; ``capable_text`` names what fails it.
        import_error: the kernel module's import failure, if any.
    """
    if bias is not None or attn_mask is not None or is_causal:
        return "bias, mask or causal"
    if not scale > 0:
        return f"scale {scale!r} <= 0 (the row max is taken before scaling)"
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes ({q.dtype}, {k.dtype}, {v.dtype}); the Gluon kernel takes one of {dtypes}"
    D, Dv = q.shape[-1], v.shape[-1]
    if D != Dv or D not in head_dims:
        return f"head dims ({D}, {Dv}); the Gluon kernel takes equal head dims in {head_dims}"
    if num_splits > 1:
        return "split-KV requested"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not strides_aligned(t, stride_elems):
            return f"{name} {stride_text}"
    if q.device.type != "cuda":
        return f"tensors on {q.device.type}"
    if not capable(torch.cuda.get_device_capability(q.device)):
        return capable_text
    return import_error


def hopper_tma_scope_reason(q, k, v, bias, attn_mask, is_causal: bool, scale: float, num_splits: int, *,
                            dtypes: tuple[torch.dtype, ...], head_dims: tuple[int, ...],
                            import_error: str | None) -> str | None:
    """:func:`scope_reason` of a Hopper kernel that TMA-loads q / k / v (wgmma, TMA): strides and base addresses
    multiples of 8 elements (16 bytes), compute capability 9.x."""
    return scope_reason(q, k, v, bias, attn_mask, is_causal, scale, num_splits, dtypes=dtypes, head_dims=head_dims,
                        stride_elems=8,
                        stride_text="strides are not TMA-legal (contiguous head dim, 16-byte-aligned base and strides)",
                        capable=_hopper, capable_text=_HOPPER_TEXT, import_error=import_error)


def kv_heads_reason(q, k, v) -> str | None:
    """Why k / v [B, Hkv, N, D] cannot serve q [B, H, N, D]'s heads as grouped-query attention reads them (one head
    count Hkv for k and v, dividing H: query head h reads K / V head h // (H / Hkv)), or ``None``."""
    h, h_k, h_v = q.shape[1], k.shape[1], v.shape[1]
    if h_k != h_v or h_k < 1 or h % h_k:
        return f"key / value heads ({h_k}, {h_v}) that do not divide the {h} query heads as one count"
    return None


def hopper_copies_scope_reason(q, k, v, bias, attn_mask, is_causal: bool, scale: float, num_splits: int, *,
                               head_dims: tuple[int, ...], import_error: str | None,
                               grouped: bool = False) -> str | None:
    """:func:`scope_reason` of a Hopper kernel that reads FP16 copies of float32 q / k / v made per (batch, head) by
    a Triton operand pass (:mod:`.scaled_fp16`; the tf32 / fp32 builds): any strides but a unit head-dim stride (the
    pass reads rows), compute capability 9.x; equal heads for q and k / v unless ``grouped`` (then k / v heads
    dividing q's: grouped-query attention)."""
    if not grouped and (k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]):
        return "grouped-query attention (fewer key / value heads than query heads)"
    reason = kv_heads_reason(q, k, v)
    if reason is not None:
        return reason
    return scope_reason(q, k, v, bias, attn_mask, is_causal, scale, num_splits, dtypes=(torch.float32,),
                        head_dims=head_dims, stride_elems=1,
                        stride_text="has a head-dim stride other than 1 (the operand pass reads rows)",
                        capable=_hopper, capable_text=_HOPPER_TEXT, import_error=import_error)


def _hopper(cc: tuple[int, int]) -> bool:
    return cc[0] == 9


_HOPPER_TEXT = "not a compute capability 9.x GPU (wgmma and TMA are Hopper's)"


@functools.lru_cache(maxsize=None)
def nvmma_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The NVMMA (wgmma / TMA) shared layout of a float16 / bfloat16 / float32 descriptor block (cached: it is Python
    work on every launch). Needs Gluon (:data:`IMPORT_ERROR` None)."""
    gdtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gdtype)


def checked_call(caller: str, modes: str, reason: str | None, q: torch.Tensor, k: torch.Tensor,
                 out_dtype: torch.dtype, launch: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """A Gluon kernel's public entry: refuse a call outside its scope, else allocate the heads-inner output
    and run ``launch(out)`` unless there is nothing to compute.

    Raises:
        ValueError: ``reason`` is not ``None`` (it names the cause; the message points at ``modes``).
        TypeError: ``out_dtype`` is not one the kernels write.
    """
    if reason is not None:
        raise ValueError(f"{caller}: {reason}; use kernels.elsa_fwd.elsa_attention(mode={modes})")
    out, needs_kernel = allocate_output(q, k.shape[2], q.shape[3], out_dtype)
    if needs_kernel:
        launch(out)
    return out


if IMPORT_ERROR is None:

    @gluon.jit
    def online_softmax(s, m_i, l_i, t, Nk, qk_scale, offs_sn, BLOCK_N: gl.constexpr, TAIL: gl.constexpr):
        """Fold the raw scores ``s`` [BLOCK_M, BLOCK_N] of KV tile ``t`` into the row state: returns
        ``(p, m_new, l_new, alpha)`` with ``p = 2^(s * qk_scale - m_new)``, the base-2 running max
        ``m_new``, ``l_new = l_i * alpha + sum(p)`` and the rescale ``alpha = 2^(m_i - m_new)`` of what
        was folded before (ELSA supplement, Alg. 1). ``TAIL`` masks keys >= Nk (the last tile only);
        ``qk_scale`` > 0 (the max is taken on the unscaled scores)."""
        p, m_new, alpha = softmax_tile(s, m_i, t, Nk, qk_scale, offs_sn, BLOCK_N, TAIL)
        return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha

    @gluon.jit
    def softmax_tile(s, m_i, t, Nk, qk_scale, offs_sn, BLOCK_N: gl.constexpr, TAIL: gl.constexpr):
        """:func:`online_softmax` without the row sums: ``(p, m_new, alpha)``."""
        if TAIL:
            s = gl.where(((t * BLOCK_N + offs_sn) < Nk)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, alpha

    @gluon.jit
    def split_mma(a, a_lo, b, b_lo, acc, USE_ACC: gl.constexpr, PARTS: gl.constexpr):
        """``acc + a b`` as async Hopper wgmmas: one (``PARTS = 1``), or the split-FP16 product ``a_lo b + a b_lo +
        a b`` of hi parts ``a``, ``b`` and lo parts ``a_lo``, ``b_lo`` (``PARTS = 2``: three wgmmas, the small terms
        first, as :func:`.split16.split_scores` sums them; FP32 accumulation). Returns the last wgmma's token."""
        if PARTS == 2:
            acc = warpgroup_mma(a_lo, b, acc, use_acc=USE_ACC, is_async=True)
            acc = warpgroup_mma(a, b_lo, acc, is_async=True)
            acc = warpgroup_mma(a, b, acc, is_async=True)
        else:
            acc = warpgroup_mma(a, b, acc, use_acc=USE_ACC, is_async=True)
        return acc

    @gluon.jit
    def split_parts(x, dtype: gl.constexpr, LO_SCALE: gl.constexpr):
        """``(hi, lo)`` of FP32 ``x``: ``x`` rounded to ``dtype``, and the rounding's remainder times ``LO_SCALE``
        (a power of two that keeps it out of FP16's subnormals where ``x`` is small) rounded."""
        hi = x.to(dtype)
        return hi, ((x - hi.to(gl.float32)) * LO_SCALE).to(dtype)

    @gluon.jit
    def tma_load_parts(a_desc, b_desc, off_b, off_h, row, bar, a_smem, b_smem, slot, PARTS: gl.constexpr):
        """TMA-load rows ``[row, row + block)`` of head ``(off_b, off_h)`` of two [B, H, N, PARTS * D] tensors
        into ring slot ``slot`` of ``a_smem`` / ``b_smem``, expected on mbarrier ``bar``: each of the ``PARTS``
        column blocks ``[part * D, (part + 1) * D)`` (mode fp32's hi and lo parts) into buffer ``slot * PARTS +
        part``."""
        HEAD_D: gl.constexpr = a_desc.block_type.shape[3]
        mbarrier.expect(bar, PARTS * (a_desc.block_type.nbytes + b_desc.block_type.nbytes))
        for part in gl.static_range(PARTS):
            tma.async_copy_global_to_shared(a_desc, [off_b, off_h, row, part * HEAD_D], bar,
                                            a_smem.index(slot * PARTS + part))
            tma.async_copy_global_to_shared(b_desc, [off_b, off_h, row, part * HEAD_D], bar,
                                            b_smem.index(slot * PARTS + part))

    @gluon.jit
    def tma_store_rows(desc, off_b, off_h, row, stage, tile):
        """Write register tile ``tile`` [rows, D] as rows ``[row, row + rows)`` of head ``(off_b, off_h)`` of a
        [B, H, N, D] tensor through ``stage`` (a shared buffer of ``desc``'s block and layout, the caller's to reuse):
        every thread's part stored and fenced for the async proxy, the calling warps' barrier, one TMA store (rows
        past N clipped), then the wait until the store has read the stage. The stage is free again once the
        calling warps pass another barrier."""
        stage.reshape([tile.shape[0], tile.shape[1]]).store(tile)
        fence_async_shared()
        cta_barrier()  # every thread's part is in shared memory before the store reads it
        tma.async_copy_shared_to_global(desc, [off_b, off_h, row, 0], stage)
        tma.store_wait(0)
