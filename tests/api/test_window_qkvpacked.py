"""window_attention_qkvpacked: one packed [B*nW, N, 3, H, D] tensor in, one packed gradient out.

The packed backward writes dQ / dK / dV through their strides into a [B*nW, N, 3, H, D] buffer (the fused window
kernel); what it returns must be bit-identical to the unpacked ``window_attention`` call's (the same kernels, the
same sums). Kernels run in the Triton interpreter without a GPU (tests/conftest.py).
"""
import pytest
import torch

import visionattn as va
from visionattn.metrics import rel_l2

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = None if DEV == "cuda" else "triton"
DTYPES = {"fp32": torch.float32, "fp32-ieee": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16}


def _case(n_img, nw, H, N, D, dtype, cosine, seed=0):
    """(qkv leaf [B*nW, N, 3, H, D], bias leaf [H, N, N], shift mask [nW, N, N] (0 / -100), logit_scale leaf
    [H, 1, 1] or None, grad_out [B*nW, N, H, D])."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n_img * nw, N, 3, H, D, generator=g).to(DEV, dtype).requires_grad_(True)
    bias = (2 * torch.randn(H, N, N, generator=g)).to(DEV).requires_grad_(True)
    mask = torch.where(torch.rand(nw, N, N, generator=g) > 0.2, 0.0, -100.0).to(DEV)
    ls = torch.log(torch.linspace(5, 40, H)).view(H, 1, 1).to(DEV).requires_grad_(True) if cosine else None
    grad_out = torch.randn(n_img * nw, N, H, D, generator=g).to(DEV, dtype)
    return qkv, bias, mask, ls, grad_out


def _packed_path_ran(out) -> bool:
    """Whether ``out`` (the [B*nW, N, H, D] transpose of the op's output) came from the packed autograd function."""
    node = out.grad_fn.next_functions[0][0] if out.grad_fn is not None else None
    return type(node).__name__ == "_WindowPackedFunctionBackward"


def _assert_same(got, ref, exact: bool):
    """Bit for bit, or (``exact`` False) within FP32 rounding: the unpacked cosine call in an FP32-product mode
    normalises q and k before the kernels, the packed one inside them."""
    for name, a, b in zip(("out", "dqkv", "dbias", "dlogit_scale"), got, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b) if exact else rel_l2(a.float(), b.float()) <= 2e-6, name


def _grads(call, qkv, bias, ls, grad_out):
    """(out, dqkv, dbias, dlogit_scale) of ``call(qkv, bias, ls)`` on fresh leaves copied from the given ones."""
    qkv, bias = (t.detach().clone().requires_grad_(True) for t in (qkv, bias))
    ls = None if ls is None else ls.detach().clone().requires_grad_(True)
    out = call(qkv, bias, ls)
    out.backward(grad_out)
    return out, qkv.grad, bias.grad, None if ls is None else ls.grad


@pytest.mark.parametrize("mode,N,cosine", [("fp32", 49, False), ("fp16", 49, False), ("fp32", 64, True),
                                           ("bf16", 64, True), ("tf32", 16, True)])
def test_packed_window_gradients_equal_the_unpacked_call_bit_for_bit(mode, N, cosine):
    """Swin (49-token windows, a [1, H, N, N] bias view) and Swin-v2 (cosine, ``logit_scale``): output and the
    gradients of qkv, the bias and ``logit_scale`` equal the unpacked call's bit for bit (FP32-product cosine:
    within FP32 rounding), on a first call and on a second call of the signature (launched from the runner and
    plans the first kept)."""
    qkv, bias, mask, ls, grad_out = _case(2, 2, 2, N, 16, DTYPES[mode], cosine)
    kw = dict(shift_mask=mask, num_windows=2, cosine=cosine, mode=mode, backend=BACKEND)

    def packed(qkv, bias, ls):
        out = va.window_attention_qkvpacked(qkv, relative_position_bias=bias[None], logit_scale=ls, **kw)
        assert _packed_path_ran(out) and out.shape == (4, N, 2, 16) and out.dtype == qkv.dtype
        return out

    def unpacked(qkv, bias, ls):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return va.window_attention(q, k, v, relative_position_bias=bias[None], logit_scale=ls, **kw).transpose(1, 2)

    ref = _grads(unpacked, qkv, bias, ls, grad_out)
    for _ in range(2):
        _assert_same(_grads(packed, qkv, bias, ls, grad_out), ref, not (cosine and DTYPES[mode] == torch.float32))


def test_calls_the_packed_kernel_does_not_take_run_the_unpacked_call():
    """No gradients, a boolean shift mask, windows beyond the fused kernel (144 tokens), or a half mode on FP32
    inputs: the unpacked call runs (its own casts, conversions and kernels) with the same results."""
    qkv, bias, mask, _, grad_out = _case(1, 2, 2, 49, 16, torch.float32, False, seed=1)
    with torch.no_grad():
        out = va.window_attention_qkvpacked(qkv, relative_position_bias=bias, shift_mask=mask, num_windows=2,
                                            backend=BACKEND)
    q, k, v = qkv.detach().permute(2, 0, 3, 1, 4).unbind(0)
    ref = va.window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=2, backend=BACKEND)
    assert torch.equal(out, ref.transpose(1, 2))
    cases = [dict(shift_mask=mask == 0, mode="fp32"), dict(shift_mask=mask, mode="fp16")]
    for kw in cases:
        out = va.window_attention_qkvpacked(qkv, relative_position_bias=bias, num_windows=2, backend=BACKEND, **kw)
        assert not _packed_path_ran(out)
    big, big_bias, big_mask, _, _ = _case(1, 1, 2, 144, 16, torch.float32, False, seed=2)
    out = va.window_attention_qkvpacked(big, relative_position_bias=big_bias, shift_mask=big_mask, num_windows=1,
                                        backend=BACKEND)
    assert not _packed_path_ran(out) and out.grad_fn is not None


