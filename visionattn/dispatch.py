"""Backend choice: one backend table per op family, read by one dispatcher (:func:`choose`).

A family (:mod:`visionattn.api` dense and PASA, :mod:`visionattn.window`, :mod:`visionattn.varlen`) lists its
backends in priority order as a :class:`BackendTable` of :class:`Backend` rows (xformers' pattern): each row has
``unsupported_reason(...) -> str | None`` and ``plan(...)``, which runs the call (and keeps its runner for the
call signature). :func:`choose` starts at the preferred row (:func:`preferred`: the ``backend=`` argument, the
process-wide setting, the device), skips each row that gives a reason, and warns once naming that reason when it
falls back to a later row. The reasons are the text of those warnings; :func:`fallback_reasons` lists the ones
seen in this process.

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
from typing import Callable, NamedTuple

import torch

from .kernels._launch import interpreting, recording

__all__ = ["BACKENDS", "Backend", "BackendTable", "choose", "preferred", "fallback_reasons", "get_backend",
           "set_backend", "use_backend", "resolve_backend", "warn_once", "functorch_fallback", "recording"]

BACKENDS = ("auto", "triton", "reference")


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


class Backend(NamedTuple):
    """One row of a family's backend table.

    ``unsupported_reason(*args) -> str | None``: why this backend cannot run the call (None: it can);
    ``plan(*args)``: run the call on this backend, keeping a runner for its signature where the family caches
    one. Both take the family's validated arguments.
    """
    name: str
    unsupported_reason: Callable
    plan: Callable


class BackendTable(NamedTuple):
    """A family's backends in priority order and the warning a fallback prints (``fallback.format(reason=...)``)."""
    family: str
    rows: tuple
    fallback: str


_reasons: dict[str, list[str]] = {}


def choose(table: BackendTable, start: str, *args) -> Backend:
    """The backend that runs a call: the first row of ``table`` from the one named ``start`` on whose
    ``unsupported_reason(*args)`` is None. A row passed over for a reason warns once per reason (the table's
    ``fallback`` text) and records it (:func:`fallback_reasons`). The last row must take every call."""
    rows = table.rows
    i = 0
    while rows[i].name != start:
        i += 1
    for row in rows[i:-1]:
        reason = row.unsupported_reason(*args)
        if reason is None:
            return row
        seen = _reasons.setdefault(table.family, [])
        if reason not in seen:
            seen.append(reason)
        warn_once(f"{table.family}-fallback:{reason}", table.fallback.format(reason=reason))
    return rows[-1]


def fallback_reasons() -> dict[str, list[str]]:
    """``{family: [reason, ...]}``: why calls of each family fell back to a later backend in this process, in the
    order first seen (the reasons the fallback warnings named)."""
    return {family: list(reasons) for family, reasons in _reasons.items()}


def preferred(backend: str | None, device_type: str, what: str) -> str:
    """The row a call starts at: :func:`resolve_backend`, and ``reference`` where a ``torch.func`` transform is
    active (:func:`functorch_fallback`, warned once naming ``what``). CUDA tensors under the default ``auto`` skip
    the lookup."""
    if device_type == "cuda" and backend is None and _backend == "auto":
        name = "triton"
    else:
        name = resolve_backend(backend, device_type)
    if name == "triton" and functorch_fallback(what):
        return "reference"
    return name
