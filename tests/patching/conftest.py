"""Fixtures for the patching tests."""
import pytest


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which one-time warnings were already given, so a test can see its own."""
    from visionattn import dispatch

    monkeypatch.setattr(dispatch, "_warned", set())
