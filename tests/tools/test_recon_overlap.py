"""The demo decodes the frames in a thread while it builds the model: each one's errors surface (the decode's
before inference), a failing build stops the decode and waits for it, and nothing is left behind."""
import os
import shutil
import threading
import time

import pytest

from testdata import MULTIVIEW
from visionattn.recon import pipeline
from visionattn.recon.images import DecodeStopped, ImageFolderError, load_images

TINY = dict(weights="random-tiny", device="cpu", size=140, preview=False, progress=False, log=lambda *a: None)


def _frames(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(MULTIVIEW, "aloe"), src)
    return src


def test_stop_event_stops_loading_at_the_next_image(tmp_path):
    src = _frames(tmp_path)
    stop = threading.Event()
    stop.set()
    with pytest.raises(DecodeStopped):
        load_images(str(src), size=140, progress=False, stop=stop)


def test_a_decode_error_surfaces_after_the_build_and_before_inference(tmp_path, monkeypatch):
    src = _frames(tmp_path)
    (src / "zz_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")  # sorts last: fails mid-decode
    built = []
    monkeypatch.setattr(pipeline, "run_model", lambda *a, **k: pytest.fail("inference ran"))
    real = pipeline.build_model
    monkeypatch.setattr(pipeline, "build_model", lambda *a, **k: built.append(1) or real(*a, **k))
    with pytest.raises(ImageFolderError, match="zz_broken"):
        pipeline.reconstruct(str(src), str(tmp_path / "out"), **TINY)
    assert built == [1] and not os.path.exists(tmp_path / "out")
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary folder left


def test_a_failing_build_stops_the_decode_and_waits_for_it(tmp_path, monkeypatch):
    src = _frames(tmp_path)
    seen = {}
    real = pipeline.load_source

    def slow_source(*args, stop=None, **kwargs):  # a decode still running when the build fails
        seen["stop"] = stop
        while not stop.is_set():
            time.sleep(0.01)
        time.sleep(0.2)  # it notices late: the error must still wait for it
        seen["finished"] = time.perf_counter()
        return real(*args, stop=stop, **kwargs)

    def failing_build(*args, **kwargs):
        time.sleep(0.1)
        raise pipeline.WeightsError("no weights here")

    monkeypatch.setattr(pipeline, "load_source", slow_source)
    monkeypatch.setattr(pipeline, "build_model", failing_build)
    with pytest.raises(pipeline.WeightsError, match="no weights here") as info:
        pipeline.reconstruct(str(src), str(tmp_path / "out"), **TINY)
    raised = time.perf_counter()
    assert seen["stop"].is_set() and seen["finished"] <= raised
    assert not getattr(info.value, "__notes__", None)  # the decode stopped as asked: no second error to tell
    assert not os.path.exists(tmp_path / "out")
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]


def test_a_second_signal_while_the_decode_is_stopped_does_not_cut_the_wait_short(monkeypatch):
    """A stop signal raises in the build; a second one (SIGHUP twice, say) whose handler raises while the decode is
    being told to stop must not let the error out before the decode has finished: the caller then removes the
    folder the decode writes into, and a frame written after that keeps the folder alive."""

    class SecondSignal(Exception):
        """What a stop signal's handler raises (a KeyboardInterrupt here would stop the test run itself)."""

    real_set = threading.Event.set
    interrupted, finished = [], []

    def set_interrupted_once(self):
        # get_ident, not current_thread(): a starting thread sets an Event before it is registered as a thread
        if threading.get_ident() == threading.main_thread().ident and not interrupted:
            interrupted.append(True)
            raise SecondSignal  # the second signal, as the stop is being set
        return real_set(self)

    monkeypatch.setattr(threading.Event, "set", set_interrupted_once)

    def decode(stop):
        for _ in range(400):  # at most 2 s: a stop that never comes fails the test instead of hanging it
            if stop.is_set():
                break
            time.sleep(0.005)
        time.sleep(0.2)  # the frame in flight
        finished.append("decode")

    def build():
        raise OSError("build failed")

    with pytest.raises(OSError, match="build failed"):
        pipeline._beside(decode, build)
    assert interrupted and finished == ["decode"]


def test_when_both_fail_the_build_error_carries_the_decode_error(tmp_path, monkeypatch):
    src = _frames(tmp_path)
    done = threading.Event()

    def broken_source(*args, **kwargs):
        try:
            raise ImageFolderError("frame 3 is corrupt")
        finally:
            done.set()

    def failing_build(*args, **kwargs):
        done.wait(10)
        raise pipeline.WeightsError("no weights here")

    monkeypatch.setattr(pipeline, "load_source", broken_source)
    monkeypatch.setattr(pipeline, "build_model", failing_build)
    with pytest.raises(pipeline.WeightsError) as info:
        pipeline.reconstruct(str(src), str(tmp_path / "out"), **TINY)
    notes = getattr(info.value, "__notes__", None)
    if hasattr(info.value, "add_note"):  # Python >= 3.11
        assert notes and "frame 3 is corrupt" in notes[0]


def test_decode_and_build_overlap(tmp_path, monkeypatch):
    """Half a second of decode beside half a second of build: the stage takes about half a second, not one."""
    src = _frames(tmp_path)
    real_source, real_build = pipeline.load_source, pipeline.build_model

    def slow(fn):
        def wrapped(*args, **kwargs):
            time.sleep(0.5)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(pipeline, "load_source", slow(real_source))
    monkeypatch.setattr(pipeline, "build_model", slow(real_build))
    res = pipeline.reconstruct(str(src), str(tmp_path / "out"), **TINY)
    own, wall = res["decode_build"], res["seconds"]["decode_build"]
    assert own["side_by_side"] and own["decode"] >= 0.5 and own["build"] >= 0.5
    assert max(own["decode"], own["build"]) <= wall < own["decode"] + own["build"] - 0.3
    assert sum(v for k, v in res["seconds"].items() if k != "total") == pytest.approx(res["seconds"]["total"])
