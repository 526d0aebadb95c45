"""The heads' precision is a stated choice of the demo: VGGT's FP32 heads by default, bf16 / fp16 as the official
FastVGGT code runs them with --heads, reported in summary.json and the summary line; π³ / Pi3X refuse it."""
import json

import pytest

from testdata import load_script
from visionattn.recon import pipeline

demo = load_script("demos/reconstruct.py")


def test_build_model_heads():
    assert pipeline.build_model("fastvggt", "random-tiny").heads_dtype in (None, "fp32")
    assert pipeline.build_model("fastvggt", "random-tiny", heads="bf16").heads_dtype == "bf16"
    with pytest.raises(ValueError, match="heads='bf16' applies to vggt / fastvggt"):
        pipeline.build_model("pi3", "random-tiny", heads="bf16")
    with pytest.raises(ValueError, match="heads='fp64'"):
        pipeline.build_model("vggt", "random-tiny", heads="fp64")


def test_demo_states_the_heads(tmp_path, capsys):
    res = demo.main(["demos/data/suzanne", "--out", str(tmp_path / "o"), "--weights", "random-tiny",
                     "--model", "fastvggt", "--heads", "bf16", "--quiet", "--no-preview"])
    assert res["exit_code"] == 0
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["heads"] == "bf16"
    assert "heads=bf16" in capsys.readouterr().out
    res = demo.main(["demos/data/suzanne", "--out", str(tmp_path / "d"), "--weights", "random-tiny", "--quiet",
                     "--no-preview"])
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["heads"] == "fp32"


def test_demo_refuses_heads_for_pi3(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["demos/data/suzanne", "--out", str(tmp_path / "o"), "--weights", "random-tiny", "--model", "pi3",
                   "--heads", "bf16"])
    assert exc.value.code == 2 and "--heads" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
