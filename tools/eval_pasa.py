#!/usr/bin/env python
"""PASA accuracy and overflow benchmarks (PASA paper, Sec. 3, App. D-E) and speed.

For each input case and each of the modes fp32, fp16 (FP32 score accumulation),
fp16-acc16 (FP16 score accumulation, no shift) and pasa, it reports the share of
non-finite output elements (NaN/inf %) and the relative RMSE against a float64
golden computed from the same float32 inputs (Eq. 19: ||O - O_gold||_2 / ||O_gold||_2;
NaN when the output has a non-finite element).

Cases (configs/eval_pasa.yaml): the paper's uniform U(x0-Am, x0+Am) and hybrid
N(x0,1) + N(0,Am^2)*Bernoulli(0.001) inputs of shape (1, 16, 1280, 128) with the
x0 / Am sweeps of its Figs. 9-10, its Table 4 overflow cases, a Q/K resonance
case (periodic head-dim patterns in phase / 180 degrees apart) and, on the GPU,
SVD-IMG2VID-like shapes [50, 5, 9216, 64] (processed one batch element at a time).

On CUDA, pasa and fp16-acc16 run the Triton kernel
(:func:`visionattn.kernels.pasa_fwd.pasa_attention`); fp32 and fp16 run
:func:`visionattn.attention` (the dense kernels, or the reference where they do
not cover the call, as its warning says). On CPU every mode runs
:func:`visionattn.attention` (the PyTorch references).

``--bench`` (CUDA) times pasa, fp16-acc16, visionattn fp16 and SDPA-flash at
N = 4096..65536, D = 64 and 128 with ``triton.testing.do_bench``.

Usage:
    python tools/eval_pasa.py                       # GPU, full sizes -> out/pasa_<gpu>.*
    python tools/eval_pasa.py --bench               # ... plus the speed table
    python tools/eval_pasa.py --cpu --quick         # CPU, reduced sizes -> out/pasa_cpu.*
"""
# no ``from __future__ import annotations``: pydantic resolves the config schema's annotations at class creation,
# also when the tool is loaded without an entry in sys.modules (as the tests load it)
import argparse
import math
import os
import sys
import re
import time
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (OutputFiles, ToolParser, check_output, default_out, environment, figure,  # noqa: E402
                      load_config, markdown_table, output_files)

import visionattn  # noqa: E402
from visionattn.pasa import BENCHMARK_KINDS, benchmark_inputs
from visionattn.reference import oracle_attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- the config's shape (pydantic)
_Finite = Annotated[float, Field(allow_inf_nan=False)]
_Positive = Annotated[int, Field(gt=0)]
_Milliseconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
_Shape = Annotated[list[_Positive], Field(min_length=4, max_length=4)]  # [B, H, N, D]
_Kind = Literal[BENCHMARK_KINDS]
_Mode = Literal[tuple(visionattn.mode_names())]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not silently ignored


class _Case(_Strict):
    kind: _Kind
    x0: _Finite
    am: _Finite
    paper_nan_pct: _Finite | None = None


class _Sweep(_Strict):
    name: str
    kind: _Kind
    x0: _Finite | list[_Finite]
    am: _Finite | list[_Finite]

    @model_validator(mode="after")
    def _one_swept(self):
        swept = [k for k in ("x0", "am") if isinstance(getattr(self, k), list)]
        if len(swept) != 1:
            raise ValueError("exactly one of x0 and am must be a list (the swept values), the other a number")
        if not getattr(self, swept[0]):
            raise ValueError(f"{swept[0]}: the list of swept values is empty")
        return self


class _Svd(_Strict):
    shape: _Shape
    cases: list[_Case]


class _Bench(_Strict):
    B: _Positive
    H: _Positive
    N: Annotated[list[_Positive], Field(min_length=1)]
    D: Annotated[list[_Positive], Field(min_length=1)]
    warmup_ms: _Milliseconds
    rep_ms: _Milliseconds
    tune_N: _Positive
    pasa_configs: list[dict[str, _Positive]]


class PasaConfig(_Strict):
    """The shape of configs/eval_pasa.yaml (checked before any work; see :func:`_harness.load_config`)."""
    shape: _Shape
    quick_shape: _Shape
    seed: int
    modes: Annotated[list[_Mode], Field(min_length=1)]
    sweeps: list[_Sweep]
    table4: list[_Case]
    resonance: list[_Case]
    svd: _Svd
    bench: _Bench

    @model_validator(mode="after")
    def _report_modes(self):
        missing = [m for m in ("fp16", "pasa") if m not in self.modes]
        if missing:
            raise ValueError(f"modes must include {' and '.join(missing)} (the report compares pasa with fp16)")
        return self


