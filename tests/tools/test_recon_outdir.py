"""The reconstruction demo's --out handling: never replace what the tool did not write, never touch the input."""
import json
import os
import runpy
import shutil
import stat

import pytest

from testdata import MULTIVIEW, REPO, default_stop_signals

from visionattn.recon.outdir import MANIFEST, OutputDirError, atomic_output_dir, check_output_dir, list_tree


TINY = ["--weights", "random-tiny", "--device", "cpu", "--size", "140", "--quiet", "--no-preview"]


demo = runpy.run_path(os.path.join(REPO, "demos", "reconstruct.py"), run_name="reconstruct_demo_outdir")


def _snapshot(folder):
    """{relative path: bytes} of every file under ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = open(p, "rb").read()
    return out


def _run(argv, capsys):
    try:
        code = demo["main"](argv)["exit_code"]
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture
def images(tmp_path):
    """Two photos with a cameras.json beside them (the generic dataset layout, also a typical input)."""
    src = tmp_path / "photos"
    shutil.copytree(os.path.join(MULTIVIEW, "aloe"), src)
    (src / "cameras.json").write_text('{"frames": []}')
    return src


def test_folder_with_a_cameras_json_and_user_files_is_not_replaced(images, tmp_path, capsys):
    m = tmp_path / "m"
    m.mkdir()
    (m / "cameras.json").write_text("{}")
    (m / "notes.txt").write_text("keep")
    before = _snapshot(m)
    code, err = _run([str(images), "--out", str(m), *TINY], capsys)
    assert code == 2
    assert _snapshot(m) == before
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "not an earlier output" in lines[0]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.parametrize("where", ["input", "inside_input", "parent_of_input"])
def test_out_overlapping_the_input_is_refused_and_images_survive(where, images, tmp_path, capsys):
    out = {"input": images, "inside_input": images / "recon", "parent_of_input": tmp_path}[where]
    before = _snapshot(images)
    code, err = _run([str(images), "--out", str(out), *TINY], capsys)
    assert code == 2 and "input" in err and len(err.strip().splitlines()) == 1
    assert _snapshot(images) == before
    assert not (images / "recon").exists()
    assert not [p for p in os.listdir(images) if p.startswith(".")]


def test_earlier_output_is_replaced_only_while_it_holds_nothing_else(images, tmp_path, capsys):
    out = tmp_path / "recon"
    code, _ = _run([str(images), "--out", str(out), *TINY], capsys)
    assert code == 0
    doc = json.load(open(out / MANIFEST))
    files, dirs = list_tree(str(out))
    assert sorted(doc["files"]) == sorted(f for f in files if f != MANIFEST) and sorted(doc["dirs"]) == dirs
    assert "cameras.json" in doc["files"] and "points.ply" in doc["files"]
    # an untouched earlier output is replaced by the new run
    (out / "cameras.json").write_text('{"marker": "old run"}')
    code, _ = _run([str(images), "--out", str(out), "--max-frames", "1", *TINY], capsys)
    assert code == 0
    assert len(json.load(open(out / "cameras.json"))["frames"]) == 1
    # once the user adds a file of their own, nothing is replaced
    (out / "notes.txt").write_text("mine")
    (out / "depth" / "extra.png").write_bytes(b"user")
    before = _snapshot(out)
    code, err = _run([str(images), "--out", str(out), *TINY], capsys)
    assert code == 2 and "notes.txt" in err and "did not write" in err
    assert _snapshot(out) == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_forged_or_broken_manifests_do_not_unlock_a_folder(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "precious.txt").write_text("x")
    for doc in ({"tool": "visionattn.recon", "files": ["../precious.txt"], "dirs": []},
                {"tool": "something-else", "files": ["precious.txt"], "dirs": []},
                {"tool": "visionattn.recon", "files": "precious.txt", "dirs": []}):
        (d / MANIFEST).write_text(json.dumps(doc))
        with pytest.raises(OutputDirError):
            check_output_dir(str(d))
    (d / MANIFEST).write_text("{not json")
    with pytest.raises(OutputDirError):
        check_output_dir(str(d))
    # a listed file is fine; an unlisted empty folder is not
    (d / MANIFEST).write_text(json.dumps({"tool": "visionattn.recon", "files": ["precious.txt"], "dirs": []}))
    check_output_dir(str(d))
    (d / "sub").mkdir()
    with pytest.raises(OutputDirError, match="sub"):
        check_output_dir(str(d))


def test_replacing_removes_only_listed_entries(tmp_path):
    """The swap deletes the earlier output entry by entry from its manifest, never with a blind rmtree."""
    out = tmp_path / "out"
    with atomic_output_dir(str(out)) as tmp:
        os.makedirs(os.path.join(tmp, "depth"))
        open(os.path.join(tmp, "depth", "a.png"), "w").write("1")
    assert json.load(open(out / MANIFEST))["files"] == ["depth/a.png"]
    with atomic_output_dir(str(out)) as tmp:
        open(os.path.join(tmp, "b.txt"), "w").write("2")
    assert sorted(os.listdir(out)) == sorted([MANIFEST, "b.txt"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_error_inside_the_block_leaves_no_trace(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(str(out)) as tmp:
            open(os.path.join(tmp, "x"), "w").write("1")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []  # the parents it created are gone too


def test_permissions_follow_umask_or_the_replaced_folder(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_output_dir(str(tmp_path / "new")):
            pass
        assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o750
        (tmp_path / "empty").mkdir()
        os.chmod(tmp_path / "empty", 0o775)
        with atomic_output_dir(str(tmp_path / "empty")):
            pass
        assert stat.S_IMODE(os.stat(tmp_path / "empty").st_mode) == 0o775
    finally:
        os.umask(old)


@pytest.mark.parametrize("where", ["proc", "under_a_file", "read_only"])
def test_unusable_out_fails_before_any_work(where, images, tmp_path, capsys):
    if where == "proc":
        out = "/proc/visionattn-recon-out"
    elif where == "under_a_file":
        (tmp_path / "file.txt").write_text("x")
        out = str(tmp_path / "file.txt" / "out")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o555)
        out = str(ro / "out")
    code, err = _run([str(images), "--out", out, *TINY], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --out") and "Traceback" not in err
    assert "inference" not in err


_GUARDED_IMPORT = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from visionattn.recon.outdir import Terminated, handle_sigterm, stop_signals_deferred
sig = getattr(signal, sys.argv[2])
deferred = sys.argv[3] == "deferred"
# a module whose optional-import guard catches BaseException (as trimesh's do), with a stop signal arriving inside it
with open(os.path.join(sys.argv[1], "guarded_lib.py"), "w") as f:
    f.write("import os, signal, time\\n"
            "try:\\n"
            f"    os.kill(os.getpid(), {int(sig)})\\n"
            "    time.sleep(0.2)\\n"
            "except BaseException:\\n"
            "    pass\\n")
with handle_sigterm():
    try:
        if deferred:
            with stop_signals_deferred():
                import guarded_lib  # noqa: F401
        else:
            import guarded_lib  # noqa: F401
    except KeyboardInterrupt as exc:  # Terminated is one
        print(type(exc).__name__, getattr(exc, "signum", int(signal.SIGINT)))
    else:
        print("went on")
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_during_a_guarded_import_is_acted_on_after_it(sig, tmp_path):
    """An import whose guards catch BaseException swallows the stop exception raised inside it, and the run goes
    on (the cause of a demo that ignored SIGTERM while trimesh imported); stop_signals_deferred holds the signal
    back and raises it once the import is done."""
    import signal
    import subprocess
    import sys

    def run(how):
        proc = subprocess.run([sys.executable, "-c", _GUARDED_IMPORT, str(tmp_path), sig, how], capture_output=True,
                              text=True, timeout=60, cwd=REPO, preexec_fn=default_stop_signals)
        assert proc.returncode == 0, proc.stderr
        (tmp_path / "guarded_lib.py").unlink()
        return proc.stdout.strip()

    assert run("plain") == "went on"
    name = "KeyboardInterrupt" if sig == "SIGINT" else "Terminated"
    assert run("deferred") == f"{name} {int(getattr(signal, sig))}"
