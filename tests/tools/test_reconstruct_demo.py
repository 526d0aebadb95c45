"""demos/reconstruct.py and tools/eval_reconstruction.py end to end on the bundled images (tiny random VGGT, CPU)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from testdata import MULTIVIEW, REPO, load_script, nearest_distances, open3d_or_skip, read_ply_points

SIZE = 182  # small frames keep the CPU run short; the pipeline is the same as at 518
TINY = ["--weights", "random-tiny", "--device", "cpu", "--size", str(SIZE), "--quiet"]


def _load(name, rel):
    return load_script(rel, name)


demo = _load("reconstruct_demo", "demos/reconstruct.py")
evaltool = _load("eval_reconstruction_tool", "tools/eval_reconstruction.py")


@pytest.fixture(scope="module")
def recon(tmp_path_factory):
    """One demo run on the 6 stereo_rig frames (grayscale JPEGs) with a non-image file beside them."""
    src = tmp_path_factory.mktemp("src") / "rig"
    shutil.copytree(os.path.join(MULTIVIEW, "stereo_rig"), src)
    (src / "README.txt").write_text("not an image")
    out = tmp_path_factory.mktemp("out") / "recon"
    summary = demo.main([str(src), "--out", str(out), *TINY])
    return summary, out, src


def test_demo_writes_every_output(recon):
    summary, out, src = recon
    assert summary["exit_code"] == 0 and summary["frames"] == 6
    assert summary["skipped"] == ["README.txt"]
    H, W = summary["image_hw"]
    assert W == SIZE and H % 14 == 0
    assert summary["tokens"] == 6 * (5 + (H // 14) * (W // 14))
    names = ["left01", "left02", "left03", "right01", "right02", "right03"]
    for sub in ["points.ply", "cameras.json", "preview.png", "summary.json", "transforms.json", "scene.glb",
                "sparse/0/cameras.bin", "sparse/0/images.bin", "sparse/0/points3D.bin"] + \
            [f"depth/{n}.png" for n in names] + [f"images/{n}.jpg" for n in names] + \
            [f"depth/{n}.npy" for n in names] + [f"confidence/{n}.npy" for n in names]:
        assert (out / sub).is_file(), sub
    assert not [p for p in os.listdir(out.parent) if p.startswith(".")]  # no temp folders left
    assert not (out / "points_full.ply").exists() and not (out / "sparse/0/cameras.txt").exists()  # not asked for

    cams = json.load(open(out / "cameras.json"))
    assert [f["name"] for f in cams["frames"]] == names
    # ply: read back (trimesh), coloured, as many points as reported
    xyz, rgb = read_ply_points(out / "points.ply")
    assert len(xyz) == summary["points_kept"] == cams["points_kept"] > 0 and rgb.shape == xyz.shape
    assert np.isfinite(xyz).all() and rgb.min() >= 0 and rgb.max() <= 1
    # the stereo rig is grayscale: the colours must be gray (R = G = B)
    assert np.abs(rgb[:, 0] - rgb[:, 1]).max() < 1e-6
    # kept points are the confidence-filtered unprojections of the saved depth maps with the saved
    # cameras (independent numpy unprojection: X = R^T (d K^-1 [u, v, 1] - t))
    all_pts = []
    for f in cams["frames"]:
        d = np.load(out / "depth" / f"{f['name']}.npy")
        assert d.shape == (H, W)
        K, E = np.array(f["intrinsic"]), np.array(f["extrinsic"])
        v, u = np.mgrid[0:H, 0:W]
        rays = np.stack([u, v, np.ones_like(u)], -1).reshape(-1, 3) @ np.linalg.inv(K).T
        cam = rays * d.reshape(-1, 1)
        all_pts.append((cam - E[:, 3]) @ E[:, :3])
    all_pts = np.concatenate(all_pts)
    dist = nearest_distances(xyz, all_pts)
    scale = np.abs(all_pts).max()
    assert dist.max() < 1e-4 * scale
    # 50th percentile of confidence: about half the pixels are kept
    assert 0.4 < len(xyz) / len(all_pts) <= 0.5 + 1e-3


def test_depth_png_and_confidence(recon):
    """Depth PNGs: source-image pixels (640x480, aligned with images/), one scale for every frame."""
    _, out, _ = recon
    cams = json.load(open(out / "cameras.json"))
    scale = cams["depth_png_scale"]
    all_depth = np.stack([np.load(out / "depth" / f"{f['name']}.npy") for f in cams["frames"]])
    assert scale == pytest.approx(65535 / all_depth[np.isfinite(all_depth)].max())
    for f in cams["frames"]:
        d = np.load(out / "depth" / f"{f['name']}.npy")
        png = Image.open(out / "depth" / f"{f['name']}.png")
        arr = np.asarray(png).astype(np.float64)
        assert png.mode.startswith("I") and arr.shape == (480, 640)
        assert float(png.text["depth_scale"]) == pytest.approx(scale)
        # source pixel (x, y) shows the depth of the model pixel its centre lands on (resize only, no crop)
        sx, sy = f["width"] / 640, f["height"] / 480
        u = np.round(sx * np.arange(640) + 0.5 * sx - 0.5).astype(int)
        v = np.round(sy * np.arange(480) + 0.5 * sy - 0.5).astype(int)
        np.testing.assert_allclose(arr / scale, d[np.ix_(v, u)], atol=0.51 / scale)
        c = np.load(out / "confidence" / f"{f['name']}.npy")
        assert c.shape == d.shape and c.dtype == np.float32 and np.isfinite(c).all()


def test_colmap_model_reads_in_pycolmap_and_matches_cameras_json(recon):
    pycolmap = pytest.importorskip("pycolmap", reason="pycolmap not installed: pip install -e '.[recon]'")
    summary, out, src = recon
    cams_json = json.load(open(out / "cameras.json"))
    rec = pycolmap.Reconstruction(str(out / "sparse" / "0"))
    assert rec.num_cameras() == rec.num_images() == 6
    assert 0 < rec.num_points3D() == summary["colmap"]["points"] <= 200_000
    assert rec.compute_num_observations() == summary["colmap"]["observations"]
    assert min(p.track.length() for p in rec.points3D.values()) >= 1  # at least the frame it came from
    rng = np.random.default_rng(0)
    for image_id, im in rec.images.items():
        f = cams_json["frames"][image_id - 1]
        assert "images/" + im.name == f["image"] and (out / f["image"]).is_file() and (src / f["file"]).is_file()
        E = np.array(f["extrinsic"])
        np.testing.assert_allclose(im.cam_from_world().matrix(), E, atol=1e-6)
        cam = rec.cameras[im.camera_id]
        assert cam.model.name == "PINHOLE" and (cam.width, cam.height) == (640, 480)  # the source, not 182 px
        fx, fy, cx, cy = cam.params
        # a 3D point projects to the same place via COLMAP (source pixels) and via cameras.json
        # (preprocessed pixels) once mapped back with the resize factors
        X = rng.normal(size=3) + np.array([0, 0, 5.0])
        xc = E[:, :3] @ X + E[:, 3]
        u_src = np.array([fx * xc[0] / xc[2] + cx, fy * xc[1] / xc[2] + cy])
        K = np.array(f["intrinsic"])
        u_pre = (K @ xc)[:2] / xc[2]
        sx, sy = f["width"] / 640, f["height"] / 480  # resized, no crop (the height stays under SIZE)
        expected_pre = np.array([sx * u_src[0], sy * u_src[1]])  # continuous pixels: a pure scale
        np.testing.assert_allclose(u_pre, expected_pre, atol=1e-6 * max(1, np.abs(u_pre).max()))


def test_summary_stages_add_up_to_the_wall_time(tmp_path):
    """summary.json's seconds: every stage, each >= 0, adding up to total, which is the wall time of the run up
    to the summary; export_outputs names each output's writer."""
    import time

    t0 = time.perf_counter()
    res = demo.main([os.path.join(MULTIVIEW, "aloe"), "--out", str(tmp_path / "o"), "--weights", "random-tiny",
                     "--device", "cpu", "--size", "140", "--quiet"])
    wall = time.perf_counter() - t0
    sec = json.load(open(tmp_path / "o" / "summary.json"))["seconds"]
    assert res["exit_code"] == 0 and sec == res["seconds"]
    assert list(sec) == ["setup", "decode_build", "compile", "warmup", "inference", "tracks",
                         "bundle_adjustment", "export", "other", "total"]
    # the frames decode beside the model build: the stage is the wall of both, each one's own seconds beside it
    own = res["decode_build"]
    assert own["side_by_side"] and own["decode"] > 0 and own["build"] > 0
    assert max(own["decode"], own["build"]) <= sec["decode_build"] <= own["decode"] + own["build"] + 0.5
    assert min(sec.values()) >= 0 and sec["tracks"] == sec["bundle_adjustment"] == 0
    assert sum(v for k, v in sec.items() if k != "total") == pytest.approx(sec["total"], rel=1e-9)
    assert sec["total"] <= wall < sec["total"] + 1.0  # the rest: summary.json and the rename into place
    assert sec["inference"] > 0 and sec["export"] > 0 and sec["other"] < 0.2 * sec["total"]
    outputs = res["export_outputs"]
    assert set(outputs) == {"select", "points.ply", "sparse/0", "scene.glb", "preview.png", "depth/", "cameras.json",
                            "transforms.json"}
    assert all(v > 0 for v in outputs.values())


