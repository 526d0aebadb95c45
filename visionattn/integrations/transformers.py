"""visionattn as a transformers attention implementation.

::

    from visionattn.integrations.transformers import register
    register()                                   # once per process
    model = AutoModel.from_pretrained(name, attn_implementation="visionattn_fp32")

:func:`register` adds one attention function per visionattn mode to transformers'
``AttentionInterface`` under the names ``"visionattn_<mode>"`` (``visionattn_fp32``,
``visionattn_fp32-ieee``, ``visionattn_tf32``, ``visionattn_fp16``, ``visionattn_bf16``,
``visionattn_pasa``, ``visionattn_fp16-acc16``) and ``"visionattn"`` for the mode it is
given. Each name is also registered with ``AttentionMaskInterface`` using transformers'
own ``sdpa_mask``, so padding / causal masks reach the function as the boolean
``[B, 1, Nq, Nk]`` masks SDPA gets (without that registration transformers drops the mask
of an unknown implementation).

The function follows transformers' ``sdpa_attention_forward`` contract (checked against
transformers 5.x): it is called as ``fn(module, query, key, value, attention_mask,
dropout=..., scaling=..., **kwargs)`` with query / key / value [B, H, N, D] and returns
``(output [B, Nq, H, Dv], None)``. Where the model's attention runs visionattn's dense
kernel it is exact in the mode's contract (:data:`visionattn.MODES`); transformers' Swin
(relative position bias plus the shifted-window mask, passed as one additive mask) runs
the dense kernel on each window, not the window kernel.

transformers is imported only when :func:`register` is called.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..api import attention
from ..dispatch import warn_once
from ..modes import get_mode, mode_names

__all__ = ["register", "registered_names", "implementation_name", "attention_forward", "DEFAULT_NAME",
           "MIN_TRANSFORMERS"]

#: The name :func:`register` gives the mode it is called with.
DEFAULT_NAME = "visionattn"
#: Oldest transformers whose attention-function contract this module was written against: 4.x models passed
#: head masks in the ``attention_mask`` slot (ViT), which this function would read as an additive mask.
MIN_TRANSFORMERS = "5.0"
_INSTALL_HINT = 'pip install "visionattn[video]" (or pip install "transformers>=5.0")'

_forwards: dict[str, Callable] = {}  # mode -> its registered function (the same object on every register())
_registered: dict[str, str] = {}  # attn_implementation name -> mode


def implementation_name(mode: str) -> str:
    """The ``attn_implementation`` name of ``mode``: ``"visionattn_" + mode`` (e.g. ``visionattn_fp32-ieee``).

    Raises:
        ValueError: unknown mode.
    """
    return f"{DEFAULT_NAME}_{get_mode(mode).name}"


def _import_transformers():
    """(AttentionInterface, AttentionMaskInterface, sdpa_mask) from transformers >= 5.0.

    Raises:
        ImportError: transformers missing (names the extra) or older than :data:`MIN_TRANSFORMERS`.
    """
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:
        raise ImportError(f"visionattn.integrations.transformers needs transformers: {_INSTALL_HINT}") from err
    major = int(transformers.__version__.split(".")[0])
    if major < int(MIN_TRANSFORMERS.split(".")[0]):
        raise ImportError(f"visionattn.integrations.transformers needs transformers>={MIN_TRANSFORMERS} (its "
                          f"attention-function contract), found {transformers.__version__}: {_INSTALL_HINT}")
    return AttentionInterface, AttentionMaskInterface, sdpa_mask


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      cache=None, *, mode: str = "fp32", **kwargs) -> tuple[torch.Tensor, None]:
    """One attention call of a transformers model, run by :func:`visionattn.attention`.

    The registered functions are this one with ``mode`` bound; transformers calls them as it
    calls ``sdpa_attention_forward``.

    Args:
        module: the calling attention module (read: ``num_key_value_groups``, ``is_causal``).
        query: [B, H, Nq, D].
        key: [B, Hkv, Nk, D]; ``Hkv = H / module.num_key_value_groups`` (grouped-query
            attention: query head ``h`` reads K/V head ``h // (H / Hkv)``, as transformers' ``repeat_kv``
            lays them out; :func:`visionattn.attention` with ``enable_gqa=True`` reads the Hkv heads in
            place, without the repeated copy).
        value: [B, Hkv, Nk, Dv].
        attention_mask: None, a boolean mask (True = attend) or an additive float mask,
            broadcastable to [B, H, Nq, Nk] (transformers passes [B, 1, Nq, Nk]).
        dropout: attention dropout probability; transformers passes 0.0 outside training.
        scaling: logit scale; None = ``D ** -0.5``.
        is_causal: None = ``module.is_causal`` (default True, as transformers' SDPA path); applied only
            when ``attention_mask`` is None and Nq > 1 (a mask already carries causality), top-left aligned.
        position_bias: optional additive [B or 1, H, Nq, Nk] bias (T5-style), added to the mask.
        cache: transformers' paged cache (continuous batching); not supported.
        mode: visionattn precision mode.
        **kwargs: the model's remaining attention kwargs. ``output_attentions=True`` warns once (no
            weights are returned); ``softcap``, ``s_aux`` (attention sinks) and ``head_mask`` other than
            None are refused; the rest (``position_ids``, ``sliding_window`` whose pattern is in the mask,
            flash-attention varlen fields) are ignored, as by transformers' SDPA path.

    Returns:
        ``(output, None)``: output [B, Nq, H, Dv] contiguous, in query's dtype. A query row whose keys are
        all masked gives zeros (SDPA gives NaN).

    Raises:
        ValueError: ``dropout`` > 0 (training with attention dropout), a ``softcap``, attention sinks, a
            head mask, or K/V heads that do not divide the query heads.
        NotImplementedError: a paged cache.
        TypeError / ValueError: inputs :func:`visionattn.attention` rejects.
    """
    where = f"visionattn ({DEFAULT_NAME}_{mode}) in {type(module).__name__}"
    if dropout and float(dropout) > 0:
        raise ValueError(f"{where}: attention dropout p={dropout} is not implemented (visionattn computes exact "
                         f"attention without dropout on the probabilities); call model.eval(), set the config's "
                         f"attention dropout to 0, or train with attn_implementation='sdpa'")
    for name, what in (("softcap", "logit soft-capping"), ("s_aux", "attention sinks"),
                       ("head_mask", "head masks")):
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: {what} (`{name}`) are not supported; use attn_implementation='eager'")
    if cache is not None:
        raise NotImplementedError(f"{where}: the paged cache of continuous batching ({type(cache).__name__}) "
                                  f"is not supported; use attn_implementation='sdpa'")
    if kwargs.get("output_attentions"):
        warn_once("transformers:output_attentions",
                  "visionattn attention does not compute attention weights: with output_attentions=True the "
                  "model returns no attention maps (as with 'sdpa'); load it with attn_implementation='eager' "
                  "to get them")

    heads, kv_heads = query.shape[1], key.shape[1]
    grouped = kv_heads != heads
    if grouped and (kv_heads == 0 or heads % kv_heads or value.shape[1] != kv_heads):
        raise ValueError(f"{where}: {heads} query heads and {kv_heads} key / {value.shape[1]} value heads; "
                         f"grouped-query attention needs the K/V heads to divide the query heads")

    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)

    bias = mask = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias

    out = attention(query, key, value, bias=bias, attn_mask=mask, is_causal=is_causal, scale=scaling, mode=mode,
                    enable_gqa=grouped)
    return out.transpose(1, 2).contiguous(), None


def _forward_for(mode: str) -> Callable:
    """The attention function of ``mode`` (built once, so registering again installs the same object)."""
    fn = _forwards.get(mode)
    if fn is None:
        def fn(module, query, key, value, attention_mask, **kwargs):
            return attention_forward(module, query, key, value, attention_mask, mode=mode, **kwargs)

        fn.__name__ = fn.__qualname__ = f"visionattn_{mode.replace('-', '_')}_attention_forward"
        fn.__doc__ = f"transformers attention function running visionattn.attention(mode={mode!r})."
        fn.visionattn_mode = mode
        _forwards[mode] = fn
    return fn


def register(mode: str = "fp32", name: str | None = None) -> str:
    """Register visionattn with transformers' attention (and attention-mask) interfaces.

    Registers ``"visionattn_<mode>"`` for every mode of :func:`visionattn.mode_names` and
    ``name`` (default ``"visionattn"``) for ``mode``. Idempotent: registering again installs
    the same functions; registering ``name`` with another mode re-points it, also for models
    already loaded with that name (transformers looks the function up at every call).

    Args:
        mode: visionattn mode that ``name`` runs.
        name: the extra ``attn_implementation`` name; default ``"visionattn"``.

    Returns:
        ``name`` as registered (pass it as ``attn_implementation``).

    Raises:
        ValueError: unknown mode; ``name`` empty, already registered by transformers or another
            library (``sdpa``, ``eager``, ``flash_attention_2``, ...), one of the per-mode names for another mode,
            or containing ``/`` or ``:`` (transformers reads those as hub kernels).
        ImportError: transformers not installed (names the ``visionattn[video]`` extra) or older than 5.0.
    """
    mode = get_mode(mode).name
    name = DEFAULT_NAME if name is None else name
    if not isinstance(name, str) or not name or "/" in name or ":" in name or "|" in name:
        raise ValueError(f"name={name!r}; expected a non-empty string without '/', ':' or '|' "
                         f"(transformers reads those as hub kernels or paged variants)")
    per_mode = {implementation_name(m): m for m in mode_names()}
    if name in per_mode and per_mode[name] != mode:
        raise ValueError(f"name={name!r} is the fixed name of mode {per_mode[name]!r}, not {mode!r}")
    attention_interface, mask_interface, sdpa_mask = _import_transformers()
    taken = (set(attention_interface()) | {"eager"}) - set(_registered)
    if name in taken:
        raise ValueError(f"name={name!r} is already an attention implementation of transformers (or registered "
                         f"by another library): {sorted(taken)}")
    for key, m in {**per_mode, name: mode}.items():
        attention_interface.register(key, _forward_for(m))
        mask_interface.register(key, sdpa_mask)
        _registered[key] = m
    return name


def registered_names() -> dict[str, str]:
    """``{attn_implementation name: visionattn mode}`` of everything :func:`register` registered."""
    return dict(_registered)
