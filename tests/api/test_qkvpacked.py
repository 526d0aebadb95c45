"""attention_qkvpacked: one packed [B, N, 3, H, D] tensor in, one packed gradient out.

The packed backward writes dQ / dK / dV through their strides into a [B, N, 3, H, D] buffer; everything it
returns must be bit-identical to the unpacked call's (the same kernels, the same sums) and match a float64
oracle. Kernels run in the Triton interpreter without a GPU (tests/conftest.py).
"""
import pytest
import torch

import visionattn as va
from visionattn.api import attention_qkvpacked
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = None if DEV == "cuda" else "triton"
DTYPES = {"fp32": torch.float32, "fp32-ieee": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16}


def _packed(B, N, H, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, D, generator=g).to(DEV, dtype).requires_grad_(True)
    grad_out = torch.randn(B, N, H, D, generator=g).to(DEV, dtype)
    return qkv, grad_out


def _packed_path_ran(out) -> bool:
    """Whether ``out`` (the [B, N, H, D] transpose of the op's output) came from the packed autograd function."""
    node = out.grad_fn.next_functions[0][0] if out.grad_fn is not None else None
    return type(node).__name__ == "_DensePackedFunctionBackward"


def _unpacked_grads(qkv, grad_out, bias=None, **kw):
    """(out [B, N, H, D], dqkv, dbias) of the plain attention call on the unbound views of a copy of qkv."""
    qkv = qkv.detach().clone().requires_grad_(True)
    bias = None if bias is None else bias.detach().clone().requires_grad_(True)
    q, k, v = qkv.unbind(2)
    out = va.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias=bias, backend=BACKEND,
                       **kw).transpose(1, 2)
    out.backward(grad_out)
    return out, qkv.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("mode,N,D,causal,with_bias", [
    ("fp32", 40, 64, False, False),  # single-pass backward (ordered dQ adds into the packed slot)
    ("fp32", 40, 64, True, False),
    ("fp16", 40, 64, False, False),
    ("bf16", 70, 64, True, False),
    ("tf32", 33, 32, False, False),
    ("fp32", 33, 32, False, True),  # two kernels, dBias summed over the batch
    ("fp32-ieee", 24, 16, False, False),
])
def test_packed_gradients_equal_the_unpacked_call_bit_for_bit(mode, N, D, causal, with_bias):
    dtype = DTYPES[mode]
    qkv, grad_out = _packed(2, N, 2, D, dtype)
    bias = torch.randn(2, N, N, device=DEV, requires_grad=True) if with_bias else None
    out = attention_qkvpacked(qkv, bias=bias, is_causal=causal, mode=mode, backend=BACKEND)
    assert _packed_path_ran(out)
    assert out.shape == (2, N, 2, D) and out.dtype == dtype
    out.backward(grad_out)
    ref_out, ref_dqkv, ref_dbias = _unpacked_grads(qkv, grad_out, bias, is_causal=causal, mode=mode)
    assert torch.equal(out, ref_out)
    assert torch.equal(qkv.grad, ref_dqkv)
    if with_bias:
        assert torch.equal(bias.grad, ref_dbias)
    # a second call of the signature launches from the plan kept by the first
    again = qkv.detach().clone().requires_grad_(True)
    bias_again = None if bias is None else bias.detach().clone().requires_grad_(True)
    out = attention_qkvpacked(again, bias=bias_again, is_causal=causal, mode=mode, backend=BACKEND)
    out.backward(grad_out)
    assert torch.equal(out, ref_out) and torch.equal(again.grad, ref_dqkv)
    if with_bias:
        assert torch.equal(bias_again.grad, ref_dbias)


def test_packed_gradients_match_the_float64_oracle():
    qkv, grad_out = _packed(1, 45, 2, 32, torch.float32, seed=3)
    out = attention_qkvpacked(qkv, mode="fp32", backend=BACKEND)
    out.backward(grad_out)
    q64 = qkv.detach().double().requires_grad_(True)
    q, k, v = (t.transpose(1, 2) for t in q64.unbind(2))
    oracle_attention(q, k, v).transpose(1, 2).backward(grad_out.double())
    assert rel_l2(out.detach(), oracle_attention(q, k, v).detach().transpose(1, 2)) <= 1e-5
    for i in range(3):  # dQ, dK, dV each within the fp32 contract
        assert rel_l2(qkv.grad[:, :, i], q64.grad[:, :, i]) <= 1e-5


def test_calls_without_gradients_or_with_another_dtype_run_the_unpacked_call():
    qkv, grad_out = _packed(1, 20, 2, 16, torch.float32, seed=1)
    with torch.no_grad():
        out = attention_qkvpacked(qkv, mode="fp32", backend=BACKEND)
    q, k, v = (t.transpose(1, 2) for t in qkv.detach().unbind(2))
    assert torch.equal(out, va.attention(q, k, v, mode="fp32", backend=BACKEND).transpose(1, 2))
    # fp16 mode on float32 inputs: the unpacked call casts, its autograd carries the gradient back
    out = attention_qkvpacked(qkv, mode="fp16", backend=BACKEND)
    assert not _packed_path_ran(out)
    out.backward(grad_out)
    _, ref_dqkv, _ = _unpacked_grads(qkv, grad_out, mode="fp16")
    assert torch.equal(qkv.grad, ref_dqkv)


def test_bad_packed_inputs_name_the_argument():
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        attention_qkvpacked([1, 2, 3])
    with pytest.raises(ValueError, match=r"qkv must be \[B, N, 3, H, D\]"):
        attention_qkvpacked(torch.zeros(1, 4, 2, 2, 8))
    with pytest.raises(ValueError, match="bias"):
        attention_qkvpacked(torch.zeros(1, 4, 3, 2, 8, requires_grad=True), bias=torch.zeros(3, 5, 5),
                            backend=BACKEND)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("N,D", [(197, 64), (1025, 64), (577, 128)])
def test_gpu_packed_gradients_equal_the_unpacked_call_bit_for_bit(mode, N, D):
    """At ViT shapes on the GPU: the Gluon forward kernels, the single-pass and two-kernel Triton backward writing
    the packed gradient, the Gluon IEEE backward (contiguous, then copied into it) and, on Hopper in fp16 / bf16 from
    half_gluon_bwd.MIN_KEYS tokens, the Gluon backward writing the packed gradient in place (its own launch, TMA
    descriptors on the K / V slices, dQ through its strides) give the unpacked call's results bit for bit."""
    from visionattn.kernels import elsa_bwd, half_gluon_bwd

    dtype = DTYPES[mode]
    qkv, grad_out = _packed(4, N, 6, D, dtype, seed=N)
    out = attention_qkvpacked(qkv, mode=mode)
    assert _packed_path_ran(out)
    out.backward(grad_out)
    ref_out, ref_dqkv, _ = _unpacked_grads(qkv, grad_out, mode=mode)
    assert torch.equal(out, ref_out)
    assert torch.equal(qkv.grad, ref_dqkv)
    if (mode in ("fp16", "bf16") and N >= half_gluon_bwd.MIN_KEYS and half_gluon_bwd._IMPORT_ERROR is None
            and torch.cuda.get_device_capability()[0] == 9):
        assert any("half_gluon_given" in plan.gluon_ran for plan in elsa_bwd.AFTER_FORWARD.plans.values())
