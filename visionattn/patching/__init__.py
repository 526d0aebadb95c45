"""Putting visionattn into existing models.

* :func:`patch_model` / :func:`unpatch_model` — exact-class patchers for timm
  (ViT / DeiT / EVA / rope ViTs, Swin, Swin-v2), native visionattn modules (VGGT)
  and diffusers models (delegated to :mod:`visionattn.patching.diffusers`);
* :func:`sdpa_override` — a context manager routing any
  ``F.scaled_dot_product_attention`` call to :func:`visionattn.attention`.

timm is imported only when a model is patched (:mod:`visionattn.patching.timm`).
"""
from .core import PatchReport, PatchSpec, patch_model, registered_patches, unpatch_model
from .sdpa import SDPAOverride, sdpa_override

__all__ = ["patch_model", "unpatch_model", "sdpa_override", "SDPAOverride", "PatchReport", "PatchSpec",
           "registered_patches"]
