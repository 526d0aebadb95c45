"""ImageNet-1K validation data for tools/eval_imagenet.py: folder layouts, labels in timm's class order.

Layouts read by :func:`scan_imagenet`:

* **ImageFolder**: one folder per WordNet synset, ``DIR/n01440764/ILSVRC2012_val_00000293.JPEG``
  (what the usual ``valprep.sh`` makes). A ``DIR/val/`` holding that layout is found too.
* **flat + LOC_val_solution.csv**: ``DIR/ILSVRC2012_val_00000001.JPEG ...`` with the Kaggle
  localisation-challenge labels (``ImageId,PredictionString``; the first token of the
  prediction string is the synset).
* **flat + devkit ground truth**: the same images with the devkit's
  ``ILSVRC2012_validation_ground_truth.txt`` (line i = ILSVRC2012_ID of image i, 1-based).
  ILSVRC2012_IDs are *not* timm's (sorted-synset) order; they are turned into synsets with the
  devkit's ``meta.mat`` (read with scipy) or a text file with one synset per ILSVRC2012_ID
  (``devkit_synsets``).

Labels become class indices through the synset list of the model's ImageNet subset, taken
from timm (:func:`timm.data.infer_imagenet_subset`, :class:`timm.data.ImageNetInfo`), so a
1k model, a 12k model or a 22k model each get their own order; nothing is hand-written here.

:class:`SyntheticCrops` makes N deterministic random crops + flips of a few real photos
(for speed / agreement runs where no ImageNet copy exists, e.g. a GPU run with random weights).

Needs the ``[eval]`` extra (timm, pillow; scipy for the devkit's meta.mat).
"""
from __future__ import annotations

import math
import os
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from PIL import Image
from torch.utils.data import Dataset

from _harness import read_rgb

__all__ = [
    "DatasetLayoutError", "ImageNetSplit", "SYNSET_RE", "LOC_CSV_NAME", "DEVKIT_GT_NAME",
    "model_synsets", "scan_imagenet", "read_loc_val_solution", "read_devkit_ground_truth",
    "synthetic_sources", "targets_for", "subsample", "ImageListDataset", "SyntheticCrops", "eval_transform",
]

SYNSET_RE = re.compile(r"^n\d{8}$")
LOC_CSV_NAME = "LOC_val_solution.csv"
DEVKIT_GT_NAME = "ILSVRC2012_validation_ground_truth.txt"
_VAL_STEM = "ILSVRC2012_val_{:08d}"

_EXPECTED = (
    "expected one of: (a) ImageFolder: one folder per WordNet synset, e.g. "
    "DIR/n01440764/ILSVRC2012_val_00000293.JPEG (DIR/val/ with that layout also works); "
    "(b) flat: DIR/ILSVRC2012_val_00000001.JPEG ... with labels in LOC_val_solution.csv (Kaggle) or the "
    "devkit's ILSVRC2012_validation_ground_truth.txt (+ its meta.mat, or a synset list via devkit_synsets / "
    "--devkit-synsets), placed in DIR or its parent or given with labels_file / --labels"
)


class DatasetLayoutError(ValueError):
    """The data folder or labels file is not one of the ImageNet layouts; says what was found."""



@dataclass
class ImageNetSplit:
    """A scanned split: ``samples`` is a list of (image path, synset) in a fixed order.

    ``layout`` is ``"imagefolder"``, ``"flat-loc-csv"``, ``"flat-devkit"`` or ``"synthetic"``;
    ``labels_file`` names the labels file used for flat layouts.
    """

    layout: str
    root: str
    samples: list[tuple[str, str]]
    labels_file: str | None = None
    notes: list[str] = field(default_factory=list)


def _image_extensions() -> set[str]:
    from timm.data.readers.img_extensions import get_img_extensions
    return set(get_img_extensions(as_set=True))


def _natural_key(s: str):
    from timm.utils.misc import natural_key
    return natural_key(s)


