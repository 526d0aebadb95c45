"""Stream-K (LeanAttention) schedule of the ragged forward: shares of key-tile iterations of equal cost per program.

The varlen kernel (:mod:`.varlen_fwd`) gives each (query tile, head, sequence) one program, optionally cut into
P equal key partitions (split-KV): over a batch of uneven lengths the longest sequence's programs set the time
while the others' SMs idle, and cutting every sequence by the longest one's partition size launches programs that
exit at once. LeanAttention's stream-K schedule (LeanAttention, Sec. 4 and its appendix) instead lays every
*iteration* — one key tile of one (sequence, head, query tile) "job" — on one line, jobs back to back, and gives
each of G programs a contiguous equal share: ``[g T / G, (g + 1) T / G)`` of the ``T`` iterations. Here a share's
cost also counts a start-up cost for each job begun in it (:data:`JOB_COSTS`; a program whose share holds many short
jobs takes fewer iterations than one inside a long job: :func:`partition`). A program folds
the ELSA state ``(m, S, W)`` over its share, job by job: a job it covers whole writes its output directly; a job cut
at the share's start or end leaves a partial state, and :func:`_stream_merge_kernel` folds each cut job's
partials with the monoid merge (:func:`.elsa_fwd.merge_partials`, the split-KV merge's arithmetic), in program
order: deterministic, no atomics. Every SM gets the same work whatever the lengths, and no program is empty.

The partition is computed on the host from the sequence lengths (:func:`partition`; once per call signature, the
plan caches it with its device table), so it needs the lengths on the host: lists of sequences
(:func:`visionattn.varlen_attention`), callers of :func:`.varlen_fwd.varlen_forward` that pass them, and dense calls
(equal lengths). The query tile follows the longest query sequence (16 to 128 rows):
few-query calls (class attention, attention pooling, one query per sequence) fold 16-row tiles instead of
128-row ones.

Rule (:func:`choose`): stream-K where the varlen kernel's single pass leaves SMs idle — the longest sequence's
programs (heads x query tiles) fewer than the SMs, LeanAttention's regime — for few-query calls (at most
:data:`MAX_QUERY_ROWS` queries a sequence) whose lengths are known; the single pass / split-KV plan otherwise.
Dense calls (:func:`dense_plan`, their batch items as equal sequences) take it where the split-KV plan would split
them, up to :data:`MAX_QUERY_ROWS` queries, from :data:`DENSE_MIN_JOBS` jobs, fp16 / bf16 from
:data:`DENSE_HALF_MIN_KEYS` keys (docs/tuning.md: stream-K for ragged and few-query calls).

Entry points: :func:`partition` (pure host code), :func:`choose`, :func:`stream_plan`, :func:`dense_plan`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._launch import (LOG2E, KernelCall, cdiv, device_table, head_blocks, interpreting, pad_pow2, partials_workspace,
                      sm_count)
from .elsa_fwd import LAZY_V_MIN_KEYS, _precision, get_config, key_tiles, merge_partials, store_partial, NOMINAL_SMS
from .varlen_fwd import _register_cap, fold_query_tile, sequence_span, store_output

__all__ = ["Partition", "partition", "choose", "ragged_prefers", "stream_plan", "dense_plan", "dense_prefers",
           "query_block", "key_block", "HALF_KEY_BLOCK",
           "PROGRAMS_PER_SM", "MAX_QUERY_ROWS", "JOB_COSTS", "JOB_COST_FP32"]

# G = PROGRAMS_PER_SM x SMs programs, one wave at two programs an SM: of 1, 2, 3, 4, 6 and 8 an SM, 2 was the fastest
# in fp32 and within 0.8-1.25x of the fastest in bf16 (docs/tuning.md: stream-K for ragged and few-query calls)
PROGRAMS_PER_SM = 2
# the fixed cost of starting a job (its query tile's load and set-up, its output or partial state's store), in key-tile
# iterations, by product precision (fp16 / bf16 "half", the FP32-class modes): the shares equalise iterations plus this
# per job begun, so a program that takes many short jobs no longer runs past one inside a long job (0-4 swept: 3 and 2
# the fastest; docs/tuning.md: stream-K for ragged and few-query calls)
JOB_COSTS = {"half": 3}
JOB_COST_FP32 = 2
# dense fp16 / bf16 calls take stream-K from this many keys; below it the split-KV plan is as fast (stream-K
# 0.85-1.12x at 1024-4096 keys, 1.05-1.27x from 16384), while the FP32-class modes' 16-row tiles pay from 1024 keys
# (1.09-1.71x) (docs/tuning.md: stream-K for ragged and few-query calls)
DENSE_HALF_MIN_KEYS = 16384
# dense calls take stream-K from this many jobs (batch x heads x query tiles): with fewer, the shares cut a job into
# one-iteration pieces that one merge program folds in series (0.50-1.28x the split-KV plan at one head), where
# split-KV's partitions are as balanced
DENSE_MIN_JOBS = 16
# stream-K runs calls whose longest query sequence fits a tile of this many rows (few-query calls: 16-row tiles for up
# to 16 queries); with full 128-row tiles (self-attention) the single pass has programs enough to balance itself and
# the pieces' partial states cost more than the balance gains (the ELSA supplement's Table 2 batch: 0.87x bf16,
# 0.90x fp32) (docs/tuning.md: stream-K for ragged and few-query calls)
MAX_QUERY_ROWS = 64
# split-job rows: int32 columns of the merge table (sequence, head, first query row, first slot, partial count)
_SPLIT_COLS = 5


@dataclass(frozen=True)
class Partition:
    """A stream-K partition of one call's iterations (:func:`partition`).

    Attributes:
        block_m, block_n: the query rows and keys of one iteration's tile.
        programs: G, the programs of the launch (each a contiguous share of the iterations).
        iterations: T, key tiles of every job together (a job without keys counts one, which writes zeros).
        jobs: J, the (sequence, head, query tile) jobs, in the order their iterations run.
        slots: partial states the programs store (at most 2 G): each cut job's pieces.
        split_jobs: S, the jobs cut between programs, which the merge folds.
        table: int32 [G + 1 | G | G | J + 1 | 3 J | 5 S] on the host: program iteration starts (and T), each
            program's first job, its first partial slot, the jobs' iteration starts (and T), each job's (sequence,
            head, first query row), each cut job's (sequence, head, first query row, first slot, partial count).
            Slots of one cut job are consecutive, in program order.
    """

    block_m: int
    block_n: int
    programs: int
    iterations: int
    jobs: int
    slots: int
    split_jobs: int
    table: torch.Tensor

    def sections(self) -> tuple[int, ...]:
        """Lengths of the table's six sections, in order."""
        G, J = self.programs, self.jobs
        return (G + 1, G, G, J + 1, 3 * J, _SPLIT_COLS * self.split_jobs)


