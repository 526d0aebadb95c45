"""Ragged (varlen) backward kernels against per-sequence float64 autograd.

CPU: the kernels run in the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py) at small shapes with
16-wide tiles, so sequences span several tiles and end inside one; ``gpu``: the supplement's ragged batch. The
oracle is autograd through :func:`visionattn.reference.oracle_attention` (float64) per sequence on the inputs
rounded to the mode's compute dtype, loss ``(out * grad_out).sum()``; the kernels get the oracle's output and
log-sum-exp, as tests/kernels/test_elsa_bwd.py does for the dense kernels. FP32 modes: rel L2 <= 1e-5 on dQ, dK
and dV; fp16 / bf16 and tf32: at most 2x the error of the same attention written in PyTorch in that precision
and differentiated by autograd (tf32 on the CPU, which has no TF32 matmuls: the mode's contract).
"""
import pytest
import torch

import visionattn
from visionattn import ops  # noqa: F401  (registers the custom ops)
from visionattn.kernels.elsa_bwd import BWD_MODES, BwdConfig, KernelTiles
from visionattn.kernels.varlen_bwd import varlen_backward
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention
from visionattn.varlen import varlen_attention

from grad_checks import FP32_TOL, assert_gradients, mode_bounds

MODES = list(BWD_MODES)
SMALL = BwdConfig(KernelTiles(16, 16, 4, 1), KernelTiles(16, 16, 4, 1))
# 0 queries with keys, keys without queries' partner (0 keys), length 1, Nq != Nk both ways, several tiles
LENS_Q = [5, 0, 17, 1, 40, 3, 2]
LENS_K = [7, 3, 0, 1, 33, 50, 2]
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; the gpu tests cover CUDA")


