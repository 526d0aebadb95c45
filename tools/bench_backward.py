#!/usr/bin/env python
"""Time the attention backward kernels alone against PyTorch SDPA's backward, per mode, eager and CUDA-graph replay.

Per shape and mode, on the same inputs: visionattn's deterministic backward (``elsa_backward`` from a saved ``out``
and FP32 ``lse``; window shapes ``swin-b-s1..4`` / ``swinv2-b-s1``: ``window_backward``, fused and split, with the
bias [H, N, N] gradient and the shift mask) vs ``torch.autograd.grad`` of SDPA (EFFICIENT, and for fp16 / bf16 FLASH
and CUDNN; the same logits through ``attn_mask = bias + shift``). Eager ms (CUDA events around ``--calls`` calls,
median of ``--repeats``) beside graph replays of the same calls in alternating windows (``--no-graph`` skips them;
n/a and ``graph_error`` where capture fails). TFLOP/s = 10*B*H*N^2*D; peak extra memory of one call.
``--bias-splits``, ``--configs`` and ``--fp32-products`` time alternatives beside the defaults. TF32 matmul is
switched off. Writes ``<out>.md`` and ``<out>.json``.

Usage: python tools/bench_backward.py [--out out/bench_backward] [--modes fp32 fp16] [--shapes vit-b16-224] [--no-graph]
       python tools/bench_backward.py --shapes swin-b-s1 swin-b-s3 --modes fp32 bf16 --bias-splits 8 32 128
"""
from __future__ import annotations

import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, add_common, check_device, default_out, eager_graph_timings,  # noqa: E402
                      positive_int, prefix_outputs, write_results)

from visionattn.checks import has_backward  # noqa: E402
from visionattn.modes import mode_names  # noqa: E402

MODES = tuple(m for m in mode_names() if has_backward(m))  # the modes with backward kernels
# name -> (B, H, N, D, relative position bias with a gradient, windows per image: 0 = dense attention)
SHAPES = {
    "long-4k": (1, 8, 4096, 64, False, 0),
    "long-16k": (1, 8, 16384, 64, False, 0),
    "vit-b16-224": (64, 12, 197, 64, False, 0),
    "vit-b16-1024": (8, 12, 4097, 64, False, 0),  # ViT-B/16 at 1024 px, batch 8: 64 x 64 patches + CLS
    "vit-l14-224": (32, 16, 257, 64, False, 0),  # ViT-L/14 at 224 px (CLIP, DINOv2), batch 32: 16 x 16 patches + CLS
    "heads-64": (256, 16, 64, 64, False, 0),  # 64-token heads (8 x 8 feature maps)
    "vit-b16-224-relpos": (64, 12, 197, 64, True, 0),
    "vit-b16-224-relpos-d32": (64, 24, 197, 32, True, 0),
    "long-4k-d128": (1, 8, 4096, 128, False, 0),
    # Swin-B 224 px, batch 64: B = 64 images x windows per image; the last stage's one window is not shifted
    "swin-b-s1": (64 * 64, 4, 49, 32, True, 64),
    "swin-b-s2": (64 * 16, 8, 49, 32, True, 16),
    "swin-b-s3": (64 * 4, 16, 49, 32, True, 4),
    "swin-b-s4": (64, 32, 49, 32, True, 1),
    # Swin-v2-B 256 px (window 8), batch 64, stage 1: 64-token windows (bias and shift mask; the cosine logit
    # scale and its gradient are not part of this timing)
    "swinv2-b-s1": (64 * 64, 4, 64, 32, True, 64),
}


