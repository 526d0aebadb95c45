"""CPU check of tools/bench_vggt.py: the long-sequence table on the tiny config writes JSON, markdown and PNG."""
import json
import os

import pytest

from testdata import load_script


def _tool():
    return load_script("tools/bench_vggt.py")


def test_bench_vggt_long_table_on_cpu_tiny(tmp_path):
    pytest.importorskip("matplotlib")
    tool = _tool()
    out = str(tmp_path / "long")
    args = tool.parser.parse_args(["--tiny", "--device", "cpu", "--long", "--max-frames", "2", "--rows",
                                   "official-fp32", "sdpa-fp32", "--height", "28", "--width", "42", "--no-point-warmup", "--out", out])
    res = tool.main(args)
    for ext in (".json", ".md", ".png"):
        assert os.path.getsize(out + ext) > 0, ext
    saved = json.load(open(out + ".json"))
    assert saved["environment"]["torch"] and saved["tiny"] is True
    for model in ("vggt", "fastvggt"):
        for row in ("official-fp32", "sdpa-fp32"):
            p = res["points"][model][row]["2"]
            assert p["finite"] and p["time_s"] > 0 and p["peak_gb"] > 0 and p["est_gb"] > 0, (model, row)
    # the official-equivalent row holds every layer: never less memory than the trimmed SDPA-free row
    assert res["points"]["vggt"]["official-fp32"]["2"]["peak_gb"] >= res["points"]["vggt"]["sdpa-fp32"]["2"]["peak_gb"]
    md = open(out + ".md").read()
    assert "official-equivalent FP32" in md and "Est. (GB)" in md
