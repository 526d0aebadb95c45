"""Multi-view reconstruction with VGGT / FastVGGT: image folders in, point clouds and cameras out.

Modules (import the one you need; none is imported here, so ``import
visionattn.recon`` stays cheap and open3d stays optional until used):

* :mod:`~visionattn.recon.images`   folder listing (natural sort), decoding (EXIF, grayscale, RGBA),
  VGGT crop / pad preprocessing -> ``load_images(folder) -> LoadedImages`` ([S, 3, H, W] in [0, 1]).
* :mod:`~visionattn.recon.pipeline` ``build_model``, ``run_model``, ``reconstruct`` (the demo's work).
* :mod:`~visionattn.recon.outdir`   the output folder: manifest, refusal to replace foreign folders or
  inputs, atomic temp-then-rename writing, SIGTERM handled like Ctrl-C.
* :mod:`~visionattn.recon.export`   points.ply (open3d), cameras.json, COLMAP text model, 16-bit depth
  PNG + npy, confidence npy; atomic output folder.
* :mod:`~visionattn.recon.preview`  headless matplotlib preview.png.
* :mod:`~visionattn.recon.metrics`  pair pose errors, AUC@30/15/5/3 (VGGT protocol), Umeyama Sim(3),
  accuracy / completeness / Chamfer.
* :mod:`~visionattn.recon.datasets` CO3Dv2 and generic ``images + cameras.json`` loaders.
* :mod:`~visionattn.recon.evaluate` the loops behind ``tools/eval_reconstruction.py``.

Command line: ``python demos/reconstruct.py --help``.
"""

__all__ = ["images", "pipeline", "outdir", "export", "preview", "metrics", "datasets", "evaluate"]
