"""The Gluon fp16 / bf16 Hopper backward (visionattn.kernels.half_gluon_bwd).

Gluon does not run under TRITON_INTERPRET=1: on CPU the scope rules and host-side helpers are checked and the
kernel is compiled offline for sm_90 (in a child process with TRITON_INTERPRET=0); ``pytest -m gpu`` checks the
gradients against the float64 oracle and their bit-for-bit reproducibility.
"""
import importlib

import pytest
import torch

from offline_compile import compile_in_child
from visionattn.kernels import half_gluon_bwd

needs_gluon = pytest.mark.skipif(half_gluon_bwd._IMPORT_ERROR is not None, reason="this Triton has no usable Gluon")


def _qkv(n_q=128, n_k=128, d=64, dtype=torch.float16, b=1, h=2, h_kv=None):
    q = torch.randn(b, h, n_q, d, dtype=dtype)
    k = torch.randn(b, h_kv or h, n_k, d, dtype=dtype)
    v = torch.randn(b, h_kv or h, n_k, d, dtype=dtype)
    do = torch.randn(b, h, n_q, d, dtype=dtype)
    return q, k, v, do


def test_module_imports_without_cuda():
    """The module imports on a CPU machine (CI) whatever the Triton: a missing Gluon API is a reason string."""
    mod = importlib.reload(half_gluon_bwd)
    assert mod._IMPORT_ERROR is None or "Gluon" in mod._IMPORT_ERROR
    assert mod.HEAD_DIMS == (64, 128)


def test_unsupported_reasons_name_the_cause():
    q, k, v, do = _qkv()
    reason = half_gluon_bwd.unsupported_reason
    assert "bias" in reason(q, k, v, do, torch.zeros(128, 128), None, False, 0.125)
    assert "mask" in reason(q, k, v, do, None, torch.ones(128, 128, dtype=torch.bool), False, 0.125)
    assert "causal" in reason(q, k, v, do, None, None, True, 0.125)
    assert "<= 0" in reason(q, k, v, do, None, None, False, 0.0)
    assert "dtypes" in reason(q.float(), k.float(), v.float(), do, None, None, False, 0.125)
    assert "dtypes" in reason(q, k.bfloat16(), v, do, None, None, False, 0.125)
    q32, k32, v32, do32 = _qkv(d=32)
    assert "head dims (32, 32)" in reason(q32, k32, v32, do32, None, None, False, 0.125)
    # grouped-query attention is in scope; K / V heads that do not divide the query heads, or differ, are not
    qg, kg, vg, dog = _qkv(h=4, h_kv=2)
    assert reason(qg, kg, vg, dog, None, None, False, 0.125) == "tensors on cpu"
    q3, k3, v3, do3 = _qkv(h=4, h_kv=3)
    assert "do not divide the 4 query heads" in reason(q3, k3, v3, do3, None, None, False, 0.125)
    assert "(2, 4)" in reason(qg, kg, _qkv(h=4)[2], dog, None, None, False, 0.125)
    assert "grad_out" in reason(q, k, v, do[:, :, :64], None, None, False, 0.125)
    # a view whose row stride is not a multiple of 8 elements: not TMA-legal
    wide = torch.randn(1, 2, 128, 68, dtype=torch.float16)[..., :64]
    assert "TMA" in reason(wide, k, v, do, None, None, False, 0.125)
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            qd, kd, vd, dod = _qkv(n_q=100, n_k=300, d=d, dtype=dtype)
            assert reason(qd, kd, vd, dod, None, None, False, 0.125) == "tensors on cpu"  # everything else fits


def test_half_backward_refuses_what_it_cannot_run():
    q, k, v, do = _qkv()
    lse = torch.zeros(1, 2, 128)
    with pytest.raises(ValueError, match="tensors on cpu"):
        half_gluon_bwd.half_backward(q, k, v, q, do, lse, 0.125)


