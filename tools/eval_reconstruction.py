#!/usr/bin/env python
"""Multi-view reconstruction evaluation for VGGT / FastVGGT / π³ / Pi3X (markdown + JSON).

    # (a) pose AUC@30/15/5/3 over all pairs, (b) point-cloud accuracy when GT clouds exist
    python tools/eval_reconstruction.py accuracy --data /data/co3dv2 --layout co3d --out out/eval_co3d
    python tools/eval_reconstruction.py accuracy --data my_scene/ --out out/eval   # images/ + cameras.json
    # (c) agreement of each attention mode with the fp32 run on one scene
    python tools/eval_reconstruction.py modes demos/data/stereo_rig --weights random --out out/modes
    python tools/eval_reconstruction.py accuracy --data my_scene/ --model pi3 --out out/eval_pi3   # π³, same protocol

Writes OUT/eval_reconstruction_<task>.json and .md with the environment; a thin CLI over
:mod:`visionattn.recon.evaluate`.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, check_device, check_output, comma_list, environment, markdown_table,  # noqa: E402
                      nonnegative_int, output_files, percentile, positive_float, positive_int, write_results)

DEFAULT_MODES = "fp32,tf32,fp16,bf16,pasa"


def build_parser() -> ToolParser:
    from visionattn.recon.pipeline import ATTN_MODES, MODEL_WEIGHTS, MODELS

    p = ToolParser(prog="eval_reconstruction.py", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="task", required=True, metavar="{accuracy,modes}", parser_class=ToolParser)

    def common(sp):
        sp.add_argument("--out", required=True, help="folder for the JSON and markdown reports")
        sp.add_argument("--model", choices=MODELS, default="vggt",
                        help="vggt, fastvggt, pi3 or pi3x; π³ / Pi3X cameras are put in VGGT's conventions (first "
                             "camera = world, intrinsics fitted to the local points: visionattn.recon.pi3) and scored "
                             "the same way (default: %(default)s)")
        sp.add_argument("--weights", default=None,
                        help="hub id, local checkpoint PATH, 'random' (full config) or 'random-tiny' (default: the "
                             "model's own: " + ", ".join(f"{m} {w}" for m, w in MODEL_WEIGHTS.items()
                                                         if m != "fastvggt") + ")")
        sp.add_argument("--device", default="auto", help="cuda, cpu or auto (default: %(default)s)")
        sp.add_argument("--size", type=positive_int, default=518,
                        help="preprocessed image width in pixels, multiple of 14 (default: %(default)s)")
        sp.add_argument("--seed", type=int, default=0, help="seed for random weights (default: %(default)s)")
        sp.add_argument("--quiet", action="store_true", help="no progress bars")

    a = sub.add_parser("accuracy", help="(a) pose AUC and (b) point-cloud accuracy against ground truth",
                       description="(a) relative rotation / translation errors over all frame pairs and "
                                   "AUC@30/15/5/3 (VGGT protocol); (b) accuracy / completeness / Chamfer after "
                                   "Umeyama Sim(3) alignment of the predicted cameras, for scenes with a "
                                   "ground-truth point cloud (CO3D pointcloud.ply, generic points.ply)")
    a.add_argument("--data", required=True,
                   help="dataset root: CO3Dv2 release (CATEGORY/frame_annotations.jgz) or generic layout "
                        "(SCENE/cameras.json + SCENE/images/, one scene or a folder of scenes)")
    a.add_argument("--layout", choices=("auto", "generic", "co3d"), default="auto",
                   help="dataset layout; auto detects CO3D by its annotation files (default: %(default)s)")
    a.add_argument("--categories", default=None,
                   help="CO3D: comma-separated categories (default: every category found)")
    a.add_argument("--max-sequences", type=positive_int, default=None,
                   help="CO3D: first N sequences per category (default: all)")
    a.add_argument("--num-frames", type=positive_int, default=10,
                   help="CO3D: random frames per sequence, seeded, as VGGT's protocol (default: %(default)s)")
    a.add_argument("--mode", choices=ATTN_MODES, default="fp32", help="attention mode (default: %(default)s)")
    a.add_argument("--conf-percentile", type=percentile, default=50.0,
                   help="(b) drop predicted points under this confidence percentile (default: %(default)s)")
    a.add_argument("--cloud-threshold", type=positive_float, default=None,
                   help="(b) also report precision / recall / F-score at this distance (GT units)")
    common(a)

    m = sub.add_parser("modes", help="(c) per-mode agreement with the fp32 run on one scene",
                       description="Run one scene with the same weights in each attention mode and report "
                                   "camera / depth / point differences to the fp32 run, plus time and memory")
    m.add_argument("image_dir", help="folder of images (e.g. demos/data/stereo_rig)")
    m.add_argument("--modes", default=DEFAULT_MODES,
                   help=f"comma-separated attention modes from {', '.join(ATTN_MODES)} "
                        "(default: %(default)s)")
    m.add_argument("--max-frames", type=positive_int, default=None, help="first N images only (default: all)")
    m.add_argument("--warmup", type=nonnegative_int, default=0,
                   help="untimed passes per mode before the timed one; use 1+ on a GPU, where the first "
                        "call compiles the Triton kernels (default: %(default)s)")
    common(m)
    return p


class DatasetError(ValueError):
    """The --data folder holds no usable scene."""


POSE = ("auc@30", "auc@15", "auc@5", "auc@3", "rot_err_median_deg", "trans_err_median_deg")
CLOUD = ("accuracy", "completeness", "chamfer")


def _markdown_accuracy(res: dict) -> str:
    rows = [[r["scene"], r["frames"], *(r["pose"][k] for k in POSE), *(r.get("cloud", {}).get(k, "-") for k in CLOUD),
             r["seconds"]] for r in res["scenes"]]
    mean = res["mean"]
    rows.append(["**mean**", "", *(mean[f"pose.{k}"] for k in POSE), *(mean.get(f"cloud.{k}", "-") for k in CLOUD), ""])
    head = ["scene", "frames", "AUC@30", "AUC@15", "AUC@5", "AUC@3", "rot err med (deg)", "trans err med (deg)",
            "accuracy", "completeness", "chamfer", "seconds"]
    return (f"# Reconstruction accuracy: {res['model']} ({res['weights']}), attention {res['mode']}\n\n"
            "Pose: all frame pairs, VGGT protocol (AUC of max(rot, trans) error on 1..T degrees). "
            "Cloud: after Sim(3) alignment of predicted to ground-truth cameras, in ground-truth units.\n\n"
            + markdown_table(rows, head) + _env_md(res["environment"]))


def _markdown_modes(res: dict) -> str:
    keys = ["seconds", "rot_max_deg", "center_rel_l2", "focal_rel_max", "depth_rel_l2", "depth_max_rel",
            "points_rel_l2", "points_from_depth_rel_l2", "auc@3", "nonfinite"]
    rows = [[m] + [r.get(k, "-") for k in keys] for m, r in res["runs"].items()]
    return (f"# Attention-mode agreement: {res['model']} ({res['weights']}), {res['frames']} frames "
            f"{res['image_hw'][0]}x{res['image_hw'][1]}\n\nDifferences to the `{res['reference']}` run "
            "(same weights, same images). rel_l2 = ||x - ref|| / ||ref||; rot in degrees; auc@3: pose "
            "protocol with the reference as ground truth.\n\n" + markdown_table(rows, ["mode"] + keys)
            + _env_md(res["environment"]))


def _env_md(env: dict) -> str:
    return "\n## Environment\n\n" + "".join(f"- {k}: `{v}`\n" for k, v in env.items())


def main(argv=None) -> dict:
    """Run the chosen evaluation; writes JSON + markdown into ``--out`` and returns the result dict."""
    from visionattn.recon.datasets import GroundTruthError, load_scenes
    from visionattn.recon.evaluate import evaluate_scenes, mode_agreement
    from visionattn.recon.images import load_images
    from visionattn.recon.pipeline import ATTN_MODES, USER_ERRORS

    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.size % 14:
        parser.error(f"--size {args.size} must be a multiple of 14 (e.g. {max(14, args.size // 14 * 14)})")
    if args.task == "modes":
        modes = comma_list(parser, "--modes", args.modes, ATTN_MODES)
        if not os.path.isdir(args.image_dir):
            parser.error(f"image_dir {args.image_dir!r} is not a folder")
    elif not os.path.isdir(args.data):
        parser.error(f"--data {args.data!r} is not a folder")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    check_device(parser, device)
    check_output(parser, args.out, folder=True)
    stem = os.path.join(args.out, f"eval_reconstruction_{args.task}")
    outputs = output_files(parser, [stem + ".json", stem + ".md"], tool="eval_reconstruction")
    progress = not args.quiet
    try:
        if args.task == "accuracy":
            cats = args.categories.split(",") if args.categories else None
            try:
                scenes = load_scenes(args.data, args.layout, cats, args.max_sequences, args.num_frames, args.seed)
            except ValueError as exc:  # no scene / unreadable annotations: a data problem, not a bug
                raise DatasetError(str(exc)) from exc
            res = evaluate_scenes(scenes, args.model, args.weights, args.mode, device, args.size,
                                  args.conf_percentile, args.cloud_threshold, args.seed, progress)
        else:
            loaded = load_images(args.image_dir, size=args.size, max_frames=args.max_frames, progress=progress)
            res = mode_agreement(loaded.images, modes, args.model, args.weights, device, args.seed,
                                 warmup=args.warmup, progress=progress)
            res["image_dir"] = args.image_dir
    except (*USER_ERRORS, DatasetError, GroundTruthError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return {"exit_code": 2, "error": str(exc)}
    res["environment"] = environment()
    md = (_markdown_accuracy if args.task == "accuracy" else _markdown_modes)(res)
    write_results(outputs, stem, res, md)
    print(md)
    res["exit_code"] = 0
    return res


if __name__ == "__main__":
    sys.exit(main()["exit_code"])
