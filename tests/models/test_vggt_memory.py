"""CPU tests of VGGT's memory discipline: layer trimming, frame chunking, the memory model, head precision."""
import pytest
import torch

from visionattn.models import FASTVGGT_MERGING, VGGT, vggt_tiny_config

KEYS = ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf", "track", "vis", "conf")


def _tiny(**kw):
    torch.manual_seed(0)
    return VGGT(**vggt_tiny_config(**kw)).eval()


def _assert_equal(a: dict, b: dict):
    for k in KEYS:
        if k in a or k in b:
            assert torch.equal(a[k], b[k]), k
    for x, y in zip(a["pose_enc_list"], b["pose_enc_list"]):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------- layer trimming
@pytest.mark.parametrize("merging", [None, FASTVGGT_MERGING])
def test_trimmed_layers_bit_identical_to_all_kept(merging):
    model = _tiny(depth=4, dpt_layers=(0, 1, 1, 2))
    model.merging = merging
    x = torch.rand(3, 3, 42, 56)
    qp = torch.tensor([[5.0, 7.0], [30.0, 20.0]])
    with torch.no_grad():
        model.keep_all_layers = True
        ref = model(x, qp)
        model.keep_all_layers = False
        got = model(x, qp)
    _assert_equal(got, ref)


def test_layers_kept_and_released_after_last_reader(monkeypatch):
    model = _tiny(depth=4, dpt_layers=(0, 1, 1, 2))
    seen = {}
    for name in ("camera_head", "depth_head", "point_head", "track_head"):
        head = getattr(model, name)
        orig = head.forward

        def spy(tokens, *a, _name=name, _orig=orig, **k):
            seen[_name] = [i for i, t in enumerate(tokens) if t is not None]
            return _orig(tokens, *a, **k)

        monkeypatch.setattr(head, "forward", spy)
    assert model.layer_readers(with_tracks=True) == [
        ("camera_head", (3,)), ("depth_head", (0, 1, 2)), ("point_head", (0, 1, 2)), ("track_head", (0, 1, 2))]
    with torch.no_grad():
        model(torch.rand(2, 3, 28, 28), torch.tensor([[3.0, 4.0]]))
    # the camera head reads the last layer, then it is dropped; layer 3 of 4 is never kept by the DPT heads
    assert seen == {"camera_head": [0, 1, 2, 3], "depth_head": [0, 1, 2], "point_head": [0, 1, 2],
                    "track_head": [0, 1, 2]}
    seen.clear()
    with torch.no_grad():
        model(torch.rand(2, 3, 28, 28))  # no query points: the track head does not run or keep anything
    assert "track_head" not in seen and seen["point_head"] == [0, 1, 2]
    model.keep_all_layers = True
    with torch.no_grad():
        model(torch.rand(2, 3, 28, 28))
    assert seen["point_head"] == [0, 1, 2, 3]


