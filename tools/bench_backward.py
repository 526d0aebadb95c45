#!/usr/bin/env python
"""Time the attention backward kernels alone against PyTorch SDPA's backward, per mode, eager.

For each shape and mode, on the same inputs in one process: visionattn's deterministic backward
(:func:`visionattn.kernels.elsa_bwd.elsa_backward`, from a saved ``out`` and ``lse``) and SDPA's backward
(``torch.autograd.grad`` of an SDPA output under ``sdpa_kernel``: EFFICIENT_ATTENTION, and for fp16 / bf16 also
FLASH_ATTENTION and CUDNN_ATTENTION; SDPA's FP32 baseline for the ``fp32`` / ``fp32-ieee`` / ``tf32`` rows is
EFFICIENT_ATTENTION on FP32 inputs). Timing: CUDA events around back-to-back calls (eager: the Python launch
path counts), median of windows. TFLOP/s count the backward as 2.5 forwards: 10 * B * H * N^2 * D (five
N x N x D matmuls). ``lse`` is computed from the FP32 logits by ``torch.logsumexp`` in query chunks and
``out`` by SDPA; only their consistency matters for timing. Peak extra memory is
``torch.cuda.max_memory_allocated`` above the inputs during one backward call.

Process-wide settings (a tool may set them): TF32 matmul OFF, so the FP32 SDPA rows are FP32.

Writes ``<out>.md`` and ``<out>.json`` (environment, command, every cell).

Usage: python tools/bench_backward.py [--out out/bench_backward] [--modes fp32 fp16] [--shapes vit-b16-224]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _cli import ToolParser, check_output, default_out, positive_int  # noqa: E402

MODES = ("fp32", "fp32-ieee", "tf32", "fp16", "bf16")
# name -> (B, H, N, D, relative position bias with a gradient)
SHAPES = {
    "long-4k": (1, 8, 4096, 64, False),
    "long-16k": (1, 8, 16384, 64, False),
    "vit-b16-224": (64, 12, 197, 64, False),
    "vit-b16-224-relpos": (64, 12, 197, 64, True),
    "long-4k-d128": (1, 8, 4096, 128, False),
}


def build_parser() -> ToolParser:
    p = ToolParser(description=__doc__.split("\n\n")[0], formatter_class=__import__("argparse").RawTextHelpFormatter)
    p.add_argument("--out", default=default_out("bench_backward"),
                   help="file prefix: writes <out>.md and <out>.json (default: out/bench_backward)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="visionattn modes to time")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["long-4k", "long-16k", "vit-b16-224"],
                   help="shapes (B, H, N, D): " + ", ".join(f"{k}={v[:4]}" for k, v in SHAPES.items())
                   + "; '-relpos' adds a [H, N, N] bias with a gradient")
    p.add_argument("--calls", type=positive_int, default=20, help="back-to-back calls per timing window")
    p.add_argument("--repeats", type=positive_int, default=5, help="timing windows (the median is reported)")
    p.add_argument("--no-sdpa", action="store_true", help="time visionattn's backward only")
    return p


def _inputs(B, H, N, D, dtype, relpos, device):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g, device=device).to(dtype) for _ in range(4))
    bias = torch.randn(H, N, N, generator=g, device=device) if relpos else None
    scale = D ** -0.5
    lse = torch.empty(B, H, N, device=device, dtype=torch.float32)
    kf = k.float()
    for i in range(0, N, 2048):  # [B, H, 2048, N] FP32 logits at a time
        s = q[:, :, i:i + 2048].float() @ kf.transpose(-1, -2) * scale
        if bias is not None:
            s = s + bias[:, i:i + 2048]
        lse[:, :, i:i + 2048] = torch.logsumexp(s, -1)
    with torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else
                                                               bias.to(dtype).expand(B, H, N, N), scale=scale)
    return q, k, v, do, out, lse, bias, scale


def _peak_extra_mb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _sdpa_backward(q, k, v, do, bias, scale, backend):
    """A callable running SDPA's backward alone (the forward graph built once, retained)."""
    from torch.nn.attention import sdpa_kernel

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    b = bias.detach().to(q.dtype).requires_grad_() if bias is not None else None
    with sdpa_kernel(backend):
        mask = b.expand(q.shape[0], *b.shape) if b is not None else None
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale)
    wrt = leaves + ([b] if b is not None else [])

    def run():
        with sdpa_kernel(backend):
            torch.autograd.grad(out, wrt, do, retain_graph=True)
    return run


