"""Window attention backward (Swin shift mask + relative position bias, Swin-v2 per-head logit scale) against
float64 autograd.

The oracle expands bias and mask to [B*nW, H, N, N] in float64 and differentiates
``softmax(c_h q k^T + bias[h] + mask[b mod nW]) v`` with autograd (loss ``(out * grad_out).sum()``); the
kernels get the forward's output and ``lse`` from it. Bounds from grad_checks.py: 1e-5 for the
FP32-accurate modes, 2x PyTorch's own backward in the same precision for tf32 / fp16 / bf16. CPU: interpreter,
small shapes; ``gpu``: Swin-B / Swin-v2-B stage-1 sizes.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from visionattn.kernels.elsa_bwd import BWD_MODES, BwdConfig, KernelTiles
from visionattn.kernels.window_bwd import get_config, window_backward

from grad_checks import assert_gradients, mode_bounds

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; the gpu tests cover CUDA")
NAMES = ("dq", "dk", "dv", "dbias", "dhead_scale")


def window_inputs(n_img, nw, h, n, d, seed=0, device="cpu", cosine=False):
    """timm-style strided q, k, v views, grad_out, bias [H, N, N] (non-contiguous), shift mask [nW, N, N] of
    0 / -100, and for cosine the per-head scale exp(min(logit_scale, log 100)) with q, k normalised."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(n_img * nw, n, 3, h, d, generator=g, device=device)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    if cosine:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    do = torch.randn(n_img * nw, h, n, d, generator=g, device=device)
    bias = torch.randn(n, n, h, generator=g, device=device).permute(2, 0, 1)
    region = torch.randint(0, 3, (nw, n), generator=g, device=device)
    mask = torch.zeros(nw, n, n, device=device).masked_fill(region[:, None] != region[:, :, None], -100.0)
    hs = None
    if cosine:
        ls = torch.log(torch.rand(h, generator=g, device=device) * 40 + 5)
        hs = torch.exp(torch.clamp(ls, max=math.log(100)))
    return q, k, v, do, bias, mask, hs


def window_autograd(dtype, q, k, v, do, bias, mask, nw, scale, hs):
    """(out, lse, grads [dq, dk, dv, dbias, dhead_scale]) by autograd in ``dtype`` (float64 = the oracle)."""
    BW, H, N, _ = q.shape
    ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    bd = bias.detach().to(dtype).requires_grad_() if bias is not None else None
    hd = hs.detach().to(dtype).requires_grad_() if hs is not None else None
    c = hd.reshape(1, H, 1, 1) if hd is not None else scale
    s = (ts[0] @ ts[1].transpose(-1, -2)) * c
    if bd is not None:
        s = s + bd.unsqueeze(0)
    if mask is not None:
        s = s + mask.to(dtype).repeat(BW // nw, 1, 1).unsqueeze(1)
    dead = torch.isneginf(s).all(-1, keepdim=True)  # rows without a visible key: output and gradients 0
    o = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0) @ ts[2]
    (o.double() * do.double()).sum().backward()
    lse = torch.logsumexp(s.detach().double(), -1).float()
    grads = [t.grad for t in ts] + [bd.grad if bd is not None else None, hd.grad if hd is not None else None]
    return o.detach(), lse, grads


def check_window(mode, q, k, v, do, bias, mask, nw, scale=0.2, hs=None, config=None, bias_splits=None, kernel="auto"):
    dtype = BWD_MODES[mode][0]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out64, lse, gold = window_autograd(torch.float64, q, k, v, do, bias, mask, nw, scale, hs)
    got = window_backward(q, k, v, out64.to(dtype), do.to(dtype), lse, bias, mask, nw, scale, mode, hs,
                          bias is not None, hs is not None, config=config, bias_splits=bias_splits, kernel=kernel)
    bounds = mode_bounds(mode, gold, lambda: window_autograd(dtype, q, k, v, do, bias, mask, nw, scale, hs)[2],
                         q.is_cuda)
    assert_gradients(mode, NAMES, got, gold, bounds)
    return got


# --------------------------------------------------------------------------- CPU (interpreter)

@cpu_only
@pytest.mark.parametrize("kernel", ["fused", "split"])
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16"])
def test_swin_shift_window(mode, kernel):
    """Swin: 49-token windows, bias [H, N, N] (gradient summed over 2 images x 3 windows in 2 partial chunks,
    each summed in registers: one key tile), shift mask -100 read per window (b mod nW); both kernel paths."""
    q, k, v, do, bias, mask, _ = window_inputs(2, 3, 2, 49, 32, seed=1)
    dq, dk, dv, db, dhs = check_window(mode, q, k, v, do, bias, mask, 3, bias_splits=2, kernel=kernel)
    assert db.shape == (2, 49, 49) and dhs is None and dq.is_contiguous()


