"""CPU tests of visionattn.models: VGGT / FastVGGT (tiny config), checkpoint layout, loading."""
import os
import subprocess
import sys

import pytest
import torch

from visionattn.metrics import rel_l2
from visionattn.models import FASTVGGT_MERGING, VGGT, TokenMerging, vggt_tiny_config
from visionattn.models.hub import CheckpointNotFoundError
from visionattn.models.layers import DinoV2, rope_tables, apply_rope

HERE = os.path.dirname(os.path.abspath(__file__))
TSV = os.path.join(HERE, "..", "data", "vggt_1b_state_dict.tsv")
VGGT_1B_PARAMS = 1_256_537_516


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return VGGT(**vggt_tiny_config()).eval()


def _outputs_close(a: dict, b: dict, tol: float):
    for key in ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf", "track", "vis", "conf"):
        if key in a:
            err = rel_l2(a[key].double(), b[key].double())
            assert err <= tol, f"{key}: rel L2 {err:.3g} > {tol}"


# ----------------------------------------------------------------------------- layout
def test_full_config_matches_official_state_dict_on_meta():
    rows = [line.rstrip("\n").split("\t") for line in open(TSV)][1:]
    ref = [(r[0], tuple(int(x) for x in r[1].strip("()").split(",") if x.strip())) for r in rows]
    with torch.device("meta"):
        model = VGGT()
    sd = model.state_dict()
    assert all(t.is_meta for t in sd.values()), "the meta build must not allocate"
    mine = [(k, tuple(v.shape)) for k, v in sd.items()]
    assert len(ref) == 1797
    assert set(k for k, _ in mine) == set(k for k, _ in ref)
    assert mine == ref  # same names, shapes and order
    assert sum(v.numel() for v in sd.values()) == VGGT_1B_PARAMS
    assert sum(int(r[3]) for r in rows) == VGGT_1B_PARAMS


# ----------------------------------------------------------------------------- forward shapes
@pytest.mark.parametrize("S,H,W", [(1, 56, 56), (2, 42, 70), (5, 56, 42)])
def test_tiny_forward_shapes(tiny, S, H, W):
    torch.manual_seed(S)
    images = torch.rand(S, 3, H, W)
    qp = torch.tensor([[10.0, 12.0], [20.0, 30.0], [3.0, 40.0]])
    with torch.no_grad():
        out = tiny(images, query_points=qp)
    B, N = 1, qp.shape[0]
    expect = {"pose_enc": (B, S, 9), "depth": (B, S, H, W, 1), "depth_conf": (B, S, H, W),
              "world_points": (B, S, H, W, 3), "world_points_conf": (B, S, H, W), "track": (B, S, N, 2),
              "vis": (B, S, N), "conf": (B, S, N), "images": (B, S, 3, H, W)}
    for k, shape in expect.items():
        assert tuple(out[k].shape) == shape, k
        assert torch.isfinite(out[k]).all(), k
        assert out[k].dtype == torch.float32, k
    assert len(out["pose_enc_list"]) == 4 and all(p.shape == (B, S, 9) for p in out["pose_enc_list"])
    assert torch.equal(out["pose_enc_list"][-1], out["pose_enc"])
    assert (out["depth"] > 0).all() and (out["depth_conf"] >= 1).all() and (out["world_points_conf"] >= 1).all()
    assert (out["pose_enc"][..., 7:] >= 0).all()  # field of view is ReLU-activated
    assert torch.allclose(out["track"][:, 0], qp[None])  # frame 0 keeps the query points
    assert ((out["vis"] >= 0) & (out["vis"] <= 1)).all()


def test_batched_input_equals_per_sample(tiny):
    torch.manual_seed(1)
    x = torch.rand(2, 2, 3, 42, 42)
    with torch.no_grad():
        both = tiny(x)
        one = tiny(x[1])
    _outputs_close({k: v[1:] for k, v in both.items() if torch.is_tensor(v)}, one, 1e-5)


