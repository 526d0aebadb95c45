"""Hostile inputs to the CLIs, each case asserting its class: a clear error (exit 2, one line naming the argument or
file, no traceback, nothing written), a correct result, or nothing of the user's changed.

Covers the demo (input frames copied, never linked; SIGHUP during loading and export; --fps inf / 1e308 / nan /
0 / negative; a disk that fills up during the export), tools/finetune.py (the output-folder rule, corrupt images),
tools/eval_reconstruction.py (NaN or 2x2 extrinsics, corrupt ground-truth PLY, empty CO3D annotations),
tools/eval_imagenet.py (corrupt images), tools/eval_pasa.py (bad or wrongly shaped --config) and tools/eval_svd.py
(corrupt --image, empty or partial --model folder).
"""
import errno
import gzip
import json
import os
import shutil
import signal

import numpy as np
import pytest
from PIL import Image

from testdata import MULTIVIEW, PHOTOS, REPO, load_script, open3d_or_skip

pytest.importorskip("trimesh", reason="trimesh not installed: pip install -e '.[recon]'")

TINY = ["--weights", "random-tiny", "--device", "cpu", "--size", "140", "--quiet", "--no-preview"]
ALOE = os.path.join(MULTIVIEW, "aloe")
PHOTO_FILES = sorted(f for f in os.listdir(PHOTOS) if f.lower().endswith(".jpg"))

demo = load_script("demos/reconstruct.py", "reconstruct_demo_hostile")


# ----------------------------------------------------------------------------- helpers
def _snapshot(folder):
    """{relative path: (bytes, mtime_ns)} of every file under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = (open(p, "rb").read(), os.stat(p).st_mtime_ns)
    return out


def _hidden(folder):
    """Hidden entries (temporary folders and files) left in ``folder``."""
    return [p for p in os.listdir(folder) if p.startswith(".")]


def _one_line(err, *needles):
    """``err``, as a terminal shows it (a progress bar cleared by carriage returns is gone), is exactly one line
    holding every needle, without a traceback."""
    lines = [shown for line in err.split("\n") if (shown := line.split("\r")[-1].strip())]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _demo(argv, capsys):
    try:
        code = demo.main(argv)["exit_code"]
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


def _tool(mod, argv, capsys):
    """(exit code, stderr) of a tool's main: SystemExit's code, or the returned dict's exit_code (0 without)."""
    try:
        res = mod.main(argv)
        code = res.get("exit_code", 0) if isinstance(res, dict) else 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture
def photos(tmp_path):
    """The two aloe photos (plain JPEGs) in a folder of the user's."""
    src = tmp_path / "photos"
    shutil.copytree(ALOE, src)
    return src


# ----------------------------------------------------------------------------- 1. frames copied, never linked
def test_output_images_share_no_storage_with_the_input_photos(photos, tmp_path, capsys):
    before = _snapshot(photos)
    out = tmp_path / "recon"
    code, err = _demo([str(photos), "--out", str(out), *TINY], capsys)
    assert code == 0, err
    frames = json.load(open(out / "cameras.json"))["frames"]
    assert len(frames) == 2
    for fr in frames:
        stored, source = out / fr["image"], photos / fr["file"]
        assert stored.read_bytes() == source.read_bytes()  # the same picture ...
        assert not os.path.samefile(stored, source) and os.stat(source).st_nlink == 1  # ... in its own file
        with open(stored, "r+b") as f:  # edited in place, as an image editor saving over it would
            f.write(b"\0" * 64)
    assert _snapshot(photos) == before  # the user's photos are untouched


def test_store_frame_copies_bytes_and_permission_bits(tmp_path):
    from visionattn.recon.images import store_frame

    src = tmp_path / "private.jpg"
    shutil.copy(os.path.join(ALOE, "aloeL.jpg"), src)
    os.chmod(src, 0o600)
    (tmp_path / "frames").mkdir()
    name = store_frame(str(tmp_path / "frames"), "f", None, str(src))
    dest = tmp_path / "frames" / name
    assert name == "f.jpg" and dest.read_bytes() == src.read_bytes()
    assert not os.path.samefile(dest, src) and os.stat(dest).st_mode & 0o777 == 0o600  # still private


