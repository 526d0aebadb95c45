"""FP16 / BF16 varlen (packed ragged) attention forward for Hopper in Gluon: the warp-specialized schedule of
:mod:`.half_gluon` (TMA producer warp, one or two consumer warpgroups, S of key tile t+1 under P V of tile t,
ping-pong at D = 128) over a table of work tiles (sequence, head, query tile) instead of a dense grid.

* **work tiles from the lengths**: with the lengths on the host, every query tile of every (sequence, head) is a
  work tile, and each of the ``ctas_per_sm x SMs`` programs takes a fixed list of them, assigned on the host
  longest first to the least-loaded program (Graham's LPT rule, the cost of a tile its key tiles plus a start-up
  cost: :func:`assign`); programs run their lists in that order, so tiles of one (sequence, head) run side by side
  and share K / V in L2. The assignment is built once per signature and lengths.
* **K / V rows of the sequence only**: the packed tensors are TMA-read as one [1, H, total, D] tensor, so a key
  tile reaching past its sequence's keys would read the next sequence's rows, and a non-finite value there would
  reach this sequence's output through ``0 x NaN``. The last key tile therefore ends at the sequence's last key
  (it starts ``BLOCK_N - rem`` keys early, those keys folded already and masked out of it); sequences with queries
  need at least ``BLOCK_N`` keys (:func:`unsupported_reason`; shorter ones run on the Triton kernel). Query rows
  past a sequence's end are read (other sequences' queries) but never written.

The fold is :mod:`.half_gluon`'s (the ELSA (m, S, W) recurrence in base 2, FP32 scores and state, P rounded to the
input dtype before ``P V``, one division at the end): results within the Triton varlen kernel's error (~2.7e-4
fp16, ~2.1e-3 bf16 vs float64). Gluon cannot run under ``TRITON_INTERPRET=1``: CPU tests compile it offline for
sm_90 and check the assignment and the dispatch; ``pytest -m gpu`` checks results against the float64 oracle.
"""
from __future__ import annotations

import functools
import heapq

import torch

from . import half_gluon
from ._gluon import hopper_tma_scope_reason, nvmma_layout
from ._launch import KernelCall, PlanCache, PlannedLaunch, cdiv, device_table, sm_count

_IMPORT_ERROR = half_gluon._IMPORT_ERROR
if _IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ._gluon import softmax_tile, split_mma
    from .half_gluon import _fold_parts, _last_pv, _p_operands, _row_parts, _shared_buffers, _step

__all__ = ["unsupported_reason", "preferred", "get_config", "assign", "kernel_constexprs", "descriptor_types",
           "VarlenGluonPlan", "HEAD_DIMS", "START_COST_TILES", "ONE_CONSUMER_BELOW", "FEW_QUERY_ROWS"]

HEAD_DIMS = half_gluon.HEAD_DIMS

# a work tile's cost in :func:`assign`: its key tiles plus this many (the Q load, the first S, the epilogue)
START_COST_TILES = 1


# D = 64 batches whose query rows meet fewer keys than this on average (work-weighted) run one consumer warpgroup
# per CTA: finer work tiles (64 rows) on twice the programs balance a ragged batch better, where the dense kernel
# switches at :data:`.half_gluon.ONE_CONSUMER_BELOW` (docs/tuning.md: varlen fp16 / bf16 on the Gluon kernel)
ONE_CONSUMER_BELOW = 4096


def get_config(lens_q, lens_k, head_dim: int, consumers: int | None = None) -> dict:
    """Launch config for sequences of ``lens_q`` queries and ``lens_k`` keys, from :func:`.half_gluon.get_config`:
    at D = 64 one consumer warpgroup and 64 query rows per CTA, two CTAs per SM, while the batch's work-weighted
    mean key count ``sum(nq nk^2) / sum(nq nk)`` (the keys a query row meets on average) is below
    :data:`ONE_CONSUMER_BELOW`, else two consumers and 128 rows, one CTA per SM; at D = 128 two consumers taking
    turns (ping-pong). Every key tile is whole (the last one shifted to end at its sequence's last key).
    ``consumers`` (1 or 2) overrides the choice at D = 64."""
    if consumers is None:
        work = sum(nq * nk for nq, nk in zip(lens_q, lens_k))
        mean_keys = sum(nq * nk * nk for nq, nk in zip(lens_q, lens_k)) // max(work, 1)
        consumers = 1 if mean_keys < ONE_CONSUMER_BELOW else 2
    below = half_gluon.ONE_CONSUMER_BELOW
    cfg = half_gluon.get_config(below - 1 if consumers == 1 else below, head_dim)  # no query rows: no four consumers
    return dict(cfg, tail_keys=(cfg["BLOCK_N"], 0), one_tile=False)


