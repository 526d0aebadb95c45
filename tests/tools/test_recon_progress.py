"""The demo's inference bar moves within the forward: one step per transformer block as it first runs, so a long
forward on a CPU shows where it is and how long is left (tqdm's rate), instead of one bar at 0/1."""
import pytest
import torch

from visionattn.recon import pipeline


class RecordingBar:
    """A tqdm stand-in recording the position after each update."""

    def __init__(self, total=None, **kwargs):
        self.total, self.n, self.positions, self.closed = total, 0, [], False

    def update(self, k=1):
        self.n += k
        self.positions.append(self.n)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("model_name", ["vggt", "pi3"])
def test_inference_bar_moves_per_block(monkeypatch, model_name):
    import tqdm.auto

    bars = []
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **k: bars.append(RecordingBar(*a, **k)) or bars[-1])
    model = pipeline.build_model(model_name, weights="random-tiny", mode="sdpa")
    blocks = pipeline._blocks(model)
    images = torch.rand(3, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    pipeline.run_model(model, images, warmup=1, progress=True)
    bar = bars[0]
    assert bar.total == 2 * len(blocks) and len(blocks) >= 4
    # every block of each forward moved the bar, one step at a time, and the bar ended full
    assert bar.positions[: len(blocks)] == list(range(1, len(blocks) + 1))
    assert bar.n == bar.total and bar.closed
    # the hooks come off after the run
    assert all(not b._forward_hooks for b in blocks)


def test_no_hooks_without_progress():
    model = pipeline.build_model("vggt", weights="random-tiny", mode="sdpa")
    pipeline.run_model(model, torch.rand(2, 3, 56, 56), progress=False)
    assert all(not b._forward_hooks for b in pipeline._blocks(model))
