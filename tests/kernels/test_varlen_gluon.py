"""The warp-specialized Hopper fp16 / bf16 varlen forward (visionattn.kernels.varlen_gluon) and the varlen
launcher's dispatch to it.

Gluon does not run under TRITON_INTERPRET=1: on CPU the kernel is compiled offline for sm_90 (child process), its
work assignment and last-key-tile arithmetic are checked in PyTorch, and the dispatch rules with a stand-in plan; the
results are checked on a Hopper GPU (``pytest -m gpu``) against the float64 oracle.
"""
import random
import warnings

import pytest
import torch

from offline_compile import compile_in_child
from visionattn.kernels import elsa_fwd, varlen_fwd, varlen_gluon
from visionattn.kernels._launch import PlanCache

TABLE2 = (785, 500, 708, 542, 1732, 262, 1039, 557)  # the ELSA supplement's Table 2 batch
needs_gluon = pytest.mark.skipif(varlen_gluon._IMPORT_ERROR is not None, reason="this Triton has no Gluon Hopper API")

_CHILD = r"""
import json, torch
from visionattn.kernels import varlen_gluon as vg
from visionattn.kernels.introspect import compile_for_arch
out = {}
for d, consumers, dt in ((64, 1, torch.bfloat16), (64, 2, torch.float16), (128, None, torch.bfloat16)):
    cfg = vg.get_config([1024], [1024], d, consumers)
    tname = "bf16" if dt == torch.bfloat16 else "fp16"
    r = compile_for_arch(vg._varlen_fwd_kernel, dict(vg.descriptor_types(cfg, d, dt), O="*" + tname, LSE="*fp32",
                         Tiles="*i32", Starts="*i32", CuQ="*i32", CuK="*i32"),
                         vg.kernel_constexprs(cfg, d, tname == "bf16"), num_warps=4, num_stages=1,
                         float_args=("qk_scale",), maxnreg=cfg["maxnreg"])
    out[f"{d}_{consumers}"] = {"shared": r.shared_bytes, "wgmma": r.wgmma, "regs": r.registers,
                               "local": r.local_bytes, "warps": r.num_warps,
                               "ws": r.ttgir.count("ttg.warp_specialize"), "programs": r.programs_per_sm}
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
@needs_gluon
def test_compiles_for_hopper_warp_specialized_without_spills():
    """With the installed Triton the kernel builds for sm_90 with one consumer warpgroup (D = 64: 128 registers, two
    CTAs per SM), two (D = 64) and two with ping-pong (D = 128, the LSE write the backward reads): wgmma products,
    one warp-specialized region, the launch register cap, the tiles within the 227 KiB of shared memory, no
    spills."""
    from visionattn.kernels.introspect import HOPPER_SHARED_LIMIT

    r = compile_in_child(_CHILD)
    assert set(r) == {"64_1", "64_2", "128_None"}
    for key, v in r.items():
        d, consumers = int(key.split("_")[0]), (None if key.endswith("None") else int(key[-1]))
        cfg = varlen_gluon.get_config([1024], [1024], d, consumers)
        tiles = 2 * (cfg["q_buffers"] * cfg["BLOCK_M"] * d + cfg["STAGES"] * 2 * cfg["BLOCK_N"] * d)
        assert tiles < v["shared"] <= HOPPER_SHARED_LIMIT, (key, v)
        assert v["wgmma"] > 0 and v["ws"] == 1 and v["warps"] == 4 * cfg["consumers"] + 4, (key, v)
        assert v["local"] == 0 and v["regs"] == cfg["maxnreg"] and v["programs"] == cfg["ctas_per_sm"], (key, v)


def test_consumers_by_the_work_weighted_key_count():
    """D = 64: one consumer warpgroup (64 rows, two CTAs per SM) while the keys a query row meets on average stay
    below the varlen ONE_CONSUMER_BELOW (the Table 2 batch: 1,246 although its longest sequence has 1,732; one
    4,096-key sequence among 40 short ones: 3,222), two beyond; D = 128 always two, taking turns (ping-pong); every
    config keeps whole 128-key tiles."""
    cfg = varlen_gluon.get_config(TABLE2, TABLE2, 64)
    assert (cfg["consumers"], cfg["ctas_per_sm"], cfg["BLOCK_M"]) == (1, 2, 64)
    skew = (4096,) + (300,) * 40
    assert varlen_gluon.get_config(skew, skew, 64)["consumers"] == 1
    long = (4096, 3000, 8192, 2048)
    assert varlen_gluon.get_config(long, long, 64)["consumers"] == 2
    assert varlen_gluon.get_config((1, 1, 1), (8192, 8192, 100), 64)["consumers"] == 2
    assert varlen_gluon.get_config((4000, 1), (100, 8192), 64)["consumers"] == 1  # the long sequence has 1 query
    d128 = varlen_gluon.get_config(TABLE2, TABLE2, 128)
    assert (d128["consumers"], d128["PINGPONG"]) == (2, True)
    assert varlen_gluon.get_config(TABLE2, TABLE2, 64, consumers=2)["consumers"] == 2
    for cfg in (cfg, d128):
        assert cfg["tail_keys"] == (cfg["BLOCK_N"], 0) and not cfg["one_tile"] and cfg["BLOCK_N"] == 128


@pytest.mark.parametrize("programs", [1, 7, 264])
def test_assign_gives_every_tile_once_in_a_list_schedule_within_grahams_bound(programs):
    """Every (sequence, head, query tile) appears once; each program's list runs longest first; the most loaded
    program carries at most the mean load plus one tile (Graham's bound for list scheduling in decreasing order); no
    program is idle; sequences without queries have no tiles."""
    rng = random.Random(programs)
    lens_k = tuple(rng.randint(1, 3000) for _ in range(13))
    lens_q = tuple(0 if i == 4 else rng.randint(1, 700) for i in range(13))
    heads, rows, block_n = 3, 64, 128
    tiles, starts = varlen_gluon.assign(lens_q, lens_k, heads, rows, block_n, programs)
    n_m = max((n + rows - 1) // rows for n in lens_q)
    expected = sorted((s * heads + h) * n_m + m for s in range(13) for h in range(heads)
                      for m in range((lens_q[s] + rows - 1) // rows))
    assert sorted(tiles) == expected
    assert len(starts) == min(programs, len(expected)) + 1 and starts[0] == 0 and starts[-1] == len(tiles)

    def cost(entry):
        return (lens_k[entry // n_m // heads] + block_n - 1) // block_n + varlen_gluon.START_COST_TILES

    loads = []
    for p in range(len(starts) - 1):
        mine = [cost(e) for e in tiles[starts[p]:starts[p + 1]]]
        assert mine and mine == sorted(mine, reverse=True)
        loads.append(sum(mine))
    assert max(loads) <= sum(loads) / len(loads) + max(cost(e) for e in tiles)


def _emulated(q, k, v, lens_q, lens_k, scale, rows=64, block_n=128, programs=5):
    """The kernel's schedule in float64 PyTorch: :func:`assign`'s work tiles decoded as the kernel decodes them, each
    query tile folded over key tiles of whole ``block_n`` rows of the packed tensors, the last one starting at
    ``n_k - block_n`` with the kernel's mask (offsets ``block_n - 1 - j`` below the keys left)."""
    H = q.shape[1]
    tiles, _ = varlen_gluon.assign(lens_q, lens_k, H, rows, block_n, programs)
    n_m = max((n + rows - 1) // rows for n in lens_q)
    cu_q = [0] + torch.tensor(lens_q).cumsum(0).tolist()
    cu_k = [0] + torch.tensor(lens_k).cumsum(0).tolist()
    pad = torch.full((block_n, H, q.shape[2]), float("nan"), dtype=torch.float64)  # what lies past the buffers
    kp, vp = torch.cat([k.double(), pad]), torch.cat([v.double(), pad])
    out = torch.full((q.shape[0], H, v.shape[2]), float("nan"), dtype=torch.float64)
    for entry in tiles:
        seq, head, m = entry // n_m // H, entry // n_m % H, entry % n_m
        q_row, n_k, k_row = cu_q[seq] + m * rows, lens_k[seq], cu_k[seq]
        left = cu_q[seq + 1] - q_row
        n_tiles = (n_k + block_n - 1) // block_n
        rem = n_k - (n_tiles - 1) * block_n
        qt = q[q_row:q_row + min(rows, left), head].double()
        scores, values = [], []
        for t in range(n_tiles):
            row = k_row + min(t * block_n, n_k - block_n)
            s = scale * qt @ kp[row:row + block_n, head].T
            if t == n_tiles - 1:  # the kernel's mask: t = 0 with offsets block_n - 1 - j and limit rem
                keep = (block_n - 1 - torch.arange(block_n)) < rem
                s = s.masked_fill(~keep, float("-inf"))
            assert k_row <= row and row + block_n <= k_row + n_k, "a key row of another sequence"
            scores.append(s)
            values.append(vp[row:row + block_n, head])
        p = torch.cat(scores, 1).softmax(-1)
        out[q_row:q_row + len(qt), head] = p @ torch.cat(values)
    return out


def test_the_last_key_tile_ends_at_the_sequences_last_key_and_masks_what_was_folded():
    """In float64 PyTorch, the kernel's schedule (work tiles as assigned and decoded, whole key tiles with the last
    one shifted back to end at the sequence's last key, its repeated keys masked) gives exact attention per
    sequence, and reads no key / value row of another sequence (nor the NaN rows past the buffers)."""
    gen = torch.Generator().manual_seed(0)
    lens_q, lens_k = (5, 0, 130, 64, 700, 1), (128, 300, 129, 1000, 257, 383)
    H, D = 2, 16
    q = torch.randn(sum(lens_q), H, D, generator=gen)
    k, v = (torch.randn(sum(lens_k), H, D, generator=gen) for _ in range(2))
    out = _emulated(q, k, v, lens_q, lens_k, 0.3)
    a = b = 0
    for nq, nk in zip(lens_q, lens_k):
        ref = torch.softmax(0.3 * q[a:a + nq].double().transpose(0, 1) @ k[b:b + nk].double().permute(1, 2, 0), -1)
        ref = (ref @ v[b:b + nk].double().transpose(0, 1)).transpose(0, 1)
        torch.testing.assert_close(out[a:a + nq], ref, rtol=1e-12, atol=1e-12)
        a, b = a + nq, b + nk


def test_unsupported_reasons_name_the_cause():
    """The Triton varlen kernel keeps calls the Gluon kernel cannot take, each for a named reason: lengths not on
    the host, sequences read in place, grouped-query heads, a sequence with queries and fewer keys than one key tile
    (one without queries may be short), causal, dtypes, head dims, strides TMA cannot read."""
    lens = (200, 300)
    q, k, v = (torch.randn(500, 2, 64).half() for _ in range(3))
    reason = varlen_gluon.unsupported_reason
    assert "host" in reason(q, k, v, None, None, False, 0.125, None)
    assert "in place" in reason(q, k, v, lens, lens, False, 0.125, torch.zeros(2, 3, dtype=torch.int64))
    assert "grouped" in reason(q, k[:, :1], v[:, :1], lens, lens, False, 0.125, None)
    assert "fewer than 128 keys" in reason(q, k, v, (100, 400), (100, 400), False, 0.125, None)
    assert reason(q, k, v, (0, 500), (100, 400), False, 0.125, None) == "tensors on cpu"
    assert "causal" in reason(q, k, v, lens, lens, True, 0.125, None)
    assert "dtypes" in reason(q.float(), k.float(), v.float(), lens, lens, False, 0.125, None)
    q8 = torch.randn(500, 2, 80).half()
    assert "head dims" in reason(q8, q8, q8, lens, lens, False, 0.125, None)
    odd = torch.randn(500, 2, 68).half()[..., :64]  # rows of 136 bytes: not a TMA stride
    assert "v strides" in reason(q, k, odd, lens, lens, False, 0.125, None)
    assert reason(q, k, v, lens, lens, False, 0.125, None) == "tensors on cpu"  # everything else fits


class _StandIn:
    """A Gluon plan stand-in: output all sevens, the lengths it was asked for recorded."""

    def __init__(self, q, k, v, out_dtype, with_lse, cfg, seen):
        self.shape, self.out_dtype, self.with_lse, self.seen = (q.shape[0], q.shape[1], v.shape[2]), out_dtype, \
            with_lse, seen
        seen.append(("plan", cfg["consumers"]))

    def work(self, lens_q, lens_k):
        return lens_q, lens_k

    def __call__(self, q, k, v, cu_q, cu_k, scale, row_offsets, work):
        self.seen.append(("call", work))
        lse = torch.zeros(self.shape[1], self.shape[0]) if self.with_lse else None
        return torch.full(self.shape, 7.0, dtype=self.out_dtype), lse


@pytest.fixture
def as_if_on_hopper(monkeypatch):
    seen = []
    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    monkeypatch.setattr(elsa_fwd, "_gluon_device", lambda device: True)
    monkeypatch.setattr(varlen_gluon, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(varlen_gluon, "VarlenGluonPlan", lambda *a: _StandIn(*a, seen))
    monkeypatch.setattr(varlen_fwd, "PLANS", PlanCache())
    monkeypatch.setattr(varlen_fwd, "_GLUON_ROUTES", PlanCache())
    return seen


def _packed(lens, dtype=torch.float16, heads=2):
    q, k, v = (torch.randn(sum(lens), heads, 64).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def test_dispatch_takes_half_calls_with_host_lengths_and_plans_once_per_signature(as_if_on_hopper, monkeypatch):
    """fp16 / bf16 calls with host lengths run on the Gluon plan (one plan per signature, the work tables asked per
    call's lengths, the LSE passed on); calls without host lengths, with an explicit num_splits, in an FP32 mode, of
    at most 64 queries a sequence, or where the split-KV rule would split the keys stay on the Triton kernel."""
    seen = as_if_on_hopper
    for dtype, mode in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        q, k, v, cu = _packed(TABLE2, dtype)
        for lens in (TABLE2, TABLE2[::-1]):
            out, lse = varlen_fwd.varlen_forward(q, k, v, cu, cu, 1732, 1732, False, 0.125, mode, with_lse=True,
                                                 lengths=(lens, lens))
            assert (out == 7.0).all() and lse.shape == (2, sum(TABLE2))
    assert seen == [("plan", 1), ("call", (TABLE2, TABLE2)), ("call", (TABLE2[::-1], TABLE2[::-1]))] * 2
    seen.clear()
    lens = (130, 300, 200)
    q, k, v, cu = _packed(lens)
    for kw in (dict(), dict(lengths=(lens, lens), num_splits=2)):
        out, _ = varlen_fwd.varlen_forward(q, k, v, cu, cu, 300, 300, False, 0.125, "fp16", **kw)
        assert not (out == 7.0).all()
    q32, k32, v32, _ = _packed(lens, torch.float32)
    out, _ = varlen_fwd.varlen_forward(q32, k32, v32, cu, cu, 300, 300, False, 0.125, "fp32", lengths=(lens, lens))
    assert not (out == 7.0).all()
    few = (64, 16, 1)  # few-query calls keep the Triton kernels (and their stream-K / split-KV schedules)
    qf, kf, vf = (torch.randn(sum(few), 2, 64).half() for _ in range(3))
    cf = torch.tensor([0, *torch.tensor(few).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = varlen_fwd.varlen_forward(qf, kf, vf, cf, cf, 64, 64, False, 0.125, "fp16", lengths=(few, few),
                                       schedule="split-kv")
    assert not (out == 7.0).all() and not varlen_gluon.preferred(few) and varlen_gluon.preferred((65, 1))
    monkeypatch.setattr(varlen_fwd, "choose_num_splits", lambda *a: 4)  # as if few query tiles
    out, _ = varlen_fwd.varlen_forward(q, k, v, cu, cu, 300, 300, False, 0.125, "fp16", lengths=(lens, lens))
    assert not (out == 7.0).all() and seen == []


def test_a_failing_gluon_build_warns_once_and_the_triton_kernel_takes_over(as_if_on_hopper, monkeypatch):
    """No silent fallback: a Gluon build that fails warns with the reason on the first call it would take, and every
    call (that one included) runs on the Triton varlen kernel, exact."""
    tries = []

    def broken(*a):
        tries.append(1)
        raise RuntimeError("no such Gluon op")

    monkeypatch.setattr(varlen_gluon, "VarlenGluonPlan", broken)
    lens = (130, 200)
    q, k, v, cu = _packed(lens)
    ref = varlen_fwd.varlen_forward(q, k, v, cu, cu, 200, 200, False, 0.125, "fp16")[0]
    with pytest.warns(RuntimeWarning, match="Gluon varlen half kernel cannot run .RuntimeError: no such Gluon op"):
        out, _ = varlen_fwd.varlen_forward(q, k, v, cu, cu, 200, 200, False, 0.125, "fp16", lengths=(lens, lens))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        varlen_fwd.varlen_forward(q, k, v, cu, cu, 200, 200, False, 0.125, "fp16", lengths=(lens, lens))
    assert tries == [1]


# ----------------------------------------------------------------------------- on a Hopper GPU
def _oracle(q, k, v, lens_q, lens_k, scale):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    a = b = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq and nk:
            s = scale * q[a:a + nq].double().transpose(0, 1) @ k[b:b + nk].double().permute(1, 2, 0)
            out[a:a + nq] = (s.softmax(-1) @ v[b:b + nk].double().transpose(0, 1)).transpose(0, 1)
            lse[:, a:a + nq] = s.logsumexp(-1)
        a, b = a + nq, b + nk
    return out, lse


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,consumers", [(64, 1), (64, 2), (128, None)])
def test_gluon_varlen_matches_float64_and_repeats_bit_identically(dtype, head_dim, consumers, monkeypatch):
    """On the GPU, at the Triton varlen kernel's error level vs float64 (output and LSE), for sequences with and
    without queries, keys a multiple of the key tile or one past it; repeats bit-identical; the plan is the Gluon
    kernel's."""
    real = varlen_gluon.get_config
    monkeypatch.setattr(varlen_gluon, "get_config", lambda lq, lk, d, c=None: real(lq, lk, d, consumers))
    monkeypatch.setattr(varlen_fwd, "PLANS", PlanCache())
    monkeypatch.setattr(varlen_fwd, "_GLUON_ROUTES", PlanCache())
    lens_q, lens_k = (64, 0, 65, 1, 700, 128, 1733), (128, 300, 129, 256, 700, 383, 1733)
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(sum(lens_q), 16, head_dim, generator=gen).to("cuda", dtype)
    k, v = (torch.randn(sum(lens_k), 16, head_dim, generator=gen).to("cuda", dtype) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (lens_q, lens_k))
    outs = [varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), False, head_dim ** -0.5,
                                      "fp16" if dtype == torch.float16 else "bf16", with_lse=True,
                                      lengths=(lens_q, lens_k)) for _ in range(2)]
    assert [type(p).__name__ for p in varlen_fwd.PLANS.plans.values()] == ["VarlenGluonPlan"]
    ref, ref_lse = _oracle(q, k, v, lens_q, lens_k, head_dim ** -0.5)
    out, lse = outs[0]
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < (4e-3 if dtype == torch.bfloat16 else 1e-3)
    finite = torch.isfinite(ref_lse)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 1e-4
    assert (lse[~finite] == float("-inf")).all()
    assert torch.equal(outs[1][0], out) and torch.equal(outs[1][1], lse)


@pytest.mark.gpu
@needs_gluon
def test_a_non_finite_value_stays_in_its_own_sequence():
    """NaN keys and values in one sequence leave the sequence packed before it finite (its last key tile ends at its
    own last key instead of reading the neighbour's rows)."""
    q, k, v = (torch.randn(700, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k[300:], v[300:] = float("nan"), float("nan")
    cu = torch.tensor([0, 300, 700], dtype=torch.int32, device="cuda")
    out, _ = varlen_fwd.varlen_forward(q, k, v, cu, cu, 400, 400, False, 0.125, "bf16", lengths=((300, 400),) * 2)
    assert torch.isfinite(out[:300]).all() and torch.isnan(out[300:]).all()


@pytest.mark.gpu
@needs_gluon
def test_randomized_ragged_batches_match_float64(monkeypatch):
    """40 random ragged batches (1-12 sequences of 128-3000 keys, lengths at key-tile boundaries and one past them,
    queries equal to the keys or drawn apart, some sequences without queries), fp16 and bf16, head dims 64 and 128,
    one or two consumer warpgroups: every output and LSE at the Triton varlen kernel's error level vs float64, on
    the Gluon plan."""
    rng = random.Random(5)
    real = varlen_gluon.get_config
    ran = 0
    for case in range(40):
        dtype = rng.choice([torch.float16, torch.bfloat16])
        d, consumers = rng.choice([(64, 1), (64, 2), (64, None), (128, None)])
        n = rng.randint(1, 12)
        lens_k = tuple(rng.choice([128, 129, 255, 256, 257, 1024, 1025, rng.randint(128, 3000)]) for _ in range(n))
        lens_q = lens_k if rng.random() < 0.5 else tuple(rng.choice([0, 1, 63, 64, 65, 128, k]) for k in lens_k)
        lens_q = lens_q if sum(lens_q) else (1,) + lens_q[1:]
        monkeypatch.setattr(varlen_gluon, "get_config", lambda lq, lk, hd, c=None: real(lq, lk, hd, consumers))
        monkeypatch.setattr(varlen_fwd, "PLANS", PlanCache())
        monkeypatch.setattr(varlen_fwd, "_GLUON_ROUTES", PlanCache())
        gen = torch.Generator().manual_seed(case)
        q = torch.randn(sum(lens_q), 16, d, generator=gen).to("cuda", dtype)
        k, v = (torch.randn(sum(lens_k), 16, d, generator=gen).to("cuda", dtype) for _ in range(2))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                      for x in (lens_q, lens_k))
        out, lse = varlen_fwd.varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), False, d ** -0.5,
                                             "fp16" if dtype == torch.float16 else "bf16", with_lse=True,
                                             lengths=(lens_q, lens_k))
        ran += [type(p).__name__ for p in varlen_fwd.PLANS.plans.values()] == ["VarlenGluonPlan"]
        ref, ref_lse = _oracle(q, k, v, lens_q, lens_k, d ** -0.5)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), (case, lens_q, lens_k, d, consumers, err)
        finite = torch.isfinite(ref_lse)
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 1e-4, (case, lens_q, lens_k)
        assert (lse[~finite] == float("-inf")).all()
    assert ran >= 25  # the rest: too few query tiles, where the split-KV plan keeps the call
