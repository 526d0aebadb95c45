"""FP16 / BF16 attention backward for Hopper in Gluon: TMA producer warp, two consumer warpgroups (FlashAttention-3).

The Triton single pass of :mod:`.elsa_bwd` (FlashAttention-2's Alg. 2 from the saved log-sum-exp, dQ added in
key-tile order) issues its loads and its five tile products from the same warps. This kernel schedules them the way
FlashAttention-3's backward does (Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony
and Low-precision", Sec. 3 and App. B.1), on Hopper's wgmma and TMA:

* one program per (key tile of ``BLOCK_N = 128`` keys, head, batch); ``K_j`` and ``V_j`` are TMA-loaded into shared
  memory once, as two 64-row halves;
* **warp specialization**: one producer warp TMA-loads the query tiles ``Q_i``, ``dO_i`` (``BLOCK_M = 64`` rows,
  4-D [B, H, N, D] descriptors: strided views need no copy, rows past N arrive as zeros) into a ring of ``STAGES``
  slots with ``ready`` / ``empty`` mbarriers; two consumer warpgroups (240 registers per thread each after
  ``setmaxnreg``, the producer 24, the dQ writers below 32) each own 64 of the tile's keys;
* per query tile, consumer ``w`` (keys ``K_w``, ``V_w``): ``S^T = K_w Q_i^T`` and ``dP^T = V_w dO_i^T`` (async
  wgmmas from shared memory), ``P^T = exp2(S^T scale log2(e) - lse_i log2(e))``, ``dS^T = P^T (dP^T - delta_i)``;
  ``dV_w += P^T dO_i`` and ``dK_w += dS^T Q_i`` with the 16-bit ``P^T`` / ``dS^T`` as the wgmma's register operand;
  ``dQ_i += scale dS_i K_j`` in FP32, split by columns: both consumers store ``dS^T`` (16-bit) into a
  double-buffered shared tile and meet on an mbarrier; consumer ``w`` then computes dQ's column half ``w`` over
  all 128 keys (two wgmmas, ``dS`` as the transposed shared-memory operand), as FlashAttention-3 shares ``dS``
  through shared memory;
* **dQ writers** (FlashAttention-3's dQ writer): the consumers store their FP32 dQ halves (scaled) into a
  shared-memory ring of ``dq_ring`` query tiles (mbarriers ``dq_full`` / ``dq_empty``) and go on at once; two
  one-warp writer partitions (sharing the producer's warpgroup; a program's step ``t`` is writer ``t % 2``'s, so
  two tiles' turns are in flight) wait for both halves of a tile, then for its turn, add each half into an FP32
  accumulator as one TMA bulk reduction (``cp.reduce.async.bulk.tensor``, ``add``) issued by one thread (the
  first share of an accumulator tile as a TMA store: the accumulators are not zeroed), wait for the reductions to
  complete (not only to read shared memory), free the slot and pass the turn on;
* **deterministic dQ**: each FP32 accumulator gets each query tile's shares in a fixed order, as in
  :mod:`.elsa_bwd`'s single pass: an int32 counter per (accumulator, batch * head, query tile) says how many
  shares were added, and the writer of key tile ``j`` waits until it reads ``j``'s turn. With ``A``
  accumulators key tile ``j`` adds into accumulator ``j % A`` (a chain of turns ``A`` times shorter), and
  :func:`combine_accumulators` writes ``dQ = ((acc_0 + acc_1) + ...)`` in the input dtype, over the accumulator
  tiles whose counters say they took a share (the others were never written). The order, a function
  of the shape alone, not the timing, fixes every sum: dQ is bit-for-bit reproducible;
* **rotated sweeps** (config ``rotate``; :func:`rotation_step`): the key tile of turn ``p`` in its chain
  sweeps the query tiles from tile ``-p * ROT`` on: the chain's key tiles, started together, work on tiles ``ROT``
  apart, where sweeping in one order they pass each query tile one after another, the chain starting skewed by
  its length times a turn's latency (10-13 % of the kernel's time with 256-512 programs). Each query tile takes
  the shares of the chain's tiles that reach it after wrapping past the last query tile into a second
  accumulator; both take their shares in key-tile order, which is the order in which they arrive
  (:func:`query_order`). Every wait, rotated or not (key tile ``j`` then waits on key tile ``j - A``), is on a
  lower program id, so the waits end as long as programs start in id order;
* dK is scaled by the softmax scale once, at the end; dK, dV are written in the input dtype through shared
  memory (the consumer's V half, its own and free by then) as TMA stores (the HEAD_SCALES builds below write their
  FP32 dK / dV from registers).

``delta = rowsum(dO * O)`` and the row ``lse`` (``+inf`` for empty rows) come from :mod:`.elsa_bwd`'s preprocess
kernel (:func:`.elsa_bwd._bwd_preprocess_kernel`), 64 floats per query tile (L2 hits); the same launch zeroes the
turn counters, which share one allocation with them and the accumulators (:class:`.elsa_bwd.Scratch`). The
producer warp loads them into the query tile's ring slot with plain loads (a TMA copy would need ``bh * Nq`` to be a
multiple of 4) and arrives on the slot's barrier after them (else each consumer loads the rows itself before its
products and spreads them over S^T's columns through shared memory, which at head dim 128 also costs spills), and at
head dim 64 each consumer holds its K / V rows in registers as the left operands of S^T's and dP^T's wgmmas (a
64 x 64 x 16 wgmma reading both operands from shared memory takes all of its bandwidth; at 128 they spill;
:func:`get_config`).

Mode ``tf32`` (:func:`tf32_backward`) runs the same kernel on FP16 copies of q, k, v, dO, each (batch, head) scaled
by a power of two (:func:`_scaled_operands_kernel`; FP16 keeps TF32's 11 significant bits, the scales give it the
range): the ``HEAD_SCALES`` build reads each head's multipliers for its logits, delta and FP32 gradients, and one
FP32 dQ accumulator is dQ itself. Mode ``fp32`` (:func:`fp32_backward`) splits those copies into hi and lo FP16
parts and forms every product as three wgmmas (``PARTS = 2``); each query tile's dK / dV products are formed in
fresh accumulators and added in FP32, and dS's lo part is kept times 2^:data:`DS_LO_EXP`. At head dim 128 the hi
and lo tiles of this layout do not fit in shared memory: the ``DSPLIT`` build runs programs of 64 keys and 32-row
query tiles whose two consumers split the head dim instead of the keys (each forms S^T and dP^T over all 64 keys,
then dV, dK and the transposed dQ share ``dQ^T = K^T dS^T`` on its own half of the columns, from its own dS^T).

Scope (:func:`unsupported_reason`): CUDA tensors of compute capability 9.x, q / k / v of one dtype (fp16 or bf16),
q [B, H, Nq, D], k / v [B, Hkv, Nk, D] with Hkv dividing H (grouped-query attention: one program per key tile of a
K / V head sweeps the query tiles of the group's query heads one head after another, or of one of the group's
:func:`kv_split` parts, with FP32 dK / dV partials summed afterwards, where the K / V heads' programs would leave SMs
idle; in the tf32 / fp32 builds each query head's multipliers are taken at its first step and the dK / dV
accumulators rescaled to them, powers of two), Nq != Nk allowed, head dim 64 or 128
for Q/K and V, no bias / mask / causal, TMA-legal strides (contiguous head dim, 16-byte-aligned base and strides).
Everything else stays on :mod:`.elsa_bwd`'s Triton kernels, which also keep the calls below :data:`MIN_KEYS`
keys or query rows (where this kernel's per-program fixed costs lose to them). Gluon cannot run under
``TRITON_INTERPRET=1``: CPU tests compile the kernel offline for sm_90, ``pytest -m gpu`` checks its gradients.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import elsa_bwd
from ._gluon import (hopper_copies_scope_reason, hopper_tma_scope_reason, kv_heads_reason, nvmma_layout,
                      strides_aligned)
from ._launch import LOG2E, SPIN_UNTIL_EQUAL_PTX, KernelCall, cdiv, head_blocks, sm_count
from .scaled_fp16 import P_SPLIT_EXP, SHIFT_LIMIT, head_shift, scaled_rows
from .split16 import pow2

try:  # Gluon is experimental: its API moves between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton._C.libtriton import ir as _ir

    from ._gluon import cta_barrier as _cta_barrier, split_mma, split_parts, tma_load_parts, tma_store_rows

    _SPIN_PTX = gl.constexpr(SPIN_UNTIL_EQUAL_PTX)
    # the bulk reductions this thread issued are complete (their writes performed, not only their shared-memory
    # reads: cp.async.bulk.wait_group without .read), then ordered before the generic-proxy release that follows
    _BULK_DONE_PTX = gl.constexpr("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, $1;")
    # the turn's acquire (generic proxy) before the bulk reductions (async proxy) that follow it
    _ASYNC_FENCE_PTX = gl.constexpr("fence.proxy.async.global;\n\tmov.u32 $0, $1;")

    @_builtin
    def _own_tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        # TMA bulk reduction (cp.reduce.async.bulk.tensor, .add) of a shared-memory tile into global memory: Gluon
        # names it tma.async_atomic_add after triton 3.6; 3.6's builder has the op already
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    _tma_reduce_add = getattr(tma, "async_atomic_add", None) or _own_tma_reduce_add
    _IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = f"Gluon Hopper API unavailable in this Triton ({exc})"

__all__ = ["half_backward", "planned_launch", "preferred", "unsupported_reason", "get_config", "kernel_constexprs",
           "rotation_step", "dq_schedule", "query_order", "descriptor_types", "ordered_buffer_sizes", "grid_size",
           "combine_accumulators", "tma_copy", "HEAD_DIMS", "MIN_KEYS", "tf32_backward", "tf32_config",
           "tf32_planned_launch", "tf32_preferred", "fp32_preferred", "fp32_backward", "fp32_config",
           "fp32_planned_launch", "fp32_unsupported_reason", "scaled_operands", "FP32_HEAD_DIMS", "P_SPLIT_EXP",
           "DS_LO_EXP", "FP32_MIN_WAVES", "FP32_LONG", "tf32_unsupported_reason", "TF32_MIN_WAVES", "TF32_MIN_QUERIES",
           "TF32_LONG", "TF32_LONG_D128", "TF32_SCALE_EXPONENTS", "TF32_SHIFT_LIMIT"]

HEAD_DIMS = (64, 128)
_DTYPES = (torch.float16, torch.bfloat16)
# consumer warpgroups per program: each owns BLOCK_N / CONSUMERS keys of the key tile
CONSUMERS = 2
MAX_DQ_ACCUMULATORS = 64
# one-warp dQ writer partitions: query tile i is writer i % DQ_WRITERS's (docs/tuning.md: Hopper fp16 / bf16 backward)
DQ_WRITERS = 2
# the backward plans of elsa_bwd take this kernel from this many keys and query rows (both): past the whole-head
# kernel's rows and keys (elsa_bwd.HEAD_MAX_ROWS, its 0.92x at 257), 1.2-1.9x the Triton kernels from 273 tokens up
# (ViT-B/16 at 384 px 1.23-1.32x); with 64-128 query rows against 4096 keys the Triton kernels keep a 12 % lead
# (docs/tuning.md: Hopper fp16 / bf16 backward from 273 keys and query rows)
MIN_KEYS = 273
# mode tf32 (tf32_backward): the largest magnitude of each head's q, k, v, dO is scaled below 2^e by a power of two
# before the rounding to FP16. 2^8 for q and k keeps FP16's normal range for entries down to 2^-22 of their head's
# largest; v and dO at 2^4, 2^3 bound dP^T - delta by 2 * 128 * 2^7 = 2^15 at head dim <= 128, so dS^T = P^T (dP^T -
# delta) (P <= 1) stays under FP16's largest, 65504
TF32_SCALE_EXPONENTS = (8, 8, 4, 3)
# the scaling shifts a head by at most 2^62 either way (scaled_fp16.SHIFT_LIMIT)
TF32_SHIFT_LIMIT = SHIFT_LIMIT
# FP32 multipliers per head in the Scales rows: qk_scale, delta's, dQ's, dK's, dV's (padded to 8)
SCALES_ROW = tl.constexpr(8)
# mode fp32 (PARTS = 2): P^T is scaled by 2^P_SPLIT_EXP (scaled_fp16's, as the forward scales P) before its hi / lo
# split, so that its lo part stays out of FP16's subnormals; dV's multiplier undoes it
P_SPLIT_SCALE = tl.constexpr(2.0 ** P_SPLIT_EXP)
# dS's lo part is kept times 2^DS_LO_EXP: dS takes P's magnitude (~1 / Nk), far below its bound, and its unscaled
# lo part (2^-11 of it) would be FP16-subnormal from a few thousand keys; the lo products are accumulated apart and
# multiplied back
DS_LO_EXP = 11
DS_LO_SCALE = tl.constexpr(2.0 ** DS_LO_EXP)
DS_LO_INV = tl.constexpr(2.0 ** -DS_LO_EXP)


def preferred(n_q: int, n_k: int) -> bool:
    """Whether :mod:`.elsa_bwd`'s backward plans run an in-scope call of ``n_q`` query rows and ``n_k`` keys here
    rather than on the Triton kernels: from :data:`MIN_KEYS` of both."""
    return min(n_q, n_k) >= MIN_KEYS


def get_config(head_dim: int) -> dict:
    """Launch config of the head dim. Keys: ``BLOCK_M`` query rows per streamed tile, ``BLOCK_N`` keys per program
    (split between the two consumer warpgroups), ``STAGES`` slots of the Q / dO ring, ``maxnreg`` at launch (12
    warps: two consumer warpgroups, the producer warp and the two dQ writers' warps padded to a warpgroup),
    ``consumer_regs`` / ``writer_regs`` per consumer / writer thread after ``setmaxnreg``, ``dq_ring`` query tiles
    in the consumers' FP32 dQ hand-off ring (at least the two writers' tiles in flight), ``dq_accumulators`` FP32
    dQ accumulators the key tiles take in turn (tile ``j`` adds into ``j % dq_accumulators``; the combine kernel
    sums them in index order), which divides each query tile's chain of ordered turns by that many.

    ``producer_rows``: the producer warp also loads each query tile's lse and delta rows into the ring slot, from
    which the consumers read the columns they need (else each consumer loads them and spreads them over S^T's
    columns through shared memory, its own loads' latency and a barrier on its path); ``kv_in_registers``: each
    consumer holds its K and V rows in registers as the left operands of S^T's and dP^T's wgmmas (else both
    operands of those products come from shared memory; ignored by the split build); ``rotate``: each key tile
    sweeps the query tiles from its own starting tile (:func:`rotation_step`), else every key tile from the first;
    ``rotated_dq_accumulators``: the chains of a call whose sweeps rotate with that many (:func:`dq_schedule`;
    ``dq_accumulators`` is then the chains of the calls whose sweeps do not).

    Defaults (docs/tuning.md: Hopper fp16 / bf16 backward): a ring of four query tiles (two at D = 128, where more
    do not fit in shared memory), rotated sweeps of one chain (two accumulators: the shares in turn and the wrapped
    ones) where the query tiles cover the chain, else two chains in one order (two accumulators); the rows from the
    producer (at D = 128 4-8 % faster: the consumers' spills go), at D = 64 with K / V in registers (together 5-7 %
    faster, apart neither; at D = 128 K / V in registers spill). Two accumulators and the TMA bulk reductions bring the
    backward to 410-420 TFLOP/s at D = 64 (440 with the two D = 64 options) and 510-520 at D = 128 (bf16, B=1 H=16 /
    8 N=16384, H200)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim}; the Gluon backward takes {HEAD_DIMS}")
    return {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 2, "maxnreg": 168, "consumer_regs": 240, "writer_regs": 32,
            "dq_ring": 4 if head_dim == 64 else 2, "dq_accumulators": 2, "producer_rows": True,
            "kv_in_registers": head_dim == 64, "rotate": True, "rotated_dq_accumulators": 1}


