"""Hostile inputs to the public API (:func:`visionattn.attention`, :func:`visionattn.attention_qkvpacked`,
:func:`visionattn.window_attention`, :func:`visionattn.window_attention_qkvpacked`,
:func:`visionattn.varlen_attention`): each case either raises a ``TypeError`` / ``ValueError`` whose message names
the argument (and the fix where there is one), never a raw error from deep inside, or returns the correct result,
checked against an independent reference (the float64 oracle, float64 autograd).

Every error case runs on both backends after a valid call of the same shapes (which leaves a cached runner in
``CALLS`` on the kernel path) and is then called twice: the signature caches must never let a bad call through.
"""
import math
import warnings

import numpy as np
import pytest
import torch

import visionattn as va
from visionattn import dispatch
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention
from window_oracle import expanded_window_oracle

BACKENDS = ["reference", "triton"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Every test here starts from no one-time warning given (so it sees its own) and leaves the process's record
    as it found it (so the warnings other modules' tests expect still come)."""
    monkeypatch.setattr(dispatch, "_warned", set())


def dense_inputs(b=2, h=2, nq=5, nk=7, d=8, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, nq, d, generator=g).to(dtype), torch.randn(b, h, nk, d, generator=g).to(dtype),
            torch.randn(b, h, nk, dv or d, generator=g).to(dtype))


def window_inputs(bw=4, h=2, n=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(bw, n, 3, h, d, generator=g).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v, torch.randn(h, n, n, generator=g), torch.log(torch.rand(h, 1, 1, generator=g) * 20 + 5)


def raises_twice(call, exc, match):
    for _ in range(2):
        with pytest.raises(exc, match=match):
            call()


def meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


# ----------------------------------------------------------------------------- attention: errors
# name -> (make(q, k, v) -> (args, kwargs) of va.attention, exception, message pattern)
DENSE_ERRORS = {
    # meta tensors: a shape without data
    "meta query/key/value": (lambda q, k, v: ((meta(q), meta(k), meta(v)), {}), ValueError,
                             r"query is a meta tensor \(a shape without data.*and so are key, value\)"),
    "meta q/k/v and bias": (lambda q, k, v: ((meta(q), meta(k), meta(v)), {"bias": meta(q[0, 0, :, :7])}),
                            ValueError, r"query is a meta tensor.*and so are key, value, bias\)"),
    "meta key only": (lambda q, k, v: ((q, meta(k), v), {}), ValueError,
                      r"one device, got query on cpu, key on meta.*shape without data"),
    "meta bias": (lambda q, k, v: ((q, k, v), {"bias": torch.empty(5, 7, device="meta")}), ValueError,
                  r"one device.*bias on meta"),
    "meta attn_mask": (lambda q, k, v: ((q, k, v), {"attn_mask": torch.empty(5, 7, dtype=torch.bool, device="meta")}),
                       ValueError, r"one device.*attn_mask on meta"),
    # numpy arrays, lists: TypeError naming the argument and the conversion
    "numpy bool attn_mask": (lambda q, k, v: ((q, k, v), {"attn_mask": np.ones((5, 7), dtype=bool)}), TypeError,
                             r"attn_mask must be a torch.Tensor or None, got ndarray; pass a torch.bool tensor.*"
                             r"torch.from_numpy"),
    "numpy bias": (lambda q, k, v: ((q, k, v), {"bias": np.zeros((5, 7), dtype=np.float32)}), TypeError,
                   r"bias must be a torch.Tensor or None, got ndarray.*torch.from_numpy"),
    "list attn_mask": (lambda q, k, v: ((q, k, v), {"attn_mask": [[True] * 7] * 5}), TypeError,
                       r"attn_mask must be a torch.Tensor or None, got list"),
    "numpy query": (lambda q, k, v: ((q.numpy(), k, v), {}), TypeError, r"query must be a torch.Tensor"),
    # sparse / nested layouts
    "sparse query": (lambda q, k, v: ((q.to_sparse(), k, v), {}), TypeError,
                     r"query is a torch.sparse_coo tensor.*query.to_dense\(\)"),
    "sparse value": (lambda q, k, v: ((q, k, v.to_sparse()), {}), TypeError, r"value is a torch.sparse_coo tensor"),
    "sparse bias": (lambda q, k, v: ((q, k, v), {"bias": torch.randn(5, 7).to_sparse()}), TypeError,
                    r"bias is a torch.sparse_coo tensor.*bias.to_dense\(\)"),
    "sparse attn_mask": (lambda q, k, v: ((q, k, v), {"attn_mask": (torch.randn(5, 7) > 0).to_sparse()}), TypeError,
                         r"attn_mask is a torch.sparse_coo tensor"),
    "sparse csr bias": (lambda q, k, v: ((q, k, v), {"bias": torch.randn(5, 7).to_sparse_csr()}), TypeError,
                        r"bias is a torch.sparse_csr tensor"),
    "nested query": (lambda q, k, v: ((torch.nested.nested_tensor([q[0], q[1]], layout=torch.jagged), k, v), {}),
                     TypeError, r"query is a nested tensor.*varlen_attention"),
    # dtypes and shapes
    "query float, key half": (lambda q, k, v: ((q, k.half(), v), {}), TypeError, r"share one dtype"),
    "complex query": (lambda q, k, v: ((q.to(torch.complex64), k, v), {}), TypeError, r"query has dtype"),
    "int key": (lambda q, k, v: ((q, k.long(), v), {}), TypeError, r"key has dtype torch.int64"),
    "query/key head_dim mismatch": (lambda q, k, v: ((q, k[..., :4], v), {}), ValueError, r"head_dim mismatch"),
    "head_dim 0": (lambda q, k, v: ((q[..., :0], k[..., :0], v), {}), ValueError, r"head_dim 0"),
    "value rows differ": (lambda q, k, v: ((q, k, v[:, :, :3]), {}), ValueError, r"value has 3"),
    "3-D query": (lambda q, k, v: ((q[0], k, v), {}), ValueError, r"query must have 4 dims"),
    "bias of wrong shape": (lambda q, k, v: ((q, k, v), {"bias": torch.zeros(5, 6)}), ValueError,
                            r"bias has shape \(5, 6\), not broadcastable to \[B, H, Nq, Nk\] = \[2, 2, 5, 7\]"),
    "bias of 5 dims": (lambda q, k, v: ((q, k, v), {"bias": torch.zeros(1, 2, 2, 5, 7)}), ValueError,
                       r"bias has shape.*at most 4 dims"),
    "int bias": (lambda q, k, v: ((q, k, v), {"bias": torch.zeros(5, 7, dtype=torch.int32)}), TypeError,
                 r"bias must be a floating tensor"),
    "float attn_mask": (lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(5, 7)}), TypeError,
                        r"attn_mask must be torch.bool.*pass additive float masks as bias"),
    "int attn_mask": (lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(5, 7, dtype=torch.uint8)}), TypeError,
                      r"attn_mask must be torch.bool"),
    "attn_mask of wrong shape": (lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(2, 7, dtype=torch.bool)}),
                                 ValueError, r"attn_mask has shape \(2, 7\)"),
    # flags
    "is_causal int": (lambda q, k, v: ((q, k, v), {"is_causal": 1}), TypeError, r"is_causal must be a bool"),
    "is_causal str": (lambda q, k, v: ((q, k, v), {"is_causal": "yes"}), TypeError, r"is_causal must be a bool"),
    "is_causal None": (lambda q, k, v: ((q, k, v), {"is_causal": None}), TypeError, r"is_causal must be a bool"),
    "is_causal numpy bool": (lambda q, k, v: ((q, k, v), {"is_causal": np.bool_(True)}), TypeError,
                             r"is_causal must be a bool"),
    "is_causal tensor": (lambda q, k, v: ((q, k, v), {"is_causal": torch.tensor(True)}), TypeError,
                         r"is_causal must be a bool"),
    "scale nan": (lambda q, k, v: ((q, k, v), {"scale": float("nan")}), ValueError, r"scale=nan; expected a finite"),
    "scale inf": (lambda q, k, v: ((q, k, v), {"scale": float("inf")}), ValueError, r"scale=inf; expected a finite"),
    "scale -inf": (lambda q, k, v: ((q, k, v), {"scale": -math.inf}), ValueError, r"expected a finite number"),
    "scale str": (lambda q, k, v: ((q, k, v), {"scale": "0.5"}), TypeError, r"scale must be a real number"),
    "scale complex": (lambda q, k, v: ((q, k, v), {"scale": 1j}), TypeError, r"scale must be a real number"),
    "scale bool": (lambda q, k, v: ((q, k, v), {"scale": True}), TypeError, r"scale must be a real number"),
    "scale of two elements": (lambda q, k, v: ((q, k, v), {"scale": torch.ones(2)}), TypeError,
                              r"scale must be a real number, got a tensor of shape \(2,\)"),
    "scale nan tensor": (lambda q, k, v: ((q, k, v), {"scale": torch.tensor(float("nan"))}), ValueError,
                         r"expected a finite number"),
    "scale meta tensor": (lambda q, k, v: ((q, k, v), {"scale": torch.empty((), device="meta")}), ValueError,
                          r"scale is a meta tensor"),
    "mode unknown": (lambda q, k, v: ((q, k, v), {"mode": "fp8"}), ValueError, r"mode='fp8' is not a visionattn mode"),
    "mode None": (lambda q, k, v: ((q, k, v), {"mode": None}), ValueError, r"mode=None is not a visionattn mode"),
    "mode int": (lambda q, k, v: ((q, k, v), {"mode": 16}), ValueError, r"mode=16 is not a visionattn mode"),
    "mode upper case": (lambda q, k, v: ((q, k, v), {"mode": "FP16"}), ValueError, r"mode='FP16' is not"),
    "num_splits 0": (lambda q, k, v: ((q, k, v), {"num_splits": 0}), ValueError, r"num_splits=0; expected a positive"),
    "num_splits -1": (lambda q, k, v: ((q, k, v), {"num_splits": -1}), ValueError, r"num_splits=-1"),
    "num_splits bool": (lambda q, k, v: ((q, k, v), {"num_splits": True}), ValueError, r"num_splits=True"),
    "num_splits float": (lambda q, k, v: ((q, k, v), {"num_splits": 2.0}), ValueError, r"num_splits=2.0"),
    "backend unknown": (lambda q, k, v: ((q, k, v), {"backend": "gpu"}), ValueError,
                        r"backend='gpu' is not known"),
    "fp16 mode, values beyond float16": (lambda q, k, v: ((q * 1e5, k, v), {"mode": "fp16"}), ValueError,
                                         r"query has values beyond float16's range"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(DENSE_ERRORS))
