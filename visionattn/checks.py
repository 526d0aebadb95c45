"""Argument checks, mode casts and call-signature keys shared by every op family.

Each family module (:mod:`visionattn.api` dense, :mod:`visionattn.window`, :mod:`visionattn.varlen`,
:mod:`visionattn.pasa`) validates its own arguments with these helpers; the errors name the argument and what
is expected. The dense and window families test the common case themselves (a mode's name, a bool flag, a finite
float or no scale, dense tensors on one device, unit last strides) and call a helper here only where that test
fails, so that a first call of a signature does not enter this module. :func:`qkv_key` / :func:`tensor_key`
describe what a cached runner depends on, so a family's call cache (:class:`visionattn.kernels._launch.PlanCache`,
looked up by ``lookup``) keys a public call by them.
"""
from __future__ import annotations

import math
import numbers

import torch

from .kernels._launch import qkv_key, tensor_key, unit_last_stride
from .modes import MODES, Mode, get_mode

__all__ = ["FLOAT_DTYPES", "KERNEL_DTYPES", "BACKWARD_MODES", "has_backward", "first_order_only", "check_tensor",
           "check_dense", "check_operand", "check_devices", "check_flags", "cast_checked", "check_float16_range",
           "caster", "mode_of", "relaid_inputs", "qkv_key", "tensor_key"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# the dtypes the kernels read and write; float64 callers get FP32 kernels and one cast
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# modes whose kernels have a backward (kernels/elsa_bwd.py, window_bwd.py, varlen_bwd.py): the dense ones
BACKWARD_MODES: frozenset = frozenset(name for name, m in MODES.items() if "dense" in m.kernels)


def has_backward(mode: str) -> bool:
    """Whether the kernels of ``mode`` have a backward (else gradients need the reference path)."""
    return mode in BACKWARD_MODES


def first_order_only(what: str) -> None:
    """Raise where autograd asks a kernel backward for a graph of its own (``create_graph=True``: a double
    backward, e.g. a gradient penalty): the backward kernels return first-order gradients only, which would
    silently be constants in the second differentiation. Inside a backward, grad mode is on exactly then.

    Raises:
        RuntimeError: naming ``what`` and the fix (the reference backend differentiates twice).
    """
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what}: double backward (create_graph=True, e.g. a gradient penalty) through the "
                           f"attention kernels is not supported: their backward is first-order only; run this "
                           f"call with backend='reference' (pure PyTorch, differentiable twice)")


def mode_of(mode: str | Mode) -> Mode:
    """The :class:`Mode` of ``mode`` (a name looked up directly, else :func:`get_mode`, which raises for an unknown
    one)."""
    md = MODES.get(mode) if isinstance(mode, str) else None
    return md if md is not None else get_mode(mode)


def relaid_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``((q, k, v), relaid)``: the three with unit last strides, the only layout the kernels take
    (:func:`visionattn.kernels._launch.unit_last_stride`: one copy of a tensor whose head dim is not of unit stride),
    and whether one was laid out, in which case a family keeps no cached runner for the call signature (its runner
    would pass the caller's layout on)."""
    if q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
        return (q, k, v), False
    return tuple(unit_last_stride(t) for t in (q, k, v)), True


def check_tensor(name: str, t, rank: int = 4, layout: str = "[B, H, N, D]") -> None:
    """Raise naming ``name`` where ``t`` is not a dense float tensor of ``rank`` dims (the first check that fails:
    not a tensor, a nested or sparse tensor, the rank, the dtype)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(name, t)
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of float16, bfloat16, float32, float64")


def check_dense(name: str, t: torch.Tensor) -> None:
    """Raise a TypeError naming ``name`` for a nested or sparse (non-strided) tensor: the kernels and the reference
    read dense strided memory."""
    if t.is_nested:
        raise TypeError(f"{name} is a nested tensor; attention takes dense [B, H, N, D] tensors: for ragged "
                        f"batches use visionattn.varlen_attention (it takes jagged nested tensors)")
    if t.layout is not torch.strided:
        raise TypeError(f"{name} is a {t.layout} tensor; attention takes dense (strided) tensors: pass "
                        f"{name}.to_dense()")


def check_operand(name: str, t, hint: str) -> None:
    """Raise naming ``name`` where an optional tensor argument (bias, mask) is not a dense tensor; ``hint`` says
    what to pass instead of an array of another library."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}"
                        + (f"; {hint}" if hasattr(t, "__array__") else ""))
    check_dense(name, t)


