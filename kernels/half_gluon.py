"""FP16 / BF16 attention forward for Hopper in Gluon: TMA producer warp, one to four consumer warpgroups.

The Triton kernel of :mod:`.elsa_fwd` issues its loads and both GEMMs from the same warps, in
lockstep. This kernel schedules the way FlashAttention-3 does (Shah et al. 2024, Sec. 3.1-3.2),
which Gluon (Triton's explicit-layout dialect) can express (docs/tuning.md: Hopper fp16 / bf16: a
warp-specialized Gluon kernel (FlashAttention-3 schedule) beside the Triton kernel):

* **warp specialization**: one producer warp TMA-loads the CTA's 64-row Q tiles (one per consumer)
  and a ring of K / V tiles (``ready`` / ``empty`` mbarriers; 4-D [B, H, N, D] descriptors, so strided
  views such as timm's ``qkv.unbind`` need no copy, and rows past N arrive as zeros); two consumer
  warpgroups get 240 registers each (one alone: 232; four: 112-120), the producer 24;
* **intra-warpgroup overlap**: each consumer issues ``S_{t+1} = Q K_{t+1}^T`` and
  ``O += P_t V_t`` as async wgmmas and runs the softmax of ``S_{t+1}`` while ``P_t V_t`` is in flight;
* **ping-pong** (D = 128 over 128-key tiles): two ``turn`` mbarriers make the consumers take turns issuing
  their wgmmas, so one group's softmax overlaps the other's GEMMs. At D = 64 the GEMMs are too
  short for it to pay, as in FlashAttention-3 (docs/tuning.md: ping-pong between consumers at D=128 only), and
  D = 128's 64-key tiles run 2-5 % faster without the turns (docs/tuning.md: no ping-pong for head dim 128's 64-key
  tiles);
* **persistent grid**: one program per SM takes work tiles (128 query rows of one head) in turn; the
  barrier phases run on across tiles, so the producer loads the next tile's Q and K / V while the
  consumers finish the last one's ``P V`` and store it (docs/tuning.md: persistent grid, next tile's loads
  under the current tile's P V). At D = 64 Q is double-buffered, so the next tile's Q load starts with the
  current tile; D = 128 has no shared memory left for it beside three 128-key K / V stages (docs/tuning.md:
  double-buffered Q at D=64; up to 1024 keys it runs 64-key tiles and two Q buffers, see below), and frees each
  Q tile at its last ``Q K^T``, a step before the last ``P V`` (docs/tuning.md: Q freed at the last Q K^T);
* **cut last key tile**: the last of a row's key tiles multiplies only the keys it holds, rounded up
  to 16 in one or (D = 64) two power-of-two parts: 1025 keys cost 8 tiles and 16 keys, not 9 tiles;
  197 keys cost 128 + 64 + 16 (docs/tuning.md: cut last key tile (16-key steps, one or two power-of-two
  parts)); up to :data:`TAIL_CUT_MAX_KEYS` keys only;
* **one consumer per CTA below 1536 keys** (D = 64): 64-row work tiles, two CTAs per SM that drift out of
  phase, so one's softmax runs under the other's products where a work tile has too few key tiles to
  overlap within (docs/tuning.md: one consumer warpgroup per CTA below 1536 keys (D=64));
* **three consumers per CTA where their waves finish first** (D = 64 from 1536 keys, D = 128 over 64-key tiles:
  129-1024 keys; docs/tuning.md: three consumers for head dim 128's 64-key tiles): 192-row work tiles, each
  K / V tile read from shared memory serving 192 rows; 7 % more rows per second than two consumers where both fill
  whole waves of SMs, so :func:`three_consumers_faster` weighs that against the rounding of each count's work tiles
  into waves (ViT-B/16 at 1024 px: 16 waves of 192 rows against 24 of 128; 8 heads of 16384 keep two: 6 waves of 192
  rows against 8 of 128) (docs/tuning.md: three consumers per CTA at D=64 where the work tiles' waves allow);
* **four consumers per CTA at 193-224 query rows** (D = 64, <= 256 keys): a work tile is a whole head, four 64-row
  chains of dependent products side by side over one K / V ring of 64-key tiles. ViT-B/16 at 224 (197 rows)
  would otherwise pay a whole chain for its last 5 rows (docs/tuning.md: four consumers per CTA at 193-224
  query rows and <= 256 keys (D=64));
* **row sums kept per thread**: each thread adds up its own columns of P's rows into [rows, 4] parts, summed
  across a row's four threads once, in the epilogue: two shuffles per row and key tile fewer (docs/tuning.md:
  P's row sums kept per thread ([rows, 4] parts, summed once in the epilogue)).
* **O by TMA stores** (two Q buffers, O in the inputs' dtype: :func:`tma_output`): each consumer stages its O tile in
  its own Q tile of the work tile (free after the last ``Q K^T``; Q is double-buffered, so the next work tile's Q
  loads into the other buffer meanwhile), writes it with one TMA store (rows past N clipped) and frees the Q buffer
  once the store has read it. Stores from the wgmma accumulator layout (4 bytes a thread and row) took 1-1.6 us a
  work tile at 197-1025 rows, a fifth of a ViT-B/16 224 work tile (docs/tuning.md: O by a TMA store). D = 128 has
  two Q buffers only at up to :data:`D128_SHORT_KEYS` keys, beside a four-slot ring of 64-key tiles instead of three
  slots of 128 keys (docs/tuning.md: head dim 128 up to 1024 keys: 64-key tiles in four stages, two Q buffers);
  longer calls store O from registers.
* **key pieces for a little-filled last round** (D = 128 past 1024 keys, the last key tile whole): where the work tiles
  leave a last round of the persistent grid on at most a third of the SMs, each of those work tiles runs as
  :func:`key_pieces` items over consecutive key ranges; a piece's rows leave as partial states (m, S, O / S) and
  :func:`_piece_merge_kernel` folds them with the monoid merge of :func:`.elsa_fwd.merge_partials`. The round then
  takes a piece's key tiles plus the merge instead of all of a work tile's: Flux at 512 px (24 heads of 1536 tokens,
  288 work tiles on 132 SMs) 1.09x (docs/tuning.md: key pieces for the last round of head-dim-128 work tiles).

Mode ``fp32`` runs a build of this kernel with ``PARTS = 2`` (:mod:`.fp32_gluon`): its q / k / v are FP16 copies
scaled per head and split into hi and lo parts, each tile loaded as two buffers, every product three wgmmas, each
key tile's ``P V`` formed in a fresh accumulator and added in FP32, and each head's multipliers read from ``Scales``.
The ``PARTS = 1`` builds compile to the same code as without it.

The fold is the (m, S, W) recurrence of :mod:`.elsa_fwd` (ELSA supplement, Alg. 1) in base 2:
FP32 scores and state, P rounded to the input dtype before ``P @ V``, FP32 accumulation, one
division and rounding at the end. Results match the Triton kernel's error (rel err ~2.7e-4 fp16,
~2.1e-3 bf16 vs float64).

Scope (:func:`unsupported_reason`): CUDA tensors of compute capability 9.x (wgmma, TMA,
``setmaxnreg``), fp16 or bf16 q / k / v of one dtype, head dim 64 or 128 for both Q/K and V, no bias /
mask / causal, no split-KV, TMA-legal strides (contiguous head dim, 16-byte-aligned base and strides).
The dense launcher takes the calls :func:`preferred` names (all but 65-128 keys at D = 64). Gluon cannot run under
``TRITON_INTERPRET=1``: CPU tests compile it offline for sm_90 and check the dispatch; ``pytest -m gpu``
checks its results against the float64 oracle. Speed against SDPA-cuDNN and the Triton kernel, per shape:
docs/tuning.md and docs/benchmarks/attention_h100_cudagraph.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._gluon import checked_call, hopper_tma_scope_reason, nvmma_layout
from ._launch import KernelCall, PlannedLaunch, cdiv, heads_inner_layout, pad_pow2, sm_count
from .elsa_fwd import merge_partials
from .scaled_fp16 import FORWARD_SCALES_ROW, P_SPLIT_EXP

try:  # Gluon is experimental: its API moves between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ._gluon import (cta_barrier as _cta_barrier, softmax_tile, split_mma, split_parts, tma_load_parts,
                         tma_store_rows)

    _IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = f"Gluon Hopper API unavailable in this Triton ({exc})"

__all__ = ["half_attention", "launch", "unsupported_reason", "get_config", "kernel_constexprs", "descriptor_types",
           "HEAD_DIMS", "preferred", "config_for", "planned_launch", "FOUR_CONSUMER_ROWS", "FOUR_CONSUMER_MAX_KEYS",
           "last_key_tile"]

HEAD_DIMS = (64, 128)


def preferred(n_q: int, n_k: int, head_dim: int) -> bool:
    """Whether the dense launcher runs an in-scope call of ``n_q`` query rows and ``n_k`` keys on this kernel rather
    than the Triton kernel. D = 128: at every length (with the one key tile cut). D = 64: everywhere but
    65-128 keys, where the Triton kernel's 32-key tiles pad less than this kernel's one 128-key tile, even cut
    to 64 + 16 or 128 keys (docs/tuning.md: fp16 / bf16 on the warp-specialized Gluon kernel (`preferred`):
    every length at D=128, all but 65-128 keys at D=64)."""
    return head_dim > 64 or not 64 < n_k <= 128


_DTYPES = (torch.float16, torch.bfloat16)


# D = 64 calls with fewer keys than this run one consumer warpgroup per CTA and two CTAs per SM (see get_config):
# with few key tiles per work tile, two out-of-phase CTAs overlap softmax and products better than two consumers
# of one CTA (docs/tuning.md: one consumer warpgroup per CTA below 1536 keys (D=64))
ONE_CONSUMER_BELOW = 1536


def _tail_keys(rem: int, split: bool) -> tuple[int, int]:
    # keys the last key tile multiplies, in one or two power-of-two parts (Triton tensors are powers of two,
    # wgmma takes 16-key steps): 1 -> (16, 0), 42 -> (32, 16), 69 -> (64, 16), 100 -> (128, 0)
    r16 = cdiv(rem, 16) * 16
    first = 1 << (r16.bit_length() - 1)
    second = r16 - first
    if second == 0:
        return first, 0
    if split and second & (second - 1) == 0:
        return first, second
    return pad_pow2(rem), 0


# The last key tile is cut to the keys it holds (one kernel build per cut) only up to this many keys: image
# models have few such lengths, each a sizeable gain; past it the whole tile runs masked (at most 1/16 of the
# work, the masked part less) so that a new long length, e.g. another frame count of VGGT's global attention,
# never compiles a new kernel (docs/tuning.md: Gluon tail cut only up to 2048 keys).
TAIL_CUT_MAX_KEYS = 2048


# D = 64 calls with this many query rows and at most FOUR_CONSUMER_MAX_KEYS keys run four consumer warpgroups per
# CTA, one head per work tile (see get_config). 197 rows (ViT-B/16 at 224) take four 64-row tiles, the last with 5
# rows: one consumer per CTA pays for that tile as a whole chain of dependent products (4 per head), four per CTA
# run the head's four chains side by side over shared K / V. At 192 or 145 rows, or from 257 keys, one per CTA is
# ahead (docs/tuning.md: four consumers per CTA at 193-224 query rows and <= 256 keys (D=64)).
FOUR_CONSUMER_ROWS = range(193, 225)
FOUR_CONSUMER_MAX_KEYS = 256

# Long D = 64 calls: three consumer warpgroups (192 query rows per work tile) form a row's products this much faster
# than two (128 rows: each K / V tile read from shared memory serves more rows, and a third chain of softmax work
# hides under the others' products), measured where both grids fill their waves; the choice between them weighs it
# against the rounding of the work tiles into waves of SMs (:func:`three_consumers_faster`; docs/tuning.md: three
# consumers per CTA at D=64 where the work tiles' waves allow). D = 128's 64-key tiles measure the same speed
# (1.05-1.08x at 257-384 rows; docs/tuning.md: three consumers for head dim 128's 64-key tiles).
THREE_CONSUMER_ROW_SPEED = 1.07
# their rows and registers, at either head dim (get_config): 192 rows, 16 warps at 128 registers each at launch,
# 160 per consumer thread after setmaxnreg
_THREE_CONSUMERS = {"BLOCK_M": 192, "maxnreg": 128, "consumer_regs": 160, "consumers": 3, "ctas_per_sm": 1}

# D = 128 calls of at most this many keys run two Q buffers, so that O leaves by TMA stores through the consumer's Q
# tile (:func:`tma_output`) and the next work tile's Q loads under the current one: a short work tile spends a large
# share of its time on the Q load and the O store (1-1.4 us each). Beside them, 64-key tiles fit a four-deep K / V
# ring in the shared memory of three 128-key stages and one Q buffer: 1.03-1.15x at 129-577 keys (1.11-1.15x at 200,
# 257, 384, 577), even at 1024; from 1536 keys the 128-key tiles' longer products win, and a call of one key tile
# keeps it whole in two stages (docs/tuning.md: head dim 128 up to 1024 keys: 64-key tiles in four stages, two Q
# buffers)
D128_SHORT_KEYS = 1024


# Key pieces of a last, part-filled round of work tiles (:func:`key_pieces`): only where that round fills at most
# this share of the SMs, and at a fixed cost, in key tiles of the long head-dim-128 build, of the pieces' start-up
# (the Q load, the first product without overlap, the epilogue) and the merge launch. Measured on an H200 (bf16,
# graph replay): a last round of 24 / 36 work tiles on 132 SMs 1.09x with 4 / 3 pieces, of 56-60 work tiles 0.92-0.99x
# with 2 (docs/tuning.md: key pieces for the last round of head-dim-128 work tiles)
PIECE_MAX_FILL = 1 / 3
PIECE_COST_TILES = 5.0


def key_pieces(n_q: int, n_k: int, heads: int, sms: int, cfg: dict) -> tuple[int, int]:
    """``(pieces, piece_tiles)``: how the long head-dim-128 build (128-key tiles, O from registers, the last key tile
    whole) cuts each work tile of a part-filled last round of its persistent grid along the keys. ``heads`` (batch x
    heads) heads of ``n_q`` query rows make ``cdiv(n_q, BLOCK_M) * heads`` work tiles; the ``rem`` of them past the
    last multiple of ``sms`` form the last round, which takes as long as a whole work tile while the other SMs idle.
    Cut into ``P`` items of ``piece_tiles = cdiv(key tiles, P)`` key tiles (``rem * P <= sms``), whose partial states
    a merge launch folds with the monoid merge, the round costs ``piece_tiles`` + :data:`PIECE_COST_TILES` key tiles
    instead of all of them: the cheapest ``P`` where that is less and ``rem <= sms *`` :data:`PIECE_MAX_FILL`, else
    ``(1, 0)`` (no cut). E.g. on 132 SMs Flux at 512 px (24 heads of 1536 tokens: 288 work tiles, 24 in the
    last round, 12 key tiles) runs 4 pieces of 3 key tiles. The pieces' states take a transient FP32 workspace of
    ``rem * P * 128 * (D + 2) * 4`` bytes, at most 8.4 MiB at D = 128 on 132 SMs (:func:`piece_workspace`)."""
    n_kt = cdiv(n_k, cfg["BLOCK_N"])
    whole = (1, 0)
    if (cfg["BLOCK_N"] != 128 or cfg["q_buffers"] != 1 or cfg["parts"] != 1 or cfg["one_tile"]
            or tuple(cfg["tail_keys"]) != (cfg["BLOCK_N"], 0)):
        return whole
    rem = cdiv(n_q, cfg["BLOCK_M"]) * heads % sms
    if rem == 0 or rem > sms * PIECE_MAX_FILL:
        return whole
    best, best_cost = whole, float(n_kt)
    for p in range(2, n_kt + 1):
        tiles = cdiv(n_kt, p)
        p = cdiv(n_kt, tiles)  # no empty piece
        if rem * p > sms:
            break
        if tiles + PIECE_COST_TILES < best_cost:
            best, best_cost = (p, tiles), tiles + PIECE_COST_TILES
    return best


def three_consumers_faster(n_q: int, heads: int, sms: int) -> bool:
    """Whether a call of ``heads`` (batch x heads) heads of ``n_q`` query rows (D = 64 from ``one_consumer_below``
    keys; D = 128 over 64-key tiles) finishes sooner on three consumer warpgroups per CTA than on two, on ``sms``
    SMs (one persistent CTA each): each count's time is taken as its waves of work tiles,
    ``ceil(heads * ceil(n_q / rows) / sms)``, times its rows per tile over its speed per row
    (:data:`THREE_CONSUMER_ROW_SPEED`). E.g. on 132 SMs: ViT-B/16 at 1024 px (96 heads of 4097 rows) and 16 heads of
    16384 take three; 8 heads of 16384 (6 waves of 192 rows against 8 of 128) and of 4096 keep two; at D = 128, 512
    heads of 257 or 384 rows take three, 128 heads of 577 and 64 of 1024 keep two."""
    def cost(rows: int, speed: float) -> float:
        return cdiv(heads * cdiv(n_q, rows), sms) * rows / speed

    return cost(192, THREE_CONSUMER_ROW_SPEED) < cost(128, 1.0)


def get_config(n_k: int, head_dim: int = 64, one_consumer_below: int | None = None, n_q: int | None = None,
               heads: int | None = None, sms: int | None = None) -> dict:
    """Launch config by head dim, key count and (for one case) query count, tuned on an H100.

    * Long calls: 128 query rows per CTA (64 per consumer warpgroup) and 128-key tiles with 3 stages: 2 stages
      starve the consumers, 4 gain nothing, 256-key tiles are slower (docs/tuning.md: long calls: 128 query rows
      per CTA, 128-key tiles, 3 stages). Registers: 168 per thread at launch (12 warps: two consumer
      warpgroups, the producer warp padded to a warpgroup), redistributed by ``setmaxnreg`` to 240 per
      consumer thread and 24 per producer thread.
    * D = 64 below ``one_consumer_below`` keys (default :data:`ONE_CONSUMER_BELOW`): one consumer warpgroup
      (64 rows) per CTA at 128 registers per thread (232 per consumer thread after ``setmaxnreg``), so two
      CTAs share an SM and run out of phase: one's softmax under the other's products.
    * D = 64, ``n_q`` in :data:`FOUR_CONSUMER_ROWS`, at most :data:`FOUR_CONSUMER_MAX_KEYS` keys and (given
      ``heads`` and ``sms``) at least one head per SM: four consumer
      warpgroups (256 rows: a whole head) per CTA over 64-key tiles, 4 stages; 96 registers per thread at launch
      (20 warps), 112-120 per consumer thread and 24 per producer thread after ``setmaxnreg``.
    * D = 64 from ``one_consumer_below`` keys (D = 128 over 64-key tiles, below), given ``n_q``, ``heads`` (batch x
      heads) and ``sms``: three consumer warpgroups (192 rows) per CTA where :func:`three_consumers_faster` says so;
      128 registers per thread at launch (16 warps), 160 per consumer thread and 24 per producer thread after
      ``setmaxnreg``.
    * ``parts``: 1 (:func:`.fp32_gluon.get_config` sets 2: mode fp32's split operands).
    * D = 128 at up to :data:`D128_SHORT_KEYS` keys: two Q buffers (O by TMA stores through them) beside 64-key
      tiles in four K / V stages, the consumers not in ping-pong, three of them (192 rows; 128 registers per thread
      at launch, 160 per consumer thread) where :func:`three_consumers_faster` says so; a call of one key tile (up
      to 128 keys) keeps its 128-key tile, in two stages, two consumers in ping-pong.
    * ``persistent``: ``ctas_per_sm`` programs per SM loop over the work tiles. ``q_buffers``: Q tiles in
      flight (2 at D = 64; at D = 128 only with 64-key tiles: beside three 128-key stages, two would need
      256 KiB of shared memory).
      ``tail_keys``: the keys the last key tile multiplies, ``n_k``'s remainder rounded up to 16 in one or (D = 64)
      two power-of-two parts; one kernel build per distinct pair. ``one_tile``: every key in one tile, cut the same way
      (docs/tuning.md: cut last key tile (16-key steps, one or two power-of-two parts)).
    * ``pieces`` / ``piece_tiles``: at D = 128, given ``n_q``, ``heads`` and ``sms``, the work tiles of a part-filled
      last round of the persistent grid cut along the keys (:func:`key_pieces`; ``(1, 0)``: none).
    """
    if one_consumer_below is None:
        one_consumer_below = ONE_CONSUMER_BELOW
    fills = heads is None or sms is None or heads >= sms  # every SM gets a head
    if head_dim <= 64 and n_q in FOUR_CONSUMER_ROWS and n_k <= FOUR_CONSUMER_MAX_KEYS and fills:
        cfg = {"BLOCK_M": 256, "BLOCK_N": 64, "STAGES": 4, "maxnreg": 96, "consumer_regs": 112, "consumers": 4,
               "ctas_per_sm": 1}
    elif head_dim <= 64 and n_k < one_consumer_below:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 3, "maxnreg": 128, "consumer_regs": 240,  # it takes 232
               "consumers": 1, "ctas_per_sm": 2}
    elif head_dim <= 64 and n_q and heads and sms and three_consumers_faster(n_q, heads, sms):
        cfg = dict(_THREE_CONSUMERS, BLOCK_N=128, STAGES=3)
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 3, "maxnreg": 168, "consumer_regs": 240, "consumers": 2,
               "ctas_per_sm": 1}
    short_d128 = head_dim > 64 and n_k <= D128_SHORT_KEYS
    if short_d128 and n_k <= cfg["BLOCK_N"]:  # one key tile: whole, in two stages (two 64-key tiles run 4-9 % slower)
        cfg.update(STAGES=2)
    elif short_d128:
        cfg.update(BLOCK_N=64, STAGES=4)
        if n_q and heads and sms and three_consumers_faster(n_q, heads, sms):
            cfg.update(_THREE_CONSUMERS)
    # ping-pong at D = 128 over 128-key tiles only (docs/tuning.md: no ping-pong for head dim 128's 64-key tiles)
    ping_pong = head_dim > 64 and cfg["BLOCK_N"] == 128
    cfg = dict(cfg, PINGPONG=ping_pong, persistent=True, q_buffers=2 if head_dim <= 64 or short_d128 else 1,
               parts=1, **last_key_tile(n_k, cfg["BLOCK_N"], head_dim))
    pieces, piece_tiles = key_pieces(n_q, n_k, heads, sms, cfg) if head_dim > 64 and n_q and heads and sms else (1, 0)
    return dict(cfg, pieces=pieces, piece_tiles=piece_tiles)


def last_key_tile(n_k: int, block_n: int, head_dim: int) -> dict:
    """The config entries for the last of ``n_k`` keys' ``block_n``-key tiles: ``one_tile`` (every key in one
    tile) and ``tail_keys``, the keys that tile multiplies (:func:`get_config`; the whole tile past
    :data:`TAIL_CUT_MAX_KEYS` keys)."""
    rem = n_k - (cdiv(n_k, block_n) - 1) * block_n
    tail = _tail_keys(rem, split=head_dim <= 64) if n_k <= TAIL_CUT_MAX_KEYS else (block_n, 0)
    return dict(one_tile=n_k <= block_n, tail_keys=tail)


def config_for(q: torch.Tensor, k: torch.Tensor) -> dict:
    """:func:`get_config` for a call's q [B, H, Nq, D] and k [B, H, Nk, D] on q's device: four consumers (one head
    per work tile) only where the B * H heads give every SM one; fewer heads take 64-row work tiles instead; three
    consumers where their waves of work tiles finish first (off CUDA, where nothing launches, the SM count is not
    asked: neither four nor three)."""
    B, H, n_q, head_dim = q.shape
    if q.device.type != "cuda":
        return get_config(k.shape[2], head_dim, n_q=n_q)
    sms = sm_count(q.device)
    return get_config(k.shape[2], head_dim, n_q=n_q, heads=B * H, sms=sms)


def unsupported_reason(q, k, v, bias, attn_mask, is_causal: bool, scale: float, num_splits: int) -> str | None:
    """Why :func:`half_attention` cannot run this call (the Triton kernel then does), or ``None``.

    Inputs as the dense launcher sees them: q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] (Hkv dividing H:
    grouped-query attention reads K / V head ``h // (H / Hkv)`` in place); ``num_splits`` 0 = automatic (the
    launcher splits only when the grid cannot fill the GPU).
    """
    return hopper_tma_scope_reason(q, k, v, bias, attn_mask, is_causal, scale, num_splits, dtypes=_DTYPES,
                                   head_dims=HEAD_DIMS, import_error=_IMPORT_ERROR)


if _IMPORT_ERROR is None:
    _P_SPLIT_SCALE = gl.constexpr(2.0 ** P_SPLIT_EXP)  # mode fp32: P's multiplier before its hi / lo split
    _SCALES_ROW = gl.constexpr(FORWARD_SCALES_ROW)  # mode fp32: each head's multipliers (logits', output's)

    @gluon.jit
    def _tile_coords(tile, tiles_m, H, ROWS: gl.constexpr):
        # work tile -> (batch, head, first query row); tiles of one head are consecutive (K / V stay in L2)
        bh = tile // tiles_m
        return bh // H, bh % H, (tile % tiles_m) * ROWS

    @gluon.jit
    def _row_parts(p):
        # partial row sums of p [M, N] in a wgmma layout, [M, 4]: a thread holds the column pairs 8j + 2t + {0, 1}
        # of its rows (t = lane % 4), so summing over j and the pair needs no shuffle; the epilogue sums the four
        return gl.sum(gl.sum(gl.reshape(p, [p.shape[0], p.shape[1] // 8, 4, 2]), axis=3), axis=1)

    @gluon.jit
    def _fold_parts(l_i, alpha, p):
        # l_i [M, 4] (see _row_parts) rescaled by alpha [M] plus this tile's parts, in l_i's layout
        parts = gl.convert_layout(_row_parts(p), l_i.type.layout)
        return l_i * gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))[:, None] + parts

    @gluon.jit
    def _n_items(n_work, n_whole, pieces, PIECES: gl.constexpr):
        # work items of a launch: the work tiles, or (PIECES) the first n_whole whole and each later one in pieces
        if PIECES:
            return n_whole + (n_work - n_whole) * pieces
        return n_work

    @gluon.jit
    def _work_item(item, n_whole, pieces, piece_tiles, Nk, BLOCK_N: gl.constexpr):
        # PIECES: work item -> (work tile, its first key, its keys): items below n_whole are whole work tiles; item
        # n_whole + j is piece j % pieces (piece_tiles key tiles, the last piece the rest) of work tile
        # n_whole + j // pieces
        tile = item
        k0 = item * 0
        n_k = Nk
        if item >= n_whole:
            j = item - n_whole
            tile = n_whole + j // pieces
            k0 = (j % pieces) * (piece_tiles * BLOCK_N)
            n_k = gl.minimum(Nk - k0, piece_tiles * BLOCK_N)
        return tile, k0, n_k

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, H, GROUP, Nq, Nk,
                  n_work, n_whole, pieces, piece_tiles,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
                  CONSUMERS: gl.constexpr, PARTS: gl.constexpr, PIECES: gl.constexpr):
        # one warp: per work item, each consumer's Q tile into a free Q buffer, then its K / V tile t into ring slot
        # g % STAGES (g counts KV tiles over every work item) once every consumer freed it; query head h reads K / V
        # head h // GROUP (grouped-query attention; GROUP = 1 folds away). PARTS = 2 (mode fp32): each tile's hi and
        # lo parts, columns [0, HEAD_D) and [HEAD_D, 2 HEAD_D) of the split copies, into consecutive buffers
        HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
        tiles_m = gl.cdiv(Nq, CONSUMERS * BLOCK_M)
        n_tiles = gl.cdiv(Nk, BLOCK_N)
        i = 0
        g_run = 0  # PIECES: KV tiles of the earlier items (their key counts differ)
        for item in range(gl.program_id(0), _n_items(n_work, n_whole, pieces, PIECES), gl.num_programs(0)):
            tile = item
            k0 = 0
            g0 = i * n_tiles
            if PIECES:
                tile, k0, n_k = _work_item(item, n_whole, pieces, piece_tiles, Nk, BLOCK_N)
                n_tiles = gl.cdiv(n_k, BLOCK_N)
                g0 = g_run
                g_run += n_tiles
            off_b, off_h, start_m = _tile_coords(tile, tiles_m, H, CONSUMERS * BLOCK_M)
            qb = i % Q_BUFS
            q_bar = q_ready.index(qb)
            mbarrier.wait(q_empty.index(qb), ((i // Q_BUFS) & 1) ^ 1)
            mbarrier.expect(q_bar, CONSUMERS * PARTS * q_desc.block_type.nbytes)
            for c in gl.static_range(CONSUMERS):
                for part in gl.static_range(PARTS):
                    tma.async_copy_global_to_shared(q_desc, [off_b, off_h, start_m + c * BLOCK_M, part * HEAD_D], q_bar,
                                                    q_smem.index((CONSUMERS * qb + c) * PARTS + part))
            off_kv = off_h // GROUP
            for t in range(n_tiles):
                g = g0 + t
                slot = g % STAGES
                mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
                tma_load_parts(k_desc, v_desc, off_b, off_kv, k0 + t * BLOCK_N, ready.index(slot), k_smem, v_smem,
                               slot, PARTS)
            i += 1

    @gluon.jit
    def _step(acc, p16, p_lo, m_i, l_i, t, g, turns, q_t, q_l, k_smem, v_smem, l_smem, ready, empty, my_turn,
              other_turn, Nk, qk_scale, offs_sn, s_zero, o_zero, WG: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_D: gl.constexpr, STAGES: gl.constexpr, TAIL: gl.constexpr, PINGPONG: gl.constexpr,
              SPLIT_AT: gl.constexpr, PARTS: gl.constexpr, q_free, FREE_Q: gl.constexpr):
        # S_{t+1} = Q K_{t+1}^T and O += P_t V_t in flight together; the softmax of S_{t+1} runs under P_t V_t.
        # g: KV tile t's count over the program's work tiles (ring slot and phase); turns: this group's turns
        # taken before this step. SPLIT_AT > 0: the second part of a last tile split in two (no ping-pong): its
        # keys [SPLIT_AT, SPLIT_AT + n) against P V of the first part, all in ring slot g.
        # PARTS = 2 (mode fp32): q_l, p_lo and the second buffer of each K / V slot hold the lo parts; every product is
        # three wgmmas (split_mma), P_t V_t formed in a fresh accumulator and added to acc in FP32 (summed in the
        # wgmma accumulator tile after tile, its error would grow with the keys), P scaled by 2^P_SPLIT_EXP.
        # FREE_Q: this step's S is the work tile's last Q K^T; it releases the Q tile (q_free) once S is formed
        LO: gl.constexpr = PARTS - 1
        if SPLIT_AT > 0:
            ks = (g % STAGES) * PARTS
            k_t = k_smem.index(ks).reshape([BLOCK_N, HEAD_D]).slice(SPLIT_AT, s_zero.shape[1])
            k_l = k_smem.index(ks + LO).reshape([BLOCK_N, HEAD_D]).slice(SPLIT_AT, s_zero.shape[1])
            v_t = v_smem.index(ks).reshape([BLOCK_N, HEAD_D]).slice(0, SPLIT_AT)
            v_l = v_smem.index(ks + LO).reshape([BLOCK_N, HEAD_D]).slice(0, SPLIT_AT)
        else:
            nxt = (g + 1) % STAGES
            mbarrier.wait(ready.index(nxt), ((g + 1) // STAGES) & 1)
            # a cut last tile: its keys
            k_t = k_smem.index(nxt * PARTS).reshape([BLOCK_N, HEAD_D]).slice(0, s_zero.shape[1])
            k_l = k_smem.index(nxt * PARTS + LO).reshape([BLOCK_N, HEAD_D]).slice(0, s_zero.shape[1])
            v_t = v_smem.index((g % STAGES) * PARTS).reshape([BLOCK_N, HEAD_D])
            v_l = v_smem.index((g % STAGES) * PARTS + LO).reshape([BLOCK_N, HEAD_D])
        if PINGPONG:
            mbarrier.wait(my_turn, (turns + (WG == 0)) & 1)
        s_tok = split_mma(q_t, q_l, k_t.permute((1, 0)), k_l.permute((1, 0)), s_zero, False, PARTS)
        if PARTS == 2:
            o_tok = split_mma(p16, p_lo, v_t, v_l, o_zero, False, PARTS)
        else:
            o_tok = warpgroup_mma(p16, v_t, acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn)
        s = warpgroup_mma_wait(2 * PARTS - 1, deps=[s_tok])  # P_t V_t's wgmmas stay in flight
        if FREE_Q:
            mbarrier.arrive(q_free)  # every Q K^T of this work tile is done: the producer may load the next Q
        rows: gl.constexpr = gl.SliceLayout(1, s.type.layout)  # the tail tile's S has a narrower wgmma layout
        p, m_new, alpha = softmax_tile(s, gl.convert_layout(m_i, rows), t + 1, Nk, qk_scale, offs_sn, BLOCK_N, TAIL)
        m_i = gl.convert_layout(m_new, m_i.type.layout)
        l_i = _fold_parts(l_i, alpha, p)
        # ptxas would sink the softmax below the next wait (no overlap) unless it must finish first: a store
        # of its row sums does that
        l_smem.store(l_i.to(gl.float16))
        # P_t is not in the deps: ptxas keeps the registers an in-flight wgmma reads, and listing a 16-bit
        # tensor there makes the compiler repack it (docs/tuning.md: P_t left out of the deps of the wgmma wait)
        if PARTS == 2:
            acc = acc + warpgroup_mma_wait(0, deps=[o_tok])
        else:
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        if SPLIT_AT == 0:
            mbarrier.arrive(empty.index(g % STAGES))  # this group is done with K_t and V_t
        p_layout: gl.constexpr = p16.type.layout
        p16, p_lo = _p_operands(p, p16.dtype, p_layout, PARTS)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        return acc, p16, p_lo, m_i, l_i

    @gluon.jit
    def _p_operands(p, dtype: gl.constexpr, layout: gl.constexpr, PARTS: gl.constexpr):
        # P's wgmma register operands: P rounded to dtype (twice the same tensor at PARTS = 1), or the hi and lo parts
        # of P times 2^P_SPLIT_EXP (PARTS = 2)
        if PARTS == 2:
            hi, lo = split_parts(p * _P_SPLIT_SCALE, dtype, 1.0)
            return gl.convert_layout(hi, layout), gl.convert_layout(lo, layout)
        p16 = gl.convert_layout(p.to(dtype), layout)
        return p16, p16

    @gluon.jit
    def _last_pv(acc, p16, p_lo, v_smem, o_zero, q_free, empty, last, my_turn, other_turn, turns, WG: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, PINGPONG: gl.constexpr, V_START: gl.constexpr,
                 PARTS: gl.constexpr, TMA_OUT: gl.constexpr, Q_FREED: gl.constexpr):
        # O += P V of a work tile's last KV tile (ring slot ``last``; P [BLOCK_M, keys from V_START on]); PARTS as in
        # _step; TMA_OUT: the epilogue stages O in this consumer's Q tile and frees it itself; Q_FREED: the step of
        # the last Q K^T freed it
        if not TMA_OUT and not Q_FREED:
            mbarrier.arrive(q_free)  # every Q K^T of this work tile is done: the producer may load the next Q
        if PINGPONG:
            mbarrier.wait(my_turn, (turns + (WG == 0)) & 1)
        v_t = v_smem.index(last * PARTS).reshape([BLOCK_N, HEAD_D]).slice(V_START, p16.shape[1])
        if PARTS == 2:
            v_l = v_smem.index(last * PARTS + 1).reshape([BLOCK_N, HEAD_D]).slice(V_START, p16.shape[1])
            o_tok = split_mma(p16, p_lo, v_t, v_l, o_zero, False, PARTS)
        else:
            o_tok = warpgroup_mma(p16, v_t, acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(other_turn)
        if PARTS == 2:
            acc = acc + warpgroup_mma_wait(0, deps=[o_tok])
        else:
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(empty.index(last))
        return acc

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE, Scales, sob,
                  soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, WG: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                  PINGPONG: gl.constexpr, Q_BUFS: gl.constexpr, TAIL_N: gl.constexpr, TAIL_N2: gl.constexpr,
                  CONSUMERS: gl.constexpr, ONE_TILE: gl.constexpr, WRITE_LSE: gl.constexpr, PARTS: gl.constexpr,
                  TMA_OUT: gl.constexpr, PIECES: gl.constexpr):
        # one warpgroup: query rows [start_m + WG * BLOCK_M, + BLOCK_M) of each of the program's work items.
        # PARTS = 2 (mode fp32): split operands scaled per head; each head's Scales row replaces qk_scale (its
        # logits' multiplier) and undoes v's and P's scales on the output. TMA_OUT: O goes through this consumer's Q
        # tile (free after the last Q K^T; same block and layout as o_desc's) as a TMA store, and the Q buffer is
        # released after it (else O is stored from registers and Q released before the last P V). PIECES: a piece's
        # rows leave as a partial state (m, S, O / S) in the workspace at Scales (:func:`_store_piece`)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        # turns go 0, 1, 0, 1, ... (n_tiles + 1 per group and work tile): group 0's first wait passes on the
        # fresh barrier (parity 1)
        my_turn = turn.index(WG % 2)  # ping-pong has two consumers; the turns of 1 or 4 are never waited on
        other_turn = turn.index(1 - WG % 2)
        l_mine = l_smem.slice(WG * BLOCK_M, BLOCK_M)
        offs_sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        o_zero = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)  # P V's fresh accumulator (PARTS = 2)
        LO: gl.constexpr = PARTS - 1
        # the last KV tile of a work tile (2+ tiles): S and P V on its first TAIL_N keys only (:func:`get_config`)
        s_tail_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, TAIL_N, 16])
        offs_sn_tail = gl.arange(0, TAIL_N, layout=gl.SliceLayout(0, s_tail_layout))
        s_zero_tail = gl.zeros([BLOCK_M, TAIL_N], gl.float32, layout=s_tail_layout)
        # without TMA_OUT the step of the last Q K^T frees the Q tile, a step before the last P V: the producer's load
        # of the next work tile's Q runs under that step's softmax and P V and the epilogue (docs/tuning.md: Q freed
        # at the last Q K^T)
        EARLY_Q: gl.constexpr = not TMA_OUT
        tiles_m = gl.cdiv(Nq, CONSUMERS * BLOCK_M)
        n_tiles = gl.cdiv(Nk, BLOCK_N)
        i = 0
        g_run = 0  # PIECES: KV tiles of the earlier items (their key counts differ)
        turns_run = 0  # PIECES: this group's turns taken in them
        for item in range(gl.program_id(0), _n_items(n_work, n_whole, pieces, PIECES), gl.num_programs(0)):
            tile = item
            n_k = Nk  # the keys of this item: all but in a piece
            g0 = i * n_tiles  # KV tiles of the earlier work items (ring slot and phase)
            turns = i * (n_tiles + 1)  # this group's turns taken in them
            if PIECES:
                tile, k0, n_k = _work_item(item, n_whole, pieces, piece_tiles, Nk, BLOCK_N)
                n_tiles = gl.cdiv(n_k, BLOCK_N)
                g0 = g_run
                turns = turns_run
                g_run += n_tiles
                turns_run += n_tiles + 1
            off_b, off_h, start_m = _tile_coords(tile, tiles_m, H, CONSUMERS * BLOCK_M)
            if PARTS == 2:
                head_scales = Scales + (off_b * H + off_h) * _SCALES_ROW
                qk = gl.load(head_scales)
            else:
                qk = qk_scale
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = _row_parts(s_zero)  # [BLOCK_M, 4] zeros in the layout the row parts take
            acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
            qb = i % Q_BUFS
            mbarrier.wait(q_ready.index(qb), (i // Q_BUFS) & 1)
            q_t = q_smem.index((CONSUMERS * qb + WG) * PARTS).reshape([BLOCK_M, HEAD_D])
            q_l = q_smem.index((CONSUMERS * qb + WG) * PARTS + LO).reshape([BLOCK_M, HEAD_D])
            mbarrier.wait(ready.index(g0 % STAGES), (g0 // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(my_turn, (turns + (WG == 0)) & 1)
            k_0 = k_smem.index((g0 % STAGES) * PARTS).reshape([BLOCK_N, HEAD_D])
            k_0l = k_smem.index((g0 % STAGES) * PARTS + LO).reshape([BLOCK_N, HEAD_D])
            if ONE_TILE:  # every key in the first tile: S on its first TAIL_N keys only
                s_tok = split_mma(q_t, q_l, k_0.slice(0, TAIL_N).permute((1, 0)), k_0l.slice(0, TAIL_N).permute((1, 0)),
                                  s_zero_tail, False, PARTS)
            else:
                s_tok = split_mma(q_t, q_l, k_0.permute((1, 0)), k_0l.permute((1, 0)), s_zero, False, PARTS)
            if PINGPONG:
                mbarrier.arrive(other_turn)
            s = warpgroup_mma_wait(0, deps=[s_tok])
            if ONE_TILE:
                p, m_i, alpha = softmax_tile(s, gl.convert_layout(m_i, gl.SliceLayout(1, s_tail_layout)), 0, n_k,
                                             qk, offs_sn_tail, BLOCK_N, True)
                m_i = gl.convert_layout(m_i, gl.SliceLayout(1, s_layout))
                l_i = _fold_parts(l_i, alpha, p)
            else:
                p, m_i, alpha = softmax_tile(s, m_i, 0, n_k, qk, offs_sn, BLOCK_N, True)
                l_i = _fold_parts(l_i, alpha, p)
            p16, p_lo = _p_operands(p, q_smem.dtype, p_layout, PARTS)
            if not ONE_TILE:
                for t in range(0, n_tiles - 2):
                    acc, p16, p_lo, m_i, l_i = _step(acc, p16, p_lo, m_i, l_i, t, g0 + t, turns + t + 1, q_t, q_l,
                                                     k_smem, v_smem, l_mine, ready, empty, my_turn, other_turn, n_k, qk,
                                                     offs_sn, s_zero, o_zero, WG, BLOCK_N, HEAD_D, STAGES, False,
                                                     PINGPONG, 0, PARTS, q_empty.index(qb), False)
            last = (g0 + n_tiles - 1) % STAGES
            if ONE_TILE:
                if TAIL_N2 > 0:  # the one tile in two parts: keys [0, TAIL_N) done, then [TAIL_N, + TAIL_N2)
                    s1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                        instr_shape=[16, TAIL_N2, 16])
                    offs_sn1 = TAIL_N + gl.arange(0, TAIL_N2, layout=gl.SliceLayout(0, s1_layout))
                    s_zero1 = gl.zeros([BLOCK_M, TAIL_N2], gl.float32, layout=s1_layout)
                    acc, p_one, p_onel, m_i, l_i = _step(acc, p16, p_lo, m_i, l_i, -1, g0, 0, q_t, q_l, k_smem, v_smem,
                                                         l_mine, ready, empty, my_turn, other_turn, n_k, qk, offs_sn1,
                                                         s_zero1, o_zero, WG, BLOCK_N, HEAD_D, STAGES, True, False,
                                                         TAIL_N, PARTS, q_empty.index(qb), EARLY_Q)
                    acc = _last_pv(acc, p_one, p_onel, v_smem, o_zero, q_empty.index(qb), empty, last, my_turn,
                                   other_turn, turns + n_tiles, WG, BLOCK_N, HEAD_D, PINGPONG, TAIL_N, PARTS, TMA_OUT,
                                   EARLY_Q)
                else:
                    acc = _last_pv(acc, p16, p_lo, v_smem, o_zero, q_empty.index(qb), empty, last, my_turn, other_turn,
                                   turns + n_tiles, WG, BLOCK_N, HEAD_D, PINGPONG, 0, PARTS, TMA_OUT, False)
            elif n_tiles > 1:
                t = n_tiles - 2
                acc, p_tail, p_taill, m_i, l_i = _step(acc, p16, p_lo, m_i, l_i, t, g0 + t, turns + t + 1, q_t, q_l,
                                                       k_smem, v_smem, l_mine, ready, empty, my_turn, other_turn, n_k,
                                                       qk, offs_sn_tail, s_zero_tail, o_zero, WG, BLOCK_N, HEAD_D,
                                                       STAGES, True, PINGPONG, 0, PARTS, q_empty.index(qb),
                                                       EARLY_Q and TAIL_N2 == 0)
                if TAIL_N2 > 0:  # the last tile in two parts: keys [0, TAIL_N) done, now [TAIL_N, TAIL_N + TAIL_N2)
                    s2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                        instr_shape=[16, TAIL_N2, 16])
                    offs_sn2 = TAIL_N + gl.arange(0, TAIL_N2, layout=gl.SliceLayout(0, s2_layout))
                    s_zero2 = gl.zeros([BLOCK_M, TAIL_N2], gl.float32, layout=s2_layout)
                    acc, p_tail2, p_tail2l, m_i, l_i = _step(acc, p_tail, p_taill, m_i, l_i, t, g0 + t + 1, 0, q_t, q_l,
                                                             k_smem, v_smem, l_mine, ready, empty, my_turn, other_turn,
                                                             n_k, qk, offs_sn2, s_zero2, o_zero, WG, BLOCK_N, HEAD_D,
                                                             STAGES, True, False, TAIL_N, PARTS, q_empty.index(qb),
                                                             EARLY_Q)
                    acc = _last_pv(acc, p_tail2, p_tail2l, v_smem, o_zero, q_empty.index(qb), empty, last, my_turn,
                                   other_turn, turns + n_tiles, WG, BLOCK_N, HEAD_D, PINGPONG, TAIL_N, PARTS, TMA_OUT,
                                   EARLY_Q)
                else:
                    acc = _last_pv(acc, p_tail, p_taill, v_smem, o_zero, q_empty.index(qb), empty, last, my_turn,
                                   other_turn, turns + n_tiles, WG, BLOCK_N, HEAD_D, PINGPONG, 0, PARTS, TMA_OUT,
                                   EARLY_Q)
            else:
                acc = _last_pv(acc, p16, p_lo, v_smem, o_zero, q_empty.index(qb), empty, last, my_turn, other_turn,
                               turns + n_tiles, WG, BLOCK_N, HEAD_D, PINGPONG, 0, PARTS, TMA_OUT, False)
            # the epilogue overlaps the producer's loads for the next work tile
            l_row = gl.convert_layout(gl.sum(l_i, axis=1), gl.SliceLayout(1, o_layout))
            if PARTS == 2:
                out = acc * (gl.load(head_scales + 1) / l_row)[:, None]
            else:
                out = acc / l_row[:, None]
            if PIECES:
                if item >= n_whole:  # the merge launch folds the pieces' states into O (and the LSE)
                    _store_piece(Scales, m_i, l_row, out, item - n_whole, pieces, n_work - n_whole, WG, BLOCK_M,
                                 CONSUMERS * BLOCK_M)
                else:
                    _store_out(out, m_i, l_row, o_desc, O, LSE, sob, soh, som, H, Nq, off_b, off_h, start_m, q_smem,
                               q_empty, qb, WG, BLOCK_M, CONSUMERS, WRITE_LSE, TMA_OUT)
            else:
                _store_out(out, m_i, l_row, o_desc, O, LSE, sob, soh, som, H, Nq, off_b, off_h, start_m, q_smem,
                           q_empty, qb, WG, BLOCK_M, CONSUMERS, WRITE_LSE, TMA_OUT)
            i += 1

    @gluon.jit
    def _store_out(out, m_i, l_row, o_desc, O, LSE, sob, soh, som, H, Nq, off_b, off_h, start_m, q_smem, q_empty, qb,
                   WG: gl.constexpr, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr, WRITE_LSE: gl.constexpr,
                   TMA_OUT: gl.constexpr):
        # a consumer's rows of a whole work tile: O = W / S (out, FP32 [BLOCK_M, D] in the wgmma layout) and the LSE
        o_layout: gl.constexpr = out.type.layout
        offs_om = start_m + WG * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        if TMA_OUT:
            # the accumulator layout's 4-byte stores take 1-1.6 us a work tile at 197-1025 rows, where the TMA
            # store of the staged tile takes ~0.3 (docs/tuning.md: O by a TMA store); rows past Nq are clipped
            tma_store_rows(o_desc, off_b, off_h, start_m + WG * BLOCK_M, q_smem.index(CONSUMERS * qb + WG),
                           out.to(q_smem.dtype))
            _cta_barrier()  # every thread is past the store's read
            mbarrier.arrive(q_empty.index(qb))  # the producer may load a later work tile's Q into it
        else:
            offs_od = gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, o_layout))
            gl.store(O + off_b.to(gl.int64) * sob + off_h.to(gl.int64) * soh + offs_om.to(gl.int64)[:, None] * som
                     + offs_od[None, :], out.to(O.dtype.element_ty), mask=(offs_om < Nq)[:, None])
        if WRITE_LSE:  # natural-log LSE of the scaled logits for the backward: m and log2 S are in log2 units
            lse = (gl.convert_layout(m_i, gl.SliceLayout(1, o_layout)) + gl.log2(l_row)) * 0.6931471805599453
            gl.store(LSE + (off_b * H + off_h).to(gl.int64) * Nq + offs_om, lse, mask=offs_om < Nq)

    @gluon.jit
    def _store_piece(Ws, m_i, l_row, out, j, pieces, split_tiles, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                     ROWS: gl.constexpr):
        # piece j % pieces of the split work tile j // pieces: its rows' partial state (m in log2 units, S, O / S)
        # into the three parts of the workspace (:func:`piece_workspace`), row (j % pieces) * plane + (j // pieces)
        # * ROWS + the row in the work tile, as :func:`_piece_merge_kernel` reads them
        layout: gl.constexpr = out.type.layout
        HEAD_D: gl.constexpr = out.shape[1]
        plane = split_tiles * ROWS
        rows = ((j % pieces) * plane + (j // pieces) * ROWS + WG * BLOCK_M
                + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)))
        gl.store(Ws + rows, gl.convert_layout(m_i, gl.SliceLayout(1, layout)))
        gl.store(Ws + pieces * plane + rows, l_row)
        cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
        gl.store(Ws + 2 * pieces * plane + rows[:, None] * HEAD_D + cols[None, :], out)

    @gluon.jit
    def _shared_buffers(q_desc, k_desc, v_desc, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
                        CONSUMERS: gl.constexpr, PARTS: gl.constexpr):
        # a forward kernel's shared memory, its mbarriers initialised: (q_smem, k_smem, v_smem, l_smem, q_ready,
        # q_empty, ready, empty, turn); PARTS buffers per tile (mode fp32's hi and lo parts). Also the varlen kernel's
        # (:mod:`.varlen_gluon`)
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * Q_BUFS * PARTS] + q_desc.block_type.shape,
                                           q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES * PARTS] + v_desc.block_type.shape, v_desc.layout)
        # [rows, 4] partial row sums, stored as FP16 (never read back): 256 bytes more than one FP32 per row, so two
        # one-consumer CTAs still share an SM (FP32 parts would need 768 and leave one)
        # (rows padded to a power of two: three consumers' 192 rows take 256)
        L_ROWS: gl.constexpr = (4 if CONSUMERS == 3 else CONSUMERS) * BLOCK_M
        l_smem = gl.allocate_shared_memory(gl.float16, [L_ROWS, 4],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_BUFS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=CONSUMERS)  # every consumer releases the Q tiles
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)  # every consumer releases a slot
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        return q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn

    # lengths and work counts are not specialised on: a new length compiles nothing new
    @gluon.jit(do_not_specialize=["Nq", "Nk", "n_work", "n_whole", "pieces", "piece_tiles"])
    def _half_fwd_kernel(q_desc, k_desc, v_desc, o_desc, O, LSE, Scales, sob, soh, som, H, GROUP, Nq, Nk, n_work,
                         n_whole, pieces, piece_tiles, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         HEAD_D: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, Q_BUFS: gl.constexpr, TAIL_N: gl.constexpr,
                         TAIL_N2: gl.constexpr, CONSUMERS: gl.constexpr, ONE_TILE: gl.constexpr,
                         WRITE_LSE: gl.constexpr, PARTS: gl.constexpr, TMA_OUT: gl.constexpr, PIECES: gl.constexpr):
        # Work tile = (CONSUMERS * BLOCK_M query rows, head, batch), n_work of them; program p takes tiles p,
        # p + grid, ... (one tile each when the grid covers them all; otherwise a persistent grid of 1 or 2
        # programs per SM, so a tile's epilogue overlaps the next tile's loads). PARTS = 2 (mode fp32, fp32_attention):
        # q / k / v descriptors over the split copies (hi, lo columns), two shared buffers per tile, and Scales
        # (FP32 [B * H, 2]) holding each head's logit and output multipliers; PARTS = 1 never reads Scales. o_desc:
        # O ([B, H, Nq, D] at strides sob, soh, som) in q's block and layout, written by TMA_OUT builds (Q
        # double-buffered, O in q's dtype, PARTS = 1); the others store through O and never read it.
        # PIECES (key_pieces): the work tiles from n_whole on run as `pieces` items each, piece_tiles key tiles apiece
        # (the last the rest), whose partial states go to the FP32 workspace passed as Scales (PARTS = 1 has no other
        # use for it) for _piece_merge_kernel; without PIECES, n_whole, pieces and piece_tiles are never read.
        gl.static_assert(not TMA_OUT or (Q_BUFS >= 2 and PARTS == 1), "O staged in a double-buffered Q tile")
        gl.static_assert(not PIECES or (PARTS == 1 and not TMA_OUT and not ONE_TILE and TAIL_N == BLOCK_N
                                        and TAIL_N2 == 0), "pieces: one part, O from registers, whole last key tiles")
        gl.static_assert(not (PINGPONG and (CONSUMERS != 2 or TAIL_N2 > 0)), "ping-pong needs two consumers and "
                         "one part per last key tile (the turn counts)")
        gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2 or CONSUMERS == 3 or CONSUMERS == 4,
                         "1, 2, 3 or 4 consumer warpgroups")
        q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn = _shared_buffers(
            q_desc, k_desc, v_desc, BLOCK_M, STAGES, Q_BUFS, CONSUMERS, PARTS)
        # one branch per consumer count: the partition list is built at trace time, one entry per warpgroup
        if CONSUMERS == 1:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 0,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, H, GROUP,
                             Nq, Nk, n_work, n_whole, pieces, piece_tiles, BLOCK_M, BLOCK_N, STAGES, Q_BUFS,
                             CONSUMERS, PARTS, PIECES)),
            ], [1], [24])
        elif CONSUMERS == 2:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 0,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 1,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, H, GROUP,
                             Nq, Nk, n_work, n_whole, pieces, piece_tiles, BLOCK_M, BLOCK_N, STAGES, Q_BUFS,
                             CONSUMERS, PARTS, PIECES)),
            ], [4, 1], [CONSUMER_REGS, 24])
        elif CONSUMERS == 3:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 0,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 1,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 2,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, H, GROUP,
                             Nq, Nk, n_work, n_whole, pieces, piece_tiles, BLOCK_M, BLOCK_N, STAGES, Q_BUFS,
                             CONSUMERS, PARTS, PIECES)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 0,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 1,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 2,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_consumer, (q_smem, k_smem, v_smem, l_smem, q_ready, q_empty, ready, empty, turn, o_desc, O, LSE,
                             Scales, sob, soh, som, H, Nq, Nk, n_work, n_whole, pieces, piece_tiles, qk_scale, 3,
                             BLOCK_M, BLOCK_N, HEAD_D, STAGES, PINGPONG, Q_BUFS, TAIL_N, TAIL_N2, CONSUMERS,
                             ONE_TILE, WRITE_LSE, PARTS, TMA_OUT, PIECES)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, H, GROUP,
                             Nq, Nk, n_work, n_whole, pieces, piece_tiles, BLOCK_M, BLOCK_N, STAGES, Q_BUFS,
                             CONSUMERS, PARTS, PIECES)),
            ], [4, 4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, 24])


def kernel_constexprs(cfg: dict, head_dim: int, write_lse: bool = False, tma_out: bool = False) -> dict:
    """The constexpr arguments of :func:`_half_fwd_kernel` for a :func:`get_config` dict (launches,
    offline compiles and their tests build the kernel from this one mapping); ``write_lse``: also write the
    per-row log-sum-exp the backward reads; ``tma_out``: write O by TMA stores (:func:`tma_output`)."""
    return dict(BLOCK_M=cfg["BLOCK_M"] // cfg["consumers"], BLOCK_N=cfg["BLOCK_N"], HEAD_D=head_dim,
                STAGES=cfg["STAGES"], PINGPONG=cfg["PINGPONG"], CONSUMER_REGS=cfg["consumer_regs"],
                Q_BUFS=cfg["q_buffers"], TAIL_N=cfg["tail_keys"][0], TAIL_N2=cfg["tail_keys"][1],
                CONSUMERS=cfg["consumers"], ONE_TILE=cfg["one_tile"], WRITE_LSE=bool(write_lse), PARTS=cfg["parts"],
                TMA_OUT=bool(tma_out), PIECES=cfg.get("pieces", 1) > 1)


def tma_output(cfg: dict, out_dtype: torch.dtype, in_dtype: torch.dtype, out_strides: tuple[int, int, int]) -> bool:
    """Whether a launch writes O by TMA stores through the consumers' Q tiles: Q double-buffered (the next work
    tile's Q then loads into the other buffer while this one holds O), one part (fp16 / bf16), O in the inputs'
    dtype (the staged tile is a Q tile) at 16-byte-aligned (batch, head, row) strides ``out_strides`` (elements).
    Short and mid-length calls gain most: the accumulator layout's 4-byte stores take 1-1.6 us a work tile there
    (docs/tuning.md: O by a TMA store)."""
    return (cfg["q_buffers"] >= 2 and cfg["parts"] == 1 and out_dtype == in_dtype
            and all(s * out_dtype.itemsize % 16 == 0 for s in out_strides))


def _descriptor_blocks(cfg: dict, head_dim: int) -> dict[str, tuple[int, ...]]:
    # the TMA block of each descriptor argument: one consumer's Q tile, a K / V tile ([B, H, N, D] order)
    rows = {"q_desc": cfg["BLOCK_M"] // cfg["consumers"], "k_desc": cfg["BLOCK_N"], "v_desc": cfg["BLOCK_N"]}
    return {name: (1, 1, n, head_dim) for name, n in rows.items()}


def descriptor_types(cfg: dict, head_dim: int, dtype: torch.dtype = torch.float16) -> dict[str, str]:
    """Signature types of the four descriptor arguments (``q_desc`` ... ``o_desc``, O's in q's block) for an
    offline compile."""
    tname = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    types = {name: f"tensordesc<{tname}[{','.join(map(str, block))}],{nvmma_layout(block, dtype)!r}>"
             for name, block in _descriptor_blocks(cfg, head_dim).items()}
    return dict(types, o_desc=types["q_desc"])


def half_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``softmax(scale q k^T) v`` with FP16 / BF16 tensor-core products on Hopper, Gluon kernel.

    Args:
        q: [B, H, Nq, D] float16 or bfloat16 CUDA (compute capability 9.x); k: [B, H, Nk, D];
            v: [B, H, Nk, D], same dtype; D in :data:`HEAD_DIMS`; any TMA-legal strides (see
            :func:`unsupported_reason`).
        scale: logit scale, > 0 (the row max is taken on the unscaled product).
        out_dtype: output dtype (the inputs' by default, or float32), rounded once from ``W / S``.

    Returns:
        [B, H, Nq, D], a view of a contiguous [B, Nq, H, D] buffer, as the Triton kernels return.

    Raises:
        ValueError: a call :func:`unsupported_reason` refuses (``scale <= 0`` among them).
        TypeError: an ``out_dtype`` the kernels do not write.
    """
    cfg = config_for(q, k)
    return checked_call("half_attention", "'fp16' / 'bf16'", unsupported_reason(q, k, v, None, None, False, scale, 1),
                        q, k, out_dtype or q.dtype, lambda out: launch(q, k, v, scale, out, cfg))


