"""Command-line plumbing shared by the tools: argument types, output paths checked before any work.

Every tool fails on bad input the same way: exit status 2 and one line,
``<tool>: error: <argument>: <what is wrong and what to pass instead>``, before it loads
a model, reads data or creates a folder. Results go where ``--out`` says, or under
``out/`` (git-ignored) in the current folder; a tool never writes into the repository
unless its ``--out`` names a path there.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os

__all__ = ["ToolParser", "positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "percentile",
           "default_out", "check_output", "check_output_folder", "output_folder", "output_files", "check_device",
           "failure_text", "CorruptImageError", "read_rgb", "check_image", "load_config"]


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


def _bounded(parse, low: float, high: float, low_open: bool, what: str, doc: str):
    """An argparse type: ``parse(text)`` within [low, high] (``low_open``: above ``low``), else a clear error."""
    def check(text: str):
        x = parse(text)
        if x < low or x > high or (low_open and x == low):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return x
    check.__doc__ = doc
    return check


positive_int = _bounded(_int, 1, math.inf, False, "an integer >= 1", "argparse type: an integer >= 1.")
nonnegative_int = _bounded(_int, 0, math.inf, False, "an integer >= 0", "argparse type: an integer >= 0.")
positive_float = _bounded(_float, 0, math.inf, True, "a number > 0", "argparse type: a finite number > 0.")
nonnegative_float = _bounded(_float, 0, math.inf, False, "a number >= 0", "argparse type: a finite number >= 0.")
percentile = _bounded(_float, 0, 100, False, "a percentile in [0, 100]",
                      "argparse type: a percentile, a number in [0, 100].")


def check_device(parser: argparse.ArgumentParser, name: str, flag: str = "--device"):
    """``torch.device(name)``, or exit 2 if the name is invalid or names CUDA on a machine without it."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        parser.error(f"{flag} {name!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"{flag} {name}: no CUDA device here; pass {flag} cpu")
    return device


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


def check_output_folder(parser: argparse.ArgumentParser, path: str, *, tool: str, inputs=(),
                        flag: str = "--out") -> str:
    """Exit 2 now unless ``path`` may become ``tool``'s output folder; creates nothing.

    The demo's rule (:mod:`visionattn.recon.outdir`): the folder is new, empty, or an earlier output of
    ``tool`` holding only the files its manifest lists, and it is not one of ``inputs``, inside one or
    around one; and a folder can be made there. Returns ``path`` made absolute.
    """
    from visionattn.recon.outdir import OutputDirError, check_output_dir

    path = check_output(parser, path, flag=flag, folder=True)
    try:
        check_output_dir(path, inputs, tool)
    except OutputDirError as e:
        parser.error(str(e).replace("--out", flag, 1))
    return path


@contextlib.contextmanager
def output_folder(parser: argparse.ArgumentParser, path: str, *, tool: str, inputs=(), flag: str = "--out"):
    """Yield a temporary folder that becomes ``path`` when the block succeeds (the demo's output rule).

    :func:`visionattn.recon.outdir.atomic_output_dir` under ``tool``'s manifest, with SIGTERM and SIGHUP
    handled like Ctrl-C. On an error, Ctrl-C or one of those signals the temporary folder is removed and
    ``path`` is left as it was; a folder that may not be replaced or a disk that fills up exits 2 with one
    line, a signal exits 128 + its number (Ctrl-C 130) with one line, no traceback.
    """
    from visionattn.recon.outdir import OutputDirError, atomic_output_dir, handle_sigterm, stop_status

    try:
        with handle_sigterm(), atomic_output_dir(path, inputs, tool=tool, warn=print) as tmp:
            yield tmp
    except OutputDirError as e:
        parser.error(str(e).replace("--out", flag, 1))
    except KeyboardInterrupt as e:
        code, how = stop_status(e)
        parser.exit(code, f"{parser.prog}: {how}: nothing was written to {path}\n")


def output_files(parser: argparse.ArgumentParser, paths=(), *, tool: str, flag: str = "--out"):
    """The writer of a tool's output files under the rule every tool that writes follows, with ``paths`` (every
    file the run will write) checked now: exit 2 with one line unless each is new or an unchanged earlier output of
    ``tool`` (its manifest ``.visionattn-<tool>.json`` in the file's folder lists it); creates nothing.

    Returns a :class:`visionattn.reporting.OutputFiles`: write through its ``write_text`` / ``write_json`` /
    ``save_figure`` / ``path``. Each write is checked again, goes to a temporary file renamed into place and is
    recorded in the manifest; a refusal or a full disk (quota, file-size limit) then also exits 2 with one line
    (naming the folder, for a full disk), leaving no partial file. For a tool that writes a whole folder, see
    :func:`output_folder`.
    """
    from visionattn.reporting import OutputFiles

    outputs = OutputFiles(tool, flag=flag, on_error=parser.error)
    outputs.check(*paths)
    return outputs


