"""How long the forward will take: the FLOP count against the operations a forward runs, how the estimate grows with
frames, and the demo's line before inference (and its warning, with the fix, when a CPU run would take minutes)."""
import json
import math
import os
import re
import shutil
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from testdata import MULTIVIEW, load_script

from visionattn.recon import pipeline
from visionattn.recon.video import frame_selector

demo = load_script("demos/reconstruct.py", "reconstruct_demo_estimate")


class CountFlops(TorchDispatchMode):
    """FLOPs of the operations run inside it: torch's own formulas (matmul, linear, convolution) under "dense",
    SDPA's CPU kernel (4 B H Nq Nk D) under "attention"."""

    def __init__(self):
        super().__init__()
        self.flops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if "scaled_dot_product" in str(packet) and "backward" not in str(packet):
            q, k = args[0], args[1]
            self.flops["attention"] += 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        elif packet in flop_registry:
            def shape(t):
                return t.shape if isinstance(t, torch.Tensor) else t

            self.flops["dense"] += flop_registry[packet](*tree_map(shape, args), **tree_map(shape, kwargs),
                                                         out_val=out)
        return out


@pytest.mark.parametrize("model_name", pipeline.MODELS)
def test_flop_count_is_that_of_the_forward(model_name):
    """forward_flops of the tiny configs equals, within 3 %, the FLOPs of the products a forward runs (SDPA
    attention, so that attention is one countable op); attention alone matches where no tokens merge."""
    config = pipeline._estimate_config(model_name, "random-tiny")
    net = pipeline.build_model(model_name, "random-tiny", mode="sdpa")
    for S, H, W in [(1, 56, 56), (5, 112, 140)]:
        counter = CountFlops()
        with counter, torch.no_grad():
            net(torch.rand(S, 3, H, W))
        got = counter.flops
        est = pipeline.forward_flops(model_name, S, H, W, config)
        assert got["attention"] > 0 and got["dense"] > 0
        assert est["dense"] + est["attention"] == pytest.approx(got["dense"] + got["attention"], rel=0.03)
        if model_name != "fastvggt" or S == 1:  # FastVGGT's merge similarities are matmuls the counter calls dense
            assert est["attention"] == pytest.approx(got["attention"], rel=0.01)


@pytest.mark.parametrize("model_name", pipeline.MODELS)
def test_estimate_linear_in_frames_until_global_attention_dominates(model_name):
    """The network's products are per frame (exactly linear in frames); attention's grow faster (global
    attention: quadratic in all frames' tokens). Doubling the frames: the estimate about doubles at 1 frame, and the
    factor grows with the frames towards 4 as global attention takes over."""
    hw = (392, 518)
    flops = {s: pipeline.forward_flops(model_name, s, *hw) for s in (1, 2, 100, 200)}
    assert flops[2]["dense"] == pytest.approx(2 * flops[1]["dense"], rel=1e-9)
    assert flops[200]["dense"] == pytest.approx(200 * flops[1]["dense"], rel=1e-9)
    assert flops[200]["attention"] > 3.5 * flops[100]["attention"]
    frames = [2 ** i for i in range(11)]  # 1 .. 1024
    seconds = {s: pipeline.estimate_seconds(model_name, s, *hw, "cpu", "fp32") for s in frames}
    factor = [seconds[2 * s] / seconds[s] for s in frames[:-1]]
    assert 2.0 < factor[0] < 2.3 and factor[-1] > 3.8
    assert factor == sorted(factor)
    # larger frames cost more; the tiny config far less; a GPU far less than a CPU
    assert pipeline.estimate_seconds(model_name, 4, 518, 518) > seconds[4]
    tiny = pipeline._estimate_config(model_name, "random-tiny")
    assert pipeline.estimate_seconds(model_name, 4, *hw, config=tiny) < seconds[4] / 10
    assert pipeline.estimate_seconds(model_name, 256, *hw, "cuda", "fp32") < seconds[256] / 100


def test_fastvggt_merging_cuts_the_global_attention():
    vggt, fast = (pipeline.forward_flops(m, 200, 392, 518) for m in ("vggt", "fastvggt"))
    assert fast["dense"] == vggt["dense"] and fast["attention"] < 0.3 * vggt["attention"]