def run_mode(mode: str, q, k, v, scale: float) -> torch.Tensor:
    """Output of one mode, [B, H, N, Dv] float32."""
    if q.is_cuda and mode in ("pasa", "fp16-acc16"):
        from visionattn.kernels.pasa_fwd import pasa_attention

        return pasa_attention(q.half(), k.half(), v.half(), None, None, False, scale,
                              shift=mode == "pasa").float()
    return visionattn.attention(q, k, v, scale=scale, mode=mode).float()


class _Acc:
    """Accumulates ||O - O_gold||^2, ||O_gold||^2 and the non-finite count over chunks."""

    def __init__(self):
        self.err2 = self.ref2 = 0.0
        self.bad = self.total = 0

    def add(self, out, gold):
        self.bad += int((~torch.isfinite(out)).sum())
        self.total += out.numel()
        self.err2 += float(((out.double() - gold) ** 2).sum())
        self.ref2 += float((gold ** 2).sum())

    def result(self) -> dict:
        rmse = math.sqrt(self.err2 / self.ref2) if self.bad == 0 else float("nan")
        return {"nan_inf_pct": 100.0 * self.bad / max(self.total, 1), "rmse": rmse}


def eval_case(case: dict, shape, modes, device, seed: int, chunks: int = 1) -> dict:
    """NaN/inf % and RMSE of every mode on one case; ``chunks`` > 1 splits the batch (seed per chunk)."""
    accs = {m: _Acc() for m in modes}
    B = shape[0]
    per = max(B // chunks, 1)
    for c0 in range(0, B, per):
        sub = (min(per, B - c0),) + tuple(shape[1:])
        q, k, v = benchmark_inputs(case["kind"], case["x0"], case["am"], sub, seed=seed + 7919 * c0, device=device)
        scale = shape[-1] ** -0.5
        gold = oracle_attention(q, k, v, scale=scale)
        for m in modes:
            accs[m].add(run_mode(m, q, k, v, scale), gold)
        del q, k, v, gold
    return {m: a.result() for m, a in accs.items()}


def _cases(cfg: dict, quick: bool, cuda: bool):
    """(section, case) pairs in report order."""
    for sw in cfg["sweeps"]:
        sweep_key = "x0" if isinstance(sw["x0"], list) else "am"
        for val in sw[sweep_key]:
            case = {"kind": sw["kind"], "x0": sw["x0"], "am": sw["am"]}
            case[sweep_key] = val
            yield sw["name"], case
    for c in cfg["table4"]:
        yield "Table 4 (overflow cases of the paper)", dict(c)
    for c in cfg["resonance"]:
        yield "resonance", dict(c)
    if cuda and not quick:
        for c in cfg["svd"]["cases"]:
            yield "SVD-like [50, 5, 9216, 64]", dict(c, shape=cfg["svd"]["shape"])


def run_accuracy(cfg: dict, args, device) -> list[dict]:
    shape = cfg["quick_shape"] if args.quick else cfg["shape"]
    rows = []
    cases = list(_cases(cfg, args.quick, device.type == "cuda"))
    for section, case in tqdm(cases, desc="accuracy cases"):
        shp = case.pop("shape", shape)
        chunks = shp[0]  # one batch element at a time (bounds the float64 golden's memory)
        t0 = time.perf_counter()
        res = eval_case(case, shp, cfg["modes"], device, cfg["seed"], chunks=chunks)
        rows.append({"section": section, **case, "shape": list(shp), "results": res,
                     "seconds": time.perf_counter() - t0})
    return rows


def run_bench(cfg: dict, device) -> list[dict]:
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from visionattn import kernels
    from visionattn.kernels.pasa_fwd import pasa_attention

    b = cfg["bench"]
    rows = []
    for D in b["D"]:
        for N in tqdm(b["N"], desc=f"bench D={D}"):
            shape = (b["B"], b["H"], N, D)
            q, k, v = (torch.randn(shape, device=device, dtype=torch.float16) for _ in range(3))
            scale = D ** -0.5
            fns = {
                "pasa": lambda: pasa_attention(q, k, v, None, None, False, scale, shift=True),
                "fp16-acc16": lambda: pasa_attention(q, k, v, None, None, False, scale, shift=False),
            }
            reason = kernels.unsupported_reason(q, k, v, None, None, "fp16")
            if reason is None:
                fns["visionattn fp16"] = lambda: visionattn.attention(q, k, v, scale=scale, mode="fp16")

            def flash():
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
            fns["SDPA-flash"] = flash
            flops = 4 * b["B"] * b["H"] * N * N * D
            row = {"N": N, "D": D, "B": b["B"], "H": b["H"], "ms": {}, "tflops": {},
                   "fp16_kernel": "available" if reason is None else f"not available: {reason}"}
            for name, fn in fns.items():
                ms = do_bench(fn, warmup=b["warmup_ms"], rep=b["rep_ms"])
                row["ms"][name] = ms
                row["tflops"][name] = flops / ms / 1e9
            ref = row["ms"].get("visionattn fp16", row["ms"]["SDPA-flash"])
            row["pasa_over_fp16"] = row["ms"]["pasa"] / ref
            if N == b["tune_N"]:  # launch-config sweep of the pasa kernel at one size per D
                row["pasa_configs"] = []
                for c in b["pasa_configs"]:
                    try:
                        ms = do_bench(lambda: pasa_attention(q, k, v, None, None, False, scale, config=c),
                                      warmup=b["warmup_ms"], rep=b["rep_ms"])
                    except Exception as e:  # e.g. out of shared memory: record, keep going
                        ms = f"failed: {type(e).__name__}: {str(e)[:120]}"
                    row["pasa_configs"].append({"config": c, "ms": ms})
            rows.append(row)
            del q, k, v
    return rows


def _fmt(r: dict) -> str:
    if r["nan_inf_pct"] > 0:
        return f"NaN/inf {r['nan_inf_pct']:.3g}%"
    return f"{r['rmse']:.3e}"


def to_markdown(results: dict) -> str:
    env = results["environment"]
    modes = results["modes"]
    text = ["# PASA: overflow and accuracy (PASA paper, Sec. 3 / App. D-E)\n",
            f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}; "
            f"command: `{env['command']}`\n",
            "Cells: relative RMSE vs the float64 golden of the same float32 inputs (Eq. 19), or the share of "
            "non-finite output elements when there are any. fp16 = FP16 inputs with FP32 score accumulation; "
            "fp16-acc16 = FP16 score accumulation without shift; pasa = FP16 score accumulation with online "
            f"pseudo-average shifting (beta = 0.984497 for 128-key blocks). Notes: {results['notes']}\n"]
    section = None
    rows = []
    for row in results["accuracy"]:
        if row["section"] != section:
            if rows:
                text.append(markdown_table(rows, header))
            section, rows = row["section"], []
            text.append(f"\n## {section} — shape {row['shape']}\n")
            header = ["kind", "x0", "Am"] + modes + ["pasa / fp16 RMSE"]
            if "paper_nan_pct" in row:
                header.insert(3, "paper NaN % (FP16 acc.)")
        pr = row["results"]
        ratio = pr["pasa"]["rmse"] / pr["fp16"]["rmse"] if pr["fp16"]["rmse"] > 0 else float("nan")
        cells = [row["kind"], row["x0"], row["am"]] + [_fmt(pr[m]) for m in modes] + [ratio]
        if "paper_nan_pct" in row:
            cells.insert(3, row["paper_nan_pct"])
        rows.append(cells)
    if rows:
        text.append(markdown_table(rows, header))
    if results.get("bench"):
        names = list(results["bench"][0]["ms"])
        text.append("\n## Speed (forward, ms; TFLOP/s = 4 B H N^2 D / t)\n")
        text.append(f"visionattn fp16 kernel: {results['bench'][0]['fp16_kernel']}. pasa / fp16 uses the "
                    "visionattn fp16 kernel where available, else SDPA-flash.\n")
        brows = [[r["N"], r["D"]] + [f"{r['ms'][n]:.3f} ({r['tflops'][n]:.0f})" for n in names]
                 + [r["pasa_over_fp16"]] for r in results["bench"]]
        text.append(markdown_table(brows, ["N", "D"] + [f"{n} ms (TFLOP/s)" for n in names] + ["pasa / fp16"]))
        for r in results["bench"]:
            if r.get("pasa_configs"):
                text.append(f"\npasa launch configs at N={r['N']}, D={r['D']} (default: {r['ms']['pasa']:.3f} ms):\n")
                text.append(markdown_table([[str(c["config"]), c["ms"]] for c in r["pasa_configs"]],
                                           ["config", "ms"]))
    return "\n".join(text)


