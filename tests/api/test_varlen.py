"""visionattn.varlen_attention: packed ragged batches (cu_seqlens) against per-sequence attention and the
float64 oracle, every dense mode's contract, 0- and 1-length sequences, causal, non-contiguous views, the
LSE, jagged nested tensors, and validation errors."""
import pytest
import torch

import visionattn
from visionattn.metrics import rel_l2
from visionattn.modes import MODES
from visionattn.reference import oracle_attention
from visionattn.varlen import varlen_attention


def offsets(lens, device="cpu"):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def packed(lens_q, lens_k, h=2, d=16, dv=None, seed=0, qkv_view=False, device="cpu"):
    """q [total_q, H, D], k / v [total_k, H, D|Dv] of N(0, 1); with ``qkv_view`` (needs lens_q == lens_k) q,
    k, v are the non-contiguous ``unbind`` views of one fused [total, 3, H, D] tensor, as timm's qkv."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    tq, tk = sum(lens_q), sum(lens_k)
    if qkv_view:
        q, k, v = torch.randn(tq, 3, h, d, generator=g).to(device).unbind(1)
    else:
        q = torch.randn(tq, h, d, generator=g).to(device)
        k = torch.randn(tk, h, d, generator=g).to(device)
        v = torch.randn(tk, h, dv, generator=g).to(device)
    return q, k, v, offsets(lens_q, device), offsets(lens_k, device)


def per_sequence(fn, q, k, v, cu_q, cu_k, dv):
    """Apply ``fn(q_s, k_s, v_s)`` ([1, H, n, D] views) per sequence; zeros for sequences without keys."""
    out = torch.zeros(q.shape[0], q.shape[1], dv, dtype=torch.float64, device=q.device)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for s in range(len(bq) - 1):
        if bq[s + 1] == bq[s] or bk[s + 1] == bk[s]:
            continue
        view = lambda t, a, b: t[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
        y = fn(view(q, bq[s], bq[s + 1]), view(k, bk[s], bk[s + 1]), view(v, bk[s], bk[s + 1]))
        out[bq[s]:bq[s + 1]] = y[0].transpose(0, 1).double()
    return out


LENS_Q = [5, 0, 17, 1, 40, 3]
LENS_K = [7, 3, 0, 1, 33, 70]


@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16", "fp32-ieee"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_per_sequence_attention(mode, causal):
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, dv=24)
    out = varlen_attention(q, k, v, cu_q, cu_k, mode=mode, is_causal=causal, backend="triton")
    assert out.shape == (q.shape[0], 2, 24) and out.dtype == q.dtype
    oracle = per_sequence(lambda a, b, c: oracle_attention(a, b, c, is_causal=causal), q, k, v, cu_q, cu_k, 24)
    tol = MODES[mode].rel_tol
    assert rel_l2(out.double(), oracle) <= tol
    dense = per_sequence(lambda a, b, c: visionattn.attention(a, b, c, mode=mode, is_causal=causal, backend="triton"),
                         q, k, v, cu_q, cu_k, 24)
    assert rel_l2(out.double(), dense) <= 2 * tol
    # a sequence without keys gives zero rows
    assert torch.all(out[cu_q[2]:cu_q[3]] == 0)


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_split_kv_partitions_match_the_oracle_and_the_single_pass(mode, causal):
    """The KV of every sequence cut into 3 partitions (16-key tiles: up to 5 tiles, so short sequences get
    identity partitions) and merged: output and LSE equal the oracle's within the mode's contract and the single
    pass's; a sequence without keys still gives zero rows and LSE -inf."""
    from visionattn.kernels import varlen_fwd
    from visionattn.kernels.elsa_fwd import TileConfig

    dtype = MODES[mode].compute_dtype
    q, k, v, cu_q, cu_k = (t.to(dtype) if t.is_floating_point() else t for t in packed(LENS_Q, LENS_K, dv=24))
    cfg = TileConfig(16, 16, 4, 1)
    runs = {}
    for splits in (1, 3):
        varlen_fwd.PLANS.clear()
        with pytest.MonkeyPatch.context() as mp:  # small tiles, so the short test sequences span several
            mp.setattr(varlen_fwd, "get_config", lambda *a, **kw: cfg)
            runs[splits] = varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal,
                                                     16 ** -0.5, mode, with_lse=True, num_splits=splits)
    varlen_fwd.PLANS.clear()
    (single, lse1), (split, lse3) = runs[1], runs[3]
    oracle = per_sequence(lambda a, b, c: oracle_attention(a, b, c, is_causal=causal), q, k, v, cu_q, cu_k, 24)
    tol = MODES[mode].rel_tol
    assert rel_l2(split.double(), oracle) <= tol and rel_l2(split.double(), single.double()) <= 2 * tol
    finite = torch.isfinite(lse1)
    assert torch.equal(finite, torch.isfinite(lse3)) and torch.all(lse3[:, cu_q[2]:cu_q[3]] == float("-inf"))
    assert torch.allclose(lse3[finite], lse1[finite], atol=5e-3 if mode != "fp32" else 1e-5, rtol=0)
    assert torch.all(split[cu_q[2]:cu_q[3]] == 0)
    with pytest.raises(ValueError, match="num_splits"):  # refused before the empty-input shortcut too
        varlen_fwd.varlen_forward(q[:0], k, v, cu_q[:1], cu_k[:1], 0, 0, causal, 0.25, mode, num_splits=-1)


