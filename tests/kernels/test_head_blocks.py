"""Tile widths of the head dims: every kernel gets equal q / k and v tile widths.

On the GPU, Triton 3.6 compiles a kernel whose V tile is narrower or wider than its K tile into code that addresses
shared memory out of range. Split-FP16 products (``fp32`` / ``tf32`` modes, :mod:`visionattn.kernels.split16`):
compute-sanitizer "Out-of-range shared or local address" in ``split16.fold_pv``; D = 64 with Dv = 16 returned NaN in
the dense forward, D = 128 with Dv = 16 wrong outputs (relative error ~1), D = 48 with Dv = 32 an illegal address,
and likewise in the backward, the window and the varlen kernels. Native fp16 / bf16 products: the varlen forward at
D = 72, Dv = 32 with a V not 16-byte aligned returned relative errors 0.8-2.1 in every sequence (an illegal address
in a longer process); PASA at D = 256, Dv = 32: "Invalid __shared__ read" in its P V product. The interpreter
computes the same kernels correctly, so these tests check the cause: every interpreted launch that has both widths
gets ``BLOCK_D == BLOCK_DV`` (:func:`visionattn.kernels._launch.head_blocks`), and the results stay exact.
"""
import pytest
import torch

import visionattn as va
from visionattn.kernels._launch import head_blocks
from visionattn.metrics import rel_l2

@pytest.fixture
def launches(kernel_launches):
    """The interpreted kernel launches (tests/conftest.py)."""
    return kernel_launches


def _widths(seen):
    """``[(kernel, BLOCK_D, BLOCK_DV)]`` of the launches with both widths."""
    return [(name, kw["BLOCK_D"], kw["BLOCK_DV"]) for name, _, kw in seen if "BLOCK_D" in kw and "BLOCK_DV" in kw]


def _check(seen):
    widths = _widths(seen)
    assert widths, "no kernel with both widths ran: the test would pass vacuously"
    bad = [w for w in widths if w[1] != w[2]]
    assert not bad, f"launches with BLOCK_D != BLOCK_DV: {bad}"


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _ref64(q, k, v, grad_out, **kw):
    l64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*l64, **kw)
    out.backward(grad_out.double())
    return [out.detach()] + [t.grad for t in l64]


def test_head_blocks_rule():
    assert head_blocks(64, 16) == (64, 64)
    assert head_blocks(16, 48) == (64, 64)
    assert head_blocks(72, 32) == (128, 128)
    assert head_blocks(256, 32) == (256, 256)
    assert head_blocks(64, 64) == (64, 64)
    assert head_blocks(8, 8) == (16, 16)


def test_varlen_half_misaligned_value_equal_widths(launches):
    """The GPU case: fp16 varlen forward at D = 72, Dv = 32, V one element off 16-byte alignment, sequences
    longest first (lengths on the host) including empty ones."""
    lens = [9, 0, 33, 1, 20]
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(sum(lens), 2, 72, generator=g).half() for _ in range(2))
    base = torch.randn(sum(lens) * 2 * 32 + 1, generator=g).half()
    v = base[1:].view(sum(lens), 2, 32)
    assert v.data_ptr() % 16 != 0
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = va.varlen_attention(q, k, v, cu, cu, mode="fp16")
    _check(launches)
    for s in range(len(lens)):
        a, b = cu[s].item(), cu[s + 1].item()
        if a == b:
            continue
        ref = torch.nn.functional.scaled_dot_product_attention(*(t[a:b].double().transpose(0, 1) for t in (q, k, v)))
        assert rel_l2(out[a:b].transpose(0, 1), ref) < 2e-3, s


@pytest.mark.parametrize("mode", ["fp16", "pasa"])
def test_dense_half_and_pasa_equal_widths(launches, mode):
    """Native half and PASA products: the dense forward (and PASA's) at D = 64, Dv = 16 and D = 32, Dv = 64."""
    for d, dv in ((64, 16), (32, 64)):
        g = torch.Generator().manual_seed(d)
        q, k = (torch.randn(1, 2, 40, d, generator=g).half() for _ in range(2))
        v = torch.randn(1, 2, 40, dv, generator=g).half()
        out = va.attention(q, k, v, mode=mode)
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
        assert rel_l2(out, ref) < 3e-3, (d, dv)
    _check(launches)


