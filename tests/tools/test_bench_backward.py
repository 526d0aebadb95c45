"""tools/bench_backward.py on CPU (Triton's interpreter): a dense and a window shape with a bias gradient, the
bias-splits sweep, the rows and their files, and the argument checks."""
import json

import pytest

from testdata import load_script


tool = load_script("tools/bench_backward.py")


def test_tiny_dense_and_window_rows(tmp_path, monkeypatch):
    """Shapes small enough for the interpreter, in the table's format (B, H, N, D, bias, windows per image):
    every (shape, mode, bias splits) cell runs and lands in the JSON and the markdown."""
    monkeypatch.setitem(tool.SHAPES, "tiny-dense", (2, 2, 24, 8, True, 0))
    monkeypatch.setitem(tool.SHAPES, "tiny-window", (6, 2, 20, 8, True, 3))
    out = tmp_path / "bwd"
    args = tool.build_parser().parse_args([
        "--device", "cpu", "--shapes", "tiny-dense", "tiny-window", "--modes", "fp32", "bf16", "--bias-splits", "1",
        "2", "--configs", "16,32,4,1/32,16,4,1", "--fp32-products", "tf32x3", "--calls", "1", "--repeats", "1",
        "--no-sdpa", "--out", str(out)])
    res = tool.main(args)
    ours = [(r["shape"], r["mode"], r["kernel"], r["bias_splits"]) for r in res["rows"]]
    expected = [(s, m, name + ("" if g is None else f" splits={g}"), g) for m in ("fp32", "bf16")
                for s, name in (("tiny-dense", "visionattn"), ("tiny-window", "visionattn-fused"),
                                ("tiny-window", "visionattn-split")) for g in (None, 1, 2)]
    expected += [(s, m, name + " tiles=16,32,4,1/32,16,4,1", None) for m in ("fp32", "bf16")
                 for s, name in (("tiny-dense", "visionattn"), ("tiny-window", "visionattn-split"))]
    expected += [(s, "fp32", name + " products=tf32x3", None) for s, name in (
        ("tiny-dense", "visionattn"), ("tiny-window", "visionattn-fused"), ("tiny-window", "visionattn-split"))]
    assert sorted(ours, key=str) == sorted(expected, key=str)
    assert all(r["ms"] > 0 and r["error"] is None for r in res["rows"])
    assert {r["windows_per_image"] for r in res["rows"]} == {0, 3}
    assert json.load(open(str(out) + ".json"))["rows"] == res["rows"]
    md = open(str(out) + ".md").read()
    assert "visionattn-split splits=2" in md and "CPU wall clock" in md


@pytest.mark.parametrize("argv", [["--shapes", "swin-b-s9"], ["--bias-splits", "0"], ["--modes", "fp8"],
                                  ["--configs", "64,64,4"], ["--configs", "48,64,4,2/64,64,4,2"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.build_parser().parse_args(argv)
    assert exc.value.code == 2 and "error" in capsys.readouterr().err
