"""Checkpoint loading for VGGT: Hugging Face hub (cache, progress), local directory or file.

``facebook/VGGT-1B`` holds ``model.safetensors`` (preferred) and ``model.pt``
(loaded with ``torch.load(weights_only=True)`` only); its weights are for
non-commercial use (:data:`VGGT_1B_LICENSE`). Nothing here downloads at import
time. :func:`hub_file` is the one loading strategy (cache first, then one online
attempt with a short timeout); offline it fails in seconds with an error naming
the repo id, the file, the cache folder and how to pass a local checkpoint.
"""
from __future__ import annotations

import logging
import os
import socket

import torch

__all__ = ["WEIGHT_FILES", "VGGT_1B_LICENSE", "hub_file", "resolve_checkpoint", "load_state_dict_file",
           "CheckpointNotFoundError"]

WEIGHT_FILES = ("model.safetensors", "model.pt")


VGGT_1B_LICENSE = ("the facebook/VGGT-1B weights are licensed for non-commercial use only (the licence terms are on "
                   "the model card, https://huggingface.co/facebook/VGGT-1B); facebook/VGGT-1B-Commercial is the gated "
                   "variant for commercial use")
"""Licence note printed (logged) whenever VGGT-1B weights are downloaded."""

_log = logging.getLogger(__name__)


class CheckpointNotFoundError(FileNotFoundError):
    """The checkpoint is neither local nor downloadable (offline, no cache, unknown repo)."""


def _offline_help(repo_id: str, cache: str, reason: str, files=WEIGHT_FILES) -> str:
    return (f"could not get {' or '.join(files)} of '{repo_id}' from the Hugging Face hub "
            f"({reason}). Hugging Face cache: {cache}. Fixes: download once with network access "
            f"(`hf download {repo_id} {files[0]}`, or `huggingface-cli download ...`) so the cache has it (then "
            f"HF_HUB_OFFLINE=1 works), or pass a local "
            f"checkpoint: VGGT.from_pretrained('/path/to/dir_with_model.safetensors') or "
            f"VGGT.from_pretrained('/path/to/model.safetensors' | '/path/to/model.pt').")


def _hub_unreachable(timeout_s: float) -> str | None:
    """None when one TCP connection to the hub endpoint (or the HTTPS proxy) opens within ``timeout_s``, else why.

    huggingface_hub retries an unreachable host 5 times with backoff (~25 s per file);
    this single connect decides in at most ``timeout_s``.
    """
    from urllib.parse import urlparse
    from urllib.request import getproxies, proxy_bypass

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    proxy = getproxies().get(url.scheme)
    if proxy and not proxy_bypass(host):
        p = urlparse(proxy if "://" in proxy else "http://" + proxy)
        host, port = p.hostname, p.port or 80
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return None
    except OSError as e:
        return f"cannot reach {host}:{port} ({e})"


