"""sdpa_override: SDPA calls inside the block run visionattn.attention; unsupported ones pass through."""
import pytest
import torch
import torch.nn.functional as F

import visionattn as va
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention
from patching_helpers import image_size, make_tiny, photos


def _qkv(b=2, h=3, n=17, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3)]


def test_routes_every_sdpa_call_of_a_timm_model():
    model = make_tiny("vit")
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True  # timm's SDPA path
    x = photos(image_size("vit"))
    with torch.no_grad():
        ref = model.double()(x.double())
        model.float()
        with va.sdpa_override("fp16") as ctx:
            y = model(x)
        y_outside = model(x)
    assert ctx.routed == 2 and ctx.passed == 0  # depth 2: one call per block
    assert rel_l2(y, ref) <= va.get_mode("fp16").rel_tol
    assert rel_l2(y, y_outside) > 0  # fp16 attention really ran inside, PyTorch's outside
    assert torch.equal(y.argmax(-1), ref.argmax(-1))


def test_routed_call_is_visionattn_attention():
    q, k, v = _qkv()
    with va.sdpa_override("bf16") as ctx:
        y = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert ctx.routed == 1
    assert torch.equal(y, va.attention(q, k, v, scale=0.3, mode="bf16"))


@pytest.mark.parametrize("kind", ["float", "bool", "causal", "none"])
def test_masks_and_scale_keep_sdpa_semantics(kind):
    q, k, v = _qkv(dtype=torch.float64)
    kw = {}
    if kind == "float":
        kw["attn_mask"] = torch.randn(3, 17, 17, dtype=torch.float64)  # additive bias, broadcast over batch
    elif kind == "bool":
        kw["attn_mask"] = torch.rand(2, 1, 17, 17, generator=torch.Generator().manual_seed(1)) > 0.3
    elif kind == "causal":
        kw["is_causal"] = True
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.2, **kw)
    with va.sdpa_override("fp32") as ctx:
        y = F.scaled_dot_product_attention(q, k, v, None if "attn_mask" not in kw else kw["attn_mask"], 0.0,
                                           kw.get("is_causal", False), scale=0.2)
    assert ctx.routed == 1
    assert y.dtype == torch.float64
    assert rel_l2(y, expected) <= va.get_mode("fp32").rel_tol


def test_unsupported_calls_pass_through_unchanged():
    q, k, v = _qkv()
    kv_split = (k[:, :1], v)  # grouped with unequal key / value heads: SDPA takes it, visionattn does not
    with va.sdpa_override("fp16") as ctx:
        torch.manual_seed(3)
        dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        gqa = F.scaled_dot_product_attention(q, *kv_split, enable_gqa=True)
        three_d = F.scaled_dot_product_attention(q[0], k[0], v[0])
        with pytest.raises(RuntimeError):  # a bad mask shape: PyTorch's own error, not ours
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(5, 5))
    assert ctx.routed == 0 and ctx.passed == 4
    assert any("dropout" in r for r in ctx.pass_reasons) and any("key has 1 heads and value 3" in r
                                                                 for r in ctx.pass_reasons)
    torch.manual_seed(3)
    assert torch.equal(dropped, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
    assert torch.equal(gqa, F.scaled_dot_product_attention(q, *kv_split, enable_gqa=True))
    assert torch.equal(three_d, F.scaled_dot_product_attention(q[0], k[0], v[0]))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_calls_are_routed(kv_heads):
    """``enable_gqa=True`` with K / V heads dividing the query's runs visionattn.attention(enable_gqa=True): SDPA's
    value, K / V not repeated (the kernels read them in place; tests/api/test_gqa.py)."""
    q = _qkv(h=4)[0]
    k, v = _qkv(h=kv_heads, seed=1)[:2]
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True, is_causal=True)
    with va.sdpa_override("fp32") as ctx:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert ctx.routed == 1 and ctx.passed == 0
    assert rel_l2(y.double(), expected) <= va.get_mode("fp32").rel_tol
    outside = F.scaled_dot_product_attention(q, k, v) if kv_heads == 1 else None  # one K / V head broadcasts
    with va.sdpa_override("fp32") as ctx:  # no enable_gqa: PyTorch's own answer
        if kv_heads == 1:
            assert torch.equal(F.scaled_dot_product_attention(q, k, v), outside)
        else:
            with pytest.raises(RuntimeError):
                F.scaled_dot_product_attention(q, k, v)
    assert ctx.routed == 0 and ctx.passed == 1


def test_other_torch_functions_untouched_and_mode_exits():
    q, k, v = _qkv()
    with va.sdpa_override("fp32") as ctx:
        s = torch.softmax(q @ k.transpose(-1, -2), -1)
    F.scaled_dot_product_attention(q, k, v)  # outside: not counted
    assert ctx.routed == 0 and ctx.passed == 0
    assert torch.equal(s, torch.softmax(q @ k.transpose(-1, -2), -1))


def test_gradients_flow_through_routed_calls():
    q, k, v = (t.double().requires_grad_() for t in _qkv(n=9))
    with va.sdpa_override("fp32"):
        y = F.scaled_dot_product_attention(q, k, v)
    y.square().sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    oracle_attention(q2, k2, v2).square().sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert rel_l2(a.grad, b.grad) <= 1e-5


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        va.sdpa_override("fp8")
    with pytest.raises(TypeError, match="unknown option"):
        va.sdpa_override("fp32", block=3)