def test_tile_table_lists_every_real_query_tile_once():
    """The tile table holds each (sequence, head, query tile) of the host lengths once, as its grid position
    ``(s * H + h) * n_m_tiles + m``, in the given sequence order, a sequence's tiles of one head adjacent, no tile
    past a sequence's queries or the grid's bound."""
    from visionattn.kernels.varlen_fwd import tile_table

    lens_q, order, heads, block_m, bound = (5, 0, 17, 16, 40), (2, 4, 3, 0, 1), 3, 8, 4
    table = tile_table(lens_q, order, heads, block_m, bound)
    assert table.dtype == torch.int32
    decoded = [(int(e) // bound // heads, int(e) // bound % heads, int(e) % bound) for e in table]
    want = [(s, h, m) for s in order for h in range(heads) for m in range(min(-(-lens_q[s] // block_m), bound))]
    assert decoded == want and len(set(decoded)) == len(decoded) == heads * (1 + 3 + 2 + 4)


def test_tile_table_plan_after_a_shared_memory_fallback(monkeypatch):
    """A plan whose config fell back to smaller query tiles (the GPU's shared memory does not hold the first one)
    has a grid of its own tile count: two calls whose lengths give equal counts at the first config's tile height
    but not at the fallback's get their own plans, every row computed (the plan key holds the counts at every
    height; on the first height alone the second call reused the first's grid, one tile short)."""
    from triton.runtime.errors import OutOfResources

    from visionattn.kernels import elsa_fwd, varlen_fwd

    class FallingBack(varlen_fwd._VarlenPlan):
        __slots__ = ()

        def __call__(self, *args):
            if self.config.block_m > 16:  # as if only 16-row tiles fit the shared memory
                raise OutOfResources(300_000, 232_448, "shared memory")
            return super().__call__(*args)

    monkeypatch.setattr(varlen_fwd, "_VarlenPlan", FallingBack)
    varlen_fwd.PLANS.clear()
    height = elsa_fwd.get_config("fp32", 16, 16, 64).block_m
    assert height >= 32
    # equal totals, longest last (a table, in its own order), one tile + one tile at the first height each; 16-row
    # tiles 1 + height / 16 against 2 + height / 16
    for lens in ((16, height), (24, height - 8)):
        q, k, v, cu_q, cu_k = packed(lens, lens)
        out = varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, height, height, False, 0.25, "fp32",
                                        lengths=(lens, lens), schedule="split-kv")[0]
        oracle = per_sequence(oracle_attention, q, k, v, cu_q, cu_k, 16)
        assert rel_l2(out.double(), oracle) <= MODES["fp32"].rel_tol, lens
    assert len(varlen_fwd.PLANS.plans) == 2 and all(p.config.block_m == 16 for p in varlen_fwd.PLANS.plans.values())
    varlen_fwd.PLANS.clear()


def test_longest_first_orders_by_keys_then_queries():
    from visionattn.kernels.varlen_fwd import longest_first

    order = longest_first(LENS_Q, LENS_K)
    assert sorted(order) == list(range(len(LENS_K)))
    keys = [(LENS_K[s], LENS_Q[s]) for s in order]
    assert keys == sorted(keys, reverse=True)
    assert longest_first([1, 9, 2], [5, 5, 5]) == (1, 2, 0)  # equal keys: more queries first
    assert longest_first([3, 3, 1], [8, 8, 2]) is None  # ties keep their order; sorted already: no table


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("splits", [0, 3])
def test_host_lengths_visit_the_longest_sequences_first(mode, splits):
    """With host-side lengths the varlen kernel runs the real query tiles only, longest sequences first, through a
    tile table (the single pass and the split-KV partitions): the output is bit-identical to the call without
    lengths (same arithmetic per program) and within the mode's contract of the oracle."""
    from visionattn.kernels import varlen_fwd

    dtype = MODES[mode].compute_dtype
    q, k, v, cu_q, cu_k = (t.to(dtype) if t.is_floating_point() else t for t in packed(LENS_Q, LENS_K, dv=24))
    varlen_fwd.PLANS.clear()
    args = (q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), False, 0.25, mode)
    plain, lse = varlen_fwd.varlen_forward(*args, with_lse=True, num_splits=splits)
    plan, (ordered, lse_o) = varlen_fwd.plan_for(*args, with_lse=True, num_splits=splits,
                                                 lengths=(tuple(LENS_Q), tuple(LENS_K)), schedule="split-kv")
    varlen_fwd.PLANS.clear()
    assert plan.main.constexprs["TILED"] and (plan.merge is not None) == (splits > 1)
    parts = plan.fixed[-2]
    assert plan.main.grid == (2 * sum(-(-n // plan.config.block_m) for n in LENS_Q) * parts,)  # H = 2
    assert torch.equal(ordered, plain) and torch.equal(lse_o, lse)
    oracle = per_sequence(oracle_attention, q, k, v, cu_q, cu_k, 24)
    assert rel_l2(ordered.double(), oracle) <= MODES[mode].rel_tol
    # the tile table is built from one length per sequence: lengths of another count are refused
    with pytest.raises(ValueError, match="one length per sequence"):
        varlen_fwd.varlen_forward(*args, num_splits=splits, lengths=((1, 2), (3, 4)), schedule="split-kv")


def test_device_tables_keep_their_host_source():
    """A host-to-device copy captured in a CUDA graph reads its source again at every replay: the tile table, the
    stream-K partition's table and a list's in-place table keep theirs (equal to the device copy) with the copy."""
    from visionattn.kernels import stream_k, varlen_fwd

    tiles = varlen_fwd._tile_tensor((3, 9, 1), (1, 0, 2), 2, 4, 3, torch.device("cpu"))
    device_copy, host = varlen_fwd._TILES.get(((3, 9, 1), (1, 0, 2), 2, 4, 3, torch.device("cpu")))
    assert device_copy is tiles and host.tolist() == tiles.tolist() == [6, 7, 8, 9, 10, 11, 0, 3, 12, 15]
    assert host.dtype == torch.int32
    q, k, v, _, _ = packed([3, 1], [40, 20])
    plan = stream_k.stream_plan(q, k, v, [3, 1], [40, 20], 4, False, "fp32", torch.float32, False, False, programs=3)
    assert torch.equal(plan.host_table, plan.table.cpu()) and torch.equal(plan.host_table, plan.part.table)
    import visionattn.varlen as vl

    seqs = [[t.clone() for t in torch.split(x, lens)] for x, lens in zip((q, k, v), ([3, 1], [40, 20], [40, 20]))]
    plan = vl._in_place_plan(*seqs, seqs[0][0], MODES["fp32"])
    cu_q = plan[1][0]
    assert plan[-1][:4 * 3].view(torch.int32).tolist() == cu_q.tolist() == [0, 3, 4]  # the source: int32 offsets first


def test_split_kv_reads_keys_past_a_low_key_bound():
    """The split path's last partition folds every key tile of its sequence, as the single pass does, when
    ``max_seqlen_k`` (trusted, not read from the offsets) is below a sequence's length: the partitions used to
    stop at ``n_splits * tiles_per_split`` tiles and drop the rest of the keys silently."""
    from visionattn.kernels import varlen_fwd
    from visionattn.kernels.elsa_fwd import TileConfig

    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, dv=24)
    cfg = TileConfig(16, 16, 4, 1)
    oracle = per_sequence(oracle_attention, q, k, v, cu_q, cu_k, 24)
    low = max(LENS_K) // 2  # below the longest sequence's keys
    for splits in (1, 2, 3):
        varlen_fwd.PLANS.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(varlen_fwd, "get_config", lambda *a, **kw: cfg)
            out, _ = varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, max(LENS_Q), low, False, 16 ** -0.5, "fp32",
                                               num_splits=splits)
        assert rel_l2(out.double(), oracle) <= MODES["fp32"].rel_tol, f"num_splits={splits}"
    varlen_fwd.PLANS.clear()


def test_reference_path_matches_oracle_and_kernel():
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K)
    ref = varlen_attention(q, k, v, cu_q, cu_k, backend="reference", is_causal=True)
    oracle = per_sequence(lambda a, b, c: oracle_attention(a, b, c, is_causal=True), q, k, v, cu_q, cu_k, 16)
    assert rel_l2(ref.double(), oracle) <= MODES["fp32"].rel_tol
    # auto on CPU tensors runs the reference
    assert torch.equal(varlen_attention(q, k, v, cu_q, cu_k, is_causal=True), ref)


def test_non_contiguous_qkv_view_and_scale():
    lens = [9, 1, 0, 30]
    q, k, v, cu_q, cu_k = packed(lens, lens, h=3, d=8, qkv_view=True)
    assert not q.is_contiguous()
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lens), max(lens), scale=0.3, backend="triton")
    oracle = per_sequence(lambda a, b, c: oracle_attention(a, b, c, scale=0.3), q, k, v, cu_q, cu_k, 8)
    assert rel_l2(out.double(), oracle) <= MODES["fp32"].rel_tol


def test_half_inputs_and_larger_max_seqlen():
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K)
    q, k, v = q.half(), k.half(), v.half()
    # a bound above the longest sequence only adds early-exiting programs
    out = varlen_attention(q, k, v, cu_q, cu_k, 300, 200, mode="fp16", backend="triton")
    assert out.dtype == torch.float16
    oracle = per_sequence(oracle_attention, q, k, v, cu_q, cu_k, 16)
    assert rel_l2(out.double(), oracle) <= MODES["fp16"].rel_tol


def test_lse_matches_logsumexp():
    from visionattn import ops
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K)
    scale = 16 ** -0.5
    for mode, causal in (("fp32", False), ("tf32", True)):
        out, lse = ops.varlen_lse(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal, scale, mode, None)
        assert lse.shape == (2, q.shape[0]) and lse.dtype == torch.float32
        bq, bk = cu_q.tolist(), cu_k.tolist()
        for s in range(len(LENS_Q)):
            if LENS_Q[s] == 0:
                continue
            rows = lse[:, bq[s]:bq[s + 1]]
            if LENS_K[s] == 0:
                assert torch.all(rows == float("-inf"))
                continue
            sc = torch.einsum("qhd,khd->hqk", q[bq[s]:bq[s + 1]].double(), k[bk[s]:bk[s + 1]].double()) * scale
            if causal:
                sc = sc.masked_fill(~torch.ones(sc.shape[1:], dtype=torch.bool).tril(), float("-inf"))
            torch.testing.assert_close(rows.double(), torch.logsumexp(sc, -1), atol=5e-3 if mode == "tf32" else 1e-5,
                                       rtol=0)


