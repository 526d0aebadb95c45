"""Offline sm_90 compiles (visionattn.kernels.introspect): no GPU needed, Triton's bundled ptxas.

The test run executes the kernels interpreted (TRITON_INTERPRET=1, tests/conftest.py), which
cannot compile, so the compiles run in a child process with TRITON_INTERPRET=0.
"""

import pytest
from offline_compile import compile_in_child

_CHILD = r"""
import json
from visionattn.kernels import elsa_fwd
from visionattn.kernels.introspect import HOPPER_SHARED_LIMIT, compile_for_arch
ptr = {n: "*fp32" for n in ("Q", "K", "V", "Bias", "Out", "Lse", "WsM", "WsS", "WsW")}
ptr["Mask"] = "*i1"
def run(precision, stages):
    const = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=16, BLOCK_DV=16, PRECISION=precision, IS_CAUSAL=False,
                 HAS_BIAS=False, HAS_MASK=False, SPLIT=False, EVEN_D=True, EVEN_DV=True, DOT_UPCAST=False,
                 LAZY_V=False, WRITE_LSE=False)
    r = compile_for_arch(elsa_fwd._elsa_fwd_kernel, ptr, const, num_warps=4, num_stages=stages,
                         unit_ints=("sqd", "skd", "svd", "sod", "sbn", "smn"), float_args=("qk_scale",))
    return {"shared": r.shared_bytes, "wgmma": r.wgmma, "regs": r.registers, "local": r.local_bytes,
            "programs": r.programs_per_sm}
print(json.dumps({"limit": HOPPER_SHARED_LIMIT, "f16x3_1": run("f16x3", 1), "f16x3_3": run("f16x3", 3),
                  "ieee_2": run("ieee", 2)}))
"""


@pytest.mark.timeout(600)
def test_shared_memory_grows_with_pipelining_and_tensor_core_paths_use_wgmma():
    """More pipeline stages buffer more K/V tiles; the split-FP16 products run as Hopper wgmma
    (3 dots x 2 per KV-loop copy for f16x3), the IEEE FMA path has none."""
    r = compile_in_child(_CHILD)
    assert 0 < r["f16x3_1"]["shared"] < r["f16x3_3"]["shared"] <= r["limit"]
    assert r["f16x3_3"]["wgmma"] >= 6
    assert r["ieee_2"]["wgmma"] == 0
    for v in (r["f16x3_1"], r["f16x3_3"], r["ieee_2"]):  # read from the cubin by Triton's bundled cuobjdump
        assert 0 < v["regs"] <= 255 and v["local"] >= 0 and v["programs"] >= 1


def test_programs_per_sm_follows_the_occupancy_rules():
    from visionattn.kernels.introspect import programs_per_sm

    # registers are allocated per warp in units of 256: 159 -> 160 per thread, 5,120 per warp, 12 warps
    assert programs_per_sm(159, 40_960, 4) == 3
    assert programs_per_sm(95, 40_960, 4) == 5  # 96 regs: 21 warps -> 5 programs; shared: 5 x 41 KiB
    assert programs_per_sm(255, 0, 8) == 1
    assert programs_per_sm(32, 0, 1) == 32  # the block limit
    assert programs_per_sm(32, 200_000, 4) == 1 and programs_per_sm(32, 240_000, 4) == 0
    regs = [programs_per_sm(r, 16_384, 4) for r in range(16, 256, 8)]
    shared = [programs_per_sm(64, b, 4) for b in range(0, 230_000, 4_096)]
    assert regs == sorted(regs, reverse=True) and shared == sorted(shared, reverse=True)


def test_interpreted_kernels_are_refused_with_the_fix():
    from visionattn.kernels import elsa_fwd
    from visionattn.kernels.introspect import compile_for_arch

    if hasattr(elsa_fwd._elsa_fwd_kernel, "cache_key"):
        pytest.skip("kernels are compiled (TRITON_INTERPRET=0) in this test run")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"):
        compile_for_arch(elsa_fwd._elsa_fwd_kernel, {}, {}, num_warps=4, num_stages=1)


