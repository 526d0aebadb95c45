"""Dense ELSA backward: deterministic FlashAttention-2-style gradients from the saved log-sum-exp.

The forward (:mod:`.elsa_fwd`) folds the keys of each query row into the ELSA monoid state
``(m, S, W)`` and keeps only ``lse_i = m_i + log S_i`` (natural log), the log of the softmax
normalizer. That one number per row makes the probabilities exactly recomputable tile by tile:

    s_ij = scale * q_i . k_j + bias_ij        (-inf where masked / after the causal diagonal)
    P_ij = exp(s_ij - lse_i)

so the backward never stores the [Nq, Nk] matrix (FlashAttention-2, Alg. 2). With
``dO = grad_out`` and ``O = out``:

    delta_i = sum_d dO_id O_id                 (= sum_j P_ij dP_ij)
    dV_j    = sum_i P_ij dO_i
    dP_ij   = dO_i . v_j
    dS_ij   = P_ij (dP_ij - delta_i)          (= dL / ds_ij = dL / dbias_ij)
    dQ_i    = scale * sum_j dS_ij k_j
    dK_j    = scale * sum_i dS_ij q_i

Three kernels, every gradient bit-for-bit reproducible:

* :func:`_bwd_preprocess_kernel`: ``delta`` per row and a contiguous copy of ``lse`` with ``+inf`` for a row
  whose keys are all masked (``lse = -inf``): every ``exp(s - lse)`` of that row is then 0, so such rows
  give exactly zero gradients, never NaN.
* :func:`_bwd_dkdv_kernel`: one program per (key tile, head, batch) holds ``K_j, V_j`` and the ``dK_j, dV_j``
  accumulators and streams the query tiles (causal: from the diagonal on).
* :func:`_bwd_dq_kernel`: one program per (query tile, bias-gradient slot, chunk) holds ``Q_i, dO_i`` and the
  ``dQ_i`` accumulator and streams the key tiles (causal: up to the diagonal). It also writes ``dS`` when the
  bias needs a gradient (below).

**Whole head** (fp16 / bf16, at most :data:`HEAD_MAX_ROWS` query rows (256 and a 16-row tail) and
:data:`HEAD_MAX_KEYS` keys, head dims padding to :data:`HEAD_DIM`, no bias or logit-scale gradient, no grouped
heads, no explicit tiles): :func:`_bwd_head_kernel` alone, one program per (batch, head) holding every query row
and streaming the key tiles; each key tile's dK / dV is complete after its step (no other program adds to it),
``delta`` and the row lse are formed in the kernel: one launch, five tile products per key tile, every sum in a
fixed order.

**Single pass** (:attr:`BwdConfig.single_pass`; by default split-FP16 products at head dim 64 up to
:data:`SINGLE_PASS_MAX_KEYS` keys, where it measured faster): the dK/dV kernel also forms each query tile's
``dS K`` and adds it into an FP32 dQ accumulator, so no dQ kernel recomputes the scores (five tile products
per tile pair instead of seven). The adds into one query tile happen in key-tile order, handed on through a
counter per query tile (atomic adds, but in a fixed order, so the sums are still reproducible); key tile
``j`` waits only for key tile ``j - 1`` of its head, whose program id is lower, so the wait ends as long as
the GPU starts programs in id order (as CUTLASS's serial split-K reduction also assumes).

The logits are formed in natural units, exactly as the forward's contract defines them, and
``P = exp2((s - lse) log2 e)``: the argument is rounded relative to ``s - lse`` (small for the
probabilities that matter), not relative to ``s``, and the logits and ``lse`` share one rounded ``log2 e``,
so a rounded ``scale * log2 e`` cannot act as a slightly different temperature (that error dominated the
Swin-v2 logit-scale gradient).

**dBias** (``bias_requires_grad=True``): ``dBias = dS`` summed over every dimension the bias is broadcast
along. The bias view's batch / head dimensions with stride 0 (e.g. a relative position bias ``[H, Nq, Nk]``
expanded over the batch) are reduced inside the dQ kernel: a program owns one (query tile, output
batch / head slot) and loops over the batch / head entries that map onto it in a fixed order, adding each
entry's ``dS`` tile into its own rows of an FP32 buffer (read-modify-write by the one program that owns
those rows, so no atomics and a fixed summation order; when every key fits one tile, the entries' ``dS`` sum
stays in registers and is stored once). When that leaves too few programs to fill the GPU, the entries are
cut into ``G`` contiguous chunks, each writing a partial buffer, and the ``G`` partials are
summed by ``torch.sum`` (deterministic). Memory: ``G * prod(reduced shape)`` FP32, where the reduced
shape is the view's shape with its stride-0 batch / head dims set to 1 (``G = 1`` on CPU; on CUDA enough
chunks for ~4 programs per SM, with ``G`` > 1 only while the partials stay under :data:`BIAS_WORKSPACE_BYTES`);
``[B, H, Nq, Nk]`` is never materialised for such a bias. Query / key dims with stride 0 (e.g. a
key-padding bias ``[B, 1, 1, Nk]``) are computed in full, ``[.., Nq, Nk]`` FP32, and then summed by torch.

Modes (:mod:`visionattn.modes`; products by ``tl.dot``, accumulation and softmax algebra in FP32):

* ``fp32``: ``"f16x3"``, split-FP16 products (:mod:`.split16`: hi / lo FP16 parts of 11 significant bits each,
  as 3xTF32 keeps, on the FP16 tensor cores at twice TF32's rate, FP32 accumulation), the forward's
  arithmetic; the tile products of the accumulating dots are summed apart and then added, so long loops do
  not lose their low bits. A product's right operand is scaled per column, which for dQ = dS K, dK = dS^T Q
  and dV = P^T dO runs across tokens: tokens within ~2^20 of the largest keep the bound; one token 10^7-10^8
  times the others costs the rest accuracy (``fp32-ieee`` has no such span). ``"f16x3-head"`` (a products
  override) scales each right operand once per (batch, head) instead, as tf32 does: no per-tile column
  maxima or their transposes (offline sm_90, head dim 64: about a fifth fewer instructions); the span then
  counts from the head's largest entry, not each tile column's (one token 10^6 times the others: up to 9x the
  per-column scales' error, within the bound). On Hopper at head dims 64 and 128, in the Gluon kernel's scope and where
  :func:`.half_gluon_bwd.fp32_preferred` says, :func:`.half_gluon_bwd.fp32_backward` instead: that kernel's
  split-FP16 build (three wgmmas per product, each query tile's dK / dV products added in FP32).
* ``fp32-ieee``: FP32 FMA products, same accumulation: on CUDA, in scope (no bias / mask / causal, head dim 32,
  64 or 128, 16-byte-aligned rows), :mod:`.ieee_gluon_bwd` (Gluon, register-blocked FMA, single pass); else
  ``tl.dot``'s ``input_precision="ieee"`` here.
* ``tf32``: ``"f16x1"``, the hi parts alone (one FP16 product of operands rounded to 11 significant bits after
  the same power-of-two scaling, the right operand's per (batch, head)): its gradients err about as much as
  PyTorch's own TF32 backward. On Hopper, in the Gluon kernel's scope and where
  :func:`.half_gluon_bwd.tf32_preferred` says (its grid three waves of SMs or long sequences),
  :func:`.half_gluon_bwd.tf32_backward` instead: the fp16 / bf16 Gluon kernel on FP16 copies of q, k, v, dO scaled
  per (batch, head) by powers of two.
* ``fp16`` / ``bf16``: half operands (``P`` and ``dS`` rounded to the input dtype before their products, as
  FlashAttention-2 does), FP32 accumulation; on Hopper, in scope (no bias / mask / causal, head dim 64 or 128,
  TMA-legal strides; grouped-query attention included) and from :data:`.half_gluon_bwd.MIN_KEYS` keys and query
  rows, :mod:`.half_gluon_bwd` (Gluon, warp-specialized, FlashAttention-3's schedule, one pass with ordered dQ adds
  over several accumulators); else the two kernels here.

The same kernels serve the window op (:mod:`.window_bwd`): an additive mask indexed by ``batch mod n``
(Swin's shift mask), a logit scale per head (Swin-v2) and its gradient ``sum dS * q k^T``.

**Grouped-query / multi-query attention** (k / v [B, Hkv, Nk, D], Hkv dividing H; FlashAttention-2's GQA /
MQA, SDPA's ``enable_gqa``): query head ``h`` reads K / V head ``h // G``, G = H / Hkv, an integer division of the
program's head index (the kernels' ``GROUP`` argument; 1, the equal-heads case, is specialised to a constant).
``dK_j = scale * sum_(h in group) sum_i dS_hij q_hi`` (and dV) is reduced inside the dK / dV kernel: one program
per (key tile, K / V head, batch) streams the query tiles of the group's G query heads one head after another,
in head order, into the same registers (the fp16 / bf16 Gluon kernel of :mod:`.half_gluon_bwd` likewise, its dQ
turns per query head, the groups cut into parts with FP32 partials where its programs would leave SMs idle). Why
this rather than FlashAttention-2's [B, H, Nk, D] dK / dV partials summed afterwards: no O(H Nk D) buffer, no
second pass over it, and the sum order is fixed by the loop, so the gradients stay bit-for-bit reproducible without
atomics. The cost is G times fewer dK / dV programs, each G times
longer: B * Hkv * cdiv(Nk, BLOCK_N) programs can underfill the GPU for multi-query attention at small batch (to be
measured against SDPA on the GPU). The dQ kernel stays one program per query head. The preprocess reads K / V at
the query head's index, so with G > 1 it reads none of them, and per-head right-operand scales
(:data:`HEAD_SCALED`) take each K / V head's largest magnitude from torch (:func:`_gqa_kv_max`).

Public entry points: :func:`elsa_backward`, :func:`bias_grad_shape`, :func:`reduce_bias_grad`,
:func:`launch_backward` (validated inputs, window extras);
for tools and tuning :func:`get_config`, :class:`BwdConfig`, :class:`KernelTiles`.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import elsa_fwd, ieee_gluon_bwd
from ._launch import (SPIN_UNTIL_EQUAL_PTX, KernelCall, PlanCache, backward_operands, cdiv, head_blocks, interpreting,
                      pad_pow2, run_first_that_fits, sm_count, unit_last_stride)
from .elsa_fwd import key_tiles, load_kv_tile
from .modes import MODES
from .split16 import SPLIT_EXP, exponent, pow2, split_rows, split_scores

__all__ = ["elsa_backward", "backward_after_forward", "launch_backward", "bias_grad_shape", "autograd_bias",
           "reduce_bias_grad",
           "get_config", "BwdConfig", "SINGLE_PASS_MAX_KEYS", "HEAD_MAX_ROWS", "HEAD_MAX_KEYS", "HEAD_DIM",
           "head_tiles",
           "KernelTiles", "BWD_MODES", "MAX_HEAD_DIM", "BIAS_WORKSPACE_BYTES", "FP32_PRODUCTS", "BACKWARD_PRODUCTS",
           "fp32_products", "product_flags", "HEAD_SCALED"]

MAX_HEAD_DIM = 256
_SPIN_PTX = tl.constexpr(SPIN_UNTIL_EQUAL_PTX)
BIAS_WORKSPACE_BYTES = 256 << 20  # dBias partials beyond the first stay under this

# mode -> (compute dtype of q / k / v, tl.dot input_precision of the FP32 operands), from the one mode table;
# half operands take their native products (the precision argument does not apply to them)
BWD_MODES: dict[str, tuple[torch.dtype, str]] = {
    name: (m.compute_dtype, m.backward_precision or "tf32") for name, m in MODES.items() if "dense" in m.kernels}


# the FP32-accurate products an FP32 backward can run (f16x3: split-FP16, :mod:`.split16`; f16x3-head: the same
# with each right operand scaled per (batch, head); else tl.dot input precisions), then every products string it
# accepts: with the TF32-class ones, f16x1 (split-FP16, hi parts only) and "SCORES/GRADS" (the score-side
# products S, dP and the gradient products dV, dK, dQ apart)
FP32_PRODUCTS = ("f16x3", "f16x3-head", "tf32x3", "ieee")
BACKWARD_PRODUCTS = FP32_PRODUCTS + ("f16x3/f16x1", "f16x1")
# products whose right operands the dense and ragged-batch kernels scale by one power of two per (batch, head)
# (:func:`_mmh`, the heads' largest magnitudes from the preprocess), and the products they run; the fused window
# backward, which takes no per-head maxima, runs them with per-tile scales
HEAD_SCALED = {"f16x1": "f16x1", "f16x3-head": "f16x3"}


def fp32_products(mode: str, products: str | None) -> tuple[torch.dtype, str]:
    """``(compute dtype, products)`` of ``mode``'s backward: :data:`BWD_MODES`' entry, its products replaced by
    ``products`` for an FP32 mode when given.

    Raises:
        ValueError: ``products`` not in :data:`BACKWARD_PRODUCTS`.
    """
    dtype, precision = BWD_MODES[mode]
    if products is not None:
        if products not in BACKWARD_PRODUCTS:
            raise ValueError(f"products={products!r}; expected one of {list(BACKWARD_PRODUCTS)} or None")
        if dtype == torch.float32:
            precision = products
    return dtype, precision


def product_flags(precision: str) -> dict:
    """The kernels' ``PRECISION`` (the score-side products: the recomputed scores S and dP = dO V^T, whose
    difference from ``delta`` cancels) and ``GRAD_PRECISION`` (dV = P^T dO, dK = dS^T Q, dQ = dS K, which go
    to the gradients unamplified) of a products string ``"SCORES[/GRADS]"``."""
    scores, _, grads = HEAD_SCALED.get(precision, precision).partition("/")
    return dict(PRECISION=scores, GRAD_PRECISION=grads or scores)


# --------------------------------------------------------------------------- jit helpers

@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``a @ b`` in FP32. ``PRECISION="f16x3"`` / ``"f16x1"`` (FP32 operands): split-FP16 products
    (:mod:`.split16`; f16x1 the hi parts alone, TF32-class), ``a`` split per row and ``b`` per column, each
    scaled by a power of two into FP16's range and undone on the result's rows and columns; else ``tl.dot``'s
    ``input_precision``. DOT_UPCAST (interpreter only, whose bf16
    ``tl.dot`` is broken): the bf16 operands are multiplied in FP32, which is exact, as the tensor cores compute
    them."""
    if DOT_UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif PRECISION == "f16x3" or PRECISION == "f16x1":
        a_hi, a_lo, a_inv = split_rows(a)
        b_hi, b_lo, b_inv = split_rows(tl.trans(b))
        r = split_scores(a_hi, a_lo, b_hi, b_lo, PRECISION) * a_inv[:, None] * b_inv[None, :]
    else:
        r = tl.dot(a, b, input_precision=PRECISION)
    return r


