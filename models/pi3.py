"""π³ (Wang et al., "π³: Permutation-Equivariant Visual Geometry Learning", arXiv:2507.13347, 2025).

Feed-forward reconstruction without a reference frame: a DINOv2 ViT-L/14 encoder with registers, a decoder of
36 blocks alternating frame-wise and global attention (2-D RoPE, qk-norm, 5 register tokens per frame), then
three frame-wise transformer decoders and heads for local point maps, confidence and camera poses. Parameter
names and shapes are those of the official ``yyfz233/Pi3`` checkpoint (1,210 keys, 958,696,738 values;
``tests/data/pi3_state_dict.tsv``). :class:`~visionattn.models.pi3x.Pi3X` is its successor.

    model = Pi3.from_pretrained("yyfz233/Pi3").cuda().eval()
    out = model.infer(images)        # images [N, 3, H, W] in [0, 1], H and W multiples of 14
    out["points"], out["camera_poses"]   # [1, N, H, W, 3] world points, [1, N, 4, 4] camera-to-world

Every attention goes through :func:`visionattn.attention` with the model's ``attn_mode`` (PyTorch SDPA for None).
"""
from __future__ import annotations

import inspect
import json
import logging
import os

import torch
from torch import nn

from .hub import CheckpointNotFoundError, load_state_dict_file, resolve_checkpoint, save_checkpoint_folder
from .layers import AUTO_MODE, AttnModeMixin, Block, DinoV2, check_attn_mode, checkpointed, normal_
from .pi3_layers import CameraHead, LinearPts3d, RopeGrid, TransformerDecoder, decoder_block

__all__ = ["Pi3", "pi3_tiny_config", "PI3_REPO", "PI3_LICENSE"]

PI3_REPO = "yyfz233/Pi3"
PI3_LICENSE = ("the π³ / Pi3X weights (yyfz233/Pi3, yyfz233/Pi3X) are licensed CC BY-NC 4.0: non-commercial "
               "research and education only, redistribution under the same restriction (github.com/yyfz/Pi3, "
               "README 'License'); the official code is BSD-3-Clause")
"""Licence note logged whenever π³ / Pi3X weights are resolved from the hub."""

_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}
_log = logging.getLogger(__name__)


