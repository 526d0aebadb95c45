"""VGGT aggregator: DINOv2 patch embed + alternating frame / global attention.

Tokens per frame: [camera (1), registers (4), patches (h*w)], patch start
index 5. ``frame_blocks[i]`` attends within each frame (tokens as [B*S, P, C]);
``global_blocks[i]`` over all frames ([B, S*P, C], frame-major). After each
frame + global pair the two outputs are concatenated on channels, giving
``depth`` outputs [B, S, P, 2C] (VGGT, Wang et al. CVPR 2025, Sec. 3.2).
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import AUTO_MODE, Block, DinoV2, checkpointed, randn_scaled, rope_tables
from .merging import TokenMerging

__all__ = ["Aggregator", "PATCH_START_IDX"]

PATCH_START_IDX = 5
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


def _first_and_rest(token: torch.Tensor, B: int, S: int, first_frame: bool = True) -> torch.Tensor:
    """[1, 2, n, C] -> [B*S, n, C]: slot 0 for frame 0, slot 1 for frames 1..S-1 (all S frames without
    ``first_frame``: a chunk of a scene that does not start at its frame 0)."""
    first = token[:, :int(first_frame)].expand(B, int(first_frame), *token.shape[2:])
    rest = token[:, 1:].expand(B, S - int(first_frame), *token.shape[2:])
    return torch.cat([first, rest], dim=1).reshape(B * S, *token.shape[2:])


class Aggregator(nn.Module):
    """Alternating-attention aggregator.

    Args:
        img_size, patch_size, embed_dim: 518, 14, 1024 for VGGT-1B.
        depth: number of frame blocks = global blocks (24).
        num_heads, mlp_ratio: 16, 4.
        num_register_tokens: 4 (aggregator and DINOv2 alike).
        patch_embed_depth, patch_embed_heads: DINOv2 depth / heads (24 / 16 for ViT-L).
        rope_base: 2-D RoPE base frequency (100).
        attn_mode: initial ``visionattn_mode`` of every attention.

    Attribute ``frames_chunk_size`` (None = all at once): frames per DINOv2 patch-embed
    chunk; each chunk's patch tokens are written into the preallocated token tensor
    [B*S, P, C] (no concatenation copy). Frames are independent in the patch embed, so
    chunking changes the result at most by FP rounding (GEMMs over another row count; see
    :class:`~visionattn.models.layers.Block`).

    Attribute ``grad_checkpointing`` (False): when autograd records, run every frame and global
    block under activation checkpointing (:func:`~visionattn.models.layers.checkpointed`): the
    forward keeps one [B*S, P, C] block input per block instead of the block's activations
    (about 20 C per token), and backward recomputes each block once. The DINOv2 blocks follow
    ``patch_embed.grad_checkpointing``. Outputs and gradients are unchanged.

    Attribute ``frame_offset`` (0): the scene index of the first frame of ``images`` when a scene's
    frames are split across ranks (set by :func:`~visionattn.models.context_parallel.split_frames`);
    only the scene's frame 0 takes the first camera / register token slot.
    """

    frames_chunk_size: int | None = None
    grad_checkpointing: bool = False
    frame_offset: int = 0

    def __init__(self, img_size: int = 518, patch_size: int = 14, embed_dim: int = 1024, depth: int = 24,
                 num_heads: int = 16, mlp_ratio: float = 4.0, num_register_tokens: int = 4,
                 patch_embed_depth: int = 24, patch_embed_heads: int = 16, rope_base: float = 100.0,
                 attn_mode: str | None = AUTO_MODE):
        super().__init__()
        self.patch_size = patch_size
        self.depth = depth
        self.rope_base = rope_base
        self.head_dim = embed_dim // num_heads
        self.patch_start_idx = 1 + num_register_tokens
        self.camera_token = nn.Parameter(randn_scaled(1, 2, 1, embed_dim, scale=1e-6))
        self.register_token = nn.Parameter(randn_scaled(1, 2, num_register_tokens, embed_dim, scale=1e-6))
        self.patch_embed = DinoV2(img_size, patch_size, embed_dim, patch_embed_depth, patch_embed_heads, mlp_ratio,
                                  num_register_tokens, init_values=1.0, attn_mode=attn_mode)
        self.frame_blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, 0.01, qk_norm=True,
                                                attn_mode=attn_mode) for _ in range(depth))
        self.global_blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, 0.01, qk_norm=True,
                                                 attn_mode=attn_mode) for _ in range(depth))
        self.register_buffer("_resnet_mean", torch.tensor(_MEAN).reshape(1, 1, 3, 1, 1), persistent=False)
        self.register_buffer("_resnet_std", torch.tensor(_STD).reshape(1, 1, 3, 1, 1), persistent=False)

    def positions(self, BS: int, h: int, w: int, device) -> torch.Tensor:
        """[BS, P, 2] long (y, x): special tokens at (0, 0), patch (i, j) at (i + 1, j + 1)."""
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        grid = torch.stack([ys, xs], dim=-1).reshape(h * w, 2) + 1
        pos = torch.cat([torch.zeros(self.patch_start_idx, 2, dtype=torch.long, device=device), grid])
        return pos[None].expand(BS, -1, -1)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, S, 3, H, W] in [0, 1] -> initial tokens [B*S, P, C] (camera, registers, DINOv2 patches).

        The dtype is that of ``torch.cat`` of the special tokens and the patch tokens (FP32
        under autocast: DINOv2 ends in a LayerNorm). Runs ``frames_chunk_size`` frames at a time.
        """
        B, S, _, H, W = images.shape
        frames = images.reshape(B * S, 3, H, W)
        mean, std = self._resnet_mean[0], self._resnet_std[0]
        n_special = self.patch_start_idx
        step = self.frames_chunk_size or B * S
        tokens = None
        for s0 in range(0, B * S, step):
            patches = self.patch_embed((frames[s0:s0 + step] - mean) / std)
            if tokens is None:
                dt = torch.promote_types(self.camera_token.dtype, patches.dtype)
                tokens = torch.empty(B * S, n_special + patches.shape[1], patches.shape[2], dtype=dt,
                                     device=patches.device)
            tokens[s0:s0 + step, n_special:] = patches
            del patches
        first = self.frame_offset == 0
        tokens[:, :1] = _first_and_rest(self.camera_token, B, S, first)
        tokens[:, 1:n_special] = _first_and_rest(self.register_token, B, S, first)
        return tokens

    def forward(self, images: torch.Tensor, merging: TokenMerging | None = None,
                keep_layers: tuple[int, ...] | None = None) -> tuple[list, int]:
        """Aggregate frames.

        Args:
            images: [B, S, 3, H, W] in [0, 1]; H, W multiples of patch_size.
            merging: FastVGGT token merging in the global blocks (None = off).
            keep_layers: keep only these outputs (the others are None and never built: each
                concatenation [B, S, P, 2C] costs 2 * B*S*P*C elements); None keeps all ``depth``.

        Returns:
            (list of ``depth`` tensors [B, S, P, 2C] or None, patch_start_idx).

        Raises:
            ValueError: wrong rank, channels or a size not divisible by patch_size.
        """
        if images.dim() != 5 or images.shape[2] != 3:
            raise ValueError(f"images must be [B, S, 3, H, W], got {tuple(images.shape)}")
        B, S, _, H, W = images.shape
        p = self.patch_size
        if H % p or W % p:
            raise ValueError(f"image size {H}x{W} must be a multiple of patch_size={p} (resize or crop first)")
        h, w = H // p, W // p
        tokens = self.embed(images)
        BS, P, C = tokens.shape
        rope = rope_tables(self.positions(BS, h, w, images.device), self.head_dim, self.rope_base,
                           dtype=torch.float32)
        rope_global = rope.view(B, S * P)
        outputs = []
        ckpt = self.grad_checkpointing
        for i in range(self.depth):
            tokens = checkpointed(self.frame_blocks[i], tokens.reshape(BS, P, C), rope, enabled=ckpt)
            frame_out = tokens.reshape(B, S, P, C)
            use_merge = merging if (merging is not None and i >= merging.start_block) else None
            tokens = checkpointed(self.global_blocks[i], tokens.reshape(B, S * P, C), rope_global, use_merge,
                                  (S, h, w), enabled=ckpt)
            if keep_layers is None or i in keep_layers:
                outputs.append(torch.cat([frame_out, tokens.reshape(B, S, P, C)], dim=-1))
            else:
                outputs.append(None)
            del frame_out
        return outputs, self.patch_start_idx
