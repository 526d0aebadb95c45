"""Swin / Swin-v2 window attention: visionattn vs timm eager, timm SDPA and FlexAttention.

Forward (default, CUDA): attention alone (q, k, v as timm's ``qkv.unbind`` views, bias + shift mask) for every stage
of the models in ``configs/bench_window.yaml`` at several batches and dtypes, the WindowAttention module (qkv +
attention + proj) and whole models, :func:`visionattn.patch_model` vs unpatched timm. Medians of
``triton.testing.do_bench`` (L2 flushed; ``--cuda-graph``: ``do_bench_cudagraph``), peak extra memory of one call,
error vs float64. ``--precisions`` times the FP32 modes' product precisions side by side. No global precision flag is
set (timm eager fp32 runs with PyTorch's defaults, recorded).

``--train``: forward + backward (the training path) of one stage per ``--cases model:stage:batch``, fp32 (TF32 off)
and bf16 (autocast), returning the gradients of the qkv leaf, the bias [H, N, N] and Swin-v2's ``logit_scale``:
``visionattn`` (:func:`visionattn.window_attention_qkvpacked`, what a patched timm module calls), ``timm-eager``
(timm's matmul + softmax lines) and ``timm-sdpa`` (Swin's fused path). Eager timing (CUDA events around back-to-back
forward + ``autograd.grad`` calls), for visionattn beside CUDA-graph replays in alternating windows (timm's lines
fail to capture on torch 2.11); CPU: wall clock, no graph. Gradient errors: relative L2 vs the same lines in float64.

Writes ``<out>.md``, ``<out>.json``, ``<out>.png``.

    python tools/bench_window.py --out out/window_h100
    python tools/bench_window.py --models swin_base_224 --batches 64 --dtypes fp32,tf32,fp16 --methods visionattn
           --precisions f16x3,tf32x3,f16x1,tf32 --no-sweep --no-module --no-models   (one command)
    python tools/bench_window.py --train --cases swin_base_224:0:64 --modes bf16 --out out/window_train_h100
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import sys
import types

import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (OutputFiles, REPO, ToolParser, add_common, bars, default_out, eager_graph_timings,  # noqa: E402
                      eager_ms, environment, failure_text, figure, graph_cells, kernel_ms, markdown_table, md_header,
                      peak_memory, per_call_ms, prefix_outputs, tf32_flags, write_results)
from _timm_models import create_timm_model  # noqa: E402

from visionattn.modes import MODES  # noqa: E402

TRAIN_CASES = ("swin_base_224:0:64", "swinv2_base_w8_256:0:64")
TRAIN_MODES = ("fp32", "bf16")
BACKENDS = ("visionattn", "timm-eager", "timm-sdpa")
TARGET = 3.0  # --train: visionattn over timm's default path, forward + backward, in fp32 and bf16

parser = ToolParser(prog="bench_window.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
parser.add_argument("--config", default=os.path.join(REPO, "configs", "bench_window.yaml"),
                    help="YAML sweep definition (models, batches, dtypes, flex cases, key case, sweep)")
parser.add_argument("--out", default=None,
                    help="output prefix: writes <out>.md, <out>.json, <out>.png (default: out/window_bench, "
                         "with --train out/window_train)")
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
train = parser.add_argument_group("--train: forward + backward")
train.add_argument("--train", action="store_true", help="time forward + backward instead (see above)")
train.add_argument("--cases", nargs="+", default=list(TRAIN_CASES),
                   help="model:stage:batch, model from the config, stage from 0 (default: %(default)s)")
train.add_argument("--modes", nargs="+", default=list(TRAIN_MODES), choices=TRAIN_MODES, help="default: %(default)s")
add_common(train, calls=20, repeats=5, device="cuda" if torch.cuda.is_available() else "cpu")


def build_parser() -> ToolParser:
    return parser


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
    q, k, v = _qkv(torch.randn(BW, N, 3, H, D, device=device, dtype=dtype))
    return q, k, v, module_bias(attn, kind, N, H)


def module_bias(attn, kind: str, N: int, H: int) -> torch.Tensor:
    """The relative position bias [H, N, N] the timm module adds (Swin-v2: its CPB MLP, ``16 * sigmoid``)."""
    with torch.no_grad():
        if kind == "v1":
            return attn._get_rel_pos_bias()[0].contiguous()
        table = attn.cpb_mlp(attn.relative_coords_table).view(-1, H)
        return 16 * torch.sigmoid(table[attn.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
                                  .contiguous())


def _qkv(qkv):
    """q, k, v [B*nW, H, N, D]: timm's ``qkv.unbind`` views of a [B*nW, N, 3, H, D] tensor."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


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
            peak = peak_memory(fn, torch.device("cuda"))["peak_extra_mib"]
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
        dtype = MODES[dt].compute_dtype
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
        dtype = MODES[dt].compute_dtype
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
            dtype = MODES[dt].compute_dtype
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