def test_the_script_counts_its_imports_in_setup(tmp_path):
    """Run as a script, the demo's stages count from before its imports (PyTorch's among them): the summary's total
    is the process's wall time but for the interpreter's start and exit, not the part after the imports."""
    import time

    t0 = time.perf_counter()
    script = os.path.join(REPO, "demos", "reconstruct.py")
    run = subprocess.run([sys.executable, script, os.path.join(MULTIVIEW, "aloe"),
                          "--out", str(tmp_path / "o"), "--weights", "random-tiny", "--device", "cpu", "--size", "140",
                          "--quiet", "--no-preview"], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    assert run.returncode == 0, run.stderr[-2000:]
    sec = json.load(open(tmp_path / "o" / "summary.json"))["seconds"]
    assert sec["setup"] > 0.25  # the imports: without them, argument and folder checks take milliseconds
    assert 0.6 * wall < sec["total"] < wall


def test_preview_png_is_a_real_picture(recon):
    _, out, _ = recon
    im = np.asarray(Image.open(out / "preview.png").convert("RGB")).astype(np.float64)
    assert im.shape[0] > 300 and im.shape[1] > 500
    assert im.std() > 20  # not blank
    # the point-cloud panels drew points: many distinct colours, not just the dark background
    assert len(np.unique(im.reshape(-1, 3), axis=0)) > 500


def test_rerun_replaces_untouched_earlier_output(recon, tmp_path):
    _, out, src = recon
    target = tmp_path / "again"
    shutil.copytree(out, target)
    res = demo.main([str(src), "--out", str(target), "--max-frames", "2", *TINY])
    assert res["exit_code"] == 0 and res["frames"] == 2
    assert len(json.load(open(target / "cameras.json"))["frames"]) == 2
    assert not (target / "depth" / "left03.npy").exists()  # the earlier run's frames are gone


@pytest.mark.parametrize("case", ["missing", "empty", "no_images", "corrupt", "out_not_ours", "bad_size"])
def test_bad_input_exit_2_and_no_output(case, tmp_path, capsys):
    folder = tmp_path / "in"
    out = tmp_path / "out"
    extra = []
    if case != "missing":
        folder.mkdir()
    if case == "no_images":
        (folder / "notes.txt").write_text("hello")
    if case == "corrupt":
        shutil.copy(os.path.join(MULTIVIEW, "aloe", "aloeL.jpg"), folder / "a.jpg")
        (folder / "b.jpg").write_bytes(b"\xff\xd8\xff\xe0 corrupt")
    if case in ("out_not_ours", "bad_size"):
        shutil.copy(os.path.join(MULTIVIEW, "aloe", "aloeL.jpg"), folder / "a.jpg")
    if case == "out_not_ours":
        out.mkdir()
        (out / "precious.txt").write_text("user data")
    if case == "bad_size":
        extra = ["--size", "100"]
    try:
        res = demo.main([str(folder), "--out", str(out), *TINY, *extra])
        code = res["exit_code"]
    except SystemExit as exc:  # argparse errors exit 2 themselves
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "error" in err
    if case == "out_not_ours":
        assert os.listdir(out) == ["precious.txt"]
    else:
        assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_offline_hub_weights_fail_fast_with_fix(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}  # empty cache
    proc = subprocess.run([sys.executable, os.path.join(REPO, "demos", "reconstruct.py"), "--out",
                           str(tmp_path / "out"), "--weights", "facebook/VGGT-1B", "--device", "cpu", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--weights PATH" in proc.stderr and "random-tiny" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_eval_modes_agreement(tmp_path):
    res = evaltool.main(["modes", os.path.join(MULTIVIEW, "aloe"), "--modes", "fp32,fp16,bf16,pasa",
                         "--out", str(tmp_path), "--weights", "random-tiny", "--device", "cpu",
                         "--size", "140", "--quiet"])
    assert res["exit_code"] == 0
    runs = res["runs"]
    assert list(runs) == ["fp32", "fp16", "bf16", "pasa"]
    ref = runs["fp32"]
    assert ref["depth_rel_l2"] == 0 and ref["points_rel_l2"] == 0 and ref["rot_max_deg"] == 0
    for m in ("fp16", "bf16", "pasa"):
        r = runs[m]
        assert r["nonfinite"] == 0
        assert 0 < r["points_rel_l2"] < 0.05  # half-precision attention changes the output, a little
        assert r["depth_rel_l2"] < 0.05
    # bf16 (8 mantissa bits) disagrees more than fp16 (11)
    assert runs["bf16"]["points_rel_l2"] > runs["fp16"]["points_rel_l2"]
    doc = json.load(open(tmp_path / "eval_reconstruction_modes.json"))
    assert doc["runs"]["fp16"]["depth_rel_l2"] == pytest.approx(runs["fp16"]["depth_rel_l2"])
    md = open(tmp_path / "eval_reconstruction_modes.md").read()
    assert "| pasa |" in md and "torch" in md


def test_eval_accuracy_on_generic_layout(recon, tmp_path):
    """Ground truth = the demo's own output (same seed, same size): AUC 1 and Chamfer ~0.
    A second copy with camera 2 rotated by 10 degrees about its centre scores exactly that."""
    open3d_or_skip()  # the cloud metrics (chamfer) use open3d
    _, out, src = recon
    scene = tmp_path / "data" / "rig"
    shutil.copytree(src, scene / "images")
    shutil.copy(out / "cameras.json", scene / "cameras.json")
    shutil.copy(out / "points.ply", scene / "points.ply")
    doc = json.load(open(out / "cameras.json"))
    E = np.array(doc["frames"][2]["extrinsic"])
    a = np.radians(10.0)
    Q = np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])
    doc["frames"][2]["extrinsic"] = (Q @ E).tolist()
    pert = tmp_path / "data" / "rig_perturbed"
    shutil.copytree(src, pert / "images")
    json.dump(doc, open(pert / "cameras.json", "w"))
    res = evaltool.main(["accuracy", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "rep"),
                         "--weights", "random-tiny", "--device", "cpu", "--size", str(SIZE), "--quiet"])
    assert res["exit_code"] == 0
    exact, perturbed = res["scenes"]
    assert exact["scene"] == "rig" and exact["pose"]["pairs"] == 15
    assert exact["pose"]["auc@3"] == pytest.approx(1.0)
    assert exact["pose"]["rot_err_mean_deg"] < 1e-3
    scale = np.abs(read_ply_points(out / "points.ply")[0]).max()
    assert exact["cloud"]["chamfer"] < 1e-4 * scale and exact["sim3_scale"] == pytest.approx(1.0, abs=1e-4)
    assert "cloud" not in perturbed  # no points.ply there
    # 5 of 15 pairs involve camera 2: their rotation error is 10 degrees, the others ~0
    assert perturbed["pose"]["rra@5"] == pytest.approx(10 / 15)
    assert perturbed["pose"]["rot_err_mean_deg"] == pytest.approx(10 * 5 / 15, abs=1e-2)
    assert (tmp_path / "rep" / "eval_reconstruction_accuracy.md").is_file()