def test_bad_inputs_raise(tiny):
    with pytest.raises(ValueError, match="multiple of patch_size"):
        tiny(torch.rand(1, 3, 50, 56))
    with pytest.raises(ValueError, match=r"\[S, 3, H, W\]"):
        tiny(torch.rand(3, 56, 56))
    with pytest.raises(ValueError, match="not a visionattn mode"):
        VGGT(**vggt_tiny_config(), attn_mode="fp64")


# ----------------------------------------------------------------------------- attention modes
def test_attention_mode_switch_sdpa_vs_fp32(tiny):
    torch.manual_seed(2)
    x = torch.rand(3, 3, 42, 56)
    qp = torch.tensor([[5.0, 7.0], [30.0, 20.0]])
    with torch.no_grad():
        tiny.set_attn_mode(None)
        ref = tiny(x, qp)
        tiny.set_attn_mode("fp32")
        got = tiny(x, qp)
        tiny.set_attn_mode("auto")
    natives = [m for m in tiny.modules() if getattr(type(m), "_visionattn_native", False)]
    # DINOv2 (2) + frame (2) + global (2) + camera trunk (1) + tracker (4 per layer)
    assert len(natives) == 2 + 2 + 2 + 1 + 4
    assert all(m.visionattn_mode == "auto" for m in natives)
    _outputs_close(got, ref, 1e-4)


def test_attention_mode_is_used(tiny, monkeypatch):
    """Every attention module routes through visionattn.attention with the model's mode."""
    import visionattn.models.layers as layers

    seen = []

    def spy(q, k, v, mode):
        seen.append((mode, q.is_contiguous()))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.setattr(layers, "_va_attention", spy)
    tiny.set_attn_mode("tf32")
    try:
        with torch.no_grad():
            tiny(torch.rand(2, 3, 28, 42), torch.tensor([[3.0, 4.0]]))
    finally:
        tiny.set_attn_mode("auto")
    # 2 DINO + 2 frame + 2 global + 4 camera iterations x 1 trunk block + tracker 2 iters x 4
    assert len(seen) == 2 + 2 + 2 + 4 + 2 * 4
    assert {m for m, _ in seen} == {"tf32"}
    assert not all(c for _, c in seen), "q views must reach the kernel without copies"


# ----------------------------------------------------------------------------- FastVGGT
def test_fastvggt_merging_disabled_is_vggt(tiny):
    torch.manual_seed(3)
    x = torch.rand(3, 3, 56, 42)
    with torch.no_grad():
        ref = tiny(x)
        for off in (None, 0, False, TokenMerging(ratio=0.0, protect=0.0)):
            tiny.merging = off if not isinstance(off, TokenMerging) else off
            got = tiny(x)
            for k in ("pose_enc", "depth", "world_points"):
                assert torch.equal(got[k], ref[k]), (off, k)
    tiny.merging = None
    assert VGGT(**vggt_tiny_config(), merging=0).merging is None


def test_fastvggt_merging_runs(tiny):
    torch.manual_seed(4)
    x = torch.rand(4, 3, 56, 70)
    with torch.no_grad():
        tiny.merging = FASTVGGT_MERGING
        try:
            out = tiny(x, torch.tensor([[5.0, 5.0]]))
        finally:
            tiny.merging = None
        ref = tiny(x)
    for k in ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf"):
        assert out[k].shape == ref[k].shape and torch.isfinite(out[k]).all(), k
    assert not torch.equal(out["depth"], ref["depth"])  # merging changed something
    with pytest.raises(TypeError, match="start_block"):
        VGGT(**vggt_tiny_config(), merging=3)


