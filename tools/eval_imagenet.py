#!/usr/bin/env python
"""ImageNet-1K validation accuracy and speed of timm models in every visionattn mode.

For each model x mode: top-1, top-5, agreement of predictions with the native run (timm's own
attention, same model, same FP32 precision), max |logit difference| vs native, throughput
(img/s of the model forward: CUDA events on a GPU, wall time on CPU; data loading excluded;
warm-up forwards untimed) and peak CUDA memory. One pass over the data per mode.

Data (--data DIR): an ImageFolder of synset folders (n01440764/...), or the flat val/ folder with
LOC_val_solution.csv or the devkit's ILSVRC2012_validation_ground_truth.txt (see
tools/_imagenet_data.py). Labels are mapped to the model's class order with timm's ImageNetInfo.

Without ImageNet (--synthetic-from DIR --limit N): N deterministic random crops + flips of the
photos in DIR (an ImageFolder of synset folders gives real labels; a flat folder such as
tests/data/photos gets placeholder labels, so only agreement and speed mean anything), e.g.

    python tools/eval_imagenet.py --random-weights --synthetic-from tests/data/photos --limit 512 \\
        --model vit_base_patch16_224 --model deit_small_patch16_224 \\
        --model swin_tiny_patch4_window7_224 --model swinv2_tiny_window8_256 --out out/imagenet.json

Process-wide options set here (and written to the output): TF32 off for matmuls and cuDNN, so
"native" is true FP32 and every mode's own precision is what differs. They are restored on return.

Writes --out (JSON, default out/eval_imagenet.json) and the same name with .md (markdown table).
Needs the [eval] extra.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any, Sequence

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers (_harness, ...)
import _imagenet_data as data  # noqa: E402
from _harness import (CorruptImageError, Stopwatch, ToolParser, check_device, check_output, default_out,  # noqa: E402
                      environment, markdown_table, nonnegative_int, output_files, positive_int, tf32_disabled)
from _timm_models import WeightsUnavailableError, create_timm_model, model_problem, weights_problem  # noqa: E402


ALL_MODES = "native,fp32,fp32-ieee,tf32,fp16,bf16,pasa,native-fp16,native-bf16"
SYNTHETIC_DEFAULT = 256


def build_parser() -> ToolParser:
    p = ToolParser(prog="eval_imagenet.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True,
                   help="timm model name; repeat for several models")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="ImageNet validation folder (ImageFolder of synset folders, or flat val/ "
                                    "with LOC_val_solution.csv / devkit ground truth)")
    src.add_argument("--synthetic-from", metavar="DIR",
                     help="build --limit random crops/flips of the photos in DIR instead of reading ImageNet "
                          "(synset folders give labels; a flat folder gets placeholder labels)")
    p.add_argument("--labels", help="labels file for a flat folder (LOC_val_solution.csv or "
                                    "ILSVRC2012_validation_ground_truth.txt); found automatically if omitted")
    p.add_argument("--devkit-synsets", help="text file, one synset per ILSVRC2012_ID (line 1 = ID 1), for the "
                                            "devkit ground truth when meta.mat / scipy is not available")
    p.add_argument("--modes", default=ALL_MODES,
                   help=f"comma-separated modes; 'native' = timm's own attention (always run as reference). "
                        f"Default {ALL_MODES}")
    p.add_argument("--img-size", type=positive_int, help="input size (square); default: the model's pretrained config")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per batch (default 64)")
    p.add_argument("--workers", type=nonnegative_int, default=min(8, os.cpu_count() or 1),
                   help="DataLoader worker processes (default min(8, CPUs))")
    p.add_argument("--limit", type=positive_int,
                   help=f"use N images spread evenly over the data set (with --synthetic-from: the number of "
                        f"crops, default {SYNTHETIC_DEFAULT})")
    p.add_argument("--checkpoint", help="local .safetensors/.pth state dict to load (one --model only)")
    p.add_argument("--pretrained", action=argparse.BooleanOptionalAction, default=True,
                   help="load timm's pretrained weights through the hub cache (default); --no-pretrained = random")
    p.add_argument("--random-weights", action="store_true", help="same as --no-pretrained")
    p.add_argument("--model-kwargs", default="{}",
                   help='JSON dict of extra timm.create_model arguments, e.g. \'{"depth": 2}\' for tiny test models')
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic crops and of random weights")
    p.add_argument("--warmup", type=nonnegative_int, default=2,
                   help="untimed warm-up forwards per input shape and mode")
    p.add_argument("--out", default=default_out("eval_imagenet.json"),
                   help="output JSON path; markdown goes next to it (.md) (default: %(default)s)")
    return p


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
    watch = Stopwatch(device)
    n = correct1 = correct5 = agree = nonfinite = 0
    max_diff = 0.0
    kept = []
    for images, targets in tqdm(loader, desc=desc, unit="batch", leave=False):
        images = images.to(device, non_blocking=True)
        with watch:
            logits = model(images)
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
    seconds = watch.seconds
    out = {
        "images": n,
        "top1": correct1 / max(n, 1), "top5": correct5 / max(n, 1),
        "agree_native": agree / max(n, 1) if reference_logits is not None else None,
        "max_abs_logit_diff": max_diff if reference_logits is not None else None,
        "nonfinite_logits": nonfinite,
        "seconds": seconds, "img_per_s": n / seconds if seconds > 0 else None, "timing": watch.kind,
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


def _loader(dataset, args, device) -> DataLoader:
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                      pin_memory=device.type == "cuda", drop_last=False)


def _data_for(args, model, split):
    """The model's eval transform and dataset (targets in the model's class order)."""
    transform, data_cfg = data.eval_transform(model, args.img_size)
    items = list(zip([p for p, _ in split.samples], data.targets_for(split.samples, data.model_synsets(model))))
    if args.synthetic_from:
        return data.SyntheticCrops(items, args.limit or SYNTHETIC_DEFAULT, transform, seed=args.seed), data_cfg
    idx = data.subsample(len(items), args.limit)
    return data.ImageListDataset([items[i] for i in idx], transform), data_cfg


def to_markdown(res: dict) -> str:
    env = res["environment"]
    d = res["data"]
    lines = [
        "# ImageNet evaluation: accuracy, agreement with native attention, speed per mode\n",
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}, timm {env['timm']}, "
        f"visionattn {res['visionattn']}; Python {env['python']}\n",
        f"Command: `{res['command']}`\n",
        f"Process-wide options: {', '.join(f'{k}={v}' for k, v in res['process_options'].items())}\n",
        f"Data: {d['layout']} at `{d['root']}`, {d['images']} images"
        + (f" (labels: `{d['labels_file']}`)" if d.get("labels_file") else "")
        + ("; " + "; ".join(d["notes"]) if d.get("notes") else "") + "\n",
        "Agreement = share of images whose top-1 class equals the native run's; max \\|Δlogit\\| vs native; "
        f"img/s from {res['results'][0]['timing'] if res['results'] else '-'} timing of the forward only.\n",
    ]
    for name, info in res["models"].items():
        rows = [[r["mode"], r["patched_modules"], 100 * r["top1"], 100 * r["top5"],
                 "-" if r["agree_native"] is None else f"{100 * r['agree_native']:.2f}",
                 "-" if r["max_abs_logit_diff"] is None else f"{r['max_abs_logit_diff']:.3g}",
                 r["nonfinite_logits"],
                 "-" if r["img_per_s"] is None else f"{r['img_per_s']:.1f}",
                 "-" if r["speedup_vs_native"] is None else f"{r['speedup_vs_native']:.2f}x",
                 "-" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f}"]
                for r in res["results"] if r["model"] == name]
        lines += [f"\n## {name}\n",
                  f"weights: {info['weights']}; input {info['input_size']}; {info['params_m']:.2f} M params\n",
                  markdown_table(rows, ["mode", "patched modules", "top-1 %", "top-5 %", "agree w/ native %",
                                        r"max \|Δlogit\|", "non-finite", "img/s", "vs native", "peak MiB"])]
        uncast = [r["mode"] for r in res["results"] if r["model"] == name and r.get("sdpa_calls_cast") == 0]
        if uncast:
            lines.append(f"\n{' / '.join(uncast)}: the model made no `scaled_dot_product_attention` call (its "
                         f"attention runs eagerly, as timm's Swin and Swin-v2 do by default), so nothing was "
                         f"cast: these rows are the native FP32 model again, not a half-precision reference.\n")
    return "\n".join(lines)


def check_args(parser: ToolParser, args) -> tuple[list[str], dict]:
    """Every argument checked before any work (exit 2 with one line); returns (modes, model kwargs)."""
    import visionattn as va

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m != "native" and m not in NATIVE_HALF_MODES and m not in va.mode_names()]
    if unknown or not modes:
        parser.error(f"--modes: {unknown or 'empty'} not known; expected 'native', one of "
                     f"{list(NATIVE_HALF_MODES)} or one of {va.mode_names()}")
    if args.checkpoint and len(args.model) > 1:
        parser.error("--checkpoint applies to one model; pass a single --model with it")
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint!r} does not exist; pass a .safetensors/.pth state dict")
    try:
        model_kwargs = json.loads(args.model_kwargs)
    except json.JSONDecodeError as e:
        parser.error(f"--model-kwargs must be a JSON object, e.g. '{{\"depth\": 2}}': {e}")
    if not isinstance(model_kwargs, dict):
        parser.error(f"--model-kwargs must be a JSON object, got {args.model_kwargs!r}")
    check_device(parser, args.device)
    pretrained = args.pretrained and not args.random_weights and not args.checkpoint
    for name in args.model:
        problem = model_problem(name, args.img_size, **model_kwargs)
        if problem:
            what, reason = problem
            flag = {"name": "--model", "input": "--img-size" if args.img_size else "--model"}.get(
                what, "--model-kwargs / --img-size" if args.img_size else "--model-kwargs")
            parser.error(f"{flag}: {reason}")
        if pretrained:
            problem = weights_problem(name)
            if problem:
                parser.error(f"--model {name}: {problem}")
    folder = args.data or args.synthetic_from
    if not os.path.isdir(folder):
        parser.error(f"{'--data' if args.data else '--synthetic-from'} {folder!r} is not a folder")
    check_output(parser, args.out)
    return modes, model_kwargs


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the evaluation; returns the results dict also written to ``--out`` (JSON) and ``.md``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    import visionattn as va

    modes, model_kwargs = check_args(parser, args)
    md = os.path.splitext(args.out)[0] + ".md"
    outputs = output_files(parser, [args.out, md], tool="eval_imagenet")
    pretrained = args.pretrained and not args.random_weights and not args.checkpoint
    device = torch.device(args.device)
    try:
        split = (data.synthetic_sources(args.synthetic_from) if args.synthetic_from
                 else data.scan_imagenet(args.data, args.labels, args.devkit_synsets))
    except data.DatasetLayoutError as e:
        parser.error(f"{'--data' if args.data else '--synthetic-from'}: {e}")
    argv_used = sys.argv[1:] if argv is None else list(argv)
    res = {
        "environment": environment(),
        "visionattn": va.__version__,
        "command": " ".join(shlex.quote(a) for a in ["python", "tools/eval_imagenet.py", *argv_used]),
        "process_options": None,
        "data": {"layout": split.layout, "root": split.root, "labels_file": split.labels_file,
                 "notes": split.notes, "images": None},
        "modes": modes, "models": {}, "results": [],
    }
    with tf32_disabled() as process_options:
        res["process_options"] = process_options
        for name in args.model:
            torch.manual_seed(args.seed)
            try:
                model = create_timm_model(name, pretrained=pretrained, checkpoint=args.checkpoint,
                                          img_size=args.img_size, **model_kwargs).to(device)
            except WeightsUnavailableError as e:
                parser.error(f"--model {name}: {e}")
            try:
                dataset, data_cfg = _data_for(args, model, split)
                res["data"]["images"] = len(dataset)
                res["models"][name] = {
                    "weights": f"checkpoint {args.checkpoint}" if args.checkpoint else
                               ("timm pretrained" if pretrained else f"random (seed {args.seed})"),
                    "input_size": list(data_cfg["input_size"]), "data_config": data_cfg,
                    "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "model_kwargs": model_kwargs,
                }
                rows = evaluate_modes(model, _loader(dataset, args, device), modes, device,
                                      warmup=args.warmup, desc=name)
            except (data.DatasetLayoutError, CorruptImageError) as e:  # nothing is written: outputs come last
                parser.error(f"{'--data' if args.data else '--synthetic-from'}: {e}")
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
