"""Shared test setup.

Without a CUDA device the Triton kernels run in the interpreter; the variable
must be set before triton is imported, so it is set here, first.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers (``-n N``) share the machine's cores: each takes its share of torch's CPU threads, else N
# workers x all cores oversubscribe it (a patched-model test's float64 oracle took ~230 s at -n 8 on 16 cores)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (run `pytest -m gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernel_launches(monkeypatch):
    """``[(kernel name, positional args, keyword args)]`` of every Triton kernel launched in the interpreter while
    the test runs, on the ``triton`` backend: what the host hands the kernels (strides, tile widths, operands),
    which the interpreter computes correctly even where the GPU's compiled code does not."""
    if torch.cuda.is_available():
        pytest.skip("records the interpreter's kernel launches (the GPU conformance suite checks the GPU)")
    from triton.runtime.interpreter import InterpretedFunction

    import visionattn as va

    seen, real = [], InterpretedFunction.run

    def run(self, *args, **kwargs):
        seen.append((getattr(self.fn, "__name__", "?"), args, dict(kwargs)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    with va.use_backend("triton"):
        yield seen
