"""patch_model on timm's NaFlexViT: padded batches of mixed aspect ratios run ragged (varlen) attention over
the valid tokens; the unpatched model (timm's SDPA on its additive padding mask) is the reference.

Tiny random NaFlexViT (2 blocks, width 64, 4 heads; linear weights redrawn so the logits are O(1) and the
softmax far from uniform) on real photos resized to different aspect ratios in one batch. Valid tokens and
the pooled logits must be within the FP32 contract of the float64 unpatched model (as close as the unpatched
FP32 model, a few x); padded rows get the unpatched model's uniform attention (symmetric mask) or attention
over the valid keys (key-only mask).
"""
import copy
import dataclasses
import os

import pytest
import timm
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from timm.models.naflexvit import NaFlexVitCfg

import visionattn as va
from visionattn.metrics import rel_l2
from visionattn.patching import naflex
from patching_helpers import PHOTOS, redraw_linear

pytestmark = pytest.mark.skipif(not naflex.PATCHES, reason="this timm's NaFlexVit has no _forward_embeds (timm < "
                                                         "1.0.18): padded batches run the masked dense path")

NAME = "naflexvit_base_patch16_gap"
# (photo, height, width): landscape, portrait, square, panorama -> 18, 18, 16, 14 patches of 16 x 16
IMAGES = [("apple.jpg", 48, 96), ("baboon.jpg", 96, 48), ("fruits.jpg", 64, 64), ("building.jpg", 32, 112)]


def tiny_naflex(seed=0, **kw):
    torch.manual_seed(seed)
    model = timm.create_model(NAME, pretrained=False, depth=2, embed_dim=64, num_heads=4, num_classes=10, **kw)
    return redraw_linear(model, seed)


def batch(device="cpu", images=IMAGES):
    imgs = [TF.normalize(TF.to_tensor(Image.open(os.path.join(PHOTOS, f)).convert("RGB").resize((w, h))),
                         [0.5] * 3, [0.5] * 3) for f, h, w in images]
    return {k: t.to(device) for k, t in naflex.naflex_batch(imgs, 16).items()}


def features(model, b):
    return model.forward_features(b["patches"], b["patch_coord"], b["patch_valid"])["patches"]


def token_valid(model, b):
    pv = b["patch_valid"]
    return torch.cat([pv.new_ones(pv.shape[0], model.num_prefix_tokens), pv], 1)


def check_against_unpatched(model, b, mode="fp32", **options):
    """Patched vs unpatched (float32 and float64) features and logits; returns (patched, unpatched) features."""
    ref64 = copy.deepcopy(model).double()
    b64 = {k: t.double() if t.is_floating_point() else t for k, t in b.items()}
    with torch.no_grad():
        f0, y0 = features(model, b), model(b)
        f64, y64 = features(ref64, b64), ref64(b64)
        va.patch_model(model, mode, **options)
        f, y = features(model, b), model(b)
    v = token_valid(model, b)
    for got, base, oracle in ((f[v], f0[v], f64[v]), (y, y0, y64)):
        err, err0 = rel_l2(got, oracle), rel_l2(base, oracle)
        assert err <= max(4 * err0, va.get_mode(mode).rel_tol), f"rel err {err:.3g} (unpatched fp32 {err0:.3g})"
    return f, f0


def test_mixed_aspect_ratios_match_unpatched():
    """Symmetric mask (timm's default): valid tokens and logits within the FP32 contract; every block's
    attention took the ragged path; padded rows are the unpatched model's uniform attention."""
    model = tiny_naflex()
    b = batch()
    assert len(set(b["patch_valid"].sum(1).tolist())) >= 3  # three or more different lengths
    calls = []
    real = naflex.key_padding_attention

    def counting(*args, **kw):
        calls.append(args[3])
        return real(*args, **kw)

    from visionattn.patching import timm as timm_patch
    timm_patch.key_padding_attention = counting
    try:
        f, f0 = check_against_unpatched(model, b, backend="triton")
    finally:
        timm_patch.key_padding_attention = real
    assert model.visionattn_report.patched == {"timm.models.naflexvit.NaFlexVit": 1,
                                               "timm.layers.attention.Attention": 2}
    assert len(calls) == 2 * 2 and all(kp.symmetric for kp in calls)  # 2 blocks x (features, logits)
    pad = ~token_valid(model, b)
    assert rel_l2(f[pad], f0[pad]) <= 1e-5


