"""patch_model / unpatch_model: the registry of patchers and the patch report.

A *patcher* replaces the attention computation of one exact module class by a
forward that calls :func:`visionattn.attention` (dense) or
:func:`visionattn.window_attention` (Swin windows). It is a module-level
subclass of the original class with only ``forward`` overridden; patching swaps
the instance's ``__class__`` to it and stores the mode on the instance
(``visionattn_mode``, ``visionattn_options``). That choice keeps every property
a patcher needs: parameters, buffers and ``state_dict()`` keys are untouched
(no new parameters, no wrappers), ``.to()`` / ``deepcopy`` / ``pickle`` work
(the class is importable by name), patching twice only updates the mode, and
``unpatch_model`` restores the original class exactly.

Matching is by exact class (``type(module) is cls``), never by attribute
guessing: a user subclass of a supported class may override ``forward`` and is
reported as skipped. Other attention-like modules (``nn.MultiheadAttention``,
classes named ``*Attention*`` / ``*Attn*``) are reported as skipped with the
reason, and a model with nothing to patch warns.

Two more kinds of modules are handled:

* *native* modules that call :func:`visionattn.attention` themselves (the VGGT
  layers in :mod:`visionattn.models`) declare the class attribute
  ``_visionattn_native = True`` and an instance attribute
  ``visionattn_mode: str | None`` (``None`` = PyTorch SDPA); patching sets it,
  unpatching restores the previous value;
* diffusers models (``diffusers.ModelMixin``) are delegated to
  :mod:`visionattn.patching.diffusers`, which goes through ``set_attn_processor``
  (and :mod:`visionattn.patching.diffusers_dispatch` for modules whose processor calls
  ``dispatch_attention_fn``).
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..dispatch import recording, warn_once
from ..modes import get_mode
from .diffusers import is_patched, patch_diffusers, unpatch_diffusers
from .options import check_options

__all__ = ["PatchSpec", "PatchReport", "patch_model", "unpatch_model", "registered_patches", "check_options",
           "inference_cached", "clear_inference_caches"]

#: ``(module providing PATCHES: tuple[PatchSpec, ...], the library it patches)``; imported on first
#: use so that ``import visionattn`` does not import timm. Without that library installed no model
#: can hold its classes, so the provider is left out instead of failing the call.
_PROVIDERS = (("visionattn.patching.timm", "timm"), ("visionattn.patching.timm_families", "timm"),
              ("visionattn.patching.transformers_swin", "transformers"), ("visionattn.patching.naflex", "timm"))

_ATTENTION_LIKE = re.compile(r"attention|attn", re.IGNORECASE)


class PatchSpec(NamedTuple):
    """One registry row.

    Attributes:
        family: short family name for reports (``"vit"``, ``"swin"``, ...).
        original: the exact class that is replaced.
        patched: its module-level subclass whose ``forward`` calls visionattn.
        check: optional ``check(module) -> str | None``: a reason the instance
            cannot be patched (e.g. an attribute missing in this timm version).
    """

    family: str
    original: type
    patched: type
    check: Callable[[nn.Module], str | None] | None = None


@dataclass
class PatchReport:
    """What :func:`patch_model` did; stored as ``model.visionattn_report``.

    Attributes:
        mode: the precision mode the model now runs.
        patched: ``{qualified class name: count}`` of replaced modules.
        native: ``{qualified class name: count}`` of native visionattn modules switched.
        skipped: ``[(module name, qualified class name, reason)]`` of attention-like
            modules left as they are.
        delegated: ``"diffusers"`` when the diffusers patcher did the work.
        details: the delegate's own report (a dict), if any.
    """

    mode: str
    patched: dict[str, int] = field(default_factory=dict)
    native: dict[str, int] = field(default_factory=dict)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    delegated: str | None = None
    details: dict | None = None

    @property
    def num_patched(self) -> int:
        """Modules now running visionattn through this patcher (patched + native)."""
        return sum(self.patched.values()) + sum(self.native.values())

    def as_dict(self) -> dict:
        """JSON-friendly dict."""
        return {"mode": self.mode, "patched": dict(self.patched), "native": dict(self.native),
                "skipped": [list(s) for s in self.skipped], "delegated": self.delegated, "details": self.details}

    def __str__(self) -> str:
        lines = [f"visionattn patch report (mode={self.mode})"]
        for name, n in sorted(self.patched.items()):
            lines.append(f"  patched {n:4d} x {name}")
        for name, n in sorted(self.native.items()):
            lines.append(f"  native  {n:4d} x {name}")
        if self.delegated:
            lines.append(f"  delegated to {self.delegated}: {self.details}")
        for mod, cls, why in self.skipped:
            lines.append(f"  skipped {mod or '<root>'} ({cls}): {why}")
        return "\n".join(lines)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_registry: dict[type, PatchSpec] = {}
_patched_to_spec: dict[type, PatchSpec] = {}
_skips: dict[type, str] = {}  # classes a provider leaves alone on purpose -> why
_loaded: set[str] = set()  # providers imported


def registered_patches(libraries=None) -> dict[type, PatchSpec]:
    """The registry ``{original class: PatchSpec}``, importing the providers of ``libraries`` on first use.

    Args:
        libraries: names of the libraries whose providers to load (``{"timm"}``, ...); None = every installed
            one. :func:`patch_model` passes the libraries the model's modules come from, so patching a timm
            model never imports transformers.

    A provider whose library is not installed (e.g. timm without the ``[timm]`` extra) contributes no rows:
    no model can hold the classes it would replace. A provider may also list classes it leaves alone on
    purpose (``SKIPPED``: ``{class: reason}``), reported with that reason.

    Raises:
        RuntimeError: two providers register a patcher for the same class.
    """
    for provider, library in _PROVIDERS:
        if provider in _loaded or (libraries is not None and library not in libraries):
            continue
        _loaded.add(provider)
        if importlib.util.find_spec(library) is None:
            continue
        module = importlib.import_module(provider)
        for spec in module.PATCHES:
            if spec.original in _registry:
                raise RuntimeError(f"two patchers registered for {_qualname(spec.original)}")
            _registry[spec.original] = spec
            _patched_to_spec[spec.patched] = spec
        _skips.update(getattr(module, "SKIPPED", {}))
    return _registry


def _libraries(model: nn.Module) -> set[str]:
    """Libraries the classes of ``model``'s modules come from (``timm``, ``transformers``, ...), a patched class
    counting as its provider's library (a patched model unpickled in a new process)."""
    modules = {type(m).__module__ for m in model.modules()}
    return {name.partition(".")[0] for name in modules} | {lib for prov, lib in _PROVIDERS if prov in modules}


