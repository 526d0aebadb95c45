"""A cached launch never runs a compiled kernel on arguments Triton would have specialised differently.

A :class:`visionattn.kernels._launch.KernelCall` compiles (or finds) its kernel on its first call and sends later
calls straight to that binary, so the plan cache holding it must key every property Triton specialises on: each
tensor's dtype and 16-byte pointer alignment, each specialised integer's "equals 1" and "divisible by 16" classes.
A key that misses one is a GPU-only defect: the interpreter computes any argument correctly, the binary does not
(on the H200 the row L2-normalisation plans, keyed without alignment, ran an aligned k's kernel on a misaligned q:
"misaligned address"). Here every ``KernelCall`` records the specialisation class of its first call's arguments
and each later call is compared with it, while the public entry points run on inputs that differ only in
alignment (and in layout), one after the other in one process, forward and backward.
"""
import pytest
import torch

import visionattn as va
from visionattn.kernels import _launch


def _unspecialised(fn) -> set[str]:
    params = getattr(fn, "params", None)
    if params:  # JITFunction
        return {p.name for p in params if p.do_not_specialize}
    return set((getattr(fn, "kwargs", {}) or {}).get("do_not_specialize") or [])  # InterpretedFunction


def _classes(fn, args) -> tuple:
    """What Triton specialises a launch of ``fn`` on, for the runtime ``args`` (in signature order)."""
    import inspect

    names = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
    skip = _unspecialised(fn)
    out = []
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            out.append((name, a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or name in skip:
            out.append((name, type(a).__name__))
        elif isinstance(a, int):
            out.append((name, a == 1, a % 16 == 0, abs(a) >= 2 ** 31))
        else:
            out.append((name, type(a).__name__))
    return tuple(out)


@pytest.fixture
def mixed_reuse(monkeypatch):
    """``{"calls": n, "bad": [(kernel, [(first call's class, this call's)])]}``: the calls of every ``KernelCall``,
    and those whose arguments Triton would specialise unlike its first call's."""
    if torch.cuda.is_available():
        pytest.skip("inspects the interpreter's launches (the GPU conformance suite runs the binaries)")
    first, seen_calls = {}, {"calls": 0, "bad": []}
    real = _launch.KernelCall.__call__

    def call(self, *args):
        classes = _classes(self.fn, args)
        seen_calls["calls"] += 1
        seen = first.setdefault(id(self), (self, classes))  # the instance is kept: its id is not reused
        if seen[1] != classes:
            diff = [(a, b) for a, b in zip(seen[1], classes) if a != b]
            seen_calls["bad"].append((getattr(getattr(self.fn, "fn", self.fn), "__name__", "?"), diff))
        return real(self, *args)

    monkeypatch.setattr(_launch.KernelCall, "__call__", call)
    with va.use_backend("triton"):
        yield seen_calls


def _check(seen_calls):
    assert seen_calls["calls"] >= 2, "no cached launch ran twice: the test would pass vacuously"
    assert not seen_calls["bad"], seen_calls["bad"]


def _shifted(t: torch.Tensor, leaf: bool = True) -> torch.Tensor:
    """``t``'s values at a data pointer one element past a 16-byte boundary, same shape and strides."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = base[1:].view(t.shape)
    out.copy_(t.detach())
    assert out.data_ptr() % 16 != 0 and out.stride() == t.contiguous().stride()
    return out.requires_grad_(t.requires_grad) if leaf else out


def _inputs(shape_q, shape_v, dtype, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(shape_q, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(shape_v, generator=g).to(dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _run_all(fn, variants):
    """``fn(*inputs)`` for each input set, and its backward where the inputs need gradients."""
    for inputs in variants:
        out = fn(*inputs)
        if any(t.requires_grad for t in inputs if isinstance(t, torch.Tensor)):
            out.float().square().sum().backward()


def _other_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with its two middle dims swapped in memory (heads inner for [B, H, N, D], as a projection's
    output is laid out), same shape."""
    out = t.detach().transpose(-3, -2).contiguous().transpose(-3, -2)
    return out.requires_grad_(t.requires_grad)


def _variants(q, k, v):
    """Aligned inputs, then one misaligned at a time, all three misaligned, then another memory layout of each: the
    order a cache meets them."""
    return [(q, k, v), (_shifted(q), k, v), (q, _shifted(k), v), (q, k, _shifted(v)),
            (_shifted(q), _shifted(k), _shifted(v)), (_other_layout(q), k, v),
            (_other_layout(q), _other_layout(k), _other_layout(v))]


@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp32-ieee", "fp16", "bf16"])
def test_dense_forward_and_backward(mixed_reuse, mode):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode, torch.float32)
    q, k, v = _inputs((1, 2, 24, 32), (1, 2, 24, 32), dtype)
    _run_all(lambda q, k, v: va.attention(q, k, v, mode=mode), _variants(q, k, v))
    _run_all(lambda q, k, v: va.attention(q, k, v, mode=mode, is_causal=True, num_splits=2),
             [tuple(t.detach() for t in x) for x in _variants(q, k, v)])
    _check(mixed_reuse)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_dense_bias_mask_and_grouped_heads(mixed_reuse, mode):
    """A relative position bias needing its gradient and a key mask, aligned then misaligned; grouped-query heads."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    q, k, v = _inputs((1, 2, 24, 32), (1, 2, 24, 32), dtype)
    bias = torch.randn(1, 2, 24, 24).to(dtype).requires_grad_()
    mask = torch.rand(1, 1, 1, 24) < 0.8
    mask[..., 0] = True
    _run_all(lambda q, k, v, b, m: va.attention(q, k, v, bias=b, attn_mask=m, mode=mode),
             [(q, k, v, bias, mask), (q, k, v, _shifted(bias), mask), (q, k, v, bias, _shifted(mask, leaf=False))])
    q4 = _inputs((1, 4, 24, 32), (1, 4, 24, 32), dtype, seed=1)[0]
    _run_all(lambda q, k, v: va.attention(q, k, v, mode=mode, enable_gqa=True),
             [(q4, k, v), (_shifted(q4), k, v), (q4, _shifted(k), _shifted(v))])
    _check(mixed_reuse)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_packed_qkv(mixed_reuse, mode):
    """timm's packed projection output [B, N, 3, H, D] (dense) and [windows, N, 3, H, D] (Swin), aligned then not."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    qkv = torch.randn(2, 16, 3, 2, 32).to(dtype).requires_grad_()
    _run_all(lambda x: va.attention_qkvpacked(x, mode=mode), [(qkv,), (_shifted(qkv),), (qkv,)])
    _run_all(lambda x: va.window_attention_qkvpacked(x, num_windows=2, mode=mode), [(qkv,), (_shifted(qkv),)])
    _check(mixed_reuse)


def test_pasa_forward(mixed_reuse):
    q, k, v = _inputs((1, 2, 24, 32), (1, 2, 24, 32), torch.float16, grad=False)
    _run_all(lambda q, k, v: va.attention(q, k, v, mode="pasa"), _variants(q, k, v))
    _check(mixed_reuse)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_varlen_forward_and_backward(mixed_reuse, mode):
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    q, k, v = _inputs((30, 2, 32), (30, 2, 32), dtype)
    cu = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    _run_all(lambda q, k, v: va.varlen_attention(q, k, v, cu, cu, mode=mode), _variants(q, k, v))
    _check(mixed_reuse)


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_window_forward_and_backward(mixed_reuse, mode):
    """Swin-v2's cosine windows with a learned logit scale (the normalisation kernels included) and plain ones."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    q, k, v = _inputs((4, 2, 16, 32), (4, 2, 16, 32), dtype)
    logit_scale = torch.full((2, 1, 1), 2.0).requires_grad_()
    _run_all(lambda q, k, v: va.window_attention(q, k, v, num_windows=2, cosine=True, logit_scale=logit_scale,
                                                 mode=mode), _variants(q, k, v))
    _run_all(lambda q, k, v: va.window_attention(q, k, v, num_windows=2, mode=mode), _variants(q, k, v))
    _check(mixed_reuse)


def test_l2_normalize(mixed_reuse):
    from visionattn.kernels.l2norm import l2_normalize

    x = torch.randn(2, 3, 7, 32).requires_grad_()
    _run_all(lambda x: l2_normalize(x), [(x,), (_shifted(x),), (x,)])
    _check(mixed_reuse)
