"""Package layout: only the folders pyproject.toml maps (kernels/, models/) are importable under visionattn."""
import importlib

import pytest


@pytest.mark.parametrize("name", ["visionattn.kernels", "visionattn.models"])
def test_mapped_folders_import(name):
    assert importlib.import_module(name).__name__ == name


@pytest.mark.parametrize("name", ["visionattn.tools", "visionattn.tests", "visionattn.docs", "visionattn.demos"])
def test_other_checkout_folders_do_not_import(name):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
