"""Checkpoint loading for VGGT: Hugging Face hub (cache, progress), local directory or file.

``facebook/VGGT-1B`` holds ``model.safetensors`` (preferred) and ``model.pt``
(loaded with ``torch.load(weights_only=True)`` only). Nothing here downloads at
import time; offline use fails fast with an error naming the repo id, the file,
the cache folder and how to pass a local checkpoint.
"""
from __future__ import annotations

import os

import torch

__all__ = ["WEIGHT_FILES", "resolve_checkpoint", "load_state_dict_file", "CheckpointNotFoundError"]

WEIGHT_FILES = ("model.safetensors", "model.pt")


class CheckpointNotFoundError(FileNotFoundError):
    """The checkpoint is neither local nor downloadable (offline, no cache, unknown repo)."""


def _offline_help(repo_id: str, cache: str, reason: str) -> str:
    return (f"could not get {WEIGHT_FILES[0]} (or {WEIGHT_FILES[1]}) of '{repo_id}' from the Hugging Face hub "
            f"({reason}). Hugging Face cache: {cache}. Fixes: download once with network access "
            f"(`huggingface-cli download {repo_id} {WEIGHT_FILES[0]}`) so the cache has it (then HF_HUB_OFFLINE=1 "
            f"works), or pass a local "
            f"checkpoint: VGGT.from_pretrained('/path/to/dir_with_model.safetensors') or "
            f"VGGT.from_pretrained('/path/to/model.safetensors' | '/path/to/model.pt').")


def resolve_checkpoint(name_or_path: str | os.PathLike, revision: str | None = None,
                       timeout_s: float = 10.0) -> str:
    """Local path of the checkpoint file for a hub repo id, a directory or a file.

    A directory must contain ``model.safetensors`` or ``model.pt``. A repo id is
    fetched with :func:`huggingface_hub.hf_hub_download` (cached, with a progress
    bar), safetensors first; ``HF_HUB_OFFLINE=1`` uses the cache only.

    Raises:
        CheckpointNotFoundError: nothing found locally and the hub is unreachable,
            offline or lacks the files -- the message names the fix.
    """
    path = os.fspath(name_or_path)
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        for f in WEIGHT_FILES:
            if os.path.isfile(os.path.join(path, f)):
                return os.path.join(path, f)
        raise CheckpointNotFoundError(f"directory {path!r} has neither of {WEIGHT_FILES}")
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise CheckpointNotFoundError(f"{path!r} is not an existing file or directory, nor a hub repo id "
                                      f"like 'facebook/VGGT-1B'")
    import huggingface_hub
    from huggingface_hub import constants, hf_hub_download

    cache = constants.HF_HUB_CACHE
    errors = []
    for f in WEIGHT_FILES:
        try:  # etag_timeout bounds the metadata request, so an unreachable hub fails in seconds
            return hf_hub_download(path, f, revision=revision, etag_timeout=timeout_s)
        except huggingface_hub.errors.EntryNotFoundError as e:  # repo exists, file does not: try the next
            errors.append(f"{f}: {type(e).__name__}")
        except Exception as e:  # offline / unreachable / gated / unknown repo: the next file fails alike
            msg = str(e).splitlines()[0] if str(e) else ""
            errors.append(f"{f}: {type(e).__name__}: {msg}")
            break
    raise CheckpointNotFoundError(_offline_help(path, cache, "; ".join(errors)))


def load_state_dict_file(path: str) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` or ``.pt`` / ``.pth`` / ``.bin`` state dict (torch.load with weights_only=True).

    A ``.pt`` holding ``{"model": state_dict}`` or ``{"state_dict": ...}`` is unwrapped.

    Raises:
        ValueError: unknown extension or not a state dict.
    """
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    if path.endswith((".pt", ".pth", ".bin")):
        sd = torch.load(path, map_location="cpu", weights_only=True)
        for key in ("model", "state_dict"):
            if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
                sd = sd[key]
        if not isinstance(sd, dict):
            raise ValueError(f"{path} does not hold a state dict (got {type(sd).__name__})")
        return sd
    raise ValueError(f"unknown checkpoint format {path!r}; expected .safetensors or .pt/.pth/.bin")
