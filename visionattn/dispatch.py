"""Backend choice: Triton kernels (GPU) or the PyTorch monoid reference (CPU).

One environment variable, read once at import: ``VISIONATTN_BACKEND`` =
``auto`` (default) | ``triton`` | ``reference``. :func:`set_backend` and the
:func:`use_backend` context manager override it in code; the ``backend=``
argument of :func:`visionattn.attention` overrides both for one call.

``auto``: CUDA tensors go to the Triton kernels, CPU tensors to the reference.
``triton`` on CPU tensors needs ``TRITON_INTERPRET=1`` (how CI tests kernels).
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

from .kernels._launch import interpreting

__all__ = ["BACKENDS", "get_backend", "set_backend", "use_backend", "resolve_backend", "warn_once",
           "functorch_fallback", "recording"]

BACKENDS = ("auto", "triton", "reference")


def recording() -> bool:
    """Whether ``torch.compile`` or ``torch.jit.trace`` records the call being made: the kernels then run as their
    custom ops, which the recorded graph holds (a direct launch would write its output where neither sees it), and
    no call-signature cache, inference cache or data-dependent shortcut is taken."""
    return torch.compiler.is_compiling() or torch._C._is_tracing()


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not known; expected one of {BACKENDS} "
                         f"(argument `backend` or environment variable VISIONATTN_BACKEND)")
    return name


_backend = _check(os.environ.get("VISIONATTN_BACKEND", "auto").strip().lower() or "auto")
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a RuntimeWarning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def functorch_fallback(what: str) -> bool:
    """True (after a one-time warning) when a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ``jacrev``,
    ``hessian``, ...) is running: the kernels' autograd functions carry no functorch rules (their launches read
    raw data pointers, which transformed tensors do not have), so ``what`` then runs the PyTorch reference, which
    the transforms differentiate and batch exactly. Not consulted under ``torch.compile`` (its graph holds the
    kernels as custom ops)."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return False
    warn_once(f"functorch:{what}", f"visionattn.{what}: a torch.func transform (grad, vmap, jvp, ...) is active and "
                                  f"the Triton kernels have no functorch rules; running the exact PyTorch reference "
                                  f"instead (the transform applies to it)")
    return True


def get_backend() -> str:
    """The process-wide backend (``auto``, ``triton`` or ``reference``)."""
    return _backend


def set_backend(name: str) -> None:
    """Set the process-wide backend.

    Raises:
        ValueError: ``name`` is not one of :data:`BACKENDS`.
    """
    global _backend
    _backend = _check(name)


@contextlib.contextmanager
def use_backend(name: str):
    """Context manager: run the block with backend ``name``, then restore the previous one."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return interpreting()


def resolve_backend(backend: str | None, device_type: str) -> str:
    """Concrete backend (``triton`` or ``reference``) for tensors on ``device_type``.

    Raises:
        ValueError: unknown ``backend``.
        RuntimeError: ``triton`` asked for CPU tensors without ``TRITON_INTERPRET=1``.
    """
    name = _check(backend) if backend is not None else _backend
    if name == "auto":
        return "triton" if device_type == "cuda" else "reference"
    if name == "triton" and device_type != "cuda" and not triton_interpreting():
        raise RuntimeError("backend='triton' with CPU tensors needs TRITON_INTERPRET=1 set before "
                           "triton is imported; move the tensors to CUDA or use backend='reference'")
    return name
