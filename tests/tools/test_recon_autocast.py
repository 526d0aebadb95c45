"""The demo's forward under autocast: which modes get it, and a tiny VGGT run through run_model under bf16 autocast
(CPU autocast, reference attention) gives FP32 outputs close to the FP32 run."""
import numpy as np
import pytest
import torch

from visionattn.recon import pipeline


@pytest.mark.parametrize("mode, want", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("pasa", torch.float16),
                                        ("fp32", None), ("tf32", None), ("fp32-ieee", None), ("sdpa", None)])
def test_half_modes_autocast_on_the_gpu_only(mode, want):
    assert pipeline.demo_autocast_dtype(mode, "cuda") is want
    assert pipeline.demo_autocast_dtype(mode, "cpu") is None
    with pytest.raises(ValueError, match="mode="):
        pipeline.demo_autocast_dtype("fp8", "cuda")


def test_run_model_under_autocast_decodes_fp32_close_to_the_fp32_forward():
    net = pipeline.build_model("vggt", "random-tiny", "sdpa", "cpu", seed=0)
    images = torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    full = pipeline.run_model(net, images, progress=False)
    half = pipeline.run_model(net, images, progress=False, autocast_dtype=torch.bfloat16)
    for name in ("depth", "world_points", "world_points_from_depth", "extrinsic"):
        assert half[name].dtype == full[name].dtype and np.isfinite(half[name]).all(), name
        a, b = half[name].astype(np.float64), full[name].astype(np.float64)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert 0 < rel < 0.1, (name, rel)  # bf16 products moved it, but only by rounding
