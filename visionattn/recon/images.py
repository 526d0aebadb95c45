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
import shutil
import stat
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .points import thread_imap

__all__ = [
    "ImageFolderError", "LoadedImages", "PATCH_SIZE", "MAX_ASPECT_RATIO", "natural_key", "list_images",
    "read_image", "to_uint8", "check_aspect", "preprocess_image", "unique_names", "stack_padded",
    "store_frame", "load_images", "DecodeStopped", "check_stop",
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
        image_files: per frame, the file name under ``frames_dir`` holding the
            original-resolution frame (empty when no ``frames_dir`` was given).
        sources: per frame, a human-readable source (file name, or ``video.mp4#frame=12``).
        extra: loader-specific metadata (video: fps, frame indices, timestamps).
    """

    images: torch.Tensor
    paths: list[str]
    names: list[str]
    original_sizes: list[tuple[int, int]]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    mode: str = "crop"
    affines: list[tuple[float, float, float, float]] = field(default_factory=list)
    image_files: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def shape_hw(self) -> tuple[int, int]:
        return int(self.images.shape[-2]), int(self.images.shape[-1])


class DecodeStopped(Exception):
    """Decoding stopped early because the caller asked (the ``stop`` event of :func:`load_images` /
    :func:`~visionattn.recon.video.load_video`)."""


def check_stop(stop) -> None:
    """Raise :class:`DecodeStopped` if ``stop`` (a :class:`threading.Event` or None) is set."""
    if stop is not None and stop.is_set():
        raise DecodeStopped("decoding stopped: the caller no longer needs the frames")


def natural_key(name: str):
    """Sort key putting ``img2`` before ``img10`` (digit runs compared as numbers, text case-folded)."""
    return [(0, int(tok), "") if tok.isdigit() else (1, 0, tok.casefold())
            for tok in re.split(r"(\d+)", name) if tok != ""]


def list_images(folder: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Image files directly inside ``folder``, naturally sorted, and the skipped entries.

    Returns:
        (paths, skipped) where ``skipped`` is a list of (file name, reason) for
        non-image files, sub-folders, unreadable entries and anything that is not a
        regular file (FIFOs, sockets, devices: reading those could block forever).

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
        try:
            mode = os.stat(full).st_mode  # follows links: a link to a regular file is used
        except OSError as exc:
            skipped.append((name, f"cannot be read ({exc.strerror or exc})"))
            continue
        if stat.S_ISDIR(mode):
            skipped.append((name, "sub-folder (not searched)"))
        elif not stat.S_ISREG(mode):  # a FIFO or device would block or never end when read
            skipped.append((name, "not a regular file (FIFO, socket or device)"))
        elif os.path.splitext(name)[1].lower() in _IMAGE_EXTS:
            paths.append(full)
        else:
            skipped.append((name, "not an image file extension"))
    if not paths:
        raise ImageFolderError(
            f"no image files in {folder!r} (looked for {', '.join(sorted(_IMAGE_EXTS))})")
    return paths, skipped


def _check_pixels(path: str, w: int, h: int) -> None:
    limit = Image.MAX_IMAGE_PIXELS
    if limit and w * h > limit:
        raise ImageFolderError(
            f"image {path!r} declares {w}x{h} = {w * h:,} pixels, more than the {limit:,} allowed (a decompression "
            "bomb, or an image far larger than the model needs); downscale it first")


def read_image(path: str) -> Image.Image:
    """Decode ``path`` fully into an 8-bit RGB :class:`PIL.Image.Image`.

    EXIF orientation is applied (phone photos stand upright); images with
    transparency (RGBA, LA, palette with alpha) are composited over white, as in
    VGGT's loader; grayscale / CMYK inputs are converted to RGB. High-bit-depth
    and float images are mapped to 8 bit by their range, not clipped (see
    :func:`to_uint8`).

    Raises:
        ImageFolderError: the file cannot be opened or decoded (corrupt/truncated),
            or it declares more pixels than ``PIL.Image.MAX_IMAGE_PIXELS`` (a
            decompression bomb); checked from the header, before decoding.
    """
    return _decode(path)[0]


def _decode(path: str) -> tuple[Image.Image, bool]:
    """read_image, plus whether the file's own bytes are that RGB image (a plain JPEG / PNG, upright)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # refuse, not just warn
            with Image.open(path) as im:
                _check_pixels(path, *im.size)
                im.load()  # force a full decode: truncated files fail here, not later
                plain = (im.format in ("JPEG", "PNG") and im.mode in ("RGB", "L")
                         and im.getexif().get(0x0112, 1) == 1)
                im = ImageOps.exif_transpose(im)
    except ImageFolderError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageFolderError(f"image {path!r} is a decompression bomb or far larger than the model needs "
                               f"({exc}); downscale it first") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, MemoryError) as exc:
        raise ImageFolderError(f"cannot read image {path!r}: {exc}") from exc
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        im = Image.fromarray(to_uint8(np.asarray(im)), "L")
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode in ("RGBA", "LA", "PA"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, rgba)
    return im.convert("RGB"), plain


def to_uint8(arr: np.ndarray) -> np.ndarray:
    """Map a high-bit-depth or float image [H, W] (or [H, W, C]) to uint8 by its range.

    * float: values in [0, 1] (the usual convention) are scaled by 255; any other
      range is mapped linearly from [min, max] of the finite values to [0, 255].
      Non-finite values become 0.
    * integer: divided by the maximum (``[0, max] -> [0, 255]``; a negative
      minimum extends the range down to it), so a 16-bit image is neither
      clipped nor left dark.

    Returns:
        uint8 array of the same shape.
    """
    a = np.asarray(arr, dtype=np.float64)
    finite = np.isfinite(a)
    if not finite.any():
        return np.zeros(a.shape, np.uint8)
    lo, hi = float(a[finite].min()), float(a[finite].max())
    if np.issubdtype(np.asarray(arr).dtype, np.floating) and lo >= 0.0 and hi <= 1.0:
        lo, hi = 0.0, 1.0
    else:
        lo = min(lo, 0.0) if not np.issubdtype(np.asarray(arr).dtype, np.floating) else lo
    span = hi - lo if hi > lo else 1.0
    out = np.where(finite, (a - lo) / span * 255.0 + 0.5, 0.0)
    return np.clip(out, 0, 255).astype(np.uint8)


MAX_ASPECT_RATIO = 8.0


def check_aspect(width: int, height: int, name: str = "image") -> None:
    """Raise :class:`ImageFolderError` for an empty image or one more elongated than 8:1.

    Such images (a 1-pixel column, a scan strip) carry no usable view for the
    model and, stretched to the model's input width, cost memory out of all
    proportion.
    """
    if width < 1 or height < 1:
        raise ImageFolderError(f"{name} is {width}x{height} pixels: empty")
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageFolderError(
            f"{name} is {width}x{height} pixels (aspect ratio {ratio:.0f}:1); images more elongated than "
            f"{MAX_ASPECT_RATIO:g}:1 are not supported: crop it or leave it out")


def _round14(x: float) -> int:
    return max(PATCH_SIZE, int(round(x / PATCH_SIZE)) * PATCH_SIZE)


def preprocess_image(img: Image.Image, size: int = 518, mode: str = "crop") -> torch.Tensor:
    """VGGT preprocessing of one RGB image -> float32 tensor [3, H, W] in [0, 1].

    ``crop``: resize so the width is ``size`` and the height is the aspect-correct
    height rounded to a multiple of 14, then centre-crop the height to ``size``.
    ``pad``: resize so the longer side is ``size`` (the other rounded to a
    multiple of 14), then pad with white (1.0) to ``size x size``.
    Resampling is bicubic, as in the reference loader.

    The resized image never exceeds ``size x size`` pixels (crop mode resamples
    only the rows it keeps).

    Raises:
        ValueError: ``size`` is not a positive multiple of 14, or ``mode`` unknown.
        ImageFolderError: the image is empty or more elongated than 8:1 (see :func:`check_aspect`).
    """
    return to_unit_float(_preprocess(img, size, mode)[0])


def to_unit_float(t: torch.Tensor) -> torch.Tensor:
    """uint8 pixels [..., 3, H, W] -> float32 in [0, 1] (``x / 255``, one pass over the tensor)."""
    return t.to(torch.float32).div_(255.0)


def _preprocess(img: Image.Image, size: int, mode: str):
    """:func:`preprocess_image` as uint8 [3, H, W] (white padding 255), plus the affine (sx, sy, ox, oy) from
    original to output pixels. The loaders stack the uint8 frames and convert the batch once
    (:func:`stack_padded`): a quarter of the bytes per frame, one float conversion instead of one per frame."""
    if size <= 0 or size % PATCH_SIZE:
        raise ValueError(f"size={size} must be a positive multiple of {PATCH_SIZE} (e.g. 518)")
    if mode not in ("crop", "pad"):
        raise ValueError(f"mode={mode!r} must be 'crop' or 'pad'")
    w, h = img.size
    check_aspect(w, h)
    if mode == "pad" and h > w:
        new_h, new_w = size, _round14(w * size / h)
    else:
        new_w, new_h = size, _round14(h * size / w)
    sx, sy = new_w / w, new_h / h
    # pixel centres: (x + 0.5) * s - 0.5 after resizing
    ox, oy = 0.5 * sx - 0.5, 0.5 * sy - 0.5
    if mode == "crop" and new_h > size:
        # Resample only the rows the centre crop keeps: widths first (PIL's own first pass, so its
        # rounding is kept), then the kept rows through a box. Same pixels as resizing to new_h and
        # cropping, without ever holding the tall intermediate image (new_h can be 8x size).
        top = (new_h - size) // 2
        img = img.resize((new_w, h), Image.Resampling.BICUBIC)
        img = img.resize((new_w, size), Image.Resampling.BICUBIC, box=(0.0, top / sy, float(new_w), (top + size) / sy))
        oy -= top
    else:
        img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    t = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()
    if mode == "pad":
        left, top = (size - t.shape[2]) // 2, (size - t.shape[1]) // 2
        t = _pad_white(t, size, size)
        ox, oy = ox + left, oy + top
    return t, (sx, sy, ox, oy)


def _pad_white(t: torch.Tensor, height: int, width: int) -> torch.Tensor:
    dh, dw = height - t.shape[1], width - t.shape[2]
    if dh <= 0 and dw <= 0:
        return t
    top, left = dh // 2, dw // 2
    white = 255 if t.dtype == torch.uint8 else 1.0
    return torch.nn.functional.pad(t, (left, dw - left, top, dh - top), mode="constant", value=white)


def stack_padded(tensors: list[torch.Tensor], affines: list) -> torch.Tensor:
    """Stack frames [3, h_i, w_i] into float32 [S, 3, H, W] in [0, 1], padding smaller ones with white, centred.

    Frames are uint8 (0-255, converted once for the whole batch, :func:`to_unit_float`) or float32 in [0, 1].
    ``affines`` (per frame (sx, sy, ox, oy)) are shifted in place by each frame's padding offset.
    """
    height = max(t.shape[1] for t in tensors)
    width = max(t.shape[2] for t in tensors)
    batch = []
    for i, t in enumerate(tensors):
        sx, sy, ox, oy = affines[i]
        affines[i] = (sx, sy, ox + (width - t.shape[2]) // 2, oy + (height - t.shape[1]) // 2)
        batch.append(_pad_white(t, height, width))
    stacked = torch.stack(batch)
    return to_unit_float(stacked) if stacked.dtype == torch.uint8 else stacked


def unique_names(paths: list[str]) -> list[str]:
    """Per-file output names: unique (also ignoring case), file-system safe, traceable to the source.

    A file's stem is its name when no other file shares that stem; files that
    share a stem (``a.jpg``, ``a.png``) get the extension appended (``a_jpg``,
    ``a_png``), and a counter only if that is still taken (``a_png`` next to a
    file named ``a_png.tif`` becomes ``a_png_2``). Characters outside
    ``[A-Za-z0-9_.-]`` become ``_``. The output's cameras.json maps each name
    back to its source file.

    Returns:
        list of names, same order and length as ``paths``.
    """
    def clean(text):
        return re.sub(r"[^\w.\-]+", "_", text, flags=re.ASCII).strip(".") or "image"

    stems = [clean(os.path.splitext(os.path.basename(p))[0]) for p in paths]
    counts: dict[str, int] = {}
    for st in stems:
        counts[st.casefold()] = counts.get(st.casefold(), 0) + 1
    names: list[str | None] = [st if counts[st.casefold()] == 1 else None for st in stems]
    used = {n.casefold() for n in names if n is not None}
    for i, p in enumerate(paths):
        if names[i] is not None:
            continue
        ext = clean(os.path.splitext(p)[1].lstrip(".")) if os.path.splitext(p)[1] else "file"
        base = cand = f"{stems[i]}_{ext}"
        k = 2
        while cand.casefold() in used:
            cand, k = f"{base}_{k}", k + 1
        used.add(cand.casefold())
        names[i] = cand
    return names


def store_frame(frames_dir: str, name: str, img: Image.Image, source: str | None = None, ext: str = ".png") -> str:
    """Put one frame into ``frames_dir`` under ``name``; returns the file name used.

    A ``source`` file whose bytes already are the decoded RGB image (plain JPEG /
    PNG, no EXIF rotation) is copied with its extension (``shutil.copy2``: bytes,
    permission bits and times; never a link, so the output shares no storage with
    the user's file and editing one leaves the other alone); anything else (rotated,
    RGBA, 16-bit, float, other formats, video frames) is written as the decoded,
    upright 8-bit RGB with extension ``ext`` (``.png``; ``.jpg`` is saved at quality
    95, as for video frames).
    """
    if source is not None:
        file = f"{name}{os.path.splitext(source)[1].lower()}"
        shutil.copy2(source, os.path.join(frames_dir, file))
        return file
    file = f"{name}{ext}"
    img.save(os.path.join(frames_dir, file), **({"quality": 95} if ext in (".jpg", ".jpeg") else {}))
    return file


def load_images(source, size: int = 518, mode: str = "crop", max_frames: int | None = None,
                progress: bool = True, frames_dir: str | None = None, stop=None, on_first_frame=None) -> LoadedImages:
    """Load a folder (or a list of files) into one VGGT batch.

    Args:
        source: a folder path (images directly inside it are used) or a list of image paths.
        size: target size in pixels, multiple of 14 (518 for the released VGGT-1B).
        mode: ``"crop"`` or ``"pad"`` (see :func:`preprocess_image`).
        max_frames: keep only the first N frames in natural order (None: all).
        progress: show a tqdm bar.
        frames_dir: if given (an existing folder), each frame is stored there under
            its output name (see :func:`store_frame`), for COLMAP / nerfstudio.
        stop: a :class:`threading.Event`: once it is set, loading stops before the next image
            (:class:`DecodeStopped`); for a caller that decodes in a background thread.
        on_first_frame: called once, on this thread, with ``(frames, H, W)``: the images listed and the first
            one's preprocessed size, as soon as it is known (see :func:`~visionattn.recon.video.load_video`).

    Returns:
        :class:`LoadedImages` with ``images`` float32 [S, 3, H, W] in [0, 1].

    Raises:
        ImageFolderError: missing/empty folder, unreadable or corrupt image.
        DecodeStopped: ``stop`` was set.
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
    names = unique_names(paths)

    def listed():
        for i in tqdm(range(len(paths)), desc="loading images", unit="img", disable=not progress):
            check_stop(stop)
            yield i

    def load(i):
        """One image decoded, checked, preprocessed and stored, on a worker thread (PIL's decoders, resampling
        and encoders let go of the GIL, so images load side by side)."""
        img, plain = _decode(paths[i])
        check_aspect(*img.size, name=f"image {paths[i]!r}")
        t, affine = _preprocess(img, size, mode)
        file = store_frame(frames_dir, names[i], img, paths[i] if plain else None) if frames_dir is not None else None
        return img.size, t, affine, file

    Image.init()  # every format plugin imported here: the workers import nothing (see thread_imap)
    tensors, sizes, affines, files = [], [], [], []
    loaded = thread_imap(load, listed(), name="recon-images")
    try:
        for wh, t, affine, file in loaded:
            if on_first_frame is not None and not tensors:
                on_first_frame(len(paths), *t.shape[-2:])
            sizes.append(wh)
            tensors.append(t)
            affines.append(affine)
            if file is not None:
                files.append(file)
    finally:
        loaded.close()  # on an error: the images in flight finish first
    return LoadedImages(images=stack_padded(tensors, affines), paths=paths, names=names, original_sizes=sizes,
                        skipped=skipped, mode=mode, affines=affines, image_files=files,
                        sources=[os.path.basename(p) for p in paths])
