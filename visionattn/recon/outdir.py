"""The output folder of a reconstruction: safe replacement, atomic writing, a manifest.

Every output folder this package writes holds a manifest, ``.visionattn-recon.json``,
listing every file and folder written into it. An existing ``OUT_DIR`` is
replaced only when

* it is empty, or
* its manifest is valid and the folder holds nothing the manifest does not list
  (an earlier output of this tool, untouched since), and
* it is not an input, does not contain an input and does not lie inside an
  input folder.

Anything else raises :class:`OutputDirError` before any work is done. Outputs
are written into a hidden temporary sibling (``.NAME.tmp-*``) created up front
(which also proves the location is writable) and renamed into place at the
end; on an error, Ctrl-C, SIGTERM or SIGHUP the temporary folder is removed and
``OUT_DIR`` is left as it was; a full disk (or quota, or a file-size limit) while
writing becomes one :class:`OutputWriteError` naming the folder. When an earlier
output is replaced, only the entries its manifest lists are deleted.

Other tools keep the same rule under their own name (``tool``, e.g.
``"visionattn.finetune"``: manifest ``.visionattn-finetune.json``): a folder is
replaced only by the tool whose manifest it holds.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager

__all__ = ["MANIFEST", "TOOL_ID", "OutputDirError", "OutputWriteError", "Terminated", "check_output_dir",
           "atomic_output_dir", "read_manifest", "manifest_name", "list_tree", "handle_sigterm", "stop_status",
           "STOP_SIGNALS", "stop_signals_deferred"]

TOOL_ID = "visionattn.recon"


def manifest_name(tool: str = TOOL_ID) -> str:
    """The manifest file of ``tool``'s output folders: ``.visionattn-recon.json`` for ``"visionattn.recon"``."""
    return "." + tool.replace(".", "-") + ".json"


MANIFEST = manifest_name(TOOL_ID)

# signals that stop a run the way Ctrl-C does: the temporary folder is removed, OUT_DIR is left as it was
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# errors of a full or limited disk: reported as OutputWriteError, in one line naming the folder
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class OutputDirError(ValueError):
    """``OUT_DIR`` cannot be used: not ours to replace, overlaps an input, or not writable."""