def grid_size(B: int, H: int, n_k: int, cfg: dict) -> int:
    """Programs of a call: one per (key tile, head, batch), the key tiles of a head consecutive (the ordered dQ
    adds of key tile ``j`` wait on key tile ``j - dq_accumulators``, a lower program id). ``H``: the K / V heads
    (grouped-query attention: a program sweeps its K / V head's query heads)."""
    return cdiv(n_k, cfg["BLOCK_N"]) * B * H


def kv_split(B: int, h_kv: int, group: int, n_k: int, cfg: dict, sms: int) -> int:
    """Parts S to cut each K / V head's ``group`` query heads into (grouped-query attention): a program per (key tile,
    part) sweeps ``group / S`` query heads and writes FP32 dK / dV partials that the host sums over the parts. S is
    the divisor of ``group`` with the fewest waves of programs times query heads per program,
    ``cdiv(B * h_kv * S * key tiles, sms) * group / S``, the smallest on ties: 1 wherever the K / V heads' programs
    fill the SMs' waves as well as a cut would, more where they leave SMs idle (e.g. 2 K / V heads of 8 query heads
    each, 4096 keys, 64 programs on 132 SMs: S = 2; docs/tuning.md: grouped-query attention on the Hopper fp16 /
    bf16 Gluon backward)."""
    n_kt = cdiv(n_k, cfg["BLOCK_N"])
    costs = {s: cdiv(B * h_kv * s * n_kt, sms) * (group // s) for s in range(1, group + 1) if group % s == 0}
    return min(costs, key=lambda s: (costs[s], s))


def rotation_step(n_q: int, n_k: int, cfg: dict) -> int:
    """The kernel's ``ROT``: how many query tiles apart the key tiles of one accumulator's chain start their sweeps
    (0: all from the first query tile). Key tile ``j``, turn ``p = j // dq_accumulators`` of its chain, sweeps
    the query tiles from tile ``-p * ROT`` (mod the query tiles): the tiles of a chain, started together (one wave),
    then reach each query tile ``ROT`` steps apart, where sweeping in one order they pass each query tile one after
    another (a wave's chain then starts skewed by its length times a turn's latency). Each query tile takes the
    shares of the chain's tiles that reach it after wrapping past the last query tile into an accumulator of its
    own, and both accumulators take their shares in key-tile order, which is also the order in which they arrive
    (:func:`query_order`), so every wait is on a lower program id that got there earlier: the waits end as long as
    programs start in id order. ``ROT = n_q_tiles // chain`` (the chain's starts spread over the query tiles)
    where the config's ``rotate`` is set and the chain has two or more tiles (docs/tuning.md: Hopper fp16 / bf16
    backward: rotated sweeps)."""
    n_m, n_kt = cdiv(n_q, cfg["BLOCK_M"]), cdiv(n_k, cfg["BLOCK_N"])
    chain = cdiv(n_kt, min(cfg["dq_accumulators"], n_kt))
    if not cfg.get("rotate", False) or chain < 2:
        return 0
    return n_m // chain


def dq_schedule(n_q: int, n_k: int, cfg: dict) -> tuple[int, int, int]:
    """``(chains, ROT, accumulators)`` of a call of ``n_q`` query rows and ``n_k`` keys: the config's
    ``rotated_dq_accumulators`` chains where the sweeps rotate with that many (:func:`rotation_step` > 0), else its
    ``dq_accumulators`` and their rotation (0 unless the chains are shorter but long enough), both capped at the key
    tiles; FP32 dQ accumulators: a chain's two (its shares in turn and those that wrapped) where the sweeps rotate,
    else one."""
    n_kt = cdiv(n_k, cfg["BLOCK_N"])
    chains = min(cfg.get("rotated_dq_accumulators") or cfg["dq_accumulators"], n_kt)
    rot = rotation_step(n_q, n_k, dict(cfg, dq_accumulators=chains))
    if rot == 0:
        chains = min(cfg["dq_accumulators"], n_kt)
        rot = rotation_step(n_q, n_k, dict(cfg, dq_accumulators=chains))
    return chains, rot, chains * (2 if rot else 1)


def query_order(n_q_tiles: int, n_k_tiles: int, chains: int, rot: int) -> tuple[list[list[int]], dict]:
    """The kernel's schedule (``_query_tile``, ``_query_turn``) in Python, for tests: ``(sweeps, turns)``, where
    ``sweeps[j]`` lists the query tiles key tile ``j`` visits, step by step, and ``turns[(acc, i)]`` the key tiles
    adding into accumulator ``acc``'s query tile ``i``, in their turns' order: chain ``a``'s shares into ``a``,
    those of its tiles that reach tile ``i`` after wrapping into ``chains + a`` (``rot`` from
    :func:`rotation_step`)."""
    sweeps = [[(t + n_q_tiles - (j // chains * rot) % n_q_tiles) % n_q_tiles for t in range(n_q_tiles)]
              for j in range(n_k_tiles)]
    turns = {}
    for a in range(min(chains, n_k_tiles)):
        chain = list(range(a, n_k_tiles, chains))
        for i in range(n_q_tiles):
            p0 = min(-(-(n_q_tiles - i) // rot), len(chain)) if rot > 0 else len(chain)
            turns[(a, i)] = chain[:p0]
            if p0 < len(chain):
                turns[(chains + a, i)] = chain[p0:]
    return sweeps, turns


def ordered_buffer_sizes(B: int, H: int, n_q: int, head_dim: int, cfg: dict) -> tuple[int, int]:
    """``(accumulators, counters)``: FP32 elements of the dQ accumulators [dq_accumulators * B * H, Nq, D] and int32
    turn counters, one per (accumulator, batch * head, query tile of ``BLOCK_M`` rows); the preprocess zeroes the
    counters only (each accumulator tile's first share is stored)."""
    accs = cfg["dq_accumulators"]
    return accs * B * H * n_q * head_dim, accs * B * H * cdiv(n_q, cfg["BLOCK_M"])


def kernel_constexprs(cfg: dict, head_dim: int, n_k: int, head_scales: bool = False, split: bool = False,
                      gqa: bool = False, kv_partials: bool = False) -> dict:
    """The constexpr arguments of :func:`_half_bwd_kernel` (launches and offline compiles): ``EVEN_N`` when every
    key tile is full (no key masking: two builds at most per head dim and dtype), ``HEAD_SCALES`` for mode tf32's
    and fp32's per-head scaled operands (:func:`tf32_backward`), ``PARTS`` 2 for fp32's split-FP16 products
    (``split``, :func:`fp32_backward`; with head_scales only), else 1; ``PRODUCER_ROWS`` and ``KV_IN_REGS`` from
    the config's ``producer_rows`` and ``kv_in_registers`` (the latter never with ``split``), ``GQA`` for grouped-query
    attention (fewer K / V heads than query heads; with head_scales each query head's multipliers are taken at its
    first step and the dK / dV accumulators rescaled to them), ``KV_PARTIALS`` for its groups cut into parts with
    FP32 dK / dV partials (:func:`kv_split`; with ``gqa`` only). Raises ValueError for a
    ``dq_accumulators`` outside 1 .. :data:`MAX_DQ_ACCUMULATORS` or a ``dq_ring`` smaller than the
    :data:`DQ_WRITERS` writers' tiles in flight (the ring's phase waits are exact only then, see ``_dq_writer``)."""
    accs, ring = cfg["dq_accumulators"], cfg["dq_ring"]
    if not (isinstance(accs, int) and 1 <= accs <= MAX_DQ_ACCUMULATORS):
        raise ValueError(f"dq_accumulators {accs!r}: 1 to {MAX_DQ_ACCUMULATORS} FP32 dQ accumulators")
    if not (isinstance(ring, int) and ring >= DQ_WRITERS):
        raise ValueError(f"dq_ring {ring!r} < {DQ_WRITERS}: the ring holds a query tile per dQ writer")
    if kv_partials and not gqa:
        raise ValueError("kv_partials cuts the query heads of grouped-query attention: pass gqa=True")
    dsplit = bool(cfg.get("dsplit", False))
    if dsplit and not split:
        raise ValueError("dsplit (the consumers split the head dim) is the split-FP16 build's: pass split=True")
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HEAD_D=head_dim, STAGES=cfg["STAGES"],
                CONSUMER_REGS=cfg["consumer_regs"], EVEN_N=n_k % cfg["BLOCK_N"] == 0, WRITER_REGS=cfg["writer_regs"],
                DQ_RING=ring, DQ_ACCS=accs, HEAD_SCALES=bool(head_scales or split), PARTS=2 if split else 1,
                PRODUCER_ROWS=cfg["producer_rows"], KV_IN_REGS=cfg["kv_in_registers"] and not split, GQA=bool(gqa),
                KV_PARTIALS=bool(kv_partials), DSPLIT=dsplit)


def unsupported_reason(q, k, v, grad_out, bias, attn_mask, is_causal: bool, scale: float) -> str | None:
    """Why :func:`half_backward` cannot run this call (the Triton kernels of :mod:`.elsa_bwd` then do), or ``None``.

    Inputs as :func:`.elsa_bwd.elsa_backward` takes them: q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv],
    grad_out [B, H, Nq, Dv]; Hkv dividing H (grouped-query attention: query head ``h`` reads K / V head
    ``h // (H / Hkv)`` in place, and dK / dV add over each group in a fixed order). Refused: k and v of different head
    counts, or Hkv not dividing H, bias / mask / causal, scale <= 0, dtypes
    other than one of fp16 / bf16 for q, k, v, head dims other than 64 / 128 (D = Dv), q / k / v strides that are not
    TMA-legal, tensors off CUDA or on a GPU other than compute capability 9.x, a Triton without the Gluon Hopper API
    (reported last). ``grad_out`` may be any float dtype and layout: :func:`half_backward` rounds it to q's dtype
    and copies it where its strides are not TMA-legal.
    """
    reason = kv_heads_reason(q, k, v)
    if reason is not None:
        return reason
    if not grad_out.dtype.is_floating_point or tuple(grad_out.shape) != (*q.shape[:3], v.shape[-1]):
        return f"grad_out {tuple(grad_out.shape)} {grad_out.dtype} does not match the output"
    return hopper_tma_scope_reason(q, k, v, bias, attn_mask, is_causal, scale, 1, dtypes=_DTYPES,
                                   head_dims=HEAD_DIMS, import_error=_IMPORT_ERROR)


if _IMPORT_ERROR is None:

    @gluon.jit
    def _program_tile(Nk, H, GROUP, BLOCK_N: gl.constexpr, GQA: gl.constexpr):
        # (key tile, batch * Hkv + K / V head, batch, K / V head) of this program (Hkv = H / GROUP K / V heads with
        # GQA, else H): the key tiles of one K / V head are consecutive ids
        n_kt = gl.cdiv(Nk, BLOCK_N)
        pid = gl.program_id(0)
        bh = pid // n_kt
        if GQA:
            h_kv = H // GROUP
            return pid % n_kt, bh, bh // h_kv, bh % h_kv
        else:
            return pid % n_kt, bh, bh // H, bh % H

    @gluon.jit
    def _step_head(t, n_m, off_b, off_h, H, GROUP, GQA: gl.constexpr):
        # (step within its query head's sweep, query head, batch * H + query head) of a program's step t: with GQA
        # the program of K / V head off_h sweeps the query tiles of its GROUP query heads off_h * GROUP + g one head
        # after another (n_m steps each), so dK / dV add over the group in a fixed order
        if GQA:
            g = t // n_m
            head = off_h * GROUP + g
            return t - g * n_m, head, off_b * H + head
        else:
            return t, off_h, off_b * H + off_h

    @gluon.jit
    def _query_tile(t, j, n_m, ROT, DQ_ACCS: gl.constexpr):
        # the query tile of key tile j's step t: key tile j, turn p = j // DQ_ACCS of its accumulator's chain,
        # starts at query tile -p * ROT (mod n_m), so that the tiles of a chain reach each query tile ROT steps
        # apart, in the order of their turns there (query_order; ROT = 0: every key tile in index order)
        p = j // DQ_ACCS
        return (t + n_m - (p * ROT) % n_m) % n_m

    @gluon.jit
    def _query_turn(i, j, n_m, n_kt, ROT, DQ_ACCS: gl.constexpr):
        # (accumulator, turn) of key tile j's dQ share at query tile i. Chain j % DQ_ACCS, turn p = j // DQ_ACCS:
        # the chain's tiles p >= p0 reach tile i after wrapping past the last query tile (_query_tile), before the
        # others; they add into an accumulator of their own (DQ_ACCS further on), in turn p - p0, the others in
        # turn p: both orders are the chain's key-tile order and the order in which the chain reaches the tile, so
        # every wait is on a lower program id that got there ROT steps earlier (query_order's rule; ROT = 0: no
        # tile wraps)
        p = j // DQ_ACCS
        P = (n_kt - j % DQ_ACCS + DQ_ACCS - 1) // DQ_ACCS
        p0 = P
        if ROT > 0:
            p0 = gl.minimum((n_m - i + ROT - 1) // ROT, P)
        wrapped = (p >= p0).to(gl.int32)
        return j % DQ_ACCS + DQ_ACCS * wrapped, p - p0 * wrapped

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, do_desc, LseRow, Delta, k_smem, v_smem, q_smem, do_smem, lse_smem,
                  delta_smem, kv_bar, ready, empty, H, GROUP, KV_SPLIT, Nq, Nk, ROT, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONS: gl.constexpr, HEAD_D: gl.constexpr,
                  PARTS: gl.constexpr, PRODUCER_ROWS: gl.constexpr, DQ_ACCS: gl.constexpr, GQA: gl.constexpr,
                  KV_PARTIALS: gl.constexpr, DSPLIT: gl.constexpr):
        # one warp: K_j, V_j (one 64-row half per consumer) once, then, step t, query tile i = _query_tile(t): Q_i,
        # dO_i into ring slot t % STAGES once both consumers freed it; PARTS = 2 (split-FP16): each tile's hi and lo
        # parts, columns [0, HEAD_D) and [HEAD_D, 2 HEAD_D) of its tensor, into consecutive buffers; PRODUCER_ROWS:
        # the tile's lse and delta rows too; with GQA the steps go over the group's query heads (_step_head), with
        # KV_PARTIALS over one of the KV_SPLIT parts of the group (off_h then numbers the parts: K / V head
        # off_h // KV_SPLIT); DSPLIT: the whole key tile as one box per part (both consumers read all its keys)
        j, bh, off_b, off_h = _program_tile(Nk, H, GROUP, BLOCK_N, GQA)
        kv_h = off_h // KV_SPLIT if KV_PARTIALS else off_h
        KV_BOXES: gl.constexpr = 1 if DSPLIT else CONS
        HALF: gl.constexpr = BLOCK_N // KV_BOXES
        offs_row = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
        mbarrier.expect(kv_bar, KV_BOXES * PARTS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
        for w in gl.static_range(KV_BOXES):
            for part in gl.static_range(PARTS):
                tma.async_copy_global_to_shared(k_desc, [off_b, kv_h, j * BLOCK_N + w * HALF, part * HEAD_D], kv_bar,
                                                k_smem.index(w * PARTS + part))
                tma.async_copy_global_to_shared(v_desc, [off_b, kv_h, j * BLOCK_N + w * HALF, part * HEAD_D], kv_bar,
                                                v_smem.index(w * PARTS + part))
        n_m = gl.cdiv(Nq, BLOCK_M)
        n_steps = n_m * GROUP if GQA else n_m
        for t in range(n_steps):
            tq, q_head, q_bh = _step_head(t, n_m, off_b, off_h, H, GROUP, GQA)
            i = _query_tile(tq, j, n_m, ROT, DQ_ACCS)
            row_base = q_bh * Nq
            slot = t % STAGES
            mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
            tma_load_parts(q_desc, do_desc, off_b, q_head, i * BLOCK_M, ready.index(slot), q_smem, do_smem, slot, PARTS)
            if PRODUCER_ROWS:
                # plain loads (a row's offset bh * Nq + i * BLOCK_M need not be 16-byte aligned, as a TMA copy's
                # must; this warp runs STAGES tiles ahead, so their latency is off the consumers' path), the slot's
                # second arrival
                rows = i * BLOCK_M + offs_row
                lse = gl.load(LseRow + row_base + rows, mask=rows < Nq, other=float("inf"))
                delta = gl.load(Delta + row_base + rows, mask=rows < Nq, other=0.0)
                lse_smem.index(slot).store(lse)
                delta_smem.index(slot).store(delta)
                _cta_barrier()  # every lane's rows are in shared memory before the arrival
                mbarrier.arrive(ready.index(slot))

    @gluon.jit
    def _delta_columns(delta_smem, slot, delta_c, delta_mult, cols: gl.constexpr, PRODUCER_ROWS: gl.constexpr,
                       HEAD_SCALES: gl.constexpr):
        # delta over S^T's columns (layout ``cols``): from ring slot ``slot`` of the producer's rows (times the
        # head's multiplier with HEAD_SCALES), else the consumer's own compact load ``delta_c`` (already scaled)
        # spread over the columns
        if PRODUCER_ROWS:
            delta = delta_smem.index(slot).load(cols)
            if HEAD_SCALES:
                delta = delta * delta_mult
        else:
            delta = gl.convert_layout(delta_c, cols)
        return delta

    @gluon.jit
    def _consumer(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready, empty,
                  ds_bar, dq_full, dq_empty, LseRow, Delta, DK, DV, dk_desc, dv_desc, Scales, H, GROUP, Nq, Nk, ROT,
                  qk_scale, scale,
                  WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                  STAGES: gl.constexpr, CONS: gl.constexpr, EVEN_N: gl.constexpr, HEAD_SCALES: gl.constexpr,
                  PARTS: gl.constexpr, PRODUCER_ROWS: gl.constexpr, KV_IN_REGS: gl.constexpr,
                  DQ_ACCS: gl.constexpr, GQA: gl.constexpr, KV_PARTIALS: gl.constexpr, DSPLIT: gl.constexpr):
        # one warpgroup: keys [j * BLOCK_N + WG * HALF, + HALF) of the program's key tile, every query tile (step t:
        # tile _query_tile(t); the rings and barriers go by t; with GQA every query head of the group in turn,
        # _step_head).
        # PARTS = 2 (mode fp32): every product of split-FP16 operands, three wgmmas; operands' hi / lo parts in
        # consecutive shared buffers, P^T scaled by 2^P_SPLIT_EXP before its split (P^T's lo part would fall into
        # FP16's subnormals) and dV's multiplier undoes it; dS's lo part kept times 2^DS_LO_EXP (see the loop).
        # DSPLIT (mode fp32 at head dim 128, PARTS = 2): both consumers form S^T and dP^T over all BLOCK_N keys
        # of the tile and split the head dim instead: consumer WG owns columns [WG * DQC, + DQC) of dK, dV and
        # the dQ share, so that its accumulators are those of head dim 64 (docs/tuning.md: fp32 on the Gluon
        # backward at head dim 128)
        HALF: gl.constexpr = BLOCK_N if DSPLIT else BLOCK_N // CONS
        # the shared buffer of this consumer's K / V rows: the tile's one box with DSPLIT, else its own half
        KV_BOX: gl.constexpr = 0 if DSPLIT else WG
        # dQ's columns [WG * DQC, + DQC) over all BLOCK_N keys are this consumer's (dS^T of both through shared
        # memory; DSPLIT: its own dS^T holds all the keys)
        DQC: gl.constexpr = HEAD_D // CONS
        # the columns of this consumer's dK / dV accumulators
        ACC_D: gl.constexpr = DQC if DSPLIT else HEAD_D
        # [keys, queries] tiles (S^T, dP^T; DSPLIT: also the dQ share's transpose [DQC, queries]), [keys, ACC_D]
        # accumulators (dK, dV), the [queries, DQC] dQ share
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, ACC_D, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQC, 16])
        dtype: gl.constexpr = q_smem.dtype
        DQ_RING: gl.constexpr = dq_full.shape[0]
        j, bh, off_b, off_h = _program_tile(Nk, H, GROUP, BLOCK_N, GQA)
        n_m = gl.cdiv(Nq, BLOCK_M)
        n_steps = n_m * GROUP if GQA else n_m
        # the multipliers of dQ's and dK's products (dV's is 1), and delta's (1): with HEAD_SCALES the query head's
        # row of Scales (its operands were scaled by powers of two, see _scaled_operands_kernel); with GQA too, each
        # query head of the group its own row, taken at its first step (the dK / dV accumulators are then rescaled
        # from the previous head's multipliers to its own: powers of two, exact)
        dq_scale = scale
        dk_scale = scale
        dv_scale = 1.0
        delta_mult = 1.0
        if HEAD_SCALES:
            head = Scales + _step_head(0, n_m, off_b, off_h, H, GROUP, GQA)[2] * SCALES_ROW
            qk_scale = gl.load(head)
            delta_mult = gl.load(head + 1)
            dq_scale = gl.load(head + 2)
            dk_scale = gl.load(head + 3)
            dv_scale = gl.load(head + 4)
        offs_row = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [4], [0]))
        offs_ad = (WG * DQC if DSPLIT else 0) + gl.arange(0, ACC_D, layout=gl.SliceLayout(0, acc_layout))
        st_zero = gl.zeros([HALF, BLOCK_M], gl.float32, layout=st_layout)
        dq_zero = gl.zeros([BLOCK_M, DQC], gl.float32, layout=dq_layout)
        dqt_zero = gl.zeros([DQC, BLOCK_M], gl.float32, layout=st_layout)  # DSPLIT's transposed dQ share
        dk = gl.zeros([HALF, ACC_D], gl.float32, layout=acc_layout)
        dv = gl.zeros([HALF, ACC_D], gl.float32, layout=acc_layout)
        acc_zero = gl.zeros([HALF, ACC_D], gl.float32, layout=acc_layout)
        key_ok = (j * BLOCK_N + KV_BOX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))) < Nk
        # the wgmma groups one product issues; the hi part's buffer and the lo part's (the hi one at PARTS = 1)
        NMMA: gl.constexpr = 2 * PARTS - 1
        LO: gl.constexpr = PARTS - 1
        k_w = k_smem.index(KV_BOX * PARTS).reshape([HALF, HEAD_D])
        k_wl = k_smem.index(KV_BOX * PARTS + LO).reshape([HALF, HEAD_D])
        v_w = v_smem.index(KV_BOX * PARTS).reshape([HALF, HEAD_D])
        v_wl = v_smem.index(KV_BOX * PARTS + LO).reshape([HALF, HEAD_D])
        mbarrier.wait(kv_bar, 0)
        if KV_IN_REGS:
            # K_w and V_w as the register operands of S^T's and dP^T's wgmmas: each product then reads only Q^T /
            # dO^T from shared memory (a 64 x 64 x 16 wgmma reading both operands takes all of its bandwidth)
            kv_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=st_layout, k_width=2)
            k_w = k_w.load(kv_op)
            v_w = v_w.load(kv_op)
        for t in range(n_steps):
            tq, q_head, q_bh = _step_head(t, n_m, off_b, off_h, H, GROUP, GQA)
            if HEAD_SCALES and GQA:
                if (tq == 0) & (t > 0):  # the next query head of the group: its multipliers
                    head = Scales + q_bh * SCALES_ROW
                    qk_scale = gl.load(head)
                    delta_mult = gl.load(head + 1)
                    dq_scale = gl.load(head + 2)
                    dk_next = gl.load(head + 3)
                    dv_next = gl.load(head + 4)
                    # exact while the accumulators stay in FP32's range: query heads of one group whose largest
                    # |q| |dO| differ by more than ~2^90 can overflow them here (such inputs are not refused)
                    dk = dk * (dk_scale / dk_next)
                    dv = dv * (dv_scale / dv_next)
                    dk_scale = dk_next
                    dv_scale = dv_next
            i = _query_tile(tq, j, n_m, ROT, DQ_ACCS)
            row_base = q_bh * Nq
            slot = t % STAGES
            # without PRODUCER_ROWS the row data first: their latency runs under the ring wait and the products (in
            # a compact layout, one register each: spread over S^T's columns only where used, through shared memory,
            # so they hold no 16 registers per thread each across the products); with it, the slot holds them and
            # each thread reads the columns it needs when it needs them
            delta_c = None  # (PRODUCER_ROWS: not loaded here)
            if not PRODUCER_ROWS:
                rows = i * BLOCK_M + offs_row
                lse_c = gl.load(LseRow + row_base + rows, mask=rows < Nq, other=float("inf"))
                delta_c = gl.load(Delta + row_base + rows, mask=rows < Nq, other=0.0)
                if HEAD_SCALES:
                    delta_c = delta_c * delta_mult
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            q_t = q_smem.index(slot * PARTS).reshape([BLOCK_M, HEAD_D])
            q_l = q_smem.index(slot * PARTS + LO).reshape([BLOCK_M, HEAD_D])
            do_t = do_smem.index(slot * PARTS).reshape([BLOCK_M, HEAD_D])
            do_l = do_smem.index(slot * PARTS + LO).reshape([BLOCK_M, HEAD_D])
            s_tok = split_mma(k_w, k_wl, q_t.permute((1, 0)), q_l.permute((1, 0)), st_zero, False, PARTS)
            dp_tok = split_mma(v_w, v_wl, do_t.permute((1, 0)), do_l.permute((1, 0)), st_zero, False, PARTS)
            s = warpgroup_mma_wait(NMMA, deps=[s_tok])
            if PRODUCER_ROWS:
                lse2 = lse_smem.index(slot).load(gl.SliceLayout(0, st_layout)) * 1.4426950408889634
            else:
                lse2 = gl.convert_layout(lse_c, gl.SliceLayout(0, st_layout)) * 1.4426950408889634
            p = gl.exp2(s * qk_scale - lse2[None, :])
            if not EVEN_N:  # keys past Nk (zero rows of K) must not carry P: exp2(-lse) may be huge
                p = gl.where(key_ok[:, None], p, 0.0)
            if PARTS == 2:
                # mode fp32. dS first, so that the FP32 P^T and dP^T retire before dV's product; each query tile's
                # dV and dK products formed apart and added in FP32 (the wgmma accumulator's own additions keep
                # fewer bits than FP32's round-to-nearest: over hundreds of query tiles dK and dV would leave fp32's
                # bound); dK's dS^T operands from shared memory (in registers beside dV's they spill). DSPLIT (head
                # dim 128): dV and dK read dO_i's and Q_i's columns [WG * DQC, + DQC) only, and this consumer's own
                # dS^T, over all the tile's keys, serves the transposed dQ share dQ_i^T[cols] = K[:, cols]^T dS^T (a
                # wgmma's rows are at least 64, the query tile's 32): no dS^T passes between the consumers, and its
                # one buffer is free once this consumer's wgmmas of the previous query tile retired
                do_c, do_cl, q_c, q_cl = do_t, do_l, q_t, q_l
                dslot = (t % 2) * CONS * PARTS
                if DSPLIT:
                    do_c = do_t.slice(WG * DQC, DQC, dim=1)
                    do_cl = do_l.slice(WG * DQC, DQC, dim=1)
                    q_c = q_t.slice(WG * DQC, DQC, dim=1)
                    q_cl = q_l.slice(WG * DQC, DQC, dim=1)
                    dslot = 0
                dp = warpgroup_mma_wait(0, deps=[dp_tok])
                delta = _delta_columns(delta_smem, slot, delta_c, delta_mult, gl.SliceLayout(0, st_layout),
                                       PRODUCER_ROWS, HEAD_SCALES)
                ds16, ds16l = split_parts(p * (dp - delta[None, :]), dtype, DS_LO_SCALE)
                p16, p16l = split_parts(p * P_SPLIT_SCALE, dtype, 1.0)
                dv_tok = split_mma(gl.convert_layout(p16, op_layout), gl.convert_layout(p16l, op_layout), do_c,
                                   do_cl, acc_zero, False, PARTS)
                ds_w = ds_smem.index(dslot + WG * PARTS)
                ds_wl = ds_smem.index(dslot + WG * PARTS + 1)
                ds_w.store(ds16)
                ds_wl.store(ds16l)
                fence_async_shared()
                _cta_barrier()  # every thread's dS^T is in shared memory before the wgmmas and the other consumer
                dv = dv + warpgroup_mma_wait(0, deps=[dv_tok])
                # dS's lo terms apart (2^DS_LO_EXP too large), scaled back after the wait
                dk_lo_tok = warpgroup_mma(ds_wl, q_c, acc_zero, use_acc=False, is_async=True)
                dk_tok = warpgroup_mma(ds_w, q_cl, acc_zero, use_acc=False, is_async=True)
                dk_tok = warpgroup_mma(ds_w, q_c, dk_tok, is_async=True)
                if DSPLIT:
                    k_c = k_w.slice(WG * DQC, DQC, dim=1).permute((1, 0))
                    dq_lo_tok = warpgroup_mma(k_c, ds_wl, dqt_zero, use_acc=False, is_async=True)
                    dq_tok = warpgroup_mma(k_wl.slice(WG * DQC, DQC, dim=1).permute((1, 0)), ds_w, dqt_zero,
                                           use_acc=False, is_async=True)
                    dq_tok = warpgroup_mma(k_c, ds_w, dq_tok, is_async=True)
                else:
                    mbarrier.arrive(ds_bar.index(t % 2))
                    mbarrier.wait(ds_bar.index(t % 2), (t // 2) & 1)
                    # dQ[:, half WG] = dS_0 K_0[:, half] + dS_1 K_1[:, half] (dS from its transpose in shared memory)
                    dq_lo_tok = dq_zero
                    for c in gl.static_range(CONS):
                        k_c = k_smem.index(c * PARTS).reshape([HALF, HEAD_D]).slice(WG * DQC, DQC, dim=1)
                        dq_lo_tok = warpgroup_mma(ds_smem.index(dslot + c * PARTS + 1).permute((1, 0)), k_c,
                                                  dq_lo_tok, use_acc=c > 0, is_async=True)
                    dq_tok = dq_zero
                    for c in gl.static_range(CONS):
                        dsc = ds_smem.index(dslot + c * PARTS).permute((1, 0))
                        k_c = k_smem.index(c * PARTS).reshape([HALF, HEAD_D]).slice(WG * DQC, DQC, dim=1)
                        k_cl = k_smem.index(c * PARTS + 1).reshape([HALF, HEAD_D]).slice(WG * DQC, DQC, dim=1)
                        dq_tok = warpgroup_mma(dsc, k_cl, dq_tok, use_acc=c > 0, is_async=True)
                        dq_tok = warpgroup_mma(dsc, k_c, dq_tok, is_async=True)
                # dK's three wgmmas retired, dQ's (three with DSPLIT, else three per consumer's keys) in flight
                dk_lo, dk_part = warpgroup_mma_wait(3 if DSPLIT else 3 * CONS, deps=[dk_lo_tok, dk_tok])
                dk = dk + (dk_part + dk_lo * DS_LO_INV)
                _cta_barrier()  # every thread's reads of the slot's rows precede the one-thread release below
                mbarrier.arrive(empty.index(slot))  # this warpgroup is done with Q_i and dO_i (K stays)
                dq_lo, part = warpgroup_mma_wait(0, deps=[dq_lo_tok, dq_tok])
                part = part + dq_lo * DS_LO_INV
                if DSPLIT:  # the share as the writers' ring holds it, [queries, DQC]
                    part = gl.permute(part, (1, 0))
            else:
                p16 = gl.convert_layout(p.to(dtype), op_layout)
                dv_tok = warpgroup_mma(p16, do_t, dv, is_async=True)
                dp = warpgroup_mma_wait(1, deps=[dp_tok])
                delta = _delta_columns(delta_smem, slot, delta_c, delta_mult, gl.SliceLayout(0, st_layout),
                                       PRODUCER_ROWS, HEAD_SCALES)
                ds16 = (p * (dp - delta[None, :])).to(dtype)
                # dS^T of this consumer's keys into its slot of the double buffer (both consumers passed the previous
                # use of this slot: each arrives on ds_bar only after its dQ product of the tile before retired)
                dslot = (t % 2) * CONS
                ds_smem.index(dslot + WG).store(ds16)
                dk_tok = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_t, dk, is_async=True)
                dv = warpgroup_mma_wait(1, deps=[dv_tok])  # P^T's registers are free before the dQ share needs its own
                fence_async_shared()
                _cta_barrier()  # every thread's dS^T is in shared memory before the other consumer reads it
                mbarrier.arrive(ds_bar.index(t % 2))
                mbarrier.wait(ds_bar.index(t % 2), (t // 2) & 1)
                # dQ[:, half WG] = dS_0 K_0[:, half] + dS_1 K_1[:, half] (dS from its transpose in shared memory)
                dq_tok = warpgroup_mma(ds_smem.index(dslot).permute((1, 0)),
                                       k_smem.index(0).reshape([HALF, HEAD_D]).slice(WG * DQC, DQC, dim=1), dq_zero,
                                       use_acc=False, is_async=True)
                dq_tok = warpgroup_mma(ds_smem.index(dslot + 1).permute((1, 0)),
                                       k_smem.index(1).reshape([HALF, HEAD_D]).slice(WG * DQC, DQC, dim=1), dq_tok,
                                       is_async=True)
                dk = warpgroup_mma_wait(1, deps=[dk_tok])
                # every thread's reads of the slot (its lse / delta rows; Q_i and dO_i through the wgmmas waited
                # above) precede the one-thread release: the producer then overwrites the slot
                _cta_barrier()
                mbarrier.arrive(empty.index(slot))  # this warpgroup is done with Q_i and dO_i (K stays)
                part = warpgroup_mma_wait(0, deps=[dq_tok])
            # hand the share to the writers through their ring (slot t % DQ_RING, this consumer's half) and go on
            # with the next query tile
            mbarrier.wait(dq_empty.index(t % DQ_RING), ((t // DQ_RING) & 1) ^ 1)
            dq_smem.index((t % DQ_RING) * CONS + WG).store(part * dq_scale)
            fence_async_shared()  # the writer's bulk reductions read the share through the async proxy
            _cta_barrier()  # every thread's share is in shared memory before the writer reads it
            mbarrier.arrive(dq_full.index(t % DQ_RING))
        if HEAD_SCALES or KV_PARTIALS:  # FP32 dK / dV (KV_PARTIALS: this part's of the group, [B, Hkv * KV_SPLIT, ..])
            offs_n = j * BLOCK_N + KV_BOX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
            out = bh.to(gl.int64) * Nk * HEAD_D + offs_n.to(gl.int64)[:, None] * HEAD_D + offs_ad[None, :]
            n_ok = (offs_n < Nk)[:, None]
            gl.store(DK + out, (dk * dk_scale).to(DK.dtype.element_ty), mask=n_ok)
            dv = dv * dv_scale
            gl.store(DV + out, dv.to(DV.dtype.element_ty), mask=n_ok)
        else:
            # through shared memory and TMA stores: the wgmma accumulator layout's 4-byte stores of every program of a
            # wave, which end together, take ~5 us at head dim 128 (docs/tuning.md: dK / dV by TMA stores). V_w is
            # this consumer's alone (dP^T's left operand), free once its last dP^T retired; rows past Nk are clipped
            stage = v_smem.index(WG * PARTS)
            tma_store_rows(dv_desc, off_b, off_h, j * BLOCK_N + WG * HALF, stage, dv.to(dtype))
            _cta_barrier()  # every thread is past the store's read: the stage takes dK
            tma_store_rows(dk_desc, off_b, off_h, j * BLOCK_N + WG * HALF, stage, (dk * dk_scale).to(dtype))

    @gluon.jit
    def _dq_writer(dq_smem, dq_full, dq_empty, dqacc_desc, Sem, H, GROUP, Nq, Nk, ROT, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, CONS: gl.constexpr, WRITER: gl.constexpr,
                   WRITERS: gl.constexpr, DQ_ACCS: gl.constexpr, GQA: gl.constexpr):
        # FlashAttention-3's dQ writer, one of WRITERS one-warp partitions: writer WRITER takes the steps t with
        # t % WRITERS == WRITER (query tile i = _query_tile(t)), so that WRITERS tiles' turn waits, reductions and
        # turn passes are in flight at once. Key tile j adds into the accumulator and at the turn _query_turn(i) says
        # (dqacc_desc: the accumulators as [A * B * H, Nq, HEAD_D], A = DQ_ACCS, twice that with ROT > 0, rows past
        # Nq clipped). Per step: wait for both consumers' column halves (ring slot t % DQ_RING), wait for the turn
        # (every key tile before this one in tile i's order that adds into the accumulator has added: the order, a
        # function of the shape alone, not the timing, fixes every sum), add each half as one TMA bulk reduction
        # issued by one thread, wait for the reductions to complete (their writes, not only
        # their shared-memory reads), free the slot and pass the turn on; the combine kernel writes dQ.
        # Ring slots: the uses of slot s (steps s, s + DQ_RING, ...) fill (dq_full) and free (dq_empty) in strict
        # alternation, so a phase-parity wait on use k is exact as long as use k - 1 has completed its phase when
        # the wait starts (parity cannot tell phase k - 1 from k + 1). A writer reaches step t only after it freed
        # its step t - WRITERS, so the consumers (who fill in step order) have filled every step up to that one;
        # the previous use of step t's slot is step t - DQ_RING, filled by then when DQ_RING >= WRITERS
        # (kernel_constexprs checks it), whichever writer owns it. A consumer's wait for the freeing of use k - 1
        # (before it fills use k) starts after its wait for the freeing of use k - 2, so it is exact too. With GQA
        # the steps run over the group's query heads (_step_head), the writers alternating across the heads' seams
        # as within a head, and each query head's tiles keep their own accumulator rows, counters and chains.
        j, bh, off_b, off_h = _program_tile(Nk, H, GROUP, BLOCK_N, GQA)
        n_m = gl.cdiv(Nq, BLOCK_M)
        n_kt = gl.cdiv(Nk, BLOCK_N)
        n_bh = gl.num_programs(0) // n_kt * GROUP if GQA else gl.num_programs(0) // n_kt  # batch * H query heads
        n_steps = n_m * GROUP if GQA else n_m
        DQC: gl.constexpr = HEAD_D // CONS
        DQ_RING: gl.constexpr = dq_full.shape[0]
        for t in range(WRITER, n_steps, WRITERS):
            tq, q_head, q_bh = _step_head(t, n_m, off_b, off_h, H, GROUP, GQA)
            i = _query_tile(tq, j, n_m, ROT, DQ_ACCS)
            acc_id, turn = _query_turn(i, j, n_m, n_kt, ROT, DQ_ACCS)
            acc_row = acc_id * n_bh + q_bh
            sem = Sem + acc_row * n_m + i  # one counter per (accumulator, batch * head, query tile)
            seen = gl.load(sem, volatile=True)
            slot = t % DQ_RING
            mbarrier.wait(dq_full.index(slot), (t // DQ_RING) & 1)
            seen = gl.inline_asm_elementwise(_SPIN_PTX, "=r,r,l,r", [seen, sem, turn], dtype=gl.int32,
                                             is_pure=False, pack=1)
            seen = gl.inline_asm_elementwise(_ASYNC_FENCE_PTX, "=r,r", [seen], dtype=gl.int32, is_pure=False,
                                             pack=1)
            # the first share of each accumulator tile is stored, the later ones added: the accumulators need no
            # zeroing pass (an accumulator tile with no share keeps its counter at 0, which the combine reads)
            if turn == 0:
                for w in gl.static_range(CONS):
                    tma.async_copy_shared_to_global(dqacc_desc, [acc_row, i * BLOCK_M, w * DQC],
                                                    dq_smem.index(slot * CONS + w).reshape([1, BLOCK_M, DQC]))
            else:
                for w in gl.static_range(CONS):
                    _tma_reduce_add(dqacc_desc, [acc_row, i * BLOCK_M, w * DQC],
                                    dq_smem.index(slot * CONS + w).reshape([1, BLOCK_M, DQC]))
            seen = gl.inline_asm_elementwise(_BULK_DONE_PTX, "=r,r", [seen], dtype=gl.int32, is_pure=False, pack=1)
            # the warp's barrier: every lane is past the completion wait before lane 0's release (a release orders
            # only what the releasing thread observed; the barrier makes the issuing lane's completed reductions
            # precede it)
            _cta_barrier()
            mbarrier.arrive(dq_empty.index(slot))
            gl.atomic_xchg(sem, turn + 1, sem="release")

    # a new length or group size compiles nothing new
    @gluon.jit(do_not_specialize=["GROUP", "KV_SPLIT", "Nq", "Nk", "ROT"])
    def _half_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dqacc_desc, dk_desc, dv_desc, LseRow, Delta, DK, DV, Sem,
                         Scales, H, GROUP, KV_SPLIT, Nq, Nk, ROT, qk_scale, scale, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr,
                         HEAD_D: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, EVEN_N: gl.constexpr,
                         WRITER_REGS: gl.constexpr, DQ_RING: gl.constexpr, DQ_ACCS: gl.constexpr,
                         HEAD_SCALES: gl.constexpr, PARTS: gl.constexpr, PRODUCER_ROWS: gl.constexpr,
                         KV_IN_REGS: gl.constexpr, GQA: gl.constexpr, KV_PARTIALS: gl.constexpr,
                         DSPLIT: gl.constexpr):
        # One (key tile, K / V head, batch) program, 1-D grid cdiv(Nk, BLOCK_N) * Hkv * B. H: query heads; GQA
        # (grouped-query attention): GROUP = H / Hkv query heads per K / V head, query head h reading K / V head
        # h // GROUP, the program sweeping the group's query heads one after another (dK / dV [B, Hkv, Nk, D] add
        # over the group in that fixed order; dQ's turns stay per query head); else GROUP is 1 and Hkv = H.
        # KV_PARTIALS (GQA whose K / V heads' programs would leave SMs idle): each group cut into KV_SPLIT parts of
        # GROUP query heads, a program per (key tile, part) writing its part's FP32 dK / dV into DK / DV [B, Hkv *
        # KV_SPLIT, Nk, D] (register stores), which the host sums over the parts in order; else KV_SPLIT is 1. LseRow,
        # Delta: FP32 [B * H, Nq] from elsa_bwd's preprocess; DK, DV: [B, Hkv, Nk, D] contiguous, input dtype, and
        # dk_desc / dv_desc over them (HALF-row tiles; the HEAD_SCALES builds store with plain stores and do not read
        # them); dqacc_desc: the FP32 dQ accumulators [A * B * H, Nq, D] (A = DQ_ACCS, twice that with ROT > 0:
        # dq_schedule), not zeroed (each tile's first share is stored); Sem: int32 counters (ordered_buffer_sizes),
        # zeroed; ROT: rotation_step's. qk_scale = scale * log2(e). HEAD_SCALES (modes tf32 / fp32): the operands
        # are FP16 copies scaled per head by powers of two, DK / DV FP32, and Scales (FP32 [B * H, SCALES_ROW],
        # _scaled_operands_kernel) holds each head's multipliers, which replace qk_scale and scale; else Scales is
        # not read. PARTS = 2 (mode fp32): the operand copies are [B, H, N, 2 HEAD_D], hi parts then lo parts, each
        # loaded into its own buffer.
        CONS: gl.constexpr = 2
        # K / V boxes per part: one per consumer (its keys), or the whole tile (DSPLIT: each consumer reads every key)
        KV_BOXES: gl.constexpr = 1 if DSPLIT else CONS
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [KV_BOXES * PARTS] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [KV_BOXES * PARTS] + v_desc.block_type.shape, v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + do_desc.block_type.shape, do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # each slot's lse and delta rows (PRODUCER_ROWS), which the consumers read as broadcast vectors
        rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], rows_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], rows_layout)
        # dS^T of both consumers, double-buffered (DSPLIT: each consumer's own dS^T of all the tile's keys, read by
        # its own wgmmas only: one buffer per part)
        DS_ROWS: gl.constexpr = BLOCK_N if DSPLIT else BLOCK_N // CONS
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DS_ROWS, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [(1 if DSPLIT else 2) * CONS * PARTS, DS_ROWS, BLOCK_M], ds_layout)
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # the consumers' FP32 dQ halves for the writers, a ring of DQ_RING query tiles
        dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D // CONS], gl.float32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_RING * CONS, BLOCK_M, HEAD_D // CONS], dq_smem_layout)
        dq_full = gl.allocate_shared_memory(gl.int64, [DQ_RING, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_RING, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for s in gl.static_range(2):
            mbarrier.init(ds_bar.index(s), count=CONS)  # both consumers' dS^T are in
        for s in gl.static_range(DQ_RING):
            mbarrier.init(dq_full.index(s), count=CONS)  # both consumers' dQ halves are in
            mbarrier.init(dq_empty.index(s), count=1)  # the writer is done with the slot
        for s in gl.static_range(STAGES):
            # the TMA loads' expect-arrival (and the producer's after the row data)
            mbarrier.init(ready.index(s), count=2 if PRODUCER_ROWS else 1)
            mbarrier.init(empty.index(s), count=CONS)  # both consumers release a slot
        # two consumer warpgroups, the producer warp and DQ_WRITERS = 2 one-warp dQ writers (sharing the producer's
        # warpgroup); a partition list's tuples stay literal: the Gluon frontend turns the constexpr members of an
        # assigned tuple into tensors
        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready,
                         empty, ds_bar, dq_full, dq_empty, LseRow, Delta, DK, DV, dk_desc, dv_desc, Scales, H,
                         GROUP, Nq, Nk, ROT, qk_scale, scale, 0, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CONS, EVEN_N,
                         HEAD_SCALES, PARTS, PRODUCER_ROWS, KV_IN_REGS, DQ_ACCS, GQA, KV_PARTIALS, DSPLIT)),
            (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, ready,
                         empty, ds_bar, dq_full, dq_empty, LseRow, Delta, DK, DV, dk_desc, dv_desc, Scales, H,
                         GROUP, Nq, Nk, ROT, qk_scale, scale, 1, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CONS, EVEN_N,
                         HEAD_SCALES, PARTS, PRODUCER_ROWS, KV_IN_REGS, DQ_ACCS, GQA, KV_PARTIALS, DSPLIT)),
            (_producer, (q_desc, k_desc, v_desc, do_desc, LseRow, Delta, k_smem, v_smem, q_smem, do_smem,
                         lse_smem, delta_smem, kv_bar, ready, empty, H, GROUP, KV_SPLIT, Nq, Nk, ROT, BLOCK_M,
                         BLOCK_N, STAGES, CONS, HEAD_D, PARTS, PRODUCER_ROWS, DQ_ACCS, GQA, KV_PARTIALS,
                         DSPLIT)),
            (_dq_writer, (dq_smem, dq_full, dq_empty, dqacc_desc, Sem, H, GROUP, Nq, Nk, ROT, BLOCK_M, BLOCK_N,
                          HEAD_D, CONS, 0, 2, DQ_ACCS, GQA)),
            (_dq_writer, (dq_smem, dq_full, dq_empty, dqacc_desc, Sem, H, GROUP, Nq, Nk, ROT, BLOCK_M, BLOCK_N,
                          HEAD_D, CONS, 1, 2, DQ_ACCS, GQA)),
        ], [4, 1, 1, 1], [CONSUMER_REGS, 24, WRITER_REGS, WRITER_REGS])


