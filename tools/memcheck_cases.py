"""A small case of every kernel family and variant, for NVIDIA's compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 9 python tools/memcheck_cases.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python tools/memcheck_cases.py --families window dense

Each case runs forward (and backward where the mode has backward kernels) on the GPU once (``--calls 2``: twice, the
second call launching directly as every later call does), at a size that takes the
variant it names: the dense Triton kernel, the Gluon half kernel (head dim 64 from 256 keys, head dim 128) and its fp32
split build, the Gluon half backward and its tf32 / fp32 builds, the Gluon IEEE-FP32 forward and backward, the
single-pass, two-kernel and whole-head backward (its 16-row tail tile too), split-KV with its merge, PASA, the
window kernels (small packed windows, tiled windows, Swin-v2 cosine, the fused backward, packed qkv) and the
ragged-batch kernels (also the stream-K schedule and its merge, and the Gluon varlen kernel). Outputs and gradients
must be finite; the sanitizer reports the memory errors. ``tools/gpu_suite.sh OUT memcheck`` runs it (also
``racecheck``, ``initcheck``). Exit 0 when every case ran, 1
when one raised or returned a non-finite value (each printed).

``--control`` runs instead the smallest warp-specialized Gluon kernel (one mbarrier initialised before
``gl.warp_specialize``, one partition arriving, the other waiting; none of our data in shared memory): racecheck
reports on it the same pair of sites it reports on the Gluon half kernel (a read at the kernel's first line
against writes at the kernel's first line and at the ``warp_specialize`` call), so those hazards lie in Triton's
partition hand-off, not in the attention kernel's own shared-memory traffic. ``--control-data`` runs a second control
kernel that hands data through shared memory the way the Gluon backward's producer warp hands a query tile's lse /
delta rows to its consumers: one warp stores 32 floats, passes a barrier of its warp and arrives on an mbarrier; a
warpgroup waits on it, reads them and writes them out: whether racecheck follows such a hand-off (a report between
that store and that read) or not (docs/benchmarks/gpu_conformance_h200.md reads the backward's reports against it).
``--control-ring plain|tma`` runs the whole ring of that hand-off: four rounds through one slot, the warpgroup
passing a barrier of its own and releasing the slot on an ``empty`` mbarrier (one thread) before the warp rewrites
it; with ``tma`` a TMA copy's bytes also complete each ``ready`` phase, as the query tile's do in the backward.
``--control-init store|tma`` writes every element of a new (uninitialised) FP32 tile with plain stores or, as the
Gluon backward stores each dQ accumulator tile's first share, through shared memory and a TMA store, then reads it
back with torch: whether initcheck counts a TMA store as initialising the memory it writes (a report on the read
after ``tma`` but not after ``store`` places the backward's combine reports on the tool).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import visionattn as va

FAMILIES = ("dense", "split", "packed", "window", "varlen")
# every production mode (not fp16-acc16, the unshifted FP16-accumulation baseline)
MODES = tuple(m for m, spec in va.MODES.items() if spec.pasa_shift or not spec.half_scores)


def _rand(*shape, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype).requires_grad_(grad)


def _run(fn, leaves, calls: int = 1) -> None:
    # the first call compiles, plans and launches through Triton's JIT path, a second (as every later call of the
    # signature) launches directly, with raw addresses where a plan passes them (unused pointers, workspaces)
    for _ in range(calls):
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        grads = []
        if any(t.requires_grad for t in leaves):
            out.sum().backward()  # a stride-0 output gradient, the most common loss
            grads = [t.grad for t in leaves if t.requires_grad]
        torch.cuda.synchronize()
        for t in (out, *grads):
            if not torch.isfinite(t).all():
                raise AssertionError("non-finite values")


def cases(families, modes):
    """``(name, fn, leaves)`` for every case of ``families`` x ``modes``."""
    from visionattn.ops import has_backward

    for mode in modes:
        dt = va.MODES[mode].compute_dtype
        grad = has_backward(mode)
        if "dense" in families:
            for n, d, extra in ((197, 64, {}), (261, 64, {}), (300, 64, {}), (130, 128, {}), (700, 128, {}),
                                (97, 32, {"is_causal": True}), (150, 80, {}), (70, 64, {"bias": True})):
                def dense(q, k, v, *b, extra=extra, mode=mode):
                    kw = {"is_causal": extra.get("is_causal", False)}
                    if b:
                        kw["bias"], kw["attn_mask"] = b[0], torch.ones(1, 1, 1, q.shape[2], device="cuda",
                                                                       dtype=torch.bool)
                    return va.attention(q, k, v, mode=mode, **kw)
                leaves = [_rand(2, 3, n, d, dtype=dt, grad=grad, seed=s) for s in range(3)]
                if extra.get("bias"):
                    leaves.append(_rand(3, n, n, grad=grad, seed=4))
                yield f"dense {mode} N={n} D={d} {sorted(extra)}", dense, leaves
            # the Gluon backward (a partial key tile): fp16 / bf16 from half_gluon_bwd.MIN_KEYS; tf32 (its HEAD_SCALES
            # build) and fp32 (its split-FP16 build; at head dim 128 the consumers split the head dim) where
            # tf32_preferred / fp32_preferred route there
            gluon_bwd = {"fp16": ((2100, 64), (2100, 128)), "bf16": ((2100, 64), (2100, 128)),
                         "tf32": ((4100, 64), (1100, 128)), "fp32": ((4100, 64), (1100, 128))}
            if mode in gluon_bwd:
                for n, d in gluon_bwd[mode]:
                    yield (f"dense {mode} N={n} D={d} (Gluon backward)", lambda q, k, v, mode=mode:
                           va.attention(q, k, v, mode=mode), [_rand(1, 2, n, d, dtype=dt, grad=grad, seed=s)
                                                              for s in range(3)])
            # grouped-query attention on the Gluon backward: a program sweeps its K / V head's query heads (fp16 /
            # bf16: 8 over 4 whole; 2 over 1 with partial tiles, cut into parts: FP32 partials; tf32 / fp32: the
            # accumulators rescaled at each query head's first step, 8 over 2 where the rules route there)
            gluon_gqa = {"fp16": ((8, 4, 4096, 64), (2, 1, 2100, 128)), "bf16": ((8, 4, 4096, 64), (2, 1, 2100, 128)),
                         "tf32": ((8, 2, 4100, 64), (8, 2, 1100, 128)), "fp32": ((8, 2, 4100, 64), (8, 2, 1100, 128))}
            if mode in gluon_gqa:
                for h, h_kv, n, d in gluon_gqa[mode]:
                    yield (f"dense {mode} H={h} Hkv={h_kv} N={n} D={d} (Gluon backward, grouped-query)",
                           lambda q, k, v, mode=mode: va.attention(q, k, v, mode=mode, enable_gqa=True),
                           [_rand(1, hh, n, d, dtype=dt, grad=grad, seed=s) for s, hh in enumerate((h, h_kv, h_kv))])
            if mode in ("fp16", "bf16"):  # the Gluon forward's three consumer warpgroups where the SMs allow (140
                # heads of 1700 rows on 132 SMs; a last key tile in two parts)
                yield (f"dense {mode} B=2 H=70 N=1700 D=64 (Gluon forward, three consumers)",
                       lambda q, k, v, mode=mode: va.attention(q, k, v, mode=mode),
                       [_rand(2, 70, 1700, 64, dtype=dt, grad=grad, seed=s) for s in range(3)])
                # and head dim 128's 64-key tiles in three consumers (320 heads of 513 rows: a last work tile of 129
                # rows, a last key tile cut to 16 keys), also over grouped-query K / V heads
                for h_kv in (40, 10):
                    yield (f"dense {mode} B=8 H=40 Hkv={h_kv} N=513 D=128 (Gluon forward, three consumers)",
                           lambda q, k, v, mode=mode: va.attention(q, k, v, mode=mode, enable_gqa=True),
                           [_rand(8, hh, 513, 128, dtype=dt, grad=grad, seed=s)
                            for s, hh in enumerate((40, h_kv, h_kv))])
                # head dim 128's key pieces for a little-filled last round (24 heads of 1536 rows on 132 SMs: 24 of
                # 288 work tiles in 4 pieces each, merged), also over grouped-query K / V heads
                for h_kv in (24, 8):
                    yield (f"dense {mode} H=24 Hkv={h_kv} N=1536 D=128 (Gluon forward, key pieces)",
                           lambda q, k, v, mode=mode: va.attention(q, k, v, mode=mode, enable_gqa=True),
                           [_rand(1, hh, 1536, 128, dtype=dt, grad=grad, seed=s)
                            for s, hh in enumerate((24, h_kv, h_kv))])
            if mode == "fp32":  # the Gluon forward's split-FP16 build, where its grid fills the GPU (a cut last key
                # tile in two parts; a masked one; head dim 128's 32-key tiles), and with grouped-query K / V heads
                for b, h, n, d in ((4, 12, 300, 64), (1, 4, 4100, 64), (4, 12, 300, 128), (1, 4, 4100, 128)):
                    yield (f"dense fp32 B={b} H={h} N={n} D={d} (Gluon forward)", lambda q, k, v:
                           va.attention(q, k, v, mode="fp32"), [_rand(b, h, n, d, grad=grad, seed=s)
                                                                for s in range(3)])
                for h_kv, d in ((4, 128), (2, 64)):
                    yield (f"dense fp32 B=2 H=16 Hkv={h_kv} N=1100 D={d} (Gluon forward, grouped-query)",
                           lambda q, k, v: va.attention(q, k, v, mode="fp32", enable_gqa=True),
                           [_rand(2, h, 1100, d, grad=grad, seed=s) for s, h in enumerate((16, h_kv, h_kv))])
        if "split" in families:
            yield (f"split-KV {mode} N=1000 D=64 num_splits=4",
                   lambda q, k, v, mode=mode: va.attention(q, k, v, mode=mode, num_splits=4),
                   [_rand(1, 2, 1000, 64, dtype=dt, seed=s) for s in range(3)])
        if "packed" in families:
            # N=577: on Hopper in fp16 / bf16 the Gluon backward writes the packed gradient in place
            for n in (197, 577):
                yield (f"qkvpacked {mode} N={n} D=64", lambda qkv, mode=mode: va.attention_qkvpacked(qkv, mode=mode),
                       [_rand(2, n, 3, 2, 64, dtype=dt, grad=grad)])
        if "window" in families:
            for n, d, cosine in ((49, 32, False), (64, 32, True), (144, 32, False), (256, 32, True)):
                nw, heads = 4, 2

                def window(q, k, v, rpb, *ls, n=n, nw=nw, cosine=cosine, mode=mode):
                    mask = torch.where(torch.arange(n * n, device="cuda").view(1, n, n) % 7 == 0, -100.0, 0.0)
                    return va.window_attention(q, k, v, relative_position_bias=rpb, shift_mask=mask.expand(nw, n, n),
                                               num_windows=nw, cosine=cosine, logit_scale=ls[0] if ls else None,
                                               mode=mode)
                leaves = [_rand(2 * nw, heads, n, d, dtype=dt, grad=grad, seed=s) for s in range(3)]
                leaves.append(_rand(heads, n, n, grad=grad, seed=5))
                if cosine:
                    leaves.append(_rand(heads, grad=grad, seed=6))
                yield f"window {mode} N={n} D={d} cosine={cosine}", window, leaves
            if grad:
                yield (f"window qkvpacked {mode} N=49",
                       lambda qkv, mode=mode: va.window_attention_qkvpacked(qkv, num_windows=2, mode=mode),
                       [_rand(4, 49, 3, 2, 32, dtype=dt, grad=True)])
        if "varlen" in families and mode != "pasa":
            lens = [1, 0, 77, 300]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            yield (f"varlen {mode} lengths {lens}",
                   lambda q, k, v, mode=mode: va.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), mode=mode),
                   [_rand(sum(lens), 2, 64, dtype=dt, grad=grad, seed=s) for s in range(3)])
            # the sequences visited longest first through the order table (host-side lengths; forward only)
            from visionattn.kernels import stream_k, varlen_fwd

            yield (f"varlen ordered {mode} lengths {lens}",
                   lambda q, k, v, mode=mode: varlen_fwd.varlen_forward(
                       q, k, v, cu, cu, max(lens), max(lens), False, 0.125, mode, lengths=(lens, lens),
                       schedule="split-kv")[0],
                   [_rand(sum(lens), 2, 64, dtype=dt, seed=s) for s in range(3)])
            if mode in ("fp16", "bf16"):  # the Gluon varlen kernel (Hopper; forward only): whole and shifted key tiles
                lq, lk = [5, 0, 130, 64, 700, 1500], [128, 300, 129, 1000, 257, 1500]
                cq, ck = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                          for x in (lq, lk))
                for d in (64, 128):
                    def gluon_varlen(q, k, v, lq=lq, lk=lk, cq=cq, ck=ck, mode=mode):
                        plan, (out, _) = varlen_fwd.plan_for(q, k, v, cq, ck, max(lq), max(lk), False, 0.125, mode,
                                                             lengths=(lq, lk))
                        if torch.cuda.get_device_capability()[0] == 9 and type(plan).__name__ != "VarlenGluonPlan":
                            raise AssertionError(f"planned {type(plan).__name__}, not the Gluon varlen kernel")
                        return out
                    yield (f"varlen gluon {mode} D={d} lengths {lq} x {lk}", gluon_varlen,
                           [_rand(sum(x), 16, d, dtype=dt, seed=s) for s, x in enumerate((lq, lk, lk))])
            # the stream-K schedule (forward only): few queries against uneven keys, shares cut inside jobs

            for lq, lk, programs in (([1, 0, 7, 3], [5000, 3, 0, 700], None), ([40, 16], [40, 333], 5)):
                cq, ck = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                          for x in (lq, lk))

                def stream(q, k, v, lq=lq, lk=lk, cq=cq, ck=ck, programs=programs, mode=mode):
                    plan = stream_k.stream_plan(q, k, v, lq, lk, sum(lq), False, mode, q.dtype, True, False,
                                                programs=programs)
                    return plan(q, k, v, cq, ck, 0.125)[0]
                yield (f"varlen stream-K {mode} lengths {lq} x {lk}", stream,
                       [_rand(sum(x), 2, 64, dtype=dt, seed=s) for s, x in enumerate((lq, lk, lk))])
            # lists of per-sequence tensors, each its own allocation, read in place at their row offsets (forward
            # only): the tile-table kernel, and few queries against uneven keys on the stream-K schedule; a second
            # call (--calls 2) launches from the list's runner
            for lq, lk in (([77, 1, 300], [77, 1, 300]), ([1, 7, 3], [5000, 3, 700])):
                def listed(*flat, n=len(lq), mode=mode):
                    from visionattn import varlen as vl

                    seen = vl.CALLS.builds + vl.CALLS.hits
                    outs = va.varlen_attention(list(flat[:n]), list(flat[n:2 * n]), list(flat[2 * n:]), mode=mode)
                    if vl.CALLS.builds + vl.CALLS.hits != seen + 1:
                        raise AssertionError("the list was packed, not read in place")
                    return torch.cat(outs)
                yield (f"varlen list {mode} lengths {lq} x {lk}", listed,
                       [_rand(n, 2, 64, dtype=dt, seed=i) for i, n in enumerate(lq + lk + lk)])


def control() -> None:
    """Run the warp-specialization control kernel (module docstring) once."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    @gluon.jit
    def waiter(out, bar):
        mbarrier.wait(bar, 0)
        offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        gl.store(out + offs, offs.to(gl.float32))

    @gluon.jit
    def arriver(out, bar):
        offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        gl.store(out + 128 + offs, offs.to(gl.float32))
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def kernel(out):
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        gl.warp_specialize([(waiter, (out, bar)), (arriver, (out, bar))], [1], [24])

    out = torch.zeros(160, device="cuda")
    kernel[(8,)](out, num_warps=4)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat([torch.arange(128.0), torch.arange(32.0)]).cuda()), "control kernel output"
    print("memcheck_cases: control kernel ran", flush=True)


