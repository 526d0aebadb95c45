"""Reconstruction helpers: image loading, export, preview, metrics (issue 8)."""
