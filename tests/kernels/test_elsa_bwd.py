"""Dense ELSA backward kernels against float64 autograd.

CPU: the kernels run in the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py) at small shapes;
``gpu``: real sizes (ViT, long sequences) on an NVIDIA GPU. The oracle is torch autograd in float64 on the
inputs rounded to the mode's compute dtype, loss ``(out * grad_out).sum()``; ``lse`` comes from
``torch.logsumexp`` of the float64 logits. FP32 modes must meet rel L2 <= 1e-5 on every gradient; fp16 / bf16
and tf32 at most 2x the error of the same attention written in PyTorch and differentiated by autograd in that
precision (FlashAttention's test rule; tf32 on the CPU, which has no TF32 matmuls: the mode's contract). The
interpreter computes ``tf32x3`` dots in FP32, so there that product kind checks control flow only.
"""
import math

import pytest
import torch

from visionattn.kernels.elsa_bwd import (BWD_MODES, FP32_PRODUCTS, SINGLE_PASS_MAX_KEYS, BwdConfig, KernelTiles,
                                         bias_grad_shape, elsa_backward, get_config, reduce_bias_grad)
from visionattn.metrics import rel_l2

from grad_checks import FP32_TOL, assert_gradients, mode_bounds
from visionattn.reference import scores_and_mask

MODES = list(BWD_MODES)
SMALL = BwdConfig(KernelTiles(16, 16, 4, 1), KernelTiles(16, 16, 4, 1))  # many tiles at small N
SMALL_SINGLE = BwdConfig(KernelTiles(16, 16, 4, 1), KernelTiles(16, 16, 4, 1), single_pass=True)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; the gpu tests cover CUDA")


# --------------------------------------------------------------------------- oracle

def _attention(q, k, v, bias, mask, causal, scale):
    """softmax(scale q k^T + bias, masked) v in the inputs' dtype (all-masked rows: 0) and the FP32 lse."""
    s = scores_and_mask(q, k, scale=scale, bias=bias, attn_mask=mask, is_causal=causal)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den == 0, torch.ones_like(den), den)
    return p.to(v.dtype) @ v, torch.logsumexp(s.detach().double(), -1).float()


def autograd_grads(dtype, q, k, v, grad_out, bias=None, mask=None, causal=False, scale=0.125, chunk=None):
    """(out, lse, [dq, dk, dv, dbias]) by autograd in ``dtype`` (float64 = the oracle). ``chunk``: query rows per
    pass (long sequences: the [Nq, Nk] matrices of one chunk at a time; dK, dV, dBias accumulate)."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    bd = bias.detach().to(dtype).requires_grad_() if bias is not None else None
    Nq = q.shape[2]
    chunk = chunk or max(Nq, 1)
    outs, lses = [], []
    for i in range(0, Nq, chunk):
        sl = slice(i, min(i + chunk, Nq))
        b_i = bd.expand(*q.shape[:2], Nq, k.shape[2])[:, :, sl] if bd is not None else None
        m_i = mask.expand(*q.shape[:2], Nq, k.shape[2])[:, :, sl] if mask is not None else None
        s_off = _attention_rows(qd[:, :, sl], kd, vd, b_i, m_i, causal, scale, i)
        o, lse = s_off
        (o.double() * grad_out[:, :, sl].double()).sum().backward()
        outs.append(o.detach())
        lses.append(lse)
    grads = [qd.grad, kd.grad, vd.grad, bd.grad if bd is not None else None]
    return torch.cat(outs, 2), torch.cat(lses, 2), grads


def _attention_rows(q, k, v, bias, mask, causal, scale, q_offset):
    if not causal or q_offset == 0:
        return _attention(q, k, v, bias, mask, causal, scale)
    keep = torch.arange(k.shape[2], device=q.device) <= torch.arange(q.shape[2], device=q.device)[:, None] + q_offset
    mask = keep if mask is None else mask & keep
    return _attention(q, k, v, bias, mask, False, scale)


def _inputs(B, H, Nq, Nk, D, Dv=None, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda n, d: torch.randn(B, H, n, d, generator=g, device=device).to(dtype)  # noqa: E731
    return mk(Nq, D), mk(Nk, D), mk(Nk, Dv or D), torch.randn(B, H, Nq, Dv or D, generator=g, device=device)


def check_mode(mode, q, k, v, do, bias=None, mask=None, causal=False, scale=0.125, config=None, chunk=None,
               bias_splits=None, products=None):
    """Run the kernels and the oracle; assert the mode's bound on every gradient. Returns the kernel grads."""
    dtype = BWD_MODES[mode][0]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out64, lse, gold = autograd_grads(torch.float64, q, k, v, do, bias, mask, causal, scale, chunk)
    got = elsa_backward(q, k, v, out64.to(dtype), do.to(dtype), lse, bias, mask, causal, scale, mode,
                        bias is not None, config=config, bias_splits=bias_splits, products=products)
    bounds = mode_bounds(mode, gold, lambda: autograd_grads(dtype, q, k, v, do, bias, mask, causal, scale, chunk)[2],
                         q.is_cuda)
    names = ("dq", "dk", "dv", "dbias")
    assert_gradients(mode, names, got, gold, bounds)
    for name, x in zip(names, got):
        assert x is None or x.dtype == (q.dtype if name != "dbias" else bias.dtype), name
    return got


# --------------------------------------------------------------------------- CPU (interpreter)

@cpu_only
@pytest.mark.parametrize("products", FP32_PRODUCTS)
def test_every_fp32_product_kind_meets_the_fp32_bound(products):
    """The FP32 products a tool can pick (split-FP16 f16x3, the default; f16x3 with per-head right-operand scales;
    tl.dot's 3xTF32 and IEEE FMA) all hold the fp32 mode's gradient bound, relative position bias included."""
    q, k, v, do = _inputs(2, 2, 37, 50, 64, seed=1)
    bias = torch.randn(2, 37, 50, generator=torch.Generator().manual_seed(2))
    check_mode("fp32", q, k, v, do, bias=bias, products=products)

