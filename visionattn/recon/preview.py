"""Headless preview image of a reconstruction (matplotlib, Agg backend; no display needed).

Top row: the coloured point cloud projected through the first camera, and the
same cloud seen from an oblique virtual camera (rotated about the cloud's
centre), both drawn far-to-near (painter's order). Bottom rows: the depth maps
of up to 8 frames with a shared colour scale.
"""
from __future__ import annotations

import numpy as np

__all__ = ["project_points", "oblique_extrinsic", "render_preview"]


def project_points(xyz: np.ndarray, extrinsic: np.ndarray, intrinsic: np.ndarray):
    """Project world points [N, 3] with camera-from-world [3, 4] and K [3, 3].

    Returns:
        (uv [M, 2] pixel coordinates, z [M] depth, keep [N] bool) for points in front (z > 0).
    """
    cam = xyz @ extrinsic[:, :3].T + extrinsic[:, 3]
    keep = cam[:, 2] > 1e-9
    cam = cam[keep]
    uvw = cam @ intrinsic.T
    return uvw[:, :2] / uvw[:, 2:3], cam[:, 2], keep


def oblique_extrinsic(extrinsic: np.ndarray, center: np.ndarray, yaw_deg: float = 35.0,
                      pitch_deg: float = 20.0, back_off: float = 1.3) -> np.ndarray:
    """A virtual camera orbiting ``center`` from ``extrinsic``: yaw about the camera's y axis, pitch about x.

    The camera keeps looking at ``center`` and moves back by ``back_off`` times
    its distance, so the whole cloud stays in view.
    """
    R, t = extrinsic[:, :3], extrinsic[:, 3]
    center_cam = R @ center + t  # cloud centre in the camera frame
    dist = max(float(np.linalg.norm(center_cam)), 1e-6)
    y, p = np.radians(yaw_deg), np.radians(pitch_deg)
    Ry = np.array([[np.cos(y), 0, np.sin(y)], [0, 1, 0], [-np.sin(y), 0, np.cos(y)]])
    Rx = np.array([[1, 0, 0], [0, np.cos(p), -np.sin(p)], [0, np.sin(p), np.cos(p)]])
    R_new = Rx @ Ry @ R  # rotate the view, then place the centre straight ahead
    t_new = np.array([0.0, 0.0, dist * back_off]) - R_new @ center
    return np.concatenate([R_new, t_new[:, None]], axis=1)


def _draw_cloud(ax, xyz, rgb, E, K, hw, title, max_points=60_000, seed=0):
    h, w = hw
    if len(xyz) > max_points:
        idx = np.random.default_rng(seed).choice(len(xyz), max_points, replace=False)
        xyz, rgb = xyz[idx], rgb[idx]
    uv, z, keep = project_points(xyz, E, K)
    col = rgb[keep]
    inside = (uv[:, 0] >= 0) & (uv[:, 0] < w) & (uv[:, 1] >= 0) & (uv[:, 1] < h)
    uv, z, col = uv[inside], z[inside], col[inside]
    order = np.argsort(-z)
    ax.set_facecolor("0.15")
    ax.scatter(uv[order, 0], uv[order, 1], c=col[order], s=max(0.5, 40000.0 / max(len(uv), 1)),
               marker="s", linewidths=0)
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.set_aspect("equal")
    ax.set_title(f"{title} ({len(uv):,} pts)", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def render_preview(path: str, xyz: np.ndarray, rgb: np.ndarray, extrinsics: np.ndarray,
                   intrinsics: np.ndarray, depth: np.ndarray, names=None, title: str = "",
                   max_depth_maps: int = 8) -> None:
    """Render ``preview.png`` without a display.

    Args:
        path: output PNG path.
        xyz, rgb: kept points [N, 3] and colours in [0, 1] [N, 3].
        extrinsics, intrinsics: [S, 3, 4] camera-from-world and [S, 3, 3] (preprocessed frame pixels).
        depth: [S, H, W] depth maps.
        names: frame names for the depth panels.
        title: figure title (model, mode, timings).
    """
    # Figure + the Agg canvas directly: no pyplot, no GUI backend, no global state touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    S, H, W = depth.shape
    n_depth = min(S, max_depth_maps)
    cols = max(2, min(4, n_depth))
    depth_rows = -(-n_depth // cols)
    aspect = H / W
    panel_w = 3.0  # inches per depth panel; the two cloud views share the full width
    cloud_h = panel_w * cols / 2 * aspect
    fig = Figure(figsize=(panel_w * cols + 0.8, cloud_h + depth_rows * panel_w * aspect + 0.9),
                 dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(1 + depth_rows, cols, height_ratios=[cloud_h] + [panel_w * aspect] * depth_rows)
    half = cols // 2
    ax0 = fig.add_subplot(gs[0, :half])
    ax1 = fig.add_subplot(gs[0, half:])
    E0, K0 = np.asarray(extrinsics[0], np.float64), np.asarray(intrinsics[0], np.float64)
    xyz = np.asarray(xyz, np.float64)
    rgb = np.asarray(rgb, np.float64)
    if len(xyz):
        _draw_cloud(ax0, xyz, rgb, E0, K0, (H, W), "points from camera 1")
        center = np.median(xyz, axis=0)
        _draw_cloud(ax1, xyz, rgb, oblique_extrinsic(E0, center), K0, (H, W), "oblique view")
    else:
        for ax in (ax0, ax1):
            ax.text(0.5, 0.5, "no points kept", ha="center", va="center")
    finite = depth[np.isfinite(depth)]
    vmin, vmax = (np.percentile(finite, [2, 98]) if finite.size else (0.0, 1.0))
    for i in range(n_depth):
        ax = fig.add_subplot(gs[1 + i // cols, i % cols])
        im = ax.imshow(depth[i], cmap="turbo", vmin=vmin, vmax=vmax)
        ax.set_title(f"depth {names[i] if names else i}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    if n_depth:
        fig.colorbar(im, ax=fig.axes[2:], shrink=0.8, label="depth (first-camera units)")
    if S > n_depth:
        fig.text(0.99, 0.01, f"+{S - n_depth} more frames", ha="right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path)