def _job_tiles(lq: int, lk: int, block_m: int, block_n: int, is_causal: bool) -> list[int]:
    """Key tiles of each query tile of one sequence, as :func:`.elsa_fwd.key_tiles` counts them (causal: up to the
    tile's last row), at least 1 (a job without keys still writes its zero rows)."""
    out = []
    for start in range(0, lq, block_m):
        hi = min(lk, start + block_m) if is_causal else lk
        out.append(max(1, cdiv(hi, block_n)))
    return out


def partition(lens_q, lens_k, heads: int, block_m: int, block_n: int, is_causal: bool, programs: int,
              job_cost: int = 0) -> Partition:
    """Cut the iterations of a ragged call into ``programs`` contiguous shares of equal cost (stream-K).

    Args:
        lens_q, lens_k: per-sequence query and key lengths (ints >= 0, one per sequence).
        heads: H; block_m / block_n: the tile's query rows and keys; is_causal: top-left causal per sequence.
        programs: the programs wanted (fewer when there are fewer iterations).
        job_cost: the cost of starting a job, in iterations (int >= 0; :data:`JOB_COSTS`).

    Jobs run sequence by sequence, head by head, query tile by query tile, so the jobs of one (sequence, head)
    share its K / V tiles in L2 and a program's share is a run of adjacent jobs. The cost of a share is its
    iterations plus ``job_cost`` for each job that begins in it, ``W = T + job_cost J`` in all; program ``g``'s
    share ends at the iteration where that running cost reaches ``(g + 1) W // G`` (with ``job_cost = 0``:
    iterations ``[g T // G, (g + 1) T // G)``). A boundary that falls inside a job's start-up cost moves to the
    job's first iteration, so each share's cost is within ``job_cost + 1`` of ``W / G``; shares left empty are
    dropped (fewer programs).

    Returns:
        A :class:`Partition` (``jobs == 0`` and no programs when no sequence has a query row).

    Raises:
        ValueError: lengths of different counts or negative, ``heads`` / ``programs`` / block sizes below 1, 2^31
            iterations or more.
    """
    lens_q, lens_k = [int(x) for x in lens_q], [int(x) for x in lens_k]
    if len(lens_q) != len(lens_k):
        raise ValueError(f"{len(lens_q)} query lengths but {len(lens_k)} key lengths; expected one of each per "
                         f"sequence")
    if any(x < 0 for x in lens_q + lens_k):
        raise ValueError("sequence lengths must be >= 0")
    if min(heads, block_m, block_n, programs) < 1:
        raise ValueError(f"heads={heads}, block_m={block_m}, block_n={block_n}, programs={programs}; expected >= 1")
    if isinstance(job_cost, bool) or not isinstance(job_cost, int) or job_cost < 0:
        raise ValueError(f"job_cost={job_cost!r}; expected an int >= 0 (key-tile iterations)")
    seq_col, heads_col, start_col, tiles_col = [], [], [], []
    for s, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        tiles = _job_tiles(lq, lk, block_m, block_n, is_causal)
        for h in range(heads):
            seq_col += [s] * len(tiles)
            heads_col += [h] * len(tiles)
            start_col += range(0, lq, block_m)
            tiles_col += tiles
    J = len(tiles_col)
    if J == 0:
        return Partition(block_m, block_n, 0, 0, 0, 0, 0, torch.zeros(2, dtype=torch.int32))
    job_it = torch.zeros(J + 1, dtype=torch.int64)
    job_it[1:] = torch.tensor(tiles_col, dtype=torch.int64).cumsum(0)
    T = int(job_it[-1])
    if T >= 2 ** 31:
        raise ValueError(f"{T} key-tile iterations pass the int32 table's range; such a call fills the GPU without "
                         f"stream-K (schedule='split-kv')")
    G = min(int(programs), T)
    prog_it = torch.arange(G + 1, dtype=torch.int64) * (T + job_cost * J) // G  # the boundaries' running costs
    if job_cost:
        job_at = job_it + job_cost * torch.arange(J + 1, dtype=torch.int64)  # running cost where each job begins
        j = torch.searchsorted(job_at, prog_it, right=True) - 1
        prog_it = torch.unique_consecutive(job_it[j] + (prog_it - job_at[j] - job_cost).clamp(min=0))
        G = prog_it.numel() - 1
    start, end = prog_it[:-1], prog_it[1:]
    first = torch.searchsorted(job_it, start, right=True) - 1  # the job holding each share's first iteration
    last = torch.searchsorted(job_it, end - 1, right=True) - 1  # ... and its last
    first_cut = (start > job_it[first]) | (end < job_it[first + 1])
    last_cut = (last != first) & (end < job_it[last + 1])
    pieces = first_cut.long() + last_cut.long()
    prog_slot = torch.zeros(G, dtype=torch.int64)
    prog_slot[1:] = pieces.cumsum(0)[:-1]
    # the cut jobs in slot order: (job of each slot); a cut job's slots are consecutive
    slot_job = torch.stack([torch.where(first_cut, first, -1), torch.where(last_cut, last, -1)], 1).reshape(-1)
    slot_job = slot_job[slot_job >= 0]
    split, counts = torch.unique_consecutive(slot_job, return_counts=True)
    slot_lo = torch.zeros_like(counts)
    slot_lo[1:] = counts.cumsum(0)[:-1]
    seq_t, start_t = torch.tensor(seq_col, dtype=torch.int64), torch.tensor(start_col, dtype=torch.int64)
    heads_t = torch.tensor(heads_col, dtype=torch.int64)
    info = torch.stack([seq_t, heads_t, start_t], 1).reshape(-1)
    merge = torch.stack([seq_t[split], heads_t[split], start_t[split], slot_lo, counts], 1).reshape(-1)
    table = torch.cat([prog_it, first, prog_slot, job_it, info, merge]).to(torch.int32)
    return Partition(block_m, block_n, G, T, J, int(pieces.sum()), int(split.numel()), table)


