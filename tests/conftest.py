"""Shared test setup.

Without a CUDA device the Triton kernels run in the interpreter; the variable
must be set before triton is imported, so it is set here, first.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
