"""What every tool stands on: arguments that fail in one line (exit 2), output files that never replace what the
tool did not write, the environment record, timing (eager beside CUDA-graph replays, the first call apart),
tables, plots, and worker processes that survive crashing cases."""
from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from visionattn.provenance import environment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout the tools belong to

__all__ = ["REPO", "ToolParser", "positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "percentile",
           "json_object", "add_common", "comma_list", "comma_ints", "comma_pairs", "default_out", "check_output",
           "check_output_folder", "output_folder", "output_files", "check_device", "failure_text", "first_error",
           "CorruptImageError", "read_rgb", "ImageList", "check_image", "load_config", "environment", "atomic_path",
           "write_text_atomic", "write_json_atomic", "OutputFiles", "markdown_table", "figure", "bars", "md_header",
           "write_results", "prefix_outputs", "tf32_flags", "Stopwatch", "call_ms", "sample_ms", "kernel_ms",
           "eager_ms", "captured_graph", "eager_graph_ms", "eager_graph_timings", "graph_cells", "host_us",
           "per_call_ms", "kernel_times", "peak_memory", "AttentionFree", "attention_free", "cores", "worker_env",
           "run_worker", "run_isolated", "run_chunks"]


# --------------------------------------------------------------------------------------------------- arguments
class ToolParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(parse, what: str):
    def number(text: str):
        try:
            x = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        return x
    return number


_int, _float = _number(int, "an integer"), _number(float, "a number")


def _bounded(parse, low: float, high: float, low_open: bool, what: str):
    """An argparse type: ``parse(text)`` within [low, high] (``low_open``: above ``low``), else a clear error."""
    def check(text: str):
        x = parse(text)
        if x < low or x > high or (low_open and x == low):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return x
    check.__doc__ = f"argparse type: {what}."
    return check


positive_int = _bounded(_int, 1, math.inf, False, "an integer >= 1")
nonnegative_int = _bounded(_int, 0, math.inf, False, "an integer >= 0")
positive_float = _bounded(_float, 0, math.inf, True, "a number > 0")
nonnegative_float = _bounded(_float, 0, math.inf, False, "a number >= 0")
percentile = _bounded(_float, 0, 100, False, "a percentile in [0, 100]")


def json_object(text: str) -> dict:
    """argparse type: a JSON object (e.g. extra ``timm.create_model`` arguments), else a one-line error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"depth\": 2}}': {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"depth\": 2}}', got {text!r}")
    return value

# the flags the tools share: name -> (type, help); a tool passes its default, and its own help where it says more
COMMON_ARGS = {
    "out": (str, "output prefix: writes <out>.md, <out>.json and <out>.png (default: %(default)s)"),
    "device": (str, "torch device: cuda, or cpu for a smoke run (wall-clock timing) (default: %(default)s)"),
    "modes": (str, "comma-separated visionattn modes (default: %(default)s)"),
    "calls": (positive_int, "back-to-back calls per timing window (default: %(default)s)"),
    "repeats": (positive_int, "timing windows; the median is reported (default: %(default)s)"),
    "warmup": (nonnegative_int, "untimed calls before timing (default: %(default)s)"),
    "seed": (int, "seed of every random draw (default: %(default)s)"),
}


def add_common(p: argparse.ArgumentParser, **defaults) -> None:
    """Add the shared flags named by ``defaults`` (:data:`COMMON_ARGS`), e.g. ``add_common(p, calls=50)``; a value
    ``(default, help)`` gives the flag the tool's own help."""
    for name, value in defaults.items():
        kind, text = COMMON_ARGS[name]
        default, text = value if isinstance(value, tuple) else (value, text)
        p.add_argument("--" + name, type=kind, default=default, help=text)


def comma_list(parser: argparse.ArgumentParser, flag: str, text: str, allowed: Sequence[str]) -> list[str]:
    """The comma-separated names of ``text`` (stripped, duplicates dropped, in order), or exit 2 with one line
    naming ``flag`` when there are none or one is not in ``allowed``."""
    items = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not items or any(x not in allowed for x in items):
        parser.error(f"{flag} {text!r}: expected a comma-separated subset of {','.join(allowed)}")
    return items


def comma_ints(parser: argparse.ArgumentParser, flag: str, text: str, low: int = 1) -> list[int]:
    """The comma-separated integers of ``text``, or exit 2 with one line naming ``flag`` when there are none or one
    is not an integer >= ``low``."""
    try:
        items = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        items = []
    if not items or min(items) < low:
        parser.error(f"{flag} {text!r}: expected comma-separated integers >= {low}")
    return items


