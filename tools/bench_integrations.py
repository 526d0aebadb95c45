"""Benchmark the transformers and diffusers integrations: each library's default attention vs visionattn.

Cells (random weights, eval mode, inference under ``torch.no_grad``), each timed in fp32 and bf16:

* **transformers** ``ViTModel`` (ViT-B/16: hidden 768, 12 layers, 12 heads, patch 16) and ``Dinov2Model``
  (DINOv2-B: hidden 768, 12 layers, 12 heads, patch 14), built from their configs with
  ``attn_implementation="sdpa"`` (transformers' default) and ``dtype=`` the mode's dtype, as users load
  them (``from_pretrained(..., dtype=torch.bfloat16)``); the same model then runs with the attention
  implementation switched to ``"visionattn_<mode>"`` (:func:`visionattn.integrations.transformers.register`;
  ``model.set_attn_implementation``), so both rows share the weights. DINOv2 runs at 518 px (37 x 37
  patches + CLS = 1370 tokens). ViT runs at 512 px, the multiple of 16 nearest 518: 32 x 32 patches + CLS =
  1025 tokens, the grid a 518 px input gives too (the stride-16 patch convolution drops its last 6 px).
* **diffusers** one Flux-sized ``FluxTransformerBlock`` (dim 3072, 24 heads of 128) on 4096 image + 512 text
  tokens, batch 1, Flux's rotary embedding of the text and image positions: diffusers' default attention
  (``dispatch_attention_fn`` on its native backend, which calls SDPA) against the same block with
  ``dispatch_attention_fn``'s SDPA calls routed to visionattn
  (:func:`visionattn.patching.diffusers_dispatch.patch_dispatch`: the hooks ``visionattn.patch_model`` installs
  on a Flux ``ModelMixin``; ``patch_model`` on a bare block patches nothing, since a block is no
  ``ModelMixin``). The row records how many attention calls one forward routed.

Columns: ms per forward (median of per-call CUDA-event timings pooled over interleaved rounds, default then
visionattn then default ...; eager, the Python launch path counts; ``--cuda-graph`` times graph replays on both
sides instead), speed-up against the default row of the same dtype, peak allocated memory during one forward,
and the output's relative L2 difference to the default row and to a float64 forward (the default attention on
float64 copies of the weights and inputs: both rows' distance from the exact result, so a difference between
the rows reads against how far each is from it; ``last_hidden_state``; the block's text and image outputs
together). Targets are printed beside each visionattn row: ViT-B/16 and DINOv2-B fp32 >= 1.4x and
bf16 >= 1.0x SDPA, the Flux block fp32 >= 2x and bf16 >= 1.0x diffusers' default; they are judged only on a
GPU at full size.

``--attention-free`` adds a row per cell: the default model with every SDPA call answering a copy of its value
rows (:func:`_harness.attention_free`), i.e. the forward without its attention. Its speed-up is the
most any attention kernel can give the cell (Amdahl's law), written as ``bound`` beside the visionattn row; a
target above it is marked so.

Process-wide settings made by this tool (restored at the end, written to the output): TF32 off for PyTorch
matmuls and cuDNN, so "fp32" means FP32 on both sides. transformers and diffusers are imported only when a
case of theirs runs; a case whose library is missing is skipped with a printed line.

    python tools/bench_integrations.py --out out/integrations_h100
    python tools/bench_integrations.py --cases flux --modes bf16 --cuda-graph --out out/flux_graph
    python tools/bench_integrations.py --attention-free --out out/integrations_bound  # with the Amdahl bound
    python tools/bench_integrations.py --tiny --device cpu --out /tmp/integrations     # seconds, smoke run
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import importlib.util
import math
import os
import sys
from typing import Callable, NamedTuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers

from _harness import (AttentionFree, OutputFiles, ToolParser, attention_free, check_device, check_output,  # noqa: E402
                      default_out, environment, failure_text, figure, markdown_table, nonnegative_int, output_files,
                      positive_float, positive_int, sample_ms, tf32_disabled)
from bench_models import graphed, peak_memory, round_timing, summarize_times  # noqa: E402

from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import MODES  # noqa: E402

CASES = ("vit", "dinov2", "flux")
BENCH_MODES = ("fp32", "fp32-ieee", "tf32", "fp16", "bf16")
LIBRARY = {"vit": "transformers", "dinov2": "transformers", "flux": "diffusers"}
#: minimum speed-up over the library's default attention, per case and mode (full size, on a GPU)
TARGETS = {"vit": {"fp32": 1.4, "bf16": 1.0}, "dinov2": {"fp32": 1.4, "bf16": 1.0}, "flux": {"fp32": 2.0, "bf16": 1.0}}
FREE = "attention-free (SDPA answers V)"  # the --attention-free row's label
_INSTALL = {"transformers": 'pip install "transformers>=5.0"', "diffusers": 'pip install "diffusers>=0.35.2"'}

parser = ToolParser(prog="bench_integrations.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
parser.add_argument("--out", default=default_out("integrations_bench"),
                    help="output prefix: writes <out>.md, <out>.json and <out>.png (default: %(default)s)")
parser.add_argument("--device", default="cuda", help="torch device; cpu for smoke runs, wall-clock timing "
                                                     "(default: %(default)s)")
parser.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated subset of {','.join(CASES)} (default: all)")
parser.add_argument("--modes", default="fp32,bf16",
                    help=f"comma-separated visionattn modes, a subset of {','.join(BENCH_MODES)}; the model runs in "
                         f"each mode's dtype on both sides (default: %(default)s)")
parser.add_argument("--batch", type=positive_int, default=8,
                    help="images per forward of the transformers models (the Flux block runs batch 1; "
                         "default: %(default)s)")
parser.add_argument("--tiny", action="store_true",
                    help="tiny configs (hidden 32-64, 2 layers, 32 px images, 80 block tokens) for a CPU smoke run")
parser.add_argument("--cuda-graph", action="store_true",
                    help="time replays of each row's forward captured in a CUDA graph (no Python / launch overhead "
                         "on either side: the GPU time)")
parser.add_argument("--rep-ms", type=positive_float, default=600.0,
                    help="timed milliseconds per row, split over the rounds (default: %(default)s)")
parser.add_argument("--warmup", type=nonnegative_int, default=3,
                    help="untimed forwards before each round's timing of a row (default: %(default)s)")
parser.add_argument("--attention-free", action="store_true",
                    help="add a row per cell with SDPA computing no attention: the Amdahl bound of the speed-up")
parser.add_argument("--rounds", type=positive_int, default=3,
                    help="interleaved timing rounds per cell (default row, visionattn row, repeated; "
                         "default: %(default)s)")


class Cell:
    """One (case, mode) comparison: a model on fixed inputs and the ways to run its attention.

    Attributes:
        info: what the rows of the cell share (case, model, image size, tokens, batch, dtype, mode, ...).
        forward: one inference forward; returns what is compared between the rows (a tensor or a tuple of them).
        variants: ``(label, configure)`` pairs, the library's default first; ``configure()`` switches the
            model to that attention and returns facts for the row.
        reference: the same forward in float64 with the library's default attention (a float64 copy of the
            weights and inputs), what every row's output is measured against; None: no such column.
        free: the :class:`_harness.AttentionFree` context of the attention-free row (None: no such row).
    """

    def __init__(self, info: dict, forward: Callable[[], torch.Tensor],
                 variants: list[tuple[str, Callable[[], dict]]], reference: Callable[[], torch.Tensor] | None = None):
        self.info, self.forward, self.variants, self.reference = info, forward, variants, reference
        self.free: AttentionFree | None = None

    def add_attention_free(self) -> None:
        """Append the attention-free row: the default configuration, its forward run inside an AttentionFree."""
        self.free = attention_free()
        self.variants.append((FREE, self.variants[0][1]))

    def forward_of(self, label: str) -> Callable[[], torch.Tensor]:
        """The forward a row runs (the attention-free row's inside its context)."""
        if label != FREE:
            return self.forward
        free, forward = self.free, self.forward

        def run():
            with free:
                return forward()
        return run


class Size(NamedTuple):
    """The shape of a case. transformers: hidden size, layers, heads, patch and image size in pixels. The Flux
    block: dimension, heads, image tokens per side (``image``) and text tokens (``text``)."""
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


def _subset(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if not items or bad:
        parser.error(f"{flag} {text!r}: expected a comma-separated subset of {','.join(allowed)}")
    return list(dict.fromkeys(items))


def _installed_version(name: str) -> str | None:
    """The installed version of distribution ``name`` from its metadata (nothing imported), None if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _environment(libraries: set[str]) -> dict:
    """:func:`_harness.environment` with the transformers and diffusers versions from package metadata.

    ``environment()`` imports diffusers to read its version; unless a case of diffusers runs
    (``libraries``), that import is made to fail at once, so the tool imports no library it does not use.
    """
    versions = {name: _installed_version(name) for name in ("transformers", "diffusers")}
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


# ----------------------------------------------------------------------------- cells
def transformers_cell(case: str, mode: str, batch: int, tiny: bool, device: torch.device) -> Cell:
    """``ViTModel`` / ``Dinov2Model`` in ``mode``'s dtype: ``attn_implementation`` "sdpa" vs "visionattn_<mode>"."""
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
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(batch, 3, s.image, s.image, generator=g).to(device, dtype)
    name = implementation_name(mode)

    def forward():
        with torch.no_grad():
            return model(pixel_values=pixels).last_hidden_state

    def use(implementation):
        model.set_attn_implementation(implementation)
        used = model.config._attn_implementation
        return {"attn_implementation": used, "attention_function": AttentionInterface()[used].__name__}

    def reference():
        model64 = copy.deepcopy(model).double()
        model64.set_attn_implementation("sdpa")
        with torch.no_grad():
            return model64(pixel_values=pixels.double()).last_hidden_state

    grid = s.image // s.patch
    label = "tiny" if tiny else {"vit": "ViT-B/16", "dinov2": "DINOv2-B/14"}[case]
    info = dict(case=case, library="transformers", model=f"{model_cls.__name__} ({label})", img=s.image,
                tokens=grid * grid + 1, batch=batch,
                params_m=sum(p.numel() for p in model.parameters()) / 1e6)
    return Cell(info, forward, [("sdpa", lambda: use("sdpa")), (name, lambda: use(name))], reference)


def flux_cell(mode: str, tiny: bool, device: torch.device) -> Cell:
    """One ``FluxTransformerBlock`` in ``mode``'s dtype: diffusers' default attention vs the block's
    ``dispatch_attention_fn`` SDPA calls routed to visionattn."""
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

    def forward():
        with torch.no_grad():
            return block(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=rotary)

    def default():
        unpatch_dispatch(block)
        return {}

    def patched():
        report = patch_dispatch(block, mode)
        return {"patched": report["replaced"]}

    # one forward here checks the routing: a block whose attention never reaches visionattn would time the default
    patched()
    forward()
    routed = dispatch_counts(block)["routed"]
    default()
    if routed == 0:
        raise RuntimeError("the patched block ran no visionattn attention (a non-native diffusers attention "
                           "backend is active?)")
    info = dict(case="flux", library="diffusers", model=f"FluxTransformerBlock ({'tiny' if tiny else 'Flux'}: dim "
                f"{s.hidden}, {s.heads} heads x {head_dim})", img=f"{s.image}x{s.image} tokens",
                tokens=image_tokens + s.text, batch=1, params_m=sum(p.numel() for p in block.parameters()) / 1e6)

    def patched_row():
        return {**patched(), "routed_per_forward": routed}

    def reference():
        block64 = copy.deepcopy(block).double()
        unpatch_dispatch(block64)
        with torch.no_grad():
            return block64(hidden_states=hidden.double(), encoder_hidden_states=text.double(), temb=temb.double(),
                           image_rotary_emb=tuple(r.double() for r in rotary))

    return Cell(info, forward, [("diffusers default (native SDPA)", default), (f"visionattn {mode}", patched_row)],
                reference)


# ----------------------------------------------------------------------------- measurement
def measure(cell: Cell, device: torch.device, timing: dict, rounds: int, cuda_graph: bool) -> list[dict]:
    """The rows of one cell: output, peak memory and interleaved timing of each variant; speed-up, memory ratio
    and output difference of each against the first (the library's default)."""
    rows, outs, samples = [], {}, {}
    for i, (label, configure) in enumerate(cell.variants):  # outputs, memory first (eager), before any CUDA graph
        row = {**cell.info, "attention": label, "baseline": i == 0, **configure()}
        forward = cell.forward_of(label)
        try:
            if label == FREE:  # its output is meaningless: only how many calls it answered
                cell.free.calls = 0
                forward()
                row["sdpa_calls_per_forward"] = cell.free.calls
            else:
                out = forward()
                outs[label] = torch.cat([t.flatten() for t in out]) if isinstance(out, tuple) else out
                del out
            row.update(peak_memory(forward, device.type))
        except Exception as err:  # noqa: BLE001 - OOM or a failing path: record it, keep the other cells going
            row["error"] = failure_text(err, device)
        rows.append(row)
        samples[label] = []
    per_round = round_timing(timing, rounds)
    for _ in range(rounds):  # A B A B ...: clock or thermal drift during the cell hits both rows alike
        for (label, configure), row in zip(cell.variants, rows):
            if "error" in row:
                continue
            configure()
            try:
                timed = graphed(cell.forward_of(label)) if cuda_graph else cell.forward_of(label)
                samples[label] += sample_ms(timed, device, **per_round)
                del timed  # frees the graph's memory pool before the next variant
            except Exception as err:  # noqa: BLE001
                row["error"] = failure_text(err, device)
    base, base_out = rows[0], outs.get(cell.variants[0][0])
    if cell.reference is not None and outs:
        try:
            ref = cell.reference()
            ref = torch.cat([t.flatten() for t in ref]) if isinstance(ref, tuple) else ref
            for (label, _), row in zip(cell.variants, rows):
                if label in outs:
                    row["rel_l2_vs_float64"] = rel_l2(outs[label].double(), ref)
            del ref
        except Exception as err:  # noqa: BLE001 - e.g. out of memory in float64: the column stays empty
            print(f"  float64 reference of {cell.info['case']}: {failure_text(err, device)}")
    for (label, _), row in zip(cell.variants, rows):
        if "error" in row:
            continue
        row.update(summarize_times(samples[label]), rounds=rounds)
        if row is base or "error" in base:
            continue
        if label == FREE and not row.get("sdpa_calls_per_forward"):
            continue  # the default never reached SDPA: its time bounds nothing
        row["speedup"] = base["median_ms"] / row["median_ms"]
        if row.get("peak_mib") is not None:
            row["mem_ratio"] = row["peak_mib"] / base["peak_mib"]
        if base_out is not None and label in outs:
            row["rel_l2_vs_default"] = rel_l2(outs[label].float(), base_out.float())
    bound = next((r.get("speedup") for r in rows if r["attention"] == FREE), None)
    if bound is not None:
        for row in rows[1:]:
            if row["attention"] != FREE:
                row["bound"] = bound
    return rows


def judge(rows: list[dict], judged: bool) -> None:
    """Add ``target_speedup`` (None: no target) and ``target_met`` (None: not judged) to every visionattn row."""
    for row in rows:
        if row.get("baseline") or row["attention"] == FREE:
            continue
        target = TARGETS.get(row["case"], {}).get(row["mode"])
        row["target_speedup"] = target
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
    lines = ["# transformers / diffusers integrations: visionattn vs each library's default attention", "",
             f"* device: {env.get('device')}; torch {env.get('torch')}, triton {env.get('triton')}, transformers "
             f"{env.get('transformers')}, diffusers {env.get('diffusers')}, CUDA {env.get('cuda')}, "
             f"Python {env.get('python')}",
             f"* command: `{env.get('command')}`",
             f"* settings: {settings}",
             "* random weights; full size (`--tiny`: the sizes in the table): ViT-B/16 at 512 px (the multiple of "
             "16 nearest 518: 32 x 32 patches + CLS = 1025 tokens, as a 518 px input gives), DINOv2-B at 518 px "
             "(37 x 37 + CLS = 1370 tokens), both "
             "transformers models built with `dtype=` the mode's dtype and timed with `attn_implementation` "
             "'sdpa' and 'visionattn_<mode>' on the same weights; the Flux block (dim 3072, 24 heads x 128) on "
             "4096 image + 512 text tokens, batch 1, diffusers' default attention vs its dispatch_attention_fn "
             "SDPA calls routed to visionattn (`patch_dispatch`, the hooks `patch_model` installs on a Flux model).",
             "* ms = median of per-forward timings pooled over interleaved rounds (CUDA events on a GPU, wall clock "
             "on a CPU; eager: the Python launch path counts); speed-up = t(default) / t(visionattn), same dtype; "
             "peak = most allocated during one forward (MiB, weights included); rel L2 = output vs the default row "
             "and vs float64 (the default attention on float64 copies of the weights and inputs; "
             "last_hidden_state; the block's text and image outputs).",
             ]
    if settings.get("cuda_graph"):
        lines.append("* **CUDA-graph timing**: both rows' forwards are replayed from CUDA graphs (GPU time, no "
                     "launch overhead), not what an eager caller waits.")
    if not settings.get("judged"):
        lines.append("* targets are not judged: tiny configs or no GPU.")
    if any(r["attention"] == FREE for r in result["rows"]):
        lines.append(f"* **{FREE}**: the default forward with every SDPA call returning a copy of its value rows "
                     "(no scores, no softmax): its speed-up is the most any attention kernel can give the cell "
                     "(Amdahl's law), the bound the `met` column compares a target with; its output is meaningless.")
    for case, why in result["skipped"].items():
        lines.append(f"* **{case} skipped**: {why}")
    header = ["case", "model", "img", "tokens", "batch", "dtype", "attention", "ms", "p10-p90 ms", "speed-up",
              "target", "met", "peak MiB", "mem ratio", "rel L2 vs default", "rel L2 vs float64"]
    table = []
    for r in result["rows"]:
        if "error" in r:
            table.append([r["case"], r["model"], r["img"], r["tokens"], r["batch"], r["dtype"], r["attention"],
                          r["error"]] + [""] * 8)
            continue
        spread = f"{r['p10_ms']:.4g}-{r['p90_ms']:.4g}"
        target = "-" if r.get("target_speedup") is None else f">= {r['target_speedup']}x"
        speedup = "-" if "speedup" not in r else f"{r['speedup']:.3f}x"
        opt = lambda key: "-" if r.get(key) is None else r[key]  # noqa: E731
        rel = "-" if r.get("rel_l2_vs_default") is None else f"{r['rel_l2_vs_default']:.2e}"
        rel64 = "-" if r.get("rel_l2_vs_float64") is None else f"{r['rel_l2_vs_float64']:.2e}"
        table.append([r["case"], r["model"], r["img"], r["tokens"], r["batch"], r["dtype"], r["attention"],
                      r["median_ms"], spread, speedup, target, _met(r), opt("peak_mib"), opt("mem_ratio"), rel,
                      rel64])
    lines += ["", markdown_table(table, header)]
    return "\n".join(lines)


def render_png(result: dict, path: str, outputs: OutputFiles | None = None) -> bool:
    """Speed-up of every visionattn row with its target as a tick; False (no file) when nothing was timed."""
    rows = [r for r in result["rows"] if "speedup" in r and r["attention"] != FREE]
    if not rows:
        return False
    with figure(path, outputs, figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5), tool="bench_integrations") as (fig, ax):
        xs = range(len(rows))
        ax.bar(xs, [r["speedup"] for r in rows], color=["tab:blue" if r["dtype"] == "float32" else "tab:orange"
                                                         for r in rows])
        for x, r in zip(xs, rows):
            if r.get("target_speedup") is not None:
                ax.plot([x - 0.4, x + 0.4], [r["target_speedup"]] * 2, color="k", lw=1.5)
            if r.get("bound") is not None:
                ax.plot([x - 0.4, x + 0.4], [r["bound"]] * 2, color="tab:red", lw=1.2, ls="--")
        ax.set_xticks(list(xs), [f"{r['case']}\n{r['mode']}" for r in rows])
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_ylabel("speed-up vs the library's default attention")
        ax.set_title("visionattn in transformers / diffusers (black: target, red dashed: attention-free bound), "
                     f"{result['environment'].get('device')}",
                     fontsize=9)
    return True


def _print_row(r: dict) -> None:
    if "error" in r:
        print(f"  {r['case']:6s} {r['dtype']:8s} {r['attention']:30s} {r['error']}", flush=True)
        return
    extra = ""
    if "speedup" in r:
        extra = f"  x{r['speedup']:.3f} (target {_met(r)})  rel L2 {r.get('rel_l2_vs_default', math.nan):.2e}"
    print(f"  {r['case']:6s} {r['dtype']:8s} {r['attention']:30s} {r['median_ms']:9.3f} ms{extra}", flush=True)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    """Run the cells ``argv`` asks for; write <out>.md / .json / .png; return the result dict."""
    args = parser.parse_args(argv)
    cases = _subset(args.cases, CASES, "--cases")
    modes = _subset(args.modes, BENCH_MODES, "--modes")
    device = check_device(parser, args.device)
    if args.cuda_graph and device.type != "cuda":
        parser.error(f"--cuda-graph needs a CUDA device, got --device {args.device}")
    out = check_output(parser, args.out)
    outputs = output_files(parser, [out + ".json", out + ".md", out + ".png"], tool="bench_integrations")

    skipped = {}
    for case in cases:
        why = missing_library(case)
        if why is not None:
            skipped[case] = why
            print(f"[bench_integrations] skipping {case}: {why}", flush=True)
    runnable = [c for c in cases if c not in skipped]
    env = _environment({LIBRARY[c] for c in runnable})
    timing = {"warmup": args.warmup, "rep_ms": args.rep_ms, "min_reps": 5 if device.type == "cuda" else 1,
              "max_reps": 100}
    judged = device.type == "cuda" and not args.tiny
    rows: list[dict] = []
    with tf32_disabled() as precision:
        settings = {"device": str(device), **precision, **timing, "rounds": args.rounds, "batch": args.batch,
                    "tiny": args.tiny, "cuda_graph": args.cuda_graph, "judged": judged}
        print(f"[bench_integrations] {env['device']}; torch {env['torch']}, triton {env['triton']}, transformers "
              f"{env['transformers']}, diffusers {env['diffusers']}; TF32 off", flush=True)
        for case in runnable:
            for mode in modes:
                base = dict(case=case, library=LIBRARY[case], model=case, img="-", tokens="-", batch="-",
                            dtype=str(MODES[mode].compute_dtype).replace("torch.", ""), mode=mode)
                try:
                    cell = (flux_cell(mode, args.tiny, device) if case == "flux" else
                            transformers_cell(case, mode, args.batch, args.tiny, device))
                except Exception as err:  # noqa: BLE001 - one failing cell must not stop the others
                    cell_rows = [{**base, "attention": "-", "error": f"build failed: {failure_text(err, device)}"}]
                else:
                    cell.info = {**base, **cell.info}
                    if args.attention_free:
                        cell.add_attention_free()
                    cell_rows = measure(cell, device, timing, args.rounds, args.cuda_graph)
                    del cell
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                judge(cell_rows, judged)
                for r in cell_rows:
                    _print_row(r)
                rows += cell_rows

    result = {"environment": env, "settings": settings, "skipped": skipped, "rows": rows}
    outputs.write_json(out + ".json", result)
    text = render_markdown(result)
    outputs.write_text(out + ".md", text)
    result["png"] = render_png(result, out + ".png", outputs)
    print(text)
    return result


if __name__ == "__main__":
    main()
