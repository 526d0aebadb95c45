#!/usr/bin/env python
"""ImageNet-1K validation accuracy and speed of timm models in every visionattn mode.

Per model x mode, one pass over the data: top-1, top-5, agreement of predictions with the native run (timm's own
attention, same model, FP32), max |logit difference| vs native, img/s of the forward alone (CUDA events on a GPU,
wall time on CPU; warm-up forwards untimed) and peak CUDA memory. native-fp16 / native-bf16: timm's own SDPA on
q, k, v cast to half, the agreement a half-precision attention can be expected to reach. TF32 is off while it runs.

Data (``--data DIR``): an ImageFolder of synset folders (``n01440764/...``, also under ``DIR/val``), or flat
``ILSVRC2012_val_*.JPEG`` files with ``LOC_val_solution.csv`` or the devkit's
``ILSVRC2012_validation_ground_truth.txt`` (+ its ``meta.mat``, or ``--devkit-synsets``); labels map to the model's
class order through timm's ImageNetInfo. Without ImageNet (``--synthetic-from DIR --limit N``): N deterministic random
crops + flips of the photos in DIR (synset folders give real labels; a flat folder placeholder labels, so only
agreement and speed mean anything):

    python tools/eval_imagenet.py --random-weights --synthetic-from tests/data/photos --limit 512 \\
        --model vit_base_patch16_224 --model swin_tiny_patch4_window7_224 --out out/imagenet.json

Writes ``--out`` (JSON) and the same name with ``.md``. Needs the [eval] extra.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import re
import sys
import time
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers (_harness, ...)
from _harness import (CorruptImageError, ImageList, Stopwatch, ToolParser, add_common, check_device,  # noqa: E402
                      check_output, comma_list, default_out, environment, json_object, markdown_table, md_header,
                      nonnegative_int, output_files, positive_int, read_rgb, tf32_flags)
from _timm_models import WeightsUnavailableError, create_timm_model, model_problem, weights_problem  # noqa: E402

from visionattn.modes import MODES  # noqa: E402

SYNTHETIC_DEFAULT = 256
SYNSET_RE = re.compile(r"^n\d{8}$")
LOC_CSV_NAME = "LOC_val_solution.csv"
DEVKIT_GT_NAME = "ILSVRC2012_validation_ground_truth.txt"
_EXPECTED = (
    "expected one of: (a) ImageFolder: one folder per WordNet synset, e.g. "
    "DIR/n01440764/ILSVRC2012_val_00000293.JPEG (DIR/val/ with that layout also works); "
    "(b) flat: DIR/ILSVRC2012_val_00000001.JPEG ... with labels in LOC_val_solution.csv (Kaggle) or the "
    "devkit's ILSVRC2012_validation_ground_truth.txt (+ its meta.mat, or a synset list via devkit_synsets / "
    "--devkit-synsets), placed in DIR or its parent or given with labels_file / --labels")


# ----------------------------------------------------------------------------- data: layouts and labels
class DatasetLayoutError(ValueError):
    """The data folder or labels file is not one of the ImageNet layouts; says what was found."""


class ImageNetSplit:
    """(image path, synset) ``samples`` in a fixed order; ``layout``: imagefolder, flat-loc-csv, flat-devkit or
    synthetic; ``labels_file``: that of a flat layout."""

    def __init__(self, layout: str, root: str, samples: list[tuple[str, str]], labels_file: str | None = None,
                 notes: list[str] | None = None):
        self.layout, self.root, self.samples, self.labels_file = layout, root, samples, labels_file
        self.notes = notes or []


def _list_dir(root: str) -> tuple[list[str], list[str], list[str]]:
    """(sub-folders, image files, other files) of ``root`` in natural order, hidden entries skipped."""
    from timm.data.readers.img_extensions import get_img_extensions
    from timm.utils.misc import natural_key

    dirs, images, other = [], [], []
    for entry in sorted(os.scandir(root), key=lambda e: natural_key(e.name)):
        if not entry.name.startswith("."):
            image = os.path.splitext(entry.name)[1].lower() in get_img_extensions(as_set=True)
            (dirs if entry.is_dir() else images if image else other).append(entry.name)
    return dirs, images, other


def _examples(names: Sequence[str], k: int = 4) -> str:
    return ", ".join(repr(n) for n in list(names)[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


def _found(root: str, dirs, images, other) -> str:
    return f"in {root!r}: " + ", ".join(f"{len(names)} {what}" + (f" ({_examples(names)})" if names else "") for
                                        what, names in (("sub-folder(s)", dirs), ("image file(s)", images),
                                                        ("other file(s)", other)))


def model_synsets(model_or_cfg) -> list[str]:
    """Synsets of the model's classes in its output order (timm's ImageNetInfo); ValueError for a head that is no
    ImageNet subset timm knows."""
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
    """Kaggle's ``LOC_val_solution.csv``: image id -> synset (first token of PredictionString)."""
    import csv

    labels: dict[str, str] = {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["ImageId", "PredictionString"]:
            raise DatasetLayoutError(f"{path}: expected a LOC_val_solution.csv with header "
                                     f"'ImageId,PredictionString', found {header!r}")
        for lineno, row in enumerate(filter(None, reader), start=2):
            tokens = row[1].split() if len(row) > 1 else []
            if not tokens or not SYNSET_RE.match(tokens[0]):
                raise DatasetLayoutError(f"{path}:{lineno}: expected 'ImageId,nXXXXXXXX x0 y0 x1 y1 ...', "
                                         f"found {','.join(row)[:80]!r}")
            labels[row[0].strip()] = tokens[0]
    return labels


def read_devkit_ground_truth(path: str, devkit_synsets: str | None = None) -> dict[str, str]:
    """The devkit's ``ILSVRC2012_validation_ground_truth.txt`` (line i: the ILSVRC2012_ID of image i): image id ->
    synset, the IDs mapped by ``devkit_synsets`` (one synset per ID, line 1 = ID 1) or the ``meta.mat`` beside it."""
    if devkit_synsets is None:
        meta = os.path.join(os.path.dirname(os.path.abspath(path)), "meta.mat")
        if not os.path.isfile(meta):
            raise DatasetLayoutError(
                f"{path}: the devkit ground truth holds ILSVRC2012_IDs, whose synsets are in the devkit's meta.mat; "
                f"no meta.mat beside it. Keep the devkit's data/ folder together or pass devkit_synsets / "
                f"--devkit-synsets (one synset per ILSVRC2012_ID)")
        try:
            from scipy.io import loadmat
        except ImportError:
            raise DatasetLayoutError(f"reading the devkit's {meta} needs scipy (`pip install scipy`); or pass a text "
                                     f"file with one synset per ILSVRC2012_ID as --devkit-synsets") from None
        synsets = loadmat(meta, squeeze_me=True)["synsets"]
        id_to_synset = {int(i): str(w) for i, w in zip(synsets["ILSVRC2012_ID"], synsets["WNID"])}
    else:
        with open(devkit_synsets, encoding="utf-8") as f:
            id_to_synset = {n: line.split()[0] for n, line in enumerate((ln for ln in f if ln.strip()), start=1)}
        bad = next(((n, w) for n, w in id_to_synset.items() if not SYNSET_RE.match(w)), None)
        if bad:
            raise DatasetLayoutError(f"{devkit_synsets}: line {bad[0]} should start with a synset (n + 8 digits) for "
                                     f"ILSVRC2012_ID {bad[0]}, found {bad[1][:60]!r}")
    labels = {}
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate((ln for ln in f if ln.strip()), start=1):
            try:
                labels[f"ILSVRC2012_val_{i:08d}"] = id_to_synset[int(line)]
            except ValueError:
                raise DatasetLayoutError(f"{path}: line {i} should be an ILSVRC2012_ID (integer 1..1000), "
                                         f"found {line.strip()[:60]!r}") from None
            except KeyError:
                raise DatasetLayoutError(f"{path}: line {i} has ILSVRC2012_ID {int(line)}, which the synset list "
                                         f"({len(id_to_synset)} ids) does not name") from None
    return labels


def _find_labels_file(roots: Sequence[str]) -> str | None:
    rels = (LOC_CSV_NAME, DEVKIT_GT_NAME, os.path.join("ILSVRC2012_devkit_t12", "data", DEVKIT_GT_NAME),
            os.path.join("data", DEVKIT_GT_NAME))
    return next((p for r in roots for p in (os.path.join(r, rel) for rel in rels) if os.path.isfile(p)), None)


def _scan_imagefolder(root: str, dirs: list[str], images: list[str], other: list[str]) -> ImageNetSplit:
    bad = [d for d in dirs if not SYNSET_RE.match(d)]
    if bad or images:
        raise DatasetLayoutError(
            f"mixed layout {_found(root, dirs, images, other)}: synset folders next to "
            + (f"non-synset folders ({_examples(bad)})" if bad else f"loose images ({_examples(images)})")
            + f"; {_EXPECTED}")
    samples = [(os.path.join(root, d, name), d) for d in dirs for name in _list_dir(os.path.join(root, d))[1]]
    if not samples:
        raise DatasetLayoutError(f"{len(dirs)} synset folders in {root!r} but no images inside; {_EXPECTED}")
    return ImageNetSplit("imagefolder", root, samples)


def scan_imagenet(root: str, labels_file: str | None = None, devkit_synsets: str | None = None) -> ImageNetSplit:
    """The (image, synset) samples of the ImageNet validation layout under ``root`` (see the module docstring);
    a flat folder's ``labels_file`` is found in ``root``, its parent and the devkit's ``data/`` there when None.
    DatasetLayoutError names what was found and what is expected."""
    if not os.path.isdir(root):
        raise DatasetLayoutError(f"data folder {root!r} does not exist or is not a folder; {_EXPECTED}")
    dirs, images, other = _list_dir(root)
    if any(SYNSET_RE.match(d) for d in dirs):
        return _scan_imagefolder(root, dirs, images, other)
    if not images and "val" in dirs:
        inner = os.path.join(root, "val")
        return scan_imagenet(inner, labels_file or _find_labels_file([inner, root]), devkit_synsets)
    if not images:
        raise DatasetLayoutError(f"no ImageNet layout {_found(root, dirs, images, other)}; {_EXPECTED}")
    labels_file = labels_file or _find_labels_file([root, os.path.dirname(os.path.abspath(root))])
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
    missing = [name for name in images if os.path.splitext(name)[0] not in labels]
    if missing:
        raise DatasetLayoutError(f"{len(missing)} of {len(images)} images in {root!r} have no label in {labels_file} "
                                 f"({_examples(missing)}); labels there are keyed like {_examples(sorted(labels), 2)}; "
                                 f"{_EXPECTED}")
    samples = [(os.path.join(root, name), labels[os.path.splitext(name)[0]]) for name in images]
    notes = [f"{labels_file} labels {len(labels)} images; {len(samples)} are present"] * (len(labels) > len(samples))
    return ImageNetSplit(layout, root, samples, labels_file, notes)


def synthetic_sources(root: str) -> ImageNetSplit:
    """Source photos of :class:`SyntheticCrops`: an ImageFolder (labels = synset folders), or a flat folder whose
    photo k of n gets the placeholder label ImageNet-1k class ``k * 1000 // n`` (accuracy meaningless)."""
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
    """Class index of each sample's synset in ``class_synsets`` (the model's order)."""
    index = {s: i for i, s in enumerate(class_synsets)}
    unknown = sorted({s for _, s in samples if s not in index})
    if unknown:
        raise DatasetLayoutError(f"{len(unknown)} synset(s) of the data are not classes of the model "
                                 f"({len(class_synsets)} classes, timm's ImageNetInfo order): {_examples(unknown)}")
    return [index[s] for _, s in samples]


def subsample(n: int, limit: int | None) -> list[int]:
    """``limit`` indices spread evenly over ``range(n)`` (so a sorted ImageFolder keeps many classes); all of them
    when ``limit`` is None or >= n."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 1:
        raise ValueError(f"limit={limit} must be >= 1")
    return [i * n // limit for i in range(limit)]


class SyntheticCrops(Dataset):
    """``length`` random crops + horizontal flips of (path, target) photos through ``transform``, deterministic per
    index (every pass and worker sees the same tensor): item i crops photo ``i % len(sources)`` with
    ``random.Random(seed * 1_000_003 + i)``: area fraction uniform in ``scale``, aspect ratio log-uniform in
    [3/4, 4/3] (as RandomResizedCrop), flip with p = 1/2."""

    def __init__(self, sources: Sequence[tuple[str, int]], length: int, transform: Callable, seed: int = 0,
                 scale: tuple[float, float] = (0.25, 1.0)):
        self.sources, self.length, self.transform, self.seed, self.scale = list(sources), length, transform, seed, scale
        self._cache: dict = {}

    def __len__(self) -> int:
        return self.length

    def crop_box(self, i: int, width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
        """(left, top, right, bottom) and flip flag of item ``i`` for a ``width`` x ``height`` photo."""
        rng = random.Random(self.seed * 1_000_003 + i)
        area = width * height * rng.uniform(*self.scale)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w = min(width, max(1, round(math.sqrt(area * ratio))))
        h = min(height, max(1, round(math.sqrt(area / ratio))))
        left, top = rng.randint(0, width - w), rng.randint(0, height - h)
        return (left, top, left + w, top + h), rng.random() < 0.5

    def __getitem__(self, i: int):
        from PIL import Image

        if not 0 <= i < self.length:
            raise IndexError(i)
        path, target = self.sources[i % len(self.sources)]
        if path not in self._cache:
            self._cache[path] = read_rgb(path)
        photo = self._cache[path]
        box, flip = self.crop_box(i, *photo.size)
        img = photo.crop(box)
        return self.transform(img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else img), target


# ----------------------------------------------------------------------------- evaluation
@torch.inference_mode()
def run_pass(model: torch.nn.Module, loader: DataLoader, device, *, reference_logits: torch.Tensor | None = None,
             warmup_shapes: Sequence[tuple[int, ...]] = (), warmup: int = 1, desc: str = "",
             keep_logits: bool = False) -> dict[str, Any]:
    """One pass of ``model`` over ``loader`` (after ``warmup`` untimed forwards of random data per shape of
    ``warmup_shapes``): images, top1, top5, agree_native and max_abs_logit_diff against ``reference_logits`` (the
    native run's [N, C] CPU logits, same order; None without), nonfinite_logits, seconds of the forwards alone,
    img_per_s, timing, peak_mem_mib (CUDA); ``keep_logits``: also all logits (float32, CPU) as ``logits``."""
    from tqdm.auto import tqdm

    device = torch.device(device)
    for shape in warmup_shapes:
        x = torch.randn(shape, device=device)
        for _ in range(warmup):
            model(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    watch = Stopwatch(device)
    n = correct1 = correct5 = agree = nonfinite = 0
    max_diff, kept = 0.0, []
    for images, targets in tqdm(loader, desc=desc, unit="batch", leave=False):
        images = images.to(device, non_blocking=True)
        with watch:
            logits = model(images)
        logits = logits.float().cpu()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        correct1 += (top[:, 0] == targets).sum().item()
        correct5 += (top == targets[:, None]).any(dim=1).sum().item()
        nonfinite += (~torch.isfinite(logits)).sum().item()
        if reference_logits is not None:
            ref = reference_logits[n:n + len(logits)]
            agree += (logits.argmax(dim=1) == ref.argmax(dim=1)).sum().item()
            max_diff = max(max_diff, (logits - ref).abs().max().item())
        if keep_logits:
            kept.append(logits)
        n += len(logits)
    seconds, compared = watch.seconds, reference_logits is not None
    out = {"images": n, "top1": correct1 / max(n, 1), "top5": correct5 / max(n, 1),
           "agree_native": agree / max(n, 1) if compared else None,
           "max_abs_logit_diff": max_diff if compared else None,
           "nonfinite_logits": nonfinite, "seconds": seconds, "img_per_s": n / seconds if seconds > 0 else None,
           "timing": watch.kind,
           "peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}
    if keep_logits:
        out["logits"] = torch.cat(kept) if kept else torch.empty(0)
    return out


# timm's own SDPA with q, k, v cast to half: what the fp16 / bf16 modes' agreement is judged against (with random
# weights, near-tied top-1 logits flip under any half-precision attention)
NATIVE_HALF_MODES = {"native-fp16": torch.float16, "native-bf16": torch.bfloat16}
# the default --modes: native, every production mode of the table (not fp16-acc16, the unshifted FP16-accumulation
# baseline), the native-half references
ALL_MODES = ",".join(["native", *(m for m, spec in MODES.items() if spec.pasa_shift or not spec.half_scores),
                      *NATIVE_HALF_MODES])


class _SDPAIn(torch.overrides.TorchFunctionMode):
    """Inside the block, every ``F.scaled_dot_product_attention`` runs on q, k, v (and a float mask) cast to
    ``dtype``, its output cast back to q's dtype; ``calls`` counts them."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.calls = dtype, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        out_dtype = args[0].dtype
        cast = lambda a: a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa
        args = tuple(cast(a) for a in args)
        if "attn_mask" in kwargs:
            kwargs["attn_mask"] = cast(kwargs["attn_mask"])
        self.calls += 1
        return func(*args, **kwargs).to(out_dtype)


def evaluate_modes(model: torch.nn.Module, loader: DataLoader, modes: Sequence[str], device, *, warmup: int = 1,
                   desc: str = "") -> list[dict[str, Any]]:
    """The native pass (``model`` unpatched, always first: the reference), then one pass per other mode of ``modes``
    on the same model and (deterministic, unshuffled) data: a visionattn mode patched in
    (``patch_model(model, mode)``, unpatched after it), a native-half mode under :class:`_SDPAIn`.
    Each row: ``mode``, :func:`run_pass`'s fields, ``speedup_vs_native``, ``patch_report``, ``patched_modules``
    (0: the numbers are timm's own) and, native-half, ``sdpa_calls_cast``."""
    import visionattn as va

    n, bs = len(loader.dataset), loader.batch_size or 1
    shape = tuple(loader.dataset[0][0].shape)
    warmup_shapes = [(min(bs, n), *shape)] + ([(n % bs, *shape)] if n > bs and n % bs else [])
    if torch.device(device).type == "cuda":  # the GPU's ramp out of idle (clocks, heuristics) before the native pass
        with torch.inference_mode():
            x, t0 = torch.randn(warmup_shapes[0], device=device), time.perf_counter()
            while time.perf_counter() - t0 < 1.0:
                model(x)
                torch.cuda.synchronize(device)
    kw = dict(warmup_shapes=warmup_shapes, warmup=warmup)
    native = run_pass(model, loader, device, desc=f"{desc} native".strip(), keep_logits=True, **kw)
    ref = native.pop("logits")
    native.update(mode="native", speedup_vs_native=1.0, patch_report=None, patched_modules=0)
    results = [native]
    for mode in (m for m in modes if m != "native"):
        if mode in NATIVE_HALF_MODES:
            with _SDPAIn(NATIVE_HALF_MODES[mode]) as cast:
                r = run_pass(model, loader, device, reference_logits=ref, desc=f"{desc} {mode}".strip(), **kw)
            r.update(patch_report=None, patched_modules=0, sdpa_calls_cast=cast.calls)
        else:
            va.patch_model(model, mode=mode)
            try:
                r = run_pass(model, loader, device, reference_logits=ref, desc=f"{desc} {mode}".strip(), **kw)
                report = model.visionattn_report
            finally:
                va.unpatch_model(model)
            r.update(patch_report=report.as_dict(), patched_modules=report.num_patched)
        r.update(mode=mode, speedup_vs_native=(r["img_per_s"] / native["img_per_s"]
                                               if r["img_per_s"] and native["img_per_s"] else None))
        results.append(r)
    return results


# ----------------------------------------------------------------------------- report / main
def to_markdown(res: dict) -> str:
    env, d = res["environment"], res["data"]
    lines = md_header(
        "ImageNet evaluation: accuracy, agreement with native attention, speed per mode",
        dict(env, command=res["command"]), f"visionattn {res['visionattn']}",
        f"process-wide options: {', '.join(f'{k}={v}' for k, v in res['process_options'].items())}",
        f"data: {d['layout']} at `{d['root']}`, {d['images']} images"
        + (f" (labels: `{d['labels_file']}`)" if d.get("labels_file") else "")
        + ("; " + "; ".join(d["notes"]) if d.get("notes") else ""),
        "agreement = share of images whose top-1 class equals the native run's; max \\|Δlogit\\| vs native; "
        f"img/s from {res['results'][0]['timing'] if res['results'] else '-'} timing of the forward only")
    opt = lambda x, f="{}": "-" if x is None else f.format(x)  # noqa: E731
    for name, info in res["models"].items():
        mine = [r for r in res["results"] if r["model"] == name]
        rows = [[r["mode"], r["patched_modules"], 100 * r["top1"], 100 * r["top5"],
                 opt(r["agree_native"] and 100 * r["agree_native"], "{:.2f}"), opt(r["max_abs_logit_diff"], "{:.3g}"),
                 r["nonfinite_logits"], opt(r["img_per_s"], "{:.1f}"), opt(r["speedup_vs_native"], "{:.2f}x"),
                 opt(r["peak_mem_mib"], "{:.0f}")] for r in mine]
        lines += [f"\n## {name}\n",
                  f"weights: {info['weights']}; input {info['input_size']}; {info['params_m']:.2f} M params\n",
                  markdown_table(rows, ["mode", "patched modules", "top-1 %", "top-5 %", "agree w/ native %",
                                        r"max \|Δlogit\|", "non-finite", "img/s", "vs native", "peak MiB"])]
        uncast = [r["mode"] for r in mine if r.get("sdpa_calls_cast") == 0]
        if uncast:
            lines.append(f"\n{' / '.join(uncast)}: the model made no `scaled_dot_product_attention` call (its "
                         f"attention runs eagerly, as timm's Swin and Swin-v2 do by default), so nothing was "
                         f"cast: these rows are the native FP32 model again, not a half-precision reference.\n")
    return "\n".join(lines)


def build_parser() -> ToolParser:
    p = ToolParser(prog="eval_imagenet.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="timm model name; repeat for several models")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="ImageNet validation folder (ImageFolder of synset folders, or flat val/ "
                                    "with LOC_val_solution.csv / devkit ground truth)")
    src.add_argument("--synthetic-from", metavar="DIR",
                     help="build --limit random crops/flips of the photos in DIR instead of reading ImageNet")
    p.add_argument("--labels", help="labels file of a flat folder (LOC_val_solution.csv or "
                                    "ILSVRC2012_validation_ground_truth.txt); found automatically if omitted")
    p.add_argument("--devkit-synsets", help="text file, one synset per ILSVRC2012_ID (line 1 = ID 1), for the "
                                            "devkit ground truth when meta.mat / scipy is not available")
    p.add_argument("--modes", default=ALL_MODES, help="comma-separated modes; 'native' = timm's own attention "
                                                      "(always run as reference). Default %(default)s")
    p.add_argument("--img-size", type=positive_int, help="input size (square); default: the model's pretrained config")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per batch (default 64)")
    p.add_argument("--workers", type=nonnegative_int, default=min(8, os.cpu_count() or 1),
                   help="DataLoader worker processes (default min(8, CPUs))")
    p.add_argument("--limit", type=positive_int, help="use N images spread evenly over the data set (with "
                   f"--synthetic-from: the number of crops, default {SYNTHETIC_DEFAULT})")
    p.add_argument("--checkpoint", help="local .safetensors/.pth state dict to load (one --model only)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights instead of timm's pretrained ones (through the hub cache)")
    p.add_argument("--model-kwargs", type=json_object, default={},
                   help='JSON dict of extra timm.create_model arguments, e.g. \'{"depth": 2}\' for tiny test models')
    add_common(p, device="cuda" if torch.cuda.is_available() else "cpu", seed=0, warmup=(2, "untimed forwards per "
               "input shape and mode"), out=(default_out("eval_imagenet.json"), "output JSON path; markdown goes next "
               "to it (.md) (default: %(default)s)"))
    return p


def check_args(parser: ToolParser, args) -> list[str]:
    """Every argument checked before any work (exit 2 with one line); returns the modes."""
    modes = comma_list(parser, "--modes", args.modes, ["native", *NATIVE_HALF_MODES, *MODES])
    if args.checkpoint and len(args.model) > 1:
        parser.error("--checkpoint applies to one model; pass a single --model with it")
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint!r} does not exist; pass a .safetensors/.pth state dict")
    check_device(parser, args.device)
    for name in args.model:
        problem = model_problem(name, args.img_size, **args.model_kwargs)
        if problem:
            what, reason = problem
            flag = {"name": "--model", "input": "--img-size" if args.img_size else "--model"}.get(
                what, "--model-kwargs / --img-size" if args.img_size else "--model-kwargs")
            parser.error(f"{flag}: {reason}")
        problem = not args.random_weights and not args.checkpoint and weights_problem(name)
        if problem:
            parser.error(f"--model {name}: {problem}")
    folder = args.data or args.synthetic_from
    if not os.path.isdir(folder):
        parser.error(f"{'--data' if args.data else '--synthetic-from'} {folder!r} is not a folder")
    check_output(parser, args.out)
    return modes


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the evaluation; returns the results dict also written to ``--out`` (JSON) and ``.md``."""
    import shlex

    import visionattn as va
    from timm.data import create_transform, resolve_data_config

    parser = build_parser()
    args = parser.parse_args(argv)
    modes = check_args(parser, args)
    md = os.path.splitext(args.out)[0] + ".md"
    outputs = output_files(parser, [args.out, md], tool="eval_imagenet")
    pretrained = not args.random_weights and not args.checkpoint
    device = torch.device(args.device)
    data_flag = "--data" if args.data else "--synthetic-from"
    try:
        split = (synthetic_sources(args.synthetic_from) if args.synthetic_from
                 else scan_imagenet(args.data, args.labels, args.devkit_synsets))
    except DatasetLayoutError as e:
        parser.error(f"{data_flag}: {e}")
    argv_used = sys.argv[1:] if argv is None else list(argv)
    res = {"environment": environment(), "visionattn": va.__version__,
           "command": " ".join(shlex.quote(a) for a in ["python", "tools/eval_imagenet.py", *argv_used]),
           "process_options": None, "modes": modes, "models": {}, "results": [],
           "data": {"layout": split.layout, "root": split.root, "labels_file": split.labels_file,
                    "notes": split.notes, "images": None}}
    with tf32_flags() as process_options:
        res["process_options"] = process_options
        for name in args.model:
            torch.manual_seed(args.seed)
            try:
                model = create_timm_model(name, pretrained=pretrained, checkpoint=args.checkpoint,
                                          img_size=args.img_size, **args.model_kwargs).to(device)
            except WeightsUnavailableError as e:
                parser.error(f"--model {name}: {e}")
            try:  # timm's eval transform; targets in the model's class order
                size = {"input_size": (3, args.img_size, args.img_size)} if args.img_size else {}
                data_cfg = resolve_data_config(size, model=model)
                transform = create_transform(**data_cfg, is_training=False)
                items = list(zip([p for p, _ in split.samples], targets_for(split.samples, model_synsets(model))))
                dataset = (SyntheticCrops(items, args.limit or SYNTHETIC_DEFAULT, transform, seed=args.seed)
                           if args.synthetic_from else
                           ImageList([items[i] for i in subsample(len(items), args.limit)], transform))
                res["data"]["images"] = len(dataset)
                res["models"][name] = {
                    "weights": f"checkpoint {args.checkpoint}" if args.checkpoint else
                               ("timm pretrained" if pretrained else f"random (seed {args.seed})"),
                    "input_size": list(data_cfg["input_size"]), "data_config": data_cfg,
                    "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "model_kwargs": args.model_kwargs}
                loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                                    pin_memory=device.type == "cuda", drop_last=False)
                rows = evaluate_modes(model, loader, modes, device, warmup=args.warmup, desc=name)
            except (DatasetLayoutError, CorruptImageError) as e:  # nothing is written: outputs come last
                parser.error(f"{data_flag}: {e}")
            for r in rows:
                r["model"] = name
                agree = "-" if r["agree_native"] is None else f"{100 * r['agree_native']:.2f}"
                print(f"{name:32s} {r['mode']:10s} top1 {100 * r['top1']:6.2f}  agree {agree:>6s}  "
                      f"img/s {r['img_per_s'] or 0:9.1f}", flush=True)
            res["results"] += rows
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    outputs.write_json(args.out, res)
    outputs.write_text(md, to_markdown(res))
    print(f"wrote {args.out} and {md}")
    return res


if __name__ == "__main__":
    main()
