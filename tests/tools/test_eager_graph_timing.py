"""The harness's eager_graph_ms (tools/_harness.py) on the GPU: paired eager and graph readings of the same calls."""
import pytest
import torch

from testdata import load_script

eager_graph_ms = load_script("tools/_harness.py").eager_graph_ms


@pytest.mark.gpu
def test_gpu_bound_calls_read_alike_eager_and_graph():
    """A matmul long enough that the launch path hides behind it: eager and graph agree within 25 %, and the
    readings scale with the work (eight times the flops, at least four times the time)."""
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(8192, 8192, device="cuda")
    eager, graph, error = eager_graph_ms(lambda: (lambda: a @ a), calls=20, repeats=3)
    assert error is None and graph is not None
    assert 0.8 < eager / graph < 1.25
    big_eager, big_graph, _ = eager_graph_ms(lambda: (lambda: b @ b), calls=5, repeats=3)
    assert big_graph > 4 * graph and big_eager > 4 * eager


@pytest.mark.gpu
def test_calls_that_cannot_be_captured_keep_their_eager_reading():
    """A call that synchronises with the host cannot be captured: the eager reading stands, the graph is None and
    the capture's exception comes back; the process keeps working afterwards."""
    x = torch.randn(1024, device="cuda")
    eager, graph, error = eager_graph_ms(lambda: (lambda: (x * 2).sum().item()), calls=4, repeats=3)
    assert eager > 0 and graph is None and isinstance(error, Exception)
    assert torch.allclose((x + 1).cpu(), x.cpu() + 1)
