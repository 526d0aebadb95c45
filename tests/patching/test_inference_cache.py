"""Position biases that patched Swin / Swin-v2 modules keep between inference forwards.

The cached bias must give the logits of recomputing it, and every way parameters change must reach the next
inference forward: an in-place update (an optimizer step), ``load_state_dict``, ``.to(dtype)``, training mode,
gradients enabled; ``clear_inference_caches`` after edits through ``.data``.
"""
import copy

import pytest
import torch

import visionattn as va
from visionattn.patching import clear_inference_caches
from patching_helpers import image_size, make_tiny, photos

FAMILIES = ["swin", "swinv2"]


def _bias_calls(model) -> list:
    """A list that grows by one each time a patched module recomputes its position bias (a hook on Swin-v2's
    cpb_mlp; on Swin, a wrapper of the patched module's _relative_position_bias)."""
    calls = []
    for mod in model.modules():
        if hasattr(mod, "cpb_mlp"):
            mod.cpb_mlp.register_forward_hook(lambda *a: calls.append(1))
        elif hasattr(mod, "_relative_position_bias"):
            inner = mod._relative_position_bias
            mod._relative_position_bias = lambda n, inner=inner: calls.append(1) or inner(n)
    return calls


def _bias_owners(model) -> int:
    return sum(hasattr(m, "cpb_mlp") or hasattr(m, "relative_position_bias_table") for m in model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_reuses_the_bias_with_identical_logits(family):
    x = photos(image_size(family))[:2]
    model = va.patch_model(make_tiny(family), "fp32")
    calls = _bias_calls(model)
    with torch.no_grad():
        first = model(x)
        assert len(calls) == _bias_owners(model)
        second = model(x)
    assert len(calls) == _bias_owners(model), "the second inference forward recomputed the position bias"
    assert torch.equal(first, second)
    unpatched = make_tiny(family)
    with torch.no_grad():
        torch.testing.assert_close(second, unpatched(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_changes_reach_the_next_forward(family):
    """In-place update, load_state_dict and .to(): each makes the next forward equal a freshly patched model's."""
    x = photos(image_size(family))[:2]
    model = va.patch_model(make_tiny(family), "fp32")
    bias_params = [p for n, p in model.named_parameters() if "cpb_mlp" in n or "relative_position_bias_table" in n]
    assert bias_params
    with torch.no_grad():
        model(x)
        for p in bias_params:  # what an optimizer step does: in place, version counter bumped
            p.add_(0.5 * torch.randn_like(p))

    def fresh_logits(m):
        clean = va.patch_model(copy.deepcopy(va.unpatch_model(copy.deepcopy(m))), "fp32")
        with torch.no_grad():
            return clean(x)

    with torch.no_grad():
        updated = model(x)
    torch.testing.assert_close(updated, fresh_logits(model), rtol=0, atol=0)
    other = make_tiny(family, seed=3)
    with torch.no_grad():
        before = model(x)
        model.load_state_dict(other.state_dict())
        loaded = model(x)
    assert not torch.equal(before, loaded)
    torch.testing.assert_close(loaded, fresh_logits(model), rtol=0, atol=0)
    model.to(torch.float64)
    with torch.no_grad():
        y64 = model(x.double())
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64, fresh_logits(model.float()).double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_and_gradients_recompute_every_forward(family):
    """With gradients enabled the bias is recomputed each call and receives its gradient."""
    x = photos(image_size(family))[:2]
    model = va.patch_model(make_tiny(family), "fp32")
    calls = _bias_calls(model)
    model(x).sum().backward()
    model(x).sum().backward()
    assert len(calls) == 2 * _bias_owners(model)
    grads = [p.grad for n, p in model.named_parameters() if "cpb_mlp" in n or "relative_position_bias_table" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    model.train()
    with torch.no_grad():
        model(x)
        model(x)
    assert len(calls) == 4 * _bias_owners(model), "training mode reused a kept bias"


def test_clear_and_unpatch_drop_the_kept_values():
    """After an edit through .data (invisible to the version counter) clear_inference_caches brings the new
    values in; unpatch_model leaves nothing behind."""
    x = photos(image_size("swinv2"))[:2]
    model = va.patch_model(make_tiny("swinv2"), "fp32")
    with torch.no_grad():
        model(x)
        for mod in model.modules():
            if hasattr(mod, "cpb_mlp"):
                mod.cpb_mlp[0].weight.data.mul_(3.0)
        stale = model(x)
        fresh = clear_inference_caches(model)(x)
    assert not torch.equal(stale, fresh)
    with torch.no_grad():
        model(x)
    kept = lambda m: [a for mod in m.modules() for a in vars(mod) if a.startswith("_visionattn_cached_")]  # noqa: E731
    assert kept(model)
    assert kept(va.unpatch_model(model)) == []


def test_inference_mode_values_stay_in_inference_mode():
    """A bias made under torch.inference_mode is not reused under no_grad (and the reverse): both run and agree."""
    x = photos(image_size("swinv2"))[:2]
    model = va.patch_model(make_tiny("swinv2"), "fp32")
    calls = _bias_calls(model)
    with torch.inference_mode():
        a = model(x)
    with torch.no_grad():
        b = model(x)
    assert len(calls) == 2 * _bias_owners(model)
    assert torch.equal(a, b)


def test_a_model_built_under_inference_mode_runs_without_the_cache():
    """Parameters made under torch.inference_mode track no version counter: the bias is computed every forward,
    and the patched model gives the unpatched model's logits."""
    x = photos(image_size("swinv2"))[:2]
    with torch.inference_mode():
        model = va.patch_model(make_tiny("swinv2"), "fp32")
        unpatched = make_tiny("swinv2")
        calls = _bias_calls(model)
        y, y0 = model(x), unpatched(x)
        model(x)
    assert len(calls) == 2 * _bias_owners(model)
    torch.testing.assert_close(y, y0, rtol=1e-4, atol=1e-5)
