#!/usr/bin/env python
"""Stable Video Diffusion attention at real shapes: visionattn modes vs diffusers' default processor.

Times the attention modules of SVD's UNet at real shapes (levels of 320/640/1280/1280 channels, 5/10/20/20 heads of
64, 9216 spatial tokens at 576x1024, 25 frames, CFG batch 2): spatial and temporal self / cross attention, the whole
diffusers ``Attention`` forward per run vs ``native*`` (AttnProcessor2_0, PyTorch SDPA), random weights; per case the
median time, the peak extra memory and the rel L2 vs native-fp32. ``--unet-bench``: one forward of the full-size SVD
UNet (random weights; ``--unet-config tiny``: eval_svd's tiny-random UNet, for tests) per run, with NaN/inf outputs
and the processor's overflow events. Runs and dtypes as in tools/eval_svd.py. Writes OUT.md and OUT.json.

  python tools/bench_svd_attention.py --bench-levels 2 --bench-reps 5 --frames 25 --out PREFIX
  python tools/bench_svd_attention.py --unet-bench --out out/svd_unet_h100
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, default_out, environment, markdown_table, md_header, nonnegative_int,  # noqa: E402
                      peak_memory, positive_int, prefix_outputs, sample_ms, tf32_flags, write_results)
from eval_svd import (DTYPE_NAMES, NATIVE, add_run_args, build_tiny_pipeline, check_run_args,  # noqa: E402
                      free_memory, jsonable, parse_modes, run_dtype)

from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.patching.diffusers import (ELSAAttnProcessor, overflow_counts, patch_diffusers,  # noqa: E402
                                           unpatch_diffusers)

DEFAULT_MODES = "native-fp32,native-fp16,fp32,tf32,fp16,pasa"
# SVD UNet (UNetSpatioTemporalConditionModel defaults = the released config).
SVD_LEVELS = ((320, 5), (640, 10), (1280, 20), (1280, 20))
SVD_CROSS_DIM = 1024


def svd_attention_cases(height: int, width: int, frames: int, levels: int, batch: int = 2) -> list[dict]:
    """SVD UNet attention shapes per level: level l has (height/8/2^l) x (width/8/2^l) latent tokens; spatial self /
    cross attention runs on batch*frames sequences of them, temporal on batch*tokens sequences of frames; cross
    attention attends to one CLIP image token of SVD_CROSS_DIM channels."""
    cases = []
    for lvl, (ch, heads) in enumerate(SVD_LEVELS[:levels]):
        n = (height // 8 >> lvl) * (width // 8 >> lvl)
        for kind, seqs, tokens, cross in (("spatial-self", batch * frames, n, False),
                                          ("spatial-cross", batch * frames, n, True),
                                          ("temporal-self", batch * n, frames, False),
                                          ("temporal-cross", batch * n, frames, True)):
            cases.append({"level": lvl, "kind": kind, "channels": ch, "heads": heads, "head_dim": ch // heads,
                          "sequences": seqs, "tokens": tokens, "kv_tokens": 1 if cross else tokens, "cross": cross})
    return cases


def _time_call(fn, device: str, reps: int, warmup: int) -> tuple[float, float | None]:
    """Median ms of ``fn()`` (:func:`_harness.sample_ms`) and the peak extra GiB of one call (CUDA)."""
    times = sample_ms(fn, device, warmup=warmup, reps=reps)
    mib = peak_memory(fn, device)["peak_extra_mib"]
    return float(np.median(times)), None if mib is None else mib / 1024


def attention_bench(args) -> tuple[dict, str]:
    """Per-mode time / peak memory / error of SVD's attention modules at real shapes vs diffusers' default."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    device = args.device
    runs = parse_modes(args.modes, "native-fp32")
    cases = svd_attention_cases(args.height, args.width, args.frames, args.bench_levels)
    res = {"environment": environment(), "config": vars(args), "cases": []}
    g = torch.Generator("cpu").manual_seed(args.seed)
    for case in tqdm(cases, desc="attention cases", disable=args.quiet):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            attn = Attention(query_dim=case["channels"], heads=case["heads"], dim_head=case["head_dim"],
                             cross_attention_dim=SVD_CROSS_DIM if case["cross"] else None).eval()
        x = torch.randn(case["sequences"], case["tokens"], case["channels"], generator=g)
        enc = torch.randn(case["sequences"], 1, SVD_CROSS_DIM, generator=g) if case["cross"] else None
        row = dict(case, runs={})
        ref = None
        for name in runs:
            dtype = run_dtype(name, args.dtype, device)
            attn.to(device=device, dtype=dtype)
            attn.set_processor(AttnProcessor2_0() if name in NATIVE else ELSAAttnProcessor(name, count_overflow=False))
            xi = x.to(device, dtype)
            ei = enc.to(device, dtype) if enc is not None else None
            with torch.no_grad():
                fn = lambda: attn(xi, encoder_hidden_states=ei)  # noqa: E731
                y = fn().float().cpu()
                ms, gib = _time_call(fn, device, args.bench_reps, args.bench_warmup)
            ref = y if ref is None else ref
            row["runs"][name] = {"dtype": DTYPE_NAMES[dtype], "ms": ms, "peak_extra_gib": gib,
                                 "rel_l2_vs_native_fp32": rel_l2(y, ref), "finite": bool(torch.isfinite(y).all())}
            del xi, ei
        attn.to("cpu")
        res["cases"].append(row)
    res = jsonable(res)
    header = ["level", "kind", "seqs x heads x N x d -> M"] + [f"{r} ms" for r in runs] + \
             [f"{r} GiB" for r in runs] + [f"{r} rel err" for r in runs[1:]]
    rows = []
    for c in res["cases"]:
        r = c["runs"]
        shape = f"{c['sequences']}x{c['heads']}x{c['tokens']}x{c['head_dim']} -> {c['kv_tokens']}"
        rows.append([c["level"], c["kind"], shape]
                    + [r[n]["ms"] for n in runs] + ["-" if r[n]["peak_extra_gib"] is None else r[n]["peak_extra_gib"]
                                                     for n in runs] + [r[n]["rel_l2_vs_native_fp32"] for n in runs[1:]])
    md = md_header(f"SVD attention at real shapes ({args.height}x{args.width}, {args.frames} frames, CFG batch 2)",
                   res["environment"], f"diffusers {res['environment'].get('diffusers')}",
                   "whole diffusers `Attention` module forward (projections + attention), random weights, median of "
                   f"{args.bench_reps} after {args.bench_warmup} warm-up; `native*` = diffusers' AttnProcessor2_0 "
                   "(SDPA); peak extra memory over the inputs; rel err = relative L2 vs native-fp32")
    return res, "\n".join(md + [markdown_table(rows, header)])


