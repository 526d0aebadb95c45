"""The record every result carries: the device, the software versions and the command that produced it.

Results without it cannot be compared or reproduced (docs/benchmarks/). The tools and the reconstruction
pipeline put :func:`environment` into every JSON they write.
"""
from __future__ import annotations

import os
import platform
import shlex
import sys
from typing import Any

import torch

__all__ = ["environment", "command_line"]


def command_line() -> str:
    """The command that started this process, shell-quoted."""
    return " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv)


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions and hardware every committed result must name (GPU, torch, triton, timm, Python).

    Args:
        extra: tool-specific entries merged in last (they win over the standard keys).
    """
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": (torch.cuda.get_device_name() if torch.cuda.is_available()
                   else f"CPU ({platform.processor() or platform.machine()})"),
        "command": command_line(),
    }
    for name in ("triton", "timm", "diffusers"):
        env[name] = _version(name)
    if extra:
        env.update(extra)
    return env


def _version(name: str) -> str | None:
    """A package's version without importing it (importing diffusers and timm takes seconds): the loaded
    module's own ``__version__`` when it is imported already, else its installed distribution's; None if
    neither."""
    from importlib import metadata

    if name in sys.modules:
        return getattr(sys.modules[name], "__version__", None)
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