def test_empty_batch_and_all_empty_sequences():
    q, k, v, cu_q, cu_k = packed([0, 0], [0, 4])
    out = varlen_attention(q, k, v, cu_q, cu_k, backend="triton")
    assert out.shape == (0, 2, 16)
    q, k, v, cu_q, cu_k = packed([3, 2], [0, 0])
    out = varlen_attention(q, k, v, cu_q, cu_k, backend="triton")
    assert torch.all(out == 0)


def test_jagged_nested_input():
    lens = [4, 11, 1]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randn(n, 2, 16, generator=g) for n in lens]
    nq = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    out = varlen_attention(nq, nq, nq, backend="triton")
    assert out.is_nested and out.layout == torch.jagged
    vals = nq.values()
    cu = offsets(lens)
    oracle = per_sequence(oracle_attention, vals, vals, vals, cu, cu, 16)
    assert rel_l2(out.values().double(), oracle) <= MODES["fp32"].rel_tol
    # the [B, H, j, D] transpose, as SDPA takes nested inputs
    t = nq.transpose(1, 2)
    out_t = varlen_attention(t, t, t, backend="triton")
    assert torch.equal(out_t.transpose(1, 2).values(), out.values())


def _read_in_place(monkeypatch):
    """The varlen plan cache, fresh; ``in_place()`` tells whether the last plan built read sequences in place."""
    from visionattn.kernels import varlen_fwd
    from visionattn.kernels._launch import PlanCache

    plans = PlanCache()
    monkeypatch.setattr(varlen_fwd, "PLANS", plans)
    return lambda: list(plans.plans)[-1][5]


