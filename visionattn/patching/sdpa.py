"""sdpa_override: route ``F.scaled_dot_product_attention`` calls to visionattn.

For models visionattn has no patcher for (official VGGT code, transformers,
anything calling SDPA), a :class:`torch.overrides.TorchFunctionMode` intercepts
each ``torch.nn.functional.scaled_dot_product_attention`` call made inside the
``with`` block and runs :func:`visionattn.attention` instead. Calls the
semantics of visionattn do not cover pass through to PyTorch unchanged, and the
context counts both (``routed``, ``passed``, ``pass_reasons``):

* ``dropout_p > 0`` (attention dropout is not implemented);
* inputs that are not 4-D [B, H, N, D] floating tensors, or that
  :func:`visionattn.api.validate_attention_inputs` rejects (shapes, devices,
  mixed dtypes, meta / sparse / nested tensors; with ``enable_gqa=True``, key and value
  head counts that differ from each other or do not divide the query's) — PyTorch then
  gives its own answer (a meta output for meta inputs) or error.

``enable_gqa=True`` (grouped-query / multi-query attention, key / value [B, Hkv, N, D] with
Hkv dividing H) runs :func:`visionattn.attention` with ``enable_gqa=True``: the kernels read
the Hkv heads in place, as SDPA's ``repeat_interleave`` of the K / V heads defines the result.

Arguments of the wrong Python type (an ``is_causal`` that is not a bool, a numpy mask, a
string scale) never reach the override: PyTorch's argument parser refuses them first.

A float ``attn_mask`` is an additive bias (SDPA semantics) and is passed as
``bias``; a bool mask as ``attn_mask`` (True = attend).
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..api import attention, validate_attention_inputs
from ..modes import get_mode
from .options import check_options

__all__ = ["sdpa_override", "SDPAOverride"]

_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _bind(args: tuple, kwargs: dict) -> dict:
    if len(args) > len(_SDPA_ARGS):
        raise TypeError("too many positional arguments for scaled_dot_product_attention")
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound


def _unsupported(a: dict) -> str | None:
    """Why this SDPA call passes through to PyTorch (None: visionattn runs it)."""
    q, k, v, mask = a.get("query"), a.get("key"), a.get("value"), a["attn_mask"]
    if set(a) - set(_SDPA_DEFAULTS) - {"query", "key", "value"}:
        return f"unknown arguments {sorted(set(a) - set(_SDPA_DEFAULTS) - {'query', 'key', 'value'})}"
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query/key/value missing or not tensors"
    if a["dropout_p"] and float(a["dropout_p"]) > 0:
        return "dropout_p > 0 (attention dropout is not implemented in visionattn)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"not 4-D [B, H, N, D] inputs (query {tuple(q.shape)})"
    if not all(t.is_floating_point() for t in (q, k, v)):
        return "non-floating query/key/value"
    if mask is not None and not isinstance(mask, torch.Tensor):
        return "attn_mask is not a tensor"
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        return f"attn_mask of dtype {mask.dtype}"
    bias = mask if mask is not None and mask.dtype != torch.bool else None
    bool_mask = mask if mask is not None and mask.dtype == torch.bool else None
    try:
        validate_attention_inputs(q, k, v, bias, bool_mask, bool(a["enable_gqa"]))
    except (TypeError, ValueError) as err:
        return f"rejected by visionattn validation: {err}"
    return None


class SDPAOverride(TorchFunctionMode):
    """TorchFunctionMode sending SDPA calls to :func:`visionattn.attention`; see :func:`sdpa_override`.

    Attributes:
        mode: the visionattn mode name.
        options: ``backend`` / ``num_splits`` passed to :func:`visionattn.attention`.
        routed: number of calls run by visionattn.
        passed: number of calls passed through to PyTorch.
        pass_reasons: ``Counter`` of reasons for passed calls.
    """

    def __init__(self, mode: str = "fp32", **options):
        super().__init__()
        self.mode = get_mode(mode).name
        self.options = {k: v for k, v in check_options(options).items() if v is not None}
        self.routed = 0
        self.passed = 0
        self.pass_reasons: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        try:
            bound = _bind(args, kwargs)
        except TypeError:
            reason = "arguments do not bind to scaled_dot_product_attention"
        else:
            reason = _unsupported(bound)
        if reason is not None:
            self.passed += 1
            self.pass_reasons[reason] += 1
            return func(*args, **kwargs)
        self.routed += 1
        mask = bound["attn_mask"]
        is_bool = mask is not None and mask.dtype == torch.bool
        return attention(bound["query"], bound["key"], bound["value"],
                         bias=None if is_bool else mask, attn_mask=mask if is_bool else None,
                         is_causal=bool(bound["is_causal"]), scale=bound["scale"], mode=self.mode,
                         enable_gqa=bool(bound["enable_gqa"]), **self.options)


def sdpa_override(mode: str = "fp32", **options) -> SDPAOverride:
    """Context manager: run ``torch.nn.functional.scaled_dot_product_attention`` via visionattn.

    ::

        with visionattn.sdpa_override("fp16") as ctx:
            y = model(x)            # every supported SDPA call inside runs visionattn.attention
        print(ctx.routed, ctx.passed, ctx.pass_reasons)

    Args:
        mode: visionattn mode (:data:`visionattn.MODES`).
        **options: ``backend``, ``num_splits`` (as :func:`visionattn.attention`).

    Returns:
        an :class:`SDPAOverride` (use it in a ``with`` statement; re-entrant use is not supported).

    Raises:
        ValueError: unknown mode or bad option value. TypeError: unknown option.
    """
    return SDPAOverride(mode, **options)
