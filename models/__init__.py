"""VGGT and FastVGGT, written for visionattn (parameter names of the official VGGT-1B checkpoint).

    from visionattn.models import VGGT, vggt_tiny_config, FASTVGGT_MERGING
    model = VGGT.from_pretrained("facebook/VGGT-1B")          # or a local dir / file
    fast = VGGT(merging=FASTVGGT_MERGING)                     # FastVGGT token merging
    out = model.infer(images)                                 # images [S, 3, H, W] in [0, 1]

Every attention goes through :func:`visionattn.attention` with the model's
``attn_mode`` (or PyTorch SDPA with ``attn_mode=None``).
"""
from .convert import predictions_to_numpy
from .geometry import (closed_form_inverse_se3, confidence_mask, extri_intri_to_pose_encoding,
                       pose_encoding_to_extri_intri, unproject_depth_map_to_point_map)
from .hub import CheckpointNotFoundError
from .memory import LiveBytes, estimate_memory, max_frames_that_fit
from .merging import FASTVGGT_MERGING, TokenMerging
from .vggt import DEFAULT_REPO, VGGT, vggt_attention_shapes, vggt_tiny_config

__all__ = [
    "VGGT", "vggt_tiny_config", "vggt_attention_shapes", "FASTVGGT_MERGING", "TokenMerging", "DEFAULT_REPO",
    "CheckpointNotFoundError",
    "pose_encoding_to_extri_intri", "extri_intri_to_pose_encoding", "unproject_depth_map_to_point_map",
    "closed_form_inverse_se3", "confidence_mask", "predictions_to_numpy",
    "estimate_memory", "max_frames_that_fit", "LiveBytes",
]

# π³ and Pi3X (github.com/yyfz/Pi3): models/pi3.py, models/pi3x.py, docs/models_pi3.md
from .pi3 import PI3_LICENSE, PI3_REPO, Pi3, pi3_tiny_config  # noqa: E402
from .pi3x import PI3X_REPO, Pi3X, pi3x_tiny_config  # noqa: E402

__all__ += ["Pi3", "Pi3X", "pi3_tiny_config", "pi3x_tiny_config", "PI3_REPO", "PI3X_REPO", "PI3_LICENSE"]
