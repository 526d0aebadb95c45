"""Window attention backward for Swin / Swin-v2 (Triton, deterministic).

The forward (:mod:`.window_fwd`) computes, for window ``b`` (``b = image * nW + w``) and head ``h``,

    y = softmax(c_h q k^T + bias[h] + mask[b mod nW]) v

with ``c_h = scale`` (Swin) or, for Swin-v2's cosine attention, ``c_h = exp(min(logit_scale_h, log 100))`` on
L2-normalised q and k. Here the caller passes the q and k the logits were formed from (normalised for
Swin-v2) and the per-head ``c_h``; the normalisation, ``logit_scale`` and continuous-position-bias
gradients chain through PyTorch autograd outside. With ``lse`` the natural-log log-sum-exp of each row's
logits, the gradients are FlashAttention-2's (Alg. 2; the ELSA monoid state reduced to ``lse`` makes the
probabilities ``P = exp(logits - lse)`` exactly recomputable):

    dS = P * (dO v^T - rowsum(dO * O)),   dq = c_h dS k,   dk = c_h dS^T q,   dv = P^T dO,
    d bias[h] = sum_b dS_bh,   d c_h = sum_(b, i, j) dS_bhij q_bhi . k_bhj.

Two kernel paths:

* **fused** (windows of at most :data:`FUSED_MAX_TOKENS` tokens: Swin's 7 x 7, Swin-v2's 8 x 8): a whole
  window is one tile, so :func:`_window_bwd_fused_kernel` forms ``S``, ``P``, ``dP`` and ``dS`` of a (window,
  head) once and writes dq, dk and dv from them: five products instead of the split kernels' seven, one
  launch instead of three (``delta = rowsum(dO * O)`` is formed in the kernel). A program owns one head and
  a chunk of windows and sums their dS in registers, storing one partial of d bias per chunk.
* **split** (larger windows, Swin-v2's 12 x 12 and 16 x 16): the dense backward kernels of :mod:`.elsa_bwd`,
  the windows as their batch, the relative position bias [H, N, N] a stride-0 view over the windows.

Either way the bias gradient, the sum over every window and image, is reduced in a fixed order (no
atomics, never materialising [B*nW, H, N, N]: per-chunk partials summed by torch), the shift mask
[nW, N, N] is read per window as ``mask[b mod nW]`` (no gradient), and ``c_h`` is a per-head scale whose
gradient is summed by torch over per-(window, head, query tile) partials.

Public entry point: :func:`window_backward`; :func:`get_config` for tools.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import (KernelCall, PlanCache, backward_operands, cdiv, head_blocks, interpreting, pad_pow2,
                      run_first_that_fits, unit_last_stride)
from .elsa_bwd import (BWD_MODES, BwdConfig, KernelTiles, _bias_mask, _bias_splits, _check_inputs, _head_scale,
                       _head_scale_grad, _mm, _tensor_key, autograd_bias, check_grads, fp32_products, launch_backward,
                       product_flags)
from .elsa_fwd import load_kv_tile
from .window_fwd import _COMPUTE_CODE, _prep_rows
from .modes import MODES

__all__ = ["window_backward", "backward_after_forward", "get_config", "fused_launch", "FUSED_MAX_TOKENS", "KERNELS"]

# Windows up to this many tokens run the fused kernel (one 64-token tile per window); larger ones the split kernels
FUSED_MAX_TOKENS = 64
KERNELS = ("auto", "fused", "split")


@triton.jit(do_not_specialize=["H", "n_add", "BW", "per_chunk"])  # a new batch size compiles nothing new
def _window_bwd_fused_kernel(Q, K, V, O, DO, LSE, Bias, Add, HS, DQ, DK, DV, DB, DHS,
                             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                             sdb, sdh, sdm, sdd, slb, slh, slm, sbh, sbm, sbn, saw, sam, san,
                             sgqb, sgqh, sgqm, sgkb, sgkh, sgkm, sgvb, sgvh, sgvm,
                             H, N, D, Dv, scale0, n_add, BW, per_chunk,
                             BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                             PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr,
                             HEAD_SCALE: tl.constexpr, WRITE_DB: tl.constexpr, WRITE_DHS: tl.constexpr,
                             EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, DOT_UPCAST: tl.constexpr,
                             GRAD_PRECISION: tl.constexpr, NORMALIZE: tl.constexpr, COMPUTE: tl.constexpr):
    """dq, dk, dv (and dS summed into a d bias partial) of windows ``[g * per_chunk, (g + 1) * per_chunk)`` of
    head ``h``, one window (N <= BLOCK tokens) per step; 1-D grid ``H * G``, program ``g * H + h``.

    Per window: ``delta = rowsum(dO * O)`` (dO rounded to the compute dtype, as the split kernels read it),
    ``P = exp(S - lse)`` (``lse = -inf`` rows read as ``+inf``: zero gradients), ``dV = P^T dO``,
    ``dS = P * (dO V^T - delta)``, ``dQ = c dS K``, ``dK = c dS^T Q``. Outputs [BW, H, N, D | Dv] through their
    (window, head, row) strides ``sg*`` (unit last stride): contiguous, or slices of one packed dQKV.
    WRITE_DB: the chunk's dS sum goes to ``DB[g, h]`` [N, N] (FP32). WRITE_DHS: each window's
    ``sum(dS * q k^T)``, made robust by :func:`.elsa_bwd._head_scale_grad`, to ``DHS[b * H + h]``.

    NORMALIZE (Swin-v2, q and k as the caller has them): the rows of q and k are L2-normalised here as the
    forward kernel normalises them (:func:`.window_fwd._prep_rows`, the same rounding), ``HS`` holds
    ``logit_scale`` [H] and ``c = exp(min(logit_scale, log 100))`` as the forward forms it, and dq, dk are
    carried through the normalisation, ``dx = (dy - y (y . dy)) / ||x||`` (``dy / eps`` where ``||x|| <= eps``,
    y the FP32 normalised row), and WRITE_DHS writes each window's gradient of ``logit_scale`` instead of c's
    (times ``c``, zero where the cap binds).
    """
    pid = tl.program_id(0)
    h = (pid % H).to(tl.int64)
    g = pid // H
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok_n = offs < N
    ok = ok_n[:, None] & ok_n[None, :]
    offs64 = offs.to(tl.int64)
    if NORMALIZE:
        ls = tl.load(HS + h).to(tl.float32)
        scale = tl.exp(tl.minimum(ls, 4.605170185988092))  # the forward's c (window_fwd._logit_mult)
        dls_mult = tl.where(ls <= 4.605170185988092, scale, 0.0)  # dc / d logit_scale (clamp passes at the cap)
    else:
        scale = _head_scale(HS, h, scale0, HEAD_SCALE)
    b_ptrs = Bias + h * sbh + offs64[:, None] * sbm + offs64[None, :] * sbn
    db_acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    r_lo = g * per_chunk
    r_hi = tl.minimum(r_lo + per_chunk, BW)
    for r in range(r_lo, r_hi):
        b = tl.cast(r, tl.int64)
        q = load_kv_tile(Q + b * sqb + h * sqh + offs64[:, None] * sqm + offs_d[None, :] * sqd, ok_n, offs_d, D,
                         True, EVEN_D)
        k = load_kv_tile(K + b * skb + h * skh + offs64[:, None] * skn + offs_d[None, :] * skd, ok_n, offs_d, D,
                         True, EVEN_D)
        v = load_kv_tile(V + b * svb + h * svh + offs64[:, None] * svn + offs_dv[None, :] * svd, ok_n, offs_dv, Dv,
                         True, EVEN_DV)
        if NORMALIZE:
            q_raw, k_raw = q, k
            q = _prep_rows(q_raw, 1.0, COMPUTE, True, False)
            k = _prep_rows(k_raw, 1.0, COMPUTE, True, False)
        do = load_kv_tile(DO + b * sdb + h * sdh + offs64[:, None] * sdm + offs_dv[None, :] * sdd, ok_n, offs_dv,
                          Dv, True, EVEN_DV).to(q.dtype)
        o = load_kv_tile(O + b * sob + h * soh + offs64[:, None] * som + offs_dv[None, :] * sod, ok_n, offs_dv, Dv,
                         True, EVEN_DV)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        lse = tl.load(LSE + b * slb + h * slh + offs * slm, mask=ok_n, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        qk = _mm(q, tl.trans(k), PRECISION, DOT_UPCAST)
        s = _bias_mask(qk * scale, b_ptrs, Add + (b % n_add) * saw + offs64[:, None] * sam + offs64[None, :] * san,
                       b_ptrs, ok, HAS_BIAS, HAS_ADD, False)
        s = tl.where(ok_n[None, :], s, float("-inf"))
        p = tl.math.exp2((s - lse[:, None]) * 1.4426950408889634)
        dv = _mm(tl.trans(p.to(q.dtype)), do, GRAD_PRECISION, DOT_UPCAST)
        dp = _mm(do, tl.trans(v), PRECISION, DOT_UPCAST)
        ds = p * (dp - delta[:, None])
        dq = _mm(ds.to(q.dtype), k, GRAD_PRECISION, DOT_UPCAST) * scale
        dk = _mm(tl.trans(ds.to(q.dtype)), q, GRAD_PRECISION, DOT_UPCAST) * scale
        if NORMALIZE:
            dq = _normalize_grad(q_raw, dq)
            dk = _normalize_grad(k_raw, dk)
        bh = b * H + h
        out_d = ok_n[:, None] & (offs_d < D)[None, :]
        tl.store(DQ + b * sgqb + h * sgqh + offs64[:, None] * sgqm + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=out_d)
        tl.store(DK + b * sgkb + h * sgkh + offs64[:, None] * sgkm + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=out_d)
        tl.store(DV + b * sgvb + h * sgvh + offs64[:, None] * sgvm + offs_dv[None, :], dv.to(DV.dtype.element_ty),
                 mask=ok_n[:, None] & (offs_dv < Dv)[None, :])
        if WRITE_DHS:
            dhs = _head_scale_grad(tl.sum(ds * qk, 1), tl.sum(ds, 1), tl.sum(p * qk, 1), tl.sum(p, 1))
            if NORMALIZE:
                dhs = dhs * dls_mult
            tl.store(DHS + bh, dhs)
        if WRITE_DB:
            db_acc += ds
    if WRITE_DB:
        tl.store(DB + (g * H + h) * N * N + offs64[:, None] * N + offs64[None, :], db_acc, mask=ok)


@triton.jit
def _normalize_grad(x, dy):
    """The gradient at ``x`` [R, C] (compute dtype) of ``x / max(||x||, eps)`` given ``dy`` (FP32) at its output,
    eps = 1e-12, as :mod:`.l2norm`'s backward forms it: ``(dy - y (y . dy)) / ||x||``, ``dy / eps`` where
    ``||x|| <= eps``; sums in FP32."""
    xf = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(xf * xf, axis=1))
    denom = tl.maximum(norm, 1e-12)
    y = xf / denom[:, None]
    dot = tl.where(norm <= 1e-12, 0.0, tl.sum(y * dy, axis=1))
    return (dy - y * dot[:, None]) / denom[:, None]


def fused_launch(block: int, n_tokens: int, half: bool, precision: str) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the fused kernel for windows of ``n_tokens`` in ``block``-row tiles, half
    operands (``half``) or FP32 ones with ``precision``'s products:

    * half operands on padded windows (Swin's 49 tokens in a 64-row tile): 8 warps, 3 stages, 1.3-1.45x the
      4-warp 2-stage kernel at Swin-B's stages 1-3 (docs/tuning.md: fused window backward, half, padded
      windows: 8 warps, 3 stages);
    * otherwise 4 warps, 2 stages (two programs per SM; Swin-v2's full 64-token tiles in half precision and
      every FP32 case measured fastest so), except IEEE-FP32 products on 64-token windows, which spill over
      1 KiB per thread at 4 warps and about 270 bytes at 8 (docs/tuning.md: fused window backward: 2 stages,
      4 warps).
    """
    if half and n_tokens < block:
        return 8, 3
    return (8 if block >= 64 and precision == "ieee" else 4), 2


