"""Hostile use of the patching layer (:func:`visionattn.patch_model`, :func:`visionattn.unpatch_model`,
:func:`visionattn.sdpa_override`): each case either raises a ``TypeError`` / ``ValueError`` naming the argument and
leaves the model as it was, or gives the correct result, checked against the unpatched model (or PyTorch's own
SDPA, or the float64 oracle).
"""
import copy
import warnings

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import Attention

import visionattn as va
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention
from patching_helpers import make_tiny


@pytest.fixture(autouse=True)
def _own_warnings(monkeypatch):
    """Every test here starts from no one-time warning given and leaves the process's record as it found it (the
    warnings other modules' tests expect still come)."""
    from visionattn import dispatch

    monkeypatch.setattr(dispatch, "_warned", set())


def tiny_vit(seed=0, **kw):
    """A one-block ViT on 32 x 32 images (16 tokens + class token), random weights."""
    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                             num_classes=10, **kw).eval()


def images(n=2, size=32, seed=1):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def classes(model):
    return [type(m) for m in model.modules()]


def qkv(b=2, h=2, n=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g) for _ in range(3)]


# ----------------------------------------------------------------------------- patch_model / unpatch_model: errors
@pytest.mark.parametrize("model", ["vit", None, torch.nn.Linear, [torch.nn.Linear(2, 2)], np.zeros(3)],
                         ids=["str", "None", "a Module class", "a list of modules", "an array"])
@pytest.mark.parametrize("fn", [va.patch_model, va.unpatch_model], ids=["patch", "unpatch"])
def test_patch_and_unpatch_refuse_what_is_not_a_module_instance(fn, model):
    for _ in range(2):
        with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got "):
            fn(model)


# (keyword arguments of patch_model, exception, message pattern)
BAD_PATCH_ARGS = {
    "mode unknown": (dict(mode="fp8"), ValueError, r"mode='fp8' is not a visionattn mode"),
    "mode None": (dict(mode=None), ValueError, r"mode=None is not a visionattn mode"),
    "mode int": (dict(mode=32), ValueError, r"mode=32 is not a visionattn mode"),
    "mode upper case": (dict(mode="BF16"), ValueError, r"mode='BF16' is not a visionattn mode"),
    "option unknown": (dict(dropout=0.1), TypeError, r"unknown option\(s\) \['dropout'\]"),
    "backend unknown": (dict(backend="cuda"), ValueError, r"backend='cuda'; expected None or one of"),
    "num_splits 0": (dict(num_splits=0), ValueError, r"num_splits=0; expected None or a positive int"),
    "num_splits bool": (dict(num_splits=True), ValueError, r"num_splits=True"),
    "num_splits float": (dict(num_splits=2.0), ValueError, r"num_splits=2.0"),
}


@pytest.mark.parametrize("already_patched", [False, True])
@pytest.mark.parametrize("case", list(BAD_PATCH_ARGS))
def test_bad_patch_arguments_raise_and_leave_the_model_as_it_was(case, already_patched):
    kw, exc, match = BAD_PATCH_ARGS[case]
    model = tiny_vit()
    if already_patched:
        va.patch_model(model, mode="fp16")
    before_classes, before_state = classes(model), copy.deepcopy(model.state_dict())
    before_mode = model.blocks[0].attn.__dict__.get("visionattn_mode")
    for _ in range(2):
        with pytest.raises(exc, match=match):
            va.patch_model(model, **kw)
    assert classes(model) == before_classes and model.blocks[0].attn.__dict__.get("visionattn_mode") == before_mode
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before_state.values()))
    assert hasattr(model, "visionattn_report") == already_patched


def test_patching_twice_takes_the_second_mode_and_options():
    x = images()
    twice = va.patch_model(va.patch_model(tiny_vit(), mode="fp16", backend="reference"), mode="bf16")
    once = va.patch_model(tiny_vit(), mode="bf16")
    attn = twice.blocks[0].attn
    assert type(attn).__name__ == "VisionattnAttention" and attn.visionattn_mode == "bf16"
    assert attn.visionattn_options == {"backend": None, "num_splits": None}
    assert twice.visionattn_report.mode == "bf16" and twice.visionattn_report.num_patched == 1
    with torch.no_grad():
        assert torch.equal(twice(x), once(x))


