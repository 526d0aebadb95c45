"""visionattn.window_attention: validation, CPU reference vs float64 oracle, equivalence with timm's
own Swin v1 / v2 WindowAttention modules (random weights, shifted and unshifted blocks)."""
import copy

import pytest
import torch
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.swin_transformer_v2 import SwinTransformerV2Block

import visionattn
from visionattn.metrics import rel_l2
from visionattn.modes import get_mode
from visionattn.window import window_attention, window_attention_reference
from window_oracle import expanded_window_oracle


def make_inputs(n_img=2, nw=4, h=2, n=49, d=16, seed=0, mask_kind="timm"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(n_img * nw, n, 3, h, d, generator=g).permute(2, 0, 3, 1, 4).unbind(0)
    bias = torch.randn(h, n, n, generator=g)
    mask = None
    if mask_kind is not None:
        region = torch.randint(0, 3, (nw, n), generator=g)
        same = region.unsqueeze(1) == region.unsqueeze(2)
        fill = -100.0 if mask_kind == "timm" else float("-inf")
        mask = torch.zeros(nw, n, n).masked_fill(~same, fill)
    ls = torch.log(torch.rand(h, 1, 1, generator=g) * 40 + 5)
    return q, k, v, bias, mask, ls


# ----------------------------------------------------------------------------- validation
def test_validation_errors_name_the_argument():
    q, k, v, bias, mask, ls = make_inputs()
    with pytest.raises(ValueError, match="num_windows"):
        window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=3)
    with pytest.raises(ValueError, match="shift_mask"):
        window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask[:2], num_windows=4)
    with pytest.raises(ValueError, match="relative_position_bias"):
        window_attention(q, k, v, relative_position_bias=bias[:1], num_windows=4)
    with pytest.raises(ValueError, match="logit_scale"):
        window_attention(q, k, v, num_windows=4, cosine=True)
    with pytest.raises(ValueError, match="logit_scale"):
        window_attention(q, k, v, num_windows=4, logit_scale=ls)
    with pytest.raises(TypeError, match="share one dtype"):
        window_attention(q, k.double(), v, num_windows=4)
    with pytest.raises(ValueError, match="key shape"):
        window_attention(q, k[:, :, :10], v, num_windows=4)
    with pytest.raises(ValueError, match="mode"):
        window_attention(q, k, v, num_windows=4, mode="fp8")
    with pytest.raises(TypeError, match="shift_mask"):
        window_attention(q, k, v, shift_mask=mask.long(), num_windows=4)


# ----------------------------------------------------------------------------- reference path
@pytest.mark.parametrize("cosine", [False, True])
@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa"])
def test_reference_path_meets_mode_contract(mode, cosine):
    q, k, v, bias, mask, ls = make_inputs(seed=1)
    kw = dict(relative_position_bias=bias, shift_mask=mask, num_windows=4, cosine=cosine,
              logit_scale=ls if cosine else None)
    out = window_attention(q, k, v, **kw, mode=mode, backend="reference")
    gold = expanded_window_oracle(q, k, v, bias, mask, 4, cosine, ls, q.shape[-1] ** -0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    # cosine logits are amplified by exp(logit_scale) (up to 45 here): the half-precision input
    # rounding error grows with it; allow that factor over the N(0,1) contract.
    half_cosine = cosine and get_mode(mode).compute_dtype != torch.float32
    amp = float(torch.exp(ls).max()) * q.shape[-1] ** 0.5 / 8 if half_cosine else 1.0
    assert rel_l2(out, gold) <= get_mode(mode).rel_tol * max(amp, 1.0)


def test_reference_float64_state_equals_expanded_oracle_and_bool_mask_equals_inf_mask():
    q, k, v, bias, mask, _ = make_inputs(seed=2, mask_kind="inf")
    got = window_attention_reference(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=4,
                                     state_dtype=torch.float64)
    assert rel_l2(got, expanded_window_oracle(q, k, v, bias, mask, 4, scale=0.25)) < 1e-12
    a = window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=4)
    b = window_attention(q, k, v, relative_position_bias=bias, shift_mask=~torch.isinf(mask), num_windows=4)
    assert torch.equal(a, b)


def test_fully_masked_rows_give_zeros_not_nan():
    q, k, v, bias, mask, _ = make_inputs(seed=3, mask_kind="inf")
    mask[2, 5, :] = float("-inf")
    out = window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=4)
    assert torch.isfinite(out).all()
    assert out[2::4, :, 5].abs().max() == 0 and out[1::4, :, 5].abs().max() > 0


def test_gradients_through_triton_backend_match_the_oracle():
    """Training through the window kernels (forward with LSE, backward kernel), no fallback warning."""
    import warnings

    q, k, v, bias, mask, _ = make_inputs(n_img=1, n=16, seed=4)
    q = q.detach().clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=4, backend="triton")
    out.square().sum().backward()
    qd = q.detach().double().requires_grad_(True)
    expanded_window_oracle(qd, k, v, bias, mask, 4, scale=0.25).square().sum().backward()
    assert rel_l2(q.grad, qd.grad) < 1e-5


# ----------------------------------------------------------------------------- timm modules
def _v1_block(shift):
    torch.manual_seed(10)
    blk = SwinTransformerBlock(32, (14, 14), num_heads=2, window_size=7, shift_size=3 if shift else 0).eval()
    with torch.no_grad():
        blk.attn.relative_position_bias_table.normal_(0, 1)
    return blk


def _v2_block(shift):
    torch.manual_seed(11)
    blk = SwinTransformerV2Block(32, (16, 16), num_heads=2, window_size=8, shift_size=4 if shift else 0).eval()
    with torch.no_grad():
        blk.attn.logit_scale.copy_(torch.log(torch.tensor([8.0, 30.0])).view(2, 1, 1))
        blk.attn.q_bias.normal_(0, 0.5)
        blk.attn.v_bias.normal_(0, 0.5)
    return blk


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("family", ["v1", "v2"])
@pytest.mark.parametrize("mode,backend", [("fp32", "reference"), ("fp16", "reference"), ("bf16", "reference"),
                                          ("pasa", "reference"), ("fp32", "triton"), ("fp16", "triton")])
def test_equivalence_with_timm_window_attention(family, shift, mode, backend):
    blk = _v1_block(shift) if family == "v1" else _v2_block(shift)
    attn, mask = blk.attn, blk.attn_mask
    assert (mask is not None) == shift
    n, nw = attn.relative_position_index.shape[0], 4
    x = torch.randn(2 * nw, n, 32, generator=torch.Generator().manual_seed(5))
    oracle_mod = copy.deepcopy(attn).double()
    patched = visionattn.patch_model(copy.deepcopy(attn), mode=mode, backend=backend)
    assert patched.visionattn_report.num_patched == 1
    with torch.no_grad():
        gold = oracle_mod(x.double(), mask=None if mask is None else mask.double())
        timm_fp32 = attn(x, mask=mask)
        ours = patched(x, mask)
    assert ours.shape == gold.shape and ours.dtype == x.dtype
    err, timm_err = rel_l2(ours, gold), rel_l2(timm_fp32, gold)
    if mode == "fp32":  # same precision as timm's own fp32 forward: within a small multiple of its error
        assert err <= max(4 * timm_err, get_mode(mode).rel_tol)
    else:
        assert err <= get_mode(mode).rel_tol * (4 if family == "v2" else 1)
