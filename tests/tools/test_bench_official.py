"""tools/bench_official.py on the CPU, against stand-in "official" checkouts (visionattn's own tiny π³ / Pi3X /
VGGT behind the official class names and constructors, on PyTorch SDPA): every row runs, the weights load strictly,
the agreement of the visionattn rows with the stand-in, the files; wrong arguments exit 2 naming the fix."""
import json
import os
import sys
import textwrap

import pytest

from testdata import load_script

tool = load_script("tools/bench_official.py")

PI3_STAND_IN = textwrap.dedent('''
    from visionattn.models import {cls} as _Model


    class {cls}(_Model):
        """The official class name over visionattn's model, on PyTorch SDPA."""

        def __init__(self, **config):
            super().__init__(**config)
            self.set_attn_mode(None)
''')
VGGT_STAND_IN = textwrap.dedent('''
    from visionattn.models import VGGT as _VGGT


    class VGGT(_VGGT):
        """The official constructor's keywords over visionattn's model, on PyTorch SDPA, heads under autocast."""

        def __init__(self, merging=0, enable_point=False, enable_track=False, **config):
            super().__init__(**config, enable_point=enable_point, enable_track=enable_track, attn_mode=None,
                             heads_dtype="bf16")
            self.patch_dims = None

        def update_patch_dimensions(self, patch_width, patch_height):
            self.patch_dims = (patch_width, patch_height)
''')


def _checkout(root, model):
    if model == "fastvggt":
        files = {"vggt/__init__.py": "", "vggt/models/__init__.py": "", "merging/__init__.py": "",
                 "merging/merge.py": "", "vggt/models/vggt.py": VGGT_STAND_IN}
    else:
        files = {"pi3/__init__.py": "", "pi3/models/__init__.py": "",
                 f"pi3/models/{model}.py": PI3_STAND_IN.format(cls={"pi3": "Pi3", "pi3x": "Pi3X"}[model])}
    for name, text in files.items():
        os.makedirs(os.path.dirname(root / name), exist_ok=True)
        (root / name).write_text(text)
    return root


def _fresh(monkeypatch, package):
    for name in [m for m in list(sys.modules) if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)


# Pi3X also warms up on fewer frames than it times: the conditions are cut to those frames with the images
@pytest.mark.parametrize("model,extra", [("pi3", []), ("pi3x", ["--conditions", "--warmup-frames", "1"])])
def test_every_pi3_row_on_a_stand_in_checkout(tmp_path, model, extra, monkeypatch):
    checkout = _checkout(tmp_path / model, model)
    _fresh(monkeypatch, "pi3")
    out = tmp_path / "res"
    res = tool.main(["--official", str(checkout), "--model", model, *extra, "--tiny", "--device", "cpu",
                     "--frames", "2", "--height", "56", "--width", "56", "--out", str(out)])
    rows = [p["row"] for p in res["points"]]
    assert rows == list(tool.PI3_ROWS)
    assert all(p["finite"] for p in res["points"])
    # the stand-in is visionattn's model on SDPA: the SDPA FP32 row is the same computation, the fp32 row within
    # the fp32 mode's contract
    same = res["agreement"]["sdpa-fp32 vs official-fp32"]
    assert set(same) >= {"points", "local_points", "conf", "camera_poses"}
    assert max(same.values()) < 1e-6
    assert max(res["agreement"]["fp32 vs official-fp32"].values()) < 1e-4
    assert json.loads((tmp_path / "res.json").read_text())["model"] == model
    md = (tmp_path / "res.md").read_text()
    assert "official code, FP32" in md and "vs official" in md and (tmp_path / "res.png").stat().st_size > 0


def test_every_fastvggt_row_on_a_stand_in_checkout(tmp_path, monkeypatch):
    checkout = _checkout(tmp_path / "FastVGGT", "fastvggt")
    _fresh(monkeypatch, "vggt")
    out = str(tmp_path / "cmp")
    res = tool.main(["--official", str(checkout), "--model", "fastvggt", "--tiny", "--device", "cpu", "--frames", "2",
                     "--height", "28", "--width", "42", "--fp32-heads", "--out", out])
    rows = [p["row"] for p in res["points"]]
    assert rows == ["official", "sdpa", "bf16", "free", "bf16-fp32-heads"]
    assert all(p["finite"] and p["time_s"] > 0 for p in res["points"])
    # the stand-in is visionattn's model on SDPA with bf16 heads: the sdpa row differs only by token merging
    agree = res["agreement"]
    assert set(agree) == {"sdpa vs official", "bf16 vs official", "bf16-fp32-heads vs official"}
    assert all(set(e) == {"depth"} and 0 <= e["depth"] < 1 for e in agree.values())
    saved = json.load(open(out + ".json"))
    assert saved["points"] == json.loads(json.dumps(res["points"]))
    md = open(out + ".md").read()
    assert "official FastVGGT code" in md and "attention-free (bound)" in md and "vs official" in md
    assert os.path.getsize(out + ".png") > 0


@pytest.mark.parametrize("model,needle", [("pi3", "pi3/models/pi3.py"), ("fastvggt", "vggt/models/vggt.py")])
def test_a_folder_without_the_official_code_exits_2(tmp_path, capsys, model, needle):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--official", str(tmp_path), "--model", model, "--device", "cpu", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv,needle", [(["--conditions"], "--model pi3x"),
                                         (["--model", "fastvggt", "--rows", "fp32"], "--rows")])
def test_arguments_the_model_does_not_take_exit_2(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--official", str(tmp_path), *argv, "--device", "cpu", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