def build_parser() -> ToolParser:
    p = ToolParser(description=__doc__.split("\n\n")[0], formatter_class=__import__("argparse").RawTextHelpFormatter)
    p.add_argument("--out", default=default_out("bench_backward"),
                   help="file prefix: writes <out>.md and <out>.json (default: out/bench_backward)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="visionattn modes to time")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["long-4k", "long-16k", "vit-b16-224"],
                   help="shapes (B, H, N, D): " + ", ".join(f"{k}={v[:4]}" for k, v in SHAPES.items())
                   + "; '-relpos' and the Swin shapes add a [H, N, N] bias with a gradient")
    p.add_argument("--bias-splits", nargs="+", type=positive_int, default=None,
                   help="chunks of the bias-gradient reduction to time beside the automatic choice")
    p.add_argument("--configs", nargs="+", type=_config, default=[], metavar="M,N,W,S[/M,N,W,S]",
                   help="tiles to time beside the default, each block_m, block_n, warps, stages: dK/dV then dQ "
                        "tiles for the two-kernel backward (e.g. 32,128,4,3/128,32,8,3); one tile set for the "
                        "single-pass backward (the dK/dV kernel with the ordered dQ accumulation, e.g. 64,128,8,2); "
                        "a fifth number sets a kernel's narrow last tile (e.g. 32,128,4,3,16/128,32,4,3,16)")
    p.add_argument("--fp32-products", nargs="+", choices=("f16x3", "f16x3-head", "tf32x3", "ieee"),
                   default=[],
                   help="FP32 modes: also time the backward (and each --configs tile set) with these products "
                        "(default: the mode's own only)")
    add_common(p, calls=20, repeats=5, warmup=3,
               device=("cuda", "device (cpu: Triton's interpreter, for a smoke test)"))
    p.add_argument("--no-sdpa", action="store_true", help="time visionattn's backward only")
    p.add_argument("--no-graph", action="store_true",
                   help="eager timing only: skip the CUDA-graph replays (graph ms and eager / graph show '-')")
    return p


def _config(text: str):
    """``M,N,W,S/M,N,W,S`` -> :class:`visionattn.kernels.elsa_bwd.BwdConfig` (dK/dV tiles, then dQ tiles);
    ``M,N,W,S`` -> the single-pass backward with those tiles; a fifth number ``,T`` on a kernel's tiles sets its
    narrow last tile (``KernelTiles.tail``)."""
    import argparse

    from visionattn.kernels.elsa_bwd import BwdConfig, KernelTiles

    try:
        tiles = [KernelTiles(*(int(x) for x in part.split(","))) for part in text.split("/")]
        if len(tiles) not in (1, 2):
            raise ValueError
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected M,N,W,S/M,N,W,S (dK/dV then dQ tiles) or M,N,W,S (single "
                                         f"pass), got {text!r}") from None
    dkdv, dq = tiles if len(tiles) == 2 else tiles * 2
    for t in (dkdv, dq):
        if min(t.block_m, t.block_n) < 16 or t.block_m & (t.block_m - 1) or t.block_n & (t.block_n - 1) \
                or t.num_warps not in (1, 2, 4, 8, 16) or t.num_stages < 1 \
                or t.tail and (t.tail < 16 or t.tail & (t.tail - 1)):
            raise argparse.ArgumentTypeError(f"{text!r}: blocks must be powers of two >= 16, warps 1-16 (a power "
                                             f"of two), stages >= 1, a tail 0 or a power of two >= 16")
    return BwdConfig(dkdv, dq, single_pass=len(tiles) == 1)


def _config_text(cfg) -> str:
    return "/".join(",".join(str(x) for x in (t.block_m, t.block_n, t.num_warps, t.num_stages)
                             + ((t.tail,) if t.tail else ()))
                    for t in ((cfg.dkdv,) if cfg.single_pass else (cfg.dkdv, cfg.dq)))


def _inputs(B, H, N, D, dtype, relpos, windows, device):
    """q, k, v, dO, the forward out and FP32 lse, the bias [H, N, N], the shift mask [nW, N, N] (windows > 1:
    timm's 0 / -100 pattern stand-in, -100 on a random third) and its [B, 1, N, N] per-window expansion."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, device=device).to(dtype) for _ in range(4))
    bias = torch.randn(H, N, N, generator=g, device=device) if relpos else None
    shift = shift_full = None
    if windows > 1:
        shift = torch.where(torch.rand(windows, N, N, generator=g, device=device) < 1 / 3, -100.0, 0.0)
        shift_full = shift.repeat(B // windows, 1, 1)[:, None]
    scale = D ** -0.5
    lse = torch.empty(B, H, N, device=device, dtype=torch.float32)
    kf = k.float()
    for i in range(0, N, 2048):  # [B, H, 2048, N] FP32 logits at a time
        s = q[:, :, i:i + 2048].float() @ kf.transpose(-1, -2) * scale
        if bias is not None:
            s = s + bias[:, i:i + 2048]
        if shift_full is not None:
            s = s + shift_full[:, :, i:i + 2048]
        lse[:, :, i:i + 2048] = torch.logsumexp(s, -1)
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(bias, shift_full, B,
                                                                                              dtype), scale=scale)
    return q, k, v, do, out, lse, bias, shift, shift_full, scale


def _sdpa_mask(bias, shift_full, B, dtype):
    """SDPA's additive mask: the bias over every batch entry, plus the per-window shift mask (None: neither)."""
    if bias is None:
        return None
    mask = bias.expand(B, *bias.shape)
    return (mask if shift_full is None else mask + shift_full).to(dtype)


