"""Run an offline-compile snippet in a child process (``from offline_compile import compile_in_child``).

Kernels are interpreted functions under TRITON_INTERPRET=1 (how CI runs them); compiling them for
sm_90 needs a fresh interpreter with TRITON_INTERPRET=0 set before triton is imported.
"""
import json
import os
import subprocess
import sys


def compile_in_child(code: str, timeout: int = 550) -> dict:
    """Run ``code`` with TRITON_INTERPRET=0 and return the JSON object its last stdout line prints.

    Raises:
        AssertionError: the child failed (its stderr tail is the message).
    """
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
