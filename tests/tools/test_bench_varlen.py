"""tools/bench_varlen.py: --help, bad arguments exit 2, a tiny CPU run writing its markdown and JSON."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "bench_varlen.py")
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench_varlen  # noqa: E402


def test_help_lists_every_flag():
    res = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for flag in ("--lengths", "--heads", "--head-dim", "--modes", "--methods", "--calls", "--repeats", "--out"):
        assert flag in res.stdout


@pytest.mark.parametrize("args", [["--modes", "fp8"], ["--methods", "flash"], ["--lengths", "3,x"],
                                  ["--lengths", "0,0"], ["--heads", "0"]])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_varlen.main(args + ["--device", "cpu"])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_tiny_cpu_run_writes_markdown_and_json(tmp_path):
    out = str(tmp_path / "vb")
    res = bench_varlen.main(["--device", "cpu", "--lengths", "5,0,9", "--heads", "2", "--head-dim", "8",
                             "--calls", "1", "--repeats", "1", "--modes", "fp32", "--out", out, "--quiet"])
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == set(bench_varlen.METHODS)
    for r in rows.values():
        assert r["rel_l2"] <= 1e-5 and r["total_ms"] > 0
    assert "sdpa-padded" in open(out + ".md").read()
    assert json.load(open(out + ".json"))["lengths"] == [5, 0, 9]
