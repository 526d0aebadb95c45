"""Ragged (variable-length) ELSA backward: gradients of packed ``cu_seqlens`` attention (FlashAttention-2, Alg. 2).

Layout as :mod:`.varlen_fwd` (FlashAttention's ``flash_attn_varlen_func`` convention): ``q`` [total_q, H, D],
``k`` [total_k, H, D], ``v`` [total_k, H, Dv], sequence ``s`` owning query rows ``cu_seqlens_q[s] :
cu_seqlens_q[s + 1]`` and key rows ``cu_seqlens_k[s] : cu_seqlens_k[s + 1]``. Per sequence and head the math is
the dense backward's (:mod:`.elsa_bwd`), recomputing the probabilities from the forward's saved log-sum-exp:

    P_ij    = exp(scale q_i . k_j - lse_i)    (j visible to i: same sequence; causal: j <= i within it)
    delta_i = sum_d dO_id O_id
    dV_j    = sum_i P_ij dO_i
    dS_ij   = P_ij (dO_i . v_j - delta_i)
    dQ_i    = scale sum_j dS_ij k_j,   dK_j = scale sum_i dS_ij q_i

Three kernels, no atomics, so every gradient is bit-for-bit reproducible:

* ``delta`` and the row ``lse`` (``+inf`` for rows without keys, so their P and gradients are exactly 0) by the
  dense :func:`.elsa_bwd._bwd_preprocess_kernel` itself, launched as the dense backward launches it
  (:func:`.elsa_bwd.preprocess_launch`): both are per row, independent of the sequences, so the packed rows are one
  batch entry of ``total_q`` rows.
* :func:`_varlen_dkdv_kernel`: one program per (key tile, head, sequence) on ``cdiv(max_seqlen_k, BLOCK_N) * H *
  n_seq`` programs holds ``K_j, V_j`` and streams its sequence's query tiles through the dense kernel's
  :func:`.elsa_bwd._dkdv_tile` (causal: from the diagonal on).
* :func:`_varlen_dq_kernel`: one program per (query tile, head, sequence) on ``cdiv(max_seqlen_q, BLOCK_M) * H *
  n_seq`` programs holds ``Q_i, dO_i`` and streams the key tiles through :func:`.elsa_bwd._dq_tile`.

Programs whose tile starts past their sequence's length return at once (the forward's max-seqlen grid: no
host-side tile table, no device-to-host read of the offsets). A sequence with 0 queries gets zero dK / dV rows
(its key programs stream no query tile); one with 0 keys gets zero dQ rows. Every row of dQ / dK / dV is written
by exactly one program, so the outputs are allocated uninitialised.

Modes (products and accumulation exactly as the dense backward, :data:`.elsa_bwd.BWD_MODES`): ``fp32``
(split-FP16 f16x3), ``fp32-ieee`` (FP32 FMA), ``tf32`` (split-FP16 hi parts, f16x1), ``fp16`` / ``bf16`` (half
operands, ``P`` and ``dS`` rounded to the input dtype before their products, FP32 accumulation). The per-head
right-operand scales of the dense kernels (:data:`.elsa_bwd.HEAD_SCALED`: tf32's f16x1) are one per head over
the whole packed batch: the preprocess finds each head's largest magnitudes over every sequence's rows. Tiles:
:func:`.elsa_bwd.get_config`'s, shrunk on out-of-shared-memory as the dense launcher does.

Entry point: :func:`varlen_backward`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import backward_operands, cdiv, head_blocks, interpreting, launch
from .elsa_bwd import (BWD_MODES, HEAD_SCALED, MAX_HEAD_DIM, BwdConfig, KernelTiles, _bwd_preprocess_kernel,
                       _dkdv_query_tiles, _dkdv_tile, _dq_tile, _head_exponents, _run_fitting, get_config,
                       preprocess_launch, product_flags)
from .elsa_fwd import key_tiles, load_kv_tile

__all__ = ["varlen_backward"]


@triton.jit
def _seq_tile(CuX, n_tiles, BLOCK: tl.constexpr, H):
    """(tile start, head, sequence, first row, length) of this program in a 1-D grid of n_tiles * H * n_seq
    programs; tiles of one (sequence, head) are adjacent."""
    pid = tl.program_id(0)
    sh = pid // n_tiles
    seq = sh // H
    start = tl.load(CuX + seq)
    return (pid % n_tiles) * BLOCK, (sh % H).to(tl.int64), seq, start.to(tl.int64), tl.load(CuX + seq + 1) - start


@triton.jit(do_not_specialize=["H", "total_q", "n_tiles"])
def _varlen_dkdv_kernel(Q, K, V, DO, Delta, LseRow, CuQ, CuK, DK, DV, E,
                        sqt, sqh, sqd, skt, skh, skd, svt, svh, svd, sdt, sdh, sdd,
                        H, total_q, n_tiles, D, Dv, scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr,
                        EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_UPCAST: tl.constexpr,
                        GRAD_PRECISION: tl.constexpr, HEAD_B: tl.constexpr):
    """dK, dV of one key tile of one (sequence, head): ``dV_j = sum_i P_ij dO_i``, ``dK_j = scale sum_i dS_ij q_i``
    over the sequence's query tiles, in the dense kernel's transposed ([keys, queries]) orientation.

    Delta / LseRow: FP32 [H, total_q]. DK [total_k, H, D] / DV [total_k, H, Dv] contiguous, in the input dtype.
    E: with HEAD_B, the heads' largest magnitudes, int32 [H, 4] (:func:`.elsa_bwd._head_exponents`).
    Keys past the sequence's end load as 0 and only reach their own (unstored) rows; queries past it read
    ``lse = +inf`` and dO = 0, so their P and dS are 0.
    """
    start_n, off_h, seq, k_start, Lk = _seq_tile(CuK, n_tiles, BLOCK_N, H)
    if start_n >= Lk:
        return
    q_start = tl.load(CuQ + seq).to(tl.int64)
    Lq = tl.load(CuQ + seq + 1) - tl.load(CuQ + seq)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = start_n + tl.arange(0, BLOCK_N)
    col_ok = cols < Lk
    cols64 = cols.to(tl.int64)
    k = load_kv_tile(K + (k_start + cols64[:, None]) * skt + off_h * skh + offs_d[None, :] * skd,
                     col_ok, offs_d, D, True, EVEN_D)
    v = load_kv_tile(V + (k_start + cols64[:, None]) * svt + off_h * svh + offs_dv[None, :] * svd,
                     col_ok, offs_dv, Dv, True, EVEN_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    q_base = Q + q_start * sqt + off_h * sqh
    do_base = DO + q_start * sdt + off_h * sdh
    row_base = off_h * total_q + q_start
    e_q, e_k, e_v, e_do = _head_exponents(E, off_h, HEAD_B)

    lo, mid, n_m = _dkdv_query_tiles(start_n, Lq, BLOCK_M, BLOCK_N, IS_CAUSAL)
    # no bias / masks: their pointers (Q, never read) and strides (0) are placeholders
    for t in range(lo, mid):
        dk, dv, _ = _dkdv_tile(dk, dv, k, v, q_base, do_base, Q, Q, Q, LseRow + row_base, Delta + row_base,
                            t * BLOCK_M, offs_m, offs_d, offs_dv, cols, col_ok, Lq, D, Dv, sqt, sqd, sdt, sdd,
                            0, 0, 0, 0, 0, 0, scale, True, False, False, False, EVEN_D, EVEN_DV, PRECISION,
                            GRAD_PRECISION, DOT_UPCAST, e_q, e_do, HEAD_B)
    for t in range(mid, n_m):
        dk, dv, _ = _dkdv_tile(dk, dv, k, v, q_base, do_base, Q, Q, Q, LseRow + row_base, Delta + row_base,
                            t * BLOCK_M, offs_m, offs_d, offs_dv, cols, col_ok, Lq, D, Dv, sqt, sqd, sdt, sdd,
                            0, 0, 0, 0, 0, 0, scale, False, False, False, False, EVEN_D, EVEN_DV, PRECISION,
                            GRAD_PRECISION, DOT_UPCAST, e_q, e_do, HEAD_B)
    dk = dk * scale
    rows_out = (k_start + cols64[:, None]) * H + off_h
    tl.store(DK + rows_out * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=col_ok[:, None] & (offs_d < D)[None, :])
    tl.store(DV + rows_out * Dv + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv < Dv)[None, :])


@triton.jit(do_not_specialize=["H", "total_q", "n_tiles"])
def _varlen_dq_kernel(Q, K, V, DO, Delta, LseRow, CuQ, CuK, DQ, E,
                      sqt, sqh, sqd, skt, skh, skd, svt, svh, svd, sdt, sdh, sdd,
                      H, total_q, n_tiles, D, Dv, scale,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_UPCAST: tl.constexpr,
                      GRAD_PRECISION: tl.constexpr, HEAD_B: tl.constexpr):
    """dQ of one query tile of one (sequence, head): ``dQ_i = scale sum_j dS_ij k_j`` over the sequence's key
    tiles (causal: up to the diagonal). DQ [total_q, H, D] contiguous, in the input dtype."""
    start_m, off_h, seq, q_start, Lq = _seq_tile(CuQ, n_tiles, BLOCK_M, H)
    if start_m >= Lq:
        return
    k_start = tl.load(CuK + seq).to(tl.int64)
    Lk = tl.load(CuK + seq + 1) - tl.load(CuK + seq)
    rows = start_m + tl.arange(0, BLOCK_M)
    row_ok = rows < Lq
    rows64 = rows.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_kv_tile(Q + (q_start + rows64[:, None]) * sqt + off_h * sqh + offs_d[None, :] * sqd,
                     row_ok, offs_d, D, True, EVEN_D)
    do = load_kv_tile(DO + (q_start + rows64[:, None]) * sdt + off_h * sdh + offs_dv[None, :] * sdd,
                      row_ok, offs_dv, Dv, True, EVEN_DV).to(q.dtype)
    row_base = off_h * total_q + q_start
    lse = tl.load(LseRow + row_base + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + row_base + rows, mask=row_ok, other=0.0)
    k_base = K + k_start * skt + off_h * skh
    v_base = V + k_start * svt + off_h * svh
    e_q, e_k, e_v, e_do = _head_exponents(E, off_h, HEAD_B)

    n_full, n_kv = key_tiles(start_m, Lk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the head-scale sums are not written (WRITE_DHS = False); no bias / masks / dBias: placeholders
    hs = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(0, n_full):
        dq, _, _, _, _, _ = _dq_tile(dq, hs, hs, hs, hs, q, do, lse, delta, k_base, v_base, Q, Q, Q, Q,
                                  t * BLOCK_N, rows, row_ok, offs_n, offs_d, offs_dv, Lk, D, Dv, skt, skd, svt,
                                  svd, 0, 0, 0, 0, 0, 0, False, scale, False, IS_CAUSAL, False, False, False, False,
                                  False, EVEN_D, EVEN_DV, PRECISION, GRAD_PRECISION, DOT_UPCAST, e_k, e_v, HEAD_B)
    for t in range(n_full, n_kv):
        dq, _, _, _, _, _ = _dq_tile(dq, hs, hs, hs, hs, q, do, lse, delta, k_base, v_base, Q, Q, Q, Q,
                                  t * BLOCK_N, rows, row_ok, offs_n, offs_d, offs_dv, Lk, D, Dv, skt, skd, svt,
                                  svd, 0, 0, 0, 0, 0, 0, False, scale, True, IS_CAUSAL, False, False, False, False,
                                  False, EVEN_D, EVEN_DV, PRECISION, GRAD_PRECISION, DOT_UPCAST, e_k, e_v, HEAD_B)
    dq = dq * scale
    tl.store(DQ + ((q_start + rows64[:, None]) * H + off_h) * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d < D)[None, :])


# --------------------------------------------------------------------------- launcher

def _check(q, k, v, out, grad_out, lse, cu_seqlens_q, cu_seqlens_k, mode):
    if mode not in BWD_MODES:
        raise ValueError(f"mode={mode!r} has no backward kernel; expected one of {list(BWD_MODES)}")
    dtype = BWD_MODES[mode][0]
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("grad_out", grad_out), ("lse", lse),
                    ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}; q is on {q.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 3 dims [total, H, D]")
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; mode {mode!r} computes in {dtype} (cast first)")
    total_q, H, D = q.shape
    total_k, Dv = k.shape[0], v.shape[2]
    if k.shape[1:] != (H, D):
        raise ValueError(f"k has shape {tuple(k.shape)}; expected [total_k, {H}, {D}] for q {tuple(q.shape)}")
    if v.shape[:2] != (total_k, H):
        raise ValueError(f"v has shape {tuple(v.shape)}; expected [{total_k}, {H}, Dv]")
    if max(D, Dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dim {max(D, Dv)} > {MAX_HEAD_DIM}")
    for name, t in (("out", out), ("grad_out", grad_out)):
        if tuple(t.shape) != (total_q, H, Dv):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [{total_q}, {H}, {Dv}]")
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; expected a floating dtype")
    if tuple(lse.shape) != (H, total_q) or lse.dtype != torch.float32:
        raise ValueError(f"lse has shape {tuple(lse.shape)} and dtype {lse.dtype}; expected float32 "
                         f"[{H}, {total_q}] (the forward's)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] != cu_seqlens_q.shape[0]:
            raise ValueError(f"{name} must be int32 [n_seq + 1] like cu_seqlens_q, got {cu.dtype} "
                             f"{tuple(cu.shape)}")


def varlen_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, is_causal: bool, scale: float, mode: str, *, config: BwdConfig | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of packed ragged attention (:func:`.varlen_fwd.varlen_forward`) by the deterministic kernels.

    Args:
        q: [total_q, H, D] in the mode's compute dtype (float32 for ``fp32`` / ``fp32-ieee`` / ``tf32``, float16
            for ``fp16``, bfloat16 for ``bf16``); any strides (read in place).
        k: [total_k, H, D]; v: [total_k, H, Dv]; same dtype and device. D, Dv in 1..256.
        out: the forward output [total_q, H, Dv], any float dtype and strides.
        grad_out: dL/d out, [total_q, H, Dv], any float dtype (rounded to the compute dtype) and strides.
        lse: float32 [H, total_q], the forward's natural-log log-sum-exp per row (``-inf`` for a row without
            keys: its gradients are exactly 0); any strides.
        cu_seqlens_q, cu_seqlens_k: int32 [n_seq + 1] offsets on q's device, validated by the caller
            (:func:`visionattn.varlen.validate_varlen_inputs`; their values are not read here).
        max_seqlen_q, max_seqlen_k: bounds of the per-sequence lengths (they size the grids).
        is_causal: top-left aligned causal mask per sequence (key j visible to query i iff j <= i).
        scale: the logit scale; mode: ``fp32``, ``fp32-ieee``, ``tf32``, ``fp16`` or ``bf16``.
        config: tile override (tests, tools); None = :func:`.elsa_bwd.get_config`'s.

    Returns:
        ``(dq, dk, dv)``: [total_q, H, D], [total_k, H, D], [total_k, H, Dv], contiguous, in q's dtype (FP32
        accumulation); zeros without launching for an empty call.

    Raises:
        ValueError: unknown mode, mismatched shapes or devices (naming the argument), head dim > 256, offsets not
            int32 [n_seq + 1], lse not float32 [H, total_q].
        TypeError: a non-tensor argument; q / k / v not in the mode's compute dtype; a non-float out / grad_out.
    """
    _check(q, k, v, out, grad_out, lse, cu_seqlens_q, cu_seqlens_k, mode)
    q, k, v, out, grad_out = backward_operands(q, k, v, out, grad_out)
    dtype, precision = BWD_MODES[mode]
    total_q, H, D = q.shape
    total_k, Dv = k.shape[0], v.shape[2]
    n_seq = cu_seqlens_q.shape[0] - 1
    empty = total_q == 0 or total_k == 0 or H == 0 or Dv == 0 or n_seq <= 0 or max_seqlen_q <= 0 \
        or max_seqlen_k <= 0
    alloc = torch.zeros if empty else torch.empty
    dq = alloc((total_q, H, D), device=q.device, dtype=q.dtype)
    dk = alloc((total_k, H, D), device=q.device, dtype=q.dtype)
    dv = alloc((total_k, H, Dv), device=q.device, dtype=q.dtype)
    if empty:
        return dq, dk, dv
    cfg = config or get_config(mode, D, Dv)
    BLOCK_D, BLOCK_DV = head_blocks(D, Dv)

    # delta and the row lse: per row, so the packed rows are one batch entry [1, H, total_q] of the dense kernel
    delta = torch.empty((H, total_q), device=q.device, dtype=torch.float32)
    lse_row = torch.empty_like(delta)
    so, sd = out.stride(), grad_out.stride()
    # HEAD_SCALED products: each head's largest magnitudes over the whole packed batch (one batch entry of
    # total_q query rows and total_k key rows), int32 [H, 4]
    head_b = precision in HEAD_SCALED
    head_max = torch.zeros(H * 4, device=q.device, dtype=torch.int32) if head_b else delta  # delta: never read
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    grid, constexprs, options = preprocess_launch(1, H, total_q, BLOCK_D, BLOCK_DV, head_b)
    launch(_bwd_preprocess_kernel, grid,
           (q, out, grad_out, lse, delta, lse_row, 0, so[1], so[0], so[2], 0, sd[1], sd[0], sd[2],
            0, *lse.stride(), H, total_q, Dv, k, v, head_max, 0, sq[1], sq[0], sq[2], 0, sk[1], sk[0], sk[2],
            0, sv[1], sv[0], sv[2], total_k, D, delta, 0), constexprs, options)

    strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride())
    flags = dict(BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, **product_flags(precision), IS_CAUSAL=bool(is_causal),
                 EVEN_D=D == BLOCK_D, EVEN_DV=Dv == BLOCK_DV,
                 DOT_UPCAST=dtype == torch.bfloat16 and interpreting(), HEAD_B=head_b)
    key = ("varlen", mode, BLOCK_D, BLOCK_DV, bool(is_causal), cfg)

    def run_dkdv(t: KernelTiles):
        n_tiles = cdiv(max_seqlen_k, t.block_n)
        launch(_varlen_dkdv_kernel, (n_tiles * H * n_seq,),
               (q, k, v, grad_out, delta, lse_row, cu_seqlens_q, cu_seqlens_k, dk, dv, head_max, *strides, H, total_q,
                n_tiles, D, Dv, float(scale)),
               dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, **flags),
               dict(num_warps=t.num_warps, num_stages=t.num_stages))

    def run_dq(t: KernelTiles):
        n_tiles = cdiv(max_seqlen_q, t.block_m)
        launch(_varlen_dq_kernel, (n_tiles * H * n_seq,),
               (q, k, v, grad_out, delta, lse_row, cu_seqlens_q, cu_seqlens_k, dq, head_max, *strides, H, total_q,
                n_tiles, D, Dv, float(scale)),
               dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, **flags),
               dict(num_warps=t.num_warps, num_stages=t.num_stages))

    _run_fitting("varlen_dkdv", key, cfg.dkdv, config is not None, run_dkdv)
    _run_fitting("varlen_dq", key, cfg.dq, config is not None, run_dq)
    return dq, dk, dv
