#!/usr/bin/env python
"""Fine-tune a timm model on an image folder with visionattn attention, in one precision mode.

Data: an ImageFolder (one sub-folder per class); ``train/`` + ``val/`` when both exist, else a seeded per-class
share (``--val-fraction``, at least one image of every class with two or more) held out; timm's transforms for the
model at ``--img-size``. Model: ``timm.create_model(--model)``, random weights or ``--pretrained`` (checked before any
work), the head sized to the classes, patched with ``visionattn.patch_model(model, --mode)`` unless ``--unpatched``.
Precision per mode: fp32 / fp32-ieee in FP32 with TF32 off; tf32 with TF32 matmuls and convolutions (process-wide
flags, restored, recorded); bf16 under autocast; fp16 under autocast with a ``GradScaler``. AdamW, constant learning
rate. Every ``--eval-every`` epochs and after the last: held-out loss and top-1, ``last.safetensors`` and, when top-1
improved, ``best.safetensors`` (metadata: model, classes, image size, mode, epoch). Also ``metrics.json`` (every
evaluation and step loss), ``metrics.md``, ``curves.png``. The output folder follows the reconstruction demo's rule
(:func:`_harness.output_folder`): new, empty or an earlier output of this tool, not inside ``--data``; written into a
temporary folder renamed into place, so an error, a corrupt image (exit 2, one line) or a signal leaves nothing.

    python tools/finetune.py --data DIR --model vit_base_patch16_224 --mode bf16 --epochs 10 --out out/ft
    python tools/finetune.py --data tests/data/photos_2cls --model vit_tiny_patch16_224 --img-size 32 \\
        --model-kwargs '{"depth": 2}' --device cpu --epochs 2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (CorruptImageError, ImageList, ToolParser, add_common, atomic_path, check_device,  # noqa: E402
                      check_output_folder, default_out, environment, figure, json_object, markdown_table, md_header,
                      nonnegative_float, nonnegative_int, output_folder, positive_float, positive_int, tf32_flags,
                      write_json_atomic, write_text_atomic)
from _timm_models import WeightsUnavailableError, create_timm_model, model_problem, weights_problem  # noqa: E402

from visionattn.checks import has_backward  # noqa: E402
from visionattn.modes import get_mode, mode_names  # noqa: E402

TRAIN_MODES = tuple(m for m in mode_names() if has_backward(m))  # the modes with backward kernels
# whose manifest an output folder holds (visionattn.recon.outdir): a later run replaces only such a folder
TOOL_ID = "visionattn.finetune"


class Precision(NamedTuple):
    """How the whole model trains beside its attention ``mode``: ``autocast`` dtype (None: FP32), ``tf32`` (the
    process-wide TF32 flags of matmuls and convolutions), ``scaler`` (a ``GradScaler`` scales the loss)."""
    mode: str
    autocast: torch.dtype | None
    tf32: bool
    scaler: bool


def precision(mode: str) -> Precision:
    """The training precision of visionattn ``mode``; ValueError unless it is one of :data:`TRAIN_MODES`."""
    if mode not in TRAIN_MODES:
        raise ValueError(f"mode {mode!r} cannot train: expected one of {', '.join(TRAIN_MODES)}"
                         + (" (pasa is forward-only; train in fp16)" if mode == "pasa" else ""))
    dtype = get_mode(mode).compute_dtype
    return Precision(mode=mode, autocast=None if dtype == torch.float32 else dtype, tf32=mode == "tf32",
                     scaler=dtype == torch.float16)


def autocast(device_type: str, prec: Precision):
    """``torch.autocast`` in ``prec``'s half dtype; a null context for FP32 training."""
    return torch.autocast(device_type, dtype=prec.autocast, enabled=prec.autocast is not None)