def test_attention_refuses_hostile_input_naming_the_argument(case, backend):
    make, exc, match = DENSE_ERRORS[case]
    q, k, v = dense_inputs()
    va.attention(q, k, v, backend=backend)  # a valid call of these shapes first (a cached runner on the kernels)
    args, kw = make(q, k, v)
    raises_twice(lambda: va.attention(*args, **{"backend": backend, **kw}), exc, match)


def test_attention_refuses_a_tensor_scale_that_needs_a_gradient():
    q, k, v = dense_inputs()
    raises_twice(lambda: va.attention(q, k, v, scale=torch.tensor(0.5, requires_grad=True)), ValueError,
                 r"scale is a tensor that requires grad.*multiply q by it")


# name -> (make(qkv) -> (args, kwargs) of va.attention_qkvpacked, exception, message pattern)
PACKED_ERRORS = {
    "qkv not a tensor": (lambda qkv: ((qkv.numpy(),), {}), TypeError, r"qkv must be a torch.Tensor"),
    "qkv of 4 dims": (lambda qkv: ((qkv[0],), {}), ValueError, r"qkv must be \[B, N, 3, H, D\]"),
    "qkv of 2 stacked": (lambda qkv: ((qkv[:, :, :2],), {}), ValueError, r"qkv must be \[B, N, 3, H, D\]"),
    "sparse qkv": (lambda qkv: ((qkv.to_sparse(),), {}), TypeError, r"qkv is a torch.sparse_coo tensor"),
    "meta qkv": (lambda qkv: ((qkv.to("meta"),), {}), ValueError, r"query is a meta tensor \(a shape without data"),
    "numpy attn_mask": (lambda qkv: ((qkv,), {"attn_mask": np.ones((5, 5), dtype=bool)}), TypeError,
                        r"attn_mask must be a torch.Tensor or None, got ndarray"),
    "is_causal str": (lambda qkv: ((qkv,), {"is_causal": "no"}), TypeError, r"is_causal must be a bool"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("case", list(PACKED_ERRORS))
def test_attention_qkvpacked_refuses_hostile_input(case, grad, backend):
    make, exc, match = PACKED_ERRORS[case]
    qkv = torch.randn(2, 5, 3, 2, 8)
    if grad:
        qkv.requires_grad_()
    va.attention_qkvpacked(qkv, backend=backend)  # a valid call of this signature first
    args, kw = make(qkv.detach() if "numpy" in case or "not a tensor" in case else qkv)
    raises_twice(lambda: va.attention_qkvpacked(*args, **{"backend": backend, **kw}), exc, match)


# ----------------------------------------------------------------------------- attention: correct results
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fp32", "bf16", "pasa"])
def test_no_keys_give_zeros_and_zero_gradients(mode, backend):
    """Nk = 0: every row is fully masked, so zeros (not NaN), and a backward of zero gradients for q, k, v and the
    bias, on the reference path as on the kernels (the output stays in the autograd graph)."""
    q, k, v = dense_inputs(nk=0)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bias = torch.randn(5, 1, requires_grad=True)  # broadcast over the (absent) keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # pasa's gradients: the reference, warned
        for _ in range(2):
            for t in (q, k, v, bias):
                t.grad = None
            out = va.attention(q, k, v, bias=bias, mode=mode, backend=backend)
            assert out.shape == (2, 2, 5, 8) and out.dtype == q.dtype and torch.equal(out, torch.zeros_like(out))
            out.square().sum().backward()
            for t in (q, k, v, bias):
                assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", [((0, 2, 5, 8), (0, 2, 7, 8)), ((2, 2, 0, 8), (2, 2, 7, 8)),
                                    ((2, 0, 5, 8), (2, 0, 7, 8))], ids=["B=0", "Nq=0", "H=0"])
