"""FP32 operands as FP16 copies scaled per (batch, head) by powers of two: the inputs of the Gluon Hopper kernels'
FP32-class builds (mode fp32's forward, :mod:`.fp32_gluon`; :mod:`.half_gluon_bwd`'s tf32 / fp32 backward).

FP16 keeps TF32's 11 significant bits; what it lacks against FP32 is range. Each head of an operand is multiplied by
the power of two that puts its largest magnitude in ``[2^(T - 1), 2^T)`` (exact; T chosen per operand by the
kernel that reads it) and rounded to FP16: the hi part. For FP32-accurate products the rounding's remainder is
rounded to FP16 as well, the lo part: hi + lo keep 22 significant bits, as 3xTF32's parts do (:mod:`.split16`'s
f16x3 splits per row or column instead). Where the remainder falls in FP16's subnormals its absolute error is at
most 2^-25, i.e. ``2^-(T + 24)`` of the head's largest magnitude: a head keeps FP32-class accuracy relative to its
largest entry, not to each entry (a row 2^-20 times the head's largest keeps fewer bits than IEEE FP32 gives it).

Every kernel here runs under ``TRITON_INTERPRET=1`` (CPU tests check them against float64).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import LOG2E, KernelCall, cdiv
from .elsa_bwd import _tile_and_head
from .split16 import pow2

__all__ = ["head_shift", "scaled_rows", "ForwardOperands", "FORWARD_SCALE_EXPONENT", "P_SPLIT_EXP", "SHIFT_LIMIT",
           "FORWARD_SCALES_ROW"]

# the scaling shifts a head by at most 2^SHIFT_LIMIT either way: products of the heads' multipliers stay in FP32's
# range
SHIFT_LIMIT = 62
# the fp32 forward's q, k and v heads are scaled to below 2^14: the lo parts' subnormal floor then lies 2^-38 under
# each head's largest magnitude; scores (<= 64 * 2^28 at head dim 64) and P V sums stay far inside FP32's range
FORWARD_SCALE_EXPONENT = 14
# P (<= 1) is scaled by 2^15 before its hi / lo split (P <= 1 stays under FP16's 65504), which keeps its lo part out
# of FP16's subnormals down to P ~ 2^-18; the output multiplier undoes it
P_SPLIT_EXP = 15
# FP32 multipliers per head in the forward's Scales rows: the logits' (log2 domain) and the output's
FORWARD_SCALES_ROW = 2


@triton.jit
def head_shift(bits, TARGET: tl.constexpr, LIMIT: tl.constexpr):
    """The exponent s (int32) such that ``2^s`` times a head whose largest magnitude has the FP32 bit pattern
    ``bits`` lies in ``[2^(TARGET - 1), 2^TARGET)``, clamped to ``+-LIMIT``; 0 for an all-zero or non-finite
    head."""
    ex = (bits >> 23) & 255
    shift = tl.minimum(tl.maximum(TARGET - 1 - (ex - 127), -LIMIT), LIMIT)
    return tl.where((bits == 0) | (ex == 255), 0, shift)


@triton.jit
def scaled_rows(X, sxm, sxd, Y, rows, n, offs_d, mult, HEAD_D: tl.constexpr, PARTS: tl.constexpr):
    """Rows ``rows`` (< ``n``) of one head of X (strided, any float dtype) times ``mult``, rounded to FP16 into Y
    (contiguous rows of ``PARTS * HEAD_D``): the hi part in columns ``[0, HEAD_D)``, with ``PARTS = 2`` the lo part
    (the rounding's remainder, rounded) in ``[HEAD_D, 2 HEAD_D)``."""
    ok = (rows < n)[:, None]
    r64 = rows.to(tl.int64)[:, None]  # 64-bit row offsets: a packed projection's row stride times a million rows
    x = tl.load(X + r64 * sxm + offs_d[None, :] * sxd, mask=ok, other=0.0).to(tl.float32) * mult
    hi = x.to(tl.float16)
    y = Y + r64 * (PARTS * HEAD_D) + offs_d[None, :]
    tl.store(y, hi, mask=ok)
    if PARTS == 2:
        tl.store(y + HEAD_D, (x - hi.to(tl.float32)).to(tl.float16), mask=ok)


@triton.jit
def _rows_absmax(X, sxm, sxd, rows, n, offs_d):
    # the largest |x| of rows ``rows`` (< n) of one head, as its FP32 bit pattern (int32; orders as the magnitudes do)
    x = tl.load(X + rows.to(tl.int64)[:, None] * sxm + offs_d[None, :] * sxd, mask=(rows < n)[:, None], other=0.0)
    return tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0).to(tl.int32, bitcast=True)


