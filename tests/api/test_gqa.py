"""Grouped-query / multi-query attention (``enable_gqa=True``; FlashAttention-2's GQA / MQA) on the dense kernels.

q [B, H, Nq, D] with k / v [B, Hkv, Nk, D]: query head ``h`` reads K / V head ``h // (H / Hkv)``, as
``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` defines it (``repeat_interleave`` of the
K / V heads). The oracle is that SDPA call in float64. Bounds, as the backward-kernel tests hold them
(tests/kernels/grad_checks.py): outputs within the mode's contract (``MODES[mode].rel_tol``); gradients within
1e-5 where the mode's products are FP32-accurate, within tf32's contract for tf32 on the CPU, and within twice
PyTorch's own error at the mode's dtype plus 1e-6 for fp16 / bf16 (FlashAttention's test rule). The kernels run in
the Triton interpreter (``backend="triton"``); the launches are recorded to show K / V are read in place.
"""
import pytest
import torch
import torch.nn.functional as F

import visionattn as va
from visionattn.kernels import elsa_bwd, half_gluon, half_gluon_bwd, ieee_gluon, ieee_gluon_bwd
from visionattn.metrics import rel_l2
from visionattn.modes import MODES
from visionattn.reference import scores_and_mask

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; the gpu tests cover CUDA")
FP32_TOL = 1e-5
DENSE_KERNELS = ("_elsa_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Once-per-process warnings warn again in this test."""
    from visionattn import dispatch

    monkeypatch.setattr(dispatch, "_warned", set())


def _inputs(B, H, Hkv, Nq, Nk, D, dtype, seed=0):
    """q [B, H, Nq, D], k / v [B, Hkv, Nk, D] in ``dtype`` (leaves needing gradients) and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=torch.float64)
               for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))
    grad_out = torch.randn(B, H, Nq, D, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], grad_out


def _sdpa_grads(leaves, grad_out, dtype, bias=None, **kw):
    """(out, [dq, dk, dv(, dbias)]) of SDPA with ``enable_gqa=True`` on ``leaves`` cast to ``dtype``."""
    xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
    b = None if bias is None else bias.detach().to(dtype).requires_grad_()
    out = F.scaled_dot_product_attention(*xs, attn_mask=b, enable_gqa=True, **kw)
    wrt = xs + ([b] if b is not None else [])
    return out.detach(), list(torch.autograd.grad(out, wrt, grad_out.to(dtype)))


def _torch_grads(leaves, grad_out, dtype, bias=None, is_causal=False):
    """[dq, dk, dv(, dbias)] of PyTorch's own attention in ``dtype`` (the half modes' same-precision baseline, as
    tests/kernels/test_elsa_bwd.py forms it: logits, softmax and P V in ``dtype``) on K / V repeated for the group
    as SDPA's ``enable_gqa`` repeats them."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in leaves)
    b = None if bias is None else bias.detach().to(dtype).requires_grad_()
    group = q.shape[1] // k.shape[1]
    s = scores_and_mask(q, k.repeat_interleave(group, 1), scale=q.shape[-1] ** -0.5, bias=b, is_causal=is_causal)
    e = torch.exp(s - s.amax(-1, keepdim=True).detach())
    out = (e / e.sum(-1, keepdim=True)) @ v.repeat_interleave(group, 1)
    return list(torch.autograd.grad(out, [q, k, v] + ([b] if b is not None else []), grad_out.to(dtype)))