def test_eval_bad_dataset_exit_2(tmp_path, capsys):
    res = evaltool.main(["accuracy", "--data", str(tmp_path), "--out", str(tmp_path / "rep"),
                         "--weights", "random-tiny", "--device", "cpu", "--quiet"])
    assert res["exit_code"] == 2 and "no scene" in capsys.readouterr().err
    assert not (tmp_path / "rep").exists()


def test_max_frames_auto_and_bad_values(recon, tmp_path, capsys):
    """``--max-frames auto`` runs (no limit on the CPU); 0 and words other than 'auto' exit 2 before any
    output."""
    _, _, src = recon
    res = demo.main([str(src), "--out", str(tmp_path / "auto"), "--max-frames", "auto", *TINY])
    assert res["exit_code"] == 0 and res["frames"] == len([p for p in os.listdir(src) if p.endswith(".jpg")])
    for bad in ("0", "many"):
        with pytest.raises(SystemExit) as exc:
            demo.main([str(src), "--out", str(tmp_path / f"bad{bad}"), "--max-frames", bad, *TINY])
        assert exc.value.code == 2 and not (tmp_path / f"bad{bad}").exists()


def test_predictions_on_disk_give_the_same_outputs(recon, tmp_path):
    """``--host-memory disk`` keeps the per-pixel predictions in .npy files beside the output until the export:
    the same point cloud, depth and cameras as in host memory, and no prediction folder left behind."""
    summary, out, src = recon
    parent = tmp_path / "parent"
    parent.mkdir()
    res = demo.main([str(src), "--out", str(parent / "disk"), "--host-memory", "disk", *TINY])
    assert res["exit_code"] == 0 and res["predictions_on_disk"] and not summary["predictions_on_disk"]
    assert sorted(os.listdir(parent)) == ["disk"]  # the prediction store is gone
    disk = parent / "disk"
    assert (disk / "points.ply").read_bytes() == (out / "points.ply").read_bytes()
    for name in ("left01", "right03"):
        for sub in ("depth", "confidence"):
            np.testing.assert_array_equal(np.load(disk / sub / f"{name}.npy"), np.load(out / sub / f"{name}.npy"))
    cams = [json.load(open(d / "cameras.json"))["frames"] for d in (disk, out)]
    assert cams[0] == cams[1]


