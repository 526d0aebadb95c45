"""The Gluon fp16 / bf16 Hopper backward (visionattn.kernels.half_gluon_bwd).

Gluon does not run under TRITON_INTERPRET=1: on CPU the scope rules and host-side helpers are checked and the
kernel is compiled offline for sm_90 (in a child process with TRITON_INTERPRET=0); ``pytest -m gpu`` checks the
gradients against the float64 oracle and their bit-for-bit reproducibility.
"""
import importlib
import math

import pytest
import torch

from offline_compile import compile_in_child
from visionattn.kernels import half_gluon_bwd

needs_gluon = pytest.mark.skipif(half_gluon_bwd._IMPORT_ERROR is not None, reason="this Triton has no usable Gluon")


def _qkv(n_q=128, n_k=128, d=64, dtype=torch.float16, b=1, h=2, h_kv=None):
    q = torch.randn(b, h, n_q, d, dtype=dtype)
    k = torch.randn(b, h_kv or h, n_k, d, dtype=dtype)
    v = torch.randn(b, h_kv or h, n_k, d, dtype=dtype)
    do = torch.randn(b, h, n_q, d, dtype=dtype)
    return q, k, v, do


def test_module_imports_without_cuda():
    """The module imports on a CPU machine (CI) whatever the Triton: a missing Gluon API is a reason string."""
    mod = importlib.reload(half_gluon_bwd)
    assert mod._IMPORT_ERROR is None or "Gluon" in mod._IMPORT_ERROR
    assert mod.HEAD_DIMS == (64, 128)


def test_unsupported_reasons_name_the_cause():
    q, k, v, do = _qkv()
    reason = half_gluon_bwd.unsupported_reason
    assert "bias" in reason(q, k, v, do, torch.zeros(128, 128), None, False, 0.125)
    assert "mask" in reason(q, k, v, do, None, torch.ones(128, 128, dtype=torch.bool), False, 0.125)
    assert "causal" in reason(q, k, v, do, None, None, True, 0.125)
    assert "<= 0" in reason(q, k, v, do, None, None, False, 0.0)
    assert "dtypes" in reason(q.float(), k.float(), v.float(), do, None, None, False, 0.125)
    assert "dtypes" in reason(q, k.bfloat16(), v, do, None, None, False, 0.125)
    q32, k32, v32, do32 = _qkv(d=32)
    assert "head dims (32, 32)" in reason(q32, k32, v32, do32, None, None, False, 0.125)
    qg, kg, vg, dog = _qkv(h=4, h_kv=2)
    assert "grouped-query" in reason(qg, kg, vg, dog, None, None, False, 0.125)
    assert "grad_out" in reason(q, k, v, do[:, :, :64], None, None, False, 0.125)
    # a view whose row stride is not a multiple of 8 elements: not TMA-legal
    wide = torch.randn(1, 2, 128, 68, dtype=torch.float16)[..., :64]
    assert "TMA" in reason(wide, k, v, do, None, None, False, 0.125)
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            qd, kd, vd, dod = _qkv(n_q=100, n_k=300, d=d, dtype=dtype)
            assert reason(qd, kd, vd, dod, None, None, False, 0.125) == "tensors on cpu"  # everything else fits


def test_half_backward_refuses_what_it_cannot_run():
    q, k, v, do = _qkv()
    lse = torch.zeros(1, 2, 128)
    with pytest.raises(ValueError, match="tensors on cpu"):
        half_gluon_bwd.half_backward(q, k, v, q, do, lse, 0.125)


