"""Gradients of the calls users write first, against float64 autograd on the GPU: ``out.sum().backward()`` (a
stride-0 output gradient) and a dense output gradient, dense and window attention, at ViT-B/16 and Swin / Swin-v2
sizes. Prints a markdown table (relative L2 error per gradient).

    python tools/grad_layouts.py

Needs a CUDA GPU; docs/benchmarks/gpu_conformance_h200.md holds a run.
"""
import argparse

import torch

import visionattn as va
from visionattn.metrics import rel_l2
from visionattn.window import window_attention_reference

DEV = "cuda"


def rel(a, b):
    """:func:`visionattn.metrics.rel_l2`, NaN where ``a`` is not finite."""
    return rel_l2(a, b) if torch.isfinite(a).all() else float("nan")


def dense(mode, shape, loss, D=64):
    B, H, N = shape
    g = torch.Generator(device=DEV).manual_seed(0)
    dt = va.get_mode(mode).compute_dtype
    leaves = [torch.randn(B, H, N, D, device=DEV, generator=g).to(dt).requires_grad_() for _ in range(3)]
    out = va.attention(*leaves, mode=mode)
    go = torch.ones_like(out) if loss == "sum" else torch.randn(out.shape, device=DEV, generator=g).to(dt)
    out.sum().backward() if loss == "sum" else out.backward(go)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    torch.nn.functional.scaled_dot_product_attention(*l64).backward(go.double())
    return {n: rel(t.grad, r.grad) for n, t, r in zip(("dq", "dk", "dv"), leaves, l64)}


def window(mode, cosine):
    nW, B, H, D = 16, 4, 4, 32
    N = 64 if cosine else 49
    g = torch.Generator(device=DEV).manual_seed(0)
    leaves = [torch.randn(B * nW, H, N, D, device=DEV, generator=g).requires_grad_() for _ in range(3)]
    leaves.append(torch.randn(H, N, N, device=DEV, generator=g).requires_grad_())
    mask = torch.where(torch.rand(nW, N, N, device=DEV, generator=g) < 0.3, -100.0, 0.0)
    if cosine:
        leaves.append((torch.rand(H, device=DEV, generator=g) * 5).requires_grad_())
    kw = dict(shift_mask=mask, num_windows=nW, cosine=cosine)
    out = va.window_attention(*leaves[:3], relative_position_bias=leaves[3], logit_scale=leaves[4] if cosine else None,
                              mode=mode, **kw)
    out.sum().backward()
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    window_attention_reference(*l64[:3], relative_position_bias=l64[3], logit_scale=l64[4] if cosine else None,
                               state_dtype=torch.float64, **kw).sum().backward()
    return {n: rel(t.grad, r.grad) for n, t, r in zip(("dq", "dk", "dv", "dbias", "dlogit_scale"), leaves, l64)}


ROWS = [
    ("attention fp32 [8,16,197,64] out.sum()", lambda: dense("fp32", (8, 16, 197), "sum")),
    ("attention fp32 [64,12,197,64] out.sum()", lambda: dense("fp32", (64, 12, 197), "sum")),
    ("attention fp32 [1,1,197,64] out.sum()", lambda: dense("fp32", (1, 1, 197), "sum")),
    ("attention fp32 [8,16,197,64] dense grad_out", lambda: dense("fp32", (8, 16, 197), "randn")),
    ("attention tf32 [8,16,197,64] out.sum()", lambda: dense("tf32", (8, 16, 197), "sum")),
    ("window fp32 49 tokens bias + shift, out.sum()", lambda: window("fp32", False)),
    ("window tf32 cosine 64 tokens, out.sum()", lambda: window("tf32", True)),
    ("attention fp32 N=1000 dense grad_out", lambda: dense("fp32", (2, 4, 1000), "randn")),
    ("attention bf16 N=197 dense grad_out", lambda: dense("bf16", (8, 16, 197), "randn")),
    ("attention fp16 N=4096 dense grad_out", lambda: dense("fp16", (1, 4, 4096), "randn")),
]

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help
    if not torch.cuda.is_available():
        raise SystemExit("grad_layouts: needs a CUDA GPU")
    print("| call (H200) | result |\n|---|---|")
    for name, fn in ROWS:
        try:
            r = fn()
            worst = max(r.values())
            print(f"| {name} | " + ", ".join(f"{k} {v:.1e}" for k, v in r.items()) + f" (worst {worst:.1e}) |",
                  flush=True)
        except Exception as exc:
            print(f"| {name} | {type(exc).__name__}: {str(exc)[:120]} |", flush=True)
