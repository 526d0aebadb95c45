"""The output rule of every tool that writes named files (``_harness.output_files``,
:class:`_harness.OutputFiles`): a file the tool did not write (a user's file, a link, its own output
edited since) is never replaced: exit status 2 and one line naming the file and the fix, before any work, the file
byte-identical; a second run replaces the tool's own earlier outputs (listed with their checksums in
``.visionattn-<tool>.json``); a full disk (ENOSPC, EDQUOT, EFBIG) is one line naming the folder, with no partial or
temporary file left.

(finetune.py and eval_svd.py, which write a whole folder under the demo's rule, are tested in test_hostile_cli.py.)
"""
import builtins
import errno
import json
import os

import pytest

from testdata import MULTIVIEW, PHOTOS, load_script

# tool -> (arguments besides --out, --out relative to tmp_path, a file the run writes, relative to tmp_path)
TOOLS = {
    "drift_table": ([], "res/r", "res/r.json"),
    "eval_pasa": (["--cpu", "--quick"], "res/r", "res/r.md"),
    "check_kernels_offline": ([], "res/r", "res/r.json"),
    "bench_attention": ([], "res", "res/bench.md"),
    "bench_backward": (["--device", "cpu"], "res/r", "res/r.md"),
    "bench_cold_start": ([], "res", "res/cold_start.json"),
    "bench_context_parallel": (["--device", "cpu"], "res/r", "res/r.md"),
    "bench_official": (["--official", "nowhere", "--model", "fastvggt", "--device", "cpu"], "res/r", "res/r.json"),
    "bench_integrations": (["--device", "cpu"], "res/r", "res/r.md"),
    "bench_models": (["--device", "cpu"], "res/r", "res/r.png"),
    "bench_svd_attention": (["--device", "cpu"], "res/r", "res/r.md"),
    "bench_train": (["--device", "cpu", "--cases", "vit_tiny_patch16_224:32:2"], "res/r", "res/r.png"),
    "bench_varlen": (["--device", "cpu"], "res/r", "res/r.md"),
    "bench_vggt": (["--device", "cpu", "--tiny"], "res/r", "res/r.json"),
    "bench_window": ([], "res/r", "res/r.md"),
    "bench_window --train": (["--train", "--device", "cpu"], "res/r", "res/r.md"),
    "eval_imagenet": (["--model", "vit_tiny_patch16_224", "--random-weights", "--synthetic-from", PHOTOS,
                       "--device", "cpu"], "res/r.json", "res/r.md"),
    "eval_reconstruction": (["modes", os.path.join(MULTIVIEW, "aloe"), "--device", "cpu"], "res",
                            "res/eval_reconstruction_modes.json"),
}
USERS = b"the user's own file\n"
_MODULES = {}


def _tool(name):
    name = name.split()[0]  # "tool --flag": the tool run with that flag
    if name not in _MODULES:
        try:
            _MODULES[name] = load_script(f"tools/{name}.py", f"outputs_hostile_{name}")
        except ImportError as e:  # an optional dependency (timm, diffusers, triton's compiler) is missing
            pytest.skip(f"tools/{name}.py cannot be imported here: {e}")
    return _MODULES[name]


def _main(mod, argv, capsys):
    """(exit code, stderr) of the tool's main called as its __main__ block does (0 when it returns)."""
    import inspect

    capsys.readouterr()
    param = next(iter(inspect.signature(mod.main).parameters))
    parser = mod.build_parser() if hasattr(mod, "build_parser") else mod.parser
    try:
        res = mod.main(argv) if param == "argv" else mod.main(parser.parse_args(argv))
        code = res.get("exit_code", 0) if isinstance(res, dict) else 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def _one_line(err, *needles):
    lines = [shown for line in err.split("\n") if (shown := line.split("\r")[-1].strip())]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _listing(folder):
    """{name: bytes} of every file in ``folder`` (hidden ones included), not recursive."""
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, f))}


# ----------------------------------------------------------------------------- a file the tool did not write
@pytest.mark.parametrize("name", list(TOOLS))
def test_a_users_file_at_an_output_path_is_refused_before_any_work(name, tmp_path, capsys):
    mod = _tool(name)
    extra, out, target = TOOLS[name]
    user = tmp_path / target
    user.parent.mkdir(parents=True)
    user.write_bytes(USERS)
    before = os.stat(user).st_mtime_ns
    code, err = _main(mod, extra + ["--out", str(tmp_path / out)], capsys)
    assert code == 2
    _one_line(err, "--out", repr(str(user)), "did not write it", "pass another --out or remove the file")
    assert user.read_bytes() == USERS and os.stat(user).st_mtime_ns == before
    assert os.listdir(user.parent) == [user.name]  # nothing written beside it: no output, manifest or temp file


