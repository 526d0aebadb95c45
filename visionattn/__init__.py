"""visionattn: exact softmax attention for vision models.

ELSA's (m, S, W) monoid run as tiled Triton kernels in FP32, TF32, FP16/BF16
and PASA, window variants for Swin / Swin-v2, and one-call patching of timm,
VGGT and diffusers models. See README.md and docs/design.md.

    import visionattn as va
    out = va.attention(q, k, v, mode="fp32")        # q [B, H, Nq, D]
    va.patch_model(model, mode="fp16")               # timm / VGGT / diffusers, in place
"""
import importlib.util as _util

# kernels/ and models/ become visionattn.kernels and visionattn.models through the install's package-dir mapping
# (pyproject.toml), so a checkout on PYTHONPATH alone lacks them: fail here, naming the fix.
if _util.find_spec(__name__ + ".kernels") is None:
    raise ImportError(f"visionattn.kernels not found: visionattn was imported from {__path__[0]} without an "
                      "install; run `pip install -e .` in the checkout (it maps kernels/ and models/ into visionattn)")

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
