"""Cheap kernel launches from cached launch plans.

A call of :func:`visionattn.attention` decides once per *plan key* what to launch
(kernel, tile config, KV splits, grid, constexprs) and keeps the decision in a
plan; every later call with the same key only allocates its outputs and launches.
Two pieces live here:

* :class:`KernelCall` — one launch of a ``@triton.jit`` / ``@gluon.jit`` kernel with a
  fixed grid, constexprs and launch options. Its first call goes through Triton's
  JIT path (argument binding, specialisation, compile or cache lookup, ~20-60 us of
  host time); it keeps the compiled kernel that path returns and hands later
  calls' arguments straight to the compiled kernel's launcher (a few us).
* :class:`PlanCache` — a bounded dict from plan keys to plans, with hit / build counters
  (tests read them to prove a second call reuses the plan).

Reusing a compiled kernel is only correct for arguments Triton would have
specialised the same way: equal integer arguments (strides, sizes that are not
``do_not_specialize``), equal dtypes and the same 16-byte alignment of every
pointer. Plan keys therefore hold the exact shapes and strides of every tensor
and the alignment class of every data pointer; a new sequence length makes a new
plan (one slow call), never a new compile (lengths are not specialised on).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

__all__ = ["KernelCall", "PlanCache", "launch", "interpreting", "recording", "qkv_key", "tensor_key",
           "SPIN_UNTIL_EQUAL_PTX"]

# ``inline_asm_elementwise`` body of the ordered reductions' wait (the single-pass backward's dQ adds): given a
# value read earlier ($1), re-read the int32 at address $2 with relaxed GPU-scope loads until it equals $3, and
# return it ($0); a PTX loop keeps the caller's loop free of a nested loop. A plain string (this module must not
# import Triton): kernels wrap it in a constexpr
SPIN_UNTIL_EQUAL_PTX = (
    "{ .reg .pred %p; .reg .b32 %c; mov.b32 %c, $1; spin_${:uid}: setp.ne.s32 %p, %c, $3; "
    "@%p ld.relaxed.gpu.global.b32 %c, [$2]; @%p bra spin_${:uid}; mov.b32 $0, %c; }")


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``), read per call: tests set it."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def recording() -> bool:
    """Whether ``torch.compile`` or ``torch.jit.trace`` records the call being made: the kernels then run as their
    custom ops, which the recorded graph holds (a direct launch would write its output where neither sees it), and
    no call-signature cache, inference cache or data-dependent shortcut is taken."""
    return torch.compiler.is_compiling() or torch._C._is_tracing()


def _launch_hooks_set() -> bool:
    """Whether a Triton launch hook (a profiler's) is installed; recent releases keep an always-present
    ``HookChain`` whose ``calls`` list is empty when none is."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - Triton releases before knobs
        return False
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _raw_launcher(run) -> Callable | None:
    """The compiled C launcher behind Triton's ``CudaLauncher`` when a call may go to it directly, else None.

    ``CudaLauncher.__call__`` of Triton 3.4-3.6 (``(gridX, gridY, gridZ, stream, function, *args)``) only
    allocates the global / profile scratch and passes everything on to ``launch``; for a kernel that needs no
    scratch, and whose ``launch`` is the C function itself (no tensor-descriptor wrapper), calling ``launch``
    with ``None`` scratch is the same launch without a Python frame and two closures (about 1-2 us of host time
    per launch). Other Triton layouts (3.7 onwards reorder the launcher's arguments) keep ``run``."""
    try:
        import inspect

        params = list(inspect.signature(type(run).__call__).parameters)
        raw = run.launch
        if (params != ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
                or run.global_scratch_size or run.profile_scratch_size or inspect.isfunction(raw)
                or getattr(raw, "__name__", None) != "launch"):
            return None
        run.launch_cooperative_grid, run.launch_pdl  # noqa: B018 - both must exist
    except (AttributeError, TypeError, ValueError):
        return None
    return raw


class KernelCall:
    """One launch of a Triton kernel with a fixed grid, constexprs and launch options.

    Args:
        fn: the ``@triton.jit`` (or ``@gluon.jit``) kernel.
        grid: the launch grid, 1 to 3 ints.
        constexprs: every ``tl.constexpr`` parameter of ``fn`` by name; in ``fn``'s signature they must
            follow all runtime parameters (the fast path appends their values to the runtime arguments).
        options: launch options (``num_warps``, ``num_stages``, ``maxnreg`` ...).

    Calling it with the runtime arguments (in signature order) launches on the current stream. The
    first call compiles or finds the kernel through Triton's JIT; later calls go to the compiled
    kernel's launcher directly. Under the interpreter, with Triton launch hooks set (profilers) when the
    first call runs, or with a Triton whose compiled kernels lack that launcher, every call takes the JIT
    path (``slow_reason`` says why).

    Raises:
        ValueError: a constexpr parameter precedes a runtime one in ``fn``'s signature, or ``constexprs``
            does not name exactly ``fn``'s constexpr parameters.
    """

    __slots__ = ("fn", "grid", "constexprs", "options", "_tail", "_fast", "_grid3", "_parts", "slow_reason")

    def __init__(self, fn, grid: tuple[int, ...], constexprs: dict[str, Any], options: dict[str, Any]):
        self.fn, self.grid, self.constexprs, self.options = fn, tuple(grid), constexprs, options
        names = list(getattr(fn, "arg_names", []))
        is_constexpr = [p.is_constexpr for p in getattr(fn, "params", [])]
        if names and is_constexpr:
            first = is_constexpr.index(True) if True in is_constexpr else len(names)
            if not all(is_constexpr[first:]):
                raise ValueError(f"{names}: constexpr parameters must follow the runtime ones")
            if set(names[first:]) != set(constexprs):
                raise ValueError(f"constexprs {sorted(constexprs)} != the kernel's {names[first:]}")
            self._tail = tuple(constexprs[n] for n in names[first:])
        else:  # pragma: no cover - a JIT object without the introspection used above: JIT path only
            self._tail = None
        self._fast: Callable | None = None
        self._grid3 = (self.grid + (1, 1))[:3]
        self._parts: tuple | None = None  # (launcher, function, packed metadata, device getter, stream getter)
        self.slow_reason: str | None = None  # why calls stay on the JIT path, once known

    def __call__(self, *args) -> None:
        fast = self._fast
        if fast is not None:
            fast(*args)
            return
        compiled = self.fn[self.grid](*args, **self.constexprs, **self.options)
        if self.slow_reason is not None:
            return
        if compiled is None or interpreting():
            self.slow_reason = "interpreted"
        elif self._tail is None:
            self.slow_reason = "the kernel does not list its parameters"
        elif _launch_hooks_set():
            self.slow_reason = "Triton launch hooks are set"
        else:
            self._fast = self._direct(compiled)

    def _direct(self, compiled) -> Callable | None:
        try:
            run = compiled.run  # a property that loads the module on first access in recent releases
            function, packed = compiled.function, compiled.packed_metadata
            from triton.runtime import driver

            active = driver.active
            current_device, current_stream = active.get_current_device, active.get_current_stream
            # torch.cuda.current_device() (Triton's getter) re-checks CUDA initialisation on every call; the
            # plan's device is initialised, so ask torch's C getter directly where this torch has it
            current_device = getattr(torch._C, "_cuda_getDevice", current_device)
        except (AttributeError, ImportError) as exc:  # pragma: no cover - another Triton layout: keep the JIT path
            self.slow_reason = f"{type(exc).__name__}: {exc}"
            return None
        g0, g1, g2 = self._grid3
        tail = self._tail
        self._parts = (run, function, packed, current_device, current_stream)
        raw = _raw_launcher(run)
        if raw is not None:
            cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl

            def launch(*args):
                raw(g0, g1, g2, current_stream(current_device()), function, cooperative, pdl, None, None, packed,
                    None, None, None, *args, *tail)

            return launch

        def launch(*args):
            run(g0, g1, g2, current_stream(current_device()), function, packed, None, None, None, *args, *tail)

        return launch

    def with_descriptors(self, templates) -> Callable | None:
        """A launch taking the base tensors of the kernel's leading TMA descriptor arguments instead of the
        descriptors: ``launch(base_0, .., base_{n-1}, *other_args)``, for descriptors shaped as ``templates``
        (host-side ``TensorDescriptor`` objects of the compiled call; their ``base`` is ignored).

        Each call encodes the tensor maps itself (one ``cuTensorMapEncodeTiled`` per descriptor, through
        Triton's own ``fill_tma_descriptor``, with the block shape, swizzle and element type Triton compiled
        the kernel for) and hands them to the compiled launcher, skipping the per-call Python wrapper that
        expands descriptor objects (~8 us of host time per call on an H100 host). Available after the
        first call, on Triton releases whose launcher wraps descriptors as 3.4-3.6 do; else None (keep
        calling with descriptors). The result is the same launch: the wrapper builds the same maps.
        """
        if self._parts is None:
            return None
        run, function, packed, current_device, current_stream = self._parts
        n = len(templates)
        try:
            wrapper = run.launch
            env = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__ or ())))
            raw, positions, metas = env["launcher"], sorted(env["tensordesc_indices"]), list(env["tensordesc_meta"])
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
            from triton.runtime import driver

            fill = driver.active.utils.fill_tma_descriptor
            cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
            if (positions != list(range(n)) or len(metas) != n or run.global_scratch_size
                    or run.profile_scratch_size or any(m is None or m.get("fp4_padded") for m in metas)):
                return None
            fixed = []  # per descriptor: fill's arguments after the address, then the shape and strides it expands to
            for t, m in zip(templates, metas):
                shape, strides = list(t.shape), list(t.strides)
                padding = 1 if getattr(t, "padding", "zero") == "nan" else 0
                fixed.append(((m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]],
                               m["block_size"], shape, strides, padding), (*shape, *strides)))
        except (AttributeError, KeyError, ImportError, TypeError, IndexError):  # another Triton's launcher layout
            return None
        g0, g1, g2 = self._grid3
        tail = self._tail

        def launch(*args):
            expanded = []
            for base, (encode, dims) in zip(args[:n], fixed):
                expanded.append(fill(base.data_ptr(), *encode))
                expanded.extend(dims)
            raw(g0, g1, g2, current_stream(current_device()), function, cooperative, pdl, None, None, packed, None,
                None, None, *expanded, *args[n:], *tail)

        return launch


