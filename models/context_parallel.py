"""VGGT or π³ with a scene's frames split across ranks: the global attention as context-parallel attention.

VGGT's aggregator alternates frame attention (the P tokens of one frame) and global attention (the
S*P tokens of all frames, frame-major). Everything but the global attention and the camera head's
trunk works frame by frame, so a scene of S frames can be split into contiguous chunks across the
ranks of a process group (rank 0 the first frames, each rank at least one), each rank running the
model on its own chunk:

* global attention: :func:`visionattn.distributed.context_parallel_attention` over the ranks' token
  shards (rank order = frame order, so the concatenation is the single-process token sequence);
* frame 0 of the scene takes the first camera / register token slot, every other frame the second:
  each rank learns the scene index of its first frame (one small all-gather per forward, which also
  agrees on every rank's inputs: a rank whose images, merging or query points are refused tells the
  others, and every rank raises the same error before any collective of the model) and sets
  :attr:`Aggregator.frame_offset <visionattn.models.aggregator.Aggregator>`;
* the camera head attends across the frames' camera tokens in its trunk: its input, one
  [B, S_r, 2C] token per frame (8 MB at 1000 frames in FP32), is all-gathered (autograd-aware), every
  rank runs the head over all S frames and keeps its own frames' poses;
* frame attention, the DINOv2 patch embed and the depth / point heads stay local.

The outputs of each rank are the single-process outputs of its frames, within the attention mode's
contract. Not supported (ValueError): FastVGGT token merging (it chooses merge targets across all
frames) and the track head (query points live in the scene's frame 0, and its tracker attends over
time).

π³ (:class:`visionattn.models.Pi3`) splits the same way, and more simply: its decoder's odd blocks attend over
the global layout [B, N*(5 + h*w), C] (frame-major, the 5 register tokens of a frame before its patches), its
RoPE positions are a frame's own (the same for every frame), and it has no reference frame, no first-frame
token and a frame-wise camera head. So only the global attention changes and every rank runs the rest on its
own frames; the outputs (``points``, ``local_points``, ``conf``, ``camera_poses``) are those of its frames.
Pi3X is refused (TypeError): its metric decoder reads every frame's tokens and its pose injection attends
among the posed frames relative to the first.

Training: the global attention's backward runs the same ring (see
:func:`~visionattn.distributed.context_parallel_attention`) and the camera tokens' gradients return
to their ranks by an all-reduce, so gradients of the inputs are exact. Each rank's parameter
gradients are its frames' share: sum them over the group (``all_reduce(SUM)``; DDP over the same
group averages, so scale by the world size) to get the single-process gradient of the summed loss.

    with split_frames(model):                      # every rank, its own chunk of frames
        out = model(images[start:stop])             # out: the poses, depth, points of those frames
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from visionattn.distributed import _agree, _check_collective_device, context_parallel_attention, gather_sequence

from .pi3 import Pi3

__all__ = ["split_frames", "FrameSplit"]


class FrameSplit:
    """What :func:`split_frames` installed on a model; :meth:`remove` (or leaving the ``with`` block) undoes it.

    Attributes:
        model: the VGGT or π³ model.
        group: the process group (None = the world).
        frames: frames per rank of the last forward (None before the first).
        frame_offset: scene index of this rank's first frame in the last forward.
    """

    def __init__(self, model, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("split_frames needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        error, attns, agg = None, [], None
        self.pi3 = type(model) is Pi3  # Pi3X derives from the same base, not from Pi3
        try:  # checked here, agreed on below: a rank refused alone would leave the others waiting in the forward
            agg = getattr(model, "aggregator", None)
            if self.pi3:
                attns = [blk.attn for blk in model.decoder[1::2]]  # odd decoder blocks: the global layout
            elif agg is None or not hasattr(agg, "global_blocks"):
                raise TypeError(f"split_frames takes a visionattn.models.VGGT or Pi3, got {type(model).__name__}"
                                + (" (its metric decoder and pose injection read every frame)"
                                   if type(model).__name__ == "Pi3X" else ""))
            else:
                attns = [blk.attn for blk in agg.global_blocks]
            if getattr(model, "merging", None) is not None:
                raise ValueError("FastVGGT token merging chooses merge targets across all frames and cannot run on "
                                 "split frames; set model.merging = None")
            if any("attend_fn" in vars(a) for a in attns):
                raise ValueError("this model's global attention is already split (remove the other FrameSplit "
                                 "first)")
        except Exception as e:
            error = e
        # a collective (once per split: 8 bytes per rank): every rank is split, or every rank raises
        _agree(group or dist.group.WORLD, "split_frames", [], error, 0)
        self.model, self.group = model, group
        self.frames: list[int] | None = None
        self.frame_offset = 0
        self._attns = attns
        self._agreed = False  # the model's pre-hook agreed on this forward; the aggregator's need not again
        for a in attns:
            a.attend_fn = self._attend
        self._hooks = [model.register_forward_pre_hook(self._before_model, with_kwargs=True)]
        if self.pi3:  # nothing else crosses frames
            return
        self._hooks.append(agg.register_forward_pre_hook(self._before_aggregator, with_kwargs=True))
        if model.camera_head is not None:
            self._hooks += [model.camera_head.register_forward_pre_hook(self._gather_camera_tokens),
                            model.camera_head.register_forward_hook(self._keep_own_frames)]
        if getattr(model, "track_head", None) is not None:
            self._hooks.append(model.track_head.register_forward_pre_hook(self._refuse_tracks))

    def _attend(self, q, k, v, mode):
        return context_parallel_attention(q, k, v, group=self.group, mode=mode)

    def _before_model(self, module, args, kwargs):
        """``VGGT.forward(images, query_points)``: agree on every rank's inputs (:meth:`_agree_frames`) before the
        model's own checks and its first collective."""
        images = args[0] if args else kwargs.get("images")
        query_points = args[1] if len(args) > 1 else kwargs.get("query_points")
        tracks = query_points is not None and getattr(module, "track_head", None) is not None
        self._agree_frames(images, getattr(module, "merging", None), tracks, four_dims=True)
        self._agreed = True

    def _before_aggregator(self, module, args, kwargs):
        """The aggregator called inside the model's forward: already agreed; called directly: agree here."""
        if self._agreed:
            self._agreed = False
            return
        images = args[0] if args else kwargs.get("images")
        self._agree_frames(images, args[1] if len(args) > 1 else kwargs.get("merging"), False, four_dims=False)

    def _agree_frames(self, images, merging, tracks: bool, four_dims: bool) -> None:
        """Every rank's frame count, after one small all-gather that also carries a rank's refusal (:func:`_agree`):
        this rank's frame offset. The checks that can fail on one rank run before it: the images' shape
        (``[S_r, 3, H, W]`` too when ``four_dims``: the model's forward takes it), dtype, size (a multiple of the
        patch size) and device, merging, query points (the track head); after it, B, H and W must agree."""
        group = self.group or dist.group.WORLD
        row, error = None, None
        try:
            if merging is not None:
                raise ValueError("FastVGGT token merging cannot run on split frames; set model.merging = None")
            if tracks:
                raise ValueError("the track head needs the scene's frame 0 (the query points) and attends over all "
                                 "frames; run it without split frames")
            if not isinstance(images, torch.Tensor):
                raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
            shape = tuple(images.shape)
            if four_dims and images.dim() == 4:
                shape = (1,) + shape
            if len(shape) != 5 or shape[2] != 3:
                raise ValueError(f"images must be [B, S_r, 3, H, W]{' or [S_r, 3, H, W]' if four_dims else ''}, "
                                 f"got {tuple(images.shape)}")
            if not images.is_floating_point():
                raise TypeError(f"images must be float in [0, 1], got {images.dtype}")
            B, S, _, H, W = shape
            p = self.model.patch_size if self.pi3 else self.model.aggregator.patch_size
            if H % p or W % p:
                raise ValueError(f"image size {H}x{W} must be a multiple of patch_size={p}")
            if S < 1:
                raise ValueError(f"no frames (images {tuple(images.shape)}): every rank needs S_r >= 1")
            _check_collective_device("images", images, group)
            row = [B, S, H, W]
        except Exception as e:  # every rank learns it in the exchange, which this rank must still join
            error = e
        rows = [[int(x) for x in r] for r in _agree(group, "split_frames", row, error, 4)]
        if len({(b, h, w) for b, _, h, w in rows}) > 1:
            raise ValueError(f"split_frames: every rank needs images [B, S_r, 3, H, W] with the same B, H and W; got "
                             f"(B, S_r, H, W) = {[tuple(r) for r in rows]} by rank")
        rank = dist.get_rank(group)
        self.frames = [s for _, s, _, _ in rows]
        self.frame_offset = sum(self.frames[:rank])
        if not self.pi3:  # π³ has no first-frame slot
            self.model.aggregator.frame_offset = self.frame_offset

    def _gather_camera_tokens(self, module, args):
        """The camera head's input: the last layer's camera tokens of all frames [B, S, 1, 2C]."""
        tokens = gather_sequence(args[0][-1][:, :, :1], dim=1, group=self.group)
        return ([tokens],) + tuple(args[1:])

    def _keep_own_frames(self, module, args, output):
        start, count = self.frame_offset, self.frames[dist.get_rank(self.group or dist.group.WORLD)]
        return [p[:, start:start + count] for p in output]

    @staticmethod
    def _refuse_tracks(module, args):
        raise ValueError("split_frames: the track head needs the scene's frame 0 (the query points) and attends "
                         "over all frames; run it without split frames")

    def remove(self) -> None:
        """Restore the model: single-process global attention, frame offset 0, no hooks."""
        for a in self._attns:
            vars(a).pop("attend_fn", None)
        if not self.pi3:
            vars(self.model.aggregator).pop("frame_offset", None)
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self) -> "FrameSplit":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def split_frames(model, group=None) -> FrameSplit:
    """Run a VGGT or π³ model with a scene's frames split across the ranks of ``group`` (module docstring).

    Each rank then calls ``model(images_r)`` with its contiguous chunk of the scene's frames
    (``images_r`` [S_r, 3, H, W] or [B, S_r, 3, H, W], rank 0 holding the first frames, S_r >= 1, same B,
    H, W everywhere) and gets the outputs of those frames: ``pose_enc`` [B, S_r, 9] (and
    ``pose_enc_list``), ``depth`` / ``world_points`` and their confidences [B, S_r, H, W, ...], equal to the
    single-process model's outputs for those frames within the attention mode's contract (π³: ``points``,
    ``local_points``, ``conf`` [B, S_r, H, W, ...] and ``camera_poses`` [B, S_r, 4, 4]). Every rank must
    run every forward (and backward) together: they are collectives.

    Args:
        model: a :class:`visionattn.models.VGGT` or :class:`visionattn.models.Pi3` (any ``attn_mode``; ``None``
            (SDPA) runs the global attention in the visionattn mode ``"auto"`` picks, since the ring needs the
            per-row LSE).
        group: the process group (default: the world).

    Returns:
        a :class:`FrameSplit`: use it as a context manager, or call ``.remove()``.

    Raises:
        RuntimeError: ``torch.distributed`` not initialised.
        TypeError: not a VGGT or Pi3 (Pi3X included).
        ValueError: token merging on, the model already split; at forward time: merging, the track head
            (query points), a rank with no frames, another batch size or image size, images the model refuses.
        A collective, like each forward: a rank that refuses its model or inputs tells the others, and every
        rank raises the same error, naming the rank (``"split_frames: rank r: ..."``).
    """
    return FrameSplit(model, group)
