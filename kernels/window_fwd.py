"""Window attention forward for Swin / Swin-v2 (Triton).

Computes, for every window ``b`` (``b = image * nW + w``) and head ``h``,

    y = softmax(c * q k^T + bias[h] + mask[b mod nW]) v

with ``c = scale`` (Swin) or, for Swin-v2 cosine attention,
``q, k <- q / max(||q||, 1e-12), k / max(||k||, 1e-12)`` and
``c = exp(min(logit_scale[h], log 100))``. The relative position bias
``[H, N, N]`` and the shift mask ``[nW, N, N]`` are read per window and never
expanded to ``[B*nW, H, N, N]`` (docs/design.md, "How a call reaches a kernel").

Two kernels, chosen by the window area ``N``:

* ``_window_small_kernel`` (N <= 128): the whole window (N padded to a power of
  two, e.g. 49 -> 64) lives in registers. One program owns one (head, window
  slot) pair and loops over a chunk of images: bias[h] + mask[w] is loaded once
  per program, pre-combined, and reused for every image of the chunk, so the
  bias/mask traffic is ``O(H*N^2 + nW*N^2)`` per chunk instead of per window.
* ``_window_tiled_kernel`` (larger windows, 144 / 256 / 576 tokens): the ELSA
  (m, S, W) fold over key blocks (FlashAttention-style online softmax) with
  bias / mask blocks indexed per window.

Precision modes (:mod:`visionattn.modes`) are constexprs. The FP32 modes' products
(``IN_PREC``):

* ``fp32`` -> ``"f16x3"`` and ``tf32`` -> ``"f16x1"``: split-FP16 products on the FP16
  tensor cores (:mod:`visionattn.kernels.split16`, shared with the dense kernel). q and k rows are
  scaled by exact powers of two (row max in [2^14, 2^15)) and split ``x = hi + lo``
  (two FP16 parts of 11 significant bits); ``s = lo_q hi_k^T + hi_q lo_k^T +
  hi_q hi_k^T`` in FP32 accumulation (``f16x1``: ``hi_q hi_k^T`` only), times the
  inverse row / column scales. P (<= 1) is scaled by 2^15 and V by an exact power
  of two per column (small kernel: one scale per window; tiled kernel: a running
  per-column exponent, undone like the softmax max) and split the same way;
  ``P V = p_lo v_hi + p_hi v_lo + p_hi v_hi``, each key tile summed apart before it
  is added to the FP32 accumulator. Cosine (Swin-v2) rows are L2-normalized in FP32
  (after an exact power-of-two prescale, so |x| up to FP32's range cannot over- or
  underflow the norm) and then split.
* ``fp32-ieee`` -> ``"ieee"`` (FP32 FMA); ``"tf32x3"`` / ``"tf32"`` (Triton's 3xTF32 /
  TF32 ``tl.dot``) stay selectable through ``precision=`` for comparison.

``fp16`` / ``bf16`` multiply on tensor cores with FP32 accumulation and round P to
half before ``P @ V``; ``pasa`` accumulates the scores in FP16 after shifting K by
its window mean (see :func:`window_attention_fwd`); ``fp16-acc16`` is the same
without the shift (the overflow baseline).

The output is returned as a ``[B*nW, H, N, Dv]`` view of a ``[B*nW, N, H, Dv]``
buffer, so the caller's ``x.transpose(1, 2).reshape(B*nW, N, H*Dv)`` (timm) is free.

On request (``with_lse``, the ``WRITE_LSE`` constexpr: a separate kernel variant, so forward-only calls
are unchanged) both kernels also write each row's natural-log log-sum-exp ``(m + log2 l) ln 2`` of the
base-2 state (the logits are held in log2 units in every precision path, the split-FP16 scales undone
before the max), ``-inf`` for a fully masked row: the saved state of :mod:`.window_bwd`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (KernelCall, PlanCache, WindowForwardRun, cdiv, head_blocks, heads_inner_layout, interpreting,
                      over_axes_1_2, pad_pow2, run_first_that_fits, sm_count)
from .modes import MODES
from .split16 import SPLIT_EXP, exponent, fold_pv, pow2, pv_unscale, split_rows, split_scores

__all__ = ["window_attention_fwd", "window_forward", "window_forward_planned", "plan_for", "get_config", "SMALL_MAX_N",
           "PRECISIONS", "PLANS"]

SMALL_MAX_N = 128  # windows up to this many tokens run fully in registers
_COMPUTE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# name -> (compute dtype, input_precision for fp32 dots, half_scores, pasa_shift), from the one mode table
_MODE_TABLE = {name: (m.compute_dtype, m.input_precision, m.half_scores, m.pasa_shift)
               for name, m in MODES.items() if "window" in m.kernels}
# product precisions the FP32 modes accept through ``precision=`` (tools compare them)
PRECISIONS = ("f16x3", "f16x1", "tf32x3", "tf32", "ieee")


# ----------------------------------------------------------------------------- jit helpers
@triton.jit
def _to_compute(x, COMPUTE: tl.constexpr):
    if COMPUTE == 1:
        y = x.to(tl.float16)
    elif COMPUTE == 2:
        y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _l2_normalize_rows(x):
    """x / max(||x||, 1e-12) per row of FP32 ``x`` [R, C], without over- / underflow in the norm.

    Each row is first scaled by the exact power of two 2^-e that puts its largest |entry| in
    [1, 2) (``e = floor(log2 max|x|)``), so the sum of squares lies in [1, C * 4) for any finite
    nonzero row (plain ``sum(x * x)`` overflows for |x| > ~1e19 and loses bits below ~1e-19).
    Then ``x / max(||x||, eps) = xs / max(||xs||, eps * 2^-e)``; zero rows stay zero.
    """
    e = exponent(tl.max(tl.abs(x), 1))
    xs = x * pow2(-e)[:, None]
    nrm = tl.sqrt(tl.sum(xs * xs, axis=1))
    return xs / tl.maximum(nrm, 1e-12 * pow2(-e))[:, None]


@triton.jit
def _prep_rows(x, mult, COMPUTE: tl.constexpr, NORMALIZE: tl.constexpr, SCALE_ROWS: tl.constexpr):
    """Round a [rows, D] tile to the compute dtype; ``NORMALIZE``: L2-normalize rows; optional row scale."""
    x = _to_compute(x, COMPUTE)
    if NORMALIZE:
        xf = x.to(tl.float32)
        if COMPUTE == 0:
            xf = _l2_normalize_rows(xf)
        else:
            nrm = tl.sqrt(tl.sum(xf * xf, axis=1))
            xf = xf / tl.maximum(nrm, 1e-12)[:, None]
        if SCALE_ROWS:
            xf = xf * mult
        x = _to_compute(xf, COMPUTE)
    elif SCALE_ROWS:
        x = _to_compute(x.to(tl.float32) * mult, COMPUTE)
    return x


@triton.jit
def _scores(q, k, IN_PREC: tl.constexpr, HALF_SCORES: tl.constexpr, COMPUTE: tl.constexpr,
            DOT_UPCAST: tl.constexpr):
    """q [M, D] @ k[N, D]^T in the mode's arithmetic, returned as float32 [M, N]. DOT_UPCAST (the interpreter only,
    whose bf16 ``tl.dot`` is broken): the bf16 operands multiplied in FP32, which is exact, as the tensor cores
    compute them (as the dense kernels do, :mod:`.elsa_fwd`)."""
    if HALF_SCORES:
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float16).to(tl.float32)
    elif DOT_UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    elif COMPUTE == 0:
        s = tl.dot(q, tl.trans(k), input_precision=IN_PREC)
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _pv(p, v, IN_PREC: tl.constexpr, COMPUTE: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """P @ V: FP32 operands at ``IN_PREC``; else P rounded to V's half dtype (DOT_UPCAST: as :func:`_scores`)."""
    if COMPUTE == 0:
        o = tl.dot(p, v, input_precision=IN_PREC)
    elif DOT_UPCAST:
        o = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        o = tl.dot(p.to(v.dtype), v)
    return o


