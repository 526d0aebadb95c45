"""Calls at the kernels' index limits: row offsets past 2^31 elements, and more than 65,535 windows on a grid axis.

    python tools/large_calls.py                  # every case on the GPU (~2 minutes on an H200)
    python tools/large_calls.py --cases varlen_bf16 window_tiled

The randomized conformance suite keeps its shapes small; these calls are the ones where an index formed in int32
wraps (a row index times a row stride of 3072 elements, timm's packed projection at 16 heads of 64, passes 2^31 from
row 699,051, about 672 VGGT frames) or a launch grid outgrows CUDA's 65,535 programs on axes 1 and 2. Each case
runs in its own process (an illegal address ends the CUDA context) and compares the call's last rows (or last
windows) with float64 on those rows alone: the output, and for the backward cases dq of the last rows (dense) or
every gradient of the last sequence (varlen), and reports the case's peak GPU memory (tens of GB for the row-offset
cases: one that runs out of memory on a smaller GPU is reported skipped, not failed). Writes OUT.md and OUT.json; exit 1 when a case fails or crashes.

``--device cpu`` runs the same cases at interpreter sizes (``TRITON_INTERPRET=1``), the tool's own test.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# case -> (description, bound on the relative error of the float64 comparison)
CASES = {
    "dense_fp32": ("fp32 forward, B=1 H=1 N=720,000 D=64, q / k / v rows of stride 3072", 1e-5),
    "dense_pasa": ("pasa forward, same inputs in float16", 1e-2),
    "dense_bf16_bwd": ("bf16 forward + backward, same, dO rows of stride 3072", 2e-2),
    "dense_fp32_bwd": ("fp32 forward + backward, same", 1e-5),
    "varlen_bf16": ("varlen bf16 forward + backward, 2,150 sequences x 1,024 tokens, H=16 D=64, packed qkv", 2e-2),
    "varlen_fp32": ("varlen fp32 forward + backward, 700 sequences x 1,024 tokens, packed qkv", 1e-5),
    "window_tiled": ("window fp32 and bf16, 4,096 windows x 16 heads x 144 tokens (tiled kernel)", 2e-2),
    "window_small": ("window fp32, 2,200,000 windows x 1 head x 4 tokens (small kernel)", 1e-5),
}
# interpreter sizes of the same calls: (dense N, varlen sequences x length x heads x head dim, windows)
_TINY = dict(n=300, seqs=(3, 64, 2, 16), tiled=(4, 2), small=8)
_FULL = dict(n=720_000, seqs=(2150, 1024, 16, 64), tiled=(4096, 16), small=2_200_000)


def _rel(a, b) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def _run_case(name: str, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    import visionattn as va

    torch.manual_seed(0)
    size = _TINY if device == "cpu" else _FULL
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def strided(n, dtype, col):  # [1, 1, n, 64] with row stride 3072
        return torch.randn(n, 3072, device=device, dtype=dtype)[:, col * 1024: col * 1024 + 64][None, None]

    def dense(mode, backward, tail=32):
        dtype = {"fp32": torch.float32, "pasa": torch.float16, "bf16": torch.bfloat16}[mode]
        q, k, v = (strided(size["n"], dtype, c).requires_grad_(backward) for c in range(3))
        o = va.attention(q, k, v, mode=mode, backend="triton")
        go = strided(size["n"], dtype, 1) if backward else None
        if backward:
            o.backward(go)
        sync()
        qt, kk, vv = q.detach()[0, 0, -tail:].double(), k.detach()[0, 0].double(), v.detach()[0, 0].double()
        p = torch.softmax(qt @ kk.T / 8.0, -1)
        ref = p @ vv
        errs = {"out": _rel(o.detach()[0, 0, -tail:], ref)}
        if backward:
            do = go[0, 0, -tail:].double()
            dq = (p * (do @ vv.T - (ref * do).sum(-1, keepdim=True))) @ kk / 8.0
            errs["dq"] = _rel(q.grad[0, 0, -tail:], dq)
            errs["finite"] = all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v))
        return errs

    def varlen(mode, seqs):
        n_seq, length, heads, dim = seqs
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        total = n_seq * length
        qkv = torch.randn(total, 3, heads, dim, device=device, dtype=dtype, requires_grad=True)
        q, k, v = qkv.unbind(1)
        cu = torch.arange(0, total + 1, length, device=device, dtype=torch.int32)
        o = va.varlen_attention(q, k, v, cu, cu, length, length, mode=mode, backend="triton")
        go = torch.randn(total, heads, dim, device=device, dtype=dtype)
        o.backward(go)
        sync()
        last = slice(total - length, total)
        ref_in = [x.detach()[last].double().transpose(0, 1).requires_grad_() for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in)
        ref.backward(go[last].double().transpose(0, 1))
        errs = {"out": _rel(o.detach()[last].transpose(0, 1), ref.detach())}
        for i, name in enumerate(("dq", "dk", "dv")):
            errs[name] = _rel(qkv.grad[last, i].transpose(0, 1), ref_in[i].grad)
        errs["finite"] = bool(torch.isfinite(qkv.grad).all())
        return errs

    def window(mode, windows, heads, tokens):
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        q, k, v = (torch.randn(windows, heads, tokens, 16, device=device, dtype=dtype) for _ in range(3))
        o = va.window_attention(q, k, v, num_windows=1, mode=mode, backend="triton")
        sync()
        ref = F.scaled_dot_product_attention(q[-3:].double(), k[-3:].double(), v[-3:].double())
        return _rel(o[-3:], ref)

    runs = {
        "dense_fp32": lambda: dense("fp32", False), "dense_pasa": lambda: dense("pasa", False),
        "dense_bf16_bwd": lambda: dense("bf16", True), "dense_fp32_bwd": lambda: dense("fp32", True),
        "varlen_bf16": lambda: varlen("bf16", size["seqs"]),
        "varlen_fp32": lambda: varlen("fp32", (700, *size["seqs"][1:]) if device == "cuda" else size["seqs"]),
        "window_tiled": lambda: {"out fp32": window("fp32", *size["tiled"], 144),
                                 "out bf16": window("bf16", *size["tiled"], 144)},
        "window_small": lambda: {"out": window("fp32", size["small"], 1, 4)},
    }
    start = time.perf_counter()
    try:
        errs = runs[name]()
    except torch.OutOfMemoryError as exc:  # a smaller GPU: not a defect of the call
        total = torch.cuda.get_device_properties(0).total_memory / 1e9
        return {"skipped": f"out of memory on a {total:.0f} GB GPU: {str(exc).splitlines()[0][:160]}"}
    result = {"errors": errs, "seconds": round(time.perf_counter() - start, 2)}
    if device == "cuda":
        result["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    return result


def _verdict(name: str, result: dict) -> str:
    if "crash" in result or "skipped" in result:
        return "crash" if "crash" in result else "skipped"
    errs = result["errors"]
    ok = errs.get("finite", True) and all(v <= CASES[name][1] for k, v in errs.items() if k != "finite")
    return "pass" if ok else "fail"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="cases to run (default: all)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda (default), or cpu: the same calls at interpreter sizes (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default="out/large_calls", help="output prefix: writes OUT.md and OUT.json")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one case may take (default 120)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_run_case(args.worker, args.device)))
        return 0
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if args.device == "cpu" else {}))
    results = {}
    for name in args.cases:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--device", args.device]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            lines = proc.stdout.strip().splitlines()
            results[name] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                "crash": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1][:300]}
        except subprocess.TimeoutExpired:
            results[name] = {"crash": f"timed out after {args.timeout:.0f} s"}
        results[name]["verdict"] = _verdict(name, results[name])
        print(f"{name}: {results[name]}", flush=True)
    rows = ["| case | call | relative error vs float64 (last rows) | s | peak GB | verdict |",
            "|---|---|---|---|---|---|"]
    for name, r in results.items():
        errs = r.get("crash") or r.get("skipped") or ", ".join(f"{k} {v:.2e}" if k != "finite" else f"finite {v}"
                                                               for k, v in r["errors"].items())
        rows.append(f"| {name} | {CASES[name][0]} | {errs} | {r.get('seconds', '')} | {r.get('peak_gb', '')} | "
                    f"{r['verdict']} |")
    device = "cpu (interpreter sizes)"
    if args.device == "cuda":
        import torch
        import triton
        device = f"{torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__})"
    command = " ".join(["python", "tools/large_calls.py", *(sys.argv[1:] if argv is None else argv)])
    md = f"# Calls at the index limits\n\nDevice: {device}. Command: `{command}`\n\n" + "\n".join(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for suffix, text in ((".md", md + "\n"), (".json", json.dumps({"device": device, "cases": results}, indent=1))):
        tmp = args.out + suffix + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out + suffix)
    print(md)
    return 0 if all(r["verdict"] in ("pass", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
