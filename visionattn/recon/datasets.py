"""Multi-view datasets with ground-truth cameras: CO3Dv2 layout and a generic layout.

Both loaders return :class:`Scene` objects with OpenCV camera-from-world
extrinsics [S, 3, 4] and pixel intrinsics [S, 3, 3] of the original images.

**Generic layout** (also what ``demos/reconstruct.py`` writes, so an output
folder can serve as ground truth)::

    SCENE/cameras.json      {"frames": [{"file": "a.jpg", "extrinsic": 3x4, "intrinsic": 3x3}, ...]}
    SCENE/images/a.jpg      (or SCENE/a.jpg, or the path in "file" relative to SCENE)
    SCENE/points.ply        optional ground-truth point cloud (same world frame)

A root holding ``cameras.json`` is one scene; otherwise each sub-folder that
holds one is a scene. ``intrinsic_original`` is preferred over ``intrinsic``
when present (demo outputs).

**CO3Dv2 layout** (Reizenstein et al., ICCV 2021; the official release)::

    ROOT/CATEGORY/frame_annotations.jgz     gzip JSON list of frame annotations
    ROOT/CATEGORY/SEQUENCE/images/frameXXXXXX.jpg
    ROOT/CATEGORY/SEQUENCE/pointcloud.ply   (optional)

Annotations hold PyTorch3D cameras (row-vector ``X_cam = X_world R + T``,
+X left, +Y up, NDC intrinsics). They are converted to OpenCV as VGGT's CO3D
evaluation does (negate the x, y columns of R and transpose; negate T's x, y),
intrinsics from ``ndc_isotropic`` / ``ndc_norm_image_bounds`` to pixels.

Ground truth is checked as it is read, before any model runs: a camera matrix
of the wrong shape or holding NaN / inf, a frame entry without its fields, an
empty annotation list, a listed image that is missing, or a point cloud that is
not a readable PLY raises :class:`GroundTruthError` (a ``ValueError``) naming the
file and the entry.
"""
from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass

import numpy as np

from .images import ImageFolderError, natural_key

__all__ = [
    "Scene", "GroundTruthError", "load_generic_scene", "find_generic_scenes", "co3d_viewpoint_to_opencv",
    "load_co3d_scenes", "load_scenes", "read_ply_points", "check_point_clouds",
]


class GroundTruthError(ValueError):
    """Ground-truth cameras, annotations or point clouds that cannot be used; the message names the file."""


def _shape_text(shape) -> str:
    return "x".join(str(n) for n in shape) or "a single number"


