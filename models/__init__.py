"""VGGT and FastVGGT (being written: issue 7)."""
