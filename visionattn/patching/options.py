"""The options every patcher accepts and passes on to :func:`visionattn.attention`.

:func:`~visionattn.patching.patch_model`, :func:`~visionattn.patching.sdpa_override` and the diffusers patchers
(:mod:`.diffusers`, :mod:`.diffusers_dispatch`) take the same ``backend`` and ``num_splits`` options and check
them here.
"""
from __future__ import annotations

from ..dispatch import BACKENDS

__all__ = ["OPTION_NAMES", "check_options"]

#: option names, in the order :func:`check_options` returns them
OPTION_NAMES = ("backend", "num_splits")


def check_options(options: dict) -> dict:
    """Validate ``patch_model`` / ``sdpa_override`` options; return them with defaults filled.

    Options: ``backend`` (``None`` | ``"auto"`` | ``"triton"`` | ``"reference"``, passed to
    :func:`visionattn.attention`) and ``num_splits`` (``None`` or int >= 1).

    Raises:
        TypeError: an unknown option name.
        ValueError: a bad option value.
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; visionattn patching accepts {list(OPTION_NAMES)}")
    out = {name: options.get(name) for name in OPTION_NAMES}
    if out["backend"] is not None and out["backend"] not in BACKENDS:
        raise ValueError(f"backend={out['backend']!r}; expected None or one of {BACKENDS}")
    ns = out["num_splits"]
    if ns is not None and (not isinstance(ns, int) or isinstance(ns, bool) or ns < 1):
        raise ValueError(f"num_splits={ns!r}; expected None or a positive int")
    return out
