"""Compile every shipped kernel config for Hopper on this machine (no GPU): shared memory, registers, occupancy.

Every config of the dense ELSA table, the Gluon fp32-ieee and fp16 / bf16 kernels (and the latter's fp32 build),
PASA, the window kernels at Swin / Swin-v2 window sizes and the backward kernels (dense, Gluon fp32-ieee and fp16 /
bf16 with the latter's tf32 and fp32 builds, window fused / split, ragged) is compiled for sm_90
(:func:`visionattn.kernels.introspect.compile_for_arch`): shared memory against the 232,448-byte limit (over it the
launchers retry smaller configs: a slow first call), registers and spill bytes, programs per SM, wgmma use and the
static SASS instruction count. The figures match the GPU's only for the same Triton version:

    pip install --target /tmp/tri36 triton==3.6.0
    PYTHONPATH=/tmp/tri36:$PWD python tools/check_kernels_offline.py --out out/kernels_sm90_offline

Writes ``OUT.md`` and ``OUT.json``.
"""
from __future__ import annotations

import os
import sys
import time

import triton  # noqa: E402
from tqdm import tqdm  # noqa: E402

from visionattn.kernels import (elsa_bwd, elsa_fwd, fp32_gluon, half_gluon, half_gluon_bwd, ieee_gluon,  # noqa: E402
                                ieee_gluon_bwd, pasa_fwd, varlen_bwd, window_bwd, window_fwd)
from visionattn.kernels._launch import heads_inner_layout, pad_pow2  # noqa: E402
from visionattn.kernels.introspect import HOPPER_SHARED_LIMIT, compile_for_arch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, default_out, environment, markdown_table, prefix_outputs, write_results)  # noqa: E402

KERNELS = ("elsa", "ieee-gluon", "half-gluon", "pasa", "window", "backward", "ieee-gluon-bwd", "varlen-bwd",
           "half-gluon-bwd")
_TL = {"half": "*fp16", "f16x3": "*fp32", "f16x1": "*fp32", "tf32": "*fp32", "tf32x3": "*fp32", "ieee": "*fp32"}


def build_parser() -> ToolParser:
    p = ToolParser(prog="check_kernels_offline.py", description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: " + ", ".join(KERNELS))
    p.add_argument("--quick", action="store_true", help="head dims 64 and 128 only, no bias/mask variants")
    p.add_argument("--out", default=default_out("kernels_sm90_offline"),
                   help="output prefix: writes OUT.md and OUT.json (default: %(default)s)")
    return p


def _elsa_jobs(quick: bool):
    for (kind, d, short), cfg in sorted(elsa_fwd._CONFIGS.items()):
        if quick and d not in (64, 128):
            continue
        ptr = _TL[kind]
        pointers = {n: ptr for n in ("Q", "K", "V", "Bias", "Out")}
        pointers.update(Lse="*fp32", WsM="*fp32", WsS="*fp32", WsW="*fp32", Mask="*i1")
        for extras in ((False,) if quick else (False, True)):
            const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=d, BLOCK_DV=d,
                         PRECISION=kind, IS_CAUSAL=False, HAS_BIAS=extras,
                         HAS_MASK=extras, SPLIT=False, EVEN_D=True, EVEN_DV=True, DOT_UPCAST=False,
                         LAZY_V=kind == "f16x3" and not short, WRITE_LSE=False)
            yield ({"kernel": "elsa", "variant": f"{kind} D={d} {'short' if short else 'long'}"
                    + (" +bias+mask" if extras else ""), "config": list(vars(cfg).values())},
                   dict(kernel=elsa_fwd._elsa_fwd_kernel, pointer_types=pointers, constexprs=const,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                        unit_ints=("sqd", "skd", "svd", "sod", "sbn", "smn"), float_args=("qk_scale",)))