def test_empty_inputs_give_empty_outputs(shapes, backend):
    """As SDPA: an empty batch (or no queries, or no heads) gives an empty output of the right shape, and gradients
    of the inputs' shapes."""
    qs, ks = shapes
    q, k, v = (torch.randn(s, requires_grad=True) for s in (qs, ks, ks))
    out = va.attention(q, k, v, backend=backend)
    assert out.shape == qs and out.numel() == 0
    out.sum().backward()
    assert q.grad.shape == qs and k.grad.shape == ks and v.grad.shape == ks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["entry", "row"])
def test_non_finite_bias_behaves_like_sdpa(value, where, backend):
    """NaN / +inf in the bias make exactly the rows SDPA (float64) makes NaN (a +inf logit is inf - inf); a -inf
    row is fully masked (zeros here, where SDPA gives NaN); every finite row matches the oracle."""
    q, k, v = dense_inputs()
    bias = torch.zeros(5, 7)
    if where == "entry":
        bias[1, 2] = value
    else:
        bias[3] = value
    out = va.attention(q, k, v, bias=bias, backend=backend)
    gold = oracle_attention(q, k, v, bias=bias)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    assert torch.equal(out.isnan(), gold.isnan())
    if value != float("-inf") or where == "entry":
        assert torch.equal(out.isnan(), sdpa.isnan())
    else:
        assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    finite = ~gold.isnan()
    assert rel_l2(out[finite], gold[finite]) <= 2e-6


