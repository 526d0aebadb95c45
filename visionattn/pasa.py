"""PASA: online pseudo-average shifting attention (PASA paper, Alg. 1): the CPU reference and the kernel's op.

The PASA family has no public function of its own: :func:`visionattn.attention` with ``mode="pasa"`` (or the
``fp16-acc16`` baseline) reaches it through the dense family's backend table, whose Triton row runs
:func:`pasa_kernel` (custom op ``visionattn::pasa_attention`` with a fake implementation while a graph is
recorded; forward only) and whose reference row runs :func:`pasa_attention_reference`.

PASA ("Online Pseudo-average Shifting Attention", Cheng et al.) lets the score
product ``S = Q K^T`` be *accumulated in FP16* without overflowing. Per KV block
of ``n`` keys the key block is multiplied by the shifting matrix (Eq. 10-11)

    M = (I - (beta / n) J) / alpha,        alpha = 1 / scale = sqrt(D),

i.e. ``K'_j = scale * (K_j - beta * mean_block(K))``, so the FP16 product
``S' = Q K'^T`` carries neither the large common bias of the keys nor the
``sqrt(D)`` amplitude. The removed part of each row is the block's
pseudo-average; the online softmax keeps its running max relative to the
running global pseudo-average ``F`` (Eq. 15, Alg. 1 lines 13-20), so the result
is softmax attention in exact arithmetic. ``beta`` comes from the
optimal-accuracy condition (Eq. 16, 20-22, :func:`optimal_beta`).

Deviations from Algorithm 1 (accuracy; both are exact in exact arithmetic):

1. **Recovery from FP32 quantities.** The paper recovers the removed part as
   ``beta / (1 - beta) * rowmean(S')`` from the FP16 product (Theorem 2.1,
   Eq. 13-14). ``beta / (1 - beta) ~ 63.5`` multiplies the FP16 rounding of that
   row mean, a per-(row, block) offset ~5.6x the rounding error of one score
   (the pasa / fp16 RMSE was 2.0-6.2 on the paper's Table 4 cases). Here the
   rounded matrix ``M = scale (a I - b J)`` is inverted exactly instead: per
   block, ``scale * q.k_j = (q.K'_j + R) / a`` with the row's recovery term
   ``R = scale (b / a) q . sum_block k`` (``= f_M rowmean(q K'^T)`` exactly, with
   ``f_M = b n / (a (a - b n))`` the first term of Eq. 20),
   computed in FP32 from the FP16 inputs (one D-long FP32 dot per row and
   block). The recovered logits are then exact up to the FP16 roundings of
   ``K'`` and of the FP16 product, and do not depend on beta satisfying Eq. 16
   (beta still comes from it and sets how much of the key bias leaves the FP16
   product). ``F`` is the running mean of ``R`` (Eq. 15) and scores are kept
   relative to it: ``t = scale q.k_j - F``, as Alg. 1's frame.
2. **Query centering.** Shifting the keys removes the per-row part of the
   scores but not the per-key part ``mu . k_j`` that a common query bias ``mu``
   creates; with uniform U(5, 35) inputs ``|S'|`` reaches ~900 (rms 200; rms 75
   once centred) and the FP16 rounding of the product (ulp 0.25-0.5 there)
   dominated the error (pasa / fp16 RMSE 2.8 with deviation 1 alone). So the queries
   are centred too: ``q' = fl16(q - mu)`` with ``mu = fl16(mean over the queries
   of (batch, head))``, and the per-key term ``c_j = mu . K'_j`` (FP32) is added
   back: ``S' = fl16acc(q' K'^T) + c``. ``mu_d`` is set to 0 in a head dimension
   where centering would enlarge the range (``max |q_d - mu_d| > max |q_d|``), so
   ``|q'_d| <= max_i |q_id|`` and the FP16 product is bounded as in the paper's
   PASA (no new overflow). ``q' + mu = q`` is exact unless ``|q|`` is much
   smaller than ``|mu|`` (then ``q'`` carries one extra FP16 rounding).

What this module emulates (and the Triton kernel :mod:`visionattn.kernels.pasa_fwd` does):

* q, k, v are rounded to FP16 (the caller's dtype may be anything).
* Shift (``shift=True``): with ``b = fl16(beta/n)`` and ``a = fl16(1 - beta/n) + b``
  (the rounded matrix ``M = a I - b J``, Eq. 21/23), ``K' = fl16(scale * (a k - b sum_block k))``
  computed in FP32 and rounded once to FP16. ``n`` is the number of keys in the block
  (the last block may be shorter; it gets its own beta). ``q' = fl16(q - mu)`` as above.
* FP16 score accumulation (:func:`fp16_accumulated_matmul`) of ``q' K'^T``: products of FP16
  numbers are exact in FP32; each 16-wide chunk of the head dimension (one
  tensor-core MMA k-step) is summed in FP32 and added to an FP16 accumulator,
  which is rounded to FP16 (round-to-nearest-even, ``|x| >= 65520 -> inf``)
  after every chunk. The GPU's tensor cores may round the last bit differently
  inside a k-step; the overflow behaviour (an FP16 partial sum out of range is inf) is the same.
* Everything after the product is FP32 (as mode ``fp16``): ``c``, ``R``, ``F``, the
  recovered scores ``t = (S' + c) / a + (R - F_new)``, bias and masks, the running
  max / sum / output; the unnormalized probabilities are rounded to FP16 before
  ``P @ V`` (FP32 accumulation).
* ``shift=False`` (mode ``fp16-acc16``): ``S = fl16acc(Q K^T)`` on the *unscaled*
  keys, then ``scale * S`` in FP32 — plain FlashAttention with FP16 score
  accumulation (the paper's "partially low-precision" allocation, Fig. 2), which
  overflows when ``|q.k| > 65504``.

``beta = 0`` gives ``M = I / alpha`` and switches off the query centering and the
recovery (``R = 0``): plain FP16-accumulation flash attention on the keys pre-scaled
by ``scale`` (the paper: "PASA degrades into FA 2.0"). It equals ``shift=False`` run on
``(q, fl16(scale * k))`` with ``scale=1`` exactly, bit for bit.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .kernels.pasa_math import check_beta as _check_beta
from .kernels._launch import recording
from .kernels.pasa_math import optimal_beta, shift_coefficients

__all__ = ["optimal_beta", "shift_coefficients", "fp16_accumulated_matmul", "shift_keys",
           "query_center", "pasa_attention_reference", "benchmark_inputs", "BENCHMARK_KINDS", "FP16_ACC_CHUNK",
           "DEFAULT_BLOCK", "pasa_kernel", "pasa_kernel_plan", "kernel_unsupported_reason"]

FP16_ACC_CHUNK = 16  # head-dim chunk summed before each FP16 rounding (one MMA k-step)
DEFAULT_BLOCK = 128  # the paper's KV block s2 (and the Triton kernel's BLOCK_N)


def fp16_accumulated_matmul(a: torch.Tensor, b: torch.Tensor, chunk: int = FP16_ACC_CHUNK) -> torch.Tensor:
    """``a @ b^T`` with FP16 accumulation, emulated exactly on any device.

    Products of FP16 values are exact in FP32; each ``chunk``-wide slice of the
    inner dimension is summed in FP32 and added to the FP16 accumulator, which
    is rounded to FP16 after every chunk (so a partial sum beyond 65504 becomes
    inf, as on the tensor cores with ``out_dtype=float16``).

    Args:
        a: [..., M, D] float16.
        b: [..., N, D] float16 (note: rows are the second operand's rows, no transpose needed).
        chunk: inner-dimension chunk per rounding (16 = one FP16 MMA k-step).

    Returns:
        [..., M, N] float16.

    Raises:
        TypeError: ``a`` or ``b`` is not float16.
    """
    if a.dtype != torch.float16 or b.dtype != torch.float16:
        raise TypeError(f"fp16_accumulated_matmul needs float16 operands, got {a.dtype} and {b.dtype}")
    d = a.shape[-1]
    acc = None
    for c0 in range(0, d, chunk):
        part = a[..., c0:c0 + chunk].float() @ b[..., c0:c0 + chunk].float().transpose(-1, -2)
        acc = part.half() if acc is None else (acc.float() + part).half()
    return acc


def shift_keys(k16: torch.Tensor, scale: float, a: float, b: float) -> torch.Tensor:
    """PASA's shifted key block ``K' = K^T M`` (Eq. 11): ``fl16(scale * (a k - b sum_rows k))``.

    Args:
        k16: key block [..., n, D] float16.
        scale, a, b: logit scale and the rounded-matrix coefficients of :func:`shift_coefficients`.

    Returns:
        [..., n, D] float16.
    """
    kf = k16.float()
    return (scale * (a * kf - b * kf.sum(dim=-2, keepdim=True))).half()


def query_center(q16: torch.Tensor) -> torch.Tensor:
    """The query centre ``mu`` of PASA's query centering (module docstring, deviation 2).

    ``mu_d = fl16(mean_i q_id)`` over the queries of each (batch, head), in FP32, except
    ``mu_d = 0`` where ``max_i |q_id - mu_d| > max_i |q_id|`` (centering would enlarge
    the range of that dimension, and with it the bound on the FP16 product).

    Args:
        q16: [..., Nq, D] float16.

    Returns:
        [..., 1, D] float16 (zeros when ``Nq == 0``).
    """
    if q16.shape[-2] == 0:
        return torch.zeros(q16.shape[:-2] + (1, q16.shape[-1]), dtype=torch.float16, device=q16.device)
    mu = torch.mean(q16, dim=-2, keepdim=True, dtype=torch.float32).half()
    lo, hi = (t.float() for t in torch.aminmax(q16, dim=-2, keepdim=True))
    muf = mu.float()
    ok = torch.maximum(hi - muf, muf - lo) <= torch.maximum(hi.abs(), lo.abs())
    return torch.where(ok, mu, torch.zeros_like(mu))


def pasa_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float, shift: bool = True,
    block_size: int = DEFAULT_BLOCK, beta: float | None = None, with_lse: bool = False,
):
    """PASA (``shift=True``) or FP16-score-accumulation (``shift=False``) attention, emulated.

    Follows PASA Algorithm 1 block by block in torch arithmetic, with the FP32
    recovery and the query centering of the module docstring (which also says
    exactly what is rounded where); the Triton kernel
    :func:`visionattn.kernels.pasa_fwd.pasa_attention` does the same on the GPU.

    Args:
        q: [B, H, Nq, D]; k: [B, H, Nk, D]; v: [B, H, Nk, Dv]; any float dtype
            (rounded to float16 here), any device, any strides.
        bias: None or additive float bias broadcastable to [B, H, Nq, Nk], added after the recovery.
        attn_mask: None or bool (True = attend) broadcastable to [B, H, Nq, Nk].
        is_causal: top-left causal mask (key j visible to query i iff j <= i).
        scale: logit scale (``1/sqrt(D)`` for standard attention).
        shift: True = PASA; False = no shift (mode ``fp16-acc16``; may return inf/NaN).
        block_size: keys per KV block (the size of M).
        beta: shift strength in [0, 1); None = :func:`optimal_beta` of each block's size.
        with_lse: also return the per-row log-sum-exp of the recovered logits, ``F + m + log l`` [B, H, Nq]
            float32 (-inf for a fully masked row), what :mod:`visionattn.distributed` merges shards with.

    Returns:
        [B, H, Nq, Dv] float32 (and the LSE with ``with_lse``). Fully masked rows are zeros.

    Raises:
        ValueError: ``beta`` outside [0, 1), ``block_size < 1``.
    """
    _check_beta(beta)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}; expected a positive int")
    q16, k16, v16 = q.half(), k.half(), v.half()
    if bias is not None:
        bias = torch.broadcast_to(bias, q.shape[:-1] + (k.shape[-2],))
    if attn_mask is not None:
        attn_mask = torch.broadcast_to(attn_mask, q.shape[:-1] + (k.shape[-2],))
    lead, nq, nk = q.shape[:-1], q.shape[-2], k.shape[-2]
    dev = q.device
    m = torch.full(lead, float("-inf"), device=dev)
    l = torch.zeros(lead, device=dev)
    acc = torch.zeros(lead + (v.shape[-1],), device=dev)
    F = torch.zeros(lead, device=dev)  # running global pseudo-average: the mean of the blocks' R (Eq. 15)
    recover = shift and beta != 0  # beta = 0: M = scale * I, no centering, R = 0 (plain FP16 accumulation)
    if recover:
        mu = query_center(q16)  # deviation 2
        qs = (q16.float() - mu.float()).half()
        q32 = q16.float()
    for j, start in enumerate(range(0, nk, block_size), start=1):
        stop = min(start + block_size, nk)
        kb = k16[..., start:stop, :]
        if not shift:
            t = fp16_accumulated_matmul(q16, kb).float() * scale
            m_old = m
        elif not recover:
            t = fp16_accumulated_matmul(q16, shift_keys(kb, scale, 1.0, 0.0)).float()
            m_old = m
        else:
            a, b, _ = shift_coefficients(stop - start, beta)
            kp = shift_keys(kb, scale, a, b)  # Alg. 1 line 6
            sp = fp16_accumulated_matmul(qs, kp).float()  # line 11, FP16 accumulation
            c = (mu.float() * kp.float()).sum(dim=-1).unsqueeze(-2)  # per-key term mu . K'_j (FP32)
            w = float(scale * b / a) * kb.float().sum(dim=-2)  # [..., D]: scale (b / a) sum_block k (FP32)
            R = (q32 * w.unsqueeze(-2)).sum(dim=-1)  # the block's removed pseudo-average (line 13, exact)
            F_new = F + (R - F) / j  # line 14 / Eq. 15
            t = (sp + c) * float(1.0 / a) + (R - F_new).unsqueeze(-1)  # scale q.k_j - F_new
            m_old = m + (F - F_new)  # lines 15-16: previous max in the new frame
            F = F_new
        if bias is not None:
            t = t + bias[..., start:stop].float()
        if attn_mask is not None:
            t = t.masked_fill(~attn_mask[..., start:stop], float("-inf"))
        if is_causal:
            kj = torch.arange(start, stop, device=dev)
            qi = torch.arange(nq, device=dev).unsqueeze(-1)
            t = t.masked_fill(kj > qi, float("-inf"))
        m_new = torch.maximum(m_old, t.amax(dim=-1))
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m_old - m_safe)
        p = torch.exp(t - m_safe.unsqueeze(-1))
        l = alpha * l + p.sum(dim=-1)
        acc = alpha.unsqueeze(-1) * acc + p.half().float() @ v16[..., start:stop, :].float()
        m = m_new
    den = l.unsqueeze(-1)  # 0 only for fully masked rows; NaN/inf (an overflow) propagates
    out = torch.where(den == 0, torch.zeros_like(acc), acc / torch.where(den == 0, torch.ones_like(den), den))
    if not with_lse:
        return out
    # m is kept relative to the running pseudo-average F: the logits' log-sum-exp is F + m + log l
    lse = torch.where(l == 0, torch.full_like(l, float("-inf")), F + m + torch.log(torch.where(l == 0, 1.0, l)))
    return out, lse


# ----------------------------------------------------------------------------------------------
# The paper's random benchmark inputs (Sec. 3.1, Eq. 17-18) and a resonance case (Sec. 3.3.2).
# ----------------------------------------------------------------------------------------------

BENCHMARK_KINDS = ("uniform", "hybrid", "resonance-aligned", "resonance-opposed")


def benchmark_inputs(kind: str, x0: float, am: float, shape=(1, 16, 1280, 128), *, seed: int = 0,
                     device="cpu", period: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (float32) for the PASA paper's random benchmarks.

    * ``uniform``: ``U(x0 - am, x0 + am)`` (Eq. 17), for q, k and v.
    * ``hybrid``: ``N(x0, 1) + N(0, am^2) * Bernoulli(0.001)`` (Eq. 18), for q, k and v.
    * ``resonance-aligned`` / ``resonance-opposed``: q and k carry the same periodic
      pattern ``am * sin(2 pi d / period)`` along the head dimension d, in phase
      (0 degrees: large positive scores) or shifted by 180 degrees (large negative
      scores), with per-token amplitude jitter ``1 + 0.05 N(0,1)``, plus
      ``x0 + N(0, 1)`` noise; v ~ N(0, 1). This is the resonance the paper finds
      between Q and K in Qwen2 and SVD (Fig. 6-7).

    Args:
        kind: one of :data:`BENCHMARK_KINDS`.
        x0: mean value; am: amplitude (uniform half-width, outlier std, or resonance amplitude).
        shape: (B, H, N, D) of q, k and v.
        seed: generator seed (CPU generator; tensors are then moved to ``device``).
        period: resonance period along the head dimension.

    Raises:
        ValueError: unknown ``kind``.
    """
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)

    def normal(*s):
        return torch.randn(*s, generator=g)

    if kind == "uniform":
        q, k, v = (x0 + am * (2 * torch.rand(shape, generator=g) - 1) for _ in range(3))
    elif kind == "hybrid":
        def one():
            outl = torch.bernoulli(torch.full(shape, 0.001), generator=g)
            return x0 + normal(*shape) + am * normal(*shape) * outl
        q, k, v = one(), one(), one()
    elif kind in ("resonance-aligned", "resonance-opposed"):
        d = torch.arange(shape[-1], dtype=torch.float32)
        wave = torch.sin(2 * math.pi * d / period)
        phase = 1.0 if kind == "resonance-aligned" else -1.0

        def pattern(sign):
            jitter = 1 + 0.05 * normal(*shape[:-1], 1)
            return sign * am * jitter * wave + x0 + normal(*shape)
        q, k, v = pattern(1.0), pattern(phase), normal(*shape)
    else:
        raise ValueError(f"kind={kind!r}; expected one of {BENCHMARK_KINDS}")
    return q.to(device), k.to(device), v.to(device)


