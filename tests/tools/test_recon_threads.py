"""visionattn.recon.points.thread_imap, the frames' conversion threads: results in order, a bounded number of items
in flight, errors where their result is taken, nothing running once the generator is closed; the loaders give the
same bytes with one thread or several."""
import os
import threading
import time

import pytest
import torch

from testdata import MULTIVIEW
from visionattn.recon import points
from visionattn.recon.points import thread_imap


def test_results_in_order_with_a_bounded_window():
    drawn, running, most = [], [0], [0]
    lock = threading.Lock()

    def items():
        for i in range(40):
            drawn.append(i)
            yield i

    def fn(i):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002 * (i % 3))  # finishing out of order
        with lock:
            running[0] -= 1
        return i * i

    out = []
    for value in thread_imap(fn, items(), workers=3, window=4):
        out.append(value)
        assert len(drawn) <= len(out) + 4  # drawn lazily: at most the window ahead of what was taken
    assert out == [i * i for i in range(40)] and most[0] <= 3


def test_an_error_is_raised_in_order_and_close_waits_for_the_running():
    done_after_close = []

    def fn(i):
        if i == 5:
            raise ValueError("frame 5")
        time.sleep(0.01)
        done_after_close.append(i)
        return i

    gen = thread_imap(fn, range(100), workers=4)
    got = []
    with pytest.raises(ValueError, match="frame 5"):
        for value in gen:
            got.append(value)
    assert got == [0, 1, 2, 3, 4]
    finished = len(done_after_close)
    time.sleep(0.1)
    assert len(done_after_close) == finished < 100  # nothing runs on, the rest was dropped
    assert not [t for t in threading.enumerate() if t.name.startswith("recon_")]


def test_video_and_images_load_the_same_with_one_thread_or_several(tmp_path, monkeypatch):
    from visionattn.recon.images import load_images
    from visionattn.recon.video import load_video

    cv2 = pytest.importorskip("cv2")
    import numpy as np

    video_path = str(tmp_path / "pattern.avi")  # a textured pattern, shifted 3 px a frame (MJPEG)
    writer = cv2.VideoWriter(video_path, cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (96, 64))
    texture = np.random.default_rng(0).integers(0, 255, (64, 96 + 3 * 16, 3), dtype=np.uint8)
    for i in range(16):
        writer.write(np.ascontiguousarray(texture[:, 3 * i:3 * i + 96]))
    writer.release()
    runs = {}
    for workers in (1, 4):
        monkeypatch.setattr(points, "worker_count", lambda w, tasks=None, n=workers: n)
        frames = tmp_path / f"frames{workers}"
        frames.mkdir()
        video = load_video(video_path, size=140, max_frames=12, progress=False, frames_dir=str(frames))
        stored = tmp_path / f"images{workers}"
        stored.mkdir()
        images = load_images(os.path.join(MULTIVIEW, "aloe"), size=140, progress=False, frames_dir=str(stored))
        runs[workers] = (video, frames, images, stored)
    (v1, f1, i1, s1), (v4, f4, i4, s4) = runs[1], runs[4]
    assert torch.equal(i1.images, i4.images) and i1.image_files == i4.image_files
    assert all((s1 / f).read_bytes() == (s4 / f).read_bytes() for f in i1.image_files)
    assert len(v1.image_files) == 12
    assert torch.equal(v1.images, v4.images) and v1.image_files == v4.image_files and v1.extra == v4.extra
    assert all((f1 / f).read_bytes() == (f4 / f).read_bytes() for f in v1.image_files)
