"""The gradient bounds the backward-kernel tests share (``from grad_checks import ...``).

A kernel gradient is compared with the float64 autograd gradient ("gold"): within :data:`FP32_TOL` (relative
L2) where the mode's products are FP32-accurate, otherwise within twice the error of PyTorch's own backward at
the same precision against the same gold, plus 1e-6 (FlashAttention's test rule).
"""
import contextlib

import torch

from visionattn.metrics import rel_l2

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