def bench_models(cfg, args) -> list[dict]:
    """Whole models (random weights), ms per forward, patched in place with :func:`visionattn.patch_model`."""
    import visionattn

    rows = []
    for spec in cfg.get("model_latency", []):
        for dt in ("fp16", "fp32"):
            dtype = MODES[dt].compute_dtype
            row = {"model": spec["timm_name"], "batch": spec["batch"], "dtype": dt}
            try:
                # random weights, Swin-v2's zero-init post-norms woken: attention reaches the logits
                model = create_timm_model(spec["timm_name"], pretrained=False).to("cuda", dtype)
                x = torch.randn(spec["batch"], 3, spec["img"], spec["img"], device="cuda", dtype=dtype)
                row["unpatched"] = measure(lambda: model(x), args.warmup_ms, args.rep_ms)
                with torch.no_grad():
                    ref = model(x).float()
                row["patched_modules"] = visionattn.patch_model(model, mode=dt).visionattn_report.num_patched
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
    lines = md_header(
        "Window attention benchmark (Swin / Swin-v2)", env, f"GPU: **{env['gpu']}**; {env['date']}",
        f"Measured copy bandwidth: {env.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s (read+write). "
        + ("Times: median ms of `triton.testing.do_bench_cudagraph` (CUDA graph: no Python launch overhead, no L2 "
           "flush, so small cases can run from L2 below the DRAM I/O floor). " if env.get("cuda_graph_timing") else
           "Times: median ms of `triton.testing.do_bench` (L2 flushed; Python launch overhead included). ")
        + "Peak: extra MiB allocated during one call. "
        f"timm eager fp32 runs with torch defaults (allow_tf32 matmul = {env['allow_tf32_matmul']}).")
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


# ----------------------------------------------------------------------------- --train
def parse_case(text: str, models: dict) -> tuple[dict, dict, int]:
    """``model:stage:batch`` -> (model entry, stage shape, batch); exit 2 with one line naming the bad part."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in models or not parts[1].isdigit() or not parts[2].isdigit():
        parser.error(f"--cases {text!r}: expected model:stage:batch with model one of {sorted(models)}")
    model = models[parts[0]]
    stages = stage_shapes(model)
    stage, batch = int(parts[1]), int(parts[2])
    if stage >= len(stages) or batch < 1:
        parser.error(f"--cases {text!r}: stage must be below {len(stages)} and batch at least 1")
    return model, stages[stage], batch


def make_case(model: dict, st: dict, batch: int, mode: str, device) -> dict:
    """Leaves and closures of one case: the timm block's attention (FP32 parameters, as under autocast), a qkv
    leaf [B*nW, N, 3, H, D] in the mode's dtype, the bias leaf [H, N, N] FP32, the shift mask, dO."""
    kind = model["kind"]
    # random parameters and inputs drawn on the CPU, the same in every run (and not from the CUDA generator,
    # which an earlier case's graph capture has registered)
    torch.manual_seed(0)
    attn, mask = make_block(kind, st, "cpu", torch.float32)
    attn, mask = attn.to(device), None if mask is None else mask.to(device)
    dtype = MODES[mode].compute_dtype
    BW, N, H = batch * st["nW"], st["N"], st["heads"]
    D = st["dim"] // H
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(BW, N, 3, H, D, generator=g).to(device=device, dtype=dtype).requires_grad_()
    leaves = [qkv, module_bias(attn, kind, N, H).requires_grad_()]
    if kind == "v2":
        leaves.append(attn.logit_scale)
    do = torch.randn(BW, H, N, D, generator=g).to(device=device, dtype=dtype)
    return {"kind": kind, "attn": attn, "mask": mask, "leaves": leaves, "do": do, "dtype": dtype, "mode": mode}


