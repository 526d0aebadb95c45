"""Command-line plumbing shared by the tools: argument types, output paths checked before any work.

Every tool fails on bad input the same way: exit status 2 and one line,
``<tool>: error: <argument>: <what is wrong and what to pass instead>``, before it loads
a model, reads data or creates a folder. Results go where ``--out`` says, or under
``out/`` (git-ignored) in the current folder; a tool never writes into the repository
unless its ``--out`` names a path there.
"""
from __future__ import annotations

import argparse
import math
import os

__all__ = ["ToolParser", "positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "percentile",
           "default_out", "check_output"]


class ToolParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return x


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {n}")
    return n


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {n}")
    return n


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    x = _float(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return x


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    x = _float(text)
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return x


def percentile(text: str) -> float:
    """argparse type: a percentile, a number in [0, 100]."""
    x = _float(text)
    if not 0 <= x <= 100:
        raise argparse.ArgumentTypeError(f"must be a percentile in [0, 100], got {text}")
    return x


def default_out(name: str) -> str:
    """``out/<name>`` in the current folder: where a tool writes when ``--out`` is not given."""
    return os.path.join("out", name)


def check_output(parser: argparse.ArgumentParser, path: str, *, flag: str = "--out", folder: bool = False) -> str:
    """Exit 2 now if ``path`` could not be written at the end of the run; creates nothing.

    Args:
        parser: the tool's parser (its ``error`` prints the line and exits).
        path: a file path or file prefix (``folder=False``: the tool writes ``path`` or ``path.md`` /
            ``path.json``), or a folder the tool writes into (``folder=True``).
        flag: the argument's name, for the message.
        folder: whether ``path`` names a folder.

    Returns:
        ``path`` made absolute.
    """
    path = os.path.abspath(path)
    if folder:
        if os.path.exists(path) and not os.path.isdir(path):
            parser.error(f"{flag} {path!r} is a file; pass a folder (it is created if missing)")
        target = path
    else:
        if os.path.isdir(path):
            parser.error(f"{flag} {path!r} is a folder; pass a file path (its folder is created if missing)")
        target = os.path.dirname(path)
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        parser.error(f"{flag} {path!r}: {existing!r} is a file, so no folder can be made there; pass another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path!r}: the folder {existing!r} is not writable; pass a path you can write to")
    return path
