#!/usr/bin/env python
"""What the first call costs: kernel compilation in a fresh process with an empty Triton cache.

Every row runs in a new Python process whose ``TRITON_CACHE_DIR`` is a new empty folder (as on a fresh machine):
**attention**, per mode the first and second call of ``visionattn.attention`` at ViT-B/16 224 (B=64 H=12 N=197 D=64)
and at VGGT's global length for 10 frames (B=1 H=16 N=10410); **vggt**, VGGT-1B (random weights, 392x518) in
``--mode``: the first and second forward at ``--frames``, then one at ``--other-frames`` counting the files Triton
adds to its cache (zero when no kernel specialises on the length), and the model's construction time. Where Triton
reports compilations (``triton.knobs.compilation.listener``) a row splits the first call's extra cost into the
kernels compiled (named with their constexprs), their compile seconds by stage (``init``, ``ttir`` .. ``cubin``,
``store``) and the rest. ``--vggt-baseline`` adds VGGT on PyTorch's SDPA (no Triton kernel); ``--compile-ahead``
adds VGGT with its kernels compiled by :class:`visionattn.warmup.CompileAhead` while the model is built.
Writes ``cold_start.md`` and ``cold_start.json`` into ``--out``.

    python tools/bench_cold_start.py --out out/cold_start --frames 100 --other-frames 60 --mode fp32
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (REPO, ToolParser, add_common, check_output, default_out, environment,  # noqa: E402
                      markdown_table, md_header, output_files, positive_int, write_results)


# each child records the kernels Triton compiles (not cache hits) and their compile seconds, per phase
_LISTENER = r"""
COMPILED = {"phase": "first", **{p + part: ({} if part == "_stages" else []) for p in ("first", "other", "ahead")
                                for part in ("", "_stages", "_names")}}
try:
    from triton import knobs as _knobs

    def _name(src):  # the kernel and its constexprs (what makes one variant differ from another)
        fn = getattr(src, "fn", None)
        names = getattr(fn, "arg_names", [])
        consts = []
        for key, value in sorted(getattr(src, "constants", {}).items()):
            if isinstance(key, tuple) and len(key) == 1 and key[0] < len(names) and names[key[0]].isupper():
                consts.append(f"{names[key[0]]}={getattr(value, 'value', value)}")
        return f"{getattr(src, 'name', '?')}({', '.join(consts)})"

    def _listen(*, src, metadata, metadata_group, times, cache_hit):
        if not cache_hit:
            phase = COMPILED["phase"]
            COMPILED[phase].append(times.total / 1e6)
            COMPILED[phase + "_names"].append(f"{_name(src)}: {times.total / 1e6:.2f} s")
            stages = COMPILED[phase + "_stages"]
            for name, us in [("init", times.ir_initialization), *times.lowering_stages, ("store", times.store_results)]:
                stages[name] = stages.get(name, 0.0) + us / 1e6

    _knobs.compilation.listener = _listen
except (ImportError, AttributeError):  # a Triton without compilation listeners: no split
    COMPILED = None


def compiled(phase):
    return {} if COMPILED is None else {f"{phase}_kernels_compiled": len(COMPILED[phase]),
                                        f"{phase}_compile_s": sum(COMPILED[phase]),
                                        f"{phase}_compile_stages_s": COMPILED[phase + "_stages"],
                                        f"{phase}_kernels": COMPILED[phase + "_names"]}
"""

_ATTENTION_CHILD = _LISTENER + r"""
import json, sys, time, torch
import visionattn as va
mode, B, H, N, D = sys.argv[1], *map(int, sys.argv[2:6])
dtype = va.get_mode(mode).compute_dtype
q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
times = []
for _ in range(2):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    va.attention(q, k, v, mode=mode); torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    if COMPILED is not None:
        COMPILED["phase"] = "other"
print(json.dumps({"first_s": times[0], "second_s": times[1], **compiled("first")}))
"""

_VGGT_CHILD = _LISTENER + r"""
import json, os, sys, time, torch
from visionattn.models import VGGT
from visionattn.models.vggt import autocast
mode, frames, other, H, W = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
cache = os.environ["TRITON_CACHE_DIR"]
count = lambda: sum(len(f) for _, _, f in os.walk(cache))
t_model, ahead = time.perf_counter(), None
if sys.argv[6:] == ["ahead"]:  # the kernels compile in a background thread while the model is built
    from visionattn.models import vggt_attention_shapes
    from visionattn.warmup import CompileAhead
    if COMPILED is not None:
        COMPILED["phase"] = "ahead"
    ahead = CompileAhead(mode, vggt_attention_shapes(frames, H, W, enable_track=False))
torch.manual_seed(0)
with torch.device("cuda"):
    model = VGGT(enable_track=False).eval()
model.set_attn_mode(None if mode == "sdpa" else mode)
ahead = ahead.wait() if ahead is not None else {}
model_s = time.perf_counter() - t_model
if COMPILED is not None:
    COMPILED["phase"] = "first"
dt = torch.bfloat16 if mode == "bf16" else None
def forward(n):
    images = torch.rand(n, 3, H, W, device="cuda")
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with torch.no_grad(), autocast("cuda", dt):
        model(images)
    torch.cuda.synchronize()
    return time.perf_counter() - t0
first = forward(frames); files_after_first = count()
second = forward(frames)
if COMPILED is not None:
    COMPILED["phase"] = "other"
before = count(); third = forward(other); added = count() - before
print(json.dumps({"first_s": first, "second_s": second, "other_frames_s": third, "model_s": model_s,
                  "ahead_s": ahead.get("seconds"), "ahead_waited_s": ahead.get("waited"),
                  "ahead_error": ahead.get("error"), "cache_files_after_first": files_after_first,
                  "cache_files_added_by_other_frames": added, **compiled("first"), **compiled("other"),
                  **(compiled("ahead") if ahead else {})}))