def test_head_dims_beyond_the_kernels_warn_and_stay_exact(fresh_warnings):
    q, k, v = dense_inputs(d=300, dv=272)
    with pytest.warns(RuntimeWarning, match="do not cover this call.*running the exact PyTorch monoid reference"):
        out = va.attention(q, k, v, backend="triton")
    assert rel_l2(out, oracle_attention(q, k, v)) <= 2e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_strides_give_the_oracle(backend):
    """A query broadcast over the batch (stride 0), keys transposed in memory (head dim not of unit stride), values
    sliced with a step, a bias broadcast as [H, 1, Nk]: read as they lie (or copied once) and exact."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 5, 8, generator=g).expand(3, 2, 5, 8)
    k = torch.randn(3, 2, 8, 7, generator=g).transpose(-1, -2)
    v = torch.randn(3, 2, 14, 8, generator=g)[:, :, ::2]
    bias = torch.randn(2, 1, 7, generator=g)
    assert q.stride(0) == 0 and k.stride(-1) != 1 and v.stride(2) == 16
    for _ in range(2):
        out = va.attention(q, k, v, bias=bias, backend=backend)
        assert rel_l2(out, oracle_attention(q, k, v, bias=bias)) <= 2e-6


def test_float64_inputs_on_the_kernels_meet_the_fp32_contract():
    q, k, v = dense_inputs(dtype=torch.float64)
    out = va.attention(q, k, v, backend="triton")
    assert out.dtype == torch.float64 and rel_l2(out, oracle_attention(q, k, v)) <= va.MODES["fp32"].rel_tol


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_torch_func_grad_runs_the_reference_and_matches_float64_autograd(mode, fresh_warnings):
    """``torch.func.grad`` on the kernel backend: the kernels' autograd functions have no functorch rules, so the
    call runs the differentiable reference (warned once, naming why) and the gradients of q and of the bias are
    float64 autograd's within the mode's contract; twice, the second call silent."""
    q, k, v = dense_inputs()
    bias = torch.randn(5, 7)

    def loss(q, bias):
        return va.attention(q, k, v, bias=bias, mode=mode, backend="triton").square().sum()

    with pytest.warns(RuntimeWarning, match="torch.func transform.*no functorch rules"):
        dq, db = torch.func.grad(loss, argnums=(0, 1))(q, bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        dq2, _ = torch.func.grad(loss, argnums=(0, 1))(q, bias)
    q64, b64 = q.double().requires_grad_(), bias.double().requires_grad_()
    oracle_attention(q64, k, v, bias=b64).square().sum().backward()
    tol = 2 * va.MODES[mode].rel_tol + (4e-3 if mode == "bf16" else 0)  # bf16: its inputs are rounded too
    assert rel_l2(dq, q64.grad) <= tol and rel_l2(db, b64.grad) <= tol
    assert torch.equal(dq, dq2)


def test_torch_func_vmap_and_jvp_give_the_oracle(fresh_warnings):
    q, k, v = dense_inputs()
    qs = torch.stack([q, 2 * q, -q])
    with pytest.warns(RuntimeWarning, match="torch.func transform"):
        out = torch.func.vmap(lambda x: va.attention(x, k, v, backend="triton"))(qs)
    for i in range(3):
        assert rel_l2(out[i], oracle_attention(qs[i], k, v)) <= 2e-6
    t = torch.randn_like(q)
    _, tangent = torch.func.jvp(lambda x: va.attention(x, k, v, backend="triton"), (q,), (t,))
    _, gold = torch.func.jvp(lambda x: oracle_attention(x, k, v), (q.double(),), (t.double(),))
    assert rel_l2(tangent, gold) <= 1e-5


def test_vmap_in_a_float16_mode_keeps_the_overflow_check(fresh_warnings):
    """Under vmap the float16 range check reads the batched values (a batched tensor cannot be one bool)."""
    q, k, v = dense_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = torch.func.vmap(lambda x: va.attention(x, k, v, mode="fp16", backend="triton"))(torch.stack([q, q]))
        assert rel_l2(out[1], oracle_attention(q, k, v)) <= va.MODES["fp16"].rel_tol
        with pytest.raises(ValueError, match="float16's range"):
            torch.func.vmap(lambda x: va.attention(x, k, v, mode="fp16", backend="triton"))(torch.stack([q, q * 1e5]))


@pytest.mark.parametrize("grad", [False, True])
def test_jit_trace_records_the_kernels_as_ops(grad):
    """``torch.jit.trace`` of a call on the kernels: the traced graph holds the ``visionattn`` custom op (a direct
    launch would leave the traced output unwritten) and gives the oracle on new inputs, also after a cached runner
    for the same signature exists."""
    q, k, v = dense_inputs()
    va.attention(q, k, v, backend="triton")  # a cached runner for this signature

    def f(q, k, v):
        return va.attention(q, k, v, scale=0.3, backend="triton")

    with torch.set_grad_enabled(grad):
        traced = torch.jit.trace(f, (q.requires_grad_(grad), k, v), check_trace=False)
    assert "visionattn::attention" in str(traced.graph)
    q2, k2, v2 = dense_inputs(seed=9)
    assert rel_l2(traced(q2, k2, v2), oracle_attention(q2, k2, v2, scale=0.3)) <= 2e-6


# ----------------------------------------------------------------------------- window_attention: errors
def _w(**kw):
    return kw


# name -> (make(q, k, v, bias, ls) -> (args, kwargs) of va.window_attention, exception, message pattern)
WINDOW_ERRORS = {
    "num_windows 0": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=0)), ValueError,
                      r"num_windows=0; expected a positive int"),
    "num_windows bool": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=True)), ValueError, r"num_windows=True"),
    "num_windows float": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2.0)), ValueError, r"num_windows=2.0"),
    "num_windows not dividing": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=3)), ValueError,
                                 r"num_windows=3 does not divide the window batch B\*nW=4"),
    "meta query/key/value": (lambda q, k, v, b, ls: ((meta(q), meta(k), meta(v)), _w(num_windows=2)), ValueError,
                             r"query is a meta tensor \(a shape without data.*and so are key, value\)"),
    "meta bias": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, relative_position_bias=meta(b))), ValueError,
                  r"one device.*relative_position_bias on meta"),
    "sparse query": (lambda q, k, v, b, ls: ((q.to_sparse(), k, v), _w(num_windows=2)), TypeError,
                     r"query is a torch.sparse_coo tensor"),
    "sparse bias": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, relative_position_bias=b.to_sparse())),
                    TypeError, r"relative_position_bias is a torch.sparse_coo tensor"),
    "sparse shift_mask": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2,
                                                                 shift_mask=torch.zeros(2, 16, 16).to_sparse())),
                          TypeError, r"shift_mask is a torch.sparse_coo tensor"),
    "numpy shift_mask": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, shift_mask=np.ones((2, 16, 16), bool))),
                         TypeError, r"shift_mask must be a torch.Tensor or None, got ndarray.*torch.from_numpy"),
    "nested query": (lambda q, k, v, b, ls: ((torch.nested.nested_tensor(list(q), layout=torch.jagged), k, v),
                                             _w(num_windows=2)), TypeError, r"query is a nested tensor"),
    "bias for another window size": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2,
                                                                          relative_position_bias=b[:, :9, :9])),
                                     ValueError, r"relative_position_bias has shape \(2, 9, 9\); expected "
                                                 r"\[H, N, N\] = \[2, 16, 16\]"),
    "int bias": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, relative_position_bias=b.long())), TypeError,
                 r"relative_position_bias must be a float tensor"),
    "shift_mask of other windows": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2,
                                                                         shift_mask=torch.zeros(4, 16, 16))),
                                    ValueError, r"shift_mask has shape \(4, 16, 16\); expected \[nW, N, N\]"),
    "int shift_mask": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2,
                                                             shift_mask=torch.zeros(2, 16, 16, dtype=torch.int32))),
                       TypeError, r"shift_mask must be an additive float mask"),
    "logit_scale of wrong shape": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, cosine=True,
                                                                        logit_scale=torch.zeros(3, 1, 1))),
                                   ValueError, r"logit_scale must be a float tensor with H=2 elements"),
    "int logit_scale": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, cosine=True,
                                                              logit_scale=torch.zeros(2, 1, 1, dtype=torch.int64))),
                        TypeError, r"logit_scale must be a float tensor"),
    "logit_scale without cosine": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, logit_scale=ls)), ValueError,
                                   r"logit_scale is only used with cosine=True"),
    "cosine without logit_scale": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, cosine=True)), ValueError,
                                   r"cosine=True \(Swin-v2\) needs logit_scale"),
    "cosine str": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, cosine="no", logit_scale=ls)), TypeError,
                   r"cosine must be a bool, got str"),
    "cosine int": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, cosine=1, logit_scale=ls)), TypeError,
                   r"cosine must be a bool"),
    "key of another window size": (lambda q, k, v, b, ls: ((q, k[:, :, :9], v), _w(num_windows=2)), ValueError,
                                   r"key shape .* must equal query shape"),
    "head_dim 0": (lambda q, k, v, b, ls: ((q[..., :0], k[..., :0], v), _w(num_windows=2)), ValueError,
                   r"head_dim 0"),
    "mixed dtypes": (lambda q, k, v, b, ls: ((q, k.half(), v), _w(num_windows=2)), TypeError, r"share one dtype"),
    "scale nan": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, scale=float("nan"))), ValueError,
                  r"expected a finite number"),
    "mode None": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, mode=None)), ValueError,
                  r"mode=None is not a visionattn mode"),
    "backend unknown": (lambda q, k, v, b, ls: ((q, k, v), _w(num_windows=2, backend="cuda")), ValueError,
                        r"backend='cuda' is not known"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(WINDOW_ERRORS))
def test_window_attention_refuses_hostile_input_naming_the_argument(case, backend):
    make, exc, match = WINDOW_ERRORS[case]
    q, k, v, bias, ls = window_inputs()
    va.window_attention(q, k, v, relative_position_bias=bias, num_windows=2, backend=backend)  # cached runner
    args, kw = make(q, k, v, bias, ls)
    raises_twice(lambda: va.window_attention(*args, **{"backend": backend, **kw}), exc, match)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_attention_qkvpacked_refuses_hostile_input(backend):
    qkv = torch.randn(4, 16, 3, 2, 8, requires_grad=True)
    va.window_attention_qkvpacked(qkv, num_windows=2, backend=backend)
    raises_twice(lambda: va.window_attention_qkvpacked(qkv.detach().to_sparse(), num_windows=2, backend=backend),
                 TypeError, r"qkv is a torch.sparse_coo tensor")
    raises_twice(lambda: va.window_attention_qkvpacked(qkv, num_windows=0, backend=backend), ValueError,
                 r"num_windows=0")
    raises_twice(lambda: va.window_attention_qkvpacked(qkv[:, :, :2], num_windows=2, backend=backend), ValueError,
                 r"qkv must be \[B\*nW, N, 3, H, D\]")


# ----------------------------------------------------------------------------- window_attention: correct results
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fp32", "fp16", "pasa"])
@pytest.mark.parametrize("cosine", [False, True])
@pytest.mark.parametrize("shape,nw", [((0, 2, 16, 8), 4), ((4, 2, 0, 8), 2), ((4, 0, 16, 8), 2)],
                         ids=["no windows", "no tokens", "no heads"])
def test_empty_windows_give_empty_outputs_and_zero_gradients(shape, nw, cosine, mode, backend):
    """B*nW = 0 or N = 0: an empty output of the right shape (as SDPA for an empty batch) and zero gradients for q,
    k, v, the bias and ``logit_scale``, unpacked and packed; ``num_windows`` itself must still be >= 1."""
    BW, H, N, D = shape
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    bias = torch.randn(H, N, N, requires_grad=True)
    ls = torch.randn(H, 1, 1, requires_grad=True) if cosine else None
    kw = dict(relative_position_bias=bias, shift_mask=torch.zeros(nw, N, N), num_windows=nw, cosine=cosine,
              logit_scale=ls, mode=mode, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # pasa's gradients: the reference, warned
        out = va.window_attention(q, k, v, **kw)
        assert out.shape == shape and out.dtype == q.dtype
        out.sum().backward()
        for t in (q, k, v, bias, ls):
            if t is not None:
                assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()
        qkv = torch.randn(BW, N, 3, H, D, requires_grad=True)
        out = va.window_attention_qkvpacked(qkv, **kw)
        assert out.shape == (BW, N, H, D)
        out.sum().backward()
        assert qkv.grad.shape == qkv.shape and not qkv.grad.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_window_bias_behaves_like_the_oracle(value, backend):
    q, k, v, bias, _ = window_inputs(seed=2)
    bias[1, 2, 3] = value
    out = va.window_attention(q, k, v, relative_position_bias=bias, num_windows=2, backend=backend)
    gold = expanded_window_oracle(q, k, v, bias, None, 2, scale=8 ** -0.5)
    assert torch.equal(out.isnan(), gold.isnan()) and out.isnan().any() == (value != float("-inf"))
    finite = ~gold.isnan()
    assert rel_l2(out[finite], gold[finite]) <= 2e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bool_shift_mask_equals_its_additive_form(backend):
    """A bool shift mask (True = attend) is taken as the 0 / -inf mask, after a float-mask call of the same shapes,
    with a fully masked row giving zeros."""
    q, k, v, bias, _ = window_inputs(seed=3)
    keep = torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[1, 5] = False
    additive = torch.zeros(2, 16, 16).masked_fill(~keep, float("-inf"))
    kw = dict(relative_position_bias=bias, num_windows=2, backend=backend)
    for _ in range(2):
        a = va.window_attention(q, k, v, shift_mask=additive, **kw)
        b = va.window_attention(q, k, v, shift_mask=keep, **kw)
        assert torch.equal(a, b) and not b[1::2, :, 5].any()
        assert rel_l2(b, expanded_window_oracle(q, k, v, bias, additive, 2, scale=8 ** -0.5)) <= 2e-6


def test_torch_func_grad_through_window_attention_matches_float64_autograd(fresh_warnings):
    q, k, v, bias, ls = window_inputs(seed=4)

    def loss(q, ls):
        return va.window_attention(q, k, v, relative_position_bias=bias, num_windows=2, cosine=True, logit_scale=ls,
                                   backend="triton").square().sum()

    with pytest.warns(RuntimeWarning, match="window_attention: a torch.func transform"):
        dq, dls = torch.func.grad(loss, argnums=(0, 1))(q, ls)
    q64, ls64 = q.double().requires_grad_(), ls.double().requires_grad_()
    expanded_window_oracle(q64, k, v, bias, None, 2, True, ls64).square().sum().backward()
    assert rel_l2(dq, q64.grad) <= 1e-5 and rel_l2(dls, ls64.grad) <= 1e-5


# ----------------------------------------------------------------------------- varlen_attention
_CU = torch.tensor([0, 3, 8], dtype=torch.int32)

# name -> (make(q) -> (args, kwargs) of va.varlen_attention, exception, message pattern)
VARLEN_ERRORS = {
    "cu_seqlens int64": (lambda q: ((q, q, q, _CU.long(), _CU), {}), TypeError,
                         r"cu_seqlens_q has dtype torch.int64; expected torch.int32"),
    "cu_seqlens decreasing": (lambda q: ((q, q, q, torch.tensor([0, 6, 3, 8], dtype=torch.int32),
                                          torch.tensor([0, 2, 3, 8], dtype=torch.int32)), {}), ValueError,
                              r"cu_seqlens_q must be non-decreasing"),
    "cu_seqlens not from 0": (lambda q: ((q, q, q, _CU + 1, _CU), {}), ValueError,
                              r"cu_seqlens_q\[0\] = 1; offsets must start at 0"),
    "cu_seqlens short of the total": (lambda q: ((q, q, q, _CU, torch.tensor([0, 3, 7], dtype=torch.int32)), {}),
                                      ValueError, r"cu_seqlens_k\[-1\] = 7, but the packed tensor has 8 rows"),
    "cu_seqlens 2-D": (lambda q: ((q, q, q, _CU[None], _CU), {}), ValueError, r"cu_seqlens_q must be 1-D"),
    "cu_seqlens numpy": (lambda q: ((q, q, q, _CU.numpy(), _CU), {}), TypeError,
                         r"cu_seqlens_q must be a torch.Tensor of int32 offsets, got ndarray"),
    "cu_seqlens sparse": (lambda q: ((q, q, q, _CU, _CU.to_sparse()), {}), TypeError,
                          r"cu_seqlens_k is a torch.sparse_coo tensor"),
    "sequence counts differ": (lambda q: ((q, q, q, _CU, torch.tensor([0, 8], dtype=torch.int32)), {}), ValueError,
                               r"cu_seqlens_q describes 2 sequences, cu_seqlens_k 1"),
    "max_seqlen too small": (lambda q: ((q, q, q, _CU, _CU, 4, 5), {}), ValueError,
                             r"max_seqlen_q=4 is below the longest sequence \(5 rows\)"),
    "max_seqlen float": (lambda q: ((q, q, q, _CU, _CU, 5, 5.0), {}), TypeError, r"max_seqlen_k must be an int"),
    "max_seqlen bool": (lambda q: ((q, q, q, _CU, _CU, True, 5), {}), TypeError, r"max_seqlen_q must be an int"),
    "meta packed tensors": (lambda q: ((meta(q), meta(q), meta(q), _CU.to("meta"), _CU.to("meta")), {}), ValueError,
                            r"q is a meta tensor \(a shape without data.*so are k, v\)"),
    "sparse packed q": (lambda q: ((q.to_sparse(), q, q, _CU, _CU), {}), TypeError, r"q is a torch.sparse_coo"),
    "4-D packed q": (lambda q: ((q[None], q, q, _CU, _CU), {}), ValueError, r"q must have 3 dims"),
    "pasa mode": (lambda q: ((q, q, q, _CU, _CU), {"mode": "pasa"}), ValueError, r"mode='pasa' has no varlen path"),
    "is_causal int": (lambda q: ((q, q, q, _CU, _CU), {"is_causal": 1}), TypeError, r"is_causal must be a bool"),
    "offsets missing": (lambda q: ((q, q, q), {}), ValueError, r"cu_seqlens_q and cu_seqlens_k are required"),
    "meta sequence list": (lambda q: (([meta(q[:3])], [meta(q[:3])], [meta(q[:3])]), {}), ValueError,
                           r"q\[0\] is a meta tensor.*so are k\[0\], v\[0\]"),
    "sparse sequence": (lambda q: (([q[:3].to_sparse()], [q[:3]], [q[:3]]), {}), TypeError,
                        r"q\[0\] is a torch.sparse_coo tensor"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(VARLEN_ERRORS))
def test_varlen_attention_refuses_hostile_input_naming_the_argument(case, backend):
    make, exc, match = VARLEN_ERRORS[case]
    q = torch.randn(8, 2, 8)
    va.varlen_attention(q, q, q, _CU, _CU, backend=backend)
    va.varlen_attention([q[:3]], [q[:3]], [q[:3]], backend=backend)
    args, kw = make(q)
    raises_twice(lambda: va.varlen_attention(*args, **{"backend": backend, **kw}), exc, match)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_under_torch_func_grad_matches_float64_autograd(backend, fresh_warnings):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(8, 2, 8, generator=g) for _ in range(3))

    def loss(q):
        return va.varlen_attention(q, k, v, _CU, _CU, backend=backend).square().sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dq = torch.func.grad(loss)(q)
    q64 = q.double().requires_grad_()
    total = 0
    for a, b in ((0, 3), (3, 8)):
        view = lambda t: t[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
        total = total + oracle_attention(view(q64), view(k), view(v)).square().sum()
    total.backward()
    assert rel_l2(dq, q64.grad) <= 1e-5