class _Pi3Base(AttnModeMixin, nn.Module):
    """Shared by :class:`Pi3` and :class:`~visionattn.models.pi3x.Pi3X`: encoder, alternating decoder, hub I/O.

    Subclasses build their heads after calling :meth:`_build_trunk` and implement ``forward``.
    """

    default_repo = PI3_REPO
    grad_checkpointing: bool = False

    # ------------------------------------------------------------------ construction
    def _build_trunk(self, img_size, patch_size, embed_dim, encoder_depth, encoder_heads, depth, num_heads,
                     mlp_ratio, num_register_tokens, rope_base, attn_mode) -> None:
        if img_size % patch_size:
            raise ValueError(f"img_size={img_size} must be a multiple of patch_size={patch_size}")
        if depth < 2 or depth % 2:
            raise ValueError(f"depth={depth} must be an even number >= 2 (frame and global blocks alternate)")
        self.patch_size, self.rope_base = patch_size, rope_base
        self.patch_start_idx = num_register_tokens
        self.encoder = DinoV2(img_size, patch_size, embed_dim, encoder_depth, encoder_heads, mlp_ratio,
                              num_register_tokens=4, init_values=1.0, attn_mode=attn_mode)
        del self.encoder.mask_token  # the official encoder drops DINOv2's mask token
        self.decoder = nn.ModuleList(decoder_block(embed_dim, num_heads, mlp_ratio, 0.01, True, attn_mode)
                                     for _ in range(depth))
        self.register_token = nn.Parameter(torch.zeros(1, 1, num_register_tokens, embed_dim))
        normal_(self.register_token, std=1e-6)
        self.register_buffer("image_mean", torch.tensor(_MEAN).view(1, 3, 1, 1))
        self.register_buffer("image_std", torch.tensor(_STD).view(1, 3, 1, 1))

    # ------------------------------------------------------------------ runtime settings
    def set_grad_checkpointing(self, enable: bool = True):
        """Activation checkpointing of the decoder blocks and the DINOv2 encoders' blocks, for fine-tuning; returns
        self.

        timm's ``set_grad_checkpointing(enable=True)``. When autograd records, each block keeps only its input and
        backward recomputes it once (:func:`~visionattn.models.layers.checkpointed`): outputs and gradients are
        unchanged, activation memory drops to one [B*N, T, C] tensor per block. Read back as
        ``model.grad_checkpointing``.

        Raises:
            TypeError: ``enable`` is not a bool.
        """
        if not isinstance(enable, bool):
            raise TypeError(f"enable={enable!r} must be a bool")
        self.grad_checkpointing = enable
        for m in self.modules():
            if isinstance(m, DinoV2):
                m.grad_checkpointing = enable
        return self

    def set_chunking(self, encoder_chunk_size: int | None = 32, tokens_chunk_size: int | None = 65536):
        """Frames per DINOv2 encoder chunk and token rows per MLP chunk (grad disabled); None = off; returns self.

        Frames and rows are independent, so chunking changes outputs only by FP rounding (GEMMs over another row
        count).

        Raises:
            ValueError: a size that is not a positive int or None.
        """
        for name, v in (("encoder_chunk_size", encoder_chunk_size), ("tokens_chunk_size", tokens_chunk_size)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name}={v!r} must be a positive int or None")
            self.config[name] = v
        self.encoder_chunk_size = encoder_chunk_size
        for m in self.modules():
            if isinstance(m, Block):
                m.tokens_chunk_size = tokens_chunk_size
        return self

    def inference_dtype(self, device=None, requested=None) -> torch.dtype:
        """Autocast dtype as the official examples choose it: bf16 on CUDA capability >= 8, fp16 on older GPUs,
        fp32 on CPU or when ``requested`` (``"fp32"``, ``torch.float32``, ...) says so.

        Raises:
            ValueError: an unknown ``requested`` dtype.
        """
        if requested is not None:
            dt = _DTYPES.get(requested) if isinstance(requested, str) else requested
            if dt not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"requested={requested!r}; expected fp32, bf16 or fp16 (or a torch dtype)")
            return dt
        device = torch.device(device if device is not None else self.image_mean.device)
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16

    # ------------------------------------------------------------------ shared forward stages
    @staticmethod
    def _as_scenes(images: torch.Tensor, patch_size: int) -> torch.Tensor:
        """[N, 3, H, W] or [B, N, 3, H, W] float -> [B, N, 3, H, W]; checks the layout and the size."""
        if images.dim() == 4:
            images = images[None]
        if images.dim() != 5 or images.shape[2] != 3:
            raise ValueError(f"images must be [N, 3, H, W] or [B, N, 3, H, W], got {tuple(images.shape)}")
        if not images.is_floating_point():
            raise TypeError(f"images must be float in [0, 1], got {images.dtype}")
        H, W = images.shape[-2:]
        if H % patch_size or W % patch_size:
            raise ValueError(f"image size {H}x{W} must be a multiple of patch_size={patch_size} in both sides")
        return images

    def _encode(self, encoder: DinoV2, x: torch.Tensor) -> torch.Tensor:
        """DINOv2 patch tokens of [M, c, H, W] -> [M, h*w, C], ``encoder_chunk_size`` frames at a time."""
        step = self.encoder_chunk_size or x.shape[0]
        if x.shape[0] <= step:
            return encoder(x)
        return torch.cat([encoder(x[i:i + step]) for i in range(0, x.shape[0], step)])

    def _decode(self, hidden: torch.Tensor, B: int, N: int, grid: RopeGrid, inject=None) -> torch.Tensor:
        """Alternating decoder over [B*N, h*w, C] patch tokens -> [B*N, R + h*w, 2C].

        Register tokens (R) are prepended per frame; even blocks attend within a frame ([B*N, T, C]), odd blocks
        across the scene ([B, N*T, C]). ``inject(i, x)`` (Pi3X pose injection) may replace block i's output.
        The result concatenates the outputs of the last two blocks on channels.
        """
        C = hidden.shape[-1]
        reg = self.register_token.expand(B, N, -1, -1).reshape(B * N, -1, C)
        x = torch.cat([reg, hidden], dim=1)
        T = x.shape[1]
        head_dim = C // self.decoder[0].attn.num_heads
        frame_rope, global_rope = grid.frame(head_dim), grid.global_(head_dim)
        keep = None
        for i, blk in enumerate(self.decoder):
            x = (checkpointed(blk, x.reshape(B * N, T, C), frame_rope, enabled=self.grad_checkpointing) if i % 2 == 0
                 else checkpointed(blk, x.reshape(B, N * T, C), global_rope, enabled=self.grad_checkpointing))
            if inject is not None:
                x = inject(i, x)
            if i == len(self.decoder) - 2:
                keep = x.reshape(B * N, T, C)
        return torch.cat([keep, x.reshape(B * N, T, C)], dim=-1)

    def _trunk(self, images: torch.Tensor):
        """Normalise and encode [B, N, 3, H, W] -> (patch tokens [B*N, h*w, C], RoPE grid)."""
        B, N, _, H, W = images.shape
        x = ((images - self.image_mean) / self.image_std).reshape(B * N, 3, H, W)
        grid = RopeGrid(N, H // self.patch_size, W // self.patch_size, self.patch_start_idx, self.rope_base,
                        self.register_token.dtype, images.device)
        return self._encode(self.encoder, x), grid

    @torch.no_grad()
    def infer(self, images: torch.Tensor, dtype=None, **kwargs) -> dict:
        """``forward(images, **kwargs)`` (Pi3X: the conditions) under ``torch.no_grad`` and autocast with
        :meth:`inference_dtype` (weights stay FP32; ``dtype`` as its ``requested``)."""
        dt = self.inference_dtype(images.device, dtype)
        ctx = torch.autocast(images.device.type, dtype=dt, enabled=dt != torch.float32)
        with ctx:
            return self(images, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def _config_from_file(cls, path: str) -> dict:
        """Constructor kwargs from a ``config.json`` (ours, or the official one with ``pos_type`` /
        ``decoder_size``); unknown keys are ignored.

        Raises:
            ValueError: an official ``decoder_size`` other than ``"large"`` or a ``pos_type`` that is not RoPE.
        """
        if not os.path.isfile(path):
            return {}
        with open(path) as f:
            raw = json.load(f)
        if raw.get("decoder_size", "large") != "large":
            raise ValueError(f"{path}: decoder_size={raw['decoder_size']!r}; only the official 'large' decoder is "
                             f"built (its width equals the ViT-L encoder's)")
        pos = raw.get("pos_type")
        if pos is not None:
            if not str(pos).startswith("rope"):
                raise ValueError(f"{path}: pos_type={pos!r}; only RoPE ('rope100') is supported")
            raw.setdefault("rope_base", float(str(pos)[4:]))
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
        return {k: v for k, v in raw.items() if k in accepted}

    @classmethod
    def _filter_state_dict(cls, sd: dict, model: nn.Module) -> dict:
        """Hook for subclasses: drop checkpoint entries the configured model does not build."""
        return sd

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike | None = None, *,
                        force_download: bool = False, token: str | bool | None = None, cache_dir=None,
                        local_files_only: bool = False, revision: str | None = None, strict: bool = True,
                        device: str | torch.device = "cpu", **model_kwargs):
        """Load weights from the hub (default ``cls.default_repo``), a directory or a checkpoint file.

        Same call as huggingface_hub's ``PyTorchModelHubMixin.from_pretrained`` (the official loader).
        Licence: :data:`PI3_LICENSE` (CC BY-NC 4.0 weights; logged when a hub id is resolved). A hub id is
        resolved with :func:`visionattn.models.hub.hub_file`: the cache first, then one online attempt with a
        short timeout, so offline it fails in seconds. The model is built on the meta device and the weights
        are assigned straight onto ``device``. ``config.json`` beside the weights (ours or the official one)
        sets the config; ``model_kwargs`` (e.g. ``attn_mode="bf16"``) win over it. The ImageNet mean / std
        buffers are filled in when a checkpoint lacks them.

        Args:
            pretrained_model_name_or_path: hub repo id, a directory holding ``model.safetensors`` /
                ``model.pt``, or such a file; None = ``cls.default_repo``.
            force_download, token, cache_dir, local_files_only, revision: as ``hf_hub_download``.
            strict: refuse missing / unexpected keys (with False, missing ones keep a fresh initialisation).
            device: where the parameters are created.

        Raises:
            visionattn.models.hub.CheckpointNotFoundError: not local and not downloadable (the message names
                the cache folder and how to pass a local file).
            RuntimeError: missing / unexpected keys or shape mismatches with ``strict=True``.
        """
        from .hub import hub_file

        src = os.fspath(pretrained_model_name_or_path or cls.default_repo)
        hub = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only,
                   force_download=force_download)
        is_hub_id = not os.path.exists(src) and src.count("/") == 1 and not src.startswith((".", "/", "~"))
        if is_hub_id and src.lower().startswith("yyfz233/"):
            _log.warning("%s: %s.", src, PI3_LICENSE)
        try:
            path = resolve_checkpoint(src, **hub)
        except CheckpointNotFoundError as e:  # name this class in the "pass a local checkpoint" hint
            raise CheckpointNotFoundError(str(e).replace("VGGT.from_pretrained", f"{cls.__name__}.from_pretrained")
                                          .replace("facebook/VGGT-1B", cls.default_repo)) from None
        config_path = os.path.join(os.path.dirname(path), "config.json")
        if is_hub_id and not os.path.isfile(config_path):
            try:
                config_path = hub_file(src, ("config.json",), **hub)
            except CheckpointNotFoundError:
                pass
        cfg = cls._config_from_file(config_path)
        cfg.update(model_kwargs)
        device = torch.device(device)
        with torch.device("meta"):
            model = cls(**cfg)
        sd = cls._filter_state_dict(load_state_dict_file(path, device), model)
        for name, value in (("image_mean", _MEAN), ("image_std", _STD)):
            sd.setdefault(name, torch.tensor(value, device=device).view(1, 3, 1, 1))
        result = model.load_state_dict(sd, strict=strict, assign=True)
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:  # strict=False and keys absent: a fresh initialisation on the device
            with torch.device(device):
                fresh = cls(**cfg)
            fsd = fresh.state_dict()
            model.load_state_dict({n: fsd[n] for n in missing}, strict=False, assign=True)
        model.load_result = result
        return model.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, *, config: dict | None = None) -> str:
        """Write ``model.safetensors`` + ``config.json`` (each atomically) to ``save_directory``; returns the
        weights path. :meth:`from_pretrained` reads the folder back."""
        target = save_checkpoint_folder(self, save_directory, {**self.config, **(config or {})})
        return target


