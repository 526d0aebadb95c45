"""Window attention forward + backward (the training path): visionattn vs timm's own attention lines.

Each case is one stage of a Swin / Swin-v2 model from ``configs/bench_window.yaml`` at a batch size
(``--cases model:stage:batch``; default the first stage of Swin-B and Swin-v2-B (window 8) at batch 64), in ``fp32``
(TF32 off) and ``bf16`` (autocast, as a bf16 training step runs timm's lines; the window kernel takes
bf16 inputs). Every backend computes the same output from the same leaves and returns the gradients a
training step needs: of the qkv tensor (q, k, v as timm's ``qkv.unbind`` views), of the relative position
bias [H, N, N] (the table gather / CPB MLP before it is outside the timing, the same for all) and, for
Swin-v2, of ``logit_scale``; the shift mask gets none. Backends:

* ``visionattn``: :func:`visionattn.window_attention_qkvpacked` on the qkv leaf in the case's mode, the call a
  patched timm Swin / Swin-v2 module makes in training (its backward writes the packed qkv gradient; timm's lines
  get theirs through ``unbind``'s backward).
* ``timm-eager``: the attention lines of timm's ``WindowAttention.forward`` (explicit matmuls and softmax;
  ``tools/bench_window.py``'s ``eager_fn``): Swin with ``fused_attn`` off, and Swin-v2's only path.
* ``timm-sdpa``: Swin's fused path (timm's default where fused attention is on): SDPA with the bias and mask
  added into an [B*nW, H, N, N] ``attn_mask``.

The "timm's path" ratio divides by timm's default path (Swin: ``timm-sdpa``, Swin-v2: ``timm-eager``). Timing:
eager (CUDA events around back-to-back forward + ``torch.autograd.grad`` calls, the Python launch path
counts); for visionattn also replays of a CUDA graph of the same calls, in alternating windows
(:func:`_harness.eager_graph_ms`). timm's lines are timed eager only: their forward + backward
fails to capture into a CUDA graph on torch 2.11 (``cudaErrorStreamCaptureInvalidated``), and a failed capture
keeps its memory for the rest of the process. On a CPU, wall clock and no graph. Peak extra memory of one
call; gradient errors: relative L2 vs the same lines in float64. Writes ``<out>.md``, ``<out>.json``,
``<out>.png``.

    python tools/bench_window_train.py --out out/window_train_h100
    python tools/bench_window_train.py --cases swin_base_224:0:64 --modes bf16
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (OutputFiles, ToolParser, check_output, default_out, eager_graph_timings, eager_ms,  # noqa: E402
                      environment, failure_text, figure, markdown_table, output_files, peak_extra_mb, sample_ms,
                      tf32_disabled)
from bench_window import eager_fn, make_block, sdpa_fn, stage_shapes  # noqa: E402


DEFAULT_CASES = ("swin_base_224:0:64", "swinv2_base_w8_256:0:64")
MODES = ("fp32", "bf16")
BACKENDS = ("visionattn", "timm-eager", "timm-sdpa")
TARGET = 3.0  # visionattn over timm's default path, forward + backward, in fp32 and bf16


def build_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="bench_window_train.py", description=__doc__.split("\n\n")[0],
                   epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(REPO, "configs", "bench_window.yaml"),
                   help="YAML with the model definitions (default: %(default)s)")
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                   help="model:stage:batch, model from the config, stage from 0 (default: %(default)s)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="default: %(default)s")
    p.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed window (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed windows, median reported (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="default: cuda when available")
    p.add_argument("--out", default=default_out("window_train"),
                   help="output prefix: <out>.md, <out>.json, <out>.png (default: %(default)s)")
    return p


def parse_case(text: str, models: dict) -> tuple[dict, dict, int]:
    """``model:stage:batch`` -> (model entry, stage shape, batch); raises SystemExit naming the bad part."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in models or not parts[1].isdigit() or not parts[2].isdigit():
        raise SystemExit(f"--cases {text!r}: expected model:stage:batch with model one of {sorted(models)}")
    model = models[parts[0]]
    stages = stage_shapes(model)
    stage, batch = int(parts[1]), int(parts[2])
    if stage >= len(stages) or batch < 1:
        raise SystemExit(f"--cases {text!r}: stage must be below {len(stages)} and batch at least 1")
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
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    BW, N, H = batch * st["nW"], st["N"], st["heads"]
    D = st["dim"] // H
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(BW, N, 3, H, D, generator=g).to(device=device, dtype=dtype).requires_grad_()
    with torch.no_grad():
        if kind == "v1":
            bias = attn._get_rel_pos_bias()[0]
        else:
            table = attn.cpb_mlp(attn.relative_coords_table).view(-1, H)
            rel = table[attn.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
            bias = 16 * torch.sigmoid(rel)  # as timm's Swin-v2 module
    leaves = [qkv, bias.contiguous().requires_grad_()]
    if kind == "v2":
        leaves.append(attn.logit_scale)
    do = torch.randn(BW, H, N, D, generator=g).to(device=device, dtype=dtype)
    return {"kind": kind, "attn": attn, "mask": mask, "leaves": leaves, "do": do, "dtype": dtype, "mode": mode}


def _qkv(qkv):
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


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


def _cpu_ms(step, repeats: int) -> float:
    """Median CPU wall-clock ms of ``step`` (Triton's interpreter for visionattn)."""
    times = sample_ms(step, "cpu", warmup=1, reps=repeats)
    return sorted(times)[len(times) // 2]


def time_step(step, device: torch.device, calls: int, repeats: int, graph: bool) -> dict:
    """{"ms", "graph_ms", "graph_error"}: eager beside graph replay on CUDA (:func:`_harness.eager_graph_timings`;
    eager alone unless ``graph``); CPU wall clock (no graph) else."""
    if device.type == "cuda" and not graph:
        return {"ms": eager_ms(step, calls=calls, repeats=repeats), "graph_ms": None, "graph_error": None}
    eager, graph_ms, error = eager_graph_timings(lambda: step, lambda fn: _cpu_ms(fn, repeats), device, calls,
                                                 repeats)
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
            row["peak_extra_mib"] = peak_extra_mb(step, device)
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


def targets(rows: list[dict]) -> list[dict]:
    """visionattn over timm's default path per case and mode against :data:`TARGET`."""
    out = []
    for r in rows:
        if r["backend"] == "visionattn" and r["x_timm_default"] is not None:
            out.append({"case": f"{r['model']} stage {r['stage'] + 1} batch {r['batch']}", "mode": r["mode"],
                        "ratio": r["x_timm_default"], "need": TARGET, "met": r["x_timm_default"] >= TARGET})
    return out


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def to_markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# Window attention forward + backward vs timm's attention lines: {env['device']}", "",
             f"* command: `{env['command']}`",
             f"* torch {env['torch']}, triton {env['triton']}, timm {env['timm']}, python {env['python']}",
             f"* {result['timing']}", f"* {result['precision']}", ""]
    header = ["case", "mode", "backend", "ms", "graph ms", "eager / graph", "x timm default", "x timm-eager",
              "peak extra MiB", "dqkv rel err", "dbias rel err", "dlogit_scale rel err"]
    table = []
    for r in result["rows"]:
        case = f"{r['model']} s{r['stage'] + 1} b{r['batch']} ({r['windows']} x {r['heads']} x {r['tokens']})"
        if r["error"]:
            table.append([case, r["mode"], r["backend"], "failed: " + r["error"]] + ["-"] * (len(header) - 4))
            continue
        graph = r["graph_ms"] if r["graph_ms"] is not None else ("n/a" if r["graph_error"] else None)
        ratio = r["ms"] / r["graph_ms"] if r["graph_ms"] else None
        table.append([case, r["mode"], f"**{r['backend']}**" if r["backend"] == "visionattn" else r["backend"],
                      _f(r["ms"]), graph if isinstance(graph, str) else _f(graph), _f(ratio, "{:.2f}"),
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


def plot(result: dict, path: str, outputs: OutputFiles | None = None) -> None:
    ok = [r for r in result["rows"] if r["error"] is None]
    groups = sorted({(r["model"], r["stage"], r["batch"], r["mode"]) for r in ok}, key=str)
    with figure(path, outputs, figsize=(max(6, 2.2 * len(groups)), 4), tool="bench_window_train") as (fig, ax):
        width = 0.8 / len(BACKENDS)
        for i, backend in enumerate(BACKENDS):
            xs, ys = [], []
            for j, g in enumerate(groups):
                r = next((r for r in ok if (r["model"], r["stage"], r["batch"], r["mode"]) == g
                          and r["backend"] == backend), None)
                if r is not None:
                    xs.append(j + (i - 1) * width)
                    ys.append(r["ms"])
            ax.bar(xs, ys, width, label=backend)
        ax.set_xticks(range(len(groups)), [f"{m}\nstage {s + 1}, batch {b}\n{mode}" for m, s, b, mode in groups],
                      fontsize=8)
        ax.set_ylabel("ms per forward + backward (eager)")
        ax.set_title(result["environment"]["device"])
        ax.legend()


def main(args) -> dict:
    import yaml

    parser = build_parser()
    check_output(parser, args.out)
    outputs = output_files(parser, [args.out + ".json", args.out + ".md", args.out + ".png"], tool="bench_window_train")
    device = torch.device(args.device)
    with open(args.config) as f:
        models = {m["name"]: m for m in yaml.safe_load(f)["models"]}
    cases = [parse_case(c, models) for c in args.cases]
    rows = []
    with tf32_disabled():
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
              "rows": rows, "targets": targets(rows)}
    outputs.write_json(args.out + ".json", result)
    outputs.write_text(args.out + ".md", to_markdown(result))
    plot(result, args.out + ".png", outputs)
    return result


if __name__ == "__main__":
    main(build_parser().parse_args())
