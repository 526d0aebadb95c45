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
blocks' LayerNorm and LayerScale outputs are FP32 under CUDA autocast) and add the
autocast cache of half-precision weight copies. Both estimates add :data:`CUDA_SCRATCH_BYTES`. The
coefficients are those of the code in :mod:`visionattn.models.layers` (counted with
:class:`~visionattn.models.memory.LiveBytes`).

The model's own :meth:`VGGT.estimate_memory <visionattn.models.VGGT.estimate_memory>` and the public
:func:`visionattn.models.memory.estimate_memory` (which also takes a config) both end here; this module
reads the model's sizes only and does not import :mod:`.vggt`.
"""
from __future__ import annotations

import math

import torch

from visionattn.modes import get_mode

__all__ = ["BYTES_PER_ELEMENT", "CUDA_SCRATCH_BYTES", "peak_bytes", "pi3_peak_bytes"]

BYTES_PER_ELEMENT = {m: get_mode(m).compute_dtype.itemsize for m in ("fp32", "tf32", "bf16", "fp16")}
"""Modes of the memory model -> bytes per element of the attention / MLP activations (half modes: autocast)."""

CUDA_SCRATCH_BYTES = 128 << 20
"""Bytes every estimate adds for what CUDA's ``max_memory_allocated`` counts beside the tensors (cuBLAS workspace,
kernel scratch, the allocator's rounding): π³ at 392 x 518 on an H200 measured 30-50 MiB above the tensors
counted here, at 25 to 500 frames; a count of live tensors on the CPU
(:class:`~visionattn.models.memory.LiveBytes`) has none."""

# attention half of a block with qk-norm and RoPE over an FP32 residual stream (VGGT's aggregator, π³'s decoder),
# in units of one [N, C] FP32 tensor (N = B*S*P rows), s = activation bytes / 4: x in, norm1 (FP32), qkv (3s), q
# normed, rotated and cast (s), then k normed (FP32) and its rotation (2.5 in FP32: the rotated halves, the
# rotate-half copy, two products) = 5.5 + 4s. FP32 9.5; half autocast 7.5, whose qk-norm runs in FP32 on CUDA.
# LiveBytes counts these on the CPU with CUDA's FP32 LayerNorm. π³ at 392 x 518 on an H200 (bf16 autocast) grows
# by 9.17-9.19 [T, C] FP32 tensors a frame from 25 to 500 frames; its decoder stage counts 9.19 with 7.5
_ATTN_UNITS = {False: 9.5, True: 7.5}
# a DINOv2 block's attention (no qk-norm, no RoPE): x in, norm1, qkv (3s), the output and its head merge (s each)
_DINO_ATTN_UNITS = {False: 7.0, True: 4.5}
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
    return int(math.ceil(base + max(agg_peak, heads))) + CUDA_SCRATCH_BYTES


# π³ / Pi3X pixel heads, in FP32 values per output pixel of a frame: at the end of π³'s forward the point head's
# reshaped output (3), exp(z), local points (3), confidence (1), the homogeneous points (4) and the 4-wide product
# whose first three channels are the world points (LiveBytes: 13.3-16.0); the linear heads themselves hold at most 9
# (output, transposed copy, pixel shuffle)
_PI3_PIXEL_VALUES = 16
# Pi3X's between and after its conv heads: the point head's outputs, exp(z), local points, rays and their
# normalisation, confidence, homogeneous and world points, the metric-scaled copies (LiveBytes: 15-23)
_PI3X_PIXEL_VALUES = 24
_CONV_RES_BLOCK = 7  # Pi3X ResidualConvBlock at c channels: x, GroupNorm, ReLU (c each), conv, GN, ReLU (2c each)
# in units of c, less the shared input, plus the output sum
# π³'s camera head at [M, h*w, camera_dim] FP32 (its input, a residual block's hidden, Linear, ReLU and sum)
_CAMERA_HEAD_UNITS = 3


def _mlp_units(rows: int, r: float, chunk: int | None, s: float, stream: float) -> float:
    """A block's MLP half over ``rows`` tokens, in units of a [rows, C] FP32 tensor: its input and the attention
    half's sum (``stream`` each: 1 for an FP32 residual stream, ``s`` for a half one), then over one ``chunk`` of
    rows (all of them unchunked) norm2 (FP32) and fc1 and its GELU (``r * s`` each); ``s``: activation bytes / 4."""
    frac = 1.0 if not chunk or chunk >= rows else chunk / rows
    return 2 * stream + frac * (1 + 2 * r * s)


def _conv_head_values(cfg: dict, f: int, h: int, w: int, outputs: int) -> int:
    """Peak FP32 values of one Pi3X ConvHead chunk of ``f`` frames (patch grid h x w): the widest stage."""
    p = cfg["patch_size"]
    dims = [cfg["head_embed_dim"], *cfg["conv_dims"]]
    peak, pix = 0, h * w
    for cin, cout in zip(dims[:-1], dims[1:]):  # x2 upsamplers: input + UV, ConvTranspose, its replicate-padded
        here = pix * (2 * cin + 2) + 4 * pix * cout * 3  # copy and the conv; then the residual blocks
        res = 4 * pix * cout * (1 + _CONV_RES_BLOCK) if cfg["conv_res_blocks"] else 0
        peak, pix = max(peak, here, res), 4 * pix
    full = h * p * w * p  # bilinear resize to H x W, UV, then per output a conv, ReLU and 1x1 conv
    # the resized x and its UV concatenation, then that concatenation with its replicate-padded copy and one
    # output block's conv, or with the conv, ReLU and output
    d, c = dims[-1] + 2, cfg["conv_last_channels"]
    last = full * max(2 * d - 2, 2 * d + c, d + 2 * c + outputs)
    return f * max(peak, last)


def pi3_peak_bytes(model, frames: int, height: int, width: int, mode: str = "fp32", *, batch: int = 1,
                   include_weights: bool = True) -> int:
    """Peak device bytes of one π³ / Pi3X inference forward without conditions (grad disabled), analytic.

    The weights (and under autocast their half copies) plus the largest of :func:`_pi3_stages`. Conditions
    (Pi3X's depth encoder, ray embedding, pose injection) are not modelled.

    Raises:
        ValueError: unknown mode, frames < 1, or a size not divisible by the patch size.
    """
    peak = max(_pi3_stages(model, frames, height, width, mode, batch).values())  # checks the arguments
    base = 0
    if include_weights:
        base += sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if BYTES_PER_ELEMENT[mode] == 2:  # autocast's half copies of the weights of every Linear / Conv run under it
        skip = {"depth_encoder", "ray_embed", "pose_inject_blk", "point_head", "conf_head", "camera_head",
                "metric_head"}
        base += 2 * sum(m.weight.numel() for name, m in model.named_modules()
                        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and name.split(".")[0] not in skip)
    return int(math.ceil(base + peak)) + CUDA_SCRATCH_BYTES


def _pi3_stages(model, frames: int, height: int, width: int, mode: str, batch: int = 1) -> dict[str, float]:
    """Activation bytes of a π³ / Pi3X forward at each candidate peak (weights left out), by stage.

    Every stage holds the images; from the decoder on, the RoPE tables (four [N*T, head_dim / 2] FP32 and the four
    of one frame).

    * ``encoder``: the normalised copy of the images, the patch tokens [M, h*w, C] (M = B*N frames; twice while
      the chunks are concatenated) and one ``encoder_chunk_size`` chunk's DINOv2 block;
    * ``decoder``: the patch tokens, the R register tokens and one block over [M, T, C] (T = R + h*w; its input
      is the kept second-to-last output in the last block), or the final [M, T, 2C] features with the two layers
      they join;
    * ``heads``: the features, the head decoders' outputs already made ([M, T, D] points and confidence,
      [M, T, camera_dim]) and one head decoder block; Pi3X's metric decoder reads the same features;
    * ``pixels``: π³'s linear heads, camera head and world points at full resolution beside the features and the
      head decoders' outputs; Pi3X's convolutional heads over one ``frames_chunk_size`` chunk at the widest of
      their stages, then every frame's outputs.

    Blocks count as :data:`_ATTN_UNITS` and :func:`_mlp_units` say, with the MLP chunked by ``tokens_chunk_size``;
    the head decoders' residual stream is in the activation dtype (no LayerScale: their Linear outputs add up
    under autocast). The coefficients are those of :mod:`visionattn.models.layers` and
    :mod:`visionattn.models.pi3_layers` as counted by :class:`~visionattn.models.memory.LiveBytes`.
    """
    cfg = model.config
    h, w = _patch_grid(cfg, mode, frames, batch, height, width)
    M, pix = batch * frames, height * width
    C, D, r = cfg["embed_dim"], cfg["head_embed_dim"], cfg["mlp_ratio"]
    T = cfg["num_register_tokens"] + h * w
    half = BYTES_PER_ELEMENT[mode] == 2
    s = BYTES_PER_ELEMENT[mode] / 4
    chunk = cfg.get("tokens_chunk_size")
    conv = "conv_dims" in cfg  # Pi3X
    images = M * 3 * pix * 4
    hidden = M * h * w * C * 4
    rope = 8 * (frames + 1) * T * C // cfg["num_heads"]  # 4 global [1, N*T, head_dim / 2] and 4 frame tables

    # encoder: the normalised copy, the patch tokens, one chunk's DINOv2 block (no qk-norm, no RoPE)
    f = min(cfg.get("encoder_chunk_size") or M, M)
    rows = f * (5 + h * w)  # class token, 4 registers, patches
    dino = rows * C * 4 * max(_DINO_ATTN_UNITS[half], _mlp_units(rows, r, chunk, s, 1))
    enc = 2 * images + hidden + max(dino, hidden if f < M else 0)

    # decoder: the patch tokens and one block, or the final concatenation with the two layers it joins
    u = M * T * C * 4
    block = max(_ATTN_UNITS[half], _mlp_units(M * T, r, chunk, s, 1))
    dec = images + hidden + M * cfg["num_register_tokens"] * C * 4 + rope + max(block, 4) * u  # + the registers

    # head decoders: the features (2u) + the outputs made so far + the input projection or one block
    uD, cam = M * T * D * 4, M * T * cfg["camera_dim"] * 4
    # attention (RoPE, no qk-norm): x in (s), norm1 (FP32), qkv (3s), q rotated (s), k's rotation (2.5s)
    head_block = max(1 + 7.5 * s, _mlp_units(M * T, r, chunk, s, s)) * uD
    project = (u if half else 0) + s * uD  # the features' half copy, the projection
    held = s * (uD + cam if conv else 2 * uD)  # Pi3X: points, camera before confidence; π³: points, confidence
    heads = images + 2 * u + rope + held + max(head_block, project)
    if conv:  # the metric decoder: its projected context [B, N*T, metric_dim], norm_y (FP32), keys, values, RoPE
        um = M * T * cfg["metric_dim"] * 4
        heads = max(heads, images + 2 * u + rope + s * (uD + cam) + (1 + 5.5 * s) * um)

    # pixel heads, in FP32 (autocast off; half outputs copied to FP32 for them)
    vals = M * pix * 4  # one FP32 value per output pixel
    copy = M * h * w * D * 4 if half else 0  # the FP32 copy of a head decoder's output that a pixel head reads
    if conv:  # features freed; per chunk of frames a conv head (the earlier chunks' outputs, then their
        # concatenation): the points', then beside the points' outputs, local points and rays the confidence's
        fc = min(cfg.get("frames_chunk_size") or M, M)
        pixel = images + rope + s * (2 * uD + cam) + copy + max(
            max(3 * vals + _conv_head_values(cfg, fc, h, w, 3) * 4, 6 * vals),
            10 * vals + _conv_head_values(cfg, fc, h, w, 1) * 4, _PI3X_PIXEL_VALUES * vals)
    else:  # π³ keeps the features and the head decoders' outputs to the end
        camera = M * h * w * cfg["camera_dim"] * 4
        pixel = images + 2 * u + rope + s * (2 * uD + cam) + max(
            _PI3_PIXEL_VALUES * vals, 9 * vals + copy, 8 * vals + (_CAMERA_HEAD_UNITS + half) * camera)
    return dict(encoder=enc, decoder=dec, heads=heads, pixels=pixel)
