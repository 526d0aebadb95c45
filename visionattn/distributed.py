"""Context-parallel attention: the sequence split across the ranks of a ``torch.distributed`` group.

Each rank holds a contiguous shard of the sequence (rank order = sequence order; shards may differ in
length, zero included) and wants the exact attention of its own queries over *all* keys. Two schemes
compute it (:func:`context_parallel_attention` picks one per call, ``scheme=``):

**Ring** (Ring Attention; Liu et al., 2023). The keys and values travel around a ring: at step ``i`` rank
``r`` holds the KV shard of rank ``(r - i) mod W``, computes the partial attention of its queries against
it, ``(out_i, lse_i)`` with the per-row log-sum-exp ``lse_i = log sum_j exp(s_ij)``, and folds it into its
running result with the monoid merge in log-sum-exp form (ELSA supplement, Eq. 4; FlashAttention's online
softmax across blocks, Ring Attention's merge across devices):

    lse = logaddexp(lse_a, lse_b),   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse),

the (m, S, W) merge of :mod:`visionattn.reference` with ``m + log S = lse`` and ``W / S = out``. A row
whose keys are all masked has ``lse = -inf`` everywhere and comes out as zeros (never NaN), as in
:func:`visionattn.attention`. The send / receive of step ``i + 1`` is posted before step ``i`` is
computed (:func:`torch.distributed.batch_isend_irecv`), so on CUDA the transfer of the next shard
overlaps the kernel of the current one. Gradients take the same ring: the shards go round again with
their dK / dV accumulators (:class:`_RingFunction`).

**Ulysses** (all-to-all head parallelism, DeepSpeed-Ulysses; Jacobs et al., 2023). One all-to-all turns
every rank's [B, H, N_r, D] shards of q, k, v into all N tokens of H / W heads (rank r: heads
``[r H / W, (r + 1) H / W)``); each rank runs :func:`visionattn.attention` on its heads; a second
all-to-all turns the output back into the rank's sequence shard. The all-to-alls are permutations of the
data, so the result is single-process attention's, head by head; their backward is the inverse
all-to-all (:class:`_HeadExchange`), around attention's own backward.

    import visionattn.distributed as vd
    out = vd.context_parallel_attention(q, k, v, mode="fp32")   # q, k, v: this rank's [B, H, N_r, D]

Backends: gloo for CPU tensors, NCCL for CUDA tensors (one GPU per rank). Nothing here runs at
``import visionattn``; this module is imported on its own (``import visionattn.distributed``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import dispatch
from .api import attention, dense_backward, dense_forward_lse, validate_attention_inputs
from .checks import caster, check_flags, first_order_only, has_backward
from .modes import Mode, get_mode, mode_names
from .reference import block_state, cpu_block_size, finalize, identity, merge, scores_and_mask

__all__ = ["SCHEMES", "context_parallel_attention", "pick_scheme", "merge_partials", "gather_sequence"]

SCHEMES = ("auto", "ring", "ulysses")  # context_parallel_attention(scheme=...): "auto" picks one of the others

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# one row per rank of the metadata every call exchanges first (float64: every field is exact)
_FIELDS = ("nq", "nk", "batch", "heads", "head_dim", "value_dim", "dtype", "mode", "is_causal", "scale", "grad",
           "bias_cols", "mask_cols", "scheme")


# ----------------------------------------------------------------------------- merge
def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets into the result over their union.

    ``lse = logaddexp(lse_a, lse_b)``; ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``, computed
    with the larger LSE as the stabiliser (detached: the result does not depend on it, so gradients are
    exact). Commutative and associative (up to rounding), with ``(0, -inf)`` as identity.

    Args:
        out_a, out_b: [..., Nq, Dv] float (the normalised outputs of each part; zeros for empty rows).
        lse_a, lse_b: [..., Nq] float, natural log; -inf where a part has no visible key.

    Returns:
        ``(out [..., Nq, Dv], lse [..., Nq])``: rows with no visible key in either part get out = 0 and
        lse = -inf, never NaN; NaN inputs propagate.
    """
    m = torch.maximum(lse_a, lse_b).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    s = wa + wb
    empty = s == 0
    safe = torch.where(empty, torch.ones_like(s), s)
    lse = torch.where(empty, torch.full_like(s, float("-inf")), m + torch.log(safe))
    out = out_a * (wa / safe).unsqueeze(-1) + out_b * (wb / safe).unsqueeze(-1)
    return out, lse


def _merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """:func:`merge_partials` in place into ``(out, lse)`` (no autograd: the forward ring), without temporaries
    of ``out``'s size."""
    m = torch.maximum(lse, lse_b)
    m.masked_fill_(torch.isneginf(m), 0.0)
    wa, wb = torch.exp(lse - m), torch.exp(lse_b - m)
    s = wa + wb
    empty = s == 0
    s.masked_fill_(empty, 1.0)
    lse.copy_(torch.log(s).add_(m).masked_fill_(empty, float("-inf")))
    out.mul_((wa / s).unsqueeze(-1)).addcmul_(out_b, (wb / s).unsqueeze(-1))


# ----------------------------------------------------------------------------- attention of one shard
def _on_kernels(q, k, v, bias, attn_mask, md: Mode) -> bool:
    """Whether the dense kernels take this call (CUDA, or the interpreter with backend ``triton``)."""
    if md.half_scores or dispatch.resolve_backend(None, q.device.type) != "triton":
        return False
    from .kernels.elsa_fwd import unsupported_reason  # imports Triton: only on the kernel path

    return unsupported_reason(q, k, v, bias, attn_mask, md.name) is None