def check_devices(named: dict) -> None:
    """Raise where the tensors of ``named`` ({argument name: tensor or None}) are not on one device, or are on the
    ``meta`` device (shapes without data: nothing to compute from).

    Raises:
        ValueError: naming each argument's device, or the meta tensors.
    """
    devices = {name: t.device for name, t in named.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{name} on {d}" for name, d in devices.items())
        hint = (" (a meta tensor is a shape without data: materialise it first)"
                if any(d.type == "meta" for d in devices.values()) else "")
        raise ValueError(f"all inputs must be on one device, got {listed}{hint}")
    if first.type == "meta":
        name, *others = devices
        also = f", and so are {', '.join(others)}" if others else ""
        raise ValueError(f"{name} is a meta tensor (a shape without data: no values to compute attention from{also}); "
                         f"pass tensors on a real device (a model built on 'meta' needs .to_empty(device=...) and its "
                         f"weights loaded first)")


def check_flags(is_causal, scale, head_dim: int) -> float:
    """Check ``is_causal`` (a bool, as SDPA requires) and ``scale`` (None or a finite real number); return the
    logit scale as a float (``head_dim ** -0.5`` for None).

    Raises:
        TypeError: ``is_causal`` not a bool; ``scale`` not a real number (a string, a tensor of more than
            one element, a complex number).
        ValueError: ``scale`` not finite; a tensor ``scale`` that requires grad (it would get none) or is a
            meta tensor.
    """
    if is_causal is not True and is_causal is not False:
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__} {is_causal!r}")
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.is_complex():
            raise TypeError(f"scale must be a real number, got a tensor of shape {tuple(scale.shape)}")
        if scale.requires_grad and torch.is_grad_enabled():
            raise ValueError("scale is a tensor that requires grad, but the logit scale is taken as a number and gets "
                             "no gradient (SDPA refuses a tensor scale); to learn it, multiply q by it and pass "
                             "scale=1.0, or pass float(scale) to train without its gradient")
        if scale.is_meta:
            raise ValueError("scale is a meta tensor (no value); pass a number")
        scale = scale.item()
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale={scale!r}; expected a finite number (default 1/sqrt(head_dim))")
    return scale


def cast_checked(t: torch.Tensor, dtype: torch.dtype, name: str, mode: str) -> torch.Tensor:
    """``t`` cast to the mode's ``dtype``; a cast to float16 that overflows (|x| > 65504) raises instead of
    returning inf / NaN silently.

    The check reads the cast tensor back (one device synchronisation), so it runs only where a cast to
    float16 happens outside CUDA-graph capture and compilation.

    Raises:
        ValueError: finite inputs that float16 cannot hold.
    """
    if t.dtype == dtype:
        return t
    c = t.to(dtype)
    if dtype == torch.float16 and not torch.compiler.is_compiling() and not (
            c.is_cuda and torch.cuda.is_current_stream_capturing()):
        u = _functorch_unwrapped(t)  # under vmap a batched tensor cannot be read as one bool: its values can
        if bool(torch.isinf(u.to(dtype)).any()) and bool(torch.isfinite(u).all()):
            raise ValueError(f"{name} has values beyond float16's range (|x| > 65504) and mode={mode!r} computes "
                             f"in float16; use mode='fp32', 'tf32' or 'bf16', or rescale the inputs")
    return c


def _functorch_unwrapped(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values under every ``torch.func`` transform level (``t`` itself outside the transforms): a batched
    tensor of ``vmap`` unwrapped to the tensor holding every batch entry."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return t
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def check_float16_range(md: Mode, **tensors: torch.Tensor) -> None:
    """Raise :func:`cast_checked`'s ValueError where a mode computing in float16 (``fp16``, ``pasa``,
    ``fp16-acc16``) is given finite float32 / float64 tensors that float16 cannot hold: the paths that do not cast
    through :func:`cast_checked` themselves (the CPU references, the window kernels, which cast inside) keep the
    kernel path's promise instead of returning inf / NaN. Keyword names name the tensors in the error."""
    if md.compute_dtype == torch.float16:
        for name, t in tensors.items():
            if t is not None and t.dtype in (torch.float32, torch.float64):
                cast_checked(t, torch.float16, name, md.name)


def caster(md: Mode, dtype_in: torch.dtype):
    """``prepare(q, k, v)`` for inputs of ``dtype_in``: the three cast to the mode's compute dtype by
    :func:`cast_checked` (a float16 overflow raises), or passed through when they already are in it."""
    dtype, name = md.compute_dtype, md.name
    if dtype_in == dtype:
        return lambda q, k, v: (q, k, v)

    def prepare(q, k, v):
        return (cast_checked(q, dtype, "query", name), cast_checked(k, dtype, "key", name),
                cast_checked(v, dtype, "value", name))

    return prepare
