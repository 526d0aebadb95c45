"""patch_model on transformers' Swin and Swin-v2 (visionattn.patching.transformers_swin).

Tiny random-weight ``SwinModel`` / ``Swinv2Model`` (two stages, shifted windows in the first)
on the real photos of tests/data/photos. Oracle: the *unpatched* model in float64, same
weights; a patched FP32 model must be as close to it as the unpatched FP32 model is (a few
x), a half mode within its contract plus that. Weights are re-drawn so the attention is far
from uniform: linear weights ~ N(0, 1/fan_in), relative position tables O(1), LayerNorm
weights around 1 (transformers initialises the tables to zero).
"""
import copy
import functools

import pytest
import torch

import visionattn as va
from visionattn.metrics import rel_l2
from patching_helpers import photos, redraw_linear

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"the Swin patchers follow transformers 5, found {transformers.__version__}", allow_module_level=True)

from visionattn.patching import transformers_swin as ts  # noqa: E402

SIZE = 32
SWIN_CLASS = "transformers.models.swin.modeling_swin." + ("SwinSelfAttention" if ts._LEGACY_SWIN else "SwinAttention")
SWINV2_CLASS = "transformers.models.swinv2.modeling_swinv2.Swinv2SelfAttention"
# image 32, patch 4: stage 1 is 8 x 8 tokens in 4 windows of 4 x 4 (second block shifted), stage 2 one window
CONFIG = dict(image_size=SIZE, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4)


def make(family: str, seed: int = 0, implementation: str = "eager", **overrides) -> torch.nn.Module:
    """A tiny random-weight ``SwinModel`` / ``Swinv2Model`` with re-drawn weights, in eval mode."""
    t = transformers
    model_cls, config_cls = {"swin": (t.SwinModel, t.SwinConfig), "swinv2": (t.Swinv2Model, t.Swinv2Config)}[family]
    torch.manual_seed(seed)
    model = model_cls._from_config(config_cls(**CONFIG, **overrides), attn_implementation=implementation)
    redraw_linear(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name:
                p.copy_(torch.randn(p.shape, generator=g))
        for mod in model.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.copy_(1 + 0.2 * torch.randn(mod.weight.shape, generator=g))
                mod.bias.copy_(0.2 * torch.randn(mod.bias.shape, generator=g))
    return model.eval()


@functools.lru_cache(maxsize=None)
def _oracle(family):
    """(photos, float64 output of the unpatched model, float32 output of the unpatched model)."""
    x, model = photos(SIZE), make(family)
    with torch.no_grad():
        return x, copy.deepcopy(model).double()(x.double()).last_hidden_state, model(x).last_hidden_state


def _run_counting(model, x, **kwargs):
    """(model output, [(mode, shift mask given)] of every window_attention call it made)."""
    calls = []
    original = ts.window_attention

    def counting(*args, **kw):
        calls.append((kw["mode"], kw["shift_mask"] is not None))
        return original(*args, **kw)

    ts.window_attention = counting
    try:
        with torch.no_grad():
            return model(x, **kwargs), calls
    finally:
        ts.window_attention = original


@pytest.mark.parametrize("family,mode", [("swin", "fp32"), ("swinv2", "fp32"), ("swin", "fp16"),
                                         ("swinv2", "bf16"), ("swin", "pasa")])
def test_patched_swin_matches_unpatched_within_mode_contract(family, mode):
    x, ref, y0 = _oracle(family)
    model = va.patch_model(make(family), mode=mode)
    assert model.visionattn_report.patched == {"swin": {SWIN_CLASS: 4}, "swinv2": {SWINV2_CLASS: 4}}[family]
    out, calls = _run_counting(model, x)
    assert [m for m, _ in calls] == [mode] * 4
    assert [shifted for _, shifted in calls] == [False, True, False, False]  # stage 2 is one window: no shift
    err, err0 = rel_l2(out.last_hidden_state, ref), rel_l2(y0, ref)
    md = va.get_mode(mode)
    bound = max(4 * err0, md.rel_tol) if md.compute_dtype == torch.float32 else md.rel_tol + 4 * err0
    assert err <= bound, f"{family}/{mode}: rel err {err:.3g} > {bound:.3g} (unpatched fp32: {err0:.3g})"


@pytest.mark.skipif(ts._LEGACY_SWIN, reason="this transformers' Swin computes attention inline (eager only)")
def test_swin_under_sdpa_implementation_is_patched_too():
    """The patcher replaces the attention-interface call whatever attn_implementation the model was loaded with."""
    x, ref, y0 = _oracle("swin")
    model = va.patch_model(make("swin", implementation="sdpa"), mode="fp32")
    out, calls = _run_counting(model, x)
    assert len(calls) == 4
    assert rel_l2(out.last_hidden_state, ref) <= max(4 * rel_l2(y0, ref), va.get_mode("fp32").rel_tol)


@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_output_attentions_runs_the_transformers_forward(family, fresh_warnings):
    plain = make(family)
    patched = va.patch_model(copy.deepcopy(plain), "fp16")
    x = photos(SIZE)[:2]
    with torch.no_grad():
        expected = plain(x, output_attentions=True)
        with pytest.warns(RuntimeWarning, match="output_attentions=True"):
            got, calls = _run_counting(patched, x, output_attentions=True)
    assert calls == []
    assert len(got.attentions) == len(expected.attentions) > 0
    assert all(torch.equal(a, b) for a, b in zip(got.attentions, expected.attentions))
    assert torch.equal(got.last_hidden_state, expected.last_hidden_state)


@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_training_with_attention_dropout_runs_the_transformers_forward(family, fresh_warnings):
    plain = make(family, attention_probs_dropout_prob=0.3)
    patched = va.patch_model(copy.deepcopy(plain), "fp32")
    x = photos(SIZE)[:2]
    outs = []
    with pytest.warns(RuntimeWarning, match="attention dropout"):
        for model in (plain.train(), patched.train()):
            torch.manual_seed(7)
            outs.append(model(x).last_hidden_state)
    assert torch.equal(*outs)  # transformers' own path, same dropout draws


@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_unpatch_restores_classes_state_dict_and_outputs(family):
    model = make(family)
    x = photos(SIZE)[:2]
    classes = [type(m) for m in model.modules()]
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(x).last_hidden_state
        va.patch_model(model, "fp16")
        assert list(model.state_dict()) == keys
        patched = model(x).last_hidden_state
        va.unpatch_model(model)
        after = model(x).last_hidden_state
    assert [type(m) for m in model.modules()] == classes
    assert torch.equal(before, after) and not torch.equal(before, patched)


def test_backward_matches_unpatched():
    """Gradients reach q / k / v, the bias table and the CPB MLP as accurately as transformers' own."""
    plain = make("swinv2").train()
    patched = va.patch_model(copy.deepcopy(plain), "fp32").train()
    oracle = copy.deepcopy(plain).double()
    x = photos(SIZE)[:2]

    def grads(model, x):
        model(x).last_hidden_state.square().sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ref = grads(oracle, x.double())
    err0 = rel_l2(grads(plain, x), ref)
    assert rel_l2(grads(patched, x), ref) <= max(4 * err0, va.get_mode("fp32").rel_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "fp16"])
