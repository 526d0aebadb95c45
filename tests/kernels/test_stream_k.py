"""The stream-K schedule of the ragged forward (:mod:`visionattn.kernels.stream_k`).

CPU: the host partition walked as the kernel walks it (every key tile of every job folded once, shares of equal
cost, each cut job's slots consecutive in the merge table), the kernel and merge in the interpreter against the
float64 oracle (every dense mode, causal, sequences without queries or keys, the LSE, shares cut anywhere), the
schedule arguments and the rule, the list path's wiring. GPU (``-m gpu``): the compiled kernels against the oracle
at the benchmark's shapes, bit-identical repeats, and the rule's choice on a few-query list. The compiled kernels
also build offline for sm_90 on the CPU (the interpreter runs code that a compile can reject).
"""
import random

import pytest
import torch
from offline_compile import compile_in_child

import visionattn
from visionattn.kernels import stream_k, varlen_fwd
from visionattn.kernels._launch import cdiv
from visionattn.metrics import rel_l2
from visionattn.modes import MODES
from visionattn.reference import oracle_attention


def _jobs(lens_q, lens_k, heads, block_m, block_n, causal):
    """The jobs (sequence, head, first row, key tiles) in launch order, counted directly from the lengths."""
    out = []
    for s, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        for h in range(heads):
            for start in range(0, lq, block_m):
                visible = min(lk, start + block_m) if causal else lk
                out.append((s, h, start, max(1, -(-visible // block_n))))
    return out


def _walk(part):
    """Walk the table as :func:`stream_k._stream_fwd_kernel` does: ``(covered, whole, pieces, shares)`` —
    (job, tile) pairs in visiting order, jobs written whole, ``{job: [slots]}`` of cut ones, iterations per program."""
    t = part.table.tolist()
    G, J = part.programs, part.jobs
    prog_it, prog_job, prog_slot = t[:G + 1], t[G + 1:2 * G + 1], t[2 * G + 1:3 * G + 1]
    job_it = t[3 * G + 1:3 * G + J + 2]
    covered, whole, pieces, shares = [], [], {}, []
    for g in range(G):
        it, end, job, slot = prog_it[g], prog_it[g + 1], prog_job[g], prog_slot[g]
        shares.append(end - it)
        while it < end:
            lo, hi = job_it[job], job_it[job + 1]
            seg_end = min(end, hi)
            covered += [(job, i - lo) for i in range(it, seg_end)]
            if it == lo and seg_end == hi:
                whole.append(job)
            else:
                pieces.setdefault(job, []).append(slot)
                slot += 1
            it, job = seg_end, job + 1
    return covered, whole, pieces, shares


CASES = [([5, 0, 17, 1, 40, 3], [7, 3, 0, 1, 33, 70], 2, 16, 16),
         ([1] * 9, [900, 16, 20, 4000, 1, 0, 64, 65, 300], 3, 16, 64),
         ([785, 500, 708, 1732, 262], [785, 500, 708, 1732, 262], 4, 128, 64),
         ([16, 16], [65536, 17], 16, 16, 64)]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("programs", [1, 2, 7, 132, 264, 10 ** 6])
@pytest.mark.parametrize("job_cost", [0, 2, 5])
def test_partition_folds_every_key_tile_once_in_equal_shares(case, causal, programs, job_cost):
    lens_q, lens_k, heads, block_m, block_n = CASES[case]
    part = stream_k.partition(lens_q, lens_k, heads, block_m, block_n, causal, programs, job_cost)
    jobs = _jobs(lens_q, lens_k, heads, block_m, block_n, causal)
    T = sum(j[3] for j in jobs)
    assert (part.jobs, part.iterations) == (len(jobs), T)
    assert part.programs == min(programs, T) if job_cost == 0 else 1 <= part.programs <= min(programs, T)
    G, J = part.programs, part.jobs
    info = part.table[3 * G + 1 + J + 1:3 * G + 1 + J + 1 + 3 * J].view(J, 3).tolist()
    assert [tuple(r) for r in info] == [j[:3] for j in jobs]
    covered, whole, pieces, shares = _walk(part)
    assert sorted(covered) == [(j, i) for j, job in enumerate(jobs) for i in range(job[3])]  # each tile once
    assert min(shares) >= 1
    # equal costs: a share's iterations plus job_cost per job begun in it, within job_cost + 1 of the mean
    starts = [sum(j[3] for j in jobs[:n]) for n in range(J)]
    bounds = part.table[:G + 1].tolist()
    costs = [hi - lo + job_cost * sum(lo <= a < hi for a in starts) for lo, hi in zip(bounds, bounds[1:])]
    assert sum(costs) == T + job_cost * J
    mean = (T + job_cost * J) / min(programs, T)
    assert all(c <= mean + job_cost + 1 for c in costs), (costs, mean)
    if G == min(programs, T):  # no share dropped: none below the mean either
        assert all(c >= mean - job_cost - 1 for c in costs), (costs, mean)
    assert sorted(whole + list(pieces)) == list(range(J))  # every job written whole or merged
    assert all(len(s) >= 2 for s in pieces.values())  # a cut job has a piece on each side of a cut
    merge = part.table[3 * G + 1 + J + 1 + 3 * J:].view(-1, 5).tolist()
    assert part.split_jobs == len(merge) == len(pieces) and part.slots <= 2 * G
    for seq, head, start, lo, n in merge:
        job = jobs.index((seq, head, start, next(j[3] for j in jobs if j[:3] == (seq, head, start))))
        assert pieces[job] == list(range(lo, lo + n))  # consecutive slots, in program order
    assert sum(len(s) for s in pieces.values()) == part.slots


def test_partition_of_calls_without_queries_and_bad_arguments():
    assert stream_k.partition([0, 0], [5, 9], 4, 16, 16, False, 8).jobs == 0
    with pytest.raises(ValueError, match="one of each per sequence"):
        stream_k.partition([1, 2], [3], 1, 16, 16, False, 4)
    with pytest.raises(ValueError, match=">= 0"):
        stream_k.partition([1, -2], [3, 4], 1, 16, 16, False, 4)
    with pytest.raises(ValueError, match="programs=0"):
        stream_k.partition([1], [3], 1, 16, 16, False, 0)
    with pytest.raises(ValueError, match="int32"):
        stream_k.partition([16], [2 ** 31 * 16], 1, 16, 16, False, 4)
    with pytest.raises(ValueError, match="job_cost"):
        stream_k.partition([1], [3], 1, 16, 16, False, 4, -1)


def test_job_cost_gives_programs_of_many_short_jobs_fewer_iterations():
    """One long sequence among short ones, one query each: with a cost per job begun, the programs whose shares hold
    the short sequences' jobs take fewer iterations than those inside the long one's, and the costs even out."""
    lens_k = [8192] + [300] * 40
    plain = stream_k.partition([1] * 41, lens_k, 4, 16, 128, False, 16)
    costed = stream_k.partition([1] * 41, lens_k, 4, 16, 128, False, 16, job_cost=2)
    its = lambda p: [b - a for a, b in zip(p.table[:p.programs].tolist(), p.table[1:p.programs + 1].tolist())]  # noqa
    assert max(its(plain)) - min(its(plain)) <= 1
    assert its(costed)[0] > its(costed)[-1]  # the first shares lie in the long sequence's jobs



def test_query_block_follows_the_longest_query_sequence():
    assert [stream_k.query_block(n, 128) for n in (1, 16, 17, 33, 64, 65, 5000)] == [16, 16, 32, 64, 64, 128, 128]
    assert stream_k.query_block(100, 64) == 64


def test_half_few_query_tiles_fold_longer_key_tiles():
    long_tile = stream_k.HALF_KEY_BLOCK
    assert [stream_k.key_block("half", m, 64, 64, 64) for m in (16, 64, 128)] == [long_tile, long_tile, 64]
    assert stream_k.key_block("half", 16, 128, 128, 128) == 128 and stream_k.key_block("half", 16, 64, 128, 64) == 64
    assert stream_k.key_block("f16x3", 16, 64, 64, 64) == 64
    q, k, v, _, _ = _packed([3, 1], [300, 20], 2, 64, torch.bfloat16, seed=0)
    plan = stream_k.stream_plan(q, k, v, [3, 1], [300, 20], 4, False, "bf16", torch.bfloat16, False, False,
                                programs=3)
    assert plan.part.block_n == long_tile and plan.main.constexprs["BLOCK_N"] == long_tile


def _packed(lens_q, lens_k, heads, d, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, d, generator=g)
    k = torch.randn(sum(lens_k), heads, d, generator=g)
    v = torch.randn(sum(lens_k), heads, d, generator=g)
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=device)
          for x in (lens_q, lens_k)]
    return (*(t.to(device, dtype) for t in (q, k, v)), *cu)


def _oracle(q, k, v, cu_q, cu_k, scale, causal):
    """float64 output [total_q, H, Dv] (0 without keys) and natural-log LSE [H, total_q] (-inf without keys)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for s in range(len(bq) - 1):
        a, b, c, d = bq[s], bq[s + 1], bk[s], bk[s + 1]
        if a == b or c == d:
            continue
        qs, ks, vs = (t.transpose(0, 1).double() for t in (q[a:b], k[c:d], v[c:d]))
        out[a:b] = oracle_attention(qs[None], ks[None], vs[None], scale=scale, is_causal=causal)[0].transpose(0, 1)
        logits = scale * qs @ ks.transpose(1, 2)
        if causal:
            logits = logits.masked_fill(torch.ones(b - a, d - c, dtype=torch.bool, device=q.device).triu(1),
                                        float("-inf"))
        lse[:, a:b] = torch.logsumexp(logits, -1)
    return out, lse


def _check(out, lse, ref, ref_lse, mode):
    tol = MODES[mode].rel_tol
    assert rel_l2(out.double(), ref) <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    atol = 1e-5 if mode in ("fp32", "fp32-ieee") else 1e-2  # tf32 / fp16 / bf16 logits keep 11 / 8 bits
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=atol, rtol=0)
    assert torch.all(out[ref.abs().sum((1, 2)) == 0] == 0)  # rows without keys are zeros


LENS_Q = [5, 0, 17, 1, 150, 3]
LENS_K = [7, 3, 0, 1, 150, 70]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the GPU tests below run the compiled code)")
@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16", "fp32-ieee"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("programs", [1, 5, 23])
def test_stream_forward_matches_float64_in_the_interpreter(mode, causal, programs):
    dtype = MODES[mode].compute_dtype
    q, k, v, cu_q, cu_k = _packed(LENS_Q, LENS_K, 2, 16, dtype, seed=programs)
    plan = stream_k.stream_plan(q, k, v, LENS_Q, LENS_K, q.shape[0], causal, mode, dtype, True, False,
                                programs=programs)
    part = plan.part
    assert 1 <= part.programs <= min(programs, part.iterations) and (plan.merge is None) == (part.split_jobs == 0)
    assert part.split_jobs > 0 or programs == 1  # shares cut inside jobs, causal too
    out, lse = plan(q, k, v, cu_q, cu_k, 0.25)
    _check(out, lse, *_oracle(q, k, v, cu_q, cu_k, 0.25, causal), mode)


@pytest.mark.parametrize("rows, tile_m, block_m, want", [(1, 16, 1, 1), (3, 16, 4, 1), (16, 16, 16, 1),
                                                        (100, 128, 64, 2), (128, 128, 64, 2), (40, 64, 64, 1)])
def test_merge_grid_covers_only_the_rows_a_job_can_hold(rows, tile_m, block_m, want):
    assert stream_k.merge_row_blocks(tile_m, rows, block_m) == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_one_query_a_sequence_merges_one_row_block_a_job(mode):
    """One query per sequence (decoding, class attention): the forward's 16-row query tile holds one row, so the
    merge launches one row block per cut job (not one per row of the tile, whose programs would loop over the
    partials with every load masked), and the merged rows equal the float64 oracle's."""
    dtype = MODES[mode].compute_dtype
    lens_q, lens_k = [1] * 5, [900, 40, 17, 700, 300]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 2, 16, dtype, seed=4)
    plan = stream_k.stream_plan(q, k, v, lens_q, lens_k, q.shape[0], False, mode, dtype, True, False, programs=9)
    assert plan.merge is not None and plan.part.block_m == 16
    assert plan.merge.grid == (plan.part.split_jobs,) and plan.merge.constexprs["ROW_BLOCKS"] == 1
    out, lse = plan(q, k, v, cu_q, cu_k, 0.25)
    _check(out, lse, *_oracle(q, k, v, cu_q, cu_k, 0.25, False), mode)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_schedule_arguments_through_varlen_forward():
    q, k, v, cu_q, cu_k = _packed(LENS_Q, LENS_K, 2, 16, torch.float32, seed=3)
    lengths = (tuple(LENS_Q), tuple(LENS_K))
    varlen_fwd.PLANS.clear()
    out, _ = varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, 150, 150, False, 0.25, "fp32", lengths=lengths,
                                       schedule="stream-k")
    ref, _ = _oracle(q, k, v, cu_q, cu_k, 0.25, False)
    assert rel_l2(out.double(), ref) <= MODES["fp32"].rel_tol
    builds = varlen_fwd.PLANS.builds
    varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, 150, 150, False, 0.25, "fp32", lengths=lengths, schedule="stream-k")
    assert varlen_fwd.PLANS.builds == builds  # the partition is built once per signature
    for bad, match in ((dict(schedule="fastest"), "schedule='fastest'"),
                       (dict(schedule="stream-k"), "pass lengths"),
                       (dict(schedule="stream-k", lengths=lengths, num_splits=2), "pass lengths"),
                       (dict(schedule="stream-k", lengths=((1, 2), (3, 4))), "one length per sequence")):
        with pytest.raises(ValueError, match=match):
            varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, 150, 150, False, 0.25, "fp32", **bad)
    varlen_fwd.PLANS.clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_calls_as_equal_sequences_in_the_interpreter(mode, causal):
    """A dense [B, H, N, D] call through the stream-K kernel (its batch items as sequences read in place, here from
    a non-contiguous [B, N, H, D] buffer): the output equals the oracle's and has the dense kernels' layout."""
    dtype = MODES[mode].compute_dtype
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 5, 2, 16, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(3, 2, 150, 16, generator=g).to(dtype) for _ in range(2))
    plan = stream_k.dense_plan(q, k, v, None, None, causal, mode, dtype, False, programs=7, rule=False)
    out, lse = plan(q, k, v, None, None, 0.25)
    assert lse is None and out.shape == (3, 2, 5, 16) and out.transpose(1, 2).is_contiguous()
    ref = oracle_attention(q.double(), k.double(), v.double(), scale=0.25, is_causal=causal)
    assert rel_l2(out.double(), ref) <= MODES[mode].rel_tol
    assert plan.stream.part.split_jobs > 0 or causal  # shares cut inside jobs (causal: one key tile a job)
    # its device tables outlive the plan caches (a CUDA graph may replay them): kept by the module
    kept = stream_k._DENSE_TABLES[-1]
    assert kept[0] is plan.stream.table and kept[2] is plan.cu_q and kept[4] is plan.row_offsets
    for refused in (dict(bias=torch.zeros(5, 150)), dict(with_lse=True)):
        kw = {"bias": None, "attn_mask": None, "with_lse": False, **refused}
        assert stream_k.dense_plan(q, k, v, kw["bias"], kw["attn_mask"], causal, mode, dtype, kw["with_lse"],
                                   rule=False) is None
    assert stream_k.dense_plan(q, k[:, :1], v[:, :1], None, None, causal, mode, dtype, False, rule=False) is None


