"""Known cameras for Pi3X: intrinsics and poses read from a COLMAP model or a ``transforms.json``.

:func:`read_camera_file` reads either

* a COLMAP model folder (``sparse/0`` with ``cameras.bin`` / ``images.bin`` or the ``.txt`` files; read with
  pycolmap): per image its ``calibration_matrix()`` (pinhole part of any camera model; distortion is
  ignored) in pixels of the image COLMAP saw, and the camera-to-world pose, the inverse of COLMAP's
  ``cam_from_world`` (COLMAP cameras use OpenCV axes already); or
* a ``transforms.json`` (nerfstudio / instant-ngp / NeRF): per frame ``transform_matrix``, an OpenGL
  camera-to-world (x right, y up, z back), turned into OpenCV axes by ``c2w @ diag(1, -1, -1, 1)``; intrinsics
  from ``fl_x``, ``fl_y``, ``cx``, ``cy``, ``w``, ``h`` of the frame or of the file's top level (missing
  ``fl_y``: ``fl_x``; missing ``cx``, ``cy``: the image centre), or from ``camera_angle_x`` (and
  ``camera_angle_y``) as in the original NeRF scenes, with the image size taken from the source image when
  the file gives none.

Both keep pixel coordinates continuous (pixel (i, j) centred at (i + 0.5, j + 0.5)), as the rest of
:mod:`visionattn.recon`. :func:`match_cameras` pairs the entries with the loaded frames by image file name
and returns Pi3X's conditions for one scene: ``intrinsics`` [N, 3, 3] in pixels of the model's frame (the
source-image matrix mapped through each frame's resize / crop / pad: ``K = A K_src`` with ``A`` of
:func:`~visionattn.recon.cameras.continuous_affine`) and ``poses`` [N, 4, 4] camera-to-world, OpenCV.

Every problem (missing or unreadable file, a frame with no entry, a size that does not fit) raises
:class:`CameraFileError` (a ``ValueError``) naming the file and the frame.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from .cameras import continuous_affine

__all__ = ["CameraFileError", "CameraEntry", "read_camera_file", "match_cameras"]

_GL_TO_CV = np.diag([1.0, -1.0, -1.0, 1.0])  # OpenGL camera axes -> OpenCV (applied on the right of a c2w)


class CameraFileError(ValueError):
    """A ``--intrinsics`` / ``--poses`` file cannot be used (unreadable, malformed, or missing a frame)."""


@dataclass
class CameraEntry:
    """One image of a camera file.

    Attributes:
        K: [3, 3] float64 pinhole intrinsics in pixels of a ``size`` image, or None (size unknown yet:
            ``camera_angle_x`` files; then ``fov`` holds the angles).
        c2w: [4, 4] float64 camera-to-world, OpenCV axes.
        size: (width, height) the intrinsics refer to, or None.
        fov: (camera_angle_x, camera_angle_y or None) in radians, for files without pixel intrinsics.
    """

    K: np.ndarray | None
    c2w: np.ndarray
    size: tuple[int, int] | None = None
    fov: tuple[float, float | None] | None = None


def _finite(a, what: str, path: str) -> np.ndarray:
    try:
        arr = np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError):
        raise CameraFileError(f"{path}: {what} is not numeric") from None
    if not np.isfinite(arr).all():
        raise CameraFileError(f"{path}: {what} has NaN / inf entries")
    return arr


def _read_colmap(folder: str) -> dict[str, CameraEntry]:
    from .colmap import require_pycolmap

    pycolmap = require_pycolmap()
    try:
        rec = pycolmap.Reconstruction(folder)
    except Exception as exc:  # pycolmap raises plain RuntimeError / ValueError subclasses on bad files
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CameraFileError(f"{folder}: not a readable COLMAP model ({why})") from exc
    entries = {}
    for img in rec.images.values():
        cam = rec.cameras[img.camera_id]
        cfw = img.cam_from_world
        cfw = cfw() if callable(cfw) else cfw  # a method from pycolmap 3.13 on, a property before
        E = np.eye(4)
        E[:3] = np.asarray(cfw.matrix(), np.float64)
        entries[img.name] = CameraEntry(K=np.asarray(cam.calibration_matrix(), np.float64),
                                        c2w=np.linalg.inv(E), size=(int(cam.width), int(cam.height)))
    if not entries:
        raise CameraFileError(f"{folder}: the COLMAP model has no images")
    return entries


def _read_transforms(path: str) -> dict[str, CameraEntry]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CameraFileError(f"{path}: not a readable JSON file ({exc})") from None
    frames = doc.get("frames") if isinstance(doc, dict) else None
    if not isinstance(frames, list) or not frames:
        raise CameraFileError(f"{path}: no 'frames' list (expected nerfstudio / NeRF transforms.json)")
    entries = {}
    for i, fr in enumerate(frames):
        if not isinstance(fr, dict) or "file_path" not in fr or "transform_matrix" not in fr:
            raise CameraFileError(f"{path}: frame {i} lacks 'file_path' or 'transform_matrix'")
        name = str(fr["file_path"])
        M = _finite(fr["transform_matrix"], f"frame {name!r} transform_matrix", path)
        if M.shape == (3, 4):
            M = np.vstack([M, [0.0, 0.0, 0.0, 1.0]])
        if M.shape != (4, 4):
            raise CameraFileError(f"{path}: frame {name!r} transform_matrix is {list(M.shape)}, expected 4x4")
        c2w = M @ _GL_TO_CV
        get = lambda key: fr.get(key, doc.get(key))  # noqa: E731  (per frame first, then the file's top level)
        w, h = get("w"), get("h")
        size = (int(w), int(h)) if w is not None and h is not None else None
        K, fov = None, None
        if get("fl_x") is not None:
            fx = float(get("fl_x"))
            fy = float(get("fl_y")) if get("fl_y") is not None else fx
            if size is None and (get("cx") is None or get("cy") is None):
                raise CameraFileError(f"{path}: frame {name!r} has fl_x but neither cx, cy nor w, h")
            cx = float(get("cx")) if get("cx") is not None else size[0] / 2.0
            cy = float(get("cy")) if get("cy") is not None else size[1] / 2.0
            K = _finite([[fx, 0.0, cx], [0.0, fy, cy], [0.0, 0.0, 1.0]], f"frame {name!r} intrinsics", path)
        elif get("camera_angle_x") is not None:
            ay = get("camera_angle_y")
            fov = (float(get("camera_angle_x")), None if ay is None else float(ay))
        entries[name] = CameraEntry(K=K, c2w=c2w, size=size, fov=fov)
    return entries


def read_camera_file(path: str) -> dict[str, CameraEntry]:
    """``{image name as the file gives it: CameraEntry}`` of a COLMAP model folder or a ``transforms.json``.

    Raises:
        CameraFileError: missing path, unreadable or malformed file, a model without images.
        MissingDependencyError: a COLMAP folder without pycolmap installed.
    """
    if os.path.isdir(path):
        has = [f for f in ("cameras.bin", "images.bin", "cameras.txt", "images.txt")
               if os.path.isfile(os.path.join(path, f))]
        if not has:
            raise CameraFileError(f"{path}: a folder without cameras.bin / images.bin (or .txt): pass a COLMAP "
                                  "model folder such as sparse/0, or a transforms.json")
        return _read_colmap(path)
    if os.path.isfile(path):
        return _read_transforms(path)
    raise CameraFileError(f"{path}: no such file or folder (expected a COLMAP model folder or a transforms.json)")


def _lookup(entries: dict[str, CameraEntry], candidates: list[str]) -> CameraEntry | None:
    """The entry whose file name (or, failing that, stem) equals one of ``candidates``' (first wins)."""
    by_base, by_stem = {}, {}
    for key, e in entries.items():
        base = os.path.basename(key.replace("\\", "/"))
        by_base.setdefault(base, e)
        by_stem.setdefault(os.path.splitext(base)[0], e)
    for c in candidates:
        if c in by_base:
            return by_base[c]
    for c in candidates:
        stem = os.path.splitext(c)[0]
        if stem in by_stem:
            return by_stem[stem]
    return None


