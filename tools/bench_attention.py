#!/usr/bin/env python
"""Benchmark the ELSA Triton kernels against PyTorch SDPA and FlexAttention.

Per shape of the config and mode, in one process on the same inputs: eager ms (CUDA events around back-to-back calls
of ``visionattn.attention`` / ``F.scaled_dot_product_attention``, the launch path counts) beside CUDA-graph replays
of the same calls in alternating windows (n/a with ``graph_error`` where capture fails; ``--cuda-graph``: graph only,
``do_bench_cudagraph``), the first call apart; TFLOP/s = 4*B*H*Nq*Nk*D / t, peak extra memory, rel. L2 error vs the
float64 oracle on sampled query rows. Baselines: SDPA math (TF32 off) / efficient / flash / cuDNN and compiled
FlexAttention (FP32: IEEE and TF32; TF32 is on only inside the flex-tf32 rows). A host-overhead table (B=1 H=1 N=64
D=64, every mode and ``window_attention`` beside SDPA) comes first. Writes ``bench.md/.json/.png`` to ``--out``.

``--backward``: forward + ``autograd.grad`` against a random dO, vs SDPA efficient / flash / cuDNN, flash under
``torch.use_deterministic_algorithms`` (``sdpa-flash-det``, NaN fill off) and Flex; TFLOP/s count 3.5 x the forward;
gradient error of dQ, dK, dV vs a float64 autograd oracle (only dQ on sampled rows beyond B*H*N*N = 2^33); writes
``fwd_bwd.*``. ``--tune``: times candidate tile configs (``elsa_fwd._CONFIGS``). ``--varlen``: the ragged-batch
table of ``tools/bench_varlen.py`` (``varlen.md/.json``).

Usage: python tools/bench_attention.py --out out/bench_attention [--quick] [--backward]
       [--config configs/bench_attention.yaml]
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import time
import zlib

import torch
import yaml
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (OutputFiles, REPO, ToolParser, call_ms, check_output, default_out,  # noqa: E402
                      bars, eager_graph_timings, eager_ms, environment, figure, graph_cells, host_us, kernel_ms,
                      kernel_times, markdown_table, md_header, output_files, tf32_flags, write_results)

from visionattn.kernels import elsa_fwd  # noqa: E402
from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import MODES  # noqa: E402
from visionattn.reference import oracle_attention  # noqa: E402

TOOL = "bench_attention"  # its output manifest: .visionattn-bench_attention.json (_harness.output_files)
HALF_BASELINES = ["sdpa-math", "sdpa-efficient", "sdpa-flash", "sdpa-flash-det", "sdpa-cudnn", "flex"]
GROUPS = {  # input dtype group -> (dtype, the visionattn modes computing in it, baselines)
    name: (dtype, [m for m, spec in MODES.items() if spec.compute_dtype == dtype and not spec.half_scores], base)
    for name, dtype, base in (("fp32", torch.float32, ["sdpa-math", "sdpa-efficient", "flex-ieee", "flex-tf32"]),
                              ("fp16", torch.float16, HALF_BASELINES), ("bf16", torch.bfloat16, HALF_BASELINES))}
BACKWARD_ONLY = ("sdpa-flash-det",)  # baselines that only the --backward table runs


def build_parser() -> ToolParser:
    p = ToolParser(prog="bench_attention.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(REPO, "configs", "bench_attention.yaml"),
                   help="YAML sweep (shapes, modes, timing)")
    p.add_argument("--out", default=default_out("bench_attention"),
                   help="output folder for bench.md / bench.json / bench.png (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="only the shapes marked quick: true, shorter timing")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (saves its compile time)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time only CUDA-graph replays (GPU time without the Python launch path), not eager calls")
    p.add_argument("--no-host", action="store_true", help="skip the host-overhead table (tiny calls)")
    p.add_argument("--kernel-times", action="store_true",
                   help="also profile each backend's call kernel by kernel (torch.profiler, 10 CUDA-graph replays): a "
                        "table per shape of each kernel's GPU time, to see where two backends' totals part")
    p.add_argument("--modes", default=None, help="comma-separated visionattn modes (default: the config's)")
    p.add_argument("--shapes", default=None, help="comma-separated shape names from the config (default: all)")
    p.add_argument("--backward", action="store_true",
                   help="time forward + backward (eager and CUDA-graph replay) vs SDPA efficient / flash / cuDNN and "
                        "FlexAttention, with gradient errors vs a float64 oracle; writes fwd_bwd.*")
    p.add_argument("--varlen", action="store_true",
                   help="run the ragged-batch table instead (the ELSA supplement's Table 2: tools/bench_varlen.py "
                        "with its defaults, --modes passed on; writes varlen.md / varlen.json to --out)")
    p.add_argument("--tune", action="store_true", help="time candidate tile configs instead of the sweep")
    p.add_argument("--tune-kinds", default=None,
                   help=f"comma-separated kinds for --tune (default all: {','.join(TUNE_CANDIDATES)})")
    return p


# --------------------------------------------------------------------------- runners

def _sdpa(backend_name, gqa=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-math": SDPBackend.MATH, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    return run


_FLEX = {}


def _flex(tf32: bool, gqa=False):
    from torch.nn.attention.flex_attention import flex_attention

    if tf32 not in _FLEX:
        # one compiled graph per shape and dtype: allow enough recompiles (tool-level setting)
        for opt in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, opt):
                setattr(torch._dynamo.config, opt, 256)
        _FLEX[tf32] = torch.compile(flex_attention, dynamic=False)
    fn = _FLEX[tf32]

    def run(q, k, v):
        with tf32_flags(tf32):
            return fn(q, k, v, enable_gqa=gqa)

    return run


def _ours(mode, gqa=False):
    import visionattn

    def run(q, k, v):
        return visionattn.attention(q, k, v, mode=mode, enable_gqa=gqa)  # the public path users call

    return run


def _repeat_kv(name):
    """``fn(q, k, v)``: SDPA backend ``name`` on K / V repeated for their query heads (``repeat_interleave``, the
    copy transformers' ``repeat_kv`` makes): the grouped-query baseline of backends that refuse ``enable_gqa``."""
    run = _sdpa(name)

    def repeated(q, k, v):
        group = q.shape[1] // k.shape[1]
        return run(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))

    return repeated


