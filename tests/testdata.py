"""Paths of the test data, importable from any test folder (``from testdata import PHOTOS``).

tests/ is on sys.path because tests/conftest.py lives there; a module named
``conftest`` is ambiguous once subfolders have their own conftest.py.
"""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHOTOS = os.path.join(REPO, "tests", "data", "photos")  # OpenCV sample photos, licence in tests/data
MULTIVIEW = os.path.join(REPO, "demos", "data")  # aloe/, stereo_rig/, suzanne/ (OpenCV samples)
