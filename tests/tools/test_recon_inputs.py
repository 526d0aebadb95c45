"""Hostile inputs to the reconstruction demo: name collisions, FIFOs, degenerate and huge images,
float / 16-bit TIFFs, bad devices and checkpoints, SIGTERM, SIGHUP and Ctrl-C."""
import json
import os
import runpy
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from testdata import REPO, default_stop_signals

from visionattn.recon.images import (ImageFolderError, list_images, load_images, preprocess_image, read_image,
                                     unique_names)


DEMO = os.path.join(REPO, "demos", "reconstruct.py")
TINY = ["--weights", "random-tiny", "--device", "cpu", "--size", "140", "--quiet", "--no-preview"]
demo = runpy.run_path(DEMO, run_name="reconstruct_demo_inputs")


def _run(argv, capsys):
    try:
        code = demo["main"](argv)["exit_code"]
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def _noise(w, h, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def test_colliding_stems_give_unique_names_that_map_back(tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    for i, name in enumerate(["a.jpg", "a.png", "a_1.png"]):
        _noise(64, 48, i).save(src / name)
    assert unique_names([str(src / n) for n in ["a.jpg", "a.png", "a_1.png"]]) == ["a_jpg", "a_png", "a_1"]
    assert len({n.casefold() for n in unique_names(["A.png", "a.PNG", "a_png.tif", "a png.gif"])}) == 4
    out = tmp_path / "out"
    code, err = _run([str(src), "--out", str(out), *TINY], capsys)
    assert code == 0, err
    frames = json.load(open(out / "cameras.json"))["frames"]
    assert sorted(f["file"] for f in frames) == ["a.jpg", "a.png", "a_1.png"]
    names = [f["name"] for f in frames]
    assert len(set(names)) == 3
    pngs = sorted(p for p in os.listdir(out / "depth") if p.endswith(".png"))
    assert pngs == sorted(f"{n}.png" for n in names)  # three frames, three depth maps
    # each frame's stored image is its own source: the pixels under images/ match the file named in "file"
    for f in frames:
        stored = np.asarray(Image.open(out / f["image"]).convert("RGB"), dtype=np.float64)
        source = np.asarray(Image.open(src / f["file"]).convert("RGB"), dtype=np.float64)
        assert np.abs(stored - source).mean() < 3


def test_fifo_named_like_an_image_is_skipped_not_read(tmp_path):
    _noise(40, 30, 0).save(tmp_path / "a.png")
    _noise(40, 30, 1).save(tmp_path / "b.png")
    os.mkfifo(tmp_path / "c.jpg")
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        loaded=load_images(str(tmp_path), size=28, progress=False)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "reading the folder blocked on the FIFO"
    loaded = result["loaded"]
    assert [os.path.basename(p) for p in loaded.paths] == ["a.png", "b.png"]
    assert dict(loaded.skipped)["c.jpg"].startswith("not a regular file")


def test_degenerate_aspect_rejected_and_tall_crop_bounded(tmp_path):
    Image.fromarray(np.full((60, 1, 3), 128, np.uint8)).save(tmp_path / "strip.png")
    with pytest.raises(ImageFolderError, match=r"strip.png.*1x60.*aspect ratio"):
        load_images(str(tmp_path), size=518, progress=False)
    # a tall but acceptable portrait: the bounded (box) resample equals resize-then-crop, the reference loader
    img = _noise(90, 700, 3)
    t = preprocess_image(img, 140, "crop")
    new_h = int(round(700 * 140 / 90 / 14)) * 14
    ref = np.asarray(img.resize((140, new_h), Image.Resampling.BICUBIC), dtype=np.float32) / 255.0
    top = (new_h - 140) // 2
    ref = torch.from_numpy(ref[top:top + 140]).permute(2, 0, 1)
    assert t.shape == (3, 140, 140)
    assert float((t - ref).abs().max()) < 1e-6


def _png_header_only(path, width, height):
    """A PNG that declares width x height pixels but carries one tiny IDAT (a decompression bomb's header)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


def _one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("case", ["bomb", "device", "device_index", "corrupt_safetensors", "corrupt_pt",
                                  "empty_weights_folder", "file_not_video"])
def test_anticipated_errors_exit_2_in_one_line_before_work(case, tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    _noise(64, 48, 0).save(src / "a.png")
    args = list(TINY)
    if case == "bomb":
        _png_header_only(src / "b.png", 100_000, 100_000)
        expect = "decompression bomb"
    elif case.startswith("device"):
        args[args.index("--device") + 1] = "foo" if case == "device" else "cuda:99"
        expect = "--device"
    elif case == "file_not_video":  # a file is taken as a video; one that is not names both accepted kinds
        src = tmp_path / "notes.txt"
        src.write_text("not a video")
        expect = "a folder of images or a video file (.3gp, .avi"
    else:
        (src / "z.jpg").write_bytes(b"\xff\xd8 corrupt")  # only reported if the weights were not checked first
        if case == "corrupt_safetensors":
            weights = tmp_path / "model.safetensors"
            weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + b"\0" * 100)
        elif case == "corrupt_pt":
            weights = tmp_path / "model.pt"
            weights.write_bytes(b"PK\x03\x04 truncated zip")
        else:
            weights = tmp_path / "ckpt"
            weights.mkdir()
        args[args.index("--weights") + 1] = str(weights)
        expect = "--weights"
    code, err = _run([str(src), "--out", str(tmp_path / "out"), *args], capsys)
    assert code == 2
    assert expect in _one_error_line(err)
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_float_and_16bit_tiffs_converted_by_range(tmp_path):
    ramp = np.linspace(0.0, 1.0, 64 * 48, dtype=np.float32).reshape(48, 64)
    Image.fromarray(ramp, "F").save(tmp_path / "unit.tif")
    got = np.asarray(read_image(str(tmp_path / "unit.tif")))[..., 0].astype(np.int64)
    assert np.abs(got - np.round(ramp * 255)).max() <= 1  # [0, 1] floats scale by 255, nothing clipped
    assert (got == 255).mean() < 0.01
    Image.fromarray(ramp * 1000.0 + 50.0, "F").save(tmp_path / "wide.tif")
    got = np.asarray(read_image(str(tmp_path / "wide.tif")))[..., 0].astype(np.int64)
    assert got.min() == 0 and got.max() == 255 and np.abs(got - np.round(ramp * 255)).max() <= 1
    v16 = (np.arange(48 * 64).reshape(48, 64) * 21).astype(np.uint16)  # 0 .. 64491
    Image.fromarray(v16).save(tmp_path / "deep.tif")
    got = np.asarray(read_image(str(tmp_path / "deep.tif")))[..., 0].astype(np.int64)
    assert np.abs(got - np.round(v16 / v16.max() * 255)).max() <= 1


def _images_for_signal(tmp_path, n=48):  # enough work that the run outlasts the 0.3 s before the signal
    src = tmp_path / "in"
    src.mkdir()
    for i in range(n):
        _noise(320, 240, i).save(src / f"f{i:02d}.png")
    return src


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_during_the_run_removes_the_temp_folder_without_traceback(sig, tmp_path):
    src = _images_for_signal(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, DEMO, str(src), "--out", str(out), "--weights", "random-tiny",
                             "--device", "cpu", "--size", "518", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_stop_signals)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if [p for p in os.listdir(tmp_path) if p.startswith(".out.tmp-")]:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the signal could be sent"
    time.sleep(0.3)  # inside the work, not at its very first line
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
    assert "Traceback" not in err and "nothing was written" in err
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_list_images_notes_unreadable_links(tmp_path):
    _noise(40, 30, 0).save(tmp_path / "a.png")
    os.symlink(tmp_path / "missing.png", tmp_path / "dangling.png")
    paths, skipped = list_images(str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["a.png"]
    assert "dangling.png" in dict(skipped)
