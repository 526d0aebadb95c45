"""tools/bench_cold_start.py's compile accounting, on CPU: the listener its child processes install counts a
kernel Triton compiles (with its compile seconds, its name and constexprs) and not a cache hit of the same
kernel."""
from offline_compile import compile_in_child
from testdata import load_script

tool = load_script("tools/bench_cold_start.py")

# a child's compile of one small forward kernel variant: run() compiles it, or finds it compiled
_KERNEL = r"""
import json
from visionattn.kernels import elsa_fwd
from visionattn.kernels.introspect import compile_for_arch
ptr = {n: "*fp32" for n in ("Q", "K", "V", "Bias", "Out", "Lse", "WsM", "WsS", "WsW")}
ptr["Mask"] = "*i1"
const = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=16, BLOCK_DV=16, PRECISION="ieee", IS_CAUSAL=False, HAS_BIAS=False,
             HAS_MASK=False, SPLIT=False, EVEN_D=True, EVEN_DV=True, DOT_UPCAST=False, LAZY_V=False, WRITE_LSE=False)
run = lambda: compile_for_arch(elsa_fwd._elsa_fwd_kernel, ptr, const, num_warps=4, num_stages=1,
                               unit_ints=("sqd", "skd", "svd", "sod", "sbn", "smn"), float_args=("qk_scale",))
"""

_COMPILE_TWICE = _KERNEL + r"""
run()
COMPILED["phase"] = "other"
run()  # the same kernel again: a cache hit
print(json.dumps({**compiled("first"), **compiled("other")}))
"""


def test_listener_counts_compiles_not_cache_hits(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # empty: the first compile is a real one
    res = compile_in_child(tool._LISTENER + _COMPILE_TWICE)
    assert res["first_kernels_compiled"] == 1 and res["first_compile_s"] > 0
    assert res["other_kernels_compiled"] == 0 and res["other_compile_s"] == 0
    stages = res["first_compile_stages_s"]
    # Triton's stages, each timed: they add up to the kernel's compile time
    assert {"init", "ttir", "ttgir", "llir", "ptx", "cubin"} <= set(stages) and min(stages.values()) >= 0
    assert abs(sum(stages.values()) - res["first_compile_s"]) <= 1e-3 + 0.01 * res["first_compile_s"]
    assert res["other_compile_stages_s"] == {} and res["other_kernels"] == []
    (name,) = res["first_kernels"]  # the kernel, the constexprs that make the variant, its seconds
    assert name.startswith("_elsa_fwd_kernel(") and "PRECISION=ieee" in name and "BLOCK_M=64" in name
    assert name.endswith(" s") and "sqd" not in name  # inner strides folded to 1 are not variant constexprs


_COMPILE_IN_A_THREAD = _KERNEL + r"""
import threading
COMPILED["phase"] = "ahead"
t = threading.Thread(target=run); t.start(); t.join()  # as CompileAhead compiles: in another thread
COMPILED["phase"] = "first"
run()  # the first call then finds it compiled
print(json.dumps({**compiled("ahead"), **compiled("first")}))
"""


def test_listener_books_a_compile_in_another_thread_to_the_ahead_phase(tmp_path, monkeypatch):
    """The compile-ahead row's accounting: a kernel compiled by a background thread while the phase is "ahead"
    counts there, and the first call that then reuses it compiles nothing."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    res = compile_in_child(tool._LISTENER + _COMPILE_IN_A_THREAD)
    assert res["ahead_kernels_compiled"] == 1 and res["ahead_compile_s"] > 0
    assert res["first_kernels_compiled"] == 0 and res["first_kernels"] == []
