"""The argument helpers of :mod:`_harness` under their earlier module name, for demos/reconstruct.py."""
from _harness import ToolParser, nonnegative_int, percentile, positive_float, positive_int  # noqa: F401