# call signature -> _FusedPlan; PLANS.hits / PLANS.builds count reuses and builds
PLANS = PlanCache()
# (forward plan, what it does not fix) -> _FusedPlan: the eager autograd path's backward (backward_after_forward)
AFTER_FORWARD = PlanCache()


class _FusedPlan:
    """The fused kernel's launch for one call signature: grid, chunking, constexprs and strides fixed; a call
    allocates the gradients (and the d bias partials) and launches once. ``grad_strides``: the (window, head, row)
    strides of dq, dk, dv that calls pass in (e.g. slices of one packed dQKV), None: allocated contiguous."""

    __slots__ = ("call", "fixed", "fixed_tail", "G", "dims", "write_db", "write_dhs", "device")

    def __init__(self, q, k, v, out, grad_out, lse, bias, add_mask, head_scale, mode, write_db, write_dhs,
                 bias_splits, products, num_stages=None, normalize=False, grad_strides=None):
        BW, H, N, D = q.shape
        Dv = v.shape[3]
        block = max(16, pad_pow2(N))
        # the d bias partials [G, H, N, N] take ~4 programs per SM; without them, one window per program
        G = _bias_splits(BW, H, 4 * H * N * N, q.device, bias_splits) if write_db else BW
        per_chunk = cdiv(BW, G)
        G = cdiv(BW, per_chunk)  # no empty chunks
        self.G, self.dims, self.device = G, (BW, H, N, D, Dv), q.device
        self.write_db, self.write_dhs = write_db, write_dhs
        sb = (bias.stride(0), bias.stride(1), bias.stride(2)) if bias is not None else (0, 0, 0)
        sa = add_mask.stride() if add_mask is not None else (0, 0, 0)
        n_add = add_mask.shape[0] if add_mask is not None else 1
        if grad_strides is None:
            grad_strides = ((H * N * D, N * D, D), (H * N * D, N * D, D), (H * N * Dv, N * Dv, Dv))
        self.fixed = (*q.stride(), *k.stride(), *v.stride(), *out.stride(), *grad_out.stride(), *lse.stride(), *sb,
                      *sa, *(int(x) for st in grad_strides for x in st), H, N, D, Dv)  # the arguments before scale0
        self.fixed_tail = (n_add, BW, per_chunk)  # and after it
        precision = fp32_products(mode, products)[1]
        block_d, block_dv = head_blocks(D, Dv)
        warps, stages = fused_launch(block, N, q.dtype != torch.float32, precision)
        num_stages = stages if num_stages is None else num_stages
        self.call = KernelCall(_window_bwd_fused_kernel, (H * G,), dict(
            BLOCK=block, BLOCK_D=block_d, BLOCK_DV=block_dv, **product_flags(precision), HAS_BIAS=bias is not None,
            HAS_ADD=add_mask is not None, HEAD_SCALE=head_scale is not None, WRITE_DB=write_db, WRITE_DHS=write_dhs,
            EVEN_D=D == block_d, EVEN_DV=Dv == block_dv,
            DOT_UPCAST=q.dtype == torch.bfloat16 and interpreting(), NORMALIZE=normalize,
            COMPUTE=_COMPUTE_CODE[q.dtype]),
            dict(num_warps=warps, num_stages=num_stages))

    def __call__(self, q, k, v, out, grad_out, lse, bias, add_mask, head_scale, scale, grads=None):
        BW, H, N, D, Dv = self.dims
        dev = self.device
        if grads is not None:  # laid out as the plan's grad_strides
            dq, dk, dv = grads
        else:
            dq = torch.empty((BW, H, N, D), device=dev, dtype=q.dtype)
            dk = torch.empty((BW, H, N, D), device=dev, dtype=q.dtype)
            dv = torch.empty((BW, H, N, Dv), device=dev, dtype=q.dtype)
        db = torch.empty((self.G, H, N, N), device=dev, dtype=torch.float32) if self.write_db else dq
        dhs = torch.empty((BW, H), device=dev, dtype=torch.float32) if self.write_dhs else dq
        self.call(q, k, v, out, grad_out, lse, q if bias is None else bias, q if add_mask is None else add_mask,
                  q if head_scale is None else head_scale, dq, dk, dv, db, dhs, *self.fixed, float(scale),
                  *self.fixed_tail)
        return dq, dk, dv, (db.sum(0) if self.G > 1 else db[0]) if self.write_db else None, \
            dhs.sum(0) if self.write_dhs else None


