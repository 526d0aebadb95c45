"""Dense ELSA forward: Triton kernels for exact softmax attention.

The ELSA view (ELSA paper, Sec. 3; supplement Alg. 1): for one query row the keys
fold into a state ``(m, S, W)`` — running max logit ``m``, normalizer
``S = sum_j exp(s_j - m)`` and unnormalized output ``W = sum_j exp(s_j - m) v_j`` —
under the associative merge

    m = max(m_a, m_b),  S = S_a 2^(m_a - m) + S_b 2^(m_b - m),  W likewise,

with identity ``(-inf, 0, 0)`` and output ``y = W / S``. Logits are kept in base 2
(``log2(e)`` is folded into the scale, so every exponential is one ``exp2``).

Two paths, both over the same inner step :func:`_fold_tile`:

* **single pass** (:func:`_elsa_fwd_kernel` with ``SPLIT=False``): one program per
  (query tile, head, batch) streams all KV tiles with the state in registers and
  writes ``W / S`` (FlashAttention's online softmax). Extra memory: the output.
* **split-KV** (``SPLIT=True`` + :func:`_elsa_merge_kernel`): the KV tiles of each
  query tile are cut into P contiguous partitions; each program writes its partial
  ``(m, S)`` and normalised output ``W / S`` (FP32) to a workspace, and the merge kernel folds the
  P partials with the monoid merge (Flash-Decoding / LeanAttention). Chosen
  automatically when ``B * H * ceil(Nq / BLOCK_M)`` programs cannot fill the GPU.

Modes (:data:`.modes.MODES` whose ``kernels`` name the dense family) and their product precisions:

* ``fp32``: ``"f16x3"``, split-FP16 products (:mod:`.split16`). Each FP32 operand is scaled by an exact
  power of two and split into two FP16 parts of 11 significant bits each (the same
  22 bits 3xTF32 keeps), and hi*hi + hi*lo + lo*hi run on the FP16 tensor cores,
  which are twice as fast as TF32's, at 3xTF32's accuracy (docs/tuning.md: fp32 products:
  split-FP16 (f16x3)). On Hopper, calls within its scope (D = Dv = 64, no bias / mask / causal, from
  :data:`.fp32_gluon.MIN_KEYS` keys) run the same products on the warp-specialized Gluon kernel of :mod:`.half_gluon`
  (:mod:`.fp32_gluon`: operands scaled per head and split once, up front).
* ``fp32-ieee``: ``"ieee"``, FP32 FMA, no tensor cores. On CUDA, calls within its scope (D = Dv in
  {32, 64, 128}, no bias / mask / causal) run the Gluon kernel of :mod:`.ieee_gluon` instead, about twice as
  fast (docs/tuning.md: fp32-ieee on a Gluon register-blocked FMA kernel (not `tl.dot(..., "ieee")`)).
* ``tf32``: ``"f16x1"``, the hi*hi product alone: operands rounded to 11 significant
  bits as TF32 rounds them (TF32-class accuracy), on the FP16 tensor cores, faster than
  ``"tf32"``; P's FP16 scale is folded into the exp2 argument (docs/tuning.md: tf32 products: one
  FP16 product of 11-bit operands (f16x1)).
* ``fp16`` / ``bf16``: half tensor-core products, P rounded to the input dtype before
  ``P @ V``. On Hopper, calls within its scope (D = Dv in {64, 128}, no bias / mask / causal, the
  lengths :func:`.half_gluon.preferred` names) run the warp-specialized Gluon kernel of :mod:`.half_gluon`
  instead (docs/tuning.md: Hopper fp16 / bf16: a warp-specialized Gluon kernel (FlashAttention-3 schedule)
  beside the Triton kernel).

Grouped-query / multi-query attention (k / v [B, Hkv, Nk, D] with Hkv dividing H; FlashAttention-2's GQA / MQA,
SDPA's ``enable_gqa``): a program of query head ``h`` reads K / V head ``h // G``, G = H / Hkv (the kernel's
``GROUP``, :func:`kv_group`), both paths, K / V read in place; the programs of one group's heads are adjacent in
the grid, so they share K / V tiles in L2.

Scores, state and accumulation are FP32 in every mode. ``"tf32x3"`` and ``"tf32"`` stay
selectable (``precision=`` of :func:`get_config` / the launcher) for comparison.

Public entry points: :func:`dense_forward` (what :mod:`visionattn.ops` calls: a cached launch
plan per call signature, see :mod:`._launch`), :func:`elsa_attention` (the same, output only),
:func:`unsupported_reason`; for tools and tuning: :func:`get_config`, :func:`choose_num_splits`,
:class:`TileConfig`. The torch custom op that ``torch.compile`` sees is ``visionattn::attention``
(:mod:`visionattn.ops`).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._launch import (OUT_DTYPES, DenseForwardRun, EmptyForwardPlan, GluonForwardPlan, KernelCall, PlanCache, cdiv,
                      head_blocks, heads_inner_layout, interpreting, pad_pow2, run_first_that_fits, sm_count)
from .modes import MODES
from .split16 import SPLIT_EXP, fold_pv, pv_unscale, split_rows, split_scores

__all__ = [
    "elsa_attention", "dense_forward", "plan_for", "unsupported_reason", "TileConfig", "get_config",
    "choose_num_splits", "kv_group", "DENSE_MODES", "MAX_HEAD_DIM", "SHORT_KV", "PLANS",
]

MAX_HEAD_DIM = 256

# modes this module's kernels serve (the facts about each live in .modes.MODES)
DENSE_MODES: tuple[str, ...] = tuple(name for name, m in MODES.items() if "dense" in m.kernels)


# --------------------------------------------------------------------------- kernels

@triton.jit
def load_kv_tile(ptrs, rows_ok, offs_c, n_c, BOUNDARY: tl.constexpr, EVEN: tl.constexpr):
    """Load a [BLOCK_N, BLOCK_C] K or V tile. BOUNDARY tiles mask rows (keys) outside ``rows_ok``;
    unless EVEN (n_c == BLOCK_C), columns >= ``n_c`` (head-dim padding) are masked too. Masked -> 0."""
    if BOUNDARY:
        if EVEN:
            x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=rows_ok[:, None] & (offs_c < n_c)[None, :], other=0.0)
    elif EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_c < n_c)[None, :], other=0.0)
    return x


@triton.jit
def load_query_tile(q_ptrs, row_ok, offs_d, D, qk_scale, BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Load a [BLOCK_M, BLOCK_D] query tile (rows outside ``row_ok`` and, unless EVEN_D, head-dim padding
    masked to 0) and prepare it for :func:`_fold_tile`: ``(q, q_lo, q_inv)``. Split-FP16 precisions ("f16x3",
    "f16x1"): the row-scaled FP16 parts of ``q * qk_scale`` and their inverse row scales; otherwise ``q``
    itself, ``q_lo = q`` (unused) and zero scales (unused).

    The logit scale goes into q before the split, so the scores are the product times exact powers of two
    only: an FMA-contracted ``qk * scale - m`` then rounds exactly as the ``qk`` the row max was taken from, and
    p = exp2(qk - m) never exceeds 1 (P's FP16 parts hold up to 2^15 * 2). With a non-power-of-two scale,
    logits of ~1e9 gave p = 2^64."""
    if EVEN_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    q_lo = q
    q_inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PRECISION == "f16x3" or PRECISION == "f16x1":
        q, q_lo, q_inv = split_rows(q * qk_scale)
    return q, q_lo, q_inv


