"""Benchmark the transformers and diffusers integrations: each library's default attention vs visionattn.

Cells (random weights, eval mode, ``torch.no_grad``), each in the dtype of every ``--modes`` mode on both sides:
transformers ``ViTModel`` (ViT-B/16 at 512 px, 1025 tokens: the grid a 518 px input gives) and ``Dinov2Model``
(DINOv2-B at 518 px, 1370 tokens) built with ``attn_implementation="sdpa"`` and ``dtype=`` the mode's dtype, then
switched to ``"visionattn_<mode>"`` on the same weights; one Flux-sized diffusers ``FluxTransformerBlock`` (dim 3072,
24 heads, 4096 image + 512 text tokens, Flux's rotary embedding) with diffusers' default attention vs its
``dispatch_attention_fn`` SDPA calls routed to visionattn (``patch_dispatch``, the hooks ``patch_model`` installs on
a Flux model). Timing, memory and interleaved rounds as tools/bench_models.py (:func:`bench_models.measure`);
outputs against the default row and a float64 forward. ``--attention-free`` adds the default forward with SDPA
answering its value rows (:func:`_harness.attention_free`): the Amdahl bound of any attention kernel. Targets are
judged only on a GPU at full size. TF32 is off while it runs.

    python tools/bench_integrations.py --out out/integrations_h100
    python tools/bench_integrations.py --cases flux --modes bf16 --cuda-graph --out out/flux_graph
    python tools/bench_integrations.py --attention-free --out out/integrations_bound  # with the Amdahl bound
    python tools/bench_integrations.py --tiny --device cpu --out /tmp/integrations     # seconds, smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.metadata
import importlib.util
import math
import os
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers

from _harness import (ToolParser, add_common, attention_free, check_device, comma_list, default_out,  # noqa: E402
                      environment, failure_text, figure, markdown_table, md_header, positive_float, positive_int,
                      prefix_outputs, tf32_flags, write_results)
from bench_models import measure  # noqa: E402

from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import MODES  # noqa: E402

CASES = ("vit", "dinov2", "flux")
BENCH_MODES = tuple(m for m, spec in MODES.items() if not spec.half_scores)  # the integrations' modes
LIBRARY = {"vit": "transformers", "dinov2": "transformers", "flux": "diffusers"}
#: minimum speed-up over the library's default attention, per case and mode (full size, on a GPU)
TARGETS = {"vit": {"fp32": 1.4, "bf16": 1.0}, "dinov2": {"fp32": 1.4, "bf16": 1.0}, "flux": {"fp32": 2.0, "bf16": 1.0}}
FREE = "attention-free (SDPA answers V)"  # the --attention-free row's label
_INSTALL = {"transformers": 'pip install "transformers>=5.0"', "diffusers": 'pip install "diffusers>=0.35.2"'}

parser = ToolParser(prog="bench_integrations.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
add_common(parser, out=default_out("integrations_bench"), device="cuda", warmup=3,
           modes=("fp32,bf16", f"comma-separated subset of {','.join(BENCH_MODES)} (default: %(default)s)"))
parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
parser.add_argument("--batch", type=positive_int, default=8,
                    help="images per forward of the transformers models (the Flux block runs batch 1)")
parser.add_argument("--tiny", action="store_true", help="tiny configs (hidden 32-64, 2 layers) for a CPU smoke run")
parser.add_argument("--cuda-graph", action="store_true", help="time replays of each row's forward in a CUDA graph")
parser.add_argument("--rep-ms", type=positive_float, default=600.0, help="timed milliseconds per row, split over "
                    "the rounds (default: %(default)s)")
parser.add_argument("--attention-free", action="store_true",
                    help="add a row per cell with SDPA computing no attention: the Amdahl bound of the speed-up")
parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds per cell")


class Size(NamedTuple):
    """transformers: hidden size, layers, heads, patch and image size (px). Flux block: dimension, 1, heads, 1,
    image tokens per side, text tokens."""
    hidden: int
    layers: int
    heads: int
    patch: int
    image: int
    text: int = 0


SIZES = {("vit", False): Size(768, 12, 12, 16, 512), ("vit", True): Size(32, 2, 2, 8, 32),
         ("dinov2", False): Size(768, 12, 12, 14, 518), ("dinov2", True): Size(32, 2, 2, 8, 32),
         # Flux: dim = heads * 128, 64 x 64 image tokens (a 1024 px image's packed latents), 512 text tokens
         ("flux", False): Size(3072, 1, 24, 1, 64, 512), ("flux", True): Size(64, 1, 2, 1, 8, 16)}


def _environment(libraries: set[str]) -> dict:
    """:func:`_harness.environment` with the transformers and diffusers versions from package metadata; diffusers
    is not imported (its import made to fail at once) unless one of its cases runs."""
    versions = {}
    for name in ("transformers", "diffusers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    hide = "diffusers" not in libraries and "diffusers" not in sys.modules
    if hide:
        sys.modules["diffusers"] = None  # an import of a None entry raises ImportError without loading anything
    try:
        return environment(versions)
    finally:
        if hide:
            del sys.modules["diffusers"]


def missing_library(case: str) -> str | None:
    """Why ``case`` cannot run here (its library absent or too old, with the install line), or None."""
    name = LIBRARY[case]
    if importlib.util.find_spec(name) is None:
        return f"{name} is not installed ({_INSTALL[name]})"
    if name == "transformers":
        from visionattn.integrations import transformers as va_transformers

        try:
            va_transformers.register()
        except ImportError as err:
            return str(err)
    return None


def _switch(apply):
    """The variant context of ``apply()``: switches the model, yields the row's facts."""
    return contextlib.contextmanager(lambda: (yield apply()))