def _sdpa_backward(q, k, v, do, bias, shift_full, scale, backend):
    """A callable running SDPA's backward alone (the forward graph built once, on the current stream, retained)."""
    from torch.nn.attention import sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    b = bias.detach().to(q.dtype).requires_grad_() if bias is not None else None
    with sdpa_kernel(backend):
        mask = _sdpa_mask(b, shift_full, q.shape[0], q.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale)
    wrt = leaves + ([b] if b is not None else [])

    def run():
        with sdpa_kernel(backend):
            torch.autograd.grad(out, wrt, do, retain_graph=True)
    return run


def _ours(q, k, v, do, out, lse, bias, shift, windows, scale, mode, splits, kernel, config=None, products=None):
    """A callable running visionattn's backward alone: the window backward (``kernel``: fused / split) for a
    window shape, else the dense one; ``config``: the split kernels' tiles (None = default); ``products``: the
    FP32 products (None = the mode's)."""
    from visionattn.kernels.elsa_bwd import elsa_backward
    from visionattn.kernels.window_bwd import window_backward

    if windows:
        return lambda: window_backward(q, k, v, out, do, lse, bias, shift, windows, scale, mode, None, True, False,
                                       bias_splits=splits, kernel=kernel, config=config, products=products)
    return lambda: elsa_backward(q, k, v, out, do, lse, bias, None, False, scale, mode, bias is not None,
                                 bias_splits=splits, config=config, products=products)