def test_unpatching_an_unpatched_model_changes_nothing_and_twice_is_safe():
    x = images()
    plain = tiny_vit()
    with torch.no_grad():
        before = plain(x)
    model = va.unpatch_model(tiny_vit())
    assert classes(model) == classes(plain) and not hasattr(model, "visionattn_report")
    patched = va.patch_model(tiny_vit())
    va.unpatch_model(patched)
    va.unpatch_model(patched)
    assert classes(patched) == classes(plain) and "visionattn_mode" not in patched.blocks[0].attn.__dict__
    with torch.no_grad():
        assert torch.equal(model(x), before) and torch.equal(patched(x), before)


def test_a_mode_object_is_taken_like_its_name():
    model = va.patch_model(tiny_vit(), mode=va.get_mode("fp16"))
    assert model.blocks[0].attn.visionattn_mode == "fp16" and model.visionattn_report.mode == "fp16"


def test_a_user_subclass_overriding_forward_is_skipped_with_the_reason():
    class MyAttention(Attention):
        def forward(self, x, attn_mask=None):
            return super().forward(x, attn_mask=attn_mask)

    model = tiny_vit()
    old = model.blocks[0].attn
    model.blocks[0].attn = MyAttention(192, num_heads=3, qkv_bias=True)
    model.blocks[0].attn.load_state_dict(old.state_dict())
    with pytest.warns(RuntimeWarning, match="nothing to patch"):
        va.patch_model(model)
    (name, cls, why), = model.visionattn_report.skipped
    assert name == "blocks.0.attn" and "subclass of supported" in why and "overrides forward" in why
    assert type(model.blocks[0].attn) is MyAttention