def hub_file(repo_id: str, filenames=WEIGHT_FILES, *, revision: str | None = None, cache_dir=None,
             token: str | bool | None = None, local_files_only: bool = False, force_download: bool = False,
             timeout_s: float = 5.0) -> str:
    """Local path of the first of ``filenames`` in a hub repo: the cache first, then one online attempt.

    The loading strategy every hub user of the project shares:

    1. the local cache (``hf_hub_download(local_files_only=True)``): no network at all;
    2. unless ``local_files_only`` or ``HF_HUB_OFFLINE=1``: ONE online attempt -- a single TCP
       connect to the endpoint (``timeout_s``), then ``hf_hub_download`` per file, moving on to
       the next file only when the hub answers that the file does not exist. huggingface_hub's
       ``LocalEntryNotFoundError`` (a subclass of ``EntryNotFoundError``) means "offline and not
       cached", not "file missing": it ends the attempt instead of trying the next file.

    Args:
        repo_id: ``owner/name``.
        filenames: candidate files in order of preference.
        revision, cache_dir, token, force_download: as :func:`huggingface_hub.hf_hub_download`.
        local_files_only: the cache only.
        timeout_s: connect timeout and metadata (etag) timeout, seconds.

    Returns:
        the cached file's path.

    Raises:
        CheckpointNotFoundError: not cached and not downloadable (offline, unreachable, no such
            repo / revision / file, gated without access); the message names the cache folder and the fix.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    filenames = tuple(filenames)
    cache = os.fspath(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    kw = dict(revision=revision, cache_dir=cache_dir, token=token)
    if not force_download:
        for f in filenames:
            try:
                return hf_hub_download(repo_id, f, local_files_only=True, **kw)
            except (LocalEntryNotFoundError, EntryNotFoundError, OSError, ValueError):
                continue  # not in the cache (or the id is not valid for the cache): the network may have it
    if local_files_only or constants.HF_HUB_OFFLINE:
        why = "local_files_only=True" if local_files_only else "HF_HUB_OFFLINE is set"
        raise CheckpointNotFoundError(_offline_help(repo_id, cache, f"not in the cache and {why}", filenames))
    reason = _hub_unreachable(timeout_s)
    if reason is not None:
        raise CheckpointNotFoundError(_offline_help(repo_id, cache, reason, filenames))
    errors = []
    for f in filenames:
        try:
            return hf_hub_download(repo_id, f, etag_timeout=timeout_s, force_download=force_download, **kw)
        except LocalEntryNotFoundError as e:  # offline / connection lost: no other file will come either
            errors.append(f"{f}: {type(e).__name__}: {_first_line(e)}")
            break
        except EntryNotFoundError as e:  # the hub answered: this file does not exist; try the next one
            errors.append(f"{f}: {type(e).__name__}")
        except Exception as e:  # unknown repo / revision, gated, HTTP errors: the next file fails alike
            errors.append(f"{f}: {type(e).__name__}: {_first_line(e)}")
            break
    raise CheckpointNotFoundError(_offline_help(repo_id, cache, "; ".join(errors), filenames))


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def resolve_checkpoint(name_or_path: str | os.PathLike, revision: str | None = None, timeout_s: float = 5.0, *,
                       cache_dir=None, token=None, local_files_only: bool = False,
                       force_download: bool = False) -> str:
    """Local path of the checkpoint file for a hub repo id, a directory or a file.

    A directory must contain ``model.safetensors`` or ``model.pt``. A repo id goes
    through :func:`hub_file` (cache first, then one online attempt; safetensors
    preferred). Downloading VGGT-1B logs its licence (:data:`VGGT_1B_LICENSE`).

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
    if path.lower().startswith("facebook/vggt-1b") and "commercial" not in path.lower():
        _log.warning("VGGT-1B: %s.", VGGT_1B_LICENSE)
    return hub_file(path, WEIGHT_FILES, revision=revision, cache_dir=cache_dir, token=token,
                    local_files_only=local_files_only, force_download=force_download, timeout_s=timeout_s)


def load_state_dict_file(path: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` or ``.pt`` / ``.pth`` / ``.bin`` state dict (torch.load with weights_only=True).

    The tensors are created on ``device``: safetensors copies each one from the file straight to it (no host
    copy of the whole checkpoint first); a ``.pt`` is read with ``map_location=device``. A ``.pt`` holding
    ``{"model": state_dict}`` or ``{"state_dict": ...}`` is unwrapped. On the CPU every tensor owns its memory:
    safetensors hands back views of its memory map of the file, which a model loaded with ``assign=True`` would
    keep as its parameters (sharing storage with the file: a write to it in place changes them, a truncation
    faults them) at the file's byte offsets rather than the allocator's 64-byte alignment (CPU matrix products
    then take other code paths, whose sums differ in the last bits).

    Raises:
        ValueError: unknown extension or not a state dict.
    """
    device = torch.device(device)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(path, device=str(device))
        return {name: t.clone() for name, t in sd.items()} if device.type == "cpu" else sd
    if path.endswith((".pt", ".pth", ".bin")):
        sd = torch.load(path, map_location=device, weights_only=True)
        for key in ("model", "state_dict"):
            if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
                sd = sd[key]
        if not isinstance(sd, dict):
            raise ValueError(f"{path} does not hold a state dict (got {type(sd).__name__})")
        return sd
    raise ValueError(f"unknown checkpoint format {path!r}; expected .safetensors or .pt/.pth/.bin")


def save_checkpoint_folder(module: torch.nn.Module, directory: str | os.PathLike, config: dict) -> str:
    """Write ``module``'s weights as ``model.safetensors`` and ``config`` as ``config.json`` into ``directory``
    (created if missing), each through a temporary file renamed into place, so an interrupted save never leaves
    a partial file under either name. Returns the weights path; ``from_pretrained`` reads the folder back."""
    import json
    import tempfile

    from safetensors.torch import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    target = os.path.join(directory, WEIGHT_FILES[0])
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    os.close(fd)
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, target)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=1)
    os.replace(tmp, os.path.join(directory, "config.json"))
    return target
