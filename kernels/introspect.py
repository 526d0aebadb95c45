"""Compile a Triton kernel for a GPU architecture without the GPU: shared memory, registers and IR.

Whether a tile config fits the 227 KiB of shared memory of an H100/H200 (``232,448`` bytes
per block) can be answered on any machine, without a GPU. Triton compiles
for a target (``GPUTarget("cuda", 90, 32)``) with its bundled ``ptxas``; given the same
specialization as a real launch (16-byte-aligned pointers, strides of 1 folded into
constants, other ints divisible by 16), the shared-memory figure equals the one the GPU
reports at launch (checked: 232,960 bytes for the PASA D=128 3-stage config, on an H100
and offline, both with triton 3.6). The figure depends on the Triton version: use the
one the GPU runs (``pip install --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR``).

Registers per thread and local-memory (spill) bytes are read from the compiled cubin with
Triton's bundled ``cuobjdump -res-usage``; with them and the shared memory, the number of
programs an SM can hold at once follows from the Hopper limits (:func:`programs_per_sm`).
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

__all__ = ["CompileReport", "compile_for_arch", "programs_per_sm", "HOPPER_SHARED_LIMIT"]

HOPPER_SHARED_LIMIT = 232_448  # bytes per block on sm_90 (H100 / H200)
# per SM on sm_90 (CUDA occupancy rules): registers, shared memory (228 KiB, of which 1 KiB is reserved
# per resident block), warps and blocks
_SM_REGISTERS, _SM_SHARED, _BLOCK_RESERVED_SHARED, _SM_WARPS, _SM_BLOCKS = 65_536, 233_472, 1_024, 64, 32


@dataclass(frozen=True)
class CompileReport:
    """What one offline compile produced.

    Attributes:
        shared_bytes: dynamic shared memory per block the kernel needs at launch.
        wgmma: number of Hopper warp-group MMAs in the TTGIR (0 = no wgmma path).
        ttgir: the TritonGPU IR text (for inspection).
        registers: registers per thread (``None`` when ``cuobjdump`` is unavailable).
        local_bytes: local memory per thread (stack frame + local arrays), i.e. register spills (``None`` likewise).
        num_warps: warps per program.
        instructions: SASS instructions in the cubin, a static count (loops counted once; ``None`` when
            ``nvdisasm`` is unavailable): fewer for the same tiles means less issued work per iteration.
    """

    shared_bytes: int
    wgmma: int
    ttgir: str
    registers: int | None = None
    local_bytes: int | None = None
    num_warps: int = 4
    instructions: int | None = None

    @property
    def programs_per_sm(self) -> int | None:
        """Programs one SM holds at once (:func:`programs_per_sm`); ``None`` without a register count."""
        if self.registers is None:
            return None
        return programs_per_sm(self.registers, self.shared_bytes, self.num_warps)


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Resident programs (thread blocks) per Hopper SM for a kernel's resources.

    Registers are allocated per warp in units of 256 (per-thread counts rounded up to 8); each block
    also reserves 1 KiB of shared memory. The minimum over registers (65,536 per SM), shared memory
    (228 KiB per SM), warps (64) and blocks (32); 0 when one program does not fit at all.

    Args:
        registers: registers per thread; shared_bytes: dynamic shared memory per program;
        num_warps: warps per program.
    """
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = (_SM_REGISTERS // per_warp) // num_warps if per_warp else _SM_BLOCKS
    by_shared = _SM_SHARED // (shared_bytes + _BLOCK_RESERVED_SHARED)
    return max(0, min(by_regs, by_shared, _SM_WARPS // num_warps, _SM_BLOCKS))


def _run_on_cubin(cubin: bytes, tool: str, *flags: str) -> str | None:
    """The standard output of Triton's bundled CUDA binary tool ``tool`` (``"cuobjdump"``, ``"nvdisasm"``) run on
    ``cubin`` with ``flags``; ``None`` if the tool is missing or fails."""
    try:
        from triton import knobs

        path = getattr(knobs.nvidia, tool).path  # Triton's own lookup: TRITON_<TOOL>_PATH, else its bundled copy
    except Exception:  # an older Triton without the knob: no such figures, the rest still works
        return None
    fd, file = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return subprocess.run([path, *flags, file], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        os.unlink(file)


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, local bytes per thread) of the one kernel in ``cubin`` via ``cuobjdump -res-usage``;
    ``(None, None)`` if the tool is missing or its output is not understood. Local bytes count the stack frame
    too: that is where ptxas spills registers (it reports ``LOCAL:0`` with them)."""
    m = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", _run_on_cubin(cubin, "cuobjdump", "-res-usage") or "")
    return (int(m.group(1)), int(m.group(2)) + int(m.group(3))) if m else (None, None)


def _instruction_count(cubin: bytes) -> int | None:
    """SASS instructions in ``cubin`` (``nvdisasm -c``: each instruction line carries its /*offset*/); ``None``
    without the tool."""
    out = _run_on_cubin(cubin, "nvdisasm", "-c")
    return None if out is None else len(re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+\S", out, flags=re.M))


def compile_for_arch(kernel, pointer_types: dict[str, str], constexprs: dict, *, num_warps: int,
                     num_stages: int, unit_ints: tuple[str, ...] = (), float_args: tuple[str, ...] = (),
                     arch: int = 90, maxnreg: int | None = None) -> CompileReport:
    """Compile ``kernel`` (a ``@triton.jit`` or ``@gluon.jit`` function) for ``cuda:arch`` as a launch would.

    Args:
        kernel: the JIT function.
        pointer_types: argument name -> Triton pointer type (``"*fp32"``, ``"*fp16"``, ``"*u8"``);
            every pointer is taken as 16-byte aligned. Gluon TMA descriptors go here too, as
            ``"tensordesc<fp16[1,1,64,64],{shared layout repr}>"`` (:func:`.half_gluon.descriptor_types`).
        constexprs: values of the ``tl.constexpr`` arguments.
        num_warps, num_stages: launch options.
        unit_ints: int arguments equal to 1 at run time (inner strides), which Triton folds into
            constants; every other int argument is taken as divisible by 16, except those the kernel
            declares ``do_not_specialize`` (a launch does not specialize them either).
        float_args: arguments passed as Python floats.
        arch: compute capability (90 = Hopper).
        maxnreg: register cap per thread, as the launch option of that name.

    Returns:
        :class:`CompileReport`; its ``num_warps`` counts every warp a warp-specialized kernel launches.

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is set (kernels are then interpreted functions,
            which do not compile); run with ``TRITON_INTERPRET=0``.
        triton.compiler.errors.CompilationError: the kernel does not compile for this variant.
    """
    if not hasattr(kernel, "cache_key"):
        raise RuntimeError(f"{getattr(kernel, '__name__', kernel)!r} is an interpreted kernel (TRITON_INTERPRET=1); "
                           f"offline compiles need TRITON_INTERPRET=0 in the environment before triton is imported")
    sig, attrs, consts = {}, {}, dict(constexprs)
    unspecialized = {p.name for p in getattr(kernel, "params", ()) if getattr(p, "do_not_specialize", False)}
    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in pointer_types:
            sig[name] = pointer_types[name]
            if not sig[name].startswith("tensordesc"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in consts:
            sig[name] = "constexpr"
        elif name in float_args:
            sig[name] = "fp32"
        elif name in unit_ints:
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if name not in unspecialized:  # a launch specializes these on divisibility by 16
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():  # Gluon kernels carry their layouts: their own front end
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ttgir = compiled.asm.get("ttgir", "")
    cubin = compiled.asm.get("cubin")
    registers, local_bytes = _resource_usage(cubin) if cubin else (None, None)
    return CompileReport(shared_bytes=int(compiled.metadata.shared), wgmma=ttgir.count("ttng.warp_group_dot "),
                         ttgir=ttgir, registers=registers, local_bytes=local_bytes,
                         num_warps=int(getattr(compiled.metadata, "num_warps", num_warps)),
                         instructions=_instruction_count(cubin) if cubin else None)
