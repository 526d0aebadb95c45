"""Triton kernels and their launchers. No model knowledge here (DESIGN.md, "Layout").

Entry points used by :mod:`visionattn.api` and :mod:`visionattn.window`:

* :func:`elsa_attention` — dense ELSA forward (single pass / split-KV + merge),
  modes fp32, fp32-ieee, tf32, fp16, bf16 (fp32-ieee on CUDA mostly through the Gluon
  kernel of :mod:`.ieee_gluon`; long fp16 / bf16 sequences on Hopper through the warp-specialized
  Gluon kernel of :mod:`.half_gluon`);
* :func:`pasa_attention` — FP16-score-accumulation forward with PASA shifting
  (``shift=True``) or without (the ``fp16-acc16`` baseline);
* :func:`window_attention_fwd` — Swin / Swin-v2 window attention;
* :func:`unsupported_reason` / :func:`pasa_unsupported_reason` — why a call cannot run on
  the dense / PASA kernels (or None);
* :data:`OUT_DTYPES` — the output dtypes the dense and PASA kernels can write (``out_dtype=``).
"""
from ._host import OUT_DTYPES
from .elsa_fwd import elsa_attention, unsupported_reason
from .pasa_fwd import pasa_attention, pasa_unsupported_reason
from .window_fwd import window_attention_fwd

__all__ = ["elsa_attention", "pasa_attention", "window_attention_fwd", "unsupported_reason",
           "pasa_unsupported_reason", "OUT_DTYPES"]
