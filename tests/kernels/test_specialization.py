"""Kernels specialise on what changes their code, never on sequence lengths or batch sizes: every Triton kernel's
integer arguments that count tokens, windows, images or splits are ``do_not_specialize`` (a new length
or batch size then compiles nothing new; Triton would otherwise compile a variant per "divisible by 16" / "equal
to 1" class of each). Read from the kernels as the interpreter loads them (``kwargs``) or as the JIT does
(``params``)."""
import inspect

import pytest

from visionattn.kernels import (elsa_bwd, elsa_fwd, half_gluon, pasa_fwd, varlen_bwd, varlen_fwd, window_bwd,
                                window_fwd)

# argument names that carry a length, a count of sequences / images / windows, or a split of them; head counts,
# head dims, strides and the window size N of the window kernels (model constants) may be specialised on
LENGTHS = {"B", "Nq", "Nk", "N_Q", "N_K", "total_q", "n_tiles", "n_m_tiles", "n_splits", "tiles_per_split",
           "CHUNK", "N_CHUNKS", "PLANE", "n_add", "B_OUT", "H_OUT", "R_H", "n_red", "per_chunk", "BW", "n_img",
           "n_work", "n_whole", "pieces", "piece_tiles"}
MODULES = (elsa_fwd, elsa_bwd, half_gluon, pasa_fwd, varlen_fwd, varlen_bwd, window_fwd, window_bwd)


def _kernels():
    for mod in MODULES:
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and hasattr(obj, "fn"):
                yield f"{mod.__name__.rsplit('.', 1)[-1]}.{name}", obj


def _unspecialised(kernel) -> set[str]:
    params = getattr(kernel, "params", None)
    if params:  # JITFunction
        return {p.name for p in params if p.do_not_specialize}
    names = (getattr(kernel, "kwargs", {}) or {}).get("do_not_specialize") or []  # InterpretedFunction
    return set(names)


KERNELS = dict(_kernels())


def test_every_launched_kernel_is_found():
    assert {"elsa_fwd._elsa_fwd_kernel", "elsa_bwd._bwd_dq_kernel", "elsa_bwd._bwd_dkdv_kernel",
            "window_bwd._window_bwd_fused_kernel", "varlen_fwd._varlen_fwd_kernel",
            "pasa_fwd._pasa_fwd_kernel", "half_gluon._piece_merge_kernel"} <= set(KERNELS)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_lengths_are_runtime_values(name):
    kernel = KERNELS[name]
    args = set(inspect.signature(kernel.fn).parameters)
    specialised = (args & LENGTHS) - _unspecialised(kernel)
    assert not specialised, f"{name} specialises on {sorted(specialised)}: add them to do_not_specialize"
