"""tools/eval_imagenet.py (with its ImageNet data helpers) and tools/_timm_models.py: layouts, label
mapping, per-mode evaluation, argument checks.

References: timm's own ImageNetInfo (class order), the unpatched timm model (native), and a checkpoint
whose head has known biases (so the expected top-1 / top-5 follow from the folder sizes alone).
"""
import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import save_file
from timm.data import ImageNetInfo

from testdata import PHOTOS, load_script

SYNSETS = ImageNetInfo("imagenet-1k").label_names()
PHOTO_FILES = sorted(f for f in os.listdir(PHOTOS) if f.lower().endswith(".jpg"))
# 8 photos into 4 real synset folders of sizes 3, 2, 2, 1 (class indices spread over timm's order)
FOLDERS = {SYNSETS[812]: PHOTO_FILES[0:3], SYNSETS[7]: PHOTO_FILES[3:5], SYNSETS[500]: PHOTO_FILES[5:7],
           SYNSETS[999]: PHOTO_FILES[7:8]}
TINY = ["--model", "vit_tiny_patch16_224", "--model-kwargs", '{"depth": 2}', "--img-size", "32",
        "--batch-size", "3"]
ALL_MODES = ["native", "fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa", "native-fp16", "native-bf16"]


tool = load_script("tools/eval_imagenet.py")
imagenet = tool  # the ImageNet layouts, labels and synthetic crops live in the tool
import _timm_models as timm_models  # noqa: E402  (tools/ is on sys.path once the tool is loaded)


@pytest.fixture(scope="module")
def imagefolder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagefolder")
    for synset, files in FOLDERS.items():
        os.makedirs(root / synset)
        for f in files:
            shutil.copy(os.path.join(PHOTOS, f), root / synset / f)
    return str(root)


def _flat_val(root):
    """Copies of the photos named ILSVRC2012_val_0000000{1..8}.JPEG in ``root``; returns {stem: synset}."""
    os.makedirs(root, exist_ok=True)
    truth = {}
    i = 0
    for synset, files in FOLDERS.items():
        for f in files:
            i += 1
            stem = f"ILSVRC2012_val_{i:08d}"
            shutil.copy(os.path.join(PHOTOS, f), os.path.join(root, stem + ".JPEG"))
            truth[stem] = synset
    return truth


def _write_loc_csv(path, truth, extra=3):
    rows = [(stem, f"{s} 10 20 110 120 {s} 5 5 50 50") for stem, s in truth.items()]
    rows += [(f"ILSVRC2012_val_{9000 + j:08d}", f"{SYNSETS[j]} 1 2 3 4") for j in range(extra)]
    random.Random(0).shuffle(rows)
    with open(path, "w") as f:
        f.write("ImageId,PredictionString\n" + "".join(f"{a},{b}\n" for a, b in rows))


@pytest.fixture(scope="module")
def biased_checkpoint(tmp_path_factory):
    """Tiny ViT whose head ignores the image: logits = bias, ranked 812 > 999 > 3 > 4 > 5 > everything else.

    Expected on the 8-photo ImageFolder: top-1 = 3/8 (folder of class 812), top-5 = 4/8 (+ class 999).
    """
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, pretrained=False)
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
        for rank, cls in enumerate([812, 999, 3, 4, 5]):
            model.head.bias[cls] = 10.0 - rank
    path = tmp_path_factory.mktemp("ckpt") / "biased.safetensors"
    save_file(model.state_dict(), str(path))
    return str(path)


def test_model_synsets_follow_timm():
    import timm

    m = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1, pretrained=False)
    assert imagenet.model_synsets(m) == SYNSETS
    with pytest.raises(ValueError, match="num_classes=10"):
        imagenet.model_synsets(timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1, num_classes=10))