def _runner(name, gqa=False):
    """``fn(q, k, v)`` of backend ``name``; ``gqa``: k / v have fewer heads than q (``enable_gqa=True``)."""
    if name.endswith("-repeat-kv"):
        return _repeat_kv(name[: -len("-repeat-kv")])
    if name.startswith("sdpa-"):
        return _sdpa(name, gqa)
    if name.startswith("flex"):
        return _flex(name == "flex-tf32", gqa)
    return _ours(name, gqa)


@contextlib.contextmanager
def _deterministic():
    """``torch.use_deterministic_algorithms(True)`` without the NaN fill of new memory, restored after."""
    import torch.utils.deterministic as det

    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        det.fill_uninitialized_memory = saved[2]


def _fwd_bwd_runner(name, do, gqa=False):
    """``fn(q, k, v) -> (dq, dk, dv)``: backend ``name``'s forward and its backward against ``do``."""
    det = name == "sdpa-flash-det"
    run = _runner("sdpa-flash" if det else name, gqa)

    def step(q, k, v):
        context = tf32_flags(True) if name == "flex-tf32" else _deterministic() if det else contextlib.nullcontext()
        with context:  # flex-tf32: its compiled backward too; flash-det: the backward runs inside
            return torch.autograd.grad(run(q, k, v), (q, k, v), do)

    return step


