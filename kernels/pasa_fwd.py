"""PASA forward in Triton: FP16 score accumulation that cannot overflow (PASA paper, Alg. 1).

Four kernels and a launcher:

* :func:`_pasa_shift_keys_kernel` — Alg. 1 lines 5-7, the pre-processing
  ``K'_j = K_j^T M`` per KV block of ``BLOCK_N`` keys with the FP16-rounded shifting
  matrix ``M = (a I - b J) * scale`` (Eq. 10-11, 21/23):
  ``K' = fl16(scale * (a k - b sum_block k))``, written once to a [B, H, Nk, D]
  FP16 buffer (the paper's batched GEMM, done as a row reduction + FMA). With
  ``RECOVER`` it also writes, in FP32, the per-key term ``c_j = mu . K'_j`` of the
  query centering (times ``log2 e / a`` of its block, so the tile loop recovers with one
  FMA), and the block's recovery vector ``w = scale (b / a) sum_block k`` as three FP16
  parts of a power-of-two-scaled copy (~33 significant bits) plus the scale.
* :func:`_pasa_fwd_kernel` — the tile loop: ``S' = (Q - mu) K'^T`` on the tensor cores
  with **FP16 accumulation** (``tl.dot(..., out_dtype=tl.float16)``), the block's
  removed pseudo-average ``R = q . w`` (line 13: one small MMA of the FP16 query tile with
  w's three parts, FP32 accumulation, ~FP32 accuracy), the running
  global pseudo-average ``F`` (line 14 / Eq. 15), the recovered scores
  ``(S' + c) / a + (R - F)`` and the running max moved by ``F_old - F`` (lines 15-17),
  then the usual online softmax in FP32 with ``exp2`` (P rounded to FP16 for ``P @ V``
  with FP32 accumulation). With ``RECOVER=False`` (mode ``fp16-acc16``, or PASA with ``beta=0``)
  the keys are used as given and the FP16 product is scaled afterwards: plain
  FP16-score-accumulation flash attention.
* :func:`_center_partials_kernel` / :func:`_center_combine_kernel` — the query centre
  ``mu``: per-chunk FP32 sums / minima / maxima over query rows, combined in a fixed order.
* :func:`pasa_attention` — validates, computes beta and the coefficients, launches.

The recovery from FP32 quantities and the query centering deviate from the paper's
Algorithm 1 for accuracy (both are exact in exact arithmetic); the CPU reference with
the same arithmetic, :func:`visionattn.pasa.pasa_attention_reference`, explains them in
its module docstring and lists what is rounded where. Kernels never import upward
(docs/design.md): the optimal-accuracy beta (Eq. 20-22) comes from :mod:`.pasa_math`, which the
reference re-exports, and ``mu`` is computed here by :func:`_query_center`;
``tests/kernels/test_pasa_kernel.py`` checks it equals :func:`visionattn.pasa.query_center`.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._launch import (OUT_DTYPES, KernelCall, PlanCache, allocate_output, cdiv, head_blocks, heads_inner_layout,
                      interpreting, pad_pow2, run_first_that_fits)
from ._launch import LOG2E
from .elsa_fwd import load_kv_tile
from .pasa_math import optimal_beta, shift_coefficients
from .split16 import SPLIT_EXP, exponent, pow2

__all__ = ["pasa_attention", "pasa_forward", "plan_for", "pasa_unsupported_reason", "BLOCK_N", "MAX_HEAD_DIM", "PLANS"]

BLOCK_N = 128  # keys per KV block = size of the shifting matrix M (the paper's s2)
MAX_HEAD_DIM = 256
_LOG2E = tl.constexpr(LOG2E)  # kernels read globals only as constexprs


# ----------------------------------------------------------------------------------- host math
def _optimal_beta(n: int) -> float:
    """The optimal-accuracy beta of a block of ``n`` keys (:func:`.pasa_math.optimal_beta`, FP16)."""
    return optimal_beta(n)


_coefficients = functools.lru_cache(maxsize=None)(shift_coefficients)


class _CenterPlan:
    """The query centre mu, [B, H, D] float32 (FP16 values; see visionattn.pasa.query_center), for one
    query shape: ``mu_d = fl16(mean_i q_id)``, or 0 where ``max_i |q_id - mu_d| > max_i |q_id|``.
    ``q``: [B, H, Nq, D] float16, any strides, ``Nq > 0``.

    One launch when one program per (batch, head) covers its rows (at most :data:`_CENTER_DIRECT_ROWS` rows,
    where a call's host time matters more than the pass): FP32 sums / minima / maxima and mu in one pass.
    Otherwise two: per-chunk partials over query rows, then their fixed-order combination (deterministic,
    unlike atomics)."""

    __slots__ = ("partials", "combine", "part_shape", "mu_shape", "fixed", "combine_fixed", "device")

    def __init__(self, q: torch.Tensor):
        B, H, Nq, D = q.shape
        block_d = pad_pow2(D)
        direct = Nq <= _CENTER_DIRECT_ROWS
        chunk = Nq if direct else pad_pow2(cdiv(Nq, _CENTER_CHUNKS), lo=_CENTER_ROWS)
        n_chunks = cdiv(Nq, chunk)
        plane = B * H * n_chunks * D
        self.device = q.device
        self.part_shape, self.mu_shape = (3, B * H, n_chunks, D), (B, H, D)
        # 1-D grid: B * H reaches ~100k in SVD's temporal attention, over grid axis 1's 65,535
        self.partials = KernelCall(_center_partials_kernel, (n_chunks * B * H,),
                                   dict(BLOCK_M=_CENTER_ROWS, BLOCK_D=block_d, DIRECT=direct), {})
        self.fixed = (*q.stride(), H, Nq, D, chunk, n_chunks, plane)
        self.combine = None if direct else KernelCall(_center_combine_kernel, (B * H,),
                                                      dict(BLOCK_C=_CENTER_CHUNKS, BLOCK_D=block_d), {})
        self.combine_fixed = (Nq, D, n_chunks, plane)

    def __call__(self, q: torch.Tensor, mu=None, part=None):
        """mu of ``q`` into ``mu`` (a [B, H, D] float32 tensor or its address; allocated when None), with
        ``part`` (:attr:`part_shape` float32, or its address) as the partials' scratch when there is a
        combine launch (allocated when None). Returns ``mu``."""
        if mu is None:
            mu = torch.empty(self.mu_shape, dtype=torch.float32, device=self.device)
        if self.combine is None:  # the partials kernel writes mu itself (PART = MU)
            self.partials(q, mu, *self.fixed)
            return mu
        if part is None:
            part = torch.empty(self.part_shape, dtype=torch.float32, device=self.device)
        self.partials(q, part, *self.fixed)
        self.combine(part, mu, *self.combine_fixed)
        return mu


def _query_center(q: torch.Tensor) -> torch.Tensor:
    """The query centre mu of ``q`` [B, H, Nq, D] float16 (:class:`_CenterPlan`), [B, H, D] float32."""
    return _CenterPlan(q)(q)


_CENTER_ROWS = 64  # query rows per loop step of _center_partials_kernel
_CENTER_CHUNKS = 64  # at most this many row chunks (programs) per (batch, head)
_CENTER_DIRECT_ROWS = 1024  # up to this many query rows, one program per (batch, head) and one launch


@triton.jit
def _center_value(total, lo, hi, N_Q):
    """mu = fl16(mean) of each query dimension from its FP32 sum / min / max, or 0 where centering would
    enlarge the dimension's range (max |q - mu| > max |q|)."""
    mu = (total / N_Q).to(tl.float16).to(tl.float32)
    keep = tl.maximum(hi - mu, mu - lo) <= tl.maximum(tl.abs(hi), tl.abs(lo))
    return tl.where(keep, mu, 0.0)


@triton.jit
def _center_stats(q_base, stride_qm, stride_qd, start, stop, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """FP32 sum, minimum and maximum of every query dimension over rows [start, stop) of one (batch, head)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    total = tl.zeros([BLOCK_D], tl.float32)
    lo = tl.full([BLOCK_D], float("inf"), tl.float32)
    hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
    for m in range(start, stop, BLOCK_M):
        ok = ((m + offs_m) < stop)[:, None] & d_ok[None, :]
        x = tl.load(q_base + (m + offs_m)[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd,
                    mask=ok, other=0.0).to(tl.float32)
        total += tl.sum(x, axis=0)
        lo = tl.minimum(lo, tl.min(tl.where(ok, x, float("inf")), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(ok, x, float("-inf")), axis=0))
    return total, lo, hi


@triton.jit(do_not_specialize=["H", "N_Q", "CHUNK", "N_CHUNKS", "PLANE"])
def _center_partials_kernel(Q, PART, stride_qb, stride_qh, stride_qm, stride_qd, H, N_Q, D, CHUNK, N_CHUNKS,
                            PLANE, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT: tl.constexpr):
    # Program bh * N_CHUNKS + chunk: FP32 sum, min and max of every query dimension over rows
    # [chunk * CHUNK, (chunk + 1) * CHUNK) -> PART [3, B*H, n_chunks, D] (PLANE = B*H*n_chunks*D).
    # DIRECT (one chunk of every row): mu itself -> PART [B*H, D].
    chunk = tl.program_id(0) % N_CHUNKS
    bh = tl.program_id(0) // N_CHUNKS
    q_base = Q + (bh // H).to(tl.int64) * stride_qb + (bh % H).to(tl.int64) * stride_qh
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    start = chunk * CHUNK
    total, lo, hi = _center_stats(q_base, stride_qm, stride_qd, start, tl.minimum(start + CHUNK, N_Q), D, BLOCK_M,
                                  BLOCK_D)
    out = PART + (bh.to(tl.int64) * N_CHUNKS + chunk) * D + offs_d
    if DIRECT:
        tl.store(out, _center_value(total, lo, hi, N_Q), mask=d_ok)
    else:
        tl.store(out, total, mask=d_ok)
        tl.store(out + PLANE, lo, mask=d_ok)
        tl.store(out + 2 * PLANE, hi, mask=d_ok)


@triton.jit(do_not_specialize=["N_Q", "N_CHUNKS", "PLANE"])
def _center_combine_kernel(PART, MU, N_Q, D, N_CHUNKS, PLANE, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (batch*head): combine the chunk partials in a fixed order, then mu = fl16(mean) or 0
    # where centering would enlarge the dimension's range.
    bh = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_c < N_CHUNKS)[:, None] & (offs_d < D)[None, :]
    ptrs = PART + (bh.to(tl.int64) * N_CHUNKS + offs_c)[:, None] * D + offs_d[None, :]
    total = tl.sum(tl.load(ptrs, mask=ok, other=0.0), axis=0)
    lo = tl.min(tl.load(ptrs + PLANE, mask=ok, other=float("inf")), axis=0)
    hi = tl.max(tl.load(ptrs + 2 * PLANE, mask=ok, other=float("-inf")), axis=0)
    tl.store(MU + bh.to(tl.int64) * D + offs_d, _center_value(total, lo, hi, N_Q), mask=offs_d < D)


@triton.jit(do_not_specialize=["H", "N_K", "N_Q"])
def _pasa_shift_keys_kernel(
    K, KP, MU, C, W, W_INV, Q, stride_kb, stride_kh, stride_kn, stride_kd, stride_qb, stride_qh, stride_qm,
    stride_qd, H, N_K, N_Q, D, scale, a_full, b_full, a_tail, b_tail, w_full, w_tail, inv_a_full, inv_a_tail,
    RECOVER: tl.constexpr, CENTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_QM: tl.constexpr,
):
    # 1-D grid (B * H can exceed the 65,535 limit of grid axes 1 and 2).
    tiles = tl.cdiv(N_K, BLOCK_N)
    pid_n = tl.program_id(0) % tiles
    pid_bh = tl.program_id(0) // tiles
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    if CENTER:
        # few query rows (_CENTER_DIRECT_ROWS): every program of the head forms mu from Q itself, as
        # _center_partials_kernel's DIRECT path does (same loop, same values), saving that launch; the
        # head's first key block stores it for the tile loop
        offs_c = tl.arange(0, BLOCK_D)
        total, lo, hi = _center_stats(Q + off_b * stride_qb + off_h * stride_qh, stride_qm, stride_qd, 0, N_Q, D,
                                      BLOCK_QM, BLOCK_D)
        mu_c = _center_value(total, lo, hi, N_Q)
        if pid_n == 0:
            tl.store(MU + pid_bh.to(tl.int64) * D + offs_c, mu_c, mask=offs_c < D)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = offs_n.to(tl.int64)[:, None]  # 64-bit row offsets: a million keys times a strided row overflow int32
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_n[:, None] < N_K) & (offs_d[None, :] < D)
    k = tl.load(K + off_b * stride_kb + off_h * stride_kh + n64 * stride_kn
                + offs_d[None, :] * stride_kd, mask=ok, other=0.0).to(tl.float32)
    full = (N_K - pid_n * BLOCK_N) >= BLOCK_N
    a = tl.where(full, a_full, a_tail)
    b = tl.where(full, b_full, b_tail)
    ksum = tl.sum(k, axis=0)
    kp = (scale * (a * k - b * ksum[None, :])).to(tl.float16)
    # KP is a contiguous [B*H, N_K, D] buffer
    tl.store(KP + pid_bh.to(tl.int64) * N_K * D + n64 * D + offs_d[None, :], kp, mask=ok)
    if RECOVER:
        # MU [B*H, D], C [B*H, N_K]: contiguous FP32 buffers
        if CENTER:
            mu = mu_c
        else:
            mu = tl.load(MU + pid_bh.to(tl.int64) * D + offs_d, mask=offs_d < D, other=0.0)
        # mu . K'_j per key, times the block's log2(e) / a: the tile loop recovers the score with one FMA
        # (docs/tuning.md: PASA: per-key centring term stored times its block's log2(e)/a (one FMA per score),
        # per-row term in the row max)
        c = tl.sum(mu[None, :] * kp.to(tl.float32), axis=1) * tl.where(full, inv_a_full, inv_a_tail)
        tl.store(C + pid_bh.to(tl.int64) * N_K + offs_n, c, mask=offs_n < N_K)
        w = tl.where(full, w_full, w_tail) * ksum  # scale (b / a) sum_block k
        # w as three FP16 parts of a power-of-two-scaled copy (~33 significant bits), so the tile
        # loop gets R = q . w from one small FP32-accumulating MMA: W16 [B*H, tiles, 3, D], W_INV [B*H, tiles]
        e = exponent(tl.max(tl.abs(w), 0))
        ws = w * pow2(-e + SPLIT_EXP)
        w_hi = ws.to(tl.float16)
        rest = ws - w_hi.to(tl.float32)
        w_mid = rest.to(tl.float16)
        w_lo = (rest - w_mid.to(tl.float32)).to(tl.float16)
        tile_id = pid_bh.to(tl.int64) * tiles + pid_n
        d_ok = offs_d < D
        tl.store(W + tile_id * 3 * D + offs_d, w_hi, mask=d_ok)
        tl.store(W + tile_id * 3 * D + D + offs_d, w_mid, mask=d_ok)
        tl.store(W + tile_id * 3 * D + 2 * D + offs_d, w_lo, mask=d_ok)
        tl.store(W_INV + tile_id, pow2(e - SPLIT_EXP))


@triton.jit
def _pasa_tile(acc, l_i, m_i, F, j, qs, q, start_n, offs_m, loc_m, offs_d, offs_dv, row_ok,
               k_base, v_base, c_base, w_base, winv_base, b_base, mk_base,
               stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
               N_K, D, DV, post_scale, inv_a_full, inv_a_tail,
               BOUNDARY: tl.constexpr, RECOVER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
               IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr):
    """Fold the KV block [start_n, start_n + BLOCK_N) into (acc, l_i, m_i) and the running pseudo-average F.

    Scores and the running max ``m_i`` are in log2 units (``log2 e`` folded into ``inv_a`` /
    ``post_scale`` and the per-row terms), so every exponential is one ``exp2``; ``F`` stays in
    natural units. BOUNDARY blocks mask keys >= N_K and (causal) keys after the query; interior
    blocks are full and entirely visible, so their loads and scores need no key mask.
    """
    loc_n = tl.arange(0, BLOCK_N)
    offs_n = start_n + loc_n
    col_ok = offs_n < N_K
    d_ok = offs_d < D
    # 64-bit tile offsets (a million keys times a strided row overflow int32), 32-bit within the tile
    start_n64 = start_n + tl.zeros([], dtype=tl.int64)
    k = load_kv_tile(k_base + start_n64 * stride_kn + loc_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                     col_ok, offs_d, D, BOUNDARY, EVEN_D)
    # FP16 score accumulation: the product whose overflow PASA prevents.
    s = tl.dot(qs, tl.trans(k), out_dtype=tl.float16).to(tl.float32)
    if RECOVER:
        if BOUNDARY:
            n_valid = tl.minimum(N_K - start_n, BLOCK_N)
            inv_a = tl.where(n_valid == BLOCK_N, inv_a_full, inv_a_tail)
            c = tl.load(c_base + offs_n, mask=col_ok, other=0.0)
        else:
            inv_a = inv_a_full
            c = tl.load(c_base + offs_n)
        # the block's removed pseudo-average R = q . w (line 13) from w's three FP16 parts: one
        # [BLOCK_M, 16] x D MMA with FP32 accumulation (rows 3..15 of the w tile are zero)
        tile = start_n // BLOCK_N
        offs_p = tl.arange(0, 16)
        w = tl.load(w_base + tile * 3 * D + offs_p[:, None] * D + offs_d[None, :],
                    mask=(offs_p[:, None] < 3) & d_ok[None, :], other=0.0)
        r = tl.sum(tl.dot(q, tl.trans(w)), axis=1) * tl.load(winv_base + tile)
        j += 1.0
        F_new = F + (r - F) / j
        # log2(e) (scale q.k - F_new) = s' log2(e) / a + c_j + row; `row` joins per row (in the max
        # and the exp2 shift) instead of per score
        s = s * inv_a + c[None, :]
        row = (r - F_new) * _LOG2E
        m_old = m_i + (F - F_new) * _LOG2E  # previous max moved to the new frame
        F = F_new
    else:
        s = s * post_scale
        row = tl.zeros_like(m_i)
        m_old = m_i
    if HAS_BIAS:  # b_base / mk_base: the tile's first row; loc_m: rows within the tile
        s += tl.load(b_base + start_n64 * stride_bn + loc_m[:, None] * stride_bm + loc_n[None, :] * stride_bn,
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32) * _LOG2E
    if HAS_MASK:
        mk = tl.load(mk_base + start_n64 * stride_mn + loc_m[:, None] * stride_mm + loc_n[None, :] * stride_mn,
                     mask=row_ok[:, None] & col_ok[None, :], other=0)
        s = tl.where(mk != 0, s, float("-inf"))
    if BOUNDARY:
        keep = col_ok[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_old, tl.max(s, axis=1) + row)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_old - m_safe)
    p = tl.math.exp2(s - (m_safe - row)[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = load_kv_tile(v_base + start_n64 * stride_vn + loc_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                     col_ok, offs_dv, DV, BOUNDARY, EVEN_DV)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
    return acc, l_i, m_new, F, j


# N_K is specialized on (unlike _elsa_fwd_kernel's lengths): the per-head C rows start at pid_bh * N_K
@triton.jit(do_not_specialize=["H", "N_Q", "N_K"])
def _pasa_fwd_kernel(
    Q, K, V, O, BIAS, MASK, MU, C, W, W_INV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    H, N_Q, N_K, D, DV, post_scale, inv_a_full, inv_a_tail,
    RECOVER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
):
    tiles = tl.cdiv(N_Q, BLOCK_M)  # 1-D grid, as in _pasa_shift_keys_kernel
    pid_m = tl.program_id(0) % tiles
    pid_bh = tl.program_id(0) // tiles
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    start_m64 = start_m.to(tl.int64)  # 64-bit tile offsets: a million rows times a strided row overflow int32
    loc_m = tl.arange(0, BLOCK_M)
    offs_m = start_m + loc_m
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N_Q
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + start_m64 * stride_qm + loc_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if RECOVER:
        # query centering: q' = fl16(q - mu) feeds the FP16 product (R uses the uncentred q)
        mu = tl.load(MU + pid_bh.to(tl.int64) * D + offs_d, mask=offs_d < D, other=0.0)
        qs = (q.to(tl.float32) - mu[None, :]).to(tl.float16)
    else:
        qs = q
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
    c_base = C + pid_bh.to(tl.int64) * N_K
    n_blocks = tl.cdiv(N_K, BLOCK_N)
    w_base = W + pid_bh.to(tl.int64) * n_blocks * 3 * D
    winv_base = W_INV + pid_bh.to(tl.int64) * n_blocks
    b_base = BIAS + off_b * stride_bb + off_h * stride_bh + start_m64 * stride_bm
    mk_base = MASK + off_b * stride_mb + off_h * stride_mh + start_m64 * stride_mm

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    F = tl.zeros([BLOCK_M], tl.float32)  # running global pseudo-average (mean of the blocks' R), Eq. 15
    j = 0.0
    hi = N_K
    if IS_CAUSAL:
        hi = tl.minimum(N_K, start_m + BLOCK_M)  # later blocks are fully masked: skipped
    n_tiles = tl.cdiv(hi, BLOCK_N)
    n_full = N_K // BLOCK_N  # blocks needing neither the N_K tail mask nor the causal mask
    if IS_CAUSAL:
        n_full = tl.minimum(n_full, (start_m + 1) // BLOCK_N)
    n_full = tl.minimum(n_full, n_tiles)
    for t in range(0, n_full):
        acc, l_i, m_i, F, j = _pasa_tile(
            acc, l_i, m_i, F, j, qs, q, t * BLOCK_N, offs_m, loc_m, offs_d, offs_dv, row_ok,
            k_base, v_base, c_base, w_base, winv_base, b_base, mk_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
            N_K, D, DV, post_scale, inv_a_full, inv_a_tail,
            False, RECOVER, HAS_BIAS, HAS_MASK, IS_CAUSAL, BLOCK_N, EVEN_D, EVEN_DV)
    for t in range(n_full, n_tiles):
        acc, l_i, m_i, F, j = _pasa_tile(
            acc, l_i, m_i, F, j, qs, q, t * BLOCK_N, offs_m, loc_m, offs_d, offs_dv, row_ok,
            k_base, v_base, c_base, w_base, winv_base, b_base, mk_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
            N_K, D, DV, post_scale, inv_a_full, inv_a_tail,
            True, RECOVER, HAS_BIAS, HAS_MASK, IS_CAUSAL, BLOCK_N, EVEN_D, EVEN_DV)
    # l == 0 only for fully masked rows (-> zeros); an overflow (NaN/inf) propagates.
    out = tl.where(l_i[:, None] == 0.0, 0.0, acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None])
    tl.store(O + off_b * stride_ob + off_h * stride_oh + start_m64 * stride_om + loc_m[:, None] * stride_om
             + offs_dv[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))


def _get_config(d: int, interpret: bool) -> dict:
    """Launch configuration by head-dim bucket (BLOCK_N is fixed: it is the size of M)."""
    if interpret:
        return {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1}
    if d <= 64:
        # (docs/tuning.md: PASA D <= 64: BLOCK_M 64, 4 warps, 2 stages)
        return {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}
    if d <= 128:
        # 3 stages need more shared memory than an H100 / H200 block has (docs/tuning.md: PASA D=128:
        # BLOCK_M 128, 8 warps, 2 stages)
        return {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1}


def _smaller_configs(cfg: dict) -> list[dict]:
    """Configs to try in order when ``cfg`` exceeds shared memory: fewer stages, then fewer query rows."""
    out, c = [], dict(cfg)
    while c["num_stages"] > 1:
        c = dict(c, num_stages=c["num_stages"] - 1)
        out.append(c)
    while c["BLOCK_M"] > 16:
        c = dict(c, BLOCK_M=c["BLOCK_M"] // 2, num_warps=min(c["num_warps"], 4))
        out.append(c)
    return out


def pasa_unsupported_reason(q, k, v, bias, attn_mask) -> str | None:
    """Why :func:`pasa_attention` cannot run this call, or ``None`` if it can.

    Inputs as :func:`visionattn.attention` passes them after validation (any float dtype:
    the launcher needs them cast to float16). Reasons: head dim above :data:`MAX_HEAD_DIM`,
    tensors not on CUDA (unless ``TRITON_INTERPRET=1``). The kernel is forward-only: the op layer
    routes calls that need gradients elsewhere.
    """
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} > {MAX_HEAD_DIM}"
    if q.device.type != "cuda" and not interpreting():
        return f"tensors on {q.device.type} (the Triton kernels need CUDA or TRITON_INTERPRET=1)"
    return None


# ------------------------------------------------------------------------------------ launcher
def pasa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   attn_mask: torch.Tensor | None, is_causal: bool, scale: float, shift: bool = True,
                   beta: float | None = None, config: dict | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """PASA (``shift=True``) or FP16-score-accumulation (``shift=False``) attention forward.

    Args:
        q: [B, H, Nq, D] float16; k: [B, H, Nk, D] float16; v: [B, H, Nk, Dv] float16;
            CUDA tensors (or CPU with ``TRITON_INTERPRET=1``); any strides. D, Dv <= 256.
        bias: None or a float [B, H, Nq, Nk] view (stride-0 broadcast allowed), added after recovery.
        attn_mask: None or a bool [B, H, Nq, Nk] view, True = attend.
        is_causal: top-left causal mask.
        scale: logit scale.
        shift: True = PASA (mode ``pasa``), False = no shift (mode ``fp16-acc16``, may overflow).
        beta: shift strength in [0, 1); None = the optimal-accuracy beta of each block size
            (Eq. 20-22; 0.984497 for the 128-key blocks). ``beta=0`` switches the shift, the query
            centering and the recovery off (plain FP16 accumulation on ``fl16(scale * k)``).
            Ignored when ``shift=False``.
        config: override the launch config (``BLOCK_M``, ``num_warps``, ``num_stages``, and
            ``BLOCK_N``, the KV block = size of M, default :data:`BLOCK_N`; beta follows it).
        out_dtype: dtype of the output (float16, bfloat16 or float32); ``None`` = float16. The FP32
            state ``W / S`` is rounded once to it, so a FP32 caller gets no intermediate FP16 rounding
            (as the CPU reference, which returns FP32).

    Returns:
        [B, H, Nq, Dv] in ``out_dtype``, a view of a contiguous [B, Nq, H, Dv] buffer (as SDPA's
        flash path returns), so ``out.transpose(1, 2).reshape(B, Nq, H * Dv)`` is free. Fully
        masked rows are zeros; with ``shift=False`` overflowing rows are inf/NaN by design.

    Raises:
        TypeError: q/k/v not float16, a non-bool mask, or an unsupported ``out_dtype``.
        ValueError: bad shapes, D or Dv > 256, ``beta`` outside [0, 1), a config ``BLOCK_N`` that is
            not a power of two in 16..256.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float16:
            raise TypeError(f"pasa_attention: {name} must be float16 (the api casts), got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"pasa_attention: {name} must be [B, H, N, D], got shape {tuple(t.shape)}")
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    if k.shape != (B, H, Nk, D) or v.shape[:3] != (B, H, Nk):
        raise ValueError(f"pasa_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"do not match [B, H, Nq, D], [B, H, Nk, D], [B, H, Nk, Dv]")
    if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        raise ValueError(f"pasa_attention: head dims D={D}, Dv={Dv}; the kernel supports up to {MAX_HEAD_DIM}")
    if beta is not None and not 0.0 <= float(beta) < 1.0:
        raise ValueError(f"pasa_attention: beta={beta!r}; expected None or a float in [0, 1)")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise TypeError(f"pasa_attention: attn_mask must be bool, got {attn_mask.dtype}")
        attn_mask = attn_mask.expand(B, H, Nq, Nk)
    if bias is not None:
        bias = bias.expand(B, H, Nq, Nk)
    if beta is None and config is None:
        return pasa_forward(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)
    cfg = dict(_get_config(D, q.device.type != "cuda"), **(config or {}))
    block_n = cfg.get("BLOCK_N", BLOCK_N)  # KV block = size of M; beta is computed for it
    if block_n not in (16, 32, 64, 128, 256):
        raise ValueError(f"pasa_attention: config BLOCK_N={block_n!r}; expected a power of two in 16..256")
    out_dtype = out_dtype or torch.float16
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype}; the kernels write one of {OUT_DTYPES}")
    return _plan_and_run(q, k, v, bias, attn_mask, bool(is_causal), float(scale), bool(shift), beta, cfg,
                         out_dtype, explicit=config is not None)[1]


class _Workspace:
    """The scratch buffers of one call signature carved from one byte allocation (one ``torch.empty`` per call
    instead of one per buffer: each costs several microseconds of host time). ``segments``: name -> (shape,
    dtype); every segment starts 128-byte aligned."""

    __slots__ = ("names", "offsets", "specs", "nbytes")

    def __init__(self, segments: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.names, self.offsets, self.specs, at = [], [], [], 0
        for name, (shape, dtype) in segments.items():
            n = math.prod(shape)
            self.names.append(name)
            self.offsets.append(at)
            self.specs.append((shape, dtype, n))
            at += -(-n * dtype.itemsize // 128) * 128
        self.nbytes = max(at, 128)

    def allocate(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def pointers(self, buf: torch.Tensor) -> tuple[int, ...]:
        """Device addresses of the segments (what a direct launch takes for a pointer argument)."""
        base = buf.data_ptr()
        return tuple(base + off for off in self.offsets)

    def tensors(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Typed views of the segments (for Triton's JIT path, which reads each pointer's dtype)."""
        return tuple(buf[off:off + n * dtype.itemsize].view(dtype).view(shape)
                     for off, (shape, dtype, n) in zip(self.offsets, self.specs))


class _PasaPlan:
    """The PASA launches for one call signature: query centre (its own launch only for more than
    :data:`_CENTER_DIRECT_ROWS` query rows), key shift, the tile loop; their scratch in one :class:`_Workspace`."""

    __slots__ = ("center", "shift_call", "main", "fixed_shift", "fixed_main", "coef", "recover", "shift",
                 "o_shape", "o_stride", "o_dtype", "device", "workspace", "direct", "scratch_offsets")

    def __init__(self, q, k, v, bias, attn_mask, is_causal, shift, beta, cfg, out_dtype):
        B, H, Nq, D = q.shape
        Nk, Dv = k.shape[2], v.shape[3]
        block_d, block_dv = head_blocks(D, Dv)  # equal widths (its docstring: a Triton 3.6 miscompile)
        block_n = cfg.get("BLOCK_N", BLOCK_N)
        self.device, self.o_dtype, self.shift = q.device, out_dtype, bool(shift)
        self.o_shape, self.o_stride = heads_inner_layout(B, H, Nq, Dv)
        # beta = 0: M = scale * I, no centering, no recovery: plain FP16 accumulation on fl16(scale * k).
        self.recover = recover = self.shift and (beta is None or float(beta) != 0.0)
        fused_center = recover and Nq <= _CENTER_DIRECT_ROWS
        self.center = _CenterPlan(q) if recover and not fused_center else None
        n_blocks = cdiv(Nk, block_n)
        segments = {}
        if self.shift:
            segments["kp"] = ((B, H, Nk, D), torch.float16)
        if recover:
            segments.update(mu=((B, H, D), torch.float32), c=((B, H, Nk), torch.float32),
                            w=((B, H, n_blocks, 3, D), torch.float16), w_inv=((B, H, n_blocks), torch.float32))
        if self.center is not None and self.center.combine is not None:
            segments["part"] = (self.center.part_shape, torch.float32)
        self.workspace = _Workspace(segments) if segments else None
        # byte offsets of kp, mu, c, w, w_inv in the workspace (the direct path adds them to its address)
        self.scratch_offsets = None
        if self.shift and self.center is None:
            at = dict(zip(self.workspace.names, self.workspace.offsets))
            self.scratch_offsets = tuple(at.get(n) for n in ("kp", "mu", "c", "w", "w_inv"))
        if self.shift:
            tail = Nk % block_n or block_n
            a_f, b_f, _ = _coefficients(block_n, beta)
            a_t, b_t, _ = _coefficients(tail, beta)
            inv = (LOG2E / a_f, LOG2E / a_t) if recover else (1.0, 1.0)
            self.coef = (a_f, b_f, a_t, b_t, b_f / a_f, b_t / a_t, *inv)
            self.shift_call = KernelCall(_pasa_shift_keys_kernel, (n_blocks * B * H,),
                                         dict(RECOVER=recover, CENTER=fused_center, BLOCK_N=block_n,
                                              BLOCK_D=block_d, BLOCK_QM=_CENTER_ROWS), dict(num_warps=4))
            # q's strides only where the kernel reads q (else zeros: no specialisation on unused values)
            self.fixed_shift = (*k.stride(), *(q.stride() if fused_center else (0, 0, 0, 0)), H, Nk, Nq, D)
            k_strides = (H * Nk * D, Nk * D, D, 1)  # the contiguous shifted keys [B, H, Nk, D]
        else:
            self.coef = (1.0, 1.0)
            k_strides = tuple(k.stride())
        sb = tuple(bias.stride()) if bias is not None else (0, 0, 0, 0)
        sm = tuple(attn_mask.stride()) if attn_mask is not None else (0, 0, 0, 0)
        self.main = KernelCall(_pasa_fwd_kernel, (cdiv(Nq, cfg["BLOCK_M"]) * B * H,), dict(
            RECOVER=recover, HAS_BIAS=bias is not None, HAS_MASK=attn_mask is not None, IS_CAUSAL=bool(is_causal),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, EVEN_D=D == block_d,
            EVEN_DV=Dv == block_dv), dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
        self.fixed_main = (*q.stride(), *k_strides, *v.stride(), *self.o_stride, *sb, *sm, H, Nq, Nk, D, Dv)
        self.direct = False

    def _direct(self) -> bool:
        """Whether every launch of the plan goes to its compiled kernel directly (which takes addresses for
        pointers); before that, Triton's JIT path needs typed tensors. Once true it stays true (kept in
        :attr:`direct`, so later calls skip the check)."""
        if not self.direct:
            calls = [self.main] + ([self.shift_call] if self.shift else [])
            if self.center is not None:
                calls += [self.center.partials] + ([self.center.combine] if self.center.combine is not None else [])
            self.direct = all(c._fast is not None for c in calls)
        return self.direct

    def __call__(self, q, k, v, bias, attn_mask, scale):
        dev = self.device
        out = torch.empty_strided(self.o_shape, self.o_stride, dtype=self.o_dtype, device=dev)
        direct = self.direct or self._direct()
        null = 0 if direct else q  # unused pointer arguments
        mu = c = w = w_inv = null
        if self.shift:
            buf = self.workspace.allocate(dev)  # kept alive (by this frame) until every launch is queued
            if direct and self.scratch_offsets is not None:  # addresses straight from the byte offsets
                base = buf.data_ptr()
                kp, mu, c, w, w_inv = (null if off is None else base + off for off in self.scratch_offsets)
            else:
                parts = dict(zip(self.workspace.names,
                                 self.workspace.pointers(buf) if direct else self.workspace.tensors(buf)))
                kp = parts["kp"]
                if self.recover:
                    mu, c, w, w_inv = parts["mu"], parts["c"], parts["w"], parts["w_inv"]
                    if self.center is not None:
                        self.center(q, mu, parts.get("part"))
            a_f, b_f, a_t, b_t, wf, wt, inv_f, inv_t = self.coef
            self.shift_call(k, kp, mu, c, w, w_inv, q, *self.fixed_shift, scale, a_f, b_f, a_t, b_t,
                            scale * wf, scale * wt, inv_f, inv_t)
            keys, post_scale = kp, LOG2E
        else:
            inv_f, inv_t = self.coef
            keys, post_scale = k, scale * LOG2E
        mask = attn_mask.view(torch.uint8) if attn_mask is not None else null
        self.main(q, keys, v, out, null if bias is None else bias, mask, mu, c, w, w_inv, *self.fixed_main,
                  post_scale, inv_f, inv_t)
        return out


def _plan_and_run(q, k, v, bias, attn_mask, is_causal, scale, shift, beta, cfg, out_dtype, explicit: bool):
    """Build the plan of a call signature by running it once: ``(plan, out)``; the default config falls back
    on out-of-shared-memory (an explicit one runs as given)."""
    if q.shape[0] * q.shape[1] * q.shape[2] == 0 or v.shape[3] == 0 or k.shape[2] == 0:
        out, _ = allocate_output(q, k.shape[2], v.shape[3], out_dtype)
        return None, out
    result = []

    def run(cf):
        plan = _PasaPlan(q, k, v, bias, attn_mask, is_causal, shift, beta, cf, out_dtype)
        result.append((plan, plan(q, k, v, bias, attn_mask, scale)))

    run_first_that_fits(run, cfg, (lambda _: []) if explicit else _smaller_configs)
    return result[-1]


# call signature -> plan (see ._launch)
PLANS = PlanCache()


def plan_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
             attn_mask: torch.Tensor | None, is_causal: bool, scale: float, shift: bool = True,
             out_dtype: torch.dtype | None = None):
    """``(plan, out)``: the cached launch plan of this call signature (built by running the call when new;
    ``None`` for an empty call) and this call's output. Arguments as :func:`pasa_forward`; a plan reads
    ``bias`` / ``attn_mask`` through their data pointers only."""
    key = (q.shape, k.shape, v.shape[3], q.stride(), k.stride(), v.stride(), q.get_device(),
           None if bias is None else (bias.stride(), bias.dtype, bias.data_ptr() & 15),
           None if attn_mask is None else (attn_mask.stride(), attn_mask.data_ptr() & 15),
           is_causal, shift, out_dtype, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15)
    plan = PLANS.get(key)
    if plan is not None:
        return plan, plan(q, k, v, bias, attn_mask, scale)
    out_dtype = out_dtype or torch.float16
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype}; the kernels write one of {OUT_DTYPES}")
    cfg = _get_config(q.shape[3], q.device.type != "cuda")
    plan, out = _plan_and_run(q, k, v, bias, attn_mask, bool(is_causal), float(scale), bool(shift), None, cfg,
                              out_dtype, explicit=False)
    if plan is not None:
        PLANS.put(key, plan)
    return plan, out


def pasa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                 attn_mask: torch.Tensor | None, is_causal: bool, scale: float, shift: bool = True,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`pasa_attention` with the optimal beta and the default config, from a cached launch plan (the op
    layer's entry; inputs validated: float16 q / k / v, bias / mask as [B, H, Nq, Nk] views)."""
    return plan_for(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)[1]