def test_every_mode_on_imagefolder(imagefolder, tmp_path):
    out = tmp_path / "res.json"
    res = tool.main(TINY + ["--random-weights", "--data", imagefolder, "--workers", "0", "--out", str(out)])
    assert [r["mode"] for r in res["results"]] == ALL_MODES
    assert res["data"]["layout"] == "imagefolder" and res["data"]["images"] == 8
    by = {r["mode"]: r for r in res["results"]}
    for mode in ("fp32", "fp32-ieee"):
        assert by[mode]["agree_native"] == 1.0
    for r in res["results"]:
        assert r["images"] == 8 and r["nonfinite_logits"] == 0 and r["img_per_s"] > 0
        assert r["timing"] == ("cuda-events" if torch.cuda.is_available() else "wall")
        native_like = r["mode"] == "native" or r["mode"] in tool.NATIVE_HALF_MODES
        assert r["patched_modules"] == (0 if native_like else 2)  # depth 2: every attention patched
    # native-bf16 is timm's own SDPA on bf16-cast q/k/v: every attention call was cast, and the logits moved
    assert by["native-bf16"]["sdpa_calls_cast"] > 0 and by["native-bf16"]["max_abs_logit_diff"] > 0
    # patching took effect: bf16 attention (8-bit mantissa) cannot reproduce FP32 logits bit for bit
    assert by["bf16"]["max_abs_logit_diff"] > 0
    assert by["fp32"]["max_abs_logit_diff"] < by["bf16"]["max_abs_logit_diff"]
    # process-wide flags are stated and restored
    assert res["process_options"]["torch.backends.cuda.matmul.allow_tf32"] is False
    on_disk = json.loads(out.read_text())
    assert [r["top1"] for r in on_disk["results"]] == [r["top1"] for r in res["results"]]
    md = (tmp_path / "res.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| mode")]
    assert [ln.split("|")[1].strip() for ln in rows] == ALL_MODES
    assert "allow_tf32=False" in md and "* command: `python tools/eval_imagenet.py " in md
    assert "made no `scaled_dot_product_attention` call" not in md  # ViT's attention is SDPA: cast


def test_native_half_rows_of_an_eager_attention_model_are_flagged(tmp_path):
    """timm's Swin-v2 never calls SDPA: its native-fp16 / native-bf16 rows are the FP32 model again,
    and the markdown says so instead of presenting them as a half-precision reference."""
    kw = '{"window_size": 4, "embed_dim": 24, "depths": [1, 1], "num_heads": [2, 2]}'
    out = tmp_path / "v2.json"
    res = tool.main(["--model", "swinv2_tiny_window8_256", "--model-kwargs", kw, "--img-size", "64",
                     "--batch-size", "2", "--random-weights", "--synthetic-from", PHOTOS, "--limit", "4",
                     "--workers", "0", "--modes", "native,native-bf16", "--out", str(out)])
    by = {r["mode"]: r for r in res["results"]}
    assert by["native-bf16"]["sdpa_calls_cast"] == 0 and by["native-bf16"]["max_abs_logit_diff"] == 0
    assert "native-bf16: the model made no `scaled_dot_product_attention` call" in (tmp_path / "v2.md").read_text()


def test_checkpoint_labels_in_timm_order(imagefolder, biased_checkpoint, tmp_path):
    res = tool.main(TINY + ["--checkpoint", biased_checkpoint, "--data", imagefolder, "--workers", "0",
                            "--modes", "native,fp32", "--out", str(tmp_path / "r.json")])
    for r in res["results"]:
        assert r["top1"] == pytest.approx(3 / 8) and r["top5"] == pytest.approx(4 / 8)
    assert "checkpoint" in res["models"]["vit_tiny_patch16_224"]["weights"]


def test_flat_loc_csv(tmp_path, biased_checkpoint):
    truth = _flat_val(tmp_path / "val")
    _write_loc_csv(tmp_path / imagenet.LOC_CSV_NAME, truth)  # in the parent of val/, found automatically
    split = imagenet.scan_imagenet(str(tmp_path))  # DIR holding val/
    assert split.layout == "flat-loc-csv"
    assert {os.path.basename(p)[:-5]: s for p, s in split.samples} == truth
    assert split.notes  # the csv labels 3 images that are not present
    res = tool.main(TINY + ["--checkpoint", biased_checkpoint, "--data", str(tmp_path / "val"), "--workers", "0",
                            "--modes", "native", "--out", str(tmp_path / "r.json")])
    assert res["results"][0]["top1"] == pytest.approx(3 / 8)


def test_flat_devkit_ground_truth(tmp_path):
    truth = _flat_val(tmp_path / "val")
    # ILSVRC2012_IDs are not timm's sorted order: use a shuffled synset list as the devkit's id order
    order = list(SYNSETS)
    random.Random(1).shuffle(order)
    (tmp_path / "synsets_by_id.txt").write_text("".join(f"{s} some words\n" for s in order))
    gt = tmp_path / imagenet.DEVKIT_GT_NAME
    gt.write_text("".join(f"{order.index(truth[stem]) + 1}\n" for stem in sorted(truth)))
    split = imagenet.scan_imagenet(str(tmp_path / "val"), labels_file=str(gt),
                                   devkit_synsets=str(tmp_path / "synsets_by_id.txt"))
    assert split.layout == "flat-devkit"
    assert {os.path.basename(p)[:-5]: s for p, s in split.samples} == truth
    with pytest.raises(imagenet.DatasetLayoutError, match="meta.mat"):
        imagenet.scan_imagenet(str(tmp_path / "val"))  # found the file, but no meta.mat / synset list