def _pasa_jobs(quick: bool):
    for d in ((64, 128) if quick else (16, 32, 64, 128, 256)):
        cfg = pasa_fwd._get_config(d, False)
        pointers = {n: "*fp16" for n in ("Q", "K", "V", "O", "BIAS")}
        pointers.update(MASK="*u8", MU="*fp32", C="*fp32", W="*fp16", W_INV="*fp32")
        for recover, extras in ((True, False),) if quick else ((True, False), (False, False), (True, True)):
            const = dict(RECOVER=recover, HAS_BIAS=extras, HAS_MASK=extras, IS_CAUSAL=False,
                         BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg.get("BLOCK_N", pasa_fwd.BLOCK_N), BLOCK_D=d, BLOCK_DV=d,
                         EVEN_D=True, EVEN_DV=True)
            yield ({"kernel": "pasa", "variant": f"D={d}" + ("" if recover else " no-shift")
                    + (" +bias+mask" if extras else ""), "config": list(cfg.values())},
                   dict(kernel=pasa_fwd._pasa_fwd_kernel, pointer_types=pointers, constexprs=const,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                        unit_ints=("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_bn", "stride_mn"),
                        float_args=("post_scale", "inv_a_full", "inv_a_tail")))


def _ieee_gluon_jobs(quick: bool):
    if ieee_gluon._IMPORT_ERROR is not None:
        return
    for d in ((64, 128) if quick else ieee_gluon.HEAD_DIMS):
        for n_k in ((4096,) if d > 64 else (197, 4096)):
            cfg = ieee_gluon.get_config(n_k, d)
            yield ({"kernel": "ieee-gluon", "variant": f"D={d} Nk={n_k}",
                    "config": [cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["STAGES"]]},
                   dict(kernel=ieee_gluon._ieee_fwd_kernel,
                        pointer_types={n: "*fp32" for n in ("Q", "K", "V", "O", "LSE")},
                        constexprs=ieee_gluon.kernel_constexprs(cfg, d), num_warps=cfg["num_warps"], num_stages=1,
                        float_args=("qk_scale",), unit_ints=("GROUP",)))  # equal heads (GQA: GROUP > 1)


def _ieee_gluon_bwd_jobs(quick: bool):
    if ieee_gluon_bwd._IMPORT_ERROR is not None:
        return
    pointers = {n: "*fp32" for n in ("Q", "K", "V", "DO", "Delta", "LseRow", "DK", "DV", "DQ")}
    pointers["Sem"] = "*i32"
    for d in ((64,) if quick else ieee_gluon_bwd.HEAD_DIMS):
        cfg = ieee_gluon_bwd.get_config(d)
        yield ({"kernel": "ieee-gluon-bwd-dkdv+dq", "variant": f"D={d}",
                "config": [cfg["BLOCK_HELD"], cfg["BLOCK_STREAMED"], cfg["num_warps"], cfg["STAGES"]]},
               dict(kernel=ieee_gluon_bwd._ieee_dkdv_kernel, pointer_types=pointers,
                    constexprs=ieee_gluon_bwd.kernel_constexprs(cfg, d), num_warps=cfg["num_warps"], num_stages=1,
                    float_args=("scale",)))