# the longest query sequence must pass this many rows: few-query calls (a 64-row work tile of 1-64 real rows) keep the
# Triton kernels and their stream-K / split-KV schedules, which are measured there (docs/benchmarks/split_kv_h200.md);
# this kernel is measured on self-attention batches
FEW_QUERY_ROWS = 64


def preferred(lens_q) -> bool:
    """Whether the launcher offers an in-scope call of these query lengths to this kernel: its longest query
    sequence has more than :data:`FEW_QUERY_ROWS` rows."""
    return max(lens_q, default=0) > FEW_QUERY_ROWS


def _as4(t: torch.Tensor) -> torch.Tensor:
    # packed [total, H, D] as the [1, H, total, D] view the descriptors read
    return t.unsqueeze(0).transpose(1, 2)


def unsupported_reason(q, k, v, lens_q, lens_k, is_causal: bool, scale: float, row_offsets, block_n: int = 128):
    """Why :class:`VarlenGluonPlan` cannot run this call (the Triton varlen kernel then does), or ``None``.

    q [total_q, H, D], k [total_k, H, D], v [total_k, H, Dv] packed; ``lens_q`` / ``lens_k`` the host lengths (None:
    not on the host); ``row_offsets``: sequences read in place (not packed)."""
    if lens_q is None:
        return "sequence lengths not on the host (the work tiles are assigned from them)"
    if row_offsets is not None:
        return "sequences read in place (row offsets), not packed"
    if k.shape[1] != q.shape[1]:
        return "grouped-query attention"
    if any(nq and nk < block_n for nq, nk in zip(lens_q, lens_k)):
        return f"a sequence with fewer than {block_n} keys (a key tile would reach the next sequence's rows)"
    return hopper_tma_scope_reason(_as4(q), _as4(k), _as4(v), None, None, is_causal, scale, 1,
                                   dtypes=(torch.float16, torch.bfloat16), head_dims=HEAD_DIMS,
                                   import_error=_IMPORT_ERROR)