# ----------------------------------------------------------------------------- 2. SIGHUP: clean like SIGTERM
@pytest.fixture
def sighup_guard():
    """A SIGHUP the code under test does not handle fails the test instead of killing pytest."""
    def unhandled(signum, frame):
        raise AssertionError("SIGHUP reached the test's own handler: the demo did not handle it")

    previous = signal.signal(signal.SIGHUP, unhandled)
    yield
    signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("stage", ["loading", "export"])
def test_sighup_during_loading_or_export_leaves_nothing(stage, photos, tmp_path, capsys, monkeypatch, sighup_guard):
    from visionattn.recon import export, images

    target, name = (images, "_decode") if stage == "loading" else (export, "write_ply")
    original = getattr(target, name)
    sent = []

    def hang_up(*a, **k):
        if not sent:  # one hang-up, as a terminal that goes away sends (decodes run on several threads)
            sent.append(True)
            os.kill(os.getpid(), signal.SIGHUP)
        return original(*a, **k)

    monkeypatch.setattr(target, name, hang_up)
    parent = tmp_path / "parent"
    parent.mkdir()
    code, err = _demo([str(photos), "--out", str(parent / "recon"), *TINY], capsys)
    assert code == 128 + signal.SIGHUP
    _one_line(err, "SIGHUP", "nothing was written")
    assert os.listdir(parent) == []  # neither OUT nor a hidden .recon.tmp-* folder


def test_sighup_ignored_under_nohup_stays_ignored():
    from visionattn.recon.outdir import handle_sigterm

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with handle_sigterm():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


# ----------------------------------------------------------------------------- 4. --fps and a full disk
@pytest.mark.parametrize("fps", ["inf", "-inf", "1e309", "nan", "0", "-2", "0x10"])
def test_demo_fps_out_of_range_is_one_line_exit_2(fps, tmp_path, capsys):
    video = _video(tmp_path / "clip.avi", 6)
    code, err = _demo([video, "--out", str(tmp_path / "o"), "--fps", fps, *TINY], capsys)
    assert code == 2
    _one_line(err, "--fps")
    assert not (tmp_path / "o").exists() and _hidden(tmp_path) == []


def _video(path, frames):
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (64, 48))
    rng = np.random.default_rng(0)
    for _ in range(frames):
        writer.write(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    writer.release()
    return str(path)


def test_demo_fps_far_above_the_video_rate_keeps_every_frame(tmp_path, capsys):
    from visionattn.recon.video import frame_selector

    keep = frame_selector(30.0, fps=1e308)
    assert all(keep(i) for i in range(1000))  # 1e308 frames/s of a 30 fps video: each frame
    with pytest.raises(ValueError, match="finite"):
        frame_selector(30.0, fps=float("inf"))
    video = _video(tmp_path / "clip.avi", 5)
    res = demo.main([video, "--out", str(tmp_path / "o"), "--fps", "1e308", *TINY])
    assert res["exit_code"] == 0 and res["video"]["frame_indices"] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("where", ["write_ply", "write_glb"])
def test_full_disk_during_export_is_one_line_naming_the_folder(where, photos, tmp_path, capsys, monkeypatch):
    from visionattn.recon import export

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export, where, full)
    parent = tmp_path / "disk"
    parent.mkdir()
    out = parent / "recon"
    code, err = _demo([str(photos), "--out", str(out), *TINY], capsys)
    assert code == 2
    _one_line(err, str(out), os.strerror(errno.ENOSPC))
    assert os.listdir(parent) == []  # no partial output, no temporary folder


# ----------------------------------------------------------------------------- 3, 6. finetune: folder rule, bad images
FT_TINY = ["--model", "vit_tiny_patch16_224", "--model-kwargs", '{"depth": 2}', "--img-size", "32", "--device", "cpu",
           "--batch-size", "4", "--epochs", "1"]


@pytest.fixture(scope="module")
def finetune():
    pytest.importorskip("timm")
    return load_script("tools/finetune.py", "finetune_hostile")


