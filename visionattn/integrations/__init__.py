"""visionattn inside other libraries' own extension points.

* :mod:`visionattn.integrations.transformers` — :func:`~visionattn.integrations.transformers.register`
  adds visionattn to transformers' ``AttentionInterface``, so a model loaded with
  ``attn_implementation="visionattn_fp32"`` (or another mode) runs :func:`visionattn.attention`.

diffusers models are patched through :func:`visionattn.patch_model` instead
(:mod:`visionattn.patching.diffusers`, :mod:`visionattn.patching.diffusers_dispatch`).

Nothing here is imported by ``import visionattn``; each submodule imports its library only
when one of its functions is called.
"""

__all__: list[str] = []