def main(args) -> dict:
    from visionattn.kernels.elsa_bwd import BWD_MODES, elsa_backward
    from visionattn.reporting import environment, eager_ms, markdown_table, write_json_atomic, write_text_atomic
    from torch.nn.attention import SDPBackend

    args.out = check_output(build_parser(), args.out)
    if not torch.cuda.is_available():
        raise SystemExit("bench_backward: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        B, H, N, D, relpos = SHAPES[shape]
        flops = 10.0 * B * H * N * N * D
        for mode in args.modes:
            dtype = BWD_MODES[mode][0]
            q, k, v, do, out, lse, bias, scale = _inputs(B, H, N, D, dtype, relpos, device)

            def ours():
                elsa_backward(q, k, v, out, do, lse, bias, None, False, scale, mode, bias is not None)

            ours()  # compile
            cells = {"visionattn": (eager_ms(ours, args.calls, 3, args.repeats), _peak_extra_mb(ours))}
            if not args.no_sdpa:
                backends = {"sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
                if dtype != torch.float32:
                    backends.update({"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION})
                for name, backend in backends.items():
                    try:
                        fn = _sdpa_backward(q, k, v, do, bias, scale, backend)
                        fn()
                        cells[name] = (eager_ms(fn, args.calls, 3, args.repeats), _peak_extra_mb(fn))
                    except RuntimeError as exc:  # backend not available for this dtype / bias
                        cells[name] = (None, None, str(exc).splitlines()[0][:120])
            ref = cells.get("sdpa-efficient", (None,))[0]
            for name, cell in cells.items():
                ms, mb = cell[0], cell[1]
                rows.append({"shape": shape, "B": B, "H": H, "N": N, "D": D, "bias_grad": relpos, "mode": mode,
                             "kernel": name, "ms": ms, "tflops": flops / ms / 1e9 if ms else None,
                             "peak_extra_mb": mb, "vs_sdpa_efficient": ref / ms if ms and ref else None,
                             "error": cell[2] if len(cell) > 2 else None})
                print(f"{shape:20s} {mode:10s} {name:15s} " + (f"{ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s"
                                                               if ms else f"n/a ({rows[-1]['error']})"), flush=True)
            del q, k, v, do, out, lse, bias
            torch.cuda.empty_cache()
    env = environment({"timing": "eager: CUDA events around back-to-back calls, median of windows",
                       "flops": "10 * B * H * N^2 * D per backward", "allow_tf32": False})
    table = markdown_table(
        [(r["shape"], r["mode"], r["kernel"], r["ms"] if r["ms"] else "n/a", r["tflops"] or "n/a",
          r["vs_sdpa_efficient"] or "", r["peak_extra_mb"] if r["peak_extra_mb"] is not None else "")
         for r in rows],
        ["shape", "mode", "kernel", "ms", "TFLOP/s", "x SDPA-efficient", "peak extra MiB"])
    md = "# Attention backward: visionattn vs SDPA (eager)\n\n" + "\n".join(f"- {k}: {v}" for k, v in env.items())
    write_text_atomic(args.out + ".md", md + "\n\n" + table)
    result = {"environment": env, "rows": rows}
    write_json_atomic(args.out + ".json", result)
    return result


if __name__ == "__main__":
    parser = build_parser()
    main(parser.parse_args())
