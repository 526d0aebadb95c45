"""Tiny timm models (random weights) and the real photos, shared by the patching tests."""
import os

import timm
import torch
from PIL import Image

# Same folder as tests/conftest.py's PHOTOS (OpenCV sample photos, licence in tests/data).
PHOTOS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "photos")

# name -> (timm model, image size, constructor overrides): every supported family, CPU-sized.
TINY = {
    "vit": ("vit_tiny_patch16_224", 64, dict(depth=2)),
    "deit": ("deit_tiny_patch16_224", 64, dict(depth=2)),
    "eva": ("eva02_tiny_patch14_224", 56, dict(depth=2)),
    "rope": ("vit_pe_core_tiny_patch16_384", 64, dict(depth=2)),
    "swin": ("swin_tiny_patch4_window7_224", 56, dict(depths=(2, 2), num_heads=(3, 6), embed_dim=48,
                                                      window_size=7)),
    "swinv2": ("swinv2_tiny_window8_256", 64, dict(depths=(2, 2), num_heads=(3, 6), embed_dim=48,
                                                   window_size=8)),
}


def make_tiny(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A CPU-sized random-weight timm model of ``family`` in eval mode.

    LayerNorm weights are re-drawn around 1: timm initializes Swin-v2's post-norms to
    zero, which would make every attention branch a no-op and the comparison vacuous.
    """
    name, size, kw = TINY[family]
    if not timm.is_model(name):  # e.g. the PE (rope) models are newer than timm 1.0.17
        import pytest

        pytest.skip(f"{name} is not in timm {timm.__version__}")
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=10, img_size=size, **{**kw, **overrides})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.LayerNorm) and mod.weight is not None:
                mod.weight.copy_(1 + 0.2 * torch.randn(mod.weight.shape, generator=g))
                mod.bias.copy_(0.2 * torch.randn(mod.bias.shape, generator=g))
    return model.eval()


def image_size(family: str) -> int:
    return TINY[family][1]


_photo_cache: dict[int, torch.Tensor] = {}


def photos(size: int) -> torch.Tensor:
    """The 8 real photos of tests/data/photos as a normalized float32 batch [8, 3, size, size]."""
    if size not in _photo_cache:
        cfg = timm.data.resolve_data_config({"input_size": (3, size, size), "crop_pct": 1.0})
        tf = timm.data.create_transform(**cfg)
        files = sorted(f for f in os.listdir(PHOTOS) if f.lower().endswith((".jpg", ".png")))
        assert len(files) >= 8, f"expected the 8 test photos in {PHOTOS}"
        _photo_cache[size] = torch.stack([tf(Image.open(os.path.join(PHOTOS, f)).convert("RGB")) for f in files])
    return _photo_cache[size]


def redraw_linear(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every ``nn.Linear`` weight redrawn ~ N(0, 1/in_features), in place; returns ``model`` in eval mode. Libraries
    zero-initialise some projections (diffusers) or draw tiny weights: this gives O(1) attention logits, so
    the softmax is far from uniform and a wrong attention shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) / mod.in_features ** 0.5)
    return model.eval()

