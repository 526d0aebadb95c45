"""--ba: tracks of VGGT's track head, filtered into observations, bundle-adjusted by pycolmap. These test our wiring
(pixel maps, filters, the model handed to pycolmap and read back), not pycolmap's solver."""
import json
import os
import sys

import numpy as np
import pytest

from testdata import MULTIVIEW, load_script

pycolmap = pytest.importorskip("pycolmap", reason="pycolmap not installed: pip install -e '.[recon]'")

from visionattn.recon.ba import (  # noqa: E402
    build_reconstruction, bundle_adjust, query_plan, reconstruction_cameras, track_observations)
from visionattn.recon.cameras import continuous_affine  # noqa: E402

demo = load_script("demos/reconstruct.py", "reconstruct_demo_ba")


def _rot_y(deg):
    a = np.radians(deg)
    return np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])


def _scene(S=5, P=300, seed=0):
    """Cameras 0.3 apart on a line, turned a few degrees, looking at points 4-6 units ahead; K of a 320x240 frame."""
    rng = np.random.default_rng(seed)
    K = np.array([[300.0, 0, 160], [0, 300.0, 120], [0, 0, 1]])
    E = np.stack([np.hstack([_rot_y(3 * (j - 2)), (-_rot_y(3 * (j - 2)) @ [0.3 * (j - 2), 0, 0])[:, None]])
                  for j in range(S)])
    X = rng.uniform([-1, -1, 4], [1, 1, 6], (P, 3))
    return rng, K, E, X


def _project(K, E, X):
    cam = np.einsum("sij,pj->spi", E[:, :, :3], X) + E[:, None, :, 3]
    return np.einsum("ij,spj->spi", K, cam / cam[..., 2:])[..., :2]  # [S, P, 2]


def test_bundle_adjustment_lowers_the_error_of_noisy_cameras_and_points():
    """Known cameras; observations = true projections + 0.3 px noise, given in the model's frame of half the
    source resolution; initial cameras and points perturbed. The model pycolmap gets is in source pixels and its
    error before BA is the one numpy computes from our arrays; BA lowers it to the noise and moves the cameras
    toward the truth, the first camera fixed."""
    rng, K, E, X = _scene()
    S, P = len(E), len(X)
    affine = (0.5, 0.5, -0.25, -0.25)  # source pixel centre (x, y) -> model pixel 0.5 x - 0.25: a 2x downscale
    obs = _project(K, E, X) + rng.normal(0, 0.3, (S, P, 2))  # model pixels
    E0 = E.copy()
    for j in range(1, S):
        angle = rng.normal(0, 0.01, 3)
        E0[j, :, :3] = _rot_y(np.degrees(angle[1])) @ E[j, :, :3]
        E0[j, :, 3] += rng.normal(0, 0.03, 3)
    X0 = X + rng.normal(0, 0.05, X.shape)
    rec = build_reconstruction([f"{j}.png" for j in range(S)], E0, [K] * S, [affine] * S, [(640, 480)] * S, X0,
                               rng.uniform(size=(P, 3)), np.tile(np.arange(P), S), np.repeat(np.arange(S), P),
                               obs.reshape(-1, 2))
    assert rec.num_images() == S and rec.num_points3D() == P and rec.compute_num_observations() == S * P
    A_inv = np.linalg.inv(continuous_affine(affine))
    K_src = A_inv @ K
    for j in range(S):
        cam = rec.cameras[rec.images[j + 1].camera_id]
        assert (cam.width, cam.height) == (640, 480)
        np.testing.assert_allclose(cam.calibration_matrix(), K_src, atol=1e-9)
        src = (A_inv @ np.concatenate([obs[j], np.ones((P, 1))], 1).T).T[:, :2]
        np.testing.assert_allclose([p.xy for p in rec.images[j + 1].points2D], src, atol=1e-9)
    expected = np.linalg.norm(_project(K_src, E0, X0) - (A_inv[:2, :2] @ obs[..., None])[..., 0] - A_inv[:2, 2],
                              axis=-1).mean()
    rec, info = bundle_adjust(rec, quiet=True)
    assert info["reprojection_error_before"] == pytest.approx(expected, rel=1e-6)
    # 0.3 px of noise in the model's frame is 0.6 px in the source: a mean error of 0.6 * sqrt(pi / 2) = 0.75 px
    assert info["reprojection_error_before"] > 5.0 and info["reprojection_error_after"] < 0.8
    assert not info["reverted"]
    E1, K1 = reconstruction_cameras(rec)
    np.testing.assert_allclose(E1[0], E0[0], atol=1e-12)  # the gauge: camera 0 stays

    def centres(E):
        return np.einsum("sji,sj->si", E[:, :, :3], -E[:, :, 3])
    assert np.linalg.norm(centres(E1) - centres(E), axis=1).sum() < np.linalg.norm(centres(E0) - centres(E),
                                                                                     axis=1).sum()
    np.testing.assert_allclose(K1[:, :2, 2], np.tile(K_src[:2, 2], (S, 1)))  # principal points stay