def query_block(max_seqlen_q: int, config_block_m: int) -> int:
    """The stream-K tile's query rows: the longest query sequence's power of two, 16 to the config's rows."""
    return max(16, min(config_block_m, pad_pow2(max(1, max_seqlen_q))))


# fp16 / bf16 query tiles of at most 64 rows at head dims <= 64 fold key tiles of this many keys (the config's 64
# otherwise): their programs stream K / V with little arithmetic a key, and the longer tile keeps more bytes in
# flight (docs/tuning.md: stream-K for ragged and few-query calls)
HALF_KEY_BLOCK = 128


def key_block(precision: str, block_m: int, head_dim: int, head_dim_v: int, config_block_n: int) -> int:
    """The stream-K tile's keys: :data:`HALF_KEY_BLOCK` for ``precision`` "half" with ``block_m`` <= 64 query rows
    and head dims <= 64, else the config's ``config_block_n``."""
    if precision == "half" and block_m <= 64 and max(head_dim, head_dim_v) <= 64:
        return max(config_block_n, HALF_KEY_BLOCK)
    return config_block_n


def choose(lens_q, lens_k, heads: int, mode: str, head_dim: int, head_dim_v: int, device: torch.device) -> bool:
    """Whether stream-K runs a ragged call of these host-side lengths on ``device`` (the module's rule, on CUDA:
    :func:`ragged_prefers` with the mode's tile config and the GPU's SM count)."""
    if device.type != "cuda" or max(lens_k, default=0) == 0:
        return False
    cfg = get_config(mode, head_dim, head_dim_v, max(lens_k))
    return ragged_prefers(lens_q, lens_k, heads, cfg.block_m, cfg.block_n, sm_count(device))