def unet_bench(args) -> tuple[dict, str]:
    """One full-size SVD UNet forward (random weights, CFG batch 2) per mode: time, peak memory, NaN, error."""
    from diffusers import UNetSpatioTemporalConditionModel

    device = args.device
    runs = parse_modes(args.modes, "native-fp32")
    h, w = args.height // 8, args.width // 8
    g = torch.Generator("cpu").manual_seed(args.seed)
    x = torch.randn(2, args.frames, 8, h, w, generator=g)
    enc = torch.randn(2, 1, SVD_CROSS_DIM if args.unet_config == "svd" else 32, generator=g)
    t = torch.tensor([1.0])
    ids = torch.tensor([[6.0, 127.0, 0.02]]).repeat(2, 1)
    res = {"environment": environment(), "config": vars(args), "runs": {}}
    plan = [(name, run_dtype(name, args.dtype, device)) for name in runs]
    order = sorted(range(len(plan)), key=lambda i: (DTYPE_NAMES[plan[i][1]] != "fp32", DTYPE_NAMES[plan[i][1]], i))
    outputs, unet, unet_dtype = {}, None, None
    for i in tqdm(order, desc="unet modes", disable=args.quiet):
        name, dtype = plan[i]
        if dtype != unet_dtype:  # rebuild from the seed per dtype: the same float32 weights, rounded once
            unet = None
            free_memory(device)
            torch.manual_seed(args.seed)  # a tool: process-wide RNG use is fine here
            with torch.device(device):
                unet = (UNetSpatioTemporalConditionModel(num_frames=args.frames) if args.unet_config == "svd"
                        else build_tiny_pipeline(args.seed, args.frames).unet).eval()
            unet.to(device=device, dtype=dtype)
            unet_dtype = dtype
        if name not in NATIVE:
            patch_diffusers(unet, name, count_overflow=True)
        inputs = [a.to(device, dtype) for a in (x, t, enc, ids)]
        try:
            with torch.no_grad():
                fn = lambda: unet(*inputs).sample  # noqa: E731
                y = fn().float().cpu()
                ms, gib = _time_call(fn, device, args.bench_reps, args.bench_warmup)
            ov = overflow_counts(unet) if name not in NATIVE else None
        finally:
            if name not in NATIVE:
                unpatch_diffusers(unet)
        outputs[name] = y
        res["runs"][name] = {"dtype": DTYPE_NAMES[dtype], "ms": ms, "peak_extra_gib": gib,
                             "finite": bool(torch.isfinite(y).all()), "overflow": ov}
        del inputs
    res["runs"] = {name: res["runs"][name] for name in runs}
    for name in runs:
        res["runs"][name]["rel_l2_vs_native_fp32"] = rel_l2(outputs[name], outputs["native-fp32"])
    res = jsonable(res)
    rows = [[n, r["dtype"], r["ms"], "-" if r["peak_extra_gib"] is None else r["peak_extra_gib"], r["finite"],
             r["rel_l2_vs_native_fp32"], "-" if r["overflow"] is None else r["overflow"]["overflow_events"]]
            for n, r in res["runs"].items()]
    md = md_header(f"Full-size SVD UNet forward ({args.height}x{args.width}, {args.frames} frames, CFG batch 2, "
                   "random weights)", res["environment"], f"diffusers {res['environment'].get('diffusers')}")
    return res, "\n".join(md + [markdown_table(rows, ["run", "dtype", "ms", "peak extra GiB", "finite",
                                                      "rel err vs native-fp32", "overflow events"])])