@pytest.mark.parametrize("mode,causal", [("fp32", False), ("fp32", True), ("fp16", False), ("tf32", True)])
def test_list_of_sequences_is_read_in_place_and_equals_the_packed_call(monkeypatch, mode, causal):
    in_place = _read_in_place(monkeypatch)
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, dv=24)
    dtype = MODES[mode].compute_dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # separate tensors per sequence (one allocation each), as a user holding per-image tokens has them
    split = [[t.clone() for t in torch.split(x, lens)] for x, lens in ((q, LENS_Q), (k, LENS_K), (v, LENS_K))]
    import visionattn.varlen as vl
    from visionattn.kernels._launch import PlanCache

    placed = PlanCache()
    monkeypatch.setattr(vl, "CALLS", placed)
    outs = varlen_attention(*split, mode=mode, is_causal=causal, backend="triton")
    assert in_place() and (placed.builds, placed.hits) == (1, 0)
    # the table lists the sequences longest first; the kernel's tile table keeps that order
    from visionattn.kernels.varlen_fwd import longest_first

    (plan,) = placed.plans.values()
    assert plan[5] == longest_first(LENS_Q, LENS_K) and plan[2] == [LENS_Q[s] for s in plan[5]]
    # a runner per causal flag, on the kernel plan with a tile table (its repeat below reads the same table)
    from visionattn.kernels import varlen_fwd

    assert list(plan[4]) == [causal] and all(p.main.constexprs["TILED"] for p in varlen_fwd.PLANS.plans.values())
    again = varlen_attention(*split, mode=mode, is_causal=causal, backend="triton")  # the same list: its plan
    assert (placed.builds, placed.hits) == (1, 1) and all(torch.equal(a, b) for a, b in zip(outs, again))
    assert [o.shape for o in outs] == [(n, 2, 24) for n in LENS_Q]
    ref = varlen_attention(q, k, v, cu_q, cu_k, mode=mode, is_causal=causal, backend="triton")
    assert torch.equal(torch.cat(outs), ref)
    oracle = per_sequence(lambda a, b, c: oracle_attention(a, b, c, is_causal=causal), q, k, v, cu_q, cu_k, 24)
    assert rel_l2(torch.cat(outs).double(), oracle) <= MODES[mode].rel_tol


