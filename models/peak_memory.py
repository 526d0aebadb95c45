"""Analytic peak bytes of one VGGT / FastVGGT (:func:`peak_bytes`) or π³ / Pi3X (:func:`pi3_peak_bytes`) inference
forward, from a built model.

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

__all__ = ["BYTES_PER_ELEMENT", "peak_bytes", "pi3_peak_bytes"]

BYTES_PER_ELEMENT = {m: get_mode(m).compute_dtype.itemsize for m in ("fp32", "tf32", "bf16", "fp16")}
"""Modes of the memory model -> bytes per element of the attention / MLP activations (half modes: autocast)."""

# attention half of one block, in units of one [N, C] FP32 tensor (N = B*S*P rows). FP32: x in, norm1, qkv (3),
# q_norm, k_norm, rotated q, the rotation temporaries of k, attention output; LiveBytes counts ~ 12 on the CPU
# path, CUDA's max_memory_allocated ~ 10 on the kernel path (VGGT-1B at 200 and 500 frames: fewer rotation
# temporaries alive at once), and the model is of the CUDA peak. Half autocast: x, norm1, q_norm, k_norm and the
# rotations in FP32, qkv and the casts of q, k, v in half ~ 7.4 (both counts agree)
_ATTN_UNITS = {False: 10.0, True: 7.4}
_DPT_FULLRES_EXTRA = 32 * 2 + 8  # full-resolution channels of a DPT chunk beyond ``features`` (conv2, ReLU, output)



def _patch_grid(cfg: dict, mode: str, frames: int, batch: int, height: int, width: int) -> tuple[int, int]:
    """The patch grid (h, w) of a ``height`` x ``width`` frame, after checking the arguments every estimate takes.

    Raises:
        ValueError: unknown mode, frames or batch < 1, or a size not divisible by the config's patch size.
    """
    if mode not in BYTES_PER_ELEMENT:
        raise ValueError(f"mode={mode!r}; expected one of {sorted(BYTES_PER_ELEMENT)}")
    if frames < 1 or batch < 1:
        raise ValueError(f"frames={frames} and batch={batch} must be >= 1")
    p = cfg["patch_size"]
    if height % p or width % p:
        raise ValueError(f"image size {height}x{width} must be a multiple of patch_size={p}")
    return height // p, width // p


def peak_bytes(model, frames: int, height: int, width: int, mode: str = "fp32", *, batch: int = 1,
               query_points: int = 0, keep_all_layers: bool | None = None, include_weights: bool = True) -> int:
    """Peak device bytes of one inference forward of the built ``model`` (a VGGT; a meta one will do).

    Arguments, return value and errors as :func:`visionattn.models.memory.estimate_memory`, which also takes
    a config instead of a model.
    """
    cfg = model.config
    h, w = _patch_grid(cfg, mode, frames, batch, height, width)
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


# π³ / Pi3X pixel heads, in FP32 values per output pixel of a frame: at the end of π³'s forward the point head's
# reshaped output (3), exp(z), local points (3), confidence (1), the homogeneous points (4) and world points (3)
# (LiveBytes: 12.8); the linear heads themselves hold at most 9 (output, transposed copy, pixel shuffle)
_PI3_PIXEL_VALUES = 15
# Pi3X's after its conv heads: the point head's outputs and their permuted copies, exp(z), local points, rays and
# their normalisation, confidence, homogeneous and world points, the metric-scaled copies (LiveBytes: ~52)
_PI3X_PIXEL_VALUES = 52
_CONV_RES_BLOCK = 7  # Pi3X ResidualConvBlock at c channels: x, GroupNorm, ReLU (c each), conv, GN, ReLU (2c each)
# in units of c, less the shared input, plus the output sum


def _block_units(rows: int, r: float, chunk: int | None, half: bool) -> float:
    """One transformer block's transient over ``rows`` tokens, in units of a [rows, C] FP32 tensor (as VGGT's)."""
    frac = 1.0 if not chunk or chunk >= rows else chunk / rows
    if frac == 1.0:
        mlp = 2 + (4 + 2 * r) if not half else 2 + 3 + r + 0.5
    else:
        mlp = 2 + frac * ((3 + 2 * r) if not half else (2 + r + 0.5))
    return max(_ATTN_UNITS[half], mlp)


def _conv_head_values(cfg: dict, f: int, h: int, w: int, outputs: int) -> int:
    """Peak FP32 values of one Pi3X ConvHead chunk of ``f`` frames (patch grid h x w): the widest stage."""
    p = cfg["patch_size"]
    dims = [cfg["head_embed_dim"], *cfg["conv_dims"]]
    peak, pix = 0, h * w
    for cin, cout in zip(dims[:-1], dims[1:]):  # x2 upsamplers: input + UV, ConvTranspose, conv, residual blocks
        here = pix * (cin + 2) + 4 * pix * cout * 2
        res = 4 * pix * cout * (1 + _CONV_RES_BLOCK) if cfg["conv_res_blocks"] else 0
        peak, pix = max(peak, here, res), 4 * pix
    full = h * p * w * p  # bilinear resize to H x W, UV, then per output a conv, ReLU and 1x1 conv
    # the resized x and its UV concatenation, then that concatenation and one output block's conv, ReLU, output
    last = full * max(2 * dims[-1] + 2, dims[-1] + 2 + 2 * cfg["conv_last_channels"] + outputs)
    return f * max(peak, last)


def pi3_peak_bytes(model, frames: int, height: int, width: int, mode: str = "fp32", *, batch: int = 1,
                   include_weights: bool = True) -> int:
    """Peak device bytes of one π³ / Pi3X inference forward without conditions (grad disabled), analytic.

    Counts, at each candidate peak, the images (and their normalised copy while encoding), then

    * encoder: the patch tokens [M, h*w, C] (M = B*N frames; twice while the chunks are concatenated) and one
      ``encoder_chunk_size`` chunk's DINOv2 block transient;
    * decoder: the patch tokens, one block's transient over [M, R + h*w, C] (units as VGGT's blocks, the MLP
      chunked by ``tokens_chunk_size``), the second-to-last output kept and the final [M, T, 2C] features;
    * head decoders: the features, the outputs already made ([M, T, D] points and confidence, [M, T, camera_dim])
      and one head block's transient; Pi3X's metric decoder reads the same features;
    * pixel heads: π³'s linear heads and world points at full resolution; Pi3X's convolutional heads over one
      ``frames_chunk_size`` chunk at the widest of their stages, plus every frame's outputs.

    Half modes count attention / MLP transients as autocast does (:data:`_ATTN_UNITS`) and autocast's half
    copies of the linear weights. The coefficients are those of :mod:`visionattn.models.pi3_layers` as counted
    by :class:`~visionattn.models.memory.LiveBytes`; conditions (Pi3X's depth encoder, ray embedding, pose
    injection) are not modelled.

    Raises:
        ValueError: unknown mode, frames < 1, or a size not divisible by the patch size.
    """
    cfg = model.config
    h, w = _patch_grid(cfg, mode, frames, batch, height, width)
    M, pix = batch * frames, height * width
    C, D, r = cfg["embed_dim"], cfg["head_embed_dim"], cfg["mlp_ratio"]
    T = cfg["num_register_tokens"] + h * w
    half = BYTES_PER_ELEMENT[mode] == 2
    chunk = cfg.get("tokens_chunk_size")
    conv = "conv_dims" in cfg  # Pi3X

    base = 0
    if include_weights:
        base += sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if half:  # autocast's half copies of the weights of every Linear / Conv run under it
        skip = {"depth_encoder", "ray_embed", "pose_inject_blk", "point_head", "conf_head", "camera_head",
                "metric_head"}
        base += 2 * sum(m.weight.numel() for name, m in model.named_modules()
                        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and name.split(".")[0] not in skip)
    images = M * 3 * pix * 4
    hidden = M * h * w * C * 4

    # encoder: images + normalised copy, the patch tokens, one chunk's block transient
    f = min(cfg.get("encoder_chunk_size") or M, M)
    dino = f * (5 + h * w) * C * 4 * max(_ATTN_UNITS[half], 6 + 2 * r if not half else 5.5 + r)
    enc = 2 * images + hidden + max(dino, hidden if f < M else 0)

    # decoder: images, the patch tokens, one block (+ the kept layer in the last) or the final concatenation
    u = M * T * C * 4
    dec = images + hidden + max((_block_units(M * T, r, chunk, half) + 1) * u, 4 * u)

    # head decoders: features (2u) + outputs made so far + one head block's transient
    uD = M * T * D * 4
    cam = M * T * cfg["camera_dim"] * 4
    head_block = (_block_units(M * T, r, chunk, half) + 1) * uD
    held = uD + cam if conv else 2 * uD  # Pi3X: points, camera before confidence; π³: points, confidence
    heads = images + 2 * u + held + head_block
    if conv:  # the metric decoder's projected context [B, N*T, metric_dim] and its cross-attention keys / values
        heads = max(heads, images + 2 * u + uD + cam + 3 * M * T * cfg["metric_dim"] * 4)

    # pixel heads
    if conv:  # features freed; per chunk of frames the conv head; every frame's outputs
        fc = min(cfg.get("frames_chunk_size") or M, M)
        pixel = images + uD + cam + max(M * pix * 3 * 4 + _conv_head_values(cfg, fc, h, w, 3) * 4,
                                        M * pix * _PI3X_PIXEL_VALUES * 4)
    else:  # π³ keeps the features and all head outputs until the end
        pixel = images + 2 * u + 2 * uD + cam + M * pix * _PI3_PIXEL_VALUES * 4
    return int(math.ceil(base + max(enc, dec, heads, pixel)))
