"""tools/eval_reconstruction.py with --model pi3 / pi3x: the same protocols as VGGT's (tiny random models, CPU)."""
import json
import os
import shutil

import numpy as np
import pytest

from testdata import MULTIVIEW, load_script

SIZE = 140
evaltool = load_script("tools/eval_reconstruction.py", "eval_reconstruction_pi3")
demo = load_script("demos/reconstruct.py", "reconstruct_demo_eval_pi3")


def test_modes_agreement_pi3(tmp_path):
    res = evaltool.main(["modes", os.path.join(MULTIVIEW, "aloe"), "--model", "pi3", "--modes", "fp32,fp16,bf16",
                         "--out", str(tmp_path), "--weights", "random-tiny", "--device", "cpu", "--size", str(SIZE),
                         "--quiet"])
    assert res["exit_code"] == 0 and res["model"] == "pi3" and res["weights"] == "random-tiny"
    runs = res["runs"]
    assert runs["fp32"]["depth_rel_l2"] == 0 and runs["fp32"]["rot_max_deg"] == 0
    for m in ("fp16", "bf16"):
        assert runs[m]["nonfinite"] == 0 and 0 < runs[m]["points_rel_l2"] < 0.05
    assert runs["bf16"]["points_rel_l2"] > runs["fp16"]["points_rel_l2"]
    assert "| bf16 |" in open(tmp_path / "eval_reconstruction_modes.md").read()


@pytest.mark.parametrize("model", ["pi3", "pi3x"])
def test_accuracy_on_generic_layout(model, tmp_path):
    """Ground truth = the demo's own cameras for the same model, seed and size: AUC 1; camera 2 rotated by
    10 degrees about its centre scores that in the 5 of 15 pairs that involve it."""
    out = tmp_path / "recon"
    rig = os.path.join(MULTIVIEW, "stereo_rig")
    assert demo.main([rig, "--out", str(out), "--model", model, "--weights", "random-tiny", "--device", "cpu",
                      "--size", str(SIZE), "--quiet", "--no-preview"])["exit_code"] == 0
    doc = json.load(open(out / "cameras.json"))
    for name, rotate in (("rig", False), ("rig_rotated", True)):
        scene = tmp_path / "data" / name
        shutil.copytree(rig, scene / "images")
        if rotate:
            a = np.radians(10.0)
            Q = np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])
            doc["frames"][2]["extrinsic"] = (Q @ np.array(doc["frames"][2]["extrinsic"])).tolist()
        json.dump(doc, open(scene / "cameras.json", "w"))
    res = evaltool.main(["accuracy", "--data", str(tmp_path / "data"), "--model", model, "--out",
                         str(tmp_path / "rep"), "--weights", "random-tiny", "--device", "cpu", "--size", str(SIZE),
                         "--quiet"])
    assert res["exit_code"] == 0 and res["model"] == model
    exact, rotated = res["scenes"]
    assert exact["pose"]["pairs"] == 15 and exact["pose"]["auc@3"] == pytest.approx(1.0)
    assert exact["pose"]["rot_err_mean_deg"] < 1e-3
    assert rotated["pose"]["rra@5"] == pytest.approx(10 / 15)
    assert (tmp_path / "rep" / "eval_reconstruction_accuracy.md").is_file()


def test_default_weights_follow_the_model():
    from visionattn.recon.pipeline import default_weights

    args = evaltool.build_parser().parse_args(["modes", "x", "--model", "pi3x", "--out", "o"])
    assert args.weights is None and default_weights(args.model) == "yyfz233/Pi3X"
    assert default_weights("vggt") == default_weights("fastvggt") == "facebook/VGGT-1B"
    with pytest.raises(ValueError, match="not known"):
        default_weights("dust3r")
