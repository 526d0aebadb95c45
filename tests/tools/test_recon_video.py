"""Video input and the outputs people load next (COLMAP, nerfstudio, glTF, PLY), each read by its own reader."""
import json
import os
import runpy
import tracemalloc

import numpy as np
import pytest
import torch

from testdata import REPO, nearest_distances, read_ply_points

from visionattn.recon.cameras import OPENCV_TO_OPENGL
from visionattn.recon.colmap import point_tracks
from visionattn.recon.images import preprocess_image
from visionattn.recon.video import expected_frames, frame_selector, load_video

cv2 = pytest.importorskip("cv2")
pycolmap = pytest.importorskip("pycolmap", reason="pycolmap not installed: pip install -e '.[recon]'")
trimesh = pytest.importorskip("trimesh", reason="trimesh not installed: pip install -e '.[recon]'")
from PIL import Image  # noqa: E402

SHARED_VIDEO = os.path.join(os.path.dirname(REPO), "shared", "data", "video")
demo = runpy.run_path(os.path.join(REPO, "demos", "reconstruct.py"), run_name="reconstruct_demo_video")


def _write_video(path, n, w, h, fps=10.0):
    """A textured pattern sliding right by 3 px a frame (MJPEG in AVI: every OpenCV build writes it)."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    assert writer.isOpened()
    rng = np.random.default_rng(0)
    texture = cv2.resize(rng.integers(0, 255, (h // 16, (w + 3 * n) // 16, 3), dtype=np.uint8), ((w + 3 * n), h),
                         interpolation=cv2.INTER_NEAREST)
    for i in range(n):
        writer.write(np.ascontiguousarray(texture[:, 3 * i:3 * i + w]))
    writer.release()
    return path


def _decode_all(path):
    cap = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, f = cap.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(f, cv2.COLOR_BGR2RGB))
    cap.release()
    return frames


def test_frame_selector_every_and_fps():
    keep = frame_selector(10.0, every=4)
    assert [i for i in range(20) if keep(i)] == [0, 4, 8, 12, 16]
    keep = frame_selector(10.0, fps=2.5)  # one frame per 0.4 s = every 4th frame at 10 fps
    assert [i for i in range(20) if keep(i)] == [0, 4, 8, 12, 16]
    keep = frame_selector(29.97, fps=1.0)  # NTSC: the first frame of each second
    assert [i for i in range(100) if keep(i)] == [0, 30, 60, 90]
    keep = frame_selector(10.0, fps=50.0)  # more than the video has: every frame
    assert all(keep(i) for i in range(10))
    with pytest.raises(ValueError, match="exclusive"):
        frame_selector(10.0, fps=1.0, every=2)


def test_load_video_samples_stops_early_and_matches_the_decoder(tmp_path):
    path = _write_video(tmp_path / "clip.avi", 30, 160, 120)
    frames_dir = tmp_path / "frames"
    frames_dir.mkdir()
    loaded = load_video(str(path), size=112, every=3, max_frames=5, progress=False, frames_dir=str(frames_dir))
    assert loaded.extra["frame_indices"] == [0, 3, 6, 9, 12]
    assert loaded.extra["frames_read"] == 13  # decoding stopped at the 5th kept frame
    assert loaded.names == [f"frame_{i:06d}" for i in (0, 3, 6, 9, 12)]
    assert loaded.sources[1] == "clip.avi#frame=3" and loaded.original_sizes == [(160, 120)] * 5
    reference = _decode_all(path)
    for k, idx in enumerate((0, 3, 6, 9, 12)):
        expected = preprocess_image(Image.fromarray(reference[idx]), 112, "crop")
        assert torch.equal(loaded.images[k], expected)
        stored = np.asarray(Image.open(frames_dir / loaded.image_files[k]), dtype=np.float64)
        err = np.abs(stored - reference[idx])
        assert stored.shape == (120, 160, 3) and np.median(err) <= 3 and err.mean() < 8  # JPEG q95, 4:2:0


@pytest.mark.parametrize("sampling", [{}, {"every": 4}, {"fps": 3.0}, {"every": 2, "max_frames": 5},
                                      {"max_frames": 40}])
def test_first_frame_reports_the_count_and_size_the_decode_ends_with(tmp_path, sampling):
    """on_first_frame: once, with the frame count the container and the sampling predict (expected_frames) and the
    first frame's size, both equal to what the whole decode returns."""
    path = _write_video(tmp_path / "clip.avi", 23, 160, 120)
    calls = []
    loaded = load_video(str(path), size=112, progress=False, on_first_frame=lambda *a: calls.append(a), **sampling)
    assert calls == [(loaded.images.shape[0], *loaded.shape_hw)]
    assert expected_frames(23, 10.0, **sampling) == loaded.images.shape[0]
    assert expected_frames(0, 10.0, every=2) == 0  # a container without a frame count predicts nothing


