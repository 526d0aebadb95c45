"""GPU tests: random-weight VGGT-1B on real multi-view images, visionattn modes vs PyTorch SDPA.

Each run is compared with a float64 copy of the same model (float64 SDPA): the
visionattn run's error must stay within a small multiple of the SDPA run's own
error in the same precision (bound by the same-precision PyTorch error, as the
FlashAttention tests do). cuDNN TF32 convolutions are switched off inside the
test so the FP32 comparison measures FP32 arithmetic.
"""
import copy
import glob
import os

import numpy as np
import pytest
import torch
from PIL import Image

from visionattn.metrics import rel_l2
from visionattn.models import VGGT, TokenMerging
from visionattn.models.vggt import autocast

MULTIVIEW = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "demos", "data")
KEYS = ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf", "track", "vis")


def _images(n=8, H=392, W=518):
    files = sorted(glob.glob(os.path.join(MULTIVIEW, "*", "*.jpg")))[:n]
    assert len(files) == n, f"need {n} images under {MULTIVIEW}, found {len(files)}"
    arr = [np.asarray(Image.open(f).convert("RGB").resize((W, H), Image.BICUBIC), dtype=np.float32) / 255
           for f in files]
    return torch.from_numpy(np.stack(arr)).permute(0, 3, 1, 2).contiguous().cuda()


def _run(model, images, qp, mode, dtype=None):
    model.set_attn_mode(mode)
    with torch.no_grad(), autocast("cuda", dtype):
        out = model(images, qp)
    return {k: out[k].double() for k in KEYS}


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = VGGT().eval()
    images = _images()
    qp = torch.tensor([[100.0, 120.0], [300.0, 200.0], [450.0, 50.0]], device="cuda")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref64 = copy.deepcopy(model).double()
        ref = _run(ref64, images.double(), qp.double(), None)
    del ref64
    torch.cuda.empty_cache()
    return model, images, qp, ref


@pytest.mark.gpu
@pytest.mark.parametrize("mode,sdpa_dtype", [("fp32", None), ("fp32", torch.bfloat16), ("bf16", torch.bfloat16)])
def test_vggt_1b_mode_vs_sdpa(setup, mode, sdpa_dtype):
    model, images, qp, ref = setup
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        base = _run(model, images, qp, None, sdpa_dtype)
        ours = _run(model, images, qp, mode, sdpa_dtype)
    model.set_attn_mode("auto")
    floor = 1e-6 if sdpa_dtype is None else 1e-3
    for k in KEYS:
        assert torch.isfinite(ours[k]).all(), k
        e_base, e_ours = rel_l2(base[k], ref[k]), rel_l2(ours[k], ref[k])
        print(f"{mode} {k}: SDPA {e_base:.3g}  visionattn {e_ours:.3g}  (vs float64)")
        assert e_ours <= 2 * e_base + floor, (k, e_ours, e_base)


@pytest.mark.gpu
def test_fastvggt_disabled_is_vggt_and_enabled_runs(setup):
    model, images, qp, _ = setup
    model.set_attn_mode("fp32")
    try:
        base = _run(model, images, qp, "fp32")
        model.merging = TokenMerging(ratio=0.0, protect=0.0)
        same = _run(model, images, qp, "fp32")
        model.merging = TokenMerging()
        fast = _run(model, images, qp, "fp32")
    finally:
        model.merging = None
        model.set_attn_mode("auto")
    for k in KEYS:
        assert torch.equal(base[k], same[k]), k
        assert torch.isfinite(fast[k]).all() and fast[k].shape == base[k].shape, k


@pytest.mark.gpu
@pytest.mark.parametrize("mode,dtype", [("fp32", None), ("bf16", torch.bfloat16)])
def test_trimmed_layers_bit_identical_8_frames(setup, mode, dtype):
    """Keeping only the layers the heads read (and dropping each after its last reader) changes no output bit."""
    model, images, qp, _ = setup
    model.set_attn_mode(mode)
    try:
        with torch.no_grad(), autocast("cuda", dtype):
            model.keep_all_layers = True
            ref = model(images, qp)
            model.keep_all_layers = False
            got = model(images, qp)
    finally:
        model.keep_all_layers = False
        model.set_attn_mode("auto")
    for k in KEYS:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.gpu
@pytest.mark.parametrize("frames,mode", [(10, "fp32"), (100, "fp32"), (10, "bf16"), (100, "bf16")])
def test_estimate_memory_within_10_percent(setup, frames, mode):
    """VGGT-1B at 392x518 (no track queries): analytic peak vs torch.cuda.max_memory_allocated."""
    model, _, _, _ = setup
    images = torch.rand(frames, 3, 392, 518, device="cuda")
    dtype = torch.bfloat16 if mode == "bf16" else None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), autocast("cuda", dtype):
        out = model(images)
    del out
    peak = torch.cuda.max_memory_allocated()  # weights, these images, and the fixture's 8-frame tensors (~0.1 GB)
    est = model.estimate_memory(frames, 392, 518, mode)
    print(f"{frames} frames {mode}: estimate {est / 2**30:.2f} GiB, measured {peak / 2**30:.2f} GiB")
    assert abs(est - peak) <= 0.10 * peak