# ----------------------------------------------------------------------------- cells
def transformers_cell(case: str, mode: str, batch: int, tiny: bool, device: torch.device):
    """(info, forward, variants, float64 forward) of ``ViTModel`` / ``Dinov2Model`` in ``mode``'s dtype:
    ``attn_implementation`` "sdpa" vs "visionattn_<mode>"."""
    import transformers
    from transformers import AttentionInterface

    from visionattn.integrations.transformers import implementation_name, register

    register()
    s = SIZES[(case, tiny)]
    common = dict(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                  patch_size=s.patch, image_size=s.image)
    if case == "vit":
        model_cls, config = transformers.ViTModel, transformers.ViTConfig(intermediate_size=4 * s.hidden, **common)
    else:
        model_cls, config = transformers.Dinov2Model, transformers.Dinov2Config(mlp_ratio=4, **common)
    dtype = MODES[mode].compute_dtype
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    pixels = torch.randn(batch, 3, s.image, s.image, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    name = implementation_name(mode)

    def forward(m=model, x=pixels):
        with torch.no_grad():
            return m(pixel_values=x).last_hidden_state

    def use(implementation):
        model.set_attn_implementation(implementation)
        used = model.config._attn_implementation
        return {"attn_implementation": used, "attention_function": AttentionInterface()[used].__name__}

    def reference():
        model64 = copy.deepcopy(model).double()
        model64.set_attn_implementation("sdpa")
        return forward(model64, pixels.double())

    label = "tiny" if tiny else {"vit": "ViT-B/16", "dinov2": "DINOv2-B/14"}[case]
    info = dict(model=f"{model_cls.__name__} ({label})", img=s.image, tokens=(s.image // s.patch) ** 2 + 1,
                batch=batch, params_m=sum(p.numel() for p in model.parameters()) / 1e6)
    return info, forward, [("sdpa", lambda: use("sdpa")), (name, lambda: use(name))], reference


def flux_cell(mode: str, tiny: bool, device: torch.device):
    """(info, forward, variants, float64 forward) of one ``FluxTransformerBlock`` in ``mode``'s dtype: diffusers'
    default attention vs the block's ``dispatch_attention_fn`` SDPA calls routed to visionattn."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxTransformerBlock

    from visionattn.patching.diffusers_dispatch import dispatch_counts, patch_dispatch, unpatch_dispatch

    s = SIZES[("flux", tiny)]
    head_dim = s.hidden // s.heads
    dtype = MODES[mode].compute_dtype
    torch.manual_seed(0)
    with torch.device(device):
        block = FluxTransformerBlock(dim=s.hidden, num_attention_heads=s.heads, attention_head_dim=head_dim)
    block = block.to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    image_tokens = s.image * s.image
    hidden = torch.randn(1, image_tokens, s.hidden, generator=g).to(device, dtype)
    text = torch.randn(1, s.text, s.hidden, generator=g).to(device, dtype)
    temb = torch.randn(1, s.hidden, generator=g).to(device, dtype)
    # Flux's position ids: text tokens at 0, image tokens at (0, row, column); rotary axes 16 / 56 / 56 of 128
    rows, cols = torch.meshgrid(torch.arange(s.image), torch.arange(s.image), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
    ids = torch.cat([torch.zeros(s.text, 3), image_ids.float()]).to(device)
    rotary = FluxPosEmbed(theta=10000, axes_dim=[head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16])(ids)

    def forward(b=block, h=hidden, t=text, e=temb, r=rotary):
        with torch.no_grad():
            return b(hidden_states=h, encoder_hidden_states=t, temb=e, image_rotary_emb=r)

    # one forward here checks the routing: a block whose attention never reaches visionattn would time the default
    patch_dispatch(block, mode)
    forward()
    routed = dispatch_counts(block)["routed"]
    unpatch_dispatch(block)
    if routed == 0:
        raise RuntimeError("the patched block ran no visionattn attention (a non-native diffusers attention "
                           "backend is active?)")

    def reference():
        block64 = copy.deepcopy(block).double()
        unpatch_dispatch(block64)
        return forward(block64, hidden.double(), text.double(), temb.double(), tuple(r.double() for r in rotary))

    info = dict(model=f"FluxTransformerBlock ({'tiny' if tiny else 'Flux'}: dim {s.hidden}, {s.heads} heads x "
                f"{head_dim})", img=f"{s.image}x{s.image} tokens", tokens=image_tokens + s.text, batch=1,
                params_m=sum(p.numel() for p in block.parameters()) / 1e6)
    variants = [("diffusers default (native SDPA)", lambda: unpatch_dispatch(block) or {}),
                (f"visionattn {mode}", lambda: {"patched": patch_dispatch(block, mode)["replaced"],
                                                "routed_per_forward": routed})]
    return info, forward, variants, reference


# ----------------------------------------------------------------------------- measurement
def measure_cell(info: dict, forward, variants, reference, device: torch.device, timing: dict, rounds: int,
                 cuda_graph: bool, free: bool) -> list[dict]:
    """The rows of one cell (:func:`bench_models.measure`), the library's default first: speed-up, memory ratio
    and output difference of each against the default, every output against the float64 forward."""
    variants = [(label, _switch(apply)) for label, apply in variants]
    if free:  # the default forward with SDPA answering V; first counts the SDPA calls one forward makes
        default, counter = variants[0][1], attention_free()
        with contextlib.suppress(Exception), default(), counter:  # a failure: the row's own forward records it
            forward()

        @contextlib.contextmanager
        def no_attention():
            with default() as facts, attention_free():
                yield {**facts, "sdpa_calls_per_forward": counter.calls}
        variants.append((FREE, no_attention))
    by, outs = measure(forward, variants, device, timing, rounds, cuda_graph)
    rows = [{**info, "attention": label, "baseline": i == 0, **by[label]} for i, (label, _) in enumerate(variants)]
    outs.pop(FREE, None)  # meaningless: only how many calls it answered
    if reference is not None and any(o is not None for o in outs.values()):
        try:
            ref = reference()
            ref = torch.cat([t.flatten() for t in ref]) if isinstance(ref, tuple) else ref
            for row in rows:
                if outs.get(row["attention"]) is not None:
                    row["rel_l2_vs_float64"] = rel_l2(outs[row["attention"]].double(), ref)
            del ref
        except Exception as err:  # noqa: BLE001 - e.g. out of memory in float64: the column stays empty
            print(f"  float64 reference of {info['case']}: {failure_text(err, device)}")
    base, base_out = rows[0], outs[variants[0][0]]
    for row in rows[1:]:
        if "error" in row or "error" in base or (row["attention"] == FREE and not row["sdpa_calls_per_forward"]):
            continue  # a default that never reached SDPA: its time bounds nothing
        row["speedup"] = base["median_ms"] / row["median_ms"]
        if row.get("peak_mib") is not None:
            row["mem_ratio"] = row["peak_mib"] / base["peak_mib"]
        if base_out is not None and outs.get(row["attention"]) is not None:
            row["rel_l2_vs_default"] = rel_l2(outs[row["attention"]].float(), base_out.float())
    bound = next((r.get("speedup") for r in rows if r["attention"] == FREE), None)
    for row in rows[1:]:
        if bound is not None and row["attention"] != FREE:
            row["bound"] = bound
    return rows


def judge(rows: list[dict], judged: bool) -> None:
    """Add ``target_speedup`` (None: no target) and ``target_met`` (None: not judged) to every visionattn row."""
    for row in rows:
        if not row.get("baseline") and row["attention"] != FREE:
            row["target_speedup"] = target = TARGETS.get(row["case"], {}).get(row["mode"])
            row["target_met"] = (row.get("speedup", 0.0) >= target) if judged and target is not None else None


# ----------------------------------------------------------------------------- report
def _met(row: dict) -> str:
    if row.get("target_speedup") is None:
        return "-"
    if row.get("target_met") is None:
        return "not judged"
    if not row["target_met"] and row.get("bound") is not None and row["bound"] < row["target_speedup"]:
        return "NO (target above the attention-free bound)"
    return "yes" if row["target_met"] else "NO"


def render_markdown(result: dict) -> str:
    """The report: environment, what each cell is, one table row per (case, mode, attention)."""
    env, settings = result["environment"], result["settings"]
    notes = [f"transformers {env.get('transformers')}, diffusers {env.get('diffusers')}", f"settings: {settings}",
             " ".join(__doc__.split("\n\n")[1].split()).replace("``", "`") + " (`--tiny`: the sizes in the table)",
             "ms = median of per-forward timings pooled over interleaved rounds (CUDA events on a GPU, wall clock on "
             "a CPU; eager: the Python launch path counts); speed-up = t(default) / t(visionattn), same dtype; peak = "
             "most allocated during one forward (MiB, weights included)."]
    if settings.get("cuda_graph"):
        notes.append("**CUDA-graph timing**: both rows' forwards are replayed from CUDA graphs (GPU time, no launch "
                     "overhead), not what an eager caller waits.")
    if not settings.get("judged"):
        notes.append("targets are not judged: tiny configs or no GPU.")
    if any(r["attention"] == FREE for r in result["rows"]):
        notes.append(f"**{FREE}**: the default forward with every SDPA call returning a copy of its value rows: its "
                     "speed-up is the most any attention kernel can give the cell (Amdahl's law), the bound the "
                     "`met` column compares a target with; its output is meaningless.")
    notes += [f"**{case} skipped**: {why}" for case, why in result["skipped"].items()]
    table = []
    for r in result["rows"]:
        case = [r["case"], r["model"], r["img"], r["tokens"], r["batch"], r["dtype"], r["attention"]]
        if "error" in r:
            table.append(case + [r["error"]] + [""] * 8)
            continue
        opt = lambda key, f="{}": "-" if r.get(key) is None else f.format(r[key])  # noqa: E731
        table.append(case + [r["median_ms"], f"{r['p10_ms']:.4g}-{r['p90_ms']:.4g}", opt("speedup", "{:.3f}x"),
                             opt("target_speedup", ">= {}x"), _met(r), opt("peak_mib"), opt("mem_ratio"),
                             opt("rel_l2_vs_default", "{:.2e}"), opt("rel_l2_vs_float64", "{:.2e}")])
    header = ["case", "model", "img", "tokens", "batch", "dtype", "attention", "ms", "p10-p90 ms", "speed-up",
              "target", "met", "peak MiB", "mem ratio", "rel L2 vs default", "rel L2 vs float64"]
    title = "transformers / diffusers integrations: visionattn vs each library's default attention"
    return "\n".join(md_header(title, env, *notes) + [markdown_table(table, header)])


def render_png(result: dict, path: str, outputs=None) -> bool:
    """Speed-up of every visionattn row with its target as a tick; False (no file) when nothing was timed."""
    rows = [r for r in result["rows"] if "speedup" in r and r["attention"] != FREE]
    if not rows:
        return False
    with figure(path, outputs, figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5), tool="bench_integrations") as (_, ax):
        xs = range(len(rows))
        ax.bar(xs, [r["speedup"] for r in rows], color=["tab:blue" if r["dtype"] == "float32" else "tab:orange"
                                                         for r in rows])
        for x, r in zip(xs, rows):
            for y, style in ((r.get("target_speedup"), dict(color="k", lw=1.5)),
                             (r.get("bound"), dict(color="tab:red", lw=1.2, ls="--"))):
                if y is not None:
                    ax.plot([x - 0.4, x + 0.4], [y] * 2, **style)
        ax.set_xticks(list(xs), [f"{r['case']}\n{r['mode']}" for r in rows])
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_ylabel("speed-up vs the library's default attention")
        ax.set_title("visionattn in transformers / diffusers (black: target, red dashed: attention-free bound), "
                     f"{result['environment'].get('device')}", fontsize=9)
    return True


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    """Run the cells ``argv`` asks for; write <out>.md / .json / .png; return the result dict."""
    args = parser.parse_args(argv)
    cases = comma_list(parser, "--cases", args.cases, CASES)
    modes = comma_list(parser, "--modes", args.modes, BENCH_MODES)
    device = check_device(parser, args.device)
    if args.cuda_graph and device.type != "cuda":
        parser.error(f"--cuda-graph needs a CUDA device, got --device {args.device}")
    outputs = prefix_outputs(parser, args.out, tool="bench_integrations")
    skipped = {c: why for c in cases if (why := missing_library(c)) is not None}
    for case, why in skipped.items():
        print(f"[bench_integrations] skipping {case}: {why}", flush=True)
    runnable = [c for c in cases if c not in skipped]
    env = _environment({LIBRARY[c] for c in runnable})
    timing = {"warmup": args.warmup, "rep_ms": args.rep_ms, "min_reps": 5 if device.type == "cuda" else 1,
              "max_reps": 100}
    judged = device.type == "cuda" and not args.tiny
    rows: list[dict] = []
    with tf32_flags() as precision:
        settings = {"device": str(device), **precision, **timing, "rounds": args.rounds, "batch": args.batch,
                    "tiny": args.tiny, "cuda_graph": args.cuda_graph, "judged": judged}
        print(f"[bench_integrations] {env['device']}; torch {env['torch']}, triton {env['triton']}, transformers "
              f"{env['transformers']}, diffusers {env['diffusers']}; TF32 off", flush=True)
        for case in runnable:
            for mode in modes:
                info = dict(case=case, library=LIBRARY[case], model=case, img="-", tokens="-", batch="-",
                            dtype=str(MODES[mode].compute_dtype).replace("torch.", ""), mode=mode)
                try:
                    cell = (flux_cell(mode, args.tiny, device) if case == "flux" else
                            transformers_cell(case, mode, args.batch, args.tiny, device))
                except Exception as err:  # noqa: BLE001 - one failing cell must not stop the others
                    cell_rows = [{**info, "attention": "-", "error": f"build failed: {failure_text(err, device)}"}]
                else:
                    cell_rows = measure_cell({**info, **cell[0]}, *cell[1:], device, timing, args.rounds,
                                             args.cuda_graph, args.attention_free)
                    del cell
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                judge(cell_rows, judged)
                for r in cell_rows:
                    what = f"  {r['case']:6s} {r['dtype']:8s} {r['attention']:30s}"
                    if "error" in r:
                        print(f"{what} {r['error']}", flush=True)
                        continue
                    extra = "" if "speedup" not in r else (f"  x{r['speedup']:.3f} (target {_met(r)})  rel L2 "
                                                           f"{r.get('rel_l2_vs_default', math.nan):.2e}")
                    print(f"{what} {r['median_ms']:9.3f} ms{extra}", flush=True)
                rows += cell_rows
    result = {"environment": env, "settings": settings, "skipped": skipped, "rows": rows}
    text = render_markdown(result)
    write_results(outputs, args.out, result, text)
    result["png"] = render_png(result, args.out + ".png", outputs)
    print(text)
    return result


if __name__ == "__main__":
    main()
