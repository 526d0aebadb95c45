"""Host-side helpers for the launchers: integer tile math and the GPU's SM count.

``triton.cdiv`` / ``triton.next_power_of_2`` are Triton constexpr functions: called from Python
they go through the JIT call path (~2 us each), and a launcher calls them several times per
attention call. These are the plain-integer equivalents.
"""
import functools

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def pad_pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= max(n, lo) (tile widths: 80 -> 128, 49 -> 64, 8 -> 16)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (cached: the property query costs microseconds)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
