"""The export at disk speed: COLMAP binary from numpy arrays, outputs written side by side, --max-points; each file
read back by its own reader (pycolmap, trimesh, Pillow)."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

trimesh = pytest.importorskip("trimesh", reason="trimesh not installed: pip install -e '.[recon]'")
pycolmap = pytest.importorskip("pycolmap", reason="pycolmap not installed: pip install -e '.[recon]'")

from visionattn.recon.colmap import write_colmap_model  # noqa: E402
from visionattn.recon.export import write_outputs, write_reconstruction  # noqa: E402
from visionattn.recon.images import LoadedImages  # noqa: E402


def _cameras(S, rng):
    """S cameras on a short arc looking at the origin's neighbourhood, one intrinsics each."""
    E, K = np.zeros((S, 3, 4)), np.zeros((S, 3, 3))
    for j in range(S):
        a = 0.05 * j
        E[j, :, :3] = [[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]]
        E[j, :, 3] = [0.2 * j, 0.01 * j, 0.0]
        K[j] = [[90.0 + j, 0, 50.5], [0, 95.0 - j, 39.5], [0, 0, 1]]
    return E, K


def test_colmap_binary_from_arrays_reads_back_exactly(tmp_path):
    """Variable-length tracks, names and 2D points in COLMAP's binary layout: pycolmap reads back every camera,
    pose, point, colour and track, and the text written from it holds the same model."""
    rng = np.random.default_rng(0)
    S, N = 5, 700
    E, K = _cameras(S, rng)
    xyz = rng.normal(size=(N, 3)) * 0.5 + [0, 0, 4]
    rgb = rng.uniform(size=(N, 3))
    seen = [rng.uniform(size=N) < p for p in (0.9, 0.5, 0.3, 0.05, 0.0)]  # the last image sees nothing
    seen[0][:3] = False  # and some points no image: a track of length 0
    names = [f"frame_{j}.jpg" for j in range(S)]
    folder = str(tmp_path / "sparse")
    res = write_colmap_model(folder, names, E, K, [(100 + j, 80) for j in range(S)], xyz, rgb, seen, text=True)
    assert res == {"points": N, "observations": int(sum(m.sum() for m in seen)), "binary": True, "text": True}
    rec = pycolmap.Reconstruction(folder)
    assert rec.num_images() == rec.num_cameras() == S and rec.num_points3D() == N
    for j in range(S):
        im = rec.images[j + 1]
        cam = rec.cameras[im.camera_id]
        assert im.name == names[j] and (cam.width, cam.height) == (100 + j, 80)
        np.testing.assert_array_equal(cam.calibration_matrix(), K[j])
        np.testing.assert_allclose(im.cam_from_world().matrix(), E[j], atol=1e-12)
        assert [p.point3D_id - 1 for p in im.points2D] == np.flatnonzero(seen[j]).tolist()  # point order
    for pid, p in rec.points3D.items():
        np.testing.assert_array_equal(p.xyz, xyz[pid - 1])
        np.testing.assert_array_equal(p.color, np.rint(rgb[pid - 1] * 255))
        assert [e.image_id - 1 for e in p.track.elements] == [j for j in range(S) if seen[j][pid - 1]]
    rec.update_point_3d_errors()  # each observation is its point's projection
    assert rec.compute_mean_reprojection_error() < 1e-9
    text = pycolmap.Reconstruction()
    text.read_text(folder)
    assert text.num_points3D() == N and text.compute_num_observations() == res["observations"]


def _prediction(S=3, H=28, W=42, seed=0):
    """A small prediction as run_model returns it, and the LoadedImages it came from (source images 2x larger)."""
    rng = np.random.default_rng(seed)
    E, K = _cameras(S, rng)
    K[:, 0, 2], K[:, 1, 2] = W / 2, H / 2
    depth = rng.uniform(2, 4, (S, H, W)).astype(np.float32)
    v, u = np.mgrid[0:H, 0:W]
    pix = np.stack([u, v, np.ones_like(u)], -1).astype(np.float64)
    pts = np.stack([((pix @ np.linalg.inv(K[j]).T) * depth[j, ..., None] - E[j, :, 3]) @ E[j, :, :3]
                    for j in range(S)]).astype(np.float32)
    pred = {"extrinsic": E, "intrinsic": K, "intrinsic_fallback": np.zeros(S, bool), "depth": depth,
            "depth_conf": rng.uniform(1, 5, (S, H, W)).astype(np.float32), "world_points": pts,
            "world_points_conf": rng.uniform(1, 5, (S, H, W)).astype(np.float32), "world_points_from_depth": pts,
            "images": rng.uniform(0, 1, (S, H, W, 3)).astype(np.float32)}
    names = [f"f{j}" for j in range(S)]
    loaded = LoadedImages(images=torch.zeros(S, 3, H, W), paths=[f"{n}.jpg" for n in names], names=names,
                          original_sizes=[(2 * W, 2 * H)] * S, affines=[(0.5, 0.5, -0.25, -0.25)] * S,
                          image_files=[f"{n}.jpg" for n in names], sources=[f"{n}.jpg" for n in names])
    return pred, loaded


