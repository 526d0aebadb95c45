"""tools/bench_varlen.py: --help, bad arguments exit 2, tiny CPU runs (forward, --backward, --naflex) writing their
markdown and JSON."""
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
    for flag in ("--lengths", "--heads", "--head-dim", "--modes", "--methods", "--calls", "--repeats", "--out",
                 "--backward", "--naflex", "--model", "--batch", "--naflex-sizes"):
        assert flag in res.stdout


@pytest.mark.parametrize("args", [["--modes", "fp8"], ["--methods", "flash"], ["--lengths", "3,x"],
                                  ["--lengths", "0,0"], ["--heads", "0"], ["--naflex-sizes", "32x"],
                                  ["--naflex-sizes", "0x16"], ["--batch", "0"]])
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


def test_tiny_cpu_backward_run(tmp_path):
    """--backward: a forward and a forward+backward row per method; gradients within FP32 of float64 autograd."""
    out = str(tmp_path / "vbb")
    res = bench_varlen.main(["--device", "cpu", "--lengths", "5,0,9", "--heads", "2", "--head-dim", "8",
                             "--calls", "1", "--repeats", "1", "--modes", "fp32", "--out", out, "--quiet",
                             "--backward"])
    rows = [r for r in res["rows"] if r["pass"] == "forward+backward"]
    assert {r["method"] for r in rows} == set(bench_varlen.METHODS)
    for r in rows:
        assert r["rel_l2"] <= 1e-5 and r["total_ms"] > 0 and r["kernel_ms"] is None
    assert "forward+backward" in open(out + ".md").read()
    assert json.load(open(out + ".json"))["backward"] is True


def test_backward_rows_leave_later_forward_inputs_without_grad(tmp_path, monkeypatch):
    """The forward rows of a mode that follows a --backward mode time inference inputs: the backward rows' leaves
    are copies, never the shared inputs turned into leaves (a list input that needs grad takes the packed path)."""
    seen = []
    calls = bench_varlen.method_calls

    def record(method, seqs, mode):
        seen.append((mode, any(t.requires_grad for s in seqs for t in s)))
        return calls(method, seqs, mode)

    monkeypatch.setattr(bench_varlen, "method_calls", record)
    bench_varlen.main(["--device", "cpu", "--lengths", "5,9", "--heads", "2", "--head-dim", "8", "--calls", "1",
                       "--repeats", "1", "--modes", "fp32,tf32", "--methods", "visionattn-list,sdpa-per-seq",
                       "--out", str(tmp_path / "v"), "--quiet", "--backward"])
    assert [g for m, g in seen] == [False, False, True, True, False, False, True, True]


def test_tiny_cpu_naflex_run(tmp_path):
    """--naflex: the unpatched model and one patched row; the patched logits as the unpatched model's."""
    out = str(tmp_path / "nf")
    res = bench_varlen.main(["--device", "cpu", "--naflex", "--batch", "3", "--naflex-sizes", "32x48,48x16,16x16",
                             "--calls", "1", "--repeats", "1", "--modes", "fp32", "--out", out, "--quiet"])
    assert [r["method"] for r in res["rows"]] == ["timm-sdpa", "visionattn-varlen"]
    assert res["naflex"]["patches_per_image"] == [6, 3, 1]
    assert res["rows"][1]["logits_rel_l2"] <= 1e-5 and res["rows"][1]["tokens_rel_l2"] <= 1e-5
    assert "NaFlexViT" in open(out + ".md").read()


def test_bench_attention_varlen_runs_this_table(tmp_path, monkeypatch):
    """tools/bench_attention.py --varlen hands its modes and output folder to this tool's main."""
    import bench_attention

    seen = []
    monkeypatch.setattr(bench_varlen, "main", lambda argv: seen.append(argv) or {"rows": []})
    out = str(tmp_path / "att")
    assert bench_attention.main(bench_attention.build_parser().parse_args(
        ["--varlen", "--modes", "fp32,bf16", "--out", out])) == {"rows": []}
    assert seen == [["--modes", "fp32,bf16", "--out", os.path.join(out, "varlen")]]
    with pytest.raises(SystemExit):
        bench_attention.main(bench_attention.build_parser().parse_args(["--varlen", "--backward", "--out", out]))
