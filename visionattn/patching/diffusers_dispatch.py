"""diffusers models whose attention goes through ``dispatch_attention_fn`` (Flux, SD3, Wan, ...).

The newer diffusers attention classes (``AttentionModuleMixin``: ``FluxAttention``,
``WanAttention``, ...) keep their math in a processor that calls
``diffusers.models.attention_dispatch.dispatch_attention_fn``, which runs the
process-wide or per-processor attention backend. Backends are members of a closed
enum (``AttentionBackendName``), so no new backend can be registered; the native
backends (``native``, ``_native_cudnn``, ``_native_efficient``, ``_native_flash``,
``_native_math``) end in ``torch.nn.functional.scaled_dot_product_attention``.

So each such module gets a *scoped override*: a forward pre-hook marks the module as
running (a per-thread stack) and a forward hook (``always_call``, so an exception
unmarks it too) unmarks it. The processor's own module (e.g.
``diffusers.models.transformers.transformer_flux``) has its ``dispatch_attention_fn``
replaced by a wrapper that, while a patched module runs in the calling thread, enters that
module's :class:`~visionattn.patching.sdpa.SDPAOverride` around the call and otherwise
calls diffusers' function unchanged. The override (a ``TorchFunctionMode``, which costs a
Python call per torch operation) is active only inside ``dispatch_attention_fn``, not
over the projections, norms and rotary embedding of the processor (docs/tuning.md: SDPA
routing only inside dispatch_attention_fn). Processors whose
module does not name ``dispatch_attention_fn`` (and the classic processors below) keep the
override over the module's whole forward. Only SDPA calls made inside a patched module's
forward run :func:`visionattn.attention`; the processor objects, their
``_attention_backend`` / ``_parallel_config`` and the module's parameters are not
touched, and :func:`unpatch_dispatch` removes the hooks and, with the last patched module
using it, the wrapper (the model is then exactly the unpatched model).

A module is dispatcher-backed by diffusers' own test (``ModelMixin.set_attention_backend``):
an instance of ``Attention`` / ``MochiAttention`` / ``AttentionModuleMixin`` whose
processor has an ``_attention_backend`` attribute (the classic ``AttnProcessor2_0``
has none and stays with :mod:`visionattn.patching.diffusers`). The same hooks serve
the classic processors of :data:`SDPA_PROCESSORS`, matched by exact class, whose only
attention is one unmasked ``F.scaled_dot_product_attention`` call (SD3's
``JointAttnProcessor2_0``). Skipped, with the reason: a processor pinned to a non-native
backend (``flash``, ``sage``, ...) and a processor with context parallelism (``_parallel_config``).

At run time every patched module counts its routed and passed SDPA calls
(:func:`dispatch_counts`); a forward that routed no call warns once (a non-native
process-wide backend, attention dropout, grouped-query K/V heads, ...).

diffusers is imported only when a diffusers model is patched.
"""
from __future__ import annotations

import functools
import sys
import threading
from collections import Counter

from torch import nn

from ..dispatch import warn_once
from ..modes import get_mode
from .options import check_options
from .sdpa import SDPAOverride

__all__ = ["patch_dispatch", "unpatch_dispatch", "is_dispatch_patched", "dispatch_counts", "DispatchRoute",
           "NATIVE_BACKENDS", "SDPA_PROCESSORS"]

#: diffusers attention backends that call ``torch.nn.functional.scaled_dot_product_attention``.
NATIVE_BACKENDS = ("native", "_native_cudnn", "_native_efficient", "_native_flash", "_native_math")
#: Classic diffusers processors (``diffusers.models.attention_processor``) that call
#: ``F.scaled_dot_product_attention`` themselves and are routed by the same hooks (exact classes).
SDPA_PROCESSORS = ("JointAttnProcessor2_0",)
# How a routed processor reaches SDPA, appended to its class name in the reports.
_VIA_DISPATCH = "(dispatch_attention_fn)"
_VIA_SDPA = "(scaled_dot_product_attention)"
# Where patch_dispatch keeps {processor key: DispatchRoute} on the model.
_ROUTES_ATTR = "_visionattn_dispatch_routes"
# Per thread: the SDPAOverride of each patched module whose forward runs now (innermost last).
_RUNNING = threading.local()
# processor module name -> number of installed routes that use its dispatch_attention_fn wrapper
_WRAPPED: Counter = Counter()


def _running() -> list:
    stack = getattr(_RUNNING, "stack", None)
    if stack is None:
        stack = _RUNNING.stack = []
    return stack


