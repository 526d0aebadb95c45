"""Memory model of VGGT / FastVGGT / π³ / Pi3X inference: analytic peak bytes, the most frames that fit, a live-bytes
meter.

:func:`estimate_memory` counts the tensors alive at the two candidate peaks of a
forward pass with grad disabled (``VGGT.infer`` / ``torch.no_grad``), for a model or
a config: the arithmetic, and what it counts, is :mod:`visionattn.models.peak_memory`
(which :meth:`VGGT.estimate_memory <visionattn.models.VGGT.estimate_memory>` calls directly). π³ and Pi3X
are passed as models (a meta one costs nothing: ``with torch.device("meta"): Pi3()``) and counted by
:func:`~visionattn.models.peak_memory.pi3_peak_bytes`.
:func:`max_frames_that_fit` inverts it for a memory budget.

:class:`LiveBytes` measures the same quantity on any device: the peak of the
bytes held by live tensor storages created inside it (views counted once), plus
a base the caller passes (e.g. the weights). On CUDA ``torch.cuda.max_memory_allocated``
is the reference; it adds allocator rounding (blocks of 512 B) and kernel workspaces.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .peak_memory import BYTES_PER_ELEMENT, peak_bytes, pi3_peak_bytes
from .vggt import VGGT
from .pi3 import _Pi3Base

__all__ = ["estimate_memory", "max_frames_that_fit", "LiveBytes", "BYTES_PER_ELEMENT"]


def _as_model(model_or_config) -> VGGT | _Pi3Base:
    """The VGGT / π³ / Pi3X itself, or a VGGT built on the meta device from a config dict (None = VGGT-1B)."""
    if isinstance(model_or_config, (VGGT, _Pi3Base)):
        return model_or_config
    with torch.device("meta"):
        return VGGT(**(model_or_config or {}))


def _peak(model, frames: int, height: int, width: int, mode: str, batch: int, query_points: int,
          keep_all_layers: bool | None, include_weights: bool) -> int:
    if isinstance(model, _Pi3Base):
        if query_points:
            raise ValueError(f"query_points={query_points}: {type(model).__name__} has no track head")
        return pi3_peak_bytes(model, frames, height, width, mode, batch=batch, include_weights=include_weights)
    return peak_bytes(model, frames, height, width, mode, batch=batch, query_points=query_points,
                      keep_all_layers=keep_all_layers, include_weights=include_weights)


def estimate_memory(model_or_config, frames: int, height: int, width: int, mode: str = "fp32", *,
                    batch: int = 1, query_points: int = 0, keep_all_layers: bool | None = None,
                    include_weights: bool = True) -> int:
    """Peak device bytes of one inference forward (grad disabled), analytic.

    Args:
        model_or_config: a :class:`~visionattn.models.VGGT` (its heads, chunk sizes,
            ``keep_all_layers`` and merging are used) or a config dict (None = VGGT-1B); or a
            :class:`~visionattn.models.Pi3` / :class:`~visionattn.models.Pi3X` (its sizes and chunk sizes; the
            forward without conditions; ``keep_all_layers`` does not apply).
        frames: S, frames per sample (>= 1).
        height, width: image size in pixels (multiples of the patch size).
        mode: ``"fp32"`` / ``"tf32"`` (FP32 model) or ``"bf16"`` / ``"fp16"`` (half autocast, as
            ``VGGT.infer`` on Ampere+). Attention backends (visionattn or SDPA) need O(N) extra
            memory and are not modelled separately.
        batch: B.
        query_points: N track queries (0: the track head does not run).
        keep_all_layers: override the model's setting (True = official behaviour: all layers held).
        include_weights: add the parameters and buffers (FP32 as stored).

    Returns:
        bytes (int), the largest of the stages' peaks (VGGT: the aggregator's and the heads'), plus
        :data:`~visionattn.models.peak_memory.CUDA_SCRATCH_BYTES` for what CUDA allocates beside the tensors.

    Raises:
        ValueError: unknown mode, frames < 1, a size not divisible by the patch size, or query points for π³.
    """
    return _peak(_as_model(model_or_config), frames, height, width, mode, batch, query_points, keep_all_layers,
                 include_weights)


def max_frames_that_fit(free_bytes: int, height: int, width: int, mode: str = "fp32", model=None, *,
                        query_points: int = 0, margin: float = 0.05, limit: int = 100_000) -> int:
    """The most frames whose :func:`estimate_memory` (weights included) fits ``free_bytes``.

    Args:
        free_bytes: device bytes available to the model and its forward (e.g. free memory
            reported by ``torch.cuda.mem_get_info()[0]`` plus what the loaded weights already take).
        height, width: image size in pixels.
        mode: as :func:`estimate_memory`.
        model: a VGGT, a π³ / Pi3X, or a VGGT config dict (None = VGGT-1B with its default heads and chunks).
        query_points: track queries per forward (0 = no track head run).
        margin: fraction of ``free_bytes`` kept in reserve (allocator fragmentation, kernel workspaces).
        limit: the largest count considered.

    Returns:
        frames >= 0 (0: not even one frame fits).
    """
    budget = free_bytes * (1.0 - margin)
    model = _as_model(model)

    def fits(s: int) -> bool:
        return _peak(model, s, height, width, mode, 1, query_points, None, True) <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # estimate_memory grows with frames: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class LiveBytes(TorchDispatchMode):
    """Context manager: the peak bytes of tensor storages created inside it and alive at once.

    ``with LiveBytes(base=weights_bytes) as meter: model(x)`` then ``meter.peak`` (bytes,
    ``base`` included) and ``meter.current``. Storages are counted once however many views
    they have and uncounted when freed; views and in-place results allocate nothing and are
    skipped (so the weights, created before, are not counted: pass them as ``base``).
    Kernel-internal workspaces are not seen.
    """

    def __init__(self, base: int = 0):
        super().__init__()
        self.current = self.peak = int(base)
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and not t._is_view():
                st = t.untyped_storage()
                key = id(st)
                if key in self._seen or key in inputs:  # counted already, or an in-place / out= result
                    continue
                n = st.nbytes()
                self._seen.add(key)
                self.current += n
                self.peak = max(self.peak, self.current)
                weakref.finalize(st, self._free, key, n)
        return out
