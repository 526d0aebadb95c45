"""CPU tests of the dense ELSA Triton kernels (``TRITON_INTERPRET=1``, set by tests/conftest.py).

Every variant — each mode, padded head dims (16, 64, 80), ragged N, Nq != Nk, broadcast bias,
boolean mask, causal, fully masked rows, non-contiguous views, split-KV with P = 1, 2, 3 —
is compared with the float64 oracle (:func:`visionattn.reference.oracle_attention`) against
the mode's contract (:mod:`visionattn.modes`). The split-FP16 products (``f16x3`` for ``fp32``,
``f16x1`` for ``tf32``) round as on the GPU (FP16 parts, FP32 accumulation); the interpreter runs
the ``tf32`` / ``tf32x3`` precisions of ``tl.dot`` in FP32, so those are checked for control flow
only (test_elsa_gpu.py covers their rounding).
"""
import warnings

import pytest
import torch

import visionattn
from visionattn.kernels import elsa_fwd
from visionattn.kernels.elsa_fwd import DENSE_MODES, elsa_attention, unsupported_reason
from visionattn.metrics import rel_l2
from visionattn.modes import get_mode
from visionattn.reference import oracle_attention

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; GPU runs test_elsa_gpu.py")

MODES = list(DENSE_MODES)


def _qkv(B, H, Nq, Nk, D, dtype, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, d: torch.randn(B, H, n, d, generator=g).to(dtype)  # noqa: E731
    return mk(Nq, D), mk(Nk, D), mk(Nk, Dv or D)


def _check(y, ref, mode, what):
    assert y.dtype == get_mode(mode).compute_dtype
    assert torch.isfinite(y).all(), what
    err = rel_l2(y, ref)
    assert err <= get_mode(mode).rel_tol, f"{mode} {what}: rel err {err:.3e} > {get_mode(mode).rel_tol}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("Nq,Nk,D,Dv", [(1, 1, 16, 16), (7, 65, 80, 80), (130, 7, 64, 32)])
def test_shapes(mode, Nq, Nk, D, Dv):
    """Ragged N (1, 7, 65, 130), Nq != Nk, padded head dims (80 -> 128), Dv != D."""
    q, k, v = _qkv(1, 2, Nq, Nk, D, get_mode(mode).compute_dtype, Dv=Dv)
    y = elsa_attention(q, k, v, None, None, False, D ** -0.5, mode)
    assert y.shape == (1, 2, Nq, Dv)
    _check(y, oracle_attention(q, k, v), mode, f"Nq={Nq} Nk={Nk} D={D} Dv={Dv}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_bias_mask_causal_split(mode, num_splits):
    """Broadcast bias [H, Nq, Nk] (fp16), bool mask with one fully masked row, causal, P = 1, 2, 3."""
    B, H, Nq, Nk, D = 2, 2, 40, 130, 64
    q, k, v = _qkv(B, H, Nq, Nk, D, get_mode(mode).compute_dtype, seed=num_splits)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(H, Nq, Nk, generator=g).half()
    mask = torch.rand(Nq, Nk, generator=g) > 0.3
    mask[3] = False
    causal = num_splits != 2
    y = elsa_attention(q, k, v, bias.expand(B, H, Nq, Nk), mask.expand(B, H, Nq, Nk), causal, 0.2, mode,
                       num_splits)
    assert (y[:, :, 3] == 0).all(), "a fully masked row must give zeros"
    ref = oracle_attention(q, k, v, bias=bias, attn_mask=mask, is_causal=causal, scale=0.2)
    _check(y, ref, mode, f"P={num_splits} causal={causal}")


@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_split_partials_stay_in_range_near_fp32_max(mode):
    """Values near FP32's largest (|V| up to ~2e38, near-uniform attention over 130 keys, so a partition's raw
    sum of P V passes FP32's range): the single pass divides its held-scaled sum first and stays finite; the
    split-KV partials are stored normalised and merged so, and agree with it."""
    q, k, v = _qkv(1, 2, 40, 130, 32, torch.float32, seed=11)
    v = v.abs() * 5e37  # at most ~2e38, within FP32
    ref = oracle_attention(q, k, v, scale=0.01)
    for num_splits in (1, 3):
        _check(elsa_attention(q, k, v, None, None, False, 0.01, mode, num_splits), ref, mode, f"P={num_splits}")


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_api_unbind_views(mode):
    """visionattn.attention(backend="triton") on timm-style qkv.unbind views, fp32 inputs, no fallback warning."""
    B, N, H, D = 2, 65, 3, 16
    qkv = torch.randn(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    assert not q.is_contiguous()
    bias = torch.randn(1, H, N, N)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference would warn
        y = visionattn.attention(q, k, v, bias=bias, is_causal=True, mode=mode, backend="triton")
    assert y.dtype == torch.float32 and y.shape == (B, H, N, D)
    qc, kc, vc = (t.to(get_mode(mode).compute_dtype) for t in (q, k, v))
    ref = oracle_attention(qc, kc, vc, bias=bias, is_causal=True)
    assert rel_l2(y, ref) <= get_mode(mode).rel_tol


def test_all_keys_masked_by_bias_and_causal_wide():
    """-inf bias rows give zeros; causal with Nq > Nk (top-left) keeps every row defined."""
    q, k, v = _qkv(1, 1, 70, 20, 16, torch.float32)
    bias = torch.zeros(1, 1, 70, 20)
    bias[..., 5, :] = float("-inf")
    y = elsa_attention(q, k, v, bias, None, True, 0.25, "fp32-ieee", 2)
    assert (y[0, 0, 5] == 0).all() and torch.isfinite(y).all()
    _check(y, oracle_attention(q, k, v, bias=bias, is_causal=True, scale=0.25), "fp32-ieee", "-inf bias")


def test_custom_ops_opcheck():
    """The dense ops (schema, fake impl, dispatcher) pass torch.library.opcheck."""
    import visionattn.ops  # noqa: F401  (registers the ops)

    q, k, v = _qkv(1, 2, 17, 33, 16, torch.float32)
    mask = (torch.rand(17, 33) > 0.5).expand(1, 2, 17, 33)
    for op in (torch.ops.visionattn.attention.default, torch.ops.visionattn.attention_lse.default):
        for out_dtype in (None, torch.float16):
            torch.library.opcheck(op, (q, k, v, None, mask, False, 0.25, "fp32", 2, out_dtype),
                                  test_utils=("test_schema", "test_faketensor"))


def test_unsupported_reason():
    q, k, v = _qkv(1, 1, 4, 4, 16, torch.float32)
    assert unsupported_reason(q, k, v, None, None, "fp32") is None
    assert "pasa" in unsupported_reason(q, k, v, None, None, "pasa")
    big = torch.randn(1, 1, 4, 320)
    assert "head dim" in unsupported_reason(big, big, big, None, None, "fp32")
    assert unsupported_reason(q, k, v, None, None, "fp16") is None  # api.py casts after asking


def test_errors_name_the_argument():
    q, k, v = _qkv(1, 1, 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        elsa_attention(q, k, v, None, None, False, 1.0, "fp32", 0)
    with pytest.raises(TypeError, match="dtype"):
        elsa_attention(q.half(), k.half(), v.half(), None, None, False, 1.0, "fp32")
    with pytest.raises(ValueError, match="mode"):
        elsa_attention(q, k, v, None, None, False, 1.0, "fp64")
    assert elsa_fwd.choose_num_splits(1, 4, 4096, elsa_fwd.get_config("fp32", 16), torch.device("cpu"), "f16x3") == 1


@pytest.mark.parametrize("precision", ["half", "f16x3", "f16x1", "ieee"])
def test_split_count_rule(monkeypatch, precision):
    """The split-KV partition count (a host decision: the GPU's SM count stubbed at 132): one pass whenever the
    grid holds at least one program per SM (for a ragged batch: the longest sequence's programs); otherwise at
    most MAX_SPLITS partitions of at least two key tiles each, more partitions for fewer programs or longer keys,
    and a ragged batch whose other sequences are short splits at least as finely as the same longest sequence
    among equally long ones (the work left over is smaller)."""
    monkeypatch.setattr(elsa_fwd, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    cfg = elsa_fwd.TileConfig(128, 64, 4, 3)

    def splits(bh, nq, nk, ragged=None):
        return elsa_fwd.choose_num_splits(bh, nq, nk, cfg, cuda, precision, ragged)

    assert splits(132, 1, 65536) == 1 and splits(2, 66 * 128, 65536) == 1  # 132 programs: every SM busy
    for bh, nq, nk in [(1, 1, 65536), (1, 16, 16384), (16, 1, 65536), (12, 1, 4096), (64, 1, 4096)]:
        p = splits(bh, nq, nk)
        assert 2 <= p <= min(elsa_fwd.MAX_SPLITS, elsa_fwd.cdiv(nk, cfg.block_n) // 2), (bh, nq, nk, p)
    assert splits(1, 1, 65536) >= splits(16, 1, 65536) >= splits(64, 1, 65536)
    assert splits(16, 1, 65536) >= splits(16, 1, 8192)
    assert splits(1, 1, 128) == 1  # two key tiles: nothing to split
    # ragged: 8 sequences x 16 heads, one of 8192 keys; the others 512 keys each, or 8192 like the longest
    short = splits(16 * 8, 16, 8192, (8, 8192 + 7 * 512))
    equal = splits(16 * 8, 16, 8192, (8, 8 * 8192))
    assert short >= equal and short >= 2
    assert splits(132 * 4, 1, 8192, (4, 4 * 8192)) == 1  # the longest sequence alone fills the SMs
    assert splits(12, 63, 0) == 1 and splits(12, 63, 0, (1, 0)) == 1  # no keys (a ragged batch's too): one pass


def test_shared_memory_fallback_sequence_shrinks():
    """Out-of-shared-memory retries only ever shrink the pipelined footprint and end at 16x16 tiles."""
    from visionattn.kernels.elsa_fwd import TileConfig, _smaller_configs

    seq = [TileConfig(128, 128, 8, 3)] + _smaller_configs(TileConfig(128, 128, 8, 3))
    foot = [c.num_stages * c.block_n + c.block_m for c in seq]  # K/V/bias stage buffers + Q rows
    assert all(b < a for a, b in zip(foot, foot[1:]))
    assert (seq[-1].block_m, seq[-1].block_n, seq[-1].num_stages) == (16, 16, 1)


@pytest.fixture(params=[False, True], ids=["eager_v", "lazy_v"])
def lazy_v(request, monkeypatch):
    """Both ways of rescaling the split-FP16 accumulator's V columns: every tile, or only when an exponent
    grows (fp32's f16x3 picks the latter past ``LAZY_V_MIN_KEYS`` keys, more than these tests use)."""
    if request.param:
        monkeypatch.setattr(elsa_fwd, "LAZY_V_MIN_KEYS", 0)
    return request.param


@pytest.mark.parametrize("precision,tol", [("f16x3", 2e-6), ("f16x1", 3e-3), ("tf32x3", 2e-6), ("ieee", 2e-6)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_precision_overrides(precision, tol, num_splits, lazy_v):
    """Every FP32 product precision meets its contract, single pass and split-KV."""
    q, k, v = _qkv(1, 2, 70, 300, 64, torch.float32, seed=11)
    y = elsa_fwd._launch(q, k, v, None, None, False, 0.125, "fp32", num_splits, precision=precision)
    err = rel_l2(y, oracle_attention(q, k, v, scale=0.125))
    assert err <= tol, f"{precision}: rel err {err:.3e} > {tol}"


@pytest.mark.parametrize("num_splits", [1, 2])
def test_tf32_huge_logits_stay_finite(num_splits):
    """tf32 (f16x1) shifts its running row max by 15 so P carries FP16's 2^15 scale; past |max| = 2^23 that
    shift could round and P overflow FP16. Logits ~1e9 must still give a convex combination of V's rows
    (finite, inside each column's range) and match the oracle, whose softmax is one-hot there."""
    q, k, v = _qkv(1, 2, 33, 150, 64, torch.float32, seed=3)
    q = q * 3e8
    y = elsa_attention(q, k, v, None, None, False, 0.125, "tf32", num_splits)
    assert torch.isfinite(y).all()
    lo, hi = v.amin(-2, keepdim=True), v.amax(-2, keepdim=True)
    assert ((y >= lo - 1e-3 * hi.abs()) & (y <= hi + 1e-3 * hi.abs())).all()
    ref = oracle_attention(q, k, v, scale=0.125)
    assert rel_l2(y, ref) <= get_mode("tf32").rel_tol


@pytest.mark.parametrize("sq,sk,sv", [(1e-20, 1e20, 1.0), (1e15, 1e-16, 1e30), (1.0, 1.0, 1e-38), (3e-3, 1e-2, 1e-4)])
def test_split_fp16_is_scale_invariant(sq, sk, sv, lazy_v):
    """fp32 (split-FP16 products) stays FP32-accurate far outside FP16's range: q, k, v scaled by
    1e-38..1e30, key rows 1e5 apart and a V block 1e6 larger than the rest (the power-of-two
    scaling of rows, of P and of the running V exponent must all be undone exactly)."""
    q, k, v = _qkv(1, 1, 40, 200, 64, torch.float32, seed=5)
    q, k, v = q * sq, k * sk, v * sv
    k[..., ::7, :] *= 1e5
    v[..., 100:, :] *= 1e6
    for num_splits in (1, 2):
        for mode in ("fp32", "tf32"):
            y = elsa_attention(q, k, v, None, None, False, 0.125, mode, num_splits)
            _check(y, oracle_attention(q, k, v, scale=0.125), mode, f"scales {sq}, {sk}, {sv}, P={num_splits}")


def test_output_layout_makes_the_head_merge_free():
    """The output is a [B, H, N, Dv] view of a [B, N, H, Dv] buffer (SDPA flash's layout): the
    callers' transpose(1, 2).reshape(B, N, H * Dv) returns the same memory without a copy, and the
    values equal those of the contiguous reference."""
    B, H, N, D = 2, 3, 33, 16
    q, k, v = _qkv(B, H, N, N, D, torch.float32, seed=9)
    y = elsa_attention(q, k, v, None, None, False, D ** -0.5, "fp32")
    flat = y.transpose(1, 2).reshape(B, N, H * D)
    assert flat.data_ptr() == y.data_ptr() and flat.is_contiguous()
    ref = oracle_attention(q, k, v).transpose(1, 2).reshape(B, N, H * D)
    assert rel_l2(flat, ref) <= get_mode("fp32").rel_tol


@pytest.mark.parametrize("ratio", [2.0 ** 12, 2.0 ** 20])
def test_split_fp16_within_row_spread(ratio):
    """One q channel `ratio` times the others (the matching k channel 1/ratio, so it does not
    dominate the scores) and one V column 2^30 times the others: fp32 still meets 2e-6, and the
    small output columns meet it on their own (V is scaled per column: one scale per tile would
    push the small columns into FP16's subnormals)."""
    q, k, v = _qkv(1, 2, 64, 256, 64, torch.float32, seed=4)
    q[..., 0] *= ratio
    k[..., 0] /= ratio
    v[..., 0] *= 2.0 ** 30
    y = elsa_attention(q, k, v, None, None, False, 0.125, "fp32")
    ref = oracle_attention(q, k, v, scale=0.125)
    _check(y, ref, "fp32", f"spread {ratio:g}")
    small = rel_l2(y[..., 1:], ref[..., 1:])
    assert small <= get_mode("fp32").rel_tol, f"small V columns: rel err {small:.3e}"


def test_run_first_that_fits_falls_back_in_order_and_reraises():
    """The shared out-of-shared-memory fallback of the dense and PASA launchers: the first config
    that runs wins, the smaller list is only built on failure, and when nothing fits the last
    OutOfResources propagates (at once if there is nothing smaller)."""
    import triton.runtime.errors as terr

    from visionattn.kernels._launch import run_first_that_fits

    def run_fitting(limit, tried):
        def run(c):
            tried.append(c)
            if c > limit:
                raise terr.OutOfResources(c, limit, "shared memory")
        return run

    built = []
    smaller = lambda c: built.append(c) or [c - 1, c - 2, c - 3]  # noqa: E731
    tried = []
    assert run_first_that_fits(run_fitting(10, tried), 8, smaller) == 8 and built == [] and tried == [8]
    tried = []
    assert run_first_that_fits(run_fitting(6, tried), 8, smaller) == 6 and tried == [8, 7, 6]
    with pytest.raises(terr.OutOfResources):
        run_first_that_fits(run_fitting(0, []), 8, smaller)
    tried = []
    with pytest.raises(terr.OutOfResources):
        run_first_that_fits(run_fitting(0, tried), 8, lambda c: [])
    assert tried == [8]


@pytest.mark.parametrize("mode", ["fp32-ieee", "fp16", "bf16"])
@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.125])
def test_scale_sign_and_mask(mode, scale):
    """The raw-max order (max of q.k, then one FMA per score) holds only for scale > 0: negative and
    zero scales (allowed by SDPA) take the scale-first order; a boolean mask with a fully masked row
    and ragged Nk run through both."""
    q, k, v = _qkv(1, 2, 33, 70, 64, get_mode(mode).compute_dtype, seed=5)
    mask = torch.rand(33, 70, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[4] = False
    y = elsa_attention(q, k, v, None, mask.expand(1, 2, 33, 70), False, scale, mode)
    assert (y[:, :, 4] == 0).all()
    _check(y, oracle_attention(q, k, v, attn_mask=mask, scale=scale), mode, f"scale={scale}")


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_out_dtype_fp32_from_half_mode(mode, num_splits):
    """A FP32 caller of a half mode gets W / S rounded once to FP32: it rounds to the half output
    (within one half ulp: double rounding) and is closer to the oracle of the half inputs."""
    half = get_mode(mode).compute_dtype
    q, k, v = _qkv(2, 2, 50, 90, 64, half, seed=9)
    y_half = elsa_attention(q, k, v, None, None, False, 0.125, mode, num_splits)
    y32 = elsa_attention(q, k, v, None, None, False, 0.125, mode, num_splits, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and y_half.dtype == half
    assert y32.shape == y_half.shape and y32.transpose(1, 2).is_contiguous()
    ulp = torch.finfo(half).eps * y32.abs().clamp_min(torch.finfo(half).tiny)
    assert ((y32 - y_half.float()).abs() <= ulp).all()
    ref = oracle_attention(q, k, v, scale=0.125)
    assert rel_l2(y32, ref) < rel_l2(y_half, ref)


def test_out_dtype_rejected():
    q, k, v = _qkv(1, 1, 4, 4, 16, torch.float16)
    with pytest.raises(TypeError, match="out_dtype"):
        elsa_attention(q, k, v, None, None, False, 0.25, "fp16", out_dtype=torch.float64)


def test_api_fp32_caller_half_mode_not_rounded():
    """visionattn.attention with FP32 inputs in bf16 mode returns the kernel's FP32 output, not a
    bf16-rounded one (values off the bf16 grid), within the bf16 contract."""
    q, k, v = _qkv(1, 2, 40, 40, 32, torch.float32, seed=3)
    y = visionattn.attention(q, k, v, mode="bf16", backend="triton")
    assert y.dtype == torch.float32
    assert (y != y.to(torch.bfloat16).float()).any()
    assert rel_l2(y, oracle_attention(q, k, v)) <= get_mode("bf16").rel_tol
