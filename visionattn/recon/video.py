"""Video files -> VGGT input tensors, decoded as a stream.

Anything OpenCV's ``VideoCapture`` reads (MP4/H.264, AVI/MJPEG, MOV, MKV, ...)
is decoded frame by frame; only the sampled frames are converted, and each is
preprocessed (see :mod:`visionattn.recon.images`) and, optionally, stored as a
JPEG at its original resolution right away, so memory holds one full-resolution
frame at a time plus the preprocessed batch.

Sampling: every frame by default; ``every=N`` keeps frames 0, N, 2N, ...;
``fps=F`` keeps the first frame of each 1/F-second interval (by the container's
frame rate); ``max_frames`` stops decoding once that many frames are kept.
"""
from __future__ import annotations

import math
import os

from .images import (ImageFolderError, LoadedImages, _preprocess, check_aspect, check_stop, stack_padded,
                     store_frame)
from .points import thread_imap

__all__ = ["VIDEO_EXTS", "is_video", "frame_selector", "expected_frames", "load_video"]

VIDEO_EXTS = frozenset({".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm", ".mpg", ".mpeg", ".wmv", ".flv",
                        ".3gp", ".ts", ".mts", ".m2ts", ".ogv"})


def is_video(path: str) -> bool:
    """True if ``path`` is a regular file with a video extension."""
    return os.path.isfile(path) and os.path.splitext(path)[1].lower() in VIDEO_EXTS


def frame_selector(video_fps: float, fps: float | None = None, every: int | None = None):
    """A predicate ``keep(index) -> bool`` over frame indices 0, 1, 2, ... (called in order).

    Args:
        video_fps: the container's frame rate (frames per second; <= 0 if unknown).
        fps: keep about this many frames per second of video (None: no time sampling).
        every: keep every N-th frame (None: no index sampling).

    An ``fps`` at or above ``video_fps`` keeps every frame.

    Raises:
        ValueError: both ``fps`` and ``every`` given, ``every`` < 1, ``fps`` not a finite number > 0, or
            ``fps`` given for a video whose frame rate is unknown.
    """
    if fps is not None and every is not None:
        raise ValueError("--fps and --every are exclusive: pass one of them")
    if every is not None:
        if every < 1:
            raise ValueError(f"--every {every} must be >= 1")
        return lambda i: i % every == 0
    if fps is not None:
        if not (fps > 0 and math.isfinite(fps)):
            raise ValueError(f"--fps {fps} must be a finite number > 0")
        if not (video_fps > 0 and math.isfinite(video_fps)):
            raise ImageFolderError("the video does not state its frame rate, so --fps cannot sample it; "
                                   "use --every N instead")
        if fps >= video_fps:  # every 1/fps interval starts a new frame (and i * fps stays finite below)
            return lambda i: True
        state = {"next": 0}

        def keep(i):
            bucket = math.floor(i * fps / video_fps + 1e-9)  # which 1/fps interval frame i starts in
            if bucket >= state["next"]:
                state["next"] = bucket + 1
                return True
            return False
        return keep
    return lambda i: True


def expected_frames(total: int, video_fps: float, fps: float | None = None, every: int | None = None,
                    max_frames: int | None = None) -> int:
    """The frames :func:`load_video` keeps from a video of ``total`` frames (as its container states; 0 when
    unknown gives 0), sampled as :func:`frame_selector` and capped at ``max_frames``."""
    keep = frame_selector(video_fps, fps, every)
    kept = sum(1 for i in range(max(0, total)) if keep(i))
    return kept if max_frames is None else min(kept, max_frames)