def comma_pairs(parser: argparse.ArgumentParser, flag: str, text: str, form: str = "HxW") -> list[tuple[int, int]]:
    """The comma-separated ``AxB`` pairs of ``text`` (e.g. ``384x384,224x224``), or exit 2 with one line naming
    ``flag`` and ``form`` when there are none or one is not two integers >= 1."""
    try:
        pairs = [tuple(int(x) for x in item.lower().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        parser.error(f"{flag} {text!r}: expected comma-separated {form} integers")
    if not pairs or any(len(ab) != 2 or min(ab) < 1 for ab in pairs):
        parser.error(f"{flag} {text!r}: expected comma-separated {form} with both >= 1")
    return pairs


def check_device(parser: argparse.ArgumentParser, name: str, flag: str = "--device"):
    """``torch.device(name)``, or exit 2 if the name is invalid or names CUDA on a machine without it."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        parser.error(f"{flag} {name!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"{flag} {name}: no CUDA device here; pass {flag} cpu")
    return device


def default_out(name: str) -> str:
    """``out/<name>`` in the current folder (git-ignored): where a tool writes when ``--out`` is not given."""
    return os.path.join("out", name)


def check_output(parser: argparse.ArgumentParser, path: str, *, flag: str = "--out", folder: bool = False) -> str:
    """Exit 2 now if ``path`` (a file or file prefix; with ``folder`` a folder) could not be written at the end of
    the run; creates nothing. Returns ``path`` made absolute."""
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
    """Exit 2 now unless ``path`` may become ``tool``'s output folder (the demo's rule,
    :mod:`visionattn.recon.outdir`: new, empty or an unchanged earlier output of ``tool``, not one of ``inputs``,
    inside or around one); creates nothing. Returns ``path`` made absolute."""
    from visionattn.recon.outdir import OutputDirError, check_output_dir

    path = check_output(parser, path, flag=flag, folder=True)
    try:
        check_output_dir(path, inputs, tool)
    except OutputDirError as e:
        parser.error(str(e).replace("--out", flag, 1))
    return path


@contextlib.contextmanager
def output_folder(parser: argparse.ArgumentParser, path: str, *, tool: str, inputs=(), flag: str = "--out"):
    """Yield a temporary folder that becomes ``path`` when the block succeeds
    (:func:`visionattn.recon.outdir.atomic_output_dir`, SIGTERM / SIGHUP handled like Ctrl-C). A refused folder or a
    full disk exits 2, a signal 128 + its number, each with one line; ``path`` is then left as it was."""
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
    """A :class:`OutputFiles` of ``tool``, with ``paths`` (every file the run will write) checked now: exit 2 with
    one line unless each is new or an unchanged earlier output of ``tool``; creates nothing."""
    outputs = OutputFiles(tool, flag=flag, on_error=parser.error)
    outputs.check(*paths)
    return outputs


class CorruptImageError(ValueError):
    """An image file cannot be decoded; the message names the file and the fix. ``str()`` gives that one line back
    also when a ``DataLoader`` worker folded its traceback into the message."""
    def __str__(self) -> str:
        text = super().__str__()
        if "Original Traceback" not in text:
            return text
        lines = [ln for ln in text.splitlines() if f"{type(self).__name__}: " in ln]
        return lines[-1].split(f"{type(self).__name__}: ", 1)[1] if lines else text


def read_rgb(path: str):
    """The image at ``path`` fully decoded as an RGB ``PIL.Image``; :class:`CorruptImageError` (one line naming
    ``path``) for anything Pillow cannot read whole."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB")  # decodes every pixel: a truncated file fails here
    except (OSError, SyntaxError, ValueError, MemoryError, Image.DecompressionBombError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise CorruptImageError(f"cannot read image {path!r} ({why}); replace or remove the file") from None


class ImageList(torch.utils.data.Dataset):
    """``(transform(image), label)`` of ``(path, label)`` items, each image read by :func:`read_rgb` (a corrupt file
    raises its one-line :class:`CorruptImageError`)."""

    def __init__(self, items: Sequence[tuple[str, int]], transform: Callable):
        self.items, self.transform = list(items), transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        path, label = self.items[i]
        return self.transform(read_rgb(path)), label


def check_image(parser: argparse.ArgumentParser, flag: str, path: str | None, example: str = "photo.jpg"):
    """The RGB image of ``path`` (:func:`read_rgb`), or exit 2 with one line when it is missing or corrupt."""
    if path is None or not os.path.isfile(path):
        parser.error(f"{flag} {path!r} is not a file; pass an image (e.g. {example})")
    try:
        return read_rgb(path)
    except CorruptImageError as e:
        parser.error(f"{flag}: {e}")


def load_config(parser: argparse.ArgumentParser, path: str, schema, flag: str = "--config") -> dict:
    """A YAML file checked against ``schema`` (a pydantic model), as a dict of what the file holds; else exit 2 with
    one line naming the file and the first offending entry (``sweeps.0.x0: Input should be a valid number``)."""
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
    """The first exception of ``err``'s ``__context__`` chain (a failed CUDA-graph capture ends with an error that
    names none of the cause)."""
    while err.__context__ is not None:
        err = err.__context__
    return err


def eager_graph_timings(make, timer, device, calls: int, repeats: int, graph: bool = True,
                        warmup: int = 3) -> tuple[float, float | None, str | None]:
    """(eager ms, graph ms, why the capture failed) per call of ``fn = make()``: on CUDA with ``graph``
    :func:`eager_graph_ms` after ``warmup`` untimed calls (the failure as :func:`failure_text` of its first error);
    else ``timer(fn)`` alone."""
    if torch.device(device).type != "cuda" or not graph:
        return timer(make()), None, None
    eager, graph, error = eager_graph_ms(make, calls, repeats, warmup)
    return eager, graph, None if error is None else failure_text(first_error(error), device)


def graph_cells(ms: float | None, graph_ms: float | None, graph_error: str | None) -> list:
    """The "graph ms" and "eager / graph" table cells of a row timed by :func:`eager_graph_timings`: n/a where the
    capture failed, - where no graph (or no eager time beside it) was timed."""
    if graph_ms is None:
        return ["n/a", "n/a"] if graph_error else ["-", "-"]
    return [graph_ms, f"{ms / graph_ms:.2f}" if ms else "-"]


def failure_text(err: BaseException, device) -> str:
    """``"Type: first line"`` of ``err`` (cut at 200 characters) for a result row, after freeing what the failed
    work left (garbage, and on CUDA the allocator cache, so the next row starts clean)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


# --------------------------------------------------------------------------------------------------- outputs
@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temp path next to ``path`` (same name ending); rename it to ``path`` when the block succeeds, delete
    it otherwise (no partial files)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; outputs get the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and a rename (no partial files)."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def write_json_atomic(path: str, obj: Any, indent: int = 2) -> None:
    """JSON-dump ``obj`` (``indent``, default 2) atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent, default=str) + "\n")


