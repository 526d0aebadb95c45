"""visionattn: exact softmax attention for vision models.

ELSA's (m, S, W) monoid run as tiled Triton kernels in FP32, TF32, FP16/BF16
and PASA, window variants for Swin / Swin-v2, and one-call patching of timm,
VGGT and diffusers models. See README.md and DESIGN.md.

    import visionattn as va
    out = va.attention(q, k, v, mode="fp32")        # q [B, H, Nq, D]
    va.patch_model(model, mode="fp16")               # timm / VGGT / diffusers, in place
"""
import os as _os

# In a source checkout imported without an editable install (PYTHONPATH=repo, or a
# setuptools too old for package-dir mappings), this folder shadows the installed
# package and `visionattn.kernels` / `visionattn.models` (the repo's kernels/ and
# models/ folders) would not resolve: let the package also search the repo root.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(_root, "kernels", "__init__.py")) and _root not in __path__:
    __path__.append(_root)

from .api import attention  # noqa: E402
from .dispatch import get_backend, set_backend, use_backend
from .modes import MODES, Mode, get_mode, mode_names
from .patching import patch_model, sdpa_override, unpatch_model
from .window import window_attention
from . import metrics, reference

__version__ = "0.1.0"

__all__ = [
    "attention", "window_attention", "patch_model", "unpatch_model", "sdpa_override",
    "MODES", "Mode", "get_mode", "mode_names", "get_backend", "set_backend", "use_backend",
    "metrics", "reference", "__version__",
]
