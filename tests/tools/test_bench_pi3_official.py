"""tools/bench_pi3_official.py on the CPU, against a stand-in "official" checkout (visionattn's own tiny π³ / Pi3X
behind the official class names, on PyTorch SDPA): every row runs, the weights load strictly, the agreement of
the visionattn rows with the stand-in, the files; wrong arguments exit 2 naming the fix."""
import json
import os
import textwrap

import pytest

from testdata import load_script

tool = load_script("tools/bench_pi3_official.py")

STAND_IN = textwrap.dedent('''
    from visionattn.models import {cls} as _Model


    class {cls}(_Model):
        """The official class name over visionattn's model, on PyTorch SDPA."""

        def __init__(self, **config):
            super().__init__(**config)
            self.set_attn_mode(None)
''')


def _checkout(root, model):
    os.makedirs(root / "pi3/models", exist_ok=True)
    for init in ("pi3/__init__.py", "pi3/models/__init__.py"):
        (root / init).write_text("")
    (root / f"pi3/models/{model}.py").write_text(STAND_IN.format(cls={"pi3": "Pi3", "pi3x": "Pi3X"}[model]))
    return root


@pytest.mark.parametrize("model,extra", [("pi3", []), ("pi3x", ["--conditions"])])
def test_every_row_on_a_stand_in_checkout(tmp_path, model, extra, monkeypatch):
    checkout = _checkout(tmp_path / model, model)
    for name in [m for m in list(__import__("sys").modules) if m == "pi3" or m.startswith("pi3.")]:
        monkeypatch.delitem(__import__("sys").modules, name)
    out = tmp_path / "res"
    res = tool.main(["--official", str(checkout), "--model", model, *extra, "--tiny", "--device", "cpu",
                     "--frames", "2", "--height", "56", "--width", "56", "--out", str(out)])
    rows = [p["row"] for p in res["points"]]
    assert rows == list(tool.ROWS)
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


def test_a_folder_without_the_official_code_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--official", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "pi3/models/pi3.py" in capsys.readouterr().err


def test_conditions_need_pi3x(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--official", str(tmp_path), "--conditions", "--device", "cpu", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2 and "--model pi3x" in capsys.readouterr().err
