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
                                   "official-fp32", "sdpa-fp32", "--height", "28", "--width", "42",
                                   "--no-point-warmup", "--out", out])
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


def test_attention_free_row_answers_every_sdpa_call_on_cpu_tiny(tmp_path, monkeypatch):
    """The free-fp32 row runs the SDPA row's model with SDPA answering its value rows: it answers every SDPA call
    the SDPA row makes (counted by a spy), per timed forward also after the point's untimed warm-up forward, and it
    is not run unless named."""
    import torch.nn.functional as F

    tool = _tool()
    assert "free-fp32" not in tool.parser.get_default("rows")
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    def run(row, out, *extra):
        args = tool.parser.parse_args(["--tiny", "--device", "cpu", "--models", "vggt", "--frames", "2", "--rows",
                                       row, "--height", "28", "--width", "42", "--out", out, *extra])
        return tool.main(args)["points"]["vggt"][row]["2"]

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    run("sdpa-fp32", str(tmp_path / "sdpa"), "--no-point-warmup")
    monkeypatch.undo()
    per_forward = len(calls) // 2  # the 2-frame warm-up forward, then the timed one
    assert per_forward > 0 and len(calls) == 2 * per_forward
    out = str(tmp_path / "free")
    p = run("free-fp32", out, "--no-point-warmup")
    assert p["sdpa_calls_per_forward"] == per_forward and p["time_s"] > 0
    warm = run("free-fp32", str(tmp_path / "warm"), "--repeats", "2")  # an untimed forward, then two timed ones
    assert warm["sdpa_calls_per_forward"] == per_forward
    assert "attention-free FP32 (bound)" in open(out + ".md").read()
