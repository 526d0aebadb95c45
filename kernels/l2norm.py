"""Row L2 normalisation with its backward, one kernel each: Swin-v2's cosine attention in training.

Swin-v2 normalises q and k (``F.normalize(x, dim=-1, eps=1e-12)``) before its cosine attention. Under PyTorch
autograd that is about eight kernels per tensor and direction on timm's strided ``qkv.unbind`` views (norm,
clamp, expand, divide; in the backward divides, products, sums, a masked fill), and at Swin-v2-B's first
stage they cost more GPU time than the window attention kernels themselves. Here one kernel reads the rows
and writes

    y = x / max(||x||, eps)   (formed in FP32)   and   ||x||   (FP32, one per row),

and one reads ``dy``, ``x`` and the norms and writes the derivative of ``x / max(||x||, eps)``:

    dx = (dy - y (y . dy)) / ||x||   where ||x|| > eps,       dx = dy / eps   elsewhere,

in x's dtype. Sums over the row in FP32, in one fixed order: bit-for-bit reproducible.

Public: :func:`l2_normalize` (differentiable; any 4-D strides with a unit last stride, head dim up to 256).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import KernelCall, PlanCache, cdiv, pad_pow2

__all__ = ["l2_normalize", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_ROWS = 32  # rows per program


@triton.jit(do_not_specialize=["n_rows", "N", "H"])
def _l2norm_fwd_kernel(X, Y, Norm, sxb, sxh, sxn, n_rows, N, H, D, eps,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # X [B, H, N, D] (unit last stride), Y contiguous [B, H, N, D], Norm [B * H * N] FP32
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < n_rows)[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)
    src = (r64 // (H * N)) * sxb + ((r64 // N) % H) * sxh + (r64 % N) * sxn
    x = tl.load(X + src[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    y = x / tl.maximum(norm, eps)[:, None]
    tl.store(Y + r64[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(Norm + rows, norm, mask=rows < n_rows)


@triton.jit(do_not_specialize=["n_rows", "N", "H"])
def _l2norm_bwd_kernel(DY, X, Norm, DX, sdb, sdh, sdn, sxb, sxh, sxn, n_rows, N, H, D, eps,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # DY, X [B, H, N, D] (unit last strides), Norm as the forward wrote it; DX contiguous [B, H, N, D]. y is
    # formed again from x in FP32 (not read back in the output's dtype, which may be half)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < n_rows)[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)
    b, h, n = r64 // (H * N), (r64 // N) % H, r64 % N
    dy = tl.load(DY + (b * sdb + h * sdh + n * sdn)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    x = tl.load(X + (b * sxb + h * sxh + n * sxn)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    norm = tl.load(Norm + rows, mask=rows < n_rows, other=1.0)
    denom = tl.maximum(norm, eps)
    y = x / denom[:, None]
    dot = tl.where(norm <= eps, 0.0, tl.sum(y * dy, axis=1))
    dx = (dy - y * dot[:, None]) / denom[:, None]
    tl.store(DX + r64[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)


# (kernel, shape, strides, dtype, device, 16-byte alignment class, what else it reads) -> KernelCall: the compiled
# kernel assumes its first call's pointer alignment (a 16-byte aligned q's kernel run on a misaligned k faults)
_PLANS = PlanCache()


def _call(kernel, x: torch.Tensor, *extra) -> KernelCall:
    B, H, N, D = x.shape
    key = (kernel, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, *extra)
    call = _PLANS.get(key)
    if call is None:
        call = _PLANS.put(key, KernelCall(kernel, (cdiv(B * H * N, _ROWS),),
                                          dict(BLOCK_R=_ROWS, BLOCK_D=pad_pow2(D)), dict(num_warps=4)))
    return call


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps, dtype):
        B, H, N, D = x.shape
        y = torch.empty((B, H, N, D), device=x.device, dtype=dtype)
        norm = torch.empty((B * H * N,), device=x.device, dtype=torch.float32)
        _call(_l2norm_fwd_kernel, x, y.dtype)(x, y, norm, *x.stride()[:3], B * H * N, N, H, D, eps)
        ctx.save_for_backward(x, norm)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, norm = ctx.saved_tensors
        B, H, N, D = x.shape
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty((B, H, N, D), device=x.device, dtype=x.dtype)
        call = _call(_l2norm_bwd_kernel, dy, x.stride(), x.dtype, x.data_ptr() & 15)
        call(dy, x, norm, dx, *dy.stride()[:3], *x.stride()[:3], B * H * N, N, H, D, ctx.eps)
        return dx, None, None


def l2_normalize(x: torch.Tensor, eps: float = 1e-12, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=eps)`` of a 4-D tensor in one kernel, differentiable (one kernel backward).

    Args:
        x: [B, H, N, D] float16 / bfloat16 / float32, any strides with a unit last stride (timm's
            ``qkv.unbind`` views), D <= :data:`MAX_HEAD_DIM`; on CUDA, or on the CPU under
            ``TRITON_INTERPRET=1``.
        eps: the norm's lower bound (``F.normalize``'s).
        dtype: of the result (default x's; ``F.normalize`` under autocast gives float32).

    Returns:
        [B, H, N, D] contiguous: ``x / max(||x||_2, eps)`` row by row, formed in FP32 and rounded once; its
        gradient (formed in FP32 from x, not from the rounded result) comes back in x's dtype.

    Raises:
        ValueError: x is not 4-D, its last stride is not 1, or D exceeds :data:`MAX_HEAD_DIM`.
    """
    if x.dim() != 4 or x.stride(-1) != 1 or x.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"x: expected [B, H, N, D] with a unit last stride and D <= {MAX_HEAD_DIM}, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}; pass x.contiguous() or use F.normalize")
    return _L2Normalize.apply(x, float(eps), x.dtype if dtype is None else dtype)