@pytest.mark.parametrize("mode", ["fp32", "tf32"])
@pytest.mark.parametrize("d,dv", [(64, 16), (16, 48)])
def test_dense_split16_equal_widths(launches, mode, d, dv):
    """Dense forward and backward (single-pass and split-KV forward) with D != Dv."""
    q, k, v = _leaves((1, 2, 40, d), (1, 2, 40, d), (1, 2, 40, dv))
    out = va.attention(q, k, v, mode=mode)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    va.attention(q.detach()[:, :, :3], k.detach(), v.detach(), mode=mode, num_splits=2)
    _check(launches)
    ref = _ref64(q, k, v, grad_out)
    tol = {"fp32": 1e-5, "tf32": 3e-3}[mode]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        assert rel_l2(got, want) < tol, name


@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_varlen_split16_equal_widths(launches, mode):
    q, k = _leaves((22, 2, 32), (22, 2, 32))
    (v,) = _leaves((22, 2, 16), seed=1)
    cu = torch.tensor([0, 5, 5, 22], dtype=torch.int32)
    out = va.varlen_attention(q, k, v, cu, cu, mode=mode)
    out.sum().backward()
    _check(launches)
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    a, b = 5, 22
    ref = _ref64(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), torch.ones(1, 2, b - a, 16))
    tol = {"fp32": 1e-5, "tf32": 3e-3}[mode]
    assert rel_l2(out[a:b].transpose(0, 1)[None], ref[0]) < tol
    assert rel_l2(q.grad[a:b].transpose(0, 1)[None], ref[1]) < tol


@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_window_split16_equal_widths(launches, mode):
    """Fused window forward and backward (49-token windows) with D = 32, Dv = 16."""
    q, k = _leaves((4, 2, 49, 32), (4, 2, 49, 32))
    (v,) = _leaves((4, 2, 49, 16), seed=1)
    out = va.window_attention(q, k, v, num_windows=2, mode=mode)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    _check(launches)
    ref = _ref64(q, k, v, grad_out)
    tol = {"fp32": 1e-5, "tf32": 3e-3}[mode]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        assert rel_l2(got, want) < tol, name


def test_window_forward_falls_back_to_tiled_configs():
    """A window too large for shared memory as one tile (128 tokens at head dim 256 in FP32: ~384 KB, over the
    H100 / H200's 227 KB; the GPU raised OutOfResources) goes on to the tiled kernel with smaller tiles, and
    those tiles compute the same attention."""
    from visionattn.kernels import window_fwd

    chain = window_fwd._smaller_configs({"kernel": "small", "imgs": 1, "num_warps": 8, "num_stages": 2})
    assert chain[0]["kernel"] == "small" and chain[0]["num_stages"] == 1
    tiled = [c for c in chain if c["kernel"] == "tiled"]
    assert tiled and min(c["block_n"] for c in tiled) == 16 and min(c["block_m"] for c in tiled) == 16
    assert any(c["num_stages"] == 1 and c["block_n"] == 16 for c in tiled)
    wide = window_fwd._smaller_configs({"kernel": "tiled", "block_m": 128, "block_n": 64, "num_warps": 4,
                                        "num_stages": 2})
    assert wide[0] == {"kernel": "tiled", "block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 1}
    assert (wide[-1]["block_m"], wide[-1]["block_n"]) == (16, 16)
    if torch.cuda.is_available():
        return
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 49, 256, generator=g) for _ in range(3))
    small_cfg = {"kernel": "tiled", "block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    _, out = window_fwd._plan_and_run(q, k, v, None, None, None, 1, False, 256 ** -0.5, "fp32-ieee", small_cfg)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert rel_l2(out, ref) < 1e-5