def test_host_helpers():
    """Grid: one program per (key tile of 128, head, batch); the ordered-dQ buffers: the FP32 accumulator and one
    counter per turn chain (with the dQ writers: per head and group of query tiles); the writers' config checks;
    EVEN_N only when every key tile is full."""
    for d in (64, 128):
        cfg = half_gluon_bwd.get_config(d)
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["STAGES"]) == (64, 128, 2)
        assert half_gluon_bwd.grid_size(2, 3, 1000, cfg) == 8 * 6
        assert half_gluon_bwd.grid_size(1, 1, 128, cfg) == 1
        # the dQ writer: one counter per (head, group of dq_tiles_per_turn query tiles); the halves without it: one
        # per (head, query tile, column half)
        assert cfg["dq_halves"] and cfg["dq_writer"]
        per_turn = cfg["dq_tiles_per_turn"]
        assert half_gluon_bwd.ordered_buffer_sizes(2, 3, 1000, d, cfg) == (
            6000 * d, 6 * math.ceil(math.ceil(1000 / 64) / per_turn))
        no_writer = dict(cfg, dq_writer=False)
        assert half_gluon_bwd.ordered_buffer_sizes(2, 3, 1000, d, no_writer) == (6000 * d,
                                                                                 6 * math.ceil(1000 / 64) * 2)
        assert half_gluon_bwd.kernel_constexprs(cfg, d, 1024)["DQ_WRITER"]
        assert not half_gluon_bwd.kernel_constexprs(no_writer, d, 1024)["DQ_WRITER"]
        assert not half_gluon_bwd.kernel_constexprs(dict(cfg, dq_halves=False), d, 1024)["DQ_WRITER"]
        # D = 64: 3 writers x 2 tiles per turn, ring of 6; D = 128: 2 writers x 1 tile, ring of 2
        want = (6, 3, 2) if d == 64 else (2, 2, 1)
        got = half_gluon_bwd.kernel_constexprs(cfg, d, 1024)
        assert (got["DQ_RING"], got["DQ_WRITERS"], got["DQ_TPT"]) == want
        # one-warp writers taking the groups of query tiles in turn (0: the two-warp writer); one counter per group
        # whatever their number; the ring holds a group per writer
        for per_turn in (1, 2):
            for writers in (0, 1, 2, 3):
                w_cfg = dict(cfg, dq_writers=writers, dq_tiles_per_turn=per_turn, dq_ring=per_turn * max(writers, 1))
                # 1000 rows: 16 query tiles (the last partial), 8 groups of 2
                assert half_gluon_bwd.ordered_buffer_sizes(2, 3, 1000, d, w_cfg) == (6000 * d, 6 * 16 // per_turn)
                got = half_gluon_bwd.kernel_constexprs(w_cfg, d, 1024)
                assert (got["DQ_WRITERS"], got["DQ_TPT"]) == (writers, per_turn)
        # 15 full tiles and a partial one (1000 rows) vs 17 tiles (1025 rows: 9 groups of 2, the last partial)
        two = dict(cfg, dq_tiles_per_turn=2, dq_writers=1, dq_ring=2)
        assert half_gluon_bwd.ordered_buffer_sizes(1, 1, 1025, d, two)[1] == 9
        assert half_gluon_bwd.ordered_buffer_sizes(1, 1, 64, d, two)[1] == 1
        with pytest.raises(ValueError, match="dq_ring"):
            half_gluon_bwd.kernel_constexprs(dict(cfg, dq_writers=3, dq_ring=2, dq_tiles_per_turn=1), d, 1024)
        with pytest.raises(ValueError, match="dq_ring 4 < dq_tiles_per_turn 2 x dq_writers 3"):
            half_gluon_bwd.kernel_constexprs(dict(cfg, dq_writers=3, dq_ring=4, dq_tiles_per_turn=2), d, 1024)
        with pytest.raises(ValueError, match="dq_ring 1 < dq_tiles_per_turn 2 x dq_writers 0"):
            half_gluon_bwd.kernel_constexprs(dict(cfg, dq_writers=0, dq_ring=1, dq_tiles_per_turn=2), d, 1024)
        with pytest.raises(ValueError, match="dq_writers"):
            half_gluon_bwd.kernel_constexprs(dict(cfg, dq_writers=4, dq_ring=8), d, 1024)
        for bad in (0, 5):
            with pytest.raises(ValueError, match="dq_tiles_per_turn"):
                half_gluon_bwd.kernel_constexprs(dict(cfg, dq_tiles_per_turn=bad, dq_ring=16), d, 1024)
        # without the writer the ring, writer count and tiles per turn do not matter: one turn per query tile
        no_w = dict(cfg, dq_writer=False, dq_writers=3, dq_ring=2, dq_tiles_per_turn=2)
        assert half_gluon_bwd.kernel_constexprs(no_w, d, 1024)["DQ_TPT"] == 1
        assert half_gluon_bwd.ordered_buffer_sizes(2, 3, 1000, d, no_w)[1] == 6 * 16 * 2
        turns = dict(cfg, dq_halves=False)
        assert half_gluon_bwd.ordered_buffer_sizes(2, 3, 1000, d, turns) == (2 * 3 * 1000 * d,
                                                                              6 * math.ceil(1000 / 64) * (d // 64))
        assert half_gluon_bwd.kernel_constexprs(cfg, d, 1024)["EVEN_N"]
        assert not half_gluon_bwd.kernel_constexprs(cfg, d, 1000)["EVEN_N"]
        assert half_gluon_bwd.kernel_constexprs(cfg, d, 1000)["HEAD_D"] == d
    with pytest.raises(ValueError, match="head dim"):
        half_gluon_bwd.get_config(96)
    # the dQ share in one 128-column part at D = 128: one counter per query tile
    one = dict(half_gluon_bwd.get_config(128), dq_cols=128, dq_halves=False)
    assert half_gluon_bwd.ordered_buffer_sizes(1, 1, 1000, 128, one)[1] == math.ceil(1000 / 64)
    assert half_gluon_bwd.kernel_constexprs(one, 128, 1000)["DQ_COLS"] == 128
    assert half_gluon_bwd.kernel_constexprs(half_gluon_bwd.get_config(64), 64, 1000)["DQ_COLS"] == 64


_CHILD = r"""
import json, torch
from visionattn.kernels import half_gluon_bwd as g
from visionattn.kernels.introspect import compile_for_arch
out = {}
# (head dim, dtype, keys, dq_writer, dq_writers, dq_tiles_per_turn: None = the default); the ring: a group per writer
for d, dtype, n_k, writer, writers, per_turn in (
        (64, torch.float16, 1024, True, None, None), (64, torch.bfloat16, 1000, True, None, None),
        (128, torch.float16, 1000, True, None, None), (64, torch.bfloat16, 1000, False, None, None),
        (64, torch.bfloat16, 1000, True, 0, 1), (64, torch.bfloat16, 1000, True, 1, 1),
        (64, torch.bfloat16, 1000, True, 3, 1), (64, torch.bfloat16, 1000, True, 2, 2),
        (128, torch.bfloat16, 1000, True, 0, 1), (128, torch.bfloat16, 1000, True, 1, 1),
        (128, torch.bfloat16, 1000, True, 1, 2)):
    cfg = dict(g.get_config(d), dq_writer=writer)
    if writers is not None:
        cfg.update(dq_writers=writers, dq_tiles_per_turn=per_turn, dq_ring=max(2, per_turn * max(writers, 1)))
    t = "fp16" if dtype == torch.float16 else "bf16"
    ptrs = dict(g.descriptor_types(cfg, d, dtype), LseRow="*fp32", Delta="*fp32", DK="*" + t, DV="*" + t, DQ="*" + t,
                DQACC="*fp32", Sem="*i32")
    r = compile_for_arch(g._half_bwd_kernel, ptrs, g.kernel_constexprs(cfg, d, n_k), num_warps=4, num_stages=1,
                         float_args=("qk_scale", "scale"), maxnreg=cfg["maxnreg"])
    name = f"{d}-{t}-{n_k}-" + ("halves" if not writer else f"writers{cfg['dq_writers']}x{cfg['dq_tiles_per_turn']}")
    out[name] = {"wgmma": r.wgmma, "local": r.local_bytes, "shared": r.shared_bytes, "warps": r.num_warps,
                 "writers": cfg["dq_writers"] if writer else None, "per_turn": cfg["dq_tiles_per_turn"]}
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
@needs_gluon
def test_compiles_for_hopper():
    """The kernel builds for sm_90: six wgmmas per consumer warpgroup (two consumers), 12 warps (the producer warp
    and the dQ writers' warps padded to a warpgroup), shared memory under Hopper's 232,448 bytes, with one and two
    query tiles per writer turn (the D = 64 default: 3 writers x 2 tiles, ring of 6); at head dim 64 no
    register spills without the writer, with it at most 32 bytes per writer partition (triton 3.6 / 3.8: values of
    the prologue that ptxas keeps in local memory across the register reallocation, reloaded once per
    partition)."""
    r = compile_in_child(_CHILD)
    assert {v["writers"] for v in r.values()} >= {0, 1, 2, 3}, r  # every writer count built
    assert {v["per_turn"] for v in r.values()} == {1, 2}, r  # one and two query tiles per turn
    for key, v in r.items():
        # S^T, dP^T, dV, dK and dQ's half of the columns over both consumers' keys (two wgmmas), per consumer
        assert v["wgmma"] == 12 and v["warps"] == 12, (key, v)
        assert 0 < v["shared"] <= 232448, (key, v)
        if key.startswith("64-"):
            assert v["local"] <= (0 if v["writers"] is None else 32 * max(v["writers"], 1)), (key, v)


def _reference(q, k, v, do, scale):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * scale
    out = torch.softmax(s, dim=-1) @ v64
    out.backward(do.double())
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), (q64.grad, k64.grad, v64.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 256, 256, 64), (1, 2, 1000, 1000, 64), (2, 3, 384, 384, 128),
                                   (1, 2, 777, 777, 128), (2, 2, 300, 520, 64)])
def test_gradients_match_float64_and_are_reproducible(shape, dtype):
    """dQ, dK, dV within the Triton backward's error of the float64 oracle (relative to the largest magnitude),
    bit-for-bit equal over repeated runs (ordered dQ adds)."""
    from visionattn.kernels import elsa_bwd

    B, H, Nq, Nk, D = shape
    if half_gluon_bwd._IMPORT_ERROR is not None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a compute capability 9.x GPU and Gluon")
    torch.manual_seed(0)
    q = torch.randn(B, H, Nq, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, H, Nk, D, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn(B, H, Nq, D, device="cuda", dtype=dtype)
    scale = D ** -0.5
    out64, lse64, ref = _reference(q, k, v, do, scale)
    out, lse = out64.to(dtype), lse64.float()
    runs = [half_gluon_bwd.half_backward(q, k, v, out, do, lse, scale) for _ in range(3)]
    mode = "fp16" if dtype == torch.float16 else "bf16"
    triton_grads = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, mode)[:3]
    for name, got, want, tri in zip("qkv", runs[0], ref, triton_grads):
        assert got.dtype == dtype and got.shape == want.shape, name
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        tri_err = ((tri.double() - want).abs().max() / want.abs().max()).item()
        assert err <= max(2 * tri_err, 2e-3 if dtype == torch.float16 else 1.6e-2), (name, err, tri_err)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
