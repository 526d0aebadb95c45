"""CPU tests of visionattn.models.Pi3X: checkpoint layout, conditions (shapes, units, masks), modes, loading."""
import copy
import os

import pytest
import torch

from test_pi3 import outputs_close, read_tsv, strict_meta_load
from visionattn.metrics import rel_l2
from visionattn.models import Pi3X, pi3x_tiny_config
from visionattn.models.pi3x import MULTIMODAL_PREFIXES

HERE = os.path.dirname(os.path.abspath(__file__))
TSV = os.path.join(HERE, "..", "data", "pi3x_state_dict.tsv")
PI3X_VALUES = 1_360_032_439
KEYS = ("points", "local_points", "rays", "conf", "camera_poses", "metric")
N, H, W = 3, 42, 56


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = Pi3X(**pi3x_tiny_config()).eval()
    with torch.no_grad():  # zero-initialised ray embedding and small LayerScales would hide the condition branch
        for name, p in model.named_parameters():
            if name.endswith("gamma") or name.startswith(("ray_embed", "depth_emb")):
                p.normal_(0, 0.3)
    return model


def conditions(n=N, h=H, w=W):
    ang = torch.linspace(0, 0.4, n)
    poses = torch.eye(4).repeat(n, 1, 1)
    poses[:, 0, 0], poses[:, 0, 2], poses[:, 2, 0], poses[:, 2, 2] = ang.cos(), ang.sin(), -ang.sin(), ang.cos()
    poses[:, 0, 3] = torch.linspace(0, 1.5, n)
    K = torch.tensor([[0.9 * w, 0, w / 2], [0, 0.9 * w, h / 2], [0, 0, 1.0]]).repeat(n, 1, 1)
    depths = 1 + 3 * torch.rand(n, h, w)
    depths[:, : h // 3] = 0  # unknown
    return dict(intrinsics=K, poses=poses, depths=depths)


@pytest.fixture(scope="module")
def images():
    torch.manual_seed(1)
    return torch.rand(N, 3, H, W)


# ----------------------------------------------------------------------------- layout
def test_full_config_matches_official_state_dict_on_meta():
    ref, total = read_tsv(TSV)
    with torch.device("meta"):
        model = Pi3X()
    sd = model.state_dict()
    assert all(t.is_meta for t in sd.values())
    assert len(ref) == len(sd) == 1873
    assert dict(ref) == {k: tuple(v.shape) for k, v in sd.items()}
    assert sum(v.numel() for v in sd.values()) == total == PI3X_VALUES
    res = strict_meta_load(model, ref)
    assert not res.missing_keys and not res.unexpected_keys
    with torch.device("meta"):
        image_only = Pi3X(use_multimodal=False)
    assert strict_meta_load(image_only, [(k, s) for k, s in ref if not k.startswith(MULTIMODAL_PREFIXES)])


# ----------------------------------------------------------------------------- forward
def test_forward_shapes_with_and_without_conditions(tiny, images):
    with torch.no_grad():
        plain = tiny(images)
        cond = tiny(images, **conditions())
    expect = {"points": (1, N, H, W, 3), "local_points": (1, N, H, W, 3), "rays": (1, N, H, W, 3),
              "conf": (1, N, H, W, 1), "camera_poses": (1, N, 4, 4), "metric": (1,)}
    for out in (plain, cond):
        assert set(out) == set(expect)
        for k, shape in expect.items():
            assert tuple(out[k].shape) == shape and torch.isfinite(out[k]).all(), k
        assert (out["metric"] > 0).all() and (out["local_points"][..., 2] > 0).all()
        assert torch.allclose(out["rays"].norm(dim=-1), torch.ones(1, N, H, W), atol=1e-5)
        R = out["camera_poses"][..., :3, :3]
        assert torch.allclose(R.transpose(-1, -2) @ R, torch.eye(3).expand_as(R), atol=1e-5)
    for k in KEYS:  # every condition reaches the outputs
        assert not torch.allclose(plain[k], cond[k]), k


@pytest.mark.parametrize("which", ["intrinsics", "poses", "depths"])
def test_each_condition_alone_changes_the_output(tiny, images, which):
    with torch.no_grad():
        plain = tiny(images)
        one = tiny(images, **{which: conditions()[which]})
    assert not torch.allclose(plain["points"], one["points"])


def test_no_condition_equals_image_only_model(tiny, images):
    """Without conditions (or with_prior=False) the condition branch is skipped: the output equals the
    image-only model's (the official disable_multimodal()) bit for bit."""
    image_only = copy.deepcopy(tiny).disable_multimodal()
    assert not any(n.startswith(MULTIMODAL_PREFIXES) for n in image_only.state_dict())
    with torch.no_grad():
        ref = image_only(images)
        for got in (tiny(images), tiny(images, **conditions(), with_prior=False)):
            for k in KEYS:
                assert torch.equal(got[k], ref[k]), k
    with pytest.raises(ValueError, match="use_multimodal=False"):
        image_only(images, depths=conditions()["depths"])


def test_masks(tiny, images):
    c = conditions()
    every = torch.ones(1, N, dtype=torch.bool)
    with torch.no_grad():
        ref = tiny(images, **c)
        got = tiny(images, **c, mask_add_depth=every, mask_add_ray=every, mask_add_pose=every)
        plain = tiny(images)
        none = tiny(images, **c, mask_add_depth=~every, mask_add_ray=~every, mask_add_pose=~every)
        one_pose = tiny(images, poses=c["poses"], mask_add_pose=torch.tensor([True, False, False]))
        two_poses = tiny(images, poses=c["poses"], mask_add_pose=torch.tensor([True, False, True]))
    outputs_close(got, ref, 0.0, KEYS)
    outputs_close(none, plain, 0.0, KEYS)
    outputs_close(one_pose, plain, 0.0, KEYS)  # a single posed frame carries no relative pose: ignored
    assert not torch.allclose(two_poses["points"], plain["points"])


def test_partial_pose_mask_keeps_unposed_frames_out(tiny, images):
    """Pose injection attends among the posed frames only: an unposed frame's pose value is never read."""
    c = conditions(4)
    x = torch.cat([images, images[:1].flip(-1)])
    mask = torch.tensor([True, True, False, True])
    other = c["poses"].clone()
    other[2] = torch.eye(4)
    with torch.no_grad():
        a = tiny(x, poses=c["poses"], mask_add_pose=mask, depths=c["depths"])
        b = tiny(x, poses=other, mask_add_pose=mask, depths=c["depths"])
    outputs_close(a, b, 1e-6, KEYS)


def test_batched_conditions_equal_per_scene(tiny, images):
    c = conditions()
    c2 = {k: torch.stack([v.flip(0), v]) for k, v in c.items()}
    c2["poses"][0] = c["poses"]  # any rigid poses
    x = torch.stack([images.flip(0), images])
    with torch.no_grad():
        both = tiny(x, **c2)
        one = tiny(images, **c)
    outputs_close({k: v[1:] for k, v in both.items()}, one, 1e-5, KEYS)


def test_rays_equal_intrinsics(tiny, images):
    """Ray directions (any length, z > 0) condition the model exactly as the intrinsics they come from."""
    K = conditions()["intrinsics"]
    v, u = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    pix = torch.stack([u, v, torch.ones_like(u)], dim=-1)
    rays = torch.einsum("nij,hwj->nhwi", torch.linalg.inv(K), pix) * 2.5
    with torch.no_grad():
        a, b = tiny(images, intrinsics=K), tiny(images, rays=rays)
    outputs_close(a, b, 1e-5, KEYS)


@pytest.mark.parametrize("kwargs,match", [
    (dict(intrinsics=torch.eye(3).repeat(2, 1, 1)), r"intrinsics must be \[B, N, 3, 3\]"),
    (dict(intrinsics="normalised"), "intrinsics look normalised"),
    (dict(intrinsics="negative"), "positive focal"),
    (dict(poses=torch.eye(4).repeat(N, 1, 1) * 2), "rigid"),
    (dict(poses=torch.eye(3).repeat(N, 1, 1)), r"poses must be \[B, N, 4, 4\]"),
    (dict(depths=-torch.ones(N, H, W)), "depths must be >= 0"),
    (dict(depths=torch.full((N, H, W), float("nan"))), "use 0 for unknown"),
    (dict(depths=torch.ones(N, H, W + 14)), r"depths must be \[B, N, 42, 56\]"),
    (dict(depths=torch.ones(N, H, W, dtype=torch.int64)), "float"),
    (dict(rays=-torch.ones(N, H, W, 3)), "z > 0"),
    (dict(intrinsics="ok", rays=torch.ones(N, H, W, 3)), "not both"),
    (dict(mask_add_pose=torch.ones(1, N, dtype=torch.bool)), "without its condition"),
    (dict(depths=torch.ones(N, H, W), mask_add_depth=torch.ones(1, N)), r"bool tensor \[B, N\]"),
])
def test_condition_errors_name_the_argument(tiny, images, kwargs, match):
    K = conditions()["intrinsics"]
    presets = {"normalised": K / torch.tensor([W, H, 1.0])[:, None],
               "negative": K * torch.tensor([-1, 1, 1.0])[:, None], "ok": K}
    kwargs = {k: presets[v] if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        tiny(images, **kwargs)


def test_permutation_equivariance_without_conditions(tiny, images):
    perm = torch.tensor([2, 0, 1])
    with torch.no_grad():
        a, b = tiny(images), tiny(images[perm])
    outputs_close({k: (v if k == "metric" else v[:, perm]) for k, v in a.items()}, b, 1e-5, KEYS)


# ----------------------------------------------------------------------------- attention modes
def test_every_attention_goes_through_visionattn(tiny, images, monkeypatch):
    import visionattn.models.layers as layers

    seen = []

    def spy(q, k, v, mode):
        seen.append(mode)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    monkeypatch.setattr(layers, "_va_attention", spy)
    tiny.set_attn_mode("bf16")
    try:
        with torch.no_grad():
            tiny(images, **conditions())
    finally:
        tiny.set_attn_mode("auto")
    # image + depth DINOv2 (2 + 2), decoder (4), pose injection (2), point / camera / conf decoders (3), metric (1)
    assert seen == ["bf16"] * (4 + 4 + 2 + 3 + 1)


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_modes_vs_float64_oracle(tiny, images, mode):
    """As for π³: FP32-class modes within 2x the FP32 SDPA error, reduced-precision attention within the bf16
    autocast run's error, against the float64 model, with every condition on."""
    c = conditions()
    ref64 = copy.deepcopy(tiny).double().set_attn_mode(None)
    with torch.no_grad():
        ref = ref64(images.double(), **{k: v.double() for k, v in c.items()})
        tiny.set_attn_mode(None)
        base = tiny(images, **c)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = tiny(images, **c)
        tiny.set_attn_mode(mode)
        out = tiny(images, **c)
    tiny.set_attn_mode("auto")
    for k in KEYS:
        e = rel_l2(out[k], ref[k])
        bound = 2 * rel_l2(base[k], ref[k]) + 1e-6 if mode == "fp32" else rel_l2(half[k], ref[k])
        assert e <= bound, (k, e, bound)


# ----------------------------------------------------------------------------- checkpoints
def test_save_load_and_image_only_load(tiny, images, tmp_path):
    path = tiny.save_pretrained(tmp_path / "ckpt")
    c = conditions()
    with torch.no_grad():
        ref, ref_plain = tiny(images, **c), tiny(images)
        outputs_close(Pi3X.from_pretrained(path)(images, **c), ref, 0.0, KEYS)
        light = Pi3X.from_pretrained(path, use_multimodal=False)  # the condition keys of a full checkpoint dropped
        assert not light.use_multimodal and not hasattr(light, "depth_encoder")
        outputs_close(light(images), ref_plain, 0.0, KEYS)