def ragged_prefers(lens_q, lens_k, heads: int, block_m: int, block_n: int, sms: int) -> bool:
    """The rule for a ragged call: the varlen kernel's single pass (``block_m``-row query tiles) gives the longest
    query sequence fewer programs (``heads x`` its query tiles) than ``sms``, no sequence has more than
    :data:`MAX_QUERY_ROWS` queries, at least one has queries and keys, and the iterations fit the partition's int32
    table (at most one per 16 queries x ``block_n`` keys)."""
    longest = max(lens_q, default=0)
    if not 0 < longest <= MAX_QUERY_ROWS or max(lens_k, default=0) == 0 or heads * cdiv(longest, block_m) >= sms:
        return False
    return heads * sum(cdiv(a, 16) * cdiv(b, block_n) for a, b in zip(lens_q, lens_k)) < 2 ** 31


@triton.jit(do_not_specialize=["H", "total_q"])
def _stream_fwd_kernel(
    Q, K, V, CuQ, CuK, RowOff, Out, Lse, WsM, WsS, WsW, ProgIt, ProgJob, ProgSlot, JobIt, JobInfo, qk_scale,
    sqt, sqh, sqd, skt, skh, skd, svt, svh, svd, sot, soh, sod,
    H, total_q, D, Dv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    DOT_UPCAST: tl.constexpr, LAZY_V: tl.constexpr, WRITE_LSE: tl.constexpr, ROW_OFFSETS: tl.constexpr,
):
    """Program ``g`` folds iterations ``[ProgIt[g], ProgIt[g + 1])``, job after job (tables of :func:`partition`).

    Per job: the query tile's rows and the key tiles of the share (interior tiles, then boundary ones, as the varlen
    kernel's :func:`.elsa_fwd.partition_tiles`), folded by :func:`.varlen_fwd.fold_query_tile`; a job covered whole
    writes ``W / S`` (and the LSE) to ``Out`` [total_q, H, Dv] (:func:`.varlen_fwd.store_output`, as
    :func:`.varlen_fwd._varlen_fwd_kernel`), a cut one its partial state to the next slot
    (:func:`.elsa_fwd.store_partial`, rows ``slot * BLOCK_M + r``). Arguments, layouts and ``ROW_OFFSETS`` as the
    varlen kernel's."""
    g = tl.program_id(0)
    it = tl.load(ProgIt + g)
    end = tl.load(ProgIt + g + 1)
    job = tl.load(ProgJob + g)
    slot = tl.load(ProgSlot + g).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < Dv
    while it < end:
        j_lo = tl.load(JobIt + job)
        j_hi = tl.load(JobIt + job + 1)
        seg_end = tl.minimum(end, j_hi)
        seq = tl.load(JobInfo + 3 * job)
        off_h = tl.load(JobInfo + 3 * job + 1).to(tl.int64)
        start_m = tl.load(JobInfo + 3 * job + 2)
        q_start, Lq = sequence_span(CuQ, seq)
        k_start, Nk = sequence_span(CuK, seq)
        start_m64 = start_m.to(tl.int64)
        rows = start_m + offs_m
        row_ok = rows < Lq
        n_full, n_tiles = key_tiles(start_m, Nk, BLOCK_M, BLOCK_N, IS_CAUSAL)
        lo_t = it - j_lo
        hi_t = tl.minimum(seg_end - j_lo, n_tiles)  # a job without keys has one iteration and no tile
        mid_t = tl.maximum(tl.minimum(n_full, hi_t), lo_t)
        lse, acc, l_i, m_i, v_unscale = fold_query_tile(
            Q, K, V, RowOff, seq, q_start, k_start, start_m64, off_h, lo_t, mid_t, hi_t, offs_m, offs_n, offs_d,
            offs_dv, rows, row_ok, Nk, D, Dv, qk_scale, sqt, sqh, sqd, skt, skh, skd, svt, svh, svd,
            BLOCK_M, BLOCK_N, BLOCK_DV, IS_CAUSAL, EVEN_D, EVEN_DV, PRECISION, DOT_UPCAST, LAZY_V, ROW_OFFSETS)
        if (it == j_lo) & (seg_end == j_hi):  # the whole job: its output
            store_output(Out, Lse, lse, acc, l_i, v_unscale, q_start, start_m64, off_h, offs_m, offs_dv, row_ok,
                         dv_ok, total_q, sot, soh, sod, WRITE_LSE)
        else:  # a piece: its partial state, for the merge
            store_partial(WsM, WsS, WsW, slot * BLOCK_M + offs_m, m_i, l_i, acc, v_unscale, offs_dv, row_ok, Dv)
            slot += 1
        it = seg_end
        job += 1