def _homogeneous_apply(poses: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Rigid transforms [B, N, 4, 4] applied to points [B, N, H, W, 3] -> [B, N, H, W, 3]."""
    hom = torch.cat([points, torch.ones_like(points[..., :1])], dim=-1)
    return torch.einsum("bnij,bnhwj->bnhwi", poses, hom)[..., :3]


class Pi3(_Pi3Base):
    """π³: reference-free multi-view reconstruction (local point maps, confidence, camera poses).

    Args:
        img_size, patch_size: DINOv2 position-embedding grid (518 / 14 = 37) and patch size (14).
        embed_dim, encoder_depth, encoder_heads: DINOv2 ViT-L/14 with 4 registers (1024, 24, 16).
        depth, num_heads, mlp_ratio: alternating decoder (36 blocks, 16 heads, 4); width = ``embed_dim``.
        num_register_tokens: decoder register tokens per frame (5; patch tokens start after them).
        head_embed_dim, head_depth, head_num_heads: the point / confidence / camera transformer decoders (1024, 5, 16).
        camera_dim: camera decoder output and camera head width (512).
        rope_base: 2-D RoPE base frequency (100, the official ``pos_type="rope100"``).
        attn_mode: precision of every attention: a visionattn mode (``"fp32"``, ``"tf32"``, ``"bf16"``, ...),
            ``"auto"`` (follow q's dtype) or None (PyTorch SDPA, as the official code). See :meth:`set_attn_mode`.
        encoder_chunk_size, tokens_chunk_size: see :meth:`set_chunking` (32 frames, 65536 rows).

    forward(images) -> dict, with B scenes of N frames of H x W pixels (multiples of 14):
        images: [N, 3, H, W] or [B, N, 3, H, W], float RGB in [0, 1].
        ``points`` [B, N, H, W, 3]: world points, ``camera_poses`` applied to ``local_points``;
        ``local_points`` [B, N, H, W, 3]: points in each camera's frame (OpenCV: x right, y down, z forward;
        z = exp(prediction) > 0);
        ``conf`` [B, N, H, W, 1]: confidence logits (``sigmoid`` gives [0, 1], higher is better);
        ``camera_poses`` [B, N, 4, 4]: camera-to-world, OpenCV convention.
        Lengths share one scene-wide scale that π³ leaves free (no metric unit). The heads run in the
        parameters' dtype with autocast off, as the official model; inference is deterministic.

    Raises (forward):
        ValueError: images not [N, 3, H, W] / [B, N, 3, H, W] or H, W not multiples of ``patch_size``.
        TypeError: integer images.
    """

    def __init__(self, img_size: int = 518, patch_size: int = 14, embed_dim: int = 1024, encoder_depth: int = 24,
                 encoder_heads: int = 16, depth: int = 36, num_heads: int = 16, mlp_ratio: float = 4.0,
                 num_register_tokens: int = 5, head_embed_dim: int = 1024, head_depth: int = 5,
                 head_num_heads: int = 16, camera_dim: int = 512, rope_base: float = 100.0,
                 attn_mode: str | None = AUTO_MODE, encoder_chunk_size: int | None = 32,
                 tokens_chunk_size: int | None = 65536):
        args = dict(locals())
        super().__init__()
        attn_mode = check_attn_mode(attn_mode)
        self.config = {k: v for k, v in args.items() if k not in ("self", "__class__", "attn_mode")}
        self._build_trunk(img_size, patch_size, embed_dim, encoder_depth, encoder_heads, depth, num_heads,
                          mlp_ratio, num_register_tokens, rope_base, attn_mode)
        dec = dict(dim=head_embed_dim, depth=head_depth, num_heads=head_num_heads, mlp_ratio=mlp_ratio,
                   attn_mode=attn_mode)
        self.point_decoder = TransformerDecoder(2 * embed_dim, head_embed_dim, **dec)
        self.point_head = LinearPts3d(patch_size, head_embed_dim, 3)
        self.conf_decoder = TransformerDecoder(2 * embed_dim, head_embed_dim, **dec)
        self.conf_head = LinearPts3d(patch_size, head_embed_dim, 1)
        self.camera_decoder = TransformerDecoder(2 * embed_dim, camera_dim, **dec)
        self.camera_head = CameraHead(camera_dim)
        self.set_chunking(encoder_chunk_size, tokens_chunk_size)

    def forward(self, images: torch.Tensor) -> dict:
        images = self._as_scenes(images, self.patch_size)
        B, N, _, H, W = images.shape
        h, w = H // self.patch_size, W // self.patch_size
        hidden, grid = self._trunk(images)
        feats = self._decode(hidden, B, N, grid)
        del hidden
        R = self.patch_start_idx
        point = self.point_decoder(feats, grid)[:, R:]
        conf = self.conf_decoder(feats, grid)[:, R:]
        camera = self.camera_decoder(feats, grid)[:, R:]
        dt = self.register_token.dtype
        with torch.autocast(images.device.type, enabled=False):
            xy, z = self.point_head(point.to(dt), h, w).reshape(B, N, H, W, 3).split([2, 1], dim=-1)
            z = torch.exp(z)
            local_points = torch.cat([xy * z, z], dim=-1)
            conf = self.conf_head(conf.to(dt), h, w).reshape(B, N, H, W, 1)
            camera_poses = self.camera_head(camera.to(dt)).reshape(B, N, 4, 4)
            points = _homogeneous_apply(camera_poses, local_points)
        return dict(points=points, local_points=local_points, conf=conf, camera_poses=camera_poses)


def pi3_tiny_config(**overrides) -> dict:
    """A tiny π³ config for CPU tests (width 64, 2 encoder + 4 decoder blocks, 4 heads, img 56): ``Pi3(**cfg)``.

    Same architecture as the official model, scaled down.
    """
    cfg = dict(img_size=56, patch_size=14, embed_dim=64, encoder_depth=2, encoder_heads=4, depth=4, num_heads=4,
               mlp_ratio=2.0, head_embed_dim=32, head_depth=1, head_num_heads=4, camera_dim=32)
    cfg.update(overrides)
    return cfg
