"""tools/bench_split_kv.py: --help, bad arguments exit 2, a tiny CPU run (Triton's interpreter, untimed) whose every
schedule — the library's choice, Flash-Decoding's rule and fixed split counts — matches the float64 softmax."""
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "bench_split_kv.py")
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench_split_kv  # noqa: E402


def test_help_lists_every_flag():
    res = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for flag in ("--modes", "--batch-heads", "--queries", "--keys", "--sequences", "--ratios", "--longest",
                 "--self-lengths", "--splits", "--job-costs", "--calls", "--repeats", "--seed", "--device", "--out"):
        assert flag in res.stdout


@pytest.mark.parametrize("args", [["--modes", "pasa"], ["--batch-heads", "2"], ["--batch-heads", "0x4"],
                                  ["--ratios", "0"], ["--ratios", "1.5"], ["--ratios", "x"], ["--keys", "0"],
                                  ["--splits", "0"], ["--sequences", "a"], ["--job-costs", "-1"]])
def test_bad_arguments_exit_2(args, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench_split_kv.main(args + ["--device", "cpu", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_ragged_lengths_meet_the_ratio():
    g = torch.Generator().manual_seed(0)
    lens = bench_split_kv.ragged_lengths(64, 0.25, 8192, g)
    assert lens[0] == 8192 and max(lens) == 8192 and min(lens) >= 16 and len(lens) == 64
    assert abs(sum(lens) / 64 / 8192 - 0.25) < 0.05
    assert bench_split_kv.ragged_lengths(4, 1.0, 100, g) == [100] * 4


def test_flash_decoding_rule_off_cuda_is_one_pass():
    cfg = bench_split_kv.get_config("fp32", 64, 64, 4096)
    assert bench_split_kv.flash_decoding_splits(1, 65536, cfg, torch.device("cpu")) == 1


def test_tiny_cpu_run_every_schedule_matches_float64(tmp_path):
    out = str(tmp_path / "sk")
    res = bench_split_kv.main(["--device", "cpu", "--modes", "fp32,bf16", "--batch-heads", "1x2", "--queries", "3",
                               "--keys", "100", "--sequences", "3", "--ratios", "0.3,1", "--longest", "90",
                               "--splits", "2,3", "--self-lengths", "40,17", "--out", out])
    rows = res["rows"]
    assert {r["schedule"] for r in rows} == {"auto", "flash-decoding", "P=2", "P=3", "stream-k"}
    assert {r["case"].split()[0] for r in rows} == {"B=1", "ragged", "self-attention"}
    for r in rows:
        assert r["max_rel_err"] <= (1e-5 if r["mode"] == "fp32" else 2e-2), r
        assert r["first_ms"] > 0, r  # the first call timed apart
    assert [r["splits"] for r in rows if r["schedule"] == "P=3"] == [3] * 8
    assert len([r for r in rows if r["schedule"] == "stream-k"]) == 8
    assert json.load(open(out + ".json"))["modes"] == ["fp32", "bf16"]
    assert "flash-decoding" in open(out + ".md").read() and "stream-k vs auto" in open(out + ".md").read()


def test_job_cost_sweep_rows_match_float64(tmp_path):
    out = str(tmp_path / "jc")
    res = bench_split_kv.main(["--device", "cpu", "--modes", "bf16", "--batch-heads", "1x2", "--queries", "1",
                               "--keys", "100", "--sequences", "3", "--ratios", "0.3", "--longest", "90",
                               "--self-lengths", "", "--job-costs", "0,3", "--out", out])
    rows = [r for r in res["rows"] if r["schedule"].startswith("stream-k cost=")]
    assert {r["schedule"] for r in rows} == {"stream-k cost=0", "stream-k cost=3"} and len(rows) == 4
    assert all(r["max_rel_err"] <= 2e-2 for r in rows), rows
    assert "stream-k cost=3" in open(out + ".md").read()
