"""How many of the package's files a call enters between the public function and the kernel launch (the first
``KernelCall.__call__``, whose file counts): a repeat call of a signature stays on its family module and the launch
module, which runs the plan the kernel module built; a first call also validates, dispatches and builds the plan
(docs/design.md draws the path).
Runs the kernels in the interpreter on the CPU (``backend="triton"``)."""
import os
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


@pytest.mark.parametrize("name", ["attention", "window"])
def test_a_repeat_call_enters_two_files_and_a_first_call_validates(name):
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("counts the interpreter's path on the CPU")
    call = _calls()[name]
    first = _files_entered(call)
    repeat = _files_entered(call)
    assert repeat == ["api.py" if name == "attention" else "window.py", "_launch.py"], repeat
    assert "checks.py" not in repeat and "dispatch.py" not in repeat  # no validation, no dispatch again
    assert "checks.py" in first and "dispatch.py" in first
    assert ("elsa_fwd.py" if name == "attention" else "window_fwd.py") in first  # the plan is built there
