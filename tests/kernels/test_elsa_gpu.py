"""GPU tests of the dense ELSA kernels at real sizes (run with ``pytest -m gpu`` on an H100/H200).

Every output is compared with the float64 oracle (:func:`visionattn.reference.oracle_attention`)
against the mode's contract (:mod:`visionattn.modes`). For long sequences the oracle runs
on a random subsample of query rows (causality expressed as an explicit mask for those rows).
"""
import pytest
import torch

import visionattn
from visionattn.kernels.elsa_fwd import DENSE_MODES, choose_num_splits, elsa_attention, get_config
from visionattn.metrics import rel_l2
from visionattn.modes import get_mode
from visionattn.reference import oracle_attention

pytestmark = pytest.mark.gpu

MODES = list(DENSE_MODES)


def _qkv(B, H, Nq, Nk, D, dtype, seed=0, Dv=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n, d: torch.randn(B, H, n, d, device="cuda", generator=g).to(dtype)  # noqa: E731
    return mk(Nq, D), mk(Nk, D), mk(Nk, Dv or D)


def _oracle_rows(q, k, v, rows, *, bias=None, mask=None, causal=False, scale=None):
    """Float64 oracle for the query rows ``rows`` only; bias/mask are [B, H, Nq, Nk] views."""
    qs = q[:, :, rows]
    m = None if mask is None else mask[:, :, rows]
    if causal:
        cm = torch.arange(k.shape[2], device=q.device)[None, :] <= rows[:, None]
        m = cm if m is None else (m & cm)
    b = None if bias is None else bias[:, :, rows]
    return oracle_attention(qs, k, v, bias=b, attn_mask=m, scale=scale)


@pytest.mark.parametrize("precision,tol", [("tf32x3", 2e-6), ("tf32", 3e-3), ("f16x3", 2e-6), ("f16x1", 3e-3)])
@pytest.mark.parametrize("scales", [(1.0, 1.0, 1.0), (1e-3, 1e3, 1e-3), (1e6, 1e-6, 1e6), (1e4, 1e4, 1.0)])
def test_fp32_product_precisions(precision, tol, scales):
    """Every FP32 product precision meets its contract at N=16384, also with q, k, v far outside
    FP16's range (the split-FP16 precisions scale by powers of two). (1e4, 1e4, 1): logits ~1e9,
    one-hot rows; TF32-class products cannot resolve those, so only the FP32-accurate ones run it.
    (Uniform q = k scaled down alone is not tested: the mean of 16384 random V rows cancels to
    ~1e-2 of |v|, and FP32 summation error alone is ~2e-6 of that, in every FP32 method.)"""
    from visionattn.kernels.elsa_fwd import _launch

    if tol > 1e-5 and scales[0] * scales[1] > 1.0:
        pytest.skip("TF32-class products cannot resolve logits of ~1e9")
    q, k, v = (t * s for t, s in zip(_qkv(1, 4, 16384, 16384, 64, torch.float32, seed=3), scales))
    y = _launch(q, k, v, None, None, False, 0.125, "fp32", 0, precision=precision)
    rows = torch.randperm(16384, device="cuda")[:128]
    err = rel_l2(y[:, :, rows], _oracle_rows(q, k, v, rows, scale=0.125))
    assert torch.isfinite(y).all()
    assert err <= tol, f"{precision} scales {scales}: rel err {err:.3e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("N,D", [(4096, 64), (65536, 64), (8192, 128)])
def test_long_sequences(mode, N, D):
    dtype = get_mode(mode).compute_dtype
    q, k, v = _qkv(1, 4 if N > 8192 else 8, N, N, D, dtype)
    y = elsa_attention(q, k, v, None, None, False, D ** -0.5, mode)
    rows = torch.randperm(N, device="cuda")[:128]
    err = rel_l2(y[:, :, rows], _oracle_rows(q, k, v, rows))
    assert torch.isfinite(y).all()
    assert err <= get_mode(mode).rel_tol, f"{mode} N={N} D={D}: rel err {err:.3e}"


@pytest.mark.parametrize("mode", MODES)
def test_bias_mask_causal(mode):
    """Broadcast bias [H, Nq, Nk], bool mask [Nq, Nk] and causal at an awkward size (N=1041, D=80)."""
    dtype = get_mode(mode).compute_dtype
    B, H, Nq, Nk, D = 2, 3, 1041, 1041, 80
    q, k, v = _qkv(B, H, Nq, Nk, D, dtype, seed=1)
    bias = torch.randn(H, Nq, Nk, device="cuda")
    mask = torch.rand(Nq, Nk, device="cuda") > 0.2
    mask[5] = False  # one fully masked row -> zeros
    for causal in (False, True):
        y = visionattn.attention(q, k, v, bias=bias, attn_mask=mask, is_causal=causal, mode=mode, backend="triton")
        ref = oracle_attention(q, k, v, bias=bias, attn_mask=mask, is_causal=causal)
        assert torch.isfinite(y).all()
        assert (y[:, :, 5] == 0).all()
        err = rel_l2(y, ref)
        assert err <= get_mode(mode).rel_tol, f"{mode} causal={causal}: rel err {err:.3e}"


@pytest.mark.parametrize("mode", MODES)
def test_vit_shape_unbind_views(mode):
    """timm ViT-B/16 attention: B=64, H=12, N=197, D=64 from qkv.unbind (non-contiguous, no copy)."""
    dtype = get_mode(mode).compute_dtype
    B, N, H, D = 64, 197, 12, 64
    qkv = torch.randn(B, N, 3, H, D, device="cuda").to(dtype).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    assert not q.is_contiguous()
    y = elsa_attention(q, k, v, None, None, False, D ** -0.5, mode)
    err = rel_l2(y, oracle_attention(q, k, v))
    assert err <= get_mode(mode).rel_tol, f"{mode}: rel err {err:.3e}"


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 7])
def test_split_kv(mode, num_splits):
    """Few query rows, long KV (the split-KV regime); forced and automatic partition counts."""
    dtype = get_mode(mode).compute_dtype
    q, k, v = _qkv(1, 2, 50, 20000, 128, dtype, seed=2, Dv=64)
    bias = torch.randn(1, 1, 50, 20000, device="cuda", dtype=torch.float16)
    for causal in (False, True):
        y = elsa_attention(q, k, v, bias.expand(1, 2, 50, 20000), None, causal, 0.1, mode, num_splits)
        ref = oracle_attention(q, k, v, bias=bias, is_causal=causal, scale=0.1)
        err = rel_l2(y, ref)
        assert err <= get_mode(mode).rel_tol, f"{mode} P={num_splits} causal={causal}: rel err {err:.3e}"