def offsets(lens, device="cpu"):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def packed(lens_q, lens_k, h=2, d=16, dv=None, seed=0, device="cpu"):
    """q [total_q, H, D], k / v [total_k, H, D|Dv], grad_out [total_q, H, Dv] of N(0, 1), and the offsets."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    tq, tk = sum(lens_q), sum(lens_k)
    ts = [torch.randn(n, h, c, generator=g).to(device) for n, c in ((tq, d), (tk, d), (tk, dv), (tq, dv))]
    return (*ts, offsets(lens_q, device), offsets(lens_k, device))


def _torch_attention(q, k, v, causal, scale):
    """softmax(scale q k^T) v written in PyTorch in the inputs' dtype, P rounded to v's dtype ([1, H, n, D])."""
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s.float(), -1).to(v.dtype) @ v


def per_sequence_grads(q, k, v, do, cu_q, cu_k, causal, scale, dtype=torch.float64):
    """(out, lse [H, total_q], [dq, dk, dv]) by autograd per sequence: float64 = the oracle
    (:func:`oracle_attention`), else :func:`_torch_attention` in ``dtype``. Rows of sequences without keys: out 0,
    lse -inf, dq 0; keys of sequences without queries: dk = dv = 0."""
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    loss = 0.0
    for s in range(len(bq) - 1):
        q0, q1, k0, k1 = bq[s], bq[s + 1], bk[s], bk[s + 1]
        if q1 == q0 or k1 == k0:
            continue
        view = lambda t, a, b: t[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731  [1, H, n, D]
        qs, ks, vs = view(qd, q0, q1), view(kd, k0, k1), view(vd, k0, k1)
        if dtype == torch.float64:
            y = oracle_attention(qs, ks, vs, is_causal=causal, scale=scale)
            sc = (qs @ ks.transpose(-1, -2)).detach() * scale
            if causal:
                sc = sc.masked_fill(~torch.ones(sc.shape[-2:], dtype=torch.bool, device=sc.device).tril(),
                                    float("-inf"))
            lse[:, q0:q1] = torch.logsumexp(sc, -1)[0].float()
        else:
            y = _torch_attention(qs, ks, vs, causal, scale)
        loss = loss + (y.double() * view(do, q0, q1).double()).sum()
        out[q0:q1] = y[0].transpose(0, 1).detach().double()
    if torch.is_tensor(loss):
        loss.backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (qd, kd, vd)]
    return out, lse, grads


def check_mode(mode, q, k, v, do, cu_q, cu_k, causal=False, scale=0.25, config=SMALL):
    """Run the kernels on the oracle's output and lse; assert the mode's bound on dQ, dK, dV. Returns them."""
    dtype = BWD_MODES[mode][0]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out64, lse, gold = per_sequence_grads(q, k, v, do, cu_q, cu_k, causal, scale)
    mq, mk = int(torch.diff(cu_q).max()), int(torch.diff(cu_k).max())
    got = varlen_backward(q, k, v, out64.to(dtype), do.to(dtype), lse, cu_q, cu_k, mq, mk, causal, scale, mode,
                          config=config)
    bounds = mode_bounds(mode, gold, lambda: per_sequence_grads(q, k, v, do, cu_q, cu_k, causal, scale, dtype)[2],
                         q.is_cuda)
    names = ("dq", "dk", "dv")
    assert_gradients(mode, names, got, gold, bounds)
    for name, x in zip(names, got):
        assert x.dtype == dtype and x.is_contiguous(), name
    return got


# --------------------------------------------------------------------------- CPU (interpreter)

@cpu_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_modes_ragged_lengths(mode, causal):
    """Every mode, causal or not: lengths 0 (no queries; no keys), 1, Nq != Nk both ways, D != Dv; rows of a
    sequence without keys get exactly zero dQ, keys of a sequence without queries exactly zero dK / dV."""
    q, k, v, do, cu_q, cu_k = packed(LENS_Q, LENS_K, dv=24, seed=1)
    dq, dk, dv = check_mode(mode, q, k, v, do, cu_q, cu_k, causal)
    assert (dq[cu_q[2]:cu_q[3]] == 0).all()
    assert (dk[cu_k[1]:cu_k[2]] == 0).all() and (dv[cu_k[1]:cu_k[2]] == 0).all()


@cpu_only
@pytest.mark.parametrize("mode", ["fp32-ieee", "bf16"])
def test_padded_head_dims_default_tiles_and_loose_maxima(mode):
    """Head dims 40 / 59 (padded to 64), the default tile config, maxima above the longest sequence (more
    early-exiting programs), the dense kernels' per-sequence result as a second reference."""
    lens_q, lens_k = [9, 70, 1], [33, 12, 65]
    q, k, v, do, cu_q, cu_k = packed(lens_q, lens_k, h=3, d=40, dv=59, seed=2)
    dtype = BWD_MODES[mode][0]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out64, lse, gold = per_sequence_grads(q, k, v, do, cu_q, cu_k, True, 40 ** -0.5)
    got = varlen_backward(q, k, v, out64.to(dtype), do.to(dtype), lse, cu_q, cu_k, 100, 90, True, 40 ** -0.5, mode)
    _, _, same = per_sequence_grads(q, k, v, do, cu_q, cu_k, True, 40 ** -0.5, dtype)
    for x, g, s in zip(got, gold, same):
        bound = FP32_TOL if dtype == torch.float32 else 2 * rel_l2(s, g) + 1e-6
        assert rel_l2(x, g) <= bound


@cpu_only
@pytest.mark.parametrize("scales", [(1.0, 1.0, 1e6, 1e-8), (1e-4, 3e3, 1.0, 1e4)])
def test_tf32_right_operands_scaled_per_head(scales):
    """tf32's products scale each right operand by one power of two per head over the whole packed batch: q, k,
    v, dO of head 1 far outside FP16's range (V up to 10^6 over its 65504, dO down to 10^-8 under its 6e-5
    normal minimum), and in head 0 one sequence's q and v 10^3 times the others' (its k and dO 10^-3: the
    logits stay as they are), keep the mode's bound."""
    q, k, v, do, cu_q, cu_k = packed(LENS_Q, LENS_K, dv=24, seed=4)
    for t, c in zip((q, k, v, do), scales):
        t[:, 1] *= c
    for t, cu, c in ((q, cu_q, 1e3), (k, cu_k, 1e-3), (v, cu_k, 1e3), (do, cu_q, 1e-3)):
        t[cu[4]:cu[5], 0] *= c  # the longest sequence
    dq, dk, dv = check_mode("tf32", q, k, v, do, cu_q, cu_k, True)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@cpu_only
@pytest.mark.parametrize("mode", ["tf32", "fp32"])
def test_wide_query_head_dim(mode):
    """A query / key head dim past 128 (160, padded to 256) beside a value head dim of 32: the preprocess then runs
    32-row programs, as the dense backward's (elsa_bwd.preprocess_launch, whichever head dim passes 128), and its
    per-head maxima of q and k read the wide tiles; the gradients keep the mode's bound."""
    q, k, v, do, cu_q, cu_k = packed([5, 40, 1], [33, 12, 7], d=160, dv=32, seed=5)
    check_mode(mode, q, k, v, do, cu_q, cu_k, False, 160 ** -0.5)


