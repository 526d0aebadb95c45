#!/usr/bin/env python
"""Reconstruct images or a video with VGGT / FastVGGT / π³ / Pi3X: points, cameras, depth, COLMAP, nerfstudio, glTF.

    python demos/reconstruct.py --out out/recon --weights random-tiny --device cpu   # quick start, CPU
    python demos/reconstruct.py my_photos/ --out out/mine                              # VGGT-1B (downloads)
    python demos/reconstruct.py my_photos/ --out out/pi3 --model pi3                   # π³ (yyfz233/Pi3)
    python demos/reconstruct.py my_photos/ --out out/pi3x --model pi3x --intrinsics my_photos/sparse/0
    python demos/reconstruct.py walk.mp4 --fps 2 --max-frames 64 --out out/walk      # a video, 2 frames/s
    python demos/reconstruct.py my_photos/ --out out/mine --weights /ckpt/VGGT-1B --mode bf16

Thin CLI over :func:`visionattn.recon.pipeline.reconstruct`. Exit codes: 0 ok;
2 for a problem with the input (bad argument value, missing, empty or unreadable
input, corrupt image, unusable --out, bad --device, weights not available or
corrupt) -- reported in one line before any heavy work, and no OUT_DIR is
created -- or a disk that filled up while writing (one line naming the folder,
nothing left behind); 130 (Ctrl-C), 143 (SIGTERM) and 129 (SIGHUP): stopped,
nothing written.
"""
from __future__ import annotations

import time

STARTED = time.perf_counter()  # run as a script, the summary's setup and total count from here: the imports too

import argparse  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_IMAGE_DIR = os.path.join(REPO, "demos", "data", "aloe")
sys.path.insert(0, os.path.join(REPO, "tools"))  # the command-line helpers the tools share
from _harness import ToolParser, nonnegative_int, percentile, positive_float, positive_int  # noqa: E402

OUTPUTS = """outputs (in OUT_DIR, all written side by side to a hidden temporary folder and renamed at the end):
  points.ply            coloured point cloud, points under the confidence percentile dropped; with
                        --max-points N a seeded random N of them -> open3d, MeshLab, CloudCompare, Blender
  points_full.ply       the whole cloud, when --max-points dropped points
  scene.glb             the points of points.ply (at most 2M) + one frustum per camera -> any glTF viewer
                        (Blender, three.js, gltf-viewer.donmccurdy.com), trimesh. Axes turned to glTF's y-up
                        (x, -y, -z)
  sparse/0/             COLMAP binary model: cameras.bin, images.bin, points3D.bin (and the .txt files with
                        --colmap-text); PINHOLE per image in source-image pixels, points with tracks; with
                        --ba the bundle-adjusted cameras and tracked points
                        -> COLMAP, pycolmap, nerfstudio (ns-process-data / colmap), gsplat
  images/               the frames under the names the models use (copies of the sources, never
                        links: editing them leaves your photos alone; decoded video frames as JPEG)
                        -> read by COLMAP, nerfstudio, gsplat
  transforms.json       nerfstudio: OpenGL camera-to-world, per-frame intrinsics, depth_file_path,
                        one depth_unit_scale_factor, ply_file_path -> ns-train ... --data OUT_DIR
  depth/NAME.png        16-bit depth in source-image pixels, one scale for all frames:
                        depth = value / depth_png_scale (cameras.json) = value * depth_unit_scale_factor
                        (transforms.json); 0 = no depth
  depth/NAME.npy        float32 depth of the model's frame (numpy)
  confidence/NAME.npy   depth confidence, float32 (numpy)
  cameras.json          per frame: name, source file (video: FILE#frame=N), image, extrinsic 3x4 (OpenCV
                        camera-from-world, world = first camera), intrinsic 3x3 (model's frame) and
                        intrinsic_original (source image) -> tools/eval_reconstruction.py, your code.
                        pi3 / pi3x: their camera-to-world poses re-expressed in the first camera's frame, depth =
                        the z of their camera-frame points, confidence = sigmoid(conf), intrinsics fitted to
                        those points (principal point at the centre) unless --intrinsics gives them
  preview.png           the point cloud from the first camera and from an oblique view, depth maps
  summary.json          frames, tokens, points kept, seconds per stage (setup, decode_build, compile, warmup,
                        inference, tracks, bundle_adjustment, export, other: they add up to total; decode_build
                        is the wall of the frame decode and the model build, which run side by side: each
                        one's own seconds in decode_build) and per output (export_outputs: written side by
                        side, so they overlap; depth/ is its frames' writers summed), inference_seconds
                        (the forward) beside estimate_s (the estimate logged before it), peak memory (host
                        RSS, CUDA), mode, environment; with --ba the reprojection error before / after
  .visionattn-recon.json  manifest of every file written: a later run replaces OUT_DIR only while
                        it holds exactly these files

exit codes: 0 success; 2 bad input (bad argument value, input missing/empty/unreadable, corrupt image or
video, --out not usable, bad --device, weights unavailable or corrupt): one line says why, before any heavy
work, and no OUT_DIR is created; also 2 when the disk fills up while writing (one line naming the folder,
nothing left behind); 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP (temporary folder removed)."""