def _is_native(module: nn.Module) -> bool:
    return getattr(type(module), "_visionattn_native", False) is True


def _is_diffusers_model(model: nn.Module) -> bool:
    # diffusers is optional: only a model whose class comes from it can be a ModelMixin.
    if not any(c.__module__.startswith("diffusers") for c in type(model).__mro__):
        return False
    from diffusers import ModelMixin

    return isinstance(model, ModelMixin)


def _skip_reason(module: nn.Module, registry: dict[type, PatchSpec]) -> str | None:
    """Why an unpatched module that looks like attention is left alone (None: not attention-like)."""
    cls = type(module)
    for base in cls.__mro__[1:]:
        if base in registry:
            overrides = cls.forward is not base.forward
            return (f"subclass of supported {_qualname(base)}"
                    + (" that overrides forward" if overrides else "")
                    + "; only exact classes are patched (register a PatchSpec for it)")
    if isinstance(module, nn.MultiheadAttention):
        return ("torch.nn.MultiheadAttention is not patched (its inference fast path is a fused native "
                "kernel); its SDPA path (need_weights=False) can run under visionattn.sdpa_override")
    if cls in _skips:
        return _skips[cls]
    if cls.__module__.startswith("diffusers"):
        return "diffusers module: call patch_model on the diffusers ModelMixin model to patch it"
    if _ATTENTION_LIKE.search(cls.__name__):
        return "attention-like class without a visionattn patcher"
    return None


def _innermost(skipped: list[tuple[str, str, str]], touched: list[str]) -> list[tuple[str, str, str]]:
    """Drop name-matched containers (``AttnBlock``, ...) holding handled or skipped attention modules."""
    inner = [n for n, _, _ in skipped] + touched

    def is_container(name: str) -> bool:
        prefix = name + "." if name else ""
        return any(other != name and other.startswith(prefix) for other in inner)

    return [s for s in skipped if not (s[2].startswith("attention-like class") and is_container(s[0]))]


