"""PASA's host-side math: the optimal-accuracy shift strength and the FP16-rounded shifting matrix.

PASA paper, Eq. 16 and 20-23. Pure Python and torch scalars (no Triton), read by both the Triton
launcher (:mod:`.pasa_fwd`) and the CPU reference (:mod:`visionattn.pasa`, which re-exports it).
"""
from __future__ import annotations

import functools

import torch

__all__ = ["optimal_beta", "shift_coefficients", "check_beta", "PAPER_BETA0"]

PAPER_BETA0 = 1.0 - 2.0 ** -6  # the paper's adopted initial value (-> 0.984497 for n = 128)
_PAPER_BETA0 = PAPER_BETA0


def _round(x: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(dtype).double())


def _practical_invariance(beta: float, n: int, dtype: torch.dtype) -> float:
    # Eq. 20-21: f(beta) = b n / (a (a - b n)) + (1 - a) / a with b = fl(beta/n), a = fl(1 - beta/n) + b.
    b = _round(beta / n, dtype)
    a = _round(1.0 - beta / n, dtype) + b
    return b * n / (a * (a - b * n)) + (1.0 - a) / a


@functools.lru_cache(maxsize=None)
def _optimal_beta_cached(n: int, dtype: torch.dtype, beta0: float, tol: float, max_iter: int) -> float:
    beta = beta0
    for _ in range(max_iter):
        f = _practical_invariance(beta, n, dtype)
        new = f / (1.0 + f)  # Eq. 22
        if abs(new - beta) <= tol * abs(beta):
            return new
        beta = new
    raise RuntimeError(f"optimal_beta: fixed-point iteration did not converge for block_size={n}, "
                       f"beta0={beta0} in {max_iter} steps")


def optimal_beta(block_size: int, dtype: torch.dtype = torch.float16, *, beta0: float = _PAPER_BETA0,
                 tol: float = 1e-12, max_iter: int = 100) -> float:
    """Shift strength beta from the optimal-accuracy condition (PASA paper, Eq. 16, 20-22).

    Solves ``beta / (1 - beta) = f(beta)`` by the fixed-point iteration
    ``beta_{k+1} = f(beta_k) / (1 + f(beta_k))`` in float64, where ``f`` is the
    pseudo-average factor the FP16-rounded shifting matrix really applies:
    ``f(beta) = b n / (a (a - b n)) + (1 - a) / a``, ``b = fl(beta / n)``,
    ``a = fl(1 - beta / n) + b`` (Eq. 20-21, ``fl`` = rounding to ``dtype``).
    At the fixed point the recovery factor ``beta / (1 - beta)`` carries no
    rounding error of its own (Appendix A, Table 3).

    For ``block_size=128`` and FP16 the paper's initial values ``1 - 2^-4``,
    ``1 - 2^-5``, ``1 - 2^-6`` converge to 0.9375, 0.968994 and 0.984497 (the
    paper adopts the last, which is the default here).

    Args:
        block_size: keys per KV block ``n`` (the size of M), >= 1.
        dtype: the low precision M is rounded to (``torch.float16`` or ``torch.bfloat16``).
        beta0: initial value of the iteration, in (0, 1).
        tol: relative change at which the iteration stops.
        max_iter: iteration limit.

    Returns:
        beta as a Python float in (0, 1).

    Raises:
        ValueError: ``block_size < 1``, ``beta0`` outside (0, 1), or a non-half ``dtype``.
        RuntimeError: no convergence within ``max_iter`` steps.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}; expected a positive int (keys per KV block)")
    if not 0.0 < beta0 < 1.0:
        raise ValueError(f"beta0={beta0!r}; expected a value in (0, 1)")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype}; expected torch.float16 or torch.bfloat16 (the precision of M)")
    return _optimal_beta_cached(block_size, dtype, float(beta0), float(tol), int(max_iter))


def check_beta(beta) -> None:
    """Raise ValueError unless ``beta`` is None or a float in [0, 1)."""
    if beta is not None and not (isinstance(beta, (int, float)) and 0.0 <= float(beta) < 1.0):
        raise ValueError(f"beta={beta!r}; expected None (optimal-accuracy beta) or a float in [0, 1)")


def shift_coefficients(n: int, beta: float | None) -> tuple[float, float, float]:
    """Coefficients of the FP16-rounded shifting matrix for a block of ``n`` keys.

    Returns:
        ``(a, b, f)``: ``K' = scale * (a k - b sum_block k)`` (Eq. 21/23, ``a`` and ``b``
        as rounded to FP16 and combined in float64) and the paper's recovery factor
        ``f = beta / (1 - beta)`` (Eq. 14; equal to the rounded matrix's invariance at the
        optimal beta). The reference and the kernel recover with ``a`` and ``b`` directly
        (module docstring, deviation 1) and do not use ``f``. ``beta=None`` uses
        :func:`optimal_beta` (n).

    Raises:
        ValueError: ``beta`` outside [0, 1) or ``n < 1``.
    """
    check_beta(beta)
    beta = optimal_beta(n) if beta is None else float(beta)
    if n < 1:
        raise ValueError(f"n={n}; a KV block has at least one key")
    b = _round(beta / n, torch.float16)
    a = _round(1.0 - beta / n, torch.float16) + b
    return a, b, beta / (1.0 - beta)