def test_bad_packed_window_inputs_name_the_argument():
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        va.window_attention_qkvpacked([1, 2, 3], num_windows=1)
    with pytest.raises(ValueError, match=r"qkv must be \[B\*nW, N, 3, H, D\]"):
        va.window_attention_qkvpacked(torch.zeros(2, 4, 2, 2, 8), num_windows=1)
    with pytest.raises(ValueError, match="relative_position_bias"):
        va.window_attention_qkvpacked(torch.zeros(2, 4, 3, 2, 8, requires_grad=True),
                                      relative_position_bias=torch.zeros(3, 5, 5), num_windows=1, backend=BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("N,H,cosine", [(49, 4, False), (64, 4, True)])
def test_gpu_packed_window_gradients_equal_the_unpacked_call_bit_for_bit(mode, N, H, cosine):
    """Swin-B / Swin-v2-B stage-1 windows (batch 8) on the GPU: the packed call gives the unpacked call's results
    bit for bit (FP32-product cosine: within FP32 rounding)."""
    qkv, bias, mask, ls, grad_out = _case(8, 16, H, N, 32, DTYPES[mode], cosine, seed=N)
    kw = dict(shift_mask=mask, num_windows=16, cosine=cosine, mode=mode)

    def packed(qkv, bias, ls):
        out = va.window_attention_qkvpacked(qkv, relative_position_bias=bias, logit_scale=ls, **kw)
        assert _packed_path_ran(out)
        return out

    def unpacked(qkv, bias, ls):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return va.window_attention(q, k, v, relative_position_bias=bias, logit_scale=ls, **kw).transpose(1, 2)

    _assert_same(_grads(packed, qkv, bias, ls, grad_out), _grads(unpacked, qkv, bias, ls, grad_out),
                 not (cosine and DTYPES[mode] == torch.float32))
