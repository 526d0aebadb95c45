"""Reconstruction metrics against constructed cases with known answers."""
import os

import numpy as np
import pytest
from testdata import open3d_or_skip

from visionattn.recon import metrics as M


def rot(axis, deg):
    axis = np.asarray(axis, dtype=np.float64)
    axis = axis / np.linalg.norm(axis)
    K = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    a = np.radians(deg)
    return np.eye(3) + np.sin(a) * K + (1 - np.cos(a)) * K @ K


def random_rotation(rng):
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def look_extrinsics(centers, rng):
    """Cameras at `centers` with random orientations: [S, 3, 4] camera-from-world."""
    Es = []
    for c in centers:
        R = random_rotation(rng)
        Es.append(np.concatenate([R, (-R @ c)[:, None]], 1))
    return np.stack(Es)


def test_rotation_angle_known():
    R = rot([1, 2, 3], 37.0)
    assert M.rotation_angle_deg(np.eye(3), R) == pytest.approx(37.0, abs=1e-9)
    assert M.rotation_angle_deg(R, R) == pytest.approx(0.0, abs=1e-5)


def test_rotation_perturbation_of_one_camera():
    """Rotating camera k about its own centre by theta: pairs with k have rot err theta, others 0."""
    rng = np.random.default_rng(0)
    gt = look_extrinsics(rng.normal(size=(5, 3)) * 3, rng)
    pred = gt.copy()
    k, theta = 2, 11.0
    Q = rot([0.3, -1, 0.5], theta)
    pred[k] = Q @ gt[k]  # R -> Q R, t -> Q t: same centre, rotated camera
    r_err, _ = M.relative_pose_errors(pred, gt)
    i, j = M.pair_indices(5)
    involved = (i == k) | (j == k)
    np.testing.assert_allclose(r_err[involved], theta, atol=1e-6)
    np.testing.assert_allclose(r_err[~involved], 0.0, atol=1e-5)
    assert r_err.size == 10


def test_translation_direction_error_known_and_auc():
    """Camera 1 moved so the 0->1 baseline turns by phi; camera 2 by psi (fixed orientations)."""
    rng = np.random.default_rng(1)
    R = [random_rotation(rng) for _ in range(3)]
    c_gt = np.array([[0.0, 0, 0], [1, 0, 0], [0, 0, 1]])
    phi = 4.0
    c_pred = c_gt.copy()
    c_pred[1] = [np.cos(np.radians(phi)), np.sin(np.radians(phi)), 0]
    gt = np.stack([np.concatenate([R[s], (-R[s] @ c_gt[s])[:, None]], 1) for s in range(3)])
    pred = np.stack([np.concatenate([R[s], (-R[s] @ c_pred[s])[:, None]], 1) for s in range(3)])
    r_err, t_err = M.relative_pose_errors(pred, gt)
    np.testing.assert_allclose(r_err, 0, atol=1e-5)
    # pairs (0,1), (0,2), (1,2): baseline directions in world coordinates
    expected = []
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        u, v = c_gt[b] - c_gt[a], c_pred[b] - c_pred[a]
        ang = np.degrees(np.arccos(u @ v / np.linalg.norm(u) / np.linalg.norm(v)))
        expected.append(min(ang, 180 - ang))
    np.testing.assert_allclose(t_err, expected, atol=1e-6)
    assert t_err[0] == pytest.approx(phi, abs=1e-6)
    # AUC@T = mean over t=1..T of frac(err < t)
    err = np.maximum(r_err, t_err)
    for T in (30, 15, 5, 3):
        want = np.mean([np.mean(err < t) for t in range(1, T + 1)])
        assert M.pose_auc(r_err, t_err, T) == pytest.approx(want, abs=1e-12)
    # pair (0,1) err 4 deg: counts at thresholds 5 and up, not 3
    assert M.pose_auc([4.0], [0.0], 3) == 0.0
    assert M.pose_auc([4.0], [0.0], 5) == pytest.approx(1 / 5)
    assert M.pose_auc([0.0], [0.0], 30) == 1.0
    assert M.pose_auc([45.0], [0.0], 30) == 0.0


def test_pose_errors_invariant_to_similarity_of_prediction():
    rng = np.random.default_rng(2)
    gt = look_extrinsics(rng.normal(size=(6, 3)), rng)
    pred = M.transform_extrinsics(gt, 3.7, random_rotation(rng), rng.normal(size=3))
    m = M.pose_metrics(pred, gt)
    assert m["pairs"] == 15
    assert m["rot_err_mean_deg"] < 1e-5 and m["trans_err_mean_deg"] < 1e-5
    assert m["auc@3"] == pytest.approx(1.0) and m["auc@30"] == pytest.approx(1.0)


def test_umeyama_recovers_similarity():
    rng = np.random.default_rng(3)
    src = rng.normal(size=(200, 3))
    s, R, t = 2.5, random_rotation(rng), np.array([1.0, -2.0, 0.5])
    dst = M.apply_sim3(src, s, R, t)
    s2, R2, t2 = M.umeyama(src, dst)
    assert s2 == pytest.approx(s, rel=1e-10)
    np.testing.assert_allclose(R2, R, atol=1e-10)
    np.testing.assert_allclose(t2, t, atol=1e-10)
    # noisy: still close, and beats the identity by far
    noisy = dst + rng.normal(scale=1e-3, size=dst.shape)
    s3, R3, _ = M.umeyama(src, noisy)
    assert abs(s3 - s) < 1e-3 and M.rotation_angle_deg(R3, R) < 0.05
    with pytest.raises(ValueError):
        M.umeyama(src[:2], dst[:2])