def _half_gluon_jobs(quick: bool):
    import torch

    if half_gluon._IMPORT_ERROR is not None:
        return
    # 4096 keys: two consumer warpgroups per CTA; 1025 keys at D = 64: one per CTA, two CTAs per SM, a cut last tile;
    # 197 rows and keys at D = 64: four per CTA; ViT-B/16 at 1024 px (96 heads of 4097 rows) on 132 SMs: three; 300
    # keys at D = 128: 64-key tiles, four stages and two Q buffers; 100 keys at D = 128: one 128-key tile, two stages;
    # Flux at 512 px (24 heads of 1536 tokens) at D = 128 on 132 SMs: key pieces for the last round; 512 heads of 300
    # rows at D = 128 on 132 SMs: three consumers over 64-key tiles
    for d, n_k, n_q, heads in ((64, 4096, None, None), (64, 1025, None, None), (64, 197, 197, None),
                               (64, 4097, 4097, 96), (128, 4096, None, None), (128, 300, None, None),
                               (128, 100, None, None), (128, 1536, 1536, 24), (128, 300, 300, 512)):
        for dtype in ((torch.float16,) if quick else (torch.float16, torch.bfloat16)):
            cfg = half_gluon.get_config(n_k, d, n_q=n_q, heads=heads, sms=132)
            # as a launch builds it: O by TMA stores where the plan's own output allows (two Q buffers)
            tma_out = half_gluon.tma_output(cfg, dtype, dtype, heads_inner_layout(1, heads or 8, n_q or n_k, d)[1][:3])
            tname = str(dtype).split(".")[-1]
            shape = (" ping-pong" if cfg["PINGPONG"] else " one consumer" if cfg["consumers"] == 1
                     else {3: " three consumers", 4: " four consumers"}.get(cfg["consumers"], ""))
            shape += " two Q buffers" if d > 64 and cfg["q_buffers"] == 2 else ""
            shape += " one key tile" if d > 64 and cfg["one_tile"] else ""
            shape += " key pieces" if cfg["pieces"] > 1 else ""
            yield ({"kernel": "half-gluon", "variant": f"D={d} {tname}{shape}",
                    "config": [cfg["BLOCK_M"], cfg["BLOCK_N"], 4 * cfg["consumers"] + 4, cfg["STAGES"]]},
                   dict(kernel=half_gluon._half_fwd_kernel,
                        pointer_types=dict(half_gluon.descriptor_types(cfg, d, dtype),
                                           O="*fp16" if dtype == torch.float16 else "*bf16", LSE="*fp32",
                                           Scales="*fp32"),
                        constexprs=half_gluon.kernel_constexprs(cfg, d, tma_out=tma_out), num_warps=4,
                        num_stages=1, float_args=("qk_scale",), maxnreg=cfg["maxnreg"], unit_ints=("GROUP",)))
    # mode fp32's split build (fp32_gluon): hi / lo FP16 operands, 64-key tiles at D=64 (1066 keys: a last tile in two
    # parts), 32-key tiles at D=128 (1066 keys: a cut last tile)
    for d in ((64,) if quick else fp32_gluon.HEAD_DIMS):
        for n_k in ((4096,) if quick else (4096, 1066)):
            cfg = fp32_gluon.get_config(n_k, d)
            yield ({"kernel": "half-gluon", "variant": f"D={d} fp32 split{' cut tail' if n_k <= 2048 else ''}",
                    "config": [cfg["BLOCK_M"], cfg["BLOCK_N"], 4 * cfg["consumers"] + 4, cfg["STAGES"]]},
                   dict(kernel=half_gluon._half_fwd_kernel,
                        pointer_types=dict(half_gluon.descriptor_types(cfg, d, torch.float16), O="*fp32", LSE="*fp32",
                                           Scales="*fp32"),
                        constexprs=half_gluon.kernel_constexprs(cfg, d), num_warps=4, num_stages=1,
                        float_args=("qk_scale",), maxnreg=cfg["maxnreg"], unit_ints=("GROUP",)))


def _half_bwd_job(cfg: dict, d: int, dtype, n_k: int, variant: str, grads: str, pointers: dict, **builds):
    # (meta, compile job) of one build of the Gluon backward: the kernel's descriptor, row-data and counter arguments,
    # dK / dV of type `grads`, the constexprs of kernel_constexprs(cfg, d, n_k, **builds)
    return ({"kernel": "half-gluon-bwd", "variant": variant, "config": [cfg["BLOCK_M"], cfg["BLOCK_N"], 12,
                                                                         cfg["STAGES"]]},
            dict(kernel=half_gluon_bwd._half_bwd_kernel,
                 pointer_types=dict(half_gluon_bwd.descriptor_types(cfg, d, dtype), LseRow="*fp32", Delta="*fp32",
                                    DK=grads, DV=grads, Sem="*i32", **pointers),
                 constexprs=half_gluon_bwd.kernel_constexprs(cfg, d, n_k, **builds), num_warps=4, num_stages=1,
                 float_args=("qk_scale", "scale"), maxnreg=cfg["maxnreg"]))