@triton.jit
def _mm_acc(acc, a, b, PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``acc + a @ b``. FP32 operands: the tile product is formed apart and then added (an FMA dot or the
    3xTF32 terms accumulating into a large ``acc`` over thousands of tiles lose the low bits of each tile);
    half operands accumulate in the MMA. ``tl.dot``'s own FP32 precisions ("ieee", "tf32") start from
    ``acc * 0.0``, as the forward's tile fold does: from a constant zero the compiler folds
    ``dot(a, b, 0) + acc`` back into ``dot(a, b, acc)``, which rounds every product into the large sum."""
    if a.dtype == tl.float32 and not DOT_UPCAST and PRECISION != "f16x3" and PRECISION != "f16x1":
        acc += tl.dot(a, b, acc * 0.0, input_precision=PRECISION)
    elif a.dtype == tl.float32 or DOT_UPCAST:
        acc += _mm(a, b, PRECISION, DOT_UPCAST)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _mmh(a, b, b_exp, PRECISION: tl.constexpr, HEAD_B: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """:func:`_mm`, except that with HEAD_B (split-FP16 products, :data:`HEAD_SCALED`) ``b`` is scaled by one power
    of two for its whole (batch, head): ``b_exp``, the exponent of its largest magnitude (:func:`_head_exponents`),
    instead of per column of each tile, and the per-tile column maxima (a reduction across the tile's rows) and
    their transposes are not formed. The hi part keeps 11 significant bits for entries down to 2^-28 of that
    largest one; with f16x3 the lo part keeps its 11 for entries down to 2^-17, and the bits it loses below that
    are FP16-subnormal steps of 2^-38 of the largest: the per-column scales' span, counted from the head's largest
    entry instead of each tile column's."""
    if HEAD_B:
        a_hi, a_lo, a_inv = split_rows(a)
        bs = b * pow2(-b_exp + SPLIT_EXP)  # tensor first: constexpr - tensor fails to interpret
        b_hi = bs.to(tl.float16)
        if PRECISION == "f16x3":  # small terms first, as split_scores sums them
            r = tl.dot(a_lo, b_hi)
            r = tl.dot(a_hi, (bs - b_hi.to(tl.float32)).to(tl.float16), r)
            r = tl.dot(a_hi, b_hi, r)
        else:
            r = tl.dot(a_hi, b_hi)
        r = r * a_inv[:, None] * pow2(b_exp - SPLIT_EXP)
    else:
        r = _mm(a, b, PRECISION, DOT_UPCAST)
    return r


@triton.jit
def _mmh_acc(acc, a, b, b_exp, PRECISION: tl.constexpr, HEAD_B: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``acc + a @ b`` as :func:`_mmh` forms it (the tile product formed apart, as :func:`_mm_acc` does for
    FP32 operands)."""
    if HEAD_B:
        acc += _mmh(a, b, b_exp, PRECISION, HEAD_B, DOT_UPCAST)
    else:
        acc = _mm_acc(acc, a, b, PRECISION, DOT_UPCAST)
    return acc


@triton.jit
def _head_exponents(E, bh, HEAD_B: tl.constexpr):
    """``(e_q, e_k, e_v, e_do)``: the exponents of the largest magnitudes of head ``bh``'s q, k, v, dO, from
    their bit patterns in ``E`` (int32 [B * H, 4], :func:`_bwd_preprocess_kernel`); zeros without HEAD_B."""
    e_q = 0
    e_k = 0
    e_v = 0
    e_do = 0
    if HEAD_B:
        base = E + bh * 4
        e_q = exponent(tl.load(base).to(tl.float32, bitcast=True))
        e_k = exponent(tl.load(base + 1).to(tl.float32, bitcast=True))
        e_v = exponent(tl.load(base + 2).to(tl.float32, bitcast=True))
        e_do = exponent(tl.load(base + 3).to(tl.float32, bitcast=True))
    return e_q, e_k, e_v, e_do


@triton.jit
def _tile_and_head(n, BLOCK: tl.constexpr, H):
    """(tile, batch, head, batch * H + head) of this program in a 1-D grid of cdiv(n, BLOCK) * H * B programs."""
    tiles = tl.cdiv(n, BLOCK)
    pid = tl.program_id(0)
    bh = (pid // tiles).to(tl.int64)
    return pid % tiles, bh // H, bh % H, bh


@triton.jit
def _head_scale(HS, off_h, scale, HEAD_SCALE: tl.constexpr):
    """The logit scale of head ``off_h``: ``HS[off_h]`` when HEAD_SCALE, else ``scale``."""
    if HEAD_SCALE:
        scale = tl.load(HS + off_h)
    return scale


@triton.jit
def _bias_mask(s, b_ptrs, a_ptrs, m_ptrs, ok, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_MASK: tl.constexpr):
    """Logits ``s`` plus the bias and additive-mask tiles, ``-inf`` where the bool mask tile is False."""
    if HAS_BIAS:
        s += tl.load(b_ptrs, mask=ok, other=0.0).to(tl.float32)
    if HAS_ADD:
        s += tl.load(a_ptrs, mask=ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        s = tl.where(tl.load(m_ptrs, mask=ok, other=0) != 0, s, float("-inf"))
    return s


@triton.jit
def _dkdv_query_tiles(start_n, Nq, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """``(lo, mid, n_m)``: the query tiles the key tile at ``start_n`` streams. Causal: tiles before ``lo`` see
    none of its keys, ``[lo, mid)`` cross the diagonal (masked), ``[mid, n_m)`` see every key; else
    ``lo = mid = 0``."""
    n_m = tl.cdiv(Nq, BLOCK_M)
    lo = 0
    mid = 0
    if IS_CAUSAL:
        lo = start_n // BLOCK_M  # earlier query tiles see none of these keys
        mid = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M), n_m)  # tiles from here see every key here
        mid = tl.maximum(mid, lo)
    return lo, mid, n_m


@triton.jit
def _tile_absmax(ptrs, rows_ok, offs_c, n_c):
    """max |x| of a [rows, C] FP32-convertible tile (masked rows / columns read 0), as int32 bits."""
    x = tl.load(ptrs, mask=rows_ok[:, None] & (offs_c < n_c)[None, :], other=0.0)
    return tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0).to(tl.int32, bitcast=True)


# lengths are runtime values: a new one compiles nothing new
@triton.jit(do_not_specialize=["H", "Nq", "Nk", "n_zero"])
def _bwd_preprocess_kernel(Q, O, DO, LSE, Delta, LseRow,
                           sob, soh, som, sod, sdb, sdh, sdm, sdd, slb, slh, slm,
                           H, Nq, Dv, K, V, E, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, Nk, D,
                           Zero, n_zero, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_D: tl.constexpr,
                           HEAD_MAX: tl.constexpr, ZERO_BLOCK: tl.constexpr):
    """Per row: ``delta = sum_d dO * O`` (dO rounded to the compute dtype, as the other kernels read it) and
    ``lse`` (``+inf`` where ``lse = -inf``). Both FP32, contiguous [B * H, Nq].
    HEAD_MAX: also the largest magnitude of each head's q, dO (this program's query rows) and k, v (key tiles
    ``pid_m``, ``pid_m + cdiv(Nq, BLOCK_M)``, ...), atomically maxed as int32 bit patterns (order-free, so
    reproducible) into ``E`` [B * H, 4] (q, k, v, dO; zeroed by the caller).
    ZERO_BLOCK > 0: program ``p`` also zeroes the int32 ``Zero[p * ZERO_BLOCK : (p + 1) * ZERO_BLOCK]`` below
    ``n_zero`` (the Gluon backward's dQ turn counters, which the next launch on the stream reads: no memset of
    its own).
    1-D grid cdiv(Nq, BLOCK_M) * H * B."""
    if ZERO_BLOCK > 0:
        offs_z = tl.program_id(0) * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        tl.store(Zero + offs_z, tl.zeros([ZERO_BLOCK], dtype=tl.int32), mask=offs_z < n_zero)
    pid_m, off_b, off_h, bh = _tile_and_head(Nq, BLOCK_M, H)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r64 = rows.to(tl.int64)  # 64-bit row offsets: a million rows times a strided row overflow int32
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < Nq
    ok = row_ok[:, None] & (offs_dv < Dv)[None, :]
    o = tl.load(O + off_b * sob + off_h * soh + r64[:, None] * som + offs_dv[None, :] * sod, mask=ok, other=0.0)
    do = tl.load(DO + off_b * sdb + off_h * sdh + r64[:, None] * sdm + offs_dv[None, :] * sdd, mask=ok, other=0.0)
    do = do.to(Q.dtype.element_ty).to(tl.float32)  # Q: only its element type (the compute dtype) is read
    delta = tl.sum(o.to(tl.float32) * do, 1)
    lse = tl.load(LSE + off_b * slb + off_h * slh + r64 * slm, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    tl.store(Delta + bh * Nq + rows, delta, mask=row_ok)
    tl.store(LseRow + bh * Nq + rows, lse, mask=row_ok)
    if HEAD_MAX:
        offs_d = tl.arange(0, BLOCK_D)
        e_base = E + bh * 4
        tl.atomic_max(e_base + 3, tl.max(tl.max(tl.abs(do), 1), 0).to(tl.int32, bitcast=True))
        tl.atomic_max(e_base, _tile_absmax(Q + off_b * sqb + off_h * sqh + r64[:, None] * sqm + offs_d[None, :] * sqd,
                                           row_ok, offs_d, D))
        for t in range(pid_m, tl.cdiv(Nk, BLOCK_M), tl.cdiv(Nq, BLOCK_M)):
            keys = t * BLOCK_M + tl.arange(0, BLOCK_M)
            key_ok = keys < Nk
            k64 = keys.to(tl.int64)[:, None]
            tl.atomic_max(e_base + 1, _tile_absmax(K + off_b * skb + off_h * skh + k64 * skn
                                                   + offs_d[None, :] * skd, key_ok, offs_d, D))
            tl.atomic_max(e_base + 2, _tile_absmax(V + off_b * svb + off_h * svh + k64 * svn
                                                   + offs_dv[None, :] * svd, key_ok, offs_dv, Dv))


def preprocess_launch(B: int, H: int, Nq: int, block_d: int, block_dv: int, head_max: bool,
                      n_zero: int = 0) -> tuple[tuple[int], dict, dict]:
    """``(grid, constexprs, options)`` of :func:`_bwd_preprocess_kernel` over ``B * H`` heads of ``Nq`` rows: 64-row
    programs (32 when a head dim's block passes 128), ``HEAD_MAX`` as given, zeroing the ``n_zero`` int32 counters
    its last two arguments give (the counters and ``n_zero``; any tensor and 0 when there are none). Every backward
    launches it so: the dense plans and :mod:`.half_gluon_bwd` through :func:`_preprocess_call`, the varlen
    backward over its packed rows as one batch entry."""
    pre_m = 64 if max(block_d, block_dv) <= 128 else 32
    grid = cdiv(Nq, pre_m) * B * H
    zero_block = pad_pow2(cdiv(n_zero, grid)) if n_zero else 0
    return ((grid,), dict(BLOCK_M=pre_m, BLOCK_DV=block_dv, BLOCK_D=block_d, HEAD_MAX=head_max,
                          ZERO_BLOCK=zero_block), dict(num_warps=4))


def _preprocess_call(B: int, H: int, Nq: int, block_d: int, block_dv: int, head_max: bool,
                     n_zero: int = 0) -> KernelCall:
    """:func:`preprocess_launch`'s launch as a kept :class:`._launch.KernelCall`."""
    return KernelCall(_bwd_preprocess_kernel, *preprocess_launch(B, H, Nq, block_d, block_dv, head_max, n_zero))


class Scratch:
    """One backward call's FP32 scratch as one allocation: ``delta`` and the row lse (``rows = B * H * Nq`` each,
    which :func:`_bwd_preprocess_kernel` writes), the Gluon backward's int32 dQ turn counters (``counters``, which
    the preprocess zeroes) and its FP32 dQ accumulators (``accumulators``, never zeroed: each tile's first share is
    stored); each part starts at a multiple of :attr:`ALIGN` elements (TMA bases need 16 bytes). One allocation and
    no memset launch, since each allocation and launch costs host time in every eager backward."""

    ALIGN = 32  # elements: 128 bytes

    def __init__(self, rows: int, counters: int = 0, accumulators: int = 0):
        self.counters = counters
        self.sizes = [rows, -rows % self.ALIGN, rows, -rows % self.ALIGN, counters, -counters % self.ALIGN,
                      accumulators]

    def allocate(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(delta, lse_row, counters, accumulators)``: flat views of one new FP32 allocation (the counters
        int32), not initialised."""
        parts = torch.empty(sum(self.sizes), device=device, dtype=torch.float32).split(self.sizes)
        return parts[0], parts[2], parts[4].view(torch.int32), parts[6]


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, b_base, a_base, m_base, lse_base, delta_base, start_m, offs_m,
               offs_d, offs_dv, cols, col_ok, Nq, D, Dv, sqm, sqd, sdm, sdd, sbm, sbn, sam, san, smm, smn, scale,
               DIAGONAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_MASK: tl.constexpr,
               EVEN_D: tl.constexpr,
               EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, GRAD_PRECISION: tl.constexpr,
               DOT_UPCAST: tl.constexpr, e_q, e_do, HEAD_B: tl.constexpr):
    """Add the query tile at ``start_m`` to (dK, dV) of the key tile ``cols`` ([keys, queries] orientation).
    DIAGONAL tiles (causal) mask the queries before each key. Returns ``(dk, dv, dS^T)``: the tile's FP32
    [BLOCK_N, BLOCK_M] dS, for a caller that also forms dQ from it."""
    rows = start_m + offs_m
    row_ok = rows < Nq
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    q = load_kv_tile(q_base + rows64[:, None] * sqm + offs_d[None, :] * sqd, row_ok, offs_d, D, True, EVEN_D)
    do = load_kv_tile(do_base + rows64[:, None] * sdm + offs_dv[None, :] * sdd, row_ok, offs_dv, Dv, True, EVEN_DV)
    do = do.to(q.dtype)
    lse = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
    st = _mmh(k, tl.trans(q), e_q, PRECISION, HEAD_B, DOT_UPCAST) * scale  # [BLOCK_N, BLOCK_M]
    st = _bias_mask(st, b_base + cols64[:, None] * sbn + rows64[None, :] * sbm,
                    a_base + cols64[:, None] * san + rows64[None, :] * sam,
                    m_base + cols64[:, None] * smn + rows64[None, :] * smm, col_ok[:, None] & row_ok[None, :],
                    HAS_BIAS, HAS_ADD, HAS_MASK)
    if DIAGONAL:
        st = tl.where(cols[:, None] <= rows[None, :], st, float("-inf"))
    pt = tl.math.exp2((st - lse[None, :]) * 1.4426950408889634)
    dv = _mmh_acc(dv, pt.to(q.dtype), do, e_do, GRAD_PRECISION, HEAD_B, DOT_UPCAST)
    dpt = _mmh(v, tl.trans(do), e_do, PRECISION, HEAD_B, DOT_UPCAST)
    dst = pt * (dpt - delta[None, :])
    dk = _mmh_acc(dk, dst.to(q.dtype), q, e_q, GRAD_PRECISION, HEAD_B, DOT_UPCAST)
    return dk, dv, dst


@triton.jit
def _wait_turn(sem_ptr, seen, turn, SPIN_ASM: tl.constexpr):
    """Return once the int32 counter at ``sem_ptr`` equals ``turn``; ``seen`` is a value read from it earlier
    (at the start of the step, so that in the steady state, where the turn has already come, no read waits
    here). SPIN_ASM: a PTX loop re-reads it, which keeps the caller's loop free of a nested loop (Triton's
    software pipeliner then still pipelines it); else a Triton ``while`` (the interpreter, which runs programs
    one after another, so the counter is already there)."""
    if SPIN_ASM:
        tl.inline_asm_elementwise(_SPIN_PTX, "=r,r,l,r", [seen, sem_ptr, turn], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        while tl.atomic_add(sem_ptr, 0, sem="acquire") != turn:
            pass


@triton.jit
def _dq_ordered_add(part, DQ, DQACC, sem_ptr, seen, dq_base, sgqm, start_m, offs_m, offs_d, turn, n_n, Nq, D,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, ACC_IS_OUT: tl.constexpr,
                    SPIN_ASM: tl.constexpr):
    """Add a key tile's share of dQ for the query tile at ``start_m``, ``part = scale * dS K`` [rows, BLOCK_D],
    into the FP32 accumulator ``DQACC`` in a fixed order of the key tiles: the query tile's counter ``sem_ptr``
    holds how many key tiles have added (``seen``: its value read at the start of the step); this one waits for
    its ``turn`` (0 .. n_n - 1), adds, and passes the turn on. The order, not the timing, fixes every sum, so dQ
    is bit-for-bit reproducible. The query tile's last turn (``n_n - 1``; causal: the last key tile whose keys
    reach these queries) also writes dQ in DQ's dtype unless ACC_IS_OUT (FP32 dQ accumulates in place)."""
    rows = start_m + offs_m
    ok = (rows < Nq)[:, None] & (offs_d < D)[None, :]
    offs = dq_base + rows.to(tl.int64)[:, None] * D + offs_d[None, :]
    _wait_turn(sem_ptr, seen, turn, SPIN_ASM)
    old = tl.atomic_add(DQACC + offs, part, mask=ok, sem="relaxed")
    if not ACC_IS_OUT:
        last = n_n - 1
        if IS_CAUSAL:
            last = tl.minimum(last, (start_m + BLOCK_M - 1) // BLOCK_N)
        if turn == last:
            tl.store(DQ + rows.to(tl.int64)[:, None] * sgqm + offs_d[None, :], (old + part).to(DQ.dtype.element_ty),
                     mask=ok)
    tl.debug_barrier()  # every thread's add is issued before the turn passes (the release orders them)
    tl.atomic_xchg(sem_ptr, turn + 1, sem="release")


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, b_base, a_base, m_base, lse_base, delta_base, DQ, DQACC, sem_base,
               dq_base, sgqm, t, offs_m, offs_d, offs_dv, cols, col_ok, turn, n_n, Nq, D, Dv, sqm, sqd, sdm, sdd, sbm,
               sbn, sam, san, smm, smn, scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_ADD: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
               EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, GRAD_PRECISION: tl.constexpr,
               DOT_UPCAST: tl.constexpr, DQ_ORDERED: tl.constexpr, ACC_IS_OUT: tl.constexpr,
               SPIN_ASM: tl.constexpr, e_q, e_k, e_do, HEAD_B: tl.constexpr):
    """Query tile ``t`` (rows ``t * BLOCK_M + offs_m``; ``offs_m`` may be narrower than BLOCK_M) into this key
    tile's (dK, dV) and, when DQ_ORDERED, its ``dS K`` into dQ at its ``turn``. Returns ``(dk, dv)``."""
    if DQ_ORDERED:
        seen = tl.load(sem_base + t, volatile=True)
    dk, dv, dst = _dkdv_tile(dk, dv, k, v, q_base, do_base, b_base, a_base, m_base, lse_base, delta_base,
                             t * BLOCK_M, offs_m, offs_d, offs_dv, cols, col_ok, Nq, D, Dv, sqm, sqd, sdm, sdd, sbm,
                             sbn, sam, san, smm, smn, scale, DIAGONAL, HAS_BIAS, HAS_ADD, HAS_MASK, EVEN_D, EVEN_DV,
                             PRECISION, GRAD_PRECISION, DOT_UPCAST, e_q, e_do, HEAD_B)
    if DQ_ORDERED:
        # keys past Nk (zero rows of K, logit 0) carry P = exp(-lse): past FP32's range for lse < -88 (a row whose
        # every key lies far below zero, e.g. under an additive mask), where inf * 0 in dS K would poison the row,
        # and short of it their large dS would set the row's split scale; keys past Nk add nothing to dQ
        dst = tl.where(col_ok[:, None], dst, 0.0)
        part = _mmh(tl.trans(dst.to(k.dtype)), k, e_k, GRAD_PRECISION, HEAD_B, DOT_UPCAST) * scale  # [rows, D]
        _dq_ordered_add(part, DQ, DQACC, sem_base + t, seen, dq_base, sgqm, t * BLOCK_M, offs_m, offs_d, turn, n_n,
                        Nq, D, BLOCK_M, BLOCK_N, IS_CAUSAL, ACC_IS_OUT, SPIN_ASM)
    return dk, dv


@triton.jit
def _dkdv_keys(Q, K, V, DO, Bias, Add, Mask, HS, Delta, LseRow, DK, DV, DQ, DQACC, Sem, E,
               sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
               sbb, sbh, sbm, sbn, saw, sam, san, smb, smh, smm, smn, sgqb, sgqh, sgqm, sgkb, sgkh, sgkn, sgvb, sgvh,
               sgvn, H, Nq, Nk, D, Dv, scale, n_add, GROUP, pid_n, turn, off_b, off_hk, bhk,
               KEYS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, TAIL: tl.constexpr,
               PRECISION: tl.constexpr, GRAD_PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_MASK: tl.constexpr, HEAD_SCALE: tl.constexpr,
               EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_UPCAST: tl.constexpr,
               DQ_ORDERED: tl.constexpr, ACC_IS_OUT: tl.constexpr, SPIN_ASM: tl.constexpr, HEAD_B: tl.constexpr):
    """The body of :func:`_bwd_dkdv_kernel` for key tile ``pid_n`` of K / V head ``off_hk`` held ``KEYS`` rows
    tall (BLOCK_N, or TAIL for a last key tile whose keys fit it). Query tiles are BLOCK_M rows; with TAIL, a last
    query tile whose rows fit TAIL runs TAIL rows tall. The ``GROUP`` query heads ``off_hk * GROUP + g`` that read
    this K / V head stream through one after another, g = 0, 1, ..., into the same (dK, dV) registers: the sum
    over the group has a fixed order. The logit scale and the K / V exponents are the group's first head's
    (HEAD_SCALE, the window op's per-head scale, runs with GROUP = 1)."""
    start_n = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = start_n + tl.arange(0, KEYS)
    col_ok = cols < Nk
    k = load_kv_tile(K + off_b * skb + off_hk * skh + cols[:, None].to(tl.int64) * skn + offs_d[None, :] * skd,
                     col_ok, offs_d, D, True, EVEN_D)
    v = load_kv_tile(V + off_b * svb + off_hk * svh + cols[:, None].to(tl.int64) * svn + offs_dv[None, :] * svd,
                     col_ok, offs_dv, Dv, True, EVEN_DV)
    dk = tl.zeros([KEYS, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([KEYS, BLOCK_DV], dtype=tl.float32)
    scale = _head_scale(HS, off_hk * GROUP, scale, HEAD_SCALE)

    # the query tiles use BLOCK_N, not KEYS: a narrow last key tile then counts a few more tiles as diagonal
    # (masked per element anyway), and the ordered dQ's "last key tile" of a query tile stays the same
    lo, mid, n_m = _dkdv_query_tiles(start_n, Nq, BLOCK_M, BLOCK_N, IS_CAUSAL)
    n_full = n_m
    if TAIL > 0 and TAIL < BLOCK_M:
        if Nq - (n_m - 1) * BLOCK_M <= TAIL:
            n_full = n_m - 1
    n_n = tl.cdiv(Nk, BLOCK_N)
    for g in range(0, GROUP):  # the group's query heads in order (GROUP = 1 is a constant: no loop)
        off_h = off_hk * GROUP + g
        bh = bhk * GROUP + g  # = off_b * H + off_h
        q_base = Q + off_b * sqb + off_h * sqh
        do_base = DO + off_b * sdb + off_h * sdh
        row_base = bh * Nq
        b_base = Bias + off_b * sbb + off_h * sbh
        m_base = Mask + off_b * smb + off_h * smh
        a_base = Add + (off_b % n_add) * saw
        e_q, e_k, e_v, e_do = _head_exponents(E, bh, HEAD_B)
        sem_base = Sem + bh * n_m
        dq_base = bh * Nq * D
        dq_out = DQ + off_b * sgqb + off_h * sgqh  # dQ's rows in its own layout (the accumulator is contiguous)
        lse_base = LseRow + row_base
        delta_base = Delta + row_base
        for phase in tl.static_range(2):  # causal diagonal tiles [lo, mid) with the mask, then [mid, n_m) without
            if phase == 0:
                t_lo, t_hi = lo, tl.minimum(mid, n_full)
            else:
                t_lo, t_hi = mid, n_full
            for t in range(t_lo, t_hi):
                dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, b_base, a_base, m_base, lse_base, delta_base,
                                    dq_out, DQACC, sem_base, dq_base, sgqm, t, offs_m, offs_d, offs_dv, cols, col_ok,
                                    turn, n_n, Nq, D, Dv, sqm, sqd, sdm, sdd, sbm, sbn, sam, san, smm, smn, scale,
                                    BLOCK_M, BLOCK_N, phase == 0, HAS_BIAS, HAS_ADD, HAS_MASK, IS_CAUSAL, EVEN_D,
                                    EVEN_DV, PRECISION, GRAD_PRECISION, DOT_UPCAST, DQ_ORDERED, ACC_IS_OUT, SPIN_ASM,
                                    e_q, e_k, e_do, HEAD_B)
        if TAIL > 0 and TAIL < BLOCK_M:
            t = n_m - 1
            if n_full < n_m and t >= lo:  # the last query tile, TAIL rows tall; causal: masked per element
                dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, b_base, a_base, m_base, lse_base, delta_base,
                                    dq_out, DQACC, sem_base, dq_base, sgqm, t, tl.arange(0, TAIL), offs_d, offs_dv,
                                    cols, col_ok, turn, n_n, Nq, D, Dv, sqm, sqd, sdm, sdd, sbm, sbn, sam, san, smm,
                                    smn, scale, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_BIAS, HAS_ADD, HAS_MASK, IS_CAUSAL,
                                    EVEN_D, EVEN_DV, PRECISION, GRAD_PRECISION, DOT_UPCAST, DQ_ORDERED, ACC_IS_OUT,
                                    SPIN_ASM, e_q, e_k, e_do, HEAD_B)
    dk = dk * scale
    out_ok = col_ok[:, None]
    dk_ptrs = DK + off_b * sgkb + off_hk * sgkh + cols[:, None].to(tl.int64) * sgkn + offs_d[None, :]
    dv_ptrs = DV + off_b * sgvb + off_hk * sgvh + cols[:, None].to(tl.int64) * sgvn + offs_dv[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=out_ok & (offs_d < D)[None, :])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=out_ok & (offs_dv < Dv)[None, :])


@triton.jit(do_not_specialize=["H", "Nq", "Nk", "n_add"])
def _bwd_dkdv_kernel(Q, K, V, DO, Bias, Add, Mask, HS, Delta, LseRow, DK, DV, DQ, DQACC, Sem, E,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                     sbb, sbh, sbm, sbn, saw, sam, san, smb, smh, smm, smn,
                     sgqb, sgqh, sgqm, sgkb, sgkh, sgkn, sgvb, sgvh, sgvn, H, Nq, Nk, D, Dv, scale, n_add, GROUP,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_ADD: tl.constexpr, HAS_MASK: tl.constexpr, HEAD_SCALE: tl.constexpr,
                     EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_UPCAST: tl.constexpr,
                     DQ_ORDERED: tl.constexpr, ACC_IS_OUT: tl.constexpr, SPIN_ASM: tl.constexpr,
                     GRAD_PRECISION: tl.constexpr, TAIL: tl.constexpr, HEAD_B: tl.constexpr):
    """dK, dV of one key tile: ``dV_j = sum_i P_ij dO_i``, ``dK_j = scale * sum_i dS_ij q_i`` over the query tiles.

    Works in the transposed orientation ([keys, queries] tiles) so both accumulators are row blocks.
    1-D grid cdiv(Nk, BLOCK_N) * Hkv * B; outputs [B, Hkv, Nk, D | Dv] in the input dtype through their (batch,
    head, row) strides ``sgk*`` / ``sgv*`` (``sgq*``: dQ's, for the ordered adds), unit stride in the last dim.

    GROUP = H / Hkv (grouped-query / multi-query attention, FlashAttention-2's GQA / MQA): a program owns a key
    tile of K / V head ``hk`` and streams the query tiles of query heads ``hk * GROUP .. hk * GROUP + GROUP - 1``
    in that order, so ``dK_j = scale * sum_h sum_i dS_hij q_hi`` (and dV) is reduced over the group in registers,
    in a fixed order (reproducible), with no [B, H, Nk, D] partial buffer and no atomics. GROUP = 1 (a constant
    after Triton's specialisation of ints equal to 1) is the equal-heads kernel.
    Keys >= Nk are not masked: they only reach their own (unstored) rows of dK / dV. Queries >= Nq read
    ``lse = +inf`` and dO = 0, so their P and dS are 0.

    TAIL (0 = off): a last key tile whose keys fit TAIL rows, and a last query tile whose rows do, run TAIL
    rows tall instead of BLOCK_N / BLOCK_M (ViT-B/16's 197 tokens: 5 keys in a 64-key tile would cost a full
    tile's products). Runtime branches pick the width, so a new length compiles nothing new.

    DQ_ORDERED (the single-pass backward): each query tile's ``dS K`` also goes into dQ through
    :func:`_dq_ordered_add` (DQACC: FP32 [B, H, Nq, D], zeroed; Sem: int32 [B * H, cdiv(Nq, BLOCK_M)], zeroed),
    so no dQ kernel recomputes the scores: five tile products per (query, key) tile pair instead of seven. The
    program of turn j of a K / V head waits only for turn j - 1 of the same K / V head, whose program id is the one
    before (turns run in program-id order within a head; with GQA both walk the group's query heads in the same
    order), so the wait ends as long as the GPU starts programs in id order. Without a causal mask the turns run
    from the last key tile down to the first: a narrow last tile (TAIL) then adds first at every query tile and,
    waiting for no one, frees its SM slot after a fraction of a full tile's time, instead of waiting out the full
    tiles' pace to the end; causal keeps the key order, in which the key tiles that reach a query tile are the
    first turns.
    """
    turn, off_b, off_hk, bhk = _tile_and_head(Nk, BLOCK_N, H // GROUP)
    pid_n = turn
    if DQ_ORDERED:
        if not IS_CAUSAL:  # the last (possibly narrow) key tile takes the first turn (the kernel docstring)
            pid_n = tl.cdiv(Nk, BLOCK_N) - 1 - turn
    if TAIL > 0 and TAIL < BLOCK_N:
        if pid_n * BLOCK_N + TAIL >= Nk:  # the last key tile, its keys within TAIL rows
            _dkdv_keys(Q, K, V, DO, Bias, Add, Mask, HS, Delta, LseRow, DK, DV, DQ, DQACC, Sem, E, sqb, sqh, sqm, sqd,
                       skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd, sbb, sbh, sbm, sbn, saw, sam, san,
                       smb, smh, smm, smn, sgqb, sgqh, sgqm, sgkb, sgkh, sgkn, sgvb, sgvh, sgvn, H, Nq, Nk, D, Dv,
                       scale, n_add, GROUP, pid_n, turn, off_b, off_hk, bhk, TAIL, BLOCK_M,
                       BLOCK_N, BLOCK_D, BLOCK_DV, TAIL, PRECISION, GRAD_PRECISION, IS_CAUSAL, HAS_BIAS, HAS_ADD,
                       HAS_MASK, HEAD_SCALE, EVEN_D, EVEN_DV, DOT_UPCAST, DQ_ORDERED, ACC_IS_OUT, SPIN_ASM, HEAD_B)
        else:
            _dkdv_keys(Q, K, V, DO, Bias, Add, Mask, HS, Delta, LseRow, DK, DV, DQ, DQACC, Sem, E, sqb, sqh, sqm, sqd,
                       skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd, sbb, sbh, sbm, sbn, saw, sam, san,
                       smb, smh, smm, smn, sgqb, sgqh, sgqm, sgkb, sgkh, sgkn, sgvb, sgvh, sgvn, H, Nq, Nk, D, Dv,
                       scale, n_add, GROUP, pid_n, turn, off_b, off_hk, bhk, BLOCK_N,
                       BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, TAIL, PRECISION, GRAD_PRECISION, IS_CAUSAL, HAS_BIAS,
                       HAS_ADD, HAS_MASK, HEAD_SCALE, EVEN_D, EVEN_DV, DOT_UPCAST, DQ_ORDERED, ACC_IS_OUT, SPIN_ASM,
                       HEAD_B)
    else:
        _dkdv_keys(Q, K, V, DO, Bias, Add, Mask, HS, Delta, LseRow, DK, DV, DQ, DQACC, Sem, E, sqb, sqh, sqm, sqd, skb,
                   skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd, sbb, sbh, sbm, sbn, saw, sam, san, smb, smh,
                   smm, smn, sgqb, sgqh, sgqm, sgkb, sgkh, sgkn, sgvb, sgvh, sgvn, H, Nq, Nk, D, Dv, scale, n_add,
                   GROUP, pid_n, turn, off_b, off_hk, bhk, BLOCK_N, BLOCK_M, BLOCK_N,
                   BLOCK_D, BLOCK_DV, TAIL, PRECISION, GRAD_PRECISION, IS_CAUSAL, HAS_BIAS, HAS_ADD, HAS_MASK,
                   HEAD_SCALE, EVEN_D, EVEN_DV, DOT_UPCAST, DQ_ORDERED, ACC_IS_OUT, SPIN_ASM, HEAD_B)


@triton.jit
def _tile_scores(q, do, lse, delta, k, v, rows, row_ok, cols, col_ok, b_base, a_base, m_base, sbm, sbn, sam, san, smm,
                 smn, scale, e_k, e_v, BOUNDARY: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_ADD: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, HEAD_B: tl.constexpr,
                 DOT_UPCAST: tl.constexpr):
    """``(qk, P, dS)`` in FP32 of query ``rows`` against the key tile ``cols`` ([rows, keys]; ``qk = q k^T``,
    unscaled): the logits ``scale * qk`` plus the bias and additive-mask tiles, ``-inf`` where the bool mask drops
    a key and, in BOUNDARY tiles, for keys >= Nk and (causal) keys after the query; ``P = exp(s - lse)``,
    ``dS = P (dO v^T - delta)``. Products as :func:`_mmh` forms them (``e_k``, ``e_v``: the K / V exponents with
    HEAD_B)."""
    qk = _mmh(q, tl.trans(k), e_k, PRECISION, HEAD_B, DOT_UPCAST)
    s = qk * scale
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    s = _bias_mask(s, b_base + rows64[:, None] * sbm + cols64[None, :] * sbn,
                   a_base + rows64[:, None] * sam + cols64[None, :] * san,
                   m_base + rows64[:, None] * smm + cols64[None, :] * smn, row_ok[:, None] & col_ok[None, :],
                   HAS_BIAS, HAS_ADD, HAS_MASK)
    if BOUNDARY:
        valid = col_ok[None, :]
        if IS_CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        s = tl.where(valid, s, float("-inf"))
    p = tl.math.exp2((s - lse[:, None]) * 1.4426950408889634)
    dp = _mmh(do, tl.trans(v), e_v, PRECISION, HEAD_B, DOT_UPCAST)
    return qk, p, p * (dp - delta[:, None])


@triton.jit
def _dq_tile(dq, hs_a, hs_z, hs_w, hs_p, q, do, lse, delta, k_base, v_base, b_base, a_base, m_base, db_base,
             start_n, rows, row_ok, offs_n, offs_d, offs_dv, Nk, D, Dv, skn, skd, svn, svd, sbm, sbn, sam, san, smm,
             smn, db_old, scale,
             BOUNDARY: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr,
             HAS_MASK: tl.constexpr, WRITE_DB: tl.constexpr, WRITE_DHS: tl.constexpr, EVEN_D: tl.constexpr,
             EVEN_DV: tl.constexpr, PRECISION: tl.constexpr, GRAD_PRECISION: tl.constexpr,
             DOT_UPCAST: tl.constexpr, e_k, e_v, HEAD_B: tl.constexpr):
    """``dq + dS K`` for the key tile at ``start_n`` (``scale`` applied by the caller); writes dS into the dBias
    buffer when WRITE_DB (added to what is there when ``db_old``). BOUNDARY tiles mask keys >= Nk and (causal)
    keys after the query; interior tiles skip both. Also returns the tile's dS (zero outside the valid rows and
    keys) for a caller that sums it in registers instead.

    WRITE_DHS: adds this tile's row sums of dS * qk, dS, P * qk and P (qk = q k^T, unscaled) to ``hs_a``,
    ``hs_z``, ``hs_w``, ``hs_p``. Exactly, sum_j dS_ij = 0; the P recomputed from the saved lse and the
    delta from the saved output break that by rounding, and a row's error along P, times the row's mean qk,
    would dominate the head-scale gradient (cancelling sum). :func:`_head_scale_grad` projects it out."""
    cols = start_n + offs_n
    col_ok = cols < Nk
    cols64 = cols.to(tl.int64)
    k = load_kv_tile(k_base + cols64[:, None] * skn + offs_d[None, :] * skd, col_ok, offs_d, D, BOUNDARY, EVEN_D)
    v = load_kv_tile(v_base + cols64[:, None] * svn + offs_dv[None, :] * svd, col_ok, offs_dv, Dv, BOUNDARY, EVEN_DV)
    qk, p, ds = _tile_scores(q, do, lse, delta, k, v, rows, row_ok, cols, col_ok, b_base, a_base, m_base, sbm, sbn,
                             sam, san, smm, smn, scale, e_k, e_v, BOUNDARY, IS_CAUSAL, HAS_BIAS, HAS_ADD, HAS_MASK,
                             PRECISION, HEAD_B, DOT_UPCAST)
    dq = _mmh_acc(dq, ds.to(q.dtype), k, e_k, GRAD_PRECISION, HEAD_B, DOT_UPCAST)
    if WRITE_DHS:
        hs_a += tl.sum(ds * qk, 1)
        hs_z += tl.sum(ds, 1)
        hs_w += tl.sum(p * qk, 1)
        hs_p += tl.sum(p, 1)
    if WRITE_DB:
        ok = row_ok[:, None] & col_ok[None, :]
        db_ptrs = db_base + rows.to(tl.int64)[:, None] * Nk + cols64[None, :]
        old = tl.load(db_ptrs, mask=ok & db_old, other=0.0)
        tl.store(db_ptrs, old + ds, mask=ok)
    return dq, hs_a, hs_z, hs_w, hs_p, ds


@triton.jit
def _head_scale_grad(a, z, w, p):
    """sum_i (a_i - z_i w_i / p_i) / p_i: the rows' sum_j dS_ij qk_ij after removing each row's dS component
    along P (z_i / p_i times P_i, which sums to z_i and would add z_i * w_i / p_i), and with P renormalised to
    sum 1 (the rounded lse scales a whole row of P by 1 + O(|lse| u)); rows without keys give 0."""
    p_safe = tl.where(p > 0.0, p, 1.0)
    return tl.sum((a - z * w / p_safe) / p_safe, 0)


@triton.jit(do_not_specialize=["H", "Nq", "Nk", "n_add", "B_OUT", "H_OUT", "R_H", "n_red", "per_chunk"])
def _bwd_dq_kernel(Q, K, V, DO, Bias, Add, Mask, HS, Delta, LseRow, DQ, DB, DHS, E,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                   sbb, sbh, sbm, sbn, saw, sam, san, smb, smh, smm, smn, sgqb, sgqh, sgqm,
                   H, Nq, Nk, D, Dv, scale0, n_add, B_OUT, H_OUT, R_H, n_red, per_chunk, GROUP,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_ADD: tl.constexpr, HAS_MASK: tl.constexpr, HEAD_SCALE: tl.constexpr, WRITE_DB: tl.constexpr,
                   WRITE_DHS: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_UPCAST: tl.constexpr,
                   DB_IN_REGS: tl.constexpr, GRAD_PRECISION: tl.constexpr, HEAD_B: tl.constexpr):
    """dQ of one query tile (``dQ_i = scale * sum_j dS_ij k_j``) for each (batch, head) entry of its slot.

    1-D grid cdiv(Nq, BLOCK_M) * B_OUT * H_OUT * G. A slot (b_out, h_out) is one entry of the dBias buffer
    [G, B_OUT, H_OUT, Nq, Nk]; the n_red = R_B * R_H (batch, head) entries reduced onto it (R_B = B when the
    bias is broadcast over the batch, else 1; R_H likewise) are cut into G chunks of ``per_chunk``; this
    program runs chunk g's entries in order, each writing its dQ rows and adding its dS into the slot's
    partial (the first entry stores). Without WRITE_DB: B_OUT = B, H_OUT = H, n_red = G = 1.
    WRITE_DHS: the entry's ``sum(dS * q k^T)`` over this query tile (the gradient of its head's logit scale,
    HEAD_SCALE) goes to ``DHS[b * H + h, tile]``.
    DB_IN_REGS (WRITE_DB with every key in one tile, Nk <= BLOCK_N: Swin's 49- and 64-token windows): the
    chunk's dS sum stays in registers and is stored once, instead of a read-modify-write of the partial and a
    barrier per entry, which serialise the chunk through memory.
    GROUP = H / Hkv: query head ``h`` reads K / V head ``h // GROUP`` (grouped-query / multi-query attention).
    """
    tiles = tl.cdiv(Nq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % tiles
    rest = pid // tiles
    n_slots = B_OUT * H_OUT
    slot = rest % n_slots
    g = rest // n_slots
    b_out = slot // H_OUT
    h_out = slot % H_OUT
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    row_ok = rows < Nq
    rows64 = rows.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    db_base = DB + ((g * B_OUT + b_out) * H_OUT + h_out).to(tl.int64) * Nq * Nk

    n_full, n_tiles = key_tiles(start_m, Nk, BLOCK_M, BLOCK_N, IS_CAUSAL)

    r_lo = g * per_chunk
    r_hi = tl.minimum(r_lo + per_chunk, n_red)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(r_lo, r_hi):
        off_b = (b_out + r // R_H).to(tl.int64)
        off_h = (h_out + r % R_H).to(tl.int64)
        bh = off_b * H + off_h
        q = load_kv_tile(Q + off_b * sqb + off_h * sqh + rows64[:, None] * sqm + offs_d[None, :] * sqd,
                         row_ok, offs_d, D, True, EVEN_D)
        do = load_kv_tile(DO + off_b * sdb + off_h * sdh + rows64[:, None] * sdm + offs_dv[None, :] * sdd,
                          row_ok, offs_dv, Dv, True, EVEN_DV).to(q.dtype)
        lse = tl.load(LseRow + bh * Nq + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(Delta + bh * Nq + rows, mask=row_ok, other=0.0)
        k_base = K + off_b * skb + (off_h // GROUP) * skh
        v_base = V + off_b * svb + (off_h // GROUP) * svh
        b_base = Bias + off_b * sbb + off_h * sbh
        m_base = Mask + off_b * smb + off_h * smh
        a_base = Add + (off_b % n_add) * saw
        scale = _head_scale(HS, off_h, scale0, HEAD_SCALE)
        e_q, e_k, e_v, e_do = _head_exponents(E, bh, HEAD_B)
        db_old = r > r_lo
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        hs_a = tl.zeros([BLOCK_M], dtype=tl.float32)
        hs_z = tl.zeros([BLOCK_M], dtype=tl.float32)
        hs_w = tl.zeros([BLOCK_M], dtype=tl.float32)
        hs_p = tl.zeros([BLOCK_M], dtype=tl.float32)
        for t in range(0, n_full):
            dq, hs_a, hs_z, hs_w, hs_p, ds = _dq_tile(
                dq, hs_a, hs_z, hs_w, hs_p, q, do, lse, delta, k_base, v_base, b_base, a_base, m_base, db_base,
                t * BLOCK_N, rows, row_ok, offs_n, offs_d, offs_dv, Nk, D, Dv, skn, skd, svn, svd, sbm, sbn, sam,
                san, smm, smn, db_old, scale, False, IS_CAUSAL, HAS_BIAS, HAS_ADD, HAS_MASK,
                WRITE_DB and not DB_IN_REGS, WRITE_DHS, EVEN_D, EVEN_DV, PRECISION, GRAD_PRECISION, DOT_UPCAST, e_k,
                e_v, HEAD_B)
            if DB_IN_REGS:
                db_acc += ds
        for t in range(n_full, n_tiles):
            dq, hs_a, hs_z, hs_w, hs_p, ds = _dq_tile(
                dq, hs_a, hs_z, hs_w, hs_p, q, do, lse, delta, k_base, v_base, b_base, a_base, m_base, db_base,
                t * BLOCK_N, rows, row_ok, offs_n, offs_d, offs_dv, Nk, D, Dv, skn, skd, svn, svd, sbm, sbn, sam,
                san, smm, smn, db_old, scale, True, IS_CAUSAL, HAS_BIAS, HAS_ADD, HAS_MASK,
                WRITE_DB and not DB_IN_REGS, WRITE_DHS, EVEN_D, EVEN_DV, PRECISION, GRAD_PRECISION, DOT_UPCAST, e_k,
                e_v, HEAD_B)
            if DB_IN_REGS:
                db_acc += ds
        dq = dq * scale
        dq_ptrs = DQ + off_b * sgqb + off_h * sgqh + rows64[:, None] * sgqm + offs_d[None, :]
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d < D)[None, :])
        if WRITE_DHS:
            tl.store(DHS + bh * tiles + pid_m, _head_scale_grad(hs_a, hs_z, hs_w, hs_p))
        if WRITE_DB and not DB_IN_REGS:
            tl.debug_barrier()  # the next entry's read of the dBias tile sees every thread's store of this one
    if DB_IN_REGS:
        tl.store(db_base + rows64[:, None] * Nk + offs_n[None, :].to(tl.int64), db_acc,
                 mask=row_ok[:, None] & (offs_n < Nk)[None, :])


@triton.jit
def _head_rows(Q, O, DO, LSE, off_b, off_h, rows, Nq, D, Dv, sqb, sqh, sqm, sqd, sob, soh, som, sod, sdb, sdh, sdm,
               sdd, slb, slh, slm, offs_d, offs_dv, EVEN_D: tl.constexpr):
    """``(q, dO, lse, delta, row_ok)`` of query ``rows`` of one head for :func:`_bwd_head_kernel`: dO rounded to the
    compute dtype (as the other kernels read it), ``delta = rowsum(dO * O)``, lse ``+inf`` for rows past Nq and for
    rows whose keys are all masked (``-inf``), so their P and dS are 0."""
    row_ok = rows < Nq
    rows64 = rows.to(tl.int64)
    q = load_kv_tile(Q + off_b * sqb + off_h * sqh + rows64[:, None] * sqm + offs_d[None, :] * sqd, row_ok, offs_d,
                     D, True, EVEN_D)
    ok_v = row_ok[:, None] & (offs_dv < Dv)[None, :]
    o = tl.load(O + off_b * sob + off_h * soh + rows64[:, None] * som + offs_dv[None, :] * sod, mask=ok_v,
                other=0.0)
    do = tl.load(DO + off_b * sdb + off_h * sdh + rows64[:, None] * sdm + offs_dv[None, :] * sdd, mask=ok_v,
                 other=0.0).to(q.dtype)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + off_b * slb + off_h * slh + rows64 * slm, mask=row_ok, other=float("inf"))
    return q, do, tl.where(lse == float("-inf"), float("inf"), lse), delta, row_ok


@triton.jit
def _head_key_tile(dq, dq_t, q, do, lse, delta, rows, row_ok, q_t, do_t, lse_t, delta_t, rows_t, row_ok_t, start_n,
                   offs_n, offs_d, offs_dv, k_base, v_base, b_base, m_base, dk_base, dv_base, Nk, D, Dv, skn, skd,
                   svn, svd, sbm, sbn, smm, smn, sgkn, sgvn, scale,
                   TAIL_M: tl.constexpr, BOUNDARY: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_MASK: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                   DOT_UPCAST: tl.constexpr):
    """One key tile of :func:`_bwd_head_kernel`: its dK / dV rows, complete (every query row of the head is in
    the program: the main tile, then with TAIL_M the tail rows), stored; ``(dq + dS K, dq_t + dS_t K)``
    returned."""
    cols = start_n + offs_n
    col_ok = cols < Nk
    cols64 = cols.to(tl.int64)
    k = load_kv_tile(k_base + cols64[:, None] * skn + offs_d[None, :] * skd, col_ok, offs_d, D, BOUNDARY, EVEN_D)
    v = load_kv_tile(v_base + cols64[:, None] * svn + offs_dv[None, :] * svd, col_ok, offs_dv, Dv, BOUNDARY, EVEN_DV)
    _, p, ds = _tile_scores(q, do, lse, delta, k, v, rows, row_ok, cols, col_ok, b_base, b_base, m_base, sbm, sbn,
                            0, 0, smm, smn, scale, 0, 0, BOUNDARY, IS_CAUSAL, HAS_BIAS, False, HAS_MASK, PRECISION,
                            False, DOT_UPCAST)
    p, ds = p.to(q.dtype), ds.to(q.dtype)  # rounded to the compute dtype for their products
    dv = _mm(tl.trans(p), do, PRECISION, DOT_UPCAST)
    dk = _mm(tl.trans(ds), q, PRECISION, DOT_UPCAST)
    dq = _mm_acc(dq, ds, k, PRECISION, DOT_UPCAST)
    if TAIL_M > 0:
        _, p_t, ds_t = _tile_scores(q_t, do_t, lse_t, delta_t, k, v, rows_t, row_ok_t, cols, col_ok, b_base, b_base,
                                    m_base, sbm, sbn, 0, 0, smm, smn, scale, 0, 0, True, IS_CAUSAL, HAS_BIAS, False,
                                    HAS_MASK, PRECISION, False, DOT_UPCAST)
        p_t, ds_t = p_t.to(q.dtype), ds_t.to(q.dtype)
        dv = _mm_acc(dv, tl.trans(p_t), do_t, PRECISION, DOT_UPCAST)
        dk = _mm_acc(dk, tl.trans(ds_t), q_t, PRECISION, DOT_UPCAST)
        dq_t = _mm_acc(dq_t, ds_t, k, PRECISION, DOT_UPCAST)
    tl.store(dv_base + cols64[:, None] * sgvn + offs_dv[None, :], dv.to(dv_base.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv < Dv)[None, :])
    tl.store(dk_base + cols64[:, None] * sgkn + offs_d[None, :], (dk * scale).to(dk_base.dtype.element_ty),
             mask=col_ok[:, None] & (offs_d < D)[None, :])
    return dq, dq_t


@triton.jit(do_not_specialize=["H", "Nq", "Nk"])  # lengths are runtime values: a new one compiles nothing new
def _bwd_head_kernel(Q, K, V, O, DO, LSE, Bias, Mask, DQ, DK, DV,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                     sdb, sdh, sdm, sdd, slb, slh, slm, sbb, sbh, sbm, sbn, smb, smh, smm, smn,
                     sgqb, sgqh, sgqm, sgkb, sgkh, sgkn, sgvb, sgvh, sgvn, H, Nq, Nk, D, Dv, scale,
                     BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                     DOT_UPCAST: tl.constexpr):
    """dQ, dK, dV of one (batch, head) whose ``Nq <= BLOCK_M + TAIL_M`` query rows the program holds whole (half
    operands): a tile of BLOCK_M rows and, with TAIL_M (0 = none), one of the TAIL_M rows after it (ViT-L/14's 257
    tokens: 256 + 16 rows instead of a 512-row tile).

    1-D grid B * H. The program holds the head's q, dO (and forms ``delta = rowsum(dO * O)`` and the row lse
    itself: no preprocess launch) and the dQ accumulator, and streams the key tiles: each key tile's dK / dV is
    the sum over every query row, so it is complete after its step and stored; no other program adds to it. Five
    tile products per key tile (the two-kernel path's dQ kernel recomputes S and dP: seven), one launch instead
    of three, no ordered adds; every sum has a fixed order (reproducible). Keys >= Nk are masked in the last
    tile; query rows >= Nq read ``lse = +inf`` and dO = 0, so their P and dS are 0; a row whose keys are all
    masked (``lse = -inf``) reads ``+inf`` too and gets zero gradients."""
    bh = tl.program_id(0).to(tl.int64)
    off_b = bh // H
    off_h = bh % H
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = tl.arange(0, BLOCK_M)
    q, do, lse, delta, row_ok = _head_rows(Q, O, DO, LSE, off_b, off_h, rows, Nq, D, Dv, sqb, sqh, sqm, sqd, sob,
                                           soh, som, sod, sdb, sdh, sdm, sdd, slb, slh, slm, offs_d, offs_dv, EVEN_D)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if TAIL_M > 0:
        rows_t = BLOCK_M + tl.arange(0, TAIL_M)
        q_t, do_t, lse_t, delta_t, row_ok_t = _head_rows(Q, O, DO, LSE, off_b, off_h, rows_t, Nq, D, Dv, sqb, sqh,
                                                         sqm, sqd, sob, soh, som, sod, sdb, sdh, sdm, sdd, slb, slh,
                                                         slm, offs_d, offs_dv, EVEN_D)
        dq_t = tl.zeros([TAIL_M, BLOCK_D], dtype=tl.float32)
    else:  # stand-ins, never read
        rows_t, q_t, do_t, lse_t, delta_t, row_ok_t, dq_t = rows, q, do, lse, delta, row_ok, dq
    k_base = K + off_b * skb + off_h * skh
    v_base = V + off_b * svb + off_h * svh
    b_base = Bias + off_b * sbb + off_h * sbh
    m_base = Mask + off_b * smb + off_h * smh
    dk_base = DK + off_b * sgkb + off_h * sgkh
    dv_base = DV + off_b * sgvb + off_h * sgvh
    n_full = Nk // BLOCK_N
    if IS_CAUSAL:
        n_full = 0  # every tile may cross a row's diagonal: masked per element
    for t in range(0, n_full):
        dq, dq_t = _head_key_tile(dq, dq_t, q, do, lse, delta, rows, row_ok, q_t, do_t, lse_t, delta_t, rows_t,
                                  row_ok_t, t * BLOCK_N, offs_n, offs_d, offs_dv, k_base, v_base, b_base, m_base,
                                  dk_base, dv_base, Nk, D, Dv, skn, skd, svn, svd, sbm, sbn, smm, smn, sgkn, sgvn,
                                  scale, TAIL_M, False, IS_CAUSAL, HAS_BIAS, HAS_MASK, EVEN_D, EVEN_DV, PRECISION,
                                  DOT_UPCAST)
    for t in range(n_full, tl.cdiv(Nk, BLOCK_N)):  # causal: keys no query row sees get their zero rows here
        dq, dq_t = _head_key_tile(dq, dq_t, q, do, lse, delta, rows, row_ok, q_t, do_t, lse_t, delta_t, rows_t,
                                  row_ok_t, t * BLOCK_N, offs_n, offs_d, offs_dv, k_base, v_base, b_base, m_base,
                                  dk_base, dv_base, Nk, D, Dv, skn, skd, svn, svd, sbm, sbn, smm, smn, sgkn, sgvn,
                                  scale, TAIL_M, True, IS_CAUSAL, HAS_BIAS, HAS_MASK, EVEN_D, EVEN_DV, PRECISION,
                                  DOT_UPCAST)
    dq_base = DQ + off_b * sgqb + off_h * sgqh
    tl.store(dq_base + rows.to(tl.int64)[:, None] * sgqm + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d < D)[None, :])
    if TAIL_M > 0:
        tl.store(dq_base + rows_t.to(tl.int64)[:, None] * sgqm + offs_d[None, :],
                 (dq_t * scale).to(DQ.dtype.element_ty), mask=row_ok_t[:, None] & (offs_d < D)[None, :])


# --------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class KernelTiles:
    """Launch configuration of one backward kernel.

    Attributes:
        block_m: query rows per tile (power of two, >= 16).
        block_n: keys per tile (power of two, >= 16).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the streamed loop.
        tail: rows of the narrow tile a last key tile and a last query tile run with when their valid rows fit
            it (the dK/dV kernel only; 0 = off): :func:`_bwd_dkdv_kernel`'s TAIL; in the whole-head kernel's
            tiles (:func:`head_tiles`) the rows of the tail tile held after the ``block_m`` rows (its TAIL_M).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tail: int = 0


@dataclass(frozen=True)
class BwdConfig:
    """Tiles of the dK/dV kernel (streams query tiles: ``block_n`` keys held) and of the dQ kernel (streams key
    tiles: ``block_m`` queries held).

    ``single_pass``: a call that needs no bias or logit-scale gradient runs the dK/dV kernel alone with its
    ordered dQ accumulation (``dkdv`` tiles; ``dq`` serves the calls that do need those gradients)."""

    dkdv: KernelTiles
    dq: KernelTiles
    single_pass: bool = False


# Keyed by (operand kind, padded head dim): "half" = fp16 / bf16 operands, "fp32" = FP32 operands with split-FP16
# or TF32 products, "ieee" = FP32 operands with IEEE FMA products. The held tile is the wide one where registers
# allow (FlashAttention-2 / the Triton tutorial's split: 128 held rows, 32 streamed); square 64 x 64 tiles where
# the wide ones measured slower (half D=128, split-FP16 D=64). docs/tuning.md ("Backward kernels") holds the H100
# timings behind the rows that were swept (head dim 64, half at 128).
_CONFIGS: dict[tuple[str, int], BwdConfig] = {
    ("half", 16): BwdConfig(KernelTiles(32, 128, 4, 3), KernelTiles(128, 32, 4, 3)),
    ("half", 32): BwdConfig(KernelTiles(32, 128, 4, 3), KernelTiles(128, 32, 4, 3)),
    ("half", 64): BwdConfig(KernelTiles(32, 128, 4, 3), KernelTiles(128, 32, 4, 3)),
    ("half", 128): BwdConfig(KernelTiles(64, 64, 4, 2), KernelTiles(64, 64, 4, 2)),
    ("half", 256): BwdConfig(KernelTiles(16, 64, 4, 1), KernelTiles(64, 16, 4, 1)),
    ("fp32", 16): BwdConfig(KernelTiles(32, 64, 4, 2), KernelTiles(64, 32, 4, 2)),
    ("fp32", 32): BwdConfig(KernelTiles(32, 64, 4, 2), KernelTiles(64, 32, 4, 2)),
    ("fp32", 64): BwdConfig(KernelTiles(64, 64, 4, 2, tail=16), KernelTiles(64, 64, 4, 2)),
    ("fp32", 128): BwdConfig(KernelTiles(32, 64, 8, 2), KernelTiles(64, 32, 8, 2)),
    ("fp32", 256): BwdConfig(KernelTiles(16, 32, 4, 1), KernelTiles(32, 16, 4, 1)),
    # IEEE FMA products hold more live registers than split-FP16's: the 64 x 64 tiles spill 2-11 KB per thread
    ("ieee", 16): BwdConfig(KernelTiles(32, 64, 4, 2), KernelTiles(64, 32, 4, 2)),
    ("ieee", 32): BwdConfig(KernelTiles(32, 64, 4, 2), KernelTiles(64, 32, 4, 2)),
    ("ieee", 64): BwdConfig(KernelTiles(32, 64, 4, 2), KernelTiles(64, 32, 4, 2)),
    ("ieee", 128): BwdConfig(KernelTiles(32, 64, 8, 2), KernelTiles(64, 32, 8, 2)),
    ("ieee", 256): BwdConfig(KernelTiles(16, 32, 4, 1), KernelTiles(32, 16, 4, 1)),
    # split-FP16 products with per-head right-operand scales (fp32's) free registers at head dim 128: taller
    # dK/dV and wider dQ tiles than f16x1's (tf32), which stays on the "fp32" row (docs/tuning.md: "D=128 f16x3-head")
    ("f16x3-head", 128): BwdConfig(KernelTiles(64, 32, 8, 2), KernelTiles(32, 128, 8, 2)),
}

# Where the dQ kernel also forms the bias gradient (an FP32 dS tile added into the dBias buffer per key tile),
# the half rows' 128-row dQ tile at 4 warps spills and runs at half speed: 8 warps, and at head dim 64 a
# half-height tile, replace it; half at head dim 128 keeps 128 x 32 dQ tiles (the 64 x 64 one spills 2 KB per
# thread with the dBias tile) and FP32 at head dim 64 the 64 x 32 dQ tile it was measured with.
# Same keys as _CONFIGS; docs/tuning.md has the timings.
_BIAS_GRAD_CONFIGS: dict[tuple[str, int], BwdConfig] = {
    ("half", 16): BwdConfig(KernelTiles(32, 128, 4, 3), KernelTiles(128, 32, 8, 3)),
    ("half", 32): BwdConfig(KernelTiles(32, 128, 4, 3), KernelTiles(128, 32, 8, 3)),
    ("half", 64): BwdConfig(KernelTiles(32, 64, 4, 2), KernelTiles(64, 32, 8, 2)),
    ("half", 128): BwdConfig(KernelTiles(32, 128, 8, 2), KernelTiles(128, 32, 8, 2)),
    ("fp32", 64): BwdConfig(KernelTiles(32, 64, 4, 2), KernelTiles(64, 32, 4, 2)),
}


# The single-pass backward (the dK/dV kernel with the ordered dQ accumulation) where it measured faster than the
# two kernels: split-FP16 products at head dim 64 with at most SINGLE_PASS_MAX_KEYS keys (ViT-B/16 224), keyed
# by operand kind as _CONFIGS, with "f16x1" for the hi parts alone (tf32), whose fewer live registers take a
# taller query tile. At longer sequences the wait for each query tile's turn, and with half operands the fused
# kernel itself, cost more than the dQ kernel's recomputed products (docs/tuning.md: "two backward kernels").
_SINGLE_PASS: dict[tuple[str, int], KernelTiles] = {("fp32", 64): KernelTiles(32, 64, 4, 2, tail=16),
                                                    ("f16x1", 64): KernelTiles(64, 64, 4, 2, tail=16)}
SINGLE_PASS_MAX_KEYS = 256

# The whole-head backward (:func:`_bwd_head_kernel`, one program per (batch, head) holding every query row) for
# fp16 / bf16 calls of at most this many query rows and keys at head dims that pad to HEAD_DIM, without a bias or
# logit-scale gradient or grouped heads (docs/tuning.md: "whole-head half backward": at head dim 32 the two
# kernels measured faster; 128 would hold twice the q, dO and FP32 dQ registers); tiles tried in order until one
# fits shared memory
HEAD_MAX_ROWS = 256 + 16
HEAD_MAX_KEYS = 256 + 16
HEAD_DIM = 64


def head_tiles(n_q: int) -> list[KernelTiles]:
    """Tiles of the whole-head backward for ``n_q`` query rows, in the order a plan tries them: one query tile of
    ``max(64, pad_pow2(n_q))`` rows up to 256 (8 warps at 256 rows, 4 below) and past 256 rows a 16-row tail tile
    after it (``tail``: ViT-L/14's 257 tokens, 261 with four register tokens); 32-key tiles in 3 stages, then fewer
    stages and 16-key tiles for GPUs with less shared memory (256 rows x 32 keys: 188 / 180 KB in 3 / 2 stages,
    x 16 keys: 156 KB in 2, with triton 3.6).

    Raises:
        ValueError: ``n_q`` outside 1 .. :data:`HEAD_MAX_ROWS`."""
    if not 1 <= n_q <= HEAD_MAX_ROWS:
        raise ValueError(f"n_q={n_q}: the whole-head backward holds 1 to {HEAD_MAX_ROWS} query rows")
    block_m = max(64, pad_pow2(min(n_q, 256)))
    warps = 8 if block_m > 128 else 4
    tail = 16 if n_q > block_m else 0
    return [KernelTiles(block_m, n, warps, stages, tail) for n, stages in ((32, 3), (32, 2), (16, 2), (16, 1))]


def get_config(mode: str, head_dim: int, head_dim_v: int | None = None, bias_grad: bool = False,
               products: str | None = None, n_keys: int | None = None) -> BwdConfig:
    """Backward tile configuration for ``mode`` and head dims (D, Dv): the larger, padded to a power of two, decides;
    ``bias_grad`` (the dQ kernel also writes dBias) picks the bias-gradient tiles where they differ; ``products``
    as :func:`fp32_products` (IEEE products take their own rows); ``n_keys`` (when given) picks the single-pass
    backward where it is the faster one (:data:`SINGLE_PASS_MAX_KEYS`).

    Raises:
        ValueError: unknown ``mode`` or ``products``; a head dim outside 1..:data:`MAX_HEAD_DIM`.
    """
    if mode not in BWD_MODES:
        raise ValueError(f"mode={mode!r} has no dense backward kernel; expected one of {list(BWD_MODES)}")
    dmax = max(head_dim, head_dim_v or head_dim)
    if not 1 <= dmax <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {dmax} outside 1..{MAX_HEAD_DIM}")
    dtype, precision = fp32_products(mode, products)
    kind = "half" if dtype != torch.float32 else "ieee" if precision == "ieee" else "fp32"
    key = (kind, pad_pow2(dmax))
    if not bias_grad and (precision, key[1]) in _CONFIGS:  # a products kind with rows of its own
        key = (precision, key[1])
    if bias_grad and key in _BIAS_GRAD_CONFIGS:
        return _BIAS_GRAD_CONFIGS[key]
    single = ("f16x1", key[1]) if precision == "f16x1" else key
    if not bias_grad and single in _SINGLE_PASS and n_keys is not None and n_keys <= SINGLE_PASS_MAX_KEYS:
        return BwdConfig(_SINGLE_PASS[single], _CONFIGS[key].dq, single_pass=True)
    return _CONFIGS[key]


def _smaller(t: KernelTiles) -> list[KernelTiles]:
    """Tiles to try, in order, when ``t`` exceeds the GPU's shared memory: fewer stages, then narrower tiles."""
    out, c = [], t
    while c.num_stages > 1:
        c = replace(c, num_stages=c.num_stages - 1)
        out.append(c)
    while c.block_n > 16 or c.block_m > 16:
        if c.block_n >= c.block_m:
            c = replace(c, block_n=c.block_n // 2)
        else:
            c = replace(c, block_m=c.block_m // 2)
        out.append(c)
    return out


# (kernel, launch key) -> the tiles that fitted after an out-of-shared-memory retry (per process)
_FITTED: dict[tuple, KernelTiles] = {}


def _run_fitting(name: str, key: tuple, tiles: KernelTiles, explicit: bool, run) -> None:
    """``run(tiles)``; unless ``explicit``, fall back to smaller tiles on out-of-shared-memory and remember them."""
    if explicit:
        run(tiles)
        return
    start = _FITTED.get((name, key), tiles)
    ran = run_first_that_fits(run, start, _smaller)
    if ran != tiles:
        _FITTED[(name, key)] = ran


# --------------------------------------------------------------------------- bias-gradient shapes

def bias_grad_shape(bias: torch.Tensor, shape4: tuple[int, int, int, int] | None = None) -> tuple[int, ...]:
    """Shape of the dBias :func:`elsa_backward` returns for ``bias``: ``bias.shape`` with every dimension of
    size > 1 and stride 0 (an ``expand``-ed dimension) set to 1, i.e. the shape of the memory the view reads.
    A bias passed un-expanded (``[H, Nq, Nk]``, ``[1, H, Nq, Nk]``) gets its own shape back.
    ``shape4``, when given, is the [B, H, Nq, Nk] the bias broadcasts to (only its rank is checked here)."""
    if shape4 is not None and bias.dim() > len(shape4):
        raise ValueError(f"bias has {bias.dim()} dims; expected at most {len(shape4)}")
    return tuple(1 if (s > 1 and st == 0) else s for s, st in zip(bias.shape, bias.stride()))


def autograd_bias(bias: torch.Tensor | None, bias_requires_grad: bool) -> torch.Tensor | None:
    """The bias to hand the backward kernels for an autograd caller, whose bias gradient must have the bias's own
    shape: a bias view with an expanded (stride 0, size > 1) dimension that needs a gradient is copied
    contiguous, so :func:`bias_grad_shape` is its shape (autograd sums the repeats through the ``expand``); any
    other bias as it is."""
    if bias is not None and bias_requires_grad and any(st == 0 and n > 1 for n, st in zip(bias.shape, bias.stride())):
        return bias.contiguous()
    return bias


def reduce_bias_grad(grad: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Sum ``grad`` (broadcastable to nothing smaller than ``shape``) down to ``shape``, deterministically.

    ``torch.Tensor.sum_to_size`` over the broadcast dims (reductions, no atomics), then a reshape when
    ``shape`` drops leading unit dims (``[1, H, Nq, Nk]`` -> ``[H, Nq, Nk]``).

    Raises:
        ValueError: ``grad`` cannot be summed to ``shape``.
    """
    shape = tuple(shape)
    lead = len(grad.shape) - len(shape)
    padded = (1,) * max(lead, 0) + shape
    try:
        out = grad.sum_to_size(padded) if tuple(grad.shape) != padded else grad
    except RuntimeError as exc:
        raise ValueError(f"grad of shape {tuple(grad.shape)} cannot be reduced to {shape}") from exc
    return out.reshape(shape)


# --------------------------------------------------------------------------- launcher

def _check_inputs(q, k, v, out, grad_out, lse, bias, attn_mask, mode):
    if mode not in BWD_MODES:
        raise ValueError(f"mode={mode!r} has no dense backward kernel; expected one of {list(BWD_MODES)}")
    dtype = BWD_MODES[mode][0]
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("grad_out", grad_out), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4 dims [B, H, N, D]")
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; mode {mode!r} computes in {dtype} (cast first)")
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    Hkv = k.shape[1]
    if k.shape[0] != B or k.shape[3] != D or (Hkv != H and (Hkv == 0 or H % Hkv)):
        raise ValueError(f"k has shape {tuple(k.shape)}; expected [{B}, Hkv, Nk, {D}] with Hkv dividing {H} for q "
                         f"{tuple(q.shape)}")
    if v.shape[:3] != (B, Hkv, Nk):
        raise ValueError(f"v has shape {tuple(v.shape)}; expected [{B}, {Hkv}, {Nk}, Dv]")
    if max(D, Dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dim {max(D, Dv)} > {MAX_HEAD_DIM}")
    for name, t in (("out", out), ("grad_out", grad_out)):
        if tuple(t.shape) != (B, H, Nq, Dv):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [{B}, {H}, {Nq}, {Dv}]")
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; expected a floating dtype")
    if tuple(lse.shape) != (B, H, Nq):
        raise ValueError(f"lse has shape {tuple(lse.shape)}; expected [{B}, {H}, {Nq}]")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse has dtype {lse.dtype}; expected torch.float32")
    for name, t in (("k", k), ("v", v), ("out", out), ("grad_out", grad_out), ("lse", lse)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}; q is on {q.device}")
    shape4 = (B, H, Nq, Nk)
    _check_broadcast("bias", bias, "a floating tensor", lambda t: t.is_floating_point(), shape4, q.device)
    _check_broadcast("attn_mask", attn_mask, "a bool tensor", lambda t: t.dtype == torch.bool, shape4, q.device)


def _check_broadcast(name, t, kind: str, kind_ok, shape4, device) -> None:
    """``t`` is None or a tensor of ``kind`` on ``device`` broadcastable to ``shape4`` with at most 4 dims."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or not kind_ok(t):
        raise TypeError(f"{name} must be {kind}, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; q is on {device}")
    if t.dim() > 4:
        raise ValueError(f"{name} has {t.dim()} dims; expected at most 4")
    try:
        torch.broadcast_shapes(t.shape, shape4)
    except RuntimeError as exc:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to {list(shape4)}") from exc


def _bias_splits(n_red: int, programs: int, partial_bytes: int, device: torch.device, requested: int | None) -> int:
    """Chunks G of the dBias reduction: enough programs for ~4 per SM, partials within
    :data:`BIAS_WORKSPACE_BYTES` (at least 1), never more than the entries reduced; 1 off CUDA."""
    if requested is not None:
        return max(1, min(int(requested), n_red))
    if n_red <= 1 or device.type != "cuda":
        return 1
    return max(1, min(n_red, cdiv(4 * sm_count(device), max(programs, 1)),
                      BIAS_WORKSPACE_BYTES // max(partial_bytes, 1)))


def elsa_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                  lse: torch.Tensor, bias: torch.Tensor | None, attn_mask: torch.Tensor | None, is_causal: bool,
                  scale: float, mode: str, bias_requires_grad: bool = False, *, config: BwdConfig | None = None,
                  bias_splits: int | None = None, products: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of ``out = softmax(scale q k^T + bias, masked) v`` by the deterministic ELSA backward kernels.

    Args:
        q: [B, H, Nq, D] in the mode's compute dtype (float32 for ``fp32`` / ``fp32-ieee`` / ``tf32``, float16
            for ``fp16``, bfloat16 for ``bf16``); any strides (read in place).
        k: [B, Hkv, Nk, D]; v: [B, Hkv, Nk, Dv]; same dtype and device. D, Dv in 1..256 (padded to a power of
            two >= 16 inside the kernels); D != Dv and Nq != Nk allowed. ``Hkv`` divides H (grouped-query /
            multi-query attention, FlashAttention-2's GQA / MQA): query head ``h`` reads K / V head
            ``h // (H / Hkv)``, and dK / dV sum the group's query heads in a fixed order (reproducible).
        out: the forward output [B, H, Nq, Dv], any float dtype, any strides.
        grad_out: dL/d out, [B, H, Nq, Dv], any float dtype (rounded to the compute dtype, as the forward's
            operands are), any strides.
        lse: float32 [B, H, Nq], any strides: the natural-log log-sum-exp of each row's logits,
            ``lse_i = log sum_j exp(scale q_i . k_j + bias_ij)`` over the unmasked keys; ``-inf`` for a row
            whose keys are all masked (its gradients are then exactly 0).
        bias: None or an additive float bias broadcastable to [B, H, Nq, Nk] (e.g. [H, Nq, Nk], or a stride-0
            ``expand``-ed view), any float dtype, read through its strides.
        attn_mask: None or a bool mask broadcastable to [B, H, Nq, Nk]; True = keep.
        is_causal: top-left causal mask (key j visible to query i iff j <= i).
        scale: the logit scale.
        mode: ``fp32``, ``fp32-ieee``, ``tf32``, ``fp16`` or ``bf16`` (products as the module docstring says).
        bias_requires_grad: also return dBias.
        config: tile override (tools, tests); None = :func:`get_config`'s, shrunk if it exceeds shared memory.
        bias_splits: chunks G of the batch / head entries reduced onto each dBias slot (module docstring);
            None = automatic (1 on CPU).
        products: the FP32 operands' products, one of :data:`BACKWARD_PRODUCTS` (tools compare them); None = the
            mode's. Half modes ignore it.

    Returns:
        ``(dq, dk, dv, dbias)``: dq [B, H, Nq, D], dk [B, Hkv, Nk, D], dv [B, Hkv, Nk, Dv], contiguous, in q's
        dtype (FP32 accumulation); dbias None unless ``bias_requires_grad`` (and a bias is given), else
        ``dS`` summed to :func:`bias_grad_shape` of ``bias`` in ``bias.dtype``. Nq == 0 or Nk == 0 give
        zero / empty gradients without launching a kernel.

    Raises:
        ValueError: unknown mode; shapes that do not match (naming the argument; K / V heads that do not divide
            H); head dim > 256; tensors on different devices; ``bias_requires_grad`` without a bias.
        TypeError: q / k / v not in the mode's compute dtype; lse not float32; a non-bool mask or non-float bias.
    """
    _check_inputs(q, k, v, out, grad_out, lse, bias, attn_mask, mode)
    if bias_requires_grad and bias is None:
        raise ValueError("bias_requires_grad=True needs a bias")
    dq, dk, dv, dbias, _ = launch_backward(q, k, v, out, grad_out, lse, bias, None, attn_mask, None, is_causal,
                                           scale, mode, bias_requires_grad, False, config, bias_splits,
                                           products=products)
    return dq, dk, dv, dbias


def launch_backward(q, k, v, out, grad_out, lse, bias, add_mask, attn_mask, head_scale, is_causal: bool,
                    scale: float, mode: str, bias_requires_grad: bool, head_scale_requires_grad: bool,
                    config: BwdConfig | None, bias_splits: int | None, default: BwdConfig | None = None,
                    products: str | None = None):
    """Allocate and launch the three kernels on validated inputs from the cached plan of the call's signature
    (shared with :mod:`.window_bwd`).

    Beyond :func:`elsa_backward`'s arguments: ``add_mask`` None or a float [n_add, Nq, Nk] additive mask, batch
    entry b reading ``add_mask[b % n_add]`` (Swin's shift mask; no gradient); ``head_scale`` None or a contiguous
    float32 [H] logit scale per head replacing ``scale``; ``head_scale_requires_grad``: also return
    ``d head_scale_h = sum_(b, i, j) dS_bhij q_bhi . k_bhj`` (FP32 [H], summed by torch over per-tile partials).

    ``config`` runs as given; otherwise ``default`` (or :func:`get_config`'s), shrunk if it exceeds shared memory.
    ``products``: as :func:`elsa_backward`'s.

    Returns (dq, dk, dv, dbias or None, dhead_scale or None).
    """
    q, k, v, out, grad_out = backward_operands(q, k, v, out, grad_out)
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    if B * H == 0 or Nq == 0 or Nk == 0 or D == 0 or Dv == 0:
        zeros = functools.partial(torch.zeros, device=q.device)
        Hkv = k.shape[1]
        return (zeros((B, H, Nq, D), dtype=q.dtype), zeros((B, Hkv, Nk, D), dtype=q.dtype),
                zeros((B, Hkv, Nk, Dv), dtype=q.dtype),
                zeros(bias_grad_shape(bias), dtype=bias.dtype) if bias_requires_grad else None,
                zeros(H, dtype=torch.float32) if head_scale_requires_grad else None)
    key = (mode, q.shape, k.shape, v.shape[3], q.stride(), k.stride(), v.stride(), out.stride(), grad_out.stride(),
           lse.stride(), q.dtype, out.dtype, grad_out.dtype, q.device, _tensor_key(bias), _tensor_key(add_mask),
           _tensor_key(attn_mask), _tensor_key(head_scale), bool(is_causal), bool(bias_requires_grad),
           bool(head_scale_requires_grad), config, bias_splits, default, products, q.data_ptr() & 15, k.data_ptr() & 15,
           v.data_ptr() & 15, out.data_ptr() & 15, grad_out.data_ptr() & 15, lse.data_ptr() & 15)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.put(key, _BackwardPlan(q, k, v, out, grad_out, lse, bias, add_mask, attn_mask, head_scale,
                                            is_causal, mode, bias_requires_grad, head_scale_requires_grad, config,
                                            bias_splits, default, products))
    return plan(q, k, v, out, grad_out, lse, bias, add_mask, attn_mask, head_scale, scale)


def backward_after_forward(forward_plan, q, k, v, out, grad_out, lse, bias, attn_mask, is_causal: bool,
                           scale: float, mode: str, bias_requires_grad: bool, grads=None):
    """:func:`elsa_backward` of a call whose forward ran from ``forward_plan`` (a dense forward plan of
    :mod:`.elsa_fwd` with the log-sum-exp): ``q`` / ``k`` / ``v`` / ``bias`` / ``attn_mask`` are what that
    forward took (validated when its plan was built), ``out`` / ``lse`` what it returned. The eager autograd
    path calls this: the forward plan already fixes everything the backward plan depends on but the output
    gradient (strides, dtype, alignment), the bias's own shape and whether it needs a gradient, so the backward
    plan is looked up by those few values instead of validating again and keying every tensor (tens of
    microseconds per call). Returns ``(dq, dk, dv, dbias)`` as :func:`elsa_backward`; with ``grads`` (dq, dk, dv
    of q / k / v's shapes and dtype, any strides with a unit last one, e.g. slices of one packed [B, N, 3, H, D]
    buffer) the kernels write into those and return them."""
    grad_strides = None if grads is None else tuple(g.stride()[:3] for g in grads)
    # q, k, v, out: as the forward plan took and wrote them (unit last strides); autograd's dO may be any layout
    grad_out = unit_last_stride(grad_out)
    bias = autograd_bias(bias, bias_requires_grad)
    key = (forward_plan, bool(bias_requires_grad), None if bias is None else (bias.shape, bias.stride()),
           grad_out.stride(), grad_out.dtype, grad_out.data_ptr() & 15, grad_strides)
    plan = AFTER_FORWARD.get(key)
    if plan is None:
        _check_inputs(q, k, v, out, grad_out, lse, bias, attn_mask, mode)
        if bias_requires_grad and bias is None:
            raise ValueError("bias_requires_grad=True needs a bias")
        B, H, Nq, D = q.shape
        check_grads(grads, q, k, v)
        if B * H == 0 or Nq == 0 or k.shape[2] == 0 or D == 0 or v.shape[3] == 0:  # zeros, no plan
            result = launch_backward(q, k, v, out, grad_out, lse, bias, None, attn_mask, None, is_causal, scale, mode,
                                     bias_requires_grad, False, None, None)[:4]
            if grads is None:
                return result
            for into in grads:
                into.zero_()
            return (*grads, result[3])
        plan = AFTER_FORWARD.put(key, _BackwardPlan(q, k, v, out, grad_out, lse, bias, None, attn_mask, None,
                                                    is_causal, mode, bias_requires_grad, False, None, None, None,
                                                    grad_strides=grad_strides))
    return plan(q, k, v, out, grad_out, lse, bias, None, attn_mask, None, scale, grads)[:4]


def check_grads(grads, q, k, v) -> None:
    """ValueError unless ``grads`` is None or (dq, dk, dv) with q / k / v's shapes, q's dtype and device and a unit
    last stride (the layout the backward kernels write through their strides)."""
    if grads is not None and any(g.shape != t.shape or g.dtype != q.dtype or g.stride(3) != 1 or g.device != q.device
                                 for g, t in zip(grads, (q, k, v))):
        raise ValueError("grads: (dq, dk, dv) must have q / k / v's shapes, q's dtype and device and a unit "
                         "stride in the last dim")


def _grads_tma_legal(dk: torch.Tensor, dv: torch.Tensor) -> bool:
    """:func:`.half_gluon_bwd.grads_tma_legal` (imported on use: that module imports this one)."""
    from .half_gluon_bwd import grads_tma_legal

    return grads_tma_legal(dk, dv)


def _tensor_key(t: torch.Tensor | None):
    # what a backward plan depends on of an optional tensor: shape, strides, dtype, 16-byte alignment
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)


_GLUON_BWD = "fp32-ieee backward"  # the Gluon IEEE backward's name in elsa_fwd's record of Gluon failures
_GLUON_HALF_BWD = "half backward"  # the Gluon fp16 / bf16 backward's (kernels/half_gluon_bwd.py)
_GLUON_TF32_BWD = "tf32 backward"  # its HEAD_SCALES build for mode tf32 (half_gluon_bwd.tf32_backward)
_GLUON_FP32_BWD = "fp32 backward"  # its split-FP16 build for mode fp32 (half_gluon_bwd.fp32_backward)


# call signature -> _BackwardPlan (see launch_backward); PLANS.hits / PLANS.builds count reuses and builds
PLANS = PlanCache()
# (forward plan, output-gradient layout, bias shape and gradient) -> _BackwardPlan (see backward_after_forward)
AFTER_FORWARD = PlanCache()


def _gqa_kv_max(head_max: torch.Tensor, k: torch.Tensor, v: torch.Tensor, B: int, Hkv: int, group: int) -> None:
    """Grouped-query attention with per-head scaled products (:data:`HEAD_SCALED`): the largest magnitude of each
    K / V head, as int32 bit patterns, into columns 1 and 2 of the rows of ``head_max`` (int32 [B * H, 4],
    :func:`_bwd_preprocess_kernel`'s layout) of the query heads reading that K / V head. Maxima are exact, so
    these are the values the preprocess finds for equal heads."""
    rows = head_max.view(B, Hkv, group, 4)
    for col, t in ((1, k), (2, v)):
        peak = t.detach().abs().amax(dim=(2, 3)).to(torch.float32).view(torch.int32)  # [B, Hkv]
        rows[:, :, :, col] = peak[:, :, None]


_HEAD_WARNED: list[bool] = []


def _head_does_not_fit(t: KernelTiles) -> None:
    """Warn, once per process, that the whole-head backward's smallest tiles exceed this GPU's shared memory."""
    if not _HEAD_WARNED:
        _HEAD_WARNED.append(True)
        warnings.warn(f"visionattn: the whole-head fp16 / bf16 backward ({t.block_m} query rows, {t.block_n}-key "
                      f"tiles) needs more shared memory than this GPU has; short calls run the two-kernel backward "
                      f"(a few tens of percent slower) instead", RuntimeWarning, stacklevel=4)


class _BackwardPlan:
    """The preprocess, dK/dV and dQ launches of one backward call signature: grids, constexprs and every
    integer argument fixed when the plan is built, tiles fitted to shared memory on its first run; a call
    allocates the gradients and launches (a few microseconds of host work instead of three keyed launches)."""

    def __init__(self, q, k, v, out, grad_out, lse, bias, add_mask, attn_mask, head_scale, is_causal, mode,
                 bias_requires_grad, head_scale_requires_grad, config, bias_splits, default, products=None,
                 grad_strides=None):
        dtype, precision = fp32_products(mode, products)
        B, H, Nq, D = q.shape
        Nk, Dv = k.shape[2], v.shape[3]
        # grouped-query attention: GROUP query heads per K / V head; dK / dV [B, Hkv, Nk, D] reduced over each
        # group inside the dK / dV kernel (one program per K / V head's key tile, the group's query heads in order)
        self.hkv = Hkv = k.shape[1]
        self.group = elsa_fwd.kv_group(q, k)
        # where dQ / dK / dV go: (batch, head, row) strides of each, contiguous unit last dim; None = the plan
        # allocates them contiguous, else the caller passes them (e.g. slices of one packed dQKV buffer)
        self.given_grads = grad_strides is not None
        if grad_strides is None:
            grad_strides = ((H * Nq * D, Nq * D, D), (Hkv * Nk * D, Nk * D, D), (Hkv * Nk * Dv, Nk * Dv, Dv))
        self.g_strides = tuple(int(x) for st in grad_strides for x in st)
        shape4 = self.shape4 = (B, H, Nq, Nk)
        bias4 = bias.expand(shape4) if bias is not None else None
        mask4 = attn_mask.expand(shape4) if attn_mask is not None else None
        self.cfg = config or default or get_config(mode, D, Dv, bool(bias_requires_grad), products, Nk)
        self.explicit = config is not None
        BLOCK_D, BLOCK_DV = head_blocks(D, Dv)
        self.dims = (B, H, Nq, Nk, D, Dv)
        # HEAD_SCALED products scale each right operand by one power of two per head (:func:`_mmh`): the
        # preprocess finds the heads' largest magnitudes
        self.head_b = precision in HEAD_SCALED
        self.pre_fixed = (*out.stride(), *grad_out.stride(), *lse.stride(), H, Nq, Dv)
        # the preprocess reads K / V at the query head's index: with GQA it reads none of them (0 keys) and the
        # K / V heads' largest magnitudes come from torch (_gqa_kv_max), into every query head's row of E
        self.pre_tail = (*q.stride(), *k.stride(), *v.stride(), Nk if self.group == 1 else 0, D)
        sb = bias4.stride() if bias4 is not None else (0, 0, 0, 0)
        sa = add_mask.stride() if add_mask is not None else (0, 0, 0)
        sm = mask4.stride() if mask4 is not None else (0, 0, 0, 0)
        self.n_add = add_mask.shape[0] if add_mask is not None else 1
        self.strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *sb, *sa, *sm)
        self.flags = dict(**product_flags(precision), IS_CAUSAL=bool(is_causal), HAS_BIAS=bias4 is not None,
                          HAS_ADD=add_mask is not None, HAS_MASK=mask4 is not None, HEAD_SCALE=head_scale is not None,
                          EVEN_D=D == BLOCK_D, EVEN_DV=Dv == BLOCK_DV,
                          DOT_UPCAST=dtype == torch.bfloat16 and interpreting(), HEAD_B=self.head_b)
        self.blocks = dict(BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV)
        self.fit_key = (mode, BLOCK_D, BLOCK_DV, bias4 is not None and bias4.dtype,
                        add_mask is not None and add_mask.dtype, mask4 is not None, head_scale is not None,
                        bool(is_causal), self.cfg)
        # dQ (+ dBias): slots of the dBias buffer and the (batch, head) entries reduced onto each
        self.write_db, self.write_dhs = bool(bias_requires_grad), bool(head_scale_requires_grad)
        red_b = self.write_db and B > 1 and bias4.stride(0) == 0
        red_h = self.write_db and H > 1 and bias4.stride(1) == 0
        self.B_OUT, self.R_B = (1, B) if red_b else (B, 1)
        self.H_OUT, self.R_H = (1, H) if red_h else (H, 1)
        self.db_shape = bias_grad_shape(bias) if self.write_db else None
        # the dims of the [B_OUT, H_OUT, Nq, Nk] dBias sum that the bias broadcasts over
        self.db_sum_dims = [d for d in (2, 3) if shape4[d] > 1 and bias4.stride(d) == 0] if self.write_db else []
        self.bias_splits = bias_splits
        self.device = q.device
        self.single_pass = self.cfg.single_pass and not (self.write_db or self.write_dhs)
        # IEEE products: the Gluon FMA kernels (ieee_gluon_bwd) where they take the call and no tiles are given,
        # unless they failed to import or build once in this process (warned once, as the forward's Gluon kernels)
        self.gluon = None
        self.gluon_ran: set[str] = set()  # the Gluon launches (attribute names) that ran once (see _run_gluon)
        if (precision == "ieee" and config is None and default is None and add_mask is None and head_scale is None
                and _GLUON_BWD not in elsa_fwd._GLUON_FAILED):
            reason = ieee_gluon_bwd.unsupported_reason(q, k, v, grad_out, bias, attn_mask, is_causal, 1.0)
            if reason is None:
                self.gluon = ieee_gluon_bwd.planned_launch(q, k, v, grad_out)
            elif reason == ieee_gluon_bwd._IMPORT_ERROR:  # reported last: the call was otherwise in scope
                elsa_fwd._gluon_failed(_GLUON_BWD, reason)
        # fp16 / bf16 on Hopper from half_gluon_bwd.MIN_KEYS keys and query rows: the warp-specialized Gluon kernel
        # (ordered dQ over several accumulators), under the same conditions as the IEEE one
        self.half_gluon = self.half_gluon_given = None
        if (dtype != torch.float32 and q.device.type == "cuda" and config is None and default is None
                and add_mask is None and head_scale is None and not bias_requires_grad
                and _GLUON_HALF_BWD not in elsa_fwd._GLUON_FAILED):
            from . import half_gluon_bwd  # lazy: it imports this module (the preprocess kernel)

            if half_gluon_bwd.preferred(Nq, Nk):
                reason = half_gluon_bwd.unsupported_reason(q, k, v, grad_out, bias, attn_mask, is_causal, 1.0)
                if reason is None:
                    self.half_gluon = half_gluon_bwd.planned_launch(q, k, v, grad_out)
                    # given gradients (e.g. slices of a packed [B, N, 3, H, D] buffer) are written in place by a
                    # launch of their own (its TMA descriptors fix their strides), where TMA-legal: no copies
                    if self.given_grads:
                        self.half_gluon_given = half_gluon_bwd.planned_launch(q, k, v, grad_out)
                elif reason == half_gluon_bwd._IMPORT_ERROR:  # reported last: the call was otherwise in scope
                    elsa_fwd._gluon_failed(_GLUON_HALF_BWD, reason)
        # tf32 (f16x1 products) on Hopper, same conditions, where tf32_preferred says: the same kernel on FP16
        # copies of q, k, v, dO scaled per head by powers of two (the preprocess finds the heads' magnitudes: f16x1
        # is HEAD_SCALED)
        # fp32 (f16x3-head) at head dims 64 and 128 likewise where fp32_preferred says, on the kernel's split-FP16
        # build (hi / lo operand parts, three wgmmas per product; fp32_unsupported_reason names the head dims)
        self.scaled_gluon = None
        split = precision == "f16x3-head"
        self.scaled_key = _GLUON_FP32_BWD if split else _GLUON_TF32_BWD
        if ((precision == "f16x1" or split) and q.device.type == "cuda" and config is None
                and default is None and add_mask is None and head_scale is None and not bias_requires_grad
                and self.scaled_key not in elsa_fwd._GLUON_FAILED):
            from . import half_gluon_bwd as hg

            if (hg.fp32_preferred if split else hg.tf32_preferred)(B, H, Nq, Nk, D, sm_count(q.device)):
                reason = (hg.fp32_unsupported_reason if split else hg.tf32_unsupported_reason)(
                    q, k, v, grad_out, bias, attn_mask, is_causal, 1.0)
                if reason is None:
                    launch = hg.fp32_planned_launch if split else hg.tf32_planned_launch
                    self.scaled_gluon = launch(q, k, v, grad_out)
                elif reason == hg._IMPORT_ERROR:
                    elsa_fwd._gluon_failed(self.scaled_key, reason)
        # fp16 / bf16 short calls: the whole-head kernel (its tiles fitted on the first run; None if none fits)
        self.head = None
        self.head_tiles = (head_tiles(Nq) if dtype != torch.float32 and config is None and default is None
                           and add_mask is None and head_scale is None and not bias_requires_grad
                           and not head_scale_requires_grad and self.group == 1 and Nq <= HEAD_MAX_ROWS
                           and Nk <= HEAD_MAX_KEYS and BLOCK_D == BLOCK_DV == HEAD_DIM
                           and self.half_gluon is None else [])
        self.head_strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride(), *grad_out.stride(), *lse.stride(),
                             *sb, *sm)
        # the dK/dV kernel's ordered dQ: accumulate in place when dQ is FP32; SPIN_ASM off in the interpreter
        # (dQ given: the Triton kernels write it at its strides, the Gluon ones contiguous, copied after)
        self.ordered = dict(DQ_ORDERED=self.single_pass, ACC_IS_OUT=dtype == torch.float32 and (
            not self.given_grads or self.gluon is not None), SPIN_ASM=not interpreting())
        self.dkdv = self.dq = None  # KernelCall, (KernelCall, G, per_chunk, n_m): fitted on the first run
        # delta, the row lse and a Gluon launch's dQ counters and accumulators: one allocation, the counters
        # zeroed by the preprocess
        gluon = self.half_gluon if self.half_gluon is not None else self.scaled_gluon
        self.scratch = Scratch(B * H * Nq, *(() if gluon is None else gluon.scratch))
        self.pre = _preprocess_call(B, H, Nq, BLOCK_D, BLOCK_DV, self.head_b, self.scratch.counters)

    def _run_gluon(self, attr: str, kernel: str, *args) -> tuple[bool, object]:
        """``(True, result)`` of the Gluon launch held in ``self.<attr>`` on ``args``, or ``(False, None)`` when it
        fails on its first call (a Triton release whose Gluon cannot build the kernel): the failure is recorded and
        warned once under ``kernel`` (:func:`.elsa_fwd._gluon_failed`) and the launch dropped, so this plan and the
        later ones run the Triton kernels. A failure after the launch once ran is raised."""
        try:
            result = getattr(self, attr)(*args)
        except Exception as exc:
            if attr in self.gluon_ran:
                raise
            elsa_fwd._gluon_failed(kernel, f"{type(exc).__name__}: {exc}")
            setattr(self, attr, None)
            return False, None
        self.gluon_ran.add(attr)
        return True, result

    def _ordered_buffers(self, dtype, dq=None):
        """``(dq, acc, sem, head_max)`` of a single-pass call from one zeroed allocation: the FP32 dQ accumulator
        (dQ itself when FP32 and not given as ``dq``), the per-query-tile int32 counters behind it (enough for the
        smallest query tile, 16 rows, so tiles fitted to shared memory on the first run still find theirs) and, with
        :data:`HEAD_SCALED` products, the heads' int32 [B * H, 4] largest magnitudes (else the counters stand in,
        never read)."""
        B, H, Nq, Nk, D, Dv = self.dims
        n = B * H * Nq * D
        n_sem = B * H * cdiv(Nq, 16)
        buf = torch.zeros(n + n_sem + 4 * B * H * self.head_b, device=self.device, dtype=torch.float32)
        acc = buf[:n].view(B, H, Nq, D)
        sem = buf[n:n + n_sem].view(torch.int32)
        head_max = buf[n + n_sem:].view(torch.int32) if self.head_b else sem
        if dq is None:
            dq = acc if self.ordered["ACC_IS_OUT"] else torch.empty((B, H, Nq, D), device=self.device, dtype=dtype)
        return dq, acc, sem, head_max

    def _dkdv_call(self, t: KernelTiles) -> KernelCall:
        B, H, Nq, Nk, D, Dv = self.dims
        return KernelCall(_bwd_dkdv_kernel, (cdiv(Nk, t.block_n) * B * self.hkv,),
                          dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, TAIL=t.tail, **self.blocks, **self.flags,
                               **self.ordered),
                          dict(num_warps=t.num_warps, num_stages=t.num_stages))

    def _head_call(self, t: KernelTiles) -> KernelCall:
        B, H = self.dims[:2]
        f = self.flags
        return KernelCall(_bwd_head_kernel, (B * H,),
                          dict(BLOCK_M=t.block_m, TAIL_M=t.tail, BLOCK_N=t.block_n, **self.blocks,
                               PRECISION=f["PRECISION"],
                               IS_CAUSAL=f["IS_CAUSAL"], HAS_BIAS=f["HAS_BIAS"], HAS_MASK=f["HAS_MASK"],
                               EVEN_D=f["EVEN_D"], EVEN_DV=f["EVEN_DV"], DOT_UPCAST=f["DOT_UPCAST"]),
                          dict(num_warps=t.num_warps, num_stages=t.num_stages))

    def _run_head(self, q, k, v, out, grad_out, lse, bias, attn_mask, scale, grads) -> tuple | None:
        """The whole-head kernel's ``(dq, dk, dv, None, None)``, or None where none of its tiles fits this GPU's
        shared memory (warned once; the plan then runs the two kernels)."""
        from triton.runtime.errors import OutOfResources

        B, H, Nq, Nk, D, Dv = self.dims
        dev = self.device
        if grads is not None:
            dq, dk, dv = grads
        else:
            dq = torch.empty((B, H, Nq, D), device=dev, dtype=q.dtype)
            dk = torch.empty((B, H, Nk, D), device=dev, dtype=q.dtype)
            dv = torch.empty((B, H, Nk, Dv), device=dev, dtype=q.dtype)
        args = (q, k, v, out, grad_out, lse, q if bias is None else bias.expand(self.shape4),
                q if attn_mask is None else attn_mask.expand(self.shape4), dq, dk, dv, *self.head_strides,
                *self.g_strides, H, Nq, Nk, D, Dv, float(scale))
        if self.head is not None:
            self.head(*args)
            return dq, dk, dv, None, None
        for t in self.head_tiles:
            call = self._head_call(t)
            try:
                call(*args)
            except OutOfResources:
                continue
            self.head = call
            return dq, dk, dv, None, None
        _head_does_not_fit(self.head_tiles[-1])
        self.head_tiles = []
        return None

    def _dq_call(self, t: KernelTiles):
        B, H, Nq, Nk, D, Dv = self.dims
        n_m = cdiv(Nq, t.block_m)
        n_red = self.R_B * self.R_H
        G = _bias_splits(n_red, n_m * self.B_OUT * self.H_OUT, 4 * self.B_OUT * self.H_OUT * Nq * Nk, self.device,
                         self.bias_splits)
        per_chunk = cdiv(n_red, G)
        G = cdiv(n_red, per_chunk)  # no empty chunks
        call = KernelCall(_bwd_dq_kernel, (n_m * self.B_OUT * self.H_OUT * G,),
                          dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, **self.blocks, WRITE_DB=self.write_db,
                               WRITE_DHS=self.write_dhs, DB_IN_REGS=self.write_db and Nk <= t.block_n,
                               **self.flags),
                          dict(num_warps=t.num_warps, num_stages=t.num_stages))
        return call, G, per_chunk, n_m

    def __call__(self, q, k, v, out, grad_out, lse, bias, add_mask, attn_mask, head_scale, scale, grads=None):
        """The backward of one call; ``grads``: (dq, dk, dv) to write, laid out as the plan's ``grad_strides``
        (a plan built with them needs them), else they are allocated contiguous."""
        B, H, Nq, Nk, D, Dv = self.dims
        dev = self.device
        in_place = (grads is not None and self.half_gluon_given is not None
                    and _grads_tma_legal(grads[1], grads[2]))  # the Gluon fp16 / bf16 backward writes into them
        if grads is not None and not in_place and (self.gluon is not None or self.half_gluon is not None
                                                   or self.scaled_gluon is not None
                                                   or self.ordered["ACC_IS_OUT"]):  # contiguous, then copied
            result = self(q, k, v, out, grad_out, lse, bias, add_mask, attn_mask, head_scale, scale)
            for into, got in zip(grads, result):
                into.copy_(got)
            return (*grads, *result[3:])
        if self.head_tiles:
            result = self._run_head(q, k, v, out, grad_out, lse, bias, attn_mask, scale, grads)
            if result is not None:
                return result
        dq = grads[0] if grads is not None else None
        if self.half_gluon is not None:  # it allocates dQ and its accumulators itself
            acc = sem = head_max = q  # not read
        elif self.scaled_gluon is not None:  # so do its tf32 / fp32 builds, scaling by the heads' magnitudes
            acc = sem = q  # not read
            head_max = torch.zeros(B * H * 4, device=dev, dtype=torch.int32)
        elif self.single_pass or self.gluon is not None:  # the Gluon IEEE kernel adds dQ in order too
            dq, acc, sem, head_max = self._ordered_buffers(q.dtype, dq)
        else:
            if dq is None:  # every element written by the dQ kernel
                dq = torch.empty((B, H, Nq, D), device=dev, dtype=q.dtype)
            acc = sem = dq  # not read
            head_max = torch.zeros(B * H * 4, device=dev, dtype=torch.int32) if self.head_b else dq
        if grads is not None:
            dk, dv = grads[1:]
        else:
            dk = torch.empty((B, self.hkv, Nk, D), device=dev, dtype=q.dtype)
            dv = torch.empty((B, self.hkv, Nk, Dv), device=dev, dtype=q.dtype)
        if self.head_b and self.group > 1:
            _gqa_kv_max(head_max, k, v, B, self.hkv, self.group)
        # preprocess: delta and the row lse (+inf for empty rows), FP32 [B * H * Nq], and a Gluon launch's zeroed
        # dQ counters
        delta, lse_row, counters, accumulators = self.scratch.allocate(dev)
        self.pre(q, out, grad_out, lse, delta, lse_row, *self.pre_fixed, k, v, head_max, *self.pre_tail, counters,
                 self.scratch.counters)
        if self.half_gluon is not None:
            attr, given = ("half_gluon_given", (grads[0],)) if in_place else ("half_gluon", ())
            ran, gluon_dq = self._run_gluon(attr, _GLUON_HALF_BWD, q, k, v, grad_out, delta, lse_row, dk, dv,
                                            float(scale), accumulators, counters, *given)
            if ran:
                return gluon_dq, dk, dv, None, None
            self.half_gluon = self.half_gluon_given = None  # the Triton kernels from here on (warned once)
            dq = grads[0] if grads is not None else torch.empty((B, H, Nq, D), device=dev, dtype=q.dtype)
            acc = sem = dq  # not read (the Triton kernels' two-kernel path: half precision never single-pass)
        if self.scaled_gluon is not None:
            ran, gluon_dq = self._run_gluon("scaled_gluon", self.scaled_key, q, k, v, grad_out, delta, lse_row,
                                            head_max.view(B * H, 4), dk, dv, float(scale), accumulators, counters)
            if ran:
                return gluon_dq, dk, dv, None, None
            # the Triton kernels: the preprocess found the heads' magnitudes into head_max already
            dq, acc, sem, _ = self._ordered_buffers(q.dtype) if self.single_pass else (
                torch.empty((B, H, Nq, D), device=dev, dtype=q.dtype), q, q, None)
        if self.gluon is not None and self._run_gluon("gluon", _GLUON_BWD, q, k, v, grad_out, delta, lse_row, dq, dk,
                                                      dv, sem, float(scale))[0]:
            return dq, dk, dv, None, None
        # absent tensors: q's pointer stands in (never read)
        tensors = (q if bias is None else bias.expand(self.shape4), q if add_mask is None else add_mask,
                   q if attn_mask is None else attn_mask.expand(self.shape4), q if head_scale is None else head_scale)
        scale = float(scale)
        dkdv_args = (q, k, v, grad_out, *tensors, delta, lse_row, dk, dv, dq, acc, sem, head_max, *self.strides,
                     *self.g_strides, H, Nq, Nk, D, Dv, scale, self.n_add, self.group)
        if self.dkdv is not None:
            self.dkdv(*dkdv_args)
        else:
            def run_dkdv(t: KernelTiles):
                call = self._dkdv_call(t)
                call(*dkdv_args)
                self.dkdv = call

            _run_fitting("dkdv" + "+dq" * self.single_pass, self.fit_key, self.cfg.dkdv, self.explicit, run_dkdv)
        if self.single_pass:
            return dq, dk, dv, None, None

        made = {}

        def run_dq(planned):
            call, G, per_chunk, n_m = planned
            # causal: the key tiles after the diagonal are never visited; their dS is 0
            alloc = torch.zeros if self.flags["IS_CAUSAL"] else torch.empty
            db = (alloc((G, self.B_OUT, self.H_OUT, Nq, Nk), device=dev, dtype=torch.float32) if self.write_db
                  else delta)
            dhs = torch.empty((B, H, n_m), device=dev, dtype=torch.float32) if self.write_dhs else delta
            made["db"], made["dhs"] = db, dhs
            call(q, k, v, grad_out, *tensors, delta, lse_row, dq, db, dhs, head_max, *self.strides, *self.g_strides[:3],
                 H, Nq, Nk, D, Dv, scale, self.n_add, self.B_OUT, self.H_OUT, self.R_H, self.R_B * self.R_H, per_chunk,
                 self.group)

        if self.dq is not None:
            run_dq(self.dq)
        else:
            def fit_dq(t: KernelTiles):
                planned = self._dq_call(t)
                run_dq(planned)
                self.dq = planned

            _run_fitting("dq", self.fit_key + (self.write_db, self.write_dhs), self.cfg.dq, self.explicit, fit_dq)
        dbias = None
        if self.write_db:
            db = made["db"]
            db = db.sum(0) if db.shape[0] > 1 else db[0]  # [B_OUT, H_OUT, Nq, Nk], FP32
            if self.db_sum_dims:
                db = db.sum(dim=self.db_sum_dims, keepdim=True)
            # db is now the 4-D grad of the bias's memory; drop the leading dims the bias did not have
            dbias = db.reshape(self.db_shape).to(bias.dtype)
        dhs = made["dhs"].sum(dim=(0, 2)) if self.write_dhs else None
        return dq, dk, dv, dbias, dhs
