"""Mode fp32's attention forward on the warp-specialized Hopper kernel of :mod:`.half_gluon` (split-FP16 products).

The Triton kernel of :mod:`.elsa_fwd` forms mode fp32's products as split-FP16 (:mod:`.split16`'s f16x3: hi and lo
FP16 parts, three tensor-core products each) from the same warps that load the tiles. This module runs the same
arithmetic on :mod:`.half_gluon`'s FlashAttention-3 schedule (TMA producer warp, two consumer warpgroups of 64 rows,
``S_{t+1}`` in flight beside ``P_t V_t``) with ``PARTS = 2``:

* q, k and v are scaled per (batch, head) by powers of two and split into hi and lo FP16 parts first
  (:class:`.scaled_fp16.ForwardOperands`: a head-max pass and a split pass, both memory-bound, each reading the
  FP32 inputs once, in place);
* every product is three wgmmas (lo hi + hi lo + hi hi, FP32 accumulation), P is scaled by 2^15 before its split;
* each key tile's ``P V`` is formed in a fresh accumulator and added to the running output in FP32 (summed in the
  wgmma accumulator tile after tile, its error would grow with the keys, as the backward's dK / dV did);
* each head's Scales row replaces the logit scale and undoes v's and P's scales on the output.

The results are within mode fp32's contract (2e-6 relative to float64; the GPU tests: heads of magnitude 1e-6 ..
1e6, 1-65536 keys). The scaling is per head, not per row: an entry far below its head's largest keeps its absolute
precision (2^-38 of the largest), not its relative one (:mod:`.scaled_fp16`).

Scope (:func:`unsupported_reason`): float32 q / k / v with a contiguous head dim (other strides any), head dim 64
or 128 for both, key / value heads dividing the query heads (grouped-query attention: the operand pass copies each
K / V head once and the kernel reads head ``h // (H / Hkv)``), no bias / mask / causal, no split-KV, compute
capability 9.x.
The dense launcher takes the calls :func:`preferred` names. The split copies take as many bytes as q, k and v; a call
whose copies pass :data:`CHUNK_BYTES` runs in chunks of heads (:func:`chunks`), so they never hold more than that.
"""
from __future__ import annotations

import torch

from . import half_gluon
from ._gluon import checked_call, hopper_copies_scope_reason
from ._launch import heads_inner_layout, sm_count
from .scaled_fp16 import ForwardOperands

_IMPORT_ERROR = half_gluon._IMPORT_ERROR

__all__ = ["fp32_attention", "planned_launch", "unsupported_reason", "preferred", "config_for", "get_config",
           "chunks", "HEAD_DIMS", "TILES", "MIN_KEYS", "CHUNK_BYTES", "CHUNK_MIN_WAVES"]

HEAD_DIMS = (64, 128)
# key tile, K / V ring slots and Q buffers by head dim (get_config)
TILES = {64: (64, 4, 2), 128: (32, 4, 1)}
# the dense launcher takes this kernel from this many keys: below, the operand pass costs more than the kernel
# gains (docs/tuning.md: fp32 forward on the Gluon kernel)
MIN_KEYS = 256


def preferred(n_q: int, n_k: int, head_dim: int) -> bool:
    """Whether the dense launcher runs an in-scope fp32 call of ``n_q`` query rows and ``n_k`` keys on this kernel
    rather than the Triton kernel: from :data:`MIN_KEYS` keys (docs/tuning.md: fp32 forward on the Gluon
    kernel)."""
    return n_k >= MIN_KEYS


