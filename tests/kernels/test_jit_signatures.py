"""Signatures of the Triton / Gluon JIT functions under visionattn.kernels, read from their source.

Triton 3.6 (the version of the GPU runs behind docs/benchmarks) hands a JIT helper's parameter default to the callee
as the bare Python value when a caller leaves the argument out: a string default of a ``tl.constexpr`` parameter
then fails the compile ("'str' object has no attribute 'type'"), while the interpreter (how CI runs the kernels) and
newer Tritons take it, so no CPU run of the kernels sees it. JIT functions therefore declare no defaults: every
caller passes every argument.
"""
import ast
from pathlib import Path

import visionattn.kernels

KERNELS = Path(visionattn.kernels.__file__).parent


def _jit_functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def test_jit_functions_declare_no_parameter_defaults():
    found = [(path, fn) for path in sorted(KERNELS.glob("*.py")) for fn in _jit_functions(path)]
    assert len(found) > 20, f"the scan found only {len(found)} JIT functions under {KERNELS}"
    with_defaults = [f"{path.name}:{fn.lineno} {fn.name}" for path, fn in found
                     if fn.args.defaults or any(fn.args.kw_defaults)]
    assert not with_defaults, f"JIT functions with parameter defaults (pass the value at every call): {with_defaults}"