def _decode_build(own: dict, wall: float) -> str:
    """``"decode 4.9 s beside build 7.7 s (7.8 s)"``: each one's own seconds and the wall of both; ``"build
    ..., then decode ..."`` where they ran one after the other (--max-frames auto)."""
    if own["side_by_side"]:
        return f"decode {own['decode']:.1f} s beside build {own['build']:.1f} s ({wall:.1f} s)"
    return f"build {own['build']:.1f} s, then decode {own['decode']:.1f} s"


def _max_frames(text: str):
    """argparse type of --max-frames: a positive int or 'auto'."""
    if text == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or 'auto')") from None


def build_parser() -> argparse.ArgumentParser:
    from visionattn.recon.pipeline import ATTN_MODES, HEADS, HOST_MEMORY, MODEL_WEIGHTS, MODELS

    p = ToolParser(  # errors: one line, exit status 2
        prog="reconstruct.py", description=__doc__.split("\n\n")[0],
        epilog=OUTPUTS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", default=DEFAULT_IMAGE_DIR, metavar="INPUT",
                   help="a folder of images (any format Pillow reads; EXIF orientation, grayscale, RGBA, "
                        "16-bit and float handled; files sorted naturally; non-image and non-regular files "
                        "skipped with a note) or a video file (anything OpenCV reads: .mp4, .avi, .mov, .mkv, "
                        "...; decoded as a stream, see --fps / --every). Default: "
                        "demos/data/aloe, the Middlebury 'Aloe' stereo pair (2 real views of a static scene, "
                        "from OpenCV's samples; other bundled sets: demos/data/stereo_rig (6 grayscale "
                        "frames), demos/data/suzanne (2 rendered views))")
    p.add_argument("--out", required=True, metavar="OUT_DIR",
                   help="output folder: new, empty, or an earlier output of this tool holding only the files "
                        "its manifest lists (then replaced); never the input, inside it or around it")
    p.add_argument("--model", choices=MODELS, default="vggt",
                   help="vggt: plain VGGT; fastvggt: VGGT with token merging in global attention "
                        "(FastVGGT); pi3: π³ (reference-free, no track head: no --ba); pi3x: Pi3X, which also "
                        "takes known cameras (--intrinsics, --poses). The π³ / Pi3X weights are CC BY-NC 4.0 "
                        "(non-commercial) (default: %(default)s)")
    p.add_argument("--mode", choices=ATTN_MODES, default="fp32",
                   help="attention precision: fp32 (FP32-accurate), fp32-ieee, tf32, fp16, bf16, pasa "
                        "(robust FP16), or sdpa (PyTorch's own attention, a baseline). On a GPU the half modes "
                        "(fp16, bf16, pasa) also run the rest of the network under autocast of their dtype, as the "
                        "official demos run it (FP32 weights; VGGT's heads as --heads says); otherwise it stays FP32 "
                        "(default: %(default)s)")
    p.add_argument("--heads", choices=HEADS, default=None,
                   help="vggt / fastvggt: precision of the camera, depth and point heads: fp32 (VGGT's FP32 "
                        "heads, the default) or bf16 / fp16 (as the official FastVGGT code runs them, faster); "
                        "stated in summary.json as 'heads'")
    p.add_argument("--weights", default=None,
                   help="a hub id (downloaded, cached), a local checkpoint PATH (folder or .safetensors/.pt), "
                        "'random' (the released configuration, random weights: timing and precision studies) or "
                        "'random-tiny' (tiny configuration: CPU quick start, CI). Offline, a hub id fails fast "
                        "and says to pass --weights PATH (default: the model's own: "
                        + ", ".join(f"{m} {w}" for m, w in MODEL_WEIGHTS.items() if m != "fastvggt") + ")")
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto (cuda if available) "
                                                    "(default: %(default)s)")
    p.add_argument("--conf-percentile", type=percentile, default=50.0, metavar="P",
                   help="drop points whose confidence is below this percentile (0..100; 0 keeps all) "
                        "(default: %(default)s)")
    p.add_argument("--max-frames", type=_max_frames, default=None, metavar="N",
                   help="use only the first N images in natural order, or the first N sampled video frames "
                        "(decoding stops there); 'auto': the most frames that fit the free GPU memory, said in "
                        "the log (default: all)")
    p.add_argument("--fps", type=positive_float, default=None, metavar="F",
                   help="video: keep about F frames per second of video (the first frame of each 1/F s; a "
                        "finite number > 0; at or above the video's own rate every frame is kept)")
    p.add_argument("--every", type=positive_int, default=None, metavar="N",
                   help="video: keep every N-th frame (0, N, 2N, ...); exclusive with --fps "
                        "(default for a video: every frame)")
    p.add_argument("--size", type=positive_int, default=518,
                   help="preprocessed width (crop) or longest side (pad) in pixels, a multiple of 14; "
                        "518 for VGGT-1B (default: %(default)s)")
    p.add_argument("--preprocess", choices=("crop", "pad"), default="crop",
                   help="VGGT preprocessing: crop (width to SIZE, height centre-cropped to at most SIZE) or "
                        "pad (longest side to SIZE, padded to a square with white) (default: %(default)s)")
    p.add_argument("--points-from", choices=("depth", "pointmap"), default="depth",
                   help="point cloud source: depth maps unprojected with the predicted cameras (VGGT's "
                        "recommendation) or the point-map head (default: %(default)s)")
    p.add_argument("--warmup", type=nonnegative_int, default=0, metavar="N",
                   help="untimed forward passes before the timed one; the first pass on a GPU includes "
                        "Triton compilation, so use 1 or more for timings (default: %(default)s)")
    p.add_argument("--no-compile-ahead", action="store_true",
                   help="on a GPU, do not compile the attention kernels in a background thread while the model "
                        "loads (they then compile in the first forward)")
    p.add_argument("--host-memory", choices=HOST_MEMORY, default="auto",
                   help="where the per-pixel predictions (48 bytes per pixel: ~10 GiB for 1000 518x392 frames) "
                        "wait for the export: on disk in a temporary folder beside OUT_DIR, or in host memory; "
                        "auto: on disk when they would take over half the free host memory (default: %(default)s)")
    p.add_argument("--max-points", type=positive_int, default=None, metavar="N",
                   help="at most N points in points.ply and scene.glb (a seeded random subset, for viewers that "
                        "choke on millions); the whole cloud then goes to points_full.ply (default: all)")
    p.add_argument("--colmap-text", action="store_true",
                   help="write sparse/0 as COLMAP text files too (.txt beside the .bin; needs pycolmap)")
    p.add_argument("--ba", action="store_true",
                   help="bundle-adjust the predicted cameras and points with pycolmap over tracks of VGGT's track "
                        "head (query pixels in --ba-query-frames frames; an observation needs track visibility "
                        "and confidence > 0.2 and lies within --ba-max-error px of its point's projection); "
                        "sparse/0 is then the refined model, summary.json has the reprojection error before / "
                        "after. Needs pycolmap (pip install pycolmap)")
    p.add_argument("--ba-query-frames", type=positive_int, default=8, metavar="N",
                   help="--ba: frames whose pixels are tracked, spread evenly from the first (default: %(default)s)")
    p.add_argument("--ba-points", type=positive_int, default=512, metavar="N",
                   help="--ba: random pixels tracked from each query frame (default: %(default)s)")
    p.add_argument("--ba-max-error", type=positive_float, default=8.0, metavar="PX",
                   help="--ba: the largest distance in pixels of the model's frame between a tracked pixel and the "
                        "projection of its point for the observation to count (default: %(default)s)")
    p.add_argument("--intrinsics", default=None, metavar="FILE",
                   help="--model pi3x: known intrinsics, from a COLMAP model folder (e.g. sparse/0; needs pycolmap) "
                        "or a transforms.json (fl_x/fl_y/cx/cy or camera_angle_x), matched to the frames by image "
                        "file name (every frame needs one); rescaled to the model's frame and used as cameras.json's "
                        "intrinsics")
    p.add_argument("--poses", default=None, metavar="FILE",
                   help="--model pi3x: known camera poses, from a COLMAP model folder or a transforms.json "
                        "(OpenGL camera-to-world, turned to OpenCV), matched by image file name; Pi3X uses them "
                        "relative to each other (any world frame and unit; at least two frames)")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and sampled points "
                                                       "(default: %(default)s)")
    p.add_argument("--no-preview", action="store_true", help="skip preview.png")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or notes (the summary line only, and warnings: a CPU run estimated to take "
                        "over 2 minutes still says so, naming the --max-frames / --fps that would take about a minute)")
    return p


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def main(argv=None, started: float | None = None) -> dict:
    """Run the demo; returns the summary dict (with ``exit_code``). Never calls sys.exit itself. ``started``: a
    ``time.perf_counter()`` reading from which the summary's setup and total count (None: the call itself)."""
    from visionattn.recon.outdir import handle_sigterm, stop_status
    from visionattn.recon.pipeline import USER_ERRORS, reconstruct

    parser = build_parser()
    args = parser.parse_args(argv)
    # argument values (their types check ranges and finiteness): parser.error prints one line and exits
    # with code 2, before any output
    if args.size % 14:
        parser.error(f"--size {args.size} must be a positive multiple of 14 (e.g. 518)")
    if args.fps is not None and args.every is not None:
        parser.error("--fps and --every are exclusive: pass one of them")
    for flag, value in (("--intrinsics", args.intrinsics), ("--poses", args.poses)):
        if value is not None and args.model != "pi3x":
            parser.error(f"{flag} conditions Pi3X only: add --model pi3x")
    if args.heads is not None and args.model in ("pi3", "pi3x"):
        parser.error(f"--heads sets VGGT / FastVGGT's heads; --model {args.model} runs its own (drop --heads)")
    if args.ba and args.model in ("pi3", "pi3x"):
        parser.error(f"--ba tracks with VGGT's track head; --model {args.model} has none (use vggt or fastvggt)")
    log = (lambda *a: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    try:
        with handle_sigterm(), warnings.catch_warnings():
            if args.quiet:  # the summary line only: notes such as the intrinsics fallback stay in summary.json
                warnings.simplefilter("ignore")
            summary = reconstruct(
                args.input, args.out, model=args.model, mode=args.mode, weights=args.weights,
                device=args.device, conf_percentile=args.conf_percentile, max_frames=args.max_frames,
                size=args.size, preprocess=args.preprocess, point_source=args.points_from, seed=args.seed,
                preview=not args.no_preview, progress=not args.quiet, warmup=args.warmup, log=log,
                fps=args.fps, every=args.every, host_memory=args.host_memory,
                compile_ahead=not args.no_compile_ahead, max_points=args.max_points, colmap_text=args.colmap_text,
                ba=args.ba, ba_query_frames=args.ba_query_frames, ba_points=args.ba_points,
                ba_max_error=args.ba_max_error, intrinsics_file=args.intrinsics, poses_file=args.poses,
                heads=args.heads, warn=lambda msg: print(f"warning: {msg}", file=sys.stderr), started=started)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return {"exit_code": 2, "error": str(exc)}
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP turned into Terminated: temp folder removed
        code, how = stop_status(exc)
        print(f"{how}: nothing was written to {args.out}", file=sys.stderr)
        return {"exit_code": code, "error": how}
    summary["command"] = shlex.join(["demos/reconstruct.py", *(sys.argv[1:] if argv is None else argv)])
    sec = summary["seconds"]
    ba = summary.get("bundle_adjustment")
    print(f"reconstructed {summary['frames']} frames ({summary['image_hw'][0]}x{summary['image_hw'][1]}), "
          f"{summary['tokens']} tokens, {summary['points_kept']:,} points kept"
          + (f" ({summary['points_ply']:,} in points.ply)" if summary["points_ply"] != summary["points_kept"] else "")
          + ("" if not ba else ", BA skipped (no track passed)" if "skipped" in ba else
             f", BA reprojection error {ba['reprojection_error_before']:.2f} px, kept (BA did not lower it)"
             if ba["reverted"] else
             f", BA reprojection error {ba['reprojection_error_before']:.2f} -> "
             f"{ba['reprojection_error_after']:.2f} px")
          + " | "
          + ", ".join([_decode_build(summary["decode_build"], sec["decode_build"])]
                      + [f"{k} {sec[k]:.1f} s" for k in ("compile", "inference", "tracks", "bundle_adjustment",
                                                         "export") if sec[k] >= 0.05])
          + f", total {sec['total']:.1f} s, "
          f"peak memory {_gib(summary['peak_memory_bytes'])} ({summary['peak_memory_kind']}), "
          f"host RSS {_gib(summary['peak_host_rss_bytes'])}"
          + (f", CUDA {_gib(summary['peak_cuda_allocated_bytes'])}" if 'peak_cuda_allocated_bytes' in summary else "")
          + " | "
          f"{summary['model']} mode={summary['mode']}"
          + (f" heads={summary['heads']}" if summary["heads"] else "")
          + f" weights={summary['weights']} on {summary['device']} "
          f"-> {summary['out_dir']}")
    summary["exit_code"] = 0
    return summary


if __name__ == "__main__":
    try:
        sys.exit(main(started=STARTED)["exit_code"])
    except KeyboardInterrupt:  # Ctrl-C before main's own handler is in place (imports): no traceback
        print("interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)