def _list_dir(root: str) -> tuple[list[str], list[str], list[str]]:
    """(sub-folders, image files, other files) of ``root``, names only, hidden entries skipped."""
    exts = _image_extensions()
    dirs, images, other = [], [], []
    for entry in sorted(os.scandir(root), key=lambda e: _natural_key(e.name)):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            dirs.append(entry.name)
        elif os.path.splitext(entry.name)[1].lower() in exts:
            images.append(entry.name)
        else:
            other.append(entry.name)
    return dirs, images, other


def _examples(names: Sequence[str], k: int = 4) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:k])
    return shown + (f", ... ({len(names)} in all)" if len(names) > k else "")


def _found(root: str, dirs, images, other) -> str:
    parts = [f"{len(dirs)} sub-folder(s)" + (f" ({_examples(dirs)})" if dirs else ""),
             f"{len(images)} image file(s)" + (f" ({_examples(images)})" if images else ""),
             f"{len(other)} other file(s)" + (f" ({_examples(other)})" if other else "")]
    return f"in {root!r}: " + ", ".join(parts)


def model_synsets(model_or_cfg) -> list[str]:
    """Synsets of the model's classes, in the model's output order, from timm's ImageNetInfo.

    Args:
        model_or_cfg: a timm model (``num_classes`` / ``pretrained_cfg``) or a dict with ``num_classes``.

    Returns:
        ``num_classes`` WordNet ids, e.g. ``['n01440764', 'n01443537', ...]`` for ImageNet-1k.

    Raises:
        ValueError: the class count matches no ImageNet subset timm knows (1000, 11221, 11821, 21841,
            21842, 21843): such a head cannot be scored on ImageNet labels.
    """
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset(model_or_cfg)
    if subset is None:
        n = (model_or_cfg.get("num_classes") if isinstance(model_or_cfg, dict)
             else getattr(model_or_cfg, "num_classes", None))
        raise ValueError(f"the model has num_classes={n}, which is not an ImageNet subset timm knows "
                         f"(1000 for ImageNet-1k, 11821 for 12k, 21841/21842/21843 for 22k variants); "
                         f"create it with its ImageNet head (do not pass num_classes=...)")
    return list(ImageNetInfo(subset).label_names())