@cpu_only
@pytest.mark.parametrize("kernel", ["fused", "split"])
@pytest.mark.parametrize("mode", ["fp32-ieee", "bf16"])
def test_swin_v2_head_scale(mode, kernel):
    """Swin-v2: normalised q, k, per-head logit scale (up to 45) with its gradient, bias and shift mask."""
    q, k, v, do, bias, mask, hs = window_inputs(2, 2, 3, 49, 16, seed=2, cosine=True)
    dq, dk, dv, db, dhs = check_window(mode, q, k, v, do, bias, mask, 2, hs=hs, kernel=kernel)
    assert dhs.shape == (3,)


@cpu_only
def test_tiled_window_no_mask_bias_splits():
    """144 tokens over 32 x 32 tiles (ragged last tile), no shift mask (nW = 1), dBias in 3 partial chunks,
    [H, 1, 1] head scale as timm stores logit_scale."""
    q, k, v, do, bias, _, hs = window_inputs(3, 1, 1, 144, 16, seed=3, cosine=True)
    cfg = BwdConfig(KernelTiles(32, 32, 4, 1), KernelTiles(32, 32, 4, 1))
    got = check_window("fp32-ieee", q, k, v, do, bias, None, 1, hs=hs.reshape(1, 1, 1), config=cfg, bias_splits=3)
    assert got[4].shape == (1, 1, 1)


@cpu_only
@pytest.mark.parametrize("kernel", ["fused", "split"])
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16"])
def test_small_windows_odd_head_dims_masked_row(mode, kernel):
    """7-token windows (one 16-row tile, mostly padding), D = 24 != Dv = 40 (neither a power of two), a bias in
    the mode's dtype (its gradient comes back in it), a query row whose logits are all -inf through the shift
    mask (zero gradients, no NaN), a head scale, and more bias splits than windows."""
    q, k, v, do, bias, mask, hs = window_inputs(2, 2, 2, 7, 40, seed=10, cosine=True)
    mask[1, 3] = float("-inf")
    bias = bias.to(BWD_MODES[mode][0])
    dq, dk, dv, db, dhs = check_window(mode, q[..., :24], k[..., :24], v, do, bias, mask, 2, hs=hs, bias_splits=9,
                                       kernel=kernel)
    assert db.dtype == bias.dtype and (dq[1::2, :, 3] == 0).all()


@cpu_only
@pytest.mark.parametrize("kernel", ["fused", "split"])
def test_expanded_bias_gets_a_per_head_gradient(kernel):
    """A stride-0 bias view ([1, N, N] expanded over the heads, [H, 1, N] over the queries): dbias has the
    view's shape [H, N, N], each element's own gradient, on both kernel paths."""
    q, k, v, do, _, mask, _ = window_inputs(1, 2, 3, 20, 16, seed=9)
    g = torch.Generator().manual_seed(9)
    for base in (torch.randn(1, 20, 20, generator=g), torch.randn(3, 1, 20, generator=g)):
        check_window("fp32", q, k, v, do, base.expand(3, 20, 20), mask, 2, kernel=kernel)


@cpu_only
@pytest.mark.parametrize("kernel", ["auto", "fused", "split"])
def test_no_windows(kernel):
    """B*nW = 0: empty dq, dk, dv and zero dbias [H, N, N] / dhead_scale [H] on every kernel choice."""
    q = torch.randn(0, 2, 16, 16)
    got = window_backward(q, q, q, q, q, torch.zeros(0, 2, 16), torch.randn(2, 16, 16), None, 1, 0.2, "fp32",
                          torch.ones(2), True, True, kernel=kernel)
    assert [tuple(t.shape) for t in got] == [(0, 2, 16, 16)] * 3 + [(2, 16, 16), (2,)]
    assert (got[3] == 0).all() and (got[4] == 0).all()


@cpu_only
def test_fused_plan_takes_one_stage_where_two_do_not_fit(monkeypatch):
    """A GPU whose shared memory cannot hold the 2-stage fused kernel (the launch raises OutOfResources): the
    plan is rebuilt with 1 stage, kept, and its gradients meet the bound."""
    import triton

    from visionattn.kernels import window_bwd

    class TwoStagesTooBig(window_bwd.KernelCall):
        def __call__(self, *args):
            if self.options["num_stages"] > 1:
                raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
            super().__call__(*args)

    monkeypatch.setattr(window_bwd, "KernelCall", TwoStagesTooBig)
    window_bwd.PLANS.clear()
    q, k, v, do, bias, mask, _ = window_inputs(2, 2, 2, 49, 16, seed=12)
    check_window("fp32", q, k, v, do, bias, mask, 2, kernel="fused")
    (plan,) = window_bwd.PLANS.plans.values()
    assert plan.call.options["num_stages"] == 1
    window_bwd.PLANS.clear()


