"""Window attention backward for Swin / Swin-v2 (Triton, deterministic).

The forward (:mod:`.window_fwd`) computes, for window ``b`` (``b = image * nW + w``) and head ``h``,

    y = softmax(c_h q k^T + bias[h] + mask[b mod nW]) v

with ``c_h = scale`` (Swin) or, for Swin-v2's cosine attention, ``c_h = exp(min(logit_scale_h, log 100))`` on
L2-normalised q and k. Here the caller passes the q and k the logits were formed from (normalised for
Swin-v2) and the per-head ``c_h``; the normalisation, ``logit_scale`` and continuous-position-bias
gradients chain through PyTorch autograd outside. With ``lse`` the natural-log log-sum-exp of each row's
logits, the gradients are FlashAttention-2's (Alg. 2; the ELSA monoid state reduced to ``lse`` makes the
probabilities ``P = exp(logits - lse)`` exactly recomputable):

    dS = P * (dO v^T - rowsum(dO * O)),   dq = c_h dS k,   dk = c_h dS^T q,   dv = P^T dO,
    d bias[h] = sum_b dS_bh,   d c_h = sum_(b, i, j) dS_bhij q_bhi . k_bhj.

They run on the dense backward kernels of :mod:`.elsa_bwd`: the windows are its batch, the relative position
bias [H, N, N] is a stride-0 view over the windows (its gradient, the sum over every window and image, is
reduced inside the dQ kernel in a fixed order, no atomics, never materialising [B*nW, H, N, N]), the shift
mask [nW, N, N] is read per window as ``mask[b mod nW]`` (no gradient), and ``c_h`` is a per-head scale
whose gradient is summed by torch over per-(window, head, query tile) partials. Tiles are sized to the
window (49 -> 64 rows).

Public entry point: :func:`window_backward`; :func:`get_config` for tools.
"""
from __future__ import annotations

import torch

from ._host import pad_pow2
from .elsa_bwd import BWD_MODES, BwdConfig, KernelTiles, _check_inputs, launch_backward

__all__ = ["window_backward", "get_config"]


def get_config(mode: str, n_tokens: int, head_dim: int) -> BwdConfig:
    """Tiles for windows of ``n_tokens``: square tiles of the padded window up to 64 (49 -> one 64 x 64 tile;
    144 / 256 -> 64 x 64 tiles), 4 warps; FP32 operands at head dims above 64 take 32-row tiles.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in BWD_MODES:
        raise ValueError(f"mode={mode!r} has no window backward kernel; expected one of {list(BWD_MODES)}")
    block = min(64, pad_pow2(n_tokens))
    if BWD_MODES[mode][0] == torch.float32 and head_dim > 64:
        block = min(block, 32)
    tiles = KernelTiles(block, block, 4, 2)
    return BwdConfig(tiles, tiles)


def window_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                    lse: torch.Tensor, relative_position_bias: torch.Tensor | None, shift_mask: torch.Tensor | None,
                    num_windows: int, scale: float, mode: str, head_scale: torch.Tensor | None = None,
                    bias_requires_grad: bool = False, head_scale_requires_grad: bool = False, *,
                    config: BwdConfig | None = None, bias_splits: int | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of window attention (module docstring) from the saved log-sum-exp.

    Args:
        q, k: [B*nW, H, N, D]; v: [B*nW, H, N, Dv]; in the mode's compute dtype (float32 for ``fp32`` /
            ``fp32-ieee`` / ``tf32``, float16 / bfloat16 for ``fp16`` / ``bf16``), any strides (timm's
            ``qkv.unbind`` views are read in place). Swin-v2: the L2-normalised q and k.
        out: the forward output [B*nW, H, N, Dv], any float dtype and strides.
        grad_out: dL/d out, [B*nW, H, N, Dv], any float dtype and strides.
        lse: float32 [B*nW, H, N], natural log of each row's softmax normalizer (``-inf`` for a row whose
            logits are all ``-inf``: zero gradients).
        relative_position_bias: None or float [H, N, N] (any strides), shared by every window.
        shift_mask: None or float additive [nW, N, N] (timm's 0 / -100, or -inf); window b reads
            ``shift_mask[b % nW]``; no gradient.
        num_windows: nW, dividing B*nW (the shift mask's first dim when there is one).
        scale: the logit scale when ``head_scale`` is None.
        mode: ``fp32``, ``fp32-ieee``, ``tf32``, ``fp16`` or ``bf16`` (:mod:`.elsa_bwd`'s products).
        head_scale: None or float [H] (or [H, 1, 1]): the logit scale of each head, replacing ``scale``
            (Swin-v2: ``exp(min(logit_scale, log 100))``).
        bias_requires_grad: also return d relative_position_bias.
        head_scale_requires_grad: also return d head_scale.
        config, bias_splits: as :func:`.elsa_bwd.elsa_backward` (None = :func:`get_config` / automatic).

    Returns:
        ``(dq, dk, dv, dbias, dhead_scale)``: dq, dk [B*nW, H, N, D] and dv [B*nW, H, N, Dv], contiguous, in
        q's dtype; dbias [H, N, N] in the bias's dtype (the sum over all windows) or None; dhead_scale in
        ``head_scale``'s shape and dtype or None.

    Raises:
        ValueError: unknown mode; mismatched shapes (naming the argument); ``num_windows`` not dividing
            B*nW or differing from the shift mask's; a gradient asked for a tensor not given.
        TypeError: q / k / v not in the mode's compute dtype; lse not float32; a non-float bias / mask /
            head scale.
    """
    _check_inputs(q, k, v, out, grad_out, lse, None, None, mode)
    BW, H, N, _ = q.shape
    if k.shape[2] != N:
        raise ValueError(f"k has {k.shape[2]} tokens, q {N}: windows attend within themselves (Nq == Nk)")
    if not isinstance(num_windows, int) or num_windows < 1 or BW % num_windows:
        raise ValueError(f"num_windows={num_windows!r} must be a positive int dividing B*nW={BW}")
    for name, t, shape in (("relative_position_bias", relative_position_bias, (H, N, N)),
                           ("shift_mask", shift_mask, (num_windows, N, N))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {list(shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}; q is on {q.device}")
    hs = None
    if head_scale is not None:
        if not isinstance(head_scale, torch.Tensor) or not head_scale.is_floating_point():
            raise TypeError(f"head_scale must be a floating tensor, got "
                            f"{getattr(head_scale, 'dtype', type(head_scale).__name__)}")
        if head_scale.numel() != H or head_scale.device != q.device:
            raise ValueError(f"head_scale has shape {tuple(head_scale.shape)} on {head_scale.device}; expected "
                             f"{H} values on {q.device}")
        hs = head_scale.detach().reshape(H).to(torch.float32).contiguous()
    if bias_requires_grad and relative_position_bias is None:
        raise ValueError("bias_requires_grad=True needs a relative_position_bias")
    if head_scale_requires_grad and head_scale is None:
        raise ValueError("head_scale_requires_grad=True needs a head_scale")
    dq, dk, dv, dbias, dhs = launch_backward(
        q, k, v, out, grad_out, lse, relative_position_bias, shift_mask, None, hs, False, float(scale), mode,
        bias_requires_grad, head_scale_requires_grad, config, bias_splits,
        default=get_config(mode, N, max(q.shape[3], v.shape[3])))
    if dhs is not None:
        dhs = dhs.reshape(head_scale.shape).to(head_scale.dtype)
    return dq, dk, dv, dbias, dhs
