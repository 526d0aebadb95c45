"""points.ply is written from numpy in trimesh's layout: no open3d needed, and the cloud reads back exactly
(float32 points, 8-bit colours) in trimesh and open3d."""
import sys

import numpy as np
import pytest

trimesh = pytest.importorskip("trimesh", reason="trimesh not installed: pip install -e '.[recon]'")

from visionattn.recon.points import rgba8, write_ply  # noqa: E402
from visionattn.recon import points  # noqa: E402


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


@pytest.mark.parametrize("n", [0, 1, 7])
def test_vertices_are_trimesh_exporters_bytes(tmp_path, monkeypatch, n):
    """Across chunk boundaries: the bytes after the header are those trimesh's exporter writes, the header
    declares the same properties, and open3d reads the same points and colours."""
    monkeypatch.setattr(points, "_PLY_CHUNK", 3)
    rng = np.random.default_rng(n)
    xyz = rng.normal(size=(n, 3)).astype(np.float32)
    rgb = rng.uniform(-0.2, 1.2, size=(n, 3)).astype(np.float32)  # clipped
    rgb[:1, :1] = 0.5 / 255  # half to even
    path = tmp_path / "points.ply"
    write_ply(str(path), xyz, rgb)
    ours = path.read_bytes()
    head, body = ours.split(b"end_header\n", 1)
    if n:
        ref = trimesh.PointCloud(xyz, colors=rgba8(rgb)).export(file_type="ply", encoding="binary")
        ref_head, ref_body = ref.split(b"end_header\n", 1)
        assert body == ref_body
        assert [ln for ln in head.split(b"\n") if not ln.startswith(b"comment")] == \
            [ln for ln in ref_head.split(b"\n") if not ln.startswith(b"comment")]
    assert len(body) == 16 * n
    try:
        import open3d
    except ImportError:
        return
    cloud = open3d.io.read_point_cloud(str(path))
    np.testing.assert_array_equal(np.asarray(cloud.points), xyz.astype(np.float64))
    if n:
        np.testing.assert_array_equal(np.rint(np.asarray(cloud.colors) * 255), rgba8(rgb)[:, :3])
