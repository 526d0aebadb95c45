"""Compile a Triton kernel for a GPU architecture without the GPU: shared memory and IR.

Device time is scarce; whether a tile config fits the 227 KiB of shared memory of an
H100/H200 (``232,448`` bytes per block) can be answered on any machine. Triton compiles
for a target (``GPUTarget("cuda", 90, 32)``) with its bundled ``ptxas``; given the same
specialization as a real launch (16-byte-aligned pointers, strides of 1 folded into
constants, other ints divisible by 16), the shared-memory figure equals the one the GPU
reports at launch (checked: 232,960 bytes for the PASA D=128 3-stage config, on the
device and here, both with triton 3.6). The figure depends on the Triton version: use
the device's (``pip install --target DIR triton==3.6.0``, then ``PYTHONPATH=DIR``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

__all__ = ["CompileReport", "compile_for_arch", "HOPPER_SHARED_LIMIT"]

HOPPER_SHARED_LIMIT = 232_448  # bytes per block on sm_90 (H100 / H200)


@dataclass(frozen=True)
class CompileReport:
    """What one offline compile produced.

    Attributes:
        shared_bytes: dynamic shared memory per block the kernel needs at launch.
        wgmma: number of Hopper warp-group MMAs in the TTGIR (0 = no wgmma path).
        ttgir: the TritonGPU IR text (for inspection).
    """

    shared_bytes: int
    wgmma: int
    ttgir: str


def compile_for_arch(kernel, pointer_types: dict[str, str], constexprs: dict, *, num_warps: int,
                     num_stages: int, unit_ints: tuple[str, ...] = (), float_args: tuple[str, ...] = (),
                     arch: int = 90) -> CompileReport:
    """Compile ``kernel`` (a ``@triton.jit`` function) for ``cuda:arch`` as a launch would.

    Args:
        kernel: the JIT function.
        pointer_types: argument name -> Triton pointer type (``"*fp32"``, ``"*fp16"``, ``"*u8"``);
            every pointer is taken as 16-byte aligned.
        constexprs: values of the ``tl.constexpr`` arguments.
        num_warps, num_stages: launch options.
        unit_ints: int arguments equal to 1 at run time (inner strides), which Triton folds into
            constants; every other int argument is taken as divisible by 16.
        float_args: arguments passed as Python floats.
        arch: compute capability (90 = Hopper).

    Returns:
        :class:`CompileReport`.

    Raises:
        RuntimeError: ``TRITON_INTERPRET=1`` is set (kernels are then interpreted functions,
            which do not compile); run with ``TRITON_INTERPRET=0``.
        triton.compiler.errors.CompilationError: the kernel does not compile for this variant.
    """
    if not hasattr(kernel, "cache_key"):
        raise RuntimeError(f"{getattr(kernel, '__name__', kernel)!r} is an interpreted kernel (TRITON_INTERPRET=1); "
                           f"offline compiles need TRITON_INTERPRET=0 in the environment before triton is imported")
    sig, attrs, consts = {}, {}, dict(constexprs)
    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in pointer_types:
            sig[name] = pointer_types[name]
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
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ttgir = compiled.asm.get("ttgir", "")
    return CompileReport(shared_bytes=int(compiled.metadata.shared), wgmma=ttgir.count("ttng.warp_group_dot "),
                         ttgir=ttgir)