def _finite_array(value, shapes, what: str) -> np.ndarray:
    """``value`` as a float64 array of one of ``shapes``, every entry finite; else :class:`GroundTruthError`."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise GroundTruthError(f"{what} is not an array of numbers (got {str(value)[:60]})") from None
    if arr.shape not in shapes:
        raise GroundTruthError(f"{what} is {_shape_text(arr.shape)}; expected "
                               f"{' or '.join(_shape_text(s) for s in shapes)}")
    if not np.isfinite(arr).all():
        raise GroundTruthError(f"{what} holds NaN or infinite values")
    return arr


@dataclass
class Scene:
    """One multi-view scene with ground-truth cameras.

    Attributes:
        name: scene id (``category/sequence`` for CO3D).
        image_paths: S image files.
        extrinsics: float64 [S, 3, 4] OpenCV camera-from-world.
        intrinsics: float64 [S, 3, 3] in original-image pixels (may be None).
        points_path: ground-truth point cloud file (PLY) or None.
    """

    name: str
    image_paths: list[str]
    extrinsics: np.ndarray
    intrinsics: np.ndarray | None = None
    points_path: str | None = None


def _resolve_image(scene_dir: str, file: str) -> str:
    for cand in (os.path.join(scene_dir, "images", file), os.path.join(scene_dir, file),
                 os.path.join(scene_dir, "images", os.path.basename(file))):
        if os.path.isfile(cand):
            return cand
    raise ImageFolderError(f"image {file!r} listed in {scene_dir}/cameras.json not found "
                           f"(looked in {scene_dir}/images/ and {scene_dir}/)")


def load_generic_scene(scene_dir: str) -> Scene:
    """Load one generic-layout scene (see module docstring).

    Raises:
        ValueError: missing/invalid cameras.json, or a listed image is missing.
        GroundTruthError: a frame entry without ``file`` / ``extrinsic``, an extrinsic that is not 3x4 / 4x4 or an
            intrinsic that is not 3x3, or NaN / inf in either.
    """
    path = os.path.join(scene_dir, "cameras.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        frames = doc["frames"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read ground-truth cameras {path!r}: {exc}") from exc
    if not isinstance(frames, list):
        raise GroundTruthError(f"{path!r}: 'frames' must be a list of frames, got {type(frames).__name__}")
    if not frames:
        raise ValueError(f"{path!r} lists no frames")
    images, E, K = [], [], []
    for i, fr in enumerate(frames):
        where = f"ground-truth cameras {path!r}, frame {i}"
        if not isinstance(fr, dict) or "extrinsic" not in fr or not isinstance(fr.get("file", fr.get("image")), str):
            raise GroundTruthError(f"{where}: expected an object with 'file' (the image) and 'extrinsic' (3x4 "
                                   "camera-from-world)")
        stored = fr.get("image")  # the demo's outputs name their stored frame (images/NAME.EXT)
        if isinstance(stored, str) and os.path.isfile(os.path.join(scene_dir, stored)):
            images.append(os.path.join(scene_dir, stored))
        else:
            if not isinstance(fr.get("file"), str):
                raise GroundTruthError(f"{where}: its image {stored!r} is missing and no 'file' names another")
            images.append(_resolve_image(scene_dir, fr["file"]))
        E.append(_finite_array(fr["extrinsic"], [(3, 4), (4, 4)], f"{where}: extrinsic")[:3, :4])
        k = fr.get("intrinsic_original", fr.get("intrinsic"))
        K.append(None if k is None else _finite_array(k, [(3, 3)], f"{where}: intrinsic"))
    intr = None if any(k is None for k in K) else np.stack(K)
    ply = os.path.join(scene_dir, "points.ply")
    return Scene(name=os.path.basename(os.path.normpath(scene_dir)), image_paths=images,
                 extrinsics=np.stack(E), intrinsics=intr, points_path=ply if os.path.isfile(ply) else None)


def find_generic_scenes(root: str) -> list[Scene]:
    """``root`` itself if it holds cameras.json, else every sub-folder that does (natural order).

    Raises:
        ValueError: no scene found.
    """
    if os.path.isfile(os.path.join(root, "cameras.json")):
        return [load_generic_scene(root)]
    if not os.path.isdir(root):
        raise ValueError(f"dataset root {root!r} is not a folder")
    scenes = [load_generic_scene(os.path.join(root, d)) for d in sorted(os.listdir(root), key=natural_key)
              if os.path.isfile(os.path.join(root, d, "cameras.json"))]
    if not scenes:
        raise ValueError(f"no scene under {root!r}: expected cameras.json in it or in its sub-folders")
    return scenes


def co3d_viewpoint_to_opencv(viewpoint: dict, image_hw) -> tuple[np.ndarray, np.ndarray]:
    """CO3D / PyTorch3D viewpoint -> (OpenCV extrinsic [3, 4], pixel intrinsic [3, 3]).

    Args:
        viewpoint: ``{"R": 3x3, "T": 3, "focal_length": [fx, fy], "principal_point": [px, py],
            "intrinsics_format": "ndc_isotropic" | "ndc_norm_image_bounds"}``.
        image_hw: (H, W) of the image the intrinsics refer to.

    Raises:
        ValueError: unknown ``intrinsics_format``.
        GroundTruthError: R not 3x3, T not 3, focal length / principal point not 2 numbers, an image size
            that is not two positive numbers, or NaN / inf in any of them.
        KeyError: a field is missing.
    """
    R = _finite_array(viewpoint["R"], [(3, 3)], "viewpoint R").copy()
    T = _finite_array(viewpoint["T"], [(3,)], "viewpoint T").copy()
    hw = _finite_array(image_hw, [(2,)], "image size")
    if not (hw > 0).all():
        raise GroundTruthError(f"image size {hw.tolist()} must be two positive numbers (height, width)")
    R[:, :2] *= -1.0
    T[:2] *= -1.0
    E = np.concatenate([R.T, T[:, None]], axis=1)
    h, w = float(image_hw[0]), float(image_hw[1])
    half = np.array([w / 2.0, h / 2.0])
    fmt = viewpoint.get("intrinsics_format", "ndc_norm_image_bounds").lower()
    if fmt == "ndc_isotropic":
        rescale = np.array([half.min(), half.min()])
    elif fmt == "ndc_norm_image_bounds":
        rescale = half
    else:
        raise ValueError(f"unknown CO3D intrinsics_format {fmt!r} "
                         "(expected 'ndc_isotropic' or 'ndc_norm_image_bounds')")
    f = _finite_array(viewpoint["focal_length"], [(2,)], "viewpoint focal_length") * rescale
    c = half - _finite_array(viewpoint["principal_point"], [(2,)], "viewpoint principal_point") * rescale
    K = np.array([[f[0], 0.0, c[0]], [0.0, f[1], c[1]], [0.0, 0.0, 1.0]])
    return E, K


def load_co3d_scenes(root: str, categories=None, max_sequences: int | None = None,
                     num_frames: int | None = 10, seed: int = 0) -> list[Scene]:
    """Scenes from a CO3Dv2 release folder.

    Args:
        root: folder holding ``CATEGORY/frame_annotations.jgz``.
        categories: list of category names (None: every category found).
        max_sequences: per category, keep the first N sequences in natural order (None: all).
        num_frames: per sequence, a seeded random sample of this many frames kept in
            frame order (VGGT's CO3D protocol uses 10); None keeps every frame.
        seed: sampling seed.

    Raises:
        ValueError: no annotation file found.
        GroundTruthError: an annotation file that holds no annotations or a malformed one (the message names the
            file and the frame), or a listed image that is missing.
    """
    if categories is None:
        categories = sorted(d for d in (os.listdir(root) if os.path.isdir(root) else [])
                            if os.path.isfile(os.path.join(root, d, "frame_annotations.jgz")))
    if not categories:
        raise ValueError(f"no CO3D category under {root!r} (expected CATEGORY/frame_annotations.jgz)")
    rng = np.random.default_rng(seed)
    scenes = []
    for cat in categories:
        ann_path = os.path.join(root, cat, "frame_annotations.jgz")
        try:
            with gzip.open(ann_path, "rt") as f:
                annotations = json.load(f)
        except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read CO3D annotations {ann_path!r}: {exc}") from exc
        if not isinstance(annotations, list) or not annotations:
            raise GroundTruthError(f"CO3D annotations {ann_path!r} hold no frame annotations (expected a non-empty "
                                   f"list, got {str(annotations)[:40]}); re-extract the category or leave it out "
                                   "with --categories")
        by_seq: dict[str, list[dict]] = {}
        for i, a in enumerate(annotations):
            if not isinstance(a, dict) or not isinstance(a.get("sequence_name"), str):
                raise GroundTruthError(f"CO3D annotations {ann_path!r}, entry {i}: expected an object with "
                                       "'sequence_name', 'frame_number', 'image' and 'viewpoint'")
            by_seq.setdefault(a["sequence_name"], []).append(a)
        seqs = sorted(by_seq, key=natural_key)
        if max_sequences is not None:
            seqs = seqs[:max_sequences]
        for seq in seqs:
            try:
                frames = sorted(by_seq[seq], key=lambda a: a["frame_number"])
            except (KeyError, TypeError) as exc:
                raise GroundTruthError(f"CO3D annotations {ann_path!r}, sequence {seq!r}: a frame without a "
                                       f"comparable 'frame_number' ({type(exc).__name__}: {exc})") from None
            if num_frames is not None and len(frames) > num_frames:
                pick = np.sort(rng.choice(len(frames), num_frames, replace=False))
                frames = [frames[i] for i in pick]
            E, K, paths = [], [], []
            for a in frames:
                where = f"CO3D annotations {ann_path!r}, {seq!r} frame {a['frame_number']}"
                try:
                    e, k = co3d_viewpoint_to_opencv(a["viewpoint"], a["image"]["size"])
                    path = os.path.join(root, a["image"]["path"])
                except (GroundTruthError, KeyError, TypeError) as exc:
                    what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
                    raise GroundTruthError(f"{where}: {what}") from None
                if not os.path.isfile(path):
                    raise GroundTruthError(f"{where}: image {path!r} not found")
                E.append(e)
                K.append(k)
                paths.append(path)
            ply = os.path.join(root, cat, seq, "pointcloud.ply")
            scenes.append(Scene(name=f"{cat}/{seq}", image_paths=paths, extrinsics=np.stack(E),
                                intrinsics=np.stack(K), points_path=ply if os.path.isfile(ply) else None))
    if not scenes:
        raise ValueError(f"no CO3D sequence under {root!r} for categories {list(categories)}")
    return scenes


def load_scenes(root: str, layout: str = "auto", categories=None, max_sequences: int | None = None,
                num_frames: int | None = 10, seed: int = 0) -> list[Scene]:
    """Scenes from ``root`` in layout ``"generic"``, ``"co3d"`` or ``"auto"`` (co3d if any
    ``*/frame_annotations.jgz`` exists, else generic). The remaining arguments apply to CO3D
    only (see :func:`load_co3d_scenes`)."""
    if layout == "auto":
        is_co3d = os.path.isdir(root) and any(
            os.path.isfile(os.path.join(root, d, "frame_annotations.jgz")) for d in os.listdir(root))
        layout = "co3d" if is_co3d else "generic"
    if layout == "co3d":
        return load_co3d_scenes(root, categories, max_sequences, num_frames, seed)
    if layout == "generic":
        return find_generic_scenes(root)
    raise ValueError(f"layout={layout!r} must be 'auto', 'generic' or 'co3d'")


def read_ply_points(path: str) -> np.ndarray:
    """Points [N, 3] float64 of a PLY file (trimesh, which refuses truncated or corrupt files); vertices with
    NaN / inf coordinates are dropped.

    Raises:
        GroundTruthError: the file is missing, not a PLY, truncated or corrupt, or holds no finite point.
    """
    from .points import require_trimesh

    try:
        loaded = require_trimesh().load(path, file_type="ply", process=False)
        pts = np.asarray(loaded.vertices, dtype=np.float64).reshape(-1, 3)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise GroundTruthError(f"ground-truth point cloud {path!r} is not a readable PLY ({why}); replace it or "
                               "remove it to evaluate poses only") from None
    pts = pts[np.isfinite(pts).all(axis=1)]
    if len(pts) == 0:
        raise GroundTruthError(f"ground-truth point cloud {path!r} holds no finite point; replace it or remove "
                               "it to evaluate poses only")
    return pts


def check_point_clouds(scenes) -> None:
    """Read every scene's ground-truth cloud once (:func:`read_ply_points`), so a corrupt one fails before any
    model runs.

    Raises:
        GroundTruthError: see :func:`read_ply_points`.
    """
    for scene in scenes:
        if scene.points_path is not None:
            read_ply_points(scene.points_path)
