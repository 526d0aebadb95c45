"""demos/reconstruct.py with --model pi3 / pi3x (tiny random models, CPU): the conversion of π³'s reference-free
cameras and local points into the outputs' conventions, every output file, and Pi3X's known cameras read from a
COLMAP model or a transforms.json."""
import json
import os

import numpy as np
import pytest
import torch

from testdata import MULTIVIEW, load_script, nearest_distances, read_ply_points
from visionattn.models.geometry import unproject_depth_map_to_point_map
from visionattn.recon.colmap import write_colmap_model
from visionattn.recon.images import load_images
from visionattn.recon.nerfstudio import write_transforms_json
from visionattn.recon.pi3 import decode_pi3, fit_focal, rigid_inverse
from visionattn.recon.priors import CameraFileError, match_cameras, read_camera_file

SIZE = 140  # 140 x 105 -> 140 x 98 frames of the 640 x 480 stereo rig
TINY = ["--weights", "random-tiny", "--device", "cpu", "--size", str(SIZE), "--quiet"]
RIG = os.path.join(MULTIVIEW, "stereo_rig")
RIG_NAMES = ["left01", "left02", "left03", "right01", "right02", "right03"]

demo = load_script("demos/reconstruct.py", "reconstruct_demo_pi3")


def _rotation(rng) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def _rigid(rng, scale=1.0) -> np.ndarray:
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = _rotation(rng), rng.normal(size=3) * scale
    return T


def _pinhole_points(K, depth):
    """Camera-frame points [S, H, W, 3] of depth [S, H, W] through K [S, 3, 3] on the integer pixel grid."""
    S, H, W = depth.shape
    v, u = np.mgrid[0:H, 0:W]
    pix = np.stack([u, v, np.ones_like(u)], -1).astype(np.float64)
    rays = np.einsum("sij,hwj->shwi", np.linalg.inv(K), pix)
    return rays * depth[..., None]


def test_fit_focal_recovers_the_pinhole():
    rng = np.random.default_rng(0)
    S, H, W = 3, 14, 28
    K = np.stack([[[f, 0, W / 2], [0, f * 1.1, H / 2], [0, 0, 1]] for f in (20.0, 35.0, 60.0)])
    depth = rng.uniform(1, 5, size=(S, H, W))
    pts = torch.from_numpy(_pinhole_points(K, depth))
    np.testing.assert_allclose(fit_focal(pts).numpy(), K, rtol=1e-10)
    # outliers with zero weight, non-finite points and points behind the camera do not move the fit
    bad = pts.clone()
    bad[:, :3] = torch.randn(S, 3, W, 3) * 100
    bad[:, 5, 5] = float("nan")
    bad[:, 6, 6, 2] = -1.0
    w = torch.ones(S, H, W, dtype=torch.float64)
    w[:, :3] = 0
    np.testing.assert_allclose(fit_focal(bad, w).numpy(), K, rtol=1e-10)


def test_decode_pi3_puts_the_world_in_the_first_camera():
    """Synthetic π³ output (random rigid camera-to-world poses in an arbitrary world, local points of a pinhole):
    frame 0 becomes [I|0], extrinsic i = T_i^-1 T_0, world points T_0^-1 X, depth = local z, and the depth
    unprojected with the decoded cameras lands on the decoded world points."""
    rng = np.random.default_rng(1)
    S, H, W = 3, 14, 21
    T = np.stack([_rigid(rng, 3.0) for _ in range(S)])
    K = np.array([[[25.0, 0, W / 2], [0, 27.0, H / 2], [0, 0, 1]]] * S)
    depth = rng.uniform(1, 4, size=(S, H, W))
    local = _pinhole_points(K, depth)
    world = np.einsum("sij,shwj->shwi", T[:, :3, :3], local) + T[:, None, None, :3, 3]
    logits = rng.normal(size=(S, H, W, 1))
    out = {"camera_poses": torch.tensor(T[None], dtype=torch.float32),
           "local_points": torch.tensor(local[None], dtype=torch.float32),
           "points": torch.tensor(world[None], dtype=torch.float32),
           "conf": torch.tensor(logits[None], dtype=torch.float32)}
    extr, intr, pixels = decode_pi3(out)
    extr, intr = extr.numpy(), intr.numpy()
    np.testing.assert_allclose(extr[0], np.eye(4)[:3], atol=1e-6)
    for i in range(S):
        np.testing.assert_allclose(extr[i], (np.linalg.inv(T[i]) @ T[0])[:3], atol=1e-5)
    np.testing.assert_allclose(intr, K, rtol=1e-4)
    maps = pixels(slice(0, S))
    expect = np.einsum("ij,shwj->shwi", np.linalg.inv(T[0])[:3, :3], world) + np.linalg.inv(T[0])[:3, 3]
    np.testing.assert_allclose(maps["world_points"].numpy(), expect, atol=1e-4)
    np.testing.assert_allclose(maps["depth"].numpy(), depth, rtol=1e-6)
    np.testing.assert_allclose(maps["depth_conf"].numpy(), 1 / (1 + np.exp(-logits[..., 0])), rtol=1e-5)
    from_depth = unproject_depth_map_to_point_map(maps["depth"].double(), torch.from_numpy(extr),
                                                  torch.from_numpy(intr))
    np.testing.assert_allclose(from_depth.numpy(), expect, atol=1e-4)
    # given intrinsics are returned as they are
    _, given, _ = decode_pi3(out, torch.from_numpy(K * 1.5))
    np.testing.assert_array_equal(given.numpy(), K * 1.5)
    np.testing.assert_allclose(rigid_inverse(torch.from_numpy(T)).numpy(), np.linalg.inv(T), atol=1e-12)


