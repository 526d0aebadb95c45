"""diffusers integration: ELSA / PASA attention behind diffusers' attention-processor interface.

diffusers routes every ``diffusers.models.attention_processor.Attention`` module
through a *processor* object (``AttnProcessor2_0`` by default on torch 2, which
calls ``F.scaled_dot_product_attention``; ``AttnProcessor`` when
``scale_qk=False``). :class:`ELSAAttnProcessor` is a drop-in replacement that
computes q, k, v exactly as those processors do and runs the attention itself
through :func:`visionattn.attention` in one of the visionattn precision modes
(``fp32`` ... ``pasa``). :func:`patch_diffusers` installs one such processor on
every Attention module of a diffusers model that still has a default processor
(through the model's own ``set_attn_processor``, no monkeypatching) and
:func:`unpatch_diffusers` puts the original processor objects back.

This covers the spatial and temporal transformer blocks of
``UNetSpatioTemporalConditionModel`` (Stable Video Diffusion: self attention
``attn1`` and cross attention ``attn2`` of ``transformer_blocks`` and
``temporal_transformer_blocks``) and the mid-block attention of the VAEs. The
PASA paper (Sec. 4) reports FP16 attention overflowing in SVD img2vid at
Q/K shapes [50, 5, 9216, 64]; mode ``pasa`` is the fix and the processor counts
NaN/inf outputs so a run can show it.

diffusers is an optional dependency (extra ``[video]``); it is imported only
inside the functions here.
"""
from __future__ import annotations

import torch

from ..api import attention
from ..dispatch import warn_once
from ..modes import get_mode
from .diffusers_dispatch import patch_dispatch, unpatch_dispatch
from .options import OPTION_NAMES

__all__ = [
    "ELSAAttnProcessor", "patch_diffusers", "unpatch_diffusers", "is_patched",
    "overflow_counts", "reset_overflow_counts",
]

# Where patch_diffusers keeps {processor key: original processor object} on the model.
_ORIGINALS_ATTR = "_visionattn_diffusers_originals"
_OPTIONS = ("count_overflow", *OPTION_NAMES)


def _diffusers_attention_classes():
    """(Attention, default processor classes) from diffusers, imported lazily."""
    try:
        from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("visionattn's diffusers integration needs diffusers: "
                          "pip install 'visionattn[video]' (or pip install diffusers)") from e
    return Attention, (AttnProcessor2_0, AttnProcessor)


