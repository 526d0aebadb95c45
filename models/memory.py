"""Memory model of VGGT / FastVGGT inference: analytic peak bytes, the most frames that fit, a live-bytes meter.

:func:`estimate_memory` counts the tensors alive at the two candidate peaks of a
forward pass with grad disabled (``VGGT.infer`` / ``torch.no_grad``):

* inside the aggregator's last kept layer: weights, the kept layer outputs
  [B, S, P, 2C] built so far, and one block's transient tensors (residual input and
  output, ``norm1``, qkv, qk-normed and rotated q / k, the attention output and its
  head merge, the projection; in global blocks also the frame block's output);
* inside the heads: weights, the kept layers, the preallocated outputs
  (``depth`` / ``world_points`` and confidences) and one DPT frame chunk's
  full-resolution activations (plus the track head's feature maps with query points).

Every size is in elements of the tensors the code allocates; half modes
(bf16 / fp16 autocast) keep the residual stream and the kept layers in FP32 (the
blocks' LayerNorm and LayerScale outputs are FP32 under autocast) and add the
autocast cache of half-precision weight copies. The coefficients are those of the
code in :mod:`visionattn.models.layers` (counted with :class:`LiveBytes`).

:class:`LiveBytes` measures the same quantity on any device: the peak of the
bytes held by live tensor storages created inside it (views counted once), plus
a base the caller passes (e.g. the weights). On CUDA ``torch.cuda.max_memory_allocated``
is the reference; it adds allocator rounding (blocks of 512 B) and kernel workspaces.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["estimate_memory", "max_frames_that_fit", "LiveBytes", "MODES"]

MODES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
"""Memory-model modes -> element size of the attention / MLP activations (half modes: autocast)."""

# attention half of one block, in units of one [N, C] FP32 tensor (N = B*S*P rows). FP32: x in, norm1, qkv (3),
# q_norm, k_norm, rotated q, the rotation temporaries of k, attention output; LiveBytes counts ~ 12 on the CPU
# path, CUDA's max_memory_allocated ~ 10 on the kernel path (VGGT-1B at 200 and 500 frames: fewer rotation
# temporaries alive at once), and the model is of the CUDA peak. Half autocast: x, norm1, q_norm, k_norm and the
# rotations in FP32, qkv and the casts of q, k, v in half ~ 7.4 (both counts agree)
_ATTN_UNITS = {False: 10.0, True: 7.4}
_DPT_FULLRES_EXTRA = 32 * 2 + 8  # full-resolution channels of a DPT chunk beyond ``features`` (conv2, ReLU, output)


def _config_numbers(model_or_config) -> dict:
    """Sizes the model needs: config dict, parameter counts (total, autocast-cast), chunk sizes, heads."""
    from .vggt import VGGT

    if isinstance(model_or_config, VGGT):
        model = model_or_config
    else:
        with torch.device("meta"):
            model = VGGT(**(model_or_config or {}))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    params += sum(b.numel() * b.element_size() for b in model.buffers())
    cast = sum(m.weight.numel() for m in model.aggregator.modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
    cfg = dict(model.config)
    return {"model": model, "cfg": cfg, "param_bytes": params, "cast_elems": cast}


def estimate_memory(model_or_config, frames: int, height: int, width: int, mode: str = "fp32", *,
                    batch: int = 1, query_points: int = 0, keep_all_layers: bool | None = None,
                    include_weights: bool = True, _numbers: dict | None = None) -> int:
    """Peak device bytes of one inference forward (grad disabled), analytic.

    Args:
        model_or_config: a :class:`~visionattn.models.VGGT` (its heads, chunk sizes,
            ``keep_all_layers`` and merging are used) or a config dict (None = VGGT-1B).
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
        bytes (int), the larger of the aggregator peak and the heads peak.

    Raises:
        ValueError: unknown mode, frames < 1, or a size not divisible by the patch size.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {sorted(MODES)}")
    if frames < 1 or batch < 1:
        raise ValueError(f"frames={frames} and batch={batch} must be >= 1")
    nums = _numbers or _config_numbers(model_or_config)
    model, cfg = nums["model"], nums["cfg"]
    p = cfg["patch_size"]
    if height % p or width % p:
        raise ValueError(f"image size {height}x{width} must be a multiple of patch_size={p}")
    h, w = height // p, width // p
    C = cfg["embed_dim"]
    P = 1 + cfg["num_register_tokens"] + h * w
    N = batch * frames * P
    unit = N * C * 4  # one [N, C] FP32 tensor: the residual stream dtype in every mode
    half = MODES[mode] == 2
    depth = cfg["depth"]
    keep_all = model.keep_all_layers if keep_all_layers is None else keep_all_layers
    readers = model.layer_readers(with_tracks=query_points > 0)
    kept = sorted(range(depth)) if keep_all else sorted({i for _, ls in readers for i in ls})

    base = nums["param_bytes"] if include_weights else 0
    if half:
        base += 2 * nums["cast_elems"]  # autocast's half copies of the aggregator weights, held for the forward
    images = batch * frames * 3 * height * width * 4

    # aggregator: one block's transient (units of [N, C] FP32) + kept outputs (2 units each)
    r = cfg["mlp_ratio"]
    chunk = cfg.get("tokens_chunk_size")
    frac = 1.0 if not chunk or chunk >= N else chunk / N
    attn = _ATTN_UNITS[half]
    if frac == 1.0:  # x in, x out, then norm2, fc1, GELU, fc2, LayerScale and the sum
        mlp = 2 + (4 + 2 * r) if not half else 2 + 3 + r + 0.5
    else:  # x in, x out (updated in place) + one chunk's norm2, fc1, GELU, fc2, LayerScale
        mlp = 2 + frac * ((3 + 2 * r) if not half else (2 + r + 0.5))
    block = (max(attn, mlp) + 1) * unit  # + the frame block's output, held during the global block
    agg_peak = 0
    n_kept = 0
    for i in range(depth):
        here = 2 * unit * n_kept + block
        if i in kept:
            here = max(here, 2 * unit * n_kept + 4 * unit)  # x, frame_out and the new [N, 2C] concatenation
            n_kept += 1
        agg_peak = max(agg_peak, here)
    # DINOv2 patch embed: the token tensor + one chunk's block transient (its own width and token count)
    f = min(cfg.get("patch_embed_chunk_size") or batch * frames, batch * frames)
    embed = unit + f * P * C * 4 * max(attn, 6 + 2 * r if not half else 5.5 + r)
    agg_peak = max(agg_peak, embed) + images

    # heads: kept layers + outputs + one DPT chunk at full resolution
    heads = 2 * unit * len(kept) + images
    hw = height * width
    out_ch = (2 if model.depth_head is not None else 0) + (4 if model.point_head is not None else 0)
    heads += batch * frames * hw * out_ch * 4
    if model.depth_head is not None or model.point_head is not None:
        f = min(cfg.get("frames_chunk_size") or frames, frames)
        heads += batch * f * hw * (cfg["dpt_features"] + _DPT_FULLRES_EXTRA) * 4
    if query_points > 0 and model.track_head is not None:
        feat = cfg["track_features"]
        fm = batch * frames * feat * (hw // 4) * 4
        heads += fm * (2 + 1 / 3)  # raw feature maps, normed copy, pyramid
        f = min(cfg.get("frames_chunk_size") or frames, frames)
        heads += batch * f * query_points * (hw // 4) * 4  # correlation volume of one chunk
    if _numbers is not None and "parts" in _numbers:
        _numbers["parts"].update(base=base, aggregator=agg_peak, heads=heads)
    return int(math.ceil(base + max(agg_peak, heads)))


def max_frames_that_fit(free_bytes: int, height: int, width: int, mode: str = "fp32", model=None, *,
                        query_points: int = 0, margin: float = 0.05, limit: int = 100_000) -> int:
    """The most frames whose :func:`estimate_memory` (weights included) fits ``free_bytes``.

    Args:
        free_bytes: device bytes available to the model and its forward (e.g. free memory
            reported by ``torch.cuda.mem_get_info()[0]`` plus what the loaded weights already take).
        height, width: image size in pixels.
        mode: as :func:`estimate_memory`.
        model: a VGGT or a config dict (None = VGGT-1B with its default heads and chunks).
        query_points: track queries per forward (0 = no track head run).
        margin: fraction of ``free_bytes`` kept in reserve (allocator fragmentation, kernel workspaces).
        limit: the largest count considered.

    Returns:
        frames >= 0 (0: not even one frame fits).
    """
    budget = free_bytes * (1.0 - margin)
    nums = _config_numbers(model)

    def fits(s: int) -> bool:
        return estimate_memory(model, s, height, width, mode, query_points=query_points, _numbers=nums) <= budget

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
