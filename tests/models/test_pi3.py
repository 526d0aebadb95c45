"""CPU tests of visionattn.models.Pi3 (π³): checkpoint layout, tiny-config forward, attention modes, loading."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from visionattn.metrics import rel_l2
from visionattn.models import Pi3, pi3_tiny_config
from visionattn.models.hub import CheckpointNotFoundError

HERE = os.path.dirname(os.path.abspath(__file__))
TSV = os.path.join(HERE, "..", "data", "pi3_state_dict.tsv")
PI3_VALUES = 958_696_738
KEYS = ("points", "local_points", "conf", "camera_poses")


def read_tsv(path):
    """[(key, shape)] and the total value count of a ``key<TAB>shape<TAB>dtype<TAB>numel`` key list."""
    rows = [line.rstrip("\n").split("\t") for line in open(path)][1:]
    ref = [(r[0], tuple(int(x) for x in r[1].strip("()").split(",") if x.strip())) for r in rows]
    return ref, sum(int(r[3]) for r in rows)


def strict_meta_load(model, ref):
    """Load meta tensors with the key list's names and shapes into ``model`` with strict=True."""
    sd = {k: torch.empty(shape, device="meta") for k, shape in ref}
    return model.load_state_dict(sd, strict=True, assign=True)


def outputs_close(a, b, tol, keys=KEYS):
    for k in keys:
        err = rel_l2(a[k].double(), b[k].double())
        assert err <= tol, f"{k}: rel L2 {err:.3g} > {tol}"


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = Pi3(**pi3_tiny_config()).eval()
    with torch.no_grad():  # LayerScale 0.01 would hide the decoder: give every block a visible contribution
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.normal_(0, 0.3)
    return model


# ----------------------------------------------------------------------------- layout
def test_full_config_matches_official_state_dict_on_meta():
    ref, total = read_tsv(TSV)
    with torch.device("meta"):
        model = Pi3()
    sd = model.state_dict()
    assert all(t.is_meta for t in sd.values()), "the meta build must not allocate"
    assert len(ref) == len(sd) == 1210
    assert dict(ref) == {k: tuple(v.shape) for k, v in sd.items()}
    assert sum(v.numel() for v in sd.values()) == total == PI3_VALUES
    res = strict_meta_load(model, ref)
    assert not res.missing_keys and not res.unexpected_keys


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("N,H,W", [(1, 56, 56), (3, 42, 70), (4, 28, 42)])
def test_tiny_forward_shapes_and_geometry(tiny, N, H, W):
    torch.manual_seed(N)
    with torch.no_grad():
        out = tiny(torch.rand(N, 3, H, W))
    expect = {"points": (1, N, H, W, 3), "local_points": (1, N, H, W, 3), "conf": (1, N, H, W, 1),
              "camera_poses": (1, N, 4, 4)}
    assert set(out) == set(expect)
    for k, shape in expect.items():
        assert tuple(out[k].shape) == shape, k
        assert out[k].dtype == torch.float32 and torch.isfinite(out[k]).all(), k
    assert (out["local_points"][..., 2] > 0).all()
    T = out["camera_poses"]
    R = T[..., :3, :3]
    assert torch.allclose(R.transpose(-1, -2) @ R, torch.eye(3).expand_as(R), atol=1e-5)
    assert torch.allclose(torch.linalg.det(R), torch.ones(1, N), atol=1e-5)
    assert torch.equal(T[..., 3, :], torch.tensor([0.0, 0, 0, 1]).expand(1, N, 4))
    world = torch.einsum("bnij,bnhwj->bnhwi", R, out["local_points"]) + T[..., None, None, :3, 3]
    assert torch.allclose(world, out["points"], atol=1e-5)


def test_permutation_equivariance(tiny):
    """π³ has no reference frame: permuting the input frames permutes every output."""
    torch.manual_seed(1)
    x = torch.rand(4, 3, 42, 56)
    perm = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        a, b = tiny(x), tiny(x[perm])
    outputs_close({k: v[:, perm] for k, v in a.items()}, b, 1e-5)


def test_batched_input_equals_per_scene(tiny):
    torch.manual_seed(2)
    x = torch.rand(2, 3, 3, 42, 42)
    with torch.no_grad():
        both, one = tiny(x), tiny(x[1])
    outputs_close({k: v[1:] for k, v in both.items()}, one, 1e-5)