def _measure(fn, q, k, v, rep, graph_only=False):
    """(timings, peak extra MiB, output) of ``fn(q, k, v)``: ``{"first": ms, "eager": ms, "graph": ms}``: the first
    call of this backend at this shape in the process, wall clock to its completion (compiles with the Triton cache
    as found, plans, launch caches), then eager and graph timed in alternating windows
    (:func:`_harness.eager_graph_ms`); with ``graph_only`` the graph alone (``triton.testing.do_bench_cudagraph``).
    Raises if the backend refuses; where only the capture fails (and eager is timed), ``graph_error`` (why) replaces
    ``graph``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    first = call_ms(lambda: fn(q, k, v), "cuda")  # the first call: compiles with the Triton cache as found
    torch.cuda.reset_peak_memory_stats()
    out = fn(q, k, v)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    if graph_only:
        return {"first": first, "graph": kernel_ms(lambda: fn(q, k, v), 0, rep, True)}, peak, out
    one = max(eager_ms(lambda: fn(q, k, v), calls=3, warmup=1, repeats=1), 0.005)
    eager, graph, error = eager_graph_timings(lambda: (lambda: fn(q, k, v)), None, "cuda",
                                              int(min(200, max(10, rep / one))), 5)
    return {"first": first, "eager": eager,
            **({"graph": graph} if graph is not None else {"graph_error": error})}, peak, out


def _graph_fields(timings: dict, flops: float) -> dict:
    """A record's graph fields from :func:`_measure`'s ``timings``: ``ms_graph``, ``tflops_graph`` and, with an eager
    time beside it, ``ms_eager`` and ``eager_over_graph``; ``graph_error`` where the calls could not be captured."""
    if "graph" not in timings:
        return {k: v for k, v in timings.items() if k == "graph_error"}
    rec = {"ms_graph": timings["graph"], "tflops_graph": flops / timings["graph"] / 1e9}
    if "eager" in timings:
        rec.update(ms_eager=timings["eager"], eager_over_graph=timings["eager"] / timings["graph"])
    return rec


def host_overhead(modes, rounds: int = 5) -> list[dict]:
    """Host time per call (us) of tiny calls, every mode and window_attention beside SDPA, one process. The calls
    of one dtype are timed in ``rounds`` interleaved rounds (SDPA, each mode, window; again ...) and each
    reading is the median over its rounds, so a clock or load change hits every call alike."""
    import visionattn

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype).split(".")[1]
        q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", generator=g).to(dtype) for _ in range(3))
        qw = torch.randn(4, 1, 49, 32, device="cuda", generator=g).to(dtype)
        rpb = torch.randn(1, 49, 49, device="cuda", generator=g)
        wmode = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
        calls = {"F.scaled_dot_product_attention": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)}
        for mode in modes:
            if visionattn.get_mode(mode).compute_dtype == dtype:
                calls[f"visionattn.attention mode={mode}"] = (
                    lambda mode=mode: visionattn.attention(q, k, v, mode=mode))
        calls[f"visionattn.window_attention mode={wmode}"] = lambda: visionattn.window_attention(
            qw, qw, qw, relative_position_bias=rpb, num_windows=1, mode=wmode)
        readings = {c: [] for c in calls}
        for _ in range(rounds):
            for c, fn in calls.items():
                readings[c].append(host_us(fn, repeats=1))
        sdpa = sorted(readings["F.scaled_dot_product_attention"])[rounds // 2]
        for c, r in readings.items():
            us = sorted(r)[rounds // 2]
            rows.append({"call": c, "dtype": name, "us": us, "x_sdpa": us / sdpa})
    return rows


def _fits_math(B, H, N, dtype):
    free, _ = torch.cuda.mem_get_info()
    return 3 * B * H * N * N * max(4, torch.finfo(dtype).bits // 8) < 0.5 * free


FULL_GRAD_ORACLE_MAX = 2 ** 33  # B*H*N*N up to which the gradient oracle covers every query row (dK, dV too)


def oracle_grads(q, k, v, do, rows, chunk_elems: int = 2 ** 25) -> dict:
    """Float64 autograd oracle of attention's gradients against ``do`` (q, do [B, H, N, D]; k, v [B, Hkv, N, D], Hkv
    dividing H: each K / V head serves H / Hkv query heads, as SDPA's ``enable_gqa``).

    Every query row, in chunks of rows (each chunk's float64 [B, H, rows, N] scores ``chunk_elems`` values; rows
    are independent, so dK and dV are sums over chunks): ``{"dq", "dk", "dv"}``. Beyond
    B*H*N*N = :data:`FULL_GRAD_ORACLE_MAX`: ``{"dq_rows"}``, dQ of the query rows ``rows`` only.
    """
    B, H, N, D = q.shape
    scale = D ** -0.5
    group = H // k.shape[1]
    if B * H * N * k.shape[2] > FULL_GRAD_ORACLE_MAX:
        qr = q[:, :, rows].double().requires_grad_()
        kr, vr = (t.repeat_interleave(group, 1) for t in (k, v))
        (dq,) = torch.autograd.grad(oracle_attention(qr, kr, vr, scale=scale), qr, do[:, :, rows].double())
        return {"dq_rows": dq}
    kd, vd = (t.double().requires_grad_() for t in (k, v))
    dq = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    dk, dv = torch.zeros_like(kd), torch.zeros_like(vd)
    chunk = max(1, chunk_elems // (B * H * k.shape[2]))
    for i in range(0, N, chunk):
        qc = q[:, :, i:i + chunk].double().requires_grad_()
        y = oracle_attention(qc, kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1), scale=scale)
        gq, gk, gv = torch.autograd.grad(y, (qc, kd, vd), do[:, :, i:i + chunk].double())
        dq[:, :, i:i + chunk] = gq
        dk += gk
        dv += gv
    return {"dq": dq, "dk": dk, "dv": dv}


def grad_errors(grads, ref: dict, rows) -> dict:
    """Relative L2 errors of ``grads`` = (dq, dk, dv) vs :func:`oracle_grads`'s ``ref``; ``rel_err`` is the largest."""
    dq, dk, dv = grads
    if "dq_rows" in ref:
        err = {"rel_err_dq": rel_l2(dq[:, :, rows], ref["dq_rows"])}
    else:
        err = {"rel_err_dq": rel_l2(dq, ref["dq"]), "rel_err_dk": rel_l2(dk, ref["dk"]),
               "rel_err_dv": rel_l2(dv, ref["dv"])}
    return {**err, "rel_err": max(err.values())}


# --------------------------------------------------------------------------- sweep

GRAPH_TIMING = ("graph: replays of a CUDA graph of the same calls, each replay timed right after an eager window "
                "(_harness.eager_graph_ms: both readings see the same GPU state; median of 5) -- graph ms "
                "column, n/a where the calls cannot be captured (graph_error in the JSON); first call: the backend's "
                "first call at the shape in the process, wall clock to its completion (compiles, with the Triton "
                "cache as found; plans) -- first call ms column")


