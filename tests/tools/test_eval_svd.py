"""tools/eval_svd.py: tiny-random SVD pipeline end to end per mode, metrics, offline errors."""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHOTOS = os.path.join(REPO, "tests", "data", "photos")  # as tests/conftest.py
sys.path.insert(0, os.path.join(REPO, "tools"))

import eval_svd  # noqa: E402

from visionattn.modes import get_mode  # noqa: E402

MODES = ["native", "fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("svd")
    modes = MODES
    res = eval_svd.main(["--model", "tiny-random", "--image", os.path.join(PHOTOS, "apple.jpg"), "--frames", "4",
                         "--steps", "2", "--height", "64", "--width", "64", "--modes", ",".join(modes),
                         "--device", "cpu", "--out", str(out), "--quiet"])
    return res, out, modes


def test_tiny_pipeline_end_to_end_every_mode(tiny_run):
    res, out, modes = tiny_run
    assert list(res["runs"]) == ["fp32"] + [m for m in modes if m != "fp32"]  # reference first
    on_disk = json.load(open(out / "results.json"))
    assert on_disk["runs"].keys() == res["runs"].keys()
    assert "min PSNR dB" in (out / "results.md").read_text()
    assert (out / "compare.png").stat().st_size > 0
    for name, run in res["runs"].items():
        assert (out / f"{name}.mp4").stat().st_size > 0 and (out / f"{name}_grid.png").stat().st_size > 0
        assert run["nonfinite_frames"] == 0 and run["nonfinite_latent_steps"] == []
        assert run["overflow"]["overflow_events"] == 0
        assert run["unet_calls"] == 2 and run["latency_s"] > run["unet_s"] > 0
        assert len(run["per_frame"]["ssim"]) == 4
        if name == "native":
            assert run["patch_report"] is None and run["overflow"]["calls"] == 0
        else:
            rep = run["patch_report"]
            assert rep["mode"] == name and rep["replaced_total"] == rep["attention_modules"] > 0
            assert run["overflow"]["calls"] == 2 * rep["replaced_total"]  # 2 steps (CFG batched in one call)


def test_reference_run_metrics_are_exact_and_other_runs_close(tiny_run):
    res, _, modes = tiny_run
    ref = res["runs"]["fp32"]
    assert ref["min_psnr_db"] == "inf" and ref["min_ssim"] == pytest.approx(1.0) and ref["max_abs"] == 0.0
    for name in modes:
        run = res["runs"][name]
        mode = "fp32" if name == "native" else name
        # a pixel in [0, 1] cannot move by more than ~ the attention contract amplified through
        # 2 denoising steps and the VAE; fp32-grade modes stay at the contract's order
        bound = 1e-3 if get_mode(mode).rel_tol <= 2e-6 else 0.05
        assert run["max_abs"] <= bound, name
        assert run["min_ssim"] >= 1 - bound, name


def test_psnr_and_ssim_match_scikit_image():
    """visionattn.metrics' image metrics, which eval_svd reports per frame."""
    from visionattn import metrics

    skm = pytest.importorskip("skimage.metrics")
    rng = np.random.default_rng(0)
    a = rng.random((40, 48, 3)).astype(np.float32)
    b = np.clip(a + 0.05 * rng.standard_normal(a.shape), 0, 1).astype(np.float32)
    assert metrics.psnr(a, b) == pytest.approx(skm.peak_signal_noise_ratio(a, b, data_range=1.0), rel=1e-6)
    ref = skm.structural_similarity(a, b, channel_axis=-1, data_range=1.0, gaussian_weights=True, sigma=1.5,
                                    use_sample_covariance=False)
    assert metrics._ssim_gaussian(a, b) == pytest.approx(ref, abs=1e-6)  # the no-skimage fallback
    assert metrics.ssim(a, a) == pytest.approx(1.0) and math.isinf(metrics.psnr(a, a))


def test_frame_metrics_skip_nonfinite_frames():
    ref = np.zeros((3, 16, 16, 3), np.float32) + 0.5
    frames = ref.copy()
    frames[1, 0, 0, 0] = np.nan
    frames[2] += 0.1
    m = eval_svd.frame_metrics(frames, ref)
    assert m["psnr_db"][1] is None and m["ssim"][1] is None
    assert m["psnr_db"][2] == pytest.approx(20.0) and m["max_abs"][2] == pytest.approx(0.1)


def test_offline_hub_model_fails_fast_naming_id_and_local_dir():
    model = "stabilityai/stable-video-diffusion-img2vid-xt"
    with pytest.raises(RuntimeError) as e:
        eval_svd.load_pipeline(model, torch.float16, "cpu", offline=True)
    msg = str(e.value)
    assert model in msg and "--model DIR" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(FileNotFoundError, match="not a directory"):
        eval_svd.load_pipeline("./no/such/svd", torch.float32, "cpu")


def test_mode_parsing_and_dtypes():
    assert eval_svd.parse_modes("fp16,pasa,fp16", "fp32") == ["fp32", "fp16", "pasa"]
    with pytest.raises(ValueError, match="fp8"):
        eval_svd.parse_modes("fp8", "fp32")
    assert eval_svd.run_dtype("pasa", "auto", "cuda") == torch.float16
    assert eval_svd.run_dtype("tf32", "auto", "cuda") == torch.float32
    assert eval_svd.run_dtype("pasa", "auto", "cpu") == torch.float32
    assert eval_svd.run_dtype("native-fp16", "fp32", "cpu") == torch.float16


GEN = ["--model", "tiny-random", "--image", os.path.join(PHOTOS, "apple.jpg"), "--frames", "2", "--steps", "1",
       "--height", "64", "--width", "64", "--modes", "fp32", "--device", "cpu", "--quiet"]


@pytest.mark.parametrize("bad, flag", [
    (["--height", "60"], "--height"),
    (["--frames", "0"], "--frames"),
    (["--steps", "-1"], "--steps"),
    (["--modes", "fp8"], "--modes"),
    (["--image", "no/such/photo.jpg"], "--image"),
    (["--model", "./no/such/svd"], "--model"),
    (["--noise-aug", "-0.5"], "--noise-aug"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
])
def test_bad_arguments_exit_2_with_one_line_and_no_folder(bad, flag, tmp_path, capsys):
    out = tmp_path / "svd_out"
    with pytest.raises(SystemExit) as e:
        eval_svd.main(GEN + bad + ["--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err, err
    assert not out.exists()  # no empty output folder left behind


def test_unwritable_output_found_first(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        eval_svd.main(GEN + ["--out", str(blocker / "svd")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