def test_first_frame_is_reported_before_the_decode_ends(tmp_path):
    """The callback runs while frames remain: here the decode then fails on a later image."""
    for i in range(4):
        Image.new("RGB", (64, 48), (40 * i, 90, 200)).save(tmp_path / f"img_{i}.png")
    (tmp_path / "img_3.png").write_bytes(b"not an image")
    from visionattn.recon.images import ImageFolderError, load_images

    calls = []
    with pytest.raises(ImageFolderError):
        load_images(str(tmp_path), size=56, progress=False, on_first_frame=lambda *a: calls.append(a))
    assert calls == [(4, 42, 56)]


def test_video_decoding_is_streamed(tmp_path):
    """Holding every decoded frame would need 120 x 230 KB; the loader keeps one at a time."""
    path = _write_video(tmp_path / "long.avi", 120, 320, 240)
    frame_bytes = 320 * 240 * 3
    tracemalloc.start()
    try:
        loaded = load_video(str(path), size=28, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert loaded.images.shape[0] == 120
    assert peak < 12 * frame_bytes, peak


def test_point_tracks_against_a_known_scene():
    """Two cameras 1 unit apart look at the plane z = 4; a point on the plane is seen by both,
    a point hidden behind it (z = 6) only by the camera it came from, one outside the view by none else."""
    K = np.array([[100.0, 0, 50], [0, 100.0, 50], [0, 0, 1]])
    E0 = np.hstack([np.eye(3), np.zeros((3, 1))])
    E1 = np.hstack([np.eye(3), np.array([[-1.0], [0], [0]])])  # camera 1 sits at x = +1
    depth = np.full((2, 100, 100), 4.0)
    pts = np.array([[0.5, 0.0, 4.0], [0.5, 0.0, 6.0], [-1.9, 0.0, 4.0]])
    seen = point_tracks(pts, np.array([0, 0, 0]), np.stack([E0, E1]), np.stack([K, K]), depth)
    assert seen[0].tolist() == [True, True, True]
    assert seen[1].tolist() == [True, False, False]


def _video_inputs():
    cases = ["synthetic"]
    if os.path.isfile(os.path.join(SHARED_VIDEO, "box.mp4")):
        cases.append("box.mp4")
    return cases


@pytest.fixture(scope="module", params=_video_inputs())
def video_run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("video")
    if request.param == "synthetic":
        src, extra = _write_video(tmp / "clip.avi", 24, 160, 120), ["--every", "3"]
    else:
        src, extra = os.path.join(SHARED_VIDEO, request.param), ["--fps", "1"]
    out = tmp / "out"
    summary = demo["main"]([str(src), "--out", str(out), "--weights", "random-tiny", "--device", "cpu",
                            "--max-frames", "8", "--size", "182", "--quiet", "--no-preview", "--colmap-text", *extra])
    assert summary["exit_code"] == 0
    return summary, out


def test_colmap_model_loads_in_pycolmap_and_matches_cameras_json(video_run):
    summary, out = video_run
    cams = json.load(open(out / "cameras.json"))
    frames = cams["frames"]
    assert len(frames) == summary["frames"] == 8
    for kind in ("bin", "txt"):
        assert all((out / "sparse" / "0" / f"{n}.{kind}").is_file() for n in ("cameras", "images", "points3D"))
    rec = pycolmap.Reconstruction(str(out / "sparse" / "0"))  # the binary model, written from numpy
    text = pycolmap.Reconstruction()  # --colmap-text: pycolmap's text of that model
    text.read_text(str(out / "sparse" / "0"))
    assert rec.num_images() == text.num_images() == 8 and rec.num_points3D() == text.num_points3D() > 0
    for image_id, im in rec.images.items():
        f = frames[image_id - 1]
        assert "images/" + im.name == f["image"]
        pic = Image.open(out / f["image"])
        cam = rec.cameras[im.camera_id]
        assert (cam.width, cam.height) == pic.size == (f["original_width"], f["original_height"])
        np.testing.assert_allclose(cam.calibration_matrix(), np.array(f["intrinsic_original"]), rtol=1e-9, atol=1e-9)
        pose = im.cam_from_world() if callable(im.cam_from_world) else im.cam_from_world
        np.testing.assert_allclose(pose.matrix(), np.array(f["extrinsic"]), atol=1e-6)
    # tracks: every point is observed, each observation is the point's projection (reprojection error 0)
    lengths = [p.track.length() for p in rec.points3D.values()]
    assert min(lengths) >= 1 and summary["colmap"]["observations"] == sum(lengths)
    assert rec.compute_mean_reprojection_error() < 1e-3
    # the points are the PLY's points (a subset of at most 200k)
    ply = read_ply_points(out / "points.ply")[0]
    xyz = np.array([p.xyz for p in rec.points3D.values()])
    dist = nearest_distances(xyz, ply)
    assert dist.max() < 1e-5 * max(1.0, np.abs(ply).max())


def test_transforms_json_is_nerfstudio_opengl_with_one_depth_scale(video_run):
    _, out = video_run
    doc = json.load(open(out / "transforms.json"))
    cams = json.load(open(out / "cameras.json"))
    assert doc["depth_unit_scale_factor"] == pytest.approx(1.0 / cams["depth_png_scale"])
    assert doc["ply_file_path"] == "points.ply"
    for fr, cf in zip(doc["frames"], cams["frames"]):
        assert set(fr) >= {"file_path", "depth_file_path", "transform_matrix", "fl_x", "fl_y", "cx", "cy", "w", "h"}
        assert fr["file_path"] == cf["image"] and (out / fr["depth_file_path"]).is_file()
        M = np.array(fr["transform_matrix"])
        E = np.array(cf["extrinsic"])
        R, t = E[:, :3], E[:, 3]
        assert M.shape == (4, 4) and np.allclose(M[3], [0, 0, 0, 1])
        np.testing.assert_allclose(M[:3, 3], -R.T @ t, atol=1e-9)  # camera centre
        np.testing.assert_allclose(-M[:3, 2], R.T @ [0, 0, 1], atol=1e-9)  # OpenGL looks down -z
        np.testing.assert_allclose(M[:3, 1], -(R.T @ [0, 1, 0]), atol=1e-9)  # and y is up
        K = np.array(cf["intrinsic_original"])
        assert (fr["fl_x"], fr["cx"], fr["w"]) == pytest.approx((K[0, 0], K[0, 2], cf["original_width"]))
        depth_png = np.asarray(Image.open(out / fr["depth_file_path"]), dtype=np.float64)
        assert depth_png.shape == (fr["h"], fr["w"])
        d = np.load(out / "depth" / f"{cf['name']}.npy")
        metres = depth_png * doc["depth_unit_scale_factor"]
        assert abs(np.median(metres[depth_png > 0]) - np.median(d)) < 0.05 * np.median(d) + 1e-6


def test_glb_scene_opens_in_trimesh_with_points_and_frusta(video_run):
    summary, out = video_run
    scene = trimesh.load(str(out / "scene.glb"))
    clouds = [g for g in scene.geometry.values() if isinstance(g, trimesh.PointCloud)]
    assert len(clouds) == 1 and len(clouds[0].vertices) == min(summary["points_kept"], 2_000_000)
    assert clouds[0].colors.shape == (len(clouds[0].vertices), 4)
    cams = json.load(open(out / "cameras.json"))["frames"]
    frusta = {k: g for k, g in scene.geometry.items() if k.startswith("camera_")}
    assert len(frusta) == len(cams)
    for i, f in enumerate(cams):
        E = np.array(f["extrinsic"])
        centre = OPENCV_TO_OPENGL @ (-E[:, :3].T @ E[:, 3])
        verts = np.asarray(frusta[f"camera_{i:04d}"].vertices)
        assert np.min(np.linalg.norm(verts - centre, axis=1)) < 1e-5  # the frustum's apex is the camera