def get_config(mode: str, n_tokens: int, head_dim: int) -> BwdConfig:
    """Tiles for windows of ``n_tokens``: square tiles of the padded window up to 64 (49 -> one 64 x 64 tile;
    144 / 256 -> 64 x 64 tiles), 4 warps; FP32 operands at head dims above 64 take 32-row tiles.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in BWD_MODES:
        raise ValueError(f"mode={mode!r} has no window backward kernel; expected one of {list(BWD_MODES)}")
    block = min(64, pad_pow2(n_tokens))
    if BWD_MODES[mode][0] == torch.float32 and head_dim > 64:
        block = min(block, 32)
    tiles = KernelTiles(block, block, 4, 2)
    return BwdConfig(tiles, tiles)


def window_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                    lse: torch.Tensor, relative_position_bias: torch.Tensor | None, shift_mask: torch.Tensor | None,
                    num_windows: int, scale: float, mode: str, head_scale: torch.Tensor | None = None,
                    bias_requires_grad: bool = False, head_scale_requires_grad: bool = False, *,
                    config: BwdConfig | None = None, bias_splits: int | None = None, kernel: str = "auto",
                    products: str | None = None, logit_scale: torch.Tensor | None = None,
                    logit_scale_requires_grad: bool = False, grads: tuple | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of window attention (module docstring) from the saved log-sum-exp.

    Args:
        q, k: [B*nW, H, N, D]; v: [B*nW, H, N, Dv]; in the mode's compute dtype (float32 for ``fp32`` /
            ``fp32-ieee`` / ``tf32``, float16 / bfloat16 for ``fp16`` / ``bf16``), any strides (timm's
            ``qkv.unbind`` views are read in place). Swin-v2: the L2-normalised q and k.
        out: the forward output [B*nW, H, N, Dv], any float dtype and strides.
        grad_out: dL/d out, [B*nW, H, N, Dv], any float dtype and strides.
        lse: float32 [B*nW, H, N], natural log of each row's softmax normalizer (``-inf`` for a row whose
            logits are all ``-inf``: zero gradients).
        relative_position_bias: None or float [H, N, N] (any strides), shared by every window.
        shift_mask: None or float additive [nW, N, N] (timm's 0 / -100, or -inf); window b reads
            ``shift_mask[b % nW]``; no gradient.
        num_windows: nW, dividing B*nW (the shift mask's first dim when there is one).
        scale: the logit scale when ``head_scale`` is None.
        mode: ``fp32``, ``fp32-ieee``, ``tf32``, ``fp16`` or ``bf16`` (:mod:`.elsa_bwd`'s products).
        head_scale: None or float [H] (or [H, 1, 1]): the logit scale of each head, replacing ``scale``
            (Swin-v2: ``exp(min(logit_scale, log 100))``).
        bias_requires_grad: also return d relative_position_bias.
        head_scale_requires_grad: also return d head_scale.
        config: tiles of the split kernels (None = :func:`get_config`); given, the split kernels run.
        bias_splits: chunks of the windows whose d bias is summed apart (None = automatic; see
            :func:`.elsa_bwd.elsa_backward`).
        kernel: ``"auto"`` (the fused kernel for windows of at most :data:`FUSED_MAX_TOKENS` tokens without a
            ``config``, else the split kernels), ``"fused"`` or ``"split"`` (module docstring).
        products: FP32 products override, as :func:`.elsa_backward`'s (None = the mode's window products,
            :attr:`.Mode.window_backward_precision` where set).
        logit_scale: Swin-v2 with q and k as the caller has them (not normalised): timm's ``logit_scale``
            (H values, any float dtype); the fused kernel normalises q and k as the forward kernel with
            ``normalized=False`` does, uses ``c = exp(min(logit_scale, log 100))`` and returns the gradients of
            the raw q and k (the normalisation's backward included). Fused kernel only (N <= 64, no
            ``config``); ``head_scale`` must be None.
        logit_scale_requires_grad: with ``logit_scale``, also return d logit_scale (in place of d head_scale).
        grads: (dq, dk, dv) to write (q / k / v's shapes, q's dtype and device, any strides with a unit last one,
            e.g. slices of one packed [B*nW, N, 3, H, D] dQKV): the fused kernel writes them in place, the split
            kernels' results are copied in; they are returned.

    Returns:
        ``(dq, dk, dv, dbias, dhead_scale)``: dq, dk [B*nW, H, N, D] and dv [B*nW, H, N, Dv], contiguous, in
        q's dtype; dbias [H, N, N] in the bias's dtype (the sum over all windows) or None; dhead_scale in
        ``head_scale``'s shape and dtype (with ``logit_scale``: d logit_scale in its shape and dtype) or None.

    Raises:
        ValueError: unknown mode; mismatched shapes (naming the argument); ``grads`` not laid out as above;
            ``num_windows`` not dividing B*nW or differing from the shift mask's; a gradient asked for a tensor
            not given.
        TypeError: q / k / v not in the mode's compute dtype; lse not float32; a non-float bias / mask /
            head scale.
    """
    return _window_backward(q, k, v, out, grad_out, lse, relative_position_bias, shift_mask, num_windows, scale, mode,
                            head_scale, bias_requires_grad, head_scale_requires_grad, config, bias_splits, kernel,
                            products, logit_scale, logit_scale_requires_grad, grads)[0]