def test_training_gradients_unchanged_by_trimming():
    model = _tiny(depth=3, dpt_layers=(0, 0, 1, 1), enable_track=False).train()
    x = torch.rand(2, 3, 28, 42)
    grads = []
    for keep_all in (True, False):
        model.zero_grad()
        model.keep_all_layers = keep_all
        out = model(x)
        (out["depth"].mean() + out["world_points"].square().mean() + out["pose_enc"].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 100
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


# ----------------------------------------------------------------------------- frame / token chunking
@pytest.mark.parametrize("merging", [None, FASTVGGT_MERGING])
def test_chunked_stages_match_unchunked(merging):
    """Chunking over frames / token rows changes only the GEMM and convolution row or batch
    counts; the CPU kernels then may block the K reduction differently, so the outputs agree to
    FP32 rounding (a few ulp), not bit for bit. The patch-embed chunking alone is bit-identical here."""
    from visionattn.metrics import rel_l2

    model = _tiny(merging=merging)
    x = torch.rand(5, 3, 42, 56)
    qp = torch.tensor([[5.0, 7.0], [30.0, 20.0], [50.0, 3.0]])
    with torch.no_grad():
        model.set_chunking(None, None, None)
        ref = model(x, qp)
        model.set_chunking(None, 2, None)
        _assert_equal(model(x, qp), ref)
        model.set_chunking(frames_chunk_size=2, patch_embed_chunk_size=3, tokens_chunk_size=37)
        got = model(x, qp)
    for k in KEYS:
        assert rel_l2(got[k].double(), ref[k].double()) < 2e-6, k
    assert model.config["tokens_chunk_size"] == 37 and model.aggregator.frames_chunk_size == 3
    assert model.track_head.tracker.frames_chunk_size == 2
    with pytest.raises(ValueError, match="tokens_chunk_size"):
        model.set_chunking(8, 32, 0)


def test_chunked_mlp_inactive_with_grad():
    """With grad enabled the block runs its MLP unchunked (no in-place update of an autograd tensor)."""
    model = _tiny(enable_track=False, tokens_chunk_size=11).train()
    out = model(torch.rand(2, 3, 28, 28))
    out["depth"].mean().backward()
    assert model.aggregator.frame_blocks[0].mlp.fc1.weight.grad is not None


def test_predictions_to_numpy_chunked_and_memmapped(tmp_path):
    import numpy as np

    from visionattn.models import predictions_to_numpy

    model = _tiny()
    with torch.no_grad():
        out = model(torch.rand(5, 3, 28, 42), torch.tensor([[3.0, 4.0]]))
    ref = {k: out[k][0].float().numpy() for k in ("depth", "world_points", "pose_enc", "track")}
    got = predictions_to_numpy(out, frames_chunk_size=2)
    disk = predictions_to_numpy(out, keys=list(ref), frames_chunk_size=3, out_dir=tmp_path / "npy")
    for k, v in ref.items():
        assert np.array_equal(got[k], v) and np.array_equal(disk[k], v), k
        assert np.array_equal(np.load(tmp_path / "npy" / f"{k}.npy"), v), k
    with pytest.raises(KeyError):
        predictions_to_numpy(out, keys=["nope"])


def test_unproject_chunked_equals_whole():
    from visionattn.models import unproject_depth_map_to_point_map as unproject

    torch.manual_seed(3)
    depth = torch.rand(5, 14, 21, 1) + 0.5
    E = torch.cat([torch.linalg.qr(torch.randn(5, 3, 3))[0], torch.randn(5, 3, 1)], dim=-1)
    K = torch.tensor([[20.0, 0, 10], [0, 20.0, 7], [0, 0, 1]]).expand(5, 3, 3)
    whole = unproject(depth, E, K)
    assert torch.equal(unproject(depth, E, K, frames_chunk_size=2), whole)
    assert (unproject(depth.numpy(), E.numpy(), K.numpy(), frames_chunk_size=3) == whole.numpy()).all()


# ----------------------------------------------------------------------------- memory model
def test_estimate_memory_vggt_1b_structure():
    from visionattn.models import max_frames_that_fit

    est = [VGGT.estimate_memory(s, 392, 518, "fp32") for s in (1, 10, 50, 100, 200)]
    assert all(a < b for a, b in zip(est, est[1:])), est
    weights = 1_256_537_516 * 4
    assert weights < est[0] < weights + 2 * 2 ** 30
    official = VGGT.estimate_memory(200, 392, 518, "fp32", keep_all_layers=True)
    assert est[-1] <= 0.45 * official  # the kept-layer trimming is what the model is meant to show
    # bf16's activations, smaller than fp32's, outweigh autocast's half weight copies at 500 frames (not at 200)
    assert VGGT.estimate_memory(500, 392, 518, "bf16") < VGGT.estimate_memory(500, 392, 518, "fp32")
    n = max_frames_that_fit(80 * 2 ** 30, 392, 518, "fp32", margin=0.0)
    assert VGGT.estimate_memory(n, 392, 518, "fp32") <= 80 * 2 ** 30 < VGGT.estimate_memory(n + 1, 392, 518, "fp32")
    assert max_frames_that_fit(2 ** 30, 392, 518, "fp32") == 0  # not even the weights fit
    with pytest.raises(ValueError, match="mode"):
        VGGT.estimate_memory(10, 392, 518, "fp8")
    with pytest.raises(ValueError, match="multiple of patch_size"):
        VGGT.estimate_memory(10, 390, 518)


@pytest.mark.parametrize("config,hw", [
    (dict(), (56, 56)),
    (dict(img_size=56, embed_dim=256, depth=6, dpt_layers=(1, 2, 3, 4), patch_embed_depth=1, enable_track=False),
     (28, 42)),
])
def test_estimate_memory_matches_measured_live_bytes(config, hw):
    """Analytic peak (less the CUDA scratch allowance) vs the live tensor bytes counted on the CPU (weights
    included), FP32 and bf16 autocast."""
    from visionattn.models import LiveBytes
    from visionattn.models.peak_memory import CUDA_SCRATCH_BYTES
    from visionattn.models.vggt import autocast

    model = VGGT(**vggt_tiny_config(**config), attn_mode=None).eval()
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    for mode, dt in (("fp32", None), ("bf16", torch.bfloat16)):
        prev = 0
        for frames in (4, 24):
            x = torch.rand(frames, 3, *hw)
            with torch.no_grad(), autocast("cpu", dt), LiveBytes(base=weights) as meter:
                model(x)
            est = model.estimate_memory(frames, *hw, mode) - CUDA_SCRATCH_BYTES
            assert 0.9 <= est / meter.peak <= 1.25, (mode, frames, est, meter.peak)
            assert est > prev
            prev = est


# ----------------------------------------------------------------------------- head precision
def test_half_heads_option():
    from visionattn.metrics import rel_l2

    model = _tiny(enable_track=False)
    x = torch.rand(3, 3, 42, 56)
    seen = []
    hook = model.depth_head.scratch.output_conv1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.no_grad():
        ref = model(x)
        model.heads_dtype = "bf16"
        got = model(x)
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]  # chosen inside forward, per call
    assert model.config["heads_dtype"] == "bf16"
    for k in ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf"):
        assert got[k].dtype == torch.float32, k
        assert rel_l2(got[k].double(), ref[k].double()) < 5e-2, k
    assert torch.equal(got["images"], ref["images"])
    model.heads_dtype = "fp32"
    assert model.heads_dtype is None
    with pytest.raises(ValueError, match="heads_dtype"):
        model.heads_dtype = "int8"