def test_modes_and_devices_take_their_table_rates(monkeypatch):
    """The estimate divides by THROUGHPUT: the network's FLOPs by the device's dense rate (on a GPU the half modes'
    autocast rate), attention's by the mode's (halving one rate doubles that part)."""
    f = pipeline.forward_flops("vggt", 50, 392, 518)
    for kind, device in (("cpu", "cpu"), ("cuda", "cuda")):
        rate = pipeline.THROUGHPUT[kind]
        for mode in pipeline.ATTN_MODES:
            est = pipeline.estimate_seconds("vggt", 50, 392, 518, device, mode)
            half = kind == "cuda" and mode in ("fp16", "bf16", "pasa")
            dense = rate["dense-half" if half else "dense"]
            expected = (f["dense"] / dense + f["attention"] / rate[mode]) / pipeline._cuda_scale(device)
            assert est == pytest.approx(expected, rel=1e-12)
    assert pipeline.estimate_seconds("vggt", 50, 392, 518, "cpu", "sdpa") < pipeline.estimate_seconds(
        "vggt", 50, 392, 518, "cpu", "pasa")
    before = pipeline.estimate_seconds("vggt", 50, 392, 518, "cpu", "fp32")
    monkeypatch.setitem(pipeline.THROUGHPUT["cpu"], "fp32", pipeline.THROUGHPUT["cpu"]["fp32"] / 2)
    after = pipeline.estimate_seconds("vggt", 50, 392, 518, "cpu", "fp32")
    assert after - before == pytest.approx(f["attention"] / pipeline.THROUGHPUT["cpu"]["fp32"] / 2, rel=1e-9)


def test_estimate_errors_and_units():
    for bad in (dict(model="nope"), dict(mode="fp64"), dict(frames=0), dict(height=100), dict(width=0)):
        args = dict(model="vggt", frames=2, height=392, width=518, mode="fp32") | bad
        with pytest.raises(ValueError):
            pipeline.estimate_seconds(**args)
    assert [pipeline.format_seconds(s) for s in (0.001, 0.45, 12.3, 59, 60, 150, 3000, 5400, 9000, 68400)] == [
        "0.1 s", "0.45 s", "12 s", "59 s", "1 min", "2 min", "50 min", "1.5 h", "2.5 h", "19 h"]


def test_cpu_warning_names_max_frames_and_fps():
    """217 frames of a 16:9 video on a CPU with VGGT-1B (the estimate's inputs only: no model runs): a warning
    naming --max-frames N, N the most frames estimated within a minute, and for the video --fps F, F spreading
    about N frames over it; none on a GPU or for a short run."""
    args = ("vggt", 217, 294, 518, "cpu", "fp32")
    line = pipeline.slow_cpu_warning(*args)
    assert line is not None and "\n" not in line
    assert f"about {pipeline.format_seconds(pipeline.estimate_seconds(*args))}" in line
    n = int(re.search(r"--max-frames (\d+)", line).group(1))
    est = [pipeline.estimate_seconds("vggt", k, 294, 518, "cpu", "fp32") for k in (n, n + 1)]
    assert est[0] <= pipeline.TARGET_CPU_SECONDS < est[1]
    assert "--fps" not in line  # images: no --fps
    video = {"video_fps": 30.0, "video_frames": 651}  # 21.7 s
    line = pipeline.slow_cpu_warning(*args, video=video)
    f = float(re.search(r"--fps ([0-9.]+)", line).group(1))
    keep = frame_selector(30.0, fps=f)
    assert max(1, n - 1) <= sum(keep(i) for i in range(651)) <= n
    assert f"--max-frames {n}" in line
    assert "--fps F" in pipeline.slow_cpu_warning(*args, video={"video_fps": 0.0, "video_frames": 0})
    assert pipeline.slow_cpu_warning("vggt", 217, 294, 518, "cuda", "fp32", video=video) is None
    assert pipeline.slow_cpu_warning("vggt", 2, 294, 518, "cpu", "fp32", video=video) is None


class _Stop(Exception):
    pass


