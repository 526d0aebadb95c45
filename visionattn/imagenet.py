"""ImageNet-1K validation data in its usual layouts, mapped to timm's class order, and the
per-mode evaluation loop behind ``tools/eval_imagenet.py`` (issue 9).

Layouts read by :func:`scan_imagenet`:

* **ImageFolder**: one folder per WordNet synset, ``DIR/n01440764/ILSVRC2012_val_00000293.JPEG``
  (what the usual ``valprep.sh`` makes). A ``DIR/val/`` holding that layout is found too.
* **flat + LOC_val_solution.csv**: ``DIR/ILSVRC2012_val_00000001.JPEG ...`` with the Kaggle
  localisation-challenge labels (``ImageId,PredictionString``; the first token of the
  prediction string is the synset).
* **flat + devkit ground truth**: the same images with the devkit's
  ``ILSVRC2012_validation_ground_truth.txt`` (line i = ILSVRC2012_ID of image i, 1-based).
  ILSVRC2012_IDs are *not* timm's (sorted-synset) order; they are turned into synsets with the
  devkit's ``meta.mat`` (read with scipy, optional) or a text file with one synset per
  ILSVRC2012_ID (``devkit_synsets``).

Labels become class indices through the synset list of the model's ImageNet subset, taken
from timm (:func:`timm.data.infer_imagenet_subset`, :class:`timm.data.ImageNetInfo`), so a
1k model, a 12k model or a 22k model each get their own order; nothing is hand-written here.

:class:`SyntheticCrops` makes N deterministic random crops + flips of a few real photos
(for speed / agreement runs where no ImageNet copy exists, e.g. the GPU run with random weights).

:func:`evaluate_modes` runs one pass over the data per mode (the unpatched "native" model first,
then ``visionattn.patch_model(model, mode=...)`` for each mode) and returns top-1 / top-5,
agreement of predictions with native, max |logit difference| vs native, throughput and peak memory.
"""
from __future__ import annotations

import math
import os
import random
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "NATIVE_HALF_MODES",
    "DatasetLayoutError", "WeightsUnavailableError", "ImageNetSplit", "SYNSET_RE", "LOC_CSV_NAME", "DEVKIT_GT_NAME",
    "model_synsets", "scan_imagenet", "read_loc_val_solution", "read_devkit_ground_truth",
    "synthetic_sources", "targets_for", "subsample", "ImageListDataset", "SyntheticCrops",
    "create_timm_model", "eval_transform", "evaluate_modes", "run_pass",
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


class WeightsUnavailableError(RuntimeError):
    """Pretrained weights cannot be had (offline, not cached); the message names the ways around it."""


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


def _load_rgb(path: str) -> Image.Image:
    with Image.open(path) as im:
        return im.convert("RGB")


class ImageListDataset(Dataset):
    """(image tensor, class index) for a list of (path, target); images read with PIL, RGB.

    ``transform`` maps a PIL image to a float tensor [3, H, W] (timm's eval transform).
    """

    def __init__(self, items: Sequence[tuple[str, int]], transform: Callable):
        self.items = list(items)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, target = self.items[i]
        return self.transform(_load_rgb(path)), target


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
            self._cache[path] = _load_rgb(path)
        photo = self._cache[path]
        box, flip = self.crop_box(i, *photo.size)
        img = photo.crop(box)
        if flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return self.transform(img), target


def _hub_address(pretrained_cfg: dict) -> tuple[str, int] | None:
    """(host, port) the weights of ``pretrained_cfg`` would be downloaded from, None if it names no source."""
    if pretrained_cfg.get("hf_hub_id"):
        from huggingface_hub import constants
        url = urlparse(constants.ENDPOINT)
    elif pretrained_cfg.get("url"):
        url = urlparse(pretrained_cfg["url"])
    else:
        return None
    return url.hostname, url.port or (80 if url.scheme == "http" else 443)


def _reachable(address: tuple[str, int], timeout: float = 5.0) -> bool:
    try:
        socket.create_connection(address, timeout=timeout).close()
        return True
    except OSError:
        return False


def _weights_cached(pretrained_cfg: dict) -> bool:
    repo = pretrained_cfg.get("hf_hub_id")
    if not repo:
        return False
    from huggingface_hub import try_to_load_from_cache

    names = [pretrained_cfg.get("hf_hub_filename")] if pretrained_cfg.get("hf_hub_filename") else \
        ["model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin", "open_clip_model.safetensors"]
    return any(isinstance(try_to_load_from_cache(repo, n), str) for n in names)


