"""CPU tests of hub loading: offline failure speed and message, save_pretrained / from_pretrained round trip."""
import os
import subprocess
import sys

import pytest
import torch

from visionattn.models import VGGT, vggt_tiny_config
from visionattn.models.hub import CheckpointNotFoundError

_PROBE = ("import time; t = time.time()\n"
          "from visionattn.models import VGGT\n"
          "try:\n    VGGT.from_pretrained('facebook/VGGT-1B'{kw})\n"
          "except Exception as e:\n    print(type(e).__name__, '|', e, '|', round(time.time() - t, 1))\n")


def _probe(tmp_path, kw=""):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HTTPS_PROXY="", https_proxy="")
    res = subprocess.run([sys.executable, "-c", _PROBE.format(kw=kw)], env=env, capture_output=True, text=True,
                         timeout=120)
    return res.stdout, res.stderr


def test_no_network_no_cache_fails_fast_with_the_fix(tmp_path):
    """HF_HUB_OFFLINE unset, empty cache, no network: one connect attempt, not huggingface_hub's retries."""
    out, err = _probe(tmp_path)
    assert out.startswith("CheckpointNotFoundError"), out + err
    assert "facebook/VGGT-1B" in out and "model.safetensors" in out
    assert str(tmp_path / "hf") in out  # the cache folder
    assert "from_pretrained('/path/to" in out and "HF_HUB_OFFLINE=1" in out  # the fixes
    assert float(out.rsplit("|", 1)[1]) < 10
    assert "non-commercial" in err  # the licence note where weights would be downloaded


def test_local_files_only_does_not_touch_the_network(tmp_path):
    out, err = _probe(tmp_path, ", local_files_only=True")
    assert out.startswith("CheckpointNotFoundError") and "local_files_only=True" in out, out + err
    assert float(out.rsplit("|", 1)[1]) < 10


def test_cache_is_used_before_the_network(tmp_path, monkeypatch):
    """A cached file is returned by the cache lookup; the hub is never contacted."""
    import visionattn.models.hub as hub

    monkeypatch.setattr(hub, "_hub_unreachable", lambda t: pytest.fail("network touched"))
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, local_files_only=False, **kw):
        calls.append((filename, local_files_only))
        if filename == "model.pt":
            return "/cache/model.pt"
        raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert hub.hub_file("facebook/VGGT-1B") == "/cache/model.pt"
    assert calls == [("model.safetensors", True), ("model.pt", True)]


def test_offline_entry_error_is_not_taken_for_a_missing_file(monkeypatch):
    """LocalEntryNotFoundError (a subclass of EntryNotFoundError) ends the online attempt at once."""
    import huggingface_hub

    import visionattn.models.hub as hub

    monkeypatch.setattr(hub, "_hub_unreachable", lambda t: None)
    online = []

    def fake_download(repo_id, filename, local_files_only=False, **kw):
        if not local_files_only:
            online.append(filename)
        raise huggingface_hub.errors.LocalEntryNotFoundError("connection lost")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    with pytest.raises(CheckpointNotFoundError, match="connection lost"):
        hub.hub_file("facebook/VGGT-1B")
    assert online == ["model.safetensors"]


def test_save_pretrained_round_trip_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = VGGT(**vggt_tiny_config(), heads_dtype="bf16", frames_chunk_size=4).eval()
    path = model.save_pretrained(tmp_path / "tiny", config={"note_for_readers": 1})
    assert os.path.basename(path) == "model.safetensors"
    loaded = VGGT.from_pretrained(tmp_path / "tiny", local_files_only=True)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert loaded.config == model.config and loaded.heads_dtype == "bf16"
    assert not any(p.is_meta for p in loaded.parameters())
    x = torch.rand(2, 3, 28, 42)
    with torch.no_grad():
        a, b = model(x), loaded(x)
    assert all(torch.equal(a[k], b[k]) for k in ("pose_enc", "depth", "world_points"))
    assert VGGT.from_pretrained(tmp_path / "tiny", attn_mode=None).attn_mode is None  # kwargs win


def test_loaded_cpu_weights_own_their_memory(tmp_path):
    """A model loaded on the CPU shares no storage with its checkpoint file: the file written over in place (or
    truncated) afterwards leaves the parameters as loaded, and each parameter sits at the allocator's 64-byte
    alignment, not at the file's byte offset (safetensors hands back views of its memory map)."""
    torch.manual_seed(0)
    model = VGGT(**vggt_tiny_config()).eval()
    path = model.save_pretrained(tmp_path / "tiny")
    loaded = VGGT.from_pretrained(tmp_path / "tiny", local_files_only=True)
    assert all(p.data_ptr() % 64 == 0 for p in loaded.parameters())
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # another writer reuses the file in place
        f.write(b"\x00" * size)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    with open(path, "wb"):  # truncated: a mapped parameter would fault on its next read
        pass
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