def read_loc_val_solution(path: str) -> dict[str, str]:
    """Read Kaggle's ``LOC_val_solution.csv``: image id -> synset (first token of PredictionString).

    Raises:
        DatasetLayoutError: missing ``ImageId,PredictionString`` header or a row whose first token is
            not a synset (``n`` + 8 digits).
    """
    import csv

    labels: dict[str, str] = {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["ImageId", "PredictionString"]:
            raise DatasetLayoutError(f"{path}: expected a LOC_val_solution.csv with header "
                                     f"'ImageId,PredictionString', found {header!r}")
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            tokens = row[1].split() if len(row) > 1 else []
            if not tokens or not SYNSET_RE.match(tokens[0]):
                raise DatasetLayoutError(f"{path}:{lineno}: expected 'ImageId,nXXXXXXXX x0 y0 x1 y1 ...', "
                                         f"found {','.join(row)[:80]!r}")
            labels[row[0].strip()] = tokens[0]
    return labels


def _devkit_id_to_synset_from_meta(meta_path: str) -> dict[int, str]:
    try:
        from scipy.io import loadmat
    except ImportError:
        raise DatasetLayoutError(
            f"reading the devkit's {meta_path} needs scipy (`pip install scipy`); or pass a text file with one "
            f"synset per ILSVRC2012_ID (line 1 = ID 1) as devkit_synsets / --devkit-synsets") from None
    synsets = loadmat(meta_path, squeeze_me=True)["synsets"]
    ids = [int(x) for x in synsets["ILSVRC2012_ID"]]
    wnids = [str(x) for x in synsets["WNID"]]
    return {i: w for i, w in zip(ids, wnids)}


def _devkit_id_to_synset_from_text(path: str) -> dict[int, str]:
    mapping = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate((ln for ln in f if ln.strip()), start=1):
            wnid = line.split()[0]
            if not SYNSET_RE.match(wnid):
                raise DatasetLayoutError(f"{path}: line {lineno} should start with a synset (n + 8 digits) for "
                                         f"ILSVRC2012_ID {lineno}, found {line.strip()[:60]!r}")
            mapping[lineno] = wnid
    return mapping


def read_devkit_ground_truth(path: str, devkit_synsets: str | None = None) -> dict[str, str]:
    """Read the devkit's ``ILSVRC2012_validation_ground_truth.txt``: image id -> synset.

    Line i (1-based) holds the ILSVRC2012_ID of ``ILSVRC2012_val_{i:08d}``. IDs are mapped to synsets with
    ``devkit_synsets`` (text, one synset per ID, first token of each line) if given, else the ``meta.mat``
    next to the ground-truth file (the devkit's ``data/`` folder; needs scipy).

    Raises:
        DatasetLayoutError: a line is not an integer, an ID has no synset, or no ID mapping is available.
    """
    if devkit_synsets is None:
        meta = os.path.join(os.path.dirname(os.path.abspath(path)), "meta.mat")
        if not os.path.isfile(meta):
            raise DatasetLayoutError(
                f"{path}: the devkit ground truth holds ILSVRC2012_IDs, whose synsets are in the devkit's meta.mat; "
                f"no meta.mat beside it. Keep the devkit's data/ folder together or pass devkit_synsets / "
                f"--devkit-synsets (one synset per ILSVRC2012_ID)")
        id_to_synset = _devkit_id_to_synset_from_meta(meta)
    else:
        id_to_synset = _devkit_id_to_synset_from_text(devkit_synsets)
    labels = {}
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate((ln for ln in f if ln.strip()), start=1):
            try:
                ilsvrc_id = int(line)
            except ValueError:
                raise DatasetLayoutError(f"{path}: line {i} should be an ILSVRC2012_ID (integer 1..1000), "
                                         f"found {line.strip()[:60]!r}") from None
            if ilsvrc_id not in id_to_synset:
                raise DatasetLayoutError(f"{path}: line {i} has ILSVRC2012_ID {ilsvrc_id}, which the synset list "
                                         f"({len(id_to_synset)} ids) does not name")
            labels[_VAL_STEM.format(i)] = id_to_synset[ilsvrc_id]
    return labels


def _find_labels_file(roots: Sequence[str]) -> str | None:
    for r in roots:
        for rel in (LOC_CSV_NAME, DEVKIT_GT_NAME, os.path.join("ILSVRC2012_devkit_t12", "data", DEVKIT_GT_NAME),
                    os.path.join("data", DEVKIT_GT_NAME)):
            p = os.path.join(r, rel)
            if os.path.isfile(p):
                return p
    return None


def _scan_imagefolder(root: str, dirs: list[str], images: list[str], other: list[str]) -> ImageNetSplit:
    bad = [d for d in dirs if not SYNSET_RE.match(d)]
    if bad or images:
        raise DatasetLayoutError(
            f"mixed layout {_found(root, dirs, images, other)}: synset folders next to "
            + (f"non-synset folders ({_examples(bad)})" if bad else f"loose images ({_examples(images)})")
            + f"; {_EXPECTED}")
    samples = []
    exts = _image_extensions()
    for d in dirs:
        for name in sorted(os.listdir(os.path.join(root, d)), key=_natural_key):
            if os.path.splitext(name)[1].lower() in exts and not name.startswith("."):
                samples.append((os.path.join(root, d, name), d))
    if not samples:
        raise DatasetLayoutError(f"{len(dirs)} synset folders in {root!r} but no images inside; {_EXPECTED}")
    return ImageNetSplit("imagefolder", root, samples)


def scan_imagenet(root: str, labels_file: str | None = None, devkit_synsets: str | None = None) -> ImageNetSplit:
    """Find the ImageNet validation layout under ``root`` and list its (image, synset) samples.

    Args:
        root: the data folder (see the module docstring for the layouts).
        labels_file: for a flat folder, ``LOC_val_solution.csv`` or ``ILSVRC2012_validation_ground_truth.txt``;
            found automatically in ``root``, its parent and ``ILSVRC2012_devkit_t12/data`` there when None.
        devkit_synsets: text file mapping ILSVRC2012_ID (line number) -> synset, for the devkit file without
            scipy / meta.mat.

    Returns:
        :class:`ImageNetSplit`; samples sorted naturally (by synset then file for ImageFolder, by file for flat).

    Raises:
        DatasetLayoutError: ``root`` is none of the layouts, or images lack labels; the message names what was
            found and what is expected.
    """
    if not os.path.isdir(root):
        raise DatasetLayoutError(f"data folder {root!r} does not exist or is not a folder; {_EXPECTED}")
    dirs, images, other = _list_dir(root)
    synset_dirs = [d for d in dirs if SYNSET_RE.match(d)]
    if synset_dirs:
        return _scan_imagefolder(root, dirs, images, other)
    if not images and "val" in dirs:
        inner = os.path.join(root, "val")
        if labels_file is None:
            labels_file = _find_labels_file([inner, root])
        return scan_imagenet(inner, labels_file, devkit_synsets)
    if not images:
        raise DatasetLayoutError(f"no ImageNet layout {_found(root, dirs, images, other)}; {_EXPECTED}")

    # flat layout: images + a labels file
    if labels_file is None:
        labels_file = _find_labels_file([root, os.path.dirname(os.path.abspath(root))])
    if labels_file is None:
        raise DatasetLayoutError(
            f"flat folder of images without a labels file {_found(root, dirs, images, other)}; looked for "
            f"{LOC_CSV_NAME} and {DEVKIT_GT_NAME} in it and its parent; {_EXPECTED}")
    if not os.path.isfile(labels_file):
        raise DatasetLayoutError(f"labels file {labels_file!r} does not exist; {_EXPECTED}")
    if labels_file.lower().endswith(".csv"):
        layout, labels = "flat-loc-csv", read_loc_val_solution(labels_file)
    elif labels_file.lower().endswith(".txt"):
        layout, labels = "flat-devkit", read_devkit_ground_truth(labels_file, devkit_synsets)
    else:
        raise DatasetLayoutError(f"labels file {labels_file!r}: expected {LOC_CSV_NAME} (.csv) or {DEVKIT_GT_NAME} "
                                 f"(.txt)")
    samples, missing = [], []
    for name in images:
        stem = os.path.splitext(name)[0]
        if stem in labels:
            samples.append((os.path.join(root, name), labels[stem]))
        else:
            missing.append(name)
    if missing:
        raise DatasetLayoutError(f"{len(missing)} of {len(images)} images in {root!r} have no label in {labels_file} "
                                 f"({_examples(missing)}); labels there are keyed like {_examples(sorted(labels), 2)}; "
                                 f"{_EXPECTED}")
    notes = []
    if len(labels) > len(samples):
        notes.append(f"{labels_file} labels {len(labels)} images; {len(samples)} are present")
    return ImageNetSplit(layout, root, samples, labels_file, notes)


def synthetic_sources(root: str) -> ImageNetSplit:
    """Source photos for :class:`SyntheticCrops`: an ImageFolder (labels = synset folders) or a flat folder.

    A flat folder of photos (e.g. ``tests/data/photos``) gets placeholder labels: photo k of n (natural
    order) is given timm's ImageNet-1k synset number ``k * 1000 // n``. Such labels mean nothing for
    accuracy; use them for speed and agreement-with-native runs (random weights).

    Raises:
        DatasetLayoutError: no images found.
    """
    if not os.path.isdir(root):
        raise DatasetLayoutError(f"synthetic source folder {root!r} does not exist")
    dirs, images, other = _list_dir(root)
    if any(SYNSET_RE.match(d) for d in dirs):
        split = _scan_imagefolder(root, dirs, images, other)
        split.layout = "synthetic"
        return split
    if not images:
        raise DatasetLayoutError(f"no photos for synthetic crops {_found(root, dirs, images, other)}; expected "
                                 f"image files, or synset folders (n01440764/...) holding them")
    from timm.data import ImageNetInfo

    names = ImageNetInfo("imagenet-1k").label_names()
    samples = [(os.path.join(root, f), names[k * len(names) // len(images)]) for k, f in enumerate(images)]
    return ImageNetSplit("synthetic", root, samples,
                         notes=["placeholder labels: photo k of n -> ImageNet-1k class k*1000//n "
                                "(accuracy meaningless)"])


def targets_for(samples: Sequence[tuple[str, str]], class_synsets: Sequence[str]) -> list[int]:
    """Class index of each sample's synset in ``class_synsets`` (the model's order).

    Raises:
        DatasetLayoutError: some synsets are not among the model's classes (names them).
    """
    index = {s: i for i, s in enumerate(class_synsets)}
    unknown = sorted({s for _, s in samples if s not in index})
    if unknown:
        raise DatasetLayoutError(f"{len(unknown)} synset(s) of the data are not classes of the model "
                                 f"({len(class_synsets)} classes, timm's ImageNetInfo order): {_examples(unknown)}")
    return [index[s] for _, s in samples]


def subsample(n: int, limit: int | None) -> list[int]:
    """``limit`` indices spread evenly over ``range(n)`` (all of them when ``limit`` is None or >= n).

    Evenly spread, not the first ``limit``, so a sorted ImageFolder keeps many classes.
    """
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 1:
        raise ValueError(f"limit={limit} must be >= 1")
    return [i * n // limit for i in range(limit)]


class ImageListDataset(Dataset):
    """(image tensor, class index) for a list of (path, target); images read with PIL, RGB
    (:func:`_harness.read_rgb`: a corrupt file raises its one-line :class:`_harness.CorruptImageError`).

    ``transform`` maps a PIL image to a float tensor [3, H, W] (timm's eval transform).
    """

    def __init__(self, items: Sequence[tuple[str, int]], transform: Callable):
        self.items = list(items)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, target = self.items[i]
        return self.transform(read_rgb(path)), target


class SyntheticCrops(Dataset):
    """``length`` random crops + horizontal flips of a few labelled photos, deterministic per index.

    Item i uses photo ``i % len(sources)`` and a crop drawn from ``random.Random(seed, i)``: area fraction
    uniform in ``scale``, aspect ratio log-uniform in [3/4, 4/3] (as RandomResizedCrop), flip with p = 1/2.
    The crop then goes through ``transform`` (the model's eval transform). Same index -> same tensor in
    every pass and every worker, so passes of different modes see identical inputs.

    Args:
        sources: (path, target) pairs.
        length: number of items.
        transform: PIL image -> tensor [3, H, W].
        seed: base seed.
        scale: (min, max) fraction of the photo's area kept.
    """

    def __init__(self, sources: Sequence[tuple[str, int]], length: int, transform: Callable, seed: int = 0,
                 scale: tuple[float, float] = (0.25, 1.0)):
        if not sources:
            raise ValueError("sources is empty; SyntheticCrops needs at least one photo")
        if length < 1:
            raise ValueError(f"length={length} must be >= 1")
        self.sources = list(sources)
        self.length = length
        self.transform = transform
        self.seed = seed
        self.scale = scale
        self._cache: dict[str, Image.Image] = {}

    def __len__(self) -> int:
        return self.length

    def crop_box(self, i: int, width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
        """(left, top, right, bottom) and flip flag of item ``i`` for a ``width`` x ``height`` photo."""
        rng = random.Random(self.seed * 1_000_003 + i)
        area = width * height * rng.uniform(*self.scale)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = min(width, max(1, round(math.sqrt(area * ratio))))
        h = min(height, max(1, round(math.sqrt(area / ratio))))
        left = rng.randint(0, width - w)
        top = rng.randint(0, height - h)
        return (left, top, left + w, top + h), rng.random() < 0.5

    def __getitem__(self, i: int):
        if not 0 <= i < self.length:
            raise IndexError(i)
        path, target = self.sources[i % len(self.sources)]
        if path not in self._cache:
            self._cache[path] = read_rgb(path)
        photo = self._cache[path]
        box, flip = self.crop_box(i, *photo.size)
        img = photo.crop(box)
        if flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return self.transform(img), target


def eval_transform(model: torch.nn.Module, img_size: int | None = None):
    """timm's eval transform for ``model`` (``resolve_data_config`` + ``create_transform``).

    Returns ``(transform, data_config)``; ``img_size`` overrides the config's input size (square).
    """
    from timm.data import create_transform, resolve_data_config

    args = {"input_size": (3, img_size, img_size)} if img_size is not None else {}
    cfg = resolve_data_config(args, model=model)
    return create_transform(**cfg, is_training=False), cfg