def test_deterministic(tiny):
    x = torch.rand(2, 3, 28, 42)
    with torch.no_grad():
        a, b = tiny(x), tiny(x)
    for k in KEYS:
        assert torch.equal(a[k], b[k]), k


def test_bad_inputs_raise(tiny):
    with pytest.raises(ValueError, match="multiple of patch_size"):
        tiny(torch.rand(1, 3, 50, 56))
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        tiny(torch.rand(3, 56, 56))
    with pytest.raises(TypeError, match="float"):
        tiny(torch.zeros(1, 3, 28, 28, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a visionattn mode"):
        Pi3(**pi3_tiny_config(), attn_mode="fp64")
    with pytest.raises(ValueError, match="even"):
        Pi3(**pi3_tiny_config(depth=3))


# ----------------------------------------------------------------------------- attention modes
def test_every_attention_goes_through_visionattn(tiny, monkeypatch):
    import visionattn.models.layers as layers

    seen = []

    def spy(q, k, v, mode):
        seen.append(mode)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.setattr(layers, "_va_attention", spy)
    tiny.set_attn_mode("tf32")
    try:
        with torch.no_grad():
            tiny(torch.rand(2, 3, 28, 42))
    finally:
        tiny.set_attn_mode("auto")
    # DINOv2 (2) + decoder (4) + point, confidence and camera decoders (1 block each)
    assert seen == ["tf32"] * (2 + 4 + 3)
    assert tiny.attn_mode == "auto"


@pytest.fixture(scope="module")
def float64_reference(tiny):
    torch.manual_seed(3)
    x = torch.rand(3, 3, 42, 56)
    ref64 = copy.deepcopy(tiny).double().set_attn_mode(None)
    with torch.no_grad():
        ref = ref64(x.double())
    sdpa = {}
    for dtype in (None, torch.bfloat16):
        tiny.set_attn_mode(None)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            sdpa[dtype] = tiny(x)
    tiny.set_attn_mode("auto")
    return x, ref, sdpa


@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "bf16", "fp16"])
def test_modes_vs_float64_oracle(tiny, float64_reference, mode):
    """Each mode's outputs against the float64 model (SDPA): FP32-class modes within 2x the FP32 SDPA run's error,
    the reduced-precision modes (attention alone in TF32 / bf16 / fp16) within the official bf16-autocast run's."""
    x, ref, sdpa = float64_reference
    tiny.set_attn_mode(mode)
    try:
        with torch.no_grad():
            out = tiny(x)
    finally:
        tiny.set_attn_mode("auto")
    for k in KEYS:
        e = rel_l2(out[k], ref[k])
        if mode.startswith("fp32"):
            assert e <= 2 * rel_l2(sdpa[None][k], ref[k]) + 1e-6, (k, e)
        else:
            assert e <= rel_l2(sdpa[torch.bfloat16][k], ref[k]), (k, e)


def test_bf16_autocast_runs_heads_in_fp32(tiny):
    out = tiny.infer(torch.rand(2, 3, 28, 28), dtype="bf16")
    assert all(out[k].dtype == torch.float32 and torch.isfinite(out[k]).all() for k in KEYS)


def test_patch_model_switches_native_attention(tiny):
    import visionattn

    natives = [m for m in tiny.modules() if getattr(type(m), "_visionattn_native", False)]
    assert len(natives) == 2 + 4 + 3
    visionattn.patch_model(tiny, mode="bf16")
    try:
        assert all(m.visionattn_mode == "bf16" for m in natives)
    finally:
        visionattn.unpatch_model(tiny)
    assert all(m.visionattn_mode == "auto" for m in natives)


def test_chunking_changes_only_rounding(tiny):
    x = torch.rand(5, 3, 28, 42)
    with torch.no_grad():
        ref = tiny(x)
        tiny.set_chunking(encoder_chunk_size=2, tokens_chunk_size=17)
        try:
            got = tiny(x)
        finally:
            tiny.set_chunking()
    outputs_close(got, ref, 1e-5)
    with pytest.raises(ValueError, match="encoder_chunk_size"):
        tiny.set_chunking(encoder_chunk_size=0)


