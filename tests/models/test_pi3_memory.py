"""estimate_memory / max_frames_that_fit for π³ and Pi3X: the analytic peak against live tensor bytes counted on the
CPU (tiny configs, FP32 and bf16 autocast), and the structure of the full-size estimate (meta models)."""
import pytest
import torch

from visionattn.models import (LiveBytes, Pi3, Pi3X, estimate_memory, max_frames_that_fit, pi3_tiny_config,
                               pi3x_tiny_config)
from visionattn.models.peak_memory import CUDA_SCRATCH_BYTES

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
def test_estimate_matches_measured_live_bytes(monkeypatch, cls, config, hw):
    """Analytic peak (less the CUDA scratch allowance) vs the peak of live tensor bytes (weights included) in FP32
    and under bf16 autocast with CUDA's FP32 LayerNorm, at 4 and 12 frames; the activations alone (peak less
    weights) within a band of their own."""
    _layer_norm_in_fp32(monkeypatch)
    model = cls(**config, attn_mode=None).eval()
    weights = _weights(model)
    for mode, dt in (("fp32", None), ("bf16", torch.bfloat16)):
        prev = 0
        for frames in (4, 12):
            x = torch.rand(frames, 3, *hw)
            with torch.no_grad(), torch.autocast("cpu", dtype=dt or torch.float32, enabled=dt is not None), \
                    LiveBytes(base=weights) as meter:
                model(x)
            est = estimate_memory(model, frames, *hw, mode) - CUDA_SCRATCH_BYTES
            assert 0.98 <= est / meter.peak <= 1.15, (mode, frames, est, meter.peak)
            assert 0.98 <= (est - weights) / (meter.peak - weights) <= 1.2, (mode, frames, est, meter.peak)
            assert est > prev
            prev = est


# π³ at 392 x 518 on an H200, GiB: torch.cuda.max_memory_allocated of one forward without grad, random weights
# (included), visionattn attention (bf16 under bf16 autocast)
PI3_H200_GIB = {"bf16": {25: 6.36, 100: 9.04, 200: 12.70, 500: 23.65}, "fp32": {25: 5.16, 100: 8.85}}


@pytest.mark.parametrize("mode", sorted(PI3_H200_GIB))
def test_full_size_estimate_against_h200(mode):
    """The full-size estimate (meta model) lies 0 to 10 % above the peaks measured on an H200."""
    with torch.device("meta"):
        model = Pi3()
    for frames, gib in PI3_H200_GIB[mode].items():
        ratio = estimate_memory(model, frames, 392, 518, mode) / (gib * 2 ** 30)
        assert 1.0 <= ratio <= 1.1, (mode, frames, ratio)


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



def _layer_norm_in_fp32(monkeypatch):
    """LayerNorm as CUDA autocast runs it (on its FP32 list: FP32 output for half inputs); CPU autocast keeps the
    input's dtype."""
    import torch.nn.functional as F

    real = F.layer_norm

    def layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
        if not torch.is_autocast_enabled("cpu"):
            return real(x, shape, weight, bias, eps)
        with torch.autocast("cpu", enabled=False):
            return real(x.float(), shape, *(None if t is None else t.float() for t in (weight, bias)), eps)

    monkeypatch.setattr(F, "layer_norm", layer_norm)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-cuda-norm"])
def test_decoder_attention_holds_one_rotation_at_a_time(monkeypatch, mode):
    """A π³ decoder block's attention (qk-norm + 2-D RoPE, global layout) normalises, rotates and (under bf16
    autocast) casts q, then k: when the attention runs, only qkv and q, k in the attention dtype are alive (no
    FP32 copy of them under autocast, whose qk-norm gives FP32 on CUDA), and the forward's peak is one rotation
    of k, measured alone, on top of qkv and q."""
    from visionattn.models import layers
    from visionattn.models.pi3_layers import RopeGrid, decoder_block

    if mode == "bf16-cuda-norm":
        _layer_norm_in_fp32(monkeypatch)
    torch.manual_seed(0)
    frames, h, w, special, C, heads = 3, 4, 5, 5, 128, 4
    attn = decoder_block(C, heads, 2.0, 0.01, True, None).attn
    rope = RopeGrid(frames, h, w, special, 100.0, torch.float32, "cpu").global_(C // heads)
    B, N = 1, frames * (special + h * w)
    x = torch.randn(B, N, C)
    half = mode != "fp32"
    size = 2 if half else 4  # bytes per element of qkv and of q, k at the attention
    elems = B * N * C
    seen = []
    real_attend = layers.attend

    def attend(q, k, v, attn_mode, fn=None):
        seen.append((meter.current, q.dtype, k.dtype))
        return real_attend(q, k, v, attn_mode, fn)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        ref = attn(x, rope)  # also fills autocast's cache of half weight copies, kept to the region's end
        qkv = attn.qkv(x).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        with LiveBytes() as alone:  # the plain computation: one rotation of k (its norm, temporaries, result)
            layers.apply_rope(attn.k_norm(qkv[1]), rope)
        del qkv
        monkeypatch.setattr(layers, "attend", attend)
        with LiveBytes() as meter:
            out = attn(x, rope)
    assert torch.equal(out, ref)
    (at_attend, q_dtype, k_dtype), = seen
    assert q_dtype == k_dtype == (torch.bfloat16 if half else torch.float32)
    assert at_attend == 3 * elems * size + 2 * elems * size, (at_attend, elems)
    assert meter.peak <= 3 * elems * size + elems * size + alone.peak, (meter.peak, alone.peak, elems)