def forward_fn(case: dict, backend: str):
    """``run() -> out`` of ``backend`` on the case's leaves (None where the backend does not apply)."""
    kind, attn, mask = case["kind"], case["attn"], case["mask"]
    qkv, bias = case["leaves"][:2]
    q, k, v = _qkv(qkv)
    if backend == "timm-eager":
        return eager_fn(kind, attn, q, k, v, bias, mask)
    if backend == "timm-sdpa":
        return sdpa_fn(kind, attn, q, k, v, bias, mask)
    import visionattn

    nw = mask.shape[0] if mask is not None else 1
    kw = dict(cosine=True, logit_scale=attn.logit_scale) if kind == "v2" else dict(scale=attn.scale)

    def run():
        return visionattn.window_attention_qkvpacked(qkv, relative_position_bias=bias, shift_mask=mask,
                                                     num_windows=nw, mode=case["mode"], **kw).transpose(1, 2)
    return run


def step_fn(case: dict, backend: str):
    """``step() -> gradients of the leaves``: the backend's forward (under bf16 autocast in bf16) and
    ``torch.autograd.grad`` against the case's dO; None where the backend does not apply."""
    run = forward_fn(case, backend)
    if run is None:
        return None
    device = case["do"].device.type
    amp = case["mode"] == "bf16"

    def step():
        with torch.autocast(device, dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            out = run()
        return torch.autograd.grad(out, case["leaves"], case["do"])
    return step


def oracle_grads(case: dict) -> list[torch.Tensor]:
    """Gradients of timm's lines in float64 on the case's leaves (the same values, no rounding)."""
    leaves64 = [t.detach().double().requires_grad_() for t in case["leaves"]]
    attn = case["attn"]
    attn64 = types.SimpleNamespace(scale=getattr(attn, "scale", None),
                                   logit_scale=leaves64[2] if case["kind"] == "v2" else None)
    q, k, v = _qkv(leaves64[0])
    mask = None if case["mask"] is None else case["mask"].double()
    out = eager_fn(case["kind"], attn64, q, k, v, leaves64[1], mask)()
    return list(torch.autograd.grad(out, leaves64, case["do"].double()))


def time_step(step, device: torch.device, calls: int, repeats: int, graph: bool) -> dict:
    """{"ms", "graph_ms", "graph_error"}: eager beside graph replay on CUDA (:func:`_harness.eager_graph_timings`;
    eager alone unless ``graph``); CPU wall clock (no graph) else."""
    timer = (functools.partial(eager_ms, calls=calls, repeats=repeats) if device.type == "cuda"
             else per_call_ms(device, 1, repeats, warmup=1))  # wall clock (Triton's interpreter)
    eager, graph_ms, error = eager_graph_timings(lambda: step, timer, device, calls, repeats, graph=graph)
    return {"ms": eager, "graph_ms": graph_ms, "graph_error": error}


def run_case(model: dict, st: dict, batch: int, mode: str, device: torch.device, args) -> list[dict]:
    from visionattn.metrics import rel_l2

    if device.type == "cuda":
        torch.cuda.empty_cache()
    case = make_case(model, st, batch, mode, device)
    gold = oracle_grads(case)
    names = ["dqkv", "dbias"] + (["dlogit_scale"] if case["kind"] == "v2" else [])
    base = {"model": model["name"], "kind": case["kind"], "stage": st["stage"], "batch": batch, "mode": mode,
            "windows": case["do"].shape[0], "heads": st["heads"], "tokens": st["N"], "head_dim": case["do"].shape[-1]}
    rows = []
    for backend in BACKENDS:
        step = step_fn(case, backend)
        if step is None:
            continue
        row = dict(base, backend=backend, error=None)
        try:
            grads = step()
            row.update({f"{n}_rel_err": rel_l2(g, ref) for n, g, ref in zip(names, grads, gold)})
            del grads
            row["peak_extra_mib"] = peak_memory(step, device)["peak_extra_mib"]
            row.update(time_step(step, device, args.calls, args.repeats, graph=backend == "visionattn"))
        except Exception as exc:  # noqa: BLE001 - a failing baseline is a result, not a crash
            row["error"] = failure_text(exc, device)
        rows.append(row)
        if device.type == "cuda":  # a graph of many calls reserves much memory: hand it back for the next one
            torch.cuda.empty_cache()
    default = "timm-sdpa" if case["kind"] == "v1" else "timm-eager"
    by = {r["backend"]: r for r in rows if r["error"] is None}
    for r in rows:
        for ref, key in ((default, "x_timm_default"), ("timm-eager", "x_timm_eager")):
            ok = r["error"] is None and ref in by
            r[key] = by[ref]["ms"] / r["ms"] if ok else None
    return rows


def train_targets(rows: list[dict]) -> list[dict]:
    """visionattn over timm's default path per case and mode against :data:`TARGET`."""
    out = []
    for r in rows:
        if r["backend"] == "visionattn" and r["x_timm_default"] is not None:
            out.append({"case": f"{r['model']} stage {r['stage'] + 1} batch {r['batch']}", "mode": r["mode"],
                        "ratio": r["x_timm_default"], "need": TARGET, "met": r["x_timm_default"] >= TARGET})
    return out


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def train_markdown(result: dict) -> str:
    lines = md_header("Window attention forward + backward vs timm's attention lines", result["environment"],
                      result["timing"], result["precision"])
    header = ["case", "mode", "backend", "ms", "graph ms", "eager / graph", "x timm default", "x timm-eager",
              "peak extra MiB", "dqkv rel err", "dbias rel err", "dlogit_scale rel err"]
    table = []
    for r in result["rows"]:
        case = f"{r['model']} s{r['stage'] + 1} b{r['batch']} ({r['windows']} x {r['heads']} x {r['tokens']})"
        if r["error"]:
            table.append([case, r["mode"], r["backend"], "failed: " + r["error"]] + ["-"] * (len(header) - 4))
            continue
        table.append([case, r["mode"], f"**{r['backend']}**" if r["backend"] == "visionattn" else r["backend"],
                      _f(r["ms"]), *graph_cells(r["ms"], r["graph_ms"], r["graph_error"]),
                      _f(r["x_timm_default"], "{:.2f}x"), _f(r["x_timm_eager"], "{:.2f}x"),
                      _f(r["peak_extra_mib"], "{:.1f}"), _f(r.get("dqkv_rel_err"), "{:.2e}"),
                      _f(r.get("dbias_rel_err"), "{:.2e}"), _f(r.get("dlogit_scale_rel_err"), "{:.2e}")])
    lines.append(markdown_table(table, header))
    lines += ["", f"Target: visionattn >= {TARGET:g}x timm's default path (Swin: timm-sdpa; Swin-v2: timm-eager), "
                  "forward + backward, eager.", ""]
    lines.append(markdown_table(
        [[t["case"], t["mode"], f"{t['ratio']:.2f}x", f"{t['need']:g}x", "met" if t["met"] else "NOT met"]
         for t in result["targets"]], ["case", "mode", "visionattn / timm default", "need", ""]))
    return "\n".join(lines) + "\n"


def train_plot(result: dict, path: str, outputs: OutputFiles | None = None) -> None:
    ok = [r for r in result["rows"] if r["error"] is None]
    groups = sorted({(r["model"], r["stage"], r["batch"], r["mode"]) for r in ok}, key=str)
    with figure(path, outputs, figsize=(max(6, 2.2 * len(groups)), 4), tool="bench_window_train") as (fig, ax):
        bars(ax, [f"{m}\nstage {s + 1}, batch {b}\n{mode}" for m, s, b, mode in groups],
             {b: [next((r["ms"] for r in ok if r["backend"] == b and (r["model"], r["stage"], r["batch"], r["mode"])
                        == g), None) for g in groups] for b in BACKENDS})
        ax.set_ylabel("ms per forward + backward (eager)")
        ax.set_title(result["environment"]["device"])
        ax.legend()


def main_train(args, cases: list, outputs: OutputFiles) -> dict:
    """``--train``: forward + backward of every case and mode."""
    device = torch.device(args.device)
    rows = []
    with tf32_flags():
        for model, st, batch in cases:
            for mode in args.modes:
                new = run_case(model, st, batch, mode, device, args)
                rows += new
                print(f"{model['name']} stage {st['stage'] + 1} batch {batch} {mode}: " + ", ".join(
                    f"{r['backend']} {_f(r['ms'])} ms" for r in new if r["error"] is None), flush=True)
    timing = ("eager: CUDA events around back-to-back forward + backward calls, median of windows (the Python "
              "launch path counts); graph (visionattn only: timm's lines under autograd fail to capture, "
              "cudaErrorStreamCaptureInvalidated): replays of a CUDA graph of the same calls in alternating "
              "windows (_harness.eager_graph_ms)" if device.type == "cuda"
              else "CPU wall clock per call (Triton's interpreter for visionattn), no CUDA graph")
    result = {"environment": environment(), "timing": timing,
              "precision": "fp32: FP32 inputs, TF32 off; bf16: bf16 qkv and dO, FP32 bias and parameters, "
                           "the forward under torch.autocast(bfloat16)",
              "rows": rows, "targets": train_targets(rows)}
    write_results(outputs, args.out, result, train_markdown(result), train_plot)
    return result


def main(args) -> dict:
    """Run the benchmark described by ``args`` (see ``--help``); returns the result dict."""
    if not os.path.isfile(args.config):
        parser.error(f"--config {args.config!r} is not a file; pass a YAML like configs/bench_window.yaml")
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    if args.train:
        cases = [parse_case(c, {m["name"]: m for m in cfg["models"]}) for c in args.cases]
    tool = "bench_window_train" if args.train else "bench_window"
    args.out = args.out or default_out("window_train" if args.train else "window_bench")
    outputs = prefix_outputs(parser, args.out, tool=tool)
    if args.train:
        return main_train(args, cases, outputs)
    if not torch.cuda.is_available():
        raise SystemExit("bench_window.py needs a CUDA GPU (the window kernel is a Triton GPU kernel); "
                         "--train runs on the CPU")
    args.warmup_ms = args.warmup_ms if args.warmup_ms is not None else cfg.get("warmup_ms", 10)
    args.rep_ms = args.rep_ms if args.rep_ms is not None else cfg.get("rep_ms", 40)
    env = environment({"gpu": torch.cuda.get_device_name(), "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    env["copy_bytes_per_s"] = copy_bandwidth()
    _TIMER["cuda_graph"] = env["cuda_graph_timing"] = bool(args.cuda_graph)
    res: dict = {"environment": env, "config": cfg}

    def save():
        write_results(outputs, args.out, res, to_markdown(res), indent=1)

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
