"""tools/large_calls.py at interpreter sizes: each case in its own process, compared with float64, reported."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import large_calls  # noqa: E402


def test_cases_run_and_report(tmp_path):
    out = tmp_path / "lc"
    assert large_calls.main(["--device", "cpu", "--cases", "dense_bf16_bwd", "window_tiled", "--out", str(out)]) == 0
    report = json.loads(Path(f"{out}.json").read_text())
    assert set(report["cases"]) == {"dense_bf16_bwd", "window_tiled"}
    bwd = report["cases"]["dense_bf16_bwd"]
    assert bwd["verdict"] == "pass" and bwd["errors"]["finite"] and 0 < bwd["errors"]["dq"] < 2e-2
    assert "| window_tiled |" in Path(f"{out}.md").read_text()


def test_verdicts():
    assert large_calls._verdict("dense_fp32", {"errors": {"out": 3e-6}}) == "pass"
    assert large_calls._verdict("dense_fp32", {"errors": {"out": 0.3}}) == "fail"
    assert large_calls._verdict("varlen_bf16", {"errors": {"out": 1e-3, "finite": False}}) == "fail"
    assert large_calls._verdict("window_small", {"crash": "illegal memory access"}) == "crash"
    assert large_calls._verdict("varlen_bf16", {"skipped": "out of memory on a 24 GB GPU"}) == "skipped"