def main(args) -> dict:
    from visionattn.kernels.elsa_bwd import BWD_MODES
    from visionattn.kernels.window_bwd import FUSED_MAX_TOKENS
    from _harness import call_ms, environment, graph_cells, markdown_table, peak_memory, per_call_ms
    from torch.nn.attention import SDPBackend

    parser = build_parser()
    outputs = prefix_outputs(parser, args.out, (".md", ".json"), tool="bench_backward")
    device = check_device(parser, args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    timer = per_call_ms(device, args.calls, args.repeats, args.warmup)
    timings = functools.partial(eager_graph_timings, timer=timer, device=device, calls=args.calls,
                                repeats=args.repeats, graph=not args.no_graph, warmup=args.warmup)
    rows = []
    for shape in args.shapes:
        B, H, N, D, relpos, windows = SHAPES[shape]
        flops = 10.0 * B * H * N * N * D
        for mode in args.modes:
            dtype = BWD_MODES[mode][0]
            q, k, v, do, out, lse, bias, shift, shift_full, scale = _inputs(B, H, N, D, dtype, relpos, windows,
                                                                            device)
            cells = {}  # kernel name -> {"ms", "mb", "splits", "error", "graph_ms", "graph_error"}
            def time_ours(kernel, suffix="", splits=None, inputs=(q, k, v, do, out, lse, bias, shift, windows,
                                                                  scale, mode), **kw):
                """One visionattn cell: compile, then time eager, measure, time graph (kernel: the window path)."""
                ours = _ours(*inputs, splits, kernel, **kw)
                first = call_ms(ours, device)  # the first call: compiles with the Triton cache as found
                name = "visionattn" + ("" if kernel is None else f"-{kernel}") + suffix
                ms, graph, why = timings(lambda: ours)
                cells[name] = {"ms": ms, "mb": peak_memory(ours, device)["peak_extra_mib"], "splits": splits,
                               "graph_ms": graph, "graph_error": why, "first_ms": first}

            # window shapes: both window kernel paths where the fused one applies (the dense kernel: one path)
            kernels = [None] if not windows else ["fused", "split"] if N <= FUSED_MAX_TOKENS else ["split"]
            for kernel in kernels:
                for splits in [None] + (args.bias_splits if relpos and args.bias_splits else []):
                    time_ours(kernel, "" if splits is None else f" splits={splits}", splits)
                for products in args.fp32_products if dtype == torch.float32 else []:
                    time_ours(kernel, f" products={products}", products=products)
            for cfg in args.configs:  # the split kernels' tiles given on the command line, with each products
                for products in [None] + (args.fp32_products if dtype == torch.float32 else []):
                    time_ours("split" if windows else None, f" tiles={_config_text(cfg)}"
                              + (f" products={products}" if products else ""), config=cfg, products=products)
            if not args.no_sdpa:
                backends = {"sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
                if dtype != torch.float32:
                    backends.update({"sdpa-flash": SDPBackend.FLASH_ATTENTION,
                                     "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION})
                for name, backend in backends.items():
                    try:
                        fn = _sdpa_backward(q, k, v, do, bias, shift_full, scale, backend)
                        first = call_ms(fn, device)
                        mb = peak_memory(fn, device)["peak_extra_mib"]
                    except RuntimeError as exc:  # backend not available for this dtype / bias
                        cells[name] = {"error": str(exc).splitlines()[0][:120]}
                        continue
                    del fn  # the timing builds its own forward on the capture stream
                    ms, graph, why = timings(functools.partial(_sdpa_backward, q, k, v, do, bias, shift_full, scale,
                                                               backend))
                    cells[name] = {"ms": ms, "mb": mb, "graph_ms": graph, "graph_error": why, "first_ms": first}
            ref = cells.get("sdpa-efficient", {}).get("ms")
            for name, cell in cells.items():
                ms, graph = cell.get("ms"), cell.get("graph_ms")
                rows.append({"shape": shape, "B": B, "H": H, "N": N, "D": D, "bias_grad": relpos,
                             "windows_per_image": windows, "mode": mode, "kernel": name,
                             "bias_splits": cell.get("splits"), "ms": ms, "tflops": flops / ms / 1e9 if ms else None,
                             "peak_extra_mb": cell.get("mb"), "vs_sdpa_efficient": ref / ms if ms and ref else None,
                             "error": cell.get("error"), "graph_ms": graph,
                             "eager_over_graph": ms / graph if ms and graph else None,
                             "graph_error": cell.get("graph_error"), "first_ms": cell.get("first_ms")})
                text = f"{ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s" if ms else f"n/a ({rows[-1]['error']})"
                if graph:
                    text += f", graph {graph:8.3f} ms"
                elif cell.get("graph_error"):
                    text += f", graph n/a ({cell['graph_error']})"
                print(f"{shape:20s} {mode:10s} {name:24s} {text}", flush=True)
            del q, k, v, do, out, lse, bias, shift, shift_full, time_ours
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type != "cuda":
        timing = "CPU wall clock (Triton interpreter): a smoke test, not a speed; no CUDA graph (graph ms: -)"
    else:
        timing = (f"eager: CUDA events around {args.calls} back-to-back calls, median of {args.repeats} windows (the "
                  "Python launch path counts) -- ms and TFLOP/s columns; graph: "
                  + ("not timed (--no-graph)" if args.no_graph else
                     f"the same {args.calls} calls captured in one CUDA graph, median of {args.repeats} replays "
                     "(GPU time without the launch path) -- graph ms column, n/a where the calls cannot be captured "
                     "(graph_error in the JSON)")
                  + "; first call: the cell's first call, wall clock to its completion (compiles with the Triton "
                    "cache as found) -- first call ms column")
    env = environment({"timing": timing, "flops": "10 * B * H * N^2 * D per backward", "allow_tf32": False})
    table = markdown_table(
        [(r["shape"], r["mode"], r["kernel"], r["ms"] if r["ms"] else "n/a", r["tflops"] or "n/a",
          *graph_cells(r["ms"], r["graph_ms"], r["graph_error"]),
          f"{r['first_ms']:.1f}" if r.get("first_ms") is not None else "-",
          r["vs_sdpa_efficient"] or "", r["peak_extra_mb"] if r["peak_extra_mb"] is not None else "")
         for r in rows],
        ["shape", "mode", "kernel", "ms", "TFLOP/s", "graph ms", "eager / graph", "first call ms",
         "x SDPA-efficient", "peak extra MiB"])
    md = ("# Attention backward: visionattn vs SDPA (eager and CUDA-graph replay)\n\n"
          + "\n".join(f"- {k}: {v}" for k, v in env.items()))
    result = {"environment": env, "rows": rows}
    write_results(outputs, args.out, result, md + "\n\n" + table)
    return result


if __name__ == "__main__":
    parser = build_parser()
    main(parser.parse_args())