@triton.jit(do_not_specialize=["H", "Nq", "Nk", "n_rows"])
def _head_max_kernel(Q, K, V, E, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, H, GROUP, Nq, Nk, n_rows,
                     HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each head's largest magnitude of q, k and v, atomically maxed (order-free: reproducible) as FP32 bit patterns
    into E (int32 [B * H, 4], zeroed by the caller; columns q, k, v). 1-D grid cdiv(n_rows, BLOCK_M) * H * B over
    q's H heads, n_rows = max(Nq, Nk); k / v have H / GROUP heads (grouped-query attention): K / V head ``h //
    GROUP``'s maxima go to the row of its first query head ``h - h % GROUP``, whose programs alone read it."""
    t, off_b, off_h, bh = _tile_and_head(n_rows, BLOCK_M, H)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    e = E + bh * 4
    if t * BLOCK_M < Nq:
        tl.atomic_max(e, _rows_absmax(Q + off_b * sqb + off_h * sqh, sqm, sqd, rows, Nq, offs_d))
    if (t * BLOCK_M < Nk) & (off_h % GROUP == 0):
        h_kv = off_h // GROUP
        tl.atomic_max(e + 1, _rows_absmax(K + off_b * skb + h_kv * skh, skn, skd, rows, Nk, offs_d))
        tl.atomic_max(e + 2, _rows_absmax(V + off_b * svb + h_kv * svh, svn, svd, rows, Nk, offs_d))


@triton.jit(do_not_specialize=["H", "Nq", "Nk", "n_rows"])
def _forward_operands_kernel(Q, K, V, E, Q16, K16, V16, Scales, sqb, sqh, sqm, sqd, skb, skh, skn, skd,
                             svb, svh, svn, svd, H, GROUP, Nq, Nk, n_rows, qk_scale, HEAD_D: tl.constexpr,
                             BLOCK_M: tl.constexpr, TARGET: tl.constexpr, LIMIT: tl.constexpr, P_EXP: tl.constexpr):
    """Query head ``bh``'s q times ``2^s_q`` and its K / V head's k, v times ``2^s_k``, ``2^s_v`` (:func:`head_shift`
    of E's magnitudes, TARGET each; K / V head ``h // GROUP``'s from the row of its first query head, which alone
    writes its copies), split into hi and lo FP16 parts in contiguous [B, H, Nq, 2 HEAD_D] / [B, H / GROUP, Nk,
    2 HEAD_D] copies; the first program of each query head writes its Scales row (FP32 [B * H, 2]): ``qk_scale
    2^-(s_q + s_k)`` (the logits' log2-domain multiplier) and ``2^-(s_v + P_EXP)`` (the output's: P enters P V
    scaled by ``2^P_EXP``). Grid as :func:`_head_max_kernel`."""
    t, off_b, off_h, bh = _tile_and_head(n_rows, BLOCK_M, H)
    lead = bh - off_h % GROUP  # the row of the K / V head's first query head
    bh_kv = off_b * (H // GROUP) + off_h // GROUP
    s_q = head_shift(tl.load(E + bh * 4), TARGET, LIMIT)
    s_k = head_shift(tl.load(E + lead * 4 + 1), TARGET, LIMIT)
    s_v = head_shift(tl.load(E + lead * 4 + 2), TARGET, LIMIT)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    if t * BLOCK_M < Nq:
        scaled_rows(Q + off_b * sqb + off_h * sqh, sqm, sqd, Q16 + bh * Nq * 2 * HEAD_D, rows, Nq, offs_d, pow2(s_q),
                    HEAD_D, 2)
    if (t * BLOCK_M < Nk) & (off_h % GROUP == 0):
        h_kv = off_h // GROUP
        scaled_rows(K + off_b * skb + h_kv * skh, skn, skd, K16 + bh_kv * Nk * 2 * HEAD_D, rows, Nk, offs_d,
                    pow2(s_k), HEAD_D, 2)
        scaled_rows(V + off_b * svb + h_kv * svh, svn, svd, V16 + bh_kv * Nk * 2 * HEAD_D, rows, Nk, offs_d,
                    pow2(s_v), HEAD_D, 2)
    if t == 0:
        # each multiplier a product of powers in range (their sum of shifts may not be)
        row = Scales + bh * 2
        tl.store(row, qk_scale * pow2(-s_q) * pow2(-s_k))
        tl.store(row + 1, pow2(-s_v) * pow2(-P_EXP))


_BLOCK_M = 64


class ForwardOperands:
    """The operands of the fp32 Gluon forward (:func:`.fp32_gluon.fp32_attention`) for one call signature.

    Args:
        B, H, Nq, Nk, D: the call's batch, query heads, query rows, keys and head dim (q [B, H, Nq, D], k / v [B,
            h_kv, Nk, D]).
        h_kv: key / value heads (dividing H: grouped-query attention, K / V head ``h // (H / h_kv)`` serving query
            head h); H by default.

    Calling it with ``(q, k, v, scale)`` (float32 CUDA or CPU tensors of those shapes, any strides; ``scale`` the
    logit scale) returns ``(q16, k16, v16, scales)``: contiguous float16 [B, H, Nq, 2 D] / [B, h_kv, Nk, 2 D] copies
    (hi parts in columns ``[0, D)``, lo parts in ``[D, 2 D)``), each head scaled to below
    2^:data:`FORWARD_SCALE_EXPONENT`, and the float32 [B * H, :data:`FORWARD_SCALES_ROW`] rows of each query head's
    logit multiplier (``scale log2(e)`` times the inverse scales of q and of its K / V head's k) and output
    multiplier (the inverse of its v's scale and of P's 2^:data:`P_SPLIT_EXP`). Three launches: zeroing,
    :func:`_head_max_kernel`, :func:`_forward_operands_kernel`.

    Raises:
        ValueError: ``h_kv`` does not divide ``H``.
    """

    __slots__ = ("shape", "h_kv", "max_call", "split_call")

    def __init__(self, B: int, H: int, Nq: int, Nk: int, D: int, h_kv: int | None = None):
        h_kv = H if h_kv is None else h_kv
        if h_kv < 1 or H % h_kv:
            raise ValueError(f"{h_kv} key / value heads do not divide the {H} query heads")
        self.shape = (B, H, Nq, Nk, D)
        self.h_kv = h_kv
        grid = (cdiv(max(Nq, Nk), _BLOCK_M) * B * H,)
        self.max_call = KernelCall(_head_max_kernel, grid, dict(HEAD_D=D, BLOCK_M=_BLOCK_M), dict(num_warps=4))
        self.split_call = KernelCall(_forward_operands_kernel, grid,
                                     dict(HEAD_D=D, BLOCK_M=_BLOCK_M, TARGET=FORWARD_SCALE_EXPONENT, LIMIT=SHIFT_LIMIT,
                                          P_EXP=P_SPLIT_EXP), dict(num_warps=4))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        B, H, Nq, Nk, D = self.shape
        h_kv = self.h_kv
        dev = q.device
        nq, nk = B * H * Nq * 2 * D, B * h_kv * Nk * 2 * D
        ops = torch.empty(nq + 2 * nk, device=dev, dtype=torch.float16)
        q16 = ops[:nq].view(B, H, Nq, 2 * D)
        k16, v16 = ops[nq:nq + nk].view(B, h_kv, Nk, 2 * D), ops[nq + nk:].view(B, h_kv, Nk, 2 * D)
        head_max = torch.zeros((B * H, 4), device=dev, dtype=torch.int32)
        scales = torch.empty((B * H, FORWARD_SCALES_ROW), device=dev, dtype=torch.float32)
        strides = (*q.stride(), *k.stride(), *v.stride())
        group = H // h_kv
        self.max_call(q, k, v, head_max, *strides, H, group, Nq, Nk, max(Nq, Nk))
        self.split_call(q, k, v, head_max, q16, k16, v16, scales, *strides, H, group, Nq, Nk, max(Nq, Nk),
                        float(scale) * LOG2E)
        return q16, k16, v16, scales
