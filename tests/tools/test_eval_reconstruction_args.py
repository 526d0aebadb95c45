"""tools/eval_reconstruction.py refuses bad arguments and unwritable output paths before any work:
exit status 2, one line naming the argument, no folder created."""
import os

import pytest

from testdata import MULTIVIEW, load_script


def _load():
    return load_script("tools/eval_reconstruction.py", "eval_reconstruction_args")


tool = _load()
MODES = ["modes", os.path.join(MULTIVIEW, "aloe"), "--weights", "random-tiny", "--device", "cpu", "--size", "140",
         "--quiet"]


def _accuracy(data):
    return ["accuracy", "--data", str(data), "--weights", "random-tiny", "--device", "cpu", "--quiet"]


@pytest.mark.parametrize("bad, flag", [
    (["--conf-percentile", "150"], "--conf-percentile"),
    (["--conf-percentile", "-1"], "--conf-percentile"),
    (["--conf-percentile", "nan"], "--conf-percentile"),
    (["--num-frames", "0"], "--num-frames"),
    (["--max-sequences", "0"], "--max-sequences"),
    (["--cloud-threshold", "0"], "--cloud-threshold"),
    (["--size", "100"], "--size"),
    (["--size", "-14"], "--size"),
])
def test_accuracy_bad_arguments(bad, flag, tmp_path, capsys, monkeypatch):
    import visionattn.recon.evaluate as ev

    monkeypatch.setattr(ev, "evaluate_scenes", lambda *a, **k: pytest.fail("evaluated despite a bad argument"))
    with pytest.raises(SystemExit) as e:
        tool.main(_accuracy(tmp_path) + bad + ["--out", str(tmp_path / "rep")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("bad, flag", [
    (["--modes", "fp32,fp33"], "--modes"),
    (["--max-frames", "0"], "--max-frames"),
    (["--warmup", "-1"], "--warmup"),
])
def test_modes_bad_arguments(bad, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(MODES + bad + ["--out", str(tmp_path / "rep")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "rep").exists()


def test_unwritable_output_is_found_before_the_evaluation(tmp_path, capsys, monkeypatch):
    import visionattn.recon.evaluate as ev

    monkeypatch.setattr(ev, "mode_agreement", lambda *a, **k: pytest.fail("evaluated before checking --out"))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for out in (blocker, blocker / "rep"):
        with pytest.raises(SystemExit) as e:
            tool.main(MODES + ["--out", str(out)])
        assert e.value.code == 2 and "--out" in capsys.readouterr().err
