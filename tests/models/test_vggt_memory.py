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
