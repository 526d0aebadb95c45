"""Features the kernels do not have fail loudly instead of quietly: a double backward raises naming the fix (the
reference backend differentiates twice, and does so correctly), a tensor ``scale`` that requires grad raises
(it would get no gradient), and an enclosing autocast does not change a mode's arithmetic."""
import pytest
import torch

import visionattn as va
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(*shape, seed=0, grad=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(*shape, device=DEV, generator=g).requires_grad_(grad) for _ in range(3)]


def _penalty(q, k, v, fn):
    out = fn(q, k, v)
    (gq,) = torch.autograd.grad((out * out).sum(), q, create_graph=True)
    return gq.square().sum()


CALLS = {
    "dense": lambda q, k, v, **kw: va.attention(q, k, v, mode="fp32", **kw),
    "window": lambda q, k, v, **kw: va.window_attention(q, k, v, num_windows=1, mode="fp32", **kw),
    "qkvpacked": lambda q, k, v, **kw: va.attention_qkvpacked(torch.stack([q, k, v], 2).transpose(1, 3),
                                                               mode="fp32", **kw),
}


@pytest.mark.parametrize("family", list(CALLS))
def test_double_backward_raises_on_the_kernels(family):
    q, k, v = _qkv(2, 2, 16, 16)
    with pytest.raises(RuntimeError, match="double backward.*backend='reference'"):
        _penalty(q, k, v, lambda *t: CALLS[family](*t, backend="triton"))


def test_double_backward_on_the_reference_is_exact():
    """The fix the error names works: a gradient penalty's gradient matches float64 autograd."""
    q, k, v = _qkv(1, 2, 12, 8)
    _penalty(q, k, v, lambda *t: va.attention(*t, mode="fp32", backend="reference")).backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    _penalty(q64, k64, v64, lambda *t: oracle_attention(*t)).backward()
    for t, r in ((q, q64), (k, k64), (v, v64)):
        assert rel_l2(t.grad.double(), r.grad) <= 1e-5


def test_varlen_double_backward_raises():
    q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in _qkv(1, 2, 16, 16))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=DEV)
    fn = lambda q, k, v: va.varlen_attention(q, k, v, cu, cu, 11, 11, mode="fp32", backend="triton")  # noqa: E731
    with pytest.raises(RuntimeError, match="double backward"):
        _penalty(q, k, v, fn)


def test_tensor_scale_requiring_grad_raises():
    q, k, v = _qkv(1, 2, 8, 8, grad=False)
    s = torch.tensor(0.3, requires_grad=True)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="scale is a tensor that requires grad"):
            va.attention(q, k, v, scale=s, backend=backend)
        with pytest.raises(ValueError, match="scale is a tensor that requires grad"):
            va.window_attention(q, k, v, num_windows=1, scale=s, backend=backend)
    ref = oracle_attention(q.double(), k.double(), v.double(), scale=0.3)
    assert rel_l2(va.attention(q, k, v, scale=s.detach()).double(), ref) <= 2e-6  # a plain tensor scale works
    with torch.no_grad():  # no gradient asked for: nothing is lost
        assert rel_l2(va.attention(q, k, v, scale=s).double(), ref) <= 2e-6


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_autocast_keeps_the_mode(backend):
    """``torch.autocast`` around an fp32-mode call: still FP32 arithmetic (the contract 2e-6), float32 output."""
    q, k, v = _qkv(2, 2, 40, 32, grad=False)
    ref = oracle_attention(q.double(), k.double(), v.double())
    wref = va.window.window_attention_reference(q.double(), k.double(), v.double(), num_windows=1,
                                                state_dtype=torch.float64)
    cu = torch.tensor([0, 40], dtype=torch.int32, device=DEV)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        out = va.attention(q, k, v, mode="fp32", backend=backend)
        wout = va.window_attention(q, k, v, num_windows=1, mode="fp32", backend=backend)
        vout = va.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 40, 40,
                                   mode="fp32", backend=backend)
    assert out.dtype == torch.float32 and rel_l2(out.double(), ref) <= 2e-6
    assert rel_l2(wout.double(), wref) <= 2e-6
    assert rel_l2(vout.double(), ref[0].transpose(0, 1)) <= 2e-6