@triton.jit
def _logit_mult(LS, h, stride_ls, scale, COSINE: tl.constexpr):
    if COSINE:
        mult = tl.exp(tl.minimum(tl.load(LS + h * stride_ls).to(tl.float32), 4.605170185988092))  # log(100)
    else:
        mult = scale
    return mult


@triton.jit
def _lse(m, l):
    """Natural-log log-sum-exp ``(m + log2 l) ln 2`` of rows whose base-2 state is (max m, sum l); -inf where
    l = 0 (every logit -inf), without taking log2(0)."""
    ok = l > 0
    return tl.where(ok, (m + tl.math.log2(tl.where(ok, l, 1.0))) * 0.6931471805599453, float("-inf"))


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _index_over_axes_1_2(SPILL: tl.constexpr):
    # this program's index along grid axes 1 and 2 read as one axis, axis 1 fastest (:func:`._launch.over_axes_1_2`);
    # grids that fit axis 1 (SPILL False) compile without the sum and the bound check that it brings
    index = tl.program_id(1)
    if SPILL:
        index += tl.program_id(2) * tl.num_programs(1)
    return index


@triton.jit(do_not_specialize=["n_img"])  # a new batch size compiles nothing new
def _window_small_kernel(
    Q, K, V, O, BIAS, MASK, LS, LSE,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_n, so_d,
    sb_h, sb_i, sb_j, sm_w, sm_i, sm_j, s_ls, sl_b, sl_h,
    n_img, n_slot, N, D, DV, scale,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, IMGS: tl.constexpr, SPILL: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, COMPUTE: tl.constexpr,
    IN_PREC: tl.constexpr, HALF_SCORES: tl.constexpr, PASA_SHIFT: tl.constexpr, SPLIT16: tl.constexpr,
    WRITE_LSE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # program (pid0 = h * n_slot + w, pid1 = image chunk over grid axes 1 and 2); window index b = img * n_slot + w;
    # a chunk past the images (the axes' rounding) has no images to fold
    pid0 = tl.program_id(0)
    pid1 = _index_over_axes_1_2(SPILL)
    h = pid0 // n_slot
    w = pid0 % n_slot
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_n < N
    col_ok = offs_n[None, :] < N

    # bias[h] + mask[w] (log2 domain), padded key columns -inf: loaded once per program.
    cb = tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.float32)
    tile_ok = row_ok[:, None] & col_ok
    if HAS_BIAS:
        cb += tl.load(BIAS + h * sb_h + offs_n[:, None] * sb_i + offs_n[None, :] * sb_j,
                      mask=tile_ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        cb += tl.load(MASK + w * sm_w + offs_n[:, None] * sm_i + offs_n[None, :] * sm_j,
                      mask=tile_ok, other=0.0).to(tl.float32)
    cb = tl.where(col_ok, cb * 1.4426950408889634, float("-inf"))

    mult = _logit_mult(LS, h, s_ls, scale, COSINE)
    if HALF_SCORES:
        post = 1.4426950408889634  # the logit scale is folded into q before the FP16 product
    else:
        post = mult * 1.4426950408889634

    img0 = pid1 * IMGS
    n_here = tl.minimum(IMGS, n_img - img0)
    qd_ok = row_ok[:, None] & (offs_d[None, :] < D)
    vd_ok = row_ok[:, None] & (offs_dv[None, :] < DV)
    for i in range(0, n_here):
        b = ((img0 + i) * n_slot + w).to(tl.int64)
        q = tl.load(Q + b * sq_b + h * sq_h + offs_n[:, None] * sq_n + offs_d[None, :] * sq_d,
                    mask=qd_ok, other=0.0)
        k = tl.load(K + b * sk_b + h * sk_h + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=qd_ok, other=0.0)
        v = tl.load(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_n + offs_dv[None, :] * sv_d,
                    mask=vd_ok, other=0.0)
        q = _prep_rows(q, mult, COMPUTE, NORMALIZE, HALF_SCORES)
        k = _prep_rows(k, 1.0, COMPUTE, NORMALIZE, False)
        if PASA_SHIFT:
            kf = k.to(tl.float32)
            kbar = tl.sum(kf, axis=0) / N  # padded rows are zero
            k = (kf - kbar[None, :]).to(tl.float16)
        v = _to_compute(v, COMPUTE)
        if SPLIT16:
            # logit scale folded into q: the scores are then scaled by powers of two only (exact),
            # so p = exp2(s - max s) <= 1 also under FMA contraction (see elsa_fwd)
            q_hi, q_lo, q_inv = split_rows(q * post)
            k_hi, k_lo, k_inv = split_rows(k)
            s = split_scores(q_hi, q_lo, k_hi, k_lo, IN_PREC)
            s = s * (q_inv[:, None] * k_inv[None, :]) + cb
        else:
            s = _scores(q, k, IN_PREC, HALF_SCORES, COMPUTE, DOT_UPCAST) * post + cb
        m = tl.max(s, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)
        p = tl.math.exp2(s - m[:, None])
        l = tl.sum(p, axis=1)
        if SPLIT16:  # one window = one key tile: one fold from the empty state
            acc, v_exp = fold_pv(tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32), tl.full((BLOCK_N,), 1.0, tl.float32),
                                 tl.full((BLOCK_DV,), SPLIT_EXP - 126, dtype=tl.int32), p, v, IN_PREC, False, False)
            # divide first (acc itself may exceed FP32 once unscaled), then undo the V and P scales
            out = acc / tl.where(l > 0, l, 1.0)[:, None] * pv_unscale(v_exp)[None, :]
        else:
            acc = _pv(p, v, IN_PREC, COMPUTE, DOT_UPCAST)
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(O + b * so_b + h * so_h + offs_n[:, None] * so_n + offs_dv[None, :] * so_d,
                 out.to(O.dtype.element_ty), mask=vd_ok)
        if WRITE_LSE:
            tl.store(LSE + b * sl_b + h * sl_h + offs_n, _lse(m, l), mask=row_ok)