def _half_gluon_bwd_jobs(quick: bool):
    import torch

    if half_gluon_bwd._IMPORT_ERROR is not None:
        return
    # full key tiles (EVEN_N) and a cut last one (keys masked)
    for d in ((64,) if quick else half_gluon_bwd.HEAD_DIMS):
        for dtype in ((torch.float16,) if quick else (torch.float16, torch.bfloat16)):
            for n_k in ((1024,) if quick else (1024, 1000)):
                cfg = half_gluon_bwd.get_config(d)
                tname = str(dtype).split(".")[-1]
                t = "*fp16" if dtype == torch.float16 else "*bf16"
                masked = "" if n_k % cfg["BLOCK_N"] == 0 else " masked"
                # grouped-query attention (bf16, full key tiles): whole groups, and groups cut into parts (FP32
                # dK / dV partials)
                gqa = ((False, False),) if quick or dtype != torch.bfloat16 or masked else (
                    (False, False), (True, False), (True, True))
                for grouped, parts in gqa:
                    label = " grouped-query" * grouped + " (parts)" * parts
                    yield _half_bwd_job(cfg, d, dtype, n_k, f"D={d} {tname}{masked}{label}",
                                        "*fp32" if parts else t, {}, gqa=grouped, kv_partials=parts)
    # modes tf32 (the HEAD_SCALES build) and fp32 (the split build; at head dim 128 its consumers split the head
    # dim): FP16 operand copies, FP32 dK / dV by plain stores, full and cut key tiles
    for d in ((64,) if quick else half_gluon_bwd.HEAD_DIMS):
        for mode, split in (("tf32", False), ("fp32", True)):
            cfg = half_gluon_bwd.fp32_config(d) if split else half_gluon_bwd.tf32_config(d)
            for n_k in ((1024,) if quick else (1024, 1000)):
                masked = "" if n_k % cfg["BLOCK_N"] == 0 else " masked"
                yield _half_bwd_job(cfg, d, torch.float16, n_k,
                                    f"D={d} {mode}{' dsplit' * bool(cfg.get('dsplit'))}{masked}", "*fp32",
                                    {"Scales": "*fp32"}, head_scales=True, split=split)


