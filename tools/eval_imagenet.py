#!/usr/bin/env python
"""ImageNet-1K validation accuracy and speed of timm models in every visionattn mode (issue 9).

For each model x mode: top-1, top-5, agreement of predictions with the native run (timm's own
attention, same model, same FP32 precision), max |logit difference| vs native, throughput
(img/s of the model forward: CUDA events on a GPU, wall time on CPU; data loading excluded;
warm-up forwards untimed) and peak CUDA memory. One pass over the data per mode.

Data (--data DIR): an ImageFolder of synset folders (n01440764/...), or the flat val/ folder with
LOC_val_solution.csv or the devkit's ILSVRC2012_validation_ground_truth.txt (see
visionattn/imagenet.py). Labels are mapped to the model's class order with timm's ImageNetInfo.

Without ImageNet (--synthetic-from DIR --limit N): N deterministic random crops + flips of the
photos in DIR (an ImageFolder of synset folders gives real labels; a flat folder such as
tests/data/photos gets placeholder labels, so only agreement and speed mean anything), e.g.

    python tools/eval_imagenet.py --random-weights --synthetic-from tests/data/photos --limit 512 \
        --model vit_base_patch16_224 --model deit_small_patch16_224 \
        --model swin_tiny_patch4_window7_224 --model swinv2_tiny_window8_256 --out docs/benchmarks/imagenet.json

Process-wide options set here (and written to the output): TF32 off for matmuls and cuDNN, so
"native" is true FP32 and every mode's own precision is what differs. They are restored on return.

Writes --out (JSON) and the same name with .md (markdown table).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch
from torch.utils.data import DataLoader

from visionattn import imagenet
from visionattn.reporting import environment, markdown_table, tf32_disabled, write_json_atomic, write_text_atomic

ALL_MODES = "native,fp32,fp32-ieee,tf32,fp16,bf16,pasa,native-fp16,native-bf16"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
    p.add_argument("--img-size", type=int, help="input size (square); default: the model's pretrained config")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch (default 64)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="DataLoader worker processes (default min(8, CPUs))")
    p.add_argument("--limit", type=int, help="use N images spread evenly over the data set (with "
                                             "--synthetic-from: the number of crops, default 256)")
    p.add_argument("--checkpoint", help="local .safetensors/.pth state dict to load (one --model only)")
    p.add_argument("--pretrained", action=argparse.BooleanOptionalAction, default=True,
                   help="load timm's pretrained weights through the hub cache (default); --no-pretrained = random")
    p.add_argument("--random-weights", action="store_true", help="same as --no-pretrained")
    p.add_argument("--model-kwargs", default="{}",
                   help='JSON dict of extra timm.create_model arguments, e.g. \'{"depth": 2}\' for tiny test models')
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (default cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic crops and of random weights")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up forwards per input shape and mode")
    p.add_argument("--out", default="results.json", help="output JSON path; markdown goes next to it (.md)")
    return p


def _loader(dataset, args, device) -> DataLoader:
    return DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                      pin_memory=device.type == "cuda", drop_last=False)


def _data_for(args, model, split):
    """The model's eval transform and dataset (targets in the model's class order)."""
    transform, data_cfg = imagenet.eval_transform(model, args.img_size)
    items = list(zip([p for p, _ in split.samples], imagenet.targets_for(split.samples, imagenet.model_synsets(model))))
    if args.synthetic_from:
        return imagenet.SyntheticCrops(items, args.limit or 256, transform, seed=args.seed), data_cfg
    idx = imagenet.subsample(len(items), args.limit)
    return imagenet.ImageListDataset([items[i] for i in idx], transform), data_cfg


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


def main(argv=None) -> dict:
    """Run the evaluation; returns the results dict also written to ``--out`` (JSON) and ``.md``."""
    args = build_parser().parse_args(argv)
    import visionattn as va

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m != "native" and m not in imagenet.NATIVE_HALF_MODES and m not in va.mode_names()]
    if unknown:
        raise SystemExit(f"--modes: {unknown} are not known; expected 'native', one of "
                         f"{list(imagenet.NATIVE_HALF_MODES)} or one of {va.mode_names()}")
    if args.checkpoint and len(args.model) > 1:
        raise SystemExit("--checkpoint applies to one model; pass a single --model with it")
    try:
        model_kwargs = json.loads(args.model_kwargs)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--model-kwargs must be a JSON object, e.g. '{{\"depth\": 2}}': {e}") from None
    if not isinstance(model_kwargs, dict):
        raise SystemExit(f"--model-kwargs must be a JSON object, got {args.model_kwargs!r}")
    pretrained = args.pretrained and not args.random_weights and not args.checkpoint
    device = torch.device(args.device)

    split = (imagenet.synthetic_sources(args.synthetic_from) if args.synthetic_from
             else imagenet.scan_imagenet(args.data, args.labels, args.devkit_synsets))
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
            model = imagenet.create_timm_model(name, pretrained=pretrained, checkpoint=args.checkpoint,
                                               img_size=args.img_size, **model_kwargs).to(device)
            dataset, data_cfg = _data_for(args, model, split)
            res["data"]["images"] = len(dataset)
            res["models"][name] = {
                "weights": f"checkpoint {args.checkpoint}" if args.checkpoint else
                           ("timm pretrained" if pretrained else f"random (seed {args.seed})"),
                "input_size": list(data_cfg["input_size"]), "data_config": data_cfg,
                "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "model_kwargs": model_kwargs,
            }
            rows = imagenet.evaluate_modes(model, _loader(dataset, args, device), modes, device,
                                           warmup=args.warmup, desc=name)
            for r in rows:
                r["model"] = name
                agree = "-" if r["agree_native"] is None else f"{100 * r['agree_native']:.2f}"
                print(f"{name:32s} {r['mode']:10s} top1 {100 * r['top1']:6.2f}  agree {agree:>6s}  "
                      f"img/s {r['img_per_s'] or 0:9.1f}", flush=True)
            res["results"] += rows
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_json_atomic(args.out, res)
    md = os.path.splitext(args.out)[0] + ".md"
    write_text_atomic(md, to_markdown(res))
    print(f"wrote {args.out} and {md}")
    return res


if __name__ == "__main__":
    try:
        main()
    except (imagenet.DatasetLayoutError, imagenet.WeightsUnavailableError, FileNotFoundError) as e:
        raise SystemExit(f"eval_imagenet: {e}") from None
