"""Precision modes: the one table of what each mode means.

A mode fixes the dtype the inputs are cast to before a kernel runs
(``compute_dtype``), the arithmetic of the two products (``input_precision``:
``"ieee"`` FP32 FMA; ``"f16x3"`` / ``"f16x1"`` split-FP16 products on the FP16
tensor cores, see :mod:`visionattn.kernels.split16`; half modes use the tensor
cores natively), where the scores accumulate (``half_scores``), whether PASA's
shift runs (``pasa_shift``), which kernel families serve it (``kernels``) and the
accuracy contract: the relative L2 error of the output against the float64
oracle on N(0, 1) inputs (docs/design.md, "Modes"). The public API
(:mod:`visionattn.modes` re-exports this module), the kernels' launchers and the
tests all read this table; nothing else lists modes.

``fp16-acc16`` is not a production mode: it is the FP16-score-accumulation
baseline that PASA fixes (PASA paper, Sec. 2), kept so the overflow can be shown
side by side. It can return inf/NaN by design.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Mode", "MODES", "get_mode", "mode_names"]


@dataclass(frozen=True)
class Mode:
    """One precision mode.

    Attributes:
        name: the string users pass (``mode="fp16"``).
        compute_dtype: dtype q, k, v are cast to before the kernel runs.
        input_precision: product precision for FP32 operands (``"ieee"``, ``"f16x3"``,
            ``"f16x1"``), ``None`` for half inputs.
        rel_tol: contract, max relative L2 output error vs the float64 oracle.
        half_scores: scores accumulated in FP16 (``pasa``, ``fp16-acc16``).
        description: one line for tables and ``--help``.
        pasa_shift: PASA's online pseudo-average shift runs (``pasa`` only).
        kernels: the kernel families that serve the mode on CUDA: ``"dense"``
            (:mod:`.elsa_fwd`), ``"pasa"`` (:mod:`.pasa_fwd`), ``"window"`` (:mod:`.window_fwd`).
        state_dtype: dtype of the (m, S, W) state and of the score accumulation after the
            products (FP32 in every mode).
        backward_precision: products of the backward kernels' FP32 operands: ``"f16x3"`` / ``"f16x1"``
            (split-FP16, :mod:`.split16`; ``"f16x3-head"``: f16x3 whose right operands take one power-of-two scale
            per (batch, head), as f16x1's do, see :data:`.elsa_bwd.HEAD_SCALED`) or a ``tl.dot`` input
            precision (``"tf32x3"``, ``"ieee"``); ``None`` for half inputs (native tensor-core products) and for
            modes without a backward kernel.
        window_backward_precision: the window backward's products where they differ from
            ``backward_precision`` (``None``: the same).
    """

    name: str
    compute_dtype: torch.dtype
    input_precision: str | None
    rel_tol: float
    half_scores: bool
    description: str
    pasa_shift: bool = False
    kernels: frozenset = frozenset({"dense", "window"})
    state_dtype: torch.dtype = torch.float32
    backward_precision: str | None = None
    window_backward_precision: str | None = None


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("fp32", torch.float32, "f16x3", 2e-6, False,
             "FP32 inputs, FP32-accurate products (split-FP16 hi/lo, 22 significant bits like 3xTF32), "
             "FP32 state", backward_precision="f16x3-head", window_backward_precision="f16x3"),
        Mode("fp32-ieee", torch.float32, "ieee", 2e-6, False,
             "strict IEEE FP32 FMA products, no tensor cores, FP32 state", backward_precision="ieee"),
        Mode("tf32", torch.float32, "f16x1", 3e-3, False,
             "TF32-class products (operands rounded to TF32's 11 significant bits), FP32 state",
             # split-FP16 hi parts (round to nearest after a power-of-two scale): gradients within 1.1x PyTorch's
             # own TF32 backward error (tl.dot's TF32 products: 2.8e-3 on dQ at ViT-B/16 224, over twice it).
             # Windows multiply FP32-accurately: at Swin's 49-token windows PyTorch's own "TF32" backward is
             # FP32-accurate (cuBLAS runs these sizes without TF32), and Swin-v2's sharp cosine logits raise the
             # f16x1 dV error to 1.9e-3 against PyTorch's TF32 6.4e-4
             backward_precision="f16x1", window_backward_precision="f16x3"),
        Mode("fp16", torch.float16, None, 2e-3, False,
             "FP16 inputs, FP32 score accumulation and state"),
        Mode("bf16", torch.bfloat16, None, 1e-2, False,
             "BF16 inputs, FP32 score accumulation and state"),
        # The shifted scores are accumulated in FP16 but the shift is undone in FP32
        # (visionattn.pasa): 8.6e-4 (D=64) / 1.0e-3 (D=128) measured on the CPU emulation;
        # the margin over fp16's 2e-3 covers the GPU's accumulation order.
        Mode("pasa", torch.float16, None, 3e-3, True,
             "FP16 inputs, FP16 score accumulation with online pseudo-average shifting (cannot overflow)",
             pasa_shift=True, kernels=frozenset({"pasa", "window"})),
        Mode("fp16-acc16", torch.float16, None, 6e-3, True,
             "diagnostic baseline: FP16 score accumulation without shifting (may overflow)",
             kernels=frozenset({"pasa", "window"})),
    )
}


def mode_names() -> list[str]:
    """All accepted mode strings, in table order."""
    return list(MODES)


def get_mode(mode: str | Mode) -> Mode:
    """Look up a mode by name.

    Raises:
        ValueError: ``mode`` is not one of :func:`mode_names`.
    """
    if isinstance(mode, Mode):
        return mode
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a visionattn mode; expected one of {mode_names()}")
    return MODES[mode]
