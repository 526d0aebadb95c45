"""Triton kernels and their launchers. No model knowledge here (docs/design.md, "Layout").

Entry points used by :mod:`visionattn.ops` (the op layer) and by tools:

* :func:`elsa_attention` / :func:`.elsa_fwd.dense_forward` — dense ELSA forward (single pass /
  split-KV + merge), modes fp32, fp32-ieee, tf32, fp16, bf16 (fp32-ieee on CUDA mostly through the
  Gluon kernel of :mod:`.ieee_gluon`; fp16 / bf16 on Hopper mostly through the warp-specialized
  Gluon kernel of :mod:`.half_gluon`, fp32 from 256 keys through its split-FP16 build, :mod:`.fp32_gluon`);
* :func:`pasa_attention` — FP16-score-accumulation forward with PASA shifting
  (``shift=True``) or without (the ``fp16-acc16`` baseline);
* :func:`window_attention_fwd` — Swin / Swin-v2 window attention;
* :func:`unsupported_reason` / :func:`pasa_unsupported_reason` — why a call cannot run on
  the dense / PASA kernels (or None);
* :data:`OUT_DTYPES` — the output dtypes the dense and PASA kernels can write (``out_dtype=``);
* :mod:`.modes` — the precision table every layer reads (imports no Triton).

Attributes load their module on first use, so ``import visionattn`` (which reads :mod:`.modes`)
does not import Triton.
"""
import importlib

__all__ = ["elsa_attention", "pasa_attention", "window_attention_fwd", "unsupported_reason",
           "pasa_unsupported_reason", "OUT_DTYPES"]

_HOMES = {"elsa_attention": "elsa_fwd", "unsupported_reason": "elsa_fwd", "pasa_attention": "pasa_fwd",
          "pasa_unsupported_reason": "pasa_fwd", "window_attention_fwd": "window_fwd", "OUT_DTYPES": "_launch"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