def load_video(path: str, size: int = 518, mode: str = "crop", fps: float | None = None,
               every: int | None = None, max_frames: int | None = None, progress: bool = True,
               frames_dir: str | None = None, stop=None, on_first_frame=None) -> LoadedImages:
    """Decode, sample and preprocess a video into one VGGT batch.

    Args:
        path: a video file OpenCV reads.
        size, mode: preprocessing (see :func:`visionattn.recon.images.preprocess_image`).
        fps, every: sampling (see :func:`frame_selector`).
        max_frames: stop after this many kept frames (None: to the end).
        progress: tqdm bar over the decoded frames.
        frames_dir: if given, each kept frame is stored there as ``frame_NNNNNN.jpg``
            (original resolution; NNNNNN = frame index in the video).
        stop: a :class:`threading.Event`: once it is set, decoding stops before the next frame
            (:class:`~visionattn.recon.images.DecodeStopped`).
        on_first_frame: called once, on this thread, with ``(frames, H, W)`` as soon as the first kept frame is
            preprocessed: the frames the container's frame count, the sampling and ``max_frames`` predict (0
            when the container states no count; the final count can differ) and that frame's size, so a
            caller can start work that depends on the shapes (e.g. compiling kernels) before the decode ends.

    Returns:
        :class:`~visionattn.recon.images.LoadedImages`: ``images`` float32 [S, 3, H, W]
        in [0, 1], names ``frame_NNNNNN``, sources ``VIDEO#frame=N``, and ``extra``
        with ``video`` (path), ``video_fps``, ``video_frames`` (as the container states),
        ``frame_indices`` and ``timestamps_s``.

    Raises:
        ImageFolderError: the file cannot be opened or decoded, no frame is kept,
            or the frames are degenerate (see :func:`~visionattn.recon.images.check_aspect`).
        ValueError: bad sampling arguments.
    """
    import cv2
    from PIL import Image
    from tqdm.auto import tqdm

    if max_frames is not None and max_frames < 1:
        raise ValueError(f"max_frames={max_frames} must be >= 1 (or None for all frames)")
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        raise ImageFolderError(f"cannot open video {path!r}: OpenCV's VideoCapture does not read it "
                               "(unknown container or codec, or not a video)")
    try:
        video_fps = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        keep = frame_selector(video_fps, fps, every)
        name = os.path.basename(path)
        bar = tqdm(total=total if total > 0 else None, desc="decoding video", unit="frame",
                   disable=not progress)
        read = {"frames": 0}

        def kept_frames():
            """(index, BGR frame) of each kept frame, decoded here, in order (OpenCV's reader is sequential)."""
            index, kept = 0, 0
            while max_frames is None or kept < max_frames:
                check_stop(stop)
                if not cap.grab():  # decodes, but converts nothing: skipped frames stay cheap
                    break
                bar.update()
                if keep(index):
                    ok, bgr = cap.retrieve()
                    if not ok or bgr is None:
                        raise ImageFolderError(f"cannot decode frame {index} of video {path!r}")
                    kept += 1
                    yield index, bgr
                index += 1
                read["frames"] = index

        def convert(item):
            """One kept frame to the model's uint8 tensor (and its JPEG), on a worker thread: OpenCV's colour
            conversion, PIL's resampling and JPEG encoder let go of the GIL, so frames convert side by side."""
            index, bgr = item
            img = Image.fromarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
            check_aspect(*img.size, name=f"video {path!r}")
            t, affine = _preprocess(img, size, mode)
            file = store_frame(frames_dir, f"frame_{index:06d}", img, ext=".jpg") if frames_dir is not None else None
            return index, t, affine, img.size, file

        Image.init()  # every format plugin imported here: the workers import nothing (see thread_imap)
        tensors, affines, sizes, indices, files = [], [], [], [], []
        converted = thread_imap(convert, kept_frames(), name="recon-frames")
        try:
            for index, t, affine, wh, file in converted:
                if on_first_frame is not None and not tensors:
                    on_first_frame(expected_frames(total, video_fps, fps, every, max_frames), *t.shape[-2:])
                tensors.append(t)
                affines.append(affine)
                sizes.append(wh)
                indices.append(index)
                if file is not None:
                    files.append(file)
        finally:
            converted.close()  # on an error: the frames in flight finish before the reader is released
        bar.close()
        index = read["frames"]
    finally:
        cap.release()
    if not tensors:
        raise ImageFolderError(f"no frame decoded from video {path!r} ({index} frames read)")
    times = [i / video_fps if video_fps > 0 else None for i in indices]
    return LoadedImages(
        images=stack_padded(tensors, affines), paths=[path] * len(indices), names=[f"frame_{i:06d}" for i in indices],
        original_sizes=sizes, mode=mode, affines=affines, image_files=files,
        sources=[f"{name}#frame={i}" for i in indices],
        extra={"video": os.path.abspath(path), "video_fps": video_fps, "video_frames": total,
               "frame_indices": indices, "timestamps_s": times, "frames_read": index})