def test_max_points_caps_ply_and_glb_and_keeps_the_full_cloud(tmp_path):
    pred, loaded = _prediction()
    res = write_reconstruction(str(tmp_path), pred, loaded, 50.0, progress=False, max_points=200, workers=4)
    full = trimesh.load(str(tmp_path / "points_full.ply"))
    ply = trimesh.load(str(tmp_path / "points.ply"))
    assert len(full.vertices) == res["points"] > 200 and len(ply.vertices) == res["points_ply"] == 200
    # the capped cloud is a subset of the full one, in its order, colours included
    rows = {tuple(r) for r in np.concatenate([full.vertices, full.colors], 1).tolist()}
    assert all(tuple(r) in rows for r in np.concatenate([ply.vertices, ply.colors], 1).tolist())
    np.testing.assert_array_equal(full.vertices, res["xyz"])
    scene = trimesh.load(str(tmp_path / "scene.glb"))
    cloud = [g for g in scene.geometry.values() if isinstance(g, trimesh.PointCloud)]
    assert len(cloud) == 1 and len(cloud[0].vertices) == 200
    cams = json.load(open(tmp_path / "cameras.json"))
    assert (cams["points_kept"], cams["points_ply"]) == (res["points"], 200)
    # the COLMAP model comes from the whole cloud, in binary only unless asked
    assert sorted(os.listdir(tmp_path / "sparse" / "0")) == ["cameras.bin", "images.bin", "points3D.bin"]
    assert pycolmap.Reconstruction(str(tmp_path / "sparse" / "0")).num_points3D() == res["points"]
    # depth PNGs from the thread pool: one per frame, the shared scale in each
    for j, name in enumerate(loaded.names):
        png = Image.open(tmp_path / "depth" / f"{name}.png")
        assert png.size == loaded.original_sizes[j] and float(png.text["depth_scale"]) == res["depth_png_scale"]
        np.testing.assert_array_equal(np.load(tmp_path / "depth" / f"{name}.npy"), pred["depth"][j])
    assert set(res["seconds"]) == {"select", "points.ply", "points_full.ply", "sparse/0", "scene.glb", "depth/",
                                   "cameras.json", "transforms.json"}


def test_outputs_match_a_serial_run(tmp_path):
    """Side by side or one at a time, the files are the same bytes."""
    pred, loaded = _prediction(seed=1)
    for workers in (1, 4):
        (tmp_path / f"w{workers}").mkdir()
        write_reconstruction(str(tmp_path / f"w{workers}"), pred, loaded, 30.0, progress=False, workers=workers)
    files = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "w1")
                   for d, _, fs in os.walk(tmp_path / "w1") for f in fs)
    assert len(files) == 4 + 3 + 3 * 3 and "sparse/0/points3D.bin" in files  # 3 frames: .png, .npy, conf .npy
    for f in files:
        assert (tmp_path / "w1" / f).read_bytes() == (tmp_path / "w4" / f).read_bytes(), f


def test_a_failing_output_stops_the_rest_and_raises():
    import time

    ran = []

    def boom():
        raise OSError(28, "No space left on device")

    tasks = [("boom", boom)] + [("later", lambda i=i: (time.sleep(0.01), ran.append(i))) for i in range(50)]
    with pytest.raises(OSError, match="No space"):
        write_outputs(tasks, workers=1, progress=False)
    assert len(ran) < 50  # the queued writers were cancelled
    assert write_outputs([("a", lambda: None)] * 3, workers=2, progress=False).keys() == {"a"}


