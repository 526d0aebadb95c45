"""Building the reconstruction models on the meta device (what from_pretrained does before it assigns the weights)
draws no random values: PyTorch's Python meta kernels of normal_ / mul import torch._dynamo on first use, which cost
seconds of every model load. Checked in a fresh process, where nothing has imported it yet."""
import subprocess
import sys

import pytest

CODE = """
import sys, torch
from visionattn.models import {cls}
assert "torch._dynamo" not in sys.modules, "imported before the build"
with torch.device("meta"):
    {cls}()
print("torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize("cls", ["VGGT", "Pi3", "Pi3X"])
def test_meta_build_imports_no_dynamo(cls):
    out = subprocess.run([sys.executable, "-c", CODE.format(cls=cls)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