class ELSAAttnProcessor:
    """diffusers attention processor running :func:`visionattn.attention` in a precision mode.

    Follows diffusers' ``AttnProcessor2_0`` step for step — ``spatial_norm``
    (with ``temb``), 4-D ``[B, C, H, W]`` inputs flattened to ``[B, H*W, C]``,
    ``attention_mask`` through ``attn.prepare_attention_mask`` (a float mask is
    passed as additive ``bias``, a bool mask as ``attn_mask``), ``group_norm``,
    ``norm_cross``, ``norm_q`` / ``norm_k``, the output projection and dropout,
    ``residual_connection`` and ``rescale_output_factor`` — and replaces only
    ``F.scaled_dot_product_attention`` by ``visionattn.attention(q, k, v,
    scale=attn.scale, mode=self.mode)`` on ``[B, heads, N, head_dim]`` views.
    ``attn.scale`` equals SDPA's default ``head_dim**-0.5`` whenever diffusers
    would choose ``AttnProcessor2_0`` and is the ``AttnProcessor`` scale otherwise.

    Overflow counter (``count_overflow=True``): after each call the processor
    records, without a host sync, whether the attention output held NaN/inf
    (``nonfinite_outputs``) and whether that happened although q, k, v were all
    finite (``overflow_events``: the attention itself overflowed, e.g. FP16
    score accumulation on large-bias inputs, PASA paper Sec. 2). Reading a
    counter syncs once. Turn it off for timing.

    Args:
        mode: a visionattn mode name (:func:`visionattn.modes.mode_names`).
        count_overflow: keep the NaN/inf counters (costs three ``isfinite``
            reductions per call).
        backend: ``None`` (process default), ``auto``, ``triton`` or ``reference``;
            passed to :func:`visionattn.attention`.
        num_splits: split-KV partitions for :func:`visionattn.attention` (None = by shape).
        name: the processor key it was installed under (for reports).

    Raises:
        ValueError: unknown ``mode`` (at construction).
    """

    def __init__(self, mode: str = "fp32", count_overflow: bool = True, backend: str | None = None,
                 num_splits: int | None = None, name: str | None = None):
        self.mode = get_mode(mode).name
        self.count_overflow = bool(count_overflow)
        self.backend = backend
        self.num_splits = num_splits
        self.name = name
        self.calls = 0
        self._counts: torch.Tensor | None = None  # int64 [2]: nonfinite outputs, overflow events

    def __repr__(self) -> str:
        return f"ELSAAttnProcessor(mode={self.mode!r}, count_overflow={self.count_overflow})"

    # -- counters ---------------------------------------------------------------------------------
    def _record(self, out, q, k, v) -> None:
        bad = ~torch.isfinite(out).all()
        inputs_ok = torch.isfinite(q).all() & torch.isfinite(k).all() & torch.isfinite(v).all()
        step = torch.stack([bad, bad & inputs_ok]).to(torch.int64)
        if self._counts is None or self._counts.device != step.device:
            prev = self._counts.to(step.device) if self._counts is not None else torch.zeros_like(step)
            self._counts = prev
        self._counts += step

    @property
    def nonfinite_outputs(self) -> int:
        """Calls whose attention output held NaN or inf (syncs the device)."""
        return 0 if self._counts is None else int(self._counts[0].item())

    @property
    def overflow_events(self) -> int:
        """Calls whose output held NaN/inf although q, k and v were finite (syncs the device)."""
        return 0 if self._counts is None else int(self._counts[1].item())

    def reset_counters(self) -> None:
        """Zero ``calls``, ``nonfinite_outputs`` and ``overflow_events``."""
        self.calls = 0
        self._counts = None

    # -- the processor ----------------------------------------------------------------------------
    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None,
                 *args, **kwargs) -> torch.Tensor:
        """Attention of one diffusers ``Attention`` module.

        Args:
            attn: the ``diffusers.models.attention_processor.Attention`` module.
            hidden_states: [B, N, C] tokens, or [B, C, H, W] feature maps (VAE mid block).
            encoder_hidden_states: [B, M, C_cross] for cross attention; None for self attention.
            attention_mask: diffusers mask ([B, M] / [B, 1, M] / [B*heads, N, M]), additive float or bool.
            temb: conditioning for ``attn.spatial_norm``.

        Returns:
            Same shape and dtype as ``hidden_states``.
        """
        if args or kwargs.get("scale") is not None:
            warn_once("diffusers:scale", "visionattn ELSAAttnProcessor: the deprecated `scale` argument is "
                                         "ignored, as in diffusers' AttnProcessor2_0")
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape)

        bias = mask = None
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
            if attention_mask.dtype == torch.bool:
                mask = attention_mask
            else:
                bias = attention_mask

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)  # [B, heads, N, d]
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)      # [B, heads, M, d]
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        out = attention(query, key, value, bias=bias, attn_mask=mask, scale=attn.scale, mode=self.mode,
                        backend=self.backend, num_splits=self.num_splits)
        self.calls += 1
        if self.count_overflow:
            self._record(out, query, key, value)

        hidden_states = out.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim).to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


def _check_model(model) -> None:
    if hasattr(model, "components") and not hasattr(model, "attn_processors"):
        raise TypeError(f"patch_diffusers takes a diffusers model such as pipe.unet, got the pipeline "
                        f"{type(model).__name__}; call it on pipe.unet (and pipe.vae if wanted)")
    if not (hasattr(model, "attn_processors") and hasattr(model, "set_attn_processor")):
        raise TypeError(f"model ({type(model).__name__}) has no attn_processors / set_attn_processor; "
                        f"expected a diffusers ModelMixin with attention (e.g. UNetSpatioTemporalConditionModel)")


def is_patched(model) -> bool:
    """True when :func:`patch_diffusers` has patched ``model`` and it was not unpatched since."""
    return getattr(model, _ORIGINALS_ATTR, None) is not None