def test_the_check_comes_before_the_work(tmp_path, capsys, monkeypatch):
    mod = _tool("drift_table")
    monkeypatch.setattr(mod, "run", lambda args: pytest.fail("computed the table despite the refusal"))
    (tmp_path / "r.md").write_bytes(USERS)
    code, err = _main(mod, ["--quick", "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and (tmp_path / "r.md").read_bytes() == USERS
    _one_line(err, "r.md")


# ----------------------------------------------------------------------------- runs that write (fast on the CPU)
def _fake_pasa_accuracy(cfg, args, device):
    """Two rows of an x0 sweep, in run_accuracy's layout (the real one takes minutes on the CPU)."""
    res = {m: {"rmse": 1e-3 * (i + 1), "nan_inf_pct": 0.0} for i, m in enumerate(cfg["modes"])}
    return [{"section": "x0 sweep (stub)", "kind": "uniform", "x0": x0, "am": 1.0, "shape": [1, 1, 8, 8],
             "results": res} for x0 in (0.0, 10.0)]


RUNS = {  # tool -> (arguments besides --out, files written under the prefix)
    "drift_table": (["--quick", "--block-size", "64"], [".json", ".md"]),
    "bench_varlen": (["--device", "cpu", "--lengths", "5,9", "--heads", "2", "--head-dim", "8", "--calls", "1",
                      "--repeats", "1", "--modes", "fp32", "--methods", "visionattn,sdpa-padded", "--quiet"],
                     [".json", ".md"]),
    "eval_pasa": (["--cpu", "--quick"], [".json", ".md", ".png"]),
}


@pytest.fixture
def runnable(monkeypatch):
    def load(name):
        mod = _tool(name)
        if name == "eval_pasa":
            monkeypatch.setattr(mod, "run_accuracy", _fake_pasa_accuracy)
        return mod
    return load


@pytest.mark.parametrize("name", list(RUNS))
def test_a_second_run_replaces_its_own_outputs_and_nothing_else(name, runnable, tmp_path, capsys):
    mod = runnable(name)
    extra, exts = RUNS[name]
    (tmp_path / "notes.txt").write_bytes(USERS)  # a user's file beside the outputs
    argv = extra + ["--out", str(tmp_path / "r")]
    assert _main(mod, argv, capsys)[0] == 0
    manifest = json.load(open(tmp_path / f".visionattn-{name}.json"))
    assert manifest["tool"] == f"visionattn.{name}" and manifest["files"] == sorted("r" + e for e in exts)
    inodes = {e: os.stat(tmp_path / ("r" + e)).st_ino for e in exts}
    code, err = _main(mod, argv, capsys)
    assert code == 0, err
    assert all(os.stat(tmp_path / ("r" + e)).st_ino != inodes[e] for e in exts)  # each replaced by a new file
    assert sorted(os.listdir(tmp_path)) == sorted([f".visionattn-{name}.json", "notes.txt"] + ["r" + e for e in exts])
    assert (tmp_path / "notes.txt").read_bytes() == USERS
    for e in exts:  # the manifest holds the checksum of what is there now
        assert json.load(open(tmp_path / f".visionattn-{name}.json"))["checksums"]["r" + e]["bytes"] == \
            os.path.getsize(tmp_path / ("r" + e))


def test_an_output_edited_since_is_refused(tmp_path, capsys):
    mod = _tool("drift_table")
    argv = ["--quick", "--block-size", "64", "--out", str(tmp_path / "r")]
    assert _main(mod, argv, capsys)[0] == 0
    with open(tmp_path / "r.md", "a") as f:
        f.write("my notes on the table\n")
    before = _listing(tmp_path)
    code, err = _main(mod, argv, capsys)
    assert code == 2
    _one_line(err, repr(str(tmp_path / "r.md")), "has changed since")
    assert _listing(tmp_path) == before


def test_another_tools_output_is_not_this_tools(tmp_path, capsys):
    """A file in bench_varlen's manifest is not drift_table's to replace."""
    mod = _tool("drift_table")
    (tmp_path / "r.json").write_text("{}\n")
    (tmp_path / ".visionattn-bench_varlen.json").write_text(json.dumps(
        {"tool": "visionattn.bench_varlen", "files": ["r.json"], "dirs": [],
         "checksums": {"r.json": {"bytes": 3, "sha256": "0" * 64}}}))
    before = _listing(tmp_path)
    code, err = _main(mod, ["--quick", "--out", str(tmp_path / "r")], capsys)
    assert code == 2
    _one_line(err, "r.json", "drift_table did not write it")
    assert _listing(tmp_path) == before


# ----------------------------------------------------------------------------- a full disk
class _FullDisk:
    """A file object that writes half of the first block it is given, then fails as a full disk does."""

    def __init__(self, f, code):
        self._f, self._code = f, code

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError(self._code, os.strerror(self._code))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _fill_disk(monkeypatch, folder, ending, code=errno.ENOSPC):
    """Writes of the temporary files in ``folder`` whose name ends with ``ending`` fail with ``code``."""
    real_open = builtins.open

    def full_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        name = str(file)
        if ("w" in mode and os.path.dirname(os.path.abspath(name)) == str(folder)
                and os.path.basename(name).startswith(".tmp-") and name.endswith(ending)):
            return _FullDisk(f, code)
        return f

    monkeypatch.setattr(builtins, "open", full_open)


@pytest.mark.parametrize("name, ending, code", [("drift_table", ".json", errno.ENOSPC),
                                                ("bench_varlen", ".md", errno.EDQUOT),
                                                ("eval_pasa", ".png", errno.EFBIG)])
def test_a_full_disk_is_one_line_naming_the_folder_and_leaves_no_partial_file(name, ending, code, runnable, tmp_path,
                                                                               capsys, monkeypatch):
    mod = runnable(name)
    extra, exts = RUNS[name]
    (tmp_path / "notes.txt").write_bytes(USERS)
    _fill_disk(monkeypatch, tmp_path, ending, code)
    code_, err = _main(mod, extra + ["--out", str(tmp_path / "r")], capsys)
    assert code_ == 2
    _one_line(err, repr(str(tmp_path)), os.strerror(code), "--out")
    done = exts[: exts.index(ending)]  # the files written before the disk filled up: complete, recorded
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt"] + ["r" + e for e in done]
                                                  + ([f".visionattn-{name}.json"] if done else []))
    if done:
        sums = json.load(open(tmp_path / f".visionattn-{name}.json"))["checksums"]
        assert sorted(sums) == ["r" + e for e in sorted(done)]
    assert (tmp_path / "notes.txt").read_bytes() == USERS


def test_a_full_disk_on_a_second_run_keeps_the_first_runs_files(tmp_path, capsys, monkeypatch):
    mod = _tool("drift_table")
    argv = ["--quick", "--block-size", "64", "--out", str(tmp_path / "r")]
    assert _main(mod, argv, capsys)[0] == 0
    before = _listing(tmp_path)
    _fill_disk(monkeypatch, tmp_path, ".md")
    code, err = _main(mod, argv, capsys)
    assert code == 2
    _one_line(err, repr(str(tmp_path)), os.strerror(errno.ENOSPC))
    after = _listing(tmp_path)
    assert after.keys() == before.keys()  # no temporary file; r.md is the first run's, whole
    assert after["r.md"] == before["r.md"]


# ----------------------------------------------------------------------------- the helper's other refusals
def test_links_folders_manifest_names_and_foreign_manifests_are_refused(tmp_path):
    from visionattn.recon.outdir import OutputDirError, OutputWriteError
    OutputFiles = load_script("tools/_harness.py").OutputFiles

    outputs = OutputFiles("drift_table")
    (tmp_path / "real.json").write_bytes(USERS)
    os.symlink(tmp_path / "real.json", tmp_path / "link.json")
    (tmp_path / "dir.json").mkdir()
    for path, needle in [(tmp_path / "link.json", "is not a file drift_table wrote"),
                         (tmp_path / "dir.json", "is not a file drift_table wrote"),
                         (tmp_path / ".visionattn-drift_table.json", "is the name of drift_table's manifest")]:
        with pytest.raises(OutputDirError, match=needle):
            outputs.write_text(str(path), "x")
    assert os.readlink(tmp_path / "link.json") == str(tmp_path / "real.json")
    assert (tmp_path / "real.json").read_bytes() == USERS

    other = tmp_path / "other"
    other.mkdir()
    (other / ".visionattn-drift_table.json").write_bytes(USERS)  # not a manifest: never replaced
    with pytest.raises(OutputDirError, match="is not a manifest of drift_table"):
        outputs.write_text(str(other / "new.md"), "x")
    assert _listing(other) == {".visionattn-drift_table.json": USERS}

    outputs.write_json(str(tmp_path / "new" / "a.json"), {"a": 1})  # a new folder: created, recorded
    outputs.write_json(str(tmp_path / "new" / "a.json"), {"a": 2})  # its own: replaced
    assert json.load(open(tmp_path / "new" / "a.json")) == {"a": 2} and outputs.written[-1].endswith("a.json")

    class Full:
        def savefig(self, path, **kw):
            open(path, "wb").write(b"half a PNG")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputWriteError, match=repr(str(tmp_path / "new"))):
        outputs.save_figure(Full(), str(tmp_path / "new" / "a.png"))
    assert sorted(os.listdir(tmp_path / "new")) == [".visionattn-drift_table.json", "a.json"]