def _write_video(path, n=20, w=160, h=120, fps=10.0):
    cv2 = pytest.importorskip("cv2")
    import numpy as np

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    rng = np.random.default_rng(0)
    for _ in range(n):
        writer.write(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    writer.release()
    return str(path)


@pytest.mark.parametrize("quiet", [False, True])
@pytest.mark.parametrize("kind", ["video", "images"])
def test_demo_says_how_long_before_inference(kind, quiet, tmp_path, monkeypatch, capsys):
    """The demo logs "inference: about X (N frames of HxW, mode, device)" before the forward starts (--quiet: not),
    and on a CPU run estimated over 2 minutes a one-line warning naming --max-frames (and --fps for a video), also
    with --quiet. The tiny model is built; only the estimate is told the released VGGT-1B config, and the forward is
    stopped as it starts."""
    if kind == "video":
        src = _write_video(tmp_path / "clip.avi")
    else:
        src = str(tmp_path / "rig")
        shutil.copytree(os.path.join(MULTIVIEW, "stereo_rig"), src)
    monkeypatch.setattr(pipeline, "_estimate_config", lambda model, weights: None)
    seen = {}

    def stop(model, images, *args, **kwargs):
        seen["stderr"] = capsys.readouterr().err  # what was said before the forward
        seen["frames"], seen["hw"] = images.shape[0], tuple(images.shape[-2:])
        raise _Stop

    monkeypatch.setattr(pipeline, "run_model", stop)
    with pytest.raises(_Stop):
        demo.main([src, "--out", str(tmp_path / "out"), "--weights", "random-tiny", "--device", "cpu",
                   "--size", "518", "--no-preview", *(["--quiet"] if quiet else [])])
    err = seen["stderr"]
    S, (H, W) = seen["frames"], seen["hw"]
    expected = pipeline.estimate_seconds("vggt", S, H, W, "cpu", "fp32")
    assert expected > pipeline.SLOW_CPU_SECONDS
    info = [ln for ln in err.splitlines() if ln.startswith("inference: about")]
    if quiet:
        assert not info
    else:
        assert info == [f"inference: about {pipeline.format_seconds(expected)} ({S} frames of {H}x{W}, fp32, cpu)"]
    warns = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
    assert len(warns) == 1 and f"{S} frames of {H}x{W} on the CPU" in warns[0]
    n = pipeline.frames_within(pipeline.TARGET_CPU_SECONDS, "vggt", H, W)
    assert f"--max-frames {n}" in warns[0]
    assert ("--fps " in warns[0]) == (kind == "video")
    assert not os.path.exists(tmp_path / "out")


def test_summary_json_carries_the_estimate(tmp_path, capsys):
    """summary.json: estimate_s (the tiny model's estimate, as logged) beside the measured inference_seconds; a
    quick --quiet run prints neither the estimate line nor a warning."""
    res = demo.main([os.path.join(MULTIVIEW, "aloe"), "--out", str(tmp_path / "o"), "--weights", "random-tiny",
                     "--device", "cpu", "--size", "140", "--no-preview", "--quiet"])
    err = capsys.readouterr().err
    assert res["exit_code"] == 0
    summary = json.load(open(tmp_path / "o" / "summary.json"))
    H, W = summary["image_hw"]
    tiny = pipeline._estimate_config("vggt", "random-tiny")
    assert summary["estimate_s"] == pytest.approx(pipeline.estimate_seconds("vggt", summary["frames"], H, W,
                                                                            "cpu", "fp32", tiny), rel=1e-12)
    assert summary["inference_seconds"] > 0 and math.isfinite(summary["estimate_s"])
    assert "inference: about" not in err and "warning:" not in err


def test_cuda_estimate_scales_with_the_device(monkeypatch):
    """On CUDA the H100 rates are scaled by the device's SM count against 132 (x 0.35 before Hopper), read from
    torch.cuda only when CUDA is available; the log names the device."""
    from types import SimpleNamespace

    h100 = pipeline.estimate_seconds("vggt", 100, 392, 518, "cuda", "bf16")
    if not torch.cuda.is_available():  # no CUDA: the H100 rates as they are, no torch.cuda query
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: pytest.fail("queried without CUDA"))
        assert pipeline.estimate_seconds("vggt", 100, 392, 518, "cuda:0", "bf16") == h100
        assert pipeline._device_label("cuda:0") == "cuda:0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = {"half": SimpleNamespace(multi_processor_count=66, major=9),
             "ampere": SimpleNamespace(multi_processor_count=132, major=8)}
    for name, expected in (("half", 2 * h100), ("ampere", h100 / 0.35)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, p=props[name]: p)
        assert pipeline.estimate_seconds("vggt", 100, 392, 518, "cuda", "bf16") == pytest.approx(expected)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert pipeline._device_label("cuda:0") == "cuda:0 (NVIDIA H200)"
    assert pipeline._device_label("cpu") == "cpu"