def patch_diffusers(model, mode: str = "fp32", **options) -> dict:
    """Install :class:`ELSAAttnProcessor` on every diffusers ``Attention`` module with a default processor.

    A module is patched when it is exactly ``diffusers...Attention`` and its
    processor is exactly ``AttnProcessor2_0`` or ``AttnProcessor`` (diffusers'
    defaults). Everything else — custom / IP-adapter / LoRA / xformers / joint
    processors, attention classes other than ``Attention``, grouped-query
    modules (``kv_heads != heads``) — is left unchanged and listed under
    ``skipped`` with the reason. Each patched module gets its own processor
    (so the overflow counters are per layer). The originals are kept on the
    model; patching a patched model first restores them (so the mode can change).
    Modules whose processor calls ``dispatch_attention_fn`` (``FluxAttention``, ...) keep their
    processor and get scoped SDPA-override hooks instead
    (:func:`visionattn.patching.diffusers_dispatch.patch_dispatch`), counted in ``replaced`` as
    ``"<processor class> (dispatch_attention_fn)"``.

    Args:
        model: a diffusers ModelMixin with ``attn_processors`` / ``set_attn_processor``
            (``UNetSpatioTemporalConditionModel``, ``AutoencoderKLTemporalDecoder``, ...).
        mode: visionattn mode (``fp32``, ``fp32-ieee``, ``tf32``, ``fp16``, ``bf16``, ``pasa``, ``fp16-acc16``).
        **options: ``count_overflow`` (bool, default True), ``backend`` (``auto`` / ``triton`` /
            ``reference`` / None), ``num_splits`` (int / None) — forwarded to every
            :class:`ELSAAttnProcessor`.

    Returns:
        Report dict: ``family``, ``model`` (class name), ``mode``, ``attention_modules`` (all
        processors found), ``replaced`` ({original processor class: count}), ``replaced_total``,
        ``skipped`` (list of {``name``, ``processor``, ``reason``}), ``repatched``, ``options``.

    Raises:
        TypeError: ``model`` is not a diffusers model with attention processors (a pipeline
            names the fix: pass ``pipe.unet``); unknown option.
        ValueError: unknown ``mode``.
    """
    _check_model(model)
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"patch_diffusers got unknown option(s) {unknown}; accepted: {list(_OPTIONS)}")
    mode = get_mode(mode).name
    Attention, defaults = _diffusers_attention_classes()
    repatched = is_patched(model)
    if repatched:
        unpatch_diffusers(model)

    current = model.attn_processors  # {"<module path>.processor": processor}
    new, replaced, skipped = {}, {}, []
    for key, proc in current.items():
        module = model.get_submodule(key[: -len(".processor")])
        reason = None
        if type(module) is not Attention:
            reason = f"module class {type(module).__name__} is not diffusers Attention"
        elif type(proc) not in defaults:
            reason = (f"processor {type(proc).__name__} is not a default processor "
                      f"({', '.join(c.__name__ for c in defaults)})")
        elif module.inner_kv_dim != module.inner_dim:
            reason = "grouped-query attention (kv_heads != heads) is not handled"
        if reason is None:
            new[key] = ELSAAttnProcessor(mode, name=key, **options)
            replaced[type(proc).__name__] = replaced.get(type(proc).__name__, 0) + 1
        else:
            new[key] = proc
            skipped.append({"name": key, "processor": type(proc).__name__, "reason": reason})

    model.set_attn_processor(dict(new))  # set_attn_processor pops from the dict it gets
    setattr(model, _ORIGINALS_ATTR, dict(current))
    # modules whose processor calls dispatch_attention_fn (Flux, SD3, Wan, ...): scoped SDPA override hooks
    routed = patch_dispatch(model, mode, **options)
    replaced.update(routed["replaced"])
    skipped = [routed["skipped"].get(s["name"], s) for s in skipped if s["name"] not in routed["patched"]]
    return {
        "family": "diffusers", "model": type(model).__name__, "mode": mode,
        "attention_modules": len(current), "replaced": replaced, "replaced_total": sum(replaced.values()),
        "skipped": skipped, "repatched": repatched, "options": dict(options),
    }


def unpatch_diffusers(model) -> None:
    """Put back the exact processor objects ``model`` had before :func:`patch_diffusers`.

    Raises:
        TypeError: ``model`` is not a diffusers model with attention processors.
        ValueError: ``model`` was not patched by :func:`patch_diffusers`.
        RuntimeError: the model's attention modules changed since patching (keys differ).
    """
    _check_model(model)
    originals = getattr(model, _ORIGINALS_ATTR, None)
    if originals is None:
        raise ValueError(f"{type(model).__name__} was not patched by visionattn (patch_diffusers); nothing to undo")
    keys = set(model.attn_processors)
    if keys != set(originals):
        raise RuntimeError(f"{type(model).__name__}'s attention modules changed since patching "
                           f"({len(keys ^ set(originals))} keys differ); cannot restore the processors exactly")
    unpatch_dispatch(model)
    model.set_attn_processor(dict(originals))
    setattr(model, _ORIGINALS_ATTR, None)


def overflow_counts(model) -> dict:
    """Sum the counters of every :class:`ELSAAttnProcessor` in ``model`` (syncs the device once per layer).

    Returns:
        ``{"calls": int, "nonfinite_outputs": int, "overflow_events": int,
        "layers": {processor key: overflow_events} for layers with events > 0}``.
    """
    _check_model(model)
    total = {"calls": 0, "nonfinite_outputs": 0, "overflow_events": 0, "layers": {}}
    for key, proc in model.attn_processors.items():
        if isinstance(proc, ELSAAttnProcessor):
            total["calls"] += proc.calls
            total["nonfinite_outputs"] += proc.nonfinite_outputs
            ev = proc.overflow_events
            total["overflow_events"] += ev
            if ev:
                total["layers"][key] = ev
    return total


def reset_overflow_counts(model) -> None:
    """Zero the counters of every :class:`ELSAAttnProcessor` in ``model``."""
    _check_model(model)
    for proc in model.attn_processors.values():
        if isinstance(proc, ELSAAttnProcessor):
            proc.reset_counters()
