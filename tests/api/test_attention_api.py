"""visionattn.attention: SDPA-like semantics, dtype handling and clear errors."""
import pytest
import torch

import visionattn as va
from visionattn import dispatch
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention


def _qkv(b=2, h=3, nq=11, nk=13, d=16, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, nq, d, generator=g).to(dtype), torch.randn(b, h, nk, d, generator=g).to(dtype),
            torch.randn(b, h, nk, dv or d, generator=g).to(dtype))


@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_output_dtype_equals_input_dtype(mode, dtype):
    q, k, v = _qkv(dtype=dtype)
    out = va.attention(q, k, v, mode=mode)
    assert out.dtype == dtype and out.shape == (2, 3, 11, 16)
    golden = oracle_attention(q, k, v)
    input_rounding = {torch.float32: 0, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert rel_l2(out, golden) <= va.MODES[mode].rel_tol + input_rounding


def test_matches_sdpa_with_bias_mask_and_unequal_lengths():
    q, k, v = _qkv(nq=7, nk=19, dv=24, dtype=torch.float64)
    bias = torch.randn(3, 7, 19, dtype=torch.float64)  # [H, Nq, Nk], broadcast over batch
    mask = torch.rand(2, 1, 7, 19) > 0.2
    out = va.attention(q, k, v, bias=bias, attn_mask=mask, scale=0.3)
    sdpa_mask = torch.where(mask, bias, torch.tensor(float("-inf"), dtype=torch.float64))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, scale=0.3)
    assert rel_l2(out, expected) <= 2e-6


def test_strided_views_give_same_result_as_contiguous():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 20, 3, 4, 16, generator=g)  # timm layout [B, N, 3, H, D]
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous()
    torch.testing.assert_close(va.attention(q, k, v), va.attention(q.contiguous(), k.contiguous(), v.contiguous()))


def test_fully_masked_rows_return_zeros_not_nan():
    q, k, v = _qkv()
    mask = torch.ones(2, 3, 11, 13, dtype=torch.bool)
    mask[:, :, 4] = False
    out = va.attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()
    assert (out[:, :, 4] == 0).all() and (out[:, :, 3].abs() > 0).any()


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "query must have 4 dims"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch/heads mismatch"),
        (lambda q, k, v: (q, k[:, :2], v), ValueError, "batch/heads mismatch"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, "head_dim mismatch"),
        (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, "value has 5"),
        (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, "query has dtype torch.int32"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "query must be a torch.Tensor"),
    ],
)
def test_bad_qkv_raise_naming_the_argument(make, exc, words):
    q, k, v = make(*_qkv())
    with pytest.raises(exc, match=words):
        va.attention(q, k, v)


def test_bad_bias_and_mask():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"attn_mask has shape \(2, 3, 11, 12\).*\[2, 3, 11, 13\]"):
        va.attention(q, k, v, attn_mask=torch.ones(2, 3, 11, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="bias has shape"):
        va.attention(q, k, v, bias=torch.zeros(5, 11, 13))
    with pytest.raises(TypeError, match="attn_mask must be torch.bool"):
        va.attention(q, k, v, attn_mask=torch.zeros(11, 13))
    with pytest.raises(TypeError, match="bias must be a floating tensor"):
        va.attention(q, k, v, bias=torch.ones(11, 13, dtype=torch.bool))


def test_unknown_mode_backend_and_num_splits():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="mode='fp8' is not a visionattn mode"):
        va.attention(q, k, v, mode="fp8")
    with pytest.raises(ValueError, match="backend='gpu' is not known"):
        va.attention(q, k, v, backend="gpu")
    with pytest.raises(ValueError, match="num_splits"):
        va.attention(q, k, v, num_splits=0)


def test_mixed_devices_raise():
    q, k, v = _qkv()
    meta = torch.empty(2, 3, 13, 16, device="meta")
    with pytest.raises(ValueError, match="one device"):
        va.attention(q, meta, v)


def test_backend_override_context_restores():
    before = dispatch.get_backend()
    with va.use_backend("reference"):
        assert dispatch.get_backend() == "reference"
    assert dispatch.get_backend() == before
    with pytest.raises(ValueError):
        va.set_backend("nope")


@pytest.mark.parametrize("where", ["key", "value", "query"])
def test_nan_inputs_propagate_like_sdpa(where):
    q, k, v = _qkv()
    target = {"query": q, "key": k, "value": v}[where]
    target[0, 0, 2, 3] = float("nan")
    out = va.attention(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.isnan(out).any()