def run_sweep(args, cfg) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    modes = args.modes.split(",") if args.modes else cfg["modes"]
    shapes = [s for s in cfg["shapes"] if (not args.quick or s.get("quick"))]
    if args.shapes:
        wanted = set(args.shapes.split(","))
        shapes = [s for s in shapes if s["name"] in wanted]
    rep = 40 if args.quick else cfg["rep_ms"]
    records = []
    jobs = []
    for shape in shapes:
        for group, (dtype, group_modes, baselines) in GROUPS.items():
            ours = [m for m in group_modes if m in modes]
            if not ours:
                continue
            base = [b for b in baselines if not (b.startswith("flex") and (args.no_flex or not shape.get("flex")))
                    and not (args.backward and b == "sdpa-math")  # training baselines: efficient, flash, cuDNN, flex
                    and (args.backward or b not in BACKWARD_ONLY)]
            if shape.get("Hkv", shape["H"]) != shape["H"]:  # SDPA-efficient refuses enable_gqa: K / V repeated
                base.append("sdpa-efficient-repeat-kv")
            jobs.append((shape, group, dtype, ours + base))
    for shape, group, dtype, backends in tqdm(jobs, desc="shapes x dtypes"):
        B, H, N, D = shape["B"], shape["H"], shape["N"], shape["D"]
        Hkv = shape.get("Hkv", H)  # fewer K / V heads: grouped-query attention, enable_gqa=True on every backend
        gqa = Hkv != H
        g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{shape['name']}/{group}".encode()))
        q, k, v = (torch.randn(B, h, N, D, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv))
        rows = torch.randperm(N, device="cuda", generator=g)[: min(N, cfg.get("oracle_rows", 256))]
        if args.backward:
            do = torch.randn(B, H, N, D, device="cuda", generator=g).to(dtype)
            ref = oracle_grads(q, k, v, do, rows)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        else:
            do, ref = None, oracle_attention(q[:, :, rows], k.repeat_interleave(H // Hkv, 1),
                                             v.repeat_interleave(H // Hkv, 1), scale=D ** -0.5)
        flops = (3.5 if args.backward else 1) * 4 * B * H * N * N * D
        for name in backends:
            rec = {"shape": shape["name"], "B": B, "H": H, "Hkv": Hkv, "N": N, "D": D, "dtype": group, "backend": name,
                   "ours": name in MODES}
            if name == "sdpa-math" and not _fits_math(B, H, N, dtype):
                rec["skipped"] = "O(N^2) memory does not fit"
                records.append(rec)
                continue
            try:
                fn = _fwd_bwd_runner(name, do, gqa) if args.backward else _runner(name, gqa)
                timings, peak, out = _measure(fn, q, k, v, rep, args.cuda_graph)
            except (RuntimeError, torch.OutOfMemoryError, Exception) as exc:  # backend refuses this case
                rec["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                records.append(rec)
                torch.cuda.empty_cache()
                continue
            ms = timings.get("eager", timings.get("graph"))  # what an eager model sees, unless graph-only
            rec.update(ms=ms, tflops=flops / ms / 1e9, ms_first=timings["first"], peak_mib=peak)
            rec.update(grad_errors(out, ref, rows) if args.backward else {"rel_err": rel_l2(out[:, :, rows], ref)})
            rec.update(_graph_fields(timings, flops))
            if args.kernel_times:
                rec["kernels"] = kernel_times(lambda: fn(q, k, v), "cuda")
            del out
            records.append(rec)
        del q, k, v, do, ref
        torch.cuda.empty_cache()
    if args.backward:
        return {"environment": environment(), "tf32_matmul": "off (on only inside flex-tf32, forward and backward)",
                "title": "Attention forward + backward", "flops": "3.5 x 4*B*H*N*N*D", "files": "fwd_bwd",
                "timing": "eager: CUDA events around back-to-back forward + backward calls (torch.autograd.grad "
                          "against a random dO; median of 5 windows; the Python launch path counts) -- ms and TFLOP/s "
                          "columns; " + GRAPH_TIMING,
                "rel_err": "relative L2 of dQ / dK / dV vs a float64 autograd oracle on the same inputs and dO "
                           "(dQ on a random subsample of query rows only where B*H*N*N > 2^33)",
                "records": records, "targets": _targets_backward(records)}
    timing = ("CUDA-graph replays only (`triton.testing.do_bench_cudagraph`, median; L2 not flushed)"
              if args.cuda_graph else
              "eager: CUDA events around back-to-back calls of the public function (median of 5 windows; the "
              "Python launch path counts) -- ms and TFLOP/s columns; " + GRAPH_TIMING)
    host = [] if args.no_host else host_overhead(modes + ["pasa"])
    return {"environment": environment(), "tf32_matmul": "off (on only inside flex-tf32)", "timing": timing,
            "host_overhead": host, "records": records, "targets": _targets(records)}


def _get(records, shape, dtype, backend):
    for r in records:
        if r["shape"] == shape and r["dtype"] == dtype and r["backend"] == backend and "ms" in r:
            return r
    return None


# grouped-query shapes' bars (fewer K / V heads; every length): fp16 / bf16 >= 1.0x SDPA with enable_gqa (cuDNN,
# flash), fp32 >= 2.5x SDPA-efficient on K / V repeated per query head (it refuses enable_gqa)
GQA_RULES = [("fp32", "fp32", "sdpa-efficient-repeat-kv", 2.5, 2.5, None),
             ("fp16", "fp16", "sdpa-flash", 1.0, 1.0, None), ("fp16", "fp16", "sdpa-cudnn", 1.0, 1.0, None),
             ("bf16", "bf16", "sdpa-flash", 1.0, 1.0, None), ("bf16", "bf16", "sdpa-cudnn", 1.0, 1.0, None)]


def _grouped(records, shape) -> bool:
    """Whether ``shape``'s records have fewer K / V heads than query heads (grouped-query attention)."""
    first = next(r for r in records if r["shape"] == shape)
    return first.get("Hkv", first["H"]) != first["H"]


def _reading(ours: dict, other: dict | None = None, graph: bool = True) -> tuple[str, str]:
    """``(record key, timing name)`` a target compares: ``tflops_graph`` / "graph" where ``graph`` allows it and
    ``ours`` and ``other`` (when given) were both captured, else ``tflops`` / "eager"."""
    if graph and "tflops_graph" in ours and (other is None or "tflops_graph" in other):
        return "tflops_graph", "graph"
    return "tflops", "eager"


def _targets(records) -> list[dict]:
    """Speed targets per shape: (ours, baseline, required ratio or absolute TFLOP/s); grouped-query shapes
    :data:`GQA_RULES`'s bars. From 4096 tokens by CUDA-graph replay where both sides have it (the kernels' speed,
    which a slow host moves for every backend; the eager columns stand beside it in the tables), else, and below 4096
    tokens, by the eager calls (a ViT-sized call's launch path is a part of its time)."""
    rules = [
        ("fp32", "fp32", "sdpa-efficient", 2.0, None), ("fp32-ieee", "fp32", "flex-ieee", 1.3, 25.0),
        ("tf32", "fp32", "flex-tf32", 1.4, 180.0),
        ("fp16", "fp16", "sdpa-flash", 1.2, None), ("fp16", "fp16", "flex", 1.1, None),
        ("fp16", "fp16", "sdpa-cudnn", 1.0, None),
        ("bf16", "bf16", "sdpa-flash", 1.2, None), ("bf16", "bf16", "flex", 1.1, None),
        ("bf16", "bf16", "sdpa-cudnn", 1.0, None),
    ]
    out = []
    for shape in dict.fromkeys(r["shape"] for r in records):
        grouped = _grouped(records, shape)  # GQA_RULES's bars at every length
        for mode, dtype, base, ratio, absolute in ([g[:4] + (None,) for g in GQA_RULES] if grouped else rules):
            ours, other = _get(records, shape, dtype, mode), _get(records, shape, dtype, base)
            if ours is None:
                continue
            vit = ours["N"] < 4096
            need = 1.0 if (vit and base == "sdpa-cudnn") else ratio
            key, timing = _reading(ours, other, graph=not vit)
            row = {"shape": shape, "mode": mode, "vs": base, "ours_tflops": ours[key], "timing": timing}
            if other is not None:
                row.update(base_tflops=other[key], ratio=ours[key] / other[key], need_ratio=need,
                           met=ours[key] / other[key] >= need)
            elif absolute is not None and not vit:
                row.update(need_tflops=absolute, met=ours[key] >= absolute)
            else:
                continue
            out.append(row)
        for mode, dtype in (("fp32", "fp32"), ("tf32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16")):
            ours = _get(records, shape, dtype, mode)
            if ours and "eager_over_graph" in ours and ours["N"] < 4096:  # ViT-sized: launch path matters most
                out.append({"shape": shape, "mode": mode, "vs": "own CUDA-graph replay",
                            "eager_over_graph": ours["eager_over_graph"], "met": ours["eager_over_graph"] <= 1.1})
        out += _memory_targets(records, shape, (("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16")), 1.1)
    return out


def _memory_targets(records, shape, modes, ratio: float) -> list[dict]:
    """Peak extra memory of each (mode, input dtype) at most ``ratio`` x SDPA-efficient's on the same inputs."""
    out = []
    for mode, dtype in modes:
        ours, eff = _get(records, shape, dtype, mode), _get(records, shape, dtype, "sdpa-efficient")
        if ours and eff:
            out.append({"shape": shape, "mode": mode, "vs": "sdpa-efficient memory", "ours_mib": ours["peak_mib"],
                        "base_mib": eff["peak_mib"], "need_mem_ratio": ratio,
                        "met": ours["peak_mib"] <= ratio * eff["peak_mib"] + 1e-6})
    return out


def _targets_backward(records) -> list[dict]:
    """Forward + backward targets: ratios to a baseline at N >= 4096 and at ViT-B/16 224 (B=64, H=12, N=197, D=64),
    by CUDA-graph replay where both sides have it (the kernels' speed; the eager columns stand beside it in the
    tables), else eager; absolute TFLOP/s, and peak extra memory <= SDPA-efficient's at every shape. The bars:
    fp16 / bf16 >= 1.05x cuDNN at long sequences and >= 1.0x at ViT-B/16 224, fp32 >= 3x and tf32 >= 5x
    SDPA-efficient at long sequences; grouped-query shapes :data:`GQA_RULES`'s at every length."""
    rules = [  # (mode, input dtype, baseline, need at N >= 4096, need at ViT-B/16 224, absolute TFLOP/s at N >= 4096)
        ("fp32", "fp32", "sdpa-efficient", 3.0, 2.0, None), ("fp32-ieee", "fp32", None, None, None, 20.0),
        ("tf32", "fp32", "sdpa-efficient", 5.0, 4.0, None),
        ("fp16", "fp16", "sdpa-flash", 1.3, None, None), ("fp16", "fp16", "sdpa-cudnn", 1.05, 1.0, None),
        ("bf16", "bf16", "sdpa-flash", 1.3, None, None), ("bf16", "bf16", "sdpa-cudnn", 1.05, 1.0, None),
    ]
    out = []
    for shape in dict.fromkeys(r["shape"] for r in records):
        grouped = _grouped(records, shape)
        for mode, dtype, base, need_long, need_vit, absolute in (GQA_RULES if grouped else rules):
            ours = _get(records, shape, dtype, mode)
            if ours is None:
                continue
            long, vit = ours["N"] >= 4096, (ours["B"], ours["H"], ours["N"], ours["D"]) == (64, 12, 197, 64)
            need = need_long if long else need_vit if vit or grouped else None
            other = _get(records, shape, dtype, base) if base else None
            if need is not None and other is not None:
                key, timing = _reading(ours, other)
                ratio = ours[key] / other[key]
                out.append({"shape": shape, "mode": mode, "vs": base, "ours_tflops": ours[key],
                            "base_tflops": other[key], "timing": timing, "ratio": ratio, "need_ratio": need,
                            "met": ratio >= need})
            elif absolute is not None and long:
                key, timing = _reading(ours)
                out.append({"shape": shape, "mode": mode, "vs": "absolute", "ours_tflops": ours[key],
                            "timing": timing, "need_tflops": absolute, "met": ours[key] >= absolute})
        out += _memory_targets(records, shape, (("fp32", "fp32"), ("fp32-ieee", "fp32"), ("tf32", "fp32"),
                                                ("fp16", "fp16"), ("bf16", "bf16")), 1.0)
    return out


def write_report(result: dict, out_dir: str, outputs: OutputFiles | None = None) -> dict:
    """Write ``<out_dir>/<result["files"] or bench>.md / .json / .png`` through ``outputs`` (default: this tool's
    :class:`OutputFiles`, which raises on a file it may not replace); returns the paths by extension."""
    lines = md_header(result.get("title", "Attention benchmark"), result["environment"],
                      f"{result.get('timing', 'median of `triton.testing.do_bench` (L2 flushed between runs)')}; "
                      f"TFLOP/s = {result.get('flops', '4*B*H*N*N*D')} / t; "
                      "peak extra memory = max_memory_allocated above the inputs; rel err = "
                      + result.get("rel_err", "relative L2 vs the float64 oracle on a random subsample of query rows")
                      + ", same inputs for every backend", f"TF32 matmul: {result['tf32_matmul']}")
    if result.get("host_overhead"):
        lines += ["## Host time per call (B=1 H=1 N=64 D=64; window: 4 windows x 49 tokens, D=32)", "",
                  markdown_table([[r["dtype"], r["call"], f"{r['us']:.1f}", f"{r['x_sdpa']:.2f}x"]
                                  for r in result["host_overhead"]], ["inputs", "call", "us / call", "vs SDPA"]), ""]
    for shape in dict.fromkeys(r["shape"] for r in result["records"]):
        rs = [r for r in result["records"] if r["shape"] == shape]
        r0 = rs[0]
        lines += [f"## {shape} (B={r0['B']}, H={r0['H']}, N={r0['N']}, D={r0['D']})", ""]
        grads = ("dq", "dk", "dv") if "flops" in result else ()  # forward + backward: the gradients' errors
        header = ["inputs", "backend", "ms", "TFLOP/s", "graph ms", "eager / graph", "first call ms", "peak extra MiB",
                  *([f"d{g[1].upper()} rel err" for g in grads] or ["rel err"])]
        rows = []
        for r in rs:
            name = ("**visionattn " + r["backend"] + "**") if r["ours"] else r["backend"]
            errs = ([f"{r[f'rel_err_{g}']:.2e}" if f"rel_err_{g}" in r else "-" for g in grads] if grads
                    else [f"{r['rel_err']:.2e}"] if "ms" in r else [])
            graph = graph_cells(r.get("ms_eager"), r.get("ms_graph"), r.get("graph_error"))
            first = f"{r['ms_first']:.1f}" if "ms_first" in r else "-"  # results written before it was timed
            rows.append([r["dtype"], name, r["ms"], r["tflops"], *graph, first, r["peak_mib"], *errs] if "ms" in r
                        else [r["dtype"], name, *["-"] * (len(header) - 3), r["skipped"]])
        lines.append(markdown_table(rows, header))
        lines += _kernel_table(rs)
    lines += ["## Targets", ""]
    trows = []
    for t in result["targets"]:
        if "eager_over_graph" in t:
            trows.append([t["shape"], t["mode"], t["vs"], "eager / graph time", f"{t['eager_over_graph']:.2f}x "
                          "(need <= 1.1x)", "met" if t["met"] else "NOT met"])
        elif "ours_mib" in t:
            trows.append([t["shape"], t["mode"], t["vs"], f"{t['ours_mib']:.1f} vs {t['base_mib']:.1f} MiB",
                          f"<= {t['need_mem_ratio']}x", "met" if t["met"] else "NOT met"])
        elif "base_tflops" in t:
            timing = f" ({t['timing']})" if "timing" in t else ""
            trows.append([t["shape"], t["mode"], t["vs"], f"{t['ours_tflops']:.1f} vs {t['base_tflops']:.1f}{timing}",
                          f"{t['ratio']:.2f}x (need {t['need_ratio']}x)", "met" if t["met"] else "NOT met"])
        else:
            timing = f" ({t['timing']})" if "timing" in t else ""
            trows.append([t["shape"], t["mode"], "absolute", f"{t['ours_tflops']:.1f}{timing}",
                          f"need {t['need_tflops']}", "met" if t["met"] else "NOT met"])
    lines.append(markdown_table(trows, ["shape", "mode", "vs", "TFLOP/s or memory", "ratio", "status"]))
    stem = os.path.join(out_dir, result.get("files", "bench"))
    write_results(outputs or OutputFiles(TOOL), stem, result, "\n".join(lines), _plot)
    return {ext: f"{stem}.{ext}" for ext in ("md", "json", "png")}


def _kernel_us(record: dict) -> float:
    """A record's GPU time per call summed over its kernels (``--kernel-times``), us."""
    return sum(kt["us"] for kt in record["kernels"])


def _kernel_table(records) -> list[str]:
    """The markdown lines of one shape's per-kernel GPU times (``--kernel-times``): each backend's kernels, largest
    first, and their sum; nothing where no record has them."""
    rows = []
    for r in records:
        if "kernels" not in r:
            continue
        name = f"visionattn {r['backend']}" if r["ours"] else r["backend"]
        rows += [[r["dtype"], name, kt["name"][:90], f"{kt['us']:.2f}", f"{kt['calls']:g}"] for kt in r["kernels"]]
        rows.append([r["dtype"], name, "**all kernels**", f"{_kernel_us(r):.2f}", ""])
    if not rows:
        return []
    return ["", "GPU time per call, kernel by kernel (torch.profiler over 10 CUDA-graph replays after 2 eager calls; "
            "names cut at 90 characters):", "", markdown_table(rows, ["inputs", "backend", "kernel", "us", "launches"])]


# the parts of a forward + backward call that the kernel-time plot stacks, by the kernel function's name (its text
# before any template or argument list): the passes first, as the forward and backward kernels' own names carry
# fwd / bwd too (FlashAttention's flash_bwd_dot_do_o_kernel, visionattn's _bwd_preprocess_kernel)
KERNEL_PARTS = (("passes (dO.O, dQ conversion, memsets, copies)",
                 re.compile(r"preprocess|combine|convert|dot_do|memset|memcpy|elementwise|fill", re.I)),
                ("forward", re.compile(r"fprop|fwd|cutlassF")), ("backward", re.compile(r"bprop|bwd|cutlassB")))


def kernel_part(name: str) -> str:
    """Which of :data:`KERNEL_PARTS` a profiled kernel is: its function name matched in order (the passes for a name
    none matches)."""
    stem = re.split(r"[<(]", name.removeprefix("void "), maxsplit=1)[0]
    return next((part for part, pattern in KERNEL_PARTS if pattern.search(stem)), KERNEL_PARTS[0][0])


def _plot(result, path, outputs):
    """With ``--kernel-times``: each shape's GPU time per call, our modes beside the fastest baseline, stacked by
    :func:`kernel_part`. Else TFLOP/s against N for the B=1 H=8 D=64 sweep where the table has two or more of its
    lengths; else (named shapes: ViT sizes, grouped-query heads) bars of graph-replay TFLOP/s (eager where the
    calls could not be captured) per shape and backend."""
    if any("kernels" in r for r in result["records"]):
        _plot_kernels(result, path, outputs)
        return
    recs = [r for r in result["records"] if "ms" in r and r["B"] == 1 and r["H"] == 8 and r["D"] == 64]
    if len({r["N"] for r in recs}) < 2:
        _plot_bars(result, path, outputs)
        return
    groups = [g for g in GROUPS if any(r["dtype"] == g for r in recs)]
    with figure(path, outputs, 1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False) as (fig, axes):
        for ax, group in zip(axes[0], groups):
            gr = [r for r in recs if r["dtype"] == group]
            for backend in dict.fromkeys(r["backend"] for r in gr):
                pts = sorted((r["N"], r["tflops"]) for r in gr if r["backend"] == backend)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        lw=2.5 if backend in MODES else 1.2,
                        label=("visionattn " + backend) if backend in MODES else backend)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N (B=1, H=8, D=64)")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{group} inputs")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(result["environment"]["device"] + (", forward + backward" if "flops" in result else ""))


def _plot_kernels(result, path, outputs):
    recs = [r for r in result["records"] if "kernels" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in recs))
    cols = min(3, len(shapes))
    rows_n = -(-len(shapes) // cols)
    colors = dict(zip((part for part, _ in KERNEL_PARTS), ("#999999", "tab:blue", "tab:orange")))
    with figure(path, outputs, rows_n, cols, figsize=(5.2 * cols, 2.6 * rows_n), squeeze=False) as (fig, axes):
        for ax, shape in zip(axes.flat, shapes):
            bars_here = []
            for group in GROUPS:
                gr = [r for r in recs if r["shape"] == shape and r["dtype"] == group]
                base = [r for r in gr if not r["ours"]]
                fastest = min(base, key=_kernel_us) if base else None
                bars_here += [(f"{group} {'visionattn ' + r['backend'] if r['ours'] else r['backend']}", r)
                              for r in [*(r for r in gr if r["ours"]), *([fastest] if fastest else [])]]
            for y, (label, r) in enumerate(bars_here):
                left = 0.0
                for part, _ in KERNEL_PARTS[1:] + KERNEL_PARTS[:1]:
                    us = sum(k["us"] for k in r["kernels"] if kernel_part(k["name"]) == part)
                    ax.barh(y, us, left=left, color=colors[part], label=part if y == 0 else None)
                    left += us
                ax.text(left, y, f" {left:.0f}", va="center", fontsize=7)
            ax.set_yticks(range(len(bars_here)), [label for label, _ in bars_here], fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("GPU time per call (us)")
            ax.set_title(shape, fontsize=9)
            ax.grid(axis="x", alpha=0.3)
            ax.set_xlim(0, ax.get_xlim()[1] * 1.1)  # room for the totals
        for ax in list(axes.flat)[len(shapes):]:
            ax.axis("off")
        fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper right", ncol=3, fontsize=7, frameon=False)
        fig.suptitle(f"{result['environment']['device']}, {'forward + backward' if 'flops' in result else 'forward'} "
                     "kernel by kernel (CUDA-graph replays)", x=0.01, ha="left", fontsize=10)


def _plot_bars(result, path, outputs):
    recs = [r for r in result["records"] if "ms" in r]
    groups = [g for g in GROUPS if any(r["dtype"] == g for r in recs)]
    if not groups:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in recs))
    width = max(5.5, 1.6 * len(shapes))
    with figure(path, outputs, 1, len(groups), figsize=(width * len(groups), 4.4), squeeze=False) as (fig, axes):
        for ax, group in zip(axes[0], groups):
            gr = [r for r in recs if r["dtype"] == group]
            cells = {(r["backend"], r["shape"]): r.get("tflops_graph") or r["tflops"] for r in gr}
            bars(ax, shapes, {("visionattn " + b) if b in MODES else b: [cells.get((b, s)) for s in shapes]
                              for b in dict.fromkeys(r["backend"] for r in gr)})
            ax.set_ylabel("TFLOP/s (graph replay)")
            ax.set_title(f"{group} inputs")
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)  # below: off the bars
        fig.suptitle(result["environment"]["device"] + (", forward + backward" if "flops" in result else ""))