@cpu_only
def test_deterministic():
    """Two runs are bit-identical (no atomics: each gradient row has one writer, fixed loop order)."""
    q, k, v, do, cu_q, cu_k = packed(LENS_Q, LENS_K, seed=3)
    out64, lse, _ = per_sequence_grads(q, k, v, do, cu_q, cu_k, True, 0.25)
    runs = [varlen_backward(q, k, v, out64.float(), do, lse, cu_q, cu_k, 40, 50, True, 0.25, "fp32", config=SMALL)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@cpu_only
@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_autograd_through_varlen_attention(mode):
    """The public function records the varlen backward: gradients match per-sequence float64 autograd within
    the mode's bound, and the per-sequence dense kernels' gradients (visionattn.attention) closely; float32
    inputs in fp16 mode get float32 gradients."""
    q, k, v, do, cu_q, cu_k = packed(LENS_Q, LENS_K, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu_q, cu_k, mode=mode, is_causal=True, backend="triton")
    grads = torch.autograd.grad(out, leaves, do)
    dtype = BWD_MODES[mode][0]
    qc, kc, vc = (t.to(dtype) for t in (q, k, v))
    _, _, gold = per_sequence_grads(qc, kc, vc, do, cu_q, cu_k, True, 0.25)
    _, _, same = per_sequence_grads(qc, kc, vc, do, cu_q, cu_k, True, 0.25, dtype)
    dense_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bq, bk = cu_q.tolist(), cu_k.tolist()
    loss = 0.0
    for s in range(len(LENS_Q)):
        if LENS_Q[s] == 0 or LENS_K[s] == 0:
            continue
        view = lambda t, a, b: t[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
        y = visionattn.attention(view(dense_leaves[0], bq[s], bq[s + 1]), view(dense_leaves[1], bk[s], bk[s + 1]),
                                 view(dense_leaves[2], bk[s], bk[s + 1]), mode=mode, is_causal=True,
                                 backend="triton")
        loss = loss + (y * view(do, bq[s], bq[s + 1])).sum()
    dense = torch.autograd.grad(loss, dense_leaves)
    for x, g, s, d in zip(grads, gold, same, dense):
        assert x.dtype == torch.float32
        bound = FP32_TOL if dtype == torch.float32 else 2 * rel_l2(s, g) + 1e-6
        assert rel_l2(x, g) <= bound
        assert rel_l2(x, d) <= bound


@cpu_only
def test_jagged_nested_input_gets_gradients():
    """Jagged nested q / k / v ([B, j, H, D]): the gradients reach the nested leaves' values."""
    lens = [4, 19, 1]
    g = torch.Generator().manual_seed(5)
    vals = torch.randn(sum(lens), 2, 16, generator=g)
    cu = offsets(lens)
    leaf = vals.clone().requires_grad_()
    nq = torch.nested.nested_tensor_from_jagged(leaf, cu.long())
    out = varlen_attention(nq, nq, nq, backend="triton")
    do = torch.randn(out.values().shape, generator=g)
    (dvals,) = torch.autograd.grad((out.values() * do).sum(), leaf)
    _, _, gold = per_sequence_grads(vals, vals, vals, do, cu, cu, False, 0.25)
    assert rel_l2(dvals, gold[0] + gold[1] + gold[2]) <= FP32_TOL


@cpu_only
def test_empty_calls_and_errors():
    """Empty batches give zero gradients without a launch; bad arguments are named."""
    q, k, v, do, cu_q, cu_k = packed([0, 0], [0, 4])
    lse = torch.empty(2, 0)
    dq, dk, dv = varlen_backward(q, k, v, do, do, lse, cu_q, cu_k, 0, 4, False, 0.25, "fp32")
    assert dq.shape == (0, 2, 16) and (dk == 0).all() and (dv == 0).all()
    q, k, v, do, cu_q, cu_k = packed([3], [5])
    lse = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mode"):
        varlen_backward(q, k, v, do, do, lse, cu_q, cu_k, 3, 5, False, 0.25, "pasa")
    with pytest.raises(TypeError, match="q has dtype"):
        varlen_backward(q.half(), k, v, do, do, lse, cu_q, cu_k, 3, 5, False, 0.25, "fp32")
    with pytest.raises(ValueError, match="lse"):
        varlen_backward(q, k, v, do, do, lse.t(), cu_q, cu_k, 3, 5, False, 0.25, "fp32")
    with pytest.raises(ValueError, match="grad_out"):
        varlen_backward(q, k, v, do, do[:2], lse, cu_q, cu_k, 3, 5, False, 0.25, "fp32")
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        varlen_backward(q, k, v, do, do, lse, cu_q, cu_k.long(), 3, 5, False, 0.25, "fp32")


@cpu_only
def test_custom_ops_pass_opcheck():
    """Schema and fake (meta) implementations of the varlen LSE forward and backward ops; the LSE op's
    registered autograd formula."""
    q, k, v, do, cu_q, cu_k = packed([5, 0, 17], [7, 3, 20])
    checks = ("test_schema", "test_faketensor")
    args = (q, k, v, cu_q, cu_k, 17, 20, True, 0.25, "fp32", None)
    torch.library.opcheck(torch.ops.visionattn.varlen_attention_lse.default, args, test_utils=checks)
    out, lse = torch.ops.visionattn.varlen_attention_lse(*args)
    torch.library.opcheck(torch.ops.visionattn.varlen_attention_backward.default,
                          (q, k, v, out, lse, do, cu_q, cu_k, 17, 20, True, 0.25, "fp32"), test_utils=checks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.visionattn.varlen_attention_lse.default, (*leaves, *args[3:]),
                          test_utils=("test_autograd_registration",))
    out_op, _ = torch.ops.visionattn.varlen_attention_lse(*leaves, *args[3:])
    grads_op = torch.autograd.grad(out_op, leaves, do)
    grads_eager = torch.autograd.grad(varlen_attention(*leaves, cu_q, cu_k, 17, 20, scale=0.25, is_causal=True,
                                                       backend="triton"), leaves, do)
    for a, b in zip(grads_op, grads_eager):
        assert torch.equal(a, b)


@cpu_only
def test_compiled_lse_op_trains_like_eager():
    """``torch.compile(fullgraph=True)`` (AOT autograd, eager backend: no C++ toolchain needed) of a function
    calling ``visionattn::varlen_attention_lse``: the forward and its registered backward op trace as opaque
    nodes, and the gradients equal the eager autograd Function's, bit for bit."""
    torch._dynamo.reset()
    q, k, v, do, cu_q, cu_k = packed([5, 0, 17], [7, 3, 20], seed=9)

    def f(q, k, v):
        return torch.ops.visionattn.varlen_attention_lse(q, k, v, cu_q, cu_k, 17, 20, False, 0.25, "fp16",
                                                         torch.float32)[0]

    leaves = [t.half().requires_grad_() for t in (q, k, v)]
    compiled = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves), leaves, do)
    eager = torch.autograd.grad(ops.varlen(*leaves, cu_q, cu_k, 17, 20, False, 0.25, "fp16", torch.float32, True),
                                leaves, do)
    for a, b in zip(compiled, eager):
        assert a.dtype == torch.float16 and torch.equal(a, b)