def test_prediction_store_choice(tmp_path, monkeypatch):
    """``auto`` keeps predictions in host memory while they take at most half the free host memory, else on disk
    (said in the log); ``disk`` always; a disk too small for them is a user error naming the fix."""
    import contextlib

    from visionattn.recon import pipeline
    from visionattn.recon.outdir import OutputDirError

    need = pipeline.prediction_bytes(10, 28, 42)
    assert need == 10 * 28 * 42 * 48
    notes = []
    with contextlib.ExitStack() as stack:
        monkeypatch.setattr(pipeline, "available_host_memory", lambda: 2 * need)
        assert pipeline.prediction_store("auto", 10, (28, 42), str(tmp_path / "o"), stack, notes.append) is None
        assert pipeline.prediction_store("ram", 10, (28, 42), str(tmp_path / "o"), stack, notes.append) is None
        assert notes == []
        monkeypatch.setattr(pipeline, "available_host_memory", lambda: 2 * need - 1)
        folder = pipeline.prediction_store("auto", 10, (28, 42), str(tmp_path / "o"), stack, notes.append)
        assert os.path.dirname(folder) == str(tmp_path) and os.path.isdir(folder) and "host memory" in notes[0]
        assert pipeline.prediction_store("disk", 10, (28, 42), str(tmp_path / "o"), stack, notes.append)
        monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(need, need - 1, 1))
        with pytest.raises(OutputDirError, match="--max-frames"):
            pipeline.prediction_store("disk", 10, (28, 42), str(tmp_path / "o"), stack, notes.append)
        with pytest.raises(ValueError, match="host_memory"):
            pipeline.prediction_store("swap", 10, (28, 42), str(tmp_path / "o"), stack, notes.append)
    assert not os.path.exists(folder)