def test_flat_devkit_meta_mat(tmp_path):
    sio = pytest.importorskip("scipy.io")
    import numpy as np

    truth = _flat_val(tmp_path / "val")
    data = tmp_path / "ILSVRC2012_devkit_t12" / "data"
    os.makedirs(data)
    order = list(SYNSETS)
    random.Random(2).shuffle(order)
    rec = np.zeros(len(order), dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")])
    for i, s in enumerate(order):
        rec[i] = (i + 1, s, 0)
    sio.savemat(str(data / "meta.mat"), {"synsets": rec})
    (data / imagenet.DEVKIT_GT_NAME).write_text("".join(f"{order.index(truth[s]) + 1}\n" for s in sorted(truth)))
    split = imagenet.scan_imagenet(str(tmp_path))  # finds val/ and the devkit under DIR
    assert split.layout == "flat-devkit"
    assert {os.path.basename(p)[:-5]: s for p, s in split.samples} == truth


def test_wrong_layouts_name_found_and_expected(tmp_path, imagefolder):
    err = imagenet.DatasetLayoutError
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(err, match=r"0 sub-folder.*0 image file.*expected one of: \(a\) ImageFolder"):
        imagenet.scan_imagenet(str(empty))
    with pytest.raises(err, match="does not exist"):
        imagenet.scan_imagenet(str(tmp_path / "nope"))
    wrong = tmp_path / "wrong"
    for d in ("cats", "dogs"):
        os.makedirs(wrong / d)
        shutil.copy(os.path.join(PHOTOS, PHOTO_FILES[0]), wrong / d / "a.jpg")
    with pytest.raises(err, match=r"2 sub-folder\(s\) \('cats', 'dogs'\).*ImageFolder: one folder per WordNet"):
        imagenet.scan_imagenet(str(wrong))
    os.makedirs(wrong / SYNSETS[0])
    with pytest.raises(err, match=r"mixed layout.*non-synset folders \('cats', 'dogs'\)"):
        imagenet.scan_imagenet(str(wrong))
    flat = tmp_path / "flat"
    truth = _flat_val(flat)
    with pytest.raises(err, match=r"without a labels file.*8 image file\(s\).*LOC_val_solution.csv"):
        imagenet.scan_imagenet(str(flat))
    missing = dict(truth)
    missing.pop("ILSVRC2012_val_00000004")
    _write_loc_csv(tmp_path / "partial.csv", missing, extra=0)
    with pytest.raises(err, match=r"1 of 8 images.*'ILSVRC2012_val_00000004.JPEG'"):
        imagenet.scan_imagenet(str(flat), labels_file=str(tmp_path / "partial.csv"))
    (tmp_path / "bad.csv").write_text("name,label\nx,y\n")
    with pytest.raises(err, match="header 'ImageId,PredictionString'"):
        imagenet.scan_imagenet(str(flat), labels_file=str(tmp_path / "bad.csv"))
    with pytest.raises(err, match="not classes of the model.*'n99999999'"):
        imagenet.targets_for([("x.jpg", "n99999999")], SYNSETS)
    # the tool turns it into one line and exit status 2
    with pytest.raises(SystemExit) as e:
        tool.main(TINY + ["--random-weights", "--data", str(empty), "--out", str(tmp_path / "r.json")])
    assert e.value.code == 2


def test_synthetic_crops_with_workers(tmp_path):
    split = imagenet.synthetic_sources(PHOTOS)
    assert split.layout == "synthetic" and len(split.samples) == len(PHOTO_FILES)
    items = [(p, 0) for p, _ in split.samples]
    from torchvision.transforms.functional import pil_to_tensor

    a = imagenet.SyntheticCrops(items, 20, pil_to_tensor, seed=3)
    b = imagenet.SyntheticCrops(items, 20, pil_to_tensor, seed=3)
    assert torch.equal(a[5][0], b[5][0]) and torch.equal(a[5][0], a[5][0])
    shapes = {tuple(a[i][0].shape) for i in range(0, 20, len(items))}  # same photo, different crops
    assert len(shapes) > 1
    for i in range(20):
        (l, t, r, btm), _ = a.crop_box(i, 640, 480)
        assert 0 <= l < r <= 640 and 0 <= t < btm <= 480
    res = tool.main(TINY + ["--random-weights", "--synthetic-from", PHOTOS, "--limit", "12", "--workers", "2",
                            "--modes", "native,fp32", "--out", str(tmp_path / "s.json")])
    assert res["data"]["layout"] == "synthetic" and [r["images"] for r in res["results"]] == [12, 12]
    assert res["results"][1]["agree_native"] == 1.0


def test_subsample_spreads_evenly():
    assert imagenet.subsample(10, None) == list(range(10))
    assert imagenet.subsample(10, 50) == list(range(10))
    idx = imagenet.subsample(1000, 7)
    assert len(set(idx)) == 7 and idx[0] == 0 and idx[-1] > 800
    with pytest.raises(ValueError, match="limit=0"):
        imagenet.subsample(10, 0)


def test_pretrained_offline_names_the_fix(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    # hub host unreachable (closed port on this machine): fails at once with the way out
    monkeypatch.setattr(constants, "ENDPOINT", "https://127.0.0.1:9")
    with pytest.raises(timm_models.WeightsUnavailableError,
                       match=r"not reachable.*--checkpoint.*HF_HUB_OFFLINE=1.*--random-weights"):
        timm_models.create_timm_model("vit_tiny_patch16_224", pretrained=True, img_size=32, depth=1)
    # HF_HUB_OFFLINE=1 with an empty cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(timm_models.WeightsUnavailableError, match=r"--checkpoint.*HF_HOME.*--random-weights"):
        timm_models.create_timm_model("vit_tiny_patch16_224", pretrained=True, img_size=32, depth=1)
    with pytest.raises(FileNotFoundError, match="checkpoint="):
        timm_models.create_timm_model("vit_tiny_patch16_224", checkpoint=str(tmp_path / "none.pth"))


def test_random_swinv2_attention_reaches_the_logits():
    """timm zero-initializes Swin-v2's res-post-norms, which would make a random-weight patched-vs-native
    comparison blind to attention; create_timm_model(pretrained=False) wakes them, so replacing every
    attention output by zeros changes the logits."""
    import timm

    kw = dict(img_size=64, window_size=4, embed_dim=24, depths=(1, 1), num_heads=(2, 2))
    raw = timm.create_model("swinv2_tiny_window8_256", pretrained=False, **kw)
    assert any(isinstance(m, torch.nn.LayerNorm) and not m.weight.any() for m in raw.modules())
    model = timm_models.create_timm_model("swinv2_tiny_window8_256", pretrained=False, **kw)
    assert not any(isinstance(m, torch.nn.LayerNorm) and not m.weight.any() for m in model.modules())
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x)
        hooks = [m.register_forward_hook(lambda mod, inp, out: torch.zeros_like(out))
                 for m in model.modules() if type(m).__name__ == "WindowAttention"]
        blind = model(x)
        for h in hooks:
            h.remove()
    assert len(hooks) == 2
    assert (ref - blind).abs().max() > 1e-3


GOOD = ["--model", "vit_tiny_patch16_224", "--model-kwargs", '{"depth": 2}', "--img-size", "32", "--batch-size", "3",
        "--random-weights", "--synthetic-from", PHOTOS, "--limit", "4", "--workers", "0", "--modes", "native,fp32"]


@pytest.mark.parametrize("bad, flag", [
    (["--limit", "0"], "--limit"),
    (["--batch-size", "0"], "--batch-size"),
    (["--workers", "-1"], "--workers"),
    (["--img-size", "3"], "--img-size"),
    (["--model", "vit_no_such_model"], "--model"),
    (["--modes", "native,fp33"], "--modes"),
    (["--model-kwargs", '{"no_such_argument": 1}'], "--model-kwargs"),
])
def test_bad_arguments_exit_2_with_one_line_before_any_work(bad, flag, tmp_path, capsys, monkeypatch):
    def must_not_run(*a, **k):
        raise AssertionError("the evaluation started although an argument is bad")

    monkeypatch.setattr(tool, "evaluate_modes", must_not_run)
    out = tmp_path / "new_folder" / "r.json"
    with pytest.raises(SystemExit) as e:
        tool.main(GOOD + bad + ["--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "new_folder").exists()  # nothing created


def test_unwritable_output_found_before_the_evaluation(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tool, "evaluate_modes", lambda *a, **k: pytest.fail("evaluated before checking --out"))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        tool.main(GOOD + ["--out", str(blocker / "r.json")])
    assert e.value.code == 2
    assert "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(GOOD + ["--out", str(tmp_path)])  # a folder where a file is expected


def test_default_output_is_out_folder_of_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = tool.main(GOOD)
    assert res["data"]["images"] == 4
    assert sorted(os.listdir(tmp_path / "out")) == [".visionattn-eval_imagenet.json",  # its manifest
                                                    "eval_imagenet.json", "eval_imagenet.md"]