class OutputWriteError(OutputDirError):
    """Writing ``OUT_DIR`` failed for lack of space (disk full, quota, file-size limit); nothing was left there."""


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by the handler of :func:`handle_sigterm` (SIGTERM, SIGHUP).

    A ``KeyboardInterrupt`` subclass, so these signals take the same clean-up path as Ctrl-C.

    Attributes:
        signum: the signal's number; ``name`` its name (``"SIGTERM"``); ``exit_code`` ``128 + signum``,
            the status a shell reports for a process that signal stopped.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(f"terminated by signal {signum}")
        self.signum = int(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_status(exc: KeyboardInterrupt) -> tuple[int, str]:
    """(exit status, words) for a run stopped by ``exc``: Ctrl-C ``(130, "interrupted (Ctrl-C)")``, a
    :class:`Terminated` ``(128 + signum, "terminated (SIGHUP)")``."""
    if isinstance(exc, Terminated):
        return exc.exit_code, f"terminated ({exc.name})"
    return 128 + signal.SIGINT, "interrupted (Ctrl-C)"


@contextmanager
def handle_sigterm(signals=STOP_SIGNALS):
    """Turn each of ``signals`` (SIGTERM and SIGHUP) into :class:`Terminated` while the block runs.

    Main thread only (elsewhere a no-op). A signal that is ignored when the block starts (SIGHUP under
    ``nohup``) stays ignored.
    """
    def _raise(signum, frame):
        raise Terminated(signum)

    with _handled(signals, _raise):
        yield


@contextmanager
def _handled(signals, handler):
    """Set ``handler`` for each of ``signals`` not ignored when the block starts, and yield the handlers it
    replaced ({signal: previous}), restored at the end; in a thread other than the main one (where handlers
    cannot be set) nothing is set and the block gets ``{}``."""
    previous = {}
    try:
        for sig in signals:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: signals cannot be handled here
        for sig, old in previous.items():
            signal.signal(sig, old)
        yield {}
        return
    try:
        yield previous
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def stop_signals_deferred():
    """Hold Ctrl-C, SIGTERM and SIGHUP back while the block runs, then act on the first that came as its
    handler would have (raise :class:`KeyboardInterrupt` / :class:`Terminated`, or the default action).

    For code that must not see the stop exception half-way: importing a library whose optional-dependency
    guards catch ``BaseException`` (trimesh's do) would swallow it, and the run would go on as if no signal had
    come. The signals' handlers run in the main thread only, so a recorder there holds them all back. Main thread
    only (elsewhere a no-op: no signal is raised in another thread).
    """
    got = []
    with _handled((signal.SIGINT, *STOP_SIGNALS), lambda signum, frame: got.append(signum)) as previous:
        yield
    if got:
        handler = previous[got[0]]
        if callable(handler):
            handler(got[0], None)
        else:  # the default action (SIG_DFL; None: a handler not set from Python), now that it is back
            signal.raise_signal(got[0])


def list_tree(folder: str) -> tuple[list[str], list[str]]:
    """(files, dirs) under ``folder`` as sorted relative POSIX paths; links count as files, never followed."""
    files, dirs = [], []
    for root, dnames, fnames in os.walk(folder, followlinks=False):
        rel = os.path.relpath(root, folder)
        for d in list(dnames):
            full = os.path.join(root, d)
            path = d if rel == "." else f"{rel}/{d}".replace(os.sep, "/")
            if os.path.islink(full):
                files.append(path)
                dnames.remove(d)
            else:
                dirs.append(path)
        for f in fnames:
            files.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
    return sorted(files), sorted(dirs)


def _safe_rel(p) -> bool:
    return (isinstance(p, str) and p != "" and not p.startswith("/") and "\\" not in p
            and all(part not in ("", ".", "..") for part in p.split("/")))


def read_manifest(folder: str, tool: str = TOOL_ID) -> dict | None:
    """The manifest of ``folder`` if it is a valid one of ``tool``, else None.

    Returns:
        dict with ``files`` and ``dirs`` (relative POSIX paths, no ``..``).
    """
    try:
        with open(os.path.join(folder, manifest_name(tool))) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("tool") != tool:
        return None
    files, dirs = doc.get("files"), doc.get("dirs")
    if not isinstance(files, list) or not isinstance(dirs, list):
        return None
    if not all(_safe_rel(p) for p in files + dirs):
        return None
    return doc


def _inside(child: str, parent: str) -> bool:
    """Whether real path ``child`` equals or lies under real path ``parent``."""
    try:
        return os.path.commonpath([child, parent]) == parent
    except ValueError:
        return False


def _check_overlap(out_real: str, inputs) -> None:
    for inp in inputs:
        if inp is None:
            continue
        in_real = os.path.realpath(inp)
        if out_real == in_real:
            raise OutputDirError(f"--out {out_real!r} is the input itself; choose a folder outside the input")
        if _inside(in_real, out_real):
            raise OutputDirError(f"--out {out_real!r} contains the input {in_real!r}; "
                                 "choose a folder that does not hold the input")
        if os.path.isdir(in_real) and _inside(out_real, in_real):
            raise OutputDirError(f"--out {out_real!r} lies inside the input folder {in_real!r}; "
                                 "choose a folder outside the input")


def check_output_dir(out_dir: str, inputs=(), tool: str = TOOL_ID) -> None:
    """Raise :class:`OutputDirError` unless ``out_dir`` may be created or replaced.

    Args:
        out_dir: the requested output folder.
        inputs: input paths (image folder, video file) ``out_dir`` must not be, contain or lie in.
        tool: whose earlier output may be replaced (see :func:`manifest_name`).

    Raises:
        OutputDirError: ``out_dir`` overlaps an input, is a file or a link, cannot
            be listed, or holds anything this tool did not write (listed in its manifest).
    """
    out_abs = os.path.abspath(out_dir)
    _check_overlap(os.path.realpath(out_abs), inputs)
    if not os.path.lexists(out_abs):
        return
    if os.path.islink(out_abs) or not os.path.isdir(out_abs):
        raise OutputDirError(f"--out {out_dir!r} exists and is not a folder; choose another path")
    try:
        entries = os.listdir(out_abs)
        if not entries:
            return
        manifest = read_manifest(out_abs, tool)
        if manifest is None:
            shown = ", ".join(repr(e) for e in sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
            raise OutputDirError(
                f"--out {out_dir!r} is not empty and is not an earlier output of this tool (no valid "
                f"{manifest_name(tool)}; "
                f"it holds {shown}); refusing to replace it: choose a new or empty folder")
        files, dirs = list_tree(out_abs)
    except OSError as exc:
        raise OutputDirError(f"--out {out_dir!r} cannot be read ({exc.strerror or exc}); choose another folder") \
            from exc
    extra = sorted((set(files) - set(manifest["files"]) - {manifest_name(tool)})
                   | (set(dirs) - set(manifest["dirs"])))
    if extra:
        shown = ", ".join(repr(e) for e in extra[:3]) + (", ..." if len(extra) > 3 else "")
        raise OutputDirError(
            f"--out {out_dir!r} is an earlier output of this tool but now also holds {shown}, which it did not "
            "write; refusing to replace it: move those files or choose a new folder")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove_listed(folder: str, manifest: dict, tool: str) -> bool:
    """Delete the entries ``manifest`` lists (and the manifest) from ``folder``; True if it ends up gone."""
    steps = [(os.unlink, rel) for rel in list(manifest["files"]) + [manifest_name(tool)]]
    steps += [(os.rmdir, rel) for rel in sorted(manifest["dirs"], key=lambda p: -p.count("/"))]
    for remove, rel in steps:
        try:
            remove(os.path.join(folder, *rel.split("/")))
        except FileNotFoundError:
            pass
        except OSError:
            return False
    try:
        os.rmdir(folder)
    except OSError:
        return False
    return True


def _write_manifest(tmp: str, extra: dict | None, tool: str) -> None:
    files, dirs = list_tree(tmp)
    name = manifest_name(tool)
    doc = {"tool": tool,
           "note": "every file and folder this tool wrote here; the folder is replaced by a later run "
                   "only while it holds nothing else",
           "files": [f for f in files if f != name], "dirs": dirs, **(extra or {})}
    with open(os.path.join(tmp, name), "w") as f:
        json.dump(doc, f, indent=1)


def _remove_empty(folders) -> None:
    for d in folders:
        try:
            os.rmdir(d)
        except OSError:
            pass


@contextmanager
def atomic_output_dir(out_dir: str, inputs=(), manifest_extra: dict | None = None, warn=None,
                      tool: str = TOOL_ID):
    """Check ``out_dir``, yield a fresh temporary sibling folder, and on success rename it into place.

    The temporary folder is created on entry, so an unwritable location (read-only
    folder, ``/proc``, a path under a file) fails here, before any work. On exit
    the manifest is written, the folder gets the permissions of the folder it
    replaces (or ``0777 & ~umask`` for a new one) and is renamed to ``out_dir``;
    an earlier output there is removed entry by entry from its manifest. Signals
    (SIGINT, SIGTERM, SIGHUP) are held back during that final swap. On any exception,
    Ctrl-C, SIGTERM and SIGHUP included (see :func:`handle_sigterm`), the temporary folder
    is removed, along with any parent folders created for it, and ``out_dir`` is untouched.

    Args:
        out_dir: destination folder.
        inputs: input paths ``out_dir`` must not overlap (see :func:`check_output_dir`).
        manifest_extra: extra keys for the manifest.
        warn: callable(str) for a note when an earlier output cannot be fully removed.
        tool: whose output this is (its manifest's name and ``tool`` entry; see :func:`manifest_name`).

    Raises:
        OutputDirError: see :func:`check_output_dir`; or the location is not writable.
        OutputWriteError: the disk (or quota) filled up while the block or the final swap wrote, in one
            line naming ``out_dir`` and the folder of the temporary copy (already removed).
    """
    out_abs = os.path.abspath(out_dir)
    check_output_dir(out_dir, inputs, tool)
    parent = os.path.dirname(out_abs)
    created = []
    probe = parent
    while not os.path.lexists(probe):
        created.append(probe)
        probe = os.path.dirname(probe)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_abs)}.tmp-", dir=parent)
    except OSError as exc:
        _remove_empty(created)
        raise OutputDirError(f"--out {out_dir!r} cannot be written ({exc.strerror or exc}); "
                             "choose a writable folder") from exc
    try:
        yield tmp
        _write_manifest(tmp, manifest_extra, tool)
        blocked = {signal.SIGINT, *STOP_SIGNALS}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            _swap_into_place(tmp, out_dir, out_abs, inputs, warn, tool)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    except BaseException as exc:
        # further stop signals wait until the temporary folder is gone (one arriving mid-removal would leave it)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *STOP_SIGNALS})
        try:
            for _ in range(3):  # a file written while the tree is removed keeps its folder: remove again
                shutil.rmtree(tmp, ignore_errors=True)
                if not os.path.lexists(tmp):
                    break
            _remove_empty(created)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS:
            raise OutputWriteError(
                f"--out {out_dir!r} could not be written: {exc.strerror or exc} in {parent!r} (where the output "
                "is assembled before it is renamed into place); nothing was written: free space there or pass "
                "an --out on another disk") from exc
        raise


def _swap_into_place(tmp: str, out_dir: str, out_abs: str, inputs, warn, tool: str) -> None:
    check_output_dir(out_dir, inputs, tool)  # again: the folder may have changed while we worked
    parent = os.path.dirname(out_abs)
    if os.path.isdir(out_abs):
        os.chmod(tmp, os.stat(out_abs).st_mode & 0o7777)
        previous = read_manifest(out_abs, tool)
        if previous is None:  # empty folder (checked just above): rename replaces it
            os.rename(tmp, out_abs)
            return
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_abs)}.old-", dir=parent)
        os.rmdir(old)
        os.rename(out_abs, old)
        os.rename(tmp, out_abs)
        if not _remove_listed(old, previous, tool) and warn is not None:
            warn(f"note: the earlier output was moved to {old!r} but could not be removed completely")
    else:
        os.chmod(tmp, 0o777 & ~_umask())
        os.rename(tmp, out_abs)