def get_config(n_k: int, head_dim: int = 64) -> dict:
    """:func:`.half_gluon.get_config`'s two-consumer config (128 query rows per CTA, 64 per consumer warpgroup) with
    ``parts = 2`` and the key tiles and stages of :data:`TILES` (the last tile cut as :func:`.half_gluon.last_key_tile`
    cuts it). Head dim 64: 64-key tiles in 4 stages; the hi and lo parts of two Q buffers (2 x 2 x 2 x 64 x 64 FP16)
    and of the 4-slot K / V ring (4 x 2 x 2 x 64 x 64) take 192 KiB of shared memory. 128-key tiles (2 stages: a
    third does not fit) run 1.2-1.4x slower: S and P's two parts of 128 keys leave the consumers too few registers.
    Head dim 128: one Q buffer (2 x 2 x 64 x 128) and a 4-slot ring of 32-key tiles (4 x 2 x 2 x 32 x 128), 192
    KiB as well; 64-key tiles in 2 stages spill more (docs/tuning.md: fp32 forward on the Gluon kernel).

    Raises:
        ValueError: a head dim outside :data:`HEAD_DIMS`.
    """
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim}; the split-FP16 Gluon forward takes {HEAD_DIMS}")
    block_n, stages, q_buffers = TILES[head_dim]
    cfg = half_gluon.get_config(n_k, head_dim, one_consumer_below=0)
    # the consumers take turns at head dim 128 at every length (the fp16 / bf16 build drops them for its 64-key tiles)
    return dict(cfg, BLOCK_N=block_n, STAGES=stages, q_buffers=q_buffers, parts=2, PINGPONG=head_dim > 64,
                **half_gluon.last_key_tile(n_k, block_n, head_dim))


def config_for(q: torch.Tensor, k: torch.Tensor) -> dict:
    """:func:`get_config` for a call's q [B, H, Nq, D] and k [B, Hkv, Nk, D]."""
    return get_config(k.shape[2], q.shape[3])


