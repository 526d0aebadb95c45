"""The layouts the host hands to the kernels: every tensor a kernel receives has a unit-stride last dim.

Triton specialises a stride argument of 1 into the compiled kernel; with any other last-dim stride it compiles
other code, which on the GPU (Triton 3.6) read shared memory out of bounds in the single-pass dense backward:
``out.sum().backward()`` (a stride-0 ``grad_out``) died with an illegal memory access in fp32 and returned NaN
gradients in tf32, and the fused window backward returned NaN in dK. The interpreter computes those kernels
correctly, so these tests check the cause instead of the symptom: they record every tensor passed to an
interpreted kernel and require a unit last stride (:func:`visionattn.kernels._launch.unit_last_stride` makes it),
and check the gradients against float64 autograd for the layouts autograd hands the backward.
"""
import pytest
import torch

import visionattn as va
from visionattn.kernels._launch import unit_last_stride
from visionattn.metrics import rel_l2

@pytest.fixture
def kernel_tensors(kernel_launches):
    """The interpreted kernel launches (tests/conftest.py), read by :func:`_unit_last` after the calls."""
    return kernel_launches


def _unit_last(launches):
    seen = [(name, i, a) for name, args, _ in launches for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    bad = [(name, i, tuple(t.shape), t.stride()) for name, i, t in seen if t.dim() >= 2 and t.stride(-1) != 1]
    assert seen, "no kernel ran: the test would pass vacuously"
    assert not bad, f"tensors with a non-unit last stride reached kernels: {bad}"


def _leaves(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _grads64(fn, leaves, grad_out):
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    fn(*l64).backward(grad_out.double())
    return [t.grad for t in l64]


LOSSES = {
    "sum": lambda out: out.sum(),                      # stride-0 grad_out
    "mean": lambda out: out.mean(),                    # stride-0, scaled
    "transposed": lambda out: (out.transpose(-1, -2) * torch.linspace(-1, 1, out.shape[-2])).sum(),
    "last-col": lambda out: out[..., ::2].sum(),       # a strided gradient with zero columns
}


def _grad_out_of(loss, out):
    """The dense gradient ``loss`` hands the backward, for the float64 oracle."""
    probe = out.detach().clone().requires_grad_()
    loss(probe).backward()
    return probe.grad


@pytest.mark.parametrize("mode,n", [("fp32", 70), ("tf32", 70), ("fp32", 300), ("fp16", 70)])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_dense_backward_any_grad_out(kernel_tensors, mode, n, loss):
    """Dense backward (single-pass at <= 256 keys in fp32 / tf32, the two-kernel one beyond) from the gradients
    of common losses: kernels see unit last strides, and the gradients match float64 autograd."""
    dtype = torch.float16 if mode == "fp16" else torch.float32
    leaves = _leaves((1, 2, n, 64), (1, 2, n, 64), (1, 2, n, 64), dtype=dtype)
    out = va.attention(*leaves, mode=mode)
    LOSSES[loss](out).backward()
    _unit_last(kernel_tensors)
    ref = _grads64(torch.nn.functional.scaled_dot_product_attention, leaves, _grad_out_of(LOSSES[loss], out))
    tol = {"fp32": 1e-5, "tf32": 3e-3, "fp16": 3e-3}[mode]
    for name, t, r in zip("qkv", leaves, ref):
        assert rel_l2(t.grad.double(), r) <= tol, f"d{name}"


def test_qkvpacked_backward_stride0(kernel_tensors):
    (qkv,) = _leaves((1, 40, 3, 2, 32))
    va.attention_qkvpacked(qkv, mode="fp32").sum().backward()
    _unit_last(kernel_tensors)
    ref = _grads64(lambda t: va.attention(*t.permute(2, 0, 3, 1, 4).unbind(0), mode="fp32", backend="reference")
                   .transpose(1, 2), [qkv], torch.ones(1, 40, 2, 32))
    assert rel_l2(qkv.grad.double(), ref[0]) <= 1e-5


@pytest.mark.parametrize("cosine", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_window_backward_stride0(kernel_tensors, cosine, packed):
    """Swin (49 tokens, bias + shift mask) and Swin-v2 (64 tokens, cosine) windows, ``out.sum().backward()``."""
    n, nw, heads, d = (64, 2, 2, 16) if cosine else (49, 2, 2, 16)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2 * nw, n, 3, heads, d, generator=g).requires_grad_()
    rpb = torch.randn(heads, n, n, generator=g).requires_grad_()
    mask = torch.where(torch.rand(nw, n, n, generator=g) < 0.3, -100.0, 0.0)
    ls = torch.rand(heads, generator=g).requires_grad_() if cosine else None
    kw = dict(relative_position_bias=rpb, shift_mask=mask, num_windows=nw, cosine=cosine, logit_scale=ls)

    def run(qkv, rpb, *ls_):
        kw2 = dict(kw, relative_position_bias=rpb, logit_scale=ls_[0] if ls_ else None)
        if packed and qkv.dtype == torch.float32:
            return va.window_attention_qkvpacked(qkv, mode="fp32", **kw2)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = va.window_attention(q, k, v, mode="fp32", **kw2).transpose(1, 2)
        return out

    leaves = [qkv, rpb] + ([ls] if cosine else [])
    out = run(*leaves)
    out.sum().backward()
    _unit_last(kernel_tensors)
    with va.use_backend("reference"):
        ref = _grads64(run, leaves, torch.ones(out.shape))
    for t, r in zip(leaves, ref):
        assert torch.isfinite(t.grad).all()
        assert rel_l2(t.grad.double(), r) <= 1e-5


def test_varlen_backward_stride0(kernel_tensors):
    lens = [5, 0, 1, 33]
    leaves = _leaves((sum(lens), 2, 32), (sum(lens), 2, 32), (sum(lens), 2, 32))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def fn(q, k, v):
        return va.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), mode="fp32")

    fn(*leaves).sum().backward()
    _unit_last(kernel_tensors)
    with va.use_backend("reference"):
        ref = _grads64(fn, leaves, torch.ones(sum(lens), 2, 32))
    for t, r in zip(leaves, ref):
        assert rel_l2(t.grad.double(), r) <= 1e-5