def test_rule_needs_cuda_and_idle_sms():
    cpu = torch.device("cpu")
    assert not stream_k.choose([1] * 8, [4096] * 8, 16, "bf16", 64, 64, cpu)  # never off CUDA
    # ragged calls: few queries, the longest sequence's single-pass programs fewer than the SMs
    assert stream_k.ragged_prefers([1] * 8, [8192, 16, 300, 0, 5, 5, 5, 5], 16, 128, 64, 132)
    assert stream_k.ragged_prefers([64, 3], [100, 100], 8, 128, 64, 132)
    assert not stream_k.ragged_prefers([65, 3], [100, 100], 8, 128, 64, 132)  # self-attention tiles: the single pass
    assert not stream_k.ragged_prefers([16] * 4, [100] * 4, 132, 128, 64, 132)  # the heads fill the SMs
    assert not stream_k.ragged_prefers([0, 0], [5, 5], 1, 128, 64, 132)  # no queries
    assert not stream_k.ragged_prefers([1], [0], 1, 128, 64, 132)  # no keys
    assert not stream_k.ragged_prefers([16], [2 ** 31 * 64], 1, 128, 64, 132)  # past the int32 table
    # dense calls: few queries, enough jobs to share out, and fp16 / bf16 only over long keys
    assert stream_k.dense_prefers(16, 1, 1024, "f16x3") and not stream_k.dense_prefers(15, 1, 65536, "f16x3")
    assert stream_k.dense_prefers(64, 64, 16384, "half") and not stream_k.dense_prefers(64, 16, 16383, "half")
    assert not stream_k.dense_prefers(64, 65, 65536, "f16x3")  # self-attention tiles: the single pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_list_path_runs_stream_k_when_the_rule_picks_it(monkeypatch, kernel_launches):
    """A list of sequences hands its host-side lengths to the kernel layer: where the rule picks stream-K the
    stream kernel runs (forced here: the rule never picks it off CUDA) and the outputs match the oracle."""
    monkeypatch.setattr(stream_k, "choose", lambda *a: True)
    varlen_fwd.PLANS.clear()
    q, k, v, cu_q, cu_k = _packed(LENS_Q, LENS_K, 2, 16, torch.float32, seed=5)
    qs, ks, vs = (list(t.split(x)) for t, x in ((q, LENS_Q), (k, LENS_K), (v, LENS_K)))
    outs = visionattn.varlen_attention(qs, ks, vs, mode="fp32", scale=0.25)
    names = [name for name, *_ in kernel_launches]
    assert "_stream_fwd_kernel" in names and "_varlen_fwd_kernel" not in names
    ref, _ = _oracle(q, k, v, cu_q, cu_k, 0.25, False)
    assert rel_l2(torch.cat(outs).double(), ref) <= MODES["fp32"].rel_tol
    # the same list again: the list's runner launches the stream kernel from its plan (no plan lookup), same bits
    kernel_launches.clear()
    looked_up = varlen_fwd.PLANS.hits + varlen_fwd.PLANS.builds
    again = visionattn.varlen_attention(qs, ks, vs, mode="fp32", scale=0.25)
    assert varlen_fwd.PLANS.hits + varlen_fwd.PLANS.builds == looked_up
    assert "_stream_fwd_kernel" in [name for name, *_ in kernel_launches]
    assert all(torch.equal(a, b) for a, b in zip(outs, again))
    varlen_fwd.PLANS.clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_packed_calls_hand_host_lengths_on_when_the_offsets_were_read(monkeypatch, kernel_launches):
    """A packed call whose offsets the public function read on the host (a maximum not given) hands the lengths to
    the kernel layer: the stream kernel runs where the rule picks it (forced here; CPU offsets are always read).
    With gradients the varlen kernel runs, as before (its LSE feeds the varlen backward)."""
    monkeypatch.setattr(stream_k, "choose", lambda *a: True)
    varlen_fwd.PLANS.clear()
    q, k, v, cu_q, cu_k = _packed(LENS_Q, LENS_K, 2, 16, torch.float32, seed=6)
    ref, _ = _oracle(q, k, v, cu_q, cu_k, 0.25, False)
    out = visionattn.varlen_attention(q, k, v, cu_q, cu_k, mode="fp32", scale=0.25)
    assert rel_l2(out.double(), ref) <= MODES["fp32"].rel_tol
    assert [name for name, *_ in kernel_launches if name.endswith("fwd_kernel")] == ["_stream_fwd_kernel"]
    kernel_launches.clear()
    q.requires_grad_()
    out = visionattn.varlen_attention(q, k, v, cu_q, cu_k, mode="fp32", scale=0.25)
    assert rel_l2(out.detach().double(), ref) <= MODES["fp32"].rel_tol
    assert [name for name, *_ in kernel_launches if name.endswith("fwd_kernel")] == ["_varlen_fwd_kernel"]
    varlen_fwd.PLANS.clear()


