"""Test machinery shipped with the package: :mod:`visionattn.testing.conformance`, the randomized conformance
suite's cases, problems, float64 oracle and pass rules (``tools/gpu_conformance.py`` runs them).

Imports nothing at package import; needs torch, never pytest or ``tools/``.
"""
__all__ = ["conformance"]