def test_a_writer_still_running_finishes_before_the_error_leaves_even_through_a_second_signal(monkeypatch):
    """A stop signal raises in the waiting thread; a second one (e.g. SIGHUP twice) raised while it waits for the
    running writers must not let the error out before they finish: the caller removes the folder they write into,
    and a file written after that keeps the folder alive."""
    import concurrent.futures
    import threading
    import time

    class SecondSignal(Exception):
        """What a stop signal's handler raises (a KeyboardInterrupt here would stop the test run itself)."""

    real_shutdown = concurrent.futures.ThreadPoolExecutor.shutdown
    interrupted = []

    def shutdown_interrupted_once(self, *args, **kwargs):
        if not interrupted:
            interrupted.append(True)
            raise SecondSignal  # the second signal, while waiting
        return real_shutdown(self, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "shutdown", shutdown_interrupted_once)
    started, finished = threading.Event(), []

    def slow_writer():
        started.set()
        time.sleep(0.3)
        finished.append("slow")

    def failing_writer():
        started.wait()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_outputs([("slow", slow_writer), ("bad", failing_writer)], workers=2, progress=False)
    assert interrupted and finished == ["slow"]


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_select_points_matches_the_plain_definition(workers):
    """The confidence filter: finite points (all three coordinates) with finite confidence at or above the
    percentile, in pixel order; colours clipped to [0, 1] in float32; frame and pixel index of each point."""
    from visionattn.recon.points import select_points

    rng = np.random.default_rng(3)
    S, H, W = 3, 5, 7
    pts = rng.normal(size=(S, H, W, 3))  # float64 in, float32 out
    pts[0, 1, 2, 1], pts[1, 0, 0, 2], pts[2, 4, 6, 0] = np.nan, np.inf, -np.inf  # one bad coordinate each
    conf = rng.uniform(size=(S, H, W)).astype(np.float32)
    conf[1, 2, 3] = np.nan
    conf[1, 3:] = -1.0  # under the percentile: frame 1 keeps its first rows only
    conf[2] = np.nan  # and frame 2 nothing: a frame without points after the others
    colors = rng.uniform(-0.5, 1.5, size=(S, H, W, 3))
    xyz, rgb, frame, pixel = select_points(pts, colors, conf, 40.0, workers=workers)
    finite = np.isfinite(pts).all(-1) & np.isfinite(conf)
    keep = finite & (conf >= np.percentile(conf[finite], 40.0))
    idx = np.flatnonzero(keep)
    assert set(np.unique(idx // (H * W))) == {0, 1} and (idx[idx // (H * W) == 1] % (H * W) < 3 * W).all()
    assert xyz.dtype == rgb.dtype == np.float32 and frame.dtype == np.int32 and pixel.dtype == np.int64
    np.testing.assert_array_equal(xyz, pts.reshape(-1, 3)[idx].astype(np.float32))
    np.testing.assert_array_equal(rgb, np.clip(colors.reshape(-1, 3)[idx], 0, 1).astype(np.float32))
    np.testing.assert_array_equal(frame, idx // (H * W))
    np.testing.assert_array_equal(pixel, idx % (H * W))
    assert colors.min() < 0  # the input is left alone


def test_depth_png_is_a_valid_16bit_png_of_the_quantised_resampled_depth(tmp_path):
    """OpenCV's PNG with the text chunks put in: Pillow verifies every chunk's CRC and reads mode I;16 with the
    text; Pillow and OpenCV read the same pixels: round(depth * scale) at the nearest model pixel, 0 where the
    depth is invalid or the source pixel was cropped away."""
    cv2 = pytest.importorskip("cv2")
    from visionattn.recon.depth import depth_to_source_pixels, write_depth

    rng = np.random.default_rng(3)
    depth = rng.uniform(0.5, 9.0, (28, 42)).astype(np.float32)
    depth[0, :5], depth[3, 3], depth[4, 4] = np.nan, -1.0, np.inf
    scale, affine, size = 65535.0 / 9.0, (0.7, 0.7, -3.2, 2.6), (70, 37)  # crops on the left, pads at the bottom
    write_depth(str(tmp_path), str(tmp_path), "f", depth, None, scale, affine, size)
    path = tmp_path / "f.png"
    Image.open(path).verify()
    png = Image.open(path)
    assert png.mode == "I;16" and png.size == size
    assert png.text == {"depth_scale": repr(scale), "description": "depth = value / depth_scale (0 = invalid)"}
    d = depth_to_source_pixels(depth, affine, size).astype(np.float64)
    ok = np.isfinite(d) & (d > 0)
    want = np.where(ok, np.round(np.where(ok, d, 0) * scale), 0).astype(np.uint16)
    assert (want == 0).any() and (want > 0).any()
    np.testing.assert_array_equal(np.asarray(png), want)
    np.testing.assert_array_equal(cv2.imread(str(path), cv2.IMREAD_UNCHANGED), want)
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy"), depth)