GPU_CASES = [([1] * 8, [8192, 40, 100, 16, 300, 1000, 16, 64]),  # one long, many short keys
             ([16] * 32, [random.Random(s).randint(16, 8192) for s in range(32)]),
             ([785, 500, 708, 542, 1732, 262, 1039, 557], [785, 500, 708, 542, 1732, 262, 1039, 557]),
             ([1, 1, 1, 1], [65536, 65536, 65536, 65536]),
             ([7, 0, 64, 3], [4000, 5000, 0, 1])]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,head_dim", [("fp32", 64), ("fp32", 128), ("tf32", 64), ("fp16", 64), ("bf16", 64),
                                           ("bf16", 128), ("fp32-ieee", 64)])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_stream_forward_matches_float64_on_the_gpu(mode, case, head_dim):
    lens_q, lens_k = GPU_CASES[case]
    dtype = MODES[mode].compute_dtype
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 16, head_dim, dtype, seed=case, device="cuda")
    lengths = (tuple(lens_q), tuple(lens_k))
    scale = head_dim ** -0.5
    ref, ref_lse = _oracle(q, k, v, cu_q, cu_k, scale, False)
    for causal in (False, True):
        if causal:
            ref, ref_lse = _oracle(q, k, v, cu_q, cu_k, scale, True)
        runs = [varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, scale, mode,
                                          with_lse=True, lengths=lengths, schedule="stream-k") for _ in range(3)]
        out, lse = runs[0]
        _check(out, lse, ref, ref_lse, mode)
        for o, s in runs[1:]:  # deterministic: bit-identical repeats
            assert torch.equal(o, out) and torch.equal(s, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [7, 100, 1000])
