"""tools/bench_integrations.py: bad arguments exit 2, a tiny CPU run of every cell writing markdown / JSON / PNG with
the fp32 rows within the fp32 contract, and a case whose library is missing skipped with a printed line."""
import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench_integrations  # noqa: E402

from visionattn import MODES  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

FAST = ["--tiny", "--device", "cpu", "--batch", "2", "--rep-ms", "2", "--warmup", "0", "--rounds", "2"]


@pytest.mark.parametrize("args", [["--cases", "vit,swin"], ["--modes", "fp8"], ["--batch", "0"], ["--rep-ms", "0"],
                                  ["--cuda-graph"]])
def test_bad_arguments_exit_2(args, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench_integrations.main(args + ["--device", "cpu", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_tiny_cpu_run_writes_every_row(tmp_path):
    out = str(tmp_path / "integrations")
    result = bench_integrations.main(FAST + ["--out", out])
    with open(out + ".json") as f:
        rows = json.load(f)["rows"]
    assert rows == json.loads(json.dumps(result["rows"], default=str))
    cells = {(c, m) for c in bench_integrations.CASES for m in ("fp32", "bf16")}
    assert {(r["case"], r["mode"]) for r in rows} == cells
    by = {(r["case"], r["mode"], r["baseline"]): r for r in rows}
    assert len(by) == len(rows) == 12 and not any("error" in r for r in rows)
    for r in rows:
        assert math.isfinite(r["median_ms"]) and r["median_ms"] > 0 and r["reps"] >= 2
    for case in ("vit", "dinov2"):
        ours = by[(case, "fp32", False)]
        assert by[(case, "fp32", True)]["attn_implementation"] == "sdpa"
        assert ours["attn_implementation"] == "visionattn_fp32"
        assert ours["attention_function"] == "visionattn_fp32_attention_forward"
    assert by[("flux", "fp32", False)]["routed_per_forward"] == 1
    for case in bench_integrations.CASES:
        ours = by[(case, "fp32", False)]
        # same weights, SDPA vs visionattn's exact FP32 path: within the fp32 mode's contract
        assert 0 <= ours["rel_l2_vs_default"] <= MODES["fp32"].rel_tol, (case, ours["rel_l2_vs_default"])
        assert ours["speedup"] == by[(case, "fp32", True)]["median_ms"] / ours["median_ms"]
        assert ours["target_speedup"] == bench_integrations.TARGETS[case]["fp32"] and ours["target_met"] is None
        assert math.isfinite(by[(case, "bf16", False)]["rel_l2_vs_default"])
        # against the float64 forward: visionattn's rows no further from it than twice the default's (FP32: its
        # contract on top)
        for mode in ("fp32", "bf16"):
            default64 = by[(case, mode, True)]["rel_l2_vs_float64"]
            ours64 = by[(case, mode, False)]["rel_l2_vs_float64"]
            slack = MODES["fp32"].rel_tol if mode == "fp32" else 0.0
            assert 0 <= ours64 <= 2 * default64 + slack, (case, mode, ours64, default64)
    md = open(out + ".md").read()
    for word in ("visionattn_bf16", "FluxTransformerBlock", "transformers 5", "diffusers 0", "command",
                 "rel L2 vs float64"):
        assert word in md
    assert os.path.getsize(out + ".png") > 0


def test_attention_free_rows_give_the_bound(tmp_path):
    """--attention-free: one more row per cell, the default forward with SDPA answering its value rows; it counts
    the SDPA calls it answered (one per layer / block) and its speed-up is the bound on the visionattn row."""
    result = bench_integrations.main(FAST + ["--modes", "fp32", "--attention-free", "--out", str(tmp_path / "b")])
    rows = result["rows"]
    free = {r["case"]: r for r in rows if r["attention"] == bench_integrations.FREE}
    assert set(free) == set(bench_integrations.CASES) and len(rows) == 9
    assert free["vit"]["sdpa_calls_per_forward"] == free["dinov2"]["sdpa_calls_per_forward"] == 2  # 2 tiny layers
    assert free["flux"]["sdpa_calls_per_forward"] == 1
    for case, r in free.items():
        default, ours = [x for x in rows if x["case"] == case and x["attention"] != bench_integrations.FREE]
        assert r["speedup"] == default["median_ms"] / r["median_ms"] == ours["bound"]
        assert "rel_l2_vs_default" not in r and "target_speedup" not in r
    assert "Amdahl" in open(str(tmp_path / "b") + ".md").read()


def test_missing_library_is_skipped(tmp_path, monkeypatch, capsys):
    """diffusers not importable: the flux case is skipped with a printed line, the other cases still run."""
    monkeypatch.setitem(sys.modules, "diffusers", None)
    result = bench_integrations.main(FAST + ["--cases", "dinov2,flux", "--modes", "fp32",
                                             "--out", str(tmp_path / "skip")])
    assert "skipping flux: diffusers is not installed" in capsys.readouterr().out
    assert set(result["skipped"]) == {"flux"} and {r["case"] for r in result["rows"]} == {"dinov2"}
    assert "flux skipped" in open(str(tmp_path / "skip") + ".md").read()
