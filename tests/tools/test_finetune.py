"""tools/finetune.py on CPU: a tiny ViT fine-tuned on the bundled photos (two classes), its checkpoint
reloading bit-exactly, the held-out split, the precision of each mode and the argument checks."""
import json
import os
import shutil

import pytest
import torch

from testdata import PHOTOS, load_script

PHOTO_FILES = sorted(f for f in os.listdir(PHOTOS) if f.lower().endswith(".jpg"))
TINY = ["--model", "vit_tiny_patch16_224", "--model-kwargs", '{"depth": 2}', "--img-size", "32", "--device", "cpu",
        "--workers", "0", "--batch-size", "4"]


tool = load_script("tools/finetune.py")


def _image_folder(root, layout=None):
    """The 8 photos as an ImageFolder of 2 classes (4 each): ``root/{a,b}``, or ``root/<split>/{a,b}`` with photo i
    in ``layout[i % len(layout)]``."""
    for i, name in enumerate(PHOTO_FILES):
        split = "" if layout is None else layout[i % len(layout)]
        folder = os.path.join(root, split, "ab"[i // 4])
        os.makedirs(folder, exist_ok=True)
        shutil.copy(os.path.join(PHOTOS, name), folder)
    return str(root)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    data = _image_folder(root / "data")
    res = tool.main(["--data", data, *TINY, "--epochs", "2", "--lr", "1e-3", "--out", str(root / "out")])
    return res, root / "out", data


def test_tiny_vit_trains_evaluates_and_writes_everything(trained):
    res, out, _ = trained
    assert sorted(os.listdir(out)) == [".visionattn-finetune.json", "best.safetensors", "curves.png",
                                       "last.safetensors", "metrics.json", "metrics.md"]  # the manifest lists the rest
    manifest = json.loads((out / ".visionattn-finetune.json").read_text())
    assert manifest["tool"] == "visionattn.finetune" and sorted(manifest["files"]) == sorted(os.listdir(out))[1:]
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["history"] == json.loads(json.dumps(res["history"]))
    assert saved["data"]["classes"] == ["a", "b"] and (saved["data"]["train"], saved["data"]["val"]) == (6, 2)
    assert [h["epoch"] for h in saved["history"]] == [1, 2]
    assert len(saved["step_losses"]) == 4  # 6 training images, batch 4: 2 steps per epoch
    assert all(torch.isfinite(torch.tensor(saved["step_losses"])))
    assert saved["model"]["attention"].startswith("visionattn (2 modules patched)")
    assert saved["process_settings"] == {"torch.backends.cuda.matmul.allow_tf32": False,
                                         "torch.backends.cudnn.allow_tf32": False}
    assert "| 2 | 4 |" in (out / "metrics.md").read_text()
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_reloads_bit_exactly(trained, tmp_path):
    """The last checkpoint, loaded into a fresh model, gives the recorded held-out loss to the bit, and a
    save / load round trip keeps every tensor bit for bit; training moved the weights off their init."""
    from safetensors.torch import load_file
    import visionattn as va

    res, out, data = trained
    from _timm_models import create_timm_model

    torch.manual_seed(0)
    model = create_timm_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=2, depth=2)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    meta = tool.load_checkpoint(model, str(out / "last.safetensors"))
    assert json.loads(meta["classes"]) == ["a", "b"] and meta["mode"] == "fp32" and meta["epoch"] == "2"
    assert any(not torch.equal(init[k], v) for k, v in model.state_dict().items())
    va.patch_model(model, "fp32")
    split = tool.scan_folder(data, 0.2, 0)
    _, val, _ = tool.datasets(split, model, 32)
    ev = tool.evaluate(model, torch.utils.data.DataLoader(val, batch_size=4), tool.precision("fp32"), "cpu")
    assert ev["loss"] == res["history"][-1]["val_loss"] and ev["top1"] == res["history"][-1]["val_top1"]
    tool.save_checkpoint(model, str(tmp_path / "again.safetensors"))
    first, again = load_file(str(out / "last.safetensors")), load_file(str(tmp_path / "again.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_held_out_split_per_class_and_train_val_layout(tmp_path):
    flat = _image_folder(tmp_path / "flat")
    split = tool.scan_folder(flat, 0.25, 0)
    assert [lbl for _, lbl in split["val"]] == [0, 1] and len(split["train"]) == 6
    assert not {p for p, _ in split["val"]} & {p for p, _ in split["train"]}
    assert tool.scan_folder(flat, 0.25, 0) == split  # seeded
    layout = tool.scan_folder(_image_folder(tmp_path / "tv", layout=["train", "train", "train", "val"]), 0.2, 0)
    assert layout["layout"] == "train/ and val/" and (len(layout["train"]), len(layout["val"])) == (6, 2)


def test_precision_per_mode():
    assert tool.precision("fp32") == tool.Precision("fp32", None, False, False)
    assert tool.precision("tf32").tf32 and not tool.precision("bf16").scaler
    assert tool.precision("fp16") == tool.Precision("fp16", torch.float16, False, True)
    with pytest.raises(ValueError, match="forward-only"):
        tool.precision("pasa")
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with tool.tf32_flags(tool.precision("tf32").tf32) as flags:
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 and all(flags.values())
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return _image_folder(tmp_path_factory.mktemp("args") / "data")


@pytest.mark.parametrize("bad, flag", [
    (["--mode", "pasa"], "--mode"),
    (["--epochs", "0"], "--epochs"),
    (["--lr", "-1"], "--lr"),
    (["--val-fraction", "1.5"], "--val-fraction"),
    (["--model", "vit_no_such_model"], "--model"),
    (["--img-size", "3"], "--img-size"),
    (["--model-kwargs", "[2]"], "--model-kwargs"),
    (["--device", "nope"], "--device"),
])
def test_bad_arguments_exit_2_with_one_line(bad, flag, data_root, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--data", data_root, *TINY, *bad, "--out", str(tmp_path / "new")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
    assert not (tmp_path / "new").exists()


def test_bad_data_folder_exits_2(tmp_path, capsys):
    one_class = tmp_path / "one"
    (one_class / "a").mkdir(parents=True)
    shutil.copy(os.path.join(PHOTOS, PHOTO_FILES[0]), one_class / "a")
    for data, words in ((tmp_path / "missing", "not a folder"), (one_class, "at least 2"), (PHOTOS, "--data")):
        with pytest.raises(SystemExit) as e:
            tool.main(["--data", str(data), *TINY, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and words in err[0], err


def test_pretrained_offline_fails_at_once_naming_the_fix(data_root, tmp_path, capsys, monkeypatch):
    import time
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        tool.main(["--data", data_root, *TINY, "--pretrained", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "--pretrained" in err[0] and "HF_HUB_OFFLINE" in err[0] and "leave out --pretrained" in err[0]
    assert time.perf_counter() - t0 < 10