def _check(mode, leaves, grad_out, bias=None, **kw):
    """Run visionattn on the kernels; assert the output and every gradient within the mode's bounds (module
    docstring). Returns the kernel gradients."""
    ours = va.attention(*leaves, bias=bias, mode=mode, backend="triton", enable_gqa=True, **kw)
    wrt = list(leaves) + ([bias] if bias is not None else [])
    got = torch.autograd.grad(ours, wrt, grad_out.to(ours.dtype))
    sdpa_kw = {k: v for k, v in kw.items() if k != "num_splits"}
    out64, gold = _sdpa_grads(leaves, grad_out, torch.float64, bias, **sdpa_kw)
    assert rel_l2(ours.detach().double(), out64) <= MODES[mode].rel_tol, "out"
    dtype = MODES[mode].compute_dtype
    if dtype == torch.float32:
        bounds = [MODES["tf32"].rel_tol if mode == "tf32" else FP32_TOL] * len(gold)
    else:
        same = _torch_grads(leaves, grad_out, dtype, bias, kw.get("is_causal", False))
        bounds = [2 * rel_l2(s.double(), g) + 1e-6 for s, g in zip(same, gold)]
    for name, x, g, bound in zip(("dq", "dk", "dv", "dbias"), got, gold, bounds):
        assert x.shape == g.shape, name
        err = rel_l2(x.double(), g)
        assert err <= bound, f"{mode} {name}: rel err {err:.3e} > {bound:.3e}"
    return got


# --------------------------------------------------------------------------- values against SDPA

@cpu_only
@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_matches_sdpa_enable_gqa(mode, kv_heads):
    """8 query heads over 8, 4, 2 and 1 (multi-query) K / V heads, Nq != Nk: output and dQ / dK / dV as SDPA's
    ``enable_gqa=True`` in float64, within each mode's bounds; dK / dV have the K / V heads' shape."""
    leaves, grad_out = _inputs(1, 8, kv_heads, 19, 37, 32, MODES[mode].compute_dtype)
    _check(mode, leaves, grad_out)


