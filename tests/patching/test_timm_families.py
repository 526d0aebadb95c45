"""patch_model on BEiT, CaiT, XCiT, CoAtNet, MaxViT, Hiera and MViTv2 (visionattn.patching.timm_families).

Oracle: the *unpatched* model in float64 on the real photos, same weights. A patched FP32
model must be as close to it as the unpatched FP32 model is (a few x); a half mode within
its contract plus that. Weights are random (no hub here), re-drawn so that the attention is
far from uniform and every relative position term matters: linear weights ~ N(0, 1/fan_in),
relative position tables / MLPs and XCiT temperatures O(1), LayerNorm weights around 1.
"""
import copy
import functools

import pytest
import timm
import torch
from timm.models import mvitv2

import visionattn as va
from visionattn.metrics import rel_l2
from visionattn.patching.timm import _dense_core as dense_core, _window_core as window_core, override_cores
from patching_helpers import photos, redraw_linear

BEIT = dict(depth=2, embed_dim=64, num_heads=2)
# name -> (constructor () -> model, image size, {patched class: count})
FAMILIES = {
    "beit": (lambda: timm.create_model("beit_base_patch16_224", img_size=64, **BEIT), 64,
             {"timm.models.beit.Attention": 2}),
    "beit-shared-bias": (lambda: timm.create_model("beit_base_patch16_224", img_size=64, use_rel_pos_bias=False,
                                                   use_shared_rel_pos_bias=True, **BEIT), 64,
                         {"timm.models.beit.Attention": 2}),
    "cait": (lambda: timm.create_model("cait_xxs24_224", img_size=64, depth=2, embed_dim=64, num_heads=2), 64,
             {"timm.models.cait.ClassAttn": 2}),
    "xcit": (lambda: timm.create_model("xcit_nano_12_p16_224", img_size=64, depth=2, embed_dim=64, num_heads=2), 64,
             {"timm.models.xcit.XCA": 2, "timm.models.cait.ClassAttn": 2}),
    "coatnet": (lambda: timm.create_model("coatnet_nano_rw_224", img_size=64), 64,
                {"timm.models.maxxvit.Attention2d": 9}),
    "maxvit": (lambda: timm.create_model("maxvit_rmlp_pico_rw_256", img_size=64), 64,
               {"timm.models.maxxvit.AttentionCl": 22}),
    "maxvit-tf": (lambda: timm.create_model("maxvit_tiny_tf_224", img_size=64), 64,
                  {"timm.models.maxxvit.AttentionCl": 22}),
    "hiera": (lambda: timm.create_model("hiera_tiny_224", img_size=64, embed_dim=16, num_heads=1,
                                        stages=(1, 1, 1, 1)), 64,
              {"timm.models.hiera.MaskUnitAttention": 4}),
    "mvitv2": (lambda: mvitv2.MultiScaleVit(mvitv2.MultiScaleVitCfg(
        depths=(1, 2), embed_dim=(16, 32), num_heads=(1, 2), use_cls_token=True,
        stride_q=((1, 1), (2, 2)), stride_kv_adaptive=(4, 4)), img_size=(64, 64)), 64,
               {"timm.models.mvitv2.MultiScaleAttention": 3}),
    "mvitv2-no-cls": (lambda: mvitv2.MultiScaleVit(mvitv2.MultiScaleVitCfg(
        depths=(1, 2), embed_dim=(16, 32), num_heads=(1, 2), stride_q=((1, 1), (2, 2)),
        stride_kv_adaptive=(4, 4)), img_size=(64, 64)), 64,
                      {"timm.models.mvitv2.MultiScaleAttention": 3}),
}

# tensors that feed the attention logits besides q / k: O(1) so a wrong bias path shows
_BIAS_PARAMS = ("relative_position_bias_table", "rel_pos_h", "rel_pos_w", "rel_pos.mlp")