def patch_model(model: nn.Module, mode: str = "fp32", **options) -> nn.Module:
    """Run every supported attention module of ``model`` through visionattn, in place.

    Supported (exact classes, the ``PATCHES`` of the providers in ``_PROVIDERS``): timm's ``layers.Attention``
    (ViT, DeiT, ...), ``layers.AttentionRope``, ``eva.EvaAttention``, the Swin and Swin-v2
    ``WindowAttention``, BEiT, CaiT / XCiT class attention, XCiT's XCA, MaxViT / CoAtNet, Hiera and MViTv2
    attention (:mod:`visionattn.patching.timm_families`), NaFlexViT's padded batches
    (:mod:`visionattn.patching.naflex`); transformers' Swin / Swin-v2 self-attention
    (:mod:`visionattn.patching.transformers_swin`); native visionattn modules (``_visionattn_native = True``);
    diffusers ``ModelMixin`` models (delegated). Only the providers of the libraries the model's modules
    come from are imported. The README's integration table lists what reaches the kernel for each.
    Patching an already patched model updates its mode and options.

    Args:
        model: any ``nn.Module``; its parameters, buffers and dtype are not touched.
        mode: a visionattn mode (:data:`visionattn.MODES`); inputs of attention are cast to
            the mode's dtype and the result cast back, so a FP32 model can run ``fp16`` attention.
        **options: ``backend`` and ``num_splits``, passed to :func:`visionattn.attention`.

    Returns:
        ``model`` itself, with ``model.visionattn_report`` (:class:`PatchReport`).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or an unknown option.
        ValueError: unknown mode or bad option value.

    Warns:
        RuntimeWarning: nothing in ``model`` could be patched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mode = get_mode(mode).name
    if _is_diffusers_model(model):
        details = dict(patch_diffusers(model, mode, **options))
        report = PatchReport(mode=mode, delegated="diffusers", details=details)
        report.patched = {f"diffusers processor {name}": n for name, n in details.get("replaced", {}).items()}
        report.skipped = [(s["name"], s["processor"], s["reason"]) for s in details.get("skipped", [])]
        if report.num_patched == 0:
            warnings.warn(f"visionattn.patch_model: nothing to patch in {type(model).__name__} (no diffusers "
                          f"Attention module with a default processor, no processor calling dispatch_attention_fn "
                          f"on a native backend); the model runs unchanged",
                          RuntimeWarning, stacklevel=2)
        model.visionattn_report = report
        return model
    opts = check_options(options)
    registry = registered_patches(_libraries(model))
    report = PatchReport(mode=mode)
    touched: list[str] = []  # names of patched / native modules
    for name, module in model.named_modules():
        cls = type(module)
        spec = registry.get(cls) or _patched_to_spec.get(cls)
        if spec is not None or _is_native(module):
            touched.append(name)
        if spec is not None:
            reason = spec.check(module) if spec.check is not None else None
            if reason is not None:
                report.skipped.append((name, _qualname(cls), reason))
                continue
            if cls is spec.original:
                module.__class__ = spec.patched
            module.visionattn_mode = mode
            module.visionattn_options = dict(opts)
            key = _qualname(spec.original)
            report.patched[key] = report.patched.get(key, 0) + 1
        elif _is_native(module):
            if "_visionattn_prev_mode" not in module.__dict__:
                module._visionattn_prev_mode = module.visionattn_mode
            module.visionattn_mode = mode
            key = _qualname(cls)
            report.native[key] = report.native.get(key, 0) + 1
        else:
            reason = _skip_reason(module, registry)
            if reason is not None:
                report.skipped.append((name, _qualname(cls), reason))
    report.skipped = _innermost(report.skipped, touched)
    if report.num_patched == 0:
        warnings.warn(
            f"visionattn.patch_model: nothing to patch in {type(model).__name__} (no module of a supported "
            f"class: {sorted(_qualname(c) for c in registry)}); the model runs unchanged"
            + (f"; attention-like modules skipped: {sorted({s[1] for s in report.skipped})}"
               if report.skipped else "")
            + ". For other models use `with visionattn.sdpa_override(mode):`.",
            RuntimeWarning, stacklevel=2)
    model.visionattn_report = report
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model` in place: original classes, previous native modes, no report.

    Safe on a model that was never patched (returns it unchanged).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _is_diffusers_model(model):
        if is_patched(model):
            unpatch_diffusers(model)
    else:
        registered_patches(_libraries(model))
        for module in model.modules():
            spec = _patched_to_spec.get(type(module))
            if spec is not None:
                module.__class__ = spec.original
                for attr in ("visionattn_mode", "visionattn_options"):
                    module.__dict__.pop(attr, None)
                _drop_inference_caches(module)
            elif _is_native(module) and "_visionattn_prev_mode" in module.__dict__:
                module.visionattn_mode = module.__dict__.pop("_visionattn_prev_mode")
    model.__dict__.pop("visionattn_report", None)
    return model


def attention_kwargs(module: nn.Module) -> dict:
    """``mode`` / ``backend`` / ``num_splits`` keyword arguments stored on a patched module."""
    opts = module.visionattn_options
    kw = {"mode": module.visionattn_mode}
    if opts["backend"] is not None:
        kw["backend"] = opts["backend"]
    if opts["num_splits"] is not None:
        kw["num_splits"] = opts["num_splits"]
    return kw


_CACHE_PREFIX = "_visionattn_cached_"  # attributes of inference_cached values on a module


def gathered_bias(table: torch.Tensor, index: torch.Tensor, N: int) -> torch.Tensor:
    """A Swin relative position bias [H, N, N] (contiguous) from its per-head table [T, H] and the [N, N] index
    into it: timm's / transformers' ``table[index].view(N, N, H).permute(2, 0, 1).contiguous()`` as one gather
    along the table's transposed view (the same values; one op and one backward node instead of three, where
    training gathers every forward)."""
    return table.t()[:, index.view(-1)].view(-1, N, N)


def inference_cached(module: nn.Module, name: str, sources: tuple, compute: Callable):
    """``compute()``, kept on ``module`` and reused while its ``sources`` (the parameters and buffers it reads)
    stay the same, in eager inference only: with gradients enabled or ``module.training`` it runs every call
    (autograd needs the graph), and so it does while ``torch.compile`` traces and while a CUDA graph is captured
    (the compiled or captured graph computes it, so replays follow in-place parameter updates), and while
    ``torch.jit.trace`` records (the traced graph computes it from the parameters). Used for what a
    patched module derives from its parameters alone (Swin's gathered relative position bias, Swin-v2's
    continuous position bias MLP): bit-identical to recomputing it, and one forward of a Swin-v2-B runs 24 of
    those small MLPs whose launches are host time. A source counts as changed when its
    address, dtype, device or version counter does (in-place updates, ``load_state_dict``, ``.to()``); edits
    through ``tensor.data`` bypass the version counter, so after those call :func:`clear_inference_caches`. The
    value is kept per inference-mode state (a tensor made under ``torch.inference_mode`` stays there).

    Args:
        module: the patched module (the value lives in its ``__dict__``, not in its state dict).
        name: what is cached, unique within the module.
        sources: the tensors ``compute`` reads.
        compute: ``() -> torch.Tensor``.
    """
    if (torch.is_grad_enabled() or module.training or recording()
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
        return compute()
    try:
        key = (torch.is_inference_mode_enabled(), *[(t.data_ptr(), t._version, t.dtype, t.device) for t in sources])
    except RuntimeError:  # inference tensors (a model built under torch.inference_mode) track no version: no cache
        return compute()
    attr = _CACHE_PREFIX + name
    kept = module.__dict__.get(attr)
    if kept is not None and kept[0] == key:
        return kept[1]
    value = compute()
    module.__dict__[attr] = (key, value)
    return value


def _drop_inference_caches(module: nn.Module) -> None:
    for attr in [a for a in module.__dict__ if a.startswith(_CACHE_PREFIX)]:
        del module.__dict__[attr]


def clear_inference_caches(model: nn.Module) -> nn.Module:
    """Drop every value :func:`inference_cached` keeps in ``model``'s modules (recomputed on the next inference
    forward): after editing parameters through ``tensor.data``, or to free their memory. Returns ``model``."""
    for module in model.modules():
        _drop_inference_caches(module)
    return model


def dropout_fallback(module: nn.Module) -> bool:
    """True when ``module`` must run its original forward: training with attention dropout > 0.

    visionattn computes exact attention without dropout on the probabilities; rather
    than silently dropping the regularizer, the module runs timm's own path (warned once).
    """
    if module.training and module.attn_drop.p > 0:
        warn_once(f"patch-dropout:{type(module).__name__}",
                  f"visionattn: {_qualname(type(module).__mro__[1])} is in training mode with attention "
                  f"dropout p={module.attn_drop.p}; visionattn does not apply dropout to attention "
                  f"probabilities, so these calls run the original timm path (call model.eval() or set "
                  f"attn_drop.p=0 to use visionattn)")
        return True
    return False
