#!/usr/bin/env python
"""PASA accuracy and overflow benchmarks (PASA paper, Sec. 3, App. D-E) and speed.

Per input case of configs/eval_pasa.yaml (the paper's uniform and hybrid inputs with its x0 / Am sweeps of Figs.
9-10, its Table 4 overflow cases, a Q/K resonance case and, on the GPU, SVD-IMG2VID-like shapes one batch element at a
time) and mode (fp32, fp16, fp16-acc16, pasa): the share of non-finite output elements and the relative RMSE against
a float64 golden of the same float32 inputs (Eq. 19). On CUDA the half-score modes run the Triton kernel
(``pasa_fwd.pasa_attention``), the others :func:`visionattn.attention`; on CPU every mode runs
:func:`visionattn.attention`. ``--bench`` (CUDA) times pasa, fp16-acc16, visionattn fp16 and SDPA-flash
(``triton.testing.do_bench``).

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
from _harness import (REPO, ToolParser, default_out, environment, figure, load_config, markdown_table,  # noqa: E402
                      md_header, prefix_outputs, write_results)

import visionattn  # noqa: E402
from visionattn.modes import MODES  # noqa: E402
from visionattn.pasa import BENCHMARK_KINDS, benchmark_inputs  # noqa: E402
from visionattn.reference import oracle_attention  # noqa: E402


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
    """Output of one mode, [B, H, N, Dv] float32: the PASA kernel for a half-score mode on CUDA."""
    if q.is_cuda and MODES[mode].half_scores:
        from visionattn.kernels.pasa_fwd import pasa_attention

        return pasa_attention(q.half(), k.half(), v.half(), None, None, False, scale,
                              shift=MODES[mode].pasa_shift).float()
    return visionattn.attention(q, k, v, scale=scale, mode=mode).float()


def eval_case(case: dict, shape, modes, device, seed: int) -> dict:
    """NaN/inf % and RMSE of every mode on one case, one batch element at a time (bounding the float64 golden's
    memory; seed per element): ||O - O_gold||^2 and ||O_gold||^2 summed over the elements."""
    sums = {m: [0.0, 0.0, 0, 0] for m in modes}  # err2, ref2, non-finite, elements
    for b in range(shape[0]):
        q, k, v = benchmark_inputs(case["kind"], case["x0"], case["am"], (1, *shape[1:]), seed=seed + 7919 * b,
                                   device=device)
        scale = shape[-1] ** -0.5
        gold = oracle_attention(q, k, v, scale=scale)
        for m in modes:
            out = run_mode(m, q, k, v, scale)
            acc = sums[m]
            acc[0] += float(((out.double() - gold) ** 2).sum())
            acc[1] += float((gold ** 2).sum())
            acc[2] += int((~torch.isfinite(out)).sum())
            acc[3] += out.numel()
        del q, k, v, gold
    return {m: {"nan_inf_pct": 100.0 * bad / max(total, 1), "rmse": math.sqrt(err2 / ref2) if bad == 0 else math.nan}
            for m, (err2, ref2, bad, total) in sums.items()}


def run_accuracy(cfg: dict, args, device) -> list[dict]:
    """One row per case (report order: the sweeps, Table 4, resonance, on a full-size GPU run the SVD shapes)."""
    cases = [(sw["name"], {"kind": sw["kind"], "x0": sw["x0"], "am": sw["am"], key: val}) for sw in cfg["sweeps"]
             for key in ["x0" if isinstance(sw["x0"], list) else "am"] for val in sw[key]]
    cases += [("Table 4 (overflow cases of the paper)", dict(c)) for c in cfg["table4"]]
    cases += [("resonance", dict(c)) for c in cfg["resonance"]]
    if device.type == "cuda" and not args.quick:
        cases += [("SVD-like [50, 5, 9216, 64]", dict(c, shape=cfg["svd"]["shape"])) for c in cfg["svd"]["cases"]]
    rows = []
    for section, case in tqdm(cases, desc="accuracy cases"):
        shape = case.pop("shape", cfg["quick_shape"] if args.quick else cfg["shape"])
        t0 = time.perf_counter()
        res = eval_case(case, shape, cfg["modes"], device, cfg["seed"])
        rows.append({"section": section, **case, "shape": list(shape), "results": res,
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


def to_markdown(results: dict) -> str:
    modes = results["modes"]
    text = md_header("PASA: overflow and accuracy (PASA paper, Sec. 3 / App. D-E)", results["environment"],
                     "Cells: relative RMSE vs the float64 golden of the same float32 inputs (Eq. 19), or the share of "
                     "non-finite output elements when there are any. fp16 = FP16 inputs with FP32 score accumulation; "
                     "fp16-acc16 = FP16 score accumulation without shift; pasa = FP16 score accumulation with online "
                     f"pseudo-average shifting (beta = 0.984497 for 128-key blocks). Notes: {results['notes']}")
    cell = lambda r: f"NaN/inf {r['nan_inf_pct']:.3g}%" if r["nan_inf_pct"] > 0 else f"{r['rmse']:.3e}"  # noqa
    for section in dict.fromkeys(r["section"] for r in results["accuracy"]):
        rows = [r for r in results["accuracy"] if r["section"] == section]
        paper = "paper_nan_pct" in rows[0]
        table = []
        for row in rows:
            pr = row["results"]
            ratio = pr["pasa"]["rmse"] / pr["fp16"]["rmse"] if pr["fp16"]["rmse"] > 0 else float("nan")
            table.append([row["kind"], row["x0"], row["am"]] + [row.get("paper_nan_pct")] * paper
                         + [cell(pr[m]) for m in modes] + [ratio])
        text += [f"\n## {section} — shape {rows[0]['shape']}\n", markdown_table(
            table, ["kind", "x0", "Am"] + ["paper NaN % (FP16 acc.)"] * paper + modes + ["pasa / fp16 RMSE"])]
    if results.get("bench"):
        names = list(results["bench"][0]["ms"])
        text += ["\n## Speed (forward, ms; TFLOP/s = 4 B H N^2 D / t)\n",
                 f"visionattn fp16 kernel: {results['bench'][0]['fp16_kernel']}. pasa / fp16 uses the "
                 "visionattn fp16 kernel where available, else SDPA-flash.\n",
                 markdown_table([[r["N"], r["D"]] + [f"{r['ms'][n]:.3f} ({r['tflops'][n]:.0f})" for n in names]
                                 + [r["pasa_over_fp16"]] for r in results["bench"]],
                                ["N", "D"] + [f"{n} ms (TFLOP/s)" for n in names] + ["pasa / fp16"])]
        for r in (r for r in results["bench"] if r.get("pasa_configs")):
            text += [f"\npasa launch configs at N={r['N']}, D={r['D']} (default: {r['ms']['pasa']:.3f} ms):\n",
                     markdown_table([[str(c["config"]), c["ms"]] for c in r["pasa_configs"]], ["config", "ms"])]
    return "\n".join(text)


def plot(results: dict, path: str, outputs=None) -> None:
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
    p.add_argument("--out", help="output path without extension (writes .md, .json, .png); default "
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
    out = os.path.abspath(args.out or default_out(f"pasa_{_default_tag(device)}"))
    plots = not args.bench_only and not args.no_plot
    outputs = prefix_outputs(parser, out, [".json", ".md"] + [".png"] * plots, tool="eval_pasa")
    notes = ["pasa / fp16-acc16: Triton kernel visionattn.kernels.pasa_fwd; fp32 / fp16: visionattn.attention"
             if device.type == "cuda" else
             "all modes: visionattn.attention on CPU (PyTorch references; FP16 accumulation emulated)"]
    if args.quick:
        notes.append("--quick: reduced shape, so rare overflows of the full shape may not occur")
    results = {"environment": environment(), "modes": cfg["modes"], "notes": "; ".join(notes),
               "accuracy": [], "bench": []}
    print(f"eval_pasa on {results['environment']['device']}", flush=True)
    if not args.bench_only:
        results["accuracy"] = run_accuracy(cfg, args, device)
    if args.bench or args.bench_only:
        results["bench"] = run_bench(cfg, device)
    md = to_markdown(results)
    write_results(outputs, out, results, md, plot if results["accuracy"] and not args.no_plot else None)
    print(md)
    return results


if __name__ == "__main__":
    main()
