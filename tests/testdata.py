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