# ----------------------------------------------------------------------------- checkpoints
def test_save_and_load_local(tiny, tmp_path):
    path = tiny.save_pretrained(tmp_path / "ckpt")
    x = torch.rand(2, 3, 42, 42)
    with torch.no_grad():
        ref = tiny(x)
        for src in (tmp_path / "ckpt", path):
            outputs_close(Pi3.from_pretrained(src)(x), ref, 0.0)
    sd = tiny.state_dict()
    sd.pop("image_mean"), sd.pop("image_std")  # constants: filled in when a checkpoint lacks them
    torch.save({"model": sd}, tmp_path / "model.pt")
    with torch.no_grad():
        outputs_close(Pi3.from_pretrained(tmp_path / "model.pt", **pi3_tiny_config())(x), ref, 0.0)
    sd.pop("register_token")
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(RuntimeError, match="register_token"):
        Pi3.from_pretrained(tmp_path / "bad.pt", **pi3_tiny_config())
    with pytest.raises(CheckpointNotFoundError):
        Pi3.from_pretrained(tmp_path / "nothing_here")


def test_official_config_json(tiny, tmp_path):
    """The hub's config.json holds the official constructor arguments (pos_type, decoder_size)."""
    d = tmp_path / "official"
    tiny.save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_base")
    (d / "config.json").write_text(json.dumps({**cfg, "pos_type": "rope100", "decoder_size": "large"}))
    assert Pi3.from_pretrained(d).rope_base == 100.0
    (d / "config.json").write_text(json.dumps({**cfg, "decoder_size": "small"}))
    with pytest.raises(ValueError, match="decoder_size"):
        Pi3.from_pretrained(d)


@pytest.mark.parametrize("cls,repo", [("Pi3", "yyfz233/Pi3"), ("Pi3X", "yyfz233/Pi3X")])
def test_offline_hub_error_is_fast_and_helpful(tmp_path, cls, repo):
    code = ("import time; t = time.time()\n"
            f"from visionattn.models import {cls}\n"
            f"try:\n    {cls}.from_pretrained()\n"
            "except Exception as e:\n    print(type(e).__name__, '|', e, '|', round(time.time() - t, 1))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    out = res.stdout
    assert out.startswith("CheckpointNotFoundError"), out + res.stderr
    assert repo in out and "model.safetensors" in out and str(tmp_path / "hf") in out
    assert f"{cls}.from_pretrained('/path/to" in out
    assert "CC BY-NC 4.0" in res.stderr  # the licence is stated before the lookup
    assert float(out.rsplit("|", 1)[1]) < 60


@pytest.mark.parametrize("cls_name", ["Pi3", "Pi3X"])
def test_grad_checkpointing_keeps_outputs_and_gradients(cls_name, monkeypatch):
    """Fine-tuning with activation checkpointing: the same loss and the same gradients as without it (the blocks
    recompute in backward), and the switch reaches the decoder and every DINOv2 encoder."""
    import visionattn.models as models
    import visionattn.models.layers as layers

    calls = []
    real = layers.checkpoint
    monkeypatch.setattr(layers, "checkpoint", lambda fn, *a, **k: calls.append(fn) or real(fn, *a, **k))

    cls = getattr(models, cls_name)
    cfg = models.pi3_tiny_config() if cls_name == "Pi3" else models.pi3x_tiny_config()
    torch.manual_seed(0)
    model = cls(**cfg, attn_mode="fp32").train()
    images = torch.rand(1, 3, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    grads = []
    for enable in (False, True):
        model.zero_grad()
        assert model.set_grad_checkpointing(enable) is model and model.grad_checkpointing is enable
        out = model(images)
        loss = sum((out[k].float() ** 2).mean() for k in ("points", "local_points", "conf", "camera_poses"))
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss0, g0), (loss1, g1) = grads
    # the decoder's and the image encoder's blocks ran checkpointed, in the enabled pass only
    ran = len(model.decoder) + sum(type(m).__name__ == "Block" for m in model.encoder.modules())
    assert len(calls) == ran
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        assert torch.allclose(g0[name], g1[name], rtol=1e-5, atol=1e-7), name
    dinos = [m for m in model.modules() if type(m).__name__ == "DinoV2"]
    assert dinos and all(m.grad_checkpointing for m in dinos)
    with pytest.raises(TypeError, match="must be a bool"):
        model.set_grad_checkpointing(1)