_CHILD_BWD = r"""
import json, sys
sys.path.insert(0, TOOLS)
import check_kernels_offline as tool
from visionattn.kernels import elsa_bwd
from visionattn.kernels.introspect import compile_for_arch
tiles = elsa_bwd.BwdConfig(elsa_bwd.KernelTiles(32, 32, 4, 1), elsa_bwd.KernelTiles(32, 32, 4, 1))
out = {}
for products in ("f16x3", "f16x3-head"):
    for meta, job in tool._split_bwd_jobs("t", "fp32", tiles, 32, False, False, False, products):
        r = compile_for_arch(**job)
        out[meta["kernel"] + " " + products] = r.instructions
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_instruction_counts_show_the_per_head_scales_saving():
    """The cubin's static SASS instruction count (``nvdisasm``): the dK/dV and dQ kernels with per-head scaled right
    operands (f16x3-head) issue fewer instructions than with per-tile column scales, whose maxima and transposes
    they drop."""
    import os

    from testdata import REPO

    r = compile_in_child(_CHILD_BWD.replace("TOOLS", repr(os.path.join(REPO, "tools"))))
    assert all(n is not None and n > 100 for n in r.values()), r
    for kernel in ("bwd-dkdv", "bwd-dq"):
        assert r[f"{kernel} f16x3-head"] < r[f"{kernel} f16x3"], r


_HEAD_CHILD = r"""
import json, sys
sys.path.insert(0, TOOLS)
import check_kernels_offline as tool
from visionattn.kernels.introspect import compile_for_arch
out = {}
for meta, job in tool._backward_jobs(quick=True):
    if meta["kernel"] == "bwd-whole-head":
        r = compile_for_arch(**job)
        out[meta["variant"]] = [r.shared_bytes, r.local_bytes, r.registers]
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_whole_head_backward_first_tiles_fit_hopper_without_spills():
    """The whole-head backward's first tiles at ViT-B/16 224 (256 rows) and ViT-L/14 224 (256 + the 16-row tail)
    compile for sm_90 within its shared memory and without spilling registers, so those calls run the tiles that
    were timed (an over-limit first tile would fall back to slower ones on the GPU)."""
    import os

    from testdata import REPO
    from visionattn.kernels.introspect import HOPPER_SHARED_LIMIT

    r = compile_in_child(_HEAD_CHILD.replace("TOOLS", repr(os.path.join(REPO, "tools"))))
    assert set(r) == {"dense D=64 N=197 bf16", "dense D=64 N=257 bf16"}, r
    for variant, (shared, spill, registers) in r.items():
        assert shared <= HOPPER_SHARED_LIMIT and spill == 0 and registers <= 255, (variant, r)


_VARLEN_CHILD = r"""
import json
from visionattn.kernels import varlen_fwd
from visionattn.kernels._launch import head_blocks
from visionattn.kernels.elsa_fwd import _precision, get_config
from visionattn.kernels.introspect import compile_for_arch
out = {}
for mode in ("bf16", "fp16"):
    cfg = get_config(mode, 64, 64, 1732)  # the ragged Table 2 batch's longest sequence: the long-key tiles
    precision = _precision(mode, None)
    block_d, block_dv = head_blocks(64, 64)
    elt = "*bf16" if mode == "bf16" else "*fp16"
    for row_offsets, ordered in ((False, False), (True, False), (False, True)):
        ptr = dict(Q=elt, K=elt, V=elt, CuQ="*i32", CuK="*i32", RowOff="*i64" if row_offsets else elt,
                   Tiles="*i32" if ordered else elt, Out=elt, Lse=elt, WsM=elt, WsS=elt, WsW=elt)
        const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                     PRECISION=precision, IS_CAUSAL=False, EVEN_D=True, EVEN_DV=True, DOT_UPCAST=False, LAZY_V=False,
                     WRITE_LSE=False, SPLIT=False, ROW_OFFSETS=row_offsets, TILED=ordered)
        options = varlen_fwd._register_cap(precision, cfg, block_d, block_dv)  # as _VarlenPlan launches it
        r = compile_for_arch(varlen_fwd._varlen_fwd_kernel, ptr, const, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages, unit_ints=("sqd", "skd", "svd", "sod"),
                             float_args=("qk_scale",), **options)
        out[f"{mode}-{'rows' if row_offsets else 'packed'}{'-ordered' if ordered else ''}"] = {"regs": r.registers, "local": r.local_bytes,
                                                                  "programs": r.programs_per_sm,
                                                                  "warps": cfg.num_warps}
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_varlen_half_long_key_tiles_fit_two_programs_per_sm():
    """The ragged forward's fp16 / bf16 long-key tiles (8 warps) as launched (with their register cap) hold two
    programs per SM, packed, read in place or through the longest-first order table, without spills: triton 3.6's ptxas gave the packed launch 138
    registers uncapped (one program per SM, the Table 2 batch 0.111 ms against 0.080 ms at two)."""
    r = compile_in_child(_VARLEN_CHILD)
    for name, v in r.items():
        if v["regs"] is None:
            pytest.skip("cuobjdump unavailable: no register count")
        assert v["warps"] == 8 and v["regs"] <= 128 and v["local"] == 0 and v["programs"] >= 2, (name, v)