@pytest.mark.skipif(not any(f.name == "use_key_only_attn_mask" for f in dataclasses.fields(NaFlexVitCfg)),
                    reason="this timm's NaFlexViT builds only the symmetric mask (no use_key_only_attn_mask)")
def test_key_only_mask():
    """``use_key_only_attn_mask``: padded query rows attend the valid keys, as the unpatched model's."""
    model = tiny_naflex(use_key_only_attn_mask=True)
    b = batch()
    f, f0 = check_against_unpatched(model, b, backend="triton")
    assert rel_l2(f, f0) <= 1e-5


def test_rope_variant():
    """Axial rope (``rope_type``): the blocks' ``AttentionRope`` modules take the same ragged path."""
    model = tiny_naflex(rope_type="axial")
    check_against_unpatched(model, batch(), backend="triton")
    assert model.visionattn_report.patched == {"timm.models.naflexvit.NaFlexVit": 1,
                                               "timm.layers.attention.AttentionRope": 2}


def test_training_gradients_match_unpatched():
    """A training step through the varlen backward: parameter gradients as the unpatched model's."""
    model = tiny_naflex().train()
    ref = copy.deepcopy(model)
    va.patch_model(model, "fp32", backend="triton")
    b = batch(images=IMAGES[:3])
    grads = []
    for m in (model, ref):
        m.zero_grad()
        (m(b) ** 2).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    assert rel_l2(grads[0], grads[1]) <= 1e-5


def test_half_mode_caller_mask_and_unpatch():
    """bf16 attention within its contract; a caller's own attn_mask is not reinterpreted (dense path, no
    packing recorded); pasa has no ragged kernel (warned, dense masked kernel); unpatch restores timm."""
    model = tiny_naflex()
    b = batch(images=IMAGES[1:])
    with torch.no_grad():
        y0 = model(b)
        va.patch_model(model, "bf16", backend="triton")
        assert rel_l2(model(b), y0) <= 4 * va.get_mode("bf16").rel_tol
        emb = model._forward_embeds(b["patches"], b["patch_coord"], b["patch_valid"], None)
        assert naflex.key_padding_of(emb["attn_mask"]) is not None
        own = emb["attn_mask"].clone()
        assert naflex.key_padding_of(own) is None
        va.patch_model(model, "pasa", backend="triton")
        with pytest.warns(RuntimeWarning, match="no ragged"):
            y = model(b)
        assert rel_l2(y, y0) <= 4 * va.get_mode("pasa").rel_tol
    va.unpatch_model(model)
    assert type(model) is timm.models.naflexvit.NaFlexVit
    with torch.no_grad():
        assert torch.equal(model(b), y0)


def test_key_padding_keeps_its_offsets_on_the_host_too():
    """The packing holds the valid tokens' offsets on the mask's device and on the CPU (what the attention calls
    pass: the lengths without a synchronisation per layer), equal, with the longest image's count."""
    valid = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    kp = naflex.KeyPadding.from_valid(valid, symmetric=True)
    assert kp.cu_seqlens_host.device.type == "cpu" and kp.cu_seqlens_host.dtype == torch.int32
    assert kp.cu_seqlens_host.tolist() == kp.cu_seqlens.tolist() == [0, 2, 7, 7, 10]
    assert kp.max_seqlen == 5 and kp.rows.tolist() == [0, 1, 5, 6, 7, 8, 9, 15, 17, 19]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_gpu_naflex_base_batch(mode):
    """naflexvit_base (12 blocks, width 768) on 16 images of mixed aspect ratios up to 256 patches, CUDA:
    valid tokens and logits as the unpatched model's (FP32: as close to the float64 model; bf16: its contract)."""
    torch.manual_seed(0)
    model = timm.create_model(NAME, pretrained=False, num_classes=10).cuda().eval()
    files = sorted(f for f in os.listdir(PHOTOS) if f.endswith(".jpg"))
    shapes = [(256, 256), (128, 512), (512, 96), (192, 320), (96, 96), (320, 160), (64, 448), (224, 224)]
    images = [(files[i % len(files)], *shapes[i % len(shapes)]) for i in range(16)]
    b = batch("cuda", images)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        y0 = ref(b)
        f0 = features(ref, b)
        va.patch_model(model, mode)
        y, f = model(b), features(model, b)
    v = token_valid(model, b)
    bound = 1e-4 if mode == "fp32" else 4 * va.get_mode(mode).rel_tol
    assert rel_l2(f[v], f0[v]) <= bound and rel_l2(y, y0) <= bound