@cpu_only
@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_causal_bias_and_mask(mode):
    """Causal, a head-wise relative bias [H, Nq, Nk] that needs a gradient (its dBias reduced over the batch)
    and, separately, a boolean key-padding mask: per query head, as SDPA applies them."""
    dtype = MODES[mode].compute_dtype
    leaves, grad_out = _inputs(2, 4, 2, 21, 30, 16, dtype, seed=1)
    _check(mode, leaves, grad_out, is_causal=True)
    bias = torch.randn(4, 21, 30, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()
    _check(mode, leaves, grad_out, bias=bias)
    keep = torch.rand(2, 1, 1, 30, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[..., 0] = True
    ours = va.attention(*leaves, attn_mask=keep, mode=mode, backend="triton", enable_gqa=True)
    ref = F.scaled_dot_product_attention(*(t.detach().double() for t in leaves), attn_mask=keep, enable_gqa=True)
    assert rel_l2(ours.detach().double(), ref) <= MODES[mode].rel_tol


@cpu_only
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_split_kv(mode):
    """The split-KV forward (partials merged by the monoid) forced with ``num_splits=3``, and its backward from
    the merged log-sum-exp."""
    leaves, grad_out = _inputs(1, 4, 1, 9, 70, 32, MODES[mode].compute_dtype, seed=4)
    _check(mode, leaves, grad_out, num_splits=3)


@cpu_only
@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_single_pass_backward(mode):
    """Head dim 64 with at most 256 keys runs the single-pass backward (dQ added in key-tile order inside the
    dK / dV kernel, with a narrow last key tile): with a group, every query head's dQ still takes its turns."""
    assert elsa_bwd.get_config(mode, 64, 64, False, None, 70).single_pass
    leaves, grad_out = _inputs(1, 4, 2, 33, 70, 64, torch.float32, seed=5)
    _check(mode, leaves, grad_out)
    _check(mode, leaves, grad_out, is_causal=True)


@cpu_only
@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_gradients_are_bit_identical_on_repeat(mode):
    """dK / dV sum the group's query heads in a fixed order inside one program (no atomics): two backward
    passes give the same bits."""
    leaves, grad_out = _inputs(1, 8, 2, 17, 45, 32, MODES[mode].compute_dtype, seed=6)
    runs = []
    for _ in range(2):
        out = va.attention(*leaves, mode=mode, backend="triton", enable_gqa=True)
        runs.append(torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))
    for name, a, b in zip("qkv", *runs):
        assert torch.equal(a, b), f"d{name}"


@cpu_only
def test_equal_heads_with_enable_gqa_change_nothing():
    """``enable_gqa=True`` with equal heads is the plain call, bit for bit."""
    leaves, grad_out = _inputs(1, 3, 3, 11, 20, 16, torch.float32, seed=7)
    a = va.attention(*leaves, backend="triton", enable_gqa=True)
    b = va.attention(*leaves, backend="triton")
    assert torch.equal(a, b)
    for x, y in zip(torch.autograd.grad(a, leaves, grad_out.float()), torch.autograd.grad(b, leaves, grad_out.float())):
        assert torch.equal(x, y)


def test_reference_backend_repeats_kv():
    """The reference (CPU tensors' default backend) repeats K / V for the group; its gradients sum back to the
    K / V heads, as SDPA's."""
    leaves, grad_out = _inputs(2, 6, 3, 8, 13, 8, torch.float64, seed=8)
    out = va.attention(*leaves, backend="reference", enable_gqa=True, is_causal=True)
    ref_out, gold = _sdpa_grads(leaves, grad_out, torch.float64, is_causal=True)
    assert rel_l2(out.detach(), ref_out) <= FP32_TOL
    for x, g in zip(torch.autograd.grad(out, leaves, grad_out), gold):
        assert x.shape == g.shape and rel_l2(x, g) <= FP32_TOL


@cpu_only
def test_pasa_modes_run_the_reference_with_a_warning(fresh_warnings):
    """The PASA kernel takes equal heads: a grouped call in a PASA mode runs the reference, warned once naming
    grouped-query attention."""
    leaves, _ = _inputs(1, 4, 2, 16, 24, 32, torch.float16, seed=9)
    with pytest.warns(RuntimeWarning, match="grouped-query attention"):
        out = va.attention(*(t.detach() for t in leaves), mode="pasa", backend="triton", enable_gqa=True)
    ref = F.scaled_dot_product_attention(*(t.detach().double() for t in leaves), enable_gqa=True)
    assert rel_l2(out.double(), ref) <= MODES["pasa"].rel_tol


@cpu_only
def test_custom_ops_and_compiled_training():
    """The custom ops' fake implementations give grouped shapes (dK / dV with the K / V heads), and a compiled
    training call (AOT autograd, the backward as an op) gives the eager gradients."""
    leaves, grad_out = _inputs(1, 4, 2, 9, 21, 16, torch.float32, seed=11)
    q, k, v = (t.detach() for t in leaves)
    for op in (torch.ops.visionattn.attention.default, torch.ops.visionattn.attention_lse.default):
        torch.library.opcheck(op, (q, k, v, None, None, True, 0.25, "fp32", 0, None),
                              test_utils=("test_schema", "test_faketensor"))

    def f(q, k, v):
        return (va.attention(q, k, v, backend="triton", enable_gqa=True) * grad_out.float()).sum()

    eager = torch.autograd.grad(f(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    for a, b in zip(eager, compiled):
        assert a.shape == b.shape and rel_l2(b, a) <= 1e-6


# --------------------------------------------------------------------------- no copy of K / V

@cpu_only
@pytest.mark.parametrize("mode,n_k", [("fp32", 70), ("fp32", 300), ("fp16", 70)])
def test_kernels_read_the_callers_kv_heads(kernel_launches, mode, n_k):
    """Every dense kernel launch (forward, dK / dV, dQ; single-pass and two-kernel backward) receives the caller's
    own K and V (same data pointers, Hkv heads): no [B, H, Nk, D] repeat is made anywhere."""
    H, Hkv, D = 4, 2, 64 if n_k == 70 else 32
    leaves, grad_out = _inputs(1, H, Hkv, 12, n_k, D, MODES[mode].compute_dtype, seed=10)
    q, k, v = leaves
    out = va.attention(q, k, v, mode=mode, enable_gqa=True)
    dq, dk, dv = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    assert dk.shape == k.shape and dv.shape == v.shape
    seen = {name for name, _, _ in kernel_launches}
    assert {"_elsa_fwd_kernel", "_bwd_dkdv_kernel"} <= seen, seen
    for name, args, _ in kernel_launches:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert not any(t.dim() == 4 and t.shape[1] == H and t.shape[2] == n_k for t in tensors), \
            f"{name} received a K / V tensor with the query's {H} heads"
        if name in DENSE_KERNELS:
            K, V = args[1], args[2]
            assert K.data_ptr() == k.data_ptr() and K.shape == k.shape, name
            assert V.data_ptr() == v.data_ptr() and V.shape == v.shape, name


# --------------------------------------------------------------------------- errors and scope

def test_errors_follow_sdpa():
    """Hkv not dividing H with ``enable_gqa=True`` (SDPA's "must divide" error), unequal heads without it (the
    message names enable_gqa), key and value head counts that differ, and a non-bool ``enable_gqa``."""
    q = torch.randn(1, 6, 5, 8)
    four, two, three = (torch.randn(1, h, 5, 8) for h in (4, 2, 3))
    with pytest.raises(ValueError, match=r"number of heads in key and value \(4\) must divide the number of heads "
                                         r"in query \(6\)"):
        va.attention(q, four, four, enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        va.attention(q, two, two)
    with pytest.raises(ValueError, match="key has 2 heads and value 3"):
        va.attention(q, two, three, enable_gqa=True)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        va.attention(q, two, two, enable_gqa=1)


def test_cached_call_without_enable_gqa_still_raises():
    """A grouped call's cached runner is not reached by the same shapes without ``enable_gqa``: the checks run
    and raise."""
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    for _ in range(2):
        va.attention(q, k, k, enable_gqa=True)
    with pytest.raises(ValueError, match="batch/heads mismatch"):
        va.attention(q, k, k)


def test_gluon_kernels_take_grouped_heads_where_they_can():
    """The Gluon forward kernels (fp32's split build, fp32-ieee, Hopper fp16 / bf16) and the Hopper Gluon backward
    in every build (fp16 / bf16; tf32 / fp32, each query head's operand scales taken at its first step) read K / V
    head h // G in place, so their scopes do not refuse grouped calls; the fp32-ieee Gluon backward gives them to
    the Triton kernels, its scope naming grouped-query attention first. Each forward plan passes the group size G =
    H / Hkv to its kernel."""
    from visionattn.kernels import fp32_gluon

    q, k = torch.randn(1, 4, 64, 64), torch.randn(1, 2, 64, 64)
    qh, kh = q.half(), k.half()
    for reason in (ieee_gluon.unsupported_reason(q, k, k, None, None, False, 0.125, 0),
                   fp32_gluon.unsupported_reason(q, k, k, None, None, False, 0.125, 0),
                   half_gluon.unsupported_reason(qh, kh, kh, None, None, False, 0.125, 0),
                   half_gluon_bwd.unsupported_reason(qh, kh, kh, qh, None, None, False, 0.125),
                   half_gluon_bwd.tf32_unsupported_reason(q, k, k, q, None, None, False, 0.125),
                   half_gluon_bwd.fp32_unsupported_reason(q, k, k, q, None, None, False, 0.125)):
        assert reason is None or "grouped-query" not in reason
    reason = ieee_gluon_bwd.unsupported_reason(q, k, k, q, None, None, False, 0.125)
    assert reason is not None and "grouped-query" in reason
    import inspect

    for kernel in (ieee_gluon, half_gluon):
        source = inspect.getsource(kernel.planned_launch)
        assert "H // k.shape[1]" in source, kernel.__name__


# --------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("kv_heads,n_q,n_k,head_dim", [(4, 1024, 1024, 64), (2, 197, 1000, 128), (1, 77, 4097, 64),
                                                       (16, 256, 255, 64)])
def test_gpu_matches_sdpa_enable_gqa(mode, kv_heads, n_q, n_k, head_dim):
    """The compiled kernels (tile sizes, pipelining and Hopper paths the interpreter does not take): 16 query heads
    over 4, 2, 1 and 16 K / V heads at tile-boundary lengths, output and gradients within each mode's bounds
    against SDPA ``enable_gqa=True`` in float64 on the GPU."""
    leaves, grad_out = _inputs(2, 16, kv_heads, n_q, n_k, head_dim, MODES[mode].compute_dtype)
    leaves = [t.detach().cuda().requires_grad_() for t in leaves]
    _check(mode, leaves, grad_out.cuda())
