"""Image folders -> VGGT input tensors.

Listing (natural sort, non-image files skipped with a note), robust decoding
(every format Pillow reads, EXIF orientation applied, grayscale / palette / RGBA
converted to RGB over white) and VGGT's preprocessing (``crop``: width to
``size``, height rounded to a multiple of 14 and centre-cropped to ``size``;
``pad``: longest side to ``size``, the other rounded to a multiple of 14, then
padded to ``size x size`` with white). Frames of different shapes after
preprocessing are padded with white to a common shape, as the VGGT reference
loader does, so a folder with mixed sizes / aspect ratios gives one batch.

Errors are raised as :class:`ImageFolderError` (a ``ValueError``) *before* any
output is written, so a CLI can turn them into exit code 2.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = [
    "ImageFolderError", "LoadedImages", "PATCH_SIZE", "natural_key", "list_images",
    "read_image", "preprocess_image", "load_images",
]

PATCH_SIZE = 14
# Extensions Pillow reads that are likely to be photos; anything else is skipped with a note.
_IMAGE_EXTS = frozenset({
    ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".dib", ".tif", ".tiff", ".webp", ".gif",
    ".ppm", ".pgm", ".pbm", ".pnm", ".tga", ".jp2", ".j2k", ".ico", ".sgi", ".pcx", ".dds",
})


class ImageFolderError(ValueError):
    """The image folder cannot be used (missing, empty, unreadable, or a corrupt image)."""


@dataclass
class LoadedImages:
    """A preprocessed batch of frames.

    Attributes:
        images: float32 tensor [S, 3, H, W] in [0, 1]; H, W multiples of 14.
        paths: the S source files, in natural order.
        names: file stems, made unique (used for per-frame output names).
        original_sizes: (width, height) of each decoded image after EXIF rotation.
        skipped: files in the folder that were not images (name, reason).
        mode: ``"crop"`` or ``"pad"``.
        affines: per frame (sx, sy, ox, oy): a pixel-centre coordinate (x, y) of the
            original image lands at (sx * x + ox, sy * y + oy) in the preprocessed
            frame (resize, crop and padding included). Used to express the predicted
            intrinsics in original-image pixels (COLMAP export).
    """

    images: torch.Tensor
    paths: list[str]
    names: list[str]
    original_sizes: list[tuple[int, int]]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    mode: str = "crop"
    affines: list[tuple[float, float, float, float]] = field(default_factory=list)

    @property
    def shape_hw(self) -> tuple[int, int]:
        return int(self.images.shape[-2]), int(self.images.shape[-1])


def natural_key(name: str):
    """Sort key putting ``img2`` before ``img10`` (digit runs compared as numbers, text case-folded)."""
    return [(0, int(tok), "") if tok.isdigit() else (1, 0, tok.casefold())
            for tok in re.split(r"(\d+)", name) if tok != ""]


def list_images(folder: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Image files directly inside ``folder``, naturally sorted, and the skipped entries.

    Returns:
        (paths, skipped) where ``skipped`` is a list of (file name, reason) for
        non-image files and sub-folders.

    Raises:
        ImageFolderError: ``folder`` does not exist, is not a directory, cannot be
            listed, or holds no image file.
    """
    if not os.path.exists(folder):
        raise ImageFolderError(f"image folder {folder!r} does not exist")
    if not os.path.isdir(folder):
        raise ImageFolderError(f"{folder!r} is not a folder; pass a folder of images")
    try:
        entries = os.listdir(folder)
    except OSError as exc:
        raise ImageFolderError(f"cannot list image folder {folder!r}: {exc}") from exc
    paths, skipped = [], []
    for name in sorted(entries, key=natural_key):
        full = os.path.join(folder, name)
        if name.startswith("."):
            continue
        if os.path.isdir(full):
            skipped.append((name, "sub-folder (not searched)"))
        elif os.path.splitext(name)[1].lower() in _IMAGE_EXTS:
            paths.append(full)
        else:
            skipped.append((name, "not an image file extension"))
    if not paths:
        raise ImageFolderError(
            f"no image files in {folder!r} (looked for {', '.join(sorted(_IMAGE_EXTS))})")
    return paths, skipped