# --------------------------------------------------------------------------- tuning

TUNE_CANDIDATES = {
    "half": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3),
             (64, 32, 4, 3), (64, 32, 4, 2), (128, 32, 8, 3)],
    "tf32": [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 4, 2)],
    "tf32x3": [(64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2)],
    "ieee": [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (32, 32, 4, 2), (128, 32, 8, 2), (64, 16, 4, 2),
             (64, 64, 4, 3), (128, 64, 4, 2), (64, 32, 2, 2), (128, 32, 4, 3), (32, 64, 2, 2)],
    "f16x3": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
              (64, 32, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2)],
    "f16x1": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
              (64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 4, 2), (64, 64, 4, 2)],
}
# kind -> (mode, product precision override; None = the mode's own)
TUNE_MODES = {"half": ("fp16", None), "tf32": ("tf32", "tf32"), "tf32x3": ("fp32", "tf32x3"),
              "ieee": ("fp32-ieee", "ieee"), "f16x3": ("fp32", "f16x3"), "f16x1": ("tf32", "f16x1")}


def run_tune(args) -> dict:
    """Time each candidate tile config of each kind (+ its rel err vs the float64 oracle)."""
    import triton.testing

    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(1, 8, 8192, 64), (64, 12, 197, 64), (1, 8, 8192, 128), (8, 12, 1025, 64)]
    kinds = args.tune_kinds.split(",") if args.tune_kinds else list(TUNE_CANDIDATES)
    results = []
    for kind in kinds:
        mode, precision = TUNE_MODES[kind]
        dtype = MODES[mode].compute_dtype
        for (B, H, N, D) in shapes:
            g = torch.Generator(device="cuda").manual_seed(N + D)
            q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g).to(dtype) for _ in range(3))
            rows = torch.randperm(N, device="cuda", generator=g)[:128]
            ref = oracle_attention(q[:, :, rows], k, v, scale=D ** -0.5)
            flops = 4 * B * H * N * N * D
            for c in TUNE_CANDIDATES[kind]:
                cfg = elsa_fwd.TileConfig(*c)
                rec = {"kind": kind, "shape": [B, H, N, D], "config": c}
                try:
                    fn = functools.partial(elsa_fwd._launch, q, k, v, None, None, False, D ** -0.5, mode, 1, cfg,
                                           precision)
                    err = rel_l2(fn()[:, :, rows], ref)
                    ms = triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
                    rec.update(ms=ms, tflops=flops / ms / 1e9, rel_err=err)
                except Exception as exc:  # out of shared memory / registers for this config
                    rec["error"] = str(exc).splitlines()[0][:120]
                results.append(rec)
                print(json.dumps(rec), flush=True)
            del q, k, v, ref
    return {"environment": environment(), "tune": results}


