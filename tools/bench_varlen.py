"""Benchmark ragged batches: visionattn varlen vs SDPA padded + key mask, SDPA per sequence, nested tensors.

The ELSA supplement's Table 2 (Sec. E): a batch of sequences of different lengths (default the 8 lengths
785, 500, 708, 542, 1732, 262, 1039, 557 — 6125 tokens —, 16 heads, D = 64), self-attention, starting
from what a model holds: one [n_i, H, D] q / k / v tensor per sequence. Each way of attending them is
timed three times, eagerly (CUDA events around back-to-back calls, :func:`_harness.eager_ms`;
the Python launch path counts):

* **conversion**: from the per-sequence tensors to the method's input (packing with ``torch.cat`` and
  offsets, padding and a key mask, a jagged nested tensor; nothing for per-sequence calls);
* **kernel**: the attention call alone on converted inputs;
* **total**: conversion and attention together, one call after another, as a model runs them;
* **kernel graph**: the attention call alone replayed from a CUDA graph: its GPU time without the Python launch
  path, timed in windows alternating with the eager kernel column's (:func:`_harness.eager_graph_ms`,
  so both see the same GPU state; n/a, with the reason in the JSON's ``graph_error``, where the call cannot be
  captured; empty on the CPU).

Methods: ``visionattn-list`` (:func:`visionattn.varlen_attention` on the list of per-sequence tensors, read
where they lie: no conversion, the row-offset table it sends to the GPU is part of the call), ``visionattn``
(the same on packed tensors and int32 ``cu_seqlens``, maxima given), ``visionattn-host`` (the same with the
offsets on the CPU: the lengths reach the kernels without a synchronisation, so fp16 / bf16 run the
warp-specialized Gluon varlen kernel on Hopper, the other modes the tile table), ``visionattn-jagged`` (the same on
jagged nested tensors), ``sdpa-padded``
(``F.scaled_dot_product_attention`` on a [B, H, Lmax, D] padded batch with a boolean key mask),
``sdpa-per-seq`` (one SDPA call per sequence), ``nested`` (SDPA on jagged nested tensors). SDPA runs with
PyTorch's defaults: its own backend choice, FP32 matmuls without TF32 (this tool sets no global flags).
The two methods on nested tensors run after every other method of every mode (what ``torch.nested`` leaves in
the process cannot touch the other rows).
Peak memory: the most allocated during one total call beyond what was allocated before it. Mtokens/s:
total tokens per total latency. Accuracy: relative L2 error of each method's output against a float64
per-sequence oracle. Writes ``<out>.md`` and ``<out>.json``.

``--backward`` adds a forward + backward row per (mode, method), same run: from per-sequence leaves that
need grad, conversion, attention and the backward (``torch.autograd.grad`` of the packed [total, H, D]
output with a fixed N(0, 1) gradient, so each PyTorch method's unpacking is timed with it; visionattn runs
its varlen backward kernels). Kernel and conversion columns stay empty there; accuracy is the largest
relative L2 error of dQ, dK, dV against per-sequence float64 autograd.

``--naflex`` benchmarks a model instead: timm's NaFlexViT (random weights) on a padded batch of ``--batch``
images of mixed aspect ratios (``--naflex-sizes``), eager inference, the unpatched model (SDPA on timm's
padding mask) against the model patched in each mode (ragged attention over the valid tokens,
:mod:`visionattn.patching.naflex`): ms per batch, images/s, peak MB, relative L2 of the logits and of the
valid tokens' features against the unpatched model.

    python tools/bench_varlen.py --out out/varlen_h100
    python tools/bench_varlen.py --modes fp16,bf16 --lengths 256,1792,1024 --methods visionattn,sdpa-per-seq
    python tools/bench_varlen.py --backward --modes fp32,bf16 --out out/varlen_bwd_h100
    python tools/bench_varlen.py --naflex --modes fp32,bf16 --out out/naflex_h100
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, add_common, check_device, comma_ints, comma_list, comma_pairs,  # noqa: E402
                      default_out, eager_graph_timings, environment, graph_cells, markdown_table, peak_memory,
                      per_call_ms, positive_int, prefix_outputs, write_results)

import visionattn  # noqa: E402
from visionattn.metrics import rel_l2  # noqa: E402
from visionattn.modes import MODES  # noqa: E402
from visionattn.reference import oracle_attention  # noqa: E402

METHODS = ("visionattn-list", "visionattn", "visionattn-host", "visionattn-jagged", "sdpa-padded", "sdpa-per-seq",
           "nested")
NESTED_METHODS = ("visionattn-jagged", "nested")  # timed after the others (see bench)
BENCH_MODES = tuple(m for m, spec in MODES.items() if not spec.half_scores)  # the varlen kernels' modes
ISSUE_LENGTHS = "785,500,708,542,1732,262,1039,557"
# (height, width) in pixels, cycled over the NaFlexViT batch: 36 .. 576 patches of 16 x 16
NAFLEX_SIZES = "384x384,224x224,160x480,512x256,96x96,320x240,448x128,256x256"

parser = ToolParser(prog="bench_varlen.py", description=__doc__.split("\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
parser.add_argument("--lengths", default=ISSUE_LENGTHS,
                    help="comma-separated sequence lengths (>= 0; default: the supplement's batch %(default)s)")
parser.add_argument("--heads", type=positive_int, default=16, help="attention heads H (default: %(default)s)")
parser.add_argument("--head-dim", type=positive_int, default=64, help="head dim D (default: %(default)s)")
parser.add_argument("--modes", default="fp32,fp16",
                    help=f"comma-separated visionattn modes, a subset of {','.join(BENCH_MODES)}; the PyTorch "
                         f"methods run in each mode's dtype (default: %(default)s)")
parser.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
add_common(parser, calls=50, repeats=5, seed=0, device="cuda",
           out=(default_out("varlen_bench"), "output prefix: writes <out>.md and <out>.json (default: %(default)s)"))
parser.add_argument("--quiet", action="store_true", help="do not print the table")
parser.add_argument("--backward", action="store_true",
                    help="also time forward + backward of every method (gradient accuracy vs float64 autograd)")
parser.add_argument("--naflex", action="store_true",
                    help="benchmark timm's NaFlexViT on a padded mixed-aspect batch instead: unpatched vs patched "
                         "per mode (--lengths, --heads, --head-dim, --methods do not apply)")
parser.add_argument("--model", default="naflexvit_base_patch16_gap",
                    help="--naflex: the timm NaFlexViT model, random weights (default: %(default)s)")
parser.add_argument("--batch", type=positive_int, default=32, help="--naflex: images per batch (default: %(default)s)")
parser.add_argument("--naflex-sizes", default=NAFLEX_SIZES,
                    help="--naflex: comma-separated HxW image sizes in pixels, cycled over the batch "
                         "(default: %(default)s)")


def method_calls(method: str, seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], mode: str):
    """``(convert, attend, to_packed)`` of one method: ``convert()`` builds its inputs from the per-sequence
    [n_i, H, D] tensors, ``attend(inputs)`` runs attention, ``to_packed(out)`` gives [total, H, D] (for the
    accuracy check; not timed)."""
    device = seqs[0][0].device
    lens = [q.shape[0] for q, _, _ in seqs]
    lmax = max(lens)
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    cu_host = torch.tensor(offsets, dtype=torch.int32)

    def packed():
        cat = [torch.cat([s[i] for s in seqs]) for i in range(3)]
        return (*cat, cu_host.to(device, non_blocking=True))

    def jagged():
        # leaves that need grad (--backward): as_nested_tensor keeps the autograd history, nested_tensor copies
        make = torch.nested.as_nested_tensor if seqs[0][0].requires_grad else torch.nested.nested_tensor
        return [make([s[i] for s in seqs], layout=torch.jagged) for i in range(3)]

    if method == "visionattn":
        def attend(x):
            q, k, v, cu = x
            return visionattn.varlen_attention(q, k, v, cu, cu, lmax, lmax, mode=mode)
        return packed, attend, lambda out: out
    if method == "visionattn-host":
        def attend(x):
            q, k, v, _ = x
            return visionattn.varlen_attention(q, k, v, cu_host, cu_host, lmax, lmax, mode=mode)
        return packed, attend, lambda out: out
    if method == "visionattn-list":
        return (lambda: seqs), (lambda x: visionattn.varlen_attention(*map(list, zip(*x)), mode=mode)), torch.cat
    if method == "visionattn-jagged":
        return jagged, lambda x: visionattn.varlen_attention(*x, mode=mode), lambda out: out.values()
    if method == "nested":
        def attend(x):
            q, k, v = (t.transpose(1, 2) for t in x)
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return jagged, attend, lambda out: out.values()
    if method == "sdpa-padded":
        keep = torch.arange(lmax, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        mask = keep[:, None, None, :]  # [B, 1, 1, Lmax]: True = attend

        def convert():
            pad = [torch.nn.utils.rnn.pad_sequence([s[i] for s in seqs], batch_first=True).transpose(1, 2)
                   for i in range(3)]
            return (*pad, mask)

        def attend(x):
            q, k, v, m = x
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return convert, attend, lambda out: torch.cat([out[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])
    if method == "sdpa-per-seq":
        def attend(x):
            # [1, H, n, D] views: with 3-D [H, n, D] inputs SDPA takes its math path, not a fused kernel
            return [F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                   v.transpose(0, 1)[None]) for q, k, v in x]
        return (lambda: seqs), attend, lambda out: torch.cat([o[0].transpose(0, 1) for o in out])
    raise ValueError(f"method={method!r}; expected one of {METHODS}")


def bench(lens: list[int], heads: int, head_dim: int, modes: list[str], methods: list[str], device: torch.device,
          calls: int, repeats: int, seed: int, quiet: bool = False, backward: bool = False) -> list[dict]:
    """One row per (mode, method): conversion / kernel / total ms, peak MB, Mtokens/s, rel L2 vs the oracle;
    with ``backward`` also a forward + backward row per (mode, method)."""
    g = torch.Generator().manual_seed(seed)
    base = [tuple(torch.randn(n, heads, head_dim, generator=g).to(device) for _ in range(3)) for n in lens]
    oracle = torch.cat([oracle_attention(*(t.transpose(0, 1)[None] for t in s))[0].transpose(0, 1) if n else
                        s[0].double() for s, n in zip(base, lens)])
    timer = per_call_ms(device, calls, repeats, warmup=3)
    total_tokens = sum(lens)
    rows = []
    # the nested-tensor methods run after every other method of every mode, so what torch.nested leaves in the
    # process cannot touch the other rows
    first = [m for m in methods if m not in NESTED_METHODS]
    for mode, group in [(m, first) for m in modes] + [(m, [x for x in methods if x in NESTED_METHODS]) for m in modes]:
        if not group:
            continue
        dtype = MODES[mode].compute_dtype
        seqs = [tuple(t.to(dtype) for t in s) for s in base]
        for method in group:
            convert, attend, to_packed = method_calls(method, seqs, mode)
            x = convert()
            out = to_packed(attend(x))
            err = rel_l2(out.double(), oracle)
            conv_ms = timer(convert)
            # graph n/a with the reason where a method's calls cannot be captured (host copies, nested tensors)
            kernel = functools.partial(attend, x)
            kern_ms, graph_ms, graph_error = eager_graph_timings(lambda fn=kernel: fn, timer, device, calls, repeats)
            total_ms = timer(lambda: attend(convert()))
            del x, kernel
            peak = peak_memory(lambda: attend(convert()), device)["peak_extra_mib"]
            rows.append(dict(mode=mode, method=method, **{"pass": "forward"}, total_ms=total_ms, kernel_ms=kern_ms,
                             kernel_graph_ms=graph_ms, graph_error=graph_error, conversion_ms=conv_ms, peak_mb=peak,
                             mtokens_per_s=total_tokens / total_ms / 1e3,
                             rel_l2=err))
            if not quiet:
                print(f"{mode:9s} {method:18s} total {total_ms:.4f} ms  kernel {kern_ms:.4f} ms  "
                      f"conversion {conv_ms:.4f} ms  rel L2 {err:.2e}", flush=True)
        if backward:
            rows += _backward_rows(base, dtype, mode, group, timer, device, seed, quiet)
    rows.sort(key=lambda r: (modes.index(r["mode"]), r["pass"] != "forward", methods.index(r["method"])))
    return rows


def _backward_rows(base, dtype, mode: str, methods: list[str], timer, device, seed: int, quiet: bool) -> list[dict]:
    """Forward + backward rows of one mode: total ms (conversion, attention, backward from the packed output
    gradient), peak MB, Mtokens/s and the largest rel L2 of dQ, dK, dV against float64 autograd."""
    g = torch.Generator().manual_seed(seed + 1)
    total = sum(s[0].shape[0] for s in base)
    grad = torch.randn(total, *base[0][0].shape[1:], generator=g).to(device)
    offsets = [0]
    for s in base:
        offsets.append(offsets[-1] + s[0].shape[0])
    gold = []
    for s, a, b in zip(base, offsets, offsets[1:]):  # float64 autograd per sequence; no rows: zero gradients
        leaves = [t.double().requires_grad_() for t in s]
        if b > a:
            out = oracle_attention(*(t.transpose(0, 1)[None] for t in leaves))[0].transpose(0, 1)
            gold.append(torch.autograd.grad(out, leaves, grad[a:b].double()))
        else:
            gold.append(tuple(torch.zeros_like(t) for t in leaves))
    gold_packed = [torch.cat([gs[i] for gs in gold]) for i in range(3)]
    # fresh leaves: .to() of a tensor already in dtype returns the tensor itself, and base feeds later modes' rows
    seqs = [tuple(t.to(dtype, copy=True).requires_grad_() for t in s) for s in base]
    leaves = [t for s in seqs for t in s]
    grad = grad.to(dtype)
    rows = []
    for method in methods:
        convert, attend, to_packed = method_calls(method, seqs, mode)

        def step():
            return torch.autograd.grad(to_packed(attend(convert())), leaves, grad, allow_unused=True)

        got = [g if g is not None else torch.zeros_like(t) for g, t in zip(step(), leaves)]
        err = max(rel_l2(torch.cat(got[i::3]).double(), gold_packed[i]) for i in range(3))
        total_ms = timer(step)
        peak = peak_memory(step, device)["peak_extra_mib"]
        rows.append(dict(mode=mode, method=method, **{"pass": "forward+backward"}, total_ms=total_ms,
                         kernel_ms=None, conversion_ms=None, peak_mb=peak, mtokens_per_s=total / total_ms / 1e3,
                         rel_l2=err))
        if not quiet:
            print(f"{mode:9s} {method:18s} forward+backward {total_ms:.4f} ms  grad rel L2 {err:.2e}", flush=True)
    return rows


def render(rows: list[dict], env: dict, lens: list[int], heads: int, head_dim: int) -> str:
    """The markdown report: one table row per (mode, method), speed-up against the mode's fastest PyTorch way."""
    best: dict[tuple[str, str], float] = {}
    for r in rows:
        if not r["method"].startswith("visionattn"):
            key = (r["mode"], r["pass"])
            best[key] = min(best.get(key, float("inf")), r["total_ms"])
    table = []
    dash = lambda x: "-" if x is None else x  # noqa: E731
    for r in rows:
        key = (r["mode"], r["pass"])
        speedup = f"{best[key] / r['total_ms']:.2f}x" if key in best else "-"
        graph = graph_cells(None, r.get("kernel_graph_ms"), r.get("graph_error"))[0]
        table.append([r["mode"], r["method"], r["pass"], r["total_ms"], dash(r["kernel_ms"]), graph,
                      dash(r["conversion_ms"]), dash(r["peak_mb"]), r["mtokens_per_s"], speedup, f"{r['rel_l2']:.2e}"])
    header = ["mode", "method", "pass", "total ms", "kernel ms", "kernel graph ms", "conversion ms", "peak MB",
              "Mtokens/s", "vs best PyTorch", "rel L2 vs float64 (backward: worst of dQ, dK, dV)"]
    lines = [f"# Ragged batch: {len(lens)} sequences (lengths {','.join(map(str, lens))}; {sum(lens)} tokens), "
             f"H={heads}, D={head_dim}", "",
             "Eager timing (CUDA events around back-to-back calls); conversion = from per-sequence tensors to the "
             "method's input; total = conversion + attention (forward+backward: also the backward from the packed "
             "output gradient); kernel graph = the attention call replayed from a CUDA graph (GPU time without the "
             "launch path; n/a where it cannot be captured).", "", markdown_table(table, header),
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
    return "\n".join(lines)


def bench_naflex(model_name: str, sizes: list[tuple[int, int]], batch: int, modes: list[str], device: torch.device,
                 calls: int, repeats: int, seed: int, quiet: bool = False) -> tuple[list[dict], dict]:
    """NaFlexViT inference on a padded batch: the unpatched model, then the model patched in each mode. Rows:
    ms per batch, images/s, peak MB, rel L2 of the logits and of the valid tokens' features vs unpatched;
    and a description of the batch (patches per image, padded length, valid fraction)."""
    import timm

    from visionattn.patching.naflex import naflex_batch

    g = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, *sizes[i % len(sizes)], generator=g) for i in range(batch)]
    inputs = {k: t.to(device) for k, t in naflex_batch(images).items()}
    torch.manual_seed(seed)
    model = timm.create_model(model_name, pretrained=False).to(device).eval()
    pv = inputs["patch_valid"]
    valid = torch.cat([pv.new_ones(pv.shape[0], model.num_prefix_tokens), pv], 1)
    timer = per_call_ms(device, calls, repeats, warmup=3)

    def features():
        return model.forward_features(inputs["patches"], inputs["patch_coord"], pv)["patches"]

    rows, ref = [], None
    with torch.no_grad():
        for mode in [None] + modes:
            if mode is not None:
                visionattn.patch_model(model, mode)
            logits, feats = model(inputs), features()
            if ref is None:
                ref = (logits, feats)
            ms = timer(lambda: model(inputs))
            peak = peak_memory(lambda: model(inputs), device)["peak_extra_mib"]
            rows.append(dict(mode=mode or "-", method="timm-sdpa" if mode is None else "visionattn-varlen",
                             total_ms=ms, images_per_s=batch / ms * 1e3, peak_mb=peak,
                             logits_rel_l2=rel_l2(logits, ref[0]), tokens_rel_l2=rel_l2(feats[valid], ref[1][valid])))
            if not quiet:
                print(f"{rows[-1]['method']:18s} {rows[-1]['mode']:9s} {ms:.3f} ms / batch  logits rel L2 "
                      f"{rows[-1]['logits_rel_l2']:.2e}", flush=True)
    counts = pv.sum(1).tolist()
    info = dict(model=model_name, batch=batch, patches_per_image=counts, padded_length=int(valid.shape[1]),
                valid_fraction=float(valid.float().mean()), sizes=[f"{h}x{w}" for h, w in sizes])
    return rows, info


