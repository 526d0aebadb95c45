"""VGGT (Wang et al., "VGGT: Visual Geometry Grounded Transformer", CVPR 2025) and FastVGGT.

A thin top model: :class:`~visionattn.models.aggregator.Aggregator` + camera,
depth, point and track heads, switched by flags. Parameter names and shapes are
those of the official ``facebook/VGGT-1B`` checkpoint (1,797 keys,
1,256,537,516 parameters). FastVGGT is the same model with ``merging=``
(:data:`~visionattn.models.merging.FASTVGGT_MERGING`).

    model = VGGT.from_pretrained("facebook/VGGT-1B").cuda().eval()
    out = model.infer(images)               # images [S, 3, H, W] in [0, 1], H, W multiples of 14
    extr, intr = pose_encoding_to_extri_intri(out["pose_enc"], images.shape[-2:])
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import tempfile

import torch
from torch import nn

from visionattn.modes import get_mode

from .aggregator import _MEAN, _STD, Aggregator
from .heads import CameraHead, DPTHead, TrackHead
from .hub import CheckpointNotFoundError, hub_file, load_state_dict_file, resolve_checkpoint, save_checkpoint_folder
from .layers import AUTO_MODE, DTYPE_MODES, AttnModeMixin, Block, check_attn_mode
from .merging import TokenMerging, as_merging
from .peak_memory import peak_bytes

__all__ = ["VGGT", "vggt_tiny_config", "vggt_attention_shapes", "DEFAULT_REPO", "autocast"]

DEFAULT_REPO = "facebook/VGGT-1B"
# dtype names accepted by heads_dtype and inference_dtype: the modes named after a dtype and torch's names
_DTYPES = {name: get_mode(m).compute_dtype for m in DTYPE_MODES
           for name in (m, str(get_mode(m).compute_dtype).removeprefix("torch."))}


class _ClassOrInstanceMethod:
    """Descriptor: ``VGGT.f(...)`` passes None (the VGGT-1B defaults), ``model.f(...)`` passes the model."""

    def __init__(self, func):
        self.__func__ = func
        self.__doc__ = func.__doc__
        self.__name__ = func.__name__

    def __get__(self, obj, owner=None):
        return functools.partial(self.__func__, obj)


class VGGT(AttnModeMixin, nn.Module):
    """VGGT / FastVGGT.

    Args:
        img_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, num_register_tokens:
            aggregator (518, 14, 1024, 24, 16, 4, 4 for VGGT-1B).
        patch_embed_depth, patch_embed_heads: DINOv2 patch embed (24, 16 = ViT-L/14).
        camera_trunk_depth: camera head trunk blocks (4).
        dpt_features, dpt_out_channels, dpt_layers: DPT heads (256, (256, 512, 1024, 1024), (4, 11, 17, 23)).
        track_*: track head (features 128, 7 correlation levels, radius 4, hidden 384, 6 layers,
            8 heads, 64 virtual tracks, 4 iterations).
        enable_camera, enable_depth, enable_point, enable_track: which heads exist.
        attn_mode: precision of every attention: a visionattn mode (``"fp32"``, ``"tf32"``,
            ``"bf16"``, ...), ``"auto"`` (follow q's dtype: fp32 / bf16 / fp16) or None
            (PyTorch SDPA, as the official code). Change later with :meth:`set_attn_mode` or
            :func:`visionattn.patch_model`.
        merging: FastVGGT token merging in the global blocks: None / 0 (off: exactly VGGT),
            :data:`FASTVGGT_MERGING`, a :class:`TokenMerging` or a dict of its fields.
        frames_chunk_size: frames per chunk of the DPT heads and of the track head's
            correlation volumes (8; None = all frames at once).
        patch_embed_chunk_size: frames per DINOv2 patch-embed chunk (32; None = all).
        tokens_chunk_size: token rows per MLP chunk of every transformer block when grad is
            disabled (65536; None = all). See :meth:`set_chunking`. Rows and frames are
            independent in the chunked stages, so the chunk sizes change the outputs only by
            FP rounding (GEMM / convolution kernels may order a reduction differently for another
            row or batch count); for given chunk sizes the outputs are deterministic.
        heads_dtype: precision of the camera, depth and point heads: None / ``"fp32"`` (FP32 with
            autocast off, as the official model) or ``"bf16"`` / ``"fp16"`` (the heads run under
            autocast of that dtype whatever the caller's autocast; confidences, activations and the
            running pose stay FP32, outputs are FP32). Chosen inside ``forward``; no global flag
            is touched. Settable later as ``model.heads_dtype``. The official FastVGGT code runs its
            heads under the caller's bf16 autocast: ``"bf16"`` matches it (and most of its speed at
            hundreds of frames: docs/benchmarks/fastvggt_official_h100.md).
        grad_checkpointing: activation checkpointing for training (timm's name and convention;
            change later with :meth:`set_grad_checkpointing`). When autograd records, every
            aggregator block (DINOv2, frame, global) and every DPT-head frame chunk runs under
            ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: less activation memory, one
            more forward of those stages in backward, the same outputs and gradients (bit for bit
            on CPU; on CUDA up to its non-deterministic backward sums, which also vary between two
            plain steps). Inactive under ``torch.no_grad`` / ``inference_mode`` (inference is
            unchanged).

    Training: the whole forward is differentiable (every output with respect to every parameter
    but DINOv2's unused ``mask_token``, and to the images) in every attention mode: None (SDPA),
    and the visionattn modes, whose backward kernels run on CUDA (``fp32``, ``fp32-ieee``,
    ``tf32``, ``fp16``, ``bf16``; :data:`visionattn.ops.BACKWARD_MODES`) and the differentiable
    reference otherwise. As in the official model, the camera head conditions each refinement on
    the detached running pose and the tracker detaches its coordinates between iterations.
    The inference shortcuts step aside when autograd records: the chunked MLP of
    :class:`~visionattn.models.layers.Block` runs unchunked, and layer trimming only skips
    building the layers no head reads.

    Memory: the aggregator keeps only the layer outputs [B, S, P, 2C] that the enabled heads
    read (``dpt_layers`` for the depth / point / track heads, the last layer for the camera
    head) and ``forward`` drops each one after the last head that reads it (VGGT and
    FastVGGT alike; outputs are bit-identical to keeping all layers). With grad enabled
    autograd still holds what backward needs. Set ``keep_all_layers = True`` for the
    official behaviour (all ``depth`` outputs held until the heads finish).

    forward(images, query_points=None) -> dict:
        images [S, 3, H, W] or [B, S, 3, H, W], float in [0, 1], H and W multiples of 14;
        query_points [N, 2] or [B, N, 2] pixel (x, y) in frame 0 (track head).
        Returns ``pose_enc`` [B, S, 9], ``pose_enc_list`` (4 x [B, S, 9]), ``depth`` [B, S, H, W, 1],
        ``depth_conf`` [B, S, H, W], ``world_points`` [B, S, H, W, 3], ``world_points_conf``
        [B, S, H, W], ``images`` [B, S, 3, H, W] (eval mode) and, with query points,
        ``track`` [B, S, N, 2], ``vis`` [B, S, N], ``conf`` [B, S, N]. Heads run in FP32.
    """

    def __init__(self, img_size: int = 518, patch_size: int = 14, embed_dim: int = 1024, depth: int = 24,
                 num_heads: int = 16, mlp_ratio: float = 4.0, num_register_tokens: int = 4,
                 patch_embed_depth: int = 24, patch_embed_heads: int = 16, camera_trunk_depth: int = 4,
                 dpt_features: int = 256, dpt_out_channels=(256, 512, 1024, 1024), dpt_layers=(4, 11, 17, 23),
                 track_features: int = 128, track_corr_levels: int = 7, track_corr_radius: int = 4,
                 track_hidden: int = 384, track_depth: int = 6, track_heads: int = 8,
                 track_virtual_tracks: int = 64, track_iters: int = 4, enable_camera: bool = True,
                 enable_depth: bool = True, enable_point: bool = True, enable_track: bool = True,
                 attn_mode: str | None = AUTO_MODE, merging=None, frames_chunk_size: int | None = 8,
                 patch_embed_chunk_size: int | None = 32, tokens_chunk_size: int | None = 65536,
                 heads_dtype: str | None = None, grad_checkpointing: bool = False):
        args = dict(locals())
        super().__init__()
        attn_mode = check_attn_mode(attn_mode)
        if img_size % patch_size:
            raise ValueError(f"img_size={img_size} must be a multiple of patch_size={patch_size}")
        if max(dpt_layers) >= depth:
            raise ValueError(f"dpt_layers={tuple(dpt_layers)} must be < depth={depth}")
        # runtime choices (attention precision, merging, checkpointing) are not part of the saved config
        self.config = {k: v for k, v in args.items()
                       if k not in ("self", "__class__", "merging", "attn_mode", "grad_checkpointing")}
        self.config["dpt_out_channels"] = list(dpt_out_channels)
        self.config["dpt_layers"] = list(dpt_layers)
        self.patch_size = patch_size
        dim2 = 2 * embed_dim
        self.aggregator = Aggregator(img_size, patch_size, embed_dim, depth, num_heads, mlp_ratio,
                                     num_register_tokens, patch_embed_depth, patch_embed_heads, attn_mode=attn_mode)
        self.camera_head = CameraHead(dim2, camera_trunk_depth, num_heads, mlp_ratio,
                                      attn_mode=attn_mode) if enable_camera else None
        dpt = dict(patch_size=patch_size, features=dpt_features, out_channels=dpt_out_channels,
                   intermediate_layer_idx=dpt_layers, frames_chunk_size=frames_chunk_size)
        self.point_head = DPTHead(dim2, output_dim=4, activation="inv_log", **dpt) if enable_point else None
        self.depth_head = DPTHead(dim2, output_dim=2, activation="exp", **dpt) if enable_depth else None
        self.track_head = TrackHead(dim2, patch_size, track_features, track_iters, dpt_out_channels, dpt_layers,
                                    corr_levels=track_corr_levels, corr_radius=track_corr_radius,
                                    hidden_size=track_hidden, depth=track_depth, num_heads=track_heads,
                                    num_virtual_tracks=track_virtual_tracks, max_scale=img_size,
                                    frames_chunk_size=frames_chunk_size, attn_mode=attn_mode) if enable_track else None
        self.merging = merging
        self.keep_all_layers = False
        self.heads_dtype = heads_dtype
        self.set_chunking(frames_chunk_size, patch_embed_chunk_size, tokens_chunk_size)
        self.set_grad_checkpointing(grad_checkpointing)

    def set_grad_checkpointing(self, enable: bool = True) -> "VGGT":
        """Switch activation checkpointing of the aggregator blocks and DPT-head chunks; returns self.

        timm's ``set_grad_checkpointing(enable=True)``. Applies when autograd records (training,
        or any forward with grad enabled); see the class docstring. Read back as
        ``model.grad_checkpointing``.

        Raises:
            TypeError: ``enable`` is not a bool.
        """
        if not isinstance(enable, bool):
            raise TypeError(f"enable={enable!r} must be a bool")
        self.aggregator.grad_checkpointing = enable
        self.aggregator.patch_embed.grad_checkpointing = enable
        for head in (self.depth_head, self.point_head):
            if head is not None:
                head.grad_checkpointing = enable
        if self.track_head is not None:
            self.track_head.feature_extractor.grad_checkpointing = enable
        return self

    @property
    def grad_checkpointing(self) -> bool:
        """Whether :meth:`set_grad_checkpointing` switched activation checkpointing on."""
        return self.aggregator.grad_checkpointing

    def set_chunking(self, frames_chunk_size: int | None = 8, patch_embed_chunk_size: int | None = 32,
                     tokens_chunk_size: int | None = 65536) -> "VGGT":
        """Set the chunk sizes of the stages that scale with frames (None = unchunked); returns self.

        Args:
            frames_chunk_size: frames per DPT-head chunk (depth, point, track features) and per
                chunk of the tracker's correlation volumes.
            patch_embed_chunk_size: frames per DINOv2 patch-embed chunk.
            tokens_chunk_size: token rows per MLP chunk in every :class:`~visionattn.models.layers.Block`
                (aggregator, DINOv2, camera trunk), grad disabled only.

        Raises:
            ValueError: a size that is not a positive int or None.
        """
        for name, v in (("frames_chunk_size", frames_chunk_size), ("patch_embed_chunk_size", patch_embed_chunk_size),
                        ("tokens_chunk_size", tokens_chunk_size)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name}={v!r} must be a positive int or None")
            self.config[name] = v
        for head in (self.depth_head, self.point_head):
            if head is not None:
                head.frames_chunk_size = frames_chunk_size
        if self.track_head is not None:
            self.track_head.feature_extractor.frames_chunk_size = frames_chunk_size
            self.track_head.tracker.frames_chunk_size = frames_chunk_size
        self.aggregator.frames_chunk_size = patch_embed_chunk_size
        for m in self.modules():
            if isinstance(m, Block):
                m.tokens_chunk_size = tokens_chunk_size
        return self

    def layer_readers(self, with_tracks: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        """The enabled heads in the order ``forward`` runs them, each with the aggregator layers it reads.

        Args:
            with_tracks: include the track head (it runs only when query points are given).

        Returns:
            [(head name, sorted layer indices)], e.g. ``[("camera_head", (23,)), ("depth_head",
            (4, 11, 17, 23)), ("point_head", (4, 11, 17, 23))]`` for VGGT-1B.
        """
        last = self.aggregator.depth - 1
        readers = [] if self.camera_head is None else [("camera_head", (last,))]
        for name in ("depth_head", "point_head"):
            head = getattr(self, name)
            if head is not None:
                readers.append((name, tuple(sorted(set(head.intermediate_layer_idx)))))
        if with_tracks and self.track_head is not None:
            layers = self.track_head.feature_extractor.intermediate_layer_idx
            readers.append(("track_head", tuple(sorted(set(layers)))))
        return readers

    def _release_plan(self, with_tracks: bool) -> tuple[tuple[int, ...] | None, dict[str, tuple[int, ...]]]:
        """(layers the aggregator keeps or None for all, {head: layers to drop after it runs})."""
        readers = self.layer_readers(with_tracks)
        if self.keep_all_layers:
            return None, {}
        last_reader = {}
        for name, layers in readers:
            for i in layers:
                last_reader[i] = name
        drop = {name: tuple(i for i in layers if last_reader[i] == name) for name, layers in readers}
        return tuple(sorted(last_reader)), drop

    @property
    def heads_dtype(self) -> str | None:
        """Precision of the camera / depth / point heads: None (FP32), ``"bf16"`` or ``"fp16"``."""
        return self._heads_dtype

    @heads_dtype.setter
    def heads_dtype(self, value: str | None) -> None:
        if _DTYPES.get(value) == torch.float32:
            value = None
        if value is not None and _DTYPES.get(value) not in (torch.bfloat16, torch.float16):
            raise ValueError(f"heads_dtype={value!r}; expected None / 'fp32', 'bf16' or 'fp16'")
        self._heads_dtype = value
        self.config["heads_dtype"] = value

    @property
    def merging(self) -> TokenMerging | None:
        """FastVGGT token merging (None = off); settable with anything :func:`as_merging` accepts."""
        return self._merging

    @merging.setter
    def merging(self, value) -> None:
        self._merging = as_merging(value)

    # ------------------------------------------------------------------ precision
    def inference_dtype(self, device=None, requested=None) -> torch.dtype:
        """Autocast dtype as the official demos choose it.

        bfloat16 on CUDA compute capability >= 8 (Ampere, Hopper), float16 on older
        GPUs, float32 on CPU or when ``requested`` (``"fp32"``, ``torch.float32``, ...) says so.

        Raises:
            ValueError: an unknown ``requested`` dtype.
        """
        if requested is not None:
            dt = _DTYPES.get(requested) if isinstance(requested, str) else requested
            if dt not in _DTYPES.values():
                raise ValueError(f"requested={requested!r}; expected fp32, bf16 or fp16 (or a torch dtype)")
            return dt
        if device is None:
            device = next(self.parameters()).device
        device = torch.device(device)
        if device.type != "cuda":
            return torch.float32
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16

    @torch.no_grad()
    def infer(self, images: torch.Tensor, query_points: torch.Tensor | None = None, dtype=None) -> dict:
        """forward under ``torch.no_grad`` and autocast with :meth:`inference_dtype` (weights stay FP32)."""
        dt = self.inference_dtype(images.device, dtype)
        with autocast(images.device.type, dt):
            return self(images, query_points)

    # ------------------------------------------------------------------ forward
    def forward(self, images: torch.Tensor, query_points: torch.Tensor | None = None) -> dict:
        if images.dim() == 4:
            images = images[None]
        if images.dim() != 5 or images.shape[2] != 3:
            raise ValueError(f"images must be [S, 3, H, W] or [B, S, 3, H, W], got {tuple(images.shape)}")
        if not images.is_floating_point():
            raise TypeError(f"images must be float in [0, 1], got {images.dtype}")
        if query_points is not None and query_points.dim() == 2:
            query_points = query_points[None]
        keep, drop = self._release_plan(query_points is not None)
        tokens, ps = self.aggregator(images, merging=self.merging, keep_layers=keep)

        def done(head: str) -> None:  # drop the layers this head read last
            for i in drop.get(head, ()):
                tokens[i] = None

        out = {}
        head_dt = _DTYPES[self.heads_dtype] if self.heads_dtype else torch.float32
        heads_ctx = (torch.autocast(images.device.type, enabled=False) if head_dt == torch.float32
                     else torch.autocast(images.device.type, dtype=head_dt))
        with heads_ctx:
            if self.camera_head is not None:
                poses = self.camera_head(tokens)
                out["pose_enc"], out["pose_enc_list"] = poses[-1], poses
                done("camera_head")
            if self.depth_head is not None:
                out["depth"], out["depth_conf"] = self.depth_head(tokens, images, ps)
                done("depth_head")
            if self.point_head is not None:
                out["world_points"], out["world_points_conf"] = self.point_head(tokens, images, ps)
                done("point_head")
        if self.track_head is not None and query_points is not None:
            tracks, vis, conf = self.track_head(tokens, images, ps, query_points)
            out["track"], out["vis"], out["conf"] = tracks[-1], vis, conf
            done("track_head")
        del tokens
        if not self.training:
            out["images"] = images
        return out

    # ------------------------------------------------------------------ memory
    @_ClassOrInstanceMethod
    def estimate_memory(self, frames: int, height: int, width: int, mode: str = "fp32", **kwargs) -> int:
        """Peak device bytes of one inference forward: weights + activations at the peak point.

        ``VGGT.estimate_memory(200, 392, 518, "fp32")`` models VGGT-1B (default heads, no
        track queries); ``model.estimate_memory(...)`` models that instance (its heads, chunk
        sizes, ``keep_all_layers``). ``mode``: ``"fp32"`` / ``"tf32"`` or ``"bf16"`` / ``"fp16"``
        (half autocast). Keyword arguments (``batch``, ``query_points``, ``keep_all_layers``,
        ``include_weights``) and the model are described in
        :func:`visionattn.models.memory.estimate_memory`.

        Raises:
            ValueError: unknown mode, frames < 1, or an image size not divisible by the patch size.
        """
        if self is None:
            with torch.device("meta"):
                self = VGGT()
        return peak_bytes(self, frames, height, width, mode, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike = DEFAULT_REPO, *,
                        force_download: bool = False, token: str | bool | None = None, cache_dir=None,
                        local_files_only: bool = False, revision: str | None = None, strict: bool = True,
                        device: str | torch.device = "cpu", **model_kwargs) -> "VGGT":
        """Load weights from the hub (``"facebook/VGGT-1B"``), a directory or a checkpoint file.

        Same call as huggingface_hub's ``PyTorchModelHubMixin.from_pretrained``. Licence: the
        ``facebook/VGGT-1B`` weights are for non-commercial use only (terms on its model card;
        ``facebook/VGGT-1B-Commercial`` is the gated commercial variant); downloading them
        logs this note. A hub id is resolved with :func:`visionattn.models.hub.hub_file`: the local
        cache first, then one online attempt with a short timeout, so offline it fails in seconds.

        The model is built on the meta device and the weights, read from the file straight onto
        ``device``, are assigned (no random initialisation of 1.26 B parameters, no host copy first
        when ``device`` is a GPU). The ``config.json`` beside the weights
        (from :meth:`save_pretrained` or the hub) sets the config; ``model_kwargs``
        (e.g. ``attn_mode="bf16"``, ``merging=FASTVGGT_MERGING``) win over it.

        Args:
            pretrained_model_name_or_path: hub repo id, a directory holding ``model.safetensors`` /
                ``model.pt``, or such a file.
            force_download, token, cache_dir, local_files_only, revision: as ``hf_hub_download``.
            strict: refuse missing / unexpected keys (with False, missing ones get a fresh init).
            device: where the parameters are created (``"cpu"``, ``"cuda"``, ...).

        Raises:
            visionattn.models.hub.CheckpointNotFoundError: not local and not downloadable
                (the message names the cache folder and how to pass a local file).
            RuntimeError: missing / unexpected keys or shape mismatches with ``strict=True``.
        """
        src = os.fspath(pretrained_model_name_or_path)
        hub = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only,
                   force_download=force_download)
        path = resolve_checkpoint(src, **hub)
        config_path = os.path.join(os.path.dirname(path), "config.json")
        if not os.path.exists(src) and not os.path.isfile(config_path):
            try:  # the hub repo's config.json, same strategy; a repo without one keeps the defaults
                config_path = hub_file(src, ("config.json",), **hub)
            except CheckpointNotFoundError:
                pass
        cfg = _read_config(config_path)
        cfg.update(model_kwargs)
        device = torch.device(device)
        sd = load_state_dict_file(path, device)
        with torch.device("meta"):
            model = cls(**cfg)
        result = model.load_state_dict(sd, strict=strict, assign=True)
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:  # strict=False and keys absent: give them a fresh initialisation on the device
            with torch.device(device):
                fresh = cls(**cfg)
            fsd = fresh.state_dict()
            model.load_state_dict({n: fsd[n] for n in missing}, strict=False, assign=True)
        agg = model.aggregator
        agg._resnet_mean = torch.tensor(_MEAN, device=device).reshape(1, 1, 3, 1, 1)
        agg._resnet_std = torch.tensor(_STD, device=device).reshape(1, 1, 3, 1, 1)
        model.load_result = result
        return model.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, *, config: dict | None = None,
                        repo_id: str | None = None, push_to_hub: bool = False, **push_to_hub_kwargs) -> str | None:
        """Write ``model.safetensors`` + ``config.json`` (each atomically) to ``save_directory``.

        Same call as ``PyTorchModelHubMixin.save_pretrained``: ``config`` adds entries to the
        saved config; ``push_to_hub=True`` then uploads the folder to ``repo_id`` (default: the
        folder name) with :meth:`push_to_hub` (``push_to_hub_kwargs`` passed on).

        Returns:
            the weights path, or the commit URL when pushed.
        """
        target = save_checkpoint_folder(self, save_directory, {**self.config, **(config or {})})
        directory = os.fspath(save_directory)
        if push_to_hub:
            return self.push_to_hub(repo_id or os.path.basename(os.path.abspath(directory)), config=config,
                                    **push_to_hub_kwargs)
        return target

    def push_to_hub(self, repo_id: str, *, config: dict | None = None,
                    commit_message: str = "Push model using huggingface_hub.", private: bool | None = None,
                    token: str | None = None, branch: str | None = None, create_pr: bool | None = None,
                    allow_patterns=None, ignore_patterns=None, delete_patterns=None) -> str:
        """Upload ``model.safetensors`` + ``config.json`` to a hub repo (created if needed), as the mixin does.

        Returns:
            the commit URL.

        Raises:
            huggingface_hub errors (authentication, network) unchanged.
        """
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, config=config)
            return str(api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message,
                                         revision=branch, create_pr=create_pr, allow_patterns=allow_patterns,
                                         ignore_patterns=ignore_patterns, delete_patterns=delete_patterns))


def autocast(device_type: str, dtype: torch.dtype | None):
    """``torch.autocast(device_type, dtype)`` for half dtypes; a no-op context for None / float32."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def _read_config(path: str) -> dict:
    """Constructor kwargs from a config.json next to the weights (unknown keys ignored); {} if absent."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    accepted = set(inspect.signature(VGGT.__init__).parameters) - {"self"}
    return {k: v for k, v in raw.items() if k in accepted}


def vggt_attention_shapes(frames: int, height: int, width: int, **config) -> list[tuple]:
    """The attention calls of one :class:`VGGT` forward over ``frames`` images of ``height`` x ``width`` pixels
    (one scene), as ``(batch, num_heads, seq_len, head_dim)``, known before the model is built; for
    :class:`visionattn.warmup.CompileAhead`.

    The DINOv2 patch embed per chunk of ``patch_embed_chunk_size`` frames, the frame and global blocks and,
    with ``enable_camera``, the camera head's trunk (attention across frames). The track head's calls depend
    on the query points and are left out; FastVGGT's merged global calls are shorter than the global one
    listed. With FP32 heads (``heads_dtype`` None or a name of FP32) the camera trunk's entry carries a fifth element,
    ``torch.float32``: its inputs stay FP32 under autocast, so a half mode runs it with an FP32 output, a kernel
    variant of its own; the other calls take the autocast (or the mode's) dtype.

    Args:
        frames, height, width: frames of the scene and their size in pixels (multiples of ``patch_size``).
        **config: :class:`VGGT` arguments that differ from its defaults (VGGT-1B).

    Raises:
        TypeError: an argument :class:`VGGT` does not take.
    """
    params = inspect.signature(VGGT.__init__).parameters
    unknown = sorted(set(config) - set(params))
    if unknown:
        raise TypeError(f"vggt_attention_shapes: VGGT takes no argument {unknown}")
    cfg = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    cfg.update(config)
    patches = (height // cfg["patch_size"]) * (width // cfg["patch_size"])
    tokens = 1 + cfg["num_register_tokens"] + patches  # [camera or cls, registers, patches] in both transformers
    heads, dim = cfg["num_heads"], cfg["embed_dim"]
    step = cfg["patch_embed_chunk_size"] or frames
    shapes = [(min(step, frames - s0), cfg["patch_embed_heads"], tokens, dim // cfg["patch_embed_heads"])
              for s0 in range(0, frames, step)]
    shapes += [(frames, heads, tokens, dim // heads), (1, heads, frames * tokens, dim // heads)]
    if cfg["enable_camera"]:
        camera = (1, heads, frames, 2 * dim // heads)
        fp32_heads = cfg["heads_dtype"] is None or _DTYPES.get(cfg["heads_dtype"]) == torch.float32  # as VGGT reads it
        shapes.append(camera + (torch.float32,) if fp32_heads else camera)
    return list(dict.fromkeys(shapes))


def vggt_tiny_config(**overrides) -> dict:
    """A tiny VGGT config for CPU tests (embed 64, 2 blocks, 4 heads, img 56): ``VGGT(**vggt_tiny_config())``.

    Same architecture as VGGT-1B, scaled down (DPT on layers (0, 0, 1, 1), track
    head with 3 correlation levels so 56 px images still have a pyramid).
    """
    cfg = dict(img_size=56, patch_size=14, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0,
               num_register_tokens=4, patch_embed_depth=2, patch_embed_heads=4, camera_trunk_depth=1,
               dpt_features=16, dpt_out_channels=(8, 16, 32, 32), dpt_layers=(0, 0, 1, 1), track_features=16,
               track_corr_levels=3, track_corr_radius=2, track_hidden=32, track_depth=1, track_heads=2,
               track_virtual_tracks=4, track_iters=2)
    cfg.update(overrides)
    return cfg
