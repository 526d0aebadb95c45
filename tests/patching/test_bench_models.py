"""tools/bench_models.py runs end to end on CPU and writes consistent markdown / JSON / PNG."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench_models  # noqa: E402


def test_bench_models_cpu_smoke(tmp_path):
    out = str(tmp_path / "models")
    args = bench_models.parser.parse_args(["--quick", "--device", "cpu", "--modes", "fp32",
                                           "--cases", "vit_tiny_patch16_224:32:2", "--rep-ms", "1", "--rounds", "2",
                                           "--out", out])
    result = bench_models.main(args)
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"unpatched", "no-attention", "fp32"}
    patched = rows["fp32"]
    assert patched["patched"] == {"timm.layers.attention.Attention": 12}
    assert patched["logits_rel_l2_vs_unpatched"] <= 1e-5 and patched["top1_agree"] == 1.0
    assert patched["speedup"] == rows["unpatched"]["median_ms"] / patched["median_ms"]
    assert patched["img_per_s"] == 2 / (patched["median_ms"] / 1e3)
    # interleaved rounds: every variant sampled in each of the 2 rounds, samples pooled
    assert all(r["rounds"] == 2 and r["reps"] >= 2 for r in rows.values())
    assert patched["p10_ms"] <= patched["median_ms"] <= patched["p90_ms"]
    with open(out + ".json") as f:
        assert json.load(f)["rows"] == json.loads(json.dumps(result["rows"], default=str))
    md = open(out + ".md").read()
    assert "vit_tiny_patch16_224" in md and "'allow_tf32_matmul': False" in md
    assert os.path.getsize(out + ".png") > 0 and result["environment"]["command"]


def test_memory_target_in_mib_with_slack():
    """A patched peak 63 KiB above a 1.6 GiB unpatched one meets "<= 1.0"; 16 MiB above does not."""
    base = dict(model="m", img=224, batch=8, dtype="float32")
    target = dict(model="m", img=224, batch=8, mode="fp32", min_speedup=1.0, max_mem_ratio=1.0)

    def met(extra_mib):
        rows = [dict(base, mode="unpatched", peak_mib=1622.97, attn_share=0.5),
                dict(base, mode="fp32", speedup=1.5, peak_mib=1622.97 + extra_mib,
                     mem_ratio=(1622.97 + extra_mib) / 1622.97)]
        return bench_models.check_targets(rows, [target])[0]["met"]

    assert met(0.06) and met(-5.0)
    assert not met(16.0)


def test_targets_report_the_amdahl_bound():
    """share 0.15 of the unpatched time in attention: no attention kernel can give more than 1/0.85."""
    base = dict(model="m", img=224, batch=64, dtype="float32")
    rows = [dict(base, mode="unpatched", peak_mib=100.0, attn_share=0.15),
            dict(base, mode="fp32", speedup=1.14, peak_mib=100.0, mem_ratio=1.0)]
    targets = [dict(model="m", img=224, batch=64, mode="fp32", min_speedup=1.3),
               dict(model="m", img=224, batch=64, mode="fp32", min_speedup=1.1)]
    hard, easy = bench_models.check_targets(rows, targets)
    assert abs(hard["amdahl_bound"] - 1 / 0.85) < 1e-12
    assert not hard["met"] and easy["met"]
    assert bench_models._met(hard) == "NO (target above the bound)" and bench_models._met(easy) == "yes"


def test_bench_models_compile_cpu(tmp_path, capsys):
    """--compile times torch.compile'd forwards (one round) and checks each against the eager output."""
    out = str(tmp_path / "models_compiled")
    args = bench_models.parser.parse_args(["--device", "cpu", "--modes", "fp32", "--no-share", "--warmup", "1",
                                           "--cases", "vit_tiny_patch16_224:32:1", "--rep-ms", "1",
                                           "--compile", "default", "--out", out])
    result = bench_models.main(args)
    rows = {r["mode"]: r for r in result["rows"]}
    assert result["settings"]["compile"] == "default" and all(r["rounds"] == 1 for r in rows.values())
    assert rows["unpatched"]["compiled_rel_l2"] <= 1e-5 and rows["fp32"]["compiled_rel_l2"] <= 1e-5
    assert "torch.compile timing" in open(out + ".md").read()
    with pytest.raises(SystemExit) as exc:  # one line, exit 2
        bench_models.main(bench_models.parser.parse_args(["--device", "cpu", "--compile", "default", "--cuda-graph",
                                                          "--out", str(tmp_path / "x")]))
    assert exc.value.code == 2 and "pick one" in capsys.readouterr().err


@pytest.mark.parametrize("bad, flag", [(["--cases", "vit_tiny_patch16_224:32"], "--cases"),
                                       (["--modes", "fp32,fp9"], "--modes"), (["--case-slice", "5"], "--case-slice"),
                                       (["--rounds", "0"], "--rounds"), (["--device", "cpu", "--cuda-graph"],
                                                                         "--cuda-graph")])
def test_bad_arguments_exit_2_with_one_line(bad, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_models.main(bench_models.parser.parse_args(bad + ["--out", str(tmp_path / "new" / "r")]))
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and flag in err[0], err
    assert not (tmp_path / "new").exists()