@pytest.fixture(scope="module")
def pi3_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pi3") / "recon"
    summary = demo.main([RIG, "--out", str(out), "--model", "pi3", *TINY])
    return summary, out


def test_pi3_demo_writes_every_output(pi3_run):
    summary, out = pi3_run
    assert summary["exit_code"] == 0 and summary["frames"] == 6
    assert summary["model"] == "pi3" and summary["weights"] == "random-tiny" and summary["conditions"] == {}
    H, W = summary["image_hw"]
    assert W == SIZE and H % 14 == 0
    assert summary["tokens"] == 6 * (5 + (H // 14) * (W // 14))  # π³: 5 register tokens per frame
    for sub in ["points.ply", "cameras.json", "preview.png", "summary.json", "transforms.json", "scene.glb",
                "sparse/0/cameras.bin", "sparse/0/images.bin", "sparse/0/points3D.bin"] + \
            [f"depth/{n}.png" for n in RIG_NAMES] + [f"images/{n}.jpg" for n in RIG_NAMES] + \
            [f"depth/{n}.npy" for n in RIG_NAMES] + [f"confidence/{n}.npy" for n in RIG_NAMES]:
        assert (out / sub).is_file(), sub
    cams = json.load(open(out / "cameras.json"))
    assert cams["model"] == "pi3" and [f["name"] for f in cams["frames"]] == RIG_NAMES
    np.testing.assert_allclose(cams["frames"][0]["extrinsic"], np.eye(4)[:3], atol=1e-6)  # world = first camera
    for f in cams["frames"]:
        R = np.array(f["extrinsic"])[:, :3]
        np.testing.assert_allclose(R @ R.T, np.eye(3), atol=1e-5)
        c = np.load(out / "confidence" / f"{f['name']}.npy")
        assert c.min() > 0 and c.max() < 1  # sigmoid of the logits
    # kept points: the saved depth unprojected with the saved cameras (as for VGGT)
    xyz, _ = read_ply_points(out / "points.ply")
    assert len(xyz) == summary["points_kept"] > 0
    all_pts = []
    for f in cams["frames"]:
        d = np.load(out / "depth" / f"{f['name']}.npy")
        assert d.shape == (H, W) and d.min() > 0
        K, E = np.array(f["intrinsic"]), np.array(f["extrinsic"])
        v, u = np.mgrid[0:H, 0:W]
        cam = np.stack([u, v, np.ones_like(u)], -1).reshape(-1, 3) @ np.linalg.inv(K).T * d.reshape(-1, 1)
        all_pts.append((cam - E[:, 3]) @ E[:, :3])
    all_pts = np.concatenate(all_pts)
    assert nearest_distances(xyz, all_pts).max() < 1e-4 * np.abs(all_pts).max()
    # transforms.json: OpenGL camera-to-world of the same cameras
    tf = json.load(open(out / "transforms.json"))
    E1 = np.vstack([cams["frames"][1]["extrinsic"], [0, 0, 0, 1]])
    np.testing.assert_allclose(np.array(tf["frames"][1]["transform_matrix"]),
                               np.linalg.inv(E1) @ np.diag([1.0, -1, -1, 1]), atol=1e-6)


def test_pi3_colmap_model_matches_cameras_json(pi3_run):
    pycolmap = pytest.importorskip("pycolmap", reason="pycolmap not installed: pip install -e '.[recon]'")
    _, out = pi3_run
    cams = json.load(open(out / "cameras.json"))["frames"]
    rec = pycolmap.Reconstruction(str(out / "sparse" / "0"))
    assert rec.num_images() == 6 and rec.num_points3D() > 0
    for image_id, im in rec.images.items():
        f = cams[image_id - 1]
        np.testing.assert_allclose(im.cam_from_world().matrix(), f["extrinsic"], atol=1e-6)
        np.testing.assert_allclose(rec.cameras[im.camera_id].calibration_matrix(), f["intrinsic_original"],
                                   rtol=1e-9)


def _camera_files(folder, names, size=(640, 480), scale=1.0, seed=2):
    """Known cameras for ``names``: a COLMAP model (sparse/0, for a ``scale``-times image) and a transforms.json
    (source size); returns (K_src [S, 3, 3] of the source size, camera-to-world OpenCV [S, 4, 4])."""
    rng = np.random.default_rng(seed)
    S = len(names)
    K = np.stack([[[500.0 + 10 * i, 0, 321.0], [0, 520.0, 239.0], [0, 0, 1]] for i in range(S)])
    c2w = np.stack([_rigid(rng, 2.0) for _ in range(S)])
    extr = np.linalg.inv(c2w)[:, :3]
    files = [f"{n}.jpg" for n in names]
    sized = [(int(size[0] * scale), int(size[1] * scale))] * S
    write_colmap_model(str(folder / "sparse" / "0"), files, extr, K * np.array([scale, scale, 1])[:, None], sized,
                       np.zeros((0, 3)), np.zeros((0, 3)), [np.zeros(0, bool)] * S)
    write_transforms_json(str(folder / "transforms.json"), [f"images/{f}" for f in files], files, extr, K,
                          [size] * S, 1.0)
    return K, c2w


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_match_cameras_rescales_to_the_model_frame(tmp_path, scale):
    """Both file kinds give the same conditions: K of the source image mapped into the model's frame (here a
    resize by 140/640), and the camera-to-world poses in OpenCV axes (transforms.json's OpenGL ones turned)."""
    pytest.importorskip("pycolmap", reason="pycolmap not installed: pip install -e '.[recon]'")
    loaded = load_images(RIG, size=SIZE, progress=False)
    K, c2w = _camera_files(tmp_path, loaded.names, scale=scale)
    H, W = loaded.shape_hw
    K_model = np.diag([W / 640, H / 480, 1.0]) @ K  # continuous pixels: a pure resize (no crop) scales K
    for intr, poses in ((tmp_path / "sparse" / "0", tmp_path / "transforms.json"),
                        (tmp_path / "transforms.json", tmp_path / "sparse" / "0")):
        cond = match_cameras(loaded, str(intr), str(poses))
        np.testing.assert_allclose(cond["intrinsics"], K_model, rtol=1e-9)
        np.testing.assert_allclose(cond["poses"], c2w, atol=1e-9)


def test_nerf_camera_angle_and_stem_matching(tmp_path):
    """The original NeRF layout: one camera_angle_x, file paths without extension, no image size."""
    loaded = load_images(RIG, size=SIZE, progress=False)
    rng = np.random.default_rng(3)
    gl = [_rigid(rng) for _ in loaded.names]
    doc = {"camera_angle_x": 0.9, "frames": [{"file_path": f"./train/{n}", "transform_matrix": m.tolist()}
                                             for n, m in zip(loaded.names, gl)]}
    (tmp_path / "transforms.json").write_text(json.dumps(doc))
    cond = match_cameras(loaded, str(tmp_path / "transforms.json"), str(tmp_path / "transforms.json"))
    f_src = 0.5 * 640 / np.tan(0.45)
    H, W = loaded.shape_hw
    np.testing.assert_allclose(cond["intrinsics"][:, 0, 0], f_src * W / 640, rtol=1e-9)
    np.testing.assert_allclose(cond["intrinsics"][:, 1, 1], f_src * H / 480, rtol=1e-9)
    np.testing.assert_allclose(cond["intrinsics"][:, :2, 2], [[W / 2, H / 2]] * 6, rtol=1e-9)
    np.testing.assert_allclose(cond["poses"], np.stack(gl) @ np.diag([1.0, -1, -1, 1]), atol=1e-12)


def test_camera_file_errors(tmp_path):
    loaded = load_images(RIG, size=SIZE, progress=False)
    with pytest.raises(CameraFileError, match="no such file"):
        read_camera_file(str(tmp_path / "nope.json"))
    with pytest.raises(CameraFileError, match="cameras.bin"):
        read_camera_file(str(tmp_path))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CameraFileError, match="JSON"):
        read_camera_file(str(tmp_path / "bad.json"))
    (tmp_path / "nof.json").write_text(json.dumps({"frames": []}))
    with pytest.raises(CameraFileError, match="'frames'"):
        read_camera_file(str(tmp_path / "nof.json"))
    (tmp_path / "nan.json").write_text(json.dumps({"frames": [{"file_path": "a.jpg", "transform_matrix":
                                                               [[float("nan")] * 4] * 4}]}))
    with pytest.raises(CameraFileError, match="NaN"):
        read_camera_file(str(tmp_path / "nan.json"))
    # a frame with no entry: the error names it and a few of the file's names
    _camera_files(tmp_path, loaded.names[:4])
    with pytest.raises(CameraFileError, match=r"2 of 6 frames \('right02.jpg', 'right03.jpg'\).*left01"):
        match_cameras(loaded, poses_file=str(tmp_path / "transforms.json"))
    # intrinsics for another aspect ratio
    doc = {"fl_x": 100.0, "w": 100, "h": 100, "frames": [{"file_path": f"{n}.jpg", "transform_matrix": np.eye(4)
                                                          .tolist()} for n in loaded.names]}
    (tmp_path / "square.json").write_text(json.dumps(doc))
    with pytest.raises(CameraFileError, match="100x100 image, the source is 640x480"):
        match_cameras(loaded, intrinsics_file=str(tmp_path / "square.json"))


def test_pi3x_demo_passes_the_known_cameras(tmp_path, monkeypatch):
    """--intrinsics sparse/0 --poses transforms.json reach Pi3X's forward as [1, N, 3, 3] model-frame pixels and
    [1, N, 4, 4] OpenCV camera-to-world; the given intrinsics are cameras.json's."""
    pytest.importorskip("pycolmap", reason="pycolmap not installed: pip install -e '.[recon]'")
    from visionattn.models import Pi3X

    K, c2w = _camera_files(tmp_path, RIG_NAMES)
    seen = []
    forward = Pi3X.forward

    def spy(self, images, **kw):
        seen.append(kw)
        return forward(self, images, **kw)

    monkeypatch.setattr(Pi3X, "forward", spy)
    out = tmp_path / "out"
    res = demo.main([RIG, "--out", str(out), "--model", "pi3x", "--intrinsics", str(tmp_path / "sparse" / "0"),
                     "--poses", str(tmp_path / "transforms.json"), *TINY])
    assert res["exit_code"] == 0 and res["conditions"] == {
        "intrinsics": str(tmp_path / "sparse" / "0"), "poses": str(tmp_path / "transforms.json")}
    kw = seen[-1]
    H, W = res["image_hw"]
    K_model = np.diag([W / 640, H / 480, 1.0]) @ K
    assert kw["intrinsics"].shape == (1, 6, 3, 3) and kw["poses"].shape == (1, 6, 4, 4)
    np.testing.assert_allclose(kw["intrinsics"][0].numpy(), K_model, rtol=1e-6)
    np.testing.assert_allclose(kw["poses"][0].numpy(), c2w, atol=1e-6)
    cams = json.load(open(out / "cameras.json"))["frames"]
    np.testing.assert_allclose([f["intrinsic"] for f in cams], K_model, rtol=1e-12)
    np.testing.assert_allclose([f["intrinsic_original"] for f in cams], K, rtol=1e-9)
    assert not any(f["intrinsic_fallback"] for f in cams)


@pytest.mark.parametrize("case", ["intrinsics_with_pi3", "ba_with_pi3", "missing_frames", "bad_file"])
def test_pi3_bad_arguments_exit_2_and_no_output(case, tmp_path, capsys):
    out = tmp_path / "out"
    args = {"intrinsics_with_pi3": ["--model", "pi3", "--intrinsics", str(tmp_path)],
            "ba_with_pi3": ["--model", "pi3", "--ba"],
            "missing_frames": ["--model", "pi3x", "--poses", str(tmp_path / "transforms.json")],
            "bad_file": ["--model", "pi3x", "--intrinsics", str(tmp_path / "bad.json")]}[case]
    _camera_files(tmp_path, RIG_NAMES[:5])
    (tmp_path / "bad.json").write_text("[1, 2")
    try:
        code = demo.main([RIG, "--out", str(out), *args, *TINY])["exit_code"]
    except SystemExit as exc:  # argparse errors exit 2 themselves
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0], err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    if case == "missing_frames":
        assert "right03.jpg" in err[0]