@cpu_only
@pytest.mark.parametrize("products", ["f16x3", "f16x3-head"])
@pytest.mark.parametrize("huge", ["q", "k", "grad_out"])
def test_f16x3_token_spanning_a_million_without_gradient(huge, products):
    """Split-FP16 products scale a product's right operand per column (f16x3-head: per head), across tokens (k in
    dQ, q in dK, dO in dV): one token 10^6 (~2^20, split16's documented span) times the others, through which no
    gradient flows (zero dO; a masked key; a masked query row), leaves the others' gradients within the fp32
    bound."""
    q, k, v, do = _inputs(1, 2, 24, 40, 32, seed=3)
    mask = torch.ones(24, 40, dtype=torch.bool)
    {"q": q, "k": k, "grad_out": do}[huge][:, :, 5] *= 1e6
    if huge == "q":
        do[:, :, 5] = 0
    elif huge == "k":
        mask[:, 5] = False
    else:
        mask[5] = False
    check_mode("fp32", q, k, v, do, mask=mask, config=SMALL, products=products)


@cpu_only
@pytest.mark.parametrize("mode", MODES)
def test_modes_with_bias_grad(mode):
    """Every mode, relative position bias [H, Nq, Nk] shared over the batch (dBias = batch sum), Nq != Nk."""
    q, k, v, do = _inputs(2, 2, 37, 50, 64, seed=1)
    bias = torch.randn(2, 37, 50, generator=torch.Generator().manual_seed(2))
    check_mode(mode, q, k, v, do, bias=bias)


@cpu_only
@pytest.mark.parametrize("Nq,Nk,D,Dv", [(1, 5, 16, 16), (17, 97, 59, 40), (97, 17, 40, 59)])
@pytest.mark.parametrize("mode", ["fp32-ieee", "fp16"])
def test_awkward_sizes(mode, Nq, Nk, D, Dv):
    """Nq = 1 (one key would make dQ, dK exactly 0), 17, 97 over 16-wide tiles (ragged last tiles), padded head
    dims (59, 40 -> 64), D != Dv."""
    q, k, v, do = _inputs(1, 2, Nq, Nk, D, Dv, seed=Nq)
    check_mode(mode, q, k, v, do, scale=D ** -0.5, config=SMALL)


@cpu_only
@pytest.mark.parametrize("Nq,Nk", [(40, 40), (45, 23), (23, 45)])
@pytest.mark.parametrize("mode", ["fp32-ieee", "bf16"])
def test_causal_mask_fully_masked_rows(mode, Nq, Nk):
    """Causal (top-left, Nq != Nk both ways), bool mask with two fully masked rows: those rows give exactly
    zero dQ and contribute nothing; no NaN anywhere; bias gradient zero on masked entries."""
    q, k, v, do = _inputs(1, 2, Nq, Nk, 32, seed=Nq + Nk)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(Nq, Nk, generator=g) > 0.3
    mask[3] = False
    mask[Nq - 1] = False
    bias = torch.randn(1, 2, Nq, Nk, generator=g)
    dq, dk, dv, db = check_mode(mode, q, k, v, do, bias=bias, mask=mask, causal=True, config=SMALL)
    assert (dq[:, :, 3] == 0).all() and (dq[:, :, Nq - 1] == 0).all()
    assert (db[..., ~mask] == 0).all()


@cpu_only
@pytest.mark.parametrize("bias_shape,splits", [((1, 3, 20, 33), None), ((3, 20, 33), 2), ("expanded", 3),
                                               ((4, 1, 1, 33), None), ((20, 33), 5)])
