"""visionattn registered as a transformers attention implementation.

Tiny random-weight transformers models loaded with ``attn_implementation="visionattn_fp32"``
are compared with the same weights under ``"sdpa"`` on the real photos of tests/data/photos.
On CPU visionattn runs its FP32 reference, so the contract is the fp32 mode's rel_tol (2e-6
relative L2).
"""
import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from patching_helpers import redraw_linear
from testdata import PHOTOS, REPO

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"visionattn.integrations.transformers needs transformers>=5, found {transformers.__version__}",
                allow_module_level=True)

from visionattn import get_mode  # noqa: E402
from visionattn.integrations import transformers as vt  # noqa: E402

TOL = get_mode("fp32").rel_tol
SIZE = 32  # tiny image size of every vision config below


def photos(size: int = SIZE, count: int = 4) -> torch.Tensor:
    """The first ``count`` photos, resized to ``size`` x ``size``, in [-1, 1]: [count, 3, size, size] float32."""
    files = sorted(f for f in os.listdir(PHOTOS) if f.lower().endswith((".jpg", ".png")))[:count]
    arrays = [np.asarray(Image.open(os.path.join(PHOTOS, f)).convert("RGB").resize((size, size), Image.BILINEAR))
              for f in files]
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0
    return (x - 0.5) / 0.5


def _pair(model_cls, config, implementation="visionattn_fp32"):
    """(visionattn model, sdpa model) with identical random weights, in eval mode."""
    torch.manual_seed(0)
    ours = redraw_linear(model_cls._from_config(copy.deepcopy(config), attn_implementation=implementation))
    ref = model_cls._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ref.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == implementation and ref.config._attn_implementation == "sdpa"
    return ours, ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _vision_cases():
    t = transformers
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=SIZE, patch_size=8)
    cases = {
        "vit": (t.ViTModel, t.ViTConfig(**common)),
        "deit": (t.DeiTModel, t.DeiTConfig(**common)),
        "dinov2": (t.Dinov2Model, t.Dinov2Config(**{k: v for k, v in common.items() if k != "intermediate_size"},
                                                  mlp_ratio=2)),
        "siglip": (t.SiglipVisionModel, t.SiglipVisionConfig(**common)),
        "clip": (t.CLIPVisionModel, t.CLIPVisionConfig(**common)),
        # relative position bias + the shifted-window mask reach the function as one additive mask
        "swin": (t.SwinModel, t.SwinConfig(image_size=SIZE, patch_size=4, embed_dim=16, depths=[2, 2],
                                           num_heads=[2, 4], window_size=4)),
    }
    return cases


@pytest.fixture(scope="module", autouse=True)
def registered():
    vt.register()
    yield


@pytest.mark.parametrize("family", list(_vision_cases()))
def test_vision_model_matches_sdpa_on_photos(family):
    model_cls, config = _vision_cases()[family]
    ours, ref = _pair(model_cls, config)
    x = photos()
    calls = []
    orig = vt.attention

    def spy(*args, **kwargs):
        calls.append(kwargs["mode"])
        return orig(*args, **kwargs)

    vt.attention = spy
    try:
        with torch.no_grad():
            out = ours(pixel_values=x).last_hidden_state
    finally:
        vt.attention = orig
    with torch.no_grad():
        expected = ref(pixel_values=x).last_hidden_state
    assert calls and set(calls) == {"fp32"}, f"visionattn was not called by {family}"
    assert _rel(out, expected) <= TOL, f"{family}: rel L2 {_rel(out, expected):.2e} > {TOL}"


def _siglip2_inputs(patch: int = 8, max_patches: int = 16):
    """NaFlex inputs from two photos: one full 32x32 grid (16 patches), one 24x32 (12 patches + 4 padding)."""
    x = photos(SIZE, count=2)
    seqs, shapes, masks = [], [], []
    for img, h in zip(x, (SIZE, 24)):
        img = img[:, :h]
        nh, nw = h // patch, SIZE // patch
        p = img.reshape(3, nh, patch, nw, patch).permute(1, 3, 2, 4, 0).reshape(nh * nw, patch * patch * 3)
        pad = max_patches - nh * nw
        seqs.append(torch.cat([p, torch.zeros(pad, p.shape[1])]))
        masks.append(torch.cat([torch.ones(nh * nw, dtype=torch.long), torch.zeros(pad, dtype=torch.long)]))
        shapes.append((nh, nw))
    return torch.stack(seqs), torch.stack(masks), torch.tensor(shapes)


def test_siglip2_padding_mask_matches_sdpa():
    config = transformers.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, patch_size=8, num_patches=16)
    ours, ref = _pair(transformers.Siglip2VisionModel, config)
    pixels, mask, shapes = _siglip2_inputs()
    with torch.no_grad():
        out = ours(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=shapes)
        expected = ref(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=shapes)
        unmasked = ours(pixel_values=pixels, pixel_attention_mask=torch.ones_like(mask), spatial_shapes=shapes)
    valid = mask.bool()
    assert _rel(out.last_hidden_state[valid], expected.last_hidden_state[valid]) <= TOL
    assert _rel(out.pooler_output, expected.pooler_output) <= TOL
    # the mask reached the attention: without it the padded sample's valid tokens change
    assert _rel(unmasked.last_hidden_state[1][valid[1]], out.last_hidden_state[1][valid[1]]) > 1e-3


