"""Ragged (variable-length) ELSA forward: packed sequences without padding (ELSA supplement, Sec. E).

Layout (FlashAttention's ``flash_attn_varlen_func`` convention): the queries of all sequences are
packed along one token axis, ``q`` [total_q, H, D], ``k`` [total_k, H, D], ``v`` [total_k, H, Dv], any
strides; sequence ``s`` owns query rows ``cu_seqlens_q[s] : cu_seqlens_q[s + 1]`` and key rows
``cu_seqlens_k[s] : cu_seqlens_k[s + 1]`` (int32 offsets, [n_seq + 1], starting at 0). For each sequence
and head the kernel computes, exactly as the dense kernel does,

    y_i = sum_j exp(s_ij - m_i) v_j / sum_j exp(s_ij - m_i),   s_ij = scale q_i . k_j  (j visible to i),

as the fold of the ELSA state ``(m, S, W)`` over the sequence's KV tiles (supplement Alg. 1; the merge
is in :mod:`.elsa_fwd`). The inner step is :func:`.elsa_fwd._fold_tile` itself, so every mode's
arithmetic (``fp32`` split-FP16 f16x3, ``fp32-ieee``, ``tf32`` f16x1, ``fp16``, ``bf16``) is the dense
kernel's, tile for tile. Causal masking is top-left aligned within each sequence (key ``j`` visible to
query ``i`` iff ``j <= i``, both counted from the sequence's start), as :func:`visionattn.attention`.

Work mapping: one program per (query tile, head, sequence) on a 1-D grid of
``cdiv(max_seqlen_q, BLOCK_M) * H * n_seq`` programs, FlashAttention's choice: programs whose tile
starts past their sequence's end return at once. It needs, given ``max_seqlen_q``, no device-to-host
synchronisation; the cost is the early-exiting programs (~1-2 ns each on an H200, docs/tuning.md). Where the
caller has the lengths on the host (a list of sequences, or ``lengths``), a tile table of the real query tiles
(:func:`tile_table`, longest sequences first) sizes the grid instead: no program exits at once. Short sequences
are thereby packed into the same launch, long ones contribute many tiles. Splitting the keys of one very long
sequence over several programs (LeanAttention /
split-KV with the monoid merge) runs when the longest sequence's query tiles give fewer programs than
the GPU has SMs, with as many partitions as :func:`.elsa_fwd.choose_num_splits` finds cheapest from the
batch's total keys (LeanAttention's balance: a batch of one long and many short sequences splits the long one
finely): every sequence's keys are cut into partitions of ``tiles_per_split`` key tiles (partitions past a
short sequence's keys hold the identity state; the last one takes any tiles past the key bound), and
:func:`.elsa_fwd._elsa_merge_kernel` folds them.

Specialisation: mode (product precision), head dims, causal, LSE and the tile config (chosen from the
``max_seqlen_k`` bucket <= / > :data:`.elsa_fwd.SHORT_KV`, like the dense kernel's short-KV rows);
lengths, totals and offsets are runtime values (``do_not_specialize``), so new lengths compile nothing.

Entry point: :func:`varlen_forward`.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import (OUT_DTYPES, KernelCall, PlanCache, VarlenForwardRun, cdiv, device_table, head_blocks,
                      interpreting, run_first_that_fits)
from .elsa_fwd import (DENSE_MODES, LAZY_V_MIN_KEYS, MAX_HEAD_DIM, TileConfig, _fold_tile,
                       _precision, _smaller_configs, choose_num_splits, final_state, get_config, key_tiles,
                       load_query_tile, merge_call, partition_tiles, store_partial, tile_of_program)
from .modes import MODES
from .split16 import SPLIT_EXP

__all__ = ["varlen_forward", "plan_for", "varlen_unsupported_reason", "PLANS"]


@triton.jit
def sequence_span(Cu, seq):
    """``(start, length)`` of sequence ``seq`` in the ``cu_seqlens`` offsets ``Cu`` [n_seq + 1]: its first row in the
    packed tensor (int64) and its row count. Shared by :func:`_varlen_fwd_kernel` and the stream-K kernel
    (:mod:`.stream_k`)."""
    return tl.load(Cu + seq).to(tl.int64), tl.load(Cu + seq + 1) - tl.load(Cu + seq)


@triton.jit
def sequence_tile(Q, K, V, RowOff, seq, q_start, k_start, start_m64, off_h, offs_m, offs_d, row_ok, D, qk_scale,
                  sqt, sqh, sqd, skt, skh, svt, svh, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                  EVEN_D: tl.constexpr, PRECISION: tl.constexpr, ROW_OFFSETS: tl.constexpr):
    """The query tile of sequence ``seq`` from row ``start_m64`` of head ``off_h`` and where its keys / values start:
    ``(q, q_lo, q_inv, v_exp, k_base, v_base)`` (:func:`.elsa_fwd.load_query_tile`'s parts, the initial V column
    exponents, the head's K / V base pointers). Rows from ``RowOff`` [n_seq, 3] (``ROW_OFFSETS``) or ``cu_seqlens``
    starts ``q_start`` / ``k_start`` times the token strides. For :func:`fold_query_tile`."""
    if ROW_OFFSETS:  # multiples of 16 elements (the host checks): vector loads stay as aligned as packed ones
        q_row0 = tl.multiple_of(tl.load(RowOff + seq * 3), 16)
        k_row0 = tl.multiple_of(tl.load(RowOff + seq * 3 + 1), 16)
        v_row0 = tl.multiple_of(tl.load(RowOff + seq * 3 + 2), 16)
    else:
        q_row0 = q_start * sqt
        k_row0 = k_start * skt
        v_row0 = k_start * svt
    q_ptrs = Q + q_row0 + start_m64 * sqt + off_h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd
    q, q_lo, q_inv = load_query_tile(q_ptrs, row_ok, offs_d, D, qk_scale, BLOCK_M, EVEN_D, PRECISION)
    v_exp = tl.full([BLOCK_DV], SPLIT_EXP - 126, dtype=tl.int32)
    k_base = K + k_row0 + off_h * skh
    v_base = V + v_row0 + off_h * svh
    return q, q_lo, q_inv, v_exp, k_base, v_base


@triton.jit
def fold_query_tile(Q, K, V, RowOff, seq, q_start, k_start, start_m64, off_h, lo_t, mid_t, hi_t,
                    offs_m, offs_n, offs_d, offs_dv, rows, row_ok, Nk, D, Dv, qk_scale,
                    sqt, sqh, sqd, skt, skh, skd, svt, svh, svd,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr,
                    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                    LAZY_V: tl.constexpr, ROW_OFFSETS: tl.constexpr):
    """The ELSA state of the query tile of sequence ``seq`` from row ``start_m64`` of head ``off_h`` (its
    :func:`sequence_tile`), folded from the empty state over key tiles ``[lo_t, mid_t)`` interior (unmasked) and
    ``[mid_t, hi_t)`` boundary (masked) with :func:`.elsa_fwd._fold_tile`: :func:`.elsa_fwd.final_state`'s
    ``(lse, acc, l_i, m_i, v_unscale)``, ``acc`` [BLOCK_M, BLOCK_DV]. Shared by :func:`_varlen_fwd_kernel` and the
    stream-K kernel (:mod:`.stream_k`)."""
    q, q_lo, q_inv, v_exp, k_base, v_base = sequence_tile(
        Q, K, V, RowOff, seq, q_start, k_start, start_m64, off_h, offs_m, offs_d, row_ok, D, qk_scale,
        sqt, sqh, sqd, skt, skh, svt, svh, BLOCK_M, BLOCK_DV, EVEN_D, PRECISION, ROW_OFFSETS)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # no bias / mask: their pointers and strides are unused placeholders (HAS_BIAS = HAS_MASK = False)
    for t in range(lo_t, mid_t):
        acc, l_i, m_i, v_exp = _fold_tile(acc, l_i, m_i, v_exp, q, q_lo, q_inv, k_base, v_base, Q, Q, t * BLOCK_N,
                                          offs_m, offs_n, offs_d, offs_dv, row_ok, rows, Nk, D, Dv,
                                          skt, skd, svt, svd, 0, 0, 0, 0, qk_scale,
                                          False, IS_CAUSAL, False, False, EVEN_D, EVEN_DV, PRECISION, DOT_UPCAST,
                                          LAZY_V)
    for t in range(mid_t, hi_t):
        acc, l_i, m_i, v_exp = _fold_tile(acc, l_i, m_i, v_exp, q, q_lo, q_inv, k_base, v_base, Q, Q, t * BLOCK_N,
                                          offs_m, offs_n, offs_d, offs_dv, row_ok, rows, Nk, D, Dv,
                                          skt, skd, svt, svd, 0, 0, 0, 0, qk_scale,
                                          True, IS_CAUSAL, False, False, EVEN_D, EVEN_DV, PRECISION, DOT_UPCAST,
                                          LAZY_V)
    return final_state(acc, l_i, m_i, v_exp, PRECISION)


@triton.jit
def store_output(Out, Lse, lse, acc, l_i, v_unscale, q_start, start_m64, off_h, offs_m, offs_dv, row_ok, dv_ok,
                 total_q, sot, soh, sod, WRITE_LSE: tl.constexpr):
    """The query tile's normalised output ``W / S`` (0 without a visible key) to ``Out`` [total_q, H, Dv] at packed
    rows ``q_start + start_m64 + offs_m`` of head ``off_h`` (columns ``dv_ok``) and, with ``WRITE_LSE``, its LSE
    ``lse`` [BLOCK_M] to ``Lse`` [H, total_q] (-inf without a visible key); ``acc``, ``l_i``, ``v_unscale`` as
    :func:`.elsa_fwd.final_state` returns them. Shared by :func:`_varlen_fwd_kernel` and the stream-K kernel
    (:mod:`.stream_k`)."""
    if WRITE_LSE:
        tl.store(Lse + off_h * total_q + q_start + start_m64 + offs_m, lse, mask=row_ok)
    l_div = tl.where(l_i > 0.0, l_i, 1.0)  # no visible key: W = 0, S = 0 -> output 0
    out = acc / l_div[:, None] * v_unscale[None, :]
    o_ptrs = Out + (q_start + start_m64) * sot + off_h * soh + offs_m[:, None] * sot + offs_dv[None, :] * sod
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit(do_not_specialize=["H", "total_q", "n_m_tiles", "n_splits", "tiles_per_split"])
def _varlen_fwd_kernel(
    Q, K, V, CuQ, CuK, RowOff, Tiles, Out, Lse, WsM, WsS, WsW, qk_scale,
    sqt, sqh, sqd, skt, skh, skd, svt, svh, svd, sot, soh, sod,
    H, total_q, n_m_tiles, D, Dv, n_splits, tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr, LAZY_V: tl.constexpr, WRITE_LSE: tl.constexpr, SPLIT: tl.constexpr,
    ROW_OFFSETS: tl.constexpr, TILED: tl.constexpr,
):
    """One (query tile, [KV partition,] head, sequence) program; 1-D grid ``n_m_tiles * P * H * n_seq``.

    Tiles of one (sequence, head) are adjacent (they share K / V in L2). A tile starting at or past its
    sequence's query count returns at once. A sequence without keys writes zeros (and LSE -inf).
    ``WRITE_LSE``: also the natural-log log-sum-exp of each row's scaled logits to ``Lse`` [H, total_q].
    ``SPLIT``: partition ``p`` folds key tiles ``[p * tiles_per_split, (p + 1) * tiles_per_split)`` of its
    sequence (none past the sequence's keys: the identity state) and stores its partial ``(m, S)`` and
    normalised output ``W / S`` to the workspace [P, H, total_q] (+ [.., Dv]) for
    :func:`.elsa_fwd._elsa_merge_kernel`.
    ``ROW_OFFSETS`` (sequences read where they lie, not packed): ``RowOff`` [n_seq, 3] int64 holds the element
    offset of sequence ``s``'s first query / key / value row from ``Q`` / ``K`` / ``V``; else that row is
    ``cu_seqlens[s]`` rows into the packed tensor. The output is packed either way.
    ``TILED``: the grid holds only the real query tiles, ``P`` programs for each entry of ``Tiles`` (int32, the
    grid position ``(seq * H + head) * n_m_tiles + tile`` that the program stands for: :func:`tile_table`), in the
    table's order.
    """
    pid0 = tl.program_id(0)
    if TILED:
        if SPLIT:
            pid0 = tl.load(Tiles + pid0 // n_splits) * n_splits + pid0 % n_splits
        else:
            pid0 = tl.load(Tiles + pid0)
    pid_m, split, sh = tile_of_program(pid0, n_m_tiles, n_splits, SPLIT)
    off_h = (sh % H).to(tl.int64)
    seq = sh // H
    q_start, Lq = sequence_span(CuQ, seq)
    start_m = pid_m * BLOCK_M
    if start_m >= Lq:
        return
    k_start, Nk = sequence_span(CuK, seq)
    start_m64 = start_m.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_m + offs_m
    row_ok = rows < Lq
    dv_ok = offs_dv < Dv

    n_full, n_tiles = key_tiles(start_m, Nk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    lo_t, mid_t, hi_t = partition_tiles(split, tiles_per_split, n_splits, n_full, n_tiles, SPLIT)
    lse, acc, l_i, m_i, v_unscale = fold_query_tile(
        Q, K, V, RowOff, seq, q_start, k_start, start_m64, off_h, lo_t, mid_t, hi_t, offs_m, offs_n, offs_d, offs_dv,
        rows, row_ok, Nk, D, Dv, qk_scale, sqt, sqh, sqd, skt, skh, skd, svt, svh, svd,
        BLOCK_M, BLOCK_N, BLOCK_DV, IS_CAUSAL, EVEN_D, EVEN_DV, PRECISION, DOT_UPCAST, LAZY_V, ROW_OFFSETS)
    if SPLIT:  # workspace [P, H, total_q] (m, S) and [P, H, total_q, Dv] (W)
        store_partial(WsM, WsS, WsW, (split * H + off_h) * total_q + q_start + start_m64 + offs_m, m_i, l_i, acc,
                      v_unscale, offs_dv, row_ok, Dv)
    else:
        store_output(Out, Lse, lse, acc, l_i, v_unscale, q_start, start_m64, off_h, offs_m, offs_dv, row_ok, dv_ok,
                     total_q, sot, soh, sod, WRITE_LSE)


def _register_cap(precision: str, cfg: TileConfig, block_d: int, block_dv: int) -> dict:
    """Launch options that cap registers: ``maxnreg=128`` for the half-precision 8-warp tiles at head dims <= 64,
    else none. Triton 3.6's ptxas gives the packed variant (``ROW_OFFSETS=False``) 138 registers per thread,
    keeping ``cu_seqlens[s] * stride`` base addresses in per-thread registers through the key loop: above 128 an
    SM holds one 256-thread program instead of two. At 128 the kernel compiles to 127 registers without spills
    (docs/tuning.md: varlen half D<=64 register cap). Wider head dims need their registers, and 4-warp tiles fit
    two programs per SM at 255."""
    if precision == "half" and cfg.num_warps == 8 and max(block_d, block_dv) <= 64:
        return {"maxnreg": 128}
    return {}


class _VarlenPlan(VarlenForwardRun):
    """The varlen kernel for one call signature (grid, constexprs, strides fixed), with the split-KV merge
    when it partitions the keys; a call allocates the output (and LSE / workspace) and launches."""

    __slots__ = ("main", "merge", "fixed", "merge_fixed", "o_shape", "o_dtype", "device", "with_lse", "config",
                 "ws_shape", "ws_w_shape", "n_m_tiles")

    def __init__(self, q, k, v, n_seq, rows_bound, is_causal, mode, cfg: TileConfig, out_dtype, with_lse,
                 max_seqlen_k, splits: int, total_q: int | None = None, row_offsets: bool = False,
                 tiles: int | None = None):
        _, H, D = q.shape
        total_q = q.shape[0] if total_q is None else total_q
        Dv = v.shape[2]
        precision = _precision(mode, None)
        block_d, block_dv = head_blocks(D, Dv)
        n_m_tiles = self.n_m_tiles = cdiv(rows_bound, cfg.block_m)
        # KV partitions (decided by varlen_forward, which keys the plan on them)
        n_kv_tiles = max(1, cdiv(max_seqlen_k, cfg.block_n))
        tiles_per_split = cdiv(n_kv_tiles, max(1, min(splits, n_kv_tiles)))
        P = cdiv(n_kv_tiles, tiles_per_split)  # no partition past every sequence's keys
        self.config, self.device, self.o_dtype, self.with_lse = cfg, q.device, out_dtype, with_lse
        self.o_shape = (total_q, H, Dv)
        self.fixed = (*q.stride(), *k.stride(), *v.stride(), H * Dv, Dv, 1, H, total_q, n_m_tiles, D, Dv, P,
                      tiles_per_split)
        # with a tile table (``tiles`` entries: :func:`tile_table`) only the real query tiles' programs
        self.main = KernelCall(_varlen_fwd_kernel, ((n_m_tiles * H * n_seq if tiles is None else tiles) * P,), dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            PRECISION=precision, IS_CAUSAL=bool(is_causal), EVEN_D=D == block_d, EVEN_DV=Dv == block_dv,
            DOT_UPCAST=q.dtype == torch.bfloat16 and interpreting(),
            LAZY_V=precision == "f16x3" and max_seqlen_k > LAZY_V_MIN_KEYS, WRITE_LSE=bool(with_lse), SPLIT=P > 1,
            ROW_OFFSETS=bool(row_offsets), TILED=tiles is not None),
            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                 **_register_cap(precision, cfg, block_d, block_dv)))
        self.merge = self.ws_shape = self.ws_w_shape = None
        if P > 1:  # the packed rows as one batch entry of [1, H, total_q]: out [total_q, H, Dv], LSE [H, total_q]
            self.ws_shape, self.ws_w_shape = (P, H, total_q), (P, H, total_q, Dv)
            self.merge = merge_call(total_q, H, Dv, q.device, with_lse)
            self.merge_fixed = (0, Dv, H * Dv, 1, 1, H, total_q, Dv, P)

    def tile_tensor(self, lens_q, order) -> torch.Tensor:
        """This plan's tile table (:func:`tile_table` at its tile height and bound) for sequences of ``lens_q``
        queries in ``order``, on its device."""
        return _tile_tensor(lens_q, order, self.o_shape[1], self.config.block_m, self.n_m_tiles, self.device)


# call signature -> plan; PLANS.hits / PLANS.builds count reuses and builds
PLANS = PlanCache(graph_safe=True)  # stream-K plans hold their partition tables


def varlen_unsupported_reason(q, v, mode: str) -> str | None:
    """Why the varlen kernel cannot run this call, or ``None``: a mode without a dense kernel (PASA), a head
    dim above :data:`.elsa_fwd.MAX_HEAD_DIM`, tensors not on CUDA (unless ``TRITON_INTERPRET=1``)."""
    if mode not in DENSE_MODES:
        return f"mode {mode!r} has no dense ELSA kernel"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {MAX_HEAD_DIM}"
    if q.device.type != "cuda" and not interpreting():
        return f"tensors on {q.device.type} (the Triton kernels need CUDA or TRITON_INTERPRET=1)"
    return None


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                   scale: float, mode: str, out_dtype: torch.dtype | None = None, with_lse: bool = False,
                   num_splits: int = 0, row_offsets: torch.Tensor | None = None, total_q: int | None = None,
                   lengths: tuple | None = None, schedule: str = "auto"):
    """Packed ragged attention on the varlen kernel: ``(out, lse)``, ``lse`` None unless ``with_lse``.

    Args:
        q: [total_q, H, D] in the mode's compute dtype (float32 for ``fp32`` / ``fp32-ieee`` / ``tf32``,
            float16 / bfloat16 for ``fp16`` / ``bf16``); any strides, never copied.
        k: [total_k, H, D]; v: [total_k, H, Dv]; same dtype and device. D, Dv in 1..256.
        cu_seqlens_q, cu_seqlens_k: int32 [n_seq + 1] on q's device, non-decreasing, from 0 to total_q /
            total_k (validated by the caller, :func:`visionattn.varlen_attention`; not checked here).
        max_seqlen_q, max_seqlen_k: upper bounds of the per-sequence lengths (they size the grid and pick
            the tile config bucket; a larger bound only adds early-exiting programs).
        is_causal: top-left aligned causal mask per sequence.
        scale: logit scale; mode: a dense mode; out_dtype: float16 / bfloat16 / float32 (None = the compute
            dtype); with_lse: also return the LSE.
        num_splits: KV partitions of every sequence (split-KV: partial states merged by the monoid merge);
            0 = automatic: split only when the query tiles of all heads and sequences give fewer programs than
            the GPU has SMs (LeanAttention's regime; never off CUDA).
        row_offsets: sequences read where they lie instead of packed: int64 [n_seq, 3] on q's device, the
            element offsets of each sequence's first query / key / value row from ``q`` / ``k`` / ``v`` (each a
            multiple of 16; all sequences share ``q`` / ``k`` / ``v``'s strides), with ``total_q`` the packed
            output's rows (the sum of the query lengths). ``cu_seqlens_*`` then only give the lengths and the
            output rows; ``q`` / ``k`` / ``v`` are any tensors of the call with the common strides.
        lengths: ``(lens_q, lens_k)``, the per-sequence lengths on the host (tuples of ints, exactly those
            ``cu_seqlens_*`` hold: the grid then covers these query tiles only, :func:`tile_table`), when the caller
            has them: they also let the stream-K schedule (:mod:`.stream_k`) run.
        schedule: ``"auto"`` (stream-K where :func:`.stream_k.choose` picks it and ``lengths`` are given, else the
            single pass / split-KV plan), ``"stream-k"`` (needs ``lengths``), ``"split-kv"`` (never stream-K).

    Returns:
        out [total_q, H, Dv] contiguous in ``out_dtype`` (zeros for rows of a sequence without keys);
        lse [H, total_q] float32, ``log sum_j exp(scale q_i . k_j)`` over the visible keys (-inf without
        keys), or None.

    Raises:
        ValueError: a mode without a dense kernel; ``num_splits`` < 0; an unknown ``schedule``, or ``"stream-k"``
            without ``lengths`` or with ``num_splits``. TypeError: q / k / v not in the mode's compute dtype, or an
            unsupported ``out_dtype``.
    """
    return plan_for(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, mode,
                    out_dtype, with_lse, num_splits, row_offsets, total_q, lengths, schedule)[1]


def plan_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
             scale: float, mode: str, out_dtype: torch.dtype | None = None, with_lse: bool = False,
             num_splits: int = 0, row_offsets: torch.Tensor | None = None, total_q: int | None = None,
             lengths: tuple | None = None, schedule: str = "auto"):
    """``(plan, (out, lse))``: :func:`varlen_forward`'s result and the cached launch plan that produced it (None
    for an empty call); a plan takes ``(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, row_offsets)`` of any later
    call with the same signature. Arguments as :func:`varlen_forward`."""
    if mode not in DENSE_MODES:
        raise ValueError(f"mode={mode!r} has no dense ELSA kernel; expected one of {list(DENSE_MODES)}")
    dtype = MODES[mode].compute_dtype
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; mode {mode!r} computes in {dtype} (cast first)")
    out_dtype = out_dtype or dtype
    if num_splits < 0:
        raise ValueError(f"num_splits={num_splits}; expected >= 1 (or 0 = automatic)")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype}; the kernels write one of {OUT_DTYPES}")
    _, H, D = q.shape
    total_q = q.shape[0] if row_offsets is None else int(total_q)
    Dv = v.shape[2]
    n_seq = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or H == 0 or Dv == 0 or n_seq <= 0 or max_seqlen_q <= 0:
        return None, _without_keys(total_q, H, Dv, out_dtype, with_lse, q.device)
    max_seqlen_k = max(int(max_seqlen_k), 0)
    if _stream_k(q, v, H, mode, num_splits, lengths, schedule):
        return _stream_plan_for(q, k, v, lengths, total_q, is_causal, scale, mode, out_dtype, with_lse,
                                cu_seqlens_q, cu_seqlens_k, row_offsets)
    if lengths is not None and not num_splits and _precision(mode, None) == "half":
        found = _gluon_plan_for(q, k, v, lengths, n_seq, total_q, is_causal, scale, out_dtype, with_lse,
                                cu_seqlens_q, cu_seqlens_k, row_offsets)
        if found is not None:
            return found
    cfg0 = get_config(mode, D, Dv, max_seqlen_k)
    n_m_tiles = max(1, cdiv(max_seqlen_q, cfg0.block_m))
    lens_q, order = None, None
    if lengths is not None:
        lens_q, lens_k = _host_lengths(lengths, n_seq)
        order = _table_order(lens_q, lens_k, cfg0.block_m, n_m_tiles)
    # a split plan's partitions depend on the exact key bound; a single pass only on its bucket
    splits = num_splits or choose_num_splits(H * n_seq, cdiv(total_q, n_seq), max_seqlen_k, cfg0, q.device,
                                             _precision(mode, None),
                                             None if row_offsets is not None else (n_seq, k.shape[0]))
    key = (mode, total_q, H, D, None if row_offsets is not None else k.shape[0], row_offsets is not None, Dv,
           q.stride(), k.stride(), v.stride(), q.dtype, q.get_device(), n_seq,
           n_m_tiles, max_seqlen_k > LAZY_V_MIN_KEYS, bool(is_causal), out_dtype, bool(with_lse),
           q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, num_splits,
           max_seqlen_k if splits > 1 else None,
           None if order is None else _tile_counts(lens_q, n_m_tiles * cfg0.block_m, cfg0))
    plan = PLANS.get(key)
    if plan is not None:
        tiles = None if order is None else plan.tile_tensor(lens_q, order)
        return plan, plan(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale), row_offsets, tiles)
    result = []

    def run(cfg):
        # rows_bound: the key's query-length bucket, so a smaller fallback config covers every call of the key
        rows_bound = n_m_tiles * cfg0.block_m
        tiles = None if order is None else _tile_tensor(lens_q, order, H, cfg.block_m, cdiv(rows_bound, cfg.block_m),
                                                        q.device)
        p = _VarlenPlan(q, k, v, n_seq, rows_bound, is_causal, mode, cfg, out_dtype, with_lse, max_seqlen_k, splits,
                        total_q, row_offsets is not None, None if tiles is None else tiles.numel())
        result.append((p, p(q, k, v, cu_seqlens_q, cu_seqlens_k, float(scale), row_offsets, tiles)))

    run_first_that_fits(run, cfg0, _smaller_configs)
    plan, res = result[-1]
    PLANS.put(key, plan)
    return plan, res


# (call signature, lengths) -> (Gluon plan, its work tables), or None where the call stays on the Triton kernel:
# the checks and the work assignment run once per signature and lengths (host time of an eager call)
_GLUON_ROUTES = PlanCache(graph_safe=True)


def _gluon_plan_for(q, k, v, lengths, n_seq: int, total_q: int, is_causal: bool, scale: float, out_dtype,
                    with_lse: bool, cu_q, cu_k, row_offsets):
    """``(plan, (out, lse))`` on the warp-specialized Gluon kernel (:mod:`.varlen_gluon`) for an fp16 / bf16 call
    with host lengths that it takes and prefers (more than 64 queries in the longest sequence) and that the single
    pass runs (where the split-KV plan would split the keys, few query tiles, the Triton kernel keeps the call); else
    None. A Gluon build that fails warns once and leaves the rest of the process on the Triton kernel."""
    from . import elsa_fwd

    if "varlen half" in elsa_fwd._GLUON_FAILED or not elsa_fwd._gluon_device(q.device):
        return None
    route_key = (tuple(lengths[0]), tuple(lengths[1]), q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
                 q.dtype, q.device, bool(is_causal), scale > 0, bool(with_lse), out_dtype, row_offsets is None,
                 q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15)
    route = _GLUON_ROUTES.get(route_key)
    if route is None:
        route = _gluon_route(q, k, v, lengths, n_seq, total_q, is_causal, scale, out_dtype, with_lse, row_offsets)
        if route is None:
            _GLUON_ROUTES.put(route_key, False)
            return None
        plan, work = route
        try:
            result = plan(q, k, v, cu_q, cu_k, float(scale), None, work)
        except Exception as exc:  # a Triton release whose Gluon cannot build this kernel
            elsa_fwd._gluon_failed("varlen half", f"{type(exc).__name__}: {exc}")
            return None
        _GLUON_ROUTES.put(route_key, route)
        return plan, result
    if route is False:
        return None
    plan, work = route
    return plan, plan(q, k, v, cu_q, cu_k, float(scale), None, work)


def _gluon_route(q, k, v, lengths, n_seq: int, total_q: int, is_causal: bool, scale: float, out_dtype,
                 with_lse: bool, row_offsets):
    """``(plan, work)`` of :func:`_gluon_plan_for`'s call (the plan from :data:`PLANS` or new; an import error warned
    once), or None where the Gluon kernel does not take it."""
    from . import elsa_fwd, varlen_gluon

    lens_q, lens_k = _host_lengths(lengths, n_seq)
    if not varlen_gluon.preferred(lens_q):
        return None
    _, H, D = q.shape
    cfg = varlen_gluon.get_config(lens_q, lens_k, D)
    reason = varlen_gluon.unsupported_reason(q, k, v, lens_q, lens_k, is_causal, scale, row_offsets, cfg["BLOCK_N"])
    if reason is not None:
        if reason == varlen_gluon._IMPORT_ERROR:  # reported last: the call was otherwise in scope
            elsa_fwd._gluon_failed("varlen half", reason)
        return None
    tiles = TileConfig(cfg["BLOCK_M"], cfg["BLOCK_N"], 4, cfg["STAGES"])
    if choose_num_splits(H * n_seq, cdiv(total_q, n_seq), max(lens_k), tiles, q.device, "half",
                         (n_seq, k.shape[0])) > 1:
        return None
    key = ("gluon", total_q, H, D, k.shape[0], q.stride(), k.stride(), v.stride(), q.dtype, q.get_device(),
           out_dtype, bool(with_lse), q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, cfg["consumers"])
    plan = PLANS.get(key)
    if plan is None:
        try:
            plan = PLANS.put(key, varlen_gluon.VarlenGluonPlan(q, k, v, out_dtype, with_lse, cfg))
        except Exception as exc:  # a Triton release whose Gluon API cannot describe these tensors
            elsa_fwd._gluon_failed("varlen half", f"{type(exc).__name__}: {exc}")
            return None
    return plan, plan.work(lens_q, lens_k)


def longest_first(lens_q, lens_k) -> tuple[int, ...] | None:
    """The order in which the varlen grid visits the sequences of these host-side lengths: by key count, then query
    count, longest first (ties in their given order), or None where that is their given order. A program's work
    grows with its sequence's keys and the GPU starts programs roughly in grid order, so the longest ones start
    first and the short ones fill the SMs at the end (Graham's longest-processing-time rule; started last, a long
    sequence's programs run alone past the others; docs/tuning.md: varlen sequence order)."""
    order = sorted(range(len(lens_k)), key=lambda s: (-lens_k[s], -lens_q[s]))
    return None if all(s == i for i, s in enumerate(order)) else tuple(order)


@functools.lru_cache(maxsize=4096)  # asked on every call with host lengths
def _tile_counts(lens_q: tuple[int, ...], rows_bound: int, config: TileConfig) -> tuple[int, ...]:
    """Query tiles per head of sequences of ``lens_q`` queries (at most ``rows_bound`` a sequence), at ``config``'s
    tile height and each shared-memory fallback's (:func:`.elsa_fwd._smaller_configs`): a plan's grid holds its
    config's count, so the plan key holds them all (two calls with equal counts at one height may differ at
    another)."""
    heights = sorted({c.block_m for c in (config, *_smaller_configs(config))})
    return tuple(sum(min(cdiv(n, m), cdiv(rows_bound, m)) for n in lens_q) for m in heights)


@functools.lru_cache(maxsize=4096)  # asked on every call with host lengths
def _table_order(lens_q, lens_k, block_m: int, n_m_tiles: int) -> tuple[int, ...] | None:
    """The sequence order of a call's tile table (:func:`longest_first`), or None where the grid's own order
    holds no tile past a sequence (nothing for a table to skip or reorder)."""
    order = longest_first(lens_q, lens_k)
    if order is None and all(cdiv(n, block_m) >= n_m_tiles for n in lens_q):
        return None
    return order or tuple(range(len(lens_q)))


def forward_runner(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
                   mode: str, out_dtype: torch.dtype | None = None, lengths: tuple | None = None,
                   row_offsets: torch.Tensor | None = None, total_q: int | None = None):
    """``(run, out)``: :func:`varlen_forward`'s output of this call (no LSE, the automatic schedule; q / k / v packed,
    or read in place at ``row_offsets`` as :func:`plan_for` takes them) and ``run(q, k, v, cu_seqlens_q, cu_seqlens_k,
    scale) -> out``, which launches a later call of the same signature, maxima, ``lengths`` and ``row_offsets`` from
    the same plan (its tile table or work tables included) without planning again; ``run`` is None where the call
    launches nothing (no query rows, heads or value columns). Arguments as :func:`varlen_forward` and
    :func:`plan_for`."""
    plan, (out, _) = plan_for(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, mode,
                              out_dtype, row_offsets=row_offsets, total_q=total_q, lengths=lengths)
    if plan is None:
        return None, out
    if isinstance(plan, _VarlenPlan):
        extra = (row_offsets, None if lengths is None else plan_tiles(plan, lengths))
    elif hasattr(plan, "work"):  # the Gluon kernel's plan (varlen_gluon.VarlenGluonPlan): its work tables
        extra = (row_offsets, plan.work(*_host_lengths(lengths, len(lengths[0]))))
    else:  # the stream-K plan (its partition is the plan's own)
        extra = (row_offsets,)

    def run(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
        return plan(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, *extra)[0]

    return run, out


def plan_tiles(plan, lengths) -> torch.Tensor | None:
    """The tile table that ``plan`` (a :func:`plan_for` plan) launches with for host ``lengths`` = ``(lens_q,
    lens_k)``, those it was planned for or others of the same signature; None for a plan without one."""
    if not isinstance(plan, _VarlenPlan) or not plan.main.constexprs["TILED"]:
        return None
    lens_q, lens_k = _host_lengths(lengths, len(lengths[0]))
    return plan.tile_tensor(lens_q, longest_first(lens_q, lens_k) or tuple(range(len(lens_q))))


def tile_table(lens_q, order, heads: int, block_m: int, n_m_tiles: int) -> torch.Tensor:
    """The varlen grid positions of the real query tiles of sequences of ``lens_q`` queries (host ints), visited in
    ``order`` (a permutation of the sequences): int32 [heads * sum_s min(cdiv(lens_q[s], block_m), n_m_tiles)], entry
    ``(s * heads + h) * n_m_tiles + m`` for tile ``m`` of head ``h`` of sequence ``s``; a sequence's tiles of one head
    adjacent (they share K / V in L2), its heads next. The kernel's grid then holds no program past its sequence's
    queries (``cdiv(max_seqlen_q, block_m) * heads * n_seq`` programs hold ~1 ns each of them: docs/tuning.md)."""
    seqs = torch.tensor(order, dtype=torch.int64)
    tiles = torch.tensor([min(cdiv(lens_q[s], block_m), n_m_tiles) for s in order], dtype=torch.int64)
    groups = (seqs[:, None] * heads + torch.arange(heads)).reshape(-1) * n_m_tiles  # first position per (seq, head)
    counts = tiles.repeat_interleave(heads)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(int(counts.sum())) - starts.repeat_interleave(counts)  # the tile within its (seq, head)
    return (groups.repeat_interleave(counts) + rank).to(torch.int32)


# (lengths, order, heads, tiles, device) -> (int32 device copy of a tile_table, its pinned host source); as many as the
# plans, 4 bytes per real query tile and head; the entries a CUDA graph captured are never dropped (graph_safe)
_TILES = PlanCache(max_size=4096, graph_safe=True)


def _tile_tensor(lens_q, order, heads: int, block_m: int, n_m_tiles: int, device: torch.device) -> torch.Tensor:
    """:func:`tile_table` on ``device``, copied once per signature (asynchronously, from pinned memory). The pinned
    source is kept with the copy: a copy made while a CUDA graph is captured reads it again at every replay."""
    key = (lens_q, order, heads, block_m, n_m_tiles, device)
    kept = _TILES.get(key)
    if kept is None:
        kept = _TILES.put(key, device_table(tile_table(lens_q, order, heads, block_m, n_m_tiles), device))
    return kept[0]


def _host_lengths(lengths, n_seq: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``lengths`` = ``(lens_q, lens_k)`` as tuples of ints, one per sequence of the call's ``n_seq``.

    Raises:
        ValueError: another count (the order table and the stream-K partition index the sequences by them)."""
    lens_q, lens_k = tuple(int(x) for x in lengths[0]), tuple(int(x) for x in lengths[1])
    if len(lens_q) != n_seq or len(lens_k) != n_seq:
        raise ValueError(f"lengths list {len(lens_q)} / {len(lens_k)} sequences, cu_seqlens {n_seq}; expected one "
                         f"length per sequence")
    return lens_q, lens_k


def _without_keys(total_q: int, heads: int, head_dim_v: int, out_dtype, with_lse: bool, device):
    """``(out, lse)`` of a call with nothing to fold: zeros [total_q, H, Dv] and, with ``with_lse``, -inf [H, total_q]
    (no visible key), without a launch."""
    out = torch.zeros((total_q, heads, head_dim_v), dtype=out_dtype, device=device)
    return out, torch.full((heads, total_q), float("-inf"), device=device) if with_lse else None


SCHEDULES = ("auto", "stream-k", "split-kv")


def _stream_k(q, v, heads: int, mode: str, num_splits: int, lengths, schedule: str) -> bool:
    """Whether the call runs the stream-K schedule (:mod:`.stream_k`): asked for, or ``"auto"`` with host-side
    lengths, no explicit split count and :func:`.stream_k.choose`'s rule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; expected one of {SCHEDULES}")
    if schedule == "stream-k":
        if lengths is None or num_splits:
            raise ValueError("schedule='stream-k' partitions by the sequence lengths: pass lengths=(lens_q, lens_k) "
                             "and no num_splits")
        return True
    if schedule == "split-kv" or lengths is None or num_splits:
        return False
    from . import stream_k

    return stream_k.choose(lengths[0], lengths[1], heads, mode, q.shape[2], v.shape[2], q.device)


def _stream_plan_for(q, k, v, lengths, total_q: int, is_causal: bool, scale: float, mode: str, out_dtype,
                     with_lse: bool, cu_q, cu_k, row_offsets):
    """``(plan, (out, lse))`` of the stream-K schedule, the plan cached by the call signature and the lengths."""
    from . import stream_k

    lens_q, lens_k = _host_lengths(lengths, cu_q.shape[0] - 1)
    key = ("stream-k", mode, total_q, q.shape[1:], v.shape[2], q.stride(), k.stride(), v.stride(), q.dtype,
           q.get_device(), row_offsets is not None, bool(is_causal), out_dtype, bool(with_lse),
           q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, lens_q, lens_k)
    plan = PLANS.get(key)
    if plan is None:
        plan = stream_k.stream_plan(q, k, v, lens_q, lens_k, total_q, is_causal, mode, out_dtype, with_lse,
                                    row_offsets is not None)
        if plan is None:  # no query rows
            return None, _without_keys(total_q, q.shape[1], v.shape[2], out_dtype, with_lse, q.device)
        PLANS.put(key, plan)
    return plan, plan(q, k, v, cu_q, cu_k, float(scale), row_offsets)