def test_bias_broadcast_shapes(bias_shape, splits):
    """dBias has the bias's own (un-expanded) shape: batch sum of [1, H, Nq, Nk] / [H, Nq, Nk] in the kernel
    (chunked in 2, 3, 5 partials), a stride-0 expanded [B, H, Nq, Nk] view reduced to [1, H, Nq, Nk], a
    key-padding bias [B, 1, 1, Nk] and a [Nq, Nk] bias shared by every batch and head."""
    B, H, Nq, Nk = 4, 3, 20, 33
    q, k, v, do = _inputs(B, H, Nq, Nk, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    if bias_shape == "expanded":
        bias = torch.randn(H, Nq, Nk, generator=g).expand(B, H, Nq, Nk)
        want = (1, H, Nq, Nk)
    else:
        bias = torch.randn(bias_shape, generator=g)
        want = bias_shape
    assert bias_grad_shape(bias) == tuple(want)
    dtype = torch.float32
    out64, lse, gold = autograd_grads(torch.float64, q, k, v, do, bias)
    dq, dk, dv, db = elsa_backward(q, k, v, out64.to(dtype), do, lse, bias, None, False, 0.125, "fp32-ieee", True,
                                   config=SMALL, bias_splits=splits)
    gold_db = reduce_bias_grad(gold[3], want) if bias_shape == "expanded" else gold[3]
    assert db.shape == tuple(want) and db.dtype == bias.dtype
    assert rel_l2(db, gold_db) <= FP32_TOL
    assert rel_l2(dq, gold[0]) <= FP32_TOL and rel_l2(dk, gold[1]) <= FP32_TOL


@cpu_only
def test_half_bias_dtype_and_unbind_views():
    """timm-style qkv.unbind views (non-contiguous q, k, v), transposed out / grad_out / lse, an fp16 bias
    in fp16 mode: gradients contiguous in the input dtype, dBias in the bias dtype."""
    B, N, H, D = 2, 33, 2, 32
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(B, N, 3, H, D, generator=g).half().permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    assert not q.is_contiguous()
    do = torch.randn(B, N, H, D, generator=g).transpose(1, 2)
    bias = torch.randn(H, N, N, generator=g).half()
    out64, lse, gold = autograd_grads(torch.float64, q, k, v, do, bias, scale=D ** -0.5)
    out = out64.half().transpose(1, 2).contiguous().transpose(1, 2)
    lse_t = lse.transpose(1, 2).contiguous().transpose(1, 2)
    got = elsa_backward(q, k, v, out, do.half(), lse_t, bias, None, False, D ** -0.5, "fp16", True)
    _, _, same = autograd_grads(torch.float16, q, k, v, do, bias, scale=D ** -0.5)
    for x, gd, s in zip(got, gold, same):
        assert x.is_contiguous() and x.dtype == torch.float16
        assert rel_l2(x, gd) <= 2 * rel_l2(s, gd) + 1e-6


@cpu_only
def test_deterministic():
    """Two runs (dBias chunked over the batch, causal, mask) are bit-identical."""
    q, k, v, do = _inputs(3, 2, 30, 30, 16, seed=6)
    bias = torch.randn(2, 30, 30)
    mask = torch.rand(30, 30) > 0.2
    out64, lse, _ = autograd_grads(torch.float64, q, k, v, do, bias, mask, True)
    runs = [elsa_backward(q, k, v, out64.float(), do, lse, bias, mask, True, 0.125, "fp32", True, config=SMALL,
                          bias_splits=2) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@cpu_only
@pytest.mark.parametrize("B,H,Nq,counters", [(1, 1, 97, 13), (2, 3, 200, 37), (1, 2, 64, 0)])
def test_preprocess_zeroes_the_counters_beside_delta(B, H, Nq, counters):
    """The preprocess kernel writes delta = rowsum(dO * O) and the row lse (+inf for -inf) into one Scratch
    allocation and zeroes the Gluon backward's int32 counters there (whatever they held: nothing else zeroes them
    before the kernel that reads them), none past their count; every part starts 128 bytes in (TMA bases need 16,
    and a kernel compiled for one pointer's alignment class runs on later calls' pointers)."""
    from visionattn.kernels.elsa_bwd import Scratch, _preprocess_call

    torch.manual_seed(0)
    D = 40
    q, out, do = (torch.randn(B, H, Nq, D) for _ in range(3))
    lse = torch.randn(B, H, Nq)
    lse[0, 0, 3] = float("-inf")
    layout = Scratch(B * H * Nq, counters, accumulators=5)
    delta, lse_row, sem, acc = layout.allocate("cpu")
    base = delta.data_ptr()
    assert [t.numel() for t in (delta, lse_row, sem, acc)] == [B * H * Nq, B * H * Nq, counters, 5]
    assert sem.dtype == torch.int32 and all((t.data_ptr() - base) % 128 == 0 for t in (lse_row, sem, acc) if t.numel())
    below = torch.full((counters + 9,), -7, dtype=torch.int32)  # counters, then memory past them
    call = _preprocess_call(B, H, Nq, 64, 64, head_max=False, n_zero=counters)
    call(q, out, do, lse, delta, lse_row, *out.stride(), *do.stride(), *lse.stride(), H, Nq, D, q, q, delta,
         *q.stride(), *q.stride(), *q.stride(), 0, D, below, counters)
    assert torch.equal(below[:counters], torch.zeros(counters, dtype=torch.int32))
    assert torch.equal(below[counters:], torch.full((9,), -7, dtype=torch.int32))
    want = (out.double() * do.double()).sum(-1).reshape(-1)
    assert torch.allclose(delta.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(lse_row, torch.where(lse == float("-inf"), float("inf"), lse).reshape(-1))


@cpu_only
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("Nq,Nk,D,Dv,causal", [(40, 40, 32, 32, True), (45, 23, 16, 40, False),
                                               (23, 61, 40, 16, True)])
def test_single_pass_meets_the_bounds(mode, Nq, Nk, D, Dv, causal):
    """The single-pass backward (dQ added in key-tile order by the dK/dV kernel): every mode's bound, causal both
    ways, a bool mask with a fully masked row (its dQ exactly 0), ragged tiles, D != Dv; two runs bit-identical."""
    q, k, v, do = _inputs(2, 2, Nq, Nk, D, Dv, seed=Nq * Nk)
    mask = torch.rand(Nq, Nk, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[5] = False
    got = check_mode(mode, q, k, v, do, mask=mask, causal=causal, scale=D ** -0.5, config=SMALL_SINGLE)
    assert (got[0][:, :, 5] == 0).all()
    dtype = BWD_MODES[mode][0]
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    out64, lse, _ = autograd_grads(torch.float64, qc, kc, vc, do, None, mask, causal, D ** -0.5)
    again = elsa_backward(qc, kc, vc, out64.to(dtype), do.to(dtype), lse, None, mask, causal, D ** -0.5, mode,
                          config=SMALL_SINGLE)
    for a, b in zip(got[:3], again[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("far", [-30.0, -100.0])
def test_rows_whose_every_key_lies_far_below_zero(mode, far):
    """A bias (no gradient asked: the single pass may run) that puts every key of some rows far below zero (lse ~
    far): the keys past Nk of the last key tile (zero rows of K, logit 0 beside them) carry P = exp(-lse), past
    FP32's range from -88; they must add nothing to the single pass's ordered dQ (inf * 0 was NaN there; short of
    it their dS set the row's split scale and rounded the real entries away). Every gradient finite and within
    the mode's bound, single pass and two kernels."""
    q, k, v, do = _inputs(2, 2, 5, 3, 48, seed=3)
    bias = torch.randn(2, 1, 5, 3, generator=torch.Generator().manual_seed(4)) * 4
    bias[:, :, 3:] = far  # rows 3, 4: every key
    bias[:, :, 1, :2] = far
    dtype = BWD_MODES[mode][0]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out64, lse, gold = autograd_grads(torch.float64, q, k, v, do, bias, None, True, 0.35)
    bounds = mode_bounds(mode, gold, lambda: autograd_grads(dtype, q, k, v, do, bias, None, True, 0.35)[2], False)
    for config in (SMALL_SINGLE, SMALL):
        got = elsa_backward(q, k, v, out64.to(dtype), do.to(dtype), lse, bias, None, True, 0.35, mode,
                            config=config)
        assert_gradients(mode, ("dq", "dk", "dv"), got[:3], gold[:3], bounds[:3])


@cpu_only
@pytest.mark.parametrize("single_pass", [True, False])
def test_f16x3_head_equals_f16x3_in_range(single_pass):
    """A power-of-two scale changes no FP16 rounding in FP16's normal range: on N(0, 1) inputs (each head's largest
    entry within a few times every tile column's) the per-head-scaled products give the per-tile ones' gradients
    bit for bit, causal with a mask and a relative position bias included."""
    q, k, v, do = _inputs(2, 2, 37, 45, 32, seed=12)
    mask = torch.rand(37, 45, generator=torch.Generator().manual_seed(5)) > 0.2
    bias = torch.randn(2, 37, 45, generator=torch.Generator().manual_seed(6))
    cfg = BwdConfig(KernelTiles(16, 16, 4, 1, tail=8), KernelTiles(16, 16, 4, 1), single_pass=single_pass)
    tile, head = (check_mode("fp32", q, k, v, do, bias=None if single_pass else bias, mask=mask, causal=True,
                             config=cfg, products=p) for p in ("f16x3", "f16x3-head"))
    for a, b in zip(tile, head):
        assert (a is None and b is None) or torch.equal(a, b)


@cpu_only
@pytest.mark.parametrize("single_pass", [True, False])
@pytest.mark.parametrize("scales", [(1.0, 1.0, 1e6, 1e-8), (1e-4, 3e3, 1.0, 1e4)])
@pytest.mark.parametrize("mode,products", [("tf32", None), ("fp32", "f16x3-head")])
def test_right_operands_scaled_per_head(mode, products, single_pass, scales):
    """tf32's products (and fp32's with products="f16x3-head") scale each right operand by one power of two per
    (batch, head) from the heads' largest magnitudes: q, k, v, dO far outside FP16's range (V up to 10^6 over
    FP16's 65504, dO down to 10^-8 under its 6e-5 normal minimum) still give gradients within the mode's bound,
    and both heads, scaled apart, get their own."""
    q, k, v, do = _inputs(2, 2, 37, 45, 32, seed=11)
    for t, c in zip((q, k, v, do), scales):
        t[1] *= c  # batch entry 1 only: each head gets its own scale
    cfg = BwdConfig(KernelTiles(16, 16, 4, 1, tail=8), KernelTiles(16, 16, 4, 1), single_pass=single_pass)
    got = check_mode(mode, q, k, v, do, config=cfg, products=products)
    assert all(torch.isfinite(g).all() for g in got[:3])


@cpu_only
@pytest.mark.parametrize("single_pass", [True, False])
@pytest.mark.parametrize("Nq,Nk,causal", [(37, 37, False), (37, 37, True), (40, 79, True), (5, 37, False),
                                          (69, 20, True), (50, 69, False)])
def test_tail_tiles(single_pass, Nq, Nk, causal):
    """Narrow tail tiles (32-row tiles, 16-row tails): a last key tile or query tile whose valid rows fit 16 runs
    16 rows tall (37 = 32 + 5 tokens), one that does not (50 = 32 + 18) runs full; causal both ways, a bool mask
    with a fully masked row, a relative position bias with its gradient; the split-FP16 products and FP16 within
    their bounds, and the same gradients with and without the tails."""
    tiles = dict(single_pass=single_pass)
    tail = BwdConfig(KernelTiles(32, 32, 4, 1, tail=16), KernelTiles(32, 32, 4, 1), **tiles)
    plain = BwdConfig(KernelTiles(32, 32, 4, 1), KernelTiles(32, 32, 4, 1), **tiles)
    q, k, v, do = _inputs(1, 2, Nq, Nk, 64, seed=Nq + Nk)
    mask = torch.rand(Nq, Nk, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[min(4, Nq - 1)] = False
    for mode in ("fp32", "fp16"):
        got = check_mode(mode, q, k, v, do, mask=mask, causal=causal, config=tail)
        ref = check_mode(mode, q, k, v, do, mask=mask, causal=causal, config=plain)
        for a, b in zip(got[:3], ref[:3]):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
    bias = torch.randn(2, Nq, Nk, generator=torch.Generator().manual_seed(4))
    check_mode("fp32", q, k, v, do, bias=bias, causal=causal, config=tail)


def _backward_plans(clear: bool = False):
    """The cached backward plans (after emptying the cache when ``clear``)."""
    from visionattn.kernels import elsa_bwd

    if clear:
        elsa_bwd.PLANS.clear()
    return list(elsa_bwd.PLANS.plans.values())


@cpu_only
@pytest.mark.parametrize("Nq,Nk,D,causal,extras", [(37, 37, 64, False, False), (37, 37, 64, True, False),
                                                   (70, 100, 40, True, False), (100, 70, 48, False, True),
                                                   (16, 256, 64, False, False), (256, 33, 40, True, True),
                                                   (257, 257, 64, False, False), (272, 100, 48, True, True),
                                                   (1, 5, 40, False, False), (3, 2, 64, True, False)])
@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_whole_head_backward_meets_the_bounds(mode, Nq, Nk, D, causal, extras):
    """fp16 / bf16 calls of at most HEAD_MAX_ROWS query rows and HEAD_MAX_KEYS keys at head dims padding to
    HEAD_DIM run the whole-head kernel (one program per head, every query row held, key tiles streamed): the mode's
    bound against float64 autograd, Nq != Nk both ways, causal (keys after the last query row get zero rows), padded
    head dims (40, 48), rows past 256 in the 16-row tail tile (257, 272), a bias without its
    gradient and a bool mask with a fully masked row (exactly zero dQ there); bit-identical on a repeat."""
    from visionattn.kernels.elsa_bwd import HEAD_MAX_KEYS, HEAD_MAX_ROWS

    assert Nq <= HEAD_MAX_ROWS and Nk <= HEAD_MAX_KEYS
    q, k, v, do = _inputs(2, 2, Nq, Nk, D, seed=Nq + Nk)
    dtype = BWD_MODES[mode][0]
    mask = bias = None
    if extras:
        g = torch.Generator().manual_seed(1)
        mask = torch.rand(Nq, Nk, generator=g) > 0.3
        mask[5] = False
        bias = torch.randn(2, Nq, Nk, generator=g)
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    out64, lse, gold = autograd_grads(torch.float64, qc, kc, vc, do, bias, mask, causal, D ** -0.5)
    _backward_plans(clear=True)
    run = lambda: elsa_backward(qc, kc, vc, out64.to(dtype), do.to(dtype), lse, bias, mask, causal,  # noqa: E731
                                D ** -0.5, mode)
    got = run()
    assert [p.head is not None for p in _backward_plans()] == [True]
    bounds = mode_bounds(mode, gold[:3], lambda: autograd_grads(dtype, qc, kc, vc, do, bias, mask, causal,
                                                                 D ** -0.5)[2][:3], False)
    assert_gradients(mode, ("dq", "dk", "dv"), got[:3], gold[:3], bounds)
    if extras:
        assert (got[0][:, :, 5] == 0).all()
    for a, b in zip(got[:3], run()[:3]):
        assert torch.equal(a, b)


@cpu_only
@pytest.mark.parametrize("case", ["rows", "keys", "head dim 32", "head dim 65", "bias grad", "gqa", "fp32", "tiles"])
def test_whole_head_backward_scope(case):
    """The whole-head kernel takes fp16 / bf16 calls within HEAD_MAX_ROWS x HEAD_MAX_KEYS at head dims padding to
    HEAD_DIM without a bias gradient, grouped heads or explicit tiles; the two kernels take the rest (gradients within
    2e-2 of the float64 oracle: the path check; the bounds are the other tests')."""
    from visionattn.kernels.elsa_bwd import HEAD_MAX_KEYS, HEAD_MAX_ROWS

    Nq, Nk, D, Hkv, mode, bias, config = 24, 24, 64, 2, "bf16", None, None
    if case == "rows":
        Nq = HEAD_MAX_ROWS + 1
    elif case == "keys":
        Nk = HEAD_MAX_KEYS + 1
    elif case.startswith("head dim"):
        D = int(case.split()[-1])
    elif case == "bias grad":
        bias = torch.randn(2, Nq, Nk)
    elif case == "gqa":
        Hkv = 1
    elif case == "fp32":
        mode = "fp32"
    else:
        config = SMALL
    q, k, v, do = _inputs(1, 2, Nq, Nk, D, seed=4)
    k, v = k[:, :Hkv], v[:, :Hkv]
    dtype = BWD_MODES[mode][0]
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    out, lse, gold = autograd_grads(torch.float64, qc, kc, vc, do, bias, None, False, 0.25)
    _backward_plans(clear=True)
    got = elsa_backward(qc, kc, vc, out.to(dtype), do.to(dtype), lse, bias, None, False, 0.25, mode,
                        bias is not None, config=config)
    assert [p.head is not None for p in _backward_plans()] == [False]
    for x, g in zip(got, gold):
        assert g is None or rel_l2(x, g) < 2e-2


@cpu_only
def test_whole_head_backward_that_fits_no_tiles_warns_once_and_runs_the_two_kernels(monkeypatch):
    """On a GPU whose shared memory takes none of the whole-head kernel's tiles, the plan warns once, runs the
    two kernels (the bound holds) and does not try the whole-head kernel again."""
    from triton.runtime.errors import OutOfResources

    from visionattn.kernels import elsa_bwd

    tried = []

    def no_fit(self, t):
        tried.append(t)

        def call(*args):
            raise OutOfResources(240000, 232448, "shared memory")
        return call

    monkeypatch.setattr(elsa_bwd._BackwardPlan, "_head_call", no_fit)
    monkeypatch.setattr(elsa_bwd, "_HEAD_WARNED", [])
    q, k, v, do = _inputs(1, 2, 30, 30, 64, seed=6)
    _backward_plans(clear=True)
    with pytest.warns(RuntimeWarning, match="whole-head .* two-kernel backward"):
        check_mode("fp16", q, k, v, do, scale=0.25)
    assert tried == elsa_bwd.head_tiles(30)
    check_mode("fp16", q, k, v, do, scale=0.25)  # the same plan: no new attempt
    assert len(tried) == len(elsa_bwd.head_tiles(30))


def test_whole_head_tiles():
    """One query tile covering the rows (at least 64), 8 warps at 256 rows, past 256 a 16-row tail tile after it;
    32-key tiles first, smaller after."""
    from visionattn.kernels.elsa_bwd import HEAD_MAX_ROWS, head_tiles

    for n, m, w, tail in ((1, 64, 4, 0), (64, 64, 4, 0), (65, 128, 4, 0), (197, 256, 8, 0), (256, 256, 8, 0),
                          (257, 256, 8, 16), (HEAD_MAX_ROWS, 256, 8, 16)):
        tiles = head_tiles(n)
        assert {t.block_m for t in tiles} == {m} and {t.num_warps for t in tiles} == {w}
        assert {t.tail for t in tiles} == {tail} and m + tail >= n
        assert tiles[0].block_n == 32 and tiles[-1].block_n == 16
        assert [t.num_stages * t.block_n for t in tiles] == sorted((t.num_stages * t.block_n for t in tiles),
                                                                   reverse=True)
    for n in (0, HEAD_MAX_ROWS + 1):
        with pytest.raises(ValueError, match="n_q"):
            head_tiles(n)


def test_single_pass_is_picked_where_it_measured_faster():
    """Split-FP16 products at head dim 64 up to SINGLE_PASS_MAX_KEYS keys without a bias gradient; the two kernels
    everywhere else."""
    assert get_config("fp32", 64, n_keys=197).single_pass
    assert get_config("tf32", 64, n_keys=SINGLE_PASS_MAX_KEYS).single_pass
    assert not get_config("fp32", 64, n_keys=SINGLE_PASS_MAX_KEYS + 1).single_pass
    assert not get_config("fp32", 64, bias_grad=True, n_keys=197).single_pass
    assert not get_config("fp32", 64).single_pass
    for mode in ("fp32-ieee", "fp16", "bf16"):
        assert not get_config(mode, 64, n_keys=197).single_pass
    assert not get_config("fp32", 128, n_keys=197).single_pass


@cpu_only
def test_the_backward_plan_is_built_once_per_signature(monkeypatch):
    """A second call with the same signature (new tensors) launches from the cached plan with gradients equal to a
    fresh build's; other strides or a bias gradient wanted build another plan."""
    from visionattn.kernels import elsa_bwd
    from visionattn.kernels._launch import PlanCache

    plans = PlanCache()
    monkeypatch.setattr(elsa_bwd, "PLANS", plans)
    bias = torch.randn(2, 20, 24)
    runs = []
    for seed in (7, 8):
        q, k, v, do = _inputs(2, 2, 20, 24, 16, seed=seed)
        out64, lse, gold = autograd_grads(torch.float64, q, k, v, do, bias)
        runs.append((q, k, v, do, out64.float(), lse))
        got = elsa_backward(q, k, v, out64.float(), do, lse, bias, None, False, 0.125, "fp32", True, config=SMALL)
        for x, gd in zip(got, gold):
            assert rel_l2(x, gd) <= FP32_TOL
    assert (plans.builds, plans.hits) == (1, 1)
    q, k, v, do, out, lse = runs[1]
    again = elsa_backward(q, k, v, out, do, lse, bias, None, False, 0.125, "fp32", True, config=SMALL)
    monkeypatch.setattr(elsa_bwd, "PLANS", PlanCache())
    fresh = elsa_backward(q, k, v, out, do, lse, bias, None, False, 0.125, "fp32", True, config=SMALL)
    assert all(torch.equal(a, b) for a, b in zip(again, fresh))
    monkeypatch.setattr(elsa_bwd, "PLANS", plans)
    elsa_backward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, out, do, lse, bias, None, False, 0.125,
                  "fp32", True, config=SMALL)
    elsa_backward(q, k, v, out, do, lse, bias, None, False, 0.125, "fp32", False, config=SMALL)
    assert plans.builds == 3


@cpu_only
@pytest.mark.parametrize("Nq,Nk", [(0, 5), (5, 0), (0, 0)])
def test_empty(Nq, Nk):
    """No queries or no keys: zero / empty gradients of the right shapes, dBias zeros."""
    q, k, v, do = _inputs(1, 2, Nq, Nk, 16, Dv=8)
    lse = torch.full((1, 2, Nq), float("-inf"))
    bias = torch.randn(2, Nq, Nk)
    dq, dk, dv, db = elsa_backward(q, k, v, torch.zeros(1, 2, Nq, 8), do, lse, bias, None, False, 0.25, "fp32",
                                   True)
    assert dq.shape == (1, 2, Nq, 16) and dk.shape == (1, 2, Nk, 16) and dv.shape == (1, 2, Nk, 8)
    assert db.shape == (2, Nq, Nk)
    for t in (dq, dk, dv, db):
        assert (t == 0).all()


@cpu_only
def test_errors_name_the_argument():
    q, k, v, do = _inputs(1, 1, 4, 4, 16)
    lse = torch.zeros(1, 1, 4)
    args = lambda **kw: {**dict(q=q, k=k, v=v, out=do, grad_out=do, lse=lse, bias=None, attn_mask=None,  # noqa: E731
                                is_causal=False, scale=0.25, mode="fp32"), **kw}
    with pytest.raises(ValueError, match="mode"):
        elsa_backward(**args(mode="fp64"))
    with pytest.raises(TypeError, match="q has dtype"):
        elsa_backward(**args(mode="fp16"))
    with pytest.raises(TypeError, match="lse"):
        elsa_backward(**args(lse=lse.double()))
    with pytest.raises(ValueError, match="lse"):
        elsa_backward(**args(lse=torch.zeros(1, 1, 5)))
    with pytest.raises(ValueError, match="grad_out"):
        elsa_backward(**args(grad_out=do[..., :8]))
    with pytest.raises(TypeError, match="attn_mask"):
        elsa_backward(**args(attn_mask=torch.ones(4, 4)))
    with pytest.raises(ValueError, match="bias"):
        elsa_backward(**args(bias=torch.zeros(3, 4)))
    with pytest.raises(ValueError, match="bias_requires_grad"):
        elsa_backward(**args(), bias_requires_grad=True)
    with pytest.raises(ValueError, match="products='tf32'"):
        elsa_backward(**args(), products="tf32")
    with pytest.raises(ValueError, match="head dim"):
        big = torch.zeros(1, 1, 4, 320)
        elsa_backward(**args(q=big, k=big, v=big, out=big, grad_out=big))


@cpu_only
@pytest.mark.parametrize("entry", ["dense", "window", "varlen"])
def test_a_float64_grad_out_is_rounded_once_to_the_compute_dtype(entry):
    """A float64 grad_out in bf16 gives the gradients of that gradient rounded to bfloat16 first, bit for bit and
    finite (the GPU kernels round it once; the interpreter's own float64 -> bfloat16 cast gave NaN gradients)."""
    from visionattn.kernels import varlen_bwd, window_bwd

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g).bfloat16() for _ in range(3))
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.25
    out = torch.softmax(s, -1) @ v.double()
    lse = torch.logsumexp(s, -1).float()
    grad_out = torch.randn(1, 2, 24, 16, generator=g, dtype=torch.float64)

    def grads(do):
        if entry == "dense":
            return elsa_backward(q, k, v, out, do, lse, None, None, False, 0.25, "bf16")[:3]
        if entry == "window":
            return window_bwd.window_backward(q, k, v, out, do, lse, None, None, 1, 0.25, "bf16")[:3]
        cu = torch.tensor([0, 24], dtype=torch.int32)
        packed = lambda t: t[0].transpose(0, 1)  # noqa: E731  [N, H, D]
        return varlen_bwd.varlen_backward(packed(q), packed(k), packed(v), packed(out), packed(do), lse[0], cu, cu,
                                          24, 24, False, 0.25, "bf16")

    wide, rounded = grads(grad_out), grads(grad_out.bfloat16())
    for a, b in zip(wide, rounded):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_reduce_bias_grad():
    g = torch.arange(24.0).reshape(2, 3, 2, 2)
    assert torch.equal(reduce_bias_grad(g, (3, 2, 2)), g.sum(0))
    assert torch.equal(reduce_bias_grad(g, (2, 1, 2, 2)), g.sum(1, keepdim=True))
    assert torch.equal(reduce_bias_grad(g, (2, 3, 2, 2)), g)
    with pytest.raises(ValueError, match="reduced"):
        reduce_bias_grad(g, (5, 2, 2))


# --------------------------------------------------------------------------- GPU (real sizes)

@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,H,N,D", [(8, 12, 197, 64), (2, 4, 1025, 128), (1, 2, 4096, 64)])
def test_gpu_shapes(mode, B, H, N, D):
    """ViT-B/16 224 (197 tokens, a relative position bias shared over the batch), a ragged 1025, 4096."""
    q, k, v, do = _inputs(B, H, N, N, D, seed=N, device="cuda")
    bias = torch.randn(H, N, N, device="cuda") if N <= 1025 else None
    check_mode(mode, q, k, v, do, bias=bias, scale=D ** -0.5, chunk=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_long_causal_mask(mode):
    """N = 16384 (one head), and a causal + masked 3000 x 5000 call with fully masked rows."""
    q, k, v, do = _inputs(1, 1, 16384, 16384, 64, seed=1, device="cuda")
    check_mode(mode, q, k, v, do, chunk=1024)
    q, k, v, do = _inputs(2, 2, 3000, 5000, 64, seed=2, device="cuda")
    mask = torch.rand(3000, 5000, device="cuda") > 0.5
    mask[7] = False
    dq = check_mode(mode, q, k, v, do, mask=mask, causal=True, chunk=1024)[0]
    assert (dq[:, :, 7] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_single_pass(mode):
    """The single-pass backward at ViT-B/16 224 (the default there for split-FP16 products) and forced at 4096
    keys (64 key tiles waiting in turn per query tile): the mode's bound, bit-identical over repeated runs."""
    for (B, H, N), tiles in (((16, 12, 197), None), ((1, 4, 4096), KernelTiles(32, 64, 4, 2))):
        q, k, v, do = _inputs(B, H, N, N, 64, seed=N, device="cuda")
        cfg = None if tiles is None else BwdConfig(tiles, tiles, single_pass=True)
        got = check_mode(mode, q, k, v, do, scale=0.125, config=cfg, chunk=1024)
        dtype = BWD_MODES[mode][0]
        qc, kc, vc = (t.to(dtype) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, scale=0.125)
        lse = torch.logsumexp((qc.float() @ kc.float().transpose(-1, -2)) * 0.125, -1)
        runs = [elsa_backward(qc, kc, vc, out, do.to(dtype), lse, None, None, False, 0.125, mode, config=cfg)
                for _ in range(3)]
        for r in runs[1:]:
            for a, b in zip(runs[0][:3], r[:3]):
                assert torch.equal(a, b)
        assert got[0].shape == (B, H, N, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,N,D", [(16, 12, 197, 64), (8, 12, 197, 64), (2, 4, 1025, 128), (1, 2, 4096, 64),
                                     (1, 1, 16384, 64)])
def test_gpu_f16x3_head_products(B, H, N, D):
    """fp32 with products="f16x3-head" (right operands scaled per head) at real sizes: ViT-B/16 224 on the single
    pass and, with a relative position bias and its gradient, on the two kernels; 1025 at head dim 128; 4096;
    16384: the fp32 bound."""
    q, k, v, do = _inputs(B, H, N, N, D, seed=N + B, device="cuda")
    bias = torch.randn(H, N, N, device="cuda") if B == 8 else None
    check_mode("fp32", q, k, v, do, bias=bias, scale=D ** -0.5, chunk=1024, products="f16x3-head")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp16", "bf16"])
@pytest.mark.parametrize("B,H,Nq,Nk,causal,extras", [(64, 12, 197, 197, False, False), (256, 16, 64, 64, False, False),
                                                     (8, 12, 145, 231, True, True), (4, 6, 256, 17, False, True),
                                                     (32, 16, 257, 257, False, False), (4, 4, 272, 261, True, True)])
def test_gpu_whole_head_backward(mode, B, H, Nq, Nk, causal, extras):
    """The whole-head kernel at ViT-B/16 224 (64 x 12 heads of 197 tokens), 64-token heads, causal with a bias and
    a mask (one fully masked row: zero dQ), few keys, ViT-L/14 224 (257 tokens: the 16-row tail tile), 272 rows:
    the mode's bound, bit-identical over repeated runs, and the plan did run it."""
    q, k, v, do = _inputs(B, H, Nq, Nk, 64, seed=Nq + Nk, device="cuda")
    dtype = BWD_MODES[mode][0]
    mask = bias = None
    if extras:
        mask = torch.rand(Nq, Nk, device="cuda") > 0.3
        mask[5] = False
        bias = torch.randn(H, Nq, Nk, device="cuda")
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    out64, lse, gold = autograd_grads(torch.float64, qc, kc, vc, do, bias, mask, causal, 0.125)
    _backward_plans(clear=True)
    runs = [elsa_backward(qc, kc, vc, out64.to(dtype), do.to(dtype), lse, bias, mask, causal, 0.125, mode)
            for _ in range(3)]
    assert [p.head is not None for p in _backward_plans()] == [True]
    bounds = mode_bounds(mode, gold[:3], lambda: autograd_grads(dtype, qc, kc, vc, do, bias, mask, causal,
                                                                 0.125)[2][:3], True)
    assert_gradients(mode, ("dq", "dk", "dv"), runs[0][:3], gold[:3], bounds)
    if extras:
        assert (runs[0][0][:, :, 5] == 0).all()
    for r in runs[1:]:
        for a, b in zip(runs[0][:3], r[:3]):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_deterministic_bias_grad():
    """Bit-identical gradients over repeated runs with the batch-chunked dBias reduction (ViT-sized)."""
    q, k, v, do = _inputs(64, 12, 197, 197, 64, seed=3, device="cuda")
    bias = torch.randn(12, 197, 197, device="cuda")
    out = torch.randn(64, 12, 197, 64, device="cuda")
    lse = torch.logsumexp((q @ k.transpose(-1, -2)) * 0.125 + bias, -1)
    runs = [elsa_backward(q, k, v, out, do, lse, bias, None, False, 0.125, "fp32", True) for _ in range(3)]
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a, b)
    assert math.isfinite(float(runs[0][3].abs().sum()))


def test_gluon_backward_fallback_on_first_failure_only(monkeypatch):
    """A backward plan's Gluon launch that fails on its first call is dropped with one warning naming the kernel
    (the plan then runs the Triton kernels); its results pass through; a failure after it once ran is raised."""
    import types

    from visionattn.kernels import elsa_bwd, elsa_fwd

    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    run = elsa_bwd._BackwardPlan._run_gluon

    def broken(*args):
        raise RuntimeError("cannot build")

    plan = types.SimpleNamespace(half_gluon=broken, gluon_ran=set())
    with pytest.warns(RuntimeWarning, match="half backward.*cannot build"):
        assert run(plan, "half_gluon", elsa_bwd._GLUON_HALF_BWD, 1, 2) == (False, None)
    assert plan.half_gluon is None and elsa_bwd._GLUON_HALF_BWD in elsa_fwd._GLUON_FAILED

    calls = []
    plan = types.SimpleNamespace(gluon=lambda *args: calls.append(args) or "dq", gluon_ran=set())
    assert run(plan, "gluon", elsa_bwd._GLUON_BWD, 3, 4) == (True, "dq") and calls == [(3, 4)]
    plan.gluon = broken  # ran once: a later failure is the caller's error, not a build problem
    with pytest.raises(RuntimeError, match="cannot build"):
        run(plan, "gluon", elsa_bwd._GLUON_BWD)
    assert plan.gluon is broken and elsa_bwd._GLUON_BWD not in elsa_fwd._GLUON_FAILED


@cpu_only
@pytest.mark.parametrize("mode", ["tf32", "fp32"])
@pytest.mark.parametrize("n", [40, 300])
def test_scaled_gluon_launch_failing_on_its_first_call_falls_back_to_the_triton_kernels(n, mode, monkeypatch):
    """A tf32 / fp32 plan whose Gluon launch fails on its first call (a Triton whose Gluon cannot build it) warns
    once, under its mode's own key, and runs the Triton kernels on the heads' magnitudes its preprocess already
    found: the bits of a plan without the Gluon launch, single pass (40 keys) and two kernels (300)."""
    from visionattn.kernels import elsa_bwd, elsa_fwd

    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    q, k, v, do = _inputs(1, 2, n, n, 64, seed=n)
    out64, lse, _ = autograd_grads(torch.float64, q, k, v, do, None, None, False, 0.125)
    out = out64.float()
    args = (q, k, v, out, do, lse, None, None, None, None, False, mode, False, False, None, None, None)
    want = elsa_bwd._BackwardPlan(*args)(q, k, v, out, do, lse, None, None, None, None, 0.125)
    plan = elsa_bwd._BackwardPlan(*args)
    assert plan.scaled_gluon is None and plan.single_pass == (n == 40)

    def broken(*a):
        raise RuntimeError("cannot build")

    plan.scaled_gluon = broken
    with pytest.warns(RuntimeWarning, match=f"{mode} backward.*cannot build"):
        got = plan(q, k, v, out, do, lse, None, None, None, None, 0.125)
    key = elsa_bwd._GLUON_TF32_BWD if mode == "tf32" else elsa_bwd._GLUON_FP32_BWD
    assert plan.scaled_gluon is None and plan.scaled_key == key and set(elsa_fwd._GLUON_FAILED) == {key}
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