def _window_backward(q, k, v, out, grad_out, lse, relative_position_bias, shift_mask, num_windows, scale, mode,
                     head_scale, bias_requires_grad, head_scale_requires_grad, config, bias_splits, kernel, products,
                     logit_scale, logit_scale_requires_grad, grads):
    """:func:`window_backward`'s ``(result, plan)``: the fused kernel's plan that ran, None for the split kernels
    or an empty call."""
    _check_inputs(q, k, v, out, grad_out, lse, None, None, mode)
    q, k, v, out, grad_out = backward_operands(q, k, v, out, grad_out)
    BW, H, N, _ = q.shape
    if k.shape[2] != N:
        raise ValueError(f"k has {k.shape[2]} tokens, q {N}: windows attend within themselves (Nq == Nk)")
    if not isinstance(num_windows, int) or num_windows < 1 or BW % num_windows:
        raise ValueError(f"num_windows={num_windows!r} must be a positive int dividing B*nW={BW}")
    for name, t, shape in (("relative_position_bias", relative_position_bias, (H, N, N)),
                           ("shift_mask", shift_mask, (num_windows, N, N))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {list(shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}; q is on {q.device}")
    hs = None
    if head_scale is not None:
        hs = _per_head("head_scale", head_scale, H, q.device).to(torch.float32).contiguous()
    if logit_scale is not None:
        if head_scale is not None or head_scale_requires_grad:
            raise ValueError("logit_scale (raw q, k normalised in the kernel) and head_scale exclude each other")
        if N > FUSED_MAX_TOKENS or config is not None or kernel == "split":
            raise ValueError(f"logit_scale (q, k normalised in the kernel) runs on the fused kernel only: windows "
                             f"of at most {FUSED_MAX_TOKENS} tokens (got {N}), no config, kernel 'auto' or 'fused'")
        hs = _per_head("logit_scale", logit_scale, H, q.device)
        if hs.stride(0) != 1:
            hs = hs.contiguous()
    elif logit_scale_requires_grad:
        raise ValueError("logit_scale_requires_grad=True needs a logit_scale")
    if bias_requires_grad and relative_position_bias is None:
        raise ValueError("bias_requires_grad=True needs a relative_position_bias")
    if head_scale_requires_grad and head_scale is None:
        raise ValueError("head_scale_requires_grad=True needs a head_scale")
    fp32_products(mode, products)  # an unknown products value raises here, whichever path runs
    if products is None:
        products = MODES[mode].window_backward_precision
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; expected one of {list(KERNELS)}")
    if kernel == "fused" and (N > FUSED_MAX_TOKENS or config is not None):
        raise ValueError(f"kernel='fused' runs windows of at most {FUSED_MAX_TOKENS} tokens without a config "
                         f"(got N={N}, config={config}); use kernel='split' or 'auto'")
    check_grads(grads, q, k, v)
    empty = BW * H == 0 or q.shape[3] == 0 or v.shape[3] == 0
    if logit_scale is not None and (empty or not BW):  # nothing to normalise: zero gradients
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v)) if grads is None else (g.zero_() for g in grads)
        return (dq, dk, dv, torch.zeros_like(relative_position_bias) if bias_requires_grad else None,
                torch.zeros_like(logit_scale) if logit_scale_requires_grad else None), None
    if logit_scale is not None:
        return _fused(q, k, v, out, grad_out, lse, relative_position_bias, shift_mask, hs, float(scale), mode,
                      logit_scale, bool(bias_requires_grad), bool(logit_scale_requires_grad), bias_splits, products,
                      normalize=True, grads=grads)
    fits = _fused_size_key(q, v, mode, products) not in _FUSED_TOO_BIG
    if BW and (kernel == "fused" or (kernel == "auto" and N <= FUSED_MAX_TOKENS and config is None and not empty
                                     and fits)):
        try:
            return _fused(q, k, v, out, grad_out, lse, relative_position_bias, shift_mask, hs, float(scale), mode,
                          head_scale, bool(bias_requires_grad), bool(head_scale_requires_grad), bias_splits, products,
                          grads=grads)
        except triton.runtime.errors.OutOfResources:
            if kernel == "fused":
                raise
            # FP32 operands at head dim 256 (~288 KB as one 64-row window) exceed the shared memory: the split
            # kernels below take 32-row tiles there (:func:`get_config`)
            _FUSED_TOO_BIG.add(_fused_size_key(q, v, mode, products))
    # a stride-0 (expanded) view: its gradient is [H, N, N], not the sum over the view's repeats
    relative_position_bias = autograd_bias(relative_position_bias, bias_requires_grad)
    dq, dk, dv, dbias, dhs = launch_backward(
        q, k, v, out, grad_out, lse, relative_position_bias, shift_mask, None, hs, False, float(scale), mode,
        bias_requires_grad, head_scale_requires_grad, config, bias_splits,
        default=get_config(mode, N, max(q.shape[3], v.shape[3])), products=products)
    if dhs is not None:
        dhs = dhs.reshape(head_scale.shape).to(head_scale.dtype)
    if grads is not None:
        for into, got in zip(grads, (dq, dk, dv)):
            into.copy_(got)
        dq, dk, dv = grads
    return (dq, dk, dv, dbias, dhs), None


