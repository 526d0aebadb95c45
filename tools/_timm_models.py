"""timm models for the tools: created in eval mode from the hub, a local file, or random weights.

Before a download, :func:`create_timm_model` checks that the weights can be had (in the hub
cache, or the hub host reachable) and otherwise fails at once with the ways around it,
instead of a long retry loop deep inside huggingface_hub. Needs the ``[eval]`` extra (timm,
huggingface_hub).
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



def _hub_address(pretrained_cfg: dict) -> tuple[str, int] | None:
    """(host, port) the weights of ``pretrained_cfg`` would be downloaded from, None if it names no source."""
    if pretrained_cfg.get("hf_hub_id"):
        from huggingface_hub import constants
        url = urlparse(constants.ENDPOINT)
    elif pretrained_cfg.get("url"):
        url = urlparse(pretrained_cfg["url"])
    else:
        return None
    return url.hostname, url.port or (80 if url.scheme == "http" else 443)


def _reachable(address: tuple[str, int], timeout: float = 5.0) -> bool:
    try:
        socket.create_connection(address, timeout=timeout).close()
        return True
    except OSError:
        return False


def _weights_cached(pretrained_cfg: dict) -> bool:
    repo = pretrained_cfg.get("hf_hub_id")
    if not repo:
        return False
    from huggingface_hub import try_to_load_from_cache

    names = [pretrained_cfg.get("hf_hub_filename")] if pretrained_cfg.get("hf_hub_filename") else \
        ["model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin", "open_clip_model.safetensors"]
    return any(isinstance(try_to_load_from_cache(repo, n), str) for n in names)


def wake_zero_init_norms(model: torch.nn.Module) -> int:
    """Set every all-zero LayerNorm weight of a random-initialized model to 1; return how many.

    timm's Swin-v2 zero-initializes its res-post-norm weights (so each block starts as the
    identity): with random weights its attention then never reaches the logits, and a
    patched-vs-native comparison could not fail. Pretrained models have no such norms.
    """
    woken = 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.weight is not None and not m.weight.any():
                m.weight.fill_(1.0)
                woken += 1
    return woken


def create_timm_model(name: str, *, pretrained: bool = True, checkpoint: str | None = None,
                      img_size: int | None = None, **kwargs) -> torch.nn.Module:
    """``timm.create_model`` in eval mode, with weights from the hub (default), a local file, or none.

    Args:
        name: timm model name (``vit_base_patch16_224``, ``swin_tiny_patch4_window7_224`` ...).
        pretrained: download / load timm's pretrained weights through huggingface_hub (cached).
        checkpoint: local ``.safetensors`` / ``.pth`` with the model's state dict (overrides ``pretrained``).
        img_size: passed to the model constructor when given.
        **kwargs: further constructor arguments (e.g. ``depth=2`` for tiny test models).

    Raises:
        FileNotFoundError: ``checkpoint`` does not exist.
        WeightsUnavailableError: (a RuntimeError) pretrained weights cannot be had (no network, no local
            cache); the message names ``--checkpoint``, ``HF_HUB_OFFLINE=1`` with ``HF_HOME`` and ``--random-weights``.
    """
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


def _fix(name: str) -> str:
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    repo = (cfg.to_dict() if cfg is not None else {}).get("hf_hub_id") or name
    return (f"pass --checkpoint PATH (a .safetensors/.pth state dict for {name}), or a local hub cache: "
            f"HF_HOME=/path/to/cache (holding {repo}) with HF_HUB_OFFLINE=1, or "
            f"--random-weights for a speed / agreement-only run")


def weights_problem(name: str) -> str | None:
    """Why timm's pretrained weights of ``name`` cannot be had now, or None (cached, or the host answers).

    Checked before any work, so an offline run fails at once instead of after other models ran.
    """
    import timm
    from huggingface_hub import constants

    cfg = timm.models.get_pretrained_cfg(name)
    cfg = cfg.to_dict() if cfg is not None else {}
    if _weights_cached(cfg):
        return None
    if constants.HF_HUB_OFFLINE:
        return (f"pretrained weights for {name} are not in the hub cache ({constants.HF_HUB_CACHE}) and "
                f"HF_HUB_OFFLINE is set; {_fix(name)}")
    address = _hub_address(cfg)
    if address is not None and not _reachable(address):
        return (f"cannot download pretrained weights for {name}: {address[0]}:{address[1]} is not reachable "
                f"(offline?) and they are not in the hub cache ({constants.HF_HUB_CACHE}); {_fix(name)}")
    return None


def model_problem(name: str, img_size: int | None = None, **kwargs) -> tuple[str, str] | None:
    """Why ``name`` cannot run here as asked, or None: ``(what, reason)`` with ``what`` one of ``"name"``
    (unknown to timm), ``"arguments"`` (the constructor refuses ``kwargs`` / ``img_size``) or
    ``"input"`` (the model cannot take ``img_size`` x ``img_size`` images). Builds the model and runs
    one forward on the meta device: no weights, no memory, no download.
    """
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