def control_data() -> None:
    """Run the data hand-off control kernel (module docstring) once."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from visionattn.kernels._gluon import cta_barrier as barrier

    @gluon.jit
    def reader(out, rows, bar):
        mbarrier.wait(bar, 0)
        vals = rows.load(gl.SliceLayout(0, gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])))
        offs = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])))
        gl.store(out + gl.program_id(0) * 32 + offs, vals)

    @gluon.jit
    def writer(out, rows, bar):
        offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        rows.store((offs + gl.program_id(0)).to(gl.float32))
        barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def kernel(out):
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        rows = gl.allocate_shared_memory(gl.float32, [32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        mbarrier.init(bar, count=1)
        gl.warp_specialize([(reader, (out, rows, bar)), (writer, (out, rows, bar))], [1], [24])

    out = torch.zeros(8, 32, device="cuda")
    kernel[(8,)](out, num_warps=4)
    torch.cuda.synchronize()
    want = torch.arange(32.0, device="cuda") + torch.arange(8.0, device="cuda")[:, None]
    assert torch.equal(out, want), "data hand-off control kernel output"
    print("memcheck_cases: data hand-off control kernel ran", flush=True)


def control_ring(tma_bytes: bool) -> None:
    """Run the ring control kernel (module docstring) once; ``tma_bytes``: a TMA copy also completes each phase."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from visionattn.kernels._gluon import nvmma_layout

    from visionattn.kernels._gluon import cta_barrier as barrier
    rounds = 4

    @gluon.jit
    def reader(out, rows, tile, desc, ready, empty, ROUNDS: gl.constexpr, TMA: gl.constexpr):
        layout: gl.constexpr = gl.SliceLayout(0, gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0]))
        offs = gl.arange(0, 32, layout=layout)
        for r in range(ROUNDS):
            mbarrier.wait(ready, r & 1)
            vals = rows.load(layout)
            gl.store(out + (gl.program_id(0) * ROUNDS + r) * 32 + offs, vals)
            barrier()  # every thread's read precedes the one-thread release (the backward's consumer does the same)
            mbarrier.arrive(empty, count=1)

    @gluon.jit
    def writer(out, rows, tile, desc, ready, empty, ROUNDS: gl.constexpr, TMA: gl.constexpr):
        offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        for r in range(ROUNDS):
            mbarrier.wait(empty, (r & 1) ^ 1)
            if TMA:  # the backward's producer: the slot's TMA bytes first, then its rows and a second arrival
                mbarrier.expect(ready, desc.block_type.nbytes)
                tma.async_copy_global_to_shared(desc, [0, 0], ready, tile)
            rows.store((offs + gl.program_id(0) + 100 * r).to(gl.float32))
            barrier()
            mbarrier.arrive(ready, count=1)

    @gluon.jit
    def kernel(out, desc, ROUNDS: gl.constexpr, TMA: gl.constexpr):
        ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        rows = gl.allocate_shared_memory(gl.float32, [32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tile = gl.allocate_shared_memory(desc.dtype, desc.block_type.shape, desc.layout)
        mbarrier.init(ready, count=2 if TMA else 1)
        mbarrier.init(empty, count=1)
        gl.warp_specialize([(reader, (out, rows, tile, desc, ready, empty, ROUNDS, TMA)),
                            (writer, (out, rows, tile, desc, ready, empty, ROUNDS, TMA))], [1], [24])

    src = torch.ones(64, 64, device="cuda", dtype=torch.float16)
    desc = TensorDescriptor.from_tensor(src, [64, 64], nvmma_layout((64, 64), torch.float16))
    out = torch.zeros(8, rounds, 32, device="cuda")
    kernel[(8,)](out, desc, ROUNDS=rounds, TMA=tma_bytes, num_warps=4)
    torch.cuda.synchronize()
    want = (torch.arange(32.0, device="cuda") + torch.arange(8.0, device="cuda")[:, None, None]
            + 100 * torch.arange(float(rounds), device="cuda")[:, None])
    assert torch.equal(out, want), "ring control kernel output"
    print(f"memcheck_cases: ring control kernel ran ({'with' if tma_bytes else 'without'} TMA bytes)", flush=True)


def control_init(tma_store: bool) -> None:
    """Run the initialisation control kernel (module docstring) once; ``tma_store``: a TMA store writes the tile."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from visionattn.kernels._gluon import nvmma_layout

    @gluon.jit
    def kernel(out, desc, TMA: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        vals = (rows[:, None] * 64 + cols[None, :]).to(gl.float32)
        if TMA:
            tile = gl.allocate_shared_memory(gl.float32, [64, 64], desc.layout)
            tile.store(vals)
            fence_async_shared()
            tma.async_copy_shared_to_global(desc, [0, 0], tile)
            tma.store_wait(0)
        else:
            gl.store(out + rows[:, None] * 64 + cols[None, :], vals)

    out = torch.empty(64, 64, device="cuda")
    desc = TensorDescriptor.from_tensor(out, [64, 64], nvmma_layout((64, 64), torch.float32))
    kernel[(1,)](out, desc, TMA=tma_store, num_warps=4)
    torch.cuda.synchronize()
    assert torch.equal(out.clone(), torch.arange(4096.0, device="cuda").view(64, 64)), "init control kernel output"
    print(f"memcheck_cases: init control kernel ran ({'TMA store' if tma_store else 'plain stores'})", flush=True)


def main(args) -> dict:
    if args.control_init:
        control_init(args.control_init == "tma")
        return {"cases": 1, "failed": []}
    if args.control or args.control_data:
        control() if args.control else control_data()
        return {"cases": 1, "failed": []}
    if args.control_ring:
        control_ring(args.control_ring == "tma")
        return {"cases": 1, "failed": []}
    ran, failed, t0 = 0, [], time.perf_counter()
    for name, fn, leaves in cases(args.families, args.modes):
        try:
            _run(fn, leaves, args.calls)
        except Exception as exc:  # report every case, then fail
            failed.append(name)
            print(f"FAILED {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        ran += 1
    print(f"memcheck_cases: {ran} cases, {len(failed)} failed, {time.perf_counter() - t0:.1f} s", flush=True)
    return {"cases": ran, "failed": failed}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="kernel families to run")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="precision modes to run")
    p.add_argument("--calls", type=int, choices=(1, 2), default=1,
                   help="calls per case: 1 (default; the first call launches through Triton's JIT path), 2 also "
                        "checks the direct launch of every later call (raw addresses for unused pointers and "
                        "workspaces); 2 doubles the sanitizer's time (the whole set then takes over 560 s on an H200)")
    p.add_argument("--control", action="store_true",
                   help="run only the warp-specialization control kernel (racecheck's baseline)")
    p.add_argument("--control-data", action="store_true",
                   help="run only the data hand-off control kernel (a warp's stores read by a warpgroup after an "
                        "mbarrier)")
    p.add_argument("--control-ring", choices=("plain", "tma"), default=None,
                   help="run only the ring control kernel: four rounds of rows handed through one ring slot with "
                        "ready / empty mbarriers, the slot rewritten after the readers' one-thread release; tma: "
                        "a TMA copy's bytes also complete each ready phase, as in the Gluon backward")
    p.add_argument("--control-init", choices=("store", "tma"), default=None,
                   help="run only the initialisation control kernel: a new FP32 tile written by plain stores or by a "
                        "TMA store (as the Gluon backward's first dQ share), read back by torch")
    return p


if __name__ == "__main__":
    parsed = build_parser().parse_args()
    if not torch.cuda.is_available():
        print("memcheck_cases: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    sys.exit(1 if main(parsed).get("failed") else 0)
