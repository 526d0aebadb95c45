"""NaFlexViT (``timm.models.naflexvit.NaFlexVit``): padded batches attend without the padded keys.

NaFlexViT batches images of different aspect ratios as patch sequences padded to one length ``N`` (prefix
tokens first, then each image's valid patches, then padding) and a validity mask ``patch_valid`` [B, N'].
timm turns it into an additive mask for every block (``create_attention_mask``): by default the symmetric
``[B, 1, N, N]`` mask, 0 where query *and* key are valid, ``finfo(dtype).min`` elsewhere; with
``use_key_only_attn_mask`` the key-only ``[B, 1, 1, N]`` mask. Run as a dense masked attention it computes
all ``N x N`` logits per image, the padded ones included.

Patched, the same batch runs as ragged attention over the valid tokens (:func:`visionattn.varlen_attention`,
one launch for the whole batch, the padded keys never loaded), with the backward of
:mod:`visionattn.kernels.varlen_bwd` when training. The model-level patch :class:`VisionattnNaFlexVit` (a
row of :data:`PATCHES`, registered in :mod:`visionattn.patching.core`) knows the validity exactly: its
``_forward_embeds`` records, for the mask it builds from ``patch_valid``, the packing (:class:`KeyPadding`);
the patched attention modules (:func:`visionattn.patching.timm._dense`) look the mask up
(:func:`key_padding_of`) and call :func:`key_padding_attention`. No mask is inspected on the device and a
mask a caller passes is never reinterpreted (it runs the dense masked path).

What each row gets, against the unpatched model (timm's SDPA on the additive mask):

* valid query rows: attention over their image's valid keys, exactly the unpatched model's (the masked keys'
  ``exp(finfo.min - m)`` is 0 there), within the mode's contract;
* padded query rows, symmetric mask: every logit of the row is ``finfo(dtype).min``, which for a float32 /
  bfloat16 mask swamps the logits, so SDPA attends uniformly to all N keys: the row gets the mean of V over
  the image's N tokens, as here (computed in PyTorch, O(N) per image). A float16 model's mask value
  (-65504) does not swamp the logits and its padded rows differ; padded rows never reach valid tokens
  (they are masked as keys) nor the pooled output (``global_pool_naflex`` skips them);
* padded query rows, key-only mask: attention over the valid keys, as the unpatched model (the varlen call
  packs every query row).

Why the ragged kernel rather than a dense kernel that skips fully masked KV tiles: the padded keys sit at
the end of each image's row, so a tile skip would need the mask read (or a per-image key count passed) and
still launch programs for the padded query rows and compute the partially padded tiles; the varlen launch
takes exactly the valid tokens, has its backward, and needs no change to the dense kernels.

Under ``torch.compile`` no packing is recorded (it needs the valid count on the host) and the compiled
model runs the dense masked path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from timm.models.naflexvit import NaFlexVit
from torch.utils.weak import WeakTensorKeyDictionary

from ..dispatch import recording
from .core import PatchSpec

__all__ = ["PATCHES", "VisionattnNaFlexVit", "KeyPadding", "key_padding_of", "key_padding_attention",
           "naflex_batch"]


@dataclass(frozen=True)
class KeyPadding:
    """How a padded batch packs into ragged sequences.

    Attributes:
        rows: int64 [total], the flat indices ``b * N + i`` of the valid tokens, image by image.
        cu_seqlens: int32 [B + 1], offsets of each image's valid tokens in the packed order, on the mask's device.
        cu_seqlens_host: the same offsets on the CPU: the attention calls pass these, so the kernels know the lengths
            without a synchronisation per layer (:func:`visionattn.varlen_attention`'s host offsets).
        max_seqlen: the most valid tokens of one image.
        batch, length: B and N of the padded batch.
        symmetric: the mask masks padded query rows too (timm's default); False: key-only mask.
    """

    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    max_seqlen: int
    batch: int
    length: int
    symmetric: bool

    @classmethod
    def from_valid(cls, valid: torch.Tensor, symmetric: bool) -> "KeyPadding":
        """From a bool validity mask [B, N] (True = a real token; two reads on the host).

        Raises:
            ValueError: ``valid`` is not a 2-D bool tensor.
        """
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
            raise ValueError(f"valid must be a bool [B, N] tensor, got {getattr(valid, 'dtype', type(valid))} "
                             f"{tuple(getattr(valid, 'shape', ()))}")
        B, N = valid.shape
        rows = valid.reshape(-1).nonzero().squeeze(1)
        lens = valid.sum(1, dtype=torch.int32).cpu()
        cu_host = torch.zeros(B + 1, dtype=torch.int32)
        cu_host[1:] = torch.cumsum(lens, 0)
        return cls(rows, cu_host.to(valid.device), cu_host, int(lens.max()) if B else 0, B, N, symmetric)


# a mask built by a patched NaFlexVit -> its packing; entries vanish with the mask (weak keys, by identity)
_TAGS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def key_padding_of(attn_mask: Optional[torch.Tensor]) -> Optional[KeyPadding]:
    """The packing :class:`VisionattnNaFlexVit` recorded for this exact mask tensor, else None."""
    if attn_mask is None or recording():
        return None  # (compiled / traced graphs run the mask as it is: the packing is data-dependent)
    return _TAGS.get(attn_mask)


def key_padding_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kp: KeyPadding, *,
                          scale: Optional[float], mode: str = "fp32", backend: Optional[str] = None,
                          num_splits: Optional[int] = None) -> Optional[torch.Tensor]:
    """Self-attention of a padded batch over its valid keys by :func:`visionattn.varlen_attention`.

    Args:
        q, k: [B, H, N, D]; v: [B, H, N, Dv] (any strides, e.g. timm's qkv ``unbind`` views), float16 /
            bfloat16 / float32; B, N as ``kp`` records.
        kp: the batch's :class:`KeyPadding`.
        scale, mode, backend: as :func:`visionattn.varlen_attention`; ``num_splits`` (a dense split-KV option)
            does not apply to the ragged kernel and is ignored.

    Returns:
        [B, H, N, Dv] in q's dtype (module docstring: valid rows attend their image's valid keys; padded rows
        the mean of V over the image's N tokens with a symmetric mask, the valid keys with a key-only one),
        or None where the ragged path does not cover the call (a mode without a varlen path: warned once).

    Raises:
        ValueError: q's batch / length differ from ``kp``'s.
    """
    from ..dispatch import warn_once
    from ..modes import get_mode
    from ..varlen import varlen_attention

    B, H, N, D = q.shape
    if (B, N) != (kp.batch, kp.length):
        raise ValueError(f"q has batch {B} and length {N}; the key padding was recorded for {kp.batch} x {kp.length}")
    md = get_mode(mode)
    if md.half_scores:
        warn_once(f"naflex-dense:{md.name}", f"visionattn: mode {md.name!r} has no ragged (varlen) kernel; the "
                                             f"padded NaFlexViT batch runs the dense masked kernel instead")
        return None
    Dv = v.shape[3]
    flat = lambda t: t.transpose(1, 2).reshape(B * N, H, t.shape[3])  # noqa: E731  [B * N, H, .], a view for qkv
    kv = [flat(t).index_select(0, kp.rows) for t in (k, v)]
    if kp.symmetric:
        out = varlen_attention(flat(q).index_select(0, kp.rows), *kv, kp.cu_seqlens_host, kp.cu_seqlens_host,
                               kp.max_seqlen, kp.max_seqlen, mode=md, scale=scale, backend=backend)
        # padded rows: SDPA's uniform attention over the N keys of a row whose every logit is finfo.min
        full = v.mean(2, dtype=torch.float32).to(out.dtype)[:, None].expand(B, N, H, Dv).reshape(B * N, H, Dv)
        out = full.index_copy(0, kp.rows, out)
    else:
        cu_q = torch.arange(0, (B + 1) * N, N, dtype=torch.int32)
        out = varlen_attention(flat(q), *kv, cu_q, kp.cu_seqlens_host, N, kp.max_seqlen, mode=md, scale=scale,
                               backend=backend)
    return out.view(B, N, H, Dv).transpose(1, 2)


class VisionattnNaFlexVit(NaFlexVit):
    """``timm.models.naflexvit.NaFlexVit`` whose blocks' attention skips the padded tokens.

    Overrides only ``_forward_embeds``: after timm's, the attention mask it built from ``patch_valid`` (not a
    caller's ``attn_mask``) is recorded with its :class:`KeyPadding`, which the patched attention modules
    find. The blocks' attention modules are patched by their own rows (``timm.layers.Attention``, ...).
    """

    def _forward_embeds(self, x, patch_coord, patch_valid, attn_mask):
        embeds = super()._forward_embeds(x, patch_coord, patch_valid, attn_mask)
        mask, valid = embeds.get("attn_mask"), embeds.get("patch_valid")
        if attn_mask is None and mask is not None and valid is not None and not recording():
            valid = valid.bool()
            if self.num_prefix_tokens:
                valid = torch.cat([valid.new_ones(valid.shape[0], self.num_prefix_tokens), valid], 1)
            if mask.shape[-1] == valid.shape[1]:
                _TAGS[mask] = KeyPadding.from_valid(valid, symmetric=not getattr(self, "use_key_only_attn_mask", False))
        return embeds


def naflex_batch(images: list[torch.Tensor], patch_size: int = 16) -> dict[str, torch.Tensor]:
    """NaFlex inputs for a list of [3, H_i, W_i] images: each patchified (``timm.data.naflex_transforms.
    patchify_image``, zero-padded to whole patches) and padded to the longest, as timm's NaFlex collator does.

    Returns:
        ``{"patches": [B, N, P * P * 3], "patch_coord": int64 [B, N, 2] (y, x), "patch_valid": bool [B, N]}``.
    """
    from timm.data.naflex_transforms import patchify_image

    parts = [patchify_image(img, (patch_size, patch_size)) for img in images]
    n = max(p[0].shape[0] for p in parts)
    B = len(parts)
    patches = images[0].new_zeros(B, n, parts[0][0].shape[1])
    coord = torch.zeros(B, n, 2, dtype=torch.long, device=images[0].device)
    valid = torch.zeros(B, n, dtype=torch.bool, device=images[0].device)
    for i, (p, c, v) in enumerate(parts):
        patches[i, :p.shape[0]] = p
        coord[i, :p.shape[0]] = c.to(coord.device)
        valid[i, :p.shape[0]] = v.to(valid.device)
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


# timm 1.0.17's NaFlexVit builds its mask inside ``forward_features`` (no ``_forward_embeds`` to hook): there the
# model is left to the patched attention modules' masked dense path
PATCHES: tuple[PatchSpec, ...] = ((PatchSpec("naflexvit", NaFlexVit, VisionattnNaFlexVit),)
                                  if hasattr(NaFlexVit, "_forward_embeds") else ())
