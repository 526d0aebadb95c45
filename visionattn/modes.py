"""Precision modes of visionattn and their accuracy contracts.

The table itself lives beside the kernels that read it (:mod:`visionattn.kernels.modes`:
kernels never import upward); this module is its public name.
"""
from .kernels.modes import MODES, Mode, get_mode, mode_names

__all__ = ["Mode", "MODES", "get_mode", "mode_names"]