def _attention_lse(q, k, v, bias, attn_mask, is_causal: bool, scale: float, md: Mode):
    """``(out, lse)`` of the queries against one KV shard, in the mode's arithmetic.

    q [B, H, Nq, D], k [B, H, Nk, D], v [B, H, Nk, Dv] already cast to the mode's compute dtype; bias /
    attn_mask None or [B, H, Nq, Nk] views; ``is_causal`` top-left (query and key offsets equal). Returns
    out [B, H, Nq, Dv] and lse [B, H, Nq], both float32 (lse -inf for a row with no visible key).

    Dense modes on CUDA: the forward kernel with the per-row LSE (``visionattn::attention_lse``,
    :func:`visionattn.kernels.elsa_fwd.dense_forward`). Elsewhere, and for PASA modes everywhere (their
    kernel writes no LSE): the PyTorch references of :mod:`visionattn.reference` (dense modes: the (m, S, W)
    fold over KV blocks, ``lse = m + log S``) and :func:`visionattn.pasa.pasa_attention_reference`.
    """
    if _on_kernels(q, k, v, bias, attn_mask, md):
        return dense_forward_lse(q, k, v, bias, attn_mask, is_causal, scale, md.name)
    if md.half_scores:
        from .pasa import pasa_attention_reference

        return pasa_attention_reference(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                        shift=md.pasa_shift, with_lse=True)
    qc, kc, vc = (t.float() for t in (q, k, v))  # already rounded to the compute dtype; state in FP32
    p_dtype = md.compute_dtype if md.compute_dtype in (torch.float16, torch.bfloat16) else None
    nk = k.shape[-2]
    block = cpu_block_size(nk)
    state = identity(q.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
    for start in range(0, nk, block):
        stop = min(start + block, nk)
        s = scores_and_mask(qc, kc[..., start:stop, :], scale=scale, bias=_cols(bias, start, stop),
                            attn_mask=_cols(attn_mask, start, stop), is_causal=is_causal, k_offset=start)
        state = merge(state, block_state(s, vc[..., start:stop, :], p_dtype=p_dtype))
    full = state.s > 0
    lse = torch.where(full, state.m + torch.log(torch.where(full, state.s, 1.0)), float("-inf"))
    return finalize(state), lse


def _cols(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """Key columns [start, stop) of a bias / mask (one broadcast over keys passes unchanged)."""
    if t is None or t.shape[-1] == 1:
        return t
    return t[..., start:stop]


def _shard_view(q, kv, d: int, bias, attn_mask, is_causal: bool, q0: int, k0: int):
    """``(k, v, bias, attn_mask, is_causal)`` of one packed KV shard ``kv`` [B, H, n, D + Dv] (global columns
    from ``k0``) for the local queries (global rows from ``q0``): bias / mask as [B, H, Nq, n] views, a causal
    mask at other offsets turned into a boolean mask; None when no key of the shard is visible to any query
    (empty, or entirely after the last query under ``is_causal``)."""
    nq, nk = q.shape[2], kv.shape[2]
    if nq == 0 or nk == 0 or (is_causal and k0 >= q0 + nq):
        return None
    if is_causal and k0 + nk - 1 <= q0:  # every key at or before the first query: all visible
        is_causal = False
    elif is_causal and k0 != q0:  # a shard across the diagonal at another offset: the causal part as a mask
        keep = (torch.arange(nk, device=q.device) + k0)[None, :] <= (torch.arange(nq, device=q.device) + q0)[:, None]
        attn_mask = keep if attn_mask is None else attn_mask & keep
        is_causal = False
    shape = (q.shape[0], q.shape[1], nq, nk)
    bias = None if bias is None else bias.expand(shape)
    attn_mask = None if attn_mask is None else attn_mask.expand(shape)
    return kv[..., :d], kv[..., d:], bias, attn_mask, is_causal


def _shard_attention(q, kv, d: int, bias, attn_mask, is_causal: bool, scale: float, md: Mode, q0: int, k0: int):
    """``(out, lse)`` of the local queries against one packed KV shard (:func:`_shard_view`); None when no key
    of the shard is visible to any query. ``bias`` / ``attn_mask``: the columns of this shard."""
    view = _shard_view(q, kv, d, bias, attn_mask, is_causal, q0, k0)
    if view is None:
        return None
    k, v, bias, attn_mask, is_causal = view
    return _attention_lse(q, k, v, bias, attn_mask, is_causal, scale, md)


def _shard_backward(q, kv, d: int, out, grad_out, lse, bias, attn_mask, is_causal: bool, scale: float, md: Mode,
                    q0: int, k0: int):
    """``(dq, dk, dv)`` (FP32) of the local queries' share of the loss through one packed KV shard, or None when
    no key of the shard is visible to them.

    FlashAttention-2's backward (Alg. 2) restricted to the shard's keys: with the *global* per-row ``lse`` and
    the global ``out``, ``P_ij = exp(s_ij - lse_i)`` over the shard's columns is exactly the softmax of the full
    row there, ``delta_i = sum(dO_i * O_i)``, ``dS = P (dO V^T - delta)``; so dQ sums over shards and each
    shard's dK / dV sums over ranks. Dense modes on CUDA run the backward kernels; elsewhere PyTorch in FP32 on
    the inputs rounded to the mode's compute dtype.
    """
    view = _shard_view(q, kv, d, bias, attn_mask, is_causal, q0, k0)
    if view is None:
        return None
    k, v, bias, attn_mask, is_causal = view
    if has_backward(md.name) and _on_kernels(q, k, v, bias, attn_mask, md):
        dq, dk, dv = dense_backward(q, k, v, out, grad_out, lse, bias, attn_mask, is_causal, scale, md.name)
        return dq.float(), dk.float(), dv.float()
    qf, kf, vf, of, gf = (t.float() for t in (q, k, v, out, grad_out))
    s = scores_and_mask(qf, kf, scale=scale, bias=bias, attn_mask=attn_mask, is_causal=is_causal)
    finite = torch.isfinite(lse)[..., None]
    p = torch.where(finite, torch.exp(s - torch.where(finite, lse[..., None], 0.0)), 0.0)
    delta = (gf * of).sum(-1, keepdim=True)
    ds = p * (gf @ vf.transpose(-1, -2) - delta)
    return scale * ds @ kf, scale * ds.transpose(-1, -2) @ qf, p.transpose(-1, -2) @ gf


# ----------------------------------------------------------------------------- agreement between the ranks
# the classes an error keeps on its way to the other ranks (subclasses travel as these; anything else as
# RuntimeError), and the bytes of its message that travel (only when a rank failed)
_ERROR_CLASSES = (ValueError, TypeError, NotImplementedError, RuntimeError)
_MESSAGE_BYTES = 512


def _agree(group, what: str, row: list[float] | None, error: Exception | None, width: int) -> list[list[float]]:
    """Every rank's metadata ``row`` (``width`` floats, exact in float64) after one all-gather; raises on every
    rank when a rank passes an ``error`` (its local checks failed) instead of a row.

    Every collective call of this module validates its inputs locally first, then calls this before any other
    collective: each rank sends its row with an error code in front (0: none; else the class of its error), so
    a rank that fails tells the others and every rank raises the same error,
    ``<class>("<what>: rank r: <message>")`` (each failing rank, group ranks; the class of the lowest), chained on
    the failing rank to the error it found; nobody is left waiting in a later collective. The messages travel
    in a second all-gather (512 bytes per rank) that runs only when a rank failed: every rank knows that from
    the first. So a call that passes costs what the exchange of the rows cost before errors were agreed on:
    one all-gather of ``8 (width + 1)`` bytes per rank and one device-to-host copy of the table. Measured
    (300 calls, 2 runs): 2 H200s on NCCL 0.17-0.25 ms per call, as the exchange before (0.22-0.26 ms; one
    all-gather that always carried the 512 message bytes: 0.29-0.35 ms), against 1.35 ms for a whole bf16
    call of 4096 tokens per rank; gloo, 2 CPU processes: 0.4-0.6 ms, the collective's latency.

    Raises:
        the class of the failing rank's error (ValueError, TypeError, NotImplementedError; RuntimeError for any
            other) on every rank, naming each failing rank and its message (cut to 512 bytes).
        RuntimeError: the all-gather itself failed (a rank died, stopped or sits in another collective: gloo
            reports a closed connection at once, or the group's ``timeout`` passes), naming ``what``.
    """
    code = 0
    if error is not None:
        cls = next((c for c in _ERROR_CLASSES if isinstance(error, c)), RuntimeError)
        code, row = _ERROR_CLASSES.index(cls) + 1, [0.0] * width
    rows = _all_gather_cpu(group, what, torch.tensor([float(code), *row], dtype=torch.float64)).tolist()
    failed = [r for r, m in enumerate(rows) if m[0]]
    if not failed:
        return [m[1:] for m in rows]
    text = b""
    if error is not None:
        msg = str(error) if type(error) in _ERROR_CLASSES else f"{type(error).__name__}: {error}"
        text = msg.encode()[:_MESSAGE_BYTES]  # a cut through a character is dropped when decoded
    buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    if text:
        buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    messages = _all_gather_cpu(group, what, buf)
    reasons = "; ".join(f"rank {r}: " + bytes(messages[r].tolist()).rstrip(b"\0").decode(errors="ignore")
                        for r in failed)
    raise _ERROR_CLASSES[int(rows[failed[0]][0]) - 1](f"{what}: {reasons}") from error


def _all_gather_cpu(group, what: str, t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (a small CPU tensor, same shape on every rank) stacked [W, ...] on the CPU; through the
    group's device (NCCL: the current GPU). A failed collective raises RuntimeError naming ``what``."""
    mine = t.to(_collective_device(group))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(parts, mine, group=group)
    except RuntimeError as e:  # gloo: "Connection closed by peer", a timeout
        raise RuntimeError(f"{what}: the exchange between the ranks failed (a rank died, stopped or called another "
                           f"collective; the group's timeout bounds the wait): {e}") from e
    return torch.stack(parts).cpu()


def _check_collective_device(name: str, t: torch.Tensor, group) -> None:
    """Raise ValueError when ``t`` is not where ``group``'s collectives take tensors: the CPU for gloo, this rank's
    current GPU for NCCL (other backends: no check but meta tensors, which no backend carries)."""
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (no data): the ranks exchange data; use real tensors")
    backend = dist.get_backend(group)
    if backend == dist.Backend.GLOO and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; the gloo group carries CPU tensors (use NCCL for CUDA tensors)")
    if backend == dist.Backend.NCCL and t.device != _collective_device(group):
        raise ValueError(f"{name} is on {t.device}; the NCCL group runs on this rank's current CUDA device "
                         f"{_collective_device(group)} (torch.cuda.set_device)")


def _wait(works: list, what: str, rank: int, world: int, ring: bool = True) -> None:
    """Wait for a ring step's transfers (``ring``) or a collective's work; a failed one (a rank died, stopped, or
    the group's timeout passed) raises RuntimeError naming ``what`` (the function and step), this rank and, for
    the ring, both neighbours, instead of gloo's bare message."""
    try:
        for work in works:
            work.wait()
    except RuntimeError as e:
        peers = " or ".join(str(r) for r in sorted({(rank - 1) % world, (rank + 1) % world}))
        who = f"a transfer with rank {peers} failed (that rank" if ring else "it failed (a rank"
        raise RuntimeError(f"{what} on rank {rank}: {who} died, stopped or called another collective; the group's "
                           f"timeout bounds the wait): {e}") from e


# ----------------------------------------------------------------------------- autograd-aware gather
class _GatherSequence(torch.autograd.Function):
    """All-gather of unequal shards along ``dim`` (zero-padded to the longest for the collective, trimmed
    after). Backward: each rank holds a gradient for every shard; one all-reduce (sum) of it, of which each
    rank keeps its own rows. Works on every backend (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, dim: int, lens: tuple, rank: int, group):
        ctx.dim, ctx.lens, ctx.rank, ctx.group = dim, lens, rank, group
        longest = max(lens)
        shape = list(x.shape)
        shape[dim] = longest
        padded = x.new_zeros(shape)
        padded.narrow(dim, 0, x.shape[dim]).copy_(x)
        parts = [torch.empty_like(padded) for _ in lens]
        _wait([dist.all_gather(parts, padded, group=group, async_op=True)], "gather_sequence: the all-gather", rank,
              len(lens), ring=False)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lens)], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        _wait([dist.all_reduce(grad, group=ctx.group, async_op=True)], "gather_sequence: the backward all-reduce",
              ctx.rank, len(ctx.lens), ring=False)
        start = sum(ctx.lens[:ctx.rank])
        return grad.narrow(ctx.dim, start, ctx.lens[ctx.rank]).clone(), None, None, None, None


_GATHER_DIMS = 8  # gather_sequence's exchange row holds the shape of a tensor of up to this many dims
_ALL_DTYPES = sorted({t for t in vars(torch).values() if isinstance(t, torch.dtype)}, key=str)


def gather_sequence(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The concatenation along ``dim`` of every rank's ``x`` (rank order); shards may differ in length along
    ``dim`` (other dims equal). Differentiable: the gradient of each rank's shard is the sum over ranks of
    the gradient of its rows (one all-reduce). Without an initialised group it returns ``x``.

    A collective: one small all-gather agrees on the shapes first (:func:`_agree`), so an invalid shard on one
    rank raises on every rank.

    Raises:
        TypeError: ``x`` not a tensor (on some rank; every rank raises, naming it).
        ValueError: a 0-dim ``x`` or one of more than 8 dims, ``dim`` out of range, ``x`` on a device the group
            does not carry (gloo: CPU, NCCL: the current GPU), the shards differing in a dim other than ``dim``,
            in ``dim`` itself, in dtype, or needing gradients on some ranks only (the backward is a collective);
            every rank raises.
    """
    if not dist.is_available() or not dist.is_initialized():
        return x
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    row, error = None, None
    try:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not 1 <= x.dim() <= _GATHER_DIMS:
            raise ValueError(f"x has {x.dim()} dims; gather_sequence takes 1 to {_GATHER_DIMS}")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim={dim} is out of range for x of shape {tuple(x.shape)}")
        _check_collective_device("x", x, group)
        dim = dim % x.dim()
        grad = float(torch.is_grad_enabled() and x.requires_grad)
        shape = [x.shape[i] if i != dim else -1 for i in range(x.dim())]
        row = [x.dim(), dim, _ALL_DTYPES.index(x.dtype), grad] + shape + [-1] * (_GATHER_DIMS - x.dim()) \
            + [x.shape[dim]]
    except Exception as e:  # every rank learns it in the exchange below, which it must still join
        error = e
    rows = _agree(group, "gather_sequence", row, error, 5 + _GATHER_DIMS)
    if any(r[:3] + r[4:-1] != rows[0][:3] + rows[0][4:-1] for r in rows):
        raise ValueError(f"gather_sequence: shards must agree in dims, dtype and every dim but dim={dim}; got "
                         + "; ".join(f"rank {i}: shape {[int(n) for n in r[4:4 + int(r[0])]]} (-1 marks dim "
                                     f"{int(r[1])}), {_ALL_DTYPES[int(r[2])]}" for i, r in enumerate(rows)))
    if len({r[3] for r in rows}) > 1:
        raise ValueError("gather_sequence: x needs gradients on some ranks but not on others ("
                         + "; ".join(f"rank {i}: {bool(r[3])}" for i, r in enumerate(rows))
                         + "); its backward is a collective, so every rank or none must need them")
    return _GatherSequence.apply(x, dim, tuple(int(r[-1]) for r in rows), rank, group)


# ----------------------------------------------------------------------------- the public function
def _single_process(group) -> bool:
    if group is None and (not dist.is_available() or not dist.is_initialized()):
        return True
    return dist.get_world_size(group or dist.group.WORLD) == 1


def _collective_device(group) -> torch.device:
    """Where a small tensor for a collective of ``group`` must live: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, mode: str | Mode = "fp32",
    bias: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
    scale: float | None = None, scheme: str = "auto",
) -> torch.Tensor:
    """Exact attention over a sequence split across the ranks of ``group``: this rank's output rows.

    The full sequence is the concatenation of every rank's shard in rank order; the result equals
    :func:`visionattn.attention` of the local queries against all keys and values (the rows of the
    single-process call that belong to this rank), within the mode's contract. Every rank of ``group``
    must call it (it is a collective), with the same mode, flags, scale and scheme.

    Exchange. Each rank first checks its own inputs (shapes, dtypes, devices, flags, the scheme's name, the
    cast to the mode's compute dtype with its float16 range check), then one small all-gather exchanges the
    shard lengths and shapes, or a rank's error (:func:`_agree`): every check that can fail on one rank runs
    before it, and every rank raises when one fails, so no rank enters a collective alone. Every rank then
    resolves the scheme from the same table.

    Scheme ``"auto"`` (the default) takes Ulysses when it can take the call, else the ring. Measured on 4 H200s
    (NCCL, N = 208,200, H = 16, D = 64; docs/benchmarks/context_parallel_4gpu_h200.md): Ulysses 3.89x one GPU in
    fp32 and 3.87x in bf16, the ring 3.76x and 3.15x, Ulysses bit-identical to the single-GPU call:

    * Ulysses needs the head count H divisible by the world size W (each rank takes H / W whole heads;
      padding heads would spend (W - H mod W) / H more compute on zeros) and no bias or mask on any rank:
      they come per local query row over all keys ([B, H, Nq_r, N_k]), and Ulysses would have to move
      them to the ranks owning the heads, which costs O(N^2) per rank against the O(N) of q, k, v.
    * Traffic per rank, in units of one shard [B, H, N / W, D]: Ulysses sends (W - 1) / W of four (q, k, v
      out, the output back; the backward four more: dO out, dq, dk, dv back), the ring sends its K and V
      W - 1 times (the backward the same plus the FP32 dK / dV accumulators). That is 4 (W - 1) / W
      against 2 (W - 1): the same at W = 2, W / 2 times less for Ulysses beyond.
    * The ring hides its transfers behind the shards' compute, Ulysses does not (its all-to-alls are on
      the critical path), but they are O(N) against the O(N^2 / W) of the attention: at VGGT's heads
      (H = 16, D = 64, bf16) and N = 2 * 10^5 on 4 GPUs about 300 MB per rank, a few ms on NVLink against
      ~100 ms of attention (an estimate from link bandwidth and kernel throughput); the share grows as N
      shrinks, and so does the ring's, whose per-step transfers then outlast the per-step compute too. In
      exchange Ulysses runs one attention call over all N tokens for its heads (the single-device kernel
      at full size, no merges, no split into W x W tiles), its causal work is even across ranks (the
      ring's rank r computes r + 1 of the W shards), and its backward is attention's own (the ring's
      backward gathers the full K, V for a bias that needs a gradient and for the PASA modes).
    * At a few hundred tokens both are latency-bound; Ulysses makes two collective calls (four with the
      backward), the ring W - 1 steps (twice with the backward): no threshold on N favours the ring.
    * The rule does not look at the topology: across hosts, Ulysses' all-to-all sends most of its data
      over the inter-host links, the ring one neighbour's shard per step; pass ``scheme="ring"`` where
      a measurement on such a group favours it.

    ``"ring"`` and ``"ulysses"`` force a scheme; ``"ulysses"`` on a call it cannot take raises ValueError.

    Ring forward (no gradients needed): ``W - 1`` steps pass the KV shards (packed [B, H, n, D + Dv] in the
    mode's compute dtype) to the next rank with ``batch_isend_irecv`` while the current one is folded in:
    per shard ``(out_i, lse_i)`` merged with :func:`merge_partials` (module docstring). Dense modes on CUDA
    run the forward kernel that writes the LSE; elsewhere, and for ``pasa`` / ``fp16-acc16`` on every
    device (their kernel writes no LSE), the PyTorch reference of the mode's arithmetic
    (:mod:`visionattn.reference`, :func:`visionattn.pasa.pasa_attention_reference`). Merges run in FP32;
    the output is cast to q's dtype.

    Ring backward (q, k or v needs gradients on every rank): the same ring. The forward saves its output and
    the global per-row LSE; the backward passes the KV shards around again, each with an FP32 dK / dV
    accumulator, and every rank adds its queries' share through the shard in flight (FlashAttention-2's
    Alg. 2 with the global LSE: exact; the backward kernels on CUDA for the dense modes, PyTorch in FP32
    elsewhere); after W steps each accumulator is back with its shard's owner. A bias that needs a gradient,
    and the PASA modes, take the gathering path instead: K and V all-gathered with an autograd-aware gather
    (:func:`gather_sequence`) and one :func:`visionattn.attention` of the local queries against the full
    K, V (the global causal mask as a boolean mask at this rank's offset; memory: the full K, V per rank).

    Ulysses: one all-to-all moves q, k, v (in q's dtype, packed into one buffer; shards of unequal length
    travel as they are) so that rank r holds heads ``[r H / W, (r + 1) H / W)`` of all N tokens; one
    :func:`visionattn.attention` call in ``mode`` on them (``is_causal`` over the whole sequence, as the
    ring); one all-to-all returns each rank its rows of the output. Backward: attention's own, between the
    inverse all-to-alls. Memory per rank, on top of the inputs: during an all-to-all its send and receive
    buffers (each the size of the tensors it moves), then the result; during attention the gathered heads
    (the size of the local q, k, v) and what attention itself takes on N tokens of H / W heads.

    Single process (no ``group`` and ``torch.distributed`` not initialised, or a group of one rank):
    exactly :func:`visionattn.attention` (no exchange; ``scheme`` is checked as with several ranks).

    Args:
        q: this rank's queries [B, H, Nq_r, D]; float16 / bfloat16 / float32 / float64; Nq_r >= 0.
        k: this rank's keys [B, H, Nk_r, D]; v: values [B, H, Nk_r, Dv] (Nk_r >= 0; usually Nk_r = Nq_r).
            B, H, D, Dv and the dtype must agree across ranks; lengths may differ.
        group: the process group (default: the world). Any group of any hosts: the collectives address its
            ranks, nothing assumes one host.
        mode: a :data:`visionattn.modes.MODES` name (inputs cast to its compute dtype, as ``attention``).
        bias: additive float bias over the FULL key length, broadcastable to [B, H, Nq_r, N_k] (rows: this
            rank's queries; columns: all keys in rank order, or 1); each ring step reads the columns of the
            shard in flight. Ring only.
        attn_mask: boolean (True = attend), broadcastable to [B, H, Nq_r, N_k] likewise. Ring only.
        is_causal: causal over the concatenated sequence, top-left: the query at global index i sees the
            key at global index j iff j <= i. Ring: shards entirely after this rank's last query are passed
            on without computing; one across the diagonal gets the causal mask at its offsets.
        scale: logit scale; default ``1 / sqrt(D)``.
        scheme: one of :data:`SCHEMES`: ``"auto"`` (default: the rule above), ``"ring"`` or ``"ulysses"``.

    Returns:
        [B, H, Nq_r, Dv] in q's dtype. Fully masked rows are zeros.

    Raises (every rank raises the same error: a collective call fails on every rank, never on one alone):
        ValueError: non-4D q / k / v, batch / heads / head dims that differ between q, k, v or across ranks
            (naming the argument), a dtype, mode, ``is_causal``, ``scale`` or ``scheme`` that differs across
            ranks, an unknown ``scheme``, gradients needed on some ranks only, a bias / mask whose key dim is
            neither 1 nor the total key length, inputs the group does not carry (gloo: CPU; NCCL: the current
            GPU; meta tensors; a meta ``scale``), inputs beyond float16's range in a float16 mode;
            ``scheme="ulysses"`` with H not divisible by the world size or a bias / mask on some rank (the
            message names the fix: ``scheme="ring"`` or ``"auto"``). An error in one rank's own inputs
            (TypeError / ValueError as :func:`visionattn.attention`; another class travels as RuntimeError)
            is raised on every rank with its class, as ``"context_parallel_attention: rank r: <message>"``.
        TypeError: as :func:`visionattn.attention` for a rank's own inputs (on every rank, naming it).
        RuntimeError: a rank died, stopped or called another collective during the call (the metadata
            exchange, a ring step, an all-to-all, the backward): gloo reports a closed connection at once,
            otherwise the group's ``timeout`` (``init_process_group(timeout=...)``) bounds the wait; the
            message names the step (and, in the ring, the neighbouring ranks). Failures inside a ring step
            or Ulysses' attention call on one rank (out of memory, a kernel error) reach the others this
            way: agreeing on them would cost a second collective and a device synchronisation per call.
    """
    if _single_process(group):
        # the errors of the scheme as with several ranks (one rank: every head count splits)
        pick_scheme(scheme, 1, 1, [0] * (bias is not None), [0] * (attn_mask is not None))
        return attention(q, k, v, bias=bias, attn_mask=attn_mask, is_causal=is_causal, scale=scale, mode=mode)
    return _context_parallel(q, k, v, group, mode, bias, attn_mask, is_causal, scale, scheme)


def _check_scheme(scheme) -> None:
    """Raise ValueError naming :data:`SCHEMES` when ``scheme`` is not one of them."""
    if not (isinstance(scheme, str) and scheme in SCHEMES):
        raise ValueError(f"scheme={scheme!r} is not one of {', '.join(map(repr, SCHEMES))}")


def _resolve_scheme(meta: list[dict], world: int) -> str:
    """``"ring"`` or ``"ulysses"`` for the agreed metadata (every rank resolves alike): :func:`pick_scheme`."""
    return pick_scheme(SCHEMES[int(meta[0]["scheme"])], int(meta[0]["heads"]), world,
                       [r for r, m in enumerate(meta) if m["bias_cols"] != -1],
                       [r for r, m in enumerate(meta) if m["mask_cols"] != -1])


def pick_scheme(scheme: str, heads: int, world_size: int, bias_ranks: list[int] = (),
                mask_ranks: list[int] = ()) -> str:
    """The scheme a :func:`context_parallel_attention` call runs: ``"ring"`` or ``"ulysses"`` (the rule of
    ``"auto"`` is in that function's docstring).

    Args:
        scheme: one of :data:`SCHEMES`, as passed to the call.
        heads: H, the query heads; world_size: W, the ranks of the group.
        bias_ranks, mask_ranks: the ranks that pass a bias / an attn_mask (empty: none).

    Raises:
        ValueError: ``scheme`` unknown, or ``"ulysses"`` for a call it cannot take (H not divisible by W, a bias
            or mask on some rank), naming why and the fix (``scheme="ring"`` or ``"auto"``).
    """
    _check_scheme(scheme)
    if scheme == "ring":
        return scheme
    reasons = []
    if heads % world_size:
        reasons.append(f"the {heads} heads do not split evenly over {world_size} ranks (each rank takes H / W "
                       f"whole heads)")
    given = [f"{name} (rank(s) {list(ranks)})" for name, ranks in (("bias", bias_ranks), ("attn_mask", mask_ranks))
             if len(ranks)]
    if given:
        reasons.append(f"it takes no bias or attn_mask, got {' and '.join(given)}: they hold a rank's query rows "
                       f"over all keys, and moving them to the ranks that own the heads costs O(N^2)")
    if not reasons:
        return "ulysses"
    if scheme == "auto":
        return "ring"
    raise ValueError("scheme='ulysses' cannot take this call: " + "; ".join(reasons)
                     + "; pass scheme='ring' (or 'auto', which picks the ring for it)")


def _local_row(q, k, v, mode, bias, attn_mask, is_causal, scale, scheme, group):
    """This rank's metadata row (:data:`_FIELDS`) and q, k, v cast to the mode's compute dtype (cast here so that
    the float16 range check runs before the exchange); raises what a local check finds."""
    md = get_mode(mode)
    _check_scheme(scheme)
    validate_attention_inputs(q, k, v)
    for name, t in (("query", q), ("bias", bias), ("attn_mask", attn_mask)):
        if isinstance(t, torch.Tensor):  # k and v: validate_attention_inputs put them on q's device
            _check_collective_device(name, t, group)
    if isinstance(scale, torch.Tensor) and scale.is_meta:
        raise ValueError("scale is a meta tensor (it holds no value); pass a number or a one-element tensor")
    B, H, nq, D = q.shape
    sc = check_flags(is_causal, scale, D)
    cols = []
    for name, t in (("bias", bias), ("attn_mask", attn_mask)):
        if t is None:
            cols.append(-1)
            continue
        n = t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() else 1
        # the checks of attention() with this tensor's own key count (whether it is the total is checked
        # once every rank's length is known)
        kf, vf = k.new_zeros(()).expand(B, H, n, D), v.new_zeros(()).expand(B, H, n, v.shape[-1])
        validate_attention_inputs(q, kf, vf, **{name: t})
        cols.append(n)
    # the backend the ring's shards (and the gathering path's attention call) resolve, and the kernels' import:
    # resolved here, so that an error in either is agreed on before the ring
    if dispatch.resolve_backend(None, q.device.type) == "triton" and not md.half_scores:
        from .kernels import elsa_fwd  # noqa: F401  (imports Triton: an import error is agreed on here)
    grad = 0.0  # 0: no gradient; 1: q / k / v need gradients; 2: the bias does too
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias)):
        grad = 2.0 if bias is not None and bias.requires_grad else 1.0
    with torch.no_grad():
        cast = caster(md, q.dtype)(q, k, v)  # raises where float16 cannot hold the inputs
    return [nq, k.shape[2], B, H, D, v.shape[-1], _DTYPES.index(q.dtype), mode_names().index(md.name),
            float(is_causal), sc, grad, *cols, SCHEMES.index(scheme)], cast


def _exchange(q, k, v, mode, bias, attn_mask, is_causal, scale, scheme, group):
    """``(meta, cast)``: every rank's metadata row as a dict and this rank's q, k, v in the mode's compute dtype;
    raises on every rank when any rank's inputs are invalid or the ranks disagree. The exchange is the call's one
    collective before the ring or the all-to-alls (:func:`_agree`: one all-gather of 8 * 15 bytes per rank; a
    second, of the messages, when a rank failed)."""
    row = cast = error = None
    try:
        row, cast = _local_row(q, k, v, mode, bias, attn_mask, is_causal, scale, scheme, group)
    except Exception as e:  # a rank that fails still joins the exchange and tells the others there
        error = e
    meta = [dict(zip(_FIELDS, r)) for r in _agree(group, "context_parallel_attention", row, error, len(_FIELDS))]

    def differ(*fields):
        return len({tuple(m[f] for f in fields) for m in meta}) > 1

    def per_rank(*fields):
        return "; ".join(f"rank {r}: " + ", ".join(f"{f}={m[f]:g}" for f in fields) for r, m in enumerate(meta))

    if differ("batch", "heads"):
        raise ValueError(f"query/key/value batch or heads differ across ranks ({per_rank('batch', 'heads')}); "
                         f"every rank's shard must be [B, H, N_r, D] with the same B and H")
    if differ("head_dim"):
        raise ValueError(f"query/key head_dim differs across ranks ({per_rank('head_dim')})")
    if differ("value_dim"):
        raise ValueError(f"value head dim differs across ranks ({per_rank('value_dim')})")
    if differ("dtype"):
        raise ValueError("query dtype differs across ranks: "
                         + "; ".join(f"rank {r}: {_DTYPES[int(m['dtype'])]}" for r, m in enumerate(meta)))
    if differ("mode"):
        raise ValueError("mode differs across ranks: "
                         + "; ".join(f"rank {r}: {mode_names()[int(m['mode'])]}" for r, m in enumerate(meta)))
    if differ("is_causal"):
        raise ValueError(f"is_causal differs across ranks ({per_rank('is_causal')})")
    if differ("scale"):
        raise ValueError(f"scale differs across ranks ({per_rank('scale')})")
    if differ("scheme"):
        raise ValueError("scheme differs across ranks: "
                         + "; ".join(f"rank {r}: {SCHEMES[int(m['scheme'])]!r}" for r, m in enumerate(meta)))
    if len({m["grad"] > 0 for m in meta}) > 1:  # the backward is a collective: one rank alone would wait forever
        raise ValueError(f"gradients are needed on some ranks but not on others ({per_rank('grad')}); q / k / v / "
                         f"bias must need gradients on every rank or on none")
    total = int(sum(m["nk"] for m in meta))
    for name, field in (("bias", "bias_cols"), ("attn_mask", "mask_cols")):
        wrong = [r for r, m in enumerate(meta) if m[field] not in (-1, 1, total)]
        if wrong:
            raise ValueError(f"{name} of rank(s) {wrong} has {[int(meta[r][field]) for r in wrong]} key columns; "
                             f"expected the total key length {total} (all ranks' keys, rank order) or 1")
    return meta, cast


def _context_parallel(q, k, v, group, mode, bias, attn_mask, is_causal, scale, scheme: str) -> torch.Tensor:
    """The multi-rank path of :func:`context_parallel_attention` (also with a group of one rank, so a test can
    run either scheme's machinery on one GPU): exchange, then Ulysses, the ring or the ring's gathering backward
    path. After the exchange nothing checks the inputs again: every rank goes on together."""
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    meta, cast = _exchange(q, k, v, mode, bias, attn_mask, is_causal, scale, scheme, group)
    md = get_mode(mode)
    sc = meta[rank]["scale"]
    q_lens = [int(m["nq"]) for m in meta]
    k_lens = [int(m["nk"]) for m in meta]
    if _resolve_scheme(meta, world) == "ulysses":
        del cast
        return _ulysses(q, k, v, md, is_causal, sc, group, rank, world, q_lens, k_lens)
    q0, k_starts = sum(q_lens[:rank]), [sum(k_lens[:r]) for r in range(world)]
    ring = (md, bias, attn_mask, is_causal, sc, group, rank, world, k_lens, k_starts, q0)
    if any(m["grad"] == 2 for m in meta) or (md.half_scores and any(m["grad"] for m in meta)):
        del cast
        return _gathered(q, k, v, md, bias, attn_mask, is_causal, sc, group, rank, k_lens, q0)
    with torch.no_grad():
        prepared = _packed(*cast)
    del cast
    if any(m["grad"] for m in meta):
        return _RingFunction.apply(q, k, v, ring, prepared)
    return _ring(q, v.shape[-1], *prepared, *ring)[0]


def _gathered(q, k, v, md, bias, attn_mask, is_causal, scale, group, rank, k_lens, q0) -> torch.Tensor:
    """The training path: K, V all-gathered (autograd-aware), one :func:`visionattn.attention` call. Its inputs
    passed the exchange (the float16 range of q, k, v included), so the call raises on no rank alone."""
    kv = torch.cat([k, v], dim=-1)
    if not kv.requires_grad:  # only q or the bias needs gradients here; other ranks' K / V may: the gather's
        kv = kv.detach().requires_grad_()  # backward (an all-reduce) must run on every rank
    kv = _GatherSequence.apply(kv, 2, tuple(k_lens), rank, group)
    d = k.shape[-1]
    if is_causal:  # keys after this rank's last query are invisible: drop them, mask the rest at the offset
        stop = min(q0 + q.shape[2], kv.shape[2])
        kv, bias, attn_mask = kv[:, :, :stop], _cols(bias, 0, stop), _cols(attn_mask, 0, stop)
        keep = torch.arange(stop, device=q.device)[None, :] <= (torch.arange(q.shape[2], device=q.device) + q0)[:, None]
        attn_mask = keep if attn_mask is None else attn_mask & keep
    return attention(q, kv[..., :d], kv[..., d:], bias=bias, attn_mask=attn_mask, scale=scale, mode=md)


def _ring_inputs(q, k, v, md: Mode):
    """q in the mode's compute dtype and this rank's K, V packed [B, H, n, D + Dv] in it (one tensor travels)."""
    return _packed(*caster(md, q.dtype)(q, k, v))


def _packed(qc, kc, vc):
    """``(qc, kv)``: q, k, v already in the compute dtype, K and V packed [B, H, n, D + Dv]."""
    return qc, torch.cat([kc, vc], dim=-1)


def _pass_on(send: torch.Tensor, recv: torch.Tensor, group, rank: int, world: int) -> list:
    """Post the isend of ``send`` to the next rank of the ring and the irecv of ``recv`` [B, H, n, ...] from the
    previous one (an empty shard is neither sent nor received); the works to wait for."""
    p2p = []
    if send.shape[2]:
        p2p.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % world), group))
    if recv.shape[2]:
        p2p.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % world), group))
    return dist.batch_isend_irecv(p2p) if p2p else []


def _ring(q, dv: int, qc, cur, md, bias, attn_mask, is_causal, scale, group, rank, world, k_lens, k_starts, q0):
    """The forward ring (module docstring) over the ring inputs ``qc``, ``cur`` (:func:`_ring_inputs`; ``q`` gives
    the output dtype, ``dv`` the value dim): step i folds the KV shard of rank (rank - i) mod W while the shard
    of step i + 1 is in flight. Returns ``(out in q's dtype, lse float32 [B, H, Nq_r])``."""
    B, H, nq, d = q.shape
    width = cur.shape[-1]
    out = lse = None  # the first partial result becomes the running one; later ones merge into it in place
    src = rank
    for step in range(world):
        pending, nxt, nxt_src = [], None, (rank - step - 1) % world
        if step < world - 1:  # post the transfer of the next shard before computing this one
            nxt = cur.new_empty((B, H, k_lens[nxt_src], width))
            pending = _pass_on(cur, nxt, group, rank, world)
        k0, k1 = k_starts[src], k_starts[src] + k_lens[src]
        part = _shard_attention(qc, cur, d, _cols(bias, k0, k1), _cols(attn_mask, k0, k1), is_causal, scale, md,
                                q0, k0)
        if part is not None and out is None:
            out, lse = part
        elif part is not None:
            _merge_into(out, lse, *part)
        del part
        _wait(pending, f"context_parallel_attention: ring step {step + 1} of {world}", rank, world)
        cur, src = nxt, nxt_src
    if out is None:  # no key visible to any local query (or no local query): zeros, LSE -inf
        return q.new_zeros((B, H, nq, dv)), q.new_full((B, H, nq), float("-inf"), dtype=torch.float32)
    return out.to(q.dtype), lse


class _RingFunction(torch.autograd.Function):
    """The ring forward (:func:`_ring`) with the ring backward: the KV shards travel the ring again, each with
    an FP32 accumulator of its dK / dV; rank r adds its queries' share (:func:`_shard_backward`) and passes
    both on, and after W steps every accumulator is back with its shard's owner. dQ stays local.

    The backward checks nothing that could fail on one rank: its inputs are the forward's, which the exchange
    agreed on, and autograd gives ``grad_out`` the output's shape and dtype. A rank that never runs the backward
    (its loss does not use the output) or dies in it leaves the others waiting until the group's timeout; the
    error then names the step and the neighbouring ranks (:func:`_wait`)."""

    @staticmethod
    def forward(ctx, q, k, v, ring, prepared):
        out, lse = _ring(q, v.shape[-1], *prepared, *ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # before any collective: a double backward is asked of every rank alike, so every rank raises here
        first_order_only("visionattn.distributed.context_parallel_attention")
        q, k, v, out, lse = ctx.saved_tensors
        md, bias, attn_mask, is_causal, scale, group, rank, world, k_lens, k_starts, q0 = ctx.ring
        qc, cur = _ring_inputs(q, k, v, md)  # the forward's casts again (they passed the range check there)
        # the output and its gradient in the compute dtype too, as the single-device backward takes them (its autograd
        # hands the kernels the compute dtype); Triton's interpreter also casts float64 to bfloat16 wrongly (1.0 -> 0,
        # -2.5 -> NaN), so a float64 pair made NaN gradients there
        out, grad_out = out.to(qc.dtype), grad_out.to(qc.dtype).contiguous()
        B, H, nq, d = q.shape
        width = cur.shape[-1]
        acc = torch.zeros((B, H, k_lens[rank], width), dtype=torch.float32, device=q.device)
        dq = torch.zeros((B, H, nq, d), dtype=torch.float32, device=q.device)
        src = rank
        for step in range(world):
            nxt_src = (rank - step - 1) % world
            pending, nxt = [], None
            if step < world - 1:  # the next shard's keys and values travel while this one is computed
                nxt = cur.new_empty((B, H, k_lens[nxt_src], width))
                pending = _pass_on(cur, nxt, group, rank, world)
            k0 = k_starts[src]
            grads = _shard_backward(qc, cur, d, out, grad_out, lse, _cols(bias, k0, k0 + k_lens[src]),
                                    _cols(attn_mask, k0, k0 + k_lens[src]), is_causal, scale, md, q0, k0)
            if grads is not None:
                dq += grads[0]
                acc[..., :d] += grads[1]
                acc[..., d:] += grads[2]
            # this shard's accumulator goes on to the next rank (after the last step: to its owner; a group of
            # one rank already is the owner)
            nxt_acc, moved = acc, []
            if world > 1:
                nxt_acc = torch.empty((B, H, k_lens[nxt_src], width), dtype=torch.float32, device=q.device)
                moved = _pass_on(acc, nxt_acc, group, rank, world)
            _wait(moved + pending, f"context_parallel_attention: backward ring step {step + 1} of {world}", rank, world)
            acc, cur, src = nxt_acc, nxt, nxt_src
        # src is now this rank again: acc holds the sum over every rank's queries
        return dq.to(q.dtype), acc[..., :d].to(k.dtype), acc[..., d:].to(v.dtype), None, None


# ----------------------------------------------------------------------------- Ulysses: all-to-all over heads
def _all_to_all(recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                group) -> list:
    """Post one all-to-all of the flat ``send`` (``send_splits[j]`` elements to rank j, in rank order) into the flat
    ``recv`` (``recv_splits[i]`` from rank i); the works to wait for.

    NCCL: one ``all_to_all_single``. gloo: pairwise isend / irecv with every peer (and a local copy), because gloo's
    all-to-all can abort the whole process (``std::terminate``) when a peer dies during it, where a failed
    point-to-point transfer raises in the wait as the ring's do."""
    if dist.get_backend(group) != "gloo":
        return [dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)]
    rank, world = dist.get_rank(group), len(send_splits)
    s_at = [sum(send_splits[:j]) for j in range(world)]
    r_at = [sum(recv_splits[:j]) for j in range(world)]
    recv[r_at[rank]:r_at[rank] + recv_splits[rank]].copy_(send[s_at[rank]:s_at[rank] + send_splits[rank]])
    p2p = []
    for j in range(world):
        if j == rank:
            continue
        peer = dist.get_global_rank(group, j)
        if send_splits[j]:
            p2p.append(dist.P2POp(dist.isend, send[s_at[j]:s_at[j] + send_splits[j]], peer, group))
        if recv_splits[j]:
            p2p.append(dist.P2POp(dist.irecv, recv[r_at[j]:r_at[j] + recv_splits[j]], peer, group))
    return dist.batch_isend_irecv(p2p) if p2p else []


def _swap(blocks: list[list[torch.Tensor]], shapes: list[list[tuple]], group, rank: int, world: int,
          what: str) -> list[list[torch.Tensor]]:
    """One all-to-all of tensor blocks: ``blocks[j]`` (any strides, one dtype) go to rank j, packed into one flat
    buffer; returns ``recv[i]``: views of the blocks of ``shapes[i]`` received from rank i. A failed collective
    raises RuntimeError naming ``what`` (:func:`_wait`)."""
    ref = next(b for row in blocks for b in row)
    sizes = [[b.numel() for b in row] for row in blocks]
    send = ref.new_empty(sum(map(sum, sizes)))
    at = 0
    for row, row_sizes in zip(blocks, sizes):
        for b, n in zip(row, row_sizes):
            send[at:at + n].view(b.shape).copy_(b)
            at += n
    numels = [[int(torch.Size(shape).numel()) for shape in row] for row in shapes]
    recv = ref.new_empty(sum(map(sum, numels)))
    _wait(_all_to_all(recv, send, [sum(n) for n in numels], [sum(n) for n in sizes], group), what, rank, world,
          ring=False)
    del send
    out, at = [], 0
    for row, row_numels in zip(shapes, numels):
        out.append([])
        for shape, n in zip(row, row_numels):
            out[-1].append(recv[at:at + n].view(shape))
            at += n
    return out


def _to_heads(xs, lens: list[list[int]], group, rank: int, world: int, what: str) -> list[torch.Tensor]:
    """Sequence shards -> head groups: ``xs[t]`` is this rank's [B, H_t, lens[t][rank], d_t]; returns, per tensor,
    [B, H_t / W, sum(lens[t]), d_t]: heads ``[rank H_t / W, (rank + 1) H_t / W)`` of every rank's tokens, in rank
    order (contiguous)."""
    heads = [x.shape[1] // world for x in xs]
    blocks = [[x[:, j * h:(j + 1) * h] for x, h in zip(xs, heads)] for j in range(world)]
    shapes = [[(x.shape[0], h, n[i], x.shape[3]) for x, h, n in zip(xs, heads, lens)] for i in range(world)]
    got = _swap(blocks, shapes, group, rank, world, what)
    outs = []
    for t, (x, h) in enumerate(zip(xs, heads)):
        out = x.new_empty((x.shape[0], h, sum(lens[t]), x.shape[3]))
        starts = [sum(lens[t][:i]) for i in range(world)]
        for i in range(world):
            out[:, :, starts[i]:starts[i] + lens[t][i]].copy_(got[i][t])
        outs.append(out)
    return outs


def _to_tokens(ys, lens: list[list[int]], group, rank: int, world: int, what: str) -> list[torch.Tensor]:
    """Head groups -> sequence shards, the inverse of :func:`_to_heads`: ``ys[t]`` is [B, h_t, sum(lens[t]), d_t]
    (this rank's heads of every token); returns, per tensor, this rank's [B, h_t W, lens[t][rank], d_t]
    (contiguous)."""
    starts = [[sum(n[:j]) for j in range(world)] for n in lens]
    blocks = [[y[:, :, s[j]:s[j] + n[j]] for y, s, n in zip(ys, starts, lens)] for j in range(world)]
    shapes = [[(y.shape[0], y.shape[1], n[rank], y.shape[3]) for y, n in zip(ys, lens)] for _ in range(world)]
    got = _swap(blocks, shapes, group, rank, world, what)
    outs = []
    for t, (y, n) in enumerate(zip(ys, lens)):
        h = y.shape[1]
        out = y.new_empty((y.shape[0], h * world, n[rank], y.shape[3]))
        for i in range(world):
            out[:, i * h:(i + 1) * h].copy_(got[i][t])
        outs.append(out)
    return outs


class _HeadExchange(torch.autograd.Function):
    """:func:`_to_heads` (``to_heads``) or :func:`_to_tokens` of tensors that share a dtype, in one all-to-all.
    Both are permutations of the data across the ranks, each the other's inverse, so the backward is the other
    direction applied to the gradients (itself differentiable: a double backward goes as far as attention's).
    ``plan``: ``(lens, group, rank, world, what)`` with ``lens[t]`` every rank's length of tensor t."""

    @staticmethod
    def forward(ctx, plan, to_heads: bool, *xs):
        ctx.plan, ctx.to_heads = plan, to_heads
        lens, group, rank, world, what = plan
        return tuple((_to_heads if to_heads else _to_tokens)(xs, lens, group, rank, world, what))

    @staticmethod
    def backward(ctx, *grads):
        lens, group, rank, world, what = ctx.plan
        plan = (lens, group, rank, world, f"{what}, backward")
        return None, None, *_HeadExchange.apply(plan, not ctx.to_heads, *grads)


def _ulysses(q, k, v, md: Mode, is_causal: bool, scale: float, group, rank: int, world: int, q_lens: list[int],
             k_lens: list[int]) -> torch.Tensor:
    """Ulysses (:func:`context_parallel_attention`): q, k, v [B, H, N_r, D] (this rank's shard, q's dtype) to
    heads ``[rank H / W, (rank + 1) H / W)`` of all tokens in one all-to-all, :func:`visionattn.attention` on
    them, the output [B, H / W, Nq, Dv] back to this rank's [B, H, Nq_r, Dv] in a second all-to-all. Its inputs
    passed the exchange (the float16 range included), so attention raises on no rank alone."""
    what = "context_parallel_attention: ulysses all-to-all"
    qh, kh, vh = _HeadExchange.apply(((q_lens, k_lens, k_lens), group, rank, world, f"{what} of q, k, v"), True,
                                     q, k, v)
    out = attention(qh, kh, vh, is_causal=is_causal, scale=scale, mode=md)
    del qh, kh, vh
    return _HeadExchange.apply(((q_lens,), group, rank, world, f"{what} of the output"), False, out)[0]