def test_list_of_sequences_packs_what_it_cannot_read_in_place(monkeypatch):
    in_place = _read_in_place(monkeypatch)
    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K)
    seqs = [[t.clone() for t in torch.split(x, lens)] for x, lens in ((q, LENS_Q), (k, LENS_K), (v, LENS_K))]
    ref = varlen_attention(q, k, v, cu_q, cu_k, backend="triton")
    # one sequence in another layout (heads outermost): the batch is packed, same result
    odd = [t.clone() for t in seqs[0]]
    odd[4] = odd[4].transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(torch.cat(varlen_attention(odd, seqs[1], seqs[2], backend="triton")), ref)
    assert not in_place()
    # float64 sequences in an fp32 mode: cast, hence packed; the output keeps float64
    out64 = varlen_attention([t.double() for t in seqs[0]], [t.double() for t in seqs[1]],
                             [t.double() for t in seqs[2]], backend="triton")
    assert out64[0].dtype == torch.float64 and torch.equal(torch.cat(out64).float(), ref)
    # gradients: packed with torch.cat, so each sequence gets its own gradient
    leaves = [[t.clone().requires_grad_(True) for t in group] for group in seqs]
    outs = varlen_attention(*leaves, backend="triton")
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad(torch.cat(outs), leaves[0] + leaves[1] + leaves[2], do)
    flat = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_grads = torch.autograd.grad(varlen_attention(*flat, cu_q, cu_k, backend="triton"), flat, do)
    n = len(LENS_Q)
    for i, (group, lens) in enumerate(((grads[:n], LENS_Q), (grads[n:2 * n], LENS_K), (grads[2 * n:], LENS_K))):
        assert torch.equal(torch.cat(group), ref_grads[i]) and [g.shape[0] for g in group] == lens


def test_list_of_sequences_errors_name_the_argument():
    seqs = [torch.randn(n, 2, 16) for n in (3, 5)]
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        varlen_attention(seqs, seqs, seqs, offsets([3, 5]), offsets([3, 5]))
    with pytest.raises(TypeError, match="k must be one too"):
        varlen_attention(seqs, torch.cat(seqs), seqs)
    with pytest.raises(ValueError, match="same number"):
        varlen_attention(seqs, seqs[:1], seqs)
    with pytest.raises(TypeError, match=r"sequence 1.*dtype"):
        varlen_attention(seqs, [seqs[0], seqs[1].double()], seqs)
    with pytest.raises(ValueError, match=r"sequence 1.*expected"):
        varlen_attention(seqs, [seqs[0], torch.randn(5, 2, 8)], seqs)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        varlen_attention(seqs, seqs, seqs, max_seqlen_q=2, backend="triton")
    assert varlen_attention([], [], []) == []


