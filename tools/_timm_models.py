"""timm models for the tools, in eval mode, from the hub, a local file or random weights.

Before a download, the weights are checked to be available (in the hub cache, or the hub host reachable): an offline
run fails at once, naming the ways around it, instead of in huggingface_hub's retry loop. Needs the [eval] extra.
"""
from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

import torch

__all__ = ["WeightsUnavailableError", "create_timm_model", "wake_zero_init_norms", "model_problem",
           "weights_problem"]


class WeightsUnavailableError(RuntimeError):
    """Pretrained weights cannot be had (offline, not cached); the message names the ways around it."""


def wake_zero_init_norms(model: torch.nn.Module) -> int:
    """Set every all-zero LayerNorm weight of a random-initialized model to 1; return how many.

    timm's Swin-v2 zero-initializes its res-post-norm weights: with random weights its attention would never reach
    the logits, and a patched-vs-native comparison could not fail. Pretrained models have no such norms."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm) and m.weight is not None
             and not m.weight.any()]
    with torch.no_grad():
        for m in norms:
            m.weight.fill_(1.0)
    return len(norms)


def create_timm_model(name: str, *, pretrained: bool = True, checkpoint: str | None = None,
                      img_size: int | None = None, **kwargs) -> torch.nn.Module:
    """``timm.create_model(name, img_size=img_size, **kwargs)`` in eval mode, with the weights of ``checkpoint`` (a
    local state dict; FileNotFoundError if missing), else timm's pretrained ones through the hub cache
    (:class:`WeightsUnavailableError` when they cannot be had), else (``pretrained=False``) random ones with
    :func:`wake_zero_init_norms`."""
    import timm

    if img_size is not None:
        kwargs["img_size"] = img_size
    if checkpoint is not None:
        if not os.path.isfile(checkpoint):
            raise FileNotFoundError(f"checkpoint={checkpoint!r} does not exist")
        return timm.create_model(name, pretrained=False, checkpoint_path=checkpoint, **kwargs).eval()
    if not pretrained:
        model = timm.create_model(name, pretrained=False, **kwargs).eval()
        wake_zero_init_norms(model)  # random weights: let every attention layer reach the logits
        return model
    problem = weights_problem(name)
    if problem:
        raise WeightsUnavailableError(problem)
    try:
        return timm.create_model(name, pretrained=True, **kwargs).eval()
    except (OSError, ValueError, RuntimeError) as e:  # hub errors derive from OSError / ValueError
        raise WeightsUnavailableError(
            f"cannot load pretrained weights for {name}: {type(e).__name__}: {e}; {_fix(name)}") from e


def _pretrained_cfg(name: str) -> dict:
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    return cfg.to_dict() if cfg is not None else {}


def _fix(name: str) -> str:
    repo = _pretrained_cfg(name).get("hf_hub_id") or name
    return (f"pass --checkpoint PATH (a .safetensors/.pth state dict for {name}), or a local hub cache: "
            f"HF_HOME=/path/to/cache (holding {repo}) with HF_HUB_OFFLINE=1, or "
            f"--random-weights for a speed / agreement-only run")


def weights_problem(name: str) -> str | None:
    """Why timm's pretrained weights of ``name`` cannot be had now (checked before any work), or None: they are in
    the hub cache, or the host they come from answers."""
    from huggingface_hub import constants, try_to_load_from_cache

    cfg = _pretrained_cfg(name)
    repo = cfg.get("hf_hub_id")
    files = [cfg["hf_hub_filename"]] if cfg.get("hf_hub_filename") else \
        ["model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin", "open_clip_model.safetensors"]
    if repo and any(isinstance(try_to_load_from_cache(repo, f), str) for f in files):
        return None
    if constants.HF_HUB_OFFLINE:
        return (f"pretrained weights for {name} are not in the hub cache ({constants.HF_HUB_CACHE}) and "
                f"HF_HUB_OFFLINE is set; {_fix(name)}")
    url = urlparse(constants.ENDPOINT if repo else cfg.get("url") or "")
    if not url.hostname:
        return None
    address = (url.hostname, url.port or (80 if url.scheme == "http" else 443))
    try:
        socket.create_connection(address, timeout=5.0).close()
    except OSError:
        return (f"cannot download pretrained weights for {name}: {address[0]}:{address[1]} is not reachable "
                f"(offline?) and they are not in the hub cache ({constants.HF_HUB_CACHE}); {_fix(name)}")
    return None


def model_problem(name: str, img_size: int | None = None, **kwargs) -> tuple[str, str] | None:
    """Why ``name`` cannot run here as asked, or None: ``(what, reason)``, ``what`` one of ``"name"`` (unknown to
    timm), ``"arguments"`` (the constructor refuses ``kwargs`` / ``img_size``) or ``"input"`` (the model cannot take
    ``img_size`` x ``img_size`` images). Builds the model and runs one forward on the meta device (no weights, no
    memory, no download)."""
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:5]
        return "name", (f"{name!r} is not a timm model" + (f"; similar names: {', '.join(close)}" if close else "")
                        + "; see timm.list_models()")
    if img_size is not None:
        kwargs["img_size"] = img_size
    what = "arguments"
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, **kwargs).eval()
            size = img_size or model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
            what = "input"
            model(torch.empty(1, 3, size, size))
    except Exception as e:  # any failure here is the model refusing these arguments
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if what == "input":
            return what, f"{name} cannot take {size}x{size} images: {type(e).__name__}: {first}"
        return what, f"{name} with {kwargs or 'its defaults'} cannot be built: {type(e).__name__}: {first}"
    return None
