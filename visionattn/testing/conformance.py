"""The randomized conformance suite: cases, problems, float64 oracle, pass rules (``tools/gpu_conformance.py``
runs the cases, in this process or in subprocesses, and writes the report).

Cases. Case ``i`` of seed ``s`` (id ``s:i``) is drawn by its own ``random.Random(f"{s}:{i}")`` (and a shared
skeleton's stream that one names, see Skeletons): its family, mode, shapes, layouts, flags and the seed of its
tensors depend on nothing else (a run's family and mode filters choose which ids run, they do not change a case;
nor does running cases in subprocesses), so one id re-runs exactly one case, on the same device kind with the
same tensors (:func:`draw_case`, :func:`run_case`). Families (:data:`FAMILIES`):

* ``dense``: :func:`visionattn.attention`, forward and (for modes with a backward) backward;
* ``qkvpacked``: :func:`visionattn.attention_qkvpacked` on a [B, N, 3, H, D] tensor (packed gradient);
* ``window`` / ``window-qkvpacked``: :func:`visionattn.window_attention` / ``window_attention_qkvpacked``: Swin
  (relative position bias [H, N, N] or [1, H, N, N], shift masks 0 / -100, 0 / -inf or boolean) and Swin-v2
  (``cosine=True`` with ``logit_scale``, some heads above the log(100) clamp), gradients of q, k, v, the bias
  and the logit scale;
* ``varlen``: :func:`visionattn.varlen_attention` on packed tensors with ``cu_seqlens`` or on lists of sequences,
  lengths including 0 and 1, query lengths differing from key lengths, causal within each sequence; a share of the
  forward-only cases as few-query lists against uneven keys, the stream-K schedule's scope;
* ``split-kv``: the dense forward with ``num_splits`` forced above 1 (more splits than key tiles included);
* ``ring``: the ring of :mod:`visionattn.distributed` (``_context_parallel`` with ``scheme="ring"``, the
  machinery the public ``context_parallel_attention`` runs on more than one rank: exchange, per-shard forward
  with LSE, merge, the ring backward) on a one-rank gloo (CPU) / NCCL (CUDA) group made by this process;
  skipped with the reason when no such group can be made.

Modes (:data:`MODES`): fp32, fp32-ieee, tf32, fp16, bf16, pasa (forward only: its calls never need gradients).
Shapes: N in 1..4100 with most draws on the +-1 neighbours of 64 .. 4096 (profile ``tiny``: 16 / 32 / 64, for
the CPU interpreter), Nq != Nk, head dims 16 .. 256 (and a few odd ones), Dv != D, B * H from 1 to 4096, the
product B * H * Nq * Nk * max(D, Dv), the oracle's B * H * Nq * Nk and the largest tensor's B * H * max(Nq, Nk) *
max(D, Dv) capped (see :data:`PROFILES`: one case of ``full`` peaks at about 3 GiB, measured on the CPU, so a
dozen worker processes fit on one GPU; the caps do not depend on how many share it, so an id is the same case
whatever ran it).
A quarter of the dense fwd+bwd cases in the modes with a Hopper Gluon backward are drawn into that kernel's scope
(:data:`GLUON_BACKWARD_SCOPE`: lengths from where the backward plans take it and a long one, head dim 64 / 128,
grouped-query heads in fp16 / bf16, nothing else that would keep them on the Triton kernels), and a third of the
other dense fp32 cases into the scope of its Gluon forward (:data:`GLUON_FORWARD_SCOPE`: head dim 64 / 128, keys
from where the forward plans take it, enough query tiles to fill an H200 without split-KV, grouped-query heads),
both with a larger work cap (:data:`GLUON_WORK_ALLOWANCE`).
Layouts of q / k / v, bias, mask and the output gradient: contiguous, transposed ([B, N, H, D] memory), D-major,
sliced from a larger tensor, strided last dim, stride-0 expanded (batch or heads), misaligned (data pointer off
16 bytes), timm's ``qkv.unbind`` views; bias / mask broadcast patterns [Nq, Nk], [H, Nq, Nk], [B, 1, Nq, Nk],
[1, H, 1, Nk], [B, 1, 1, Nk], ..., boolean masks, additive -inf / -100 entries, causal, fully masked rows and
batches; gradients of ``out.sum()``, ``out.mean()``, expanded and strided output gradients.

Skeletons. What Triton compiles a kernel variant for (dtypes, head dims, layouts and alignments, bias / mask /
causal / cosine flags, which gradients) is a case's *skeleton*; B, H, the sequence lengths and windows are runtime
values of the kernels (mostly: a length can still pick another tile config or stride class). Half the cases
(:data:`SHARED_SKELETONS`) take their skeleton from one of 4 per family and mode of the seed (a stream of its own,
``random.Random(f"{seed}:{family}:{mode}:skeleton{j}")``) and draw their own lengths and values; the other half
draw everything, from the whole space, so no layout or shape class is left out. The trade-off: a run of
2000 cases draws about 1190 distinct skeletons instead of 2000 (a bug that needs a rare skeleton needs more
cases, or other seeds, to show) and tests each of the 168 shared ones at about 6 sets of lengths; counted on the
CPU (launches recorded, not run), 2000 ``full`` cases launch about 2600 distinct kernel specialisations instead of
3400, and in the second thousand 73% of the cases need a new one instead of 92%.

What passes. NaN or inf anywhere in an output or a gradient fails, as do a wrong output dtype or shape and a
nonzero output (or dQ) row where every key is masked (the contract: zeros). Errors are relative L2 norms against
the float64 oracle (:func:`visionattn.reference.oracle_attention`, autograd in float64, on the case's device;
windows and varlen are mapped onto it: normalised and scaled q for Swin-v2, the bias plus each window's shift
mask, a block-diagonal mask over the packed sequences). "PyTorch's error" ``||t - g||`` is the error of plain
PyTorch attention (SDPA's math path: matmul, softmax, matmul, and autograd through it,
:func:`same_precision_attention`) in the mode's compute dtype: fp16 / bf16; FP32 with FP32 matmuls for fp32,
fp32-ieee; for tf32 FP32 with every matmul operand, forward and backward, cut to TF32's 11 significant bits
(the 13 low mantissa bits dropped, as the tensor cores read FP32 registers), so the bound does not depend on
whether cuBLAS picks TF32 for a shape. With ``x`` ours and ``g`` the oracle's:

* output: ``||x - g|| <= max(contract ||g||, 2 ||t - g|| + 2 ||round(g) - g|| + 1e-6 ||g||)``. The contract is
  the mode's ``rel_tol`` in :data:`visionattn.modes.MODES`, stated for N(0, 1) inputs at the default scale;
  large biases, -100 masks and Swin-v2's logit scales up to 100 amplify input rounding, and the PyTorch term
  follows them. ``round(g)``: the exact result stored in the dtype ours is returned in (FlashAttention-3's
  ``atol``), which matters where a tensor has few elements and PyTorch's error is small by chance.
* each gradient (dQ, dK, dV, dBias, dLogitScale), FlashAttention's rule with absolute floors:
  ``|| max(|x - g| - 8 u |c|, 0) || <= 2 ||t - g|| + 2 ||round(g) - g|| + 2 ||r|| + floor ||g||`` (the max
  elementwise),
  ``floor`` 1e-5 where the products are FP32-accurate (fp32, fp32-ieee: the backward-kernel tests' bound),
  else 1e-6 (FlashAttention's constant). tf32's bound is never below its contract (3e-3 ||g||), as the
  backward-kernel tests hold tf32 on the CPU: PyTorch's TF32 is no one arithmetic (cuBLAS uses TF32 for some
  shapes only; rounding instead of truncating the operands halves the error) and the FA2-style backward's
  ``D_i = dO_i . O_i`` reads the forward's TF32 output, which PyTorch's softmax backward does not.

  ``r`` (fp16, bf16): the move of the gradient when dS is formed as a FlashAttention-style half backward forms
  it: ``D_i = dO_i . O_i`` from the output it stored in the half dtype, and dS rounded to that dtype before its
  products on the tensor cores (the gradient of ``<S, round(dS') - dS>``). PyTorch's error ``t`` includes such
  roundings too, but in a tensor of a few rows (4 queries x 19 keys at head dim 256) the two sides' sizes scatter
  independently: over 40 draws of that shape on an H200, ours was 0.42x PyTorch's at the median and up to 2.9x,
  where ``r`` bounds what those steps alone cost.

  ``8 u |c|`` absorbs what is left where the softmax backward cancels exactly. ``dS = P (dP - D)``: where a row
  sees one key (or one key dominates by e^100) ``dP - D`` is 0 in exact arithmetic, so dQ and dK are, and
  PyTorch's softmax backward gives exactly 0 too, while a kernel's differently ordered dot products leave a
  rounding residue that no relative rule accepts. With ``W = P w`` (P the oracle's probabilities,
  ``w_i = ||dO_i|| max_j ||v_j||``, the scale of the rounding of ``dP_ij`` or ``D_i`` in units of ``u``: a dot
  product of length Dv accumulated in FP32 rounds by up to about ``u |a| |b|`` whatever Dv, not by ``u`` times its
  value ``|a| |b| / sqrt(Dv)``; on an H200, rows seeing one key left up to 0.66 u w at Dv = 160 in fp32-ieee and
  4 u w at Dv = 64 in bf16), ``c`` is,
  elementwise, the larger of the gradient of ``<S, W>`` (S the logits; one rounding of ``D_i`` per row,
  coherent over its keys) and the RMS of the gradients of ``<S, W r>`` over :data:`CANCEL_DRAWS` random signs
  ``r_ij = +-1`` (one rounding per ``dP_ij``; few draws leave some elements' RMS far below its expectation: with
  4, a dK summed over the rows of a key shared by a batch had an element at 1 / 56 of the median, where a
  kernel's residue is not small), and ``u`` the roundoff of those dot products: 2^-21 for FP32 accumulation
  (fp32-ieee; fp16 / bf16, whose half inputs multiply exactly in FP32), 2^-20 for fp32 (split-FP16 products
  with one power-of-two scale per head: 22 significant bits at the head's largest element, fewer below it),
  2^-11 for tf32. Where the gradient does not cancel, ``8 u |c|`` is about ``8 u sqrt(Dv) |g|`` elementwise
  (fp32-ieee at Dv = 64: 3e-5 |g|): this suite does not judge FP32 gradients' last digits there, the
  backward-kernel tests do (1e-5 in L2).

Under Triton's interpreter (the CPU) a cast from FP32 to bfloat16 truncates where the GPU rounds to nearest:
bf16 rounding errors there are twice the GPU's and biased toward zero, so they do not average out in sums
(dBias, dV). The same cast maps an FP32 value below FP32's smallest normal (2^-126) to a bfloat16 value up to about
2^-126 away (2.6e-42 becomes 9.5e-39, where the GPU rounds it to 0): behind a -100 bias P underflows, and a
gradient whose exact value is ~1e-42 comes out ~1e-38, which no relative rule accepts when the whole gradient is
that small. On the interpreter bf16's PyTorch term is therefore doubled, ``r`` is formed with the interpreter's
truncating casts (where a row's ``dP - D`` cancels, dropped bits all of one sign move dQ by many times what rounding
to nearest does: one query against 16 keys under a 4x bias, dQ 3.0x its norm off the oracle, as a float64 model of
the truncating backward predicts, against 0.26x rounding to nearest), its gradient bound is never below
4x the bf16 contract (4e-2), elementwise differences up to :data:`INTERPRETER_BF16_UNDERFLOW` (2^-126 for each of
up to 1024 summed terms) are not counted, and the window families skip bf16 (the interpreter's bf16 ``tl.dot`` is
wrong; the dense kernels upcast there, the window forward kernel does not): a smoke test of the plumbing; judge
bf16 accuracy on a GPU.


Exceptions. A ``ValueError`` / ``TypeError`` raised for a combination the API documents as refused (varlen in a
PASA mode; FP32 inputs beyond float16's range in a float16 mode) is "refused", listed apart, not a failure; the
same exception anywhere else, and every other exception (``RuntimeError``, CUDA errors, a call that should have
refused and did not) is a failure. A CUDA error that leaves the context unusable is flagged (``cuda_error``): the
cases after it cannot run in the same process.

Fallbacks (a call the kernels do not cover runs the exact reference and warns once) are correct by contract
and pass; the warnings are recorded per case, so a family that never reached a kernel shows. On the CPU the
Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) with the
``triton`` backend: a smoke test; GPU-only bugs do not show there.

Imports torch and visionattn, never Triton at import time (the interpreter's switch must precede it).
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import tempfile
import time
import warnings
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

import visionattn as va
from visionattn.checks import has_backward
from visionattn.modes import get_mode

__all__ = ["FAMILIES", "MODES", "FORWARD_ONLY", "QUANTITIES", "FAMILY_WEIGHTS", "UNIT_ROUNDOFF", "SHARED_SKELETONS",
           "INTERPRETER_SKIPS", "Profile", "PROFILES", "LAYOUTS", "draw_case", "describe", "parse_case_id",
           "select_cases", "make_tensor", "place", "Problem", "BUILDERS", "same_precision_attention", "oracle",
           "torch_reference", "check_quantity", "dead_rows_ok", "is_cuda_error", "run_case", "release_ring_group",
           "summarize"]

FAMILIES = ("dense", "qkvpacked", "window", "window-qkvpacked", "varlen", "split-kv", "ring")
MODES = ("fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa")  # every mode but fp16-acc16 (a diagnostic baseline)
FORWARD_ONLY = frozenset(m for m in MODES if not has_backward(m))
QUANTITIES = ("out", "dq", "dk", "dv", "dbias", "dlogit_scale")
# how often each family is drawn
FAMILY_WEIGHTS = {"dense": 30, "qkvpacked": 10, "window": 18, "window-qkvpacked": 10, "varlen": 12, "split-kv": 8,
                  "ring": 12}
# the gradient rule's relative floor and its cancellation floor's roundoff per mode (module docstring)
FP32_ACCURATE = frozenset({"fp32", "fp32-ieee"})
GRAD_FLOOR_FP32, GRAD_FLOOR = 1e-5, 1e-6
UNIT_ROUNDOFF = {"fp32": 2.0 ** -20, "fp32-ieee": 2.0 ** -21, "tf32": 2.0 ** -11, "fp16": 2.0 ** -21,
                 "bf16": 2.0 ** -21, "pasa": 2.0 ** -21}
CANCEL_FACTOR = 8.0
INTERPRETER_BF16_FACTOR = 2.0  # the interpreter truncates FP32 -> bfloat16 casts (module docstring)
INTERPRETER_BF16_CONTRACTS = 4.0
INTERPRETER_BF16_UNDERFLOW = 2.0 ** -126 * 1024  # the interpreter's casts of FP32 underflows (module docstring)
FWD_FLOOR = 1e-6
CUDA_ERROR_WORDS = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
                    "CUBLAS_STATUS", "cudaErrorLaunchFailure", "misaligned address")
# (share, count): this share of the cases takes its skeleton (module docstring) from one of `count` skeletons per
# family and mode of the seed, so that it mostly reuses kernel variants compiled for an earlier case
SHARED_SKELETONS = (0.5, 4)
# (family, mode) the Triton interpreter cannot run: its bf16 tl.dot returns garbage; the dense kernels upcast
# there (DOT_UPCAST in kernels/elsa_fwd.py, elsa_bwd.py), the window forward kernel does not. GPU only.
_WINDOW_BF16 = ("the window forward kernel's bf16 tl.dot is wrong in Triton's interpreter (no DOT_UPCAST there); "
                "GPU only")
INTERPRETER_SKIPS = {("window", "bf16"): _WINDOW_BF16, ("window-qkvpacked", "bf16"): _WINDOW_BF16}


class Profile(NamedTuple):
    """The shape distribution of a run.

    Attributes:
        name: ``full`` (GPU) or ``tiny`` (the CPU interpreter).
        boundaries: tile / bucket sizes whose -1 / 0 / +1 neighbours most draws of N take.
        n_max: the largest N drawn.
        head_dims: head dims drawn most of the time; ``odd_head_dims`` the rest.
        window_tokens: tokens per window (window families).
        bh_max: the largest B * H drawn (before the caps).
        work_cap: cap on B * H * Nq * Nk * max(D, Dv) (the cost of every side of a case).
        elem_cap: cap on B * H * Nq * Nk (the float64 oracle's probability matrix and its autograd).
        tensor_cap: cap on B * H * max(Nq, Nk) * max(D, Dv), the largest of q, k, v, the output and their
            gradients (the oracle holds about 20 such tensors in float64).
        max_seqs: sequences of a varlen case.
        windows: windows per image (``num_windows``) of the window families.
    """

    name: str
    boundaries: tuple
    n_max: int
    head_dims: tuple
    odd_head_dims: tuple
    window_tokens: tuple
    bh_max: int
    work_cap: int
    elem_cap: int
    tensor_cap: int
    max_seqs: int
    windows: tuple


PROFILES = {
    # one H200 shared by up to a dozen worker processes: 3 * 2^27 multiply-adds per product at most (N = 4097
    # self-attention at D = 16; a 4097 x 1533 call at D = 64), 2^25 float64 probabilities (256 MiB), 2^24 elements
    # in the largest tensor (128 MiB in float64). The peak of a case (its oracle's autograd and cancellation
    # floors), measured on the CPU: about 110 bytes per probability and 80 per element of the largest tensor, under
    # 3 GiB for the largest cases drawn
    "full": Profile("full", (64, 128, 256, 512, 1024, 2048, 4096), 4100, (16, 32, 48, 64, 80, 96, 128, 256),
                    (8, 24, 40, 72, 112, 160, 200),
                    (4, 9, 16, 25, 36, 48, 49, 50, 63, 64, 65, 81, 100, 127, 128, 129, 144, 196, 255, 256, 257, 576),
                    4096, 3 << 27, 1 << 25, 1 << 24, 24, (1, 2, 3, 4, 16, 64)),
    # the Triton interpreter on a CPU: a few thousand multiply-adds per program
    "tiny": Profile("tiny", (16, 32, 64), 66, (16, 32, 48, 64, 80, 96, 128), (8, 24, 40),
                    (4, 9, 15, 16, 17, 25, 31, 32, 33, 49), 8, 1 << 16, 1 << 13, 1 << 15, 4, (1, 2, 3, 4)),
}
LAYOUTS = ("contiguous", "transposed", "colmajor", "sliced", "noncontig", "expanded", "misaligned")
AUX_LAYOUTS = ("contiguous", "transposed", "sliced", "noncontig", "expanded", "misaligned")
# bias / mask shapes, one letter per dim: B batch, H heads, Q query rows, K keys, 1 broadcast
PATTERNS = ("QK", "HQK", "B1QK", "1H1K", "BHQK", "111K", "BHQ1", "K", "H1K", "B11K")
GRAD_OUTS = ("randn", "randn", "transposed", "sum", "mean", "expand-batch", "expand-heads", "sliced", "misaligned",
             "noncontig")


# ----------------------------------------------------------------------------- drawing cases
def _weighted(rng: random.Random, weights: dict):
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _draw_n(rng: random.Random, prof: Profile, low: int = 1) -> int:
    """A sequence length: mostly a tile boundary or its +-1 neighbour, else a short or a log-uniform one."""
    r = rng.random()
    if r < 0.55:
        n = rng.choice(prof.boundaries) + rng.choice((-1, 0, 1))
    elif r < 0.7:
        n = rng.randint(1, 17)
    else:
        n = int(math.exp(rng.uniform(0.0, math.log(prof.n_max))))
    return max(low, min(prof.n_max, n))


def _draw_d(rng: random.Random, prof: Profile) -> int:
    return rng.choice(prof.head_dims) if rng.random() < 0.9 else rng.choice(prof.odd_head_dims)


def _draw_dims(rng: random.Random, prof: Profile, same: bool = False, p_same: float = 0.8) -> tuple[int, int]:
    """(D, Dv): Dv = D when ``same``, else with probability ``p_same``, else drawn on its own."""
    d = _draw_d(rng, prof)
    return d, (d if same or rng.random() < p_same else _draw_d(rng, prof))


def _draw_bh(rng: random.Random, prof: Profile) -> tuple[int, int]:
    bh = int(math.exp(rng.uniform(0.0, math.log(prof.bh_max + 1))))
    h = rng.choice([x for x in (1, 2, 3, 4, 6, 8, 12, 16) if x <= max(1, bh)])
    return max(1, bh // h), h


def _over(prof: Profile, bh: int, nq: int, nk: int, d: int) -> bool:
    """Whether B * H = ``bh`` heads of Nq x Nk at head dim ``d`` (the larger of D, Dv) exceed a cap of ``prof``."""
    return bh * nq * nk * d > prof.work_cap or bh * nq * nk > prof.elem_cap or bh * max(nq, nk) * d > prof.tensor_cap


def _fit(prof: Profile, b: int, h: int, nq: int, nk: int, d: int, tied: bool = False):
    """Shrink B, then H, then the shorter sequence (both when ``tied``), until the case is within the caps."""
    def over():
        return _over(prof, b * h, nq, nk, d)
    while over() and b > 1:
        b = max(1, b // 2)
    while over() and h > 1:
        h = max(1, h // 2)
    while over():
        if tied:
            nq = nk = max(1, int(math.sqrt(min(prof.work_cap // d, prof.elem_cap))))
        elif nq <= nk and nq > 1:
            nq = max(1, min(nq - 1, prof.work_cap // (nk * d), prof.elem_cap // nk))
        elif nk > 1:
            nk = max(1, min(nk - 1, prof.work_cap // (nq * d), prof.elem_cap // nq))
        else:
            nq = max(1, nq // 2)
    return b, h, nq, nk


def _pick_layout(rng: random.Random, shape, expand_dims, choices=LAYOUTS) -> str:
    """A memory layout for a tensor of ``shape``; ``expanded@<dim>`` names the stride-0 dim (one of
    ``expand_dims`` of size > 1). Takes as many draws from ``rng`` whatever ``shape`` is (a skeleton's draws
    must not depend on the lengths of the case drawing them)."""
    if rng.random() < 0.35:
        return "contiguous"
    layout, pick = rng.choice(choices), rng.random()
    if layout == "expanded":
        dims = [d for d in expand_dims if shape[d] > 1]
        return f"expanded@{dims[int(pick * len(dims))]}" if dims else "contiguous"
    if layout in ("transposed", "colmajor") and len(shape) < 2:
        return "contiguous"
    return layout


def _pattern_shape(pattern: str, sizes: dict) -> list[int]:
    return [sizes[c] if c != "1" else 1 for c in pattern]


def _draw_aux(rng: random.Random, sizes: dict, p: float) -> dict | None:
    """With probability ``p`` a bias / mask's broadcast pattern, its shape and its layout, else None."""
    if rng.random() > p:
        return None
    pattern = rng.choice(PATTERNS)
    shape = _pattern_shape(pattern, sizes)
    return {"pattern": pattern, "shape": shape,
            "layout": _pick_layout(rng, shape, range(len(shape) - 1), AUX_LAYOUTS)}


def _draw_bias(rng: random.Random, spec: dict, sizes: dict, grad: bool, p: float = 0.45):
    bias = _draw_aux(rng, sizes, p)
    if bias is not None:
        bias.update(dtype=rng.choice(["float32", "float32", "float32", spec["dtype"], spec["dtype"], "float64"]),
                    sigma=rng.choice([0.5, 1.0, 2.0, 4.0]), neg=rng.choice([None, None, None, "-inf", "-100"]),
                    neg_frac=rng.choice([0.1, 0.5, 0.9]), grad=grad and rng.random() < 0.35)
    return bias


def _draw_mask(rng: random.Random, sizes: dict, p: float = 0.35):
    mask = _draw_aux(rng, sizes, p)
    if mask is not None:  # dead -1: the first slice all False
        mask.update(keep=rng.choice([0.95, 0.7, 0.3, 0.05]),
                    dead=rng.choice([0, 0, 0, 1, 3]) if rng.random() < 0.95 else -1)
    return mask


def _draw_grad_out(rng: random.Random, numel: int, out_dtype: str, listed: bool = False) -> dict:
    kind = rng.choice(GRAD_OUTS)
    if kind == "mean" and (listed or (out_dtype == "float16" and numel > 8192)):
        kind = "sum"  # 1 / numel would be subnormal (or flush to 0) in float16 before any kernel sees it
    return {"kind": kind}


def _compute_dtype(mode: str) -> str:
    """The name of the mode's compute dtype, as a case spec holds dtypes (``"float16"``)."""
    return str(get_mode(mode).compute_dtype).removeprefix("torch.")


def _dtype_for(rng: random.Random, mode: str) -> str:
    """The input dtype: the mode's compute dtype mostly, sometimes FP32 into a half mode or FP64 (cast paths)."""
    compute = _compute_dtype(mode)
    r = rng.random()
    if r < 0.8:
        return compute
    return "float32" if r < 0.95 else "float64"


# Each draw below takes ``rng``, the case's skeleton (everything Triton compiles a kernel variant for: dtypes,
# head dims, layouts, bias / mask / causal / cosine flags, which gradients), and ``lengths``, its shapes (B, H,
# sequence lengths, windows; lengths are runtime values of the kernels). Both are one stream for most cases; a
# case sharing a skeleton (:data:`SHARED_SKELETONS`) takes ``rng`` from the skeleton's own stream, so the
# skeleton's draws must not depend on the lengths (a self-attention case stays one under the caps; a layout pick
# takes the same draws whatever the shape).
def _draw_dense_like(rng: random.Random, lengths: random.Random, prof: Profile, spec: dict, tied: bool = False,
                     nq: int | None = None):
    """Shapes, layouts, bias / mask / causal / scale of a dense-style case (dense, qkvpacked, split-kv, ring);
    ``nq``: the query count (else drawn)."""
    self_attn = tied or rng.random() < 0.4
    d, dv = _draw_dims(rng, prof, same=tied)
    nq = nq or _draw_n(lengths, prof)
    nk = nq if self_attn else _draw_n(lengths, prof)
    b, h = _draw_bh(lengths, prof)
    b, h, nq, nk = _fit(prof, b, h, nq, nk, max(d, dv), self_attn)
    spec.update(B=b, H=h, Nq=nq, Nk=nk, D=d, Dv=dv)
    sizes = {"B": b, "H": h, "Q": nq, "K": nk}
    packed = not tied and self_attn and d == dv and rng.random() < 0.15
    if tied:
        shape = (b, nq, 3, h, d)
        spec["layouts"] = {"qkv": _pick_layout(rng, shape, (0,), ("contiguous", "transposed", "sliced", "noncontig",
                                                                    "expanded", "misaligned"))}
    elif packed:
        spec["layouts"] = "packed"  # timm's qkv.unbind views
    else:
        spec["layouts"] = {name: _pick_layout(rng, (b, h, n, dd), (0, 1))
                           for name, n, dd in (("q", nq, d), ("k", nk, d), ("v", nk, dv))}
    spec["bias"] = _draw_bias(rng, spec, sizes, spec["grad"])
    spec["mask"] = _draw_mask(rng, sizes)
    spec["causal"] = rng.random() < 0.25
    spec["scale"] = None if rng.random() < 0.7 else round(rng.uniform(0.05, 0.5), 4)
    if spec["grad"]:
        spec["needs"] = ["q", "k", "v"] if tied or packed or rng.random() < 0.8 else \
            sorted(rng.sample(["q", "k", "v"], rng.randint(1, 2)))
        out_numel = b * h * nq * dv
        spec["grad_out"] = _draw_grad_out(rng, out_numel, spec["dtype"])


def _draw_window(rng: random.Random, lengths: random.Random, prof: Profile, spec: dict, packed: bool):
    d, dv = _draw_dims(rng, prof, same=packed)
    n = lengths.choice(prof.window_tokens)
    nw = lengths.choice(prof.windows)
    imgs = max(1, int(math.exp(lengths.uniform(0.0, math.log(max(2, prof.bh_max // nw))))))
    h = lengths.choice([1, 2, 3, 4, 6, 8, 16])
    while _over(prof, imgs * nw * h, n, n, max(d, dv)):
        if imgs > 1:
            imgs //= 2
        elif h > 1:
            h //= 2
        elif nw > 1:
            nw = 1
        else:
            n = max(1, n // 2)
    spec.update(B=imgs * nw, H=h, Nq=n, Nk=n, D=d, Dv=dv, num_windows=nw, images=imgs)
    if packed:
        spec["layouts"] = {"qkv": _pick_layout(rng, (imgs * nw, n, 3, h, d), (0,),
                                               ("contiguous", "transposed", "sliced", "noncontig", "misaligned"))}
    elif d == dv and rng.random() < 0.35:
        spec["layouts"] = "packed"
    else:
        spec["layouts"] = {name: _pick_layout(rng, (imgs * nw, h, n, dd), (0, 1))
                           for name, dd in (("q", d), ("k", d), ("v", dv))}
    cosine = rng.random() < 0.4
    spec["cosine"] = cosine
    spec["rpb"] = None if rng.random() < 0.25 else {
        "shape": rng.choice(["HNN", "HNN", "1HNN"]),
        "layout": rng.choice(["contiguous", "permuted", "sliced", "misaligned"]),
        "dtype": rng.choice(["float32", "float32", spec["dtype"]]), "sigma": rng.choice([0.5, 1.0, 2.0]),
        "grad": spec["grad"] and rng.random() < 0.5}
    spec["shift"] = None if rng.random() < 0.4 else {
        "kind": rng.choice(["-100", "-100", "-inf", "bool"]), "regions": rng.randint(1, 4),
        "layout": rng.choice(["contiguous", "contiguous", "expanded", "transposed", "misaligned"]),
        "dead": rng.random() < 0.1}
    spec["logit_scale"] = None if not cosine else {
        "shape": rng.choice(["H11", "H"]), "clamped": rng.random() < 0.3,
        "dtype": rng.choice(["float32", "float32", spec["dtype"]]), "grad": spec["grad"] and rng.random() < 0.85}
    spec["scale"] = None if cosine or rng.random() < 0.7 else round(rng.uniform(0.05, 0.5), 4)
    if spec["grad"]:
        spec["needs"] = ["q", "k", "v"]
        spec["grad_out"] = _draw_grad_out(rng, spec["B"] * h * n * dv, spec["dtype"])


def _draw_lengths(rng: random.Random, prof: Profile, count: int) -> list[int]:
    def one():
        r = rng.random()
        if r < 0.1:
            return 0
        if r < 0.2:
            return 1
        return _draw_n(rng, prof)
    return [one() for _ in range(count)]


def _draw_varlen(rng: random.Random, lengths: random.Random, prof: Profile, spec: dict):
    same_lens = rng.random() < 0.6
    d, dv = _draw_dims(rng, prof)
    count = lengths.randint(1, prof.max_seqs)
    lens_q = _draw_lengths(lengths, prof, count)
    lens_k = list(lens_q) if same_lens else _draw_lengths(lengths, prof, count)
    h = lengths.choice([1, 2, 3, 4, 8, 12, 16])
    # the oracle is one dense call with a block-diagonal mask: cap the dense work
    while _over(prof, h, sum(lens_q), sum(lens_k), max(d, dv)):
        if h > 1:
            h //= 2
            continue
        longest = max(range(count), key=lambda i: max(lens_q[i], lens_k[i]))
        lens_q[longest] //= 2
        lens_k[longest] //= 2
    spec.update(B=1, H=h, Nq=sum(lens_q), Nk=sum(lens_k), D=d, Dv=dv, lens_q=lens_q, lens_k=lens_k)
    spec["form"] = "list" if rng.random() < 0.3 else "packed"
    if same_lens and d == dv and rng.random() < 0.2:
        spec["layouts"] = "packed"
    else:
        spec["layouts"] = {name: _pick_layout(rng, (t, h, dd), (1,))
                           for name, t, dd in (("q", sum(lens_q), d), ("k", sum(lens_k), d), ("v", sum(lens_k), dv))}
    spec["max_seqlen"] = rng.choice(["none", "exact", "loose"])
    spec["causal"] = rng.random() < 0.3
    spec["scale"] = None if rng.random() < 0.7 else round(rng.uniform(0.05, 0.5), 4)
    if spec["grad"]:
        spec["needs"] = ["q", "k", "v"] if rng.random() < 0.8 else sorted(rng.sample(["q", "k", "v"], 2))
        spec["grad_out"] = _draw_grad_out(rng, sum(lens_q) * h * dv, spec["dtype"], listed=spec["form"] == "list")


# share of the forward-only varlen cases (``profile`` full only; a stream of its own) redrawn into the scope of the
# stream-K schedule (kernels/stream_k.py), which the list path's rule takes on a GPU: lists of sequences (lengths on
# the host) of at most 64 queries each against uneven keys, one sequence much longer than the rest, so that the
# schedule's shares cut jobs between programs (their partial states folded by the merge). The other draws reach it
# rarely: few queries seldom come with long keys, a list and no gradients at once
STREAM_K_SHARE = 0.3


def _draw_stream_k(rng: random.Random, prof: Profile, spec: dict) -> None:
    """Redraw a forward-only varlen case (:data:`STREAM_K_SHARE` of them) into the stream-K schedule's scope (see
    there): 2 to 16 sequences of 1 to 64 queries, one of 700 to 5000 keys and the others 0 to that, 1 to 16 heads,
    within the oracle's caps."""
    if prof.name != "full" or spec["grad"] or spec["expect_refusal"] or rng.random() >= STREAM_K_SHARE:
        return
    count = rng.randint(2, max(2, min(16, prof.max_seqs)))
    longest = rng.choice((700, 2000, 5000))
    lens_q = [rng.choice((1, 1, 2, 7, 16, 33, 64)) for _ in range(count)]
    lens_k = [longest] + [rng.randint(0, longest) for _ in range(count - 1)]
    h = rng.choice((1, 2, 4, 8, 16))
    d, dv = spec["D"], spec["Dv"]
    while _over(prof, h, sum(lens_q), sum(lens_k), max(d, dv)):
        if h > 1:
            h //= 2
            continue
        i = max(range(count), key=lambda j: lens_k[j])
        lens_k[i] //= 2
    spec.update(H=h, Nq=sum(lens_q), Nk=sum(lens_k), lens_q=lens_q, lens_k=lens_k, form="list", causal=False,
                stream_k=True)
    spec["layouts"] = {name: _pick_layout(rng, (t, h, dd), (1,))
                       for name, t, dd in (("q", sum(lens_q), d), ("k", sum(lens_k), d), ("v", sum(lens_k), dv))}


# share of the dense and split-KV cases with grouped-query key / value heads (enable_gqa=True)
GQA_SHARE = 0.3


def _divisor_above_one(rng: random.Random, h: int) -> int:
    # a divisor of h above 1, drawn (h > 1)
    return rng.choice([g for g in range(2, h + 1) if h % g == 0])


def _draw_gqa(rng: random.Random, spec: dict) -> None:
    """Grouped-query attention for some dense / split-KV cases: ``Hkv`` = H / G key / value heads, G a divisor of H
    above 1 (G = H: multi-query). Its own stream, so the rest of a case is drawn as without it."""
    if spec["H"] > 1 and rng.random() < GQA_SHARE:
        spec["Hkv"] = spec["H"] // _divisor_above_one(rng, spec["H"])


# share of the dense fwd+bwd cases, in a mode that has a Hopper Gluon backward, redrawn into that kernel's scope
# (``profile`` full only; a stream of its own, so every other case is drawn as without it): head dim 64 / 128 for
# q, k and v, both lengths from a length where the backward plans take the Gluon kernel, no bias / mask / causal,
# grouped-query heads in GLUON_GQA_SHARE of them, layouts whose strides TMA takes. The other draws land there
# rarely: a long sequence seldom comes with a head dim of 64 / 128, no bias, mask, causal flag or grouped heads and
# such layouts all at once
GLUON_BACKWARD_SHARE = 0.25
# per mode: head dim -> lengths (queries and keys) from which the redrawn cases start: the least at which the
# backward plans run the Gluon kernel for one to four heads on an H200 (half_gluon_bwd.preferred, tf32_preferred,
# fp32_preferred; a CPU test checks them) and, for fp16 / bf16, a long one (many key tiles' ordered dQ turns)
GLUON_BACKWARD_SCOPE = {"fp16": {64: (273, 2048), 128: (273, 2048)}, "bf16": {64: (273, 2048), 128: (273, 2048)},
                        "tf32": {64: (4096,), 128: (1024,)}, "fp32": {64: (1024,), 128: (128, 1024)}}
# share of the redrawn backward cases of two or four heads with grouped-query key / value heads
GLUON_GQA_SHARE = 0.3
# the Gluon-scope cases' work cap, times the profile's: their lengths are fixed by the scope, so B * H cannot
# shrink them under it (their oracle and tensors stay within elem_cap and tensor_cap)
GLUON_WORK_ALLOWANCE = 4


def _draw_gluon_backward(rng: random.Random, prof: Profile, spec: dict) -> None:
    """Redraw a dense fwd+bwd case (:data:`GLUON_BACKWARD_SHARE` of those in a :data:`GLUON_BACKWARD_SCOPE` mode)
    into the Gluon backward's scope: lengths at one of the scope's lengths, or one to two tiles past it (a cut last
    key / query tile), B = 1 and one to four heads within the oracle caps (grouped-query key / value heads in
    :data:`GLUON_GQA_SHARE` of those with two or four)."""
    scope = GLUON_BACKWARD_SCOPE.get(spec["mode"])
    if not scope or prof.name != "full" or not spec["grad"] or rng.random() >= GLUON_BACKWARD_SHARE:
        return
    d = rng.choice(sorted(scope))
    low = rng.choice(scope[d])
    nq = low + rng.choice((0, 1, 63, 129))
    self_attn = rng.random() < 0.5
    nk = nq if self_attn else low + rng.choice((0, 1, 64, 127))
    h = rng.choice((1, 2, 4))
    while h > 1 and (h * nq * nk > prof.elem_cap or h * max(nq, nk) * d > prof.tensor_cap
                     or h * nq * nk * d > GLUON_WORK_ALLOWANCE * prof.work_cap):
        h //= 2
    spec.pop("Hkv", None)
    spec.update(B=1, H=h, Nq=nq, Nk=nk, D=d, Dv=d, skeleton=None, bias=None, mask=None, causal=False,
                dtype=_compute_dtype(spec["mode"]), needs=["q", "k", "v"],
                gluon_backward=True)
    grouped = h > 1 and rng.random() < GLUON_GQA_SHARE
    if grouped:
        spec["Hkv"] = h // _divisor_above_one(rng, h)
    if self_attn and not grouped and rng.random() < 0.3:
        spec["layouts"] = "packed"  # timm's qkv.unbind views: TMA-legal strides
    else:
        spec["layouts"] = {name: rng.choice(("contiguous", "contiguous", "transposed")) for name in ("q", "k", "v")}
    spec["grad_out"] = _draw_grad_out(rng, h * nq * d, spec["dtype"])


# share of the other dense fp32 cases redrawn into the scope of fp32's Gluon forward (its split-FP16 build;
# ``profile`` full only, a stream of its own): head dim 64 / 128, keys from GLUON_FORWARD_SCOPE's least count (one
# or two tiles past it), as many heads as give an H200's 132 SMs a query tile each (the dense plan then splits no
# keys), grouped-query heads in GLUON_GQA_SHARE of them, no bias / mask / causal, q / k / v with a unit head-dim
# stride (the operand pass reads rows: any other strides, any alignment). Forward only or fwd+bwd as drawn (the
# backward, from the Gluon forward's LSE, is what fp32_preferred picks: at head dim 128 the Gluon split build from
# 128 query rows, at 64 the Triton kernels below its grid and length thresholds)
GLUON_FORWARD_SHARE = 0.33
# per mode: head dim -> the least key count at which the forward plans run the Gluon kernel (fp32_gluon.MIN_KEYS;
# a CPU test checks it)
GLUON_FORWARD_SCOPE = {"fp32": {64: 256, 128: 256}}
# the SMs whose query tiles the redrawn forward cases fill (an H200's), and the kernel's query rows per tile
GLUON_FORWARD_SMS, GLUON_FORWARD_ROWS = 132, 128


def _draw_gluon_forward(rng: random.Random, prof: Profile, spec: dict) -> None:
    """Redraw a dense case (:data:`GLUON_FORWARD_SHARE` of those in a :data:`GLUON_FORWARD_SCOPE` mode, not already
    redrawn for the backward) into the Gluon forward's scope (see :data:`GLUON_FORWARD_SHARE`)."""
    scope = GLUON_FORWARD_SCOPE.get(spec["mode"])
    if not scope or prof.name != "full" or spec.get("gluon_backward") or rng.random() >= GLUON_FORWARD_SHARE:
        return
    d = rng.choice(sorted(scope))
    nk = scope[d] + rng.choice((0, 1, 63, 129))
    nq = nk if rng.random() < 0.5 else rng.choice((128, 129, 255, 300, 511))
    h = rng.choice((2, 4, 6, 8, 12, 16))
    tiles = -(-nq // GLUON_FORWARD_ROWS)
    b = -(-GLUON_FORWARD_SMS // (h * tiles))  # one query tile per SM at least
    spec.pop("Hkv", None)
    spec.update(B=b, H=h, Nq=nq, Nk=nk, D=d, Dv=d, skeleton=None, bias=None, mask=None, causal=False,
                dtype=_compute_dtype(spec["mode"]), gluon_forward=True)
    if rng.random() < GLUON_GQA_SHARE:
        spec["Hkv"] = h // _divisor_above_one(rng, h)
    spec["layouts"] = {name: rng.choice(("contiguous", "transposed", "sliced", "misaligned"))
                       for name in ("q", "k", "v")}
    if spec["grad"]:
        spec["needs"] = ["q", "k", "v"]
        spec["grad_out"] = _draw_grad_out(rng, b * h * nq * d, spec["dtype"])


def draw_case(seed: int, index: int, profile: str) -> dict:
    """The case ``seed:index`` of ``profile``: a JSON-serialisable description, drawn by its own
    ``random.Random(f"{seed}:{index}")`` (nothing else changes it). Its family, mode and lengths come from that
    stream; its skeleton too, except for the cases that share one (:data:`SHARED_SKELETONS`), whose skeleton
    comes from ``random.Random(f"{seed}:{family}:{mode}:skeleton{j}")``."""
    own = random.Random(f"{seed}:{index}")
    prof = PROFILES[profile]
    family = _weighted(own, FAMILY_WEIGHTS)
    mode = own.choice(MODES)
    if family == "varlen" and mode == "pasa" and own.random() < 0.85:
        mode = own.choice(MODES[:-1])  # mostly a mode varlen takes; the rest checks the documented refusal
    shared, skeleton = own.random() < SHARED_SKELETONS[0], own.randrange(SHARED_SKELETONS[1])
    rng = random.Random(f"{seed}:{family}:{mode}:skeleton{skeleton}") if shared else own
    spec: dict[str, Any] = {"id": f"{seed}:{index}", "seed": seed, "index": index, "profile": profile,
                            "family": family, "mode": mode, "skeleton": skeleton if shared else None,
                            "dtype": _dtype_for(rng, mode), "tensor_seed": own.getrandbits(31),
                            "expect_refusal": None}
    backward_family = family not in ("split-kv",)
    spec["grad"] = mode not in FORWARD_ONLY and backward_family and rng.random() < 0.5
    if family in ("dense", "ring"):
        _draw_dense_like(rng, own, prof, spec)
    elif family == "qkvpacked":
        _draw_dense_like(rng, own, prof, spec, tied=True)
    elif family == "split-kv":
        decode = rng.random() < 0.5  # few queries, many keys
        spec["num_splits"] = rng.choice([2, 3, 4, 5, 8, 16, 33])
        _draw_dense_like(rng, own, prof, spec, nq=own.choice([1, 2, 3, 7, 16, 17]) if decode else None)
    elif family in ("window", "window-qkvpacked"):
        _draw_window(rng, own, prof, spec, packed=family == "window-qkvpacked")
    else:
        _draw_varlen(rng, own, prof, spec)
        if mode in ("pasa",):
            spec["expect_refusal"] = "varlen_attention has no PASA path (documented ValueError)"
            spec["refusal_words"] = "no varlen path"
        _draw_stream_k(random.Random(f"{seed}:{index}:stream-k"), prof, spec)
    if family in ("dense", "split-kv") and spec["layouts"] != "packed":
        _draw_gqa(random.Random(f"{seed}:{index}:gqa"), spec)
    if family == "dense":
        _draw_gluon_backward(random.Random(f"{seed}:{index}:gluon-backward"), prof, spec)
        _draw_gluon_forward(random.Random(f"{seed}:{index}:gluon-forward"), prof, spec)
    # (the window calls cast inside their kernel and document no such refusal)
    if (mode in ("fp16", "pasa") and spec["dtype"] in ("float32", "float64") and rng.random() < 0.1
            and not spec["expect_refusal"] and family not in ("window", "window-qkvpacked")):
        spec["overflow"] = True  # q beyond float16's range: a documented ValueError in float16 modes
        spec["expect_refusal"] = ("float32 / float64 inputs beyond float16's range in a float16 mode "
                                  "(documented ValueError)")
        spec["refusal_words"] = "beyond float16's range"
    return spec


def describe(spec: dict) -> str:
    """One line naming everything a case draws."""
    parts = [spec["family"], spec["mode"], "fwd+bwd" if spec["grad"] else "fwd",
             f"skeleton{spec['skeleton']}" if spec.get("skeleton") is not None else "",
             "gluon-backward-scope" if spec.get("gluon_backward") else "",
             "gluon-forward-scope" if spec.get("gluon_forward") else "",
             "stream-k-scope" if spec.get("stream_k") else "",
             f"B={spec['B']} H={spec['H']}" + (f" Hkv={spec['Hkv']}" if "Hkv" in spec else "")
             + f" Nq={spec['Nq']} Nk={spec['Nk']} D={spec['D']} Dv={spec['Dv']}",
             f"in={spec['dtype']}"]
    lay = spec.get("layouts")
    parts.append("qkv=packed-views" if lay == "packed" else " ".join(f"{k}={v}" for k, v in (lay or {}).items()))
    if spec["family"] in ("window", "window-qkvpacked"):
        parts.append(f"nW={spec['num_windows']}" + (" cosine" if spec["cosine"] else ""))
        if spec["rpb"]:
            r = spec["rpb"]
            parts.append(f"rpb={r['shape']}/{r['layout']}/{r['dtype']}" + ("/grad" if r["grad"] else ""))
        if spec["shift"]:
            s = spec["shift"]
            parts.append(f"shift={s['kind']}/{s['regions']}regions/{s['layout']}" + ("/dead-row" if s["dead"] else ""))
        if spec["logit_scale"]:
            ls = spec["logit_scale"]
            parts.append(f"logit_scale={ls['shape']}/{ls['dtype']}" + ("/clamped" if ls["clamped"] else "")
                         + ("/grad" if ls["grad"] else ""))
    if spec["family"] == "varlen":
        parts.append(f"{spec['form']} lens_q={spec['lens_q']} lens_k={spec['lens_k']} max_seqlen={spec['max_seqlen']}")
    if spec.get("bias"):
        b = spec["bias"]
        parts.append(f"bias={b['pattern']}/{b['layout']}/{b['dtype']}/x{b['sigma']}"
                     + (f"/{b['neg']}@{b['neg_frac']}" if b["neg"] else "") + ("/grad" if b["grad"] else ""))
    if spec.get("mask"):
        m = spec["mask"]
        parts.append(f"mask={m['pattern']}/{m['layout']}/keep{m['keep']}" + (f"/dead{m['dead']}" if m["dead"] else ""))
    if spec.get("causal"):
        parts.append("causal")
    if spec.get("scale") is not None:
        parts.append(f"scale={spec['scale']}")
    if spec.get("num_splits"):
        parts.append(f"num_splits={spec['num_splits']}")
    if spec["grad"]:
        parts.append(f"dO={spec['grad_out']['kind']}")
        if spec.get("needs") and spec["needs"] != ["q", "k", "v"]:
            parts.append("grad-of=" + ",".join(spec["needs"]))
    if spec.get("overflow"):
        parts.append("q-beyond-fp16-range")
    return " ".join(p for p in parts if p)


# ----------------------------------------------------------------------------- building tensors
def _dtype(name: str):
    return getattr(torch, name)


def _argsort(perm):
    return tuple(sorted(range(len(perm)), key=lambda i: perm[i]))


def make_tensor(shape, layout: str, gen, device, dtype=None, *, kind: str = "randn", keep: float = 0.5,
                perm=None, post: Callable | None = None, requires_grad: bool = False):
    """A tensor of ``shape``: N(0, 1) values (``kind="randn"``, cast to ``dtype``) or booleans with P(True) =
    ``keep``, edited in place by ``post`` (on the logical values), then laid out by :func:`place`."""
    shape = tuple(int(s) for s in shape)
    if kind == "bool":
        values = torch.rand(shape, generator=gen, device=device) < keep
    else:
        values = torch.randn(shape, generator=gen, device=device).to(dtype)
    if post is not None:
        post(values)
    return place(values, layout, perm=perm, requires_grad=requires_grad)


def place(values, layout: str, *, perm=None, requires_grad: bool = False):
    """``values`` in memory laid out as ``layout`` (:data:`LAYOUTS`; ``transposed``: memory in the dim order
    ``perm``; ``permuted``: the first dim innermost, as timm's relative position bias; ``expanded@d``: stride 0
    along dim d, the values at index 0 of d repeated). Memory around the view (``sliced``, ``noncontig``,
    ``misaligned``) holds NaN (True for masks): a kernel reading outside its tensor shows. With
    ``requires_grad`` the underlying tensor is a leaf and the view returned is in its graph."""
    shape = tuple(values.shape)

    def pad(shp):
        fill = True if values.dtype == torch.bool else float("nan")
        return torch.full(tuple(shp), fill, dtype=values.dtype, device=values.device)

    if layout in ("transposed", "permuted"):
        if layout == "permuted":
            perm = tuple(range(1, len(shape))) + (0,)
        perm = perm or tuple(range(len(shape)))
        base, view = values.permute(perm).contiguous(), lambda b: b.permute(_argsort(perm))
    elif layout == "colmajor":
        base, view = values.transpose(-1, -2).contiguous(), lambda b: b.transpose(-1, -2)
    elif layout == "sliced":
        index = tuple(slice(1, None) for _ in shape)
        base = pad([s + 1 for s in shape])
        base[index] = values
        view = lambda b: b[index]  # noqa: E731
    elif layout == "noncontig":
        base = pad(shape[:-1] + (2 * shape[-1],))
        base[..., ::2] = values
        view = lambda b: b[..., ::2]  # noqa: E731
    elif layout.startswith("expanded@"):
        base, view = values.narrow(int(layout[9:]), 0, 1).contiguous(), lambda b: b.expand(shape)
    elif layout == "misaligned":
        base = pad([values.numel() + 1])
        base[1:] = values.reshape(-1)
        view = lambda b: b[1:].view(shape)  # noqa: E731
    else:
        base, view = values, lambda b: b
    if requires_grad:
        base.requires_grad_(True)
    return view(base)


class Problem:
    """One case's tensors and calls.

    Attributes:
        theta: the float inputs by name (views as passed to the API); gradients are taken of those that require
            them. Every reference is computed from copies of these.
        call: runs our API on ``theta`` -> its output (a tensor, or a list for listed varlen sequences).
        canon: our output (or an output gradient) -> the oracle's [B, H, Nq, Dv] layout.
        ref_args: ``theta``-like dict (any dtype) -> keyword arguments of
            :func:`visionattn.reference.oracle_attention` (explicit ``scale``).
        slicers: theta name -> [(quantity, g -> the oracle-layout part of a gradient of that input)].
        out_shape: the shape of our output (of the packed output for listed sequences).
        out_perm: memory order of a ``transposed`` output gradient; ``out_expand``: its batch / heads dims.
        out_dtype: the dtype our output must have.
        split: packed output gradient -> what the call's output is (a list for listed sequences), else None.
        grad_out: the output gradient of a backward case (None for ``sum`` / ``mean``, whose constant is
            ``grad_out_value``).
    """

    def __init__(self, theta: dict, call: Callable, canon: Callable, ref_args: Callable, slicers: dict,
                 out_shape: tuple, out_perm: tuple, out_expand: tuple, out_dtype, split: Callable | None = None):
        self.theta, self.call, self.canon, self.ref_args, self.slicers = theta, call, canon, ref_args, slicers
        self.out_shape, self.out_perm, self.out_expand, self.out_dtype = out_shape, out_perm, out_expand, out_dtype
        self.split = split
        self.grad_out = None
        self.grad_out_value: float | None = None


def _qkv_separate(spec, gen, device, dt, shape_of, perm, needs):
    """q, k, v each in its own layout (``shape_of(name)``: its shape)."""
    layouts = spec["layouts"]
    post = _overflow_post(spec)
    return {name: make_tensor(shape_of(name), layouts[name], gen, device, dt, perm=perm,
                              post=post if name == "q" else None, requires_grad=name in needs)
            for name in ("q", "k", "v")}


def _overflow_post(spec):
    if not spec.get("overflow"):
        return None
    return lambda b: b.mul_(1e5)


def _bias_tensor(bspec: dict, gen, device):
    if bspec is None:
        return None

    def post(b):
        b.mul_(bspec["sigma"])
        if bspec["neg"]:
            hit = torch.rand(b.shape, generator=gen, device=device) < bspec["neg_frac"]
            b.masked_fill_(hit, float("-inf") if bspec["neg"] == "-inf" else -100.0)

    return make_tensor(bspec["shape"], bspec["layout"], gen, device, _dtype(bspec["dtype"]),
                       perm=_swap_last(len(bspec["shape"])), post=post, requires_grad=bspec["grad"])


def _swap_last(nd: int):
    return tuple(range(nd - 2)) + (nd - 1, nd - 2) if nd >= 2 else (0,)


def _mask_tensor(mspec: dict, gen, device):
    if mspec is None:
        return None
    pattern = mspec["pattern"]

    def post(m):
        if mspec["dead"] == -1:
            m[0] = False  # the first slice (e.g. batch 0, or every row when the pattern has no Q) sees nothing
        elif mspec["dead"] and "Q" in pattern:
            axis = pattern.index("Q")
            rows = torch.randint(0, m.shape[axis], (mspec["dead"],), generator=gen, device=m.device)
            m.index_fill_(axis, rows, False)

    return make_tensor(mspec["shape"], mspec["layout"], gen, device, kind="bool", keep=mspec["keep"],
                       perm=_swap_last(len(mspec["shape"])), post=post)


def _dense_problem(spec: dict, gen, device) -> Problem:
    """dense / split-kv / ring: q [B, H, Nq, D], k [B, H, Nk, D], v [B, H, Nk, Dv] and a bias / mask."""
    B, H, nq, nk, D, Dv = (spec[k] for k in ("B", "H", "Nq", "Nk", "D", "Dv"))
    dt = _dtype(spec["dtype"])
    needs = set(spec.get("needs", ()))
    if spec["layouts"] == "packed":
        qkv = make_tensor((B, nq, 3, H, D), "contiguous", gen, device, dt, post=_overflow_post(spec),
                          requires_grad=bool(needs))
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        theta = {"q": q, "k": k, "v": v}
    else:
        hkv = spec.get("Hkv", H)  # grouped-query: key / value heads shared by H / hkv query heads each
        shapes = {"q": (B, H, nq, D), "k": (B, hkv, nk, D), "v": (B, hkv, nk, Dv)}
        theta = _qkv_separate(spec, gen, device, dt, shapes.get, (0, 2, 1, 3), needs)
    group = H // spec.get("Hkv", H)
    bias = _bias_tensor(spec["bias"], gen, device)
    if bias is not None:
        theta["bias"] = bias
    mask = _mask_tensor(spec["mask"], gen, device)
    causal, mode = spec["causal"], spec["mode"]
    scale = spec["scale"]
    family = spec["family"]

    def call():
        t = theta
        if family == "ring":
            from visionattn.distributed import _context_parallel

            return _context_parallel(t["q"], t["k"], t["v"], None, mode, t.get("bias"), mask, causal, scale, "ring")
        kw = {"num_splits": spec["num_splits"]} if family == "split-kv" else {}
        if group > 1:
            kw["enable_gqa"] = True
        return va.attention(t["q"], t["k"], t["v"], bias=t.get("bias"), attn_mask=mask, is_causal=causal,
                            scale=scale, mode=mode, **kw)

    def ref_args(th):  # the oracle sees each key / value head repeated for its query heads (SDPA's enable_gqa)
        k, v = (th[n].repeat_interleave(group, dim=1) if group > 1 else th[n] for n in ("k", "v"))
        return {"q": th["q"], "k": k, "v": v, "bias": th.get("bias"), "attn_mask": mask,
                "is_causal": causal, "scale": D ** -0.5 if scale is None else scale}

    ident = lambda g: g  # noqa: E731
    slicers = {"q": [("dq", ident)], "k": [("dk", ident)], "v": [("dv", ident)], "bias": [("dbias", ident)]}
    return Problem(theta, call, ident, ref_args, slicers, (B, H, nq, Dv), (0, 2, 1, 3), (0, 1), dt)


def _packed_slicers(transpose):
    """dQ / dK / dV of a gradient of a packed qkv ([..., N, 3, H, D]) in the oracle's [.., H, N, D] layout."""
    def part(i):
        return lambda g: transpose(g[:, :, i])

    return {"qkv": [(name, part(i)) for i, name in enumerate(("dq", "dk", "dv"))],
            "bias": [("dbias", lambda g: g)], "rpb": [("dbias", lambda g: g)],
            "logit_scale": [("dlogit_scale", lambda g: g)]}


def _qkvpacked_problem(spec: dict, gen, device) -> Problem:
    B, H, N, D = (spec[k] for k in ("B", "H", "Nq", "D"))
    dt = _dtype(spec["dtype"])
    qkv = make_tensor((B, N, 3, H, D), spec["layouts"]["qkv"], gen, device, dt, perm=(0, 2, 3, 1, 4),
                      post=_overflow_post(spec), requires_grad=spec["grad"])
    theta = {"qkv": qkv}
    bias = _bias_tensor(spec["bias"], gen, device)
    if bias is not None:
        theta["bias"] = bias
    mask = _mask_tensor(spec["mask"], gen, device)
    causal, scale, mode = spec["causal"], spec["scale"], spec["mode"]

    def call():
        return va.attention_qkvpacked(theta["qkv"], bias=theta.get("bias"), attn_mask=mask, is_causal=causal,
                                      scale=scale, mode=mode)

    def ref_args(th):
        q, k, v = th["qkv"].permute(2, 0, 3, 1, 4).unbind(0)
        return {"q": q, "k": k, "v": v, "bias": th.get("bias"), "attn_mask": mask, "is_causal": causal,
                "scale": D ** -0.5 if scale is None else scale}

    return Problem(theta, call, lambda o: o.transpose(1, 2), ref_args, _packed_slicers(lambda g: g.transpose(1, 2)),
                   (B, N, H, D), (0, 2, 1, 3), (0, 2), dt)


def _window_problem(spec: dict, gen, device) -> Problem:

    BW, H, N, D, Dv, nw = (spec[k] for k in ("B", "H", "Nq", "D", "Dv", "num_windows"))
    imgs = spec["images"]
    dt = _dtype(spec["dtype"])
    packed_family = spec["family"] == "window-qkvpacked"
    theta: dict = {}
    if packed_family:
        theta["qkv"] = make_tensor((BW, N, 3, H, D), spec["layouts"]["qkv"], gen, device, dt, perm=(0, 2, 3, 1, 4),
                                   post=_overflow_post(spec), requires_grad=spec["grad"])
    elif spec["layouts"] == "packed":
        qkv = make_tensor((BW, N, 3, H, D), "contiguous", gen, device, dt, post=_overflow_post(spec),
                          requires_grad=spec["grad"])
        theta.update(zip(("q", "k", "v"), qkv.permute(2, 0, 3, 1, 4).unbind(0)))
    else:
        shapes = {"q": (BW, H, N, D), "k": (BW, H, N, D), "v": (BW, H, N, Dv)}
        theta.update(_qkv_separate(spec, gen, device, dt, shapes.get, (0, 2, 1, 3), set(spec.get("needs", ()))))
    cosine = spec["cosine"]
    r = spec["rpb"]
    if r is not None:
        def rpb_post(b):
            b.mul_(r["sigma"])
            if cosine:  # Swin-v2: 16 * sigmoid(cpb_mlp(...))
                b.copy_(16 * torch.sigmoid(b.float()).to(b.dtype))

        shape = (H, N, N) if r["shape"] == "HNN" else (1, H, N, N)
        layout = r["layout"] if r["shape"] == "HNN" or r["layout"] != "permuted" else "contiguous"
        theta["rpb"] = make_tensor(shape, layout, gen, device, _dtype(r["dtype"]), post=rpb_post,
                                   requires_grad=r["grad"])
    ls = spec["logit_scale"]
    if ls is not None:
        def ls_post(b):  # log of U(1, 100) (timm's init is log 10); "clamped": some heads above log(100)
            hi = 300.0 if ls["clamped"] else 100.0
            b.copy_(torch.log(1.0 + (hi - 1.0) * torch.rand(b.shape, generator=gen, device=device)).to(b.dtype))

        theta["logit_scale"] = make_tensor((H, 1, 1) if ls["shape"] == "H11" else (H,), "contiguous", gen, device,
                                           _dtype(ls["dtype"]), post=ls_post, requires_grad=ls["grad"])
    s = spec["shift"]
    shift = None
    if s is not None:
        region = torch.randint(0, s["regions"], (nw, N), generator=gen, device=device)
        same = region[:, :, None] == region[:, None, :]
        if s["dead"] and N > 1:
            same[0, N // 2] = False  # a row that sees no key (bool / -inf masks)
        if s["kind"] == "bool":
            shift = same
        else:
            fill = -100.0 if s["kind"] == "-100" else float("-inf")
            shift = torch.zeros(nw, N, N, device=device).masked_fill(~same, fill)
        layout = {"expanded": "expanded@0", "transposed": "transposed"}.get(s["layout"], s["layout"])
        shift = place(shift, layout, perm=(0, 2, 1))
    scale, mode = spec["scale"], spec["mode"]

    def call():
        t = theta
        kw = dict(relative_position_bias=t.get("rpb"), shift_mask=shift, num_windows=nw, cosine=cosine,
                  logit_scale=t.get("logit_scale"), scale=scale, mode=mode)
        if packed_family:
            return va.window_attention_qkvpacked(t["qkv"], **kw)
        return va.window_attention(t["q"], t["k"], t["v"], **kw)

    def ref_args(th):
        if packed_family:
            q, k, v = th["qkv"].permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = th["q"], th["k"], th["v"]
        sc = D ** -0.5 if scale is None else scale
        if cosine:
            mult = torch.exp(torch.clamp(th["logit_scale"].reshape(1, H, 1, 1), max=math.log(100.0))).to(q.dtype)
            q, k, sc = F.normalize(q, dim=-1) * mult, F.normalize(k, dim=-1), 1.0
        bias = attn_mask = None
        if "rpb" in th:
            bias = th["rpb"].reshape(1, H, N, N).to(q.dtype)
        if shift is not None:
            per_window = shift.repeat(imgs, 1, 1)[:, None]  # window b uses shift[b % nW]
            if shift.dtype == torch.bool:
                attn_mask = per_window
            else:
                bias = per_window.to(q.dtype) if bias is None else bias + per_window.to(q.dtype)
        return {"q": q, "k": k, "v": v, "bias": bias, "attn_mask": attn_mask, "is_causal": False, "scale": sc}

    if packed_family:
        return Problem(theta, call, lambda o: o.transpose(1, 2), ref_args,
                       _packed_slicers(lambda g: g.transpose(1, 2)), (BW, N, H, D), (0, 2, 1, 3), (0, 2), dt)
    ident = lambda g: g  # noqa: E731
    slicers = {"q": [("dq", ident)], "k": [("dk", ident)], "v": [("dv", ident)], "rpb": [("dbias", ident)],
               "logit_scale": [("dlogit_scale", ident)]}
    return Problem(theta, call, ident, ref_args, slicers, (BW, H, N, Dv), (0, 2, 1, 3), (0, 1), dt)


def _varlen_problem(spec: dict, gen, device) -> Problem:
    H, D, Dv = spec["H"], spec["D"], spec["Dv"]
    lens_q, lens_k = spec["lens_q"], spec["lens_k"]
    tq, tk = sum(lens_q), sum(lens_k)
    dt = _dtype(spec["dtype"])
    needs = set(spec.get("needs", ()))
    if spec["layouts"] == "packed":
        qkv = make_tensor((tq, 3, H, D), "contiguous", gen, device, dt, post=_overflow_post(spec),
                          requires_grad=bool(needs))
        theta = dict(zip(("q", "k", "v"), qkv.unbind(1)))
    else:
        shapes = {"q": (tq, H, D), "k": (tk, H, D), "v": (tk, H, Dv)}
        theta = _qkv_separate(spec, gen, device, dt, shapes.get, (1, 0, 2), needs)
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    extra = {"none": None, "exact": 0, "loose": 5}[spec["max_seqlen"]]
    max_q = None if extra is None else max(lens_q) + extra
    max_k = None if extra is None else max(lens_k) + extra
    causal, scale, mode = spec["causal"], spec["scale"], spec["mode"]
    listed = spec["form"] == "list"
    # the oracle: one dense call over the packed tokens with a block-diagonal (and in-sequence causal) mask
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q), device=device), torch.tensor(lens_q, device=device))
    seq_k = torch.repeat_interleave(torch.arange(len(lens_k), device=device), torch.tensor(lens_k, device=device))
    keep = seq_q[:, None] == seq_k[None, :]
    if causal:
        pos_q = torch.arange(tq, device=device) - cu_q[:-1].long()[seq_q]
        pos_k = torch.arange(tk, device=device) - cu_k[:-1].long()[seq_k]
        keep &= pos_k[None, :] <= pos_q[:, None]

    def call():
        t = theta
        if listed:
            return va.varlen_attention(list(t["q"].split(lens_q)), list(t["k"].split(lens_k)),
                                       list(t["v"].split(lens_k)), max_seqlen_q=max_q, max_seqlen_k=max_k,
                                       mode=mode, scale=scale, is_causal=causal)
        return va.varlen_attention(t["q"], t["k"], t["v"], cu_q, cu_k, max_q, max_k, mode=mode, scale=scale,
                                   is_causal=causal)

    def canon(o):
        if isinstance(o, (list, tuple)):
            o = torch.cat(list(o)) if len(o) else torch.zeros((0, H, Dv), device=device)
        return o.transpose(0, 1).unsqueeze(0)

    def ref_args(th):
        four = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
        return {"q": four(th["q"]), "k": four(th["k"]), "v": four(th["v"]), "bias": None, "attn_mask": keep,
                "is_causal": False, "scale": D ** -0.5 if scale is None else scale}

    to4 = lambda g: g.transpose(0, 1).unsqueeze(0)  # noqa: E731
    slicers = {"q": [("dq", to4)], "k": [("dk", to4)], "v": [("dv", to4)]}
    return Problem(theta, call, canon, ref_args, slicers, (tq, H, Dv), (1, 0, 2), (1,), dt,
                   split=(lambda g: list(g.split(lens_q))) if listed else None)


BUILDERS = {"dense": _dense_problem, "split-kv": _dense_problem, "ring": _dense_problem,
            "qkvpacked": _qkvpacked_problem, "window": _window_problem, "window-qkvpacked": _window_problem,
            "varlen": _varlen_problem}


def _attach_grad_out(prob: Problem, spec: dict, gen, device) -> None:
    """The output gradient of a backward case, in our output's layout (or the constant of sum / mean)."""
    kind = spec["grad_out"]["kind"]
    shape = prob.out_shape
    if kind in ("sum", "mean"):
        value = 1.0 if kind == "sum" else 1.0 / max(1, math.prod(shape))
        prob.grad_out_value = float(torch.tensor(value, dtype=prob.out_dtype))  # what autograd hands the kernel
        return
    layout = {"randn": "contiguous", "transposed": "transposed", "sliced": "sliced", "misaligned": "misaligned",
              "noncontig": "noncontig", "expand-batch": f"expanded@{prob.out_expand[0]}",
              "expand-heads": f"expanded@{prob.out_expand[-1]}"}[kind]
    if layout.startswith("expanded@") and shape[int(layout[9:])] == 1:
        layout = "contiguous"
    prob.grad_out = make_tensor(shape, layout, gen, device, prob.out_dtype, perm=prob.out_perm)


# ----------------------------------------------------------------------------- references
def _drop_low_bits(x, bits: int):
    """``x`` in FP32 with the low ``bits`` bits of its mantissa cleared (a cut toward zero): TF32 as the tensor cores
    read FP32 registers (13 bits), bfloat16 as Triton's interpreter casts FP32 (16 bits)."""
    return (x.float().contiguous().view(torch.int32) & -(1 << bits)).view(torch.float32)


class _TF32Matmul:
    """``a @ b`` with both operands cut to TF32 (11 significant bits, the 13 low mantissa bits dropped), forward
    and backward: PyTorch's TF32 matmul, emulated so it is the same on every device and for every shape."""

    fn = None

    @classmethod
    def apply(cls, a, b):
        if cls.fn is None:

            def rnd(x):
                return _drop_low_bits(x, 13)

            class Fn(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, y):
                    ctx.save_for_backward(x, y)
                    return rnd(x) @ rnd(y)

                @staticmethod
                def backward(ctx, g):
                    x, y = ctx.saved_tensors
                    gx = (rnd(g) @ rnd(y).transpose(-1, -2)).sum_to_size(x.shape)
                    gy = (rnd(x).transpose(-1, -2) @ rnd(g)).sum_to_size(y.shape)
                    return gx, gy

            cls.fn = Fn
        return cls.fn.apply(a, b)


@contextlib.contextmanager
def _fp32_matmuls():
    """PyTorch's FP32 matmuls in full FP32 for the duration (TF32 off); the previous setting restored."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def same_precision_attention(q, k, v, *, bias=None, attn_mask=None, is_causal=False, scale, tf32=False):
    """Plain PyTorch attention (SDPA's math path: ``softmax(q k^T scale + bias, masked) v``) in the inputs' dtype;
    rows with no visible key give zeros. ``tf32``: every matmul on TF32-rounded operands."""
    mm = _TF32Matmul.apply if tf32 else torch.matmul
    s = mm(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    keep = attn_mask
    if is_causal:
        causal = torch.arange(q.shape[-2], device=q.device)[:, None] >= torch.arange(k.shape[-2], device=q.device)
        keep = causal if keep is None else keep & causal
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return mm(p, v)


def _grads(out, theta: dict, go):
    """Gradients of ``out`` (with output gradient ``go``) for the entries of ``theta`` that require them (zeros
    where ``out`` does not depend on one)."""
    names = [n for n, t in theta.items() if t.requires_grad]
    if not names:
        return {}
    got = torch.autograd.grad(out, [theta[n] for n in names], go, allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(theta[n])) for n, g in zip(names, got)}


def oracle(prob: Problem, go64, need_grads: bool, ds_dtype: torch.dtype | None = None,
           truncate: bool = False) -> dict:
    """The float64 oracle on the case's device: ``out`` [B, H, Nq, Dv], ``dead`` [B, H, Nq] (rows with no visible
    key), and with ``need_grads`` the gradients and cancellation floors by theta name (module docstring); with
    ``ds_dtype`` (a half dtype) also ``ds_rounding``: by theta name, the change of the gradient when the exact
    ``dS`` is rounded to ``ds_dtype`` before its products (module docstring; ``truncate``: cast as Triton's
    interpreter casts FP32 to bfloat16, :func:`_to_half`)."""
    from visionattn.reference import oracle_attention, scores_and_mask

    th = {n: t.detach().double().requires_grad_(t.requires_grad) for n, t in prob.theta.items()}
    args = prob.ref_args(th)
    if args["k"].shape[-2] == 0:  # no keys at all: zeros (oracle_attention's amax needs a key)
        q, v = args["q"], args["v"]
        out = q.new_zeros(torch.broadcast_shapes(q.shape[:-2], v.shape[:-2]) + (q.shape[-2], v.shape[-1]))
        res = {"out": out, "dead": out.new_ones(out.shape[:-1], dtype=torch.bool)}
        if need_grads:
            res["floors"], res["ds_rounding"] = {}, {}
            res["grads"] = {n: torch.zeros_like(t) for n, t in th.items() if t.requires_grad}
        return res
    out, p = oracle_attention(**args, return_probs=True)
    res = {"out": out.detach(), "dead": (p.detach().sum(-1) == 0)}
    if need_grads:
        v_norm = args["v"].detach().norm(dim=-1)
        w = go64.norm(dim=-1) * v_norm.amax(-1, keepdim=True)
        weight = (p.detach() * w.unsqueeze(-1))
        s = scores_and_mask(args["q"], args["k"], scale=args["scale"], bias=args["bias"],
                            attn_mask=args["attn_mask"], is_causal=args["is_causal"])
        live = torch.where(p.detach() > 0, s, torch.zeros_like(s))  # the logits, masked ones (-inf) as 0
        # the floors and the rounding term go back through the graph that the gradients then free (a cosine
        # window's normalisation and logit scale lie on both paths), so the gradients come last
        res["floors"] = _cancellation_floors(th, live, weight)
        res["ds_rounding"] = ({} if ds_dtype is None else
                              _ds_rounding(th, live, p.detach(), go64, args["v"], out.detach(), ds_dtype, truncate))
        res["grads"] = _grads(out, th, go64)
    return res


def _to_half(x, dtype: torch.dtype, truncate: bool):
    """``x`` cast to the half ``dtype`` (back in float64) as a kernel casts it: to nearest, or with ``truncate`` as
    Triton's interpreter casts FP32 to bfloat16, the FP32 value's low 16 bits dropped (module docstring)."""
    if not truncate:
        return x.to(dtype).double()
    return _drop_low_bits(x, 16).double()


def _ds_rounding(th: dict, live, p, go64, v, out, dtype, truncate: bool = False) -> dict:
    """By theta name, the gradient of ``<S, round(dS') - dS>``: how far dQ / dK / dBias (/ dLogitScale) move when a
    FlashAttention-style half backward forms ``dS' = P (dO V^T - D')`` with ``D'_i = dO_i . round(O_i)`` from the
    output it stored in ``dtype`` and rounds ``dS'`` to ``dtype`` for the tensor cores, against the exact
    ``dS = P (dO V^T - D)`` (the module docstring's ``r``); ``live``: the logits S with masked ones as 0;
    ``truncate``: both casts as the interpreter's bfloat16 casts (:func:`_to_half`)."""
    names = [n for n, t in th.items() if t.requires_grad]
    if not names or not live.requires_grad:
        return {}
    dp = go64 @ v.detach().transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    stored = (go64 * _to_half(out, dtype, truncate)).sum(-1, keepdim=True)  # D' from the stored half output
    kernel = _to_half(p * (dp - stored), dtype, truncate)
    got = torch.autograd.grad((live * (kernel - ds)).sum(), [th[n] for n in names], allow_unused=True,
                              retain_graph=True)
    return {n: g.detach() for n, g in zip(names, got) if g is not None}


# random-sign draws of the cancellation floor's RMS term: an element's RMS over n draws falls below a quarter of its
# expectation with probability ~ (n / 32)^(n / 2) / (n / 2)! (4 draws: ~1 / 140, over the thousands of elements of a
# gradient a certainty; 16 draws: ~1e-7)
CANCEL_DRAWS = 16


def _cancellation_floors(th: dict, live, weight, draws: int = CANCEL_DRAWS) -> dict:
    """The vectors ``c`` of the cancellation floor (module docstring) by theta name: elementwise the larger of
    the gradient of ``<S, W>`` (one rounding of ``D_i`` per row: coherent over the row's keys) and the RMS over
    ``draws`` random-sign versions ``<S, W r>``, ``r_ij = +-1`` (one rounding per ``dP_ij``: incoherent), with
    ``W = P w`` held fixed; ``live``: the logits S with masked ones (-inf, no weight) as 0."""
    names = [n for n, t in th.items() if t.requires_grad]
    if not names or not live.requires_grad:
        return {}
    gen = torch.Generator(device=weight.device).manual_seed(0)
    coherent = torch.autograd.grad((live * weight).sum(), [th[n] for n in names], allow_unused=True,
                                   retain_graph=True)
    squares = [None] * len(names)
    for _ in range(draws):
        sign = torch.randint(0, 2, weight.shape, generator=gen, device=weight.device, dtype=weight.dtype) * 2 - 1
        got = torch.autograd.grad((live * weight * sign).sum(), [th[n] for n in names], allow_unused=True,
                                  retain_graph=True)
        squares = [a if g is None else (g.detach() ** 2 if a is None else a + g.detach() ** 2)
                   for a, g in zip(squares, got)]
    return {n: torch.maximum(c.detach().abs(), (sq / draws).sqrt()) for n, c, sq in zip(names, coherent, squares)
            if c is not None and sq is not None}


def torch_reference(prob: Problem, mode: str, go64, need_grads: bool) -> dict:
    """PyTorch's attention at the mode's precision (:func:`same_precision_attention`): ``out`` in the oracle's
    layout and, with ``need_grads``, its gradients by theta name."""
    md = va.get_mode(mode)
    th = {n: t.detach().to(md.compute_dtype).requires_grad_(t.requires_grad) for n, t in prob.theta.items()}
    with _fp32_matmuls():
        args = prob.ref_args(th)
        out = same_precision_attention(**args, tf32=mode == "tf32")
        grads = _grads(out, th, go64.to(out.dtype)) if need_grads else {}
    return {"out": out.detach(), "grads": grads}


# ----------------------------------------------------------------------------- checking
def _norm(t) -> float:
    return float(torch.linalg.vector_norm(t.detach().double())) if t.numel() else 0.0


def check_quantity(name: str, got, gold, ref, mode: str, floor=None, interpreted: bool = False,
                   ds_rounding=None) -> dict:
    """Compare one output or gradient with the oracle by the module docstring's rules.

    Args:
        name: ``out`` or a gradient's name (``dq``, ``dk``, ``dv``, ``dbias``, ``dlogit_scale``).
        got: ours (its dtype is the one the result is stored in); gold: the float64 oracle's; ref: PyTorch's at
            the mode's precision (same shape; None: no PyTorch term); floor: a gradient's cancellation vector
            ``c`` (None: none); ds_rounding: the gradient's move under a half ``dS`` (``r``; None: none).
        mode: the mode whose contract and roundoff apply.
        interpreted: the kernels ran in Triton's interpreter (bf16's bounds widened, module docstring).

    Returns:
        ``{"err", "beyond_floor", "bound", "ratio", "ref_err", "ok", "why"}``: relative L2 errors (``err`` of ours,
        ``beyond_floor`` of the part of it above the cancellation floor, ``ref_err`` of PyTorch's), the bound in the
        same units, ``beyond_floor / bound`` (0 when both are 0, inf when only the bound is), whether it passes
        and, if not, why.
    """
    if tuple(got.shape) != tuple(gold.shape):
        return {"err": math.inf, "beyond_floor": math.inf, "bound": 0.0, "ratio": math.inf, "ref_err": None,
                "ok": False, "why": f"{name}: shape {tuple(got.shape)}, expected {tuple(gold.shape)}"}
    if got.numel() and not bool(torch.isfinite(got.detach()).all()):
        bad = int((~torch.isfinite(got.detach())).sum())
        return {"err": math.inf, "beyond_floor": math.inf, "bound": 0.0, "ratio": math.inf, "ref_err": None,
                "ok": False, "why": f"{name}: {bad} non-finite values (NaN / inf)"}
    gd = gold.detach().double()
    diff = (got.detach().double() - gd).abs()
    a, gn = _norm(diff), _norm(gd)
    tn = _norm(ref.detach().double() - gd) if ref is not None else None
    stored = _norm(gd.to(got.dtype).double() - gd) if got.dtype != torch.float64 else 0.0  # the result's rounding
    factor = INTERPRETER_BF16_FACTOR if interpreted and mode == "bf16" else 1.0
    contract = va.get_mode(mode).rel_tol
    if name == "out":
        beyond = a
        bound = max(contract * gn, (2 * factor * tn + 2 * stored + FWD_FLOOR * gn) if tn is not None else 0.0)
    else:
        excess = diff
        if interpreted and mode == "bf16":
            excess = (diff - INTERPRETER_BF16_UNDERFLOW).clamp_min(0)
        beyond = _norm(excess) if floor is None else _norm((excess - CANCEL_FACTOR * UNIT_ROUNDOFF[mode]
                                                            * floor.detach().double().abs()).clamp_min(0))
        bound = (2 * factor * tn if tn is not None else 0.0) + 2 * stored + \
            (2 * _norm(ds_rounding) if ds_rounding is not None else 0.0) + \
            (GRAD_FLOOR_FP32 if mode in FP32_ACCURATE else GRAD_FLOOR) * gn
        if mode == "tf32":  # PyTorch's TF32 is no one arithmetic (module docstring): never below the contract
            bound = max(bound, contract * gn)
        if interpreted and mode == "bf16":
            bound = max(bound, INTERPRETER_BF16_CONTRACTS * contract * gn)

    def rel(x):
        return x / gn if gn > 0 else (0.0 if x == 0 else math.inf)

    ok = beyond <= bound
    res = {"err": rel(a), "beyond_floor": rel(beyond), "bound": rel(bound),
           "ratio": 0.0 if beyond == 0 else (beyond / bound if bound > 0 else math.inf),
           "ref_err": rel(tn) if tn is not None else None, "ok": ok, "why": None}
    if not ok:
        ref_text = "n/a" if res["ref_err"] is None else f"{res['ref_err']:.3e}"
        res["why"] = (f"{name}: rel err {res['err']:.3e} (beyond the cancellation floor {res['beyond_floor']:.3e}) > "
                      f"bound {res['bound']:.3e} (PyTorch's own: {ref_text})" if gn > 0 else
                      f"{name}: {beyond:.3e} (L2, beyond the cancellation floor) where the oracle is exactly 0")
    return res


def dead_rows_ok(name: str, got, dead) -> str | None:
    """None if every row of ``got`` [B, H, Nq, *] flagged in ``dead`` [B, H, Nq] is exactly 0, else why not."""
    if not bool(dead.any()) or tuple(got.shape[:-1]) != tuple(dead.shape):
        return None
    rows = got.detach()[dead]
    if bool((rows == 0).all()):
        return None
    return (f"{name}: {int((rows != 0).any(-1).sum())} of {int(dead.sum())} fully masked rows are not zero "
            f"(max |x| {float(rows.abs().max()) if bool(torch.isfinite(rows).all()) else float('nan'):.3e})")


def is_cuda_error(err: BaseException) -> bool:
    """Whether ``err`` is a CUDA error that leaves the context unusable (illegal address, device assert, ...)."""
    name = type(err).__name__
    text = str(err)
    return name in ("AcceleratorError", "CudaError") or any(w in text for w in CUDA_ERROR_WORDS)


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"


_GROUP: dict = {}


def _ring_group(device) -> str | None:
    """Make (once) a one-rank process group for the ring family: gloo on the CPU, NCCL on CUDA. Returns None when
    one is ready, else why the ring cannot run."""
    import torch.distributed as dist

    if "why" in _GROUP:
        return _GROUP["why"]
    why = None
    try:
        if not dist.is_available():
            why = "torch.distributed is not available"
        elif dist.is_initialized():
            if dist.get_world_size() != 1:
                why = f"a process group of {dist.get_world_size()} ranks is already initialised"
        else:
            path = os.path.join(tempfile.mkdtemp(prefix="gpu_conformance_"), "init")
            kw = {}
            if device.type == "cuda":
                kw["device_id"] = torch_device_of(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{path}",
                                    rank=0, world_size=1, **kw)
            _GROUP["made"] = True
        from visionattn.distributed import _context_parallel  # noqa: F401  (the ring entry this suite runs)
    except Exception as e:  # noqa: BLE001  any reason a one-rank group cannot be made skips the family
        why = f"no one-rank process group: {_error_text(e)}"
    _GROUP["why"] = why
    return why


def torch_device_of(device):
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def release_ring_group() -> None:
    import torch.distributed as dist

    if _GROUP.pop("made", None) and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP.clear()


def _reset_fallback_warnings() -> None:
    """Let the library's once-per-process fallback warnings fire again, so each case records its own."""
    from visionattn import dispatch

    warned = getattr(dispatch, "_warned", None)
    if isinstance(warned, set):
        warned.clear()


def run_case(spec: dict, device, backend: str = "triton") -> dict:
    """Run one case: build its tensors, call the API (and its backward), the oracle and PyTorch's reference,
    check. Returns the JSON-serialisable result: ``status`` (``pass``, ``fail``, ``refused``, ``skipped``,
    ``harness-error``), ``metrics`` by quantity, ``errors``, ``fallbacks`` (warnings naming a reference fallback),
    ``cuda_error`` (the context is unusable after it), ``seconds``."""
    t0 = time.perf_counter()
    res = {"id": spec["id"], "family": spec["family"], "mode": spec["mode"], "grad": spec["grad"],
           "desc": describe(spec), "status": "pass", "metrics": {}, "errors": [], "fallbacks": [],
           "cuda_error": False}

    def done(status=None, error=None):
        if status:
            res["status"] = status
        if error:
            res["errors"].append(error)
        res["seconds"] = round(time.perf_counter() - t0, 4)
        return res

    from visionattn.kernels._launch import interpreting

    why = INTERPRETER_SKIPS.get((spec["family"], spec["mode"]))
    if why and interpreting() and device.type == "cpu" and backend != "reference":
        return done("skipped", why)
    if spec["family"] == "ring":
        why = _ring_group(device)
        if why:
            return done("skipped", why)
    gen = torch.Generator(device=device).manual_seed(spec["tensor_seed"])
    _reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught, va.use_backend(backend):
        warnings.simplefilter("always")
        try:
            prob = BUILDERS[spec["family"]](spec, gen, device)
            if spec["grad"]:
                _attach_grad_out(prob, spec, gen, device)
        except Exception as e:  # noqa: BLE001
            res["cuda_error"] = is_cuda_error(e)
            return done("harness-error", f"building the inputs: {_error_text(e)}")
        try:
            with contextlib.nullcontext() if spec["grad"] else torch.no_grad():
                out = prob.call()
                grads = _our_grads(prob, out, spec) if spec["grad"] else {}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except (ValueError, TypeError) as e:
            res["fallbacks"] = _fallbacks(caught)
            if spec["expect_refusal"] and spec.get("refusal_words", "") in str(e):
                res["refusal"] = spec["expect_refusal"]
                return done("refused", _error_text(e))
            if spec["expect_refusal"]:
                return done("fail", f"refused, but not as documented ({spec['expect_refusal']}): {_error_text(e)}")
            return done("fail", f"unexpected refusal of a supported call: {_error_text(e)}")
        except Exception as e:  # noqa: BLE001  RuntimeError, CUDA errors, Triton compile errors: failures
            res["cuda_error"] = is_cuda_error(e)
            res["fallbacks"] = _fallbacks(caught)
            return done("fail", _error_text(e))
        res["fallbacks"] = _fallbacks(caught)
    if spec["expect_refusal"]:
        return done("fail", f"expected a documented refusal ({spec['expect_refusal']}), but the call returned")
    try:
        errors = _check(prob, spec, out, grads, device, res["metrics"])
    except Exception as e:  # noqa: BLE001
        res["cuda_error"] = is_cuda_error(e)
        return done("harness-error", f"references / checks: {_error_text(e)}")
    for err in errors:
        res["errors"].append(err)
    return done("fail" if errors else "pass")


def _fallbacks(caught) -> list[str]:
    return sorted({str(w.message)[:240] for w in caught if "visionattn" in str(w.message)})


def _our_grads(prob: Problem, out, spec: dict) -> dict:
    """Our gradients by theta name: of ``out.sum()`` / ``out.mean()``, or of ``out`` with the drawn output
    gradient (split like the output for listed sequences)."""
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    kind = spec["grad_out"]["kind"]
    names = [n for n, t in prob.theta.items() if t.requires_grad]
    if kind in ("sum", "mean"):
        loss = sum(o.sum() for o in outs) if kind == "sum" else outs[0].mean()
        got = torch.autograd.grad(loss, [prob.theta[n] for n in names], allow_unused=True)
    else:
        gos = prob.split(prob.grad_out) if prob.split is not None else [prob.grad_out]
        pairs = [(o, g) for o, g in zip(outs, gos) if o.numel()]
        got = torch.autograd.grad([o for o, _ in pairs], [prob.theta[n] for n in names], [g for _, g in pairs],
                                  allow_unused=True) if pairs else [None] * len(names)
    return {n: (g if g is not None else torch.zeros_like(prob.theta[n])) for n, g in zip(names, got)}


def _check(prob: Problem, spec: dict, out, grads: dict, device, metrics: dict) -> list[str]:
    """Every check of a case that ran; fills ``metrics`` by quantity, returns the failures' texts."""
    errors = []
    mode = spec["mode"]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    for o in outs:
        if o.dtype != prob.out_dtype:
            errors.append(f"out: dtype {o.dtype}, expected the input's {prob.out_dtype}")
            break
    if not isinstance(out, (list, tuple)) and tuple(out.shape) != tuple(prob.out_shape):
        errors.append(f"out: shape {tuple(out.shape)}, expected {tuple(prob.out_shape)}")
    got_out = prob.canon(out)
    go64 = None
    if spec["grad"]:
        shape = tuple(got_out.shape)
        go64 = (torch.full(shape, prob.grad_out_value, dtype=torch.float64, device=device)
                if prob.grad_out is None else prob.canon(prob.grad_out).double())
    from visionattn.kernels._launch import interpreting

    interpreted = interpreting() and device.type == "cpu"
    compute = va.get_mode(mode).compute_dtype
    gold = oracle(prob, go64, spec["grad"], compute if compute in (torch.float16, torch.bfloat16) else None,
                  truncate=interpreted and compute == torch.bfloat16)
    ref = torch_reference(prob, mode, go64, spec["grad"])
    metrics["out"] = check_quantity("out", got_out, gold["out"], ref["out"], mode, interpreted=interpreted)
    why = dead_rows_ok("out", got_out, gold["dead"])
    if why:
        errors.append(why)
    for name, got in grads.items():
        for quantity, sl in prob.slicers[name]:
            g = gold["grads"][name]
            floor, moved = gold["floors"].get(name), gold["ds_rounding"].get(name)
            m = check_quantity(quantity, sl(got), sl(g), sl(ref["grads"][name]), mode,
                               None if floor is None else sl(floor), interpreted, None if moved is None else sl(moved))
            metrics[quantity] = m
            if quantity == "dq":
                why = dead_rows_ok("dq", sl(got), gold["dead"])
                if why:
                    errors.append(why)
    errors += [m["why"] for m in metrics.values() if not m["ok"]]
    return errors

# ----------------------------------------------------------------------------- selecting, reporting
def parse_case_id(text: str) -> tuple[int, int]:
    """``"S:I"`` -> (seed, index); ``ValueError`` naming the expected form otherwise."""
    try:
        seed, index = text.split(":")
        seed, index = int(seed), int(index)
        if index < 0:
            raise ValueError
        return seed, index
    except ValueError:
        raise ValueError(f"expected a case id SEED:INDEX (e.g. 0:123), got {text!r}") from None


def select_cases(seed: int, count: int, profile: str, families=FAMILIES, modes=MODES) -> list[dict]:
    """The first ``count`` cases of ``seed`` whose family is one of ``families`` and mode one of ``modes``, in id
    order (at most ``1000 * count`` ids are drawn)."""
    fams, modes = set(families), set(modes)
    out, i = [], 0
    while len(out) < count and i < 1000 * count:
        spec = draw_case(seed, i, profile)
        if spec["family"] in fams and spec["mode"] in modes:
            out.append(spec)
        i += 1
    return out


def summarize(specs: list[dict], results: list[dict], seconds: float, stopped: str | None,
              reproduce: Callable[[str], str]) -> dict:
    """A run's JSON report: counts per family x mode, failures, refusals, skips, worst errors per mode and
    quantity, fallbacks, every result. ``reproduce(case_id)``: the command line that re-runs a case."""
    by_id = {s["id"]: s for s in specs}
    counts: dict = {}
    worst: dict = {}
    failures, refused, skipped, fallbacks = [], [], [], {}
    for r in results:
        spec = by_id.get(r["id"])
        fam, mode = (spec["family"], spec["mode"]) if spec else (r.get("family"), r.get("mode"))
        cell = counts.setdefault(fam, {}).setdefault(mode, {"pass": 0, "fail": 0, "refused": 0, "skipped": 0,
                                                             "crash": 0, "harness-error": 0})
        cell[r["status"]] = cell.get(r["status"], 0) + 1
        for q, m in r.get("metrics", {}).items():
            w = worst.setdefault(mode, {}).get(q)
            if w is None or _key(m["ratio"]) > _key(w["ratio"]):
                worst[mode][q] = {"err": m["err"], "beyond_floor": m["beyond_floor"], "bound": m["bound"],
                                  "ratio": m["ratio"], "ref_err": m["ref_err"], "case": r["id"]}
        entry = {"id": r["id"], "reproduce": reproduce(r["id"]),
                 "desc": r.get("desc", describe(spec) if spec else ""), "errors": r.get("errors", [])}
        if r["status"] in ("fail", "crash", "harness-error"):
            failures.append({**entry, "status": r["status"]})
        elif r["status"] == "refused":
            refused.append({**entry, "refusal": r.get("refusal")})
        elif r["status"] == "skipped":
            skipped.append(entry)
        for f in r.get("fallbacks", []):
            fallbacks.setdefault(f, []).append(r["id"])
    total = {s: sum(c.get(s, 0) for fam in counts.values() for c in fam.values())
             for s in ("pass", "fail", "refused", "skipped", "crash", "harness-error")}
    return {"summary": {"cases_selected": len(specs), "cases_run": len(results), **total,
                        "failed": total["fail"] + total["crash"] + total["harness-error"],
                        "seconds": round(seconds, 2), "stopped_early": stopped},
            "counts": counts, "worst": worst, "failures": failures, "refused": refused, "skipped": skipped,
            "fallbacks": {k: {"cases": len(v), "first": v[:5]} for k, v in sorted(fallbacks.items())},
            "results": results}


def _key(x) -> float:
    return math.inf if x is None or (isinstance(x, float) and math.isnan(x)) else x

