"""Cheap kernel launches from cached launch plans.

A call of :func:`visionattn.attention` decides once per *plan key* what to launch
(kernel, tile config, KV splits, grid, constexprs) and keeps the decision in a
plan; every later call with the same key only allocates its outputs and launches.
What lives here:

* :class:`KernelCall` — one launch of a ``@triton.jit`` / ``@gluon.jit`` kernel with a
  fixed grid, constexprs and launch options. Its first call goes through Triton's
  JIT path (argument binding, specialisation, compile or cache lookup, ~20-60 us of
  host time); it keeps the compiled kernel that path returns and hands later
  calls' arguments straight to the compiled kernel's launcher (a few us).
* :class:`PlanCache` — a bounded dict from plan keys to plans, with hit / build counters
  (tests read them to prove a second call reuses the plan).
* The host-side helpers the kernel modules build plans with: integer tile math (:func:`cdiv`,
  :func:`pad_pow2`, :func:`head_blocks`), the layouts the kernels read and write (:func:`unit_last_stride`,
  :func:`backward_operands`, :func:`heads_inner_layout`, :data:`OUT_DTYPES`), the GPU's SM count and the
  out-of-shared-memory config fallback (:func:`run_first_that_fits`). A first call's plan is thus built from its
  kernel module and this one.
* The plans' runs: what a repeat call executes once a kernel module has built its plan
  (:class:`DenseForwardRun`, :class:`GluonForwardPlan`, :class:`EmptyForwardPlan`, :class:`PlannedLaunch`,
  :class:`WindowForwardRun`, :class:`VarlenForwardRun`). The kernel modules choose and build (kernels,
  tiles, grids, fixed arguments); the runs live here, so a repeat call goes from the public function
  to this module and the compiled launcher, through no other file.

Reusing a compiled kernel is only correct for arguments Triton would have
specialised the same way: equal integer arguments (strides, sizes that are not
``do_not_specialize``), equal dtypes and the same 16-byte alignment of every
pointer. Plan keys therefore hold the exact shapes and strides of every tensor
and the alignment class of every data pointer; a new sequence length makes a new
plan (one slow call), never a new compile (lengths are not specialised on).
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, TypeVar

import torch

__all__ = ["KernelCall", "PlanCache", "launch", "interpreting", "recording", "qkv_key", "tensor_key",
           "SPIN_UNTIL_EQUAL_PTX", "LOG2E", "launch_partitions", "DenseForwardRun", "GluonForwardPlan",
           "EmptyForwardPlan", "PlannedLaunch", "WindowForwardRun", "VarlenForwardRun", "cdiv", "pad_pow2",
           "head_blocks", "OUT_DTYPES", "unit_last_stride", "heads_inner_layout", "heads_inner_output",
           "allocate_output", "sm_count", "run_first_that_fits", "backward_operands"]

# the kernels exponentiate with exp2: a softmax scale reaches them as scale * log2(e)
LOG2E = 1.4426950408889634

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
        ValueError: a constexpr parameter precedes a runtime one in ``fn``'s signature, ``constexprs``
            does not name exactly ``fn``'s constexpr parameters, or ``grid`` exceeds CUDA's launch limits
            (:data:`GRID_AXIS_LIMITS`; :func:`over_axes_1_2` spreads a long second axis over the third).
    """

    __slots__ = ("fn", "grid", "constexprs", "options", "_tail", "_fast", "_grid3", "_parts", "slow_reason")

    def __init__(self, fn, grid: tuple[int, ...], constexprs: dict[str, Any], options: dict[str, Any]):
        self.fn, self.grid, self.constexprs, self.options = fn, tuple(grid), constexprs, options
        if any(g > limit for g, limit in zip(self.grid, GRID_AXIS_LIMITS)):
            name = getattr(getattr(fn, "fn", fn), "__name__", fn)
            raise ValueError(f"{name}: launch grid {self.grid} exceeds CUDA's limits (2^31 - 1 programs on axis 0, "
                             f"65,535 on axes 1 and 2)")
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