def test_auto_split_is_chosen_when_grid_is_small():
    cfg = get_config("fp16", 64)
    assert choose_num_splits(2, 64, 65536, cfg, torch.device("cuda"), "half") > 1
    assert choose_num_splits(64 * 12, 197, 197, cfg, torch.device("cuda"), "half") == 1


def test_large_batch_heads():
    """B*H = 16384 (Swin-like window count x heads) in one launch."""
    q, k, v = _qkv(4096, 4, 49, 49, 32, torch.float16, seed=3)
    y = elsa_attention(q, k, v, None, None, False, 32 ** -0.5, "fp16")
    assert rel_l2(y, oracle_attention(q, k, v)) <= get_mode("fp16").rel_tol


@pytest.mark.parametrize("mode, num_splits", [("fp32", None), ("fp32", 2), ("fp16", None), ("fp16", 2),
                                              ("pasa", None)])  # PASA has no split-KV path
def test_batch_heads_beyond_grid_axis_limit(mode, num_splits):
    """B*H = 92,160 > 65,535 (SVD temporal attention: 2 x 9216 positions x 5 heads, 14 frames)."""
    dtype = get_mode(mode).compute_dtype  # the output has the input's dtype: fp16 inputs cap fp32 at ~2e-4
    q, k, v = _qkv(18432, 5, 14, 14, 64, dtype, seed=5)
    y = visionattn.attention(q, k, v, mode=mode, num_splits=num_splits)
    assert rel_l2(y, oracle_attention(q, k, v)) <= get_mode(mode).rel_tol


def test_torch_compile_and_cuda_graph():
    """visionattn.attention inside torch.compile (custom op) and inside a captured CUDA graph."""
    q, k, v = _qkv(2, 4, 300, 300, 64, torch.float32, seed=4)
    bias = torch.randn(4, 300, 300, device="cuda")

    def f(q, k, v, bias):
        return visionattn.attention(q * 1.0, k, v, bias=bias, mode="fp32", backend="triton") + 1.0

    ref = oracle_attention(q, k, v, bias=bias) + 1.0
    y = torch.compile(f, fullgraph=True)(q, k, v, bias)
    assert rel_l2(y, ref) <= 1e-5

    static = [t.clone() for t in (q, k, v)]
    f(*static, bias)  # warm-up / compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(*static, bias)
    q2, k2, v2 = _qkv(2, 4, 300, 300, 64, torch.float32, seed=5)
    for s, t in zip(static, (q2, k2, v2)):
        s.copy_(t)
    graph.replay()
    assert rel_l2(out, oracle_attention(q2, k2, v2, bias=bias) + 1.0) <= 1e-5
