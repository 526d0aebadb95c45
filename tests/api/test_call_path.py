"""How many of the package's files a call enters between the public function and the kernel launch (the first
``KernelCall.__call__``, whose file counts): a repeat call of a signature stays on its family module and the launch
module, which runs the plan the kernel module built; a first call also dispatches and builds the plan, and
validates in its family module (docs/design.md draws the path).
Runs the kernels in the interpreter on the CPU (``backend="triton"``). A call signature's path is counted with the
kernel modules imported, as any earlier kernel call of the process imports them; the first kernel call of a process
(counted in a fresh interpreter) also imports its kernel module and what that module's kernels are built from.
"""
import os
import subprocess
import sys

import pytest
import torch

import visionattn as va
from visionattn.kernels import _launch

ROOTS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (va, _launch))
LAUNCH = os.path.abspath(_launch.__file__)


def _files_entered(fn) -> list[str]:
    files, done = [], [False]

    def prof(frame, event, arg):
        path = frame.f_code.co_filename
        if done[0] or event != "call" or not path.startswith(ROOTS):
            return
        if path not in files:
            files.append(path)
        if path == LAUNCH and frame.f_code.co_name == "__call__":
            done[0] = True

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    assert done[0], "no kernel launch recorded"
    return [os.path.basename(f) for f in files]


def _calls():
    # shapes no other test uses, so the first call here is the first of its signature in the process
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 19, 16, generator=g, dtype=torch.float16) for _ in range(3))
    wq, wk, wv = (torch.randn(6, 3, 9, 16, generator=g, dtype=torch.float16) for _ in range(3))
    bias = torch.randn(3, 9, 9, generator=g, dtype=torch.float16)
    return {
        "attention": lambda: va.attention(q, k, v, mode="fp16", backend="triton"),
        "window": lambda: va.window_attention(wq, wk, wv, relative_position_bias=bias, num_windows=2, mode="fp16",
                                              backend="triton"),
    }


# files entered by a first and a repeat call of a signature, in order
FIRST = {"attention": ["api.py", "_launch.py", "dispatch.py", "elsa_fwd.py"],
         "window": ["window.py", "_launch.py", "dispatch.py", "window_fwd.py"]}
REPEAT = {"attention": ["api.py", "_launch.py"], "window": ["window.py", "_launch.py"]}


@pytest.mark.parametrize("name", ["attention", "window"])
def test_a_repeat_call_enters_two_files_and_a_first_call_dispatches_and_plans(name):
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("counts the interpreter's path on the CPU")
    from visionattn.kernels import elsa_fwd, window_fwd  # noqa: F401  (imported as an earlier kernel call would)

    call = _calls()[name]
    first = _files_entered(call)
    repeat = _files_entered(call)
    assert first == FIRST[name], first  # validated in the family module, dispatched, planned in the kernel module
    assert repeat == REPEAT[name], repeat  # no validation, no dispatch, no planning again


@pytest.mark.parametrize("name", ["attention", "window"])
def test_the_first_kernel_call_of_a_process_imports_only_its_kernel_module(name):
    """In a fresh interpreter the first call also runs the import of its kernel module, which imports the
    split-FP16 helpers its kernels are built from; the Gluon modules are not imported for CPU tensors, nor the
    package's lazy attributes asked."""
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("counts the interpreter's path on the CPU")
    code = f"import test_call_path as t; print(t._files_entered(t._calls()[{name!r}]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)),
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert out.strip() == str([*FIRST[name], "split16.py"]), out
