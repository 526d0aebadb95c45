"""Split-FP16 products ("f16x3" / "f16x1"): FP32-accurate and TF32-class matmuls on FP16 tensor cores.

Each FP32 operand x is scaled by an exact power of two so its largest entry lies in
[2^SPLIT_EXP, 2^(SPLIT_EXP+1)) = [2^14, 2^15), then split x = hi + lo with hi = fp16(x),
lo = fp16(x - hi). hi and lo keep 11 significant bits each, as TF32's hi and lo do in 3xTF32,
so hi*hi + hi*lo + lo*hi (FP32 accumulation) is as accurate as 3xTF32, and hi*hi alone is
TF32-class; FP16 tensor cores run at twice TF32's rate. The scaling keeps every part inside
FP16's range: per row for q and k (undone on the score's rows/columns), a running per-column
exponent for V (undone like the softmax max), 2^15 for P <= 1 (f16x1 takes it inside the exp2).

Entries down to 2^-14 of their row's (column's) largest keep all 22 bits; smaller ones keep
fewer (their lo part turns FP16-subnormal). With one q channel 2^r times the others (and the
matching k channel 2^-r): rel err 3.0e-7 at r=16, 9.1e-7 at 20, 3.5e-6 at 22, 1.4e-5 at 24
(3xTF32: 2.9e-7 throughout). Rows spanning more than ~2^20 want fp32-ieee (or tf32x3).

Used by the dense (:mod:`.elsa_fwd`) and window (:mod:`.window_fwd`) forward kernels and, for every FP32
product of the ``fp32`` / ``tf32`` backward, by :func:`.elsa_bwd._mm`.
"""
import triton
import triton.language as tl

__all__ = ["SPLIT_EXP", "exponent", "pow2", "split_rows", "split_cols", "split_scores", "fold_pv", "pv_unscale"]

SPLIT_EXP = tl.constexpr(14)


@triton.jit
def exponent(x):
    """floor(log2 x) of FP32 x >= 0 from its exponent bits, clamped below to SPLIT_EXP - 126 (so
    that 2^(SPLIT_EXP - e) and 2^(e - SPLIT_EXP) stay normal; 0 -> the clamp)."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.maximum(e, SPLIT_EXP - 126)


@triton.jit
def pow2(e):
    """2^e as FP32 for integer e (int32), exact; e clamped to the normal range [-126, 127]."""
    e = tl.minimum(tl.maximum(e, -126), 127)
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def split_rows(x):
    """Row-scaled FP16 split of FP32 ``x`` [R, C]: (hi, lo, inv) with x = (hi + lo) * inv[:, None]."""
    e = exponent(tl.max(tl.abs(x), 1))
    xs = x * pow2(-e + SPLIT_EXP)[:, None]
    hi = xs.to(tl.float16)
    lo = (xs - hi.to(tl.float32)).to(tl.float16)
    return hi, lo, pow2(e - SPLIT_EXP)


@triton.jit
def split_cols(x, e):
    """FP16 split of FP32 ``x`` [R, C] with column exponents ``e`` [C] (int32, >= every |x| exponent).

    Returns (hi, lo) with ``x * 2^(SPLIT_EXP - e) = hi + lo`` (columns scaled into (-2^15, 2^15)).
    """
    xs = x * pow2(-e + SPLIT_EXP)[None, :]
    hi = xs.to(tl.float16)
    lo = (xs - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


@triton.jit
def split_scores(q_hi, q_lo, k_hi, k_lo, PREC: tl.constexpr):
    """Scaled scores from the FP16 parts: lo_q hi_k^T + hi_q lo_k^T + hi_q hi_k^T (f16x3, small terms
    first) or hi_q hi_k^T (f16x1), FP32 accumulation, [M, N]. The caller undoes the row/column scales."""
    kt = tl.trans(k_hi)
    if PREC == "f16x3":
        s = tl.dot(q_lo, kt)
        s = tl.dot(q_hi, tl.trans(k_lo), s)
        s = tl.dot(q_hi, kt, s)
    else:
        s = tl.dot(q_hi, kt)
    return s


@triton.jit
def _pv(p, v_hi, v_lo):
    """2^15 P @ V_scaled, f16x3: p_lo v_hi + p_hi v_lo + p_hi v_hi, FP32, summed apart from any accumulator."""
    ps = p * 32768.0
    p_hi = ps.to(tl.float16)
    o = tl.dot((ps - p_hi.to(tl.float32)).to(tl.float16), v_hi)
    o = tl.dot(p_hi, v_lo, o)
    return tl.dot(p_hi, v_hi, o)


@triton.jit
def fold_pv(acc, alpha, v_exp, p, v, PREC: tl.constexpr, P_SCALED: tl.constexpr, LAZY_V: tl.constexpr):
    """``acc * alpha + P V`` with V split per column; returns (acc, v_exp).

    ``acc`` [M, DV] is held scaled by 2^(SPLIT_EXP - v_exp + 15) per column, ``v_exp`` [DV] (int32)
    being the largest V exponent seen so far in each column (start: SPLIT_EXP - 126); a larger one
    rescales ``acc`` like the softmax max does. ``LAZY_V``: only when some exponent grew (a branch on a
    reduction: over long sequences the exponents settle after a few tiles and the multiply per
    accumulator entry is then skipped; over few tiles the reduction costs more than it saves).
    ``P_SCALED``: ``p`` already carries the 2^15 (f16x1 shifts its exp2 argument by 15); else it is
    multiplied in here. f16x3 sums this tile's product apart and adds it once: FP16 MMAs accumulating
    into ``acc`` tile after tile make the error grow with N (docs/tuning.md: f16x3 sums each tile's P V
    apart and adds it once). f16x1 (TF32-class anyway) accumulates in the MMA.
    """
    e_new = tl.maximum(v_exp, exponent(tl.max(tl.abs(v), 0)))
    if LAZY_V:
        acc = acc * alpha[:, None]
        if tl.max(e_new - v_exp, 0) > 0:
            acc = acc * pow2(v_exp - e_new)[None, :]
    else:
        acc = acc * alpha[:, None] * pow2(v_exp - e_new)[None, :]
    v_hi, v_lo = split_cols(v, e_new)
    if PREC == "f16x3":
        acc += _pv(p, v_hi, v_lo)
    elif P_SCALED:
        acc = tl.dot(p.to(tl.float16), v_hi, acc)
    else:
        acc = tl.dot((p * 32768.0).to(tl.float16), v_hi, acc)
    return acc, e_new


@triton.jit
def pv_unscale(v_exp):
    """[DV] factors undoing the V (per column) and P (2^15) scales of a :func:`fold_pv` accumulator."""
    return pow2(v_exp - SPLIT_EXP) * (1.0 / 32768.0)