@triton.jit(do_not_specialize=["total_q"])
def _stream_merge_kernel(WsM, WsS, WsW, Out, Lse, CuQ, Split, sot, soh, total_q, Dv,
                         TILE_M: tl.constexpr, ROW_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_DV: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Fold each cut job's partial states (``Split`` rows of :func:`partition`: sequence, head, first query row,
    first slot, count) with :func:`.elsa_fwd.merge_partials`; write ``W / S`` to ``Out`` [total_q, H, Dv] and, with
    ``WRITE_LSE``, the LSE to ``Lse`` [H, total_q]. 1-D grid: cut jobs x ``ROW_BLOCKS`` blocks of ``BLOCK_M`` rows
    x ``Dv`` slices; the row blocks cover the rows a job can hold (the forward's query tile of ``TILE_M`` rows, or
    the call's longest query sequence where that is shorter: :func:`merge_row_blocks`)."""
    dv_tiles = tl.cdiv(Dv, BLOCK_DV)
    pid0 = tl.program_id(0)
    pid_dv = pid0 % dv_tiles
    pid_m = (pid0 // dv_tiles) % ROW_BLOCKS
    job = pid0 // (dv_tiles * ROW_BLOCKS)
    seq = tl.load(Split + 5 * job)
    off_h = tl.load(Split + 5 * job + 1).to(tl.int64)
    start_m = tl.load(Split + 5 * job + 2)
    slot_lo = tl.load(Split + 5 * job + 3).to(tl.int64)
    n_parts = tl.load(Split + 5 * job + 4)
    q_start = tl.load(CuQ + seq).to(tl.int64)
    Lq = tl.load(CuQ + seq + 1) - tl.load(CuQ + seq)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = pid_dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    row_ok = start_m + local < Lq
    dv_ok = offs_dv < Dv
    plane = tl.full([], TILE_M, dtype=tl.int64)
    base = slot_lo * TILE_M + local
    m, s, w = merge_partials(WsM, WsS, WsW, n_parts, row_ok, plane, base, offs_dv, dv_ok, Dv, BLOCK_M, BLOCK_P,
                             BLOCK_DV)
    rows = q_start + start_m + local
    if WRITE_LSE:
        tl.store(Lse + off_h * total_q + rows, (m + tl.math.log2(s)) * 0.6931471805599453,
                 mask=row_ok & (pid_dv == 0))
    o_ptrs = Out + rows[:, None] * sot + off_h * soh + offs_dv[None, :]
    tl.store(o_ptrs, w.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


# FP32 elements of one merge program's [BLOCK_M, BLOCK_P, BLOCK_DV] tile, as the split-KV merge's (elsa_fwd.MERGE_TILE)
_MERGE_TILE = 8192


def _merge_blocks(tile_m: int, rows: int, head_dim_v: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_P, BLOCK_DV, num_warps)`` of the stream-K merge: rows up to the query tile's valid ones (a
    divisor of ``tile_m``), head dim slices of at most 64, partitions filling the rest of the tile."""
    block_dv = min(64, pad_pow2(head_dim_v))
    block_m = max(1, min(tile_m, pad_pow2(rows, 1), _MERGE_TILE // 2 // block_dv))
    block_p = max(2, min(64, _MERGE_TILE // (block_m * block_dv)))
    return block_m, block_p, block_dv, max(1, min(8, block_m * block_p * block_dv // 1024))


def merge_row_blocks(tile_m: int, rows: int, block_m: int) -> int:
    """Row blocks of ``block_m`` rows per cut job in the stream-K merge's grid: enough for the rows a job can hold,
    ``min(tile_m, rows)`` (``rows`` the call's longest query sequence). A few-query call's 16-row tile holds one to
    a few rows; programs for the rest would only loop over the partials with every load masked (one query a
    sequence: 16 programs a job where 1 has rows, the merge 3x slower)."""
    return cdiv(min(tile_m, rows), block_m)


class StreamPlan:
    """The stream-K launches of one call signature (lengths included): the partition's device table, the forward
    and, when jobs are cut, the merge. Calling it with ``(q, k, v, cu_q, cu_k, scale, row_offsets)`` returns
    ``(out [total_q, H, Dv], lse [H, total_q] or None)``, as :class:`._launch.VarlenForwardRun`."""

    __slots__ = ("part", "table", "host_table", "views", "main", "merge", "fixed", "merge_fixed", "o_shape", "o_dtype",
                 "device", "with_lse", "ws_rows", "dv")

    def __init__(self, part: Partition, heads: int, head_dim: int, head_dim_v: int, strides: tuple, device,
                 dtype: torch.dtype, total_q: int, is_causal: bool, mode: str, out_dtype, with_lse: bool,
                 max_seqlen_k: int, max_rows: int, row_offsets: bool):
        H, D, Dv = heads, head_dim, head_dim_v
        precision = _precision(mode, None)
        block_d, block_dv = head_blocks(D, Dv)
        cfg = get_config(mode, D, Dv, max_seqlen_k)
        self.part, self.device, self.o_dtype, self.with_lse, self.dv = part, device, out_dtype, with_lse, Dv
        self.o_shape = (total_q, H, Dv)
        self.ws_rows = part.slots * part.block_m
        self.table, self.host_table = device_table(part.table, device)  # the pinned source stays with the plan
        self.views, at = [], 0
        for n in part.sections():
            self.views.append(self.table[at:at + n])
            at += n
        warps = 4 if part.block_m <= 64 else cfg.num_warps
        cap = _register_cap(precision, replace(cfg, num_warps=warps), block_d, block_dv)  # the varlen kernel's cap
        self.fixed = (*strides, H * Dv, Dv, 1, H, total_q, D, Dv)
        self.main = KernelCall(_stream_fwd_kernel, (part.programs,), dict(
            BLOCK_M=part.block_m, BLOCK_N=part.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            PRECISION=precision, IS_CAUSAL=bool(is_causal), EVEN_D=D == block_d, EVEN_DV=Dv == block_dv,
            DOT_UPCAST=dtype == torch.bfloat16 and interpreting(),
            LAZY_V=precision == "f16x3" and max_seqlen_k > LAZY_V_MIN_KEYS, WRITE_LSE=bool(with_lse),
            ROW_OFFSETS=bool(row_offsets)), dict(num_warps=warps, num_stages=cfg.num_stages, **cap))
        self.merge = None
        if part.split_jobs:
            bm, bp, bdv, nw = _merge_blocks(part.block_m, max_rows, Dv)
            row_blocks = merge_row_blocks(part.block_m, max_rows, bm)
            grid = part.split_jobs * row_blocks * cdiv(Dv, bdv)
            self.merge = KernelCall(_stream_merge_kernel, (grid,), dict(
                TILE_M=part.block_m, ROW_BLOCKS=row_blocks, BLOCK_M=bm, BLOCK_P=bp, BLOCK_DV=bdv,
                WRITE_LSE=bool(with_lse)), dict(num_warps=nw))
            self.merge_fixed = (H * Dv, Dv, total_q, Dv)

    def __call__(self, q, k, v, cu_q, cu_k, scale, row_offsets=None):
        dev = self.device
        out = torch.empty(self.o_shape, dtype=self.o_dtype, device=dev)
        lse = torch.empty((self.o_shape[1], self.o_shape[0]), dtype=torch.float32, device=dev) if self.with_lse \
            else None
        dummy = 0 if self.main._fast is not None else q  # unused pointers: null on the direct path
        ws = [dummy] * 3
        if self.merge is not None:
            *ws, _ws = partials_workspace(self.ws_rows, self.dv, dev, self.main, self.merge)
        prog_it, prog_job, prog_slot, job_it, job_info, split = self.views
        self.main(q, k, v, cu_q, cu_k, dummy if row_offsets is None else row_offsets, out,
                  dummy if lse is None else lse, *ws, prog_it, prog_job, prog_slot, job_it, job_info,
                  scale * LOG2E, *self.fixed)
        if self.merge is not None:
            merge_lse = lse if lse is not None else (0 if self.merge._fast is not None else q)
            self.merge(*ws, out, merge_lse, cu_q, split, *self.merge_fixed)
        return out, lse


def stream_plan(q, k, v, lens_q, lens_k, total_q: int, is_causal: bool, mode: str, out_dtype, with_lse: bool,
                row_offsets: bool, programs: int | None = None, job_cost: int | None = None) -> StreamPlan | None:
    """The :class:`StreamPlan` of a ragged call (q [total_q, H, D], k [total_k, H, D], v [total_k, H, Dv], or any
    tensors with those strides read through ``row_offsets``) with host-side lengths ``lens_q`` / ``lens_k``; None
    when no sequence has a query row. ``programs``: G (default :data:`PROGRAMS_PER_SM` per SM), ``job_cost``: the
    partition's start-up cost per job (default the mode's :data:`JOB_COSTS` entry); tools and tests choose others."""
    return _plan(q, v, q.shape[1], q.stride(), k.stride(), v.stride(), lens_q, lens_k, total_q, is_causal, mode,
                 out_dtype, with_lse, row_offsets, programs, job_cost)


def _plan(q, v, heads, sq, sk, sv, lens_q, lens_k, total_q, is_causal, mode, out_dtype, with_lse, row_offsets,
          programs=None, job_cost=None):
    """:func:`stream_plan` with the token / head / head-dim strides ``sq`` / ``sk`` / ``sv`` given."""
    D, Dv = q.shape[-1], v.shape[-1]
    max_k = max(lens_k, default=0)
    cfg = get_config(mode, D, Dv, max_k)
    block_m = query_block(max(lens_q, default=0), cfg.block_m)
    precision = _precision(mode, None)
    block_n = key_block(precision, block_m, D, Dv, cfg.block_n)
    if programs is None:
        sms = sm_count(q.device) if q.device.type == "cuda" else NOMINAL_SMS
        programs = PROGRAMS_PER_SM * sms
    if job_cost is None:
        job_cost = JOB_COSTS.get(precision, JOB_COST_FP32)
    part = partition(lens_q, lens_k, heads, block_m, block_n, is_causal, programs, job_cost)
    if part.jobs == 0:
        return None
    return StreamPlan(part, heads, D, Dv, (*sq, *sk, *sv), q.device, q.dtype, total_q, is_causal, mode,
                      out_dtype, with_lse, max_k, min(block_m, max(lens_q)), row_offsets)


def dense_prefers(jobs: int, n_q: int, n_k: int, precision: str) -> bool:
    """Whether a dense call the split-KV plan would split runs faster on stream-K: at most :data:`MAX_QUERY_ROWS`
    queries, at least :data:`DENSE_MIN_JOBS` jobs, and fp16 / bf16 (``precision`` "half") from
    :data:`DENSE_HALF_MIN_KEYS` keys."""
    return (n_q <= MAX_QUERY_ROWS and jobs >= DENSE_MIN_JOBS
            and (precision != "half" or n_k >= DENSE_HALF_MIN_KEYS))


class DenseStreamPlan:
    """The stream-K schedule of a dense call q [B, H, Nq, D], k / v [B, H, Nk, D | Dv] (a plan of
    :mod:`.elsa_fwd`'s cache): its B batch items as B sequences of equal lengths, read in place through row offsets
    (``b`` times the batch strides), the output [B, H, Nq, Dv] a view of the packed [B Nq, H, Dv] one (the dense
    kernels' heads-inner layout). Called as :class:`._launch.DenseForwardRun` plans are: ``(out, None)``."""

    __slots__ = ("stream", "cu_q", "cu_k", "row_offsets", "shape")

    def __init__(self, stream: StreamPlan, cu_q, cu_k, row_offsets, shape):
        self.stream, self.cu_q, self.cu_k, self.row_offsets, self.shape = stream, cu_q, cu_k, row_offsets, shape

    def __call__(self, q, k, v, bias, attn_mask, scale):
        out, _ = self.stream(q, k, v, self.cu_q, self.cu_k, scale, self.row_offsets)
        B, Nq, H, Dv = self.shape
        return out.view(B, Nq, H, Dv).transpose(1, 2), None


def dense_plan(q, k, v, bias, attn_mask, is_causal: bool, mode: str, out_dtype, with_lse: bool,
               programs: int | None = None, rule: bool = True):
    """A :class:`DenseStreamPlan` for a dense call where the single pass leaves SMs idle (the split-KV plan's regime:
    :func:`.elsa_fwd.choose_num_splits` would split) and :func:`dense_prefers` it, or None: a bias, a mask, the LSE
    (training calls keep the split-KV plan), grouped key / value heads, batch strides that are not multiples of 16
    elements (the row offsets' aligned loads), or off CUDA. ``rule=False`` skips the regime test (tests, in the
    interpreter); ``programs`` as :func:`stream_plan`'s."""
    from .elsa_fwd import choose_num_splits

    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if (bias is not None or attn_mask is not None or with_lse or k.shape[1] != H
            or (B > 1 and any(t.stride(0) % 16 for t in (q, k, v)))):
        return None
    cfg = get_config(mode, D, v.shape[3], Nk)
    precision = _precision(mode, None)
    jobs = B * H * cdiv(Nq, query_block(Nq, cfg.block_m))
    if rule and (choose_num_splits(B * H, Nq, Nk, cfg, q.device, precision) <= 1  # (1 off CUDA)
                 or not dense_prefers(jobs, Nq, Nk, precision)):
        return None
    if jobs * cdiv(Nk, cfg.block_n) >= 2 ** 31:  # past the partition's int32 table
        return None
    stream = _plan(q, v, H, q.stride()[2:0:-1] + q.stride()[3:], k.stride()[2:0:-1] + k.stride()[3:],
                   v.stride()[2:0:-1] + v.stride()[3:], [Nq] * B, [Nk] * B, B * Nq, is_causal, mode, out_dtype,
                   False, True, programs)
    cu_q, cu_k = (torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=q.device) for n in (Nq, Nk))
    offsets = torch.tensor([[b * t.stride(0) for t in (q, k, v)] for b in range(B)], dtype=torch.int64,
                           device=q.device)
    _DENSE_TABLES.append((stream.table, stream.host_table, cu_q, cu_k, offsets))
    return DenseStreamPlan(stream, cu_q, cu_k, offsets, (B, Nq, H, v.shape[3]))


# the device tables of every dense stream-K plan, kept for the process: a CUDA graph may replay a plan's launches
# after the plan caches drop it, and checking for a capture on every dense call's cache lookup costs ~1 us of host
# time; one entry per dense signature that takes stream-K (few-query calls), a few KB each
_DENSE_TABLES: list = []