# errors of a full or limited disk (disk full, quota, file-size limit): one line naming the folder, as the demo
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _checksum(path: str) -> dict[str, Any]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


class OutputFiles:
    """The files a tool writes, never replacing one it did not write (the demo's output rule, file by file).

    Each folder written into keeps the manifest ``.visionattn-<tool>.json`` listing the files ``tool`` wrote there
    (size, SHA-256). An existing file is replaced only when listed and unchanged; anything else is refused with one
    line naming the file and the fix, before the work (:meth:`check`) and again at each write. Writes go through a
    temporary file renamed into place; a full disk removes it and names the folder. ``on_error`` gets each refusal's
    line (a CLI passes ``parser.error``); otherwise ``visionattn.recon.outdir.OutputDirError`` is raised.
    ``written``: the absolute paths written so far.
    """
    def __init__(self, tool: str, flag: str = "--out", on_error: Callable[[str], Any] | None = None):
        from visionattn.recon.outdir import manifest_name

        self.tool = tool
        self.tool_id = f"visionattn.{tool}"
        self.manifest = manifest_name(self.tool_id)
        self.flag = flag
        self.written: list[str] = []
        self._on_error = on_error

    def _fail(self, exc: Exception) -> None:
        if self._on_error is not None:
            self._on_error(str(exc))
        raise exc

    def _read_manifest(self, folder: str) -> tuple[dict | None, str | None]:
        """(this tool's manifest in ``folder`` or None, why it cannot be used or None)."""
        from visionattn.recon.outdir import read_manifest

        path = os.path.join(folder, self.manifest)
        if not os.path.lexists(path):
            return None, None
        doc = None if os.path.islink(path) else read_manifest(folder, self.tool_id)
        if doc is None:
            return None, (f"{self.flag}: {path!r} is not a manifest of {self.tool} (it names the files {self.tool} "
                          f"wrote there); refusing to replace it: pass another {self.flag} or remove the file")
        return doc, None

    def refusal(self, path: str) -> str | None:
        """Why ``path`` may not be written now (one line naming it and the fix), or None when it may."""
        path = os.path.abspath(path)
        folder, name = os.path.split(path)
        if name == self.manifest:
            return f"{self.flag}: {path!r} is the name of {self.tool}'s manifest; pass another {self.flag}"
        manifest, why = self._read_manifest(folder)
        if why is not None:
            return why
        if not os.path.lexists(path):
            return None
        if os.path.islink(path) or not os.path.isfile(path):
            return (f"{self.flag}: {path!r} exists and is not a file {self.tool} wrote; refusing to replace it: "
                    f"pass another {self.flag} or remove it")
        entry = (manifest or {}).get("checksums", {}).get(name) if name in (manifest or {}).get("files", ()) else None
        if not isinstance(entry, dict):
            return (f"{self.flag}: {path!r} exists and {self.tool} did not write it (it is not in {self.manifest} "
                    f"there); refusing to replace it: pass another {self.flag} or remove the file")
        try:
            same = os.stat(path).st_size == entry.get("bytes") and _checksum(path) == entry
        except OSError:
            same = False
        if not same:
            return (f"{self.flag}: {path!r} was written by {self.tool} but has changed since; refusing to replace "
                    f"it: pass another {self.flag} or remove the file")
        return None

    def check(self, *paths: str) -> None:
        """Refuse (``on_error``, else raise) if any of ``paths`` may not be written (:meth:`refusal`); writes
        nothing."""
        from visionattn.recon.outdir import OutputDirError

        for p in paths:
            why = self.refusal(p)
            if why is not None:
                self._fail(OutputDirError(why))

    def _record(self, path: str, checksum: dict[str, Any]) -> None:
        folder, name = os.path.split(path)
        manifest, _ = self._read_manifest(folder)
        sums = {f: c for f, c in ((manifest or {}).get("checksums") or {}).items()
                if f in manifest["files"] and os.path.lexists(os.path.join(folder, f))}
        sums[name] = checksum
        doc = {"tool": self.tool_id,
               "note": f"the files {self.tool} wrote in this folder (bytes, SHA-256); a later run replaces only these, "
                       "and only while they are unchanged",
               "files": sorted(sums), "dirs": [], "checksums": dict(sorted(sums.items()))}
        write_text_atomic(os.path.join(folder, self.manifest), json.dumps(doc, indent=1) + "\n")

    @contextlib.contextmanager
    def path(self, path: str) -> Iterator[str]:
        """Yield a temporary path, renamed to ``path`` and recorded in the manifest when the block succeeds; refused
        (:meth:`refusal`) before the block and again before the rename; no partial file on any failure."""
        from visionattn.recon.outdir import OutputDirError, OutputWriteError

        path = os.path.abspath(path)
        folder = os.path.dirname(path)
        self.check(path)
        try:
            with atomic_path(path) as tmp:
                yield tmp
                checksum = _checksum(tmp)
                why = self.refusal(path)  # again: the file may have appeared while the tool worked
                if why is not None:
                    raise OutputDirError(why)
            self._record(path, checksum)
        except OutputDirError as exc:
            self._fail(exc)
        except OSError as exc:
            if exc.errno not in STORAGE_ERRNOS:
                raise
            self._fail(OutputWriteError(
                f"{self.flag}: could not write {path!r}: {exc.strerror or exc} in the folder {folder!r}; no partial "
                f"file was left: free space there or pass another {self.flag} on another disk"))
        self.written.append(path)

    def write_text(self, path: str, text: str) -> None:
        """Write ``text`` to ``path`` under the rule (:meth:`path`)."""
        with self.path(path) as tmp, open(tmp, "w") as f:
            f.write(text)

    def write_json(self, path: str, obj: Any, indent: int = 2) -> None:
        """JSON-dump ``obj`` (``indent``, default 2; non-JSON values as ``str``) to ``path`` under the rule."""
        self.write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")

    def save_figure(self, fig: Any, path: str, **savefig_kwargs: Any) -> None:
        """``fig.savefig(path, **savefig_kwargs)`` under the rule; the figure is left open (close it yourself)."""
        with self.path(path) as tmp:
            fig.savefig(tmp, **savefig_kwargs)