def test_kv_split_cuts_groups_only_where_programs_leave_sms_idle():
    """kv_split: the group's query heads stay whole where the K / V heads' programs fill the SMs' waves as well as a
    cut would (ties keep 1), and are cut where they leave SMs idle, into the fewest parts of the fewest waves times
    heads per program."""
    cfg = half_gluon_bwd.get_config(128)
    split = half_gluon_bwd.kv_split
    # (B, Hkv, group, keys) -> parts on 132 SMs
    for args, want in {(1, 8, 4, 8192): 1, (2, 4, 8, 4096): 1, (4, 1, 16, 4096): 1, (8, 4, 3, 4097): 1,
                       (1, 2, 8, 4096): 2, (1, 2, 8, 2048): 4, (1, 1, 7, 2048): 7, (1, 4, 7, 8192): 1}.items():
        assert split(*args, cfg, 132) == want, args
    # the choice minimises waves x heads per program over the divisors, the smallest on ties
    for B, h_kv, group, n_k in ((1, 2, 12, 1000), (3, 1, 16, 3000), (1, 3, 6, 700)):
        n_kt = -(-n_k // 128)
        costs = {s: -(-B * h_kv * s * n_kt // 132) * group // s for s in range(1, group + 1) if group % s == 0}
        got = split(B, h_kv, group, n_k, cfg, 132)
        assert costs[got] == min(costs.values()) and got == min(s for s in costs if costs[s] == costs[got])


def test_host_helpers():
    """Grid: one program per (key tile of 128, head, batch); the ordered-dQ buffers: the FP32 accumulators and one
    turn counter per (accumulator, head, query tile); the config checks; EVEN_N only when every key tile is
    full."""
    for d in (64, 128):
        cfg = half_gluon_bwd.get_config(d)
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"]) == (64, 128, 2)
        assert (cfg["dq_accumulators"], cfg["dq_ring"]) == (2, 4 if d == 64 else 2)
        # rotated sweeps of one chain (two accumulators: the shares in turn, the wrapped ones) where the query tiles
        # cover the chain; else two chains, rotated where they are short enough, else in one order
        assert cfg["rotate"] and cfg["rotated_dq_accumulators"] == 1
        for (n_q, n_k), want in {(4096, 4096): (1, 2, 2), (16384, 16384): (1, 2, 2), (65536, 65536): (1, 2, 2),
                                 (2048, 8192): (2, 1, 4), (130, 4100): (2, 0, 2), (100, 100): (1, 0, 1)}.items():
            assert half_gluon_bwd.dq_schedule(n_q, n_k, cfg) == want, (n_q, n_k)
            assert half_gluon_bwd.dq_schedule(n_q, n_k, dict(cfg, rotate=False)) == (
                min(2, -(-n_k // 128)), 0, min(2, -(-n_k // 128))), (n_q, n_k)
        # modes tf32 / fp32 keep one accumulator, dQ itself (their peak memory): in one order
        assert half_gluon_bwd.dq_schedule(4096, 4096, half_gluon_bwd.tf32_config(d)) == (1, 0, 1)
        assert half_gluon_bwd.grid_size(2, 3, 1000, cfg) == 8 * 6
        assert half_gluon_bwd.grid_size(1, 1, 128, cfg) == 1
        # 1000 rows: 16 query tiles (the last partial); accumulators [accs * B * H, Nq, D]
        for accs in (1, 2, 4):
            acc_cfg = dict(cfg, dq_accumulators=accs)
            assert half_gluon_bwd.ordered_buffer_sizes(2, 3, 1000, d, acc_cfg) == (accs * 6000 * d, accs * 6 * 16)
            assert half_gluon_bwd.kernel_constexprs(acc_cfg, d, 1024)["DQ_ACCS"] == accs
        assert half_gluon_bwd.ordered_buffer_sizes(1, 1, 1025, d, cfg)[1] == 2 * 17
        for bad in (0, half_gluon_bwd.MAX_DQ_ACCUMULATORS + 1, 2.0):
            with pytest.raises(ValueError, match="dq_accumulators"):
                half_gluon_bwd.kernel_constexprs(dict(cfg, dq_accumulators=bad), d, 1024)
        # the ring holds a query tile per writer (two): its phase waits are exact only then
        assert half_gluon_bwd.kernel_constexprs(dict(cfg, dq_ring=2), d, 1024)["DQ_RING"] == 2
        with pytest.raises(ValueError, match="dq_ring 1 < 2"):
            half_gluon_bwd.kernel_constexprs(dict(cfg, dq_ring=1), d, 1024)
        assert half_gluon_bwd.kernel_constexprs(cfg, d, 1024)["EVEN_N"]
        assert not half_gluon_bwd.kernel_constexprs(cfg, d, 1000)["EVEN_N"]
        assert half_gluon_bwd.kernel_constexprs(cfg, d, 1000)["HEAD_D"] == d
        # mode tf32: one accumulator (the FP32 dQ itself), the HEAD_SCALES build
        assert half_gluon_bwd.tf32_config(d) == dict(cfg, dq_accumulators=1, rotate=False)
        # the producer loads the row data; K / V in registers at head dim 64 (they spill at 128); never in the
        # split build (mode fp32)
        assert cfg["producer_rows"] and cfg["kv_in_registers"] == (d == 64)
        flags = half_gluon_bwd.kernel_constexprs(cfg, d, 1000)
        assert flags["PRODUCER_ROWS"] and flags["KV_IN_REGS"] == (d == 64)
        assert not half_gluon_bwd.kernel_constexprs(cfg, d, 1000, head_scales=True, split=True)["KV_IN_REGS"]
        assert half_gluon_bwd.kernel_constexprs(cfg, d, 1000, head_scales=True)["HEAD_SCALES"]
        assert not half_gluon_bwd.kernel_constexprs(cfg, d, 1000)["HEAD_SCALES"]
        # grouped-query attention: every build (the scaled ones take each query head's multipliers at its first
        # step)
        assert half_gluon_bwd.kernel_constexprs(cfg, d, 1000, gqa=True)["GQA"]
        assert not half_gluon_bwd.kernel_constexprs(cfg, d, 1000)["GQA"]
        for scaled in (dict(head_scales=True), dict(head_scales=True, split=True)):
            flags = half_gluon_bwd.kernel_constexprs(cfg, d, 1000, gqa=True, **scaled)
            assert flags["GQA"] and flags["HEAD_SCALES"]
    with pytest.raises(ValueError, match="head dim 96"):
        half_gluon_bwd.get_config(96)
    fp32 = half_gluon_bwd.fp32_config(64)
    assert not fp32["producer_rows"] and not fp32["kv_in_registers"] and not fp32.get("dsplit")
    # head dim 128: 64-key programs whose consumers split the head dim, 32-row query tiles (shared memory), the
    # consumers' dK / dV accumulators as at head dim 64; the split build only
    wide = half_gluon_bwd.fp32_config(128)
    assert wide["dsplit"] and (wide["BLOCK_M"], wide["BLOCK_N"]) == (32, 64)
    assert half_gluon_bwd.kernel_constexprs(wide, 128, 1000, head_scales=True, split=True)["DSPLIT"]
    assert not half_gluon_bwd.kernel_constexprs(fp32, 64, 1000, head_scales=True, split=True)["DSPLIT"]
    with pytest.raises(ValueError, match="dsplit"):
        half_gluon_bwd.kernel_constexprs(wide, 128, 1000, head_scales=True)
    blocks = half_gluon_bwd._descriptors(wide, 128, torch.float16)
    assert blocks["k_desc"][0] == (1, 1, 64, 128) and blocks["q_desc"][0] == (1, 1, 32, 128)
    assert blocks["dqacc_desc"][0] == (1, 32, 64)


@pytest.mark.parametrize("n_q, n_k, accs", [(4096, 4096, 2), (4096, 4096, 1), (1000, 1000, 2), (300, 520, 2),
                                             (16384, 16384, 2), (8192, 2048, 4), (130, 4100, 2), (2048, 8192, 1),
                                             (4097, 4097, 2), (64, 64, 2)])
def test_rotated_query_order_visits_every_tile_in_turn_order(n_q, n_k, accs):
    """The rotated schedule (config rotate; rotation_step, query_order: the kernel's _query_tile / _query_turn):
    every key tile visits every query tile once; at each query tile a chain's key tiles split into the shares in
    turn and the wrapped ones, each list in key-tile order (every wait on a lower program id: the waits end as long
    as programs start in id order) and in the order in which the key tiles reach that tile (no writer waits for a
    share that comes at a later step: the chain runs without the skew); the chain's tiles start ROT query tiles
    apart and are at distinct query tiles at every step. Without rotation (ROT = 0, or the config's rotate off)
    every key tile sweeps in index order and adds into its chain's accumulator in index order (the unrotated
    kernel's order)."""
    cfg = dict(half_gluon_bwd.get_config(64), dq_accumulators=accs, rotated_dq_accumulators=accs)
    n_m, n_kt = -(-n_q // cfg["BLOCK_M"]), -(-n_k // cfg["BLOCK_N"])
    chains = min(accs, n_kt)
    chain = -(-n_kt // chains)
    rot = half_gluon_bwd.rotation_step(n_q, n_k, cfg)
    assert rot == (n_m // chain if chain >= 2 else 0)
    assert half_gluon_bwd.rotation_step(n_q, n_k, dict(cfg, rotate=False)) == 0
    assert half_gluon_bwd.dq_schedule(n_q, n_k, cfg) == (chains, rot, chains * (2 if rot else 1))
    for r in sorted({rot, 0}):
        sweeps, turns = half_gluon_bwd.query_order(n_m, n_kt, chains, r)
        for j, sweep in enumerate(sweeps):
            assert sorted(sweep) == list(range(n_m)), j
            assert sweep[0] == (-(j // chains) * r) % n_m
        assert {acc for acc, _ in turns} <= set(range(2 * chains if r else chains))
        for a in range(chains):
            chain_tiles = list(range(a, n_kt, chains))
            for i in range(n_m):
                in_turn, wrapped = turns[(a, i)], turns.get((chains + a, i), [])
                assert sorted(in_turn + wrapped) == chain_tiles
                for order in (in_turn, wrapped):
                    assert order == sorted(order)  # key-tile order: waits on lower program ids only
                    steps = [sweeps[j].index(i) for j in order]
                    assert steps == sorted(steps), (a, i, steps)
                    assert not r or len(set(steps)) == len(steps), (a, i, steps)  # rotated: ROT steps apart
                if not r:
                    assert not wrapped and {sweeps[j].index(i) for j in in_turn} == {i}
        if r:  # at any step the chain's tiles are at distinct query tiles
            for t in range(n_m):
                at = [sweeps[j][t] for j in range(0, n_kt, chains)]
                assert len(set(at)) == len(at)


def test_default_dq_order_waits_only_on_lower_program_ids():
    """The default schedule's dQ turns, rotated or not, follow the key tiles' index in every accumulator at every
    query tile: each wait on a lower program id, so the waits end whatever the GPU runs beside the kernel (SM
    limits, another kernel on another stream)."""
    for cfg in (half_gluon_bwd.get_config(64), half_gluon_bwd.get_config(128), half_gluon_bwd.tf32_config(64)):
        for n_q, n_k in ((4096, 4096), (1000, 1000), (2048, 8192), (16384, 16384), (300, 520)):
            n_m, n_kt = -(-n_q // 64), -(-n_k // 128)
            chains, rot, accs = half_gluon_bwd.dq_schedule(n_q, n_k, cfg)
            _, turns = half_gluon_bwd.query_order(n_m, n_kt, chains, rot)
            assert {acc for acc, _ in turns} <= set(range(accs))
            assert all(order == sorted(order) for order in turns.values()), (n_q, n_k)


@pytest.mark.parametrize("n_q,n_k", [(1000, 2100), (4097, 4097), (640, 9000)])
def test_stored_first_shares_and_the_combine_give_every_share_once(n_q, n_k):
    """The writers' rule over the default schedule (query_order: the kernel's _query_tile / _query_turn): each
    accumulator tile's first share stored, the later ones added, nothing zeroed (the unwritten tiles hold NaN), each
    tile's counter the shares it took; then the combine. Every query row's dQ is the sum of every key tile's share
    exactly once (float64 sum within FP32 rounding, no NaN: no unwritten tile is read), bit-identical to the
    accumulators' fixed order; rotated schedules (two accumulators, some tiles with no wrapped share) and plain ones."""
    cfg = half_gluon_bwd.get_config(64)
    chains, rot, accs = half_gluon_bwd.dq_schedule(n_q, n_k, cfg)
    block_m = cfg["BLOCK_M"]
    n_m, n_kt, bh, d = -(-n_q // block_m), -(-n_k // cfg["BLOCK_N"]), 2, 64
    _, turns = half_gluon_bwd.query_order(n_m, n_kt, chains, rot)
    g = torch.Generator().manual_seed(n_q + n_k)
    shares = torch.randn(n_kt, bh, n_q, d, generator=g) * torch.exp2(torch.randint(-8, 9, (n_kt, 1, n_q, 1),
                                                                                   generator=g).float())
    acc = torch.full((accs, bh, n_q, d), float("nan"))
    sem = torch.zeros(accs, bh, n_m, dtype=torch.int32)
    for (a, i), order in turns.items():
        rows = slice(i * block_m, min((i + 1) * block_m, n_q))
        for turn, j in enumerate(order):
            if turn == 0:
                acc[a, :, rows] = shares[j, :, rows]
            else:
                acc[a, :, rows] += shares[j, :, rows]
        sem[a, :, i] = len(order)
    assert (sem.sum(0) == n_kt).all()  # every key tile's share of every query tile, once
    if rot:
        assert (sem[chains:] == 0).any() and (sem[chains:] > 0).any()  # tiles with and without wrapped shares
    dq = torch.empty(1, bh, n_q, d)
    half_gluon_bwd.combine_accumulators(acc.reshape(-1), dq, sem, accs, block_m)
    want = torch.zeros(bh, n_q, d)
    for a in range(accs):
        took = sem[a].repeat_interleave(block_m, dim=1)[:, :n_q, None] > 0
        want = want + torch.where(took, acc[a], 0.0)
    assert torch.equal(dq[0], want)
    exact = shares.double().sum(0)
    assert ((dq[0].double() - exact).abs() <= 1e-5 * shares.double().abs().sum(0) + 1e-30).all()


def test_grad_out_copies_are_tma_legal():
    """The dO the kernel reads when the given one is not TMA-legal: a new, 16-byte-aligned contiguous copy in q's
    dtype, also of a contiguous dO of the right dtype at an offset (``.to`` alone would return that view itself)."""
    buf = torch.randn(1 * 2 * 64 * 64 + 1, dtype=torch.bfloat16)
    shifted = buf[1:].view(1, 2, 64, 64)  # contiguous, 2 bytes past an aligned address
    assert shifted.is_contiguous() and shifted.data_ptr() % 16
    for given in (shifted, shifted.float(), torch.randn(1, 64, 2, 64, dtype=torch.bfloat16).transpose(1, 2),
                  torch.ones(1, 1, 1, 1, dtype=torch.bfloat16).expand(1, 2, 64, 64)):
        got = half_gluon_bwd.tma_copy(given, torch.bfloat16)
        assert got.data_ptr() != given.data_ptr() and got.is_contiguous() and got.data_ptr() % 16 == 0
        assert got.dtype == torch.bfloat16 and torch.equal(got, given.to(torch.bfloat16))


def test_preferred_from_min_keys():
    """The backward plans take the Gluon kernel from MIN_KEYS keys and query rows, both."""
    m = half_gluon_bwd.MIN_KEYS
    assert half_gluon_bwd.preferred(m, m) and half_gluon_bwd.preferred(4 * m, m)
    assert not half_gluon_bwd.preferred(m - 1, 4 * m) and not half_gluon_bwd.preferred(4 * m, m - 1)


def test_combine_writes_dq_through_its_strides():
    """The combine writes dQ through its strides: into the Q slice of a packed [B, N, 3, H, D] gradient (viewed
    [B, H, N, D]) the same bits as into a contiguous dQ, and nothing into the K / V slices; grads_tma_legal takes
    such slices at head dim 64 in half precision and refuses a row stride that is not a multiple of 16 bytes."""
    torch.manual_seed(0)
    B, H, N, D = 2, 3, 70, 64
    acc = torch.randn(2 * B * H * N * D)
    sem = torch.ones(2, B * H, -(-N // 64), dtype=torch.int32)
    flat = torch.empty(B, H, N, D)
    half_gluon_bwd.combine_accumulators(acc, flat, sem, 2, 64)
    packed = torch.full((B, N, 3, H, D), 7.0)
    dq = packed[:, :, 0].transpose(1, 2)  # [B, H, N, D] at strides (3 N H D, D, 3 H D, 1)
    half_gluon_bwd.combine_accumulators(acc, dq, sem, 2, 64)
    assert torch.equal(dq, flat) and bool((packed[:, :, 1:] == 7.0).all())
    grads = torch.empty(B, N, 3, H, D, dtype=torch.bfloat16).unbind(2)
    dk, dv = (g.transpose(1, 2) for g in grads[1:])
    assert half_gluon_bwd.grads_tma_legal(dk, dv)
    odd = torch.empty(B, N, 3, H, D + 4, dtype=torch.bfloat16)[..., :D].unbind(2)
    assert not half_gluon_bwd.grads_tma_legal(*(g.transpose(1, 2) for g in odd[1:]))


@pytest.mark.parametrize("accs", [1, 2, 5])
def test_combine_accumulators_adds_in_index_order(accs):
    """dQ = ((acc_0 + acc_1) + ...) elementwise in that order (FP32 sums are not associative: the order is part of
    the result), rounded once to dQ's dtype; sizes that do not fill the last block."""
    torch.manual_seed(0)
    n = 3 * 5 * 7 * 64 + 0  # 6720: not a multiple of the 1024-element block
    # magnitudes 2^-20 .. 2^20 so that another order would round differently
    acc = torch.randn(accs, n) * torch.exp2(torch.randint(-20, 21, (accs, n)).float())
    sem = torch.ones(accs, 15, 1, dtype=torch.int32)  # every tile took a share
    want = acc[0].clone()
    for a in range(1, accs):
        want = want + acc[a]
    dq = torch.empty(3, 5, 7, 64)
    half_gluon_bwd.combine_accumulators(acc.reshape(-1), dq, sem, accs, 64)
    assert torch.equal(dq.reshape(-1), want)
    if accs > 2:  # the order matters for these values: a reversed sum differs somewhere
        rev = acc[-1].clone()
        for a in range(accs - 2, -1, -1):
            rev = rev + acc[a]
        assert not torch.equal(rev, want)
    half = torch.empty(3, 5, 7, 64, dtype=torch.bfloat16)
    half_gluon_bwd.combine_accumulators(acc.reshape(-1), half, sem, accs, 64)
    # one rounding to bfloat16 (the interpreter may truncate instead of rounding: within one unit in the last place)
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert ((half.float().reshape(-1) - want).abs() <= ulp).all()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_combine_skips_accumulator_tiles_without_shares(head_dim):
    """The kernel stores each accumulator tile's first share and never zeroes the accumulators: a query tile whose
    turn counter is 0 holds whatever the allocation held (NaN here) and must count as 0; tiles are ``block_m`` rows
    of one (batch, head), so a tile's rows follow Nq, not the flat index (Nq = 100 leaves a 36-row last tile)."""
    torch.manual_seed(1)
    B, H, Nq, block_m, accs = 2, 3, 100, 64, 3
    n_m = -(-Nq // block_m)
    acc = torch.randn(accs, B * H, Nq, head_dim)
    sem = torch.randint(0, 3, (accs, B * H, n_m), dtype=torch.int32)
    sem[0] = 1  # the first accumulator always takes a share
    took = sem.repeat_interleave(block_m, dim=2)[:, :, :Nq, None].expand_as(acc) > 0
    acc = torch.where(took, acc, torch.nan)
    want = torch.where(took, acc, 0.0)
    want = (want[0] + want[1]) + want[2]
    dq = torch.empty(B, H, Nq, head_dim)
    half_gluon_bwd.combine_accumulators(acc.reshape(-1), dq, sem, accs, block_m)
    assert not (sem > 0).all() and not (sem == 0)[1:].all()  # both kinds of tile occur
    assert torch.equal(dq.reshape(B * H, Nq, head_dim), want)


_CHILD = r"""
import json, re, torch
from visionattn.kernels import half_gluon_bwd as g
from visionattn.kernels.introspect import compile_for_arch
out = {}
# (head dim, dtype, keys, dQ accumulators: None = the default, mode tf32's HEAD_SCALES build)
for d, dtype, n_k, accs, tf32 in ((64, torch.float16, 1024, None, False), (64, torch.bfloat16, 1000, None, False),
                                  (128, torch.float16, 1000, None, False), (128, torch.bfloat16, 1024, None, False),
                                  (64, torch.bfloat16, 1000, 1, False), (128, torch.bfloat16, 1000, 4, False),
                                  (64, torch.float16, 1000, None, True), (128, torch.float16, 1024, None, True),
                                  (64, torch.float16, 1000, None, "split"), (64, torch.float16, 1024, None, "split"),
                                  (64, torch.bfloat16, 1000, None, "gqa"), (128, torch.float16, 1024, None, "gqa"),
                                  (128, torch.bfloat16, 1000, None, "gqa-parts"),
                                  (128, torch.float16, 1000, None, "tf32-gqa-parts"),
                                  (64, torch.float16, 1024, None, "split-gqa"),
                                  (128, torch.float16, 1000, None, "split"), (128, torch.float16, 1024, None, "split"),
                                  (128, torch.float16, 1024, None, "split-gqa")):
    label = tf32
    split, gqa = tf32 in ("split", "split-gqa"), tf32 in ("gqa", "gqa-parts", "tf32-gqa-parts", "split-gqa")
    parts = tf32 in ("gqa-parts", "tf32-gqa-parts")
    tf32 = tf32 is True or split or label == "tf32-gqa-parts"
    cfg = g.fp32_config(d) if split else g.get_config(d)
    if accs is not None:
        cfg["dq_accumulators"] = accs
    t = "fp16" if dtype == torch.float16 else "bf16"
    grads = "*fp32" if tf32 or parts else "*" + t
    ptrs = dict(g.descriptor_types(cfg, d, dtype), LseRow="*fp32", Delta="*fp32", DK=grads, DV=grads,
                Sem="*i32", Scales="*fp32")
    r = compile_for_arch(g._half_bwd_kernel, ptrs, g.kernel_constexprs(cfg, d, n_k, tf32, split, gqa, parts),
                         num_warps=4, num_stages=1, float_args=("qk_scale", "scale"), maxnreg=cfg["maxnreg"])
    out[f"{d}-{t}-{n_k}-{cfg['dq_accumulators']}acc" + ("-split" if split else "-tf32" * tf32) + "-gqa" * gqa
        + "-parts" * parts] = {
        "wgmma": r.wgmma, "local": r.local_bytes, "shared": r.shared_bytes, "warps": r.num_warps,
        "accs": cfg["dq_accumulators"], "bulk_reduce": r.ttgir.count("ttng.async_tma_reduce"),
        "bulk_store": r.ttgir.count("ttng.async_tma_copy_local_to_global"),
        "completion_wait": "cp.async.bulk.wait_group 0;" in r.ttgir,
        "fresh": len(re.findall(r"ttng\.warp_group_dot [^,]+, [^,]+, [^,]+, %false(_[0-9]+)? ", r.ttgir)),
        "register_lhs": len(re.findall(r"ttng\.warp_group_dot .*isAsync = true} : tensor<", r.ttgir))}
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
@needs_gluon
def test_compiles_for_hopper():
    """The kernel builds for sm_90 with one, two or four dQ accumulators, full and cut key tiles: six wgmmas per
    consumer warpgroup (two consumers), 12 warps (the producer warp and the two dQ writers' warps padded to a
    warpgroup), shared memory under Hopper's 232,448 bytes; each writer adds both consumer halves by TMA bulk
    reductions (the first share of an accumulator tile as a TMA store) and waits for their completion, not only for
    their shared-memory reads, before a turn passes
    (``wait_group`` without ``.read``: the next key tile's reductions must find these in the accumulator); at
    head dim 64 at most 32 bytes of register spills per writer (triton 3.6 / 3.8: values of the prologue that ptxas
    keeps in local memory across the register reallocation, reloaded once per partition). Mode tf32's HEAD_SCALES
    builds (FP16 operands, FP32 dK / dV by plain stores, the heads' multipliers) have the same products, the fp16 /
    bf16 builds write dK and dV by TMA stores (two per consumer); mode fp32's split build
    three wgmmas for each (hi and lo parts), its shared memory still under the limit, and every query tile's dK /
    dV products and dS's lo terms start on a zero accumulator (summed in the wgmma accumulator across query tiles
    the split products leave fp32's bound on the GPU); at head dim 128 its consumers split the head dim (dsplit):
    five products each, dQ's share over the tile's keys from the consumer's own dS^T in one product. The
    grouped-query builds (a program sweeping its K / V head's query heads; tf32 / fp32 too) have their equal-heads
    builds' products and stores, those of groups cut into parts their FP32 dK / dV partials by plain stores."""
    r = compile_in_child(_CHILD)
    assert {v["accs"] for v in r.values()} == {1, 2, 4}, r
    assert sum("-gqa" in key for key in r) == 6, r
    for key, v in r.items():
        # S^T, dP^T, dV, dK and dQ's half of the columns over both consumers' keys (two wgmmas), per consumer;
        # dsplit: dQ's columns in one product
        split = "-split" in key
        products = 5 if key.startswith("128-") and split else 6
        assert v["wgmma"] == 2 * products * (3 if split else 1) and v["warps"] == 12, (key, v)
        assert 0 < v["shared"] <= 232448, (key, v)
        assert v["bulk_reduce"] == 2 * 2 and v["completion_wait"], (key, v)  # two halves in each of two writers
        # the writers' first shares (two halves each) and, in the fp16 / bf16 builds, each consumer's dK and dV tiles
        plain = any(x in key for x in ("-tf32", "-split", "-parts"))  # FP32 dK / dV by plain stores
        assert v["bulk_store"] == 2 * 2 + (0 if plain else 2 * 2), (key, v)
        # product chains started on a zero accumulator, per consumer: S^T, dP^T and the dQ share; the split build
        # also each query tile's dV, dK and dS's lo terms of dK and dQ apart (not summed in the wgmma accumulator)
        assert v["fresh"] == 2 * (7 if split else 3), (key, v)
        # left operands from registers, per consumer: P^T (dV) and dS^T (dK); at head dim 64 also K_w (S^T) and V_w
        # (dP^T) (kv_in_registers); the split build's three dV wgmmas (its dK reads dS^T from shared memory)
        want = 3 if split else 4 if key.startswith("64-") else 2
        assert v["register_lhs"] == 2 * want, (key, v)
        if key.startswith("64-"):
            assert v["local"] <= 32 * 2, (key, v)


def _reference(q, k, v, do, scale):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * scale
    out = torch.softmax(s, dim=-1) @ v64
    out.backward(do.double())
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), (q64.grad, k64.grad, v64.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 256, 256, 64), (1, 2, 1000, 1000, 64), (2, 3, 384, 384, 128),
                                   (1, 2, 777, 777, 128), (2, 2, 300, 520, 64)])
def test_gradients_match_float64_and_are_reproducible(shape, dtype):
    """dQ, dK, dV within the Triton backward's error of the float64 oracle (relative to the largest magnitude),
    bit-for-bit equal over repeated runs (ordered dQ adds)."""
    from visionattn.kernels import elsa_bwd

    B, H, Nq, Nk, D = shape
    if half_gluon_bwd._IMPORT_ERROR is not None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a compute capability 9.x GPU and Gluon")
    torch.manual_seed(0)
    q = torch.randn(B, H, Nq, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, H, Nk, D, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn(B, H, Nq, D, device="cuda", dtype=dtype)
    scale = D ** -0.5
    out64, lse64, ref = _reference(q, k, v, do, scale)
    out, lse = out64.to(dtype), lse64.float()
    runs = [half_gluon_bwd.half_backward(q, k, v, out, do, lse, scale) for _ in range(3)]
    mode = "fp16" if dtype == torch.float16 else "bf16"
    triton_grads = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, mode)[:3]
    for name, got, want, tri in zip("qkv", runs[0], ref, triton_grads):
        assert got.dtype == dtype and got.shape == want.shape, name
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        tri_err = ((tri.double() - want).abs().max() / want.abs().max()).item()
        assert err <= max(2 * tri_err, 2e-3 if dtype == torch.float16 else 1.6e-2), (name, err, tri_err)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


def _needs_hopper():
    if half_gluon_bwd._IMPORT_ERROR is not None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a compute capability 9.x GPU and Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", [(2, 3, 777, 1300), (1, 2, 1000, 1000), (1, 3, 130, 4100)])
def test_row_data_and_register_operands_change_no_bit(shape, head_dim):
    """The data-movement options (the producer loading lse / delta into the ring slot; at head dim 64 also K / V as
    register operands) move data, not arithmetic: fp16 / bf16 and tf32 gradients bit-identical with and without
    them, also where a head's rows start at offsets that are not multiples of 4 floats (B * H > 1, Nq = 777) and
    with one query tile against many keys."""
    _needs_hopper()
    B, H, Nq, Nk = shape
    scale = head_dim ** -0.5
    torch.manual_seed(0)
    q, do = (torch.randn(B, H, Nq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, H, Nk, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out64, lse64, _ = _reference(q, k, v, do, scale)
    out, lse = out64.to(q.dtype), lse64.float()
    base = half_gluon_bwd.get_config(head_dim)
    assert base["producer_rows"] and base["kv_in_registers"] == (head_dim == 64)
    plain = dict(base, producer_rows=False, kv_in_registers=False)
    for opts in ({}, {"producer_rows": False}, {"kv_in_registers": False}):
        got = half_gluon_bwd.half_backward(q, k, v, out, do, lse, scale, config=dict(base, **opts))
        want = half_gluon_bwd.half_backward(q, k, v, out, do, lse, scale, config=plain)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), opts
    q32, k32, v32, do32, out32 = (t.float() for t in (q, k, v, do, out))
    tf32 = half_gluon_bwd.tf32_config(head_dim)
    got = half_gluon_bwd.tf32_backward(q32, k32, v32, out32, do32, lse, scale)
    want = half_gluon_bwd.tf32_backward(q32, k32, v32, out32, do32, lse, scale,
                                        config=dict(tf32, producer_rows=False, kv_in_registers=False))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_two_backward_launches_on_two_streams_finish_bit_identically():
    """Two backward kernels launched on two streams at once (their programs interleave on the SMs, so a head's
    programs need not be resident together): the default dQ order waits only on lower program ids, so both finish,
    20 times over, with the gradients of the same calls run alone, bit for bit."""
    torch.manual_seed(0)
    calls = []
    for n in (8192, 4096):
        q, k, v, do, out = (torch.randn(2, 16, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        lse = (torch.randn(2, 16, n, device="cuda") + 8).float()
        calls.append((q, k, v, out, do, lse, 0.125))
    alone = [half_gluon_bwd.half_backward(*c) for c in calls]
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    runs = []
    for _ in range(20):
        pair = []
        for stream, c in zip(streams, calls):
            with torch.cuda.stream(stream):
                pair.append(half_gluon_bwd.half_backward(*c))
        runs.append(pair)
    torch.cuda.synchronize()
    for pair in runs:
        for got, want in zip(pair, alone):
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, accs", [((1, 2, 1000, 1000, 64), 2), ((2, 2, 300, 520, 64), 2),
                                         ((1, 2, 2048, 2048, 128), 2), ((1, 3, 2100, 3000, 64), 1),
                                         ((2, 2, 777, 1300, 64), 4)])
def test_rotated_sweeps_match_float64_like_the_unrotated(shape, accs):
    """The rotated query order (each key tile from its own starting tile, dQ shares added in the order the tiles
    arrive: rotation_step > 0 at these shapes) changes only the order of FP32 additions: gradients within the same
    bound of the float64 oracle as the unrotated kernel's, bit-for-bit reproducible."""
    _needs_hopper()
    B, H, Nq, Nk, D = shape
    torch.manual_seed(0)
    q, do = (torch.randn(B, H, Nq, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, H, Nk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out64, lse64, ref = _reference(q, k, v, do, D ** -0.5)
    out, lse = out64.to(q.dtype), lse64.float()
    cfg = dict(half_gluon_bwd.get_config(D), dq_accumulators=accs, rotated_dq_accumulators=accs)
    chains, rot, _ = half_gluon_bwd.dq_schedule(Nq, Nk, cfg)
    assert chains == accs and rot > 0
    rotated = [half_gluon_bwd.half_backward(q, k, v, out, do, lse, D ** -0.5, config=cfg) for _ in range(2)]
    plain = half_gluon_bwd.half_backward(q, k, v, out, do, lse, D ** -0.5, config=dict(cfg, rotate=False))
    assert all(torch.equal(a, b) for a, b in zip(*rotated))
    for name, got, base, want in zip("qkv", rotated[0], plain, ref):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        base_err = ((base.double() - want).abs().max() / want.abs().max()).item()
        assert base_err <= 1.6e-2 and err <= max(1.5 * base_err, 8e-3), (name, err, base_err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, cut", [((4, 8, 2, 1000, 4096, 64), False), ((2, 8, 1, 640, 8192, 128), False),
                                        ((2, 8, 2, 300, 520, 64), True), ((1, 4, 1, 1000, 1000, 128), True),
                                        ((2, 6, 3, 777, 777, 64), True), ((1, 8, 2, 2048, 2048, 128), True)])
def test_grouped_query_gradients_match_sdpa_enable_gqa(shape, cut, dtype):
    """Grouped-query / multi-query attention (Hkv K / V heads dividing H; rotated sweeps at the first shape; ``cut``:
    on 132 SMs the K / V heads' programs leave SMs idle and kv_split cuts the groups into parts with FP32 dK / dV
    partials): dQ, dK [B, Hkv, Nk, D], dV within the Triton backward's error of SDPA ``enable_gqa=True`` in float64,
    bit-for-bit reproducible; dQ bit-identical to the equal-heads kernel on K / V repeated per query head (each
    query head's dQ takes the same shares in the same turns), dK / dV within rounding of the sums of its per-head
    gradients."""
    _needs_hopper()
    import torch.nn.functional as F
    from visionattn.kernels import elsa_bwd

    B, H, Hkv, Nq, Nk, D = shape
    G, scale = H // Hkv, D ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms == 132:
        assert (half_gluon_bwd.kv_split(B, Hkv, G, Nk, half_gluon_bwd.get_config(D), sms) > 1) == cut
    torch.manual_seed(0)
    q, do = (torch.randn(B, H, Nq, D, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype) for _ in range(2))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out64 = F.scaled_dot_product_attention(*leaves, scale=scale, enable_gqa=True)
    out64.backward(do.double())
    with torch.no_grad():
        lse = torch.logsumexp((leaves[0] @ leaves[1].repeat_interleave(G, 1).transpose(-1, -2)) * scale, -1).float()
    out = out64.detach().to(dtype)
    runs = [half_gluon_bwd.half_backward(q, k, v, out, do, lse, scale) for _ in range(2)]
    mode = "fp16" if dtype == torch.float16 else "bf16"
    triton = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, mode,
                                    config=elsa_bwd.get_config(mode, D))[:3]
    for name, got, leaf, tri in zip("qkv", runs[0], leaves, triton):
        want = leaf.grad
        assert got.dtype == dtype and got.shape == want.shape, name
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        tri_err = ((tri.double() - want).abs().max() / want.abs().max()).item()
        assert err <= max(2 * tri_err, 2e-3 if dtype == torch.float16 else 1.6e-2), (name, err, tri_err)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    if min(Nq, Nk) >= half_gluon_bwd.MIN_KEYS:  # the backward plans route grouped calls here too
        routed = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, mode)[:3]
        assert all(torch.equal(a, b) for a, b in zip(routed, runs[0]))
    kr, vr = (t.repeat_interleave(G, 1) for t in (k, v))
    dq, dk, dv = half_gluon_bwd.half_backward(q, kr, vr, out, do, lse, scale)
    assert torch.equal(runs[0][0], dq)
    for got, per_head in ((runs[0][1], dk), (runs[0][2], dv)):
        summed = per_head.float().view(B, Hkv, G, Nk, D).sum(2)
        tol = 4 * G * torch.finfo(dtype).eps * summed.abs().max().item()
        assert (got.float() - summed).abs().max().item() <= tol


@pytest.mark.gpu
def test_dq_ring_depth_keeps_the_bits_per_accumulator_count():
    """For a given number of accumulators every element's shares arrive in the same order however far the
    consumers run ahead of the writers (hand-off rings of two and four query tiles): identical bits."""
    _needs_hopper()
    torch.manual_seed(0)
    B, H, N, D = 1, 2, 1000, 64
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out64, lse64, _ = _reference(q, k, v, do, D ** -0.5)
    base = half_gluon_bwd.get_config(D)
    for accs in (1, 4):
        runs = [half_gluon_bwd.half_backward(q, k, v, out64.to(q.dtype), do, lse64.float(), D ** -0.5,
                                             config=dict(base, dq_accumulators=accs, rotated_dq_accumulators=accs,
                                                         dq_ring=ring))
                for ring in (2, 4)]
        assert all(torch.equal(a, b) for a, b in zip(*runs)), accs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_plans_route_from_min_keys(dtype):
    """elsa_backward runs the Gluon kernel from MIN_KEYS keys and query rows (its bits), the Triton kernels below
    (the bits of an explicit Triton config); autograd through visionattn.attention reaches it too: gradients within
    the contract of float64, reproducible."""
    _needs_hopper()
    import visionattn
    from visionattn.kernels import elsa_bwd

    mode = "fp16" if dtype == torch.float16 else "bf16"
    D = 64
    for n in (half_gluon_bwd.MIN_KEYS - 1, half_gluon_bwd.MIN_KEYS):  # the last one for autograd below
        torch.manual_seed(0)
        q, do = (torch.randn(1, 2, n, D, device="cuda", dtype=dtype) for _ in range(2))
        # keys past the whole-head kernel's: below MIN_KEYS query rows the Triton kernels run
        k, v = (torch.randn(1, 2, n + 700, D, device="cuda", dtype=dtype) for _ in range(2))
        out64, lse64, ref = _reference(q, k, v, do, D ** -0.5)
        out, lse = out64.to(dtype), lse64.float()
        got = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, D ** -0.5, mode)[:3]
        if n >= half_gluon_bwd.MIN_KEYS:
            want = half_gluon_bwd.half_backward(q, k, v, out, do, lse, D ** -0.5)
        else:
            cfg = elsa_bwd.get_config(mode, D, n_keys=k.shape[2])
            want = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, D ** -0.5, mode, config=cfg)[:3]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), n
    runs = []
    for _ in range(2):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        visionattn.attention(qg, kg, vg, mode=mode).backward(do)
        runs.append((qg.grad, kg.grad, vg.grad))
    for got, want in zip(runs[0], ref):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-2
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
def test_planned_launch_repeats_bits_on_new_tensors():
    """A plan's later calls (the descriptors encoded onto each call's tensors without descriptor objects, where the
    Triton release allows it) give the first call's bits on copies of the inputs at other addresses, and
    half_backward's."""
    _needs_hopper()
    torch.manual_seed(0)
    B, H, N, D = 1, 2, 700, 128
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out64, lse64, _ = _reference(q, k, v, do, D ** -0.5)
    out, lse = out64.to(q.dtype), lse64.float()
    want = half_gluon_bwd.half_backward(q, k, v, out, do, lse, D ** -0.5)
    launch = half_gluon_bwd.planned_launch(q, k, v, do)
    for _ in range(3):
        qc, kc, vc, doc = (t.clone() for t in (q, k, v, do))
        delta, lse_row, counters, accumulators = half_gluon_bwd._preprocess(qc, out, doc, lse, scratch=launch.scratch)
        dk, dv = torch.empty_like(kc), torch.empty_like(vc)
        dq = launch(qc, kc, vc, doc, delta, lse_row, dk, dv, D ** -0.5, accumulators, counters)
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), want))


# ---- mode tf32 on the same kernel (HEAD_SCALES): scaled FP16 operands ----

# each head's magnitudes (q, k, v, dO) span 1e-6 .. 1e6 over the heads; the logits stay moderate (q * k = 1)
_MAGNITUDES = ((1e-6, 1e6, 1e-6, 1e3), (1e-2, 1e2, 1.0, 1e-5), (1.0, 1.0, 1e6, 1e-3), (1e5, 1e-5, 1e-4, 1e6))


def _magnitude_heads(n_q=96, n_k=160, d=64, seed=0):
    torch.manual_seed(seed)
    m = torch.tensor(_MAGNITUDES, dtype=torch.float32).T[:, None, :, None, None]  # [4 tensors, 1, H, 1, 1]
    q = torch.randn(1, len(_MAGNITUDES), n_q, d) * m[0]
    k = torch.randn(1, len(_MAGNITUDES), n_k, d) * m[1]
    v = torch.randn(1, len(_MAGNITUDES), n_k, d) * m[2]
    do = torch.randn(1, len(_MAGNITUDES), n_q, d) * m[3]
    return q, k, v, do


def _tf32_inputs(q, k, v, do, scale):
    out64, lse64, ref = _reference(q, k, v, do, scale)
    head_max = torch.zeros(q.shape[0] * q.shape[1], 4, dtype=torch.int32)
    delta, lse_row = half_gluon_bwd._preprocess(q, out64.float(), do, lse64.float(), k, v, head_max)[:2]
    return out64, lse64, ref, head_max, delta, lse_row


def test_tf32_unsupported_reasons():
    """tf32 takes float32 q / k / v at any strides (the kernel reads FP16 copies) and grouped-query K / V heads;
    fp16 inputs, head counts that do not divide, bias and a mismatched dO are refused by name; on the CPU everything
    else fits."""
    q, k, v, do = (t.float() for t in _qkv(n_q=100, n_k=300))
    reason = half_gluon_bwd.tf32_unsupported_reason
    assert reason(q, k, v, do, None, None, False, 0.125) == "tensors on cpu"
    wide = torch.randn(1, 2, 100, 70)[..., 3:67]  # no TMA-legal strides: still in scope
    assert reason(wide, k, v, do, None, None, False, 0.125) == "tensors on cpu"
    assert "head-dim stride" in reason(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, do, None, None, False,
                                       0.125)  # the operand pass reads rows
    assert "dtypes" in reason(q.half(), k.half(), v.half(), do, None, None, False, 0.125)
    assert "bias" in reason(q, k, v, do, torch.zeros(100, 300), None, False, 0.125)
    qg, kg, vg, dog = (t.float() for t in _qkv(h=4, h_kv=2))
    assert reason(qg, kg, vg, dog, None, None, False, 0.125) == "tensors on cpu"
    qg, kg, vg, dog = (t.float() for t in _qkv(h=3, h_kv=2))
    assert "do not divide the 3 query heads" in reason(qg, kg, vg, dog, None, None, False, 0.125)
    assert "grad_out" in reason(q, k, v, do[:, :, :50], None, None, False, 0.125)
    with pytest.raises(ValueError, match="tensors on cpu"):
        half_gluon_bwd.tf32_backward(q, k, v, q, do, torch.zeros(1, 2, 100), 0.125)
    # fp32's split build: head dims 64 and 128, else as tf32
    split = half_gluon_bwd.fp32_unsupported_reason
    assert split(q, k, v, do, None, None, False, 0.125) == "tensors on cpu"
    q2, k2, v2, do2 = (t.float() for t in _qkv(d=128))
    assert split(q2, k2, v2, do2, None, None, False, 0.125) == "tensors on cpu"
    q3, k3, v3, do3 = (t.float() for t in _qkv(d=32))
    assert "head dims (32, 32)" in split(q3, k3, v3, do3, None, None, False, 0.125)
    assert "bias" in split(q, k, v, do, torch.zeros(100, 300), None, False, 0.125)
    with pytest.raises(ValueError, match="head dim 96"):
        half_gluon_bwd.fp32_config(96)
    with pytest.raises(ValueError, match="tensors on cpu"):
        half_gluon_bwd.fp32_backward(q, k, v, q, do, torch.zeros(1, 2, 100), 0.125)


def test_tf32_operands_scale_each_head_by_a_power_of_two():
    """The operand kernel (interpreted): each head of q, k, v, dO times 2^s, its largest magnitude in [2^(e-1),
    2^e) for e = TF32_SCALE_EXPONENTS, rounded to FP16 (strided inputs read in place); the Scales rows hold the
    inverse powers the kernel needs: logits' qk_scale 2^-(s_q + s_k), delta's 2^(s_v + s_do), dQ's
    scale 2^-(s_v + s_do + s_k), dK's scale 2^-(s_v + s_do + s_q), dV's 2^-s_do. An all-zero head is unscaled."""
    q, k, v, do = _magnitude_heads()
    v = v.transpose(2, 3).contiguous().transpose(2, 3)  # strided: read in place
    v[0, 1] = 0.0
    scale = 0.125
    *_, head_max, _, _ = _tf32_inputs(q, k, v, do, scale)
    q16, k16, v16, do16, scales = half_gluon_bwd.scaled_operands(q, k, v, do, head_max, scale)
    shifts = []
    for t, t16, e in zip((q, k, v, do), (q16, k16, v16, do16), half_gluon_bwd.TF32_SCALE_EXPONENTS):
        peak = t.abs().amax(dim=(2, 3))[0]  # [H]
        s = torch.where(peak > 0, e - torch.frexp(peak)[1], 0)  # peak = m 2^x, m in [0.5, 1): floor(log2) = x - 1
        shifts.append(s)
        mult = torch.exp2(s.double()).float()[None, :, None, None]
        assert t16.dtype == torch.float16 and t16.is_contiguous()
        assert torch.equal(t16, (t * mult).half())
        scaled = t16.float().abs().amax(dim=(2, 3))[0]
        live = peak > 0
        assert (scaled[live] < 2.0 ** e).all() and (scaled[live] >= 2.0 ** (e - 1) * (1 - 2 ** -11)).all()
    assert shifts[2][1] == 0  # the zero head
    s_q, s_k, s_v, s_do = (s.double() for s in shifts)
    want = torch.stack([scale * 1.4426950408889634 * torch.exp2(-s_q - s_k), torch.exp2(s_v + s_do),
                        scale * torch.exp2(-s_v - s_do - s_k), scale * torch.exp2(-s_v - s_do - s_q),
                        torch.exp2(-s_do)], 1)
    assert torch.allclose(scales[:, :5].double(), want, rtol=1e-6, atol=0)


def _parts(t16, split):
    # (hi, lo) of an operand copy as float64: [.., 2 D] hi / lo halves with split, else (t, 0)
    if not split:
        return t16.double(), torch.zeros_like(t16, dtype=torch.float64)
    d = t16.shape[-1] // 2
    return t16[..., :d].double(), t16[..., d:].double()


def _halves(x, split, lo_exp=0):
    # x (float64 holding FP32 values) rounded to FP16, and with split the remainder rounded too (times 2^lo_exp,
    # as the kernel keeps dS's lo part; the value returned is the part's own)
    x = x.float()
    hi = x.half()
    lo = ((x - hi.float()) * 2.0 ** lo_exp).half().double() * 2.0 ** -lo_exp if split else torch.zeros_like(x)
    return hi.double(), lo.double()


def _mm(a, b, split):
    # the kernel's product of (hi, lo) pairs: a_lo b_hi + a_hi b_lo + a_hi b_hi (float64 model of its wgmmas)
    return a[0] @ b[0] + (a[1] @ b[0] + a[0] @ b[1] if split else 0)


def _kernel_model(q16, k16, v16, do16, scales, delta, lse_row, split=False):
    # the HEAD_SCALES kernel's arithmetic in float64 with its roundings to FP16 (P^T, dS^T; with split their hi and
    # lo parts, P^T scaled by 2^P_SPLIT_EXP first, dS's lo part kept times 2^DS_LO_EXP) and its multipliers
    B, H = q16.shape[:2]
    sc = scales.double().view(B, H, -1, 1, 1)
    qk, dmult, dqm, dkm, dvm = (sc[:, :, c] for c in range(5))
    q, k, v, do = (_parts(t, split) for t in (q16, k16, v16, do16))
    tr = lambda a: (a[0].transpose(-1, -2), a[1].transpose(-1, -2))  # noqa: E731
    lse2 = lse_row.double().view(B, H, -1, 1) * 1.4426950408889634
    p = torch.exp2(_mm(q, tr(k), split) * qk - lse2)
    dp = _mm(do, tr(v), split)
    ds = _halves(p * (dp - delta.double().view(B, H, -1, 1) * dmult), split, half_gluon_bwd.DS_LO_EXP)
    ps = _halves(p * 2.0 ** (half_gluon_bwd.P_SPLIT_EXP if split else 0), split)
    return _mm(ds, k, split) * dqm, _mm(tr(ds), q, split) * dkm, _mm(tr(ps), do, split) * dvm


@pytest.mark.parametrize("d", [64, 128])
def test_tf32_kernel_model_keeps_the_contract_over_head_magnitudes(d):
    """The kernel's arithmetic (a float64 model of its FP16 roundings, on the operand kernel's real outputs) keeps
    mode tf32's contract (3e-3 of each head's largest gradient) for heads of magnitude 1e-6 .. 1e6, within twice
    the Triton tf32 backward's error; the same model without the per-head scales (plain FP16 roundings) breaks it:
    the scaling is what keeps the heads in FP16's range."""
    from visionattn.kernels import elsa_bwd

    q, k, v, do = _magnitude_heads(d=d)
    scale = d ** -0.5
    out64, lse64, ref, head_max, delta, lse_row = _tf32_inputs(q, k, v, do, scale)
    ops = half_gluon_bwd.scaled_operands(q, k, v, do, head_max, scale)
    got = _kernel_model(*ops, delta, lse_row)
    tri = elsa_bwd.elsa_backward(q, k, v, out64.float(), do, lse64.float(), None, None, False, scale, "tf32")[:3]
    H = q.shape[1]
    for name, g, t, want in zip("qkv", got, tri, ref):
        peak = want.abs().amax(dim=(0, 2, 3))
        err = ((g - want).abs().amax(dim=(0, 2, 3)) / peak)
        tri_err = ((t.double() - want).abs().amax(dim=(0, 2, 3)) / peak)
        assert (err <= 3e-3).all() and (err <= torch.clamp(2 * tri_err, min=5e-4)).all(), (name, err, tri_err)
    # unscaled: the same roundings on q, k, v, dO as they come, multipliers for unit scales
    B = q.shape[0]
    unit = torch.zeros(B * H, 8)
    unit[:, 0], unit[:, 1], unit[:, 2], unit[:, 3], unit[:, 4] = scale * 1.4426950408889634, 1.0, scale, scale, 1.0
    plain = _kernel_model(q.half(), k.half(), v.half(), do.half(), unit, delta, lse_row)
    errs = [((g - w).abs().amax() / w.abs().amax()).item() for g, w in zip(plain, ref)]
    assert any(not e <= 3e-3 for e in errs), errs  # NaN (overflow) or out of contract


def test_fp32_split_operands_and_kernel_model_keep_the_fp32_contract():
    """Mode fp32's split build: the operand kernel (interpreted) writes each scaled operand's hi part and the
    remainder's rounding as lo part (hi + lo = the scaled FP32 value to 22 bits); the kernel's arithmetic (a float64
    model of its three-wgmma products and its FP16 roundings of P^T, scaled by 2^P_SPLIT_EXP, and dS^T) keeps mode
    fp32's 2e-6 of each head's largest gradient over heads of magnitude 1e-6 .. 1e6, where the tf32 build's one
    part does not; without P^T's scale its lo part falls into FP16's subnormals and dV leaves the contract (1024
    keys: P ~ 1e-3)."""
    q, k, v, do = _magnitude_heads(n_k=1024, d=64)
    scale = 0.125
    out64, lse64, ref, head_max, delta, lse_row = _tf32_inputs(q, k, v, do, scale)
    ops = half_gluon_bwd.scaled_operands(q, k, v, do, head_max, scale, split=True)
    one = half_gluon_bwd.scaled_operands(q, k, v, do, head_max, scale)
    for t16, t1, t in zip(ops[:4], one[:4], (q, k, v, do)):
        assert t16.shape == (*t.shape[:3], 128) and torch.equal(t16[..., :64], t1)  # the hi part is tf32's operand
        ratio = t1.float().abs().amax(dim=(2, 3)) / t.abs().amax(dim=(2, 3))  # the head's power of two, rounded
        mult = torch.exp2(torch.round(torch.log2(ratio)))[:, :, None, None]
        assert torch.equal(t16[..., 64:], (t * mult - t1.float()).half())
    assert torch.equal(ops[4][:, :4], one[4][:, :4]) and torch.equal(ops[4][:, 4], one[4][:, 4] * 2.0 ** -15)
    got = _kernel_model(*ops, delta, lse_row, split=True)
    tf32 = _kernel_model(*one, delta, lse_row)
    for name, g, t, want in zip("qkv", got, tf32, ref):
        peak = want.abs().amax(dim=(0, 2, 3))
        err = (g - want).abs().amax(dim=(0, 2, 3)) / peak
        assert (err <= 2e-6).all() and ((t - want).abs().amax(dim=(0, 2, 3)) / peak > 2e-5).all(), (name, err)
    unscaled = ops[4].clone()
    unscaled[:, 4] *= 2.0 ** 15
    p_exp = half_gluon_bwd.P_SPLIT_EXP
    try:
        half_gluon_bwd.P_SPLIT_EXP = 0  # the model's P^T without its scale
        dv = _kernel_model(*ops[:4], unscaled, delta, lse_row, split=True)[2]
    finally:
        half_gluon_bwd.P_SPLIT_EXP = p_exp
    assert ((dv - ref[2]).abs().amax() / ref[2].abs().amax()).item() > 2e-6


def test_fp32_split_keeps_the_lo_part_of_ds_out_of_the_subnormals_at_many_keys():
    """dS takes P's magnitude (~1 / Nk) far below its bound, so at thousands of keys the rounding remainder of its
    hi part (2^-11 of it) falls into FP16's subnormals and loses its bits: in the float64 model of the split kernel
    dQ (a sum over the keys) leaves mode fp32's 2e-6 at 8192 keys with dS's lo part kept as it is, and dQ and dK
    keep it with the lo part kept times 2^DS_LO_EXP (the kernel's, multiplied back after its products)."""
    q, k, v, do = _magnitude_heads(n_q=64, n_k=8192, d=64)
    scale = 0.125
    out64, lse64, ref, head_max, delta, lse_row = _tf32_inputs(q, k, v, do, scale)
    ops = half_gluon_bwd.scaled_operands(q, k, v, do, head_max, scale, split=True)

    def worst(model):
        return [((g - w).abs().amax(dim=(0, 2, 3)) / w.abs().amax(dim=(0, 2, 3))).max().item()
                for g, w in zip(model[:2], ref[:2])]

    kept = worst(_kernel_model(*ops, delta, lse_row, split=True))
    lo_exp = half_gluon_bwd.DS_LO_EXP
    try:
        half_gluon_bwd.DS_LO_EXP = 0  # dS's lo part as the remainder rounds
        plain = worst(_kernel_model(*ops, delta, lse_row, split=True))
    finally:
        half_gluon_bwd.DS_LO_EXP = lo_exp
    assert max(kept) <= 2e-6 and plain[0] > 2e-6, (kept, plain)


# grouped-query heads of many magnitudes: K / V heads (k, v) cycling through these, the query heads of a group with
# q at c / k (moderate logits) for c cycling through _GROUPED_Q and dO cycling through _GROUPED_DO, so that the query
# heads of one group have multipliers far apart (the kernel's accumulators cross those seams)
_GROUPED_KV = ((1e6, 1e-6), (1e-5, 1e-4), (1.0, 1e6))
_GROUPED_Q = (1.0, 0.3, 2.0)
_GROUPED_DO = (1e3, 1e-5, 1e6, 1e-3)


def _grouped_magnitude_heads(n_q=96, n_k=160, d=64, b=1, h=4, h_kv=2, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    group = h // h_kv
    kv = torch.tensor([_GROUPED_KV[j % len(_GROUPED_KV)] for j in range(h_kv)], device=device)
    q_m = torch.tensor([_GROUPED_Q[i % len(_GROUPED_Q)] for i in range(h)], device=device) / \
        kv[:, 0].repeat_interleave(group)
    do_m = torch.tensor([_GROUPED_DO[i % len(_GROUPED_DO)] for i in range(h)], device=device)
    rand = lambda hh, n: torch.randn(b, hh, n, d, generator=g, device=device)  # noqa: E731
    return (rand(h, n_q) * q_m[:, None, None], rand(h_kv, n_k) * kv[:, 0, None, None],
            rand(h_kv, n_k) * kv[:, 1, None, None], rand(h, n_q) * do_m[:, None, None])


@pytest.mark.parametrize("split", [False, True])
def test_grouped_scaled_operands_copy_each_key_value_head_once(split):
    """Grouped-query attention in the tf32 / fp32 builds (interpreted operand pass): the preprocess's head maxima
    equal the equal-heads run's on K / V repeated per query head (each query head's row holding its K / V head's),
    and the operand kernel gives that run's q / dO copies and Scales rows bit for bit and one copy of each K / V
    head (the repeated run's copy of its first query head)."""
    q, k, v, do = _grouped_magnitude_heads()
    scale = 0.125
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    out64, lse64, _ = _reference(q, kr, vr, do, scale)
    maxima = []
    for kk, vv in ((k, v), (kr, vr)):
        head_max = torch.zeros(q.shape[0] * q.shape[1], 4, dtype=torch.int32)
        half_gluon_bwd._preprocess(q, out64.float(), do, lse64.float(), kk, vv, head_max)
        maxima.append(head_max)
    assert torch.equal(*maxima)
    grouped = half_gluon_bwd.scaled_operands(q, k, v, do, maxima[0], scale, split)
    repeated = half_gluon_bwd.scaled_operands(q, kr, vr, do, maxima[1], scale, split)
    assert grouped[1].shape[1] == grouped[2].shape[1] == 2
    for i in (0, 3):
        assert torch.equal(grouped[i], repeated[i])
    assert torch.equal(grouped[4][:, :5], repeated[4][:, :5])  # the rows' five multipliers (the rest unused)
    for i in (1, 2):
        assert torch.equal(grouped[i], repeated[i][:, ::2])


@pytest.mark.parametrize("split", [False, True])
def test_grouped_kernel_model_keeps_the_contract(split):
    """The HEAD_SCALES kernels' arithmetic with grouped-query heads (the float64 model of their roundings, on the
    operand pass's real outputs: each query head's products on its K / V head's copy, its own multipliers, the
    group's dK / dV summed over its query heads in true units, as the kernel's accumulators hold them after each
    exact power-of-two rescale) keeps the mode's contract against the float64 gradients of SDPA's enable_gqa
    semantics (K / V repeated, their gradients summed over the group): tf32 3e-3, fp32 2e-6 of each head's
    largest."""
    q, k, v, do = _grouped_magnitude_heads(n_k=1024 if split else 160)
    scale = 0.125
    group = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(group, 1) for t in (k, v))
    out64, lse64, (dq64, dk64, dv64) = _reference(q, kr, vr, do, scale)
    head_max = torch.zeros(q.shape[0] * q.shape[1], 4, dtype=torch.int32)
    delta, lse_row = half_gluon_bwd._preprocess(q, out64.float(), do, lse64.float(), k, v, head_max)[:2]
    q16, k16, v16, do16, scales = half_gluon_bwd.scaled_operands(q, k, v, do, head_max, scale, split)
    k16r, v16r = (t.repeat_interleave(group, 1) for t in (k16, v16))  # each query head's K / V copy
    dq, dk_h, dv_h = _kernel_model(q16, k16r, v16r, do16, scales, delta, lse_row, split=split)
    dk, dv = (t.view(t.shape[0], -1, group, *t.shape[2:]).sum(2) for t in (dk_h, dv_h))
    want = (dq64, *(t.view(t.shape[0], -1, group, *t.shape[2:]).sum(2) for t in (dk64, dv64)))
    bound = 2e-6 if split else 3e-3
    for name, got, ref in zip("qkv", (dq, dk, dv), want):
        err = (got - ref).abs().amax(dim=(0, 2, 3)) / ref.abs().amax(dim=(0, 2, 3))
        assert (err <= bound).all(), (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("shape", [(1, 8, 2, 1024, 1024, 64), (2, 8, 4, 2100, 2048, 64), (1, 16, 2, 4096, 4096, 64),
                                   (1, 8, 2, 1100, 1024, 128)])
def test_grouped_scaled_gradients_match_sdpa_enable_gqa(shape, split):
    """The tf32 / fp32 builds with grouped-query K / V heads (a program per key tile and K / V head sweeping its query
    heads, the accumulators rescaled to each head's multipliers; groups cut into parts where the SMs idle): dQ,
    dK [B, Hkv, Nk, D], dV within the mode's contract of float64 SDPA ``enable_gqa=True`` per head in L2 (heads of
    magnitude 1e-6 .. 1e6), dQ bit-equal to the equal-heads build on K / V repeated per query head, bit-for-bit
    reproducible, and what elsa_backward returns where its rules route there. The contract is a relative L2 error, as
    :mod:`visionattn.modes` states it: at thousands of keys the largest elementwise error of fp32's equal-heads build
    on these heads reaches 2.5e-6 of a head's largest gradient (L2 1.2e-6), and the grouped build's is the same."""
    import torch.nn.functional as F
    from visionattn.kernels import elsa_bwd
    from visionattn.kernels._launch import sm_count

    _needs_hopper()
    B, H, h_kv, Nq, Nk, D = shape
    q, k, v, do = _grouped_magnitude_heads(Nq, Nk, D, B, H, h_kv, device="cuda")
    scale = D ** -0.5
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out64 = F.scaled_dot_product_attention(*leaves, scale=scale, enable_gqa=True)
    out64.backward(do.double())
    lse = torch.logsumexp(scale * leaves[0].detach() @ leaves[1].detach().repeat_interleave(H // h_kv, 1)
                          .transpose(-1, -2), dim=-1).float()
    out = out64.detach().float()
    backward = half_gluon_bwd.fp32_backward if split else half_gluon_bwd.tf32_backward
    runs = [backward(q, k, v, out, do, lse, scale) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    kr, vr = k.repeat_interleave(H // h_kv, 1), v.repeat_interleave(H // h_kv, 1)
    assert torch.equal(backward(q, kr, vr, out, do, lse, scale)[0], runs[0][0])
    bound = 2e-6 if split else 3e-3
    for name, got, leaf in zip("qkv", runs[0], leaves):
        want = leaf.grad
        assert got.shape == want.shape and got.dtype == torch.float32, name
        err = (got.double() - want).norm(dim=(2, 3)) / want.norm(dim=(2, 3))
        assert (err <= bound).all(), (name, err)
    mode = "fp32" if split else "tf32"
    rule = half_gluon_bwd.fp32_preferred if split else half_gluon_bwd.tf32_preferred
    if rule(B, H, Nq, Nk, D, sm_count(q.device)):
        got = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, mode)[:3]
        assert all(torch.equal(a, b) for a, b in zip(got, runs[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4, 1000, 1000, 64), (1, 4, 384, 520, 128), (1, 4, 2100, 2048, 64)])
def test_tf32_gradients_match_float64_and_are_reproducible(shape):
    """tf32_backward on heads of magnitude 1e-6 .. 1e6: each head's dQ, dK, dV within mode tf32's contract (3e-3
    of its largest) and twice the Triton tf32 backward's error of the float64 oracle, float32, bit-for-bit equal
    over repeated runs; a strided (heads-inner) q gives the same bits."""
    from visionattn.kernels import elsa_bwd

    _needs_hopper()
    B, H, Nq, Nk, D = shape
    q, k, v, do = (t.cuda() for t in _magnitude_heads(Nq, Nk, D))
    scale = D ** -0.5
    out64, lse64, ref = _reference(q, k, v, do, scale)
    out, lse = out64.float(), lse64.float()
    runs = [half_gluon_bwd.tf32_backward(q, k, v, out, do, lse, scale) for _ in range(3)]
    tri = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, "tf32",
                                 config=elsa_bwd.get_config("tf32", D))[:3]
    for name, got, want, t in zip("qkv", runs[0], ref, tri):
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        peak = want.abs().amax(dim=(0, 2, 3))
        err = (got.double() - want).abs().amax(dim=(0, 2, 3)) / peak
        tri_err = (t.double() - want).abs().amax(dim=(0, 2, 3)) / peak
        assert (err <= 3e-3).all() and (err <= torch.clamp(2 * tri_err, min=5e-4)).all(), (name, err, tri_err)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))
    q_inner = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert all(torch.equal(a, b) for a, b in
               zip(half_gluon_bwd.tf32_backward(q_inner, k, v, out, do, lse, scale), runs[0]))


def test_tf32_preferred_from_three_waves_or_long_sequences():
    """tf32 takes the Gluon kernel from TF32_MIN_QUERIES query rows when its grid (one program per 128 keys and head)
    fills the GPU TF32_MIN_WAVES times (ViT-B/16 224 at batch 64, 1024 px at batch 8 on 132 SMs) or both lengths
    reach TF32_LONG (TF32_LONG_D128 at head dim 128); not one head group of 2048 tokens at head dim 64, nor few
    queries against many keys."""
    pref = half_gluon_bwd.tf32_preferred
    assert pref(64, 12, 197, 197, 64, 132) and pref(8, 12, 1025, 1025, 64, 132)
    assert pref(1, 8, 4096, 4096, 64, 132) and pref(1, 8, 1024, 1024, 128, 132)
    assert not pref(1, 16, 2048, 2048, 64, 132) and not pref(1, 16, 1536, 1536, 64, 132)
    assert not pref(1, 8, 1000, 1000, 128, 132) and not pref(8, 16, 64, 65536, 64, 132)
    waves = half_gluon_bwd.TF32_MIN_WAVES
    assert pref(1, 1, 128, 128 * waves * 100, 64, 100)
    assert not pref(1, 1, 128, 128 * waves * 100 - 128, 64, 1000)


def test_fp32_preferred_from_two_waves_or_1024_tokens():
    """fp32's split build takes over from the Triton kernels earlier than tf32's: from TF32_MIN_QUERIES query rows
    when its grid fills the GPU FP32_MIN_WAVES times (ViT-B/16 224 from batch 16 on 132 SMs) or both lengths reach
    FP32_LONG (one head group of 1025 or 1536 tokens, which tf32 leaves to Triton); not ViT-B/16 224 at batch 8,
    nor 577 tokens at batch 2, nor few queries against many keys. At head dim 128 (the Triton kernels' slowest) it
    takes every grid from TF32_MIN_QUERIES query rows."""
    pref = half_gluon_bwd.fp32_preferred
    low = half_gluon_bwd.TF32_MIN_QUERIES
    assert pref(1, 1, low, low, 128, 132) and pref(8, 12, 197, 197, 128, 132) and pref(1, 1, low, 65536, 128, 132)
    assert not pref(1, 1, low - 1, 4096, 128, 132) and not pref(8, 16, 64, 65536, 128, 132)
    assert pref(16, 12, 197, 197, 64, 132) and pref(1, 12, 1025, 1025, 64, 132) and pref(1, 16, 1536, 1536, 64, 132)
    assert not half_gluon_bwd.tf32_preferred(1, 16, 1536, 1536, 64, 132)
    assert not pref(8, 12, 197, 197, 64, 132) and not pref(2, 12, 577, 577, 64, 132)
    assert not pref(8, 16, 64, 65536, 64, 132) and not pref(1, 1, 1000, 1000, 64, 132)
    waves = half_gluon_bwd.FP32_MIN_WAVES
    assert pref(1, 1, 128, 128 * waves * 100, 64, 100) and not pref(1, 1, 128, 128 * waves * 100 - 128, 64, 100)


@pytest.mark.gpu
def test_tf32_backward_plans_route_by_waves():
    """elsa_backward(mode='tf32') runs the HEAD_SCALES build where tf32_preferred says (tf32_backward's bits), the
    Triton kernels elsewhere; autograd through visionattn.attention(mode='tf32') reaches it: gradients within the
    contract, reproducible."""
    _needs_hopper()
    import visionattn
    from visionattn.kernels import elsa_bwd
    from visionattn.kernels._launch import sm_count

    D, n = 64, 1024
    for B, H in ((1, 4), (4, 16)):  # 32 and 512 programs: on each side of 3 waves on 100-170 SMs
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(B, H, n, D, device="cuda") for _ in range(4))
        out64, lse64, ref = _reference(q, k, v, do, D ** -0.5)
        out, lse = out64.float(), lse64.float()
        got = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, D ** -0.5, "tf32")[:3]
        gluon = half_gluon_bwd.tf32_preferred(B, H, n, n, D, sm_count(q.device))
        assert gluon == (H == 16), (B, H)
        if gluon:
            want = half_gluon_bwd.tf32_backward(q, k, v, out, do, lse, D ** -0.5)
        else:
            cfg = elsa_bwd.get_config("tf32", D)
            want = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, D ** -0.5, "tf32", config=cfg)[:3]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (B, H)
    runs = []
    for _ in range(2):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        visionattn.attention(qg, kg, vg, mode="tf32").backward(do)
        runs.append((qg.grad, kg.grad, vg.grad))
    for got, want in zip(runs[0], ref):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 3e-3
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1000, 1000, 64), (1, 2100, 2048, 64), (2, 320, 900, 64), (1, 1100, 1100, 64),
                                   (1, 8192, 8192, 64), (1, 1000, 1000, 128), (1, 2048, 2100, 128), (2, 33, 700, 128),
                                   (1, 4097, 4097, 128), (1, 8192, 8192, 128)])
def test_fp32_split_gradients_match_float64_and_are_reproducible(shape):
    """fp32_backward (split-FP16 operands and products; at head dim 128 the consumers split the head dim) on heads
    of magnitude 1e-6 .. 1e6: each head's dQ, dK, dV within 2e-6 of its largest of the float64 oracle (at head dim
    128, whose logits sum twice as many products, within the larger of that and twice the Triton f16x3-head kernels'
    error, the same split-FP16 arithmetic in another implementation, as the tf32 test bounds tf32's, and each head's
    L2 error within the mode's 2e-6), float32, bit-for-bit equal over repeated runs; elsa_backward(mode='fp32')
    gives its bits where fp32_preferred routes there."""
    from visionattn.kernels import elsa_bwd
    from visionattn.kernels._launch import sm_count

    _needs_hopper()
    B, Nq, Nk, D = shape  # the heads: one per row of _MAGNITUDES
    q, k, v, do = (t.cuda().repeat(B, 1, 1, 1) for t in _magnitude_heads(Nq, Nk, D))
    H = q.shape[1]
    scale = 0.125
    out64, lse64, ref = _reference(q, k, v, do, scale)
    out, lse = out64.float(), lse64.float()
    runs = [half_gluon_bwd.fp32_backward(q, k, v, out, do, lse, scale) for _ in range(3)]
    tri = (None if D == 64 else elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, "fp32",
                                                       config=elsa_bwd.get_config("fp32", D))[:3])
    for i, (name, got, want) in enumerate(zip("qkv", runs[0], ref)):
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        peak = want.abs().amax(dim=(0, 2, 3))
        err = (got.double() - want).abs().amax(dim=(0, 2, 3)) / peak
        bound = torch.full_like(err, 2e-6)
        if tri is not None:
            bound = torch.maximum(bound, 2 * (tri[i].double() - want).abs().amax(dim=(0, 2, 3)) / peak)
            l2 = (got.double() - want).norm(dim=(2, 3)) / want.norm(dim=(2, 3))
            assert (l2 <= 2e-6).all(), (name, l2)
        assert (err <= bound).all(), (name, err, bound)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))
    if half_gluon_bwd.fp32_preferred(B, H, Nq, Nk, D, sm_count(q.device)):
        got = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, "fp32")[:3]
        assert all(torch.equal(a, b) for a, b in zip(got, runs[0]))