# ----------------------------------------------------------------------------- patched models: hostile inputs
def test_a_patched_model_on_the_meta_device_says_meta_tensors_have_no_data():
    with torch.device("meta"):
        model = tiny_vit()
    va.patch_model(model)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"query is a meta tensor \(a shape without data.*to_empty"):
            model(torch.empty(1, 3, 32, 32, device="meta"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_integer_attn_mask_names_attn_mask(backend):
    attn = va.patch_model(tiny_vit(), backend=backend).blocks[0].attn
    x = torch.randn(2, 17, 192)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"attn_mask has dtype torch.int64; timm's attention takes a bool mask"):
            attn(x, attn_mask=torch.ones(17, 17, dtype=torch.long))
    keep = torch.rand(2, 1, 17, 17, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[..., 0] = True
    plain = tiny_vit().blocks[0].attn
    with torch.no_grad():  # a bool mask (True = keep) and a float one (added): timm's semantics
        assert rel_l2(attn(x, attn_mask=keep), plain(x, attn_mask=keep)) <= 1e-5
        additive = torch.randn(17, 17)
        assert rel_l2(attn(x, attn_mask=additive), plain(x, attn_mask=additive)) <= 1e-5


def test_attention_dropout_in_training_runs_timms_forward():
    plain = tiny_vit(attn_drop_rate=0.25).train()
    patched = va.patch_model(copy.deepcopy(plain)).train()
    x = images()
    warned = []
    for _ in range(2):
        torch.manual_seed(3)
        expected = plain(x)
        torch.manual_seed(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = patched(x)
        assert torch.equal(got, expected)  # timm's own path, the same dropout draws
        warned.append(sum("attention dropout p=0.25" in str(w.message) for w in caught))
    assert warned == [1, 0]  # once, naming why
    with torch.no_grad():
        assert rel_l2(patched.eval()(x), plain.eval()(x)) <= 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_torch_func_grad_through_a_patched_model_matches_the_unpatched_model(backend):
    """``torch.func.grad`` of a loss over ``functional_call``: the patched model's parameter gradients are the
    unpatched model's (the kernel backend runs the reference under the transform, warned once)."""
    plain = tiny_vit()
    patched = va.patch_model(copy.deepcopy(plain), backend=backend)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    x = images()

    def loss(model):
        return lambda p: torch.func.functional_call(model, p, (x,)).square().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = torch.func.grad(loss(patched))(params)
    want = torch.func.grad(loss(plain))(params)
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "patch_embed.proj.weight"):
        assert rel_l2(got[name], want[name]) <= 1e-4, name


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("grad", [False, True])
def test_jit_trace_of_a_patched_vit_gives_the_unpatched_model(backend, grad):
    """``torch.jit.trace`` of a patched ViT: on the kernels the traced graph records the ``visionattn`` op (a direct
    launch would leave its output unwritten), and the traced model on new images gives the unpatched model's
    logits, with or without gradients."""
    plain = tiny_vit()
    patched = va.patch_model(copy.deepcopy(plain), backend=backend)
    x, x2 = images(seed=1), images(seed=2)
    with torch.no_grad():
        patched(x)  # a cached runner for the signature first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings of shape checks, the deprecation notice
        with torch.set_grad_enabled(grad):
            traced = torch.jit.trace(patched, x, check_trace=False)
            out = traced(x2)
    if backend == "triton":
        assert "visionattn::attention" in str(traced.inlined_graph)
    with torch.no_grad():
        assert rel_l2(out, plain(x2)) <= 1e-5
    if grad:
        out.square().sum().backward()
        assert patched.blocks[0].attn.qkv.weight.grad is not None


@pytest.mark.parametrize("family", ["swin", "swinv2"])
def test_jit_trace_of_patched_swin_records_the_window_op(family):
    plain = make_tiny(family)
    patched = va.patch_model(copy.deepcopy(plain), backend="triton")
    x, x2 = images(1, 56 if family == "swin" else 64, seed=1), images(1, 56 if family == "swin" else 64, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            traced = torch.jit.trace(patched, x, check_trace=False)
            out = traced(x2)
            want = plain(x2)
    assert "visionattn::window_attention" in str(traced.inlined_graph)
    assert rel_l2(out, want) <= 1e-5


# ----------------------------------------------------------------------------- sdpa_override
@pytest.mark.parametrize("args,kw,exc,match", [
    (("fp8",), {}, ValueError, r"mode='fp8' is not a visionattn mode"),
    ((None,), {}, ValueError, r"mode=None is not a visionattn mode"),
    ((), {"dropout": 0.1}, TypeError, r"unknown option\(s\) \['dropout'\]"),
    ((), {"backend": "gpu"}, ValueError, r"backend='gpu'"),
    ((), {"num_splits": 0}, ValueError, r"num_splits=0"),
], ids=["mode unknown", "mode None", "option unknown", "backend unknown", "num_splits 0"])
def test_sdpa_override_refuses_bad_arguments(args, kw, exc, match):
    for _ in range(2):
        with pytest.raises(exc, match=match):
            va.sdpa_override(*args, **kw)


def test_nested_overrides_route_to_the_innermost_and_restore_the_outer():
    q, k, v = qkv()
    with va.sdpa_override("fp32") as outer:
        with va.sdpa_override("bf16") as inner:
            y_inner = F.scaled_dot_product_attention(q, k, v)
        y_outer = F.scaled_dot_product_attention(q, k, v)
    y_after = F.scaled_dot_product_attention(q, k, v)
    assert (inner.routed, outer.routed) == (1, 1)
    assert torch.equal(y_inner, va.attention(q, k, v, mode="bf16"))
    assert torch.equal(y_outer, va.attention(q, k, v, mode="fp32"))
    assert torch.equal(y_after, torch.nn.functional.scaled_dot_product_attention(q, k, v))  # nothing left active
    assert (inner.routed, outer.routed) == (1, 1)


def test_an_exception_inside_the_block_restores_sdpa():
    from torch.overrides import _get_current_function_mode_stack

    q, k, v = qkv()
    stack = list(_get_current_function_mode_stack())
    ctx = va.sdpa_override("bf16")
    with pytest.raises(KeyError):
        with ctx:
            F.scaled_dot_product_attention(q, k, v)
            raise KeyError("boom")
    assert list(_get_current_function_mode_stack()) == stack
    y = F.scaled_dot_product_attention(q, k, v)
    assert ctx.routed == 1 and rel_l2(y, oracle_attention(q, k, v)) <= 1e-6  # PyTorch's, not bf16's


def test_one_override_entered_twice_counts_once_per_call():
    q, k, v = qkv()
    ctx = va.sdpa_override()
    with ctx:
        with ctx:
            F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v)
    assert ctx.routed == 2 and ctx.passed == 0


def _torch_outcome(fn):
    try:
        return "value", fn()
    except Exception as err:  # noqa: BLE001 - PyTorch's own error, whichever it is
        return "error", type(err)


# name -> make(q, k, v) -> (args, kwargs) of F.scaled_dot_product_attention that visionattn must pass to PyTorch
PASS_THROUGH = {
    "sparse mask": lambda q, k, v: ((q, k, v), {"attn_mask": (torch.randn(9, 9) > 0).to_sparse()}),
    "int mask": lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(9, 9, dtype=torch.int32)}),
    "mask of wrong shape": lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(3, 9, dtype=torch.bool)}),
    "meta inputs": lambda q, k, v: ((q.to("meta"), k.to("meta"), v.to("meta")), {}),
    "dropout": lambda q, k, v: ((q, k, v), {"dropout_p": 0.5}),
    "gqa, unequal key / value heads": lambda q, k, v: ((q, k[:, :1], v), {"enable_gqa": True}),
    "gqa, heads not dividing": lambda q, k, v: ((q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1)),
                                                {"enable_gqa": True}),
    "3-D inputs": lambda q, k, v: ((q[0], k[0], v[0]), {}),
    "int inputs": lambda q, k, v: ((q.long(), k.long(), v.long()), {}),
    "mixed dtypes": lambda q, k, v: ((q, k.double(), v), {}),
}
# arguments of the wrong Python type: PyTorch's argument parser refuses them before any override sees the call
PARSER_REFUSED = {
    "is_causal int": lambda q, k, v: ((q, k, v), {"is_causal": 1}),
    "is_causal None": lambda q, k, v: ((q, k, v), {"is_causal": None}),
    "numpy mask": lambda q, k, v: ((q, k, v), {"attn_mask": np.ones((9, 9), dtype=bool)}),
    "scale str": lambda q, k, v: ((q, k, v), {"scale": "0.3"}),
}


