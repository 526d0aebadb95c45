"""Benchmark Swin / Swin-v2 window attention: visionattn vs timm eager, timm SDPA and FlexAttention.

Attention only (q, k, v given as timm's ``qkv.unbind`` views, bias + shift mask) for
every stage of the models in ``configs/bench_window.yaml`` at several batch sizes,
fp16 and fp32; then the WindowAttention module (qkv + attention + proj) and whole
models (random weights), patched with :func:`visionattn.patch_model`
vs unpatched timm. Times are medians of ``triton.testing.do_bench`` (CUDA events,
L2 flushed between runs); memory is the peak allocated during one call beyond the
inputs. Writes ``<out>.md``, ``<out>.json`` and ``<out>.png``.

This tool sets no global precision flags: timm eager fp32 runs with PyTorch's
defaults (``torch.backends.cuda.matmul.allow_tf32 = False``), recorded in the output.

    python tools/bench_window.py --out out/window_h100
    python tools/bench_window.py --batches 64 --models swin_base_224 --methods visionattn,eager
    python tools/bench_window.py --models swin_base_224 --batches 64 --dtypes fp32,tf32,fp16 \
        --methods visionattn --precisions f16x3,tf32x3,f16x1,tf32 --no-sweep --no-module --no-models

``--precisions`` times the FP32 modes' product precisions side by side in the same run
(:data:`visionattn.kernels.window_fwd.PRECISIONS`: split-FP16 ``f16x3`` / ``f16x1`` vs
Triton's ``tf32x3`` / ``tf32`` / ``ieee``), each with its error against the float64 reference.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (OutputFiles, ToolParser, check_output, default_out, environment, figure, kernel_ms,  # noqa: E402
                      markdown_table, output_files, peak_extra_mb)
from _timm_models import create_timm_model  # noqa: E402

parser = ToolParser(prog="bench_window.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--config", default=os.path.join(REPO, "configs", "bench_window.yaml"),
                    help="YAML sweep definition (models, batches, dtypes, flex cases, key case, sweep)")
parser.add_argument("--out", default=default_out("window_bench"),
                    help="output prefix: writes <out>.md, <out>.json, <out>.png (default: %(default)s)")
parser.add_argument("--models", default=None, help="comma-separated model names from the config (default: all)")
parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default: config)")
parser.add_argument("--dtypes", default=None,
                    help="comma-separated subset of fp16,fp32,tf32 (visionattn modes; tf32 runs on fp32 inputs; "
                         "default: config)")
parser.add_argument("--methods", default=None,
                    help="comma-separated subset of visionattn,eager,sdpa,flex (default: config)")
parser.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep on the key case")
parser.add_argument("--no-module", action="store_true", help="skip the WindowAttention module timings")
parser.add_argument("--no-models", action="store_true", help="skip the whole-model latency table")
parser.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up time per measurement (ms)")
parser.add_argument("--rep-ms", type=float, default=None, help="do_bench measuring time per measurement (ms)")
parser.add_argument("--precisions", default=None,
                    help="comma-separated FP32 product precisions to compare on the fp32/tf32 rows "
                         "(f16x3,tf32x3,ieee apply to fp32; f16x1,tf32 to tf32), e.g. f16x3,tf32x3,f16x1,tf32")
parser.add_argument("--cuda-graph", action="store_true",
                    help="time with triton.testing.do_bench_cudagraph: no Python launch overhead, but no L2 flush "
                         "either (small cases then run from L2 and can beat the DRAM I/O floor)")
parser.add_argument("--max-cases", type=int, default=None, help="stop after this many attention cases (smoke runs)")


# ----------------------------------------------------------------------------- environment / io
def tool_environment() -> dict:
    """:func:`_harness.environment` plus this tool's keys (gpu, TF32 matmul flag, UTC date)."""
    return environment({
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})


