"""Multi-view reconstruction with VGGT / FastVGGT / π³ / Pi3X: image folders in, point clouds and cameras out.

Modules (import the one you need; none is imported here, so ``import
visionattn.recon`` stays cheap and open3d stays optional until used):

* :mod:`~visionattn.recon.images`   folder listing (natural sort), decoding (EXIF, grayscale, RGBA),
  VGGT crop / pad preprocessing -> ``load_images(folder) -> LoadedImages`` ([S, 3, H, W] in [0, 1]).
* :mod:`~visionattn.recon.pipeline` ``build_model``, ``run_model``, ``reconstruct`` (the demo's work).
* :mod:`~visionattn.recon.pi3`      π³ / Pi3X outputs in VGGT's conventions (first camera = world, fitted focal).
* :mod:`~visionattn.recon.priors`   Pi3X's known cameras from a COLMAP model or a transforms.json.
* :mod:`~visionattn.recon.outdir`   the output folder: manifest, refusal to replace foreign folders or
  inputs, atomic temp-then-rename writing, SIGTERM and SIGHUP handled like Ctrl-C, a full disk in one line.
* :mod:`~visionattn.recon.export`   ``write_reconstruction``: every output file of a run, side by side in a
  thread pool, through the per-format modules below (whose names it re-exports).
* :mod:`~visionattn.recon.points`   confidence-filtered points, points.ply (trimesh).
* :mod:`~visionattn.recon.cameras`  camera conventions (source-image intrinsics, OpenCV -> OpenGL), cameras.json.
* :mod:`~visionattn.recon.colmap`   COLMAP sparse model (binary from numpy; text with pycolmap), point tracks.
* :mod:`~visionattn.recon.ba`       bundle adjustment (pycolmap) over tracks of VGGT's track head.
* :mod:`~visionattn.recon.nerfstudio` nerfstudio transforms.json.
* :mod:`~visionattn.recon.scene`    scene.glb (points + camera frusta, trimesh).
* :mod:`~visionattn.recon.depth`    16-bit depth PNG + npy, confidence npy.
* :mod:`~visionattn.recon.preview`  headless matplotlib preview.png.
* :mod:`~visionattn.recon.metrics`  pair pose errors, AUC@30/15/5/3 (VGGT protocol), Umeyama Sim(3),
  accuracy / completeness / Chamfer.
* :mod:`~visionattn.recon.datasets` CO3Dv2 and generic ``images + cameras.json`` loaders.
* :mod:`~visionattn.recon.evaluate` the loops behind ``tools/eval_reconstruction.py``.

Command line: ``python demos/reconstruct.py --help``.
"""

__all__ = ["images", "pipeline", "pi3", "priors", "outdir", "export", "points", "cameras", "colmap", "ba",
           "nerfstudio", "scene", "depth", "preview", "metrics", "datasets", "evaluate"]
