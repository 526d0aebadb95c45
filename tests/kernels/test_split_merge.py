"""CPU tests of the split-KV merge (:func:`visionattn.kernels.elsa_fwd._elsa_merge_kernel`) in the interpreter.

The merge folds blocks of ``BLOCK_P`` partitions at a time. Its workspaces are written here from float64 partial
states of known logits, so every blocking (partition counts that are not a multiple of ``BLOCK_P``, row counts
that are not a multiple of ``BLOCK_M``, ``Dv`` cut into slices), empty partitions, rows without any visible key
and values near FP32's range are checked against the float64 softmax of all keys; then through
:func:`.elsa_fwd.dense_forward` against :func:`visionattn.reference.oracle_attention`.
"""
import math

import pytest
import torch

from visionattn.kernels import elsa_fwd
from visionattn.kernels._launch import cdiv
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests")

LOG2E = 1.0 / math.log(2.0)


def _partials(B, H, Nq, P, n, Dv, seed, empty=0.3, v_scale=1.0):
    """Logits [B, H, Nq, P, n] (float64, -inf where hidden), values [B, H, P, n, Dv] and the partial states
    ``(m, S, O)`` each partition stores (base 2, FP32): about ``empty`` of the partitions of each row hide every
    key, row 1 of each head hides every key of every partition."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(B, H, Nq, P, n, generator=g, dtype=torch.float64)
    hide = torch.rand(B, H, Nq, P, n, generator=g, dtype=torch.float64) < 0.3
    hide |= (torch.rand(B, H, Nq, P, 1, generator=g, dtype=torch.float64) < empty)  # empty partitions
    if Nq > 1:
        hide[:, :, 1] = True  # a row without any visible key
    logits = logits.masked_fill(hide, float("-inf"))
    v = v_scale * (2 * torch.rand(B, H, P, n, Dv, generator=g, dtype=torch.float64) - 1)
    s2 = logits * LOG2E
    m = s2.amax(-1)  # [B, H, Nq, P]
    e = torch.exp2(s2 - torch.where(torch.isinf(m), 0.0, m)[..., None])
    S = e.sum(-1)
    W = torch.einsum("bhqpn,bhpnd->bhqpd", e, v)
    O = W / torch.where(S > 0, S, 1.0)[..., None]
    ws = lambda t: t.movedim(3, 0).contiguous().float()  # noqa: E731  [P, B, H, Nq(, Dv)]
    return logits, v, ws(m), ws(S), ws(O)


def _reference(logits, v):
    """float64 output [B, H, Nq, Dv] (0 for a row without a visible key) and natural-log LSE [B, H, Nq]."""
    B, H, Nq, P, n = logits.shape
    flat = logits.reshape(B, H, Nq, P * n)
    lse = torch.logsumexp(flat, -1)
    prob = torch.exp(flat - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bhkd->bhqd", prob, v.reshape(B, H, P * n, -1)), lse


def _merge(ws_m, ws_s, ws_w, block_m, block_p, block_dv, num_warps=4):
    P, B, H, Nq, Dv = ws_w.shape
    out = torch.full((B, H, Nq, Dv), float("nan"))
    lse = torch.full((B, H, Nq), float("nan"))
    grid = (cdiv(Nq, block_m) * cdiv(Dv, block_dv) * B * H,)
    elsa_fwd._elsa_merge_kernel[grid](ws_m, ws_s, ws_w, out, lse, *out.stride(), B, H, Nq, Dv, P,
                                      BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_DV=block_dv, WRITE_LSE=True,
                                      num_warps=num_warps)
    return out, lse


def _check(out, lse, ref, ref_lse, what):
    dead = torch.isinf(ref_lse)
    assert torch.isfinite(out).all(), what
    assert torch.all(out[dead] == 0) and torch.all(lse[dead] == float("-inf")), what
    assert rel_l2(out.double(), ref) <= 1e-6, what
    assert torch.allclose(lse[~dead].double(), ref_lse[~dead], rtol=0, atol=1e-5), what


@pytest.mark.parametrize("P", [1, 3, 17, 40])
@pytest.mark.parametrize("block_m,block_p,block_dv", [(1, 8, 32), (2, 16, 16), (4, 8, 64)])
def test_merge_blocks_of_partitions_match_float64(P, block_m, block_p, block_dv):
    """P not a multiple of BLOCK_P (and below it), 5 rows (not a multiple of BLOCK_M), Dv = 40 in slices of 16 or
    32 or one padded slice of 64, empty partitions, a row with no visible key (O = 0, LSE = -inf)."""
    logits, v, ws_m, ws_s, ws_w = _partials(2, 2, 5, P, 6, 40, seed=P)
    out, lse = _merge(ws_m, ws_s, ws_w, block_m, block_p, block_dv)
    _check(out, lse, *_reference(logits, v), f"P={P} blocks={block_m, block_p, block_dv}")


def test_merge_of_rows_whose_partitions_are_all_empty():
    """Every partition of every row the identity (m = -inf, S = 0; O not read as a value): O = 0 and LSE = -inf
    everywhere, no NaN."""
    P, Nq, Dv = 19, 3, 24
    ws_m = torch.full((P, 1, 2, Nq), float("-inf"))
    ws_s = torch.zeros(P, 1, 2, Nq)
    ws_w = torch.full((P, 1, 2, Nq, Dv), 3.0)  # identity partials drop out whatever their O holds
    out, lse = _merge(ws_m, ws_s, ws_w, 2, 8, 16)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_merge_of_one_visible_partition_is_exact():
    """A row whose visible keys all lie in one partition merges to that partition's output bit for bit (its
    weight is exactly 1, every other weight exactly 0), wherever the partition sits among the blocks."""
    P, Nq, Dv = 21, 4, 32
    g = torch.Generator().manual_seed(7)
    ws_m = torch.full((P, 1, 1, Nq), float("-inf"))
    ws_s = torch.zeros(P, 1, 1, Nq)
    ws_w = torch.full((P, 1, 1, Nq, Dv), 5.0)  # identity partials drop out whatever their O holds
    # sums S whose FP32 reciprocal does not give S * (1 / S) == 1: the weight must be b / S, or exactly 1
    sums = (1.0240119695663452, 1.921460747718811, 3.761380672454834, 6.528764247894287)
    for row, p in enumerate((0, 7, 8, 20)):  # first, last of a block of 8, first of the next, last partition
        ws_m[p, 0, 0, row] = 3.7 + row
        ws_s[p, 0, 0, row] = sums[row]
        ws_w[p, 0, 0, row] = torch.randn(Dv, generator=g)
    out, lse = _merge(ws_m, ws_s, ws_w, 4, 8, 32)
    assert torch.equal(out[0, 0], torch.stack([ws_w[p, 0, 0, row] for row, p in enumerate((0, 7, 8, 20))]))
    assert torch.all(torch.isfinite(lse))


@pytest.mark.parametrize("P", [5, 40])
def test_merge_of_values_near_fp32_range_does_not_overflow(P):
    """|V| up to 3e38 with sums S_p in the thousands: the merge combines normalised outputs with weights in
    [0, 1] (never W = O S, nor O_p - O), so the output stays finite and accurate."""
    logits, v, ws_m, ws_s, ws_w = _partials(1, 2, 5, P, 8, 32, seed=11, empty=0.2, v_scale=3e38)
    ws_s *= 1000.0  # as from many keys near the partition's max logit; S enters only as a ratio
    ws_w[:, :, :, 0] = 3e38  # row 0: every partial at the top of the range
    ref, ref_lse = _reference(logits, v)
    ref[:, :, 0] = 3e38
    ref_lse = ref_lse + math.log(1000.0)
    out, lse = _merge(ws_m, ws_s, ws_w, 2, 16, 32)
    _check(out, lse, ref, ref_lse, f"P={P}")
    assert torch.allclose(out[:, :, 0].double(), ref[:, :, 0], rtol=1e-6, atol=0)


def test_merge_blocks_choice():
    """Few rows: BLOCK_M their count's power of two and Dv in 32-column slices while the programs do not fill
    the SMs; many rows: whole Dv and at least two partitions a program. The tile stays within MERGE_TILE."""
    assert elsa_fwd.merge_blocks(1, 16, 128, 132) == (1, 64, 32, 2)
    assert elsa_fwd.merge_blocks(5, 16, 64, 132) == (8, 32, 32, 8)
    assert elsa_fwd.merge_blocks(4096, 64, 128, 132) == (32, 2, 128, 8)
    assert elsa_fwd.merge_blocks(4096, 64, 256, 132) == (16, 2, 256, 8)
    for rows in (1, 2, 3, 16, 17, 64, 1000):
        for dv in (8, 16, 40, 64, 128, 256):
            for bh in (1, 16, 512):
                bm, bp, bdv, warps = elsa_fwd.merge_blocks(rows, bh, dv, 132)
                for x in (bm, bp, bdv):
                    assert x & (x - 1) == 0, (rows, dv, bh)
                assert bm <= 64 and 1 <= bp <= elsa_fwd.MERGE_MAX_BLOCK_P and bdv >= min(32, dv)
                assert bm * bp * bdv <= elsa_fwd.MERGE_TILE and 1 <= warps <= 8 and warps * 1024 >= min(bm * bp * bdv, 8192)


@pytest.mark.parametrize("Nq,splits", [(1, 3), (3, 17), (6, 40)])
def test_split_forward_with_lse_matches_oracle(Nq, splits):
    """Few-query split calls through the plan (BLOCK_M of 1, 4, 8; Dv slices): output and LSE as float64,
    a fully masked row gives O = 0 and LSE = -inf."""
    g = torch.Generator().manual_seed(Nq)
    B, H, Nk, D, Dv = 1, 2, 16 * 40 + 5, 16, 72
    q, k, v = (torch.randn(B, H, n, d, generator=g) for n, d in ((Nq, D), (Nk, D), (Nk, Dv)))
    mask = torch.rand(B, H, Nq, Nk, generator=g) < 0.8
    mask[:, :, Nq - 1] = False
    cfg = elsa_fwd.TileConfig(16, 16, 4, 1)  # 16-key tiles: the keys make 41 tiles to partition
    plan, (out, lse) = elsa_fwd._plan_and_run(q, k, v, None, mask, False, 0.25, "fp32", splits, torch.float32, True,
                                              config=cfg)
    assert plan.merge.constexprs["BLOCK_M"] == elsa_fwd.pad_pow2(Nq, 1)
    ref = oracle_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.25)
    logits = (q.double() @ k.double().transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    ref_lse = torch.logsumexp(logits, -1)
    _check(out, lse, ref, ref_lse, f"Nq={Nq} P={splits}")


@pytest.mark.parametrize("rows, dv", [(1, 1), (33, 64), (64, 24)])
def test_partials_workspace_parts_are_disjoint_aligned_and_the_same_as_addresses(rows, dv):
    """The split-KV / stream-K workspace from one allocation: m, S [rows] and W [rows, dv] as disjoint parts, each at
    a multiple of 128 bytes from the allocation (Triton specialises the pointers' 16-byte alignment at the first
    call); views while any launch is JIT, the same offsets as raw addresses once every launch is direct."""
    from types import SimpleNamespace

    from visionattn.kernels._launch import partials_workspace

    direct, jit = SimpleNamespace(_fast=print), SimpleNamespace(_fast=None)
    *views, base = partials_workspace(rows, dv, torch.device("cpu"), direct, jit)
    assert [t.numel() for t in views] == [rows, rows, rows * dv]
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in views)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= base.data_ptr() + 4 * base.numel()
    assert all((t.data_ptr() - base.data_ptr()) % 128 == 0 for t in views)
    *addresses, base2 = partials_workspace(rows, dv, torch.device("cpu"), direct, direct)
    assert addresses == [base2.data_ptr() + t.data_ptr() - base.data_ptr() for t in views]