def _window_jobs(quick: bool):
    import torch

    for n in ((49, 144) if quick else (49, 64, 144, 256, 576)):
        for mode, (dtype, *_) in window_fwd._MODE_TABLE.items():
            cfg = window_fwd.get_config(64 * 64, 4, n, 32, 64, torch.device("cpu"), mode=mode)
            ptr = "*fp16" if dtype != torch.float32 else "*fp32"
            pointers = {n_: ptr for n_ in ("Q", "K", "V", "O")}
            pointers.update(BIAS="*fp32", MASK="*fp32", LS="*fp32")
            const = dict(window_fwd.mode_constexprs(mode, None, True, True, False),
                         BLOCK_N=pad_pow2(n), BLOCK_D=32, BLOCK_DV=32, SPILL=False)
            if cfg["kernel"] == "small":
                kernel, const["IMGS"] = window_fwd._window_small_kernel, cfg["imgs"]
            else:
                kernel = window_fwd._window_tiled_kernel
                const.update(BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"])
            yield ({"kernel": f"window-{cfg['kernel']}", "variant": f"N={n} D=32 {mode} +bias+mask",
                    "config": [cfg.get("block_m", pad_pow2(n)), cfg.get("block_n", pad_pow2(n)), cfg["num_warps"],
                               cfg["num_stages"]]},
                   dict(kernel=kernel, pointer_types=pointers, constexprs=const, num_warps=cfg["num_warps"],
                        num_stages=cfg["num_stages"], unit_ints=("sq_d", "sk_d", "sv_d", "so_d", "sb_j", "sm_j"),
                        float_args=("scale",)))


_BWD_UNIT_INTS = ("sqd", "skd", "svd", "sdd", "sbn", "san", "smn")
_BWD_MODES = ("fp32", "fp32-ieee", "bf16")  # one per kind of product (split-FP16, IEEE FMA, half); fp16 = bf16's code


def _bwd_pointers(mode: str, names: tuple[str, ...], inputs: tuple[str, ...]) -> dict:
    t = "*bf16" if mode == "bf16" else "*fp32"
    return {n: (t if n in inputs else "*i1" if n == "Mask" else "*fp32") for n in names}


def _split_bwd_jobs(label: str, mode: str, tiles: "elsa_bwd.BwdConfig", d: int, bias: bool, add: bool,
                    single_key_tile: bool, products: str | None = None):
    """The dK / dV and dQ kernels of one backward configuration (bias: with its gradient; ``products``: an FP32
    mode's products override, as :func:`visionattn.kernels.elsa_bwd.fp32_products`)."""
    precision = elsa_bwd.fp32_products(mode, products)[1]
    base = dict(BLOCK_D=d, BLOCK_DV=d, **elsa_bwd.product_flags(precision), HEAD_B=precision in elsa_bwd.HEAD_SCALED,
                IS_CAUSAL=False, HAS_BIAS=bias, HAS_ADD=add,
                HAS_MASK=False, HEAD_SCALE=False, EVEN_D=True, EVEN_DV=True, DOT_UPCAST=False)
    dkdv_ptr = _bwd_pointers(mode, ("Q", "K", "V", "DO", "Bias", "Add", "Mask", "HS", "Delta", "LseRow", "DK", "DV",
                                    "DQ", "DQACC", "Sem", "E"), ("Q", "K", "V", "DO", "DK", "DV", "DQ"))
    dq_ptr = _bwd_pointers(mode, ("Q", "K", "V", "DO", "Bias", "Add", "Mask", "HS", "Delta", "LseRow", "DQ", "DB",
                                  "DHS", "E"), ("Q", "K", "V", "DO", "DQ"))
    dkdv_ptr["Sem"] = dkdv_ptr["E"] = dq_ptr["E"] = "*i32"
    single = tiles.single_pass and not bias
    ordered = dict(DQ_ORDERED=single, ACC_IS_OUT=mode != "bf16", SPIN_ASM=True, TAIL=tiles.dkdv.tail)
    kernels = [("dkdv+dq" if single else "dkdv", tiles.dkdv, elsa_bwd._bwd_dkdv_kernel, dkdv_ptr, ordered,
                ("scale",))]
    if not single:
        kernels.append(("dq", tiles.dq, elsa_bwd._bwd_dq_kernel, dq_ptr,
                        dict(WRITE_DB=bias, WRITE_DHS=False, DB_IN_REGS=bias and single_key_tile), ("scale0",)))
    for name, t, kernel, ptr, extra, floats in kernels:
        yield ({"kernel": f"bwd-{name}", "variant": f"{label} {mode}" + (f" products={products}" if products else "")
                + (" +bias grad" if bias else ""),
                "config": [t.block_m, t.block_n, t.num_warps, t.num_stages]},
               dict(kernel=kernel, pointer_types=ptr, constexprs=dict(base, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                                                                       **extra),
                    num_warps=t.num_warps, num_stages=t.num_stages, unit_ints=_BWD_UNIT_INTS, float_args=floats))


def _varlen_bwd_jobs(quick: bool):
    """The ragged-batch backward's dK / dV and dQ kernels per mode and head dim, as :func:`.varlen_backward`
    launches them."""
    for mode in _BWD_MODES + ("tf32",):
        if mode == "fp32-ieee":
            continue  # the IEEE products' tiles are the dense kernels' (same helpers); one FP32 kind is enough here
        precision = elsa_bwd.BWD_MODES[mode][1]
        for d in ((64,) if quick else (64, 128)):
            tiles = elsa_bwd.get_config(mode, d, d)
            flags = dict(BLOCK_D=d, BLOCK_DV=d, **elsa_bwd.product_flags(precision), IS_CAUSAL=False, EVEN_D=True,
                         EVEN_DV=True, DOT_UPCAST=False, HEAD_B=precision in elsa_bwd.HEAD_SCALED)
            for name, t, kernel, outs in (("dkdv", tiles.dkdv, varlen_bwd._varlen_dkdv_kernel, ("DK", "DV")),
                                          ("dq", tiles.dq, varlen_bwd._varlen_dq_kernel, ("DQ",))):
                ptr = _bwd_pointers(mode, ("Q", "K", "V", "DO", "Delta", "LseRow", *outs),
                                    ("Q", "K", "V", "DO", *outs))
                ptr.update(CuQ="*i32", CuK="*i32", E="*i32")
                yield ({"kernel": f"varlen-bwd-{name}", "variant": f"D={d} {mode}",
                        "config": [t.block_m, t.block_n, t.num_warps, t.num_stages]},
                       dict(kernel=kernel, pointer_types=ptr, constexprs=dict(flags, BLOCK_M=t.block_m,
                                                                               BLOCK_N=t.block_n),
                            num_warps=t.num_warps, num_stages=t.num_stages, unit_ints=("sqd", "skd", "svd", "sdd"),
                            float_args=("scale",)))


def _backward_jobs(quick: bool):
    for mode in _BWD_MODES + ("tf32",):  # tf32: the dense kernels' f16x1 products (its windows run fp32's)
        for d in ((64, 128) if quick else (32, 64, 128, 256)):
            for bias in (False, True):
                yield from _split_bwd_jobs(f"dense D={d}", mode, elsa_bwd.get_config(mode, d, d, bias), d, bias,
                                           False, False)
                if mode == "fp32" and d in (64, 128):  # the per-tile-scaled split-FP16 products beside the default
                    yield from _split_bwd_jobs(f"dense D={d}", mode, elsa_bwd.get_config(mode, d, d, bias, "f16x3"),
                                               d, bias, False, False, "f16x3")
        if mode in ("fp32", "tf32"):  # the single pass at ViT-B/16 224's 197 keys
            for products in ((None, "f16x3") if mode == "fp32" else (None,)):
                tiles = elsa_bwd.get_config(mode, 64, 64, False, products, 197)
                yield from _split_bwd_jobs("dense D=64 N=197 single pass", mode, tiles, 64, False, False, False,
                                           products)
        if mode == "bf16":  # the whole-head backward at ViT-B/16 224 (197 rows) and ViT-L/14 224 (257: the tail tile)
            names = ("Q", "K", "V", "O", "DO", "LSE", "Bias", "Mask", "DQ", "DK", "DV")
            for n in (197, 257):
                t = elsa_bwd.head_tiles(n)[0]
                yield ({"kernel": "bwd-whole-head", "variant": f"dense D=64 N={n} bf16",
                        "config": [t.block_m, t.block_n, t.num_warps, t.num_stages, t.tail]},
                       dict(kernel=elsa_bwd._bwd_head_kernel,
                            pointer_types=_bwd_pointers(mode, names, ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")),
                            constexprs=dict(BLOCK_M=t.block_m, TAIL_M=t.tail, BLOCK_N=t.block_n, BLOCK_D=64,
                                            BLOCK_DV=64, PRECISION=elsa_bwd.BWD_MODES[mode][1], IS_CAUSAL=False,
                                            HAS_BIAS=False, HAS_MASK=False, EVEN_D=True, EVEN_DV=True,
                                            DOT_UPCAST=False),
                            num_warps=t.num_warps, num_stages=t.num_stages,
                            unit_ints=("sqd", "skd", "svd", "sod", "sdd", "sbn", "smn"), float_args=("scale",)))
        if mode == "tf32":
            continue
        for n in ((49, 144) if quick else (49, 64, 144, 256)):
            tiles = window_bwd.get_config(mode, n, 32)
            yield from _split_bwd_jobs(f"window N={n} D=32 split", mode, tiles, 32, True, True,
                                       n <= tiles.dq.block_n)
            if n > window_bwd.FUSED_MAX_TOKENS:
                continue
            block = pad_pow2(n)
            precision = elsa_bwd.BWD_MODES[mode][1]
            half = elsa_bwd.BWD_MODES[mode][0] != elsa_bwd.BWD_MODES["fp32"][0]
            warps, stages = window_bwd.fused_launch(block, n, half, precision)
            names = ("Q", "K", "V", "O", "DO", "LSE", "Bias", "Add", "HS", "DQ", "DK", "DV", "DB", "DHS")
            # Swin-v2's 64-token windows: also the cosine variant (q, k normalised in the kernel, d logit_scale)
            for cosine in ((False, True) if n == 64 else (False,)):
                yield ({"kernel": "bwd-window-fused",
                        "variant": f"window N={n} D=32 {mode} +bias grad" + (" cosine" if cosine else ""),
                        "config": [block, block, warps, stages]},
                       dict(kernel=window_bwd._window_bwd_fused_kernel,
                            pointer_types=_bwd_pointers(mode, names, ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")),
                            constexprs=dict(BLOCK=block, BLOCK_D=32, BLOCK_DV=32, **elsa_bwd.product_flags(precision),
                                            HAS_BIAS=True, HAS_ADD=True, HEAD_SCALE=False, WRITE_DB=True,
                                            WRITE_DHS=cosine, EVEN_D=True, EVEN_DV=True, DOT_UPCAST=False,
                                            NORMALIZE=cosine,
                                            COMPUTE=0 if mode.startswith("fp32") else 2 if mode == "bf16" else 1),
                            num_warps=warps, num_stages=stages,
                            unit_ints=("sqd", "skd", "svd", "sod", "sdd", "slm", "sbn", "san"),
                            float_args=("scale0",)))


def _spill(local_bytes) -> str:
    if local_bytes is None:
        return "-"
    return f"**{local_bytes}**" if local_bytes else "0"




def main(args) -> dict:
    parser = build_parser()
    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in KERNELS]
    if unknown or not wanted:
        parser.error(f"--kernels: unknown {unknown or 'empty list'}; choose from {', '.join(KERNELS)}")
    outputs = prefix_outputs(parser, args.out, (".md", ".json"), tool="check_kernels_offline")
    jobs = []
    for name, gen in (("elsa", _elsa_jobs), ("ieee-gluon", _ieee_gluon_jobs), ("half-gluon", _half_gluon_jobs),
                      ("pasa", _pasa_jobs), ("window", _window_jobs), ("backward", _backward_jobs),
                      ("ieee-gluon-bwd", _ieee_gluon_bwd_jobs), ("varlen-bwd", _varlen_bwd_jobs),
                      ("half-gluon-bwd", _half_gluon_bwd_jobs)):
        if name in wanted:
            jobs += list(gen(args.quick))
    rows, t0 = [], time.perf_counter()
    for meta, job in tqdm(jobs, desc="compiling for sm_90"):
        try:
            rep = compile_for_arch(**job)
            meta.update(shared_bytes=rep.shared_bytes, wgmma=rep.wgmma,
                        fits=rep.shared_bytes <= HOPPER_SHARED_LIMIT, registers=rep.registers,
                        local_bytes=rep.local_bytes, programs_per_sm=rep.programs_per_sm,
                        instructions=rep.instructions)
        except Exception as exc:  # a variant that does not compile is a finding, not a crash
            meta.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        rows.append(meta)
    over = [r for r in rows if r.get("fits") is False]
    failed = [r for r in rows if "error" in r]
    env = environment({"triton_compiled_with": triton.__version__})
    result = {"environment": env, "limit_bytes": HOPPER_SHARED_LIMIT, "rows": rows, "over_limit": len(over),
              "failed": len(failed), "seconds": time.perf_counter() - t0}
    table = markdown_table([[r["kernel"], r["variant"], r["config"], r.get("shared_bytes", r.get("error")),
                             {True: "yes", False: "**NO**"}.get(r.get("fits"), "-"), r.get("registers", "-"),
                             _spill(r.get("local_bytes")), r.get("programs_per_sm", "-"), r.get("wgmma", "-"),
                             r.get("instructions") or "-"]
                            for r in rows],
                           ["kernel", "variant", "config (M, N, warps, stages)", "shared bytes", "fits",
                            "registers / thread", "spill bytes", "programs / SM", "wgmma", "SASS instructions"])
    md = (f"# Kernel configs compiled for sm_90 (offline)\n\n* triton {triton.__version__} (only the target GPU's "
          f"triton version gives its figures); limit {HOPPER_SHARED_LIMIT} bytes per block\n"
          f"* command: `{env.get('command', '')}`\n* {len(rows)} variants, {len(over)} over the limit "
          f"(the launcher then retries smaller configs), {len(failed)} failed to compile\n"
          "* registers and spill bytes (stack frame + local memory) per thread from the cubin (`cuobjdump "
          "-res-usage`); programs / SM by the Hopper occupancy rules (registers, 228 KiB shared memory with 1 KiB per "
          "program, 64 warps, 32 programs; 0 over the limit)\n"
          "* SASS instructions: a static count (`nvdisasm`; a loop body counts once), comparable between variants "
          "of one kernel at the same tiles\n* half-gluon (warp-specialized): registers are the launch cap over its "
          "12 warps (8 / 16 / 20 with one / three / four consumer warpgroups); `setmaxnreg` then gives each consumer "
          "thread 240 (232 with one, 160 with three, 112-120 with four) and each producer 24; half-gluon-bwd likewise: "
          "240 per consumer thread, 24 for the producer, 32 for each of the two dQ writers (the fp32 dsplit build: "
          "232 for the second consumer, which leaves the first 248, and 24 for each writer)"
          f"\n\n{table}\n")
    write_results(outputs, args.out, result, md)
    print(md)
    return result


if __name__ == "__main__":
    main(build_parser().parse_args())
