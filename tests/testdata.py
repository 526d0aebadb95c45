"""Paths of the test data, importable from any test folder (``from testdata import PHOTOS``).

tests/ is on sys.path because tests/conftest.py lives there; a module named
``conftest`` is ambiguous once subfolders have their own conftest.py.
"""
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHOTOS = os.path.join(REPO, "tests", "data", "photos")  # OpenCV sample photos, licence in tests/data
MULTIVIEW = os.path.join(REPO, "demos", "data")  # aloe/, stereo_rig/, suzanne/ (OpenCV samples)


def load_script(rel_path: str, name: str | None = None):
    """A fresh module from the repository file ``rel_path`` (a tool or demo script, not a package module), under
    ``name`` (default: the file's stem); each call executes the file again."""
    name = name or os.path.splitext(os.path.basename(rel_path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, rel_path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_ply_points(path):
    """``(xyz, rgb)`` of a point-cloud PLY read by trimesh: float64 [N, 3] positions and float [N, 3] colours in
    0..1 (the demo's own writer is trimesh too; the tests read back without open3d, which needs libusb)."""
    import numpy as np
    import trimesh

    cloud = trimesh.load(str(path))
    colors = np.asarray(cloud.colors, dtype=np.float64)[:, :3] / 255.0 if len(cloud.colors) else None
    return np.asarray(cloud.vertices, dtype=np.float64), colors


def nearest_distances(points, reference):
    """Distance from each of ``points`` [N, 3] to its nearest point of ``reference`` [M, 3] (scipy's k-d tree)."""
    from scipy.spatial import cKDTree

    return cKDTree(reference).query(points)[0]


def open3d_or_skip():
    """open3d, or a skip naming why it cannot be imported (not installed, or installed without the system library
    libusb-1.0 it loads: ``apt-get install libusb-1.0-0``). For the tests of the evaluation tools' cloud metrics,
    the one part of the project that needs it."""
    import pytest

    try:
        import open3d
    except (ImportError, OSError) as exc:
        pytest.skip(f"open3d unavailable ({exc}); the point-cloud metrics need it: pip install -e '.[recon]' and "
                    f"apt-get install libusb-1.0-0")
    return open3d


def default_stop_signals():
    """For ``subprocess.Popen(preexec_fn=...)``: in the child, SIGINT and SIGHUP as from a terminal. A runner
    started in the background ignores SIGINT (and one under nohup SIGHUP), children inherit that, and code that
    keeps an ignored signal ignored would then never see it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