def wake_zero_init_norms(model: torch.nn.Module) -> int:
    """Set every all-zero LayerNorm weight of a random-initialized model to 1; return how many.

    timm's Swin-v2 zero-initializes its res-post-norm weights (so each block starts as the
    identity): with random weights its attention then never reaches the logits, and a
    patched-vs-native comparison could not fail. Pretrained models have no such norms.
    """
    woken = 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.weight is not None and not m.weight.any():
                m.weight.fill_(1.0)
                woken += 1
    return woken


def create_timm_model(name: str, *, pretrained: bool = True, checkpoint: str | None = None,
                      img_size: int | None = None, **kwargs) -> torch.nn.Module:
    """``timm.create_model`` in eval mode, with weights from the hub (default), a local file, or none.

    Args:
        name: timm model name (``vit_base_patch16_224``, ``swin_tiny_patch4_window7_224`` ...).
        pretrained: download / load timm's pretrained weights through huggingface_hub (cached).
        checkpoint: local ``.safetensors`` / ``.pth`` with the model's state dict (overrides ``pretrained``).
        img_size: passed to the model constructor when given.
        **kwargs: further constructor arguments (e.g. ``depth=2`` for tiny test models).

    Raises:
        FileNotFoundError: ``checkpoint`` does not exist.
        WeightsUnavailableError: (a RuntimeError) pretrained weights cannot be had (no network, no local
            cache); the message names ``--checkpoint``, ``HF_HUB_OFFLINE=1`` with ``HF_HOME`` and ``--random-weights``.
    """
    import timm

    if img_size is not None:
        kwargs["img_size"] = img_size
    if checkpoint is not None:
        if not os.path.isfile(checkpoint):
            raise FileNotFoundError(f"checkpoint={checkpoint!r} does not exist")
        return timm.create_model(name, pretrained=False, checkpoint_path=checkpoint, **kwargs).eval()
    if not pretrained:
        model = timm.create_model(name, pretrained=False, **kwargs).eval()
        wake_zero_init_norms(model)  # random weights: let every attention layer reach the logits
        return model

    from huggingface_hub import constants

    cfg = timm.models.get_pretrained_cfg(name)
    cfg = cfg.to_dict() if cfg is not None else {}
    fix = (f"pass --checkpoint PATH (a .safetensors/.pth state dict for {name}), or a local hub cache: "
           f"HF_HOME=/path/to/cache (holding {cfg.get('hf_hub_id') or name}) with HF_HUB_OFFLINE=1, or "
           f"--random-weights for a speed / agreement-only run")
    if not constants.HF_HUB_OFFLINE and not _weights_cached(cfg):
        address = _hub_address(cfg)
        if address is not None and not _reachable(address):
            raise WeightsUnavailableError(
                f"cannot download pretrained weights for {name}: {address[0]}:{address[1]} is not reachable "
                f"(offline?) and they are not in the hub cache ({constants.HF_HUB_CACHE}); {fix}")
    try:
        return timm.create_model(name, pretrained=True, **kwargs).eval()
    except (OSError, ValueError, RuntimeError) as e:  # hub errors derive from OSError / ValueError
        raise WeightsUnavailableError(
            f"cannot load pretrained weights for {name}: {type(e).__name__}: {e}; {fix}") from e


def eval_transform(model: torch.nn.Module, img_size: int | None = None):
    """timm's eval transform for ``model`` (``resolve_data_config`` + ``create_transform``).

    Returns ``(transform, data_config)``; ``img_size`` overrides the config's input size (square).
    """
    from timm.data import create_transform, resolve_data_config

    args = {"input_size": (3, img_size, img_size)} if img_size is not None else {}
    cfg = resolve_data_config(args, model=model)
    return create_transform(**cfg, is_training=False), cfg


def _timer(device: torch.device):
    """(start, stop) callables: CUDA events on CUDA (GPU time), perf_counter elsewhere (wall time)."""
    if device.type == "cuda":
        events = []

        def start():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append([e, None])

        def stop():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events[-1][1] = e

        def total() -> float:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in events) / 1000.0
        return start, stop, total, "cuda-events"
    t = [0.0, 0.0]

    def start():
        t[1] = time.perf_counter()

    def stop():
        t[0] += time.perf_counter() - t[1]
    return start, stop, lambda: t[0], "wall"


