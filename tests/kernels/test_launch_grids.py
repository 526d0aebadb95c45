"""Launch grids stay within CUDA's limits: the kernels take 1-D grids (2^31 - 1 programs), never a second axis
(65,535 programs), which the window forward used for its windows x heads (tiled kernel) and image chunks (small
kernel): batch 64 x 64 windows x 16 heads of a window over 128 tokens would not launch. ``KernelCall`` refuses a grid
past the limits with a clear error instead of CUDA's launch failure."""
import pytest
import torch

import visionattn as va
from visionattn.kernels import _launch, window_fwd


def test_grid_past_cuda_limits_is_refused():
    with pytest.raises(ValueError, match=r"launch grid \(1, 65536\) exceeds CUDA's limits"):
        _launch.KernelCall(window_fwd._window_tiled_kernel, (1, 65_536), {}, {})


def test_every_launch_grid_is_one_dimensional(monkeypatch):
    grids = []
    real = _launch.KernelCall.__init__

    def init(self, fn, grid, constexprs, options):
        grids.append((getattr(getattr(fn, "fn", fn), "__name__", "?"), tuple(grid)))
        real(self, fn, grid, constexprs, options)

    monkeypatch.setattr(_launch.KernelCall, "__init__", init)
    g = torch.Generator().manual_seed(0)
    for n, mode in ((49, "fp32"), (49, "bf16"), (144, "fp32")):  # the small kernel, and the tiled one past 128
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        q, k, v = (torch.randn(4, 2, n, 16, generator=g).to(dtype) for _ in range(3))
        mask = torch.zeros(2, n, n)
        mask[1, :, : n // 2] = float("-inf")
        out = va.window_attention(q, k, v, shift_mask=mask, num_windows=2, mode=mode, backend="triton")
        full = mask.repeat(2, 1, 1)[:, None].to(torch.float64)
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=full)
        assert (out.double() - ref).abs().max() < (2e-2 if mode == "bf16" else 1e-5)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    va.attention(q, k, v, mode="fp32", backend="triton")
    names = {name for name, _ in grids}
    assert {"_window_small_kernel", "_window_tiled_kernel"} <= names, names
    assert all(len(grid) == 1 for _, grid in grids), [x for x in grids if len(x[1]) != 1]