def main(args) -> dict:
    parser = build_parser()
    if args.varlen:
        if args.tune or args.backward or args.cuda_graph:
            parser.error("--varlen runs tools/bench_varlen.py's table alone; drop --tune / --backward / --cuda-graph")
        import bench_varlen

        check_output(parser, args.out, folder=True)
        return bench_varlen.main((["--modes", args.modes] if args.modes else [])
                                 + ["--out", os.path.join(args.out, "varlen")])
    if not args.tune and not os.path.isfile(args.config):
        parser.error(f"--config {args.config!r} is not a file; pass a YAML like configs/bench_attention.yaml")
    if args.backward and (args.tune or args.cuda_graph):
        parser.error(f"--backward reports eager beside graph forward + backward; drop "
                     f"{'--tune' if args.tune else '--cuda-graph'}")
    check_output(parser, args.out, folder=True)
    stem = os.path.join(args.out, "tune" if args.tune else "fwd_bwd" if args.backward else "bench")
    outputs = output_files(parser, [stem + ".json"] if args.tune else [stem + ".md", stem + ".json", stem + ".png"],
                           tool=TOOL)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (H100/H200); none is visible here")
    print("environment:", json.dumps(environment()), flush=True)
    print("note: this tool sets torch.backends.cuda.matmul.allow_tf32 = False (TF32 only inside flex-tf32 rows)")
    t0 = time.perf_counter()
    if args.tune:
        result = run_tune(args)
        outputs.write_json(stem + ".json", result)
        return result
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    result = run_sweep(args, cfg)
    result["seconds"] = time.perf_counter() - t0
    result["paths"] = write_report(result, args.out, outputs)
    print(open(result["paths"]["md"]).read())
    return result


if __name__ == "__main__":
    main(build_parser().parse_args())
