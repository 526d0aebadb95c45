"""patch_model on diffusers models whose attention goes through dispatch_attention_fn (Flux, Wan) or
through a classic processor calling SDPA itself (SD3's JointAttnProcessor2_0).

Tiny random-weight models on CPU, patched vs unpatched within the fp32 mode's rel_tol; the image
tokens of the Flux model are a real photo, packed 2x2 as Flux packs its latents.
"""
import os
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from patching_helpers import redraw_linear
from testdata import PHOTOS

diffusers = pytest.importorskip("diffusers")
dispatch = pytest.importorskip("diffusers.models.attention_dispatch")

import visionattn as va  # noqa: E402
from visionattn.patching.diffusers_dispatch import dispatch_counts, is_dispatch_patched  # noqa: E402

TOL = va.get_mode("fp32").rel_tol


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _photo_tokens(size: int = 16) -> torch.Tensor:
    """Two photos at size x size, packed 2x2 into tokens: [2, (size/2)^2, 12] float32 in [-1, 1]."""
    files = sorted(f for f in os.listdir(PHOTOS) if f.lower().endswith((".jpg", ".png")))[:2]
    x = np.stack([np.asarray(Image.open(os.path.join(PHOTOS, f)).convert("RGB").resize((size, size), Image.BILINEAR))
                  for f in files])
    x = torch.from_numpy(x).float().div(127.5).sub(1.0).permute(0, 3, 1, 2)  # [2, 3, size, size]
    h = size // 2
    return x.reshape(2, 3, h, 2, h, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, h * h, 12)


def _flux():
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=12, num_layers=1, num_single_layers=2,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    g = torch.Generator().manual_seed(1)
    grid = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.0), torch.arange(8.0), indexing="ij"), -1)
    inputs = dict(hidden_states=_photo_tokens(), encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                  pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor([0.3, 0.8]),
                  img_ids=grid.reshape(-1, 3), txt_ids=torch.zeros(8, 3), return_dict=False)
    return redraw_linear(model), inputs


def _run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def test_flux_patched_matches_unpatched_and_unpatch_restores_bits():
    model, inputs = _flux()
    before = _run(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "nothing to patch" warning
        va.patch_model(model, mode="fp32")
    report = model.visionattn_report
    assert report.patched == {"diffusers processor FluxAttnProcessor (dispatch_attention_fn)": 3}
    assert report.num_patched == 3 and report.skipped == []
    assert is_dispatch_patched(model)
    patched = _run(model, inputs)
    counts = dispatch_counts(model)
    assert counts["routed"] == 3 and counts["passed"] == 0 and set(counts["modules"].values()) == {1}
    assert 0 < _rel(patched, before) <= TOL, _rel(patched, before)
    va.unpatch_model(model)
    assert not is_dispatch_patched(model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.equal(_run(model, inputs), before)


def test_flux_repatch_changes_mode_and_pinned_backend_is_skipped():
    model, inputs = _flux()
    before = _run(model, inputs)
    va.patch_model(model, mode="fp32")
    va.patch_model(model, mode="bf16")  # re-patching replaces the hooks, does not stack them
    assert all(len(m._forward_pre_hooks) <= 1 for m in model.modules())
    out = _run(model, inputs)
    assert dispatch_counts(model)["routed"] == 3
    assert TOL < _rel(out, before) <= va.get_mode("bf16").rel_tol  # now bf16 attention (fp32 elsewhere)
    va.unpatch_model(model)

    model.single_transformer_blocks[0].attn.processor._attention_backend = dispatch.AttentionBackendName.FLASH
    model.single_transformer_blocks[1].attn.processor._attention_backend = dispatch.AttentionBackendName._NATIVE_MATH
    va.patch_model(model, mode="fp32")
    report = model.visionattn_report
    assert report.num_patched == 2  # the native-math module is routed; the flash-pinned one is not
    assert [s[0] for s in report.skipped] == ["single_transformer_blocks.0.attn.processor"]
    assert "'flash'" in report.skipped[0][2]
    va.unpatch_model(model)


def test_wan_is_patched():
    torch.manual_seed(0)
    model = redraw_linear(diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2,
                                                          attention_head_dim=8, in_channels=4, out_channels=4,
                                                          text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                                                          rope_max_seq_len=32))
    g = torch.Generator().manual_seed(2)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 6, 16, generator=g), return_dict=False)
    before = _run(model, inputs)
    va.patch_model(model, mode="fp32")
    assert model.visionattn_report.patched == {"diffusers processor WanAttnProcessor (dispatch_attention_fn)": 2}
    assert _rel(_run(model, inputs), before) <= TOL and dispatch_counts(model)["routed"] == 2
    va.unpatch_model(model)
    assert torch.equal(_run(model, inputs), before)


