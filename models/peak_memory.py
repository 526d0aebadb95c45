"""Analytic peak bytes of one VGGT / FastVGGT inference forward, from a built model.

:func:`peak_bytes` counts the tensors alive at the two candidate peaks of a
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
code in :mod:`visionattn.models.layers` (counted with :class:`~visionattn.models.memory.LiveBytes`).

The model's own :meth:`VGGT.estimate_memory <visionattn.models.VGGT.estimate_memory>` and the public
:func:`visionattn.models.memory.estimate_memory` (which also takes a config) both end here; this module
reads the model's sizes only and does not import :mod:`.vggt`.
"""
from __future__ import annotations

import math

import torch

from visionattn.modes import get_mode

__all__ = ["BYTES_PER_ELEMENT", "peak_bytes"]

BYTES_PER_ELEMENT = {m: get_mode(m).compute_dtype.itemsize for m in ("fp32", "tf32", "bf16", "fp16")}
"""Modes of the memory model -> bytes per element of the attention / MLP activations (half modes: autocast)."""

# attention half of one block, in units of one [N, C] FP32 tensor (N = B*S*P rows). FP32: x in, norm1, qkv (3),
# q_norm, k_norm, rotated q, the rotation temporaries of k, attention output; LiveBytes counts ~ 12 on the CPU
# path, CUDA's max_memory_allocated ~ 10 on the kernel path (VGGT-1B at 200 and 500 frames: fewer rotation
# temporaries alive at once), and the model is of the CUDA peak. Half autocast: x, norm1, q_norm, k_norm and the
# rotations in FP32, qkv and the casts of q, k, v in half ~ 7.4 (both counts agree)
_ATTN_UNITS = {False: 10.0, True: 7.4}
_DPT_FULLRES_EXTRA = 32 * 2 + 8  # full-resolution channels of a DPT chunk beyond ``features`` (conv2, ReLU, output)


def peak_bytes(model, frames: int, height: int, width: int, mode: str = "fp32", *, batch: int = 1,
               query_points: int = 0, keep_all_layers: bool | None = None, include_weights: bool = True) -> int:
    """Peak device bytes of one inference forward of the built ``model`` (a VGGT; a meta one will do).

    Arguments, return value and errors as :func:`visionattn.models.memory.estimate_memory`, which also takes
    a config instead of a model.
    """
    if mode not in BYTES_PER_ELEMENT:
        raise ValueError(f"mode={mode!r}; expected one of {sorted(BYTES_PER_ELEMENT)}")
    if frames < 1 or batch < 1:
        raise ValueError(f"frames={frames} and batch={batch} must be >= 1")
    cfg = model.config
    p = cfg["patch_size"]
    if height % p or width % p:
        raise ValueError(f"image size {height}x{width} must be a multiple of patch_size={p}")
    h, w = height // p, width // p
    C = cfg["embed_dim"]
    P = 1 + cfg["num_register_tokens"] + h * w
    N = batch * frames * P
    unit = N * C * 4  # one [N, C] FP32 tensor: the residual stream dtype in every mode
    half = BYTES_PER_ELEMENT[mode] == 2
    depth = cfg["depth"]
    keep_all = model.keep_all_layers if keep_all_layers is None else keep_all_layers
    readers = model.layer_readers(with_tracks=query_points > 0)
    kept = sorted(range(depth)) if keep_all else sorted({i for _, ls in readers for i in ls})

    base = 0
    if include_weights:
        base += sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if half:  # autocast's half copies of the aggregator weights, held for the forward
        base += 2 * sum(m.weight.numel() for m in model.aggregator.modules()
                        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
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
    return int(math.ceil(base + max(agg_peak, heads)))
