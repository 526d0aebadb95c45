"""Reference implementations: the float64 oracle and the (m, S, W) monoid.

The ELSA view of softmax attention (ELSA supplement, Sec. A): for one query, the
keys fold into a state ``(m, S, W)`` — running max logit ``m``, normalizer
``S = sum_i exp(s_i - m)`` and weighted value sum ``W = sum_i exp(s_i - m) v_i``
— under the associative merge

    m = max(m_a, m_b),  S = S_a e^(m_a - m) + S_b e^(m_b - m),  W likewise,

with identity ``(-inf, 0, 0)``. The output is ``W / S``. This module gives

* :func:`oracle_attention` — the vectorized float64 oracle (supplement Alg. 2,
  Eq. 17), optionally returning the probability matrix P;
* the monoid as a small API: :class:`State`, :func:`identity`, :func:`merge`,
  :func:`block_state`, :func:`reduce_states`, :func:`finalize`;
* :func:`blocked_attention` — attention computed by folding KV blocks into the
  state with O(Nk) extra memory per query row; the CPU implementation of every
  mode (:mod:`visionattn.modes`).

A query row whose keys are all masked has ``S = 0``; :func:`finalize` returns
zeros for it (not NaN), and so do the oracle and :func:`visionattn.attention`.
"""
from __future__ import annotations

import random
from typing import NamedTuple, Sequence

import torch

from .modes import Mode, get_mode

__all__ = [
    "State", "identity", "merge", "block_state", "reduce_states", "finalize",
    "scores_and_mask", "oracle_attention", "blocked_attention", "blocked_attention_with_probs", "no_keys_output",
    "cpu_block_size",
]


class State(NamedTuple):
    """A batch of monoid states, one per query row.

    Attributes:
        m: running max logit, float [..., Nq]; ``-inf`` for the identity.
        s: normalizer ``sum exp(s_i - m)``, float [..., Nq]; 0 for the identity.
        w: weighted value sum, float [..., Nq, Dv]; 0 for the identity.
    """

    m: torch.Tensor
    s: torch.Tensor
    w: torch.Tensor


def cpu_block_size(nk: int) -> int:
    """Keys per block of :func:`blocked_attention` on the CPU path for ``nk`` keys: large blocks are faster on CPU
    (fewer Python steps) and memory stays O(Nq * block)."""
    return min(max(nk, 1), 1024)


def identity(shape: Sequence[int], dv: int, *, dtype=torch.float32, device=None) -> State:
    """The monoid identity ``(-inf, 0, 0)`` for query rows of ``shape`` ([..., Nq])."""
    shape = tuple(shape)
    return State(
        torch.full(shape, float("-inf"), dtype=dtype, device=device),
        torch.zeros(shape, dtype=dtype, device=device),
        torch.zeros(shape + (dv,), dtype=dtype, device=device),
    )


