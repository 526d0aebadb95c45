"""Host-side integer helpers for the launchers.

``triton.cdiv`` / ``triton.next_power_of_2`` are Triton constexpr functions: called from Python
they go through the JIT call path (~2 us each), and a launcher calls them several times per
attention call. These are the plain-integer equivalents.
"""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def pad_pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= max(n, lo) (tile widths: 80 -> 128, 49 -> 64, 8 -> 16)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())