class TrainStep:
    """``step(x [B, 3, H, W], y [B]) -> loss`` (detached, on the device; reading it synchronises): forward under the
    precision's autocast, cross-entropy, backward (scaled by ``scaler`` for fp16), AdamW ``optimizer`` step."""

    def __init__(self, model: torch.nn.Module, prec: Precision, *, lr: float, weight_decay: float = 0.05):
        self.model = model.train()
        self.prec = prec
        self.device_type = next(model.parameters()).device.type
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.scaler = torch.amp.GradScaler(self.device_type) if prec.scaler else None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device_type, self.prec):
            loss = F.cross_entropy(self.model(x), y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return loss.detach()


def train_one_epoch(step: TrainStep, loader: Any, device: torch.device | str, *, desc: str = "train",
                    on_step: Callable[[float], None] | None = None) -> dict[str, float]:
    """One pass of ``step`` over ``loader`` (``(images, labels)``), ``on_step(loss)`` after each step; returns
    ``{"loss": mean step loss, "images", "seconds", "img_per_s"}``."""
    from tqdm.auto import tqdm

    total, images, t0 = 0.0, 0, time.perf_counter()
    bar = tqdm(loader, desc=desc, leave=False, dynamic_ncols=True)
    for x, y in bar:
        loss = float(step(x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
        total += loss * len(y)
        images += len(y)
        bar.set_postfix(loss=f"{loss:.4f}")
        if on_step is not None:
            on_step(loss)
    seconds = time.perf_counter() - t0
    return {"loss": total / max(images, 1), "images": images, "seconds": seconds,
            "img_per_s": images / seconds if seconds > 0 else float("nan")}


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Any, prec: Precision, device: torch.device | str, *,
             desc: str = "eval") -> dict[str, float]:
    """Mean cross-entropy and top-1 (fraction) of ``model`` over ``loader`` in ``prec``'s autocast (in eval mode for
    the pass, then back in the mode it was in)."""
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    total, correct, images = 0.0, 0, 0
    with autocast(torch.device(device).type, prec):
        for x, y in tqdm(loader, desc=desc, leave=False, dynamic_ncols=True):
            x, y = x.to(device), y.to(device)
            logits = model(x).float()
            total += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            images += len(y)
    model.train(was_training)
    return {"loss": total / max(images, 1), "top1": correct / max(images, 1), "images": images}


def save_checkpoint(model: torch.nn.Module, path: str, metadata: dict[str, Any] | None = None) -> None:
    """``safetensors.torch.save_file`` of ``model``'s state dict (CPU copies) written atomically; ``metadata``
    values as strings (JSON for non-strings)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    with atomic_path(path) as tmp:
        save_file(state, tmp, metadata=meta)


def load_checkpoint(model: torch.nn.Module, path: str) -> dict[str, str]:
    """Load a :func:`save_checkpoint` file into ``model`` (strict); returns its metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    model.load_state_dict(load_file(path, device=str(next(model.parameters()).device)), strict=True)
    with safe_open(path, "pt") as f:
        return dict(f.metadata() or {})


class DataError(ValueError):
    """The image folder cannot be used; the message says why."""


def scan_folder(root: str, val_fraction: float, seed: int) -> dict[str, Any]:
    """``{"layout", "classes", "train": [(path, label)], "val": [...]}`` of an ImageFolder ``root`` (no image
    decoded): ``root/train`` + ``root/val``, or per class ``round(val_fraction * n)`` images (at least 1 of 2 or more,
    never all) held out by a ``seed``-ed permutation. DataError: no or one class, different classes in train/ and
    val/, or an empty split."""
    from torchvision.datasets import ImageFolder

    def folder(path):
        try:
            return ImageFolder(path)
        except (FileNotFoundError, OSError) as e:
            raise DataError(f"{path}: {e}") from None

    if os.path.isdir(os.path.join(root, "train")) and os.path.isdir(os.path.join(root, "val")):
        train, val = folder(os.path.join(root, "train")), folder(os.path.join(root, "val"))
        if train.classes != val.classes:
            raise DataError(f"{root}: train/ and val/ have different classes "
                            f"({len(train.classes)} vs {len(val.classes)}); they must match")
        split = {"layout": "train/ and val/", "classes": train.classes, "train": train.samples, "val": val.samples}
    else:
        whole = folder(root)
        g = torch.Generator().manual_seed(seed)
        split = {"layout": f"one folder, {val_fraction:g} of each class held out (seed {seed})",
                 "classes": whole.classes, "train": [], "val": []}
        for label in range(len(whole.classes)):
            items = [s for s in whole.samples if s[1] == label]
            held = min(len(items) - 1, max(1 if len(items) > 1 else 0, round(val_fraction * len(items))))
            order = torch.randperm(len(items), generator=g).tolist()
            split["val"] += [items[i] for i in sorted(order[:held])]
            split["train"] += [items[i] for i in sorted(order[held:])]
    if len(split["classes"]) < 2:
        raise DataError(f"{root}: {len(split['classes'])} class folder(s); a classifier needs at least 2")
    for name in ("train", "val"):
        if not split[name]:
            raise DataError(f"{root}: the {name} split is empty; add images or change --val-fraction")
    return split


def datasets(split: dict[str, Any], model: torch.nn.Module, img_size: int) -> tuple[Any, Any, dict]:
    """Train and held-out datasets of ``split`` with timm's transforms for ``model`` at ``img_size``;
    also the data config used (mean, std, interpolation, crop)."""
    from timm.data import create_transform, resolve_model_data_config

    cfg = resolve_model_data_config(model)
    cfg["input_size"] = (3, img_size, img_size)
    train = ImageList(split["train"], create_transform(**cfg, is_training=True))
    val = ImageList(split["val"], create_transform(**cfg, is_training=False))
    return train, val, {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


def build_parser() -> ToolParser:
    p = ToolParser(prog="finetune.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--data", required=True, help="ImageFolder root: one sub-folder per class, or train/ and val/")
    p.add_argument("--model", default="vit_base_patch16_224", help="timm model name (default: %(default)s)")
    p.add_argument("--model-kwargs", type=json_object, default={},
                   help='JSON dict of extra timm.create_model arguments, e.g. \'{"depth": 2}\' for tiny test models')
    p.add_argument("--pretrained", action="store_true",
                   help="start from timm's pretrained weights (hub cache or network; checked before any work)")
    p.add_argument("--mode", default="fp32", choices=TRAIN_MODES,
                   help="visionattn mode, which also sets the model's precision (see above; default: %(default)s)")
    p.add_argument("--unpatched", action="store_true",
                   help="train with timm's own attention in the same precision (a baseline run)")
    p.add_argument("--epochs", type=positive_int, default=10, help="passes over the training split (default 10)")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.05, help="AdamW weight decay (default 0.05)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per step (default 32)")
    p.add_argument("--img-size", type=positive_int, default=224, help="square input size (default 224)")
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="share of each class held out when --data has no train/ and val/ (default 0.2)")
    p.add_argument("--eval-every", type=positive_int, default=1, help="evaluate every N epochs (and after the last)")
    p.add_argument("--workers", type=nonnegative_int, default=min(4, os.cpu_count() or 1),
                   help="DataLoader worker processes (default min(4, CPUs))")
    add_common(p, device=("cuda" if torch.cuda.is_available() else "cpu", "torch device (default: %(default)s)"),
               seed=(0, "seed of the weights, the split and the data order"),
               out=(default_out("finetune"), "output folder: checkpoints, metrics.json / .md, curves.png; new, "
                    "empty or an earlier output of this tool (then replaced), never a folder of yours "
                    "(default: %(default)s)"))
    return p


def check_args(parser: ToolParser, args: argparse.Namespace) -> dict:
    """Every check that can fail, before any work: exit 2 with one line. Returns the data split."""
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    check_device(parser, args.device)
    if not os.path.isdir(args.data):
        parser.error(f"--data {args.data!r} is not a folder; pass an ImageFolder root (one sub-folder per class)")
    check_output_folder(parser, args.out, tool=TOOL_ID, inputs=[args.data])
    try:
        split = scan_folder(args.data, args.val_fraction, args.seed)
    except DataError as e:
        parser.error(f"--data: {e}")
    problem = model_problem(args.model, args.img_size, num_classes=len(split["classes"]), **args.model_kwargs)
    if problem:
        what, reason = problem
        parser.error(f"{ {'name': '--model', 'input': '--img-size'}.get(what, '--model-kwargs')}: {reason}")
    if args.pretrained:
        problem = weights_problem(args.model)
        if problem:
            parser.error(f"--pretrained: {problem} (in finetune.py: leave out --pretrained to start from random "
                         "weights)")
    return split


def render_markdown(res: dict) -> str:
    data, a = res["data"], res["args"]
    lines = md_header(f"Fine-tuning {res['model']['name']} ({res['model']['attention']}, mode {res['mode']})",
                      res["environment"], f"data: {data['root']} ({data['layout']}): {len(data['classes'])} classes, "
                      f"{data['train']} train / {data['val']} held-out images",
                      f"precision: {res['precision']}; process-wide: {res['process_settings']}",
                      f"AdamW lr {a['lr']:g}, weight decay {a['weight_decay']:g}, batch {a['batch_size']}, "
                      f"{a['img_size']} px")
    rows = [[h["epoch"], h["step"], h["train_loss"], h["train_img_per_s"], h["val_loss"], f"{100 * h['val_top1']:.2f}",
             "yes" if h["best"] else ""] for h in res["history"]]
    lines.append(markdown_table(rows, ["epoch", "step", "train loss", "train img/s", "held-out loss",
                                       "held-out top-1 %", "best"]))
    lines += ["", f"Checkpoints: {', '.join(f'`{p}`' for p in res['checkpoints'].values())}", ""]
    return "\n".join(lines)


def render_png(res: dict, path: str) -> None:
    with figure(path, None, 1, 2, figsize=(10, 3.8), dpi=110) as (fig, (ax_loss, ax_acc)):
        ax_loss.plot(range(1, len(res["step_losses"]) + 1), res["step_losses"], lw=1, label="train (per step)")
        history = res["history"]
        ax_loss.plot([h["step"] for h in history], [h["val_loss"] for h in history], "o-", label="held-out")
        ax_loss.legend()
        ax_acc.plot([h["epoch"] for h in history], [100 * h["val_top1"] for h in history], "o-")
        for ax, x, y in ((ax_loss, "step", "cross-entropy"), (ax_acc, "epoch", "held-out top-1 %")):
            ax.set(xlabel=x, ylabel=y)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{res['model']['name']} {res['model']['attention']} mode {res['mode']} "
                     f"({res['environment']['device']})")


