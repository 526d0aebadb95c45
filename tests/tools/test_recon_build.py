"""Model build for the demo: a checkpoint loads without a random init first, to the parameters and outputs of the
slow path (random init, then load_state_dict); random weights build on the target device, one model per seed."""
import time

import pytest
import torch

from visionattn.models import VGGT, vggt_tiny_config
from visionattn.recon.pipeline import build_model

pytest.importorskip("safetensors")

_INITS = ("kaiming_uniform_", "xavier_uniform_", "trunc_normal_", "normal_", "uniform_", "zeros_", "ones_")


def _count_real_inits(monkeypatch):
    """Record each torch.nn.init call on a tensor with storage (on the meta device an init writes nothing)."""
    calls = []
    for name in _INITS:
        orig = getattr(torch.nn.init, name)

        def spy(tensor, *args, _orig=orig, _name=name, **kwargs):
            if not tensor.is_meta:
                calls.append(_name)
            return _orig(tensor, *args, **kwargs)
        monkeypatch.setattr(torch.nn.init, name, spy)
    return calls


def test_safetensors_load_skips_the_random_init_and_matches_the_slow_path(tmp_path, monkeypatch):
    saved = build_model("vggt", "random-tiny", "fp32", "cpu", seed=3)
    path = saved.save_pretrained(tmp_path / "ckpt")
    build_model("vggt", str(tmp_path / "ckpt"), "fp32", "cpu")  # the imports (safetensors, ...) out of the timing
    calls = _count_real_inits(monkeypatch)

    t0 = time.perf_counter()
    fast = build_model("vggt", str(tmp_path / "ckpt"), "fp32", "cpu")
    t_fast = time.perf_counter() - t0
    fast_inits = len(calls)

    t0 = time.perf_counter()
    slow = VGGT(**vggt_tiny_config(), attn_mode="fp32")  # random init, then overwritten
    from safetensors.torch import load_file
    slow.load_state_dict(load_file(path))
    slow.eval()
    t_slow = time.perf_counter() - t0
    print(f"tiny VGGT from safetensors on the CPU: {t_fast * 1e3:.0f} ms (meta + assign), "
          f"{t_slow * 1e3:.0f} ms (random init + load_state_dict)")

    assert fast_inits == 0 and len(calls) > 10  # the slow path initialises every layer; the fast one none
    assert not any(p.is_meta or b.is_meta for p, b in zip(fast.parameters(), fast.buffers()))
    sd_fast, sd_slow = fast.state_dict(), slow.state_dict()
    assert sd_fast.keys() == sd_slow.keys() and all(torch.equal(sd_fast[k], sd_slow[k]) for k in sd_fast)
    x = torch.rand(2, 3, 42, 56)
    q = torch.tensor([[10.0, 12.0], [30.0, 20.0]])
    with torch.inference_mode():
        a, b = fast(x, query_points=q), slow(x, query_points=q)
    for k in ("pose_enc", "depth", "depth_conf", "world_points", "track", "vis", "conf"):
        assert torch.equal(a[k], b[k]), k


def test_random_weights_build_on_the_device_one_model_per_seed():
    a, b, c = (build_model("vggt", "random-tiny", "fp32", "cpu", seed=s) for s in (5, 5, 6))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    before = torch.random.get_rng_state()
    build_model("vggt", "random-tiny", "fp32", "cpu", seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left alone
    assert all(p.device.type == "cpu" for p in a.parameters())
