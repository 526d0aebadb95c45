"""estimate_memory / max_frames_that_fit for π³ and Pi3X: the analytic peak against live tensor bytes counted on the
CPU (tiny configs, FP32 and bf16 autocast), and the structure of the full-size estimate (meta models)."""
import pytest
import torch

from visionattn.models import (LiveBytes, Pi3, Pi3X, estimate_memory, max_frames_that_fit, pi3_tiny_config,
                               pi3x_tiny_config)

PI3_VALUES = 958_696_738  # parameters of yyfz233/Pi3 (tests/data/pi3_state_dict.tsv)
PI3X_VALUES = 1_360_032_439


def _weights(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("cls, config", [
    (Pi3, pi3_tiny_config()),
    (Pi3, pi3_tiny_config(embed_dim=256, head_embed_dim=128, camera_dim=64)),
    (Pi3X, pi3x_tiny_config()),
    (Pi3X, pi3x_tiny_config(embed_dim=256, head_embed_dim=128, camera_dim=64)),
])
@pytest.mark.parametrize("hw", [(56, 56), (28, 42)])
def test_estimate_matches_measured_live_bytes(cls, config, hw):
    """Analytic peak vs the peak of live tensor bytes (weights included) in FP32 and under bf16 autocast, at 4 and
    12 frames; the activations alone (peak less weights) within the same loose band."""
    model = cls(**config, attn_mode=None).eval()
    weights = _weights(model)
    for mode, dt in (("fp32", None), ("bf16", torch.bfloat16)):
        prev = 0
        for frames in (4, 12):
            x = torch.rand(frames, 3, *hw)
            with torch.no_grad(), torch.autocast("cpu", dtype=dt or torch.float32, enabled=dt is not None), \
                    LiveBytes(base=weights) as meter:
                model(x)
            est = estimate_memory(model, frames, *hw, mode)
            assert 0.9 <= est / meter.peak <= 1.25, (mode, frames, est, meter.peak)
            assert 0.85 <= (est - weights) / (meter.peak - weights) <= 1.35, (mode, frames, est, meter.peak)
            assert est > prev
            prev = est


@pytest.mark.parametrize("cls, values", [(Pi3, PI3_VALUES), (Pi3X, PI3X_VALUES)])
def test_full_size_estimate_structure(cls, values):
    with torch.device("meta"):
        model = cls()
    est = [estimate_memory(model, s, 392, 518) for s in (1, 10, 50, 100, 200)]
    assert all(a < b for a, b in zip(est, est[1:])), est
    weights = values * 4
    assert weights < est[0] < weights + 2 ** 30
    assert estimate_memory(model, 100, 392, 518, include_weights=False) == est[3] - weights
    assert estimate_memory(model, 10, 392, 518, batch=2) > est[1]
    n = max_frames_that_fit(80 * 2 ** 30, 392, 518, "fp32", model=model, margin=0.0)
    assert estimate_memory(model, n, 392, 518) <= 80 * 2 ** 30 < estimate_memory(model, n + 1, 392, 518)
    assert max_frames_that_fit(weights, 392, 518, model=model) == 0  # the weights alone fill it
    with pytest.raises(ValueError, match="track head"):
        estimate_memory(model, 10, 392, 518, query_points=16)
    with pytest.raises(ValueError, match="multiple of patch_size"):
        estimate_memory(model, 10, 390, 518)
    with pytest.raises(ValueError, match="mode"):
        estimate_memory(model, 10, 392, 518, "fp8")