@functools.lru_cache(maxsize=1024)
def assign(lens_q: tuple[int, ...], lens_k: tuple[int, ...], heads: int, rows: int, block_n: int,
           programs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The work tiles of each program: ``(tiles, starts)``, program ``p`` running ``tiles[starts[p]:starts[p + 1]]``
    in order; a work tile is ``(s * heads + h) * n_m + m`` (query tile ``m`` of ``rows`` rows of head ``h`` of
    sequence ``s``, ``n_m`` = the most query tiles of a sequence). Tiles go longest first (by key tiles; a
    sequence's tiles and heads in order) to the program with the least work so far (the cost of a tile its key
    tiles plus :data:`START_COST_TILES`; ties to the lower program): Graham's LPT list schedule, which the
    hardware's own block scheduler approximates for a grid of one program per tile. Sequences without queries have
    no tiles; at most ``programs`` programs (fewer where there are fewer tiles)."""
    n_m = max(1, max((cdiv(n, rows) for n in lens_q), default=1))
    order = sorted(range(len(lens_q)), key=lambda s: -lens_k[s])
    work = [((s * heads + h) * n_m + m, cdiv(lens_k[s], block_n) + START_COST_TILES)
            for s in order for h in range(heads) for m in range(cdiv(lens_q[s], rows))]
    n_prog = max(1, min(programs, len(work)))
    lists = [[] for _ in range(n_prog)]
    load = [(0, p) for p in range(n_prog)]  # a heap of (work so far, program)
    for entry, cost in work:
        done, p = heapq.heappop(load)
        lists[p].append(entry)
        heapq.heappush(load, (done + cost, p))
    starts = [0]
    for lst in lists:
        starts.append(starts[-1] + len(lst))
    return tuple(e for lst in lists for e in lst), tuple(starts)


if _IMPORT_ERROR is None:
    @gluon.jit
    def _work_tile(Tiles, CuQ, CuK, w, H, n_m_tiles, ROWS: gl.constexpr):
        # table entry w -> (head, first packed query row, query rows from there to the sequence's end, first packed
        # key row, keys)
        entry = gl.load(Tiles + w)
        sh = entry // n_m_tiles
        seq = sh // H
        q0 = gl.load(CuQ + seq)
        k0 = gl.load(CuK + seq)
        m0 = (entry % n_m_tiles) * ROWS
        return sh % H, q0 + m0, gl.load(CuQ + seq + 1) - q0 - m0, k0, gl.load(CuK + seq + 1) - k0

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, Tiles, Starts,
                  CuQ, CuK, H, n_m_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  Q_BUFS: gl.constexpr, CONSUMERS: gl.constexpr):
        # one warp: per work tile, each consumer's Q tile into a free Q buffer, then the key tiles into ring slot
        # g % STAGES (g counts key tiles over the program's work tiles), the last one ending at the last key
        pid = gl.program_id(0)
        g = 0
        i = 0
        for w in range(gl.load(Starts + pid), gl.load(Starts + pid + 1)):
            head, q_row, _, k_row, n_k = _work_tile(Tiles, CuQ, CuK, w, H, n_m_tiles, CONSUMERS * BLOCK_M)
            qb = i % Q_BUFS
            q_bar = q_ready.index(qb)
            mbarrier.wait(q_empty.index(qb), ((i // Q_BUFS) & 1) ^ 1)
            mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
            for c in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(q_desc, [0, head, q_row + c * BLOCK_M, 0], q_bar,
                                                q_smem.index(CONSUMERS * qb + c))
            for t in range(gl.cdiv(n_k, BLOCK_N)):
                slot = g % STAGES
                mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
                row = k_row + gl.minimum(t * BLOCK_N, n_k - BLOCK_N)
                bar = ready.index(slot)
                mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [0, head, row, 0], bar, k_smem.index(slot))
                tma.async_copy_global_to_shared(v_desc, [0, head, row, 0], bar, v_smem.index(slot))
                g += 1
            i += 1

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, O, LSE, Tiles, Starts, CuQ,
                  CuK, soh, som, H, n_m_tiles, total_q, qk_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                  Q_BUFS: gl.constexpr, CONSUMERS: gl.constexpr, WRITE_LSE: gl.constexpr):
        # one warpgroup: query rows [WG * BLOCK_M, + BLOCK_M) of each of the program's work tiles
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        my_turn = turn.index(WG % 2)  # turns as in half_gluon: n_tiles + 1 per group and work tile
        other_turn = turn.index(1 - WG % 2)
        l_mine = l_smem.slice(WG * BLOCK_M, BLOCK_M)
        offs_sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        # the last key tile ends at the sequence's last key: of its columns j, those with BLOCK_N - 1 - j < rem are
        # new keys. softmax_tile keeps the columns with t * BLOCK_N + offs < limit: with these offsets and t = 0,
        # limit = rem keeps exactly those
        offs_new = BLOCK_N - 1 - offs_sn
        offs_od = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        o_zero = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
        g0 = 0
        turns = 0
        i = 0
        for w in range(gl.load(Starts + gl.program_id(0)), gl.load(Starts + gl.program_id(0) + 1)):
            head, q_row, rows, k_row, n_k = _work_tile(Tiles, CuQ, CuK, w, H, n_m_tiles, CONSUMERS * BLOCK_M)
            n_tiles = gl.cdiv(n_k, BLOCK_N)
            rem = n_k - (n_tiles - 1) * BLOCK_N
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = _row_parts(s_zero)
            acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
            qb = i % Q_BUFS
            mbarrier.wait(q_ready.index(qb), (i // Q_BUFS) & 1)
            q_t = q_smem.index(CONSUMERS * qb + WG).reshape([BLOCK_M, HEAD_D])
            mbarrier.wait(ready.index(g0 % STAGES), (g0 // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(my_turn, (turns + (WG == 0)) & 1)
            k_0 = k_smem.index(g0 % STAGES).reshape([BLOCK_N, HEAD_D])
            s_tok = split_mma(q_t, q_t, k_0.permute((1, 0)), k_0.permute((1, 0)), s_zero, False, 1)
            if PINGPONG:
                mbarrier.arrive(other_turn)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            first_new = rem + (n_tiles > 1).to(gl.int32) * (BLOCK_N - rem)  # all columns but in a one-tile call
            p, m_i, alpha = softmax_tile(s, m_i, 0, first_new, qk_scale, offs_new, BLOCK_N, True)
            l_i = _fold_parts(l_i, alpha, p)
            p16, p_lo = _p_operands(p, q_smem.dtype, p_layout, 1)
            for t in range(0, n_tiles - 2):
                acc, p16, p_lo, m_i, l_i = _step(acc, p16, p_lo, m_i, l_i, t, g0 + t, turns + t + 1, q_t, q_t,
                                                 k_smem, v_smem, l_mine, ready, empty, my_turn, other_turn, n_k,
                                                 qk_scale, offs_sn, s_zero, o_zero, WG, BLOCK_N, HEAD_D, STAGES,
                                                 False, PINGPONG, 0, 1, q_empty.index(qb), False)
            if n_tiles > 1:  # the last key tile, shifted: _step masks with tile index t + 1 = 0 and limit rem
                t = n_tiles - 2
                acc, p16, p_lo, m_i, l_i = _step(acc, p16, p_lo, m_i, l_i, -1, g0 + t, turns + t + 1, q_t, q_t,
                                                 k_smem, v_smem, l_mine, ready, empty, my_turn, other_turn, rem,
                                                 qk_scale, offs_new, s_zero, o_zero, WG, BLOCK_N, HEAD_D, STAGES,
                                                 True, PINGPONG, 0, 1, q_empty.index(qb), False)
            acc = _last_pv(acc, p16, p_lo, v_smem, o_zero, q_empty.index(qb), empty, (g0 + n_tiles - 1) % STAGES,
                           my_turn, other_turn, turns + n_tiles, WG, BLOCK_N, HEAD_D, PINGPONG, 0, 1, False, False)
            # the epilogue overlaps the producer's loads for the next work tile
            l_row = gl.convert_layout(gl.sum(l_i, axis=1), gl.SliceLayout(1, o_layout))
            out = acc / l_row[:, None]
            offs_om = WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
            row_ok = offs_om < rows
            packed = (q_row + offs_om).to(gl.int64)
            gl.store(O + packed[:, None] * som + head.to(gl.int64) * soh + offs_od[None, :],
                     out.to(O.dtype.element_ty), mask=row_ok[:, None])
            if WRITE_LSE:  # natural-log LSE of the scaled logits, [H, total_q]: m and log2 S are in log2 units
                lse = (gl.convert_layout(m_i, gl.SliceLayout(1, o_layout)) + gl.log2(l_row)) * 0.6931471805599453
                gl.store(LSE + head.to(gl.int64) * total_q + packed, lse, mask=row_ok)
            g0 += n_tiles
            turns += n_tiles + 1
            i += 1

    @gluon.jit(do_not_specialize=["H", "n_m_tiles", "total_q"])  # new lengths compile nothing new
    def _varlen_fwd_kernel(q_desc, k_desc, v_desc, O, LSE, Tiles, Starts, CuQ, CuK, soh, som, H, n_m_tiles, total_q,
                           qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                           STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           Q_BUFS: gl.constexpr, CONSUMERS: gl.constexpr, WRITE_LSE: gl.constexpr):
        # program p runs work tiles Tiles[Starts[p]:Starts[p + 1]] (assign); descriptors over [1, H, total, D] views
        # of the packed q / k / v; O [total_q, H, D] (row stride som, head stride soh), LSE [H, total_q]
        gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2, "1 or 2 consumer warpgroups")
        gl.static_assert(not PINGPONG or CONSUMERS == 2, "ping-pong needs two consumers")
        q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn = _shared_buffers(
            q_desc, k_desc, v_desc, BLOCK_M, STAGES, Q_BUFS, CONSUMERS, 1)
        if CONSUMERS == 1:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, O, LSE, Tiles,
                             Starts, CuQ, CuK, soh, som, H, n_m_tiles, total_q, qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_D,
                             STAGES, PINGPONG, Q_BUFS, CONSUMERS, WRITE_LSE)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, Tiles,
                             Starts, CuQ, CuK, H, n_m_tiles, BLOCK_M, BLOCK_N, STAGES, Q_BUFS, CONSUMERS)),
            ], [1], [24])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, O, LSE, Tiles,
                             Starts, CuQ, CuK, soh, som, H, n_m_tiles, total_q, qk_scale, 0, BLOCK_M, BLOCK_N, HEAD_D,
                             STAGES, PINGPONG, Q_BUFS, CONSUMERS, WRITE_LSE)),
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, O, LSE, Tiles,
                             Starts, CuQ, CuK, soh, som, H, n_m_tiles, total_q, qk_scale, 1, BLOCK_M, BLOCK_N, HEAD_D,
                             STAGES, PINGPONG, Q_BUFS, CONSUMERS, WRITE_LSE)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, Tiles,
                             Starts, CuQ, CuK, H, n_m_tiles, BLOCK_M, BLOCK_N, STAGES, Q_BUFS, CONSUMERS)),
            ], [4, 1], [CONSUMER_REGS, 24])


def kernel_constexprs(cfg: dict, head_dim: int, write_lse: bool = False) -> dict:
    """The constexpr arguments of :func:`_varlen_fwd_kernel` for a :func:`get_config` dict."""
    return dict(BLOCK_M=cfg["BLOCK_M"] // cfg["consumers"], BLOCK_N=cfg["BLOCK_N"], HEAD_D=head_dim,
                STAGES=cfg["STAGES"], PINGPONG=cfg["PINGPONG"], CONSUMER_REGS=cfg["consumer_regs"],
                Q_BUFS=cfg["q_buffers"], CONSUMERS=cfg["consumers"], WRITE_LSE=bool(write_lse))


def descriptor_types(cfg: dict, head_dim: int, dtype: torch.dtype = torch.float16) -> dict[str, str]:
    """Signature types of the three descriptor arguments for an offline compile (:mod:`.half_gluon`'s q / k / v
    ones: this kernel stores O from registers)."""
    types = half_gluon.descriptor_types(cfg, head_dim, dtype)
    return {name: types[name] for name in ("q_desc", "k_desc", "v_desc")}


# (lengths, heads, rows, key tile, programs, device) -> (int32 device tables of :func:`assign`, their pinned host
# sources); the entries a CUDA graph captured are never dropped (graph_safe)
_WORK = PlanCache(max_size=4096, graph_safe=True)


class VarlenGluonPlan:
    """The Gluon varlen forward for one call signature: ``plan(q, k, v, cu_seqlens_q, cu_seqlens_k, scale,
    row_offsets=None, work=None) -> (out [total_q, H, D], lse [H, total_q] or None)``, ``work`` the call's
    :meth:`work` tables (``row_offsets`` unused: :func:`unsupported_reason` refuses it). ``out`` contiguous in
    ``out_dtype``; ``lse`` float32 natural-log, as :func:`.varlen_fwd.varlen_forward` returns them."""

    __slots__ = ("launch", "launches", "config", "o_shape", "o_dtype", "device", "with_lse")

    def __init__(self, q, k, v, out_dtype, with_lse: bool, cfg: dict):
        total_q, H, D = q.shape
        self.config, self.o_shape, self.o_dtype, self.device, self.with_lse = cfg, (total_q, H, D), out_dtype, \
            q.device, with_lse
        blocks = half_gluon._descriptor_blocks(cfg, D)
        templates = [TensorDescriptor.from_tensor(_as4(t), list(block), nvmma_layout(block, q.dtype))
                     for t, block in zip((q, k, v), blocks.values())]
        for t in templates:  # a cached plan must not keep this call's tensors alive
            t.base = None
        self.launch = (templates, kernel_constexprs(cfg, D, with_lse), (D, H * D, H, total_q))
        self.launches = {}

    def work(self, lens_q: tuple[int, ...], lens_k: tuple[int, ...]):
        """``(tiles, starts, n_m)`` for host lengths: :func:`assign`'s tables as int32 tensors on the plan's device
        (copied once per lengths, asynchronously from pinned memory) and the table's query tiles per sequence."""
        cfg, H = self.config, self.o_shape[1]
        rows = cfg["BLOCK_M"]
        programs = cfg["ctas_per_sm"] * sm_count(self.device) if self.device.type == "cuda" else 1
        key = (lens_q, lens_k, H, rows, cfg["BLOCK_N"], programs, self.device)
        kept = _WORK.get(key)
        if kept is None:
            tiles, starts = assign(lens_q, lens_k, H, rows, cfg["BLOCK_N"], programs)
            dev, host = device_table(torch.tensor(tiles + starts, dtype=torch.int32), self.device)
            n_m = max(1, max(cdiv(n, rows) for n in lens_q))
            kept = _WORK.put(key, (dev[:len(tiles)], dev[len(tiles):], n_m, host))
        return kept[:3]

    def __call__(self, q, k, v, cu_q, cu_k, scale, row_offsets=None, work=None):
        tiles, starts, n_m = work
        out = torch.empty(self.o_shape, dtype=self.o_dtype, device=self.device)
        lse = None
        if self.with_lse:
            lse = torch.empty((self.o_shape[1], self.o_shape[0]), dtype=torch.float32, device=self.device)
        programs = starts.numel() - 1
        launch = self.launches.get((programs, n_m))
        if launch is None:  # one per program count and query tiles a sequence (the grid, an argument): a few
            templates, constexprs, (soh, som, H, total_q) = self.launch
            call = KernelCall(_varlen_fwd_kernel, (programs,), constexprs,
                              dict(num_warps=4, maxnreg=self.config["maxnreg"]))
            launch = self.launches[(programs, n_m)] = PlannedLaunch(call, (soh, som, H, n_m, total_q), templates)
        # the descriptors take their shape and strides from the templates (the [1, H, total, D] views): the packed
        # tensors themselves stand for those views
        launch(q, k, v, scale, out, lse, extra=(tiles, starts, cu_q, cu_k))
        return out, lse