@pytest.fixture
def fused_never_fits(monkeypatch):
    """A GPU whose shared memory holds the fused kernel at no stage count (FP32 operands at head dim 256 need
    ~288 KB as one 64-row window; an H200 has 227 KB): its launches raise OutOfResources. Yields the list of
    fused launch attempts."""
    import triton

    from visionattn.kernels import window_bwd

    tries = []

    class FusedTooBig(window_bwd.KernelCall):
        def __call__(self, *args):
            tries.append(self.options["num_stages"])
            raise triton.runtime.errors.OutOfResources(294912, 232448, "shared memory")

    monkeypatch.setattr(window_bwd, "KernelCall", FusedTooBig)
    monkeypatch.setattr(window_bwd, "_FUSED_TOO_BIG", set())
    window_bwd.PLANS.clear()
    yield tries
    window_bwd.PLANS.clear()


@cpu_only
def test_fused_that_never_fits_runs_the_split_kernels(fused_never_fits):
    """kernel='auto' on a window the fused kernel cannot hold: the split kernels compute the gradients (within the
    mode's bound against float64), the signature is remembered (a second call tries the fused kernel no more),
    and kernel='fused' says so."""
    import triton

    q, k, v, do, bias, mask, _ = window_inputs(2, 2, 2, 49, 16, seed=13)
    check_window("fp32", q, k, v, do, bias, mask, 2)
    tried = len(fused_never_fits)
    assert tried >= 1
    check_window("fp32", q, k, v, do, bias, mask, 2)
    assert len(fused_never_fits) == tried
    with pytest.raises(triton.runtime.errors.OutOfResources):
        check_window("fp32", q, k, v, do, bias, mask, 2, kernel="fused")


@cpu_only
def test_deterministic():
    q, k, v, do, bias, mask, hs = window_inputs(4, 2, 2, 20, 16, seed=4, cosine=True)
    out64, lse, _ = window_autograd(torch.float64, q, k, v, do, bias, mask, 2, 0.2, hs)
    runs = [window_backward(q, k, v, out64.float(), do, lse, bias, mask, 2, 0.2, "fp32", hs, True, True,
                            bias_splits=3) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@cpu_only
def test_errors_name_the_argument():
    q, k, v, do, bias, mask, hs = window_inputs(1, 2, 2, 16, 16)
    lse = torch.zeros(2, 2, 16)
    base = dict(q=q, k=k, v=v, out=do, grad_out=do, lse=lse, relative_position_bias=bias, shift_mask=mask,
                num_windows=2, scale=0.25, mode="fp32")
    with pytest.raises(ValueError, match="num_windows"):
        window_backward(**{**base, "num_windows": 3})
    with pytest.raises(ValueError, match="shift_mask"):
        window_backward(**{**base, "shift_mask": mask[:1]})
    with pytest.raises(ValueError, match="relative_position_bias"):
        window_backward(**{**base, "relative_position_bias": bias[:1]})
    with pytest.raises(ValueError, match="head_scale"):
        window_backward(**base, head_scale=torch.ones(3))
    with pytest.raises(ValueError, match="head_scale_requires_grad"):
        window_backward(**base, head_scale_requires_grad=True)
    with pytest.raises(TypeError, match="q has dtype"):
        window_backward(**{**base, "mode": "bf16"})
    with pytest.raises(ValueError, match="mode"):
        get_config("pasa", 49, 32)
    with pytest.raises(ValueError, match="kernel="):
        window_backward(**base, kernel="flash")
    with pytest.raises(ValueError, match="kernel='fused'"):
        window_backward(**base, kernel="fused", config=get_config("fp32", 16, 16))
    q144 = torch.randn(2, 2, 144, 16)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        window_backward(**{**base, "q": q144, "k": q144, "v": q144, "out": q144, "grad_out": q144,
                           "lse": torch.zeros(2, 2, 144), "relative_position_bias": None, "shift_mask": None},
                        kernel="fused")


# --------------------------------------------------------------------------- GPU (real sizes)

@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(BWD_MODES))
@pytest.mark.parametrize("case", ["v1-49-fused", "v1-49-split", "v2-64-fused", "v2-256-split"])
def test_gpu_swin_stage1(mode, case):
    """Stage 1 shapes, 4 heads, D = 32: Swin-B's 49-token windows (64 windows x 8 images) on both kernel
    paths; Swin-v2's cosine attention with logit scales on 64-token windows (window 8, fused) and 256-token
    windows (window 16, split), 16 windows x 4 images."""
    if case.startswith("v1"):
        q, k, v, do, bias, mask, _ = window_inputs(8, 64, 4, 49, 32, seed=6, device="cuda")
        check_window(mode, q, k, v, do, bias, mask, 64, scale=32 ** -0.5, kernel=case.split("-")[-1])
    else:
        n = int(case.split("-")[1])
        q, k, v, do, bias, mask, hs = window_inputs(4, 16, 4, n, 32, seed=5, device="cuda", cosine=True)
        check_window(mode, q, k, v, do, bias, mask, 16, hs=hs, kernel=case.split("-")[-1])
