"""tools/bench_context_parallel.py: --help, bad arguments exit 2, tiny gloo runs on 2 processes under torchrun
(NVLink multicast variables unset in their environment: the tool sets them): the attention alone, and the tiny
VGGT with its frames split across the ranks (--vggt)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "bench_context_parallel.py")
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench_context_parallel  # noqa: E402


def test_help_lists_every_flag():
    res = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for flag in ("--seq", "--mode", "--batch", "--heads", "--head-dim", "--calls", "--repeats", "--warmup",
                 "--no-single", "--device", "--out", "--vggt", "--tiny", "--height", "--width"):
        assert flag in res.stdout


@pytest.mark.parametrize("args", [["--mode", "fp8"], ["--seq", "3,x"], ["--seq", "0"], ["--heads", "0"],
                                  ["--vggt", "3,x"], ["--vggt", "0"], ["--vggt", "3", "--mode", "fp32,pasa"],
                                  ["--vggt", "3", "--height", "50"]])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_context_parallel.main(args + ["--device", "cpu"])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_vggt_frames_below_the_world_size_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")  # as under torchrun with 2 ranks; the check comes before the group starts
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        bench_context_parallel.main(["--device", "cpu", "--tiny", "--vggt", "4,1"])
    assert exc.value.code == 2
    assert "--vggt '4,1'" in capsys.readouterr().err


def test_shards_are_as_even_as_possible():
    bounds = [bench_context_parallel.shard_bounds(10, 3, r) for r in range(3)]
    assert bounds == [(0, 4), (4, 7), (7, 10)]


def test_tiny_gloo_run_on_two_processes(tmp_path):
    out = str(tmp_path / "cp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TOOL,
           "--device", "cpu", "--seq", "37", "--heads", "2", "--head-dim", "8", "--calls", "1", "--repeats", "1",
           "--warmup", "0", "--mode", "fp32,pasa", "--out", out, "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in bench_context_parallel.NVLS_VARIABLES}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.load(open(out + ".json"))
    assert result["world_size"] == 2 and result["environment"]["backend"] == "gloo"
    env = result["environment"]  # NVLink multicast off: set by the tool before init
    assert [env[k] for k in bench_context_parallel.NVLS_VARIABLES] == ["0", "1", "1"]
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"fp32", "pasa"}
    for mode, r in rows.items():
        assert r["shard_tokens"] == [19, 18] and r["ring_ms"] > 0 and r["single_ms"] > 0
        assert r["rel_l2_rank0"] <= 2 * bench_context_parallel.MODES[mode].rel_tol
    assert "| 37 |" in open(out + ".md").read()


@pytest.mark.parametrize("model", ["vggt", "pi3"])
def test_tiny_model_split_across_two_gloo_processes_equals_one(tmp_path, model):
    """--vggt FRAMES with VGGT or π³ (--model pi3): the frames split over two gloo processes give the
    single-process model's outputs on rank 0's frames."""
    out = str(tmp_path / f"cp_{model}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TOOL,
           "--device", "cpu", "--tiny", "--vggt", "3", "--model", model, "--mode", "fp32", "--repeats", "1",
           "--out", out, "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in bench_context_parallel.NVLS_VARIABLES}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.load(open(out + ".json"))
    assert result["world_size"] == 2 and result["environment"]["backend"] == "gloo"
    assert result["model"] == model and len(result["rows"]) == 1
    row = result["rows"][0]
    assert row["frames"] == 3 and row["mode"] == "fp32" and row["world_size"] == 2
    assert row["frames_per_rank"] == [2, 1]  # unequal shards
    assert row["split_s"] > 0 and len(row["split_s_per_rank"]) == 2 and row["single_s"] > 0
    assert row["rel_l2_rank0"] <= 1e-5  # the split model's outputs are the single-process model's
    assert "| 3 | fp32 | 2 | 2+1 |" in open(out + ".md").read()
    assert os.path.getsize(out + ".png") > 0