def plot(results: dict, path: str, outputs: OutputFiles | None = None) -> None:
    """Figs. 9-10 style: RMSE per mode over each sweep; overflowing points marked at the top."""
    sweeps = [s for s in dict.fromkeys(r["section"] for r in results["accuracy"]) if "sweep" in s]
    panels = max(len(sweeps), 1)
    with figure(path, outputs, 1, panels, figsize=(4.2 * panels, 3.6), squeeze=False, tool="eval_pasa",
                dpi=110) as (fig, axes):
        for ax, name in zip(axes[0], sweeps):
            rows = [r for r in results["accuracy"] if r["section"] == name]
            key = "x0" if "x0 sweep" in name else "am"
            xs = [r[key] for r in rows]
            top = max(r["results"][m]["rmse"] for r in rows for m in results["modes"]
                      if math.isfinite(r["results"][m]["rmse"]))
            for m, marker in zip(results["modes"], "osD^"):
                ys = [r["results"][m]["rmse"] for r in rows]
                ax.plot(xs, [y if math.isfinite(y) else float("nan") for y in ys], marker=marker, label=m)
                for x, y in zip(xs, ys):
                    if not math.isfinite(y):
                        ax.plot([x], [top * 3], marker="x", color="red")
                        ax.annotate("NaN", (x, top * 3), fontsize=7, color="red", ha="center", va="bottom")
            ax.set_yscale("log")
            ax.set_xlabel(key)
            ax.set_ylabel("relative RMSE")
            ax.set_title(name, fontsize=8)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"PASA vs FP16 accumulation — {results['environment']['device']}", fontsize=9)