def read_image(path: str) -> Image.Image:
    """Decode ``path`` fully into an RGB :class:`PIL.Image.Image`.

    EXIF orientation is applied (phone photos stand upright); images with
    transparency (RGBA, LA, palette with alpha) are composited over white, as in
    VGGT's loader; grayscale / CMYK / 16-bit inputs are converted to 8-bit RGB.

    Raises:
        ImageFolderError: the file cannot be opened or decoded (corrupt/truncated).
    """
    try:
        with Image.open(path) as im:
            im.load()  # force a full decode: truncated files fail here, not later
            im = ImageOps.exif_transpose(im)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ImageFolderError(f"cannot read image {path!r}: {exc}") from exc
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grayscale: rescale to 8 bit
        arr = np.asarray(im, dtype=np.float64)
        hi = arr.max() if arr.size and arr.max() > 0 else 1.0
        im = Image.fromarray(np.clip(arr / hi * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode in ("RGBA", "LA", "PA"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, rgba)
    return im.convert("RGB")


def _round14(x: float) -> int:
    return max(PATCH_SIZE, int(round(x / PATCH_SIZE)) * PATCH_SIZE)


def preprocess_image(img: Image.Image, size: int = 518, mode: str = "crop") -> torch.Tensor:
    """VGGT preprocessing of one RGB image -> float32 tensor [3, H, W] in [0, 1].

    ``crop``: resize so the width is ``size`` and the height is the aspect-correct
    height rounded to a multiple of 14, then centre-crop the height to ``size``.
    ``pad``: resize so the longer side is ``size`` (the other rounded to a
    multiple of 14), then pad with white (1.0) to ``size x size``.
    Resampling is bicubic, as in the reference loader.

    Raises:
        ValueError: ``size`` is not a positive multiple of 14, or ``mode`` unknown.
    """
    return _preprocess(img, size, mode)[0]


def _preprocess(img: Image.Image, size: int, mode: str):
    """:func:`preprocess_image` plus the affine (sx, sy, ox, oy) from original to output pixels."""
    if size <= 0 or size % PATCH_SIZE:
        raise ValueError(f"size={size} must be a positive multiple of {PATCH_SIZE} (e.g. 518)")
    if mode not in ("crop", "pad"):
        raise ValueError(f"mode={mode!r} must be 'crop' or 'pad'")
    w, h = img.size
    if mode == "pad" and h > w:
        new_h, new_w = size, _round14(w * size / h)
    else:
        new_w, new_h = size, _round14(h * size / w)
    img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    t = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255.0)
    sx, sy = new_w / w, new_h / h
    # pixel centres: (x + 0.5) * s - 0.5 after resizing
    ox, oy = 0.5 * sx - 0.5, 0.5 * sy - 0.5
    if mode == "crop" and new_h > size:
        top = (new_h - size) // 2
        t = t[:, top:top + size, :]
        oy -= top
    if mode == "pad":
        left, top = (size - t.shape[2]) // 2, (size - t.shape[1]) // 2
        t = _pad_white(t, size, size)
        ox, oy = ox + left, oy + top
    return t.contiguous(), (sx, sy, ox, oy)


def _pad_white(t: torch.Tensor, height: int, width: int) -> torch.Tensor:
    dh, dw = height - t.shape[1], width - t.shape[2]
    if dh <= 0 and dw <= 0:
        return t
    top, left = dh // 2, dw // 2
    return torch.nn.functional.pad(t, (left, dw - left, top, dh - top), mode="constant", value=1.0)


def _unique_names(paths: list[str]) -> list[str]:
    names, seen = [], {}
    for p in paths:
        stem = os.path.splitext(os.path.basename(p))[0]
        stem = re.sub(r"[^\w.\-]+", "_", stem) or "image"
        n = seen.get(stem, 0)
        seen[stem] = n + 1
        names.append(stem if n == 0 else f"{stem}_{n}")
    return names


def load_images(source, size: int = 518, mode: str = "crop", max_frames: int | None = None,
                progress: bool = True) -> LoadedImages:
    """Load a folder (or a list of files) into one VGGT batch.

    Args:
        source: a folder path (images directly inside it are used) or a list of image paths.
        size: target size in pixels, multiple of 14 (518 for the released VGGT-1B).
        mode: ``"crop"`` or ``"pad"`` (see :func:`preprocess_image`).
        max_frames: keep only the first N frames in natural order (None: all).
        progress: show a tqdm bar.

    Returns:
        :class:`LoadedImages` with ``images`` float32 [S, 3, H, W] in [0, 1].

    Raises:
        ImageFolderError: missing/empty folder, unreadable or corrupt image.
        ValueError: bad ``size``, ``mode`` or ``max_frames``.
    """
    from tqdm.auto import tqdm

    if max_frames is not None and max_frames < 1:
        raise ValueError(f"max_frames={max_frames} must be >= 1 (or None for all frames)")
    if isinstance(source, (str, os.PathLike)):
        paths, skipped = list_images(os.fspath(source))
    else:
        paths, skipped = [os.fspath(p) for p in source], []
        if not paths:
            raise ImageFolderError("no image paths given")
    if max_frames is not None:
        paths = paths[:max_frames]
    tensors, sizes, affines = [], [], []
    for p in tqdm(paths, desc="loading images", unit="img", disable=not progress):
        img = read_image(p)
        sizes.append(img.size)
        t, affine = _preprocess(img, size, mode)
        tensors.append(t)
        affines.append(affine)
    height = max(t.shape[1] for t in tensors)
    width = max(t.shape[2] for t in tensors)
    batch = []
    for i, t in enumerate(tensors):  # mixed shapes: pad to the largest with white, centred
        sx, sy, ox, oy = affines[i]
        affines[i] = (sx, sy, ox + (width - t.shape[2]) // 2, oy + (height - t.shape[1]) // 2)
        batch.append(_pad_white(t, height, width))
    return LoadedImages(images=torch.stack(batch), paths=paths, names=_unique_names(paths),
                        original_sizes=sizes, skipped=skipped, mode=mode, affines=affines)
