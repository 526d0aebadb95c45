"""Drift metrics of the ELSA supplement (Sec. C.2) and relative errors.

All metrics compare an approximation (P_hat, Y_hat) with a reference (P_ref,
Y_ref), usually the float64 oracle. Per query row (b, h, i) they are:

1. max |dP|             — worst pointwise probability error in the row
2. rel L2 dP            — ||dP||_2 / ||P_ref||_2 over the row
3. Jensen-Shannon       — JS(P_hat_row || P_ref_row), natural log
4. argmax disagreement  — 1 if argmax_j differs, else 0
5. max |dY|             — worst output error in the row
6. rel L2 dY            — ||dY||_2 / ||Y_ref||_2 over the row

:func:`drift_metrics` reports for each the median / p95 / p99 over rows plus the
global value (global max, global relative L2, mean JS, disagreement rate).

:func:`psnr` and :func:`ssim` compare images (video frames) in [0, 1], as NumPy arrays.
"""
from __future__ import annotations

import math

import torch

__all__ = ["rel_l2", "drift_metrics", "METRIC_NAMES", "psnr", "ssim"]

METRIC_NAMES = ("max_abs_dP", "rel_l2_dP", "js_mean", "argmax_disagree", "max_abs_dY", "rel_l2_dY")


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref||_2 / ||ref||_2`` in float64 (inf/NaN in ``x`` propagate)."""
    x, ref = x.double(), ref.double()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))


def _js_rows(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    m = 0.5 * (p + q)

    def kl(a, b):
        return torch.where(a > 0, a * (torch.log(a.clamp_min(1e-300)) - torch.log(b.clamp_min(1e-300))),
                           torch.zeros_like(a)).sum(-1)

    return (0.5 * kl(p, m) + 0.5 * kl(q, m)).clamp_min(0)


def _summary(per_row: torch.Tensor, overall: float) -> dict:
    qs = torch.quantile(per_row.flatten().double(), torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64))
    return {"median": float(qs[0]), "p95": float(qs[1]), "p99": float(qs[2]), "overall": overall}


def drift_metrics(p_hat: torch.Tensor, p_ref: torch.Tensor, y_hat: torch.Tensor, y_ref: torch.Tensor) -> dict:
    """The six drift metrics with median / p95 / p99 over query rows.

    Args:
        p_hat, p_ref: probabilities [B, H, Nq, Nk] (any float dtype; compared in float64).
        y_hat, y_ref: outputs [B, H, Nq, Dv].

    Returns:
        ``{name: {"median", "p95", "p99", "overall"}}`` for the names in :data:`METRIC_NAMES`.

    Raises:
        ValueError: shapes of a pair differ.
    """
    if p_hat.shape != p_ref.shape or y_hat.shape != y_ref.shape:
        raise ValueError(f"shape mismatch: P {tuple(p_hat.shape)} vs {tuple(p_ref.shape)}, "
                         f"Y {tuple(y_hat.shape)} vs {tuple(y_ref.shape)}")
    p_hat, p_ref, y_hat, y_ref = (t.double() for t in (p_hat, p_ref, y_hat, y_ref))
    dp, dy = (p_hat - p_ref).abs(), (y_hat - y_ref).abs()
    eps = 1e-300
    rows = {
        "max_abs_dP": dp.amax(-1),
        "rel_l2_dP": dp.norm(dim=-1) / p_ref.norm(dim=-1).clamp_min(eps),
        "js_mean": _js_rows(p_hat, p_ref),
        "argmax_disagree": (p_hat.argmax(-1) != p_ref.argmax(-1)).double(),
        "max_abs_dY": dy.amax(-1),
        "rel_l2_dY": dy.norm(dim=-1) / y_ref.norm(dim=-1).clamp_min(eps),
    }
    overall = {
        "max_abs_dP": float(dp.max()),
        "rel_l2_dP": rel_l2(p_hat, p_ref),
        "js_mean": float(rows["js_mean"].mean()),
        "argmax_disagree": float(rows["argmax_disagree"].mean()),
        "max_abs_dY": float(dy.max()),
        "rel_l2_dY": rel_l2(y_hat, y_ref),
    }
    return {name: _summary(rows[name], overall[name]) for name in METRIC_NAMES}


def _ssim_gaussian(a, b, data_range: float = 1.0) -> float:
    """SSIM (Wang et al. 2004) as ``skimage.metrics.structural_similarity(gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False)``: 11x11 Gaussian window (OpenCV blurs), K1 0.01, K2 0.03, the 5-pixel border
    cropped, channel mean. a, b: [H, W, C] float."""
    import cv2
    import numpy as np

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    blur = lambda x: cv2.GaussianBlur(x, (11, 11), 1.5, borderType=cv2.BORDER_REFLECT)  # noqa: E731
    vals = []
    for ch in range(a.shape[-1]):
        x, y = a[..., ch].astype(np.float64), b[..., ch].astype(np.float64)
        mx, my = blur(x), blur(y)
        vx, vy, cxy = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
        s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
        vals.append(s[5:-5, 5:-5].mean())
    return float(np.mean(vals))


def ssim(a, b) -> float:
    """SSIM of two [H, W, 3] frames in [0, 1]: scikit-image when installed, else :func:`_ssim_gaussian`."""
    try:
        from skimage.metrics import structural_similarity
    except ImportError:
        return _ssim_gaussian(a, b)
    return float(structural_similarity(a, b, channel_axis=-1, data_range=1.0, gaussian_weights=True, sigma=1.5,
                                       use_sample_covariance=False))


def psnr(a, b) -> float:
    """PSNR in dB of frames in [0, 1] (inf when identical)."""
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)