def test_compile_ahead_starts_at_the_first_frame(tmp_path, monkeypatch):
    """The kernels' compile starts from the first decoded frame (the predicted frame count and that frame's size),
    while the other frames still decode: its shapes are the batch's the forward then gets."""
    from visionattn.recon import pipeline

    started = []
    monkeypatch.setattr(pipeline, "start_compile_ahead", lambda *a, **k: started.append(a[3]))
    summary = demo.main([os.path.join(MULTIVIEW, "stereo_rig"), "--out", str(tmp_path / "out"), *TINY])
    assert started == [(summary["frames"], 3, *summary["image_hw"])]


def test_compile_ahead_where_kernels_compile(recon):
    """The demo compiles the attention kernels ahead (while the model builds) on CUDA in a visionattn mode, for
    the calls its forward makes; on the CPU or with SDPA there is nothing to compile and the summary says so."""
    import warnings

    from visionattn.models import vggt_attention_shapes, vggt_tiny_config
    from visionattn.recon import pipeline

    summary, _, _ = recon
    assert summary["compile_ahead"] is None  # the fixture ran on the CPU
    assert pipeline.start_compile_ahead("fp32", "random-tiny", "cpu", (3, 3, 56, 42)) is None
    assert pipeline.start_compile_ahead("sdpa", "random", "cuda", (3, 3, 518, 392)) is None
    ahead = pipeline.start_compile_ahead("bf16", "random-tiny", "cuda", (3, 3, 56, 42))
    assert ahead.mode == "bf16" and ahead.shapes == vggt_attention_shapes(3, 56, 42, **vggt_tiny_config())
    half_heads = pipeline.start_compile_ahead("bf16", "random-tiny", "cuda", (3, 3, 56, 42), heads="bf16")
    assert half_heads.shapes == vggt_attention_shapes(3, 56, 42, **vggt_tiny_config(heads_dtype="bf16"))
    assert half_heads.shapes != ahead.shapes  # the camera trunk's inputs: FP32 with FP32 heads, bf16 with bf16 ones
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # without a GPU the warm-up fails, said by a warning
        info = ahead.wait()
        half_heads.wait()
    assert ("error" in info) != torch.cuda.is_available()
