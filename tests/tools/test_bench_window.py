"""tools/bench_window.py --train on CPU (Triton's interpreter): a tiny Swin and Swin-v2 stage, every backend in fp32
and bf16, the gradient errors against float64, the ratios and the files."""
import json
import os

import pytest

from testdata import load_script

tool = load_script("tools/bench_window.py")

TINY = """models:
  - {name: tiny_v1, kind: v1, img: 56, embed_dim: 16, heads: [2], window: 7}
  - {name: tiny_v2, kind: v2, img: 64, embed_dim: 16, heads: [2], window: 8}
"""


def test_tiny_swin_and_swinv2_rows(tmp_path):
    cfg = tmp_path / "models.yaml"
    cfg.write_text(TINY)
    out = tmp_path / "wt"
    args = tool.build_parser().parse_args(["--train", "--device", "cpu", "--config", str(cfg), "--cases", "tiny_v1:0:1",
                                           "tiny_v2:0:1", "--repeats", "1", "--out", str(out)])
    res = tool.main(args)
    got = [(r["model"], r["mode"], r["backend"]) for r in res["rows"]]
    assert got == [(m, mode, b) for m, backends in (("tiny_v1", tool.BACKENDS), ("tiny_v2", ("visionattn",
                                                                                               "timm-eager")))
                   for mode in ("fp32", "bf16") for b in backends]
    for r in res["rows"]:
        assert r["error"] is None and r["ms"] > 0, r
        assert r["windows"] == 4 and r["tokens"] == (49 if r["kind"] == "v1" else 64)
        names = ["dqkv", "dbias"] + (["dlogit_scale"] if r["kind"] == "v2" else [])
        for n in names:  # every backend against the float64 lines: the same gradients, to its precision (the
            # logit-scale gradient sums terms that cancel; bf16 Swin-v2: logit scales up to 50 amplify the rounding)
            bound = (1e-4 if n == "dlogit_scale" else 1e-5) if r["mode"] == "fp32" else 0.1
            assert r[f"{n}_rel_err"] <= bound, (r["backend"], r["mode"], n, r[f"{n}_rel_err"])
        default = "timm-sdpa" if r["kind"] == "v1" else "timm-eager"
        ref = next(x for x in res["rows"] if (x["model"], x["mode"], x["backend"]) == (r["model"], r["mode"],
                                                                                       default))
        assert r["x_timm_default"] == pytest.approx(ref["ms"] / r["ms"])
    assert {(t["case"], t["mode"]) for t in res["targets"]} == {
        (f"{m} stage 1 batch 1", mode) for m in ("tiny_v1", "tiny_v2") for mode in ("fp32", "bf16")}
    assert json.load(open(str(out) + ".json"))["rows"] == res["rows"]
    md = open(str(out) + ".md").read()
    assert "**visionattn**" in md and "no CUDA graph" in md and "timm-sdpa" in md
    assert (tmp_path / "wt.png").stat().st_size > 0


@pytest.mark.parametrize("case", ["nope:0:1", "swin_base_224:9:1", "swin_base_224:0"])
def test_bad_case_exits_2_with_one_line_naming_the_argument(case, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(tool.build_parser().parse_args(["--train", "--device", "cpu", "--cases", case, "--out",
                                                  str(tmp_path / "x" / "r")]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cases" in err[0], err
    assert not (tmp_path / "x").exists()


def test_train_writes_under_out_without_an_out_argument(tmp_path, monkeypatch):
    """The --out default is resolved in main: out/window_train for --train (out/window_bench for the forward run)."""
    cfg = tmp_path / "models.yaml"
    cfg.write_text(TINY)
    monkeypatch.chdir(tmp_path)
    tool.main(tool.build_parser().parse_args(["--train", "--device", "cpu", "--config", str(cfg), "--cases",
                                              "tiny_v1:0:1", "--modes", "fp32", "--repeats", "1"]))
    assert sorted(os.listdir(tmp_path / "out")) == [".visionattn-bench_window_train.json", "window_train.json",
                                                    "window_train.md", "window_train.png"]