@torch.inference_mode()
def run_pass(model: torch.nn.Module, loader: DataLoader, device: torch.device | str, *,
             reference_logits: torch.Tensor | None = None, warmup_shapes: Sequence[tuple[int, ...]] = (),
             warmup: int = 1, desc: str = "", keep_logits: bool = False) -> dict[str, Any]:
    """One pass of ``model`` over ``loader``; accuracy, agreement with ``reference_logits``, speed, memory.

    Args:
        model: classifier in eval mode on ``device``; outputs logits [B, C].
        loader: yields (images [B, 3, H, W] float, targets [B] int64) in a fixed order.
        device: where the model runs.
        reference_logits: [N, C] float32 CPU logits of the native run over the same loader (same order);
            when given, agreement of argmax and max |logit difference| are computed.
        warmup_shapes: input shapes run ``warmup`` times on random data before timing (kernel compilation
            and autotuning stay out of the timed region).
        desc: tqdm label.
        keep_logits: return all logits [N, C] (float32, CPU) under ``"logits"``.

    Returns:
        dict with images, top1, top5 (fractions), agree_native, max_abs_logit_diff (None without reference),
        nonfinite_logits, seconds (model time only, data loading excluded), img_per_s, timing
        ("cuda-events" or "wall"), peak_mem_mib (CUDA max allocated during the pass, None on CPU).
    """
    from tqdm.auto import tqdm

    device = torch.device(device)
    for shape in warmup_shapes:
        x = torch.randn(shape, device=device)
        for _ in range(warmup):
            model(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start, stop, total, timing = _timer(device)
    n = correct1 = correct5 = agree = nonfinite = 0
    max_diff = 0.0
    kept = []
    for images, targets in tqdm(loader, desc=desc, unit="batch", leave=False):
        images = images.to(device, non_blocking=True)
        start()
        logits = model(images)
        stop()
        logits = logits.float().cpu()
        b = logits.shape[0]
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        correct1 += (top[:, 0] == targets).sum().item()
        correct5 += (top == targets[:, None]).any(dim=1).sum().item()
        nonfinite += (~torch.isfinite(logits)).sum().item()
        if reference_logits is not None:
            ref = reference_logits[n:n + b]
            agree += (logits.argmax(dim=1) == ref.argmax(dim=1)).sum().item()
            max_diff = max(max_diff, (logits - ref).abs().max().item())
        if keep_logits:
            kept.append(logits)
        n += b
    seconds = total()
    out = {
        "images": n,
        "top1": correct1 / max(n, 1), "top5": correct5 / max(n, 1),
        "agree_native": agree / max(n, 1) if reference_logits is not None else None,
        "max_abs_logit_diff": max_diff if reference_logits is not None else None,
        "nonfinite_logits": nonfinite,
        "seconds": seconds, "img_per_s": n / seconds if seconds > 0 else None, "timing": timing,
        "peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
    }
    if keep_logits:
        out["logits"] = torch.cat(kept) if kept else torch.empty(0)
    return out


# Native attention in half precision: timm's own SDPA call with q, k, v cast to the dtype. The
# agreement of these runs with native FP32 is what the fp16 / bf16 modes should be judged against
# (with random weights, near-tied top-1 logits flip under any half-precision attention).
NATIVE_HALF_MODES = {"native-fp16": torch.float16, "native-bf16": torch.bfloat16}


class _SDPAIn(torch.overrides.TorchFunctionMode):
    """Inside the ``with`` block, run every ``F.scaled_dot_product_attention`` on q, k, v (and a float
    mask) cast to ``dtype``; the output is cast back to q's dtype. ``calls`` counts the cast calls."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.calls = dtype, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            out_dtype = args[0].dtype
            args = tuple(a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in args)
            mask = kwargs.get("attn_mask")
            if isinstance(mask, torch.Tensor) and mask.is_floating_point():
                kwargs["attn_mask"] = mask.to(self.dtype)
            self.calls += 1
            return func(*args, **kwargs).to(out_dtype)
        return func(*args, **kwargs)


@torch.inference_mode()
def _spin_up(model: torch.nn.Module, shape: tuple[int, ...], device, seconds: float = 1.0) -> None:
    """Untimed forwards for ``seconds`` on CUDA before the first (native) pass, so that pass does not
    also carry the GPU's ramp out of idle (clocks, allocator, cuDNN/cuBLAS heuristics); the modes
    after it run on a warm GPU. No-op on CPU."""
    import time

    device = torch.device(device)
    if device.type != "cuda":
        return
    x = torch.randn(shape, device=device)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        model(x)
        torch.cuda.synchronize(device)


def evaluate_modes(model: torch.nn.Module, loader: DataLoader, modes: Sequence[str], device: torch.device | str,
                   *, warmup: int = 1, desc: str = "", patch_options: dict | None = None) -> list[dict[str, Any]]:
    """Native pass, then one pass per visionattn mode, on the same model and data.

    "native" is ``model`` unpatched (timm's own attention) in its own precision; every other mode runs
    ``visionattn.patch_model(model, mode=mode, **patch_options)`` for its pass and
    ``visionattn.unpatch_model(model)`` after it (also on error). Predictions and logits of each mode are
    compared with the native run over the identical inputs (``loader`` must be deterministic, unshuffled).

    Args:
        model: timm classifier in eval mode, on ``device``, not patched.
        loader: deterministic DataLoader of (images, targets).
        modes: names from ``visionattn.mode_names()``, ``"native"`` (always runs first: it is the
            reference, reported once) and/or ``"native-fp16"`` / ``"native-bf16"`` (timm's own SDPA
            with q, k, v cast to half: the agreement a half-precision attention can be expected to reach).
        device: where the model runs.
        warmup: untimed warm-up forwards per input shape before each pass.
        desc: prefix of the progress-bar labels (e.g. the model name).
        patch_options: extra keyword arguments of ``patch_model``.

    Returns:
        One dict per mode (native first): ``mode`` plus :func:`run_pass`'s fields, ``speedup_vs_native``,
        ``patch_report`` (``model.visionattn_report.as_dict()`` after patching, None for native) and
        ``patched_modules`` (attention modules running visionattn in that pass; 0 would mean the mode's
        numbers are timm's own).

    Raises:
        ValueError: an unknown mode name.
    """
    import visionattn as va

    unknown = [m for m in modes if m != "native" and m not in NATIVE_HALF_MODES and m not in va.mode_names()]
    if unknown:
        raise ValueError(f"modes {unknown} are not known; expected 'native', one of {list(NATIVE_HALF_MODES)} "
                         f"or one of {va.mode_names()}")
    n = len(loader.dataset)
    bs = loader.batch_size or 1
    shape = tuple(loader.dataset[0][0].shape)
    warmup_shapes = [(min(bs, n), *shape)] + ([(n % bs, *shape)] if n > bs and n % bs else [])
    _spin_up(model, warmup_shapes[0], device)
    native = run_pass(model, loader, device, warmup_shapes=warmup_shapes, warmup=warmup,
                      desc=f"{desc} native".strip(), keep_logits=True)
    ref = native.pop("logits")
    native.update(mode="native", speedup_vs_native=1.0, patch_report=None, patched_modules=0)
    results = [native]
    for mode in modes:
        if mode == "native":
            continue
        if mode in NATIVE_HALF_MODES:
            with _SDPAIn(NATIVE_HALF_MODES[mode]) as cast:
                r = run_pass(model, loader, device, reference_logits=ref, warmup_shapes=warmup_shapes,
                             warmup=warmup, desc=f"{desc} {mode}".strip())
            r.update(mode=mode, patch_report=None, patched_modules=0, sdpa_calls_cast=cast.calls,
                     speedup_vs_native=(r["img_per_s"] / native["img_per_s"]
                                        if r["img_per_s"] and native["img_per_s"] else None))
            results.append(r)
            continue
        va.patch_model(model, mode=mode, **(patch_options or {}))
        try:
            r = run_pass(model, loader, device, reference_logits=ref, warmup_shapes=warmup_shapes, warmup=warmup,
                         desc=f"{desc} {mode}".strip())
            report = model.visionattn_report
        finally:
            va.unpatch_model(model)
        r.update(mode=mode, patch_report=report.as_dict(), patched_modules=report.num_patched,
                 speedup_vs_native=(r["img_per_s"] / native["img_per_s"]
                                    if r["img_per_s"] and native["img_per_s"] else None))
        results.append(r)
    return results
