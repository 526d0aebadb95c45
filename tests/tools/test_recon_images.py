"""Image loading for the reconstruction demo: EXIF, grayscale, RGBA, mixed sizes, natural order, errors."""
import os

import numpy as np
import pytest
import torch
from PIL import Image

from visionattn.recon.images import (ImageFolderError, load_images, natural_key, preprocess_image,
                                     read_image)

from testdata import MULTIVIEW


def _gradient(w, h):
    """An RGB image whose red channel grows left->right and green top->bottom."""
    x = np.linspace(0, 255, w)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h)[:, None].repeat(w, 1)
    return Image.fromarray(np.stack([x, y, np.full_like(x, 60)], -1).astype(np.uint8), "RGB")


def test_natural_sort_and_skipped_files(tmp_path):
    for name in ["img10.png", "img2.png", "IMG1.png"]:
        _gradient(30, 20).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "sub").mkdir()
    loaded = load_images(str(tmp_path), size=28, progress=False)
    assert [os.path.basename(p) for p in loaded.paths] == ["IMG1.png", "img2.png", "img10.png"]
    assert {n for n, _ in loaded.skipped} == {"notes.txt", "sub"}
    assert sorted(["a10", "a2", "a1b", "a1"], key=natural_key) == ["a1", "a1b", "a2", "a10"]


def test_exif_orientation_applied(tmp_path):
    img = _gradient(60, 20)  # landscape, stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": the displayed image is portrait
    img.save(tmp_path / "rot.jpg", exif=exif, quality=95)
    shown = read_image(str(tmp_path / "rot.jpg"))
    assert shown.size == (20, 60)
    ref = np.asarray(img.transpose(Image.Transpose.ROTATE_270), dtype=np.float64)
    assert np.abs(np.asarray(shown, dtype=np.float64) - ref).mean() < 4.0  # JPEG loss only


def test_grayscale_rgba_palette_16bit(tmp_path):
    Image.fromarray(np.full((20, 30), 128, np.uint8), "L").save(tmp_path / "g.png")
    rgba = np.zeros((20, 30, 4), np.uint8)
    rgba[..., 0] = 255
    rgba[:, :15, 3] = 255  # left half opaque red, right half transparent -> white
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    _gradient(30, 20).convert("P").save(tmp_path / "p.gif")
    Image.fromarray((np.arange(600).reshape(20, 30) * 100).astype(np.uint16)).save(tmp_path / "d.png")
    g = np.asarray(read_image(str(tmp_path / "g.png")))
    assert g.shape == (20, 30, 3) and (g == 128).all()
    a = np.asarray(read_image(str(tmp_path / "a.png")))
    assert (a[:, :15] == [255, 0, 0]).all() and (a[:, 15:] == 255).all()
    assert np.asarray(read_image(str(tmp_path / "p.gif"))).shape == (20, 30, 3)
    d = np.asarray(read_image(str(tmp_path / "d.png")))
    assert d.shape == (20, 30, 3) and d.max() == 255 and d.min() == 0


def test_vggt_crop_and_pad_shapes():
    land, port = _gradient(640, 480), _gradient(300, 1000)
    t = preprocess_image(land, 518, "crop")
    assert t.shape == (3, 392, 518) and t.dtype == torch.float32  # 480*518/640 = 388.5 -> 392
    t = preprocess_image(port, 518, "crop")
    assert t.shape == (3, 518, 518)  # height 1727 cropped to 518
    t = preprocess_image(port, 518, "pad")
    assert t.shape == (3, 518, 518)
    # pad mode: resized to 518 x round(155.4/14)*14 = 154 wide, padded with white on both sides
    assert torch.all(t[:, :, :182] == 1.0) and torch.all(t[:, :, 182 + 154:] == 1.0)
    assert float(t.min()) >= 0.0 and float(t.max()) <= 1.0
    with pytest.raises(ValueError, match="multiple of 14"):
        preprocess_image(land, 500)


def test_mixed_sizes_padded_and_affine_consistent(tmp_path):
    _gradient(640, 480).save(tmp_path / "a.png")
    _gradient(300, 1000).save(tmp_path / "b.png")
    _gradient(128, 128).save(tmp_path / "c.png")
    loaded = load_images(str(tmp_path), size=140, progress=False)
    S, C, H, W = loaded.images.shape
    assert (S, C) == (3, 3) and H % 14 == 0 and W % 14 == 0 and (H, W) == (140, 140)
    # the affine maps an original pixel to where its colour ends up: check with the gradient
    for i, (w, h) in enumerate(loaded.original_sizes):
        sx, sy, ox, oy = loaded.affines[i]
        x, y = 0.5 * w, 0.5 * h
        u, v = int(round(sx * x + ox)), int(round(sy * y + oy))
        px = loaded.images[i, :, v, u].numpy() * 255
        assert abs(px[0] - 255 * x / (w - 1)) < 8 and abs(px[1] - 255 * y / (h - 1)) < 8


def test_bundled_multiview_sets_load():
    for scene in ("aloe", "stereo_rig", "suzanne"):
        loaded = load_images(os.path.join(MULTIVIEW, scene), progress=False)
        assert loaded.images.shape[-1] == 518 and loaded.images.shape[-2] % 14 == 0
        assert len(loaded.names) == len(set(loaded.names)) == loaded.images.shape[0] >= 2


def test_bad_folders(tmp_path):
    with pytest.raises(ImageFolderError, match="does not exist"):
        load_images(str(tmp_path / "missing"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageFolderError, match="no image files"):
        load_images(str(tmp_path / "empty"), progress=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    _gradient(30, 20).save(bad / "ok.png")
    (bad / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    with pytest.raises(ImageFolderError, match="broken.jpg"):
        load_images(str(bad), progress=False)
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    _gradient(200, 200).save(trunc / "t.jpg", quality=95)
    data = (trunc / "t.jpg").read_bytes()
    (trunc / "t.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageFolderError, match="t.jpg"):
        load_images(str(trunc), progress=False)


@pytest.mark.parametrize("mode", ["crop", "pad"])
def test_batch_equals_each_image_preprocessed_and_padded_white(tmp_path, mode):
    """The loaders stack uint8 frames and convert the batch once: the result equals each image preprocessed on its
    own in float (x / 255) and centred on white (1.0), bit for bit, frames of different shapes included."""
    images = [_gradient(60, 40), _gradient(40, 60), _gradient(56, 56)]
    for i, img in enumerate(images):
        img.save(tmp_path / f"im{i}.png")
    loaded = load_images(str(tmp_path), size=28, mode=mode, progress=False)
    assert loaded.images.dtype == torch.float32
    H, W = loaded.images.shape[-2:]
    for i, img in enumerate(images):
        one = preprocess_image(img, size=28, mode=mode)
        h, w = one.shape[-2:]
        want = torch.ones(3, H, W)
        top, left = (H - h) // 2, (W - w) // 2
        want[:, top:top + h, left:left + w] = one
        assert torch.equal(loaded.images[i], want), i
        assert torch.equal(one * 255, (one * 255).round())  # exactly k / 255