@triton.jit(do_not_specialize=["Nq", "n_work", "n_whole", "pieces"])
def _piece_merge_kernel(Ws, Out, Lse, sob, soh, som, H, Nq, n_work, n_whole, pieces, ROWS: tl.constexpr,
                        HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, WRITE_LSE: tl.constexpr):
    """O (and with ``WRITE_LSE`` the natural-log LSE) of ``BLOCK_M`` rows of the work tiles from ``n_whole`` on, folded
    from their ``pieces`` partial states in the workspace ``Ws`` (:func:`piece_workspace`) by
    :func:`.elsa_fwd.merge_partials` (the ELSA monoid merge, deterministic). Row ``r`` of the split tiles is row
    ``r % ROWS`` of work tile ``n_whole + r // ROWS`` (batch-major, head, query tile: the forward kernel's order);
    rows past ``Nq`` are not written."""
    plane = (n_work - n_whole) * ROWS
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < plane
    offs_d = tl.arange(0, HEAD_D)
    m, s, w = merge_partials(Ws, Ws + pieces * plane, Ws + 2 * pieces * plane, pieces, row_ok, plane, r, offs_d,
                             offs_d < HEAD_D, HEAD_D, BLOCK_M, BLOCK_P, HEAD_D)
    tile = n_whole + r // ROWS
    tiles_m = tl.cdiv(Nq, ROWS)
    bh = (tile // tiles_m).to(tl.int64)
    row = (tile % tiles_m) * ROWS + r % ROWS
    ok = row_ok & (row < Nq)
    o_rows = (bh // H) * sob + (bh % H) * soh + row.to(tl.int64) * som
    tl.store(Out + o_rows[:, None] + offs_d[None, :], w.to(Out.dtype.element_ty), mask=ok[:, None])
    if WRITE_LSE:  # as the forward kernel writes it: (m + log2 S) ln 2
        tl.store(Lse + bh * Nq + row, (m + tl.math.log2(s)) * 0.6931471805599453, mask=ok)


def piece_workspace(cfg: dict, n_work: int, head_dim: int, device: torch.device) -> int:
    """FP32 elements of the workspace of a launch with key pieces: ``pieces x rows`` partial states, rows the split
    work tiles' (those past :func:`whole_tiles`), in three parts (m [P, rows], S [P, rows], O / S [P, rows, head
    dim]) that the kernel's pieces write and :func:`_piece_merge_kernel` reads; each call allocates its own."""
    return (n_work - whole_tiles(cfg, n_work, device)) * cfg["BLOCK_M"] * cfg["pieces"] * (2 + head_dim)


def whole_tiles(cfg: dict, n_work: int, device: torch.device) -> int:
    """Work tiles a launch runs whole: all, or with key pieces those of the persistent grid's full rounds."""
    if cfg.get("pieces", 1) <= 1:
        return n_work
    return n_work // sm_count(device) * sm_count(device)


class _PiecesLaunch:
    """A launch with key pieces: the forward kernel (whole work tiles and pieces; the pieces' partial states into a
    workspace of ``ws_numel`` FP32 elements allocated per call) then the merge launch writing the split tiles' rows of
    O (and the LSE)."""

    __slots__ = ("kernel", "merge", "merge_fixed", "ws_numel")

    def __init__(self, kernel: PlannedLaunch, merge: KernelCall, merge_fixed: tuple, ws_numel: int):
        self.kernel, self.merge, self.merge_fixed, self.ws_numel = kernel, merge, merge_fixed, ws_numel

    def __call__(self, q, k, v, scale, out, lse=None, scales=None):
        ws = torch.empty(self.ws_numel, dtype=torch.float32, device=q.device)
        self.kernel(q, k, v, scale, out, lse, ws)
        self.merge(ws, out, out if lse is None else lse, *self.merge_fixed)

    def descriptors_direct(self) -> bool:
        """Whether the forward kernel's calls take the direct descriptor launch (:class:`._launch.PlannedLaunch`)."""
        return self.kernel.descriptors_direct()


def planned_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: dict, write_lse: bool = False,
                   out_strides: tuple[int, int, int] | None = None, out_dtype: torch.dtype | None = None):
    """The launch of :func:`half_attention`'s kernel for this call signature (shapes, strides, alignment,
    ``cfg``), as a callable ``(q, k, v, scale, out, lse=None, scales=None) -> None`` for later calls with the same
    signature, without checks: for a caller that ran :func:`unsupported_reason` and :func:`get_config` already (the
    dense launcher's plans). The TMA descriptors are built and validated once, here; a call copies them onto its
    tensors. With ``write_lse`` every call passes ``lse``, a contiguous float32 [B, H, Nq] buffer that receives
    the rows' natural-log log-sum-exp of ``scale q k^T`` (what the backward kernels recompute P from). A config
    with ``parts = 2`` takes the split copies [B, H, N, 2 D] of :class:`.scaled_fp16.ForwardOperands` and their
    ``scales`` (:mod:`.fp32_gluon`). ``out_strides``: the (batch, head, row) strides of ``out`` where it is not the
    plan's own heads-inner buffer (a view of a larger one). ``out_dtype``: ``out``'s (q's by default); where
    :func:`tma_output` allows, for the plan's own buffer only (a view may sit at an unaligned offset), O is written
    by TMA stores through a fourth descriptor rebased onto each call's ``out``."""
    B, H, Nq, D = q.shape
    D //= cfg["parts"]
    Nk = k.shape[2]
    templates = [TensorDescriptor.from_tensor(t, list(block), nvmma_layout(block, q.dtype))
                 for t, block in zip((q, k, v), _descriptor_blocks(cfg, D).values())]
    for t in templates:  # a cached plan must not keep this call's tensors (and what they view) alive
        t.base = None
    strides = out_strides or heads_inner_layout(B, H, Nq, D)[1][:3]
    tma_out = out_strides is None and tma_output(cfg, out_dtype or q.dtype, q.dtype, strides)
    if tma_out:  # O [B, H, Nq, D] at the plan's strides, in Q's block and layout (q only stands in for the check)
        o_template = TensorDescriptor(q, [B, H, Nq, D], [*strides, 1], list(templates[0].block_shape),
                                      templates[0].layout)
        o_template.base = None
    else:  # never read: q's descriptor stands in
        o_template = templates[0]
    n_work = cdiv(Nq, cfg["BLOCK_M"]) * B * H
    pieces = cfg.get("pieces", 1)
    n_whole = whole_tiles(cfg, n_work, q.device)
    n_items = n_whole + (n_work - n_whole) * pieces
    grid = min(n_items, cfg["ctas_per_sm"] * sm_count(q.device)) if cfg["persistent"] else n_items
    call = KernelCall(_half_fwd_kernel, (grid,), kernel_constexprs(cfg, D, write_lse, tma_out),
                      dict(num_warps=4, maxnreg=cfg["maxnreg"]))
    # out: the plan's heads-inner buffer; k / v may have fewer heads (grouped-query attention)
    fixed = (*strides, H, H // k.shape[1], Nq, Nk, n_work, n_whole, pieces, cfg.get("piece_tiles") or 0)
    kernel = PlannedLaunch(call, fixed, [*templates, o_template], scales_arg=True, o_base="out" if tma_out else "q")
    if pieces <= 1:
        return kernel
    rows = (n_work - n_whole) * cfg["BLOCK_M"]
    block_p = pad_pow2(pieces)
    block_m = max(1, min(16, 8192 // (block_p * D)))
    merge = KernelCall(_piece_merge_kernel, (cdiv(rows, block_m),),
                       dict(ROWS=cfg["BLOCK_M"], HEAD_D=D, BLOCK_M=block_m, BLOCK_P=block_p, WRITE_LSE=bool(write_lse)),
                       dict(num_warps=4))
    return _PiecesLaunch(kernel, merge, (*strides, H, Nq, n_work, n_whole, pieces),
                         piece_workspace(cfg, n_work, D, q.device))


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor, cfg: dict) -> None:
    """One :func:`planned_launch` into ``out`` (heads-inner, as :func:`._launch.allocate_output` makes it)."""
    planned_launch(q, k, v, cfg, out_dtype=out.dtype)(q, k, v, float(scale), out)