def test_sd3_joint_processor_is_patched():
    torch.manual_seed(0)
    model = redraw_linear(diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                                    attention_head_dim=8, num_attention_heads=2,
                                                    joint_attention_dim=16, caption_projection_dim=16,
                                                    pooled_projection_dim=16, out_channels=4))
    g = torch.Generator().manual_seed(3)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(2, 5, 16, generator=g),
                  pooled_projections=torch.randn(2, 16, generator=g), timestep=torch.tensor([10, 900]),
                  return_dict=False)
    before = _run(model, inputs)
    va.patch_model(model, mode="fp32")
    assert model.visionattn_report.patched == {
        "diffusers processor JointAttnProcessor2_0 (scaled_dot_product_attention)": 2}
    assert model.visionattn_report.skipped == []
    assert _rel(_run(model, inputs), before) <= TOL and dispatch_counts(model)["routed"] == 2
    va.unpatch_model(model)
    assert torch.equal(_run(model, inputs), before)


def test_unrouted_call_warns_once(fresh_warnings):
    """A forward whose attention never reaches SDPA (a non-native backend chosen process-wide) says so."""
    model, inputs = _flux()
    va.patch_model(model, mode="fp32")
    with dispatch.attention_backend("flex"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(model, inputs)
    ours = [str(w.message) for w in caught if "visionattn" in str(w.message)]
    assert len(ours) == 1 and "made no SDPA call" in ours[0]
    assert dispatch_counts(model)["routed"] == 0
    va.unpatch_model(model)


def test_override_covers_only_dispatch_attention_fn_and_unpatch_restores_it(monkeypatch):
    """The routing TorchFunctionMode is active only inside the processor module's dispatch_attention_fn: it never
    sees the processor's projections (F.linear); the wrapper stays while any patched model uses it and diffusers'
    own function is back after the last unpatch."""
    from diffusers.models.transformers import transformer_flux

    from visionattn.patching.sdpa import SDPAOverride

    seen = []
    original_tf = SDPAOverride.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return original_tf(self, func, types, args, kwargs)

    monkeypatch.setattr(SDPAOverride, "__torch_function__", spy)
    model, inputs = _flux()
    other, _ = _flux()
    before = _run(model, inputs)
    va.patch_model(model, mode="fp32")
    va.patch_model(other, mode="fp32")
    assert transformer_flux.dispatch_attention_fn._visionattn_original is dispatch.dispatch_attention_fn
    out = _run(model, inputs)
    assert dispatch_counts(model)["routed"] == 3 and _rel(out, before) <= TOL
    assert "scaled_dot_product_attention" in seen and "linear" not in seen, sorted(set(seen))
    assert len(seen) <= 3 * 12  # a few permutes / views around each of the 3 SDPA calls, not the whole processor
    va.unpatch_model(model)
    assert transformer_flux.dispatch_attention_fn._visionattn_original is dispatch.dispatch_attention_fn  # other
    assert torch.equal(_run(model, inputs), before)  # the unpatched model is not routed by the wrapper
    assert dispatch_counts(other)["routed"] == 0
    va.unpatch_model(other)
    assert transformer_flux.dispatch_attention_fn is dispatch.dispatch_attention_fn


def test_compiled_patched_flux_routes_the_same_calls():
    """torch.compile (TorchDynamo, eager backend) traces through the hooks and the dispatch wrapper: the compiled
    model routes its three attention calls to visionattn and gives the eager patched model's output."""
    model, inputs = _flux()
    va.patch_model(model, mode="fp32")
    eager = _run(model, inputs)
    routed = dispatch_counts(model)["routed"]
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        out = compiled(**inputs)[0]
    assert dispatch_counts(model)["routed"] == routed + 3
    assert torch.equal(out, eager)
    va.unpatch_model(model)
