"""The gradient bounds the backward-kernel tests share (``from grad_checks import ...``).

A kernel gradient is compared with the float64 autograd gradient ("gold"): within :data:`FP32_TOL` (relative
L2) where the mode's products are FP32-accurate, otherwise within twice the error of PyTorch's own backward at
the same precision against the same gold, plus 1e-6 (FlashAttention's test rule). ``tf32`` on the CPU, where
PyTorch has no TF32 matmuls to compare with, is held to the mode's own contract (``MODES["tf32"].rel_tol``).
"""
import contextlib

import torch

from visionattn.metrics import rel_l2
from visionattn.modes import MODES

FP32_TOL = 1e-5


@contextlib.contextmanager
def torch_matmul_precision(mode: str):
    """PyTorch's FP32 matmuls in the mode's product precision for the duration: TF32 for ``tf32``, else full FP32;
    the previous setting is restored."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def gradient_bounds(gold, same_precision=None) -> list:
    """One bound per gold gradient (None where the gold is None): :data:`FP32_TOL` when ``same_precision`` is
    None, else ``2 * rel_l2(same, gold) + 1e-6`` with ``same`` PyTorch's own gradients at the kernel's
    precision."""
    if same_precision is None:
        return [None if g is None else FP32_TOL for g in gold]
    return [None if g is None else 2 * rel_l2(s, g) + 1e-6 for s, g in zip(same_precision, gold)]


def assert_gradients(mode: str, names, got, gold, bounds) -> None:
    """Each kernel gradient: None where the gold is None, else the gold's shape, finite, within its bound."""
    for name, x, g, bound in zip(names, got, gold, bounds):
        if g is None:
            assert x is None, name
            continue
        assert x.shape == g.shape, f"{name}: shape {tuple(x.shape)} vs {tuple(g.shape)}"
        assert torch.isfinite(x).all(), f"{mode} {name}: non-finite"
        err = rel_l2(x, g)
        assert err <= bound, f"{mode} {name}: rel err {err:.3e} > {bound:.3e}"


def mode_bounds(mode: str, gold, same_precision_grads, on_cuda: bool) -> list:
    """The bounds of ``mode``'s gradients (the module docstring's rule): ``same_precision_grads()`` gives
    PyTorch's own gradients at the mode's precision (called under :func:`torch_matmul_precision` only where
    the rule needs them)."""
    if mode == "tf32" and not on_cuda:
        return [None if g is None else MODES["tf32"].rel_tol for g in gold]
    if MODES[mode].compute_dtype == torch.float32 and mode != "tf32":
        return gradient_bounds(gold)
    with torch_matmul_precision(mode):
        return gradient_bounds(gold, same_precision_grads())
