"""Putting visionattn into existing models.

* :func:`patch_model` / :func:`unpatch_model` — exact-class patchers for timm
  (ViT / DeiT / EVA / rope ViTs, Swin, Swin-v2: :mod:`.timm`; BEiT, CaiT / XCiT, MaxViT / CoAtNet,
  Hiera, MViTv2: :mod:`.timm_families`; NaFlexViT's padded batches: :mod:`.naflex`), transformers'
  Swin / Swin-v2 (:mod:`.transformers_swin`), native visionattn modules (VGGT) and diffusers models
  (delegated to :mod:`.diffusers`);
* :func:`sdpa_override` — a context manager routing any
  ``F.scaled_dot_product_attention`` call to :func:`visionattn.attention`;
* :func:`clear_inference_caches` — drop what patched modules keep between inference forwards
  (position biases derived from parameters alone; see :func:`.core.inference_cached`).

A library's patchers (and the library) are imported only when a model holding its modules is patched.
"""
from .core import PatchReport, PatchSpec, clear_inference_caches, patch_model, registered_patches, unpatch_model
from .sdpa import SDPAOverride, sdpa_override

__all__ = ["patch_model", "unpatch_model", "sdpa_override", "SDPAOverride", "PatchReport", "PatchSpec",
           "registered_patches", "clear_inference_caches"]