def _source_intrinsics(e: CameraEntry, src_size: tuple[int, int], name: str, path: str) -> np.ndarray:
    """The entry's intrinsics in pixels of the source image (``src_size`` = (width, height))."""
    W, H = src_size
    if e.K is None:
        if e.fov is None:
            raise CameraFileError(f"{path}: no intrinsics for {name!r} (fl_x / camera_angle_x missing)")
        fx = 0.5 * W / math.tan(0.5 * e.fov[0])
        fy = fx if e.fov[1] is None else 0.5 * H / math.tan(0.5 * e.fov[1])
        return np.array([[fx, 0.0, W / 2.0], [0.0, fy, H / 2.0], [0.0, 0.0, 1.0]])
    if e.size is None or tuple(e.size) == (W, H):
        return e.K
    w, h = e.size
    if abs(w / h - W / H) > 0.01 * (W / H):
        raise CameraFileError(f"{path}: the intrinsics of {name!r} are for a {w}x{h} image, the source is {W}x{H} "
                              "(another aspect ratio)")
    return np.diag([W / w, H / h, 1.0]) @ e.K  # the same camera at another resolution


def match_cameras(loaded, intrinsics_file: str | None = None, poses_file: str | None = None,
                  intrinsics_entries=None, poses_entries=None) -> dict:
    """Pi3X's conditions for the frames of ``loaded`` (a :class:`~visionattn.recon.images.LoadedImages`).

    A frame matches the entry whose image file name equals its source file's (video frames: the stored
    frame's, ``frame_000012.jpg``), else whose name without extension does. ``*_entries``: files already read with
    :func:`read_camera_file` (read ``*_file`` otherwise; the file name still appears in errors).

    Returns:
        ``{"intrinsics": float64 [N, 3, 3] pixels of the model's frame, "poses": float64 [N, 4, 4]
        camera-to-world OpenCV}``, each only when its file is given.

    Raises:
        CameraFileError: a frame has no entry (the message names up to five such frames and a few of the
            file's names), or intrinsics that do not fit the source image.
    """
    out = {}
    for key, path, entries in (("intrinsics", intrinsics_file, intrinsics_entries),
                               ("poses", poses_file, poses_entries)):
        if path is None and entries is None:
            continue
        entries = read_camera_file(path) if entries is None else entries
        found, missing = [], []
        for i, name in enumerate(loaded.names):
            # an image's own file name first; video frames by their stored name (frame_000012.jpg)
            cands = [] if "video" in loaded.extra else [os.path.basename(loaded.paths[i])]
            cands += [*loaded.image_files[i:i + 1], name]
            e = _lookup(entries, cands)
            (missing.append(cands[0]) if e is None else found.append(e))
        if missing:
            some = ", ".join(repr(n) for n in list(entries)[:3])
            raise CameraFileError(f"--{key} {path}: no camera for {len(missing)} of {len(loaded.names)} frames "
                                  f"({', '.join(repr(m) for m in missing[:5])}{', ...' if len(missing) > 5 else ''});"
                                  f" it names images such as {some}. Frames are matched by image file name")
        if key == "poses":
            out["poses"] = np.stack([e.c2w for e in found])
        else:
            Ks = [continuous_affine(loaded.affines[i]) @ _source_intrinsics(e, loaded.original_sizes[i],
                                                                           loaded.names[i], path)
                  for i, e in enumerate(found)]
            out["intrinsics"] = np.stack(Ks)
    return out