@triton.jit
def key_tiles(start_m, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """``(n_full, n_tiles)``: the key tiles the query tile at ``start_m`` streams, ``[0, n_full)`` interior (every
    key valid and, causal, visible to every row: neither the Nk tail mask nor the causal mask), ``[n_full,
    n_tiles)`` boundary (masked); causal stops at the diagonal (later key tiles are fully masked: skipped)."""
    hi = Nk
    if IS_CAUSAL:
        hi = tl.minimum(Nk, start_m + BLOCK_M)
    n_tiles = tl.cdiv(hi, BLOCK_N)
    n_full = Nk // BLOCK_N
    if IS_CAUSAL:
        n_full = tl.minimum(n_full, (start_m + 1) // BLOCK_N)
    return tl.minimum(n_full, n_tiles), n_tiles


@triton.jit
def program_tile(n_m_tiles, n_splits, SPLIT: tl.constexpr):
    """``(pid_m, split, rest)`` of this program in a 1-D grid ``n_m_tiles * P * rest``: the query tile, its KV
    partition (0 without SPLIT) and the index of its (head, batch / sequence) group."""
    return tile_of_program(tl.program_id(0), n_m_tiles, n_splits, SPLIT)


@triton.jit
def tile_of_program(pid0, n_m_tiles, n_splits, SPLIT: tl.constexpr):
    """:func:`program_tile` of program ``pid0`` (a grid position, or one that a table maps a program to)."""
    tiles = n_m_tiles * n_splits
    pid = pid0 % tiles
    if SPLIT:
        pid_m = pid // n_splits
        split = pid % n_splits
    else:
        pid_m = pid
        split = 0
    return pid_m, split, pid0 // tiles


@triton.jit
def partition_tiles(split, tiles_per_split, n_splits, n_full, n_tiles, SPLIT: tl.constexpr):
    """``(lo, mid, hi)``: the key tiles partition ``split`` of ``n_splits`` folds, ``[lo, mid)`` interior and
    ``[mid, hi)`` boundary (:func:`key_tiles`' split at ``n_full``); without SPLIT every tile, ``lo = 0``. The
    last partition also takes any tiles past ``n_splits * tiles_per_split`` (a ragged call's key bound below a
    sequence's length, which the single pass reads whole too)."""
    lo = 0
    hi = n_tiles
    if SPLIT:
        lo = split * tiles_per_split
        hi = tl.where(split == n_splits - 1, n_tiles, tl.minimum(lo + tiles_per_split, n_tiles))
    return lo, tl.maximum(tl.minimum(n_full, hi), lo), hi


@triton.jit
def final_state(acc, l_i, m_i, v_exp, PRECISION: tl.constexpr):
    """After the last tile: ``(lse, acc, l_i, m_i, v_unscale)``, ``lse`` the rows' natural-log log-sum-exp
    (-inf without a visible key), ``(m_i, l_i)`` the state as partials store it (f16x1: ``(m + 15, S / 2^15)``,
    the same state, so partitions whose rows took the minus-15 shift and those past 2^23 that did not merge
    consistently) and ``v_unscale`` [BLOCK_DV] the factors undoing the V / P scales of ``acc``."""
    v_unscale = tl.full(v_exp.shape, 1.0, dtype=tl.float32)
    if PRECISION == "f16x3" or PRECISION == "f16x1":
        v_unscale = pv_unscale(v_exp)
    # log2 sum_j 2^(s_j) = m + log2(sum_j 2^(s_j - m)) with the raw running sum (before f16x1's 2^-15)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    if PRECISION == "f16x1":
        l_i = l_i * (1.0 / 32768.0)  # P's 2^15 was in each p (see _fold_tile); acc's goes with v_unscale
        m_i = m_i + 15.0
    return lse, acc, l_i, m_i, v_unscale


@triton.jit
def store_partial(WsM, WsS, WsW, row_id, m_i, l_i, acc, v_unscale, offs_dv, row_ok, Dv):
    """A partition's partial state of rows ``row_id``: m, S to ``WsM`` / ``WsS`` and its normalised output
    ``W / S`` (0 without a visible key) to ``WsW`` (rows of ``Dv``), for :func:`_elsa_merge_kernel`. Stored
    normalised, a partial is bounded by the largest |V| like the single pass's output (``W`` itself can pass
    FP32's range when V is near it)."""
    tl.store(WsM + row_id, m_i, mask=row_ok)
    tl.store(WsS + row_id, l_i, mask=row_ok)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_unscale[None, :]  # divide first, as the single pass
    tl.store(WsW + row_id[:, None] * Dv + offs_dv[None, :], out, mask=row_ok[:, None] & (offs_dv < Dv)[None, :])


@triton.jit
def _fold_tile(acc, l_i, m_i, v_exp, q, q_lo, q_inv, k_base, v_base, b_base, msk_base, start_n,
               offs_m, offs_n, offs_d, offs_dv, row_ok, rows, Nk, D, Dv,
               skn, skd, svn, svd, sbm, sbn, smm, smn, qk_scale,
               BOUNDARY: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_MASK: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, LAZY_V: tl.constexpr):
    """Fold one KV tile [start_n, start_n + BLOCK_N) into the per-row state (acc=W, l_i=S, m_i=m).

    Split-FP16 precisions ("f16x3", "f16x1"): ``q`` / ``q_lo`` are the row-scaled FP16 parts of the
    query tile times the logit scale and ``q_inv`` their inverse row scales; ``acc`` is held scaled by
    2^(SPLIT_EXP - v_exp + 15) per column, ``v_exp`` [BLOCK_DV] being the largest V exponent seen so
    far in each column.

    BOUNDARY tiles mask keys >= Nk and (causal) keys after the query; interior tiles skip both.
    DOT_UPCAST (interpreter only, whose bf16 ``tl.dot`` is broken): products of the bf16
    operands in FP32, which is exact, as the tensor cores compute them.
    """
    cols = start_n + offs_n
    col_ok = cols < Nk
    start_n64 = start_n + tl.zeros([], dtype=tl.int64)  # 64-bit tile offsets (loop var may be a Python int)
    k = load_kv_tile(k_base + start_n64 * skn + offs_n[:, None] * skn + offs_d[None, :] * skd,
                     col_ok, offs_d, D, BOUNDARY, EVEN_D)
    if PRECISION == "f16x3" or PRECISION == "f16x1":
        k_hi, k_lo, k_inv = split_rows(k)
        # scores = product * q_inv (rows) * k_inv (columns), exact powers of two; the row factor joins
        # later (the row max of product * k_inv times q_inv is the scores' max; the exp2's FMA takes it)
        qk = split_scores(q, q_lo, k_hi, k_lo, PRECISION) * k_inv[None, :]
        if HAS_BIAS:
            qk = qk * q_inv[:, None]
    elif DOT_UPCAST:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
    elif PRECISION == "half":
        qk = tl.dot(q, tl.trans(k)) * qk_scale
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    # interior tiles mask bias / mask loads by row only: a mask uniform along the key axis lets them
    # load as vectors, pipelined like K and V (the key mask depends on the unspecialized Nk)
    if BOUNDARY:
        bm_ok = row_ok[:, None] & col_ok[None, :]
    else:
        bm_ok = row_ok[:, None]
    if HAS_BIAS:
        b_ptrs = b_base + start_n64 * sbn + offs_m[:, None] * sbm + offs_n[None, :] * sbn
        bias = tl.load(b_ptrs, mask=bm_ok, other=0.0)
        qk += bias.to(tl.float32) * 1.4426950408889634
    if HAS_MASK:
        mk_ptrs = msk_base + start_n64 * smn + offs_m[:, None] * smm + offs_n[None, :] * smn
        keep = tl.load(mk_ptrs, mask=bm_ok, other=0)
        qk = tl.where(keep != 0, qk, float("-inf"))
    if BOUNDARY:
        valid = col_ok[None, :]
        if IS_CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        qk = tl.where(valid, qk, float("-inf"))
    if (PRECISION == "f16x3" or PRECISION == "f16x1") and not HAS_BIAS:
        m_tile = tl.max(qk, 1) * q_inv
    else:
        m_tile = tl.max(qk, 1)
    if PRECISION == "f16x1":
        # m_i is the row max minus 15, so p = exp2(score - m_i) <= 2^15 carries P's FP16 scale itself (one
        # multiply per score fewer; the sum l_i carries it too until the kernel's end). Past 2^23 the subtraction
        # could round m_i down and p overflow FP16: such rows keep p <= 1 (TF32-class is lost there anyway).
        m_tile = tl.where(tl.abs(m_tile) < 8388608.0, m_tile - 15.0, m_tile)
    m_new = tl.maximum(m_i, m_tile)
    # a row with every key so far masked keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if (PRECISION == "f16x3" or PRECISION == "f16x1") and not HAS_BIAS:
        p = tl.math.exp2(qk * q_inv[:, None] - m_safe[:, None])  # one FMA: qk * q_inv is exact
    else:
        p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    v = load_kv_tile(v_base + start_n64 * svn + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                     col_ok, offs_dv, Dv, BOUNDARY, EVEN_DV)
    if PRECISION == "f16x3" or PRECISION == "f16x1":
        l_i = l_i * alpha + tl.sum(p, 1)
        acc, v_exp = fold_pv(acc, alpha, v_exp, p, v, PRECISION, PRECISION == "f16x1", LAZY_V)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DOT_UPCAST:
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
        elif PRECISION == "ieee":
            # FMA dots accumulate product by product into `acc`: over 65536 keys that is 65536
            # roundings against a large sum (rel err ~5e-6). Sum this tile apart and add it once
            # (one rounding per tile, as the MMA does). The start value `acc * 0.0` is not a known
            # zero, so the compiler cannot fold the add back into the dot.
            acc += tl.dot(p, v, acc * 0.0, input_precision="ieee")
        elif PRECISION == "half":
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new, v_exp


# Sequence lengths are not specialized on (divisibility by 16, == 1): a new length, e.g. FastVGGT's
# data-dependent merged length, then never triggers a recompile in the middle of a timed run.
@triton.jit(do_not_specialize=["B", "H", "Nq", "Nk", "n_splits", "tiles_per_split"])
def _elsa_fwd_kernel(
    Q, K, V, Bias, Mask, Out, Lse, WsM, WsS, WsW, qk_scale,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sbb, sbh, sbm, sbn, smb, smh, smm, smn, sob, soh, som, sod,
    B, H, Nq, Nk, D, Dv, n_splits, tiles_per_split, GROUP,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_UPCAST: tl.constexpr,
    LAZY_V: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """One (query tile, [KV partition,] head, batch) program; 1-D grid n_m_tiles * P * H * B.

    One grid axis: axes 1 and 2 stop at 65,535, and B * H reaches ~100k in SVD's
    temporal attention. Tiles of one (batch, head) are adjacent, so they share K/V in L2.
    Per-call arguments come first (pointers, then ``qk_scale``), the plan's fixed ints after
    them. ``WRITE_LSE``: the single pass also writes each row's natural-log log-sum-exp of
    the scaled, biased logits to ``Lse`` [B, H, Nq] FP32 (-inf for a fully masked row), the
    state the backward recomputes from.

    ``GROUP`` = H / Hkv query heads share one key / value head (grouped-query / multi-query attention,
    FlashAttention-2's GQA / MQA): query head ``h`` reads K / V head ``h // GROUP``, as SDPA's
    ``enable_gqa=True`` (``repeat_interleave`` of the K / V heads) defines it. One integer division per
    program, no copy of K / V; ``GROUP = 1`` is specialised to a constant, so equal heads compile as before.
    """
    pid_m, split, bh = program_tile(tl.cdiv(Nq, BLOCK_M), n_splits, SPLIT)
    bh = bh.to(tl.int64)
    off_h = bh % H
    off_b = bh // H
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M
    start_m64 = start_m.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_m + offs_m
    row_ok = rows < Nq

    q_ptrs = Q + off_b * sqb + off_h * sqh + start_m64 * sqm + offs_m[:, None] * sqm + offs_d[None, :] * sqd
    q, q_lo, q_inv = load_query_tile(q_ptrs, row_ok, offs_d, D, qk_scale, BLOCK_M, EVEN_D, PRECISION)
    v_exp = tl.full([BLOCK_DV], SPLIT_EXP - 126, dtype=tl.int32)
    k_base = K + off_b * skb + off_hk * skh
    v_base = V + off_b * svb + off_hk * svh
    b_base = Bias
    msk_base = Mask
    if HAS_BIAS:
        b_base = Bias + off_b * sbb + off_h * sbh + start_m64 * sbm
    if HAS_MASK:
        msk_base = Mask + off_b * smb + off_h * smh + start_m64 * smm

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    n_full, n_tiles = key_tiles(start_m, Nk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    lo_t, mid_t, hi_t = partition_tiles(split, tiles_per_split, n_splits, n_full, n_tiles, SPLIT)
    for t in range(lo_t, mid_t):
        acc, l_i, m_i, v_exp = _fold_tile(acc, l_i, m_i, v_exp, q, q_lo, q_inv, k_base, v_base, b_base, msk_base,
                                   t * BLOCK_N, offs_m, offs_n, offs_d, offs_dv, row_ok, rows, Nk, D, Dv,
                                   skn, skd, svn, svd, sbm, sbn, smm, smn, qk_scale,
                                   False, IS_CAUSAL, HAS_BIAS, HAS_MASK, EVEN_D, EVEN_DV, PRECISION, DOT_UPCAST, LAZY_V)
    for t in range(mid_t, hi_t):
        acc, l_i, m_i, v_exp = _fold_tile(acc, l_i, m_i, v_exp, q, q_lo, q_inv, k_base, v_base, b_base, msk_base,
                                   t * BLOCK_N, offs_m, offs_n, offs_d, offs_dv, row_ok, rows, Nk, D, Dv,
                                   skn, skd, svn, svd, sbm, sbn, smm, smn, qk_scale,
                                   True, IS_CAUSAL, HAS_BIAS, HAS_MASK, EVEN_D, EVEN_DV, PRECISION, DOT_UPCAST, LAZY_V)

    dv_ok = offs_dv < Dv
    lse, acc, l_i, m_i, v_unscale = final_state(acc, l_i, m_i, v_exp, PRECISION)
    if WRITE_LSE and not SPLIT:
        tl.store(Lse + (off_b * H + off_h) * Nq + start_m64 + offs_m, lse, mask=row_ok)
    if SPLIT:
        # partial state of partition `split`: workspace [P, B, H, Nq] (m, S) and [P, B, H, Nq, Dv] (W)
        store_partial(WsM, WsS, WsW, ((split * B + off_b) * H + off_h) * Nq + start_m64 + offs_m, m_i, l_i, acc,
                      v_unscale, offs_dv, row_ok, Dv)
    else:
        l_div = tl.where(l_i > 0.0, l_i, 1.0)  # fully masked rows: W = 0, S = 0 -> output 0
        out = acc / l_div[:, None] * v_unscale[None, :]  # divide first: acc may exceed FP32 once unscaled
        o_ptrs = Out + off_b * sob + off_h * soh + start_m64 * som + offs_m[:, None] * som + offs_dv[None, :] * sod
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit
def _partial_block(WsM, WsS, p0, offs_p, n_splits, row_ok, plane, base):
    """A [BLOCK_M, BLOCK_P] block of partitions ``p0 + offs_p`` of the split workspace for
    :func:`_elsa_merge_kernel`: ``(ok, row_id, m_p, S_p)``, masked entries the identity (-inf, 0)."""
    parts = p0 + offs_p
    ok = row_ok[:, None] & (parts < n_splits)[None, :]
    row_id = parts[None, :].to(tl.int64) * plane + base[:, None]
    m_p = tl.load(WsM + row_id, mask=ok, other=float("-inf"))
    s_p = tl.load(WsS + row_id, mask=ok, other=0.0)
    return ok, row_id, m_p, s_p


@triton.jit
def merge_partials(WsM, WsS, WsW, n_splits, row_ok, plane, base, offs_dv, dv_ok, Dv, BLOCK_M: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``(m, S, O)`` of ``BLOCK_M`` rows folded from their ``n_splits`` partial states, partial ``p`` of row ``r``
    at workspace row ``p * plane + base[r]`` (:func:`store_partial`'s layout): :func:`_elsa_merge_kernel`'s two
    passes, shared with the stream-K merge (:mod:`.stream_k`). ``O`` [BLOCK_M, BLOCK_DV] covers columns
    ``offs_dv``."""
    offs_p = tl.arange(0, BLOCK_P)
    # pass 1: m = max_p m_p, S = sum_p 2^(m_p - m) S_p, online over blocks of partitions
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    for p0 in range(0, n_splits, BLOCK_P):
        _, _, m_p, s_p = _partial_block(WsM, WsS, p0, offs_p, n_splits, row_ok, plane, base)
        m_new = tl.maximum(m, tl.max(m_p, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: every term is 0 * 0
        s = s * tl.math.exp2(m - m_safe) + tl.sum(tl.math.exp2(m_p - m_safe[:, None]) * s_p, axis=1)
        m = m_new
    # pass 2: O = sum_p O_p c_p
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s_div = tl.where(s > 0.0, s, 1.0)
    w = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for p0 in range(0, n_splits, BLOCK_P):
        ok, row_id, m_p, s_p = _partial_block(WsM, WsS, p0, offs_p, n_splits, row_ok, plane, base)
        b = tl.math.exp2(m_p - m_safe[:, None]) * s_p
        # c_p = b / S: exactly 1 for the partial that is the whole sum and 0 for one that adds nothing; at most 1
        # where exp2 / the division round up, so no term exceeds its |O_p|
        c = tl.where((b == s[:, None]) & (s[:, None] > 0.0), 1.0, tl.minimum(b / s_div[:, None], 1.0))
        o_p = tl.load(WsW + row_id[:, :, None] * Dv + offs_dv[None, None, :],
                      mask=ok[:, :, None] & dv_ok[None, None, :], other=0.0)
        w += tl.sum(o_p * c[:, :, None], axis=1)
    return m, s, w


@triton.jit(do_not_specialize=["B", "H", "Nq", "n_splits"])
def _elsa_merge_kernel(WsM, WsS, WsW, Out, Lse, sob, soh, som, sod, B, H, Nq, Dv, n_splits,
                       BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr,
                       WRITE_LSE: tl.constexpr):
    """Fold the P partial states of each query row with the monoid merge; write W / S (and, with
    ``WRITE_LSE``, the row's log-sum-exp ``(m + log2 S) ln 2`` to ``Lse`` [B, H, Nq]).

    The ELSA merge of P states ``(m_p, S_p, W_p)`` in one step:

        m = max_p m_p,  S = sum_p 2^(m_p - m) S_p,  O = W / S = sum_p O_p c_p,  c_p = 2^(m_p - m) S_p / S,

    with ``O_p = W_p / S_p`` the normalised partials :func:`store_partial` writes. Two passes over the
    partitions, ``BLOCK_P`` of them at a time (a [BLOCK_M, BLOCK_P] tile of m / S, a [BLOCK_M, BLOCK_P, BLOCK_DV]
    tile of O), so a row's partitions load side by side rather than in a chain of P dependent steps: the first
    folds ``(m, S)`` block by block (``S`` rescaled by ``2^(m_old - m)`` when a block raises the max), the
    second sums ``O_p c_p`` over each block's partition axis. Bounds: ``0 <= c_p <= 1`` (clamped; ``sum_p c_p``
    is 1 up to rounding), so every product and partial sum stays within the largest |V| — ``W`` and
    differences ``O_p - O`` are never formed, since they can pass FP32's range when V is near it. A partial
    that is the whole of ``S`` (one partition saw every visible key of the row) gets ``c_p = 1`` exactly and
    the others 0, so such rows match the single pass bit for bit. Partitions that saw no visible key are the
    identity (-inf, 0, 0): ``c_p = 0``; a row without any visible key keeps ``m = -inf``, ``S = 0`` and writes
    ``O = 0``, ``lse = -inf``. Fixed order and reduction trees, no atomics: deterministic.

    1-D grid cdiv(Nq, BLOCK_M) * cdiv(Dv, BLOCK_DV) * H * B (:func:`merge_blocks`); the programs of one row
    tile's ``Dv`` slices each fold ``(m, S)`` themselves (a few loads) and the first writes the LSE.
    """
    tiles = tl.cdiv(Nq, BLOCK_M)
    dv_tiles = tl.cdiv(Dv, BLOCK_DV)
    pid0 = tl.program_id(0)
    pid_dv = pid0 % dv_tiles
    pid_m = (pid0 // dv_tiles) % tiles
    bh = (pid0 // (dv_tiles * tiles)).to(tl.int64)
    off_h = bh % H
    off_b = bh // H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = pid_dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    row_ok = rows < Nq
    dv_ok = offs_dv < Dv
    plane = tl.cast(B, tl.int64) * H * Nq  # 64-bit: P * B * H * Nq rows of workspace
    base = (off_b * H + off_h) * Nq + rows
    m, s, w = merge_partials(WsM, WsS, WsW, n_splits, row_ok, plane, base, offs_dv, dv_ok, Dv, BLOCK_M, BLOCK_P,
                             BLOCK_DV)
    if WRITE_LSE:
        tl.store(Lse + base, (m + tl.math.log2(s)) * 0.6931471805599453, mask=row_ok & (pid_dv == 0))
    o_ptrs = Out + off_b * sob + off_h * soh + rows[:, None].to(tl.int64) * som + offs_dv[None, :] * sod
    tl.store(o_ptrs, w.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


# --------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class TileConfig:
    """Launch configuration of :func:`_elsa_fwd_kernel`.

    Attributes:
        block_m: query rows per program (power of two, >= 16).
        block_n: keys per KV tile (power of two, >= 16).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the KV loop.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Keyed by (precision kind, padded head dim, short KV): "half" = fp16/bf16 inputs; the FP32
# kinds are the tl.dot input precisions; "short" = Nk <= SHORT_KV (ViT-sized sequences, where
# narrower KV tiles waste less on the tail). Chosen with `tools/bench_attention.py --tune`; the
# D=16/32/256 rows use smaller tiles where registers / shared memory run out (docs/tuning.md: tile
# configs by (precision, head dim, short KV <= 512 keys)).
SHORT_KV = 512
_CONFIGS: dict[tuple[str, int, bool], TileConfig] = {}
for _short in (False, True):
    _CONFIGS.update({
        ("half", 16, _short): TileConfig(128, 64, 4, 3),
        ("half", 32, _short): TileConfig(128, 32 if _short else 64, 4, 3),
        # tuned on an H100 (docs/tuning.md: half D=64: (128, 32, 4, 3) short, (128, 64, 8, 3) long)
        ("half", 64, _short): TileConfig(128, 32, 4, 3) if _short else TileConfig(128, 64, 8, 3),
        ("half", 128, _short): TileConfig(128, 128, 8, 3) if not _short else TileConfig(128, 64, 8, 3),
        ("half", 256, _short): TileConfig(64, 32, 4, 2),
        ("tf32", 16, _short): TileConfig(128, 64, 4, 2),
        ("tf32", 32, _short): TileConfig(128, 64, 4, 2),
        ("tf32", 64, _short): TileConfig(128, 32, 4, 3) if _short else TileConfig(128, 64, 4, 2),
        ("tf32", 128, _short): TileConfig(128, 32, 4, 3),
        ("tf32", 256, _short): TileConfig(64, 32, 4, 2),
        ("tf32x3", 16, _short): TileConfig(128, 64, 8, 2),
        ("tf32x3", 32, _short): TileConfig(128, 64, 8, 2),
        ("tf32x3", 64, _short): TileConfig(128, 64, 8, 2),
        ("tf32x3", 128, _short): TileConfig(128, 32, 8, 3),
        ("tf32x3", 256, _short): TileConfig(64, 32, 4, 2),
        ("ieee", 16, _short): TileConfig(64, 64, 4, 2),
        ("ieee", 32, _short): TileConfig(64, 64, 4, 2),
        ("ieee", 64, _short): TileConfig(128, 64, 8, 2) if _short else TileConfig(64, 64, 4, 2),
        ("ieee", 128, _short): TileConfig(32, 32, 4, 2),
        ("ieee", 256, _short): TileConfig(32, 32, 4, 1),
        # f16x1 / f16x3: `--tune` on an H100
        ("f16x1", 16, _short): TileConfig(128, 64, 4, 3),
        ("f16x1", 32, _short): TileConfig(128, 64, 4, 3),
        # 32-key tiles are slower here even for short KV (docs/tuning.md: f16x1 D=64: (128, 64, 4, 3) also for short KV)
        ("f16x1", 64, _short): TileConfig(128, 64, 4, 3),
        ("f16x1", 128, _short): TileConfig(128, 128, 8, 2),  # (docs/tuning.md: f16x1 D=128: (128, 128, 8, 2))
        ("f16x1", 256, _short): TileConfig(64, 32, 4, 2),
        ("f16x3", 16, _short): TileConfig(128, 64, 4, 3),
        ("f16x3", 32, _short): TileConfig(128, 64, 4, 3),
        # 32-key tiles pad less on ViT-sized KV (docs/tuning.md: f16x3 D=64 short KV: (128, 32, 4, 3))
        ("f16x3", 64, _short): TileConfig(128, 32, 4, 3) if _short else TileConfig(128, 64, 4, 3),
        ("f16x3", 128, _short): TileConfig(128, 64, 8, 2),
        ("f16x3", 256, _short): TileConfig(64, 32, 4, 2),
    })
del _short


# fp32 (f16x3) over more keys than this rescales the accumulator's columns only when a V column exponent
# grows (:func:`.split16.fold_pv`'s LAZY_V): it pays over long sequences, where the exponents settle, and costs
# over few tiles; tf32 (f16x1) never takes it (docs/tuning.md: lazy V-column rescale (fp32 from 512 keys,
# never tf32)).
LAZY_V_MIN_KEYS = SHORT_KV

PRECISIONS = ("tf32x3", "ieee", "tf32", "f16x3", "f16x1")


def _precision(mode: str, precision: str | None) -> str:
    """The kernel's PRECISION constexpr for ``mode``: its FP32 product precision (or the explicit override,
    FP32 modes only), ``"half"`` for the half modes (native tensor-core products)."""
    md = MODES[mode]
    if md.compute_dtype != torch.float32:
        return "half"
    if precision is None:
        return md.input_precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; expected one of {PRECISIONS}")
    return precision


def _pad_dim(d: int) -> int:
    return pad_pow2(d)


def get_config(mode: str, head_dim: int, head_dim_v: int | None = None, n_k: int | None = None,
               precision: str | None = None) -> TileConfig:
    """Tile configuration for ``mode``, head dims (D, Dv) (the larger padded dim decides) and key count.

    ``n_k`` <= :data:`SHORT_KV` selects the short-sequence row (ViT-sized); ``None`` = long.
    ``precision`` overrides the FP32 modes' product precision (one of :data:`PRECISIONS`).

    Raises:
        ValueError: unknown mode, or a head dim outside 1..:data:`MAX_HEAD_DIM`.
    """
    if mode not in DENSE_MODES:
        raise ValueError(f"mode={mode!r} has no dense ELSA kernel; expected one of {list(DENSE_MODES)}")
    dmax = max(head_dim, head_dim_v or head_dim)
    if not 1 <= dmax <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {dmax} outside 1..{MAX_HEAD_DIM}")
    return _CONFIGS[(_precision(mode, precision), _pad_dim(dmax), n_k is not None and n_k <= SHORT_KV)]


# (docs/tuning.md: split-KV partitions by a cost model)
MAX_SPLITS = 256  # KV partitions of one call at most
# by product precision: (programs of a split launch that one SM runs side by side, a partition's fixed cost in
# key tiles — its query tile's load, the partial state it writes —, the merge's cost per partition in key tiles —
# the loads and weights of each partition's partial state, :func:`_elsa_merge_kernel` —, and a ragged launch's
# cost per program that exits at once — a partition past its sequence's keys)
_SPLIT_COSTS = {"half": (2, 48, 0.05, 4.0)}
_SPLIT_COSTS_FP32 = (2, 48, 0.01, 0.5)


def choose_num_splits(batch_heads: int, n_q: int, n_k: int, config: TileConfig, device: torch.device,
                      precision: str, ragged: tuple[int, int] | None = None) -> int:
    """Number of KV partitions P for the split-KV path (1 = single pass).

    Split only when the single pass leaves SMs idle: fewer programs than SMs (for a ragged batch: the longest
    sequence's programs), the few-query, long-key calls of LeanAttention's regime. P (at most
    :data:`MAX_SPLITS`, at least two key tiles per partition) then minimises a cost in key tiles:
    ``max(critical path, total work / slots) + merge * P``, the critical path one partition of the longest
    sequence plus a partition's fixed cost (rounded up to whole waves of programs for equal lengths), the total
    work every key tile plus every busy partition's fixed cost (for a ragged batch also a cost for each program
    that exits at once); slots and costs by ``precision`` (the kernels' product precision: "half", "f16x3",
    "f16x1", "ieee"; fitted to H200 sweeps). The merge folds partitions in blocks, so its cost per partition is
    small and few-query calls take up to :data:`MAX_SPLITS` partitions.

    ``ragged = (sequences, total_keys)`` for a ragged batch (``batch_heads`` = heads x sequences, ``n_k`` the
    longest sequence's keys, ``total_keys`` all sequences' keys together): every sequence is cut into
    partitions of the longest one's size and the partitions past a sequence's keys exit at once, so the work
    and the busy partitions are counted from the total keys: the partitions are sized by the batch's total work
    rather than its average length (LeanAttention's balance across a heterogeneous batch).
    """
    if device.type != "cuda" or n_k <= 0:  # no keys: nothing to split (and no partition size to divide by)
        return 1
    q_tiles = cdiv(n_q, config.block_m)
    programs = batch_heads * q_tiles
    sms = sm_count(device)
    per_sequence = programs // ragged[0] if ragged is not None else programs
    if per_sequence >= sms:
        return 1
    n_tiles = cdiv(n_k, config.block_n)
    if ragged is None:
        return _cheapest_split(programs, programs, n_tiles, None, 0, sms, precision)
    return _cheapest_split(programs, per_sequence, n_tiles, cdiv(ragged[1], config.block_n), ragged[0], sms,
                           precision)


@functools.lru_cache(maxsize=4096)  # a varlen call asks before its plan lookup: the search runs once per signature
def _cheapest_split(programs: int, per_sequence: int, n_tiles: int, key_tiles: int | None, sequences: int, sms: int,
                    precision: str) -> int:
    """:func:`choose_num_splits`' search over P for a call that leaves SMs idle (``key_tiles``: a ragged
    batch's key tiles of all sequences, None for equal lengths)."""
    per_sm, fixed, merge, idle = _SPLIT_COSTS.get(precision, _SPLIT_COSTS_FP32)
    slots = per_sm * sms
    best, best_cost = 1, None
    for p in range(1, max(1, min(n_tiles // 2, MAX_SPLITS)) + 1):
        per_split = cdiv(n_tiles, p)
        if key_tiles is None:
            busy, work = programs * p, programs * n_tiles
            critical = cdiv(busy, slots) * (per_split + fixed)
        else:  # about half of the sequences end inside a partially filled partition
            busy, work = per_sequence * (cdiv(key_tiles, per_split) + sequences // 2), per_sequence * key_tiles
            critical = per_split + fixed
            work += idle * max(0, per_sequence * sequences * p - busy)  # the launch's programs that exit at once
        cost = max(critical, (work + busy * fixed) / slots) + merge * p
        if best_cost is None or cost < best_cost:
            best, best_cost = p, cost
    return best


def kv_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per key / value head, ``H / Hkv`` of q [B, H, Nq, D] and k [B, Hkv, Nk, D]: the kernels'
    ``GROUP`` (1 for equal heads; grouped-query attention above 1, multi-query attention at ``Hkv = 1``).

    Raises:
        ValueError: ``Hkv`` does not divide ``H`` (or is 0 with ``H`` > 0).
    """
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv == H:
        return 1
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"key / value have {Hkv} heads, which does not divide the query's {H} heads "
                         f"(grouped-query attention needs H % Hkv == 0)")
    return H // Hkv


def unsupported_reason(q, k, v, bias, attn_mask, mode: str) -> str | None:
    """Why the dense kernels cannot run this call, or ``None`` if they can.

    Inputs as :func:`visionattn.attention` validated them (before casting to the mode's dtype, so the
    dtype is not checked here). Reasons: a mode without a dense kernel (PASA modes have their own), a
    head dim above :data:`MAX_HEAD_DIM`, tensors not on CUDA (unless ``TRITON_INTERPRET=1``).
    """
    if mode not in DENSE_MODES:
        return f"mode {mode!r} has no dense ELSA kernel"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {MAX_HEAD_DIM}"
    if q.device.type != "cuda" and not interpreting():
        return f"tensors on {q.device.type} (the Triton kernels need CUDA or TRITON_INTERPRET=1)"
    return None


# --------------------------------------------------------------------------- launch plans

# FP32 elements of one merge program's [BLOCK_M, BLOCK_P, BLOCK_DV] tile of partial outputs, 1024 a warp (sm_90:
# about 128 registers a thread at 8 warps, no spills; 4 warps on the same tile take 215-230)
MERGE_TILE = 8192
MERGE_MAX_BLOCK_P = 64  # partitions a merge program loads at once, at most (MAX_SPLITS = 256: four blocks)
NOMINAL_SMS = 132  # SMs the merge's blocking assumes off CUDA (the interpreter runs an H200's blocking)


def merge_blocks(rows: int, batch_heads: int, head_dim_v: int, sms: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_P, BLOCK_DV, num_warps)`` of :func:`_elsa_merge_kernel` for ``rows`` query rows per
    (batch, head), ``batch_heads`` of them, output head dim ``head_dim_v``, ``sms`` SMs.

    The few-query calls that split have a handful of rows: BLOCK_M is their count's next power of two (at most
    64, and at most ``MERGE_TILE / 2 / BLOCK_DV`` so that two partitions fit beside the rows), so no lane holds
    a row that does not exist. While the programs do not fill the SMs, the output columns are cut into slices
    of >= 32 (one 128-byte line a row) that separate programs merge. BLOCK_P fills the rest of the tile
    (``MERGE_TILE``), at most ``MERGE_MAX_BLOCK_P``; it does not depend on the partition count, so a call
    with another P reuses the compiled merge. One warp per 1024 elements of the tile (up to 8).
    """
    block_dv = pad_pow2(head_dim_v)
    block_m = max(1, min(64, pad_pow2(rows, 1), MERGE_TILE // 2 // block_dv))
    while block_dv > 32 and batch_heads * cdiv(rows, block_m) * cdiv(head_dim_v, block_dv) < sms:
        block_dv //= 2
    block_p = min(MERGE_MAX_BLOCK_P, MERGE_TILE // (block_m * block_dv))
    return block_m, block_p, block_dv, max(1, min(8, block_m * block_p * block_dv // 1024))


def merge_call(rows: int, batch_heads: int, head_dim_v: int, device: torch.device, with_lse: bool) -> KernelCall:
    """The :func:`_elsa_merge_kernel` launch of a split plan (:func:`merge_blocks`' blocking on ``device``)."""
    sms = sm_count(device) if device.type == "cuda" else NOMINAL_SMS
    block_m, block_p, block_dv, num_warps = merge_blocks(rows, batch_heads, head_dim_v, sms)
    grid = cdiv(rows, block_m) * cdiv(head_dim_v, block_dv) * batch_heads
    return KernelCall(_elsa_merge_kernel, (grid,), dict(BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_DV=block_dv,
                                                        WRITE_LSE=bool(with_lse)), dict(num_warps=num_warps))


def _smaller_configs(cfg: TileConfig) -> list[TileConfig]:
    """Configs to try, in order, when ``cfg`` exceeds the GPU's shared memory.

    Bias / mask tiles are pipelined too, so a config measured without them can overflow:
    first fewer stages (down to 2), then narrower KV tiles, then 1 stage, then fewer query rows.
    """
    out, c = [], cfg
    while c.num_stages > 2:
        c = replace(c, num_stages=c.num_stages - 1)
        out.append(c)
    while c.block_n > 16:
        c = replace(c, block_n=c.block_n // 2)
        out.append(c)
    if c.num_stages > 1:
        c = replace(c, num_stages=1)
        out.append(c)
    while c.block_m > 16:
        c = replace(c, block_m=c.block_m // 2, num_warps=min(c.num_warps, 4))
        out.append(c)
    return out


class _TritonPlan(DenseForwardRun):
    """The Triton forward (plus the split-KV merge when ``P`` > 1) for one call signature: grid,
    constexprs and every integer argument fixed; a call (:class:`._launch.DenseForwardRun`) allocates the
    output (and LSE / workspace) and launches."""

    __slots__ = ("main", "merge", "fixed", "merge_fixed", "o_shape", "o_stride", "o_dtype", "device",
                 "lse_shape", "ws_shape", "ws_w_shape", "config")

    def __init__(self, q, k, v, bias, attn_mask, is_causal, mode, num_splits, cfg: TileConfig, precision,
                 out_dtype, with_lse):
        B, H, Nq, D = q.shape
        Nk, Dv = k.shape[2], v.shape[3]
        n_tiles = cdiv(Nk, cfg.block_n)
        P = num_splits or choose_num_splits(B * H, Nq, Nk, cfg, q.device, precision)
        P = max(1, min(P, n_tiles))
        tiles_per_split = cdiv(n_tiles, P)
        P = cdiv(n_tiles, tiles_per_split)  # no empty trailing partitions
        block_d, block_dv = head_blocks(D, Dv)
        self.config, self.device, self.o_dtype = cfg, q.device, out_dtype
        self.o_shape, self.o_stride = heads_inner_layout(B, H, Nq, Dv)  # as SDPA's flash path returns
        self.lse_shape = (B, H, Nq) if with_lse else None
        sb = bias.stride() if bias is not None else (0, 0, 0, 0)
        sm = attn_mask.stride() if attn_mask is not None else (0, 0, 0, 0)
        self.fixed = (*q.stride(), *k.stride(), *v.stride(), *sb, *sm, *self.o_stride,
                      B, H, Nq, Nk, D, Dv, P, tiles_per_split, kv_group(q, k))
        self.main = KernelCall(_elsa_fwd_kernel, (cdiv(Nq, cfg.block_m) * P * H * B,), dict(
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            PRECISION=precision, IS_CAUSAL=bool(is_causal), HAS_BIAS=bias is not None,
            HAS_MASK=attn_mask is not None, SPLIT=P > 1, EVEN_D=D == block_d, EVEN_DV=Dv == block_dv,
            DOT_UPCAST=q.dtype == torch.bfloat16 and interpreting(),
            LAZY_V=precision == "f16x3" and Nk > LAZY_V_MIN_KEYS, WRITE_LSE=bool(with_lse)),
            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        self.merge = None
        self.ws_shape = self.ws_w_shape = None
        if P > 1:
            self.ws_shape, self.ws_w_shape = (P, B, H, Nq), (P, B, H, Nq, Dv)
            self.merge = merge_call(Nq, B * H, Dv, q.device, with_lse)
            self.merge_fixed = (*self.o_stride, B, H, Nq, Dv, P)


# Gluon kernel ("fp32-ieee" / "half" / "fp32"; "varlen half": kernels/varlen_gluon.py; "fp32-ieee backward":
# kernels/ieee_gluon_bwd.py; "half backward" / "tf32 backward" / "fp32 backward": kernels/half_gluon_bwd.py) -> why it
# could not run in this process (first failure; warned once)
_GLUON_FAILED: dict[str, str] = {}
_GLUON_FALLBACK_COST = {"fp32-ieee": "mode 'fp32-ieee' uses the Triton kernel (about half the speed)",
                        "half": "modes 'fp16' / 'bf16' use the Triton kernel (0.8-0.95x the speed at long sequences)",
                        "fp32": "mode 'fp32' uses the Triton kernel (0.55-0.9x the speed from 256 keys)",
                        "varlen half": "varlen calls in modes 'fp16' / 'bf16' use the Triton varlen kernel (0.78-0.97x "
                                       "the speed)",
                        "fp32-ieee backward": "mode 'fp32-ieee' trains on the Triton backward kernels (about 0.4x the "
                                              "speed)",
                        "half backward": "modes 'fp16' / 'bf16' train on the Triton backward kernels (about 0.8x the "
                                         "backward's speed at long sequences)",
                        "tf32 backward": "mode 'tf32' trains on the Triton backward kernels (0.15-0.9x the backward's "
                                         "speed where the Gluon one runs)",
                        "fp32 backward": "mode 'fp32' trains on the Triton backward kernels (0.45-0.9x the backward's "
                                         "speed where the Gluon one runs)"}


def _gluon_failed(kernel: str, why: str) -> None:
    """Record why the Gluon ``kernel`` (a key of :data:`_GLUON_FALLBACK_COST`) cannot run in this process and
    warn, once."""
    _GLUON_FAILED[kernel] = why[:500]
    warnings.warn(f"visionattn: the Gluon {kernel} kernel cannot run ({_GLUON_FAILED[kernel]}); "
                  f"{_GLUON_FALLBACK_COST[kernel]} for the rest of this process", RuntimeWarning, stacklevel=5)


def _gluon_device(device: torch.device) -> bool:
    """Whether a Gluon kernel can run on ``device`` at all: CUDA only (Gluon has no interpreter), so a call on
    other tensors neither imports nor asks the Gluon modules (their scope checks say the same, later)."""
    return device.type == "cuda"


def _gluon_kernel(kernel: str):
    """``(module, preferred)`` of Gluon ``kernel``, the module imported on first use: ``preferred(n_q, n_k, head
    dim)`` says whether it is ahead of this module's kernel on an in-scope call."""
    if kernel == "half":
        from . import half_gluon

        return half_gluon, half_gluon.preferred
    if kernel == "fp32":
        from . import fp32_gluon

        return fp32_gluon, fp32_gluon.preferred
    from . import ieee_gluon

    return ieee_gluon, lambda n_q, n_k, head_dim: True


def _gluon_plan(kernel: str, q, k, v, bias, attn_mask, is_causal, scale, num_splits, out_dtype, with_lse=False):
    """A :class:`._launch.GluonForwardPlan` on ``kernel`` ("fp32-ieee": the FMA kernel of :mod:`.ieee_gluon`, ~2x this
    module's IEEE loop; "half": the warp-specialized Hopper kernel of :mod:`.half_gluon`; "fp32": the same kernel's
    split-FP16 build, :mod:`.fp32_gluon`; "half" and "fp32" also write the LSE when asked), or ``None`` when it does
    not take the call: tensors off CUDA, lengths it is not preferred at, outside its scope, where the split-KV path
    would run (few query tiles), or after it failed to import or compile once in this process (warned once)."""
    if kernel in _GLUON_FAILED or not _gluon_device(q.device):
        return None
    module, preferred = _gluon_kernel(kernel)
    if not preferred(q.shape[2], k.shape[2], q.shape[3]):
        return None
    reason = module.unsupported_reason(q, k, v, bias, attn_mask, is_causal, scale, num_splits)
    if reason is not None:
        if reason == module._IMPORT_ERROR:  # reported last: the call was otherwise in scope
            _gluon_failed(kernel, reason)
        return None
    B, H, Nq = q.shape[:3]
    cfg = module.config_for(q, k)
    tiles = TileConfig(cfg["BLOCK_M"], cfg["BLOCK_N"], 4, cfg["STAGES"])
    if num_splits == 0 and choose_num_splits(B * H, Nq, k.shape[2], tiles, q.device, "half") > 1:
        return None
    # the fp16 / bf16 kernel writes O by TMA stores where its output is in the inputs' dtype (half_gluon.tma_output)
    extra = {"out_dtype": out_dtype} if kernel == "half" else {}
    launch = module.planned_launch(q, k, v, cfg, with_lse, **extra)
    return GluonForwardPlan(launch, q, v, out_dtype, with_lse)


def _check_call(q, k, v, mode: str, num_splits: int, out_dtype) -> None:
    kv_group(q, k)
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"value has {v.shape[1]} heads and key {k.shape[1]}; key and value need one head count")
    dtype = MODES[mode].compute_dtype
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; mode {mode!r} computes in {dtype} (cast first)")
    if num_splits < 0:
        raise ValueError(f"num_splits={num_splits}; expected >= 1 (or 0 / None = automatic)")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"output dtype {out_dtype} (the out_dtype argument, or the inputs' dtype where none is "
                        f"given); the kernels write one of {OUT_DTYPES}")


def _plan_and_run(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype, with_lse,
                  config: TileConfig | None = None, precision: str | None = None):
    """Build the plan of a call signature by running it once: ``(plan, (out, lse))``.

    Order: nothing to compute -> :class:`._launch.EmptyForwardPlan`; a Gluon kernel that takes the call (not with an
    explicit ``config`` / ``precision``); the stream-K schedule where the single pass leaves SMs idle
    (:func:`.stream_k.dense_plan`; not with an explicit ``num_splits``); else the Triton kernel with the table's config,
    and on out-of-shared-memory (bias / mask tiles add to it) the next smaller of :func:`_smaller_configs`.
    """
    if mode not in DENSE_MODES:
        raise ValueError(f"mode={mode!r} has no dense ELSA kernel; expected one of {list(DENSE_MODES)}")
    dtype = MODES[mode].compute_dtype
    out_dtype = out_dtype or dtype
    _check_call(q, k, v, mode, num_splits, out_dtype)
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    if B * H * Nq == 0 or Dv == 0 or Nk == 0:
        plan = EmptyForwardPlan(q, k, v, out_dtype, with_lse)
        return plan, plan(q, k, v, bias, attn_mask, scale)
    prec = _precision(mode, precision)
    gluon = ("fp32-ieee" if prec == "ieee" else "half" if dtype != torch.float32
             else "fp32" if prec == "f16x3" else None)
    if gluon is not None and config is None and precision is None:
        plan = _gluon_plan(gluon, q, k, v, bias, attn_mask, is_causal, scale, num_splits, out_dtype, with_lse)
        if plan is not None:
            try:
                return plan, plan(q, k, v, bias, attn_mask, scale)
            except Exception as exc:  # a Triton release whose Gluon cannot build this kernel
                _gluon_failed(gluon, f"{type(exc).__name__}: {exc}")
    if config is None and precision is None and num_splits == 0 and q.is_cuda:
        from . import stream_k  # the stream-K schedule of calls the single pass leaves SMs idle in (never off CUDA)

        plan = stream_k.dense_plan(q, k, v, bias, attn_mask, is_causal, mode, out_dtype, with_lse)
        if plan is not None:
            return plan, plan(q, k, v, bias, attn_mask, scale)
    result = []

    def run(cfg):
        plan = _TritonPlan(q, k, v, bias, attn_mask, is_causal, mode, num_splits, cfg, prec, out_dtype, with_lse)
        result.append((plan, plan(q, k, v, bias, attn_mask, scale)))

    first = config if config is not None else get_config(mode, D, Dv, Nk, precision)
    run_first_that_fits(run, first, (lambda _: []) if config is not None else _smaller_configs)
    return result[-1]


# call signature -> plan (see _launch); PLANS.hits / PLANS.builds count reuses and builds
PLANS = PlanCache()


def plan_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
             attn_mask: torch.Tensor | None, is_causal: bool, scale: float, mode: str, num_splits: int = 0,
             out_dtype: torch.dtype | None = None, with_lse: bool = False):
    """``(plan, (out, lse))``: the cached launch plan of this call signature (built by running the call
    when new) and this call's result. A plan takes ``(q, k, v, bias, attn_mask, scale)`` of any later call
    with the same signature; it reads ``bias`` / ``attn_mask`` only through their data pointers (the strides
    of the [B, H, Nq, Nk] views are part of the plan). Arguments and key as :func:`dense_forward`."""
    key = (mode, q.shape, k.shape, v.shape[3], q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
           q.get_device(), None if bias is None else (bias.stride(), bias.dtype, bias.data_ptr() & 15),
           None if attn_mask is None else (attn_mask.stride(), attn_mask.data_ptr() & 15),
           is_causal, num_splits, out_dtype, with_lse, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15)
    plan = PLANS.get(key)
    if plan is not None:
        return plan, plan(q, k, v, bias, attn_mask, scale)
    plan, result = _plan_and_run(q, k, v, bias, attn_mask, bool(is_causal), float(scale), mode, int(num_splits),
                                 out_dtype, bool(with_lse))
    PLANS.put(key, plan)
    return plan, result


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                  attn_mask: torch.Tensor | None, is_causal: bool, scale: float, mode: str, num_splits: int = 0,
                  out_dtype: torch.dtype | None = None, with_lse: bool = False):
    """The dense forward from a cached launch plan: ``(out, lse)``, ``lse`` None unless ``with_lse``.

    Arguments as :func:`elsa_attention` (``num_splits`` 0 = automatic). The plan key holds what decides
    the launch and Triton's specialisation: mode, shapes, strides, dtypes, device, bias / mask strides,
    causal, splits, output dtype, LSE, and each data pointer's 16-byte alignment. The first call of a key
    validates, chooses the kernel and config and launches through Triton's JIT; later calls allocate the
    output and launch from the plan (see :mod:`._launch`).

    ``lse``: [B, H, Nq] float32, ``log sum_j exp(scale q_i . k_j + bias_ij)`` over the visible keys, -inf
    for a fully masked row: what the backward recomputes P from (FlashAttention-2's ``softmax_lse``).
    """
    return plan_for(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype, with_lse)[1]


def _launch(q, k, v, bias, attn_mask, is_causal: bool, scale: float, mode: str, num_splits: int,
            config: TileConfig | None = None, precision: str | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One uncached launch with an explicit tile ``config`` and / or product ``precision`` (tools and tests
    compare them): the output only. Without either it is :func:`dense_forward`."""
    if config is None and precision is None:
        return dense_forward(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits, out_dtype)[0]
    return _plan_and_run(q, k, v, bias, attn_mask, bool(is_causal), float(scale), mode, int(num_splits),
                         out_dtype, False, config, precision)[1][0]


def elsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   attn_mask: torch.Tensor | None, is_causal: bool, scale: float, mode: str,
                   num_splits: int | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Exact attention ``softmax(scale q k^T + bias, masked) v`` by the ELSA Triton kernels.

    Args:
        q: [B, H, Nq, D] in the mode's compute dtype (fp32 for ``fp32`` / ``fp32-ieee`` /
            ``tf32``, float16 for ``fp16``, bfloat16 for ``bf16``); any strides (no copy).
        k: [B, Hkv, Nk, D], same dtype/device; v: [B, Hkv, Nk, Dv] (Dv may differ from D). ``Hkv`` divides
            H: query head ``h`` reads K / V head ``h // (H / Hkv)`` (grouped-query / multi-query attention,
            as SDPA's ``enable_gqa=True``), read in place, never repeated in memory.
            D, Dv in 1..256 (padded to a power of two >= 16 inside the kernel).
        bias: None or an additive float bias viewed as [B, H, Nq, Nk] (stride-0 broadcast
            views are read through their strides, any float dtype).
        attn_mask: None or a bool mask viewed as [B, H, Nq, Nk]; True = keep.
        is_causal: top-left causal mask (key j visible to query i iff j <= i); KV tiles
            entirely after a query tile are skipped.
        scale: logit scale (``log2 e`` is folded in for ``exp2``).
        mode: ``fp32``, ``fp32-ieee``, ``tf32``, ``fp16`` or ``bf16``.
        num_splits: KV partitions of the split-KV path; ``None`` = automatic (split only
            when the single pass cannot fill the SMs), 1 = single pass (memory-lean);
            clamped to the number of KV tiles.
        out_dtype: dtype of the output (float16, bfloat16 or float32); ``None`` = the compute
            dtype. The FP32 state is divided and rounded once to it, so a FP32 caller of a half
            mode gets ``W / S`` without an intermediate half rounding (and no cast kernel).

    Returns:
        [B, H, Nq, Dv] in ``out_dtype``, a view of a contiguous [B, Nq, H, Dv] buffer (as
        SDPA's flash path returns), so ``out.transpose(1, 2).reshape(B, Nq, H * Dv)`` is free.
        Rows whose keys are all masked are 0.

    Raises:
        ValueError: unknown mode, head dim > 256, ``num_splits`` < 1, K / V heads that do not divide H.
        TypeError: q/k/v dtype differs from the mode's compute dtype; an unsupported ``out_dtype``.
    """
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits}; expected a positive int or None")
    return dense_forward(q, k, v, bias, attn_mask, bool(is_causal), float(scale), mode, int(num_splits or 0),
                         out_dtype)[0]