def _scoped(original):
    """``dispatch_attention_fn`` that runs inside the override of the innermost patched module running in this
    thread, and is diffusers' own call anywhere else."""
    @functools.wraps(original)
    def dispatch_attention_fn(*args, **kwargs):
        stack = _running()
        if not stack:
            return original(*args, **kwargs)
        with stack[-1]:
            return original(*args, **kwargs)

    dispatch_attention_fn._visionattn_original = original
    return dispatch_attention_fn


def _wrap_dispatch(processor) -> str | None:
    """Install the scoped wrapper in the module that defines ``processor``'s class (once per module, counted);
    returns that module's name, or None when it does not call ``dispatch_attention_fn`` by that global name."""
    name = type(processor).__module__
    module = sys.modules.get(name)
    current = getattr(module, "dispatch_attention_fn", None)
    if current is None or not callable(current):
        return None
    if getattr(current, "_visionattn_original", None) is None:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if current is not dispatch_attention_fn:  # a name the processor's module defines itself: leave it
            return None
        module.dispatch_attention_fn = _scoped(current)
    _WRAPPED[name] += 1
    return name


def _unwrap_dispatch(name: str) -> None:
    """One route fewer uses ``name``'s wrapper; the last one puts diffusers' function back."""
    _WRAPPED[name] -= 1
    if _WRAPPED[name] > 0:
        return
    del _WRAPPED[name]
    module = sys.modules.get(name)
    original = getattr(getattr(module, "dispatch_attention_fn", None), "_visionattn_original", None)
    if original is not None:
        module.dispatch_attention_fn = original


class DispatchRoute:
    """The forward hooks of one attention module: its SDPA calls run visionattn while its forward runs.

    Attributes:
        name: the processor key (``"<module path>.processor"``).
        mode: visionattn mode name.
        options: ``backend`` / ``num_splits`` for :func:`visionattn.attention` (None values dropped).
        routed: SDPA calls run by visionattn since patching.
        passed: SDPA calls passed through to PyTorch (see :class:`SDPAOverride`).
        pass_reasons: ``Counter`` of the reasons for passed calls.
    """

    def __init__(self, name: str, mode: str, options: dict):
        self.name = name
        self.mode = mode
        self.options = {k: v for k, v in options.items() if v is not None}
        self.routed = 0
        self.passed = 0
        self.pass_reasons: Counter = Counter()
        self._active: list[SDPAOverride] = []
        self._handles: list = []
        self._wrapped: str | None = None  # the processor module whose dispatch_attention_fn carries the override

    def install(self, module: nn.Module, processor=None) -> None:
        """Register the pre-hook and the always-called hook on ``module``. With ``processor`` (a dispatcher-backed
        one) the override covers only its module's ``dispatch_attention_fn`` where that can be wrapped; otherwise
        the module's whole forward."""
        self._wrapped = None if processor is None else _wrap_dispatch(processor)
        self._handles = [module.register_forward_pre_hook(self._enter),
                         module.register_forward_hook(self._exit, always_call=True)]

    def remove(self) -> None:
        """Remove both hooks (and this route's use of the dispatch wrapper)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._wrapped is not None:
            _unwrap_dispatch(self._wrapped)
            self._wrapped = None

    def _enter(self, module: nn.Module, args) -> None:
        ctx = SDPAOverride(self.mode, **self.options)
        if self._wrapped is not None:
            _running().append(ctx)
        else:
            ctx.__enter__()
        self._active.append(ctx)

    def _exit(self, module: nn.Module, args, output) -> None:
        ctx = self._active.pop()
        if self._wrapped is not None:
            _running().remove(ctx)
        else:
            ctx.__exit__(None, None, None)
        self.routed += ctx.routed
        self.passed += ctx.passed
        self.pass_reasons.update(ctx.pass_reasons)
        if ctx.routed == 0 and output is not None:
            why = (f"its SDPA calls passed through: {dict(ctx.pass_reasons)}" if ctx.passed else
                   "it made no SDPA call (a non-native diffusers attention backend is active, e.g. "
                   "DIFFUSERS_ATTN_BACKEND or `with attention_backend(...)`)")
            warn_once(f"dispatch-unrouted:{type(module).__name__}:{why}",
                      f"visionattn: {type(module).__name__} ({self.name}) is patched but ran no visionattn "
                      f"attention in this call: {why}")


def _diffusers_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(attention classes that may hold a dispatcher-backed processor, the :data:`SDPA_PROCESSORS` classes)
    of the installed diffusers; the first is empty when this diffusers predates ``AttentionModuleMixin``."""
    from diffusers.models import attention_processor

    sdpa = tuple(getattr(attention_processor, n) for n in SDPA_PROCESSORS if hasattr(attention_processor, n))
    try:
        from diffusers.models.attention import AttentionModuleMixin
    except ImportError:
        return (attention_processor.Attention,), sdpa
    return (attention_processor.Attention, attention_processor.MochiAttention, AttentionModuleMixin), sdpa