# --------------------------------------------------------------------------- GPU

SUPPLEMENT_LENS = [785, 500, 708, 542, 1732, 262, 1039, 557]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_supplement_batch(mode, causal):
    """The supplement's ragged batch (8 sequences, H = 16, D = 64), default tiles, every mode."""
    q, k, v, do, cu_q, cu_k = packed(SUPPLEMENT_LENS, SUPPLEMENT_LENS, h=16, d=64, seed=6, device="cuda")
    check_mode(mode, q, k, v, do, cu_q, cu_k, causal, scale=64 ** -0.5, config=None)


@pytest.mark.gpu
def test_gpu_end_to_end_deterministic_and_ragged_keys():
    """varlen_attention + backward on CUDA twice, bit-identical, Nq != Nk and a zero-length sequence; close to
    the float64 oracle."""
    lens_q, lens_k = [785, 0, 1, 300, 1732], [500, 10, 0, 1732, 1039]
    q, k, v, do, cu_q, cu_k = packed(lens_q, lens_k, h=16, d=64, seed=7, device="cuda")
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, cu_q, cu_k, max(lens_q), max(lens_k))
        runs.append(torch.autograd.grad(out, leaves, do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    _, _, gold = per_sequence_grads(q, k, v, do, cu_q, cu_k, False, 64 ** -0.5)
    for x, g in zip(runs[0], gold):
        assert rel_l2(x, g) <= 2e-5  # the forward's fp32 output and lse feed the backward here