def main(argv: Sequence[str] | None = None) -> dict:
    """Fine-tune as the arguments say; returns the record also written to ``<out>/metrics.json``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    split = check_args(parser, args)
    out = os.path.abspath(args.out)
    with output_folder(parser, out, tool=TOOL_ID, inputs=[args.data]) as tmp:
        try:
            res = _finetune(parser, args, split, out, tmp)
        except CorruptImageError as e:  # found while training or evaluating: nothing is kept
            parser.error(f"--data: {e}")
    print(f"wrote {out}/metrics.json, metrics.md, curves.png, last.safetensors, best.safetensors")
    return res


def _finetune(parser: ToolParser, args: argparse.Namespace, split: dict, out: str, tmp: str) -> dict:
    """The run of :func:`main`: files go into ``tmp``, named in the record by their final place in ``out``."""
    import visionattn as va

    model_kwargs = args.model_kwargs
    device = torch.device(args.device)
    prec = precision(args.mode)
    torch.manual_seed(args.seed)
    try:
        model = create_timm_model(args.model, pretrained=args.pretrained, img_size=args.img_size,
                                  num_classes=len(split["classes"]), **model_kwargs).to(device)
    except WeightsUnavailableError as e:  # the hub went away between the check and the download
        parser.error(f"--pretrained: {e}")
    attention = "timm attention (unpatched)"
    if not args.unpatched:
        va.patch_model(model, args.mode)
        attention = f"visionattn ({sum(model.visionattn_report.patched.values())} modules patched)"
    train_set, val_set, data_cfg = datasets(split, model, args.img_size)
    loader_kw = {"batch_size": args.batch_size, "num_workers": args.workers, "pin_memory": device.type == "cuda",
                 "persistent_workers": args.workers > 0}
    train_loader = torch.utils.data.DataLoader(train_set, shuffle=True,
                                               generator=torch.Generator().manual_seed(args.seed), **loader_kw)
    val_loader = torch.utils.data.DataLoader(val_set, shuffle=False, **loader_kw)
    checkpoints = {"last": os.path.join(out, "last.safetensors"), "best": os.path.join(out, "best.safetensors")}
    res: dict[str, Any] = {
        "environment": environment(), "args": vars(args), "mode": args.mode,
        "precision": {"autocast": str(prec.autocast).replace("torch.", "") if prec.autocast else None,
                      "tf32": prec.tf32, "grad_scaler": prec.scaler},
        "model": {"name": args.model, "attention": attention, "pretrained": args.pretrained,
                  "kwargs": model_kwargs, "params_m": sum(p.numel() for p in model.parameters()) / 1e6},
        "data": {"root": os.path.abspath(args.data), "layout": split["layout"], "classes": split["classes"],
                 "train": len(train_set), "val": len(val_set), "transform": data_cfg},
        "history": [], "step_losses": [], "checkpoints": checkpoints,
    }
    meta = {"model": args.model, "model_kwargs": model_kwargs, "classes": split["classes"], "img_size": args.img_size,
            "mode": args.mode, "attention": attention}
    step = TrainStep(model, prec, lr=args.lr, weight_decay=args.weight_decay)
    best = -math.inf
    with tf32_flags(prec.tf32) as settings:
        res["process_settings"] = settings
        print(f"[finetune] {res['environment']['device']}: {args.model} {attention}, mode {args.mode}, "
              f"{len(train_set)} train / {len(val_set)} held-out images; TF32 {'on' if prec.tf32 else 'off'} "
              f"(process-wide)", flush=True)
        for epoch in range(1, args.epochs + 1):
            stats = train_one_epoch(step, train_loader, device, desc=f"epoch {epoch}/{args.epochs}",
                                    on_step=res["step_losses"].append)
            if epoch % args.eval_every and epoch != args.epochs:
                continue
            ev = evaluate(model, val_loader, prec, device, desc=f"eval {epoch}")
            improved = ev["top1"] > best
            row = {"epoch": epoch, "step": len(res["step_losses"]), "train_loss": stats["loss"],
                   "train_img_per_s": stats["img_per_s"], "val_loss": ev["loss"], "val_top1": ev["top1"],
                   "best": improved}
            res["history"].append(row)
            save_checkpoint(model, os.path.join(tmp, "last.safetensors"), {**meta, "epoch": epoch})
            if improved:
                best = ev["top1"]
                save_checkpoint(model, os.path.join(tmp, "best.safetensors"), {**meta, "epoch": epoch})
            print(f"epoch {epoch}: train loss {stats['loss']:.4f}, held-out loss {ev['loss']:.4f}, "
                  f"top-1 {100 * ev['top1']:.2f}%" + (" (best)" if improved else ""), flush=True)
    write_json_atomic(os.path.join(tmp, "metrics.json"), res)
    write_text_atomic(os.path.join(tmp, "metrics.md"), render_markdown(res))
    render_png(res, os.path.join(tmp, "curves.png"))
    return res


if __name__ == "__main__":
    main()
