"""The (m, S, W) monoid and the blocked reference against the float64 oracle."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from visionattn import reference as ref
from visionattn.metrics import rel_l2
from visionattn.modes import MODES


def _random_state(gen, rows=5, dv=3, neg_inf_frac=0.3):
    m = torch.randn(rows, generator=gen, dtype=torch.float64) * 4
    s = torch.rand(rows, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(rows, dv, generator=gen, dtype=torch.float64)
    dead = torch.rand(rows, generator=gen) < neg_inf_frac  # identity-like rows: -inf max, zero sums
    m[dead], s[dead], w[dead] = float("-inf"), 0.0, 0.0
    return ref.State(m.float(), s.float(), w.float())


def _assert_state_close(a, b, rtol=1e-6):
    assert torch.equal(torch.isneginf(a.m), torch.isneginf(b.m))
    finite = ~torch.isneginf(a.m)
    torch.testing.assert_close(a.m[finite], b.m[finite], rtol=0, atol=0)
    torch.testing.assert_close(a.s, b.s, rtol=rtol, atol=1e-30)
    torch.testing.assert_close(a.w, b.w, rtol=rtol, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_identity_is_two_sided(seed):
    gen = torch.Generator().manual_seed(seed)
    a = _random_state(gen)
    e = ref.identity(a.m.shape, a.w.shape[-1])
    for got in (ref.merge(e, a), ref.merge(a, e)):
        _assert_state_close(got, a, rtol=0)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_merge_is_associative(seed):
    gen = torch.Generator().manual_seed(seed)
    a, b, c = (_random_state(gen) for _ in range(3))
    left = ref.merge(ref.merge(a, b), c)
    right = ref.merge(a, ref.merge(b, c))
    _assert_state_close(left, right, rtol=4 * 2**-23)
    assert not any(torch.isnan(t).any() for t in left)


def test_all_identity_merge_stays_identity():
    e = ref.identity((4,), 2)
    out = ref.merge(e, e)
    assert torch.isneginf(out.m).all() and (out.s == 0).all() and (out.w == 0).all()
    assert (ref.finalize(out) == 0).all()


@pytest.mark.parametrize("order", ["right", "tree", "random"])
def test_reduction_orders_agree(order):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 17, 32, generator=gen)
    k = torch.randn(2, 3, 300, 32, generator=gen)
    v = torch.randn(2, 3, 300, 24, generator=gen)
    states = []
    for start in range(0, 300, 37):
        s = ref.scores_and_mask(q, k[..., start:start + 37, :], scale=32 ** -0.5)
        states.append(ref.block_state(s, v[..., start:start + 37, :]))
    base = ref.finalize(ref.reduce_states(states, "left"))
    other = ref.finalize(ref.reduce_states(states, order, seed=123))
    assert rel_l2(other, base) <= 1e-6
    assert rel_l2(base, ref.oracle_attention(q, k, v)) <= 2e-6


def test_reduce_states_rejects_bad_arguments():
    with pytest.raises(ValueError, match="non-empty"):
        ref.reduce_states([])
    with pytest.raises(ValueError, match="order"):
        ref.reduce_states([ref.identity((1,), 1)], order="sideways")


def _case(n, d, kind, gen, nq=None, dv=None):
    nq = n if nq is None else nq
    q = torch.randn(2, 2, nq, d, generator=gen)
    k = torch.randn(2, 2, n, d, generator=gen)
    v = torch.randn(2, 2, n, dv or d, generator=gen)
    kw = {}
    if kind == "bias":
        kw["bias"] = torch.randn(2, 1, nq, n, generator=gen)  # broadcast over heads
    elif kind == "mask":
        mask = torch.rand(1, 2, nq, n, generator=gen) > 0.3
        mask[..., 0, :] = False  # one fully masked row per head
        kw["attn_mask"] = mask
    elif kind == "causal":
        kw["is_causal"] = True
    return q, k, v, kw


# Inputs are rounded to the mode's dtype first, so the half-mode bound is set by
# that rounding; modes "tf32" runs FP32 on the CPU.
# N = 1025 is run at two head dims only, to keep CI short.
_SIZES = [(n, d) for n in (1, 7, 64, 197, 1025) for d in (16, 32, 64, 80, 128) if n < 1025 or d in (64, 128)]


@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("n, d", _SIZES)
@pytest.mark.parametrize("kind", ["plain", "bias", "mask", "causal"])
def test_blocked_attention_meets_mode_contract(mode, n, d, kind):
    gen = torch.Generator().manual_seed(n * 1000 + d)
    q, k, v, kw = _case(n, d, kind, gen)
    golden = ref.oracle_attention(q, k, v, **kw)
    out = ref.blocked_attention(q, k, v, mode=mode, block_size=64, **kw)
    assert torch.isfinite(out).all()
    assert rel_l2(out, golden) <= MODES[mode].rel_tol * (1 + math.log2(max(n, 2)) / 10)
    if "attn_mask" in kw:
        dead = ~kw["attn_mask"].expand(2, 2, n, n).any(-1)
        assert (out[dead] == 0).all()


def test_oracle_probabilities_are_normalized_and_match_softmax():
    gen = torch.Generator().manual_seed(1)
    q, k, v, kw = _case(33, 16, "bias", gen, nq=5)
    y, p = ref.oracle_attention(q, k, v, return_probs=True, **kw)
    assert p.dtype == torch.float64 and y.shape == (2, 2, 5, 16)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 2, 5, dtype=torch.float64))
    direct = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4 + kw["bias"].double(), -1)
    torch.testing.assert_close(p, direct)


def test_causal_matches_sdpa_alignment_with_unequal_lengths():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 5, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, 9, 16, generator=gen, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ref.oracle_attention(q, k, v, is_causal=True), expected)
    blocked = ref.blocked_attention(q, k, v, is_causal=True, block_size=4, state_dtype=torch.float64)
    torch.testing.assert_close(blocked, expected)