def _descriptors(cfg: dict, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    # (block, dtype) of each descriptor argument, in the kernel's order: a Q / dO tile and one consumer's half of the
    # K / V tile (the whole tile with the config's dsplit) in the input dtype, one consumer's FP32 column half of a
    # query tile's dQ share (the accumulators, [accumulators * B * H, Nq, D]), one consumer's rows of dK and dV
    kv_rows = cfg["BLOCK_N"] if cfg.get("dsplit") else cfg["BLOCK_N"] // CONSUMERS
    rows = {"q_desc": cfg["BLOCK_M"], "k_desc": kv_rows, "v_desc": kv_rows, "do_desc": cfg["BLOCK_M"]}
    return {**{name: ((1, 1, n, head_dim), dtype) for name, n in rows.items()},
            "dqacc_desc": ((1, cfg["BLOCK_M"], head_dim // CONSUMERS), torch.float32),
            "dk_desc": ((1, 1, cfg["BLOCK_N"] // CONSUMERS, head_dim), dtype),
            "dv_desc": ((1, 1, cfg["BLOCK_N"] // CONSUMERS, head_dim), dtype)}


def descriptor_types(cfg: dict, head_dim: int, dtype: torch.dtype = torch.float16) -> dict[str, str]:
    """Signature types of the seven descriptor arguments (``q_desc`` ... ``dv_desc``) for an offline compile."""
    tnames = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    return {name: f"tensordesc<{tnames[dt]}[{','.join(map(str, block))}],{nvmma_layout(block, dt)!r}>"
            for name, (block, dt) in _descriptors(cfg, head_dim, dtype).items()}


@triton.jit
def _dq_combine_kernel(ACC, DQ, Sem, n, Nq, n_m, n_bh, H, sdb, sdh, sdm, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       ACCS: tl.constexpr, BLOCK: tl.constexpr):
    # dQ = ((acc_0 + acc_1) + acc_2) + ... in the input dtype: a fixed order, so the sum is reproducible. An
    # accumulator's query tile whose turn counter (Sem: int32 [ACCS, n_bh, n_m]) is 0 took no share and was never
    # written (the kernel stores each tile's first share instead of zeroing): it counts as 0, unread. DQ [B, H, Nq,
    # HEAD_D] at strides (sdb, sdh, sdm, 1): contiguous, or e.g. a slice of a packed [B, Nq, 3, H, D] gradient
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    row = offs // HEAD_D
    bh = row // Nq
    m = row - bh * Nq
    tile = bh * n_m + m // BLOCK_M
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for a in tl.static_range(ACCS):
        took = tl.load(Sem + (a * n_bh * n_m + tile), mask=ok, other=0) > 0
        total += tl.load(ACC + (offs + a * n.to(tl.int64)), mask=took, other=0.0)
    out = (bh // H) * sdb + (bh % H) * sdh + m * sdm + (offs - row * HEAD_D)
    tl.store(DQ + out, total.to(DQ.dtype.element_ty), mask=ok)


COMBINE_BLOCK = 1024


def _combine_call(n: int, head_dim: int, block_m: int, accs: int) -> KernelCall:
    # the combine kernel's launch over n elements of dQ (a plan keeps it: KernelCall's direct launch after the first)
    return KernelCall(_dq_combine_kernel, (cdiv(n, COMBINE_BLOCK),),
                      dict(HEAD_D=head_dim, BLOCK_M=block_m, ACCS=accs, BLOCK=COMBINE_BLOCK), dict(num_warps=4))


def combine_accumulators(acc: torch.Tensor, dq: torch.Tensor, sem: torch.Tensor, accs: int, block_m: int) -> None:
    """``dq`` ([B, H, Nq, D] at any strides with a unit last one, its dtype) = the sum of the ``accs`` FP32
    accumulators ``acc`` [accs * dq.numel()] (contiguous [B, H, Nq, D] each), added in index order, each query tile
    of ``block_m`` rows of an accumulator only where its int32 turn counter ``sem`` [accs, B * H, cdiv(Nq, block_m)]
    is positive (a tile that took no share is not read and counts as 0)."""
    B, H, Nq, D = dq.shape
    _combine_call(dq.numel(), D, block_m, accs)(acc, dq, sem, dq.numel(), Nq, cdiv(Nq, block_m), B * H, H,
                                                *dq.stride()[:3])


def _preprocess(q, out, grad_out, lse, k=None, v=None, head_max=None, scratch=(0, 0)):
    """``(delta, lse_row, counters, accumulators)`` of one call by :mod:`.elsa_bwd`'s preprocess kernel (its launch
    as the backward plans make it): delta and the row lse FP32 [B * H * Nq] and, from a launch's ``scratch`` (its
    ``(counters, accumulators)`` sizes), its zeroed int32 dQ counters and uninitialised FP32 dQ accumulators, all in
    one :class:`.elsa_bwd.Scratch` allocation; with ``head_max`` (int32 [B * H, 4], zeroed) also the heads' largest
    magnitudes of q, k, v, dO into it (with grouped-query K / V heads, each query head's row holding its K / V
    head's, by :func:`.elsa_bwd._gqa_kv_max`, as the backward plans do)."""
    B, H, Nq, D = q.shape
    Dv = out.shape[3]
    layout = elsa_bwd.Scratch(B * H * Nq, *scratch)
    delta, lse_row, counters, accumulators = layout.allocate(q.device)
    call = elsa_bwd._preprocess_call(B, H, Nq, *head_blocks(D, Dv), head_max=head_max is not None,
                                     n_zero=layout.counters)
    keys = 0 if head_max is None else k.shape[2]
    if head_max is None:  # HEAD_MAX off: K / V, E and their strides are not read (q stands in; 0 keys)
        k = v = q
        head_max = delta
    elif k.shape[1] != H:  # the K / V maxima per K / V head, not in the kernel (it reads K / V head h)
        elsa_bwd._gqa_kv_max(head_max, k, v, B, k.shape[1], H // k.shape[1])
        keys = 0
    call(q, out, grad_out, lse, delta, lse_row, *out.stride(), *grad_out.stride(), *lse.stride(), H, Nq, Dv,
         k, v, head_max, *q.stride(), *k.stride(), *v.stride(), keys, D, counters, layout.counters)
    return delta, lse_row, counters, accumulators


def half_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                  lse: torch.Tensor, scale: float, *, config: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``out = softmax(scale q k^T) v`` with FP16 / BF16 tensor-core products on Hopper, Gluon kernel
    (FlashAttention-3's backward schedule: Shah et al. 2024, arXiv:2407.08608, App. B.1).

    Args:
        q: [B, H, Nq, D] float16 or bfloat16 CUDA (compute capability 9.x); k, v: [B, Hkv, Nk, D], same dtype
            (Nq != Nk allowed; Hkv dividing H: grouped-query attention); D in :data:`HEAD_DIMS`; TMA-legal strides
            (see :func:`unsupported_reason`).
        out: the forward output [B, H, Nq, D], any float dtype and strides.
        grad_out: dL/d out [B, H, Nq, D], any float dtype (rounded to q's dtype, as the Triton backward reads it)
            and strides (copied when not TMA-legal).
        lse: float32 [B, H, Nq], any strides: the natural-log log-sum-exp of each row's scaled logits
            ``lse_i = log sum_j exp(scale q_i . k_j)`` (``-inf`` rows get zero gradients).
        scale: the logit scale, > 0.
        config: a :func:`get_config` dict to run instead of the head dim's (tools, tests).

    Returns:
        ``(dq, dk, dv)``: dq like q, dk / dv [B, Hkv, Nk, D], contiguous, in q's dtype, FP32 accumulation, as
        :func:`.elsa_backward` returns them for mode ``fp16`` / ``bf16``; dq is bit-for-bit reproducible (ordered
        adds), dk / dv are too (fixed order per program, over the group's query heads in index order). Nq == 0,
        Nk == 0 or B * H == 0 give zeros without a launch.

    Raises:
        ValueError: a call :func:`unsupported_reason` refuses (the message names the cause).
        TypeError: ``lse`` is not float32.
    """
    empty = _checked_call("half_backward", unsupported_reason(q, k, v, grad_out, None, None, False, scale),
                          "kernels.elsa_bwd.elsa_backward", q, k, lse)
    if empty is not None:
        return empty
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    launch = planned_launch(q, k, v, grad_out, config)
    # the kernel rounds dO to q's dtype as it reads it
    delta, lse_row, counters, accumulators = _preprocess(q, out, grad_out, lse, scratch=launch.scratch)
    dk = torch.empty((B, k.shape[1], Nk, D), device=q.device, dtype=q.dtype)
    dv = torch.empty_like(dk)
    dq = launch(q, k, v, grad_out, delta, lse_row, dk, dv, scale, accumulators, counters)
    return dq, dk, dv


def _checked_call(name: str, reason: str | None, instead: str, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor):
    # the checks of a public entry (half_backward, tf32_backward): raise ValueError for a call its scope refuses
    # (``reason``; the message points at ``instead``) and TypeError for a non-float32 lse; for a call with nothing to
    # compute (Nq, Nk or B * H zero) the zero gradients (dq like q, dk / dv [B, Hkv, Nk, D]), else None
    if reason is not None:
        raise ValueError(f"{name}: {reason}; use {instead}")
    if lse.dtype != torch.float32:
        raise TypeError(f"{name}: lse must be float32, got {lse.dtype}")
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if B * H == 0 or Nq == 0 or Nk == 0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format), *(
            torch.zeros((B, k.shape[1], Nk, D), device=q.device, dtype=q.dtype) for _ in range(2))
    return None


def tma_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous copy of ``t`` in ``dtype``, which a TMA descriptor takes: always a copy, since a
    contiguous tensor of the right dtype at an address that is not 16-byte aligned (a view at an offset) would
    otherwise come back as itself."""
    return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def grads_tma_legal(dk: torch.Tensor, dv: torch.Tensor) -> bool:
    """Whether the kernel can write dK / dV of these layouts by TMA stores (16-byte aligned bases and strides, unit
    last stride), e.g. the K and V slices of a packed [B, N, 3, H, D] gradient at head dim 64 / 128."""
    return all(t.stride(3) == 1 and strides_aligned(t, 8) for t in (dk, dv))


def planned_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                   config: dict | None = None):
    """The kernel's launch for this call signature (shapes, strides, dtypes), as a callable
    ``(q, k, v, grad_out, delta, lse_row, dk, dv, scale, accumulators, counters) -> dq`` for any later call with the
    same signature, without checks: for a caller that ran :func:`unsupported_reason` (the backward plans of
    :mod:`.elsa_bwd`). ``delta``, ``lse_row``: FP32 [B * H * Nq] from :mod:`.elsa_bwd`'s preprocess kernel; ``dk``,
    ``dv``: [B, Hkv, Nk, D] contiguous, q's dtype, written; ``grad_out`` is rounded to q's dtype and copied contiguous
    where its dtype or strides are not the kernel's; ``accumulators`` (FP32, any contents: each tile's first share
    is stored) and ``counters`` (int32, zeroed) flat, 16-byte aligned, of the sizes in the callable's ``scratch``
    attribute ``(counters, accumulators)`` (:func:`dq_schedule`), e.g. from the preprocess's
    :class:`.elsa_bwd.Scratch`. Returns dQ [B, H, Nq, D] contiguous in q's dtype, or the call's ``dq`` (any strides
    with a unit last one: e.g. a slice of a packed [B, Nq, 3, H, D] gradient) written; ``dk`` / ``dv`` may be such
    slices too where their strides are TMA-legal (:func:`grads_tma_legal`), fixed by the first call. ``config``: a
    :func:`get_config` dict (tools, tests). The first call builds (and validates)
    the seven TMA descriptors; later calls encode them onto their tensors through
    :meth:`.KernelCall.with_descriptors` where the Triton release allows it (the signature fixes every shape and
    stride), skipping the descriptor objects' construction (tens of microseconds of host time per call)."""
    B, H, Nq, D = q.shape
    h_kv, cfg = k.shape[1], config or get_config(D)
    parts = kv_split(B, h_kv, H // h_kv, k.shape[2], cfg, sm_count(q.device)) if h_kv != H else 1
    run = _kernel_plan(B, H, Nq, k.shape[2], D, q.dtype, q.dtype, cfg, head_scales=False, h_kv=h_kv, kv_split=parts)
    copy_grad = grad_out.dtype != q.dtype or not strides_aligned(grad_out, 8)

    def launch(q, k, v, grad_out, delta, lse_row, dk, dv, scale, accumulators, counters, dq=None):
        if copy_grad:
            grad_out = tma_copy(grad_out, q.dtype)
        return run(q, k, v, grad_out, delta, lse_row, dk, dv, scale, delta, accumulators, counters, dq)

    launch.scratch = run.scratch
    return launch


def _kernel_plan(B: int, H: int, Nq: int, Nk: int, D: int, dtype: torch.dtype, dq_dtype: torch.dtype,
                 config: dict | None, head_scales: bool, split: bool = False, h_kv: int | None = None,
                 kv_split: int = 1):
    # the launches of one signature (operands [B, H, N, D] of ``dtype`` at TMA-legal strides, which the first call
    # fixes): a callable (q, k, v, grad_out, delta, lse_row, dk, dv, scale, scales, accumulators, counters) -> dq
    # [B, H, Nq, D] contiguous in dq_dtype; ``scales``: the Scales rows with head_scales, else not read (any tensor);
    # ``split``: the operands are [B, H, N, 2 D] hi / lo parts (PARTS = 2); its ``scratch``: the sizes (counters,
    # accumulators) of the caller's zeroed counters and accumulators (none where dQ, FP32, is the one accumulator:
    # the run allocates it as dQ); ``h_kv``: K / V heads (grouped-query attention, dk / dv [B, h_kv, Nk, D]), H if None;
    # ``kv_split``: parts of each group (kv_split), whose FP32 dK / dV partials [B, h_kv * kv_split, Nk, D] the run
    # allocates and sums in part order
    h_kv = h_kv or H
    cfg = dict(config or get_config(D))
    chains, rot, accs = dq_schedule(Nq, Nk, cfg)
    cfg["dq_accumulators"] = chains
    call = KernelCall(_half_bwd_kernel, (grid_size(B, h_kv * kv_split, Nk, cfg),),
                      kernel_constexprs(cfg, D, Nk, head_scales, split, gqa=h_kv != H, kv_partials=kv_split > 1),
                      dict(num_warps=4, maxnreg=cfg["maxnreg"]))
    n_acc, n_sem = ordered_buffer_sizes(B, H, Nq, D, dict(cfg, dq_accumulators=accs))
    specs = _descriptors(cfg, D, dtype).values()
    blocks = [list(block) for block, _ in specs]
    layouts = [nvmma_layout(block, dt) for block, dt in specs]
    # one FP32 accumulator for an FP32 dQ is dQ itself: no combine
    combine = (None if accs == 1 and dq_dtype == torch.float32
               else _combine_call(B * H * Nq * D, D, cfg["BLOCK_M"], accs))
    direct = []  # the descriptor-encoding launch, once the first call has compiled the kernel

    def run(q, k, v, grad_out, delta, lse_row, dk, dv, scale, scales, acc, sem, dq=None):
        if combine is None:  # dQ is the accumulator (its tiles' first shares stored: not zeroed)
            acc = dq = torch.empty((B, H, Nq, D), device=q.device, dtype=torch.float32)
        elif dq is None:
            dq = torch.empty((B, H, Nq, D), device=q.device, dtype=dq_dtype)
        dk_out, dv_out = dk, dv
        if kv_split > 1:  # each part's FP32 dK / dV, summed below
            dk, dv = (torch.empty((B, h_kv * kv_split, Nk, D), device=q.device, dtype=torch.float32) for _ in "kv")
        args = (lse_row, delta, dk, dv, sem, scales, H, H // h_kv // kv_split, kv_split, Nq, Nk, rot,
                float(scale) * LOG2E, float(scale))
        # dK / dV's descriptors (the HEAD_SCALES and KV_PARTIALS builds store their FP32 dK / dV with plain stores
        # and never read them: q's tiles stand in)
        stores = (q, q) if head_scales or kv_split > 1 else (dk, dv)
        if direct and direct[0] is not None:  # the descriptors read only the bases' addresses
            direct[0](q, k, v, grad_out, acc, *stores, *args)
        else:
            bases = (q, k, v, grad_out, acc.view(accs * B * H, Nq, D), *stores)
            descs = [TensorDescriptor.from_tensor(t, block, layout) for t, block, layout in zip(bases, blocks, layouts)]
            call(*descs, *args)
            if not direct and call.slow_reason is None:
                for d in descs:  # the plan keeps no tensor of this call alive
                    d.base = None
                direct.append(call.with_descriptors(descs))
        if combine is not None:
            combine(acc, dq, sem, dq.numel(), Nq, cdiv(Nq, cfg["BLOCK_M"]), B * H, H, *dq.stride()[:3])
        if kv_split > 1:  # the parts' FP32 sum (a reduction of fixed order), then the gradients' dtype (one rounding)
            for part, out in ((dk, dk_out), (dv, dv_out)):
                out.copy_(part.view(B, h_kv, kv_split, Nk, D).sum(dim=2))
        return dq

    run.scratch = (n_sem, 0 if combine is None else n_acc)
    return run


# ---- mode tf32 on the same kernel: FP32 inputs as FP16 operands scaled per head by powers of two ----

# mode tf32's backward plans take this kernel (tf32_preferred) from TF32_MIN_QUERIES query rows when its grid fills
# the GPU TF32_MIN_WAVES times over or the sequences are long (TF32_LONG keys and query rows at head dim 64,
# TF32_LONG_D128 at 128): against the Triton f16x1 kernels (FP16 products of split-FP16 hi parts at 60-130 TFLOP/s)
# it measured 1.06-5.6x faster there (ViT-B/16 224 bs64 1.10x, B=8 H=12 N=1025 1.79x, B=1 H=8 N=4096 fwd+bwd 1.7x,
# head dim 128 4.2-5.6x) and 0.74-0.93x with fewer programs at head dim 64 (B=1 H=16 N=1536 / 2048)
# (docs/tuning.md: tf32 on the Gluon backward)
TF32_MIN_WAVES = 3
TF32_MIN_QUERIES = 128
TF32_LONG = 4096
TF32_LONG_D128 = 1024


def tf32_preferred(B: int, H: int, n_q: int, n_k: int, head_dim: int, sms: int) -> bool:
    """Whether :mod:`.elsa_bwd`'s backward plans run an in-scope tf32 call here rather than on the Triton kernels:
    from :data:`TF32_MIN_QUERIES` query rows (few rows against many keys would serialise each query tile's chain of
    ordered dQ turns), when the grid (one program per 128 keys and head) fills ``sms`` multiprocessors
    :data:`TF32_MIN_WAVES` times or both lengths reach :data:`TF32_LONG` (:data:`TF32_LONG_D128` at head dim 128,
    where the Triton kernels are slowest)."""
    return _scaled_preferred(B, H, n_q, n_k, sms, TF32_MIN_WAVES, TF32_LONG_D128 if head_dim == 128 else TF32_LONG)


def _scaled_preferred(B: int, H: int, n_q: int, n_k: int, sms: int, waves: int, long: int) -> bool:
    # the HEAD_SCALES builds' rule: from TF32_MIN_QUERIES query rows, a grid of `waves` times `sms` programs or both
    # lengths from `long`
    return n_q >= TF32_MIN_QUERIES and (grid_size(B, H, n_k, get_config(64)) >= waves * sms
                                        or min(n_q, n_k) >= long)


# mode fp32's backward plans take the split build (fp32_preferred) from TF32_MIN_QUERIES query rows; at head dim 64
# when its grid fills the GPU FP32_MIN_WAVES times over or both lengths reach FP32_LONG: against the Triton
# f16x3-head kernels (at 28-76 TFLOP/s) it measured 1.1-2.1x faster there (B=16 H=12 N=197 1.10x, B=1 H=12 N=1025
# 1.13x, B=1 H=16 N=1536 2.07x) and 0.78-0.91x below (B=8 H=12 N=197, B=2 H=12 N=577: 192 / 120 programs of few
# query tiles); at head dim 128, where the Triton kernels run at 30-35 TFLOP/s, 1.35-3.2x faster at every grid
# measured, one head of 256 tokens included (docs/tuning.md: fp32 on the Gluon backward)
FP32_MIN_WAVES = 2
FP32_LONG = 1024


def fp32_preferred(B: int, H: int, n_q: int, n_k: int, head_dim: int, sms: int) -> bool:
    """:func:`tf32_preferred` for mode fp32's split build (head dims 64 and 128; the caller checks them): from
    :data:`TF32_MIN_QUERIES` query rows, at head dim 64 when the grid fills ``sms`` multiprocessors
    :data:`FP32_MIN_WAVES` times or both lengths reach :data:`FP32_LONG` (the Triton f16x3 kernels it replaces are
    slower than tf32's f16x1, so the break-even comes earlier), at head dim 128 at any grid."""
    if head_dim == 128:
        return n_q >= TF32_MIN_QUERIES
    return _scaled_preferred(B, H, n_q, n_k, sms, FP32_MIN_WAVES, FP32_LONG)


def tf32_config(head_dim: int) -> dict:
    """:func:`get_config` for mode tf32: one dQ accumulator, which is then the FP32 dQ itself (no combine, no second
    FP32 buffer: the peak memory of a tf32 backward stays at SDPA-efficient's or below; docs/tuning.md)."""
    return dict(get_config(head_dim), dq_accumulators=1, rotate=False)


def tf32_unsupported_reason(q, k, v, grad_out, bias, attn_mask, is_causal: bool, scale: float) -> str | None:
    """Why :func:`tf32_backward` cannot run this call (:mod:`.elsa_bwd`'s Triton kernels then do), or ``None``:
    as :func:`unsupported_reason`, for float32 q / k / v at any strides with a unit head-dim stride (the kernel reads
    FP16 copies: :func:`._gluon.hopper_copies_scope_reason`)."""
    if not grad_out.dtype.is_floating_point or tuple(grad_out.shape) != (*q.shape[:3], v.shape[-1]):
        return f"grad_out {tuple(grad_out.shape)} {grad_out.dtype} does not match the output"
    return hopper_copies_scope_reason(q, k, v, bias, attn_mask, is_causal, scale, 1, head_dims=HEAD_DIMS,
                                      import_error=_IMPORT_ERROR, grouped=True)


@triton.jit(do_not_specialize=["H", "Nq", "Nk", "n_rows"])
def _scaled_operands_kernel(Q, K, V, DO, E, Q16, K16, V16, DO16, Scales,
                            sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                            H, GROUP, Nq, Nk, n_rows, qk_scale, scale, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                            TQ: tl.constexpr, TK: tl.constexpr, TV: tl.constexpr, TDO: tl.constexpr,
                            LIMIT: tl.constexpr, ROW: tl.constexpr, PARTS: tl.constexpr, P_EXP: tl.constexpr):
    """The FP16 operands of the Gluon backward's HEAD_SCALES builds: head ``bh``'s q, k, v, dO times ``2^s_q``,
    ``2^s_k``, ``2^s_v``, ``2^s_do`` (:func:`.scaled_fp16.head_shift` of their largest magnitudes, whose FP32 bit
    patterns E [B * H, 4] holds, from :mod:`.elsa_bwd`'s preprocess), rounded to FP16 (``PARTS = 2``: split into hi
    and lo parts, mode fp32) into contiguous [B, H, N, PARTS * HEAD_D] copies; the first program of each head writes its
    row of Scales (FP32 [B * H, ROW]): ``qk_scale 2^-(s_q + s_k)`` (the logits' log2-domain multiplier),
    ``2^(s_v + s_do)`` (delta's), ``scale 2^-(s_v + s_do + s_k)`` (dQ's), ``scale 2^-(s_v + s_do + s_q)`` (dK's),
    ``2^-(s_do + P_EXP)`` (dV's: P^T enters dV scaled by ``2^P_EXP``). 1-D grid cdiv(n_rows, BLOCK_M) * H * B,
    n_rows = max(Nq, Nk). Grouped-query attention: k / v have H / GROUP heads, K / V head ``h // GROUP`` copied into
    [B, H / GROUP, Nk, PARTS * HEAD_D] by the programs of its first query head (every query head's row of E holds its
    K / V head's magnitudes: :func:`.elsa_bwd._gqa_kv_max`)."""
    t, off_b, off_h, bh = elsa_bwd._tile_and_head(n_rows, BLOCK_M, H)
    e = E + bh * 4
    s_q = head_shift(tl.load(e), TQ, LIMIT)
    s_k = head_shift(tl.load(e + 1), TK, LIMIT)
    s_v = head_shift(tl.load(e + 2), TV, LIMIT)
    s_do = head_shift(tl.load(e + 3), TDO, LIMIT)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    W: tl.constexpr = PARTS * HEAD_D
    if t * BLOCK_M < Nq:
        scaled_rows(Q + off_b * sqb + off_h * sqh, sqm, sqd, Q16 + bh * Nq * W, rows, Nq, offs_d, pow2(s_q), HEAD_D,
                     PARTS)
        scaled_rows(DO + off_b * sdb + off_h * sdh, sdm, sdd, DO16 + bh * Nq * W, rows, Nq, offs_d, pow2(s_do),
                     HEAD_D, PARTS)
    if (t * BLOCK_M < Nk) & (off_h % GROUP == 0):
        h_kv = off_h // GROUP
        bh_kv = off_b * (H // GROUP) + h_kv
        scaled_rows(K + off_b * skb + h_kv * skh, skn, skd, K16 + bh_kv * Nk * W, rows, Nk, offs_d, pow2(s_k),
                    HEAD_D, PARTS)
        scaled_rows(V + off_b * svb + h_kv * svh, svn, svd, V16 + bh_kv * Nk * W, rows, Nk, offs_d, pow2(s_v),
                    HEAD_D, PARTS)
    if t == 0:
        # each multiplier as a product of powers in range (their sum of shifts may not be): it rounds only where
        # the gradient itself falls below FP32's normal range
        inv_vdo = pow2(-s_v) * pow2(-s_do)
        row = Scales + bh * ROW
        tl.store(row, qk_scale * pow2(-s_q) * pow2(-s_k))
        tl.store(row + 1, pow2(s_v) * pow2(s_do))
        tl.store(row + 2, scale * inv_vdo * pow2(-s_k))
        tl.store(row + 3, scale * inv_vdo * pow2(-s_q))
        tl.store(row + 4, pow2(-s_do - P_EXP))  # within range: shifts are capped at LIMIT < 126 - P_EXP


SCALED_OPERANDS_BLOCK = 64


def _scaled_operands_call(B: int, H: int, Nq: int, Nk: int, D: int, split: bool) -> KernelCall:
    # the launch of _scaled_operands_kernel for one signature
    return KernelCall(_scaled_operands_kernel, (cdiv(max(Nq, Nk), SCALED_OPERANDS_BLOCK) * B * H,),
                      dict(HEAD_D=D, BLOCK_M=SCALED_OPERANDS_BLOCK, TQ=TF32_SCALE_EXPONENTS[0],
                           TK=TF32_SCALE_EXPONENTS[1], TV=TF32_SCALE_EXPONENTS[2], TDO=TF32_SCALE_EXPONENTS[3],
                           LIMIT=TF32_SHIFT_LIMIT, ROW=SCALES_ROW.value, PARTS=2 if split else 1,
                           P_EXP=P_SPLIT_EXP if split else 0), dict(num_warps=4))


def scaled_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                    head_max: torch.Tensor, scale: float, split: bool = False, _call: KernelCall | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q16, k16, v16, do16, scales)``: the operands of the Gluon backward's HEAD_SCALES builds (mode tf32, and
    mode fp32 with ``split``), by :func:`_scaled_operands_kernel` (runs under ``TRITON_INTERPRET=1`` too).

    Args:
        q: float32 [B, H, Nq, D], any strides; k, v: [B, Hkv, Nk, D], Hkv dividing H (grouped-query attention);
            grad_out: [B, H, Nq, D], any float dtype.
        head_max: int32 [B * H, 4], the FP32 bit patterns of each query head's largest magnitude of q, its K / V
            head's k and v, and dO (as :func:`.elsa_bwd._bwd_preprocess_kernel` finds them with ``HEAD_MAX``, the
            K / V columns from :func:`.elsa_bwd._gqa_kv_max` with grouped heads).
        scale: the logit scale.
        split: hi and lo FP16 parts of each scaled operand (22 significant bits, as 3xTF32 keeps), for fp32.
        _call: the operand kernel's kept launch for this signature (a plan's; else one is made).

    Returns:
        contiguous float16 copies of q, k, v, dO, each head times a power of two (its largest magnitude in
        ``[2^(e - 1), 2^e)``, e from :data:`TF32_SCALE_EXPONENTS`; an all-zero or non-finite head unscaled; shifts
        within :data:`TF32_SHIFT_LIMIT`), [B, H or Hkv, N, D], or with ``split`` [B, H or Hkv, N, 2 D] (hi parts in
        the first D columns, lo parts in the last), and the FP32 [B * H, 8] multipliers of each query head the
        kernel's HEAD_SCALES build reads.
    """
    B, H, Nq, D = q.shape
    h_kv, Nk = k.shape[1], k.shape[2]
    W = 2 * D if split else D
    nq, nk = B * H * Nq * W, B * h_kv * Nk * W
    ops = torch.empty(2 * (nq + nk), device=q.device, dtype=torch.float16)
    q16, do16 = ops[:nq].view(B, H, Nq, W), ops[nq:2 * nq].view(B, H, Nq, W)
    k16, v16 = ops[2 * nq:2 * nq + nk].view(B, h_kv, Nk, W), ops[2 * nq + nk:].view(B, h_kv, Nk, W)
    scales = torch.empty((B * H, SCALES_ROW.value), device=q.device, dtype=torch.float32)
    call = _call or _scaled_operands_call(B, H, Nq, Nk, D, split)
    call(q, k, v, grad_out, head_max, q16, k16, v16, do16, scales, *q.stride(), *k.stride(), *v.stride(),
         *grad_out.stride(), H, H // h_kv, Nq, Nk, max(Nq, Nk), float(scale) * LOG2E, float(scale))
    return q16, k16, v16, do16, scales


def _scaled_planned_launch(q, k, v, grad_out, config, split: bool):
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg = config or (fp32_config(D) if split else tf32_config(D))
    h_kv = k.shape[1]
    parts = kv_split(B, h_kv, H // h_kv, Nk, cfg, sm_count(q.device)) if h_kv != H else 1
    run = _kernel_plan(B, H, Nq, Nk, D, torch.float16, torch.float32, cfg, head_scales=True, split=split, h_kv=h_kv,
                       kv_split=parts)
    operands = _scaled_operands_call(B, H, Nq, Nk, D, split)

    def launch(q, k, v, grad_out, delta, lse_row, head_max, dk, dv, scale, accumulators, counters):
        q16, k16, v16, do16, scales = scaled_operands(q, k, v, grad_out, head_max, scale, split, operands)
        return run(q16, k16, v16, do16, delta, lse_row, dk, dv, scale, scales, accumulators, counters)

    launch.scratch = run.scratch
    return launch


def tf32_planned_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                        config: dict | None = None):
    """As :func:`planned_launch`, for mode tf32 (float32 q / k / v, any strides): a callable ``(q, k, v, grad_out,
    delta, lse_row, head_max, dk, dv, scale, accumulators, counters) -> dq`` (its ``scratch`` as there) that makes
    the scaled FP16 operands (:func:`scaled_operands`, from ``head_max``, the preprocess's int32 [B * H, 4]) and runs
    the HEAD_SCALES build; ``dk``, ``dv``: float32 [B, H, Nk, D] contiguous, written; dQ float32 [B, H, Nq, D]
    contiguous."""
    return _scaled_planned_launch(q, k, v, grad_out, config, split=False)


def fp32_planned_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                        config: dict | None = None):
    """:func:`tf32_planned_launch` for mode fp32: split-FP16 operands and products (``PARTS = 2``), head dims 64 and
    128 (:func:`fp32_config`)."""
    return _scaled_planned_launch(q, k, v, grad_out, config, split=True)


def _scaled_backward(name: str, q, k, v, out, grad_out, lse, scale, config, split: bool):
    reason = (fp32_unsupported_reason if split else tf32_unsupported_reason)(q, k, v, grad_out, None, None, False,
                                                                             scale)
    mode = "fp32" if split else "tf32"
    empty = _checked_call(name, reason, f"kernels.elsa_bwd.elsa_backward(mode='{mode}')", q, k, lse)
    if empty is not None:
        return empty
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    head_max = torch.zeros((B * H, 4), device=q.device, dtype=torch.int32)
    launch = _scaled_planned_launch(q, k, v, grad_out, config, split)
    delta, lse_row, counters, accumulators = _preprocess(q, out, grad_out, lse, k, v, head_max, launch.scratch)
    dk = torch.empty((B, k.shape[1], Nk, D), device=q.device, dtype=torch.float32)
    dv = torch.empty_like(dk)
    return launch(q, k, v, grad_out, delta, lse_row, head_max, dk, dv, scale, accumulators, counters), dk, dv


def tf32_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                  lse: torch.Tensor, scale: float, *, config: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``out = softmax(scale q k^T) v`` for mode ``tf32`` on the Gluon kernel of :func:`half_backward`:
    q, k, v, dO are scaled per (batch, head) by powers of two (:data:`TF32_SCALE_EXPONENTS`: range, not rounding, is
    what FP16 lacks against TF32; both keep 11 significant bits) and rounded to FP16; the kernel multiplies its
    logits, delta and FP32 gradients by the heads' inverse scales (exact: powers of two).

    Args:
        q: [B, H, Nq, D] float32 CUDA (compute capability 9.x), any strides; k, v: [B, Hkv, Nk, D] float32, Hkv
            dividing H (grouped-query attention: dk, dv [B, Hkv, Nk, D]); D in
            :data:`HEAD_DIMS`.
        out: the forward output [B, H, Nq, D]; grad_out: dL/d out, same shape, any float dtype and strides.
        lse: float32 [B, H, Nq], the natural-log log-sum-exp of each row's scaled logits.
        scale: the logit scale, > 0.
        config: a :func:`get_config` dict to run instead of :func:`tf32_config`'s (tools, tests).

    Returns:
        ``(dq, dk, dv)``: float32, contiguous, within mode tf32's contract; bit-for-bit reproducible (ordered dQ
        adds). Heads whose largest magnitude lies outside ``2^-54 .. 2^54`` or so lose precision (the shifts are
        capped at :data:`TF32_SHIFT_LIMIT`). Nq == 0, Nk == 0 or B * H == 0 give zeros without a launch.

    Raises:
        ValueError: a call :func:`tf32_unsupported_reason` refuses (the message names the cause).
        TypeError: ``lse`` is not float32.
    """
    return _scaled_backward("tf32_backward", q, k, v, out, grad_out, lse, scale, config, split=False)


# ---- mode fp32 on the same kernel: split-FP16 operands and products (PARTS = 2) ----

FP32_HEAD_DIMS = (64, 128)


def fp32_config(head_dim: int) -> dict:
    """:func:`get_config` for mode fp32 (split-FP16). Head dim 64: one dQ accumulator (the FP32 dQ itself) and a dQ
    hand-off ring of two query tiles, since the hi and lo parts of K, V, the Q / dO ring and dS^T fill the rest of
    shared memory; the consumers load their own row data and read K / V from shared memory (the options measured for
    the half builds only). Head dim 128 (``dsplit``): programs of 64 keys whose two consumers split the head dim
    (each forms S^T and dP^T over all the keys and owns half of dK's, dV's and dQ's columns: its accumulators are
    those of head dim 64), 32-row query tiles in three stages (the hi and lo parts of a 128-key tile and 64-row
    query tiles would need 256 KB of shared memory), the producer's row data and rotated sweeps (two FP32 dQ
    accumulators and the combine: a chain has twice the key tiles of head dim 64's; 2-18 % faster from 1024
    tokens), the dQ writers at 24 registers and the second consumer at 232, which leaves the first (the partition
    that holds the kernel's prologue values) 248 (its 64-bit shared-memory descriptors spill at 232 or 240: 4-6 %
    faster; docs/tuning.md: fp32 on the Gluon backward at head dim 128)."""
    if head_dim not in FP32_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim}; the split-FP16 Gluon backward takes {FP32_HEAD_DIMS}")
    cfg = dict(get_config(head_dim), dq_accumulators=1, rotate=False, dq_ring=2, producer_rows=False,
               kv_in_registers=False)
    if head_dim == 128:
        cfg.update(BLOCK_M=32, BLOCK_N=64, STAGES=3, dsplit=True, producer_rows=True, rotate=True, writer_regs=24,
                   consumer_regs=232)
    return cfg


def fp32_unsupported_reason(q, k, v, grad_out, bias, attn_mask, is_causal: bool, scale: float) -> str | None:
    """Why :func:`fp32_backward` cannot run this call, or ``None``: as :func:`tf32_unsupported_reason`, at head dims
    :data:`FP32_HEAD_DIMS` (64, 128)."""
    if q.shape[-1] not in FP32_HEAD_DIMS or v.shape[-1] not in FP32_HEAD_DIMS:
        return f"head dims ({q.shape[-1]}, {v.shape[-1]}); the split-FP16 Gluon backward takes {FP32_HEAD_DIMS}"
    return tf32_unsupported_reason(q, k, v, grad_out, bias, attn_mask, is_causal, scale)


def fp32_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                  lse: torch.Tensor, scale: float, *, config: dict | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tf32_backward` for mode ``fp32``: the operands scaled per head as there, each split into hi and lo
    FP16 parts (22 significant bits, as 3xTF32 keeps), every product of the kernel as three wgmmas (lo hi + hi lo +
    hi hi, FP32 accumulation), P^T scaled by 2^:data:`P_SPLIT_EXP` before its split and dS's lo part kept times
    2^:data:`DS_LO_EXP` (its products accumulated apart and multiplied back: dS ~ P ~ 1 / Nk, and its unscaled lo
    part would be FP16-subnormal); each query tile's dK and dV products formed in fresh accumulators and added in
    FP32 (summed inside the wgmma accumulator over hundreds of query tiles they leave the contract: 1e-4 of the
    largest at 32768 tokens on an H200). Head dims 64 and 128 (at 128 the consumers split the head dim:
    :func:`fp32_config`). Same arguments, returns and errors (:func:`fp32_unsupported_reason`); the gradients within
    mode fp32's contract (2e-6 relative L2 per head), bit-for-bit reproducible."""
    return _scaled_backward("fp32_backward", q, k, v, out, grad_out, lse, scale, config, split=True)