def test_validation_errors_name_the_argument():
    q, k, v, cu_q, cu_k = packed([3, 4], [2, 5])
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        varlen_attention(q, k, v, cu_q.long(), cu_k)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\]"):
        varlen_attention(q, k, v, cu_q, offsets([2, 4]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\]"):
        varlen_attention(q, k, v, cu_q + 1, cu_k)
    with pytest.raises(ValueError, match="non-decreasing"):
        varlen_attention(q, k, v, torch.tensor([0, 5, 3, 7], dtype=torch.int32), offsets([2, 2, 3]))
    with pytest.raises(ValueError, match="sequences"):
        varlen_attention(q, k, v, cu_q, offsets([7]))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=3)
    with pytest.raises(TypeError, match="max_seqlen_k"):
        varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_k=5.0)
    with pytest.raises(ValueError, match="3 dims"):
        varlen_attention(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="heads"):
        varlen_attention(q, k[:, :1], v, cu_q, cu_k)
    with pytest.raises(TypeError, match="dtype"):
        varlen_attention(q, k.half(), v, cu_q, cu_k)
    with pytest.raises(ValueError, match="required"):
        varlen_attention(q, k, v)
    with pytest.raises(ValueError, match="pasa"):
        varlen_attention(q, k, v, cu_q, cu_k, mode="pasa")
    with pytest.raises(TypeError, match="is_causal"):
        varlen_attention(q, k, v, cu_q, cu_k, is_causal=1)


def test_packed_calls_without_gradients_launch_from_a_runner_that_follows_new_offsets():
    """A packed call without gradients keeps a runner (``varlen.RUNS``) that a later call of the same signature and
    offsets launches from (same output, any scale); new values in the same offsets tensors are a new call, checked
    and planned, whose output follows them; bad new values still raise; a call that needs gradients keeps none."""
    from visionattn import varlen as varlen_module

    q, k, v, cu_q, cu_k = packed(LENS_Q, LENS_K, dv=24, seed=3)
    tol = MODES["fp32"].rel_tol

    def oracle(scale=None):
        return per_sequence(lambda a, b, c: oracle_attention(a, b, c, scale=scale), q, k, v, cu_q, cu_k, 24)

    runs = varlen_module.RUNS
    runs.plans.clear()
    builds, hits = runs.builds, runs.hits
    first = varlen_attention(q, k, v, cu_q, cu_k, mode="fp32", backend="triton")
    assert (runs.builds, runs.hits) == (builds + 1, hits)
    again = varlen_attention(q, k, v, cu_q, cu_k, mode="fp32", backend="triton")
    assert runs.hits == hits + 1 and torch.equal(again, first)
    assert rel_l2(again.double(), oracle()) <= tol
    scaled = varlen_attention(q, k, v, cu_q, cu_k, mode="fp32", backend="triton", scale=0.3)
    assert runs.hits == hits + 2 and rel_l2(scaled.double(), oracle(0.3)) <= tol
    # the same tensors, other offsets (same totals): a new key, the output of the new sequences
    cu_q.copy_(offsets([20, 6, 0, 30, 1, 9]))
    cu_k.copy_(offsets([50, 1, 40, 0, 20, 3]))
    moved = varlen_attention(q, k, v, cu_q, cu_k, mode="fp32", backend="triton")
    assert runs.builds == builds + 2 and rel_l2(moved.double(), oracle()) <= tol
    assert not torch.equal(moved, first)
    # the first offsets again, in new tensors, while the first call's tensors hold other values: the runner of the
    # first offsets reads this call's tensors, not the first call's
    cu_q2, cu_k2 = offsets(LENS_Q), offsets(LENS_K)
    back = varlen_attention(q, k, v, cu_q2, cu_k2, mode="fp32", backend="triton")
    assert runs.builds == builds + 2 and torch.equal(back, first)
    cu_k[2] = cu_k[1] - 1
    with pytest.raises(ValueError, match="non-decreasing"):
        varlen_attention(q, k, v, cu_q, cu_k, mode="fp32", backend="triton")
    cu_k.copy_(offsets([50, 1, 40, 0, 20, 3]))
    varlen_attention(q.clone().requires_grad_(), k, v, cu_q, cu_k, mode="fp32", backend="triton").sum().backward()
    assert runs.builds == builds + 2


def test_import_does_not_load_triton():
    import subprocess
    import sys
    code = "import visionattn, sys; visionattn.varlen_attention; print('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# ----------------------------------------------------------------------------- GPU, the supplement's batch
