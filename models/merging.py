"""FastVGGT token merging for VGGT's global attention (training-free, same weights).

FastVGGT (Shen et al. 2025, "FastVGGT: Training-Free Acceleration of Visual
Geometry Transformer", code mystorm16/FastVGGT) merges tokens inside the global
attention blocks only:

* similarity: cosine between tokens of the block's normalised input ``norm1(x)``;
* destinations (kept, receive merges): every token of the reference frame 0, the
  5 special tokens (camera + registers) of every frame, and one randomly picked
  token (fixed seed) per ``sy x sx`` (2 x 2) region of every other frame's patch grid;
* protected: ``protect`` (10 %) of all tokens, evenly strided over the sequence,
  are appended unmerged (a protected destination therefore appears twice, as in
  FastVGGT);
* every other token (source) is averaged into its most similar destination
  (``mean`` including the destination itself); at most ``ratio * N`` sources are
  merged, the least similar remaining ones are kept unmerged;
* q, k, v are merged after RoPE; attention runs over the merged sequence
  [unmerged sources, destinations, protected]; after the output projection every
  token takes the output of the slot it went to (unmerge), so the block still
  returns all N tokens.

Differences from the FastVGGT code, on purpose: the 2 x 2 destination pattern is
laid out on the true patch grid also when the grid width is odd (FastVGGT writes
its pattern row-major over an even-width grid, which shifts it on 37-wide grids);
merged means of half-precision q, k, v are accumulated in FP32; when no token would
be merged (S = 1) the block runs unmerged. Similarities are BF16 matmuls on CUDA
as in FastVGGT (``sim_dtype``; FP32 would cost ~8 TFLOP per block at 200 frames)
and FP32 on CPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["TokenMerging", "FASTVGGT_MERGING", "MergePlan", "plan_merge", "as_merging"]


@dataclass(frozen=True)
class TokenMerging:
    """FastVGGT merging settings.

    Attributes:
        start_block: first global block (0-based) that merges (FastVGGT's ``merging``; 0 = all).
        ratio: at most ``int(ratio * N)`` source tokens are merged (0.9).
        protect: fraction of tokens kept unmerged, evenly strided (0.1).
        region: (sy, sx) destination region on the patch grid, one destination per region ((2, 2)).
        seed: seed of the destination pick (33, as FastVGGT).
        num_special: special tokens per frame (camera + 4 registers = 5).
        sim_chunk: source rows per similarity chunk (memory bound of the plan).
        sim_dtype: dtype of the similarity matmul on CUDA (bfloat16 as FastVGGT; CPU uses float32).
    """

    start_block: int = 0
    ratio: float = 0.9
    protect: float = 0.1
    region: tuple[int, int] = (2, 2)
    seed: int = 33
    num_special: int = 5
    sim_chunk: int = 4096
    sim_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.start_block < 0:
            raise ValueError(f"start_block={self.start_block} must be >= 0")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio={self.ratio} must be in [0, 1]")
        if not 0.0 <= self.protect < 1.0:
            raise ValueError(f"protect={self.protect} must be in [0, 1)")
        if len(self.region) != 2 or min(self.region) < 1:
            raise ValueError(f"region={self.region} must be two positive ints (sy, sx)")


FASTVGGT_MERGING = TokenMerging()


def as_merging(merging) -> TokenMerging | None:
    """Normalise the ``merging`` argument of VGGT.

    ``None`` / ``False`` / ``0`` -> disabled (exactly VGGT); a :class:`TokenMerging`
    -> itself; a dict -> ``TokenMerging(**dict)``; ``True`` -> :data:`FASTVGGT_MERGING`.

    Raises:
        TypeError: anything else (FastVGGT's integer ``merging=k`` is
            ``TokenMerging(start_block=k)`` here; an int other than 0 is refused to
            avoid confusing "0 = disabled" with FastVGGT's "0 = from block 0").
    """
    if merging is None or merging is False or (isinstance(merging, int) and not isinstance(merging, bool)
                                               and merging == 0):
        return None
    if merging is True:
        return FASTVGGT_MERGING
    if isinstance(merging, TokenMerging):
        return merging
    if isinstance(merging, dict):
        return TokenMerging(**merging)
    raise TypeError(f"merging={merging!r}: expected None/0 (off), True, a TokenMerging or a dict of its fields; "
                    f"for FastVGGT's merging=k pass TokenMerging(start_block=k)")


class MergePlan:
    """Index plan of one merging step for a batch [B, N, C] -> merged length M.

    Attributes (all long/float tensors on the tokens' device):
        keep_idx [B, M]: token index of every merged slot (unmerged sources, destinations, protected).
        src_idx [B, R]: merged source tokens; src_slot [B, R]: the slot each one is averaged into.
        counts [B, M]: 1 + number of sources averaged into the slot.
        source_map [B, N]: slot whose output every token takes after attention (unmerge).
    """

    def __init__(self, keep_idx, src_idx, src_slot, counts, source_map):
        self.keep_idx, self.src_idx, self.src_slot = keep_idx, src_idx, src_slot
        self.counts, self.source_map = counts, source_map

    @property
    def merged_len(self) -> int:
        return self.keep_idx.shape[1]

    def merge(self, t: torch.Tensor) -> torch.Tensor:
        """q, k or v [B, H, N, D] -> merged [B, H, M, D] (same dtype; means accumulated in FP32).

        Each slot starts from its kept token and adds its merged sources in plan order.
        """
        acc = torch.promote_types(t.dtype, torch.float32)  # half inputs: FP32 sums
        out = _take(t, 2, self.keep_idx).to(acc)
        _add_into(out, 2, self.src_slot, _take(t, 2, self.src_idx).to(acc))
        out /= self.counts[:, None, :, None]
        return out.to(t.dtype)

    def unmerge(self, o: torch.Tensor) -> torch.Tensor:
        """Projected output [B, M, C] -> [B, N, C] (each token copies its slot's output)."""
        return _take(o, 1, self.source_map)


def _take(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """``t`` with dimension ``dim`` (1 or 2) re-indexed per batch row: idx [B, K] -> size K there.

    Batch size 1 (VGGT's usual case) takes whole slices with ``index_select`` (one index per
    slice, contiguous slice copies); larger batches use ``gather`` with the index broadcast over
    the other dimensions. Both are plain copies, so the result is the same either way.
    """
    if t.shape[0] == 1:
        return t.index_select(dim, idx[0])
    shape = list(t.shape)
    shape[dim] = idx.shape[1]
    view = idx.reshape(idx.shape[0], *([1] * (dim - 1)), idx.shape[1], *([1] * (t.dim() - dim - 1)))
    return torch.gather(t, dim, view.expand(shape))


def _add_into(out: torch.Tensor, dim: int, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``out[b, ..., idx[b, r], ...] += src[b, ..., r, ...]`` along ``dim`` (in place, sources in order r)."""
    if out.shape[0] == 1:
        out.index_add_(dim, idx[0], src)
        return
    view = idx.reshape(idx.shape[0], *([1] * (dim - 1)), idx.shape[1], *([1] * (out.dim() - dim - 1)))
    out.scatter_add_(dim, view.expand(src.shape), src)


def _destination_mask(S: int, h: int, w: int, cfg: TokenMerging) -> torch.Tensor:
    """[S * P] bool on the CPU, True for destination tokens (P = num_special + h * w)."""
    P = cfg.num_special + h * w
    dst = torch.zeros(S, P, dtype=torch.bool)
    dst[0] = True
    dst[:, :cfg.num_special] = True
    sy, sx = cfg.region
    hr, wr = h // sy, w // sx
    if S > 1 and hr > 0 and wr > 0:
        gen = torch.Generator().manual_seed(cfg.seed)
        pick = torch.randint(sy * sx, (S - 1, hr, wr), generator=gen)
        ys = torch.arange(hr)[None, :, None] * sy + pick // sx
        xs = torch.arange(wr)[None, None, :] * sx + pick % sx
        flat = (cfg.num_special + ys * w + xs).reshape(S - 1, -1)
        dst[1:].scatter_(1, flat, True)
    return dst.reshape(-1)


@functools.lru_cache(maxsize=8)
def _token_sets(S: int, h: int, w: int, cfg: TokenMerging, device: torch.device):
    """Destination, protected and candidate-source token indices (long [Dn], [Pn], [Nc], ascending, on ``device``).

    They depend on the sequence layout only, not on the tokens: built once on the CPU and
    kept per (S, h, w, cfg, device), so the global blocks of a forward (and later forwards of
    the same size) neither rebuild them nor wait on the device for ``nonzero``.
    """
    N = S * (cfg.num_special + h * w)
    is_dst = _destination_mask(S, h, w, cfg)
    n_prot = int(N * cfg.protect)
    prot = torch.arange(0, N, max(1, N // n_prot))[:n_prot] if n_prot > 0 else torch.zeros(0, dtype=torch.long)
    is_prot = torch.zeros(N, dtype=torch.bool)
    is_prot[prot] = True
    cand = (~is_dst & ~is_prot).nonzero().squeeze(1)  # mergeable sources
    return tuple(t.to(device) for t in (is_dst.nonzero().squeeze(1), prot, cand))


@torch.no_grad()
def plan_merge(metric: torch.Tensor, S: int, h: int, w: int, cfg: TokenMerging) -> MergePlan | None:
    """Build the FastVGGT merge plan from a global block's normalised input.

    Args:
        metric: norm1(x) [B, N, C], N = S * (num_special + h * w), frame-major.
        S, h, w: frames and patch grid.
        cfg: :class:`TokenMerging`.

    Returns:
        a :class:`MergePlan`, or None when no token would be merged.

    Raises:
        ValueError: N does not match S, h, w.
    """
    B, N, _ = metric.shape
    P = cfg.num_special + h * w
    if N != S * P:
        raise ValueError(f"global tokens N={N} != S * (num_special + h * w) = {S} * {P}")
    dev = metric.device
    dst_idx, prot, cand = _token_sets(S, h, w, cfg, dev)
    r = min(int(N * cfg.ratio), cand.numel())
    if r == 0:
        return None
    m = metric.float()
    m = (m / m.norm(dim=-1, keepdim=True)).to(cfg.sim_dtype if m.is_cuda else torch.float32)
    b = m[:, dst_idx]  # [B, Dn, C]
    best = torch.empty(B, cand.numel(), device=dev)
    arg = torch.empty(B, cand.numel(), dtype=torch.long, device=dev)
    for i in range(0, cand.numel(), cfg.sim_chunk):
        sim = torch.bmm(m[:, cand[i:i + cfg.sim_chunk]], b.transpose(1, 2))
        mx = sim.max(dim=2)
        best[:, i:i + cfg.sim_chunk], arg[:, i:i + cfg.sim_chunk] = mx.values.float(), mx.indices
        del sim
    order = best.argsort(dim=1, descending=True)
    merged, kept = order[:, :r], order[:, r:]
    U, Dn, Pn = kept.shape[1], dst_idx.numel(), prot.numel()
    unm_tok = cand[kept]  # [B, U]
    src_idx = cand[merged]  # [B, R]
    src_slot = U + torch.gather(arg, 1, merged)
    keep_idx = torch.cat([unm_tok, dst_idx.expand(B, Dn), prot.expand(B, Pn)], dim=1)
    counts = torch.ones(B, U + Dn + Pn, device=dev)
    counts.scatter_add_(1, src_slot, torch.ones_like(src_slot, dtype=counts.dtype))
    source_map = torch.empty(B, N, dtype=torch.long, device=dev)
    ar = torch.arange
    source_map.scatter_(1, unm_tok, ar(U, device=dev).expand(B, U))
    source_map[:, dst_idx] = U + ar(Dn, device=dev)
    source_map.scatter_(1, src_idx, src_slot)
    source_map[:, prot] = U + Dn + ar(Pn, device=dev)
    return MergePlan(keep_idx, src_idx, src_slot, counts, source_map)
