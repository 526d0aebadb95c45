"""The row L2 normalisation kernels (visionattn.kernels.l2norm) against float64 ``F.normalize`` autograd:
forward values, input gradients on timm's strided qkv views, rows at and below ``eps``, result dtypes, and
the argument checks. CPU: interpreter, small shapes; ``gpu``: Swin-v2-B's first-stage size."""
import pytest
import torch
import torch.nn.functional as F

from visionattn.kernels.l2norm import MAX_HEAD_DIM, l2_normalize
from visionattn.metrics import rel_l2

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _views(n_windows, n, h, d, dtype, device, seed=0):
    """A qkv leaf [windows, N, 3, H, D] and its q view (timm's ``qkv.unbind``), with a zero row and a row whose
    norm is below eps (the clamped branch) except in float16, which cannot hold their gradients (dy / eps ~
    1e12: inf there from F.normalize too)."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(n_windows, n, 3, h, d, generator=g, device=device)
    if dtype != torch.float16:
        qkv[0, 3, 0, 1] = 0.0
        qkv[1 % n_windows, 2, 0, 0] = 1e-14
    qkv = qkv.to(dtype).requires_grad_()
    return qkv, qkv.permute(2, 0, 3, 1, 4).unbind(0)[0]


def _oracle(qkv, dy):
    q64 = qkv.detach().double().requires_grad_()
    y = F.normalize(q64.permute(2, 0, 3, 1, 4).unbind(0)[0], dim=-1, eps=1e-12)
    return y.detach(), torch.autograd.grad(y, q64, dy.double())[0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
@pytest.mark.parametrize("d", [24, 32])
def test_values_and_gradients_match_float64_normalize(dtype, tol, d):
    """y within one rounding of its dtype, dx (through the strided view into the qkv leaf) likewise; the
    zero row and the row below eps take F.normalize's clamped branch (dx = dy / eps) without NaN."""
    qkv, q = _views(6, 10, 2, d, dtype, DEV)
    y = l2_normalize(q)
    assert y.dtype == dtype and y.is_contiguous() and y.shape == q.shape
    dy = torch.randn(y.shape, device=DEV).to(dtype)
    (dx,) = torch.autograd.grad(y, qkv, dy)
    y64, dx64 = _oracle(qkv, dy)
    assert torch.isfinite(dx).all() and dx.dtype == dtype
    assert rel_l2(y.detach(), y64) <= tol and rel_l2(dx, dx64) <= tol
    if dtype != torch.float16:
        clamped = dx[1, 2, 0, 0].double()  # the row of 1e-14: x / eps, so dx = dy / eps
        assert torch.allclose(clamped, dy[1, 0, 2].double() / 1e-12, rtol=tol)


def test_result_dtype_and_repeatability():
    """``dtype=float32`` on half inputs (F.normalize's result under autocast) keeps FP32 values; a second call
    gives the same bits."""
    qkv, q = _views(4, 9, 3, 16, torch.bfloat16, DEV, seed=1)
    y = l2_normalize(q, dtype=torch.float32)
    assert y.dtype == torch.float32
    y64, _ = _oracle(qkv, torch.zeros(y.shape, device=DEV))
    assert rel_l2(y.detach(), y64) <= 1e-6
    assert torch.equal(y, l2_normalize(q, dtype=torch.float32))


def test_bad_inputs_name_the_fix():
    x = torch.randn(2, 3, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="unit last stride"):
        l2_normalize(x.transpose(-1, -2))
    with pytest.raises(ValueError, match=r"\[B, H, N, D\]"):
        l2_normalize(x[0])
    with pytest.raises(ValueError, match=str(MAX_HEAD_DIM)):
        l2_normalize(torch.randn(1, 1, 2, MAX_HEAD_DIM + 8, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_swinv2_stage1_size(dtype, tol):
    """Swin-v2-B's first stage at batch 64 (4096 windows x 4 heads x 64 tokens, D=32): float64 agreement and
    bit-identical gradients over two runs."""
    qkv, q = _views(4096, 64, 4, 32, dtype, "cuda", seed=2)
    dy = torch.randn(q.shape, device="cuda").to(dtype)
    runs = [torch.autograd.grad(l2_normalize(q), qkv, dy)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    y64, dx64 = _oracle(qkv, dy)
    assert rel_l2(l2_normalize(q).detach(), y64) <= tol and rel_l2(runs[0], dx64) <= tol


def test_misaligned_rows_get_their_own_compiled_kernel():
    """A plan's compiled kernel assumes its first call's 16-byte pointer alignment: Swin-v2's k (aligned) and a q
    one element off, same shape and strides, must not share one (on the GPU the shared kernel's backward faulted:
    "misaligned address"). Forward and backward each build one plan per alignment class, and both stay exact."""
    from visionattn.kernels import l2norm

    l2norm._PLANS.clear()
    g = torch.Generator(device=DEV).manual_seed(5)
    base = torch.randn(2 * 3 * 7 * 32 + 1, generator=g, device=DEV)
    shifted = base[1:].view(2, 3, 7, 32).detach().requires_grad_()
    aligned = base[:-1].clone().view(2, 3, 7, 32).requires_grad_()
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
    dy = torch.randn(2, 3, 7, 32, generator=g, device=DEV)
    for x in (aligned, shifted):
        y = l2_normalize(x)
        y.backward(dy)
        x64 = x.detach().double().requires_grad_()
        ref = F.normalize(x64, dim=-1, eps=1e-12)
        ref.backward(dy.double())
        assert rel_l2(y, ref) < 1e-6 and rel_l2(x.grad, x64.grad) < 1e-6
    assert l2norm._PLANS.builds == 4  # forward and backward, each aligned and misaligned