def test_track_filters():
    """One query frame, three frames, four tracks on exact projections: each threshold drops what it should."""
    _, K, E, X = _scene(S=3, P=4)
    H, W = 240, 320
    uv = _project(K, E, X)  # [S, P, 2]
    q_pix = np.rint(uv[0])  # the query pixels of frame 0
    cam0 = np.concatenate([q_pix, np.ones((4, 1))], 1) @ np.linalg.inv(K).T * 5.0  # on their rays, 5 units deep
    pts = (cam0 - E[0, :, 3]) @ E[0, :, :3]  # world = R^T (cam - t)
    world = np.full((3, H, W, 3), np.nan)
    world[0, q_pix[:, 1].astype(int), q_pix[:, 0].astype(int)] = pts
    conf = np.ones((3, H, W))
    tracks = _project(K, E, pts)[None]  # [1, S, N, 2] exact projections of the query points
    vis = np.full((1, 3, 4), 0.9)
    cf = np.full((1, 3, 4), 0.9)
    vis[0, 1, 0] = 0.1  # track 0: not visible in frame 1
    cf[0, 2, 0] = 0.1  # ... nor confident in frame 2: only its query frame is left, the track goes
    tracks[0, 1, 1] += [9.0, 0.0]  # track 1: 9 px off in frame 1 (> 8 px)
    conf[0, int(q_pix[2, 1]), int(q_pix[2, 0])] = 0.5  # track 2: its depth is not confident enough
    got = track_observations(tracks, vis, cf, [0], q_pix[None], world, conf, np.zeros((3, H, W, 3)), E,
                             np.stack([K] * 3), conf_threshold=0.8)
    assert len(got["xyz"]) == 2  # tracks 1 and 3
    np.testing.assert_allclose(got["xyz"], pts[[1, 3]])
    assert got["obs_image"].tolist() == [0, 0, 1, 2, 2]  # by image, then point
    assert got["obs_point"].tolist() == [0, 1, 1, 0, 1]
    np.testing.assert_allclose(got["obs_xy"][:2], q_pix[[1, 3]])  # the query pixels themselves in frame 0


def test_query_plan_spreads_frames_and_pixels():
    frames, pts = query_plan(20, (28, 42), query_frames=4, points_per_frame=100, seed=0)
    assert frames.tolist() == [0, 6, 13, 19] and pts.shape == (4, 100, 2)
    assert (pts >= 0).all() and (pts[..., 0] < 42).all() and (pts[..., 1] < 28).all() and (pts == np.rint(pts)).all()
    assert all(len({tuple(p) for p in f.tolist()}) == 100 for f in pts)  # distinct pixels per frame
    assert query_plan(1, (28, 42), 8, 10_000)[1].shape == (1, 28 * 42, 2)  # at most every pixel


def test_demo_ba_on_bundled_images_writes_a_refined_model(tmp_path, capfd):
    """Random tiny model on the bundled stereo rig: tracks -> BA -> sparse/0 that pycolmap reads, with the errors
    in summary.json (--ba-max-error 100: random weights track nothing within 8 px). --quiet prints one line."""
    out = tmp_path / "out"
    res = demo.main([os.path.join(MULTIVIEW, "stereo_rig"), "--out", str(out), "--weights", "random-tiny",
                     "--device", "cpu", "--size", "126", "--no-preview", "--quiet", "--ba", "--ba-points", "64",
                     "--ba-max-error", "100", "--colmap-text"])
    assert res["exit_code"] == 0
    captured = capfd.readouterr()
    assert captured.err == "" and len(captured.out.strip().splitlines()) == 1 and "BA reprojection" in captured.out
    ba = json.load(open(out / "summary.json"))["bundle_adjustment"]
    assert ba["query_frames"] == [0, 1, 2, 3, 4, 5] and ba["points_per_frame"] == 64
    assert ba["thresholds"]["vis"] == ba["thresholds"]["conf"] == 0.2
    assert ba["thresholds"]["max_reprojection_error_px"] == 100
    rec = pycolmap.Reconstruction(str(out / "sparse" / "0"))
    assert rec.num_images() == 6 and rec.num_points3D() == ba["points"] == ba["tracks"] > 0
    assert rec.compute_num_observations() == ba["observations"] >= 2 * ba["tracks"]
    assert (out / "sparse" / "0" / "points3D.txt").is_file()
    assert not ba["reverted"] and ba["reprojection_error_after"] < ba["reprojection_error_before"]
    rec.update_point_3d_errors()
    assert rec.compute_mean_reprojection_error() == pytest.approx(ba["reprojection_error_after"], rel=1e-6)
    cams = json.load(open(out / "cameras.json"))["frames"]
    assert sorted(im.name for im in rec.images.values()) == sorted(f["image"][len("images/"):] for f in cams)
    for im in rec.images.values():  # source-image cameras
        cam = rec.cameras[im.camera_id]
        assert (cam.width, cam.height) == (640, 480)
    assert res["seconds"]["tracks"] > 0 and res["seconds"]["bundle_adjustment"] > 0


@pytest.mark.parametrize("flag", ["--ba", "--colmap-text"])
def test_without_pycolmap_fails_before_any_work(flag, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pycolmap", None)  # import pycolmap raises ImportError
    res = demo.main([os.path.join(MULTIVIEW, "aloe"), "--out", str(tmp_path / "out"), "--weights", "random-tiny",
                     "--device", "cpu", "--quiet", flag])
    err = capsys.readouterr().err
    assert res["exit_code"] == 2 and "pip install pycolmap" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []


def test_without_trimesh_fails_before_any_work(tmp_path, capsys, monkeypatch):
    """points.ply and scene.glb need trimesh: its absence stops the demo before any decoding (checked without
    importing it; the writers import it when they run)."""
    monkeypatch.setitem(sys.modules, "trimesh", None)  # an import of trimesh raises ImportError
    res = demo.main([os.path.join(MULTIVIEW, "aloe"), "--out", str(tmp_path / "out"), "--weights", "random-tiny",
                     "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err
    assert res["exit_code"] == 2 and "pip install trimesh" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []


def test_the_demo_does_not_import_trimesh_before_the_export():
    """The check before any work finds trimesh without importing it (a second or two of the setup)."""
    import subprocess

    code = ("import sys; from visionattn.recon.points import check_trimesh; check_trimesh(); "
            "print('trimesh' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