def device_table(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(copy on device, its source)`` of a host-built table (offsets, tiles, partitions) that launches read: for
    CUDA, one asynchronous copy from pinned memory (not one that waits for the stream). The caller keeps the pinned
    source with the copy: a copy made while a CUDA graph is captured reads it again at every replay."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True), host


def graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (False, without a query, before CUDA is used)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class PlanCache:
    """Plans by key, at most ``max_size`` of them besides the pinned ones (the oldest half is dropped when full).

    ``graph_safe``: the plans hold device tensors that their launches read (tables of offsets, tiles, partitions). A
    CUDA graph captured with such a launch reads the tensor at every replay, so an entry found or stored while a
    graph is being captured is pinned (:attr:`pinned`): never dropped, as the graph may outlive any later use. One
    capture query per lookup (~0.85 us of host time on an H200 host), so only the caches that hold such tables and
    churn with the lengths of ragged calls take it.

    ``hits`` / ``builds`` count lookups that found a plan and plans built; tests read them.
    """

    def __init__(self, max_size: int = 4096, graph_safe: bool = False):
        self.max_size = max_size
        self.graph_safe = graph_safe
        self.plans: dict = {}
        self.pinned: set = set()
        self.hits = 0
        self.builds = 0

    def get(self, key):
        plan = self.plans.get(key)
        if plan is not None:
            self.hits += 1
            if self.graph_safe and graph_capturing():
                self.pinned.add(key)
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
            if self.graph_safe and graph_capturing():
                self.pinned.add(key)
        return key, plan

    def put(self, key, plan):
        if len(self.plans) - len(self.pinned) >= self.max_size:  # the oldest half of the entries not pinned
            for old in [k for k in self.plans if k not in self.pinned][: self.max_size // 2]:
                del self.plans[old]
        self.plans[key] = plan
        self.builds += 1
        if self.graph_safe and graph_capturing():
            self.pinned.add(key)
        return plan

    def clear(self) -> None:
        self.plans.clear()
        self.pinned.clear()
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


# ----------------------------------------------------------------------------- host-side helpers
# ``triton.cdiv`` / ``triton.next_power_of_2`` are Triton constexpr functions: called from Python they go through
# the JIT call path (~2 us each), and a launcher calls them several times per attention call. These are the
# plain-integer equivalents, with the output layouts, the SM count and the config fallback the plans share.
C = TypeVar("C")


GRID_AXIS_LIMITS = (2 ** 31 - 1, 65_535, 65_535)  # CUDA's programs per launch grid axis (x, y, z)


def over_axes_1_2(n: int) -> tuple[int, int]:
    """Grid axes 1 and 2 ``(y, z)`` holding ``n`` programs where axis 1 alone holds at most 65,535: ``y * z >= n``
    (fewer than ``z`` programs past ``n``, which the kernel skips), ``z = 1`` up to 65,535 programs. The kernel reads
    its index as ``program_id(1) + program_id(2) * num_programs(1)`` (axis 1 fastest: programs keep their order; no
    division decodes it), and where ``z = 1`` as ``program_id(1)`` alone, compiled as before."""
    z = max(1, cdiv(n, GRID_AXIS_LIMITS[1]))
    return cdiv(n, z), z


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def pad_pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= max(n, lo) (tile widths: 80 -> 128, 49 -> 64, 8 -> 16)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def head_blocks(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_DV)``, the tile widths of a kernel's q / k rows and v / output rows: both the larger head
    dim padded to a power of two >= 16 (:func:`pad_pow2`), for every kind of product.

    On the GPU, Triton 3.6 compiles a kernel whose V tile is narrower or wider than its K tile into code that
    addresses shared memory out of range, where the interpreter computes the same kernel correctly: split-FP16
    products (e.g. D = 64, Dv = 16: compute-sanitizer "Out-of-range shared or local address" in
    :func:`.split16.fold_pv`, NaN or wrong outputs), native fp16 / bf16 products (the varlen forward at D = 72,
    Dv = 32 with a V not 16-byte aligned: relative errors 0.8-2.1 and an illegal address) and PASA's (D = 256,
    Dv = 32: "Invalid __shared__ read" in its P V product). Equal widths compile correctly; the padded columns are
    masked loads and stores like any padded head dim, extra work only where D != Dv.
    """
    block = pad_pow2(max(head_dim, head_dim_v))
    return block, block


# dtypes the kernels can write their output in (the FP32 state is divided and rounded once to it)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def backward_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, out, grad_out)`` as the backward kernels read them, for every backward entry point.

    * Each with a unit last stride (:func:`unit_last_stride`: out.sum()'s dO is stride 0).
    * A float64 ``grad_out`` rounded to ``q.dtype`` (the compute dtype) by torch first, one correctly rounded cast
      as the GPU kernels' own; narrower ones as given (the kernels round them). The interpreter's float64 ->
      bfloat16 cast is wrong (1.0 -> 0, -2.5 -> NaN), so a direct backward call with a float64 gradient under
      ``TRITON_INTERPRET=1`` would give NaN gradients.
    """
    if grad_out.dtype == torch.float64:
        grad_out = grad_out.to(q.dtype)
    return tuple(unit_last_stride(t) for t in (q, k, v, out, grad_out))


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has unit stride, else the same values laid out so that it has: a view
    with that stride set to 1 when the last dim has size 1 (no copy; the stride of a size-1 dim is never used),
    else one contiguous copy.

    Every kernel takes the rows of its head-dim operands (q, k, v, out, dO) through their strides, and Triton
    specialises a stride argument of 1 into the compiled kernel. With any other last-dim stride (``out.sum()``'s
    stride-0 gradient, a ``[..., ::2]`` slice) Triton 3.6 compiles kernels that are wrong on the GPU though
    right in the interpreter: the single-pass dense backward read shared memory out of bounds (an illegal
    memory access in fp32, NaN gradients in tf32). The launchers therefore only ever pass unit last strides;
    the other strides (batch, head, row, stride 0 included) are read as given.
    """
    if t.stride(-1) == 1:
        return t
    if t.shape[-1] == 1:
        return t.as_strided(t.shape, (*t.stride()[:-1], 1))
    return t.contiguous()


def heads_inner_layout(batch: int, heads: int, n_q: int, dv: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(shape, strides)`` of the [B, H, Nq, Dv] output every kernel writes: a view of a contiguous
    [B, Nq, H, Dv] buffer (see :func:`heads_inner_output`); launch plans allocate it with
    ``torch.empty_strided`` in one call."""
    return (batch, heads, n_q, dv), (n_q * heads * dv, dv, heads * dv, 1)


def heads_inner_output(q: torch.Tensor, n_q: int, dv: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, Nq, Dv] view of a contiguous [B, Nq, H, Dv] buffer, the layout SDPA's flash path
    returns: the callers' ``out.transpose(1, 2).reshape(B, Nq, H * Dv)`` (timm, diffusers, VGGT)
    is then a view instead of a copy.

    Raises:
        TypeError: ``dtype`` not in :data:`OUT_DTYPES`.
    """
    if dtype not in OUT_DTYPES:
        raise TypeError(f"output dtype {dtype} (the out_dtype argument, or the inputs' dtype where none is "
                        f"given); the kernels write one of {OUT_DTYPES}")
    B, H = q.shape[0], q.shape[1]
    return torch.empty((B, n_q, H, dv), device=q.device, dtype=dtype).transpose(1, 2)


def allocate_output(q: torch.Tensor, n_k: int, dv: int, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """The :func:`heads_inner_output` for queries ``q`` [B, H, Nq, D], and whether a kernel must fill it:
    ``False`` when it is empty, or when there are no keys (then it is zeros: W = 0 over no keys).

    Raises:
        TypeError: ``dtype`` not in :data:`OUT_DTYPES`.
    """
    B, H, n_q = q.shape[:3]
    out = heads_inner_output(q, n_q, dv, dtype)
    if B * H * n_q == 0 or dv == 0:
        return out, False
    if n_k == 0:
        return out.zero_(), False
    return out, True


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (cached: the property query costs microseconds)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def run_first_that_fits(run: Callable[[C], None], config: C, smaller: Callable[[C], list[C]]) -> C:
    """``run(config)``; if the compiled kernel needs more shared memory than the GPU has (bias / mask
    tiles are pipelined too), ``run`` each of ``smaller(config)`` in order until one fits.

    Returns the config that ran. Raises the last ``triton.runtime.errors.OutOfResources`` when
    none fits (at once when ``smaller(config)`` is empty); ``smaller`` is only called on failure.
    """
    from triton.runtime.errors import OutOfResources  # a plan is built: Triton is imported already

    try:
        run(config)
        return config
    except OutOfResources as exc:
        err = exc
    for c in smaller(config):
        try:
            run(c)
            return c
        except OutOfResources as exc:
            err = exc
    raise err


# ----------------------------------------------------------------------------- the plans' runs
def launch_partitions(plan, inputs: tuple, out: torch.Tensor, lse: torch.Tensor | None, dummy,
                      scale_log2: float) -> None:
    """The launches of a forward plan (:class:`DenseForwardRun`, :class:`VarlenForwardRun`): ``plan.main`` over
    ``inputs`` (its leading tensor arguments, q first) writing ``out`` / ``lse`` directly, or with split-KV
    (``plan.merge`` set) writing FP32 partials into a fresh workspace that ``plan.merge`` folds into ``out`` /
    ``lse``. ``dummy`` stands for the pointers a launch does not read."""
    lse_t = dummy if lse is None else lse
    if plan.merge is None:
        plan.main(*inputs, out, lse_t, dummy, dummy, dummy, scale_log2, *plan.fixed)
        return
    rows = math.prod(plan.ws_shape)
    ws_m, ws_s, ws_w, _ws = partials_workspace(rows, plan.ws_w_shape[-1], plan.device, plan.main, plan.merge)
    plan.main(*inputs, out, lse_t, ws_m, ws_s, ws_w, scale_log2, *plan.fixed)
    merge_lse = lse if lse is not None else (0 if plan.merge._fast is not None else inputs[0])
    plan.merge(ws_m, ws_s, ws_w, out, merge_lse, *plan.merge_fixed)


# the parts of a partials workspace start at multiples of this many FP32 entries (128 bytes): the kernels' pointers keep
# the 16-byte alignment Triton specialised them on at the first call
_WORKSPACE_ALIGN = 32


def partials_workspace(rows: int, dv: int, device: torch.device, *calls: KernelCall) -> tuple:
    """The FP32 workspace of a forward whose cut partitions a merge folds (split-KV, stream-K): ``(ws_m, ws_s, ws_w,
    base)``, the running maxima and sums [rows] and the weighted sums [rows, dv] as parts of one allocation ``base``
    (one allocator call instead of three: docs/tuning.md, split-KV and stream-K workspaces). Where every one of
    ``calls`` launches directly (:attr:`KernelCall._fast`), the parts are addresses, else views (a JIT launch reads the
    pointers' types from tensors). Keep ``base`` until the launches are queued."""
    step = -(-rows // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
    base = torch.empty(2 * step + rows * dv, dtype=torch.float32, device=device)
    if all(call._fast is not None for call in calls):
        at = base.data_ptr()
        return at, at + 4 * step, at + 8 * step, base
    return base[:rows], base[step:step + rows], base[2 * step:], base


class DenseForwardRun:
    """The run of the dense Triton forward plan (:class:`visionattn.kernels.elsa_fwd._TritonPlan`, which
    sets ``main``, ``merge``, ``fixed``, ``merge_fixed``, ``o_shape``, ``o_stride``, ``o_dtype``, ``device``,
    ``lse_shape``, ``ws_shape``, ``ws_w_shape``): allocate the output (and LSE), launch. Returns ``(out, lse)``."""

    __slots__ = ()

    def __call__(self, q, k, v, bias, attn_mask, scale):
        dev = self.device
        out = torch.empty_strided(self.o_shape, self.o_stride, dtype=self.o_dtype, device=dev)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=dev)
        # unused pointers (no bias / mask / LSE / workspace) are never read: a null pointer on the direct path,
        # a tensor on the first (JIT) call, whose pointer types the compiled kernel keeps
        dummy = 0 if self.main._fast is not None else q
        b_t = dummy if bias is None else bias
        m_t = dummy if attn_mask is None else attn_mask
        launch_partitions(self, (q, k, v, b_t, m_t), out, lse, dummy, scale * LOG2E)
        return out, lse


class VarlenForwardRun:
    """The run of the ragged forward plan (:class:`visionattn.kernels.varlen_fwd._VarlenPlan`, which sets
    ``main``, ``merge``, ``fixed``, ``merge_fixed``, ``o_shape``, ``o_dtype``, ``device``, ``with_lse``,
    ``ws_shape``, ``ws_w_shape``). Returns ``(out [total_q, H, Dv], lse [H, total_q] or None)``."""

    __slots__ = ()

    def __call__(self, q, k, v, cu_q, cu_k, scale, row_offsets=None, tiles=None):
        dev = self.device
        out = torch.empty(self.o_shape, dtype=self.o_dtype, device=dev)
        lse = None
        if self.with_lse:
            lse = torch.empty((self.o_shape[1], self.o_shape[0]), dtype=torch.float32, device=dev)
        dummy = 0 if self.main._fast is not None else q  # unused pointers: null on the direct path
        launch_partitions(self, (q, k, v, cu_q, cu_k, dummy if row_offsets is None else row_offsets,
                                 dummy if tiles is None else tiles), out, lse, dummy, scale * LOG2E)
        return out, lse


class GluonForwardPlan:
    """A Gluon forward kernel's :class:`PlannedLaunch` for one call signature, with its output (heads-inner
    [B, H, Nq, Dv] of ``out_dtype``) and, with ``with_lse``, its float32 [B, H, Nq] LSE. Returns ``(out, lse)``."""

    __slots__ = ("launch", "o_shape", "o_stride", "o_dtype", "device", "lse_shape")

    def __init__(self, launch, q, v, out_dtype, with_lse=False):
        B, H, Nq = q.shape[:3]
        Dv = v.shape[3]
        self.launch, self.device, self.o_dtype = launch, q.device, out_dtype
        self.o_shape, self.o_stride = heads_inner_layout(B, H, Nq, Dv)
        self.lse_shape = (B, H, Nq) if with_lse else None

    def __call__(self, q, k, v, bias, attn_mask, scale):
        out = torch.empty_strided(self.o_shape, self.o_stride, dtype=self.o_dtype, device=self.device)
        if self.lse_shape is None:
            self.launch(q, k, v, scale, out)
            return out, None
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        self.launch(q, k, v, scale, out, lse)
        return out, lse


class EmptyForwardPlan:
    """Nothing to compute: no rows, no value columns, or no keys (then W = 0: zero output, LSE -inf)."""

    __slots__ = ("o_shape", "o_stride", "o_dtype", "device", "lse_shape", "zero")

    def __init__(self, q, k, v, out_dtype, with_lse):
        B, H, Nq = q.shape[:3]
        Dv = v.shape[3]
        self.device, self.o_dtype = q.device, out_dtype
        self.o_shape, self.o_stride = heads_inner_layout(B, H, Nq, Dv)
        self.lse_shape = (B, H, Nq) if with_lse else None
        self.zero = k.shape[2] == 0

    def __call__(self, q, k, v, bias, attn_mask, scale):
        out = torch.empty_strided(self.o_shape, self.o_stride, dtype=self.o_dtype, device=self.device)
        if self.zero:
            out.zero_()
        lse = None if self.lse_shape is None else torch.full(self.lse_shape, float("-inf"), device=self.device)
        return out, lse


def _rebased(template, base: torch.Tensor):
    # a copy of descriptor ``template`` on another tensor of the same shape, strides and alignment class:
    # the dataclass's validation ran once, on the template
    d = object.__new__(type(template))
    d.__dict__.update(template.__dict__)
    d.base = base
    return d


class PlannedLaunch:
    """A Gluon forward kernel's launch for one call signature: ``launch(q, k, v, scale, out, lse=None, scales=None,
    extra=())`` calls ``call(q', k', v', out, lse or out, *extra, *fixed, scale * log2(e))`` (with ``scales_arg``:
    ``call(q', k', v', out, lse or out, scales or out, *extra, ...)``; ``extra``: per-call tensors), where q', k', v'
    are the tensors themselves or, with ``templates``
    (host-side TMA descriptors of the first call's shapes, strides and blocks, their ``base`` cleared so that a
    cached plan keeps no tensor alive), descriptors copied onto them. With ``o_base`` ("out" or "q") a fourth
    template follows them, rebased onto each call's ``out`` (a kernel writing O by TMA stores) or onto ``q`` (a
    build that never reads it), and its descriptor comes before ``out``. After the first call a descriptor launch
    goes through :meth:`KernelCall.with_descriptors` where the Triton release allows it. Without an LSE (or scales)
    the kernel never reads that pointer: the output's stands in."""

    __slots__ = ("call", "fixed", "templates", "scales_arg", "o_base", "_direct", "_tried")

    def __init__(self, call: KernelCall, fixed: tuple, templates=None, scales_arg: bool = False,
                 o_base: str | None = None):
        if o_base not in (None, "out", "q"):
            raise ValueError(f"o_base {o_base!r}: 'out', 'q' or None")
        self.call, self.fixed, self.templates, self.scales_arg, self.o_base = call, fixed, templates, scales_arg, \
            o_base
        self._direct, self._tried = None, False

    def __call__(self, q, k, v, scale, out, lse=None, scales=None, extra=()):
        ptrs = (out, out if lse is None else lse)
        if self.scales_arg:
            ptrs += (out if scales is None else scales,)
        ptrs += extra
        bases = (q, k, v) if self.o_base is None else (q, k, v, out if self.o_base == "out" else q)
        direct = self._direct
        if direct is not None:
            direct(*bases, *ptrs, *self.fixed, scale * LOG2E)
            return
        if self.templates is None:
            self.call(q, k, v, *ptrs, *self.fixed, scale * LOG2E)
            return
        self.call(*(_rebased(t, b) for t, b in zip(self.templates, bases)), *ptrs, *self.fixed, scale * LOG2E)
        if not self._tried and self.call.slow_reason is None:
            self._tried = True
            self._direct = self.call.with_descriptors(self.templates)

    def descriptors_direct(self) -> bool:
        """Whether calls take :meth:`KernelCall.with_descriptors`'s launch (tests read it)."""
        return self._direct is not None


class WindowForwardRun:
    """The run of a window forward plan (:class:`visionattn.kernels.window_fwd._WindowPlan`, which sets ``call``,
    ``fixed``, ``o_shape``, ``o_stride``, ``o_dtype``, ``device``, ``lse_shape``): the output [B*nW, H, N, Dv],
    or ``(out, lse)`` for a plan built with an LSE (float32 [B*nW, H, N])."""

    __slots__ = ()

    def __call__(self, q, k, v, bias, mask, logit_scale, scale):
        out = torch.empty_strided(self.o_shape, self.o_stride, dtype=self.o_dtype, device=self.device)
        dummy = 0 if self.call._fast is not None else q  # unused pointers: null on the direct path
        if self.lse_shape is None:
            self.call(q, k, v, out, dummy if bias is None else bias, dummy if mask is None else mask,
                      dummy if logit_scale is None else logit_scale, dummy, *self.fixed, scale)
            return out
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        self.call(q, k, v, out, dummy if bias is None else bias, dummy if mask is None else mask,
                  dummy if logit_scale is None else logit_scale, lse, *self.fixed, scale)
        return out, lse