# ----------------------------------------------------------------------------- shapes
def stage_shapes(model: dict) -> list[dict]:
    """Window-attention shape of each stage of a Swin / Swin-v2 config (dict from the YAML)."""
    out = []
    for i, heads in enumerate(model["heads"]):
        res = model["img"] // 4 // (2 ** i)
        ws = min(model["window"], res)
        out.append({"stage": i, "res": res, "window": ws, "N": ws * ws, "nW": (res // ws) ** 2,
                    "heads": heads, "dim": model["embed_dim"] * 2 ** i, "shifted": res > ws})
    return out


def make_block(kind: str, st: dict, device, dtype):
    """timm block of this stage (shifted when the stage shifts): returns (WindowAttention, shift mask | None)."""
    from timm.models.swin_transformer import SwinTransformerBlock
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block

    cls = SwinTransformerBlock if kind == "v1" else SwinTransformerV2Block
    shift = st["window"] // 2 if st["shifted"] else 0
    blk = cls(st["dim"], (st["res"], st["res"]), num_heads=st["heads"], window_size=st["window"],
              shift_size=shift).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # non-trivial bias (timm initializes the v1 table at std 0.02)
        if kind == "v1":
            blk.attn.relative_position_bias_table.normal_(0, 1)
        else:
            blk.attn.logit_scale.uniform_(math.log(5), math.log(50))
    return blk.attn, blk.attn_mask


def attn_inputs(attn, kind: str, batch: int, st: dict, mask, device, dtype):
    """q, k, v views of one qkv tensor [B*nW, N, 3, H, D] and the bias the module would use."""
    BW, N, H = batch * st["nW"], st["N"], st["heads"]
    D = st["dim"] // H
    qkv = torch.randn(BW, N, 3, H, D, device=device, dtype=dtype).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    with torch.no_grad():
        if kind == "v1":
            bias = attn._get_rel_pos_bias()[0]
        else:
            table = attn.cpb_mlp(attn.relative_coords_table).view(-1, H)
            rel = table[attn.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1).contiguous()
            bias = 16 * torch.sigmoid(rel)  # as timm's (and the patched) Swin-v2 module
    return q, k, v, bias


# ----------------------------------------------------------------------------- methods (attention only)
def eager_fn(kind, attn, q, k, v, bias, mask):
    """timm's eager attention lines (swin_transformer[_v2].WindowAttention.forward)."""
    H, N = q.shape[1], q.shape[2]

    def run():
        if kind == "v1":
            a = (q * attn.scale) @ k.transpose(-2, -1)
        else:
            a = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
            a = a * torch.clamp(attn.logit_scale, max=math.log(1. / 0.01)).exp()
        a = a + bias.unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            a = a.view(-1, nw, H, N, N) + mask.unsqueeze(1).unsqueeze(0)
            a = a.view(-1, H, N, N)
        return a.softmax(-1) @ v
    return run


def sdpa_fn(kind, attn, q, k, v, bias, mask):
    """timm's fused path (TIMM_FUSED_ATTN, Swin v1 only): bias + mask expanded to [B*nW, H, N, N]."""
    if kind != "v1":
        return None
    H, N, BW = q.shape[1], q.shape[2], q.shape[0]

    def run():
        am = bias.unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            am = am + mask.view(1, nw, 1, N, N).expand(BW // nw, -1, H, -1, -1).reshape(-1, H, N, N)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=am)
    return run


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_fn(kind, attn, q, k, v, bias, mask):
    """FlexAttention with a score_mod adding bias[h] and mask[b % nW] (Swin-v2: normalize q, k outside)."""
    flex = _compiled_flex()
    nw = mask.shape[0] if mask is not None else 1
    mask_t = mask if mask is not None else torch.zeros(1, 1, 1, device=q.device, dtype=q.dtype)
    if kind == "v1":
        def score_mod(score, b, h, qi, kj):
            return score + bias[h, qi, kj] + mask_t[b % nw, qi, kj]

        return lambda: flex(q, k, v, score_mod=score_mod, scale=attn.scale)
    ls = torch.clamp(attn.logit_scale.detach(), max=math.log(100.0)).exp().reshape(-1)

    def score_mod2(score, b, h, qi, kj):
        return score * ls[h] + bias[h, qi, kj] + mask_t[b % nw, qi, kj]

    return lambda: flex(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, score_mod=score_mod2, scale=1.0)


def visionattn_fn(kind, attn, q, k, v, bias, mask, mode, config=None, precision=None):
    from visionattn.window import validate_window_inputs
    from visionattn.kernels.window_fwd import window_attention_fwd

    nw = mask.shape[0] if mask is not None else 1
    cosine = kind == "v2"
    ls = attn.logit_scale.detach() if cosine else None
    b, m, ls = validate_window_inputs(q, k, v, bias, mask, nw, cosine, ls)
    scale = attn.scale if kind == "v1" else 1.0
    return lambda: window_attention_fwd(q, k, v, b, m, nw, cosine, ls, scale, mode, config=config,
                                        precision=precision)


# ----------------------------------------------------------------------------- measuring
_TIMER = {"cuda_graph": False}  # set from --cuda-graph in main()


def measure(fn, warmup: float, rep: float) -> dict:
    """Median ms (do_bench, or do_bench_cudagraph with --cuda-graph) and peak extra memory (MiB) of
    ``fn``; errors are recorded, not raised."""
    try:
        with torch.no_grad():
            peak = peak_extra_mb(fn, torch.device("cuda"))
            ms = kernel_ms(fn, warmup, rep, _TIMER["cuda_graph"])
        return {"ms": float(ms), "peak_mib": float(peak)}
    except Exception as e:  # noqa: BLE001 - a failing baseline is a result, not a crash
        torch.cuda.empty_cache()
        return {"ms": None, "peak_mib": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}


def io_floor_ms(q, v, bytes_per_s: float | None) -> float | None:
    if not bytes_per_s:
        return None
    n = q.numel() * 2 + v.numel() * 2  # read q, k, v; write the output
    return n * q.element_size() / bytes_per_s * 1e3


def copy_bandwidth() -> float:
    """Measured device copy bandwidth (bytes/s, read + write) with a 1 GiB buffer."""
    import triton.testing

    x = torch.empty(2 ** 28, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median")
    return 2 * x.numel() * 4 / (ms * 1e-3)


def _accuracy(kind, attn, q, k, v, bias, mask, mode, precision=None) -> float:
    from visionattn.metrics import rel_l2
    from visionattn.window import window_attention_reference

    nw = mask.shape[0] if mask is not None else 1
    sl = slice(0, min(q.shape[0], 4 * nw))
    kw = dict(relative_position_bias=bias, shift_mask=mask, num_windows=nw, cosine=kind == "v2",
              logit_scale=attn.logit_scale.detach() if kind == "v2" else None,
              scale=attn.scale if kind == "v1" else None)
    ref = window_attention_reference(q[sl], k[sl], v[sl], **kw, state_dtype=torch.float64)
    out = visionattn_fn(kind, attn, q[sl], k[sl], v[sl], bias, mask, mode, precision=precision)()
    return rel_l2(out, ref)


# FP32 product precisions comparable with each mode's own (same accuracy class)
PRECISION_CLASS = {"fp32": ("f16x3", "tf32x3", "ieee"), "fp32-ieee": ("f16x3", "tf32x3", "ieee"),
                   "tf32": ("f16x1", "tf32")}


def precisions_for(mode: str, requested: list[str]) -> list[str]:
    """The requested precisions that belong to ``mode``'s accuracy class (none for half modes)."""
    from visionattn.kernels.window_fwd import PRECISIONS

    bad = [p for p in requested if p not in PRECISIONS]
    if bad:
        raise SystemExit(f"--precisions: unknown {bad}; expected a subset of {list(PRECISIONS)}")
    return [p for p in requested if p in PRECISION_CLASS.get(mode, ())]


# ----------------------------------------------------------------------------- parts
def bench_attention(cfg, args, env, rows: list, save=lambda: None) -> list[dict]:
    models = [m for m in cfg["models"] if not args.models or m["name"] in args.models.split(",")]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else cfg["batches"]
    dtypes = args.dtypes.split(",") if args.dtypes else cfg["dtypes"]
    methods = args.methods.split(",") if args.methods else cfg["methods"]
    flex_cases = {(c["model"], c["stage"], c["batch"]) for c in cfg.get("flex_cases", [])}
    jobs = [(m, st, b, dt) for m in models for st in stage_shapes(m) for b in batches for dt in dtypes]
    if args.max_cases:
        jobs = jobs[:args.max_cases]
    for m, st, batch, dt in tqdm(jobs, desc="attention cases"):
        dtype = torch.float16 if dt == "fp16" else torch.float32
        attn, mask = make_block(m["kind"], st, "cuda", dtype)
        q, k, v, bias = attn_inputs(attn, m["kind"], batch, st, mask, "cuda", dtype)
        row = {"model": m["name"], "kind": m["kind"], **st, "batch": batch, "dtype": dt,
               "windows": q.shape[0], "D": q.shape[-1],
               "io_floor_ms": io_floor_ms(q, v, env.get("copy_bytes_per_s"))}
        for meth in methods:
            if meth == "flex" and (m["name"], st["stage"], batch) not in flex_cases:
                continue
            if meth == "visionattn":
                fn = visionattn_fn(m["kind"], attn, q, k, v, bias, mask, dt)
            else:
                fn = {"eager": eager_fn, "sdpa": sdpa_fn, "flex": flex_fn}[meth](m["kind"], attn, q, k, v, bias, mask)
            if fn is not None:
                row[meth] = measure(fn, args.warmup_ms, args.rep_ms)
        if "visionattn" in methods:
            row["visionattn_rel_l2_vs_fp64"] = _accuracy(m["kind"], attn, q, k, v, bias, mask, dt)
        for prec in precisions_for(dt, args.precisions.split(",") if args.precisions else []):
            r = measure(visionattn_fn(m["kind"], attn, q, k, v, bias, mask, dt, precision=prec),
                        args.warmup_ms, args.rep_ms)
            r["rel_l2_vs_fp64"] = _accuracy(m["kind"], attn, q, k, v, bias, mask, dt, precision=prec)
            row.setdefault("precisions", {})[prec] = r
        rows.append(row)
        if len(rows) % 8 == 0:
            save()
        del q, k, v, bias, attn, mask
        torch.cuda.empty_cache()
    return rows


def bench_sweep(cfg, args) -> list[dict]:
    from visionattn.kernels.window_fwd import get_config

    kc = cfg["key_case"]
    model = next(m for m in cfg["models"] if m["name"] == kc["model"])
    st = stage_shapes(model)[kc["stage"]]
    rows = []
    for dt in ("fp16", "fp32"):
        dtype = torch.float16 if dt == "fp16" else torch.float32
        attn, mask = make_block(model["kind"], st, "cuda", dtype)
        q, k, v, bias = attn_inputs(attn, model["kind"], kc["batch"], st, mask, "cuda", dtype)
        default = get_config(q.shape[0], st["heads"], st["N"], q.shape[-1], st["nW"], q.device, mode=dt)
        for c in tqdm([None] + list(cfg.get("sweep", [])), desc=f"config sweep {dt}"):
            conf = None if c is None else {"kernel": "small", **c}
            r = measure(visionattn_fn(model["kind"], attn, q, k, v, bias, mask, dt, config=conf),
                        args.warmup_ms, args.rep_ms)
            rows.append({"dtype": dt, "config": conf or {"default": default}, **r})
    return rows


def bench_module(cfg, args) -> list[dict]:
    """WindowAttention module (qkv + attention + proj): timm eager / timm fused vs a patch_model'd copy."""
    import copy

    import visionattn

    kc = cfg["key_case"]
    rows = []
    for m in cfg["models"]:
        st = stage_shapes(m)[0]
        for dt in ("fp16", "fp32"):
            dtype = torch.float16 if dt == "fp16" else torch.float32
            attn, mask = make_block(m["kind"], st, "cuda", dtype)
            x = torch.randn(kc["batch"] * st["nW"], st["N"], st["dim"], device="cuda", dtype=dtype)
            row = {"model": m["name"], "stage": 0, "batch": kc["batch"], "dtype": dt}
            if m["kind"] == "v1":
                attn.fused_attn = False
            row["timm_eager"] = measure(lambda: attn(x, mask=mask), args.warmup_ms, args.rep_ms)
            if m["kind"] == "v1":
                attn.fused_attn = True
                row["timm_sdpa"] = measure(lambda: attn(x, mask=mask), args.warmup_ms, args.rep_ms)
                attn.fused_attn = False
            patched = visionattn.patch_model(copy.deepcopy(attn), mode=dt)  # patched once, outside the timing
            row["visionattn"] = measure(lambda: patched(x, mask), args.warmup_ms, args.rep_ms)
            rows.append(row)
    return rows


def patch_window_attention(model, mode: str) -> int:
    """Patch ``model`` in place with :func:`visionattn.patch_model`; return the number of patched modules."""
    import visionattn

    return visionattn.patch_model(model, mode=mode).visionattn_report.num_patched


def bench_models(cfg, args) -> list[dict]:
    rows = []
    for spec in cfg.get("model_latency", []):
        for dt in ("fp16", "fp32"):
            dtype = torch.float16 if dt == "fp16" else torch.float32
            row = {"model": spec["timm_name"], "batch": spec["batch"], "dtype": dt}
            try:
                # random weights, Swin-v2's zero-init post-norms woken: attention reaches the logits
                model = create_timm_model(spec["timm_name"], pretrained=False).to("cuda", dtype)
                x = torch.randn(spec["batch"], 3, spec["img"], spec["img"], device="cuda", dtype=dtype)
                row["unpatched"] = measure(lambda: model(x), args.warmup_ms, args.rep_ms)
                with torch.no_grad():
                    ref = model(x).float()
                row["patched_modules"] = patch_window_attention(model, dt)
                row["patched"] = measure(lambda: model(x), args.warmup_ms, args.rep_ms)
                with torch.no_grad():
                    out = model(x).float()
                row["logits_rel_l2_patched_vs_unpatched"] = float((out - ref).norm() / ref.norm())
                del model, x
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch.cuda.empty_cache()
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report
def _fmt(r: dict | None) -> str:
    if not r:
        return "-"
    if r.get("ms") is None:
        return "err"
    return f"{r['ms']:.4f}"


def to_markdown(res: dict) -> str:
    env = res["environment"]
    lines = ["# Window attention benchmark (Swin / Swin-v2)", "",
             f"GPU: **{env['gpu']}**; torch {env['torch']}, triton {env['triton']}, timm {env['timm']}, "
             f"CUDA {env['cuda']}; {env['date']}.", "",
             f"Command: `{env['command']}`", "",
             f"Measured copy bandwidth: {env.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s (read+write). "
             + ("Times: median ms of `triton.testing.do_bench_cudagraph` (CUDA graph: no Python launch overhead, "
              "no L2 flush, so small cases can run from L2 below the DRAM I/O floor). "
              if env.get("cuda_graph_timing") else
              "Times: median ms of `triton.testing.do_bench` (L2 flushed; Python launch overhead included). ")
             + "Peak: extra MiB allocated during one call. "
             f"timm eager fp32 runs with torch defaults (allow_tf32 matmul = {env['allow_tf32_matmul']}).", ""]
    def section(title: str, header: list[str], rows: list[list]) -> None:
        lines.extend([f"## {title}", "", markdown_table(rows, header)])

    def peak(r: dict, side: str) -> str:
        return f"{(r.get(side) or {}).get('peak_mib') or 0:.1f}"

    if res.get("key_case"):
        section("Key case: Swin-B stage 1 (64 images x 64 windows, 4 heads, N=49, D=32, bias + shift mask)",
                ["dtype", "visionattn", "eager", "SDPA (expanded bias)", "FlexAttention", "I/O floor",
                 "visionattn peak MiB", "SDPA peak MiB"],
                [[r["dtype"], *(_fmt(r.get(m)) for m in ("visionattn", "eager", "sdpa", "flex")),
                  f"{r['io_floor_ms'] or 0:.4f}", peak(r, "visionattn"), peak(r, "sdpa")] for r in res["key_case"]])
    prec = []
    for r in (r for r in res.get("attention", []) if r.get("precisions")):
        base = (r.get("visionattn") or {}).get("ms")
        for name, p in r["precisions"].items():
            acc = p.get("rel_l2_vs_fp64")
            prec.append([r["model"], r["stage"] + 1, r["N"], r["batch"], r["dtype"], name, _fmt(p),
                         "-" if acc is None else f"{acc:.1e}",
                         f"{p['ms'] / base:.2f}" if base and p.get("ms") else "-"])
    if prec:
        section("FP32 product precisions (visionattn, same run)",
                ["model", "stage", "N", "batch", "mode", "precision", "ms", "rel L2 vs fp64", "ms / mode default"],
                prec)
    if res.get("sweep"):
        section("Launch-config sweep on the key case", ["dtype", "config", "ms"],
                [[r["dtype"], f"`{json.dumps(r['config'])}`", _fmt(r)] for r in res["sweep"]])
    if res.get("attention"):
        rows = []
        for r in res["attention"]:
            others = [r[m]["ms"] for m in ("eager", "sdpa", "flex") if r.get(m) and r[m].get("ms")]
            va, acc = (r.get("visionattn") or {}).get("ms"), r.get("visionattn_rel_l2_vs_fp64")
            rows.append([r["model"], r["stage"] + 1, r["N"], r["nW"], r["heads"], r["batch"], r["dtype"],
                         *(_fmt(r.get(m)) for m in ("visionattn", "eager", "sdpa", "flex")),
                         f"{r['io_floor_ms'] or 0:.4f}", f"{min(others) / va:.1f}x" if others and va else "-",
                         "-" if acc is None else f"{acc:.1e}"])
        section("Attention only, every stage", ["model", "stage", "N", "nW", "H", "batch", "dtype", "visionattn",
                                                "eager", "SDPA", "Flex", "floor", "speed-up vs best other",
                                                "rel L2 vs fp64"], rows)
    if res.get("module"):
        section("WindowAttention module (qkv + attention + proj), stage 1, key-case batch",
                ["model", "dtype", "timm eager", "timm SDPA", "visionattn (patch_model)"],
                [[r["model"], r["dtype"], *(_fmt(r.get(m)) for m in ("timm_eager", "timm_sdpa", "visionattn"))]
                 for r in res["module"]])
    if res.get("models"):
        section("Whole model (random weights), ms per forward",
                ["model", "batch", "dtype", "unpatched timm", "patched", "rel L2 logits", "note"],
                [[r["model"], r["batch"], r["dtype"], _fmt(r.get("unpatched")), _fmt(r.get("patched")),
                  "-" if r.get("logits_rel_l2_patched_vs_unpatched") is None
                  else f"{r['logits_rel_l2_patched_vs_unpatched']:.1e}", r.get("error", "")] for r in res["models"]])
    return "\n".join(lines)


def plot(res: dict, path: str, outputs: OutputFiles | None = None) -> None:
    rows = [r for r in res.get("attention", []) if r["stage"] == 0]
    models = sorted({r["model"] for r in rows})
    if not models:
        return
    with figure(path, outputs, 2, len(models), figsize=(3.2 * len(models), 6), squeeze=False, tool="bench_window",
                dpi=110) as (fig, axes):
        for j, mname in enumerate(models):
            for i, dt in enumerate(("fp16", "fp32")):
                ax = axes[i][j]
                sel = sorted((r for r in rows if r["model"] == mname and r["dtype"] == dt), key=lambda r: r["batch"])
                for meth in ("visionattn", "eager", "sdpa"):
                    pts = [(r["batch"], r[meth]["ms"]) for r in sel if r.get(meth) and r[meth].get("ms")]
                    if pts:
                        ax.loglog(*zip(*pts), marker="o", label=meth)
                pts = [(r["batch"], r["io_floor_ms"]) for r in sel if r.get("io_floor_ms")]
                if pts:
                    ax.loglog(*zip(*pts), ls="--", color="gray", label="I/O floor")
                ax.set_title(f"{mname} stage 1 {dt}", fontsize=8)
                ax.set_xlabel("batch")
                ax.set_ylabel("ms")
                ax.legend(fontsize=6)


def main(args) -> dict:
    """Run the benchmark described by ``args`` (see ``--help``); returns the result dict."""
    if not os.path.isfile(args.config):
        parser.error(f"--config {args.config!r} is not a file; pass a YAML like configs/bench_window.yaml")
    check_output(parser, args.out)
    outputs = output_files(parser, [args.out + ".json", args.out + ".md", args.out + ".png"], tool="bench_window")
    if not torch.cuda.is_available():
        raise SystemExit("bench_window.py needs a CUDA GPU (the window kernel is a Triton GPU kernel)")
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    args.warmup_ms = args.warmup_ms if args.warmup_ms is not None else cfg.get("warmup_ms", 10)
    args.rep_ms = args.rep_ms if args.rep_ms is not None else cfg.get("rep_ms", 40)
    env = tool_environment()
    env["copy_bytes_per_s"] = copy_bandwidth()
    _TIMER["cuda_graph"] = env["cuda_graph_timing"] = bool(args.cuda_graph)
    res: dict = {"environment": env, "config": cfg}

    def save():
        outputs.write_json(args.out + ".json", res, indent=1)
        outputs.write_text(args.out + ".md", to_markdown(res))

    if not args.no_sweep:
        res["sweep"] = bench_sweep(cfg, args)
        save()
    res["attention"] = []
    bench_attention(cfg, args, env, res["attention"], save)
    kc = cfg["key_case"]
    res["key_case"] = [r for r in res["attention"] if r["model"] == kc["model"] and r["stage"] == kc["stage"]
                       and r["batch"] == kc["batch"]]
    save()
    if not args.no_module:
        res["module"] = bench_module(cfg, args)
        save()
    if not args.no_models:
        res["models"] = bench_models(cfg, args)
    save()
    plot(res, args.out + ".png", outputs)
    return res


if __name__ == "__main__":
    main(parser.parse_args())