@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_patched_swin_on_gpu(family, mode):
    x, ref, _ = _oracle(family)
    model = make(family).cuda()
    with torch.no_grad():
        y0 = model(x.cuda()).last_hidden_state.cpu()
        y = va.patch_model(model, mode)(x.cuda()).last_hidden_state.cpu()
    md = va.get_mode(mode)
    err, err0 = rel_l2(y, ref), rel_l2(y0, ref)
    bound = max(4 * err0, md.rel_tol) if md.compute_dtype == torch.float32 else md.rel_tol + 4 * err0
    assert err <= bound, f"{family}/{mode} on GPU: rel err {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_position_bias_kept_between_inference_forwards_and_updated_with_parameters(family, monkeypatch):
    """Eager inference computes each module's position bias once; an in-place parameter update (an optimizer
    step) reaches the next forward, which then equals a freshly patched copy's."""
    computed = []
    kept = ts.inference_cached

    def counting(module, name, sources, compute):
        return kept(module, name, sources, lambda: computed.append(name) or compute())

    monkeypatch.setattr(ts, "inference_cached", counting)
    x = photos(SIZE)[:2]
    model = va.patch_model(make(family), "fp32")
    n_modules = model.visionattn_report.num_patched
    with torch.no_grad():
        first = model(x).last_hidden_state
        second = model(x).last_hidden_state
    assert len(computed) == n_modules and torch.equal(first, second)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name or "continuous_position_bias_mlp" in name:
                p.add_(0.5 * torch.randn_like(p))
        updated = model(x).last_hidden_state
        assert len(computed) == 2 * n_modules
        fresh = va.patch_model(copy.deepcopy(va.unpatch_model(copy.deepcopy(model))), "fp32")(x).last_hidden_state
    assert not torch.equal(updated, first) and torch.equal(updated, fresh)