def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="bench_svd_attention.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, DEFAULT_MODES)
    p.add_argument("--out", default=None,
                   help="output path without extension (default out/svd_attention, with --unet-bench out/svd_unet)")
    p.add_argument("--unet-bench", action="store_true",
                   help="time one full-size SVD UNet forward (random weights) per mode, not the attention modules")
    p.add_argument("--unet-config", default="svd", choices=["svd", "tiny"],
                   help="--unet-bench UNet: the released SVD config (1.5B parameters) or the tiny-random one (tests)")
    p.add_argument("--bench-levels", type=int, default=4, choices=[1, 2, 3, 4], help="UNet levels of attention cases")
    p.add_argument("--bench-reps", type=positive_int, default=10, help="timed repetitions per benchmark case")
    p.add_argument("--bench-warmup", type=nonnegative_int, default=2, help="untimed repetitions per benchmark case")
    return p


def main(argv=None) -> dict:
    """Parse and check ``argv`` (exit 2 with one line before any work), then run the benchmark with TF32 off for
    PyTorch matmuls and cuDNN convolutions (said in the output); returns the results dict."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_run_args(parser, args, "native-fp32")
    args.out = args.out or default_out("svd_unet" if args.unet_bench else "svd_attention")
    files = prefix_outputs(parser, args.out, (".json", ".md"), tool="bench_svd_attention")
    with tf32_flags() as settings:
        print(f"process-wide settings for this run: {settings}")
        res, md = unet_bench(args) if args.unet_bench else attention_bench(args)
    write_results(files, args.out, res, md)
    print(md)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