def unsupported_reason(q, k, v, bias, attn_mask, is_causal: bool, scale: float, num_splits: int) -> str | None:
    """Why :func:`fp32_attention` cannot run this call (the Triton kernel then does), or ``None``. Inputs as the
    dense launcher sees them: q [B, H, Nq, D], k / v [B, Hkv, Nk, D]; ``num_splits`` 0 = automatic. Besides the
    kernel's scope: a call whose :func:`chunks` would each hold fewer than :data:`CHUNK_MIN_WAVES` waves of work
    tiles."""
    reason = hopper_copies_scope_reason(q, k, v, bias, attn_mask, is_causal, scale, num_splits, head_dims=HEAD_DIMS,
                                        import_error=_IMPORT_ERROR, grouped=True)
    B, H, Nq, D = q.shape
    parts = chunks(B, H, Nq, k.shape[2], D, H // k.shape[1]) if reason is None else [None]
    if len(parts) > 1:
        heads = min(len(range(B)[bs]) * len(range(H)[hs]) for bs, hs in parts)
        if heads * -(-Nq // 128) < CHUNK_MIN_WAVES * sm_count(q.device):
            return (f"the split copies ({CHUNK_BYTES >> 20} MiB at most) would run in chunks of {heads} heads, too few "
                    f"query tiles to fill the GPU")
    return reason


# the split copies of one launch take at most this many bytes (or one head's): a larger call runs in chunks of
# heads or batch items, each with its own copies, so long sequences (VGGT's global attention over hundreds of frames)
# do not hold a second q / k / v's worth of memory. A chunked call whose chunks would hold fewer than
# CHUNK_MIN_WAVES waves of work tiles (few query rows against very many keys) stays on the Triton kernel
CHUNK_BYTES = 512 << 20
CHUNK_MIN_WAVES = 8


def chunks(B: int, H: int, Nq: int, Nk: int, D: int, group: int = 1) -> list[tuple[slice, slice]]:
    """``(batch slice, query head slice)`` of each launch of a [B, H, Nq, D] x [B, H / group, Nk, D] call (``group``
    query heads per key / value head): as many key / value heads, each with its ``group`` query heads, per chunk as
    the split copies (``4 D (group Nq + 2 Nk)`` bytes each) of :data:`CHUNK_BYTES` hold, at least one; whole batch
    items per chunk where a chunk holds all heads, else heads of one batch item (so that each chunk's output and
    LSE are plain views); near-equal chunks; one for a call within the budget. A chunk's key / value heads are its
    query heads' ``slice(start // group, stop // group)``."""
    h_kv = H // group
    max_heads = max(1, CHUNK_BYTES // (4 * D * (group * Nq + 2 * Nk)))
    if max_heads >= B * h_kv:
        return [(slice(0, B), slice(0, H))]
    if max_heads >= h_kv:
        n = -(-B // (max_heads // h_kv))
        return [(slice(B * i // n, B * (i + 1) // n), slice(0, H)) for i in range(n)]
    n = -(-h_kv // max_heads)
    return [(slice(b, b + 1), slice(h_kv * i // n * group, h_kv * (i + 1) // n * group))
            for b in range(B) for i in range(n)]


def planned_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: dict, write_lse: bool = False):
    """The launch of this call signature as a callable ``(q, k, v, scale, out, lse=None) -> None`` (as
    :func:`.half_gluon.planned_launch`'s; ``out`` heads-inner, ``lse`` contiguous): per chunk of :func:`chunks`, the
    split operands of its heads (:class:`.scaled_fp16.ForwardOperands`; k / v may have fewer heads, dividing q's),
    then the kernel with ``PARTS = 2`` writing into the chunk's view of ``out`` / ``lse``; TMA descriptors built on
    the first call's operand copies, one plan per chunk shape."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    group = H // k.shape[1]
    parts = chunks(B, H, Nq, Nk, D, group)
    out_strides = heads_inner_layout(B, H, Nq, D)[1][:3]
    plans = {}  # chunk shape -> (operands, kernel launch or None until the first call)

    def launch(q, k, v, scale, out, lse=None):
        for bs, hs in parts:
            qc, kc, vc, oc, lc = q, k, v, out, lse
            if len(parts) > 1:  # the chunk's views
                kvs = slice(hs.start // group, hs.stop // group)
                qc, kc, vc, oc = q[bs, hs], k[bs, kvs], v[bs, kvs], out[bs, hs]
                lc = None if lse is None else lse[bs, hs]
            shape = qc.shape[:2]
            if shape not in plans:
                plans[shape] = [ForwardOperands(*shape, Nq, Nk, D, kc.shape[1]), None]
            ops, kernel = plans[shape]
            q16, k16, v16, scales = ops(qc, kc, vc, scale)
            if kernel is None:
                kernel = plans[shape][1] = half_gluon.planned_launch(q16, k16, v16, cfg, write_lse, out_strides)
            kernel(q16, k16, v16, scale, oc, lc, scales)
            del q16, k16, v16  # before the next chunk's copies: one chunk's at a time

    return launch


def fp32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``softmax(scale q k^T) v`` in mode fp32 on Hopper: split-FP16 tensor-core products on the Gluon kernel.

    Args:
        q: [B, H, Nq, D] float32 CUDA (compute capability 9.x), D in :data:`HEAD_DIMS`, contiguous head dim; k, v:
            [B, Hkv, Nk, D] float32, Hkv dividing H (grouped-query attention: query head h reads K / V head
            ``h // (H / Hkv)``).
        scale: logit scale, > 0.
        out_dtype: output dtype (float32 by default), rounded once from ``W / S``.

    Returns:
        [B, H, Nq, D], a view of a contiguous [B, Nq, H, D] buffer, within mode fp32's contract (2e-6 relative
        to float64).

    Raises:
        ValueError: a call :func:`unsupported_reason` refuses (``scale <= 0`` among them).
        TypeError: an ``out_dtype`` the kernels do not write.
    """
    reason = unsupported_reason(q, k, v, None, None, False, scale, 1)
    cfg = config_for(q, k)
    return checked_call("fp32_attention", "'fp32'", reason, q, k, out_dtype or q.dtype,
                        lambda out: planned_launch(q, k, v, cfg)(q, k, v, float(scale), out))