# ----------------------------------------------------------------------------- the kernel's op
# (kernels/pasa_fwd.py is imported inside these functions: importing Triton is slow and CPU calls never need it)
@torch.library.custom_op("visionattn::pasa_attention", mutates_args=())
def _pasa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
             attn_mask: Optional[torch.Tensor], is_causal: bool, scale: float, shift: bool,
             out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    from .kernels import pasa_fwd

    return pasa_fwd.pasa_forward(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)


@_pasa_op.register_fake
def _(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype):
    B, H, Nq = q.shape[:3]
    return q.new_empty((B, Nq, H, v.shape[3]), dtype=out_dtype or torch.float16).transpose(1, 2)


def kernel_unsupported_reason(q, k, v, bias, attn_mask) -> str | None:
    """Why the PASA kernel cannot run this call (:func:`visionattn.kernels.pasa_fwd.pasa_unsupported_reason`), or
    None."""
    from .kernels.pasa_fwd import pasa_unsupported_reason

    return pasa_unsupported_reason(q, k, v, bias, attn_mask)


def pasa_kernel(q, k, v, bias, attn_mask, is_causal: bool, scale: float, shift: bool,
                out_dtype: torch.dtype | None) -> torch.Tensor:
    """PASA (``shift``) / FP16-accumulation forward on the kernel: q, k [B, H, N, D], v [B, H, Nk, Dv] float16,
    validated; bias / attn_mask [B, H, Nq, Nk] views or None. Returns [B, H, Nq, Dv] in ``out_dtype``. While a graph
    is recorded, the custom op ``visionattn::pasa_attention``."""
    if recording():
        return _pasa_op(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)
    from .kernels import pasa_fwd

    return pasa_fwd.pasa_forward(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)


def pasa_kernel_plan(q, k, v, bias, attn_mask, is_causal: bool, scale: float, shift: bool, out_dtype: torch.dtype):
    """Eager: ``(plan, out)`` of a PASA call (:func:`visionattn.kernels.pasa_fwd.plan_for`; plan None when empty);
    the dense family keeps the plan in its call cache."""
    from .kernels import pasa_fwd

    return pasa_fwd.plan_for(q, k, v, bias, attn_mask, is_causal, scale, shift, out_dtype)
