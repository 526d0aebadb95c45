"""Launch grids stay within CUDA's limits (2^31 - 1 programs on axis 0, 65,535 on axes 1 and 2). The window forward
put its windows x heads (tiled kernel) or image chunks (small kernel) on grid axis 1 alone: batch 64 x 64 windows x
16 heads of a window over 144 tokens did not launch ("invalid argument"). Axis 1 now spills into axis 2
(:func:`over_axes_1_2`), and ``KernelCall`` refuses a grid past the limits with a clear error instead of CUDA's
launch failure. The tests shrink the axis limit so that the interpreter runs the spilled grids, with the programs
past the end that the rounding adds."""
import pytest
import torch

import visionattn as va
from visionattn.kernels import _launch, window_fwd


def test_grid_past_cuda_limits_is_refused():
    with pytest.raises(ValueError, match=r"launch grid \(1, 65536\) exceeds CUDA's limits"):
        _launch.KernelCall(window_fwd._window_tiled_kernel, (1, 65_536), {}, {})
    with pytest.raises(ValueError, match="exceeds CUDA's limits"):
        _launch.KernelCall(window_fwd._window_tiled_kernel, (2 ** 31,), {}, {})


@pytest.mark.parametrize("n", [1, 7, 8, 65_535, 65_536, 131_071, 2 ** 31])
def test_over_axes_1_2_covers_every_program(n):
    y, z = _launch.over_axes_1_2(n)
    assert y <= 65_535 and z <= 65_535 and n <= y * z < n + z
    assert z == 1 or n > 65_535


def test_window_grids_spill_into_axis_2(monkeypatch):
    """With axis 1 limited to 5 programs, a window call of 11-13 windows x heads runs on a (x, 5-7, 2-3) grid, the
    programs past the end included, and matches the float64 oracle."""
    grids = []
    real = _launch.KernelCall.__init__

    def init(self, fn, grid, constexprs, options):
        grids.append((getattr(getattr(fn, "fn", fn), "__name__", "?"), tuple(grid)))
        real(self, fn, grid, constexprs, options)

    monkeypatch.setattr(_launch.KernelCall, "__init__", init)
    monkeypatch.setattr(_launch, "GRID_AXIS_LIMITS", (2 ** 31 - 1, 5, 5))
    window_fwd.PLANS.clear()
    g = torch.Generator().manual_seed(0)
    for n, windows, heads, mode in ((49, 13, 1, "fp32"), (49, 11, 1, "bf16"), (144, 11, 1, "fp32"),
                                    (144, 6, 2, "bf16")):
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        q, k, v = (torch.randn(windows, heads, n, 16, generator=g).to(dtype) for _ in range(3))
        out = va.window_attention(q, k, v, num_windows=1, mode=mode, backend="triton")
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
        assert (out.double() - ref).abs().max() < (2e-2 if mode == "bf16" else 1e-5), (n, windows, heads, mode)
    window_fwd.PLANS.clear()
    names = {name for name, _ in grids}
    assert {"_window_small_kernel", "_window_tiled_kernel"} <= names, names
    spilled = [grid for name, grid in grids if name.startswith("_window") and len(grid) == 3 and grid[2] > 1]
    assert len(spilled) >= 3, grids
    assert all(len(grid) <= 3 and max(grid[1:], default=1) <= 5 for _, grid in grids if grid), grids