TABLE2_LENS = [785, 500, 708, 542, 1732, 262, 1039, 557]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_supplement_batch(mode, causal):
    q, k, v, cu_q, cu_k = packed(TABLE2_LENS, TABLE2_LENS, h=16, d=64, device="cuda")
    dtype = MODES[mode].compute_dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(TABLE2_LENS), max(TABLE2_LENS), mode=mode, is_causal=causal)
    oracle = per_sequence(lambda a, b, c: oracle_attention(a, b, c, is_causal=causal), q, k, v, cu_q, cu_k, 64)
    assert rel_l2(out.double(), oracle) <= MODES[mode].rel_tol
    dense = per_sequence(lambda a, b, c: visionattn.attention(a, b, c, mode=mode, is_causal=causal),
                         q, k, v, cu_q, cu_k, 64)
    assert rel_l2(out.double(), dense) <= 2 * MODES[mode].rel_tol


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16"])
def test_gpu_list_of_sequences_in_place(monkeypatch, mode):
    in_place = _read_in_place(monkeypatch)
    q, k, v, cu_q, cu_k = packed(TABLE2_LENS, TABLE2_LENS, h=16, d=64, device="cuda")
    dtype = MODES[mode].compute_dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    seqs = [[t.clone() for t in torch.split(x, TABLE2_LENS)] for x in (q, k, v)]
    ref = varlen_attention(q, k, v, cu_q, cu_k, max(TABLE2_LENS), max(TABLE2_LENS), mode=mode)
    for _ in range(3):  # the first call builds the plan, later ones launch from it
        outs = varlen_attention(*seqs, mode=mode)
        assert in_place() and torch.equal(torch.cat(outs), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_gpu_offsets_on_the_host_need_no_synchronisation(mode):
    """Offsets given on the CPU for CUDA tensors: the lengths reach the kernels (bf16: the Gluon varlen kernel) with
    no synchronisation after the first call (CUDA's sync debug mode raises on one), outputs at the oracle's
    tolerance, the offsets copied to the GPU once."""
    from visionattn import varlen as varlen_module
    from visionattn.kernels import varlen_fwd

    q, k, v, cu_q, cu_k = packed(TABLE2_LENS, TABLE2_LENS, h=16, d=64, device="cuda")
    dtype = MODES[mode].compute_dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    host = cu_q.cpu()
    varlen_fwd.PLANS.clear()
    varlen_fwd._GLUON_ROUTES.clear()
    first = varlen_attention(q, k, v, host, host, max(TABLE2_LENS), max(TABLE2_LENS), mode=mode)
    torch.cuda.synchronize()
    copies = varlen_module._DEVICE_OFFSETS.builds
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = varlen_attention(q, k, v, host, host, max(TABLE2_LENS), max(TABLE2_LENS), mode=mode)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, first) and varlen_module._DEVICE_OFFSETS.builds == copies
    oracle = per_sequence(oracle_attention, q, k, v, cu_q, cu_k, 64)
    assert rel_l2(first.double(), oracle) <= MODES[mode].rel_tol
    kinds = {type(p).__name__ for p in varlen_fwd.PLANS.plans.values()}
    assert kinds == ({"VarlenGluonPlan"} if mode == "bf16" else {"_VarlenPlan"})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_gpu_a_captured_graph_keeps_its_tables_through_cache_churn(monkeypatch, mode):
    """A CUDA graph captured from calls with host offsets (the tile table in fp32, the Gluon kernel's work tables in
    bf16, the offsets' device copy) replays the same output after later calls with other lengths overflow every
    cache that holds such tables: the entries the capture used are pinned, not freed and reused."""
    from visionattn import varlen as varlen_module
    from visionattn.kernels import varlen_fwd, varlen_gluon

    for cache in (varlen_fwd.PLANS, varlen_fwd._TILES, varlen_fwd._GLUON_ROUTES, varlen_gluon._WORK,
                  varlen_module._DEVICE_OFFSETS):
        monkeypatch.setattr(cache, "max_size", 2)
    dtype = MODES[mode].compute_dtype
    q, k, v, cu_q, _ = packed(TABLE2_LENS, TABLE2_LENS, h=16, d=64, device="cuda")
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    host = cu_q.cpu()
    call = lambda: varlen_attention(q, k, v, host, host, max(TABLE2_LENS), max(TABLE2_LENS), mode=mode)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        want = call().clone()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    for i in range(12):  # other lengths: new tables, each cache past its size
        lens = [n + 7 * (i + 1) for n in TABLE2_LENS]
        a, b, c, _, _ = packed(lens, lens, h=16, d=64, device="cuda")
        offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        varlen_attention(a.to(dtype), b.to(dtype), c.to(dtype), offsets, offsets, max(lens), max(lens), mode=mode)
    got.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_gpu_packed_runners_on_device_offsets_and_on_stream_k_lengths(mode):
    """Offsets on the GPU with both maxima given (values trusted, not read): the runner launches later calls with the
    caller's offsets, so new values in the same tensors give the new sequences' output. Host offsets of a few-query
    ragged batch (the stream-K schedule): later calls launch from the runner, bit-identical to the first."""
    from visionattn import varlen as varlen_module
    from visionattn.kernels import varlen_fwd

    dtype = MODES[mode].compute_dtype
    runs = varlen_module.RUNS
    q, k, v, cu_q, cu_k = packed(TABLE2_LENS, TABLE2_LENS, h=16, d=64, device="cuda")
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    longest = max(TABLE2_LENS)
    first = varlen_attention(q, k, v, cu_q, cu_k, longest, longest, mode=mode)
    hits = runs.hits
    moved_lens = [longest, 262, 1039, 557, 785, 500, 708, 542]  # a permutation: same totals and maximum
    cu_q.copy_(offsets(moved_lens, "cuda"))
    cu_k.copy_(offsets(moved_lens, "cuda"))
    moved = varlen_attention(q, k, v, cu_q, cu_k, longest, longest, mode=mode)
    assert runs.hits == hits + 1 and not torch.equal(moved, first)
    assert rel_l2(moved.double(), per_sequence(oracle_attention, q, k, v, cu_q, cu_k, 64)) <= MODES[mode].rel_tol
    lens_q, lens_k = [1, 4, 16, 2, 1, 9, 3, 1], [4096, 300, 2048, 77, 9000, 512, 1024, 128]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, h=16, d=64)
    q, k, v = q.to("cuda", dtype), k.to("cuda", dtype), v.to("cuda", dtype)
    varlen_fwd.PLANS.clear()
    first = varlen_attention(q, k, v, cu_q, cu_k, mode=mode)
    assert {type(p).__name__ for p in varlen_fwd.PLANS.plans.values()} == {"StreamPlan"}
    hits = runs.hits
    again = varlen_attention(q, k, v, cu_q, cu_k, mode=mode)
    assert runs.hits == hits + 1 and torch.equal(again, first)
    oracle = per_sequence(oracle_attention, q, k, v, cu_q.cuda(), cu_k.cuda(), 64)
    assert rel_l2(again.double(), oracle) <= MODES[mode].rel_tol