@triton.jit(do_not_specialize=["n_bh"])  # a new batch size compiles nothing new
def _window_tiled_kernel(
    Q, K, V, O, BIAS, MASK, LS, LSE,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_n, so_d,
    sb_h, sb_i, sb_j, sm_w, sm_i, sm_j, s_ls, sl_b, sl_h,
    n_bh, H, n_mask, N, D, DV, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPILL: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, COSINE: tl.constexpr, COMPUTE: tl.constexpr,
    IN_PREC: tl.constexpr, HALF_SCORES: tl.constexpr, PASA_SHIFT: tl.constexpr, SPLIT16: tl.constexpr,
    WRITE_LSE: tl.constexpr, NORMALIZE: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # program (pid_m = query block, pid_bh = b * H + h over grid axes 1 and 2); ELSA fold over key blocks.
    pid_m = tl.program_id(0)
    pid_bh = _index_over_axes_1_2(SPILL)
    if SPILL:
        if pid_bh >= n_bh:  # past the windows x heads (the axes' rounding)
            return
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    w = b % n_mask
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < N
    mult = _logit_mult(LS, h, s_ls, scale, COSINE)
    if HALF_SCORES:
        post = 1.4426950408889634
    else:
        post = mult * 1.4426950408889634

    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_n + offs_d[None, :] * sq_d,
                mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    q = _prep_rows(q, mult, COMPUTE, NORMALIZE, HALF_SCORES)
    q_lo = q
    q_inv = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SPLIT16:
        q, q_lo, q_inv = split_rows(q * post)  # logit scale in q: exact score scaling (see elsa_fwd)
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h

    if PASA_SHIFT:  # window-wide key mean: one shift for all key blocks, so no recovery is needed
        ksum = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            offs_n = start + offs_n0
            kt = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d,
                         mask=(offs_n[:, None] < N) & (offs_d[None, :] < D), other=0.0)
            kt = _prep_rows(kt, 1.0, COMPUTE, NORMALIZE, False)
            ksum += tl.sum(kt.to(tl.float32), axis=0)
        kbar = ksum / N

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    # SPLIT16: acc is held scaled by 2^(SPLIT_EXP - v_exp + 15) per column, v_exp the largest V exponent so far
    v_exp = tl.full((BLOCK_DV,), SPLIT_EXP - 126, dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + offs_n0
        n_ok = offs_n < N
        k = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_n + offs_dv[None, :] * sv_d,
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        k = _prep_rows(k, 1.0, COMPUTE, NORMALIZE, False)
        if PASA_SHIFT:
            k = (k.to(tl.float32) - kbar[None, :]).to(tl.float16)
        v = _to_compute(v, COMPUTE)
        if SPLIT16:
            k_hi, k_lo, k_inv = split_rows(k)
            s = split_scores(q, q_lo, k_hi, k_lo, IN_PREC) * (q_inv[:, None] * k_inv[None, :])
        else:
            s = _scores(q, k, IN_PREC, HALF_SCORES, COMPUTE, DOT_UPCAST) * post
        tile_ok = m_ok[:, None] & n_ok[None, :]
        if HAS_BIAS:
            s += tl.load(BIAS + h * sb_h + offs_m[:, None] * sb_i + offs_n[None, :] * sb_j,
                         mask=tile_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        if HAS_MASK:
            s += tl.load(MASK + w * sm_w + offs_m[:, None] * sm_i + offs_n[None, :] * sm_j,
                         mask=tile_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SPLIT16:
            acc, v_exp = fold_pv(acc, alpha, v_exp, p, v, IN_PREC, False, False)
        else:
            acc = acc * alpha[:, None] + _pv(p, v, IN_PREC, COMPUTE, DOT_UPCAST)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT16:
        out = out * pv_unscale(v_exp)[None, :]  # undo the V and P scales
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_n + offs_dv[None, :] * so_d,
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & (offs_dv[None, :] < DV))
    if WRITE_LSE:
        tl.store(LSE + b * sl_b + h * sl_h + offs_m, _lse(m_i, l_i), mask=m_ok)


# ----------------------------------------------------------------------------- configuration
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return sm_count(device)
    return 4  # interpreter: few programs keep CPU tests fast


# Programs per SM the small kernel aims for (images per program grow until fewer would exist, up to
# _SMALL_MAX_IMGS), and its pipeline depth over a program's images:
# * half: long chunks win, as they reuse bias / mask over more images (docs/tuning.md: window small kernel,
#   half modes: 2 programs per SM, image chunks up to 64).
# * fp32: programs do ~3x the work per window (split-FP16 products), so more, shorter programs win
#   (docs/tuning.md: window small kernel, fp32: 3 programs per SM, chunks up to 32).
# * 3 stages pay when a program loops over >= 2 images, not on single-image programs (docs/tuning.md:
#   window small kernel: 3 stages for programs over >= 2 images, 2 for single-image programs; not 4).
_SMALL_PROGRAMS_PER_SM = {"half": 2, "fp32": 3}
_SMALL_MAX_IMGS = {"half": 64, "fp32": 32}  # longest image chunk per program
_SMALL_STAGES = 3  # for programs over >= 2 images; single-image programs keep 2


def get_config(n_windows: int, heads: int, n_tokens: int, head_dim: int, n_slot: int,
               device: torch.device, *, mode: str) -> dict:
    """Launch configuration chosen by shape and mode (overridable through ``config=``).

    Returns a dict with ``kernel`` (``"small"`` / ``"tiled"``), ``num_warps``,
    ``num_stages`` and, for ``small``, ``imgs`` (images per program: bias/mask are reused
    across the chunk; the chunk grows while at least :data:`_SMALL_PROGRAMS_PER_SM` programs
    per SM remain), for ``tiled`` ``block_m`` / ``block_n``.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in _MODE_TABLE:
        raise ValueError(f"mode={mode!r} has no window kernel; expected one of {list(_MODE_TABLE)}")
    if n_tokens <= SMALL_MAX_N:
        block = pad_pow2(n_tokens)
        n_img = n_windows // n_slot
        base = heads * n_slot
        kind = "fp32" if _MODE_TABLE[mode][0] == torch.float32 else "half"
        target = _SMALL_PROGRAMS_PER_SM[kind] * _num_sms(device)
        imgs = 1
        while imgs < _SMALL_MAX_IMGS[kind] and base * cdiv(n_img, imgs * 2) >= target:
            imgs *= 2
        return {"kernel": "small", "imgs": imgs, "num_warps": 4 if block <= 64 else 8,
                "num_stages": _SMALL_STAGES if block <= 64 and imgs >= 2 else 2}
    bm = 64 if n_tokens <= 256 else 128
    return {"kernel": "tiled", "block_m": bm, "block_n": 64, "num_warps": 4, "num_stages": 2}


def _smaller_configs(cfg: dict) -> list[dict]:
    """Configs to try in order when ``cfg`` exceeds shared memory (large head dims, FP32 tiles): fewer stages;
    then, for the small kernel (a whole window per tile), the tiled kernel at (64, 32), (32, 16), (16, 16) with
    one stage; for the tiled kernel, narrower key tiles, then fewer query rows, one stage. Each try compiles a
    kernel, so the list stays short: a 128-token window at head dim 256 in FP32 needs ~384 KB as one tile, the
    tiled kernel at (64, 32) ~100 KB."""
    out = [dict(cfg, num_stages=n) for n in range(cfg["num_stages"] - 1, 0, -1)]
    if cfg["kernel"] != "tiled":
        tiles = [(64, 32), (32, 16), (16, 16)]
    else:
        bm, bn, tiles = cfg["block_m"], cfg["block_n"], []
        while bn > 16:
            bn //= 2
            tiles.append((bm, bn))
        while bm > 16:
            bm //= 2
            tiles.append((bm, bn))
    return out + [{"kernel": "tiled", "block_m": m, "block_n": n, "num_warps": 4, "num_stages": 1} for m, n in tiles]


# ----------------------------------------------------------------------------- launcher
def _precision(mode: str, precision: str | None) -> str | None:
    """The FP32 product precision of ``mode``, or the explicit override (FP32 modes only)."""
    compute, in_prec = _MODE_TABLE[mode][:2]
    if precision is None:
        return in_prec
    if compute != torch.float32:
        raise ValueError(f"precision={precision!r} applies to the FP32 modes (fp32, fp32-ieee, tf32) only; "
                         f"mode {mode!r} computes in {compute}: pass precision=None")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; expected one of {PRECISIONS}")
    return precision


def mode_constexprs(mode: str, precision: str | None, has_bias: bool, has_mask: bool, cosine: bool,
                    with_lse: bool = False, normalized: bool = False) -> dict:
    """The mode / feature constexprs both window kernels take (tools compile them offline from this).

    ``cosine``: per-head logit scale ``exp(min(logit_scale, log 100))`` and, unless ``normalized`` (q, k given
    already L2-normalised), the rows' L2 normalisation in the kernel (``NORMALIZE``). ``DOT_UPCAST``: bf16 products
    in FP32 where the Triton interpreter runs the kernels (its bf16 ``tl.dot`` is wrong; :func:`_scores`), always
    False on the GPU, whose code is unchanged by it.

    Raises:
        ValueError: ``with_lse`` in a mode that accumulates the scores in FP16 (``pasa``, ``fp16-acc16``):
            their logits are shifted / rounded, so no log-sum-exp of the true logits exists to write.
    """
    compute, _, half_scores, pasa_shift = _MODE_TABLE[mode]
    if with_lse and half_scores:
        raise ValueError(f"mode={mode!r} accumulates the scores in FP16 and writes no log-sum-exp "
                         f"(with_lse=True needs fp32, fp32-ieee, tf32, fp16 or bf16)")
    in_prec = _precision(mode, precision)
    return dict(HAS_BIAS=has_bias, HAS_MASK=has_mask, COSINE=bool(cosine), COMPUTE=_COMPUTE_CODE[compute],
                IN_PREC=in_prec or "ieee", HALF_SCORES=half_scores, PASA_SHIFT=pasa_shift,
                SPLIT16=in_prec in ("f16x3", "f16x1"), WRITE_LSE=bool(with_lse),
                NORMALIZE=bool(cosine) and not normalized,
                DOT_UPCAST=compute == torch.bfloat16 and interpreting())  # False on the GPU


class _WindowPlan(WindowForwardRun):
    """The small or tiled window kernel for one call signature: grid, constexprs and strides fixed.

    Calling it returns the output [B*nW, H, N, Dv] or, for a plan built ``with_lse``, ``(out, lse)`` with
    ``lse`` float32 [B*nW, H, N] (contiguous): each row's natural-log log-sum-exp of its logits
    ``c q.k + bias + mask``, ``-inf`` for a row whose logits are all ``-inf``.
    """

    __slots__ = ("call", "fixed", "o_shape", "o_stride", "o_dtype", "device", "config", "lse_shape")

    def __init__(self, q, k, v, bias, mask, logit_scale, n_slot_mask, cosine, mode, cfg, precision,
                 with_lse=False, normalized=False):
        BW, H, N, D = q.shape
        DV = v.shape[-1]
        self.config, self.device, self.o_dtype = cfg, q.device, q.dtype
        self.o_shape, self.o_stride = heads_inner_layout(BW, H, N, DV)  # timm's reshape is then a view
        self.lse_shape = (BW, H, N) if with_lse else None
        b_str = tuple(bias.stride()) if bias is not None else (0, 0, 0)
        m_str = tuple(mask.stride()) if mask is not None else (0, 0, 0)
        ls_str = logit_scale.stride(0) if logit_scale is not None else 0
        lse_str = (H * N, N) if with_lse else (0, 0)
        strides = (*q.stride(), *k.stride(), *v.stride(), *self.o_stride, *b_str, *m_str, ls_str, *lse_str)
        flags = mode_constexprs(mode, precision, bias is not None, mask is not None, cosine, with_lse, normalized)
        block_d, block_dv = head_blocks(D, DV)
        options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        n_slot = n_slot_mask if mask is not None else 1
        if cfg["kernel"] == "small":
            if N > SMALL_MAX_N:
                raise ValueError(f"config kernel='small' needs N <= {SMALL_MAX_N}, got N={N}")
            n_img = BW // n_slot
            imgs = int(cfg["imgs"])
            axes = over_axes_1_2(cdiv(n_img, imgs))
            self.call = KernelCall(_window_small_kernel, (H * n_slot, *axes), dict(
                BLOCK_N=pad_pow2(N), BLOCK_D=block_d, BLOCK_DV=block_dv, IMGS=imgs, SPILL=axes[1] > 1, **flags),
                options)
            self.fixed = (*strides, n_img, n_slot, N, D, DV)
        elif cfg["kernel"] == "tiled":
            axes = over_axes_1_2(BW * H)
            self.call = KernelCall(_window_tiled_kernel, (cdiv(N, cfg["block_m"]), *axes), dict(
                BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_D=block_d, BLOCK_DV=block_dv,
                SPILL=axes[1] > 1, **flags), options)
            self.fixed = (*strides, BW * H, H, n_slot, N, D, DV)
        else:
            raise ValueError(f"config kernel={cfg['kernel']!r}; expected 'small' or 'tiled'")


def _plan_and_run(q, k, v, bias, mask, logit_scale, n_slot_mask: int, cosine: bool, scale: float, mode: str,
                  config: dict | None, precision: str | None = None, with_lse: bool = False,
                  normalized: bool = False):
    """Build the plan of a call signature by running it once: ``(plan, result)``, result ``out`` or, with
    ``with_lse``, ``(out, lse)``. On out-of-shared-memory (large head dims) the default config gives way to
    :func:`_smaller_configs` in order; an explicit ``config`` runs as given."""
    BW, H, N, D = q.shape
    cfg = dict(config) if config else get_config(BW, H, N, D, n_slot_mask if mask is not None else 1, q.device,
                                                 mode=mode)
    result = []

    def run(c):
        plan = _WindowPlan(q, k, v, bias, mask, logit_scale, n_slot_mask, cosine, mode, c, precision, with_lse,
                           normalized)
        result.append((plan, plan(q, k, v, bias, mask, logit_scale, scale)))

    run_first_that_fits(run, cfg, (lambda _: []) if config else _smaller_configs)
    return result[-1]


# call signature -> plan (see ._launch)
PLANS = PlanCache()


def _training_precision(mode: str, with_lse: bool, cosine: bool) -> str | None:
    """The score products of a window forward: the mode's own (None), except in the training forward of Swin-v2's
    cosine windows in an FP32 mode whose window backward multiplies otherwise
    (:attr:`.modes.Mode.window_backward_precision`: tf32's f16x3). That forward then scores with the backward's
    products, so the LSE it saves belongs to the logits the backward recomputes: with logit scales up to 100, the
    two roundings of one logit (f16x1 here, f16x3 there) differ by ~1e-2, and the probabilities the backward
    forms from them no longer sum to 1 (dV errs 3-6e-3 where PyTorch's TF32 errs 1.1e-3)."""
    md = MODES[mode]
    if with_lse and cosine and md.compute_dtype == torch.float32 and md.window_backward_precision is not None:
        return md.window_backward_precision
    return None


def plan_for(q, k, v, relative_position_bias, shift_mask, logit_scale, num_windows: int, cosine: bool, scale: float,
             mode: str, with_lse: bool = False, normalized: bool = False):
    """``(plan, result)``: the cached launch plan of this call signature (built by running the call when new) and
    this call's result: the output, or ``(out, lse)`` with ``with_lse`` (see :class:`_WindowPlan`).
    ``relative_position_bias`` [H, N, N] and ``shift_mask`` [nW, N, N] with a unit last stride, ``logit_scale``
    [H]: a plan reads them through their data pointers only. ``with_lse`` is part of the key: a forward-only call
    (the default) runs the kernel variant that writes no LSE. ``normalized`` (with ``cosine``): q and k come
    L2-normalised already and are used as given (the training path of windows larger than the fused backward
    takes normalises them in PyTorch, so the forward's logits, hence its LSE, are exactly those the backward
    recomputes; renormalising half-precision rows in the kernel would round them differently).

    Raises:
        ValueError: unknown ``mode``; ``with_lse`` in ``pasa`` / ``fp16-acc16`` (:func:`mode_constexprs`).
    """
    b, m, ls = relative_position_bias, shift_mask, logit_scale
    key = (mode, q.shape, q.stride(), k.stride(), v.shape[3], v.stride(), q.dtype, q.get_device(),
           None if b is None else (b.shape, b.stride(), b.dtype, b.data_ptr() & 15),
           None if m is None else (m.shape, m.stride(), m.dtype, m.data_ptr() & 15),
           None if ls is None else (ls.stride(), ls.dtype, ls.data_ptr() & 15),
           num_windows, cosine, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15, with_lse, normalized)
    plan = PLANS.get(key)
    if plan is not None:
        return plan, plan(q, k, v, b, m, ls, scale)
    if mode not in _MODE_TABLE:
        raise ValueError(f"mode={mode!r} has no window kernel; expected one of {list(_MODE_TABLE)}")
    plan, result = _plan_and_run(q, k, v, b, m, ls, int(num_windows), bool(cosine), float(scale), mode, None,
                                 _training_precision(mode, with_lse, cosine), with_lse=bool(with_lse),
                                 normalized=bool(normalized))
    PLANS.put(key, plan)
    return plan, result


def window_forward(q, k, v, relative_position_bias, shift_mask, logit_scale, num_windows: int, cosine: bool,
                   scale: float, mode: str, with_lse: bool = False, normalized: bool = False):
    """:func:`window_attention_fwd` from a cached launch plan (the op layer's entry; no ``config`` /
    ``precision`` overrides). The key holds shapes, strides, dtypes, device, alignment and the flags.

    Returns:
        ``out`` [B*nW, H, N, Dv] in q's dtype; with ``with_lse``, ``(out, lse)``, ``lse`` float32 [B*nW, H, N]
        the natural-log log-sum-exp of each row's logits (``-inf`` for a fully masked row), what
        :func:`visionattn.kernels.window_bwd.window_backward` recomputes the probabilities from.
        ``normalized``: see :func:`plan_for`.

    Raises:
        ValueError: unknown ``mode``; ``with_lse`` in ``pasa`` / ``fp16-acc16``.
    """
    return window_forward_planned(q, k, v, relative_position_bias, shift_mask, logit_scale, num_windows, cosine,
                                  scale, mode, with_lse, normalized)[1]


def window_forward_planned(q, k, v, relative_position_bias, shift_mask, logit_scale, num_windows: int, cosine: bool,
                           scale: float, mode: str, with_lse: bool = False, normalized: bool = False):
    """``(plan, result)``: :func:`window_forward`'s result and the plan it ran from, which fixes every layout the
    backward depends on but the output gradient's (:func:`.window_bwd.backward_after_forward` keys on it)."""
    if relative_position_bias is not None and relative_position_bias.stride(-1) != 1:
        relative_position_bias = relative_position_bias.contiguous()
    if shift_mask is not None and shift_mask.stride(-1) != 1:
        shift_mask = shift_mask.contiguous()
    if logit_scale is not None and logit_scale.dim() != 1:
        logit_scale = logit_scale.reshape(-1)
    return plan_for(q, k, v, relative_position_bias, shift_mask, logit_scale, num_windows, cosine, scale, mode,
                    with_lse, normalized)


def window_attention_fwd(q, k, v, relative_position_bias, shift_mask, num_windows, cosine, logit_scale,
                         scale, mode, *, config: dict | None = None, precision: str | None = None,
                         with_lse: bool = False, normalized: bool = False):
    """Launch the window attention kernel (inputs already validated by :func:`visionattn.window_attention`).

    Args:
        q, k: [B*nW, H, N, D]; v: [B*nW, H, N, Dv]; one dtype (fp16 / bf16 / fp32), any
            strides (timm's ``qkv.unbind`` views are read in place). Cast to the mode's
            compute dtype inside the kernel.
        relative_position_bias: float [H, N, N] or None, any strides (copied once when the last
            stride is not 1).
        shift_mask: float additive [nW, N, N] (0 / -inf or timm's -100) or None (copied once
            when the last stride is not 1); window
            ``b`` reads ``shift_mask[b % nW]``.
        num_windows: nW (divides B*nW).
        cosine: Swin-v2 cosine attention (q, k L2-normalized, eps 1e-12, in the kernel).
        logit_scale: [H, 1, 1] or [H] (timm's parameter) when ``cosine``; the logits are
            multiplied by ``exp(min(logit_scale, log 100))``; None otherwise.
        scale: logit scale for non-cosine attention (ignored when ``cosine``).
        mode: a :mod:`visionattn.modes` name. ``pasa``: K is shifted by its window mean
            (PASA paper Eq. 11-12 with beta = 1) before the FP16-accumulated product;
            the window is one softmax block (or every key block gets the same shift), so
            the per-row shift cancels in the softmax and PASA's global recovery
            (Theorem 2.1, which needs beta < 1 to invert M) is not needed.
            FP32 modes: ``fp32`` multiplies in split FP16 (``"f16x3"``, FP32-accurate),
            ``tf32`` in ``"f16x1"`` (TF32-class), ``fp32-ieee`` in FP32 FMA (module docstring).
        config: optional launch override (see :func:`get_config`); used by the benchmark.
        precision: optional override of the FP32 modes' product precision, one of
            :data:`PRECISIONS` (``"f16x3"``, ``"f16x1"``, ``"tf32x3"``, ``"tf32"``, ``"ieee"``);
            used by ``tools/bench_window.py`` to compare them. None = the mode's own.
        with_lse: also return each row's log-sum-exp (the backward's saved state).
        normalized: with ``cosine``, q and k are L2-normalised already and used as given (see :func:`plan_for`).

    Returns:
        [B*nW, H, N, Dv] in q's dtype, a view of a contiguous [B*nW, N, H, Dv] buffer; with
        ``with_lse``, ``(out, lse)``, ``lse`` float32 [B*nW, H, N] =
        ``ln sum_j exp(c q_i.k_j + bias_ij + mask_ij)`` (``-inf`` for a row whose logits are all ``-inf``).

    Raises:
        ValueError: unknown ``mode``; ``precision`` not in :data:`PRECISIONS` or given for a
            half-precision mode; a ``config`` naming an unknown kernel or ``small`` with N > 128;
            ``with_lse`` in ``pasa`` / ``fp16-acc16`` (their scores are shifted / FP16-accumulated).
    """
    if config is None and precision is None:
        return window_forward(q, k, v, relative_position_bias, shift_mask, logit_scale, num_windows, cosine, scale,
                              mode, with_lse, normalized)
    if mode not in _MODE_TABLE:
        raise ValueError(f"mode={mode!r} has no window kernel; expected one of {list(_MODE_TABLE)}")
    _precision(mode, precision)  # validate before launching
    if logit_scale is not None:
        logit_scale = logit_scale.reshape(-1)
    # Every program reads whole bias / mask rows: with a non-unit last stride (e.g. timm's v2 bias
    # before its .contiguous()) each element costs a memory sector. One copy of these small [H, N, N] /
    # [nW, N, N] tensors per call is far cheaper (docs/tuning.md: strided window bias copied once per call).
    if relative_position_bias is not None and relative_position_bias.stride(-1) != 1:
        relative_position_bias = relative_position_bias.contiguous()
    if shift_mask is not None and shift_mask.stride(-1) != 1:
        shift_mask = shift_mask.contiguous()
    return _plan_and_run(q, k, v, relative_position_bias, shift_mask, logit_scale, int(num_windows), bool(cosine),
                         float(scale), mode, config, precision, bool(with_lse), bool(normalized))[1]
