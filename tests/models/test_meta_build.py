"""Building the reconstruction models on the meta device (what from_pretrained does before it assigns the weights)
draws no random values: PyTorch's Python meta kernels of normal_ / mul (and, on some releases such as 2.11,
trunc_normal_'s erfinv_ / clamp_) import torch._dynamo on first use, which cost seconds of every model load. Checked
in a fresh process, where nothing has imported it yet, and, whatever this PyTorch's meta kernels are, by refusing
the normal and truncated-normal initialisers on meta tensors during the build."""
import subprocess
import sys

import pytest
import torch

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


@pytest.mark.parametrize("cls", ["VGGT", "Pi3", "Pi3X"])
def test_meta_build_calls_no_normal_initialiser(cls, monkeypatch):
    import visionattn.models as models

    def refuse(name):
        original = getattr(torch.nn.init, name)

        def init(t, *args, **kwargs):
            assert not t.is_meta, f"nn.init.{name} on a meta tensor of shape {tuple(t.shape)}"
            return original(t, *args, **kwargs)
        return init

    for name in ("normal_", "trunc_normal_"):
        monkeypatch.setattr(torch.nn.init, name, refuse(name))
    with torch.device("meta"):
        net = getattr(models, cls)()
    assert all(p.is_meta for p in net.parameters())