def make(family: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight ``family`` model in eval mode with re-drawn weights (see the module docstring)."""
    torch.manual_seed(seed)
    model = FAMILIES[family][0]()
    redraw_linear(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(key in name for key in _BIAS_PARAMS):
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if "rel_pos_" in name else 1.0))
            elif name.endswith("temperature"):
                p.copy_(0.5 + 2 * torch.rand(p.shape, generator=g))
        for mod in model.modules():
            if isinstance(mod, torch.nn.LayerNorm) and mod.weight is not None:
                mod.weight.copy_(1 + 0.2 * torch.randn(mod.weight.shape, generator=g))
                mod.bias.copy_(0.2 * torch.randn(mod.bias.shape, generator=g))
    return model.eval()


@functools.lru_cache(maxsize=None)
def _oracle(family):
    """(photos, float64 logits of the unpatched model, float32 logits of the unpatched model)."""
    x, model = photos(FAMILIES[family][1]), make(family)
    with torch.no_grad():
        return x, copy.deepcopy(model).double()(x.double()), model(x)


def _check(family, mode, model):
    x, ref, y0 = _oracle(family)
    calls = []

    def counting(core):
        def counted(*args, **kwargs):
            calls.append(kwargs["mode"])
            return core(*args, **kwargs)
        return counted

    with torch.no_grad(), override_cores(dense=counting(dense_core), window=counting(window_core)):
        y = model(x)
    assert calls == [mode] * model.visionattn_report.num_patched, f"{family}: visionattn core calls {calls}"
    err, err0 = rel_l2(y, ref), rel_l2(y0, ref)
    md = va.get_mode(mode)
    bound = max(4 * err0, md.rel_tol) if md.compute_dtype == torch.float32 else md.rel_tol + 4 * err0
    assert err <= bound, f"{family}/{mode}: logits rel err {err:.3g} > {bound:.3g} (unpatched fp32: {err0:.3g})"
    if md.compute_dtype == torch.float32:
        assert torch.equal(y.argmax(-1), ref.argmax(-1)), f"{family}/{mode}: predicted class changed"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_family_matches_unpatched_fp32(family):
    model = va.patch_model(make(family), mode="fp32")
    assert model.visionattn_report.patched == FAMILIES[family][2]
    _check(family, "fp32", model)


@pytest.mark.parametrize("family,mode", [("beit", "fp16"), ("xcit", "bf16"), ("maxvit", "fp16"), ("hiera", "bf16"),
                                         ("mvitv2", "fp16"), ("cait", "pasa"), ("coatnet", "bf16")])
def test_patched_family_within_half_mode_contract(family, mode):
    _check(family, mode, va.patch_model(make(family), mode=mode))


@pytest.mark.parametrize("family", ["maxvit", "maxvit-tf"])
def test_maxvit_partitions_run_on_the_window_kernel(family):
    """Block and grid partitions (<= 64 tokens) take window_attention with the relative position bias."""
    model = va.patch_model(make(family), mode="fp32")
    cores = []

    def tagged(name, core):
        def run(*args, **kwargs):
            cores.append(name)
            return core(*args, **kwargs)
        return run

    with torch.no_grad(), override_cores(dense=tagged("dense", dense_core), window=tagged("window", window_core)):
        model(photos(FAMILIES[family][1])[:1])
    assert cores == ["window"] * model.visionattn_report.num_patched


@pytest.mark.parametrize("family", ["beit", "xcit", "coatnet", "hiera", "mvitv2"])
def test_unpatch_restores_classes_state_dict_and_outputs(family):
    model = make(family)
    x = photos(FAMILIES[family][1])[:2]
    classes = [type(m) for m in model.modules()]
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(x)
        va.patch_model(model, "fp16")
        assert list(model.state_dict()) == keys
        patched = model(x)
        va.unpatch_model(model)
        after = model(x)
    assert [type(m) for m in model.modules()] == classes
    assert torch.equal(before, after) and not torch.equal(before, patched)


def test_talking_heads_and_pool_first_attention_are_reported_skipped():
    cait = va.patch_model(make("cait"), "fp32")
    skipped = {cls: reason for _, cls, reason in cait.visionattn_report.skipped}
    assert "after the softmax" in skipped["timm.models.cait.TalkingHeadAttn"]
    assert "timm.models.cait.ClassAttn" not in skipped
    cfg = mvitv2.MultiScaleVitCfg(depths=(1, 1), embed_dim=(16, 32), num_heads=(1, 2), pool_first=True)
    model = mvitv2.MultiScaleVit(cfg, img_size=(32, 32))
    with pytest.warns(RuntimeWarning, match="nothing to patch"):
        va.patch_model(model, "fp32")
    assert {cls for _, cls, _ in model.visionattn_report.skipped} == {
        "timm.models.mvitv2.MultiScaleAttentionPoolFirst"}
    assert "untransposed k" in model.visionattn_report.skipped[0][2]


@pytest.mark.parametrize("family", ["beit", "xcit", "maxvit"])
def test_training_with_attention_dropout_runs_the_timm_forward(family, fresh_warnings):
    plain = make(family)
    for mod in plain.modules():
        if isinstance(getattr(mod, "attn_drop", None), torch.nn.Dropout):
            mod.attn_drop.p = 0.3
    patched = va.patch_model(copy.deepcopy(plain), "fp32")
    x = photos(FAMILIES[family][1])[:2]
    outs = []
    with pytest.warns(RuntimeWarning, match="attention dropout"):
        for model in (plain.train(), patched.train()):
            torch.manual_seed(7)
            outs.append(model(x))
    assert torch.equal(*outs)  # timm's own path, same dropout draws


def _grads(model, x):
    """All parameter gradients of ``sum(model(x)^2)`` as one vector (some are zero in exact arithmetic: a bias
    on every key shifts a whole softmax row, so a per-tensor relative error would be rounding noise)."""
    model(x).square().sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("family", ["beit", "mvitv2", "hiera", "maxvit-tf"])
def test_backward_matches_unpatched(family):
    """Gradients flow through the patched core, the relative position bias included, as accurately as timm's."""
    plain = make(family).train()
    patched = va.patch_model(copy.deepcopy(plain), "fp32").train()
    oracle = copy.deepcopy(plain).double()
    x = photos(FAMILIES[family][1])[:2]
    ref = _grads(oracle, x.double())
    err0 = rel_l2(_grads(plain, x), ref)
    assert rel_l2(_grads(patched, x), ref) <= max(4 * err0, va.get_mode("fp32").rel_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "fp16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_family_on_gpu(family, mode):
    x, ref, _ = _oracle(family)
    model = make(family).cuda()
    with torch.no_grad():
        y0 = model(x.cuda()).cpu()
        y = va.patch_model(model, mode)(x.cuda()).cpu()
    md = va.get_mode(mode)
    err, err0 = rel_l2(y, ref), rel_l2(y0, ref)
    bound = max(4 * err0, md.rel_tol) if md.compute_dtype == torch.float32 else md.rel_tol + 4 * err0
    assert err <= bound, f"{family}/{mode} on GPU: logits rel err {err:.3g} > {bound:.3g}"


@pytest.mark.gpu
def test_xcit_with_more_tokens_than_kernel_head_dim_warns_and_stays_exact(fresh_warnings):
    """XCA's head dim is the token count: 17 x 17 = 289 tokens > 256 runs the reference, saying why."""
    torch.manual_seed(0)
    model = timm.create_model("xcit_nano_12_p16_224", img_size=272, depth=1, embed_dim=64, num_heads=2).cuda().eval()
    x = photos(272)[:2].cuda()
    with torch.no_grad():
        y0 = model(x)
        with pytest.warns(RuntimeWarning, match="head dim 289 > 256"):
            y = va.patch_model(model, "fp32")(x)
    assert rel_l2(y, y0) <= 1e-4