# ----------------------------------------------------------------------------- layers vs independent references
def test_dinov2_matches_timm():
    """The patch embed equals timm's DINOv2-reg4 ViT given the same weights (incl. pos-embed resampling)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(5)
    ours = DinoV2(img_size=56, patch_size=14, embed_dim=64, depth=2, num_heads=4, attn_mode=None).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.2)
    ref = timm.create_model("vit_large_patch14_reg4_dinov2", pretrained=False, img_size=56, embed_dim=64,
                            depth=2, num_heads=4, dynamic_img_size=True).eval()
    sd = {k: v for k, v in ours.state_dict().items() if k.startswith(("blocks.", "norm.", "patch_embed."))}
    sd["cls_token"] = ours.cls_token + ours.pos_embed[:, :1]
    sd["pos_embed"] = ours.pos_embed[:, 1:]
    sd["reg_token"] = ours.register_tokens
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"head.weight", "head.bias"}
    for H, W in ((56, 56), (42, 70)):
        x = torch.randn(2, 3, H, W)
        with torch.no_grad():
            a = ours(x)
            b = ref.forward_features(x)[:, 5:]
        assert rel_l2(a.double(), b.double()) < 1e-5, (H, W)


def test_rope_2d_relative_and_special_tokens():
    """q.k after 2-D RoPE depends only on the (dy, dx) offset; position (0, 0) is the identity."""
    torch.manual_seed(6)
    D = 16
    pos = torch.tensor([[[0, 0], [3, 5], [1, 2], [4, 9], [2, 4]]])
    tab = rope_tables(pos, D, base=100.0)
    q = torch.randn(1, 1, 1, D).expand(1, 1, 5, D)
    k = torch.randn(1, 1, 1, D).expand(1, 1, 5, D)
    rq, rk = apply_rope(q, tab), apply_rope(k, tab)
    assert torch.allclose(rq[..., 0, :], q[..., 0, :])
    # offsets (3,5)-(1,2) = (2,3) and (4,9)-(2,4) = (2,5) vs (2,3) again from shifted pairs
    d1 = (rq[..., 1, :] * rk[..., 2, :]).sum()
    shifted = rope_tables(pos + torch.tensor([7, 11]), D)
    sq, sk = apply_rope(q, shifted), apply_rope(k, shifted)
    d2 = (sq[..., 1, :] * sk[..., 2, :]).sum()
    assert torch.allclose(d1, d2, atol=1e-5)
    assert not torch.allclose(d1, (rq[..., 3, :] * rk[..., 4, :]).sum(), atol=1e-3)
    # rotation is norm-preserving
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)


# ----------------------------------------------------------------------------- dtype
def test_inference_dtype(tiny):
    assert tiny.inference_dtype("cpu") == torch.float32
    assert tiny.inference_dtype("cpu", "bf16") == torch.bfloat16
    assert tiny.inference_dtype(requested=torch.float16) == torch.float16
    with pytest.raises(ValueError, match="requested"):
        tiny.inference_dtype("cpu", "int8")
    out = tiny.infer(torch.rand(2, 3, 28, 28), dtype="bf16")  # CPU bf16 autocast; heads stay FP32
    assert out["depth"].dtype == torch.float32 and out["pose_enc"].dtype == torch.float32
    assert torch.isfinite(out["depth"]).all()


# ----------------------------------------------------------------------------- checkpoints
def test_save_and_load_local(tiny, tmp_path):
    path = tiny.save_pretrained(tmp_path / "ckpt")
    x = torch.rand(2, 3, 42, 42)
    with torch.no_grad():
        ref = tiny(x)
        for src in (tmp_path / "ckpt", path):
            got = VGGT.from_pretrained(src)(x)
            _outputs_close(got, ref, 0.0)
    pt = tmp_path / "model.pt"
    torch.save({"model": tiny.state_dict()}, pt)
    with torch.no_grad():
        _outputs_close(VGGT.from_pretrained(pt, **vggt_tiny_config())(x), ref, 0.0)
    sd = tiny.state_dict()
    sd.pop("camera_head.empty_pose_tokens")
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(RuntimeError, match="empty_pose_tokens"):
        VGGT.from_pretrained(tmp_path / "bad.pt", **vggt_tiny_config())
    loose = VGGT.from_pretrained(tmp_path / "bad.pt", strict=False, **vggt_tiny_config())
    assert not any(p.is_meta for p in loose.parameters())
    with pytest.raises(CheckpointNotFoundError):
        VGGT.from_pretrained(tmp_path / "nothing_here")


def test_offline_hub_error_is_fast_and_helpful(tmp_path):
    code = ("import time; t = time.time()\n"
            "from visionattn.models import VGGT\n"
            "try:\n    VGGT.from_pretrained('facebook/VGGT-1B')\n"
            "except Exception as e:\n    print(type(e).__name__, '|', e, '|', round(time.time() - t, 1))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    out = res.stdout
    assert out.startswith("CheckpointNotFoundError"), out + res.stderr
    assert "facebook/VGGT-1B" in out and "model.safetensors" in out
    assert str(tmp_path / "hf") in out  # the cache path
    assert "from_pretrained('/path/to" in out  # how to pass a local checkpoint
    assert float(out.rsplit("|", 1)[1]) < 30


def test_autocast_attention_dtype(tiny, monkeypatch):
    """Under bf16 autocast the attention sees bf16 q, k, v and "auto" resolves to the bf16 mode."""
    import visionattn.models.layers as layers

    seen = set()

    def spy(q, k, v, mode):
        seen.add((mode, q.dtype, k.dtype, v.dtype))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.setattr(layers, "_va_attention", spy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tiny.aggregator(torch.rand(1, 2, 3, 28, 28))
    assert seen == {("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16)}


def test_patch_model_switches_native_attention(tiny):
    import visionattn

    natives = [m for m in tiny.modules() if getattr(type(m), "_visionattn_native", False)]
    visionattn.patch_model(tiny, mode="bf16")
    try:
        assert all(m.visionattn_mode == "bf16" for m in natives)
        assert sum(tiny.visionattn_report.native.values()) == len(natives)
    finally:
        visionattn.unpatch_model(tiny)
    assert all(m.visionattn_mode == "auto" for m in natives)


@pytest.mark.parametrize("frames,chunk,hw", [(3, 2, (56, 42)), (1, None, (28, 56))])
def test_attention_shapes_are_the_calls_a_forward_makes(monkeypatch, frames, chunk, hw):
    """vggt_attention_shapes (what the demo compiles ahead) lists exactly the (batch, heads, tokens, head dim)
    of the attention calls a forward makes: DINOv2 per patch-embed chunk, frame, global, camera trunk."""
    import visionattn.models.layers as layers
    from visionattn.models import vggt_attention_shapes

    seen = []
    real = layers._va_attention

    def recording(q, k, v, **kw):
        seen.append(tuple(q.shape))
        return real(q, k, v, **kw)

    monkeypatch.setattr(layers, "_va_attention", recording)
    cfg = vggt_tiny_config(patch_embed_chunk_size=chunk)
    model = VGGT(**cfg, attn_mode="fp32").eval()
    with torch.no_grad():
        model(torch.rand(frames, 3, *hw))
    assert sorted(set(seen)) == sorted(s[:4] for s in vggt_attention_shapes(frames, *hw, **cfg))
    with pytest.raises(TypeError, match="no argument"):
        vggt_attention_shapes(frames, *hw, num_head=4)


@pytest.mark.parametrize("heads_dtype", [None, "float32", "bf16"])
def test_attention_shapes_name_the_inputs_dtype_under_autocast(monkeypatch, heads_dtype):
    """Under bf16 autocast the aggregator's calls get bf16 inputs, the camera trunk's FP32 ones with FP32 heads
    (a kernel variant of its own in a half mode): vggt_attention_shapes marks exactly those with torch.float32."""
    import visionattn.models.layers as layers
    from visionattn.models import vggt_attention_shapes
    from visionattn.models.vggt import autocast

    seen = []
    real = layers._va_attention

    def recording(q, k, v, **kw):
        seen.append((*q.shape, q.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(layers, "_va_attention", recording)
    cfg = vggt_tiny_config(heads_dtype=heads_dtype)
    model = VGGT(**cfg, attn_mode="bf16").eval()
    with torch.no_grad(), autocast("cpu", torch.bfloat16):
        model(torch.rand(2, 3, 28, 42))
    expected = [(*s[:4], s[4] if len(s) > 4 else torch.bfloat16) for s in vggt_attention_shapes(2, 28, 42, **cfg)]
    assert sorted(set(seen), key=str) == sorted(expected, key=str)
    assert any(d == torch.float32 for *_, d in expected) == (heads_dtype != "bf16")