# the fused kernel's signatures (dtype, padded window and head dims, products) whose shared memory does not fit the
# GPU: the split kernels run them without trying again. Swin-v2's logit_scale path (the fused kernel only) reaches
# here from window_attention with half operands only (it normalises FP32 q and k itself), half the FP32 bytes
_FUSED_TOO_BIG: set = set()


def _fused_size_key(q, v, mode: str, products) -> tuple:
    return (q.device, q.dtype, pad_pow2(q.shape[2]), pad_pow2(q.shape[3]), pad_pow2(v.shape[3]), mode, products)


def _per_head(name: str, t, H: int, device: torch.device) -> torch.Tensor:
    """``t`` (H float values, any shape) detached as [H]; TypeError / ValueError naming ``name`` otherwise."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.numel() != H or t.device != device:
        raise ValueError(f"{name} has shape {tuple(t.shape)} on {t.device}; expected {H} values on {device}")
    return t.detach().reshape(H)


def _grad_strides(grads) -> tuple | None:
    """(window, head, row) strides of given (dq, dk, dv), None when none are given."""
    return None if grads is None else tuple(g.stride()[:3] for g in grads)


def _fused_key(q, k, v, out, grad_out, lse, bias, shift_mask, hs, mode, write_db, write_dhs, bias_splits, products,
               normalize, grads=None):
    """The :data:`PLANS` key of a fused call: shapes, strides, dtypes, alignment and flags."""
    return (mode, q.shape, v.shape[3], q.stride(), k.stride(), v.stride(), out.stride(), grad_out.stride(),
            lse.stride(), q.dtype, out.dtype, grad_out.dtype, q.device, _tensor_key(bias), _tensor_key(shift_mask),
            hs is not None, write_db, write_dhs, bias_splits, products, q.data_ptr() & 15, k.data_ptr() & 15,
            v.data_ptr() & 15, out.data_ptr() & 15, grad_out.data_ptr() & 15, lse.data_ptr() & 15, normalize,
            hs is not None and hs.dtype, _grad_strides(grads))


def backward_after_forward(forward_plan, q, k, v, out, grad_out, lse, bias, shift_mask, num_windows: int,
                           scale: float, mode: str, head_scale=None, logit_scale=None, bias_requires_grad=False,
                           scale_requires_grad=False, grads=None):
    """:func:`window_backward` of a call whose forward ran from ``forward_plan`` (a
    :func:`.window_fwd.window_forward_planned` plan with the LSE): ``q`` / ``k`` / ``v`` / ``bias`` / ``shift_mask`` /
    ``logit_scale`` are what that forward took, ``out`` / ``lse`` what it returned, in the mode's compute dtype.
    ``head_scale`` (with ``scale_requires_grad``: its gradient) or ``logit_scale`` (Swin-v2, raw q and k; with
    ``scale_requires_grad``: d logit_scale) and ``grads`` as :func:`window_backward` takes them.

    The eager autograd path calls this. The forward plan fixes every layout the fused kernel's plan depends on but
    the output gradient's and the bias's strides, so a signature's first call validates and builds as
    :func:`window_backward` does and later calls find the fused plan by those few values (no second validation,
    no 28-entry key). Windows the fused kernel does not take run :func:`window_backward` every call."""
    grad_out = unit_last_stride(grad_out)  # autograd's dO may be any layout (:func:`._launch.unit_last_stride`)
    key = (forward_plan, grad_out.stride(), grad_out.dtype, grad_out.data_ptr() & 15,
           None if bias is None else bias.stride(), bool(bias_requires_grad), bool(scale_requires_grad),
           head_scale is not None, logit_scale is not None and logit_scale.dtype, _grad_strides(grads))
    plan = AFTER_FORWARD.get(key)
    if plan is None:
        result, ran = _window_backward(q, k, v, out, grad_out, lse, bias, shift_mask, num_windows, scale, mode,
                                       head_scale, bias_requires_grad, scale_requires_grad and head_scale is not None,
                                       None, None, "auto", None, logit_scale,
                                       scale_requires_grad and logit_scale is not None, grads)
        # kept for the fused kernel only, and with a logit scale only where the kernel can read it in place
        if ran is not None and (logit_scale is None or logit_scale.is_contiguous()):
            AFTER_FORWARD.put(key, ran)
        return result
    if logit_scale is not None:
        hs = logit_scale  # contiguous (the plan was kept only then): the kernel reads its H values in place
    elif head_scale is not None:
        hs = head_scale.detach().reshape(-1).to(torch.float32).contiguous()
    else:
        hs = None
    return _shaped(plan(q, k, v, out, grad_out, lse, bias, shift_mask, hs, scale, grads), bias,
                   logit_scale if logit_scale is not None else head_scale)


def _shaped(grads, bias, head_scale):
    """The fused kernel's (dq, dk, dv, dbias, dhs) with dbias in the bias's dtype and dhs in the shape and dtype of
    ``head_scale`` (the logit scale with NORMALIZE)."""
    dq, dk, dv, dbias, dhs = grads
    if dbias is not None:
        dbias = dbias.to(bias.dtype)
    if dhs is not None:
        dhs = dhs.reshape(head_scale.shape).to(head_scale.dtype)
    return dq, dk, dv, dbias, dhs


def _fused(q, k, v, out, grad_out, lse, bias, shift_mask, hs, scale, mode, head_scale, write_db, write_dhs,
           bias_splits, products, normalize=False, grads=None):
    """``(result, plan)``: :func:`window_backward` on the fused kernel from the cached plan of the call's signature
    (``normalize``: ``hs`` is the logit scale and ``head_scale`` the caller's logit_scale tensor, the kernel's
    NORMALIZE)."""
    key = _fused_key(q, k, v, out, grad_out, lse, bias, shift_mask, hs, mode, write_db, write_dhs, bias_splits,
                     products, normalize, grads)
    plan = PLANS.get(key)
    given = grads
    if plan is not None:
        grads = plan(q, k, v, out, grad_out, lse, bias, shift_mask, hs, scale, given)
    else:  # built by running it: fused_launch's stages, fewer where their shared memory does not fit
        built = []

        def run(stages: int | None):
            p = _FusedPlan(q, k, v, out, grad_out, lse, bias, shift_mask, hs, mode, write_db, write_dhs,
                           bias_splits, products, stages, normalize, _grad_strides(given))
            built.append((p, p(q, k, v, out, grad_out, lse, bias, shift_mask, hs, scale, given)))

        first = fused_launch(max(16, pad_pow2(q.shape[2])), q.shape[2], q.dtype != torch.float32,
                             fp32_products(mode, products)[1])[1]
        run_first_that_fits(run, first, lambda stages: list(range(stages - 1, 0, -1)))
        plan, grads = built[-1]
        PLANS.put(key, plan)
    return _shaped(grads, bias, head_scale), plan