def _class_folders(root, corrupt=None):
    """The 8 photos as two classes a/ b/ under ``root``; ``corrupt``: extra bytes saved as ``b/zz_bad.jpg``."""
    for i, name in enumerate(PHOTO_FILES):
        os.makedirs(root / "ab"[i // 4], exist_ok=True)
        shutil.copy(os.path.join(PHOTOS, name), root / "ab"[i // 4])
    if corrupt is not None:
        (root / "b" / "zz_bad.jpg").write_bytes(corrupt)
    return str(root)


def _truncated_jpeg():
    data = open(os.path.join(PHOTOS, PHOTO_FILES[0]), "rb").read()
    return data[: len(data) // 2]


def test_finetune_refuses_a_folder_holding_the_users_checkpoint(finetune, tmp_path, capsys, monkeypatch):
    data = _class_folders(tmp_path / "data")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "best.safetensors").write_bytes(b"the user's own weights")
    before = _snapshot(out)
    monkeypatch.setattr(finetune, "create_timm_model", lambda *a, **k: pytest.fail("trained despite the refusal"))
    code, err = _tool(finetune, ["--data", data, *FT_TINY, "--workers", "0", "--out", str(out)], capsys)
    assert code == 2
    _one_line(err, "--out", "best.safetensors")
    assert _snapshot(out) == before and _hidden(tmp_path) == []


def test_finetune_refuses_an_out_inside_the_data(finetune, tmp_path, capsys):
    data = _class_folders(tmp_path / "data")
    before = _snapshot(data)
    code, err = _tool(finetune, ["--data", data, *FT_TINY, "--workers", "0", "--out", f"{data}/run"], capsys)
    assert code == 2
    _one_line(err, "--out", "input")
    assert _snapshot(data) == before  # no class folder "run" appeared among the classes


def test_finetune_replaces_only_its_own_untouched_output(finetune, tmp_path, capsys):
    data = _class_folders(tmp_path / "data")
    out = tmp_path / "run"
    argv = ["--data", data, *FT_TINY, "--workers", "0", "--out", str(out)]
    assert _tool(finetune, argv, capsys)[0] == 0
    first = _snapshot(out)
    assert _tool(finetune, argv + ["--seed", "1"], capsys)[0] == 0  # an earlier output: replaced
    second = _snapshot(out)
    assert second.keys() == first.keys() and second["last.safetensors"][0] != first["last.safetensors"][0]
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    code, err = _tool(finetune, argv, capsys)
    assert code == 2
    _one_line(err, "--out", "notes.txt")
    assert _snapshot(out) == before and _hidden(tmp_path) == []


@pytest.mark.parametrize("corrupt, workers", [(b"this is not a JPEG", "0"), (b"this is not a JPEG", "1"),
                                              (_truncated_jpeg(), "0")])
def test_finetune_corrupt_jpeg_is_one_line_and_leaves_nothing(corrupt, workers, finetune, tmp_path, capsys):
    data = _class_folders(tmp_path / "data", corrupt=corrupt)
    parent = tmp_path / "outs"
    parent.mkdir()
    code, err = _tool(finetune, ["--data", data, *FT_TINY, "--workers", workers, "--out", str(parent / "run")],
                      capsys)
    assert code == 2
    _one_line(err, "--data", "zz_bad.jpg")
    assert os.listdir(parent) == []


# ----------------------------------------------------------------------------- 6. eval_imagenet: corrupt images
@pytest.fixture(scope="module")
def eval_imagenet():
    pytest.importorskip("timm")
    return load_script("tools/eval_imagenet.py", "eval_imagenet_hostile")


@pytest.mark.parametrize("corrupt", [b"\xff\xd8\xff\xe0 garbage", _truncated_jpeg()])
def test_eval_imagenet_corrupt_jpeg_is_one_line_and_writes_nothing(corrupt, eval_imagenet, tmp_path, capsys):
    """(The error's way out of a DataLoader worker is the same _cli.CorruptImageError as finetune's, tested there.)"""
    from timm.data import ImageNetInfo

    synsets = ImageNetInfo("imagenet-1k").label_names()
    for k, name in enumerate(PHOTO_FILES[:4]):
        os.makedirs(tmp_path / "val" / synsets[k], exist_ok=True)
        shutil.copy(os.path.join(PHOTOS, name), tmp_path / "val" / synsets[k])
    bad = tmp_path / "val" / synsets[1] / "ILSVRC2012_val_00000009.JPEG"
    bad.write_bytes(corrupt)
    out = tmp_path / "rep" / "r.json"
    code, err = _tool(eval_imagenet, [
        "--model", "vit_tiny_patch16_224", "--model-kwargs", '{"depth": 2}', "--img-size", "32", "--batch-size", "2",
        "--random-weights", "--modes", "native,fp32", "--data", str(tmp_path / "val"), "--workers", "0",
        "--device", "cpu", "--out", str(out)], capsys)
    assert code == 2, err
    _one_line(err, "--data", str(bad))
    assert not (tmp_path / "rep").exists()


# ----------------------------------------------------------------------------- 5. eval_reconstruction: ground truth
@pytest.fixture(scope="module")
def eval_recon():
    return load_script("tools/eval_reconstruction.py", "eval_reconstruction_hostile")


def _scene(root, extrinsics=None, ply=None):
    """A generic-layout scene: the aloe pair, cameras.json (``extrinsics`` per frame) and ``ply`` as points.ply."""
    os.makedirs(root / "images")
    names = sorted(os.listdir(ALOE))
    for n in names:
        shutil.copy(os.path.join(ALOE, n), root / "images" / n)
    if extrinsics is None:
        extrinsics = [np.eye(4)[:3].tolist(), [[1, 0, 0, -0.2], [0, 1, 0, 0], [0, 0, 1, 0]]]
    K = [[300.0, 0, 320], [0, 300.0, 240], [0, 0, 1]]
    frames = [{"file": n, "extrinsic": e, "intrinsic": K} for n, e in zip(names, extrinsics)]
    (root / "cameras.json").write_text(json.dumps({"frames": frames}))
    if ply is not None:
        (root / "points.ply").write_bytes(ply)
    return str(root)


def _binary_ply(points):
    pts = np.asarray(points, np.float32)
    head = (f"ply\nformat binary_little_endian 1.0\nelement vertex {len(pts)}\nproperty float x\nproperty float y\n"
            "property float z\nend_header\n").encode()
    return head + pts.tobytes()


def _accuracy(eval_recon, data, out, capsys, monkeypatch, model_runs=False):
    import visionattn.recon.evaluate as ev

    if not model_runs:
        monkeypatch.setattr(ev, "build_model", lambda *a, **k: pytest.fail("the model ran before the data was checked"))
    return _tool(eval_recon, ["accuracy", "--data", str(data), "--weights", "random-tiny", "--device", "cpu",
                              "--size", "140", "--quiet", "--out", str(out)], capsys)


@pytest.mark.parametrize("case, needle", [
    ("nan", "NaN"),
    ("2x2", "2x2"),
    ("strings", "numbers"),
    ("no_extrinsic", "'extrinsic'"),
    ("frames_not_a_list", "'frames'"),
])
def test_eval_reconstruction_bad_cameras_are_one_line(case, needle, eval_recon, tmp_path, capsys, monkeypatch):
    ext = {"nan": [np.eye(4)[:3].tolist(), [[float("nan")] * 4] * 3],
           "2x2": [[[1, 0], [0, 1]]] * 2,
           "strings": [[["a", "b", "c", "d"]] * 3] * 2}.get(case)
    scene = _scene(tmp_path / "scene", ext)
    if case in ("no_extrinsic", "frames_not_a_list"):
        doc = json.load(open(os.path.join(scene, "cameras.json")))
        if case == "no_extrinsic":
            del doc["frames"][1]["extrinsic"]
        else:
            doc["frames"] = {"a": doc["frames"][0]}
        open(os.path.join(scene, "cameras.json"), "w").write(json.dumps(doc))
    code, err = _accuracy(eval_recon, scene, tmp_path / "rep", capsys, monkeypatch)
    assert code == 2
    _one_line(err, "cameras.json", needle)
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("ply", [b"garbage, not a PLY", b"", _binary_ply(np.ones((10, 3)))[:-7],
                                 _binary_ply(np.full((4, 3), np.nan))])
def test_eval_reconstruction_corrupt_ground_truth_ply_fails_before_the_model(ply, eval_recon, tmp_path, capsys,
                                                                            monkeypatch):
    scene = _scene(tmp_path / "scene", ply=ply)
    code, err = _accuracy(eval_recon, scene, tmp_path / "rep", capsys, monkeypatch)
    assert code == 2
    _one_line(err, os.path.join(scene, "points.ply"))
    assert not (tmp_path / "rep").exists()


def test_eval_reconstruction_ply_with_some_nan_points_evaluates_the_finite_ones(eval_recon, tmp_path, capsys,
                                                                             monkeypatch):
    from visionattn.recon.datasets import read_ply_points

    open3d_or_skip()  # the cloud metrics use open3d
    rng = np.random.default_rng(0)
    pts = np.concatenate([rng.normal(size=(200, 3)), np.full((3, 3), np.nan)])
    scene = _scene(tmp_path / "scene", ply=_binary_ply(pts))
    assert read_ply_points(os.path.join(scene, "points.ply")).shape == (200, 3)
    code, err = _accuracy(eval_recon, scene, tmp_path / "rep", capsys, monkeypatch, model_runs=True)
    assert code == 0, err
    res = json.load(open(tmp_path / "rep" / "eval_reconstruction_accuracy.json"))
    assert all(np.isfinite(v) for v in res["scenes"][0]["cloud"].values())


@pytest.mark.parametrize("annotations, needle", [
    ([], "no frame annotations"),
    ({"not": "a list"}, "no frame annotations"),
    ([{"frame_number": 0}], "entry 0"),
    ([{"sequence_name": "s", "frame_number": 0, "image": {"path": "c/s/images/f.jpg", "size": [48, 64]},
       "viewpoint": {"R": [[1, 0], [0, 1]], "T": [0, 0, 0], "focal_length": [1, 1], "principal_point": [0, 0]}}],
     "viewpoint R is 2x2"),
])
def test_eval_reconstruction_bad_co3d_annotations_are_one_line(annotations, needle, eval_recon, tmp_path, capsys,
                                                              monkeypatch):
    os.makedirs(tmp_path / "co3d" / "c" / "s" / "images")
    Image.new("RGB", (64, 48)).save(tmp_path / "co3d" / "c" / "s" / "images" / "f.jpg")
    with gzip.open(tmp_path / "co3d" / "c" / "frame_annotations.jgz", "wt") as f:
        json.dump(annotations, f)
    code, err = _accuracy(eval_recon, tmp_path / "co3d", tmp_path / "rep", capsys, monkeypatch)
    assert code == 2
    _one_line(err, "frame_annotations.jgz", needle)
    assert not (tmp_path / "rep").exists()


# ----------------------------------------------------------------------------- 7. eval_pasa --config
@pytest.fixture(scope="module")
def eval_pasa():
    pytest.importorskip("yaml")
    pytest.importorskip("pydantic")
    return load_script("tools/eval_pasa.py", "eval_pasa_hostile")


def _pasa_config(edit):
    import yaml

    cfg = yaml.safe_load(open(os.path.join(REPO, "configs", "eval_pasa.yaml")))
    edit(cfg)
    return yaml.safe_dump(cfg)


@pytest.mark.parametrize("text, needle", [
    ("shape: [1, 2\nseed: 0\n", "not valid YAML at line"),
    ("- a\n- list\n", "valid dictionary"),
    ("", "valid dictionary"),
    (b"\xff\xfe\x00garbage", "--config"),
    (_pasa_config(lambda c: c.pop("table4")), "table4: Field required"),
    (_pasa_config(lambda c: c["sweeps"][0].update(x0="hot")), "sweeps.0"),
    (_pasa_config(lambda c: c["sweeps"][1].update(x0=[1, 2])), "exactly one of x0 and am"),
    (_pasa_config(lambda c: c["table4"][0].update(am=float("inf"))), "table4.0.am"),
    (_pasa_config(lambda c: c["table4"][0].update(kind="gaussian")), "table4.0.kind"),
    (_pasa_config(lambda c: c.update(shape=[1, 16, 1280])), "shape"),
    (_pasa_config(lambda c: c.update(shape=[1, 16, 0, 128])), "shape.2"),
    (_pasa_config(lambda c: c.update(modes=["fp32", "fp16", "fp8", "pasa"])), "modes.2"),
    (_pasa_config(lambda c: c.update(modes=["fp32", "fp16"])), "include pasa"),
    (_pasa_config(lambda c: c.update(sweeps_typo=[])), "sweeps_typo: Extra inputs"),
])
def test_eval_pasa_bad_config_is_one_line_before_any_work(text, needle, eval_pasa, tmp_path, capsys, monkeypatch):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setattr(eval_pasa, "run_accuracy", lambda *a, **k: pytest.fail("ran despite a bad config"))
    code, err = _tool(eval_pasa, ["--cpu", "--quick", "--config", str(path), "--out", str(tmp_path / "o" / "p")],
                      capsys)
    assert code == 2
    _one_line(err, "--config", needle)
    assert not (tmp_path / "o").exists()


def test_eval_pasa_shipped_config_is_valid_and_keeps_its_entries(eval_pasa, tmp_path, capsys):
    import yaml

    cfg = eval_pasa.load_config(eval_pasa.build_parser(), os.path.join(REPO, "configs", "eval_pasa.yaml"),
                                eval_pasa.PasaConfig)
    raw = yaml.safe_load(open(os.path.join(REPO, "configs", "eval_pasa.yaml")))
    assert cfg == raw  # checked, not changed (resonance cases get no paper_nan_pct)
    assert "paper_nan_pct" not in cfg["resonance"][0]


# ----------------------------------------------------------------------------- 8. eval_svd --image / --model
@pytest.fixture(scope="module")
def eval_svd():
    pytest.importorskip("diffusers")
    return load_script("tools/eval_svd.py", "eval_svd_hostile")


SVD = ["--frames", "2", "--steps", "1", "--height", "64", "--width", "64", "--modes", "fp32", "--device", "cpu",
       "--quiet"]
SVD_INDEX = {"_class_name": "StableVideoDiffusionPipeline", "_diffusers_version": "0.30.0",
             "unet": ["diffusers", "UNetSpatioTemporalConditionModel"],
             "vae": ["diffusers", "AutoencoderKLTemporalDecoder"],
             "image_encoder": ["transformers", "CLIPVisionModelWithProjection"],
             "scheduler": ["diffusers", "EulerDiscreteScheduler"],
             "feature_extractor": ["transformers", "CLIPImageProcessor"]}


@pytest.mark.parametrize("corrupt", [b"garbage with a .jpg name", _truncated_jpeg()])
def test_eval_svd_corrupt_image_is_one_line(corrupt, eval_svd, tmp_path, capsys):
    image = tmp_path / "photo.jpg"
    image.write_bytes(corrupt)
    code, err = _tool(eval_svd, ["--model", "tiny-random", "--image", str(image), *SVD, "--out", str(tmp_path / "o")],
                      capsys)
    assert code == 2
    _one_line(err, "--image", str(image))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case, needle", [
    ("empty", "model_index.json"),
    ("other_pipeline", "StableDiffusionPipeline"),
    ("missing_parts", "unet"),
    ("empty_parts", "does not hold a complete"),  # found only when diffusers loads it: one line, nothing left
])
def test_eval_svd_unusable_model_folder_is_one_line(case, needle, eval_svd, tmp_path, capsys):
    model = tmp_path / "svd"
    model.mkdir()
    if case != "empty":
        index = dict(SVD_INDEX, _class_name="StableDiffusionPipeline") if case == "other_pipeline" else SVD_INDEX
        (model / "model_index.json").write_text(json.dumps(index))
    if case == "empty_parts":
        for part in ("unet", "vae", "image_encoder", "scheduler", "feature_extractor"):
            (model / part).mkdir()
    before = _snapshot(model)
    parent = tmp_path / "outs"
    parent.mkdir()
    code, err = _tool(eval_svd, ["--model", str(model), "--image", os.path.join(PHOTOS, "apple.jpg"), *SVD,
                                 "--out", str(parent / "o")], capsys)
    assert code == 2
    _one_line(err, "--model", needle)
    assert os.listdir(parent) == [] and _snapshot(model) == before


def test_eval_svd_refuses_a_folder_of_the_users(eval_svd, tmp_path, capsys):
    out = tmp_path / "videos"
    out.mkdir()
    (out / "fp32.mp4").write_bytes(b"the user's own video")
    before = _snapshot(out)
    code, err = _tool(eval_svd, ["--model", "tiny-random", "--image", os.path.join(PHOTOS, "apple.jpg"), *SVD,
                                 "--out", str(out)], capsys)
    assert code == 2
    _one_line(err, "--out", "fp32.mp4")
    assert _snapshot(out) == before
