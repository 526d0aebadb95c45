"""Host-side helpers for the launchers: integer tile math, the GPU's SM count, config fallback.

``triton.cdiv`` / ``triton.next_power_of_2`` are Triton constexpr functions: called from Python
they go through the JIT call path (~2 us each), and a launcher calls them several times per
attention call. These are the plain-integer equivalents.
"""
import functools
from typing import Callable, TypeVar

import torch
import triton.runtime.errors

C = TypeVar("C")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def pad_pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= max(n, lo) (tile widths: 80 -> 128, 49 -> 64, 8 -> 16)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def head_blocks(head_dim: int, head_dim_v: int, precision: str) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_DV)``, the tile widths of a kernel's q / k rows and v / output rows.

    Each head dim is padded to a power of two >= 16 (:func:`pad_pow2`), and where ``precision`` (a kernel's
    ``PRECISION`` string, or the backward's ``"SCORES/GRADS"`` products) multiplies in split FP16
    (``"f16x3"`` / ``"f16x1"``, :mod:`.split16`) both to the larger of the two: on the GPU, Triton 3.6 compiles
    a split-FP16 kernel whose V tile is narrower or wider than its K tile (e.g. D = 64, Dv = 16) into code
    that addresses shared memory out of range (compute-sanitizer: "Out-of-range shared or local address" in
    :func:`.split16.fold_pv`), giving NaN, wrong outputs or an illegal-address error, where the interpreter
    computes the same kernel correctly. Equal widths compile correctly; the padded columns are masked loads
    and stores like any padded head dim.
    """
    block_d, block_dv = pad_pow2(head_dim), pad_pow2(head_dim_v)
    if "f16x" in precision:
        block_d = block_dv = max(block_d, block_dv)
    return block_d, block_dv


# dtypes the kernels can write their output in (the FP32 state is divided and rounded once to it)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    try:
        run(config)
        return config
    except triton.runtime.errors.OutOfResources as exc:
        err = exc
    for c in smaller(config):
        try:
            run(c)
            return c
        except triton.runtime.errors.OutOfResources as exc:
            err = exc
    raise err