def _backend_name(backend) -> str | None:
    return None if backend is None else str(getattr(backend, "value", backend))


def is_dispatch_patched(model: nn.Module) -> bool:
    """True when :func:`patch_dispatch` installed hooks on ``model`` that were not removed since."""
    return bool(getattr(model, _ROUTES_ATTR, None))


def patch_dispatch(model: nn.Module, mode: str = "fp32", **options) -> dict:
    """Route the SDPA calls of every dispatcher-backed attention module of ``model`` to visionattn.

    Args:
        model: a diffusers ``ModelMixin`` (``FluxTransformer2DModel``, ``SD3Transformer2DModel``,
            ``WanTransformer3DModel``, ...). Models without dispatcher-backed modules are left as they are.
        mode: visionattn mode (:data:`visionattn.MODES`).
        **options: ``backend`` and ``num_splits`` (passed to :func:`visionattn.attention`);
            ``count_overflow`` is accepted and ignored (the counters belong to
            :class:`~visionattn.patching.diffusers.ELSAAttnProcessor`).

    Returns:
        ``{"replaced": {"<processor class> (dispatch_attention_fn)" or "<processor class>
        (scaled_dot_product_attention)": count}, "patched": [processor keys],
        "skipped": {processor key: {"name", "processor", "reason"}}}``; keys as in ``model.attn_processors``.

    Raises:
        ValueError: unknown mode or bad option value. TypeError: unknown option.
    """
    mode = get_mode(mode).name
    opts = check_options({k: v for k, v in options.items() if k != "count_overflow"})
    if is_dispatch_patched(model):
        unpatch_dispatch(model)
    classes, sdpa_processors = _diffusers_classes()
    routes, replaced, skipped = {}, {}, {}
    for name, module in model.named_modules():
        proc = getattr(module, "processor", None) if isinstance(module, classes) else None
        dispatched = hasattr(proc, "_attention_backend")
        if proc is None or not (dispatched or type(proc) in sdpa_processors):
            continue
        key, proc_name = f"{name}.processor" if name else "processor", type(proc).__name__
        backend = _backend_name(proc._attention_backend) if dispatched else None
        reason = None
        if backend is not None and backend not in NATIVE_BACKENDS:
            reason = (f"processor pinned to diffusers attention backend {backend!r}; only the native backends "
                      f"{list(NATIVE_BACKENDS)} call SDPA (model.reset_attention_backend() clears it)")
        elif getattr(proc, "_parallel_config", None) is not None:
            reason = "context parallelism (_parallel_config) is set: its ring / Ulysses attention is not routed"
        if reason is not None:
            skipped[key] = {"name": key, "processor": proc_name, "reason": reason}
            continue
        route = DispatchRoute(key, mode, opts)
        route.install(module, proc if dispatched else None)
        routes[key] = route
        label = f"{proc_name} {_VIA_DISPATCH if dispatched else _VIA_SDPA}"
        replaced[label] = replaced.get(label, 0) + 1
    if routes:
        setattr(model, _ROUTES_ATTR, routes)
    return {"replaced": replaced, "patched": list(routes), "skipped": skipped}


def unpatch_dispatch(model: nn.Module) -> None:
    """Remove the hooks :func:`patch_dispatch` installed (no-op on a model without them)."""
    for route in (getattr(model, _ROUTES_ATTR, None) or {}).values():
        route.remove()
    if _ROUTES_ATTR in model.__dict__:
        delattr(model, _ROUTES_ATTR)


def dispatch_counts(model: nn.Module) -> dict:
    """SDPA calls seen by the patched modules of ``model`` since patching.

    Returns:
        ``{"routed": int, "passed": int, "pass_reasons": {reason: count}, "modules": {processor key: routed}}``.
    """
    routes = getattr(model, _ROUTES_ATTR, None) or {}
    reasons: Counter = Counter()
    for route in routes.values():
        reasons.update(route.pass_reasons)
    return {"routed": sum(r.routed for r in routes.values()), "passed": sum(r.passed for r in routes.values()),
            "pass_reasons": dict(reasons), "modules": {k: r.routed for k, r in routes.items()}}