@pytest.mark.parametrize("case", list(PASS_THROUGH) + list(PARSER_REFUSED))
def test_calls_visionattn_does_not_take_reach_pytorch_unchanged(case):
    """What visionattn refuses inside the override (sparse, meta or integer tensors, masks of another shape,
    dropout, grouped heads with unequal or non-dividing key / value head counts, other ranks, mixed dtypes) runs
    PyTorch's SDPA as if no override were active: its value
    (a meta output for meta inputs) or its own error, counted as passed with the reason; arguments PyTorch's parser
    refuses never reach the override (nothing counted), with PyTorch's own error."""
    args, kw = {**PASS_THROUGH, **PARSER_REFUSED}[case](*qkv())
    for _ in range(2):
        torch.manual_seed(0)
        kind, want = _torch_outcome(lambda: F.scaled_dot_product_attention(*args, **kw))
        with va.sdpa_override() as ctx:
            torch.manual_seed(0)
            got_kind, got = _torch_outcome(lambda: F.scaled_dot_product_attention(*args, **kw))
        assert ctx.routed == 0 and ctx.passed == (case in PASS_THROUGH) == sum(ctx.pass_reasons.values())
        assert got_kind == kind
        if kind == "error":
            assert got is want
        else:
            assert got.shape == want.shape and got.device == want.device
            if got.device.type != "meta":
                assert torch.equal(got, want)


def test_a_non_finite_scale_inside_the_override_names_scale():
    """A NaN / inf scale reaches the override (a float to PyTorch's parser) and is refused naming ``scale``,
    where PyTorch's SDPA would return NaN silently."""
    q, k, v = qkv()
    with va.sdpa_override() as ctx:
        for bad in (float("nan"), float("inf")):
            for _ in range(2):
                with pytest.raises(ValueError, match=r"scale=(nan|inf); expected a finite number"):
                    F.scaled_dot_product_attention(q, k, v, scale=bad)
    assert ctx.routed == 4