class CorruptImageError(ValueError):
    """An image file cannot be decoded; the message names the file and the fix.

    Raised in a ``DataLoader`` worker, it reaches the main process with the worker's traceback folded into its
    message; ``str()`` gives back the one line either way.
    """

    def __str__(self) -> str:
        text = super().__str__()
        if "Original Traceback" not in text:
            return text
        lines = [ln for ln in text.splitlines() if f"{type(self).__name__}: " in ln]
        return lines[-1].split(f"{type(self).__name__}: ", 1)[1] if lines else text


def read_rgb(path: str):
    """The image at ``path`` fully decoded as an RGB ``PIL.Image`` (as torchvision's ``pil_loader``).

    Raises:
        CorruptImageError: not an image Pillow reads, truncated or corrupt data, a decompression bomb, or
            an unreadable file; one line naming ``path``.
    """
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB")  # decodes every pixel: a truncated file fails here
    except (OSError, SyntaxError, ValueError, MemoryError, Image.DecompressionBombError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise CorruptImageError(f"cannot read image {path!r} ({why}); replace or remove the file") from None


def check_image(parser: argparse.ArgumentParser, flag: str, path: str | None, example: str = "photo.jpg"):
    """The RGB image of ``path`` (:func:`read_rgb`), or exit 2 with one line when it is missing or corrupt."""
    if path is None or not os.path.isfile(path):
        parser.error(f"{flag} {path!r} is not a file; pass an image (e.g. {example})")
    try:
        return read_rgb(path)
    except CorruptImageError as e:
        parser.error(f"{flag}: {e}")


def load_config(parser: argparse.ArgumentParser, path: str, schema, flag: str = "--config") -> dict:
    """A YAML file checked against ``schema`` (a pydantic model), as a plain dict of what the file holds (optional
    entries it leaves out stay out, as in the file); else exit 2 with one line.

    The line names the file and, for a file of the wrong shape, the first offending entry
    (``sweeps.0.x0: Input should be a valid number``) and how many more problems there are.
    """
    import pydantic
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"{flag} {path!r} cannot be read ({getattr(e, 'strerror', None) or e}); pass a YAML file")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or type(e).__name__
        parser.error(f"{flag} {path!r} is not valid YAML{where}: {what}")
    try:
        return schema.model_validate(doc).model_dump(exclude_unset=True)
    except pydantic.ValidationError as e:
        errors = e.errors()
        first = errors[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(the whole file)"
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        parser.error(f"{flag} {path!r}: {loc}: {first['msg']}{more}")


def first_error(err: BaseException) -> BaseException:
    """The first exception of ``err``'s chain (``__context__``): what went wrong, not a later complaint about it
    (a failed CUDA-graph capture ends with an error that names none of the cause)."""
    while err.__context__ is not None:
        err = err.__context__
    return err


def eager_graph_timings(make, timer, device, calls: int, repeats: int) -> tuple[float, float | None, str | None]:
    """(eager ms, graph ms, why the capture failed) per call of ``fn = make()``: on CUDA timed in alternating eager
    and graph windows (:func:`visionattn.reporting.eager_graph_ms`; ``make`` runs on its capture stream, where
    autograd then runs each backward op), a failed capture named by :func:`failure_text` of its first error; on
    the CPU ``timer(fn)`` alone. ``device``: a ``torch.device`` or its name."""
    import torch

    from visionattn import reporting

    if torch.device(device).type != "cuda":
        return timer(make()), None, None
    eager, graph, error = reporting.eager_graph_ms(make, calls, repeats)
    return eager, graph, None if error is None else failure_text(first_error(error), device)


def failure_text(err: BaseException, device) -> str:
    """One line naming ``err`` for a result row (``"Type: first line"``, the line cut at 200 characters), after
    freeing what the failed work left (garbage, and on a CUDA ``device`` the allocator cache: e.g. after an OOM,
    so the next row starts clean). ``device``: a ``torch.device`` or its name."""
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