def _default_tag(device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    m = re.search(r"(h100|h200|a100|l40s?|b200|rtx ?\d+)", name)
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name)).replace(" ", "")


def build_parser() -> ToolParser:
    p = ToolParser(prog="eval_pasa.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(REPO, "configs", "eval_pasa.yaml"),
                   help="YAML with shapes, sweeps and bench sizes")
    p.add_argument("--out", default=None,
                   help="output path without extension (writes .md, .json, .png); default "
                        "out/pasa_<gpu or cpu>")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    p.add_argument("--quick", action="store_true", help="reduced shape (config quick_shape), no SVD-like shapes")
    p.add_argument("--bench", action="store_true", help="also time pasa / fp16-acc16 / fp16 / SDPA-flash (CUDA)")
    p.add_argument("--bench-only", action="store_true", help="skip the accuracy part (implies --bench)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    return p


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isfile(args.config):
        parser.error(f"--config {args.config!r} is not a file; pass a YAML like configs/eval_pasa.yaml")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if (args.bench or args.bench_only) and device.type != "cuda":
        parser.error("--bench / --bench-only need a CUDA device (drop them, or run on a GPU without --cpu)")
    cfg = load_config(parser, args.config, PasaConfig)
    out = check_output(parser, args.out or default_out(f"pasa_{_default_tag(device)}"))
    plots = not args.bench_only and not args.no_plot
    outputs = output_files(parser, [out + ".json", out + ".md"] + [out + ".png"] * plots, tool="eval_pasa")
    notes = []
    if device.type == "cuda":
        notes.append("pasa / fp16-acc16: Triton kernel visionattn.kernels.pasa_fwd; fp32 / fp16: visionattn.attention")
    else:
        notes.append("all modes: visionattn.attention on CPU (PyTorch references; FP16 accumulation emulated)")
    if args.quick:
        notes.append("--quick: reduced shape, so rare overflows of the full shape may not occur")
    results = {"environment": environment(), "modes": cfg["modes"], "notes": "; ".join(notes),
               "accuracy": [], "bench": []}
    print(f"eval_pasa on {results['environment']['device']}", flush=True)
    if not args.bench_only:
        results["accuracy"] = run_accuracy(cfg, args, device)
    if args.bench or args.bench_only:
        results["bench"] = run_bench(cfg, device)
    outputs.write_json(out + ".json", results)
    md = to_markdown(results)
    outputs.write_text(out + ".md", md)
    if results["accuracy"] and not args.no_plot:
        plot(results, out + ".png", outputs)
    print(md)
    return results


if __name__ == "__main__":
    main()