@pytest.mark.gpu
def test_gpu_zero_lengths_and_new_lengths_compile_nothing():
    from visionattn.kernels.varlen_fwd import _varlen_fwd_kernel
    lens_q, lens_k = [785, 0, 1, 300, 0], [500, 10, 0, 1732, 0]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, h=16, d=64, device="cuda")
    out = varlen_attention(q, k, v, cu_q, cu_k)
    oracle = per_sequence(oracle_attention, q, k, v, cu_q, cu_k, 64)
    assert rel_l2(out.double(), oracle) <= MODES["fp32"].rel_tol
    assert torch.all(out[cu_q[2]:cu_q[3]] == 0)
    before = sum(len(c[0]) for c in _varlen_fwd_kernel.device_caches.values()) if hasattr(
        _varlen_fwd_kernel, "device_caches") else None
    lens_q2, lens_k2 = [700, 3, 2, 333, 9], [513, 17, 1, 1500, 4]
    q, k, v, cu_q, cu_k = packed(lens_q2, lens_k2, h=16, d=64, device="cuda")
    out = varlen_attention(q, k, v, cu_q, cu_k)
    oracle = per_sequence(oracle_attention, q, k, v, cu_q, cu_k, 64)
    assert rel_l2(out.double(), oracle) <= MODES["fp32"].rel_tol
    if before is not None:
        assert sum(len(c[0]) for c in _varlen_fwd_kernel.device_caches.values()) == before


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_few_programs_split_the_keys(mode, causal):
    """One long and one short sequence, one head: too few query tiles for the SMs, so the automatic choice
    splits the keys (the plan holds the merge); outputs and the training path's gradients as the oracle's."""
    from visionattn.kernels import varlen_fwd

    lens = [6000, 7]
    q, k, v, cu_q, cu_k = packed(lens, lens, h=1, d=64, device="cuda")
    dtype = MODES[mode].compute_dtype
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    varlen_fwd.PLANS.clear()
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lens), max(lens), mode=mode, is_causal=causal)
    assert any(p.merge is not None for p in varlen_fwd.PLANS.plans.values())
    oracle = per_sequence(lambda a, b, c: oracle_attention(a, b, c, is_causal=causal), q.detach(), k.detach(),
                          v.detach(), cu_q, cu_k, 64)
    assert rel_l2(out.detach().double(), oracle) <= MODES[mode].rel_tol
    # the backward reads the merged LSE: gradients as the dense kernels' per sequence
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dense = per_sequence(lambda a, b, c: visionattn.attention(a, b, c, mode=mode, is_causal=causal), *leaves,
                         cu_q, cu_k, 64)
    ref = torch.autograd.grad(dense.float().square().sum(), leaves)
    for got, want in zip(grads, ref):
        assert rel_l2(got.double(), want.double()) <= 4 * MODES[mode].rel_tol