@pytest.mark.parametrize("layout", ["every-other", "transposed"])
def test_forward_inputs_any_last_stride(kernel_tensors, layout):
    """Forward inputs whose head dim is not of unit stride are laid out by the host (one copy), twice: the
    second call goes through the call-signature cache."""
    g = torch.Generator().manual_seed(2)
    if layout == "every-other":
        q, k, v = (torch.randn(1, 2, 40, 64, generator=g)[..., ::2] for _ in range(3))
    else:
        q, k, v = (torch.randn(1, 2, 32, 40, generator=g).transpose(-1, -2) for _ in range(3))
    ref = va.reference.oracle_attention(q.double(), k.double(), v.double())
    for _ in range(2):
        assert rel_l2(va.attention(q, k, v, mode="fp32").double(), ref) <= 2e-6
    qw, kw_, vw = (t.reshape(2, 2, 20, 32) for t in (q.contiguous(), k.contiguous(), v.contiguous()))
    qw, kw_, vw = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (qw, kw_, vw))
    refw = va.reference.oracle_attention(qw.double(), kw_.double(), vw.double())
    assert rel_l2(va.window_attention(qw, kw_, vw, num_windows=1, mode="fp32").double(), refw) <= 2e-6
    _unit_last(kernel_tensors)


def test_unit_last_stride():
    base = torch.randn(3, 1)
    t = base.expand(3, 1)[:, :1].as_strided((3, 1), (1, 5))
    view = unit_last_stride(t)
    assert view.stride(-1) == 1 and view.data_ptr() == t.data_ptr() and torch.equal(view, t)  # size-1: no copy
    s0 = torch.tensor(2.0).expand(4, 8)
    made = unit_last_stride(s0)
    assert made.stride() == (8, 1) and torch.equal(made, s0)
    c = torch.randn(4, 8)
    assert unit_last_stride(c) is c


FP16_MODES = ["fp16", "pasa", "fp16-acc16"]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("mode", FP16_MODES)
def test_float16_overflow_raises_on_every_path(backend, mode):
    """float32 inputs beyond float16's range in a float16 mode raise the same ValueError on the CPU reference as
    the kernel path's cast does (they returned NaN / inf there), for every op family and on a repeated call."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(3))
    big = q * 1e5
    with va.use_backend(backend):
        va.attention(q, k, v, mode=mode)  # a valid call first: its signature's cached runner must check too
        for _ in range(2):  # the second call of a signature goes through the call cache
            with pytest.raises(ValueError, match="float16's range"):
                va.attention(big, k, v, mode=mode)
        qkv = torch.stack([big, k, v], 2).transpose(1, 3)  # [B, N, 3, H, D]
        with pytest.raises(ValueError, match="float16's range"):
            va.attention_qkvpacked(qkv.contiguous(), mode=mode)
        if mode != "fp16-acc16":
            va.window_attention(q, k, v, num_windows=1, mode=mode)
            for _ in range(2):
                with pytest.raises(ValueError, match="float16's range"):
                    va.window_attention(big, k, v, num_windows=1, mode=mode)
        flat = [t[0].transpose(0, 1).contiguous() for t in (big, k, v)]  # [16, 2, 16]
        cu = torch.tensor([0, 7, 16], dtype=torch.int32)
        if mode == "fp16":
            with pytest.raises(ValueError, match="float16's range"):
                va.varlen_attention(*flat, cu, cu, 9, 9, mode=mode)
        # in range: no error, finite
        assert torch.isfinite(va.attention(q * 100, k, v, mode=mode)).all()
