#!/usr/bin/env python
"""Reproduce the ELSA supplement's Table 1 (monoid scan vs float64 oracle) on CPU.

Three scenarios of the supplement at laptop sizes (:data:`SCENARIOS`; stress: q, k x4 and 1 % outlier keys x8). The
scan reduces per-block (m, S, W) states of ``--block-size`` keys with a balanced tree of merges, in float64 (the
paper's magnitudes) and in FP32 (the fp32 mode); the six drift metrics (supplement Sec. C.2) at p95 over query rows.

Usage: python tools/drift_table.py [--out out/drift_table1_cpu] [--quick]
(``--out docs/benchmarks/drift_table1_cpu`` regenerates the committed table.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, default_out, environment, markdown_table, positive_int, prefix_outputs,  # noqa: E402
                      write_results)

from visionattn.metrics import METRIC_NAMES, drift_metrics  # noqa: E402
from visionattn.reference import blocked_attention_with_probs, oracle_attention  # noqa: E402

SCENARIOS = {
    "regular": dict(b=2, h=8, n=512, d=64, stress=False),
    "long": dict(b=1, h=4, n=2048, d=64, stress=False),
    "stress": dict(b=2, h=4, n=1024, d=64, stress=True),
}
LABELS = {
    "max_abs_dP": r"max \|dP\|", "rel_l2_dP": "rel L2 dP", "js_mean": "JS mean",
    "argmax_disagree": "argmax disagreement", "max_abs_dY": r"max \|dY\|", "rel_l2_dY": "rel L2 dY",
}


def make_inputs(b, h, n, d, stress, seed=0):
    """q, k, v float64 [b, h, n, d] for one scenario."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    if stress:
        q, k = 4 * q, 4 * k
        outliers = torch.rand(b, h, n, 1, generator=g) < 0.01
        k = torch.where(outliers, 8 * k, k)
    return q, k, v


def run(args) -> dict:
    results = {"environment": environment(), "scenarios": {}}
    shrink = 4 if args.quick else 1
    for name, cfg in SCENARIOS.items():
        cfg = dict(cfg, n=max(cfg["n"] // shrink, 64))
        q, k, v = make_inputs(cfg["b"], cfg["h"], cfg["n"], cfg["d"], cfg["stress"])
        t0 = time.perf_counter()
        y_ref, p_ref = oracle_attention(q, k, v, return_probs=True)
        entry = {"config": cfg}
        for label, dtype in (("scan_fp64", torch.float64), ("scan_fp32", torch.float32)):
            y, p = blocked_attention_with_probs(q, k, v, block_size=args.block_size, state_dtype=dtype)
            entry[label] = drift_metrics(p, p_ref, y, y_ref)
        entry["seconds"] = time.perf_counter() - t0
        results["scenarios"][name] = entry
        print(f"{name}: n={cfg['n']} done in {entry['seconds']:.1f}s", flush=True)
    return results


def to_markdown(results: dict) -> str:
    env = results["environment"]
    names = list(results["scenarios"])
    text = ["# Table 1 reproduction: monoid scan vs float64 oracle (p95 over query rows)\n",
            f"Device: {env['device']}; torch {env['torch']}; command: `{env['command']}`\n",
            "Scenarios: " + "; ".join(f"{n} (B={c['config']['b']}, H={c['config']['h']}, N={c['config']['n']}, "
                                      f"D={c['config']['d']})" for n, c in results["scenarios"].items()) + "\n"]
    for label, title in (("scan_fp64", "Scan in float64 (the supplement's magnitudes)"),
                         ("scan_fp32", "Scan in FP32 (the fp32 mode's arithmetic)")):
        rows = [[LABELS[m]] + [results["scenarios"][n][label][m]["p95"] for n in names] for m in METRIC_NAMES]
        text += [f"\n## {title}\n", markdown_table(rows, ["Metric (p95)"] + names)]
    return "\n".join(text)


def build_parser() -> ToolParser:
    parser = ToolParser(prog="drift_table.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=default_out("drift_table1_cpu"),
                        help="output path without extension; writes OUT.md and OUT.json (default: %(default)s)")
    parser.add_argument("--block-size", type=positive_int, default=128, help="keys per monoid block (paper: 128)")
    parser.add_argument("--quick", action="store_true", help="4x shorter sequences (for tests)")
    return parser


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    outputs = prefix_outputs(parser, args.out, (".json", ".md"), tool="drift_table")
    results = run(args)
    write_results(outputs, args.out, results, to_markdown(results))
    print(to_markdown(results))
    return results


if __name__ == "__main__":
    main()