@pytest.mark.parametrize("padded", [False, True])
def test_causal_text_model_with_padding_matches_sdpa(padded):
    """CLIP's text tower: causal (is_causal without padding, a boolean causal + padding mask with it)."""
    config = transformers.CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=16)
    ours, ref = _pair(transformers.CLIPTextModel, config)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 7:] = 0
    with torch.no_grad():
        out = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        expected = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    assert _rel(out, expected) <= TOL


def test_grouped_query_attention_matches_sdpa():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ours, ref = _pair(transformers.LlamaModel, config)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ours(input_ids=ids, use_cache=False).last_hidden_state
        expected = ref(input_ids=ids, use_cache=False).last_hidden_state
    assert _rel(out, expected) <= TOL


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's kernel launches")
def test_grouped_query_attention_reads_kv_heads_in_place(kernel_launches):
    """A grouped-query call (2 K / V heads for 4 query heads, Llama's layout) reaches the kernels with the caller's
    K / V, not transformers' ``repeat_kv`` copy: every dense kernel launch gets K's data pointer and its 2 heads;
    the output is SDPA's with ``enable_gqa=True``."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k, v = (torch.randn(2, 2, 9, 16, generator=g) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = vt.attention_forward(module, q, k, v, None, scaling=0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert _rel(out, ref.transpose(1, 2)) <= TOL
    launches = [args for name, args, _ in kernel_launches if name == "_elsa_fwd_kernel"]
    assert launches and all(a[1].data_ptr() == k.data_ptr() and a[1].shape == k.shape for a in launches)


def test_output_attentions_warns_and_returns_no_maps(fresh_warnings):
    model_cls, config = _vision_cases()["vit"]
    ours, ref = _pair(model_cls, config)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="does not compute attention weights"):
        out = ours(pixel_values=photos(count=1), output_attentions=True)
        expected = ref(pixel_values=photos(count=1))
    assert not any(a is not None for a in (out.attentions or ()))
    assert _rel(out.last_hidden_state, expected.last_hidden_state) <= TOL


def test_training_with_attention_dropout_is_refused():
    config = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    image_size=SIZE, patch_size=8, attention_probs_dropout_prob=0.1)
    model = transformers.ViTModel._from_config(config, attn_implementation="visionattn_fp32").train()
    with pytest.raises(ValueError, match="attention dropout p=0.1"):
        model(pixel_values=photos(count=1))
    with torch.no_grad():
        model.eval()(pixel_values=photos(count=1))  # dropout is 0.0 outside training


@pytest.mark.parametrize("kwarg", ["softcap", "s_aux", "head_mask"])
def test_unsupported_arguments_are_refused(kwarg):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=kwarg):
        vt.attention_forward(torch.nn.Module(), q, q, q, None, **{kwarg: torch.ones(2)})
    with pytest.raises(NotImplementedError, match="paged cache"):
        vt.attention_forward(torch.nn.Module(), q, q, q, None, cache=object())


def test_float_mask_and_position_bias_are_additive():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 3, 5, 5, generator=g)
    mask = torch.zeros(2, 1, 5, 5).masked_fill(torch.rand(2, 1, 5, 5, generator=g) < 0.3, float("-inf"))
    mask[..., 0] = 0.0  # no fully masked row
    module = torch.nn.Module()
    out, weights = vt.attention_forward(module, q, k, v, mask, scaling=0.3, position_bias=bias)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask + bias, scale=0.3)
    assert weights is None and out.shape == (2, 5, 3, 8) and out.is_contiguous()
    assert _rel(out, ref.transpose(1, 2)) <= TOL


def test_register_is_idempotent_and_names_are_checked():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    before = {name: AttentionInterface._global_mapping[name] for name in vt.registered_names()}
    assert vt.register() == "visionattn" and vt.register("fp32") == "visionattn"
    assert {name: AttentionInterface._global_mapping[name] for name in vt.registered_names()} == before
    assert set(before) >= {"visionattn", "visionattn_fp32", "visionattn_fp32-ieee", "visionattn_tf32",
                           "visionattn_fp16", "visionattn_bf16"}
    assert all(AttentionMaskInterface._global_mapping[name] is sdpa_mask for name in before)
    assert vt.implementation_name("fp32-ieee") == "visionattn_fp32-ieee"
    try:
        vt.register("bf16")
        assert vt.registered_names()["visionattn"] == "bf16"
        assert AttentionInterface._global_mapping["visionattn"] is before["visionattn_bf16"]
        assert vt.register("tf32", name="my_attention") == "my_attention"
    finally:
        vt.register("fp32")
    for bad in ("sdpa", "eager", "flash_attention_2", "org/kernel", ""):
        with pytest.raises(ValueError):
            vt.register(name=bad)
    with pytest.raises(ValueError, match="fixed name of mode 'fp32'"):
        vt.register("fp16", name="visionattn_fp32")
    with pytest.raises(ValueError, match="mode"):
        vt.register("fp64")


def test_register_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(ImportError, match=r"visionattn\[video\]"):
        vt.register()


def test_transformers_is_imported_only_by_register():
    code = ("import sys, visionattn, visionattn.integrations.transformers as vt\n"
            "print('transformers' in sys.modules, end=' ')\n"
            "vt.register()\n"
            "print('transformers' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]