def markdown_table(rows: Iterable[Sequence[Any]], header: Sequence[str]) -> str:
    """A GitHub markdown table; floats shown with 4 significant digits."""
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.4g}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def tf32_flags(enabled: bool = False):
    """TF32 on or (default) off for PyTorch matmuls and cuDNN convolutions (process-wide: tools and tests only),
    restored after; yields the settings for the tool's record."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield {"torch.backends.cuda.matmul.allow_tf32": enabled, "torch.backends.cudnn.allow_tf32": enabled}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class AttentionFree:
    """While active, ``F.scaled_dot_product_attention`` computes no attention: it returns a copy of the value rows
    (``value[..., :Nq, :]``; zeros of the output's shape, without a gradient, when there are fewer key rows or the
    leading dims differ). A model timed inside runs everything but its attention: ``t(model) / t(inside)`` bounds the
    speed-up of any attention kernel (Amdahl). Gradients reach ``value``, and zeros a float ``attn_mask`` (or the
    ``relative_position_bias`` / ``bias`` of :meth:`core`) that requires them, so every other backward still runs.
    :meth:`core` answers alike for a non-SDPA attention core (``visionattn.patching.timm.override_cores``).
    ``calls`` / ``core_calls``: calls answered (0 after a forward: no bound). Not re-entrant (RuntimeError).
    """
    def __init__(self):
        self.calls = 0
        self.core_calls = 0
        self._saved = None

    def _sdpa(self, query, key, value, attn_mask=None, *args, **kwargs):
        self.calls += 1
        return self._value_rows(query, value, attn_mask)

    def core(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        """An attention core ``(query [..., Nq, D], key, value [..., Nk, Dv], **options) -> [..., Nq, Dv]`` that
        computes no attention: a copy of the value rows, as the SDPA stand-in (a ``relative_position_bias`` or
        ``bias`` option that requires a gradient gets zeros; other options ignored)."""
        self.core_calls += 1
        return self._value_rows(query, value, kwargs.get("relative_position_bias", kwargs.get("bias")))

    @staticmethod
    def _value_rows(query, value, bias=None):
        n = query.shape[-2]
        if value.shape[:-2] == query.shape[:-2] and value.shape[-2] >= n:
            out = value[..., :n, :].clone()
        else:
            out = value.new_zeros(query.shape[:-1] + value.shape[-1:])
        if isinstance(bias, torch.Tensor) and bias.requires_grad and bias.is_floating_point():
            out = _ZeroGradTo.apply(out, bias)
        return out

    def __enter__(self) -> "AttentionFree":
        if self._saved is not None:
            raise RuntimeError("AttentionFree is not re-entrant")
        self._saved = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.functional.scaled_dot_product_attention = self._saved
        self._saved = None


class _ZeroGradTo(torch.autograd.Function):
    """``out`` unchanged; in the backward, zeros for ``tied`` (its producers' backward still runs)."""

    @staticmethod
    def forward(ctx, out, tied):
        ctx.tied = (tied.shape, tied.dtype, tied.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.tied
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def attention_free() -> AttentionFree:
    """Context manager :class:`AttentionFree`: ``with attention_free() as free: t = call_ms(...)``; check
    ``free.calls > 0``."""
    return AttentionFree()


# --------------------------------------------------------------------------------------------------- timing
def _median(xs) -> float:
    return float(sorted(xs)[len(xs) // 2])


def _wall_ms(fn: Callable[[], Any], calls: int, repeats: int) -> list[float]:
    """Wall-clock ms per call of ``calls`` back-to-back ``fn()``, for each of ``repeats`` windows."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return times


class Stopwatch:
    """Total time of the regions between :meth:`start` and :meth:`stop` (or ``with stopwatch:``): CUDA events on a
    CUDA ``device`` (GPU time of the work queued, no sync inside), ``perf_counter`` elsewhere. ``kind``:
    ``"cuda-events"`` or ``"wall"``; ``count``: regions timed; :attr:`seconds` waits for the last event."""
    def __init__(self, device: str | torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.kind = "cuda-events" if self.cuda else "wall"
        self.count = 0
        self._events: list[tuple[Any, Any]] = []
        self._wall = 0.0
        self._open: Any = None

    def start(self) -> None:
        if self.cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        if self._open is None:
            raise RuntimeError("Stopwatch.stop() without a start()")
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._open, end))
        else:
            self._wall += time.perf_counter() - self._open
        self._open = None
        self.count += 1

    def __enter__(self) -> "Stopwatch":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def seconds(self) -> float:
        """Total seconds of the timed regions."""
        if self.cuda:
            if self._events:
                self._events[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        return self._wall


def call_ms(fn: Callable[[], Any], device: str | torch.device) -> float:
    """Milliseconds of one ``fn()`` (:class:`Stopwatch`; on CUDA the GPU work ``fn`` queued is inside)."""
    watch = Stopwatch(device)
    with watch:
        fn()
    return watch.seconds * 1e3


def sample_ms(fn: Callable[[], Any], device: str | torch.device, *, warmup: int = 1, reps: int | None = None,
              rep_ms: float | None = None, min_reps: int = 1, max_reps: int = 1000) -> list[float]:
    """Per-call ms of ``fn()`` (:func:`call_ms`) after ``warmup`` untimed calls: ``reps`` calls, or as many as fit
    in ``rep_ms`` (estimated from one more untimed call) within ``[min_reps, max_reps]``."""
    if (reps is None) == (rep_ms is None):
        raise ValueError("pass exactly one of reps or rep_ms")
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if reps is None:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        est_ms = (time.perf_counter() - t0) * 1e3
        reps = int(min(max_reps, max(min_reps, math.ceil(rep_ms / max(est_ms, 1e-3)))))
    return [call_ms(fn, device) for _ in range(reps)]


def kernel_ms(fn: Callable[[], Any], warmup: float, rep: float, cuda_graph: bool = False) -> float:
    """Median ms of ``fn()`` on CUDA: ``triton.testing.do_bench`` (L2 flushed between calls; a launch path longer
    than the GPU work reads as the launch time), or with ``cuda_graph`` ``do_bench_cudagraph`` (GPU time alone, no
    L2 flush). ``warmup`` / ``rep`` are ms."""
    import triton.testing

    if cuda_graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def eager_ms(fn: Callable[[], Any], calls: int = 50, warmup: int = 5, repeats: int = 5) -> float:
    """Ms per call of ``fn()`` run back to back in eager PyTorch: CUDA events around ``calls`` calls, median of
    ``repeats`` windows. The Python launch path counts, as in an eager model."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return _median(times)


def captured_graph(fn: Callable[[], Any], stream, warmup: int, calls: int):
    """``(graph, None)``: ``calls`` calls of ``fn`` captured in one CUDA graph on ``stream`` (a side stream, current)
    after ``warmup`` eager ones (compiles settle outside the capture), replayed once (the first replay uploads the
    graph); ``(None, the exception)`` where the calls cannot be captured."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
        graph.replay()
        return graph, None
    except Exception as exc:
        return None, exc


def eager_graph_ms(make: Callable[[], Callable[[], Any]], calls: int = 50, repeats: int = 5,
                   warmup: int = 3) -> tuple[float, float | None, BaseException | None]:
    """Ms per call of ``fn = make()`` eager and replayed from a CUDA graph, in alternating windows so that both see
    the same GPU state (clocks and caches drift: up to ~15 % for ~0.1 ms kernels read one after the other).

    Everything runs on a side stream (autograd runs a backward on its forward's stream): ``warmup`` calls (compiles
    settle outside the capture), ``calls`` calls captured in one graph (its own pool, freed on return), then per
    round ``calls`` eager calls between CUDA events and one replay. Returns the medians (eager, graph, None), or
    (eager, None, the exception) when the calls cannot be captured.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = error = None
    try:
        with torch.cuda.stream(stream):
            fn = make()
            graph, error = captured_graph(fn, stream, warmup, calls)
            if graph is None:  # a launch path that cannot be captured: eager timing still stands
                torch.cuda.synchronize()

            def window(run: Callable[[], Any]) -> float:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / calls

            def burst() -> None:
                for _ in range(calls):
                    fn()

            eager, replay = [], []
            for _ in range(repeats):
                eager.append(window(burst))
                if graph is not None:
                    replay.append(window(graph.replay))
    finally:
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return _median(eager), (_median(replay) if replay else None), error


def host_us(fn: Callable[[], Any], calls: int = 200, warmup: int = 20, repeats: int = 5) -> float:
    """Host µs per call of ``fn()``: wall time of ``calls`` calls without synchronising, median of ``repeats``
    windows (a tiny call's GPU work ends before the next launch: the Python + dispatch + launch path alone)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        times += _wall_ms(fn, calls, 1)
        torch.cuda.synchronize()
    return _median(times) * 1e3


def kernel_times(fn: Callable[[], Any], device: str | torch.device, calls: int = 10,
                 warmup: int = 2) -> list[dict]:
    """Where one ``fn()`` spends its time, kernel by kernel: ``[{"name", "us", "calls"}]``, ``us`` the kernel's time
    and ``calls`` its launches per ``fn()``, the largest time first, from ``torch.profiler`` over ``calls`` calls
    after ``warmup`` unprofiled ones. On CUDA: every GPU activity (kernels, memsets, copies) with its device time, the
    calls replayed from a CUDA graph on a side stream (as :func:`eager_graph_ms` captures them): eager calls of a small
    shape leave the GPU idle between launches, and its clocks then drop and stretch the kernels; where the calls cannot
    be captured, eager ones. Elsewhere: the ATen operators with their self CPU time. Two backends a few percent apart
    in total differ in some of these rows."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    run = fn
    if cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph, _ = captured_graph(fn, stream, warmup, 1)
            run = fn if graph is None else graph.replay  # a launch path that cannot be captured: eager calls
            torch.cuda.synchronize()
    else:
        for _ in range(warmup):
            fn()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    totals: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != kind or not (cuda or event.name.startswith("aten::")):
            continue
        spent = totals.setdefault(event.name, [0.0, 0])
        spent[0] += event.device_time_total if cuda else event.self_cpu_time_total
        spent[1] += 1
    rows = [{"name": name, "us": us / calls, "calls": n / calls} for name, (us, n) in totals.items()]
    return sorted(rows, key=lambda r: -r["us"])


def per_call_ms(device: torch.device, calls: int, repeats: int,
                warmup: int = 3) -> Callable[[Callable[[], Any]], float]:
    """A timer ``timer(fn) -> ms per call``: :func:`eager_ms` on CUDA; elsewhere the wall clock around ``calls``
    calls, median of ``repeats`` windows after ``warmup`` untimed calls."""
    if device.type == "cuda":
        return lambda fn: eager_ms(fn, calls=calls, warmup=warmup, repeats=repeats)

    def wall(fn):
        for _ in range(warmup):
            fn()
        return _median(_wall_ms(fn, calls, repeats))
    return wall


def peak_memory(fn: Callable[[], Any], device: str | torch.device) -> dict:
    """Most CUDA memory allocated during one ``fn()`` (MiB): ``peak_mib`` in all, ``peak_extra_mib`` beyond what was
    allocated before it (garbage collected and the allocator's cache emptied first); None on the CPU."""
    if torch.device(device).type != "cuda":
        return {"peak_mib": None, "peak_extra_mib": None}
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"peak_mib": peak / 2**20, "peak_extra_mib": (peak - before) / 2**20}


# --------------------------------------------------------------------------------------------------- reports
def md_header(title: str, env: dict, *notes: str) -> list[str]:
    """The opening lines of a markdown report: ``# title``, the device and versions, the command, then one bullet
    per note."""
    return [f"# {title}", "",
            f"* device: {env.get('device')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), triton "
            f"{env.get('triton')}, timm {env.get('timm')}, python {env.get('python')}",
            f"* command: `{env.get('command')}`", *(f"* {n}" for n in notes), ""]




def write_results(outputs: OutputFiles, prefix: str, result: dict, markdown: str | None = None,
                  plot: Callable[[dict, str, OutputFiles], Any] | None = None, indent: int = 2) -> None:
    """Write ``<prefix>.json`` (``result``, JSON indented by ``indent``), ``<prefix>.md`` (``markdown``, when given)
    and ``<prefix>.png`` (``plot(result, path, outputs)``, when given) through ``outputs``."""
    outputs.write_json(prefix + ".json", result, indent)
    if markdown is not None:
        outputs.write_text(prefix + ".md", markdown)
    if plot is not None:
        plot(result, prefix + ".png", outputs)


def prefix_outputs(parser: argparse.ArgumentParser, prefix: str, exts: Sequence[str] = (".md", ".json", ".png"), *,
                   tool: str, flag: str = "--out") -> OutputFiles:
    """:func:`check_output` of the file prefix ``prefix``, then :func:`output_files` of ``prefix + ext`` for each
    of ``exts``: the writer of a tool that writes ``<out>.md``, ``<out>.json``, ..., checked before any work."""
    check_output(parser, prefix, flag=flag)
    return output_files(parser, [prefix + ext for ext in exts], tool=tool, flag=flag)
@contextlib.contextmanager
def figure(path: str, outputs: OutputFiles | None = None, *args: Any, dpi: int = 120, tool: str | None = None,
           **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """Yield ``(fig, axes)`` of ``plt.subplots(*args, **subplots)`` (Agg); when the block succeeds the figure is
    laid out tight and saved to ``path`` at ``dpi`` through ``outputs`` (else ``OutputFiles(tool)``, else
    atomically); closed either way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*args, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        if outputs is None and tool is None:
            with atomic_path(path) as tmp:
                fig.savefig(tmp, dpi=dpi)
        else:
            (outputs or OutputFiles(tool)).save_figure(fig, path, dpi=dpi)
    finally:
        plt.close(fig)


def bars(ax, labels: Sequence[str], series: dict, fontsize: int = 8) -> None:
    """Grouped bars on ``ax``: a group per label, a bar per series (name -> values, one per label; None: no bar),
    each group centred on its tick."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        shown = [(j + (i - (len(series) - 1) / 2) * width, v) for j, v in enumerate(values) if v is not None]
        ax.bar([x for x, _ in shown], [v for _, v in shown], width, label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=fontsize)


# --------------------------------------------------------------------------------------------------- isolation
def cores() -> int:
    """The CPU cores this process may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def worker_env(jobs: int = 1) -> dict:
    """A worker's environment: this process's (one shared Triton cache), plus, unless set,
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (processes sharing a GPU) and, with ``jobs`` > 1,
    ``OMP_NUM_THREADS`` = cores per job."""
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if jobs > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores() // jobs)))
    return env


class Workers:
    """The live worker processes, so that an interrupted run can kill them and start no more."""

    lock = threading.Lock()
    live: set = set()
    cancelled = threading.Event()

    @classmethod
    def start(cls, cmd: list[str], env: dict):
        with cls.lock:
            if cls.cancelled.is_set():
                return None
            proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=sys.stderr, env=env)
            cls.live.add(proc)
            return proc

    @classmethod
    def finished(cls, proc) -> None:
        with cls.lock:
            cls.live.discard(proc)

    @classmethod
    def cancel(cls) -> None:
        with cls.lock:
            cls.cancelled.set()
            for proc in cls.live:
                proc.kill()


def run_worker(cmd: list[str], ids: list[str], *, env: dict, case_timeout: float,
               tmp_prefix: str = "worker_") -> tuple[list[dict], int | str, bool]:
    """Run ``cmd --worker-ids FILE --worker-out FILE`` for ``ids``; the worker writes JSON lines: ``{"id": ...}``
    per result, ``{"begin": id}`` before each case, ``{"stopped": why}`` on its time budget. Returns (results, exit
    status, or ``"hung"``: no progress for ``case_timeout`` s (0: wait forever), killed, or ``"cancelled"``:
    interrupted first; whether it stopped on the budget or was not started)."""
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
        ids_path, out_path = os.path.join(tmp, "ids.txt"), os.path.join(tmp, "results.jsonl")
        with open(ids_path, "w") as f:
            f.write("\n".join(ids))
        proc = Workers.start(cmd + ["--worker-ids", ids_path, "--worker-out", out_path], env)
        if proc is None:
            return [], "cancelled", True
        try:
            rc = _wait_worker(proc, out_path, case_timeout)
        finally:
            Workers.finished(proc)
        results, stopped = _read_worker_results(out_path)
        return results, rc, stopped


def _wait_worker(proc, out_path: str, case_timeout: float) -> int | str:
    """A worker's exit status, or ``"hung"`` once its results file has not grown for ``case_timeout`` s since its
    first line (killed; 0: wait forever)."""
    size, progress = 0, time.time()
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            now_size = os.path.getsize(out_path) if os.path.exists(out_path) else 0
            if now_size != size:
                size, progress = now_size, time.time()
            elif size and case_timeout and time.time() - progress > case_timeout:
                proc.kill()  # a kernel that never returns (a spin-wait on a flag never set)
                proc.wait()
                return "hung"


def _read_worker_results(out_path: str) -> tuple[list[dict], bool]:
    """The results a worker wrote, and whether it stopped on the time budget."""
    results, stopped = [], False
    if os.path.exists(out_path):
        with open(out_path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # the last line of a process killed mid-write
                    continue
                if row.get("stopped"):
                    stopped = True
                elif "id" in row:
                    results.append(row)
    return results, stopped


def run_isolated(ids: list[str], spawn: Callable, deadline: float | None = None) -> tuple[list[dict], bool]:
    """Run ``ids`` through ``spawn(ids, deadline) -> (results, returncode | "hung", stopped)``, surviving processes
    that die: finished cases are kept and the rest run again; a chunk that dies before finishing anything is halved
    until a case that kills a process alone is found (``crash``); a case whose CUDA error poisoned its process
    (exit status 3) is re-run alone to confirm. Returns (results in ``ids`` order, whether the budget stopped it)."""
    by_id: dict[str, dict] = {}
    stopped = False

    def go(chunk: list[str]):
        nonlocal stopped
        if not chunk or stopped or (deadline is not None and time.time() > deadline):
            stopped = stopped or bool(chunk)
            return
        results, rc, halted = spawn(chunk, deadline)
        for r in results:
            by_id[r["id"]] = r
        if halted:
            stopped = True
            return
        left = [i for i in chunk if i not in by_id]
        poisoned = [r for r in results if r.get("cuda_error")]
        if rc == 3 and poisoned and len(chunk) > 1:
            culprit = poisoned[-1]["id"]
            alone, rc_alone, _ = spawn([culprit], deadline)
            again = alone[0] if alone else None
            note = ("fails alone too" if (again and again["status"] != "pass") or rc_alone not in (0, 1)
                    else "PASSES alone: the fault may belong to a case run before it in " + ",".join(chunk))
            by_id[culprit].setdefault("errors", []).append(f"re-run alone in a fresh process: {note}")
        if not left:
            return
        if rc in (0, 1, 3) and results:
            go(left)
        elif len(chunk) == 1:
            why = ("hung: no result within --case-timeout, killed" if rc == "hung" else
                   f"the process running this case alone died (exit status {rc})")
            by_id[chunk[0]] = {"id": chunk[0], "status": "crash", "cuda_error": True, "metrics": {}, "fallbacks": [],
                               "errors": [why]}
        elif left == chunk:
            half = len(chunk) // 2
            go(chunk[:half])
            go(chunk[half:])
        else:
            go(left)

    go(list(ids))
    return [by_id[i] for i in ids if i in by_id], stopped


def run_chunks(ids: list[str], spawn: Callable, deadline: float | None = None, chunk_size: int = 200,
               jobs: int = 1, on_chunk: Callable | None = None) -> tuple[list[dict], bool]:
    """:func:`run_isolated` on consecutive chunks of ``chunk_size`` ids, up to ``jobs`` at a time, in id order
    (none starts after ``deadline``); ``on_chunk(results)`` runs in the calling thread as each finishes; an exception
    (Ctrl-C) kills the live workers. Returns (results in ``ids`` order, whether the budget stopped it)."""
    chunks = [ids[i:i + chunk_size] for i in range(0, len(ids), chunk_size)]
    parts: list = [[] for _ in chunks]
    stopped = False
    Workers.cancelled.clear()
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(chunks)))) as pool:
        futures = {pool.submit(run_isolated, chunk, spawn, deadline): n for n, chunk in enumerate(chunks)}
        try:
            for fut in as_completed(futures):
                parts[futures[fut]], halted = fut.result()
                stopped = stopped or halted
                if on_chunk is not None:
                    on_chunk(parts[futures[fut]])
        except BaseException:
            for fut in futures:
                fut.cancel()
            Workers.cancel()
            raise
    return [r for part in parts for r in part], stopped

