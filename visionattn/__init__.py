"""visionattn: exact softmax attention for vision models.

ELSA's (m, S, W) monoid run as tiled Triton kernels in FP32, TF32, FP16/BF16
and PASA, window variants for Swin / Swin-v2, and one-call patching of timm,
VGGT and diffusers models. See README.md and docs/design.md.

    import visionattn as va
    out = va.attention(q, k, v, mode="fp32")        # q [B, H, Nq, D]
    va.patch_model(model, mode="fp16")               # timm / VGGT / diffusers, in place
"""
import importlib.util as _util
import os as _os
import sys as _sys

# pyproject.toml maps two folders of the checkout into this package: kernels/ -> visionattn.kernels and
# models/ -> visionattn.models. An install (editable or not) resolves them. In a source checkout imported
# without an install (PYTHONPATH=repo), or with a setuptools too old for package-dir mappings, they would not
# resolve: a finder then maps exactly these two names to their folders. Nothing else of the checkout (tools/,
# tests/, ...) becomes importable as visionattn.<folder>.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_CHECKOUT_PACKAGES = {__name__ + ".kernels": "kernels", __name__ + ".models": "models"}


class _CheckoutFinder:
    """Meta-path finder for the mapped folders of a source checkout, and for nothing else."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        folder = _CHECKOUT_PACKAGES.get(fullname)
        if folder is None:
            return None
        return _util.spec_from_file_location(fullname, _os.path.join(_root, folder, "__init__.py"),
                                             submodule_search_locations=[_os.path.join(_root, folder)])


if (_os.path.isfile(_os.path.join(_root, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py"))
        and _util.find_spec(__name__ + ".kernels") is None):
    _sys.meta_path.append(_CheckoutFinder)

from .api import attention, attention_qkvpacked  # noqa: E402
from .dispatch import get_backend, set_backend, use_backend
from .modes import MODES, Mode, get_mode, mode_names
from .patching import patch_model, sdpa_override, unpatch_model
from .window import window_attention, window_attention_qkvpacked
from .varlen import varlen_attention
from . import metrics, reference

__version__ = "0.1.0"

__all__ = [
    "attention", "attention_qkvpacked", "window_attention", "window_attention_qkvpacked", "varlen_attention",
    "patch_model", "unpatch_model", "sdpa_override",
    "MODES", "Mode", "get_mode", "mode_names", "get_backend", "set_backend", "use_backend",
    "metrics", "reference", "__version__",
]