def qkv_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What a plan depends on of query, key and value: shapes, strides, dtypes, devices (each one's: a key on
    another device, or on ``meta``, must not reach a runner built for one device), the 16-byte alignment of each data
    pointer."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15)


def tensor_key(t: torch.Tensor | None):
    """What a plan depends on of an optional tensor argument: shape, strides, dtype, device, the 16-byte
    alignment of its data pointer, whether it needs gradients."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15, t.requires_grad

class PlanCache:
    """Plans by key, at most ``max_size`` of them (the oldest half is dropped when full).

    ``hits`` / ``builds`` count lookups that found a plan and plans built; tests read them.
    """

    def __init__(self, max_size: int = 4096):
        self.max_size = max_size
        self.plans: dict = {}
        self.hits = 0
        self.builds = 0

    def get(self, key):
        plan = self.plans.get(key)
        if plan is not None:
            self.hits += 1
        return plan

    def lookup(self, make_key: Callable, *args) -> tuple:
        """``(key, plan)`` of a public call: ``key = make_key(*args)`` and the plan kept under it (None when new).
        ``(None, None)`` while :func:`recording` (the graph must hold the custom ops, not a direct launch) and
        where ``make_key`` raises AttributeError / TypeError / RuntimeError (arguments that are not tensors, or
        unhashable: the caller's checks then say why)."""
        if torch.compiler.is_compiling() or torch._C._is_tracing():
            return None, None
        try:
            key = make_key(*args)
            plan = self.plans.get(key)
        except (AttributeError, TypeError, RuntimeError):
            return None, None
        if plan is not None:
            self.hits += 1
        return key, plan

    def put(self, key, plan):
        if len(self.plans) >= self.max_size:
            for old in list(self.plans)[: self.max_size // 2]:
                del self.plans[old]
        self.plans[key] = plan
        self.builds += 1
        return plan

    def clear(self) -> None:
        self.plans.clear()
        self.hits = self.builds = 0


# (kernel, grid, argument signature, constexprs, options) -> KernelCall; see launch()
_CALLS: dict = {}


def launch(fn, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], options: dict[str, Any]) -> None:
    """Launch ``fn[grid](*args, **constexprs, **options)`` through a :class:`KernelCall` cached on everything
    Triton specialises on: every integer argument's value, every tensor argument's dtype and 16-byte alignment,
    the types of the other arguments, the constexprs and options. For launchers without a plan of their own:
    building this key costs a few microseconds, far less than the JIT path it replaces on repeated calls."""
    sig = tuple(a if type(a) is int else (a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else type(a)
                for a in args)
    key = (fn, grid, sig, tuple(constexprs.items()), tuple(options.items()))
    call = _CALLS.get(key)
    if call is None:
        if len(_CALLS) >= 4096:
            _CALLS.clear()
        call = _CALLS[key] = KernelCall(fn, grid, constexprs, options)
    call(*args)