def test_stream_forward_with_any_program_count_on_the_gpu(programs):
    lens_q, lens_k = GPU_CASES[1]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 16, 64, torch.bfloat16, seed=9, device="cuda")
    plan = stream_k.stream_plan(q, k, v, lens_q, lens_k, q.shape[0], False, "bf16", torch.bfloat16, True, False,
                                programs=programs)
    out, lse = plan(q, k, v, cu_q, cu_k, 0.125)
    _check(out, lse, *_oracle(q, k, v, cu_q, cu_k, 0.125, False), "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16", "tf32"])
def test_dense_few_query_calls_take_stream_k_on_the_gpu(mode):
    """Few queries against long keys (class attention): :func:`visionattn.attention` runs the stream-K plan, equal
    to the oracle and to the split-KV plan within the mode's contract, bit-identical on repeats."""
    from visionattn.kernels import elsa_fwd

    dtype = MODES[mode].compute_dtype
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(4, 16, 1, 64, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(4, 16, 20000, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    plan, (out, _) = elsa_fwd.plan_for(q, k, v, None, None, False, 0.125, mode)
    assert isinstance(plan, stream_k.DenseStreamPlan)
    ref = oracle_attention(q.double(), k.double(), v.double(), scale=0.125)
    assert rel_l2(out.double(), ref) <= MODES[mode].rel_tol
    split = elsa_fwd.elsa_attention(q, k, v, None, None, False, 0.125, mode, num_splits=4)
    assert rel_l2(out.double(), split.double()) <= 2 * MODES[mode].rel_tol
    assert torch.equal(visionattn.attention(q, k, v, scale=0.125, mode=mode), out)


@pytest.mark.gpu
def test_rule_picks_stream_k_for_a_few_query_list_on_the_gpu():
    lens_q, lens_k = GPU_CASES[0]
    assert stream_k.choose(lens_q, lens_k, 16, "bf16", 64, 64, torch.device("cuda"))
    table2 = [785, 500, 708, 542, 1732, 262, 1039, 557]  # self-attention: the single pass
    assert not stream_k.choose(table2[:3], table2[:3], 2, "bf16", 64, 64, torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    many = [cdiv(sms * 128, 16)] * 2  # the longest sequence's query tiles fill the SMs: the single pass
    assert not stream_k.choose(many, many, 16, "bf16", 64, 64, torch.device("cuda"))


_COMPILE_CHILD = r"""
import json
from visionattn.kernels import elsa_fwd, stream_k
from visionattn.kernels.elsa_fwd import _precision
from visionattn.kernels.introspect import compile_for_arch

out = {}
for mode, t in (("bf16", "bf16"), ("fp32", "fp32")):
    p = {n: "*" + t for n in ("Q", "K", "V", "Out")}
    p.update({n: "*fp32" for n in ("Lse", "WsM", "WsS", "WsW")})
    p.update({n: "*i32" for n in ("CuQ", "CuK", "RowOff", "ProgIt", "ProgJob", "ProgSlot", "JobIt", "JobInfo")})
    r = compile_for_arch(stream_k._stream_fwd_kernel, p, dict(
        BLOCK_M=16, BLOCK_N=128 if mode == "bf16" else 64, BLOCK_D=64, BLOCK_DV=64, PRECISION=_precision(mode, None),
        IS_CAUSAL=False, EVEN_D=True, EVEN_DV=True, DOT_UPCAST=False, LAZY_V=False, WRITE_LSE=True,
        ROW_OFFSETS=False), num_warps=4, num_stages=2, unit_ints=("sqd", "skd", "svd", "sod"),
        float_args=("qk_scale",))
    out[f"stream_fwd_{mode}"] = r.local_bytes
    r = compile_for_arch(stream_k._stream_merge_kernel, dict(WsM="*fp32", WsS="*fp32", WsW="*fp32", Out="*" + t,
                         Lse="*fp32", CuQ="*i32", Split="*i32"),
                         dict(TILE_M=16, ROW_BLOCKS=1, BLOCK_M=16, BLOCK_P=8, BLOCK_DV=64, WRITE_LSE=True),
                         num_warps=4, num_stages=1)
    out[f"stream_merge_{mode}"] = r.local_bytes
    r = compile_for_arch(elsa_fwd._elsa_merge_kernel, dict(WsM="*fp32", WsS="*fp32", WsW="*fp32", Out="*" + t,
                         Lse="*fp32"), dict(BLOCK_M=16, BLOCK_P=8, BLOCK_DV=64, WRITE_LSE=True), num_warps=4,
                         num_stages=1, unit_ints=("sod",))
    out[f"split_merge_{mode}"] = r.local_bytes
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_forward_and_merges_compile_for_hopper():
    """The stream-K forward, its merge and the split-KV merge (which share :func:`.elsa_fwd.merge_partials`) build
    for sm_90 in bf16 and fp32 with no spills (the interpreter runs code that a compile rejects:
    test_jit_signatures.py)."""
    spills = compile_in_child(_COMPILE_CHILD)
    assert len(spills) == 6, spills
    assert all(v == 0 for v in spills.values()), spills