def render_naflex(rows: list[dict], info: dict, env: dict) -> str:
    """The --naflex markdown report: one row per (unpatched | mode), speed-up against the unpatched model."""
    base = rows[0]["total_ms"]
    table = [[r["method"], r["mode"], r["total_ms"], r["images_per_s"], "-" if r["peak_mb"] is None else r["peak_mb"],
              f"{base / r['total_ms']:.2f}x", f"{r['logits_rel_l2']:.2e}", f"{r['tokens_rel_l2']:.2e}"] for r in rows]
    header = ["method", "mode", "ms / batch", "images/s", "peak MB", "vs unpatched", "logits rel L2",
              "valid tokens rel L2"]
    lines = [f"# NaFlexViT padded batch: {info['model']}, {info['batch']} images ({', '.join(info['sizes'])} "
             f"cycled), padded to {info['padded_length']} tokens, {100 * info['valid_fraction']:.1f}% valid", "",
             "Eager inference (CUDA events around back-to-back calls), random weights; rel L2 against the "
             "unpatched model (timm's SDPA on its padding mask).", "", markdown_table(table, header),
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parser.parse_args(argv)
    lens = comma_ints(parser, "--lengths", args.lengths, 0)
    if max(lens) == 0:
        parser.error(f"--lengths {args.lengths!r}: expected integers >= 0, at least one > 0")
    modes = comma_list(parser, "--modes", args.modes, BENCH_MODES)
    methods = comma_list(parser, "--methods", args.methods, METHODS)
    sizes = comma_pairs(parser, "--naflex-sizes", args.naflex_sizes)
    device = check_device(parser, args.device)
    outputs = prefix_outputs(parser, args.out, (".md", ".json"), tool="bench_varlen")
    env = environment({"tf32_matmul": torch.backends.cuda.matmul.allow_tf32})
    if not args.quiet:
        print(", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    if args.naflex:
        rows, info = bench_naflex(args.model, sizes, args.batch, modes, device, args.calls, args.repeats, args.seed,
                                  args.quiet)
        result = dict(naflex=info, rows=rows, environment=env)
        text = render_naflex(rows, info, env)
    else:
        rows = bench(lens, args.heads, args.head_dim, modes, methods, device, args.calls, args.repeats, args.seed,
                     args.quiet, args.backward)
        result = dict(lengths=lens, heads=args.heads, head_dim=args.head_dim, backward=args.backward, rows=rows,
                      environment=env)
        text = render(rows, env, lens, args.heads, args.head_dim)
    write_results(outputs, args.out, result, text)
    if not args.quiet:
        print(text)
    return result


if __name__ == "__main__":
    main()