"""


def build_parser() -> ToolParser:
    p = ToolParser(prog="bench_cold_start.py", description=__doc__.split("\n\n")[0])
    add_common(p, out=(default_out("cold_start"), "output folder (default: %(default)s)"),
               modes=("fp32,tf32,fp16,bf16", "modes of the attention rows (default: %(default)s)"))
    p.add_argument("--mode", default="fp32", help="VGGT's attention mode (default: %(default)s)")
    p.add_argument("--vggt-baseline", action="store_true",
                   help="also VGGT with PyTorch's SDPA attention (no Triton kernel): its first-call cost without "
                        "visionattn's kernels (CUDA libraries' set-up, first use of PyTorch's kernels)")
    p.add_argument("--frames", type=positive_int, default=100, help="VGGT frames (default: %(default)s)")
    p.add_argument("--other-frames", type=positive_int, default=60,
                   help="the second frame count, which must compile nothing new (default: %(default)s)")
    p.add_argument("--height", type=positive_int, default=392, help="frame height (default: %(default)s)")
    p.add_argument("--width", type=positive_int, default=518, help="frame width (default: %(default)s)")
    p.add_argument("--compile-ahead", action="store_true",
                   help="also VGGT with its kernels compiled in a background thread while the model is built "
                        "(visionattn.warmup.CompileAhead, as the reconstruction demo does)")
    p.add_argument("--skip-vggt", action="store_true", help="only the attention rows")
    return p


def _child(code: str, args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="triton-cold-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "failed"}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["process_s"] = time.perf_counter() - t0
        return result


def render(rows: list[dict], env: dict) -> str:
    fmt = lambda x, f=".2f": "-" if x is None else format(x, f)  # noqa: E731
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["what"], *"-------", r["error"], "-"])
            continue
        extra, compile_s = r["first_s"] - r["second_s"], r.get("first_compile_s")
        table.append([r["what"], fmt(r["first_s"]), fmt(r["second_s"], ".3f"), fmt(extra),
                      r.get("first_kernels_compiled", "-"), fmt(compile_s),
                      "-" if compile_s is None else fmt(extra - compile_s), fmt(r.get("other_frames_s", float("nan"))),
                      r.get("cache_files_added_by_other_frames", "-"),
                      ", ".join(f"{k} {v:.2f}" for k, v in (r.get("first_compile_stages_s") or {}).items()) or "-"])
    lines = md_header(f"First-call cost (empty Triton cache): {env['device']}", env,
                      "every row in a new process with a new empty TRITON_CACHE_DIR; first - second = compilation and "
                      "first-use cost")
    lines.append(markdown_table(table, ["call", "first s", "second s", "first - second s", "kernels compiled",
                                        "their compile s", "rest of first - second s", "other length s",
                                        "cache files added by the other length", "compile s by stage"]))
    compiled_lists = [(r["what"], r["first_kernels"]) for r in rows if r.get("first_kernels")]
    if compiled_lists:
        lines += ["", "Kernels compiled by each first call (name, constexprs, compile seconds):", ""]
        lines += [f"* {what}: " + "; ".join(f"`{n}`" for n in names) for what, names in compiled_lists]
    vggt = [r for r in rows if r["what"].startswith("VGGT") and "model_s" in r]
    if vggt:
        lines += ["", "VGGT's model construction (random weights on the GPU; with the kernels compiled ahead, until "
                  "they are done) and the compile ahead:", "",
                  markdown_table([[r["what"], fmt(r["model_s"]), fmt(r.get("ahead_s")), fmt(r.get("ahead_waited_s")),
                                   r.get("ahead_kernels_compiled", "-"), r.get("ahead_error") or "-"] for r in vggt],
                                 ["call", "model construction s", "compile ahead s", "waited for it s",
                                  "kernels compiled ahead", "error"])]
    return "\n".join(lines) + "\n"


def main(args) -> dict:
    import torch

    from visionattn.modes import mode_names

    parser = build_parser()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes + ([] if args.mode == "sdpa" else [args.mode]):
        if m not in mode_names():
            parser.error(f"unknown mode {m!r}; expected one of {mode_names()}")
    check_output(parser, args.out, folder=True)
    prefix = os.path.join(args.out, "cold_start")
    outputs = output_files(parser, [prefix + ".md", prefix + ".json"], tool="bench_cold_start")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (H100/H200); none is visible here")
    rows = []
    for mode in modes:
        for shape in ((64, 12, 197, 64), (1, 16, 10410, 64)):
            rows.append({"what": f"attention {mode} B,H,N,D={shape}",
                         **_child(_ATTENTION_CHILD, [mode, *map(str, shape)], 600)})
            print(json.dumps(rows[-1]), flush=True)
    vggt_rows = [(args.mode, False)] + [(args.mode, True)] * args.compile_ahead + [("sdpa", False)] * args.vggt_baseline
    for vggt_mode, ahead in ([] if args.skip_vggt else vggt_rows):
        r = _child(_VGGT_CHILD, [vggt_mode, str(args.frames), str(args.other_frames), str(args.height),
                                 str(args.width)] + ["ahead"] * ahead, 900)
        how = ", kernels compiled ahead while the model is built" if ahead else ""
        rows.append({"what": f"VGGT-1B {vggt_mode} {args.frames} frames{how}, then {args.other_frames}", **r})
        print(json.dumps(rows[-1]), flush=True)
    result = {"environment": environment(), "rows": rows}
    text = render(rows, result["environment"])
    write_results(outputs, prefix, result, text)
    print(text)
    return result


if __name__ == "__main__":
    main(build_parser().parse_args())
