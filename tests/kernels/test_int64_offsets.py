"""Row offsets in 64 bits: a row index times a row stride must not wrap at 2^31 elements.

A VGGT global attention over ~700 frames has ~730,000 tokens; read from timm's packed projection output its values
have a row stride of 3 x 16 x 64 = 3072 elements, so row 699,051 lies 2^31 elements in. A kernel that forms
``rows * stride`` in int32 (Triton keeps int32 x int32 products in int32) then reads or writes the wrong rows on
the GPU, silently or with an illegal address. The interpreter wraps the same way, but a tensor 2^31 elements long is
too large for a CPU test, so these tests check the cause in the compiled IR instead: offline sm_90 compiles of the
kernels that take user row strides, each of whose row strides must be widened to 64 bits (``arith.extsi``) before
it multiplies a row index (the main attention kernels form their tile offsets in 64 bits already).
"""
import pytest
from offline_compile import compile_in_child

_CHILD = r"""
import json, re
from visionattn.kernels import elsa_bwd, pasa_fwd, scaled_fp16
from visionattn.kernels.introspect import compile_for_arch

def widened(kernel, pointers, constexprs, units, floats, strides, warps=4, stages=1):
    r = compile_for_arch(kernel, pointers, constexprs, num_warps=warps, num_stages=stages, unit_ints=units,
                         float_args=floats)
    return {s: bool(re.search(rf"arith\.extsi %{s} : i32 to i64", r.ttgir)) for s in strides}

out = {}
p = {n: "*fp16" for n in ("Q", "K", "V", "O", "W")}
p.update(BIAS="*fp32", MASK="*u8", MU="*fp32", C="*fp32", W_INV="*fp32")
out["pasa_fwd"] = widened(
    pasa_fwd._pasa_fwd_kernel, p,
    dict(RECOVER=True, HAS_BIAS=True, HAS_MASK=True, IS_CAUSAL=False, BLOCK_M=64, BLOCK_N=128, BLOCK_D=64,
         BLOCK_DV=64, EVEN_D=True, EVEN_DV=True),
    ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_bn", "stride_mn"),
    ("post_scale", "inv_a_full", "inv_a_tail"),
    ("stride_qm", "stride_kn", "stride_vn", "stride_om", "stride_bm", "stride_mm"))
p = {n: "*fp16" for n in ("K", "KP", "W", "Q")}
p.update(MU="*fp32", C="*fp32", W_INV="*fp32")
out["pasa_shift_keys"] = widened(
    pasa_fwd._pasa_shift_keys_kernel, p, dict(RECOVER=True, CENTER=True, BLOCK_N=128, BLOCK_D=64, BLOCK_QM=64),
    ("stride_kd", "stride_qd"),
    ("scale", "a_full", "b_full", "a_tail", "b_tail", "w_full", "w_tail", "inv_a_full", "inv_a_tail"),
    ("stride_kn",))
p = {n: "*fp32" for n in ("Q", "O", "DO", "LSE", "Delta", "LseRow", "K", "V")}
p["E"] = p["Zero"] = "*i32"
out["bwd_preprocess"] = widened(
    elsa_bwd._bwd_preprocess_kernel, p, dict(BLOCK_M=64, BLOCK_DV=64, BLOCK_D=64, HEAD_MAX=True, ZERO_BLOCK=16),
    ("sod", "sdd", "sqd", "skd", "svd"), (), ("som", "sdm", "sqm", "skn", "svn"))
p = {n: "*fp32" for n in ("Q", "K", "V", "Scales")}
p.update(E="*i32", Q16="*fp16", K16="*fp16", V16="*fp16")
out["forward_operands"] = widened(
    scaled_fp16._forward_operands_kernel, p, dict(HEAD_D=64, BLOCK_M=64, TARGET=8, LIMIT=100, P_EXP=15),
    ("sqd", "skd", "svd"), ("qk_scale",), ("sqm", "skn", "svn"))
p = {n: "*fp32" for n in ("Q", "K", "V")}
p["E"] = "*i32"
out["head_max"] = widened(scaled_fp16._head_max_kernel, p, dict(HEAD_D=64, BLOCK_M=64), ("sqd", "skd", "svd"), (),
                          ("sqm", "skn", "svn"))
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_row_strides_multiply_in_64_bits():
    r = compile_in_child(_CHILD)
    narrow = {kernel: [s for s, wide in strides.items() if not wide] for kernel, strides in r.items()}
    assert not any(narrow.values()), f"row strides multiplied in int32: {narrow}"