def _rescale(m_part: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    # exp(m_part - m_new), defined as 0 where m_part = -inf (also when m_new = -inf,
    # where the plain formula gives exp(nan)).
    diff = torch.where(torch.isneginf(m_part), torch.full_like(m_part, float("-inf")), m_part - m_new)
    return torch.exp(diff)


def merge(a: State, b: State) -> State:
    """The monoid operation ``a (+) b`` (ELSA supplement, Eq. 4).

    Associative, with :func:`identity` as two-sided identity; handles ``m = -inf``
    on either or both sides (fully masked rows stay the identity, never NaN).
    """
    m = torch.maximum(a.m, b.m)
    alpha, beta = _rescale(a.m, m), _rescale(b.m, m)
    return State(m, a.s * alpha + b.s * beta, a.w * alpha.unsqueeze(-1) + b.w * beta.unsqueeze(-1))


def block_state(scores: torch.Tensor, v: torch.Tensor, *, p_dtype: torch.dtype | None = None) -> State:
    """State of one KV block.

    Args:
        scores: logits [..., Nq, Nb] (scaled, bias added, masked entries ``-inf``).
        v: values [..., Nb, Dv], same dtype as ``scores``.
        p_dtype: if given, the unnormalized probabilities are rounded to this
            dtype before the ``P @ V`` product (what half-precision kernels do).
    """
    m = scores.amax(dim=-1)
    e = torch.exp(scores - torch.where(torch.isneginf(m), torch.zeros_like(m), m).unsqueeze(-1))
    pv = e if p_dtype is None else e.to(p_dtype).to(e.dtype)
    return State(m, e.sum(dim=-1), pv @ v)


def reduce_states(states: Sequence[State], order: str = "left", *, seed: int | None = None) -> State:
    """Reduce a sequence of block states with :func:`merge`.

    Args:
        states: non-empty sequence of states of equal shape, in key order.
        order: ``"left"`` (((s0+s1)+s2)...), ``"right"`` (s0+(s1+(s2...))),
            ``"tree"`` (balanced pairwise) or ``"random"`` (random adjacent merges;
            the monoid is associative, not commutative, so key order is kept).
        seed: seed for ``order="random"``.

    Raises:
        ValueError: empty ``states`` or unknown ``order``.
    """
    items = list(states)
    if not items:
        raise ValueError("states must be a non-empty sequence of State")
    if order == "left":
        acc = items[0]
        for st in items[1:]:
            acc = merge(acc, st)
        return acc
    if order == "right":
        acc = items[-1]
        for st in reversed(items[:-1]):
            acc = merge(st, acc)
        return acc
    if order == "tree":
        while len(items) > 1:
            nxt = [merge(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
            if len(items) % 2:
                nxt.append(items[-1])
            items = nxt
        return items[0]
    if order == "random":
        rng = random.Random(seed)
        while len(items) > 1:
            i = rng.randrange(len(items) - 1)
            items[i:i + 2] = [merge(items[i], items[i + 1])]
        return items[0]
    raise ValueError(f"order={order!r}; expected 'left', 'right', 'tree' or 'random'")


def finalize(state: State) -> torch.Tensor:
    """Output ``W / S`` [..., Nq, Dv]; rows with ``S = 0`` (all keys masked) give zeros.

    NaN in the state (NaN inputs) propagates to the output, as in SDPA.
    """
    s = state.s.unsqueeze(-1)
    empty = s == 0
    return torch.where(empty, torch.zeros_like(state.w), state.w / torch.where(empty, torch.ones_like(s), s))


def scores_and_mask(
    q: torch.Tensor, k: torch.Tensor, *, scale: float, bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None, is_causal: bool = False, q_offset: int = 0, k_offset: int = 0,
) -> torch.Tensor:
    """Logits ``scale * q k^T + bias`` with masked entries set to ``-inf``.

    q [..., Nq, D] and k [..., Nk, D] in the compute dtype; ``bias`` / ``attn_mask``
    already sliced to this block and broadcastable to [..., Nq, Nk]. ``is_causal``
    keeps key j for query i iff ``j + k_offset <= i + q_offset`` (top-left
    alignment, as ``torch.nn.functional.scaled_dot_product_attention``).
    """
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    if is_causal:
        qi = torch.arange(q.shape[-2], device=q.device).unsqueeze(-1) + q_offset
        kj = torch.arange(k.shape[-2], device=q.device) + k_offset
        s = s.masked_fill(kj > qi, float("-inf"))
    return s


def oracle_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
    return_probs: bool = False,
):
    """Float64 vectorized attention (ELSA supplement, Alg. 2 / Eq. 17).

    Args:
        q: [B, H, Nq, D]; k: [B, H, Nk, D]; v: [B, H, Nk, Dv]; any float dtype,
            upcast to float64 on their device.
        bias: additive float bias broadcastable to [B, H, Nq, Nk].
        attn_mask: boolean, True = keep, broadcastable to [B, H, Nq, Nk].
        is_causal: top-left causal mask, as SDPA.
        scale: logit scale; default ``1 / sqrt(D)``.
        return_probs: also return P [B, H, Nq, Nk] (float64; memory O(Nq * Nk)).

    Returns:
        Y float64 [B, H, Nq, Dv], or ``(Y, P)``. Fully masked rows give zeros.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scores_and_mask(q.double(), k.double(), scale=scale,
                        bias=None if bias is None else bias.double(), attn_mask=attn_mask, is_causal=is_causal)
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)  # all-masked rows: P = 0, Y = 0
    y = p @ v.double()
    return (y, p) if return_probs else y


def _slice_kv(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    # bias / mask broadcast over keys when their last dim is 1.
    if t is None or t.shape[-1] == 1:
        return t
    return t[..., start:stop]


def no_keys_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The output of attention over no keys (k, v [..., 0, D]): zeros [..., Nq, Dv] in q's dtype, every row being
    fully masked, formed as ``(q k^T) v`` (products over an empty axis) so that autograd carries it back: zero
    gradients for q, k, v and, through an empty slice of it, for ``bias``, as the kernels' backward gives them."""
    out = (q @ k.transpose(-1, -2)) @ v
    if bias is not None:
        out = out + bias[..., :0].sum().to(out.dtype)  # a sum over nothing: 0, with bias in the graph
    return out


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
    mode: str | Mode = "fp32", block_size: int = 256, state_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention by folding KV blocks into (m, S, W) states: O(Nk) extra memory per row.

    Emulates a mode's arithmetic on any device: q, k, v are rounded to the mode's
    ``compute_dtype`` and the products and state run in ``state_dtype`` (FP32);
    half modes round the unnormalized probabilities to half before ``P @ V``, as
    the kernels do. ``tf32`` has no CPU equivalent and runs FP32 (inside its
    contract). ``pasa`` / ``fp16-acc16`` are not handled here: see
    :func:`visionattn.pasa.pasa_attention_reference`.

    Args:
        q, k, v: [B, H, Nq, D], [B, H, Nk, D], [B, H, Nk, Dv]; already validated.
        bias, attn_mask, is_causal, scale: as :func:`oracle_attention`.
        mode: a non-PASA mode.
        block_size: keys per block.
        state_dtype: dtype of products and state (float64 gives an oracle-grade scan).

    Returns:
        [B, H, Nq, Dv] in ``state_dtype``.
    """
    md = get_mode(mode)
    if md.half_scores:
        raise ValueError(f"blocked_attention does not emulate mode={md.name!r}; use visionattn.pasa")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if state_dtype != torch.float64:
        def cast(t):
            return t.to(md.compute_dtype).to(state_dtype)
    else:
        def cast(t):
            return t.double()
    qc, kc, vc = cast(q), cast(k), cast(v)
    p_dtype = md.compute_dtype if md.compute_dtype in (torch.float16, torch.bfloat16) else None
    nk = k.shape[-2]
    if nk == 0:
        return no_keys_output(qc, kc, vc, bias)
    state = identity(q.shape[:-1], v.shape[-1], dtype=state_dtype, device=q.device)
    for start in range(0, nk, block_size):
        stop = min(start + block_size, nk)
        s = scores_and_mask(qc, kc[..., start:stop, :], scale=scale, bias=_slice_kv(bias, start, stop),
                            attn_mask=_slice_kv(attn_mask, start, stop), is_causal=is_causal, k_offset=start)
        state = merge(state, block_state(s, vc[..., start:stop, :], p_dtype=p_dtype))
    return finalize(state)


def blocked_attention_with_probs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None, block_size: int = 128,
    state_dtype: torch.dtype = torch.float32, order: str = "tree",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monoid scan that also returns its probabilities (for drift studies, small N).

    KV blocks of ``block_size`` are turned into states by :func:`block_state`
    and reduced in ``order`` (:func:`reduce_states`); P is then
    ``exp(s - m) / S`` with the reduced (m, S), in ``state_dtype``.

    Returns:
        ``(Y [B, H, Nq, Dv], P [B, H, Nq, Nk])`` in ``state_dtype``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = (t.to(state_dtype) for t in (q, k, v))
    nk = k.shape[-2]
    states = [block_state(scores_and_mask(qc, kc[..., i:i + block_size, :], scale=scale), vc[..., i:i + block_size, :])
              for i in range(0, nk, block_size)]
    st = reduce_states(states, order)
    p = torch.exp(scores_and_mask(qc, kc, scale=scale) - st.m.unsqueeze(-1)) / st.s.unsqueeze(-1)
    return finalize(st), p
