"""points.ply is written by trimesh: no open3d needed, and the cloud reads back exactly (float32 points,
8-bit colours)."""
import sys

import numpy as np
import pytest

trimesh = pytest.importorskip("trimesh", reason="trimesh not installed: pip install -e '.[recon]'")

from visionattn.recon.points import write_ply  # noqa: E402


def test_point_cloud_is_written_and_read_back_without_open3d(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "open3d", None)  # an import of open3d would raise ImportError
    rng = np.random.default_rng(0)
    xyz = rng.normal(size=(500, 3)) * 3.0
    rgb = rng.uniform(size=(500, 3))
    path = tmp_path / "points.ply"
    write_ply(str(path), xyz, rgb)
    assert path.read_bytes().startswith(b"ply\nformat binary_little_endian 1.0")
    cloud = trimesh.load(str(path))
    assert isinstance(cloud, trimesh.PointCloud) and len(cloud.vertices) == 500
    np.testing.assert_allclose(cloud.vertices, xyz.astype(np.float32), rtol=0, atol=0)
    np.testing.assert_array_equal(cloud.colors[:, :3], np.round(rgb * 255).astype(np.uint8))
