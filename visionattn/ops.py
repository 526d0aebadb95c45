"""Former home of the custom ops, kept so that existing imports keep working.

Each op family now holds its own public function, checks, custom ops, autograd, backend table and call cache:
:mod:`visionattn.api` (dense: ``visionattn::attention``, ``attention_lse``, ``attention_backward``),
:mod:`visionattn.pasa` (``visionattn::pasa_attention``), :mod:`visionattn.window` (``visionattn::window_attention``,
``window_attention_lse``, ``window_attention_backward``) and :mod:`visionattn.varlen`
(``visionattn::varlen_attention``, ``varlen_attention_lse``, ``varlen_attention_backward``). Importing this module
imports them (the ops register with the families, at ``import visionattn``). New code imports from the families.
"""
from __future__ import annotations

import sys
import types

from . import api as _api
from . import pasa as _pasa
from . import varlen as _varlen
from . import window as _window
from .api import _attention_bwd_op, _attention_lse_op, _attention_op, dense, dense_packed  # noqa: F401
from .checks import BACKWARD_MODES, first_order_only, has_backward, relaid_inputs  # noqa: F401
from .pasa import _pasa_op  # noqa: F401
from .pasa import pasa_kernel as pasa  # noqa: F401
from .pasa import pasa_kernel_plan as pasa_plan  # noqa: F401
from .varlen import _varlen_bwd_op, _varlen_lse_op, _varlen_op  # noqa: F401
from .varlen import varlen_kernel as varlen  # noqa: F401
from .varlen import varlen_kernel_lse as varlen_lse  # noqa: F401
from .window import _window_bwd_op, _window_lse_op, _window_op, window_packed, window_plan  # noqa: F401
from .window import window_kernel as window  # noqa: F401

__all__ = ["dense", "dense_packed", "pasa", "pasa_plan", "window", "window_packed", "window_plan", "varlen",
           "varlen_lse", "BACKWARD_MODES", "has_backward", "first_order_only", "relaid_inputs"]

# a name of this module -> (family module, name there): assigning it here (a test's monkeypatch) assigns it where
# the families call it, so code written against this module keeps working
_HOMES = {"dense": (_api, "dense"), "dense_packed": (_api, "dense_packed"), "pasa": (_pasa, "pasa_kernel"),
          "pasa_plan": (_pasa, "pasa_kernel_plan"), "window": (_window, "window_kernel"),
          "window_packed": (_window, "window_packed"), "window_plan": (_window, "window_plan"),
          "varlen": (_varlen, "varlen_kernel"), "varlen_lse": (_varlen, "varlen_kernel_lse")}


class _Forwarding(types.ModuleType):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        home = _HOMES.get(name)
        if home is not None:
            setattr(home[0], home[1], value)


sys.modules[__name__].__class__ = _Forwarding