def test_align_cameras_recovers_similarity_and_aligns_cloud():
    open3d_or_skip()  # the cloud metrics use open3d
    rng = np.random.default_rng(4)
    pred = look_extrinsics(rng.normal(size=(2, 3)), rng)  # two cameras are enough
    s, R, t = 0.3, random_rotation(rng), np.array([5.0, 0.0, -1.0])
    gt = M.transform_extrinsics(pred, s, R, t)
    s2, R2, t2 = M.align_cameras_sim3(pred, gt)
    assert s2 == pytest.approx(s, rel=1e-9)
    np.testing.assert_allclose(R2, R, atol=1e-9)
    np.testing.assert_allclose(t2, t, atol=1e-9)
    np.testing.assert_allclose(M.transform_extrinsics(pred, s2, R2, t2), gt, atol=1e-9)
    cloud = rng.normal(size=(500, 3))
    gt_cloud = M.apply_sim3(cloud, s, R, t)
    res = M.cloud_metrics(M.apply_sim3(cloud, s2, R2, t2), gt_cloud)
    assert res["chamfer"] < 1e-9


def test_chamfer_identical_and_shifted():
    open3d_or_skip()  # the cloud metrics use open3d
    g = np.stack(np.meshgrid(np.arange(10.0), np.arange(10.0), np.arange(10.0), indexing="ij"), -1).reshape(-1, 3)
    same = M.cloud_metrics(g, g)
    assert same["chamfer"] == 0.0 and same["accuracy"] == 0.0 and same["completeness"] == 0.0
    shift = np.array([0.0, 0.0, 0.1])  # smaller than half the grid spacing: NN is the shifted twin
    res = M.cloud_metrics(g + shift, g, threshold=0.05)
    assert res["accuracy"] == pytest.approx(0.1, abs=1e-9)
    assert res["completeness"] == pytest.approx(0.1, abs=1e-9)
    assert res["chamfer"] == pytest.approx(0.1, abs=1e-9)
    assert res["fscore"] == 0.0
    # a partial prediction is accurate but incomplete
    part = M.cloud_metrics(g[: len(g) // 2], g)
    assert part["accuracy"] == 0.0 and part["completeness"] > 0.5


def _pytorch3d_project(X, R, T, focal, pp, hw, fmt):
    """Project a world point the PyTorch3D way (row vectors, +X left, +Y up, NDC) to pixels (u right, v down)."""
    Xc = X @ R + T
    x_ndc = focal[0] * Xc[0] / Xc[2] + pp[0]
    y_ndc = focal[1] * Xc[1] / Xc[2] + pp[1]
    h, w = hw
    s = (min(h, w) / 2, min(h, w) / 2) if fmt == "ndc_isotropic" else (w / 2, h / 2)
    return np.array([w / 2 - x_ndc * s[0], h / 2 - y_ndc * s[1]])


@pytest.mark.parametrize("fmt", ["ndc_isotropic", "ndc_norm_image_bounds"])
def test_co3d_loader_converts_pytorch3d_cameras(tmp_path, fmt):
    import gzip
    import json

    from PIL import Image

    from visionattn.recon.datasets import load_scenes

    rng = np.random.default_rng(5)
    hw = (120, 160)
    anns = []
    for n in range(4):
        img = tmp_path / "apple" / "seq_1" / "images" / f"frame{n + 1:06d}.jpg"
        img.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (hw[1], hw[0]), (n * 40, 0, 0)).save(img)
        anns.append({"sequence_name": "seq_1", "frame_number": 4 - n,
                     "image": {"path": f"apple/seq_1/images/{img.name}", "size": list(hw)},
                     "viewpoint": {"R": random_rotation(rng).tolist(), "T": (rng.normal(size=3) + [0, 0, 4]).tolist(),
                                   "focal_length": [1.7, 1.9], "principal_point": [0.05, -0.1],
                                   "intrinsics_format": fmt}})
    with gzip.open(tmp_path / "apple" / "frame_annotations.jgz", "wt") as f:
        json.dump(anns, f)
    scenes = load_scenes(str(tmp_path), num_frames=3, seed=1)
    assert len(scenes) == 1 and scenes[0].name == "apple/seq_1" and len(scenes[0].image_paths) == 3
    sc = scenes[0]
    by_path = {os.path.join(str(tmp_path), a["image"]["path"]): a for a in anns}
    numbers = [by_path[p]["frame_number"] for p in sc.image_paths]
    assert numbers == sorted(numbers)  # kept in frame order
    for p, E, K in zip(sc.image_paths, sc.extrinsics, sc.intrinsics):
        vp = by_path[p]["viewpoint"]
        np.testing.assert_allclose(E[:, :3] @ E[:, :3].T, np.eye(3), atol=1e-12)
        for _ in range(3):
            X = rng.normal(size=3) * 0.5
            want = _pytorch3d_project(X, np.array(vp["R"]), np.array(vp["T"]), vp["focal_length"],
                                      vp["principal_point"], hw, fmt)
            xc = E[:, :3] @ X + E[:, 3]
            got = (K @ xc)[:2] / xc[2]
            assert xc[2] > 0
            np.testing.assert_allclose(got, want, atol=1e-9)
