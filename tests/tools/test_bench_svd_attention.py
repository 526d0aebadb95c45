"""tools/bench_svd_attention.py: SVD attention cases at real shapes, attention and UNet benchmarks on small shapes."""
import os
import sys

import pytest
import torch

pytest.importorskip("diffusers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))

import bench_svd_attention  # noqa: E402

from visionattn.modes import get_mode  # noqa: E402


def test_attention_bench_small_shapes_cpu(tmp_path):
    cases = bench_svd_attention.svd_attention_cases(576, 1024, 25, 4)
    first = cases[0]  # the PASA paper's SVD overflow shape [50, 5, 9216, 64]
    assert (first["sequences"], first["heads"], first["tokens"], first["head_dim"]) == (50, 5, 9216, 64)
    assert {c["kind"] for c in cases} == {"spatial-self", "spatial-cross", "temporal-self", "temporal-cross"}
    out = str(tmp_path / "bench")
    res = bench_svd_attention.main(["--device", "cpu", "--height", "32", "--width", "48", "--frames", "3",
                                    "--bench-levels", "1", "--bench-reps", "1", "--bench-warmup", "0",
                                    "--modes", "native-fp32,fp32,fp16", "--out", out, "--quiet"])
    assert len(res["cases"]) == 4 and os.path.getsize(out + ".md") > 0
    for case in res["cases"]:
        r = case["runs"]
        assert all(v["finite"] for v in r.values())
        assert r["fp32"]["rel_l2_vs_native_fp32"] <= 1e-5
        assert r["fp16"]["rel_l2_vs_native_fp32"] <= 10 * get_mode("fp16").rel_tol


@pytest.mark.gpu
def test_unet_bench_gpu_small(tmp_path):
    res = bench_svd_attention.main(["--unet-bench", "--height", "128", "--width", "128", "--frames", "4",
                                    "--bench-reps", "2", "--modes", "native-fp32,native-fp16,fp32,fp16,pasa",
                                    "--out", str(tmp_path / "u"), "--quiet"])
    assert all(r["finite"] for r in res["runs"].values())
    assert res["runs"]["fp32"]["rel_l2_vs_native_fp32"] <= 1e-4


def test_unet_bench_tiny_config_cpu(tmp_path):
    out = str(tmp_path / "unet")
    res = bench_svd_attention.main(["--unet-bench", "--unet-config", "tiny", "--device", "cpu", "--height", "64",
                                    "--width", "64", "--frames", "3", "--bench-reps", "1", "--bench-warmup", "0",
                                    "--modes", "native-fp32,fp32,bf16", "--out", out, "--quiet"])
    assert list(res["runs"]) == ["native-fp32", "fp32", "bf16"] and os.path.getsize(out + ".md") > 0
    assert all(r["finite"] for r in res["runs"].values())
    assert res["runs"]["native-fp32"]["rel_l2_vs_native_fp32"] == 0.0
    assert res["runs"]["fp32"]["rel_l2_vs_native_fp32"] <= 1e-5
    assert res["runs"]["fp32"]["overflow"]["calls"] > 0 and res["runs"]["native-fp32"]["overflow"] is None


@pytest.mark.parametrize("bad, flag", [
    (["--height", "60"], "--height"),
    (["--frames", "0"], "--frames"),
    (["--modes", "fp8"], "--modes"),
    (["--bench-levels", "5"], "--bench-levels"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
])
def test_bad_arguments_exit_2_with_one_line_and_no_output(bad, flag, tmp_path, capsys):
    out = tmp_path / "bench"
    with pytest.raises(SystemExit) as e:
        bench_svd_attention.main(["--device", "cpu", "--quiet"] + bad + ["--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err, err
    assert os.listdir(tmp_path) == []


def test_folder_as_output_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # the bench writes OUT.json / OUT.md: a folder there is refused
        bench_svd_attention.main(["--device", "cpu", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
