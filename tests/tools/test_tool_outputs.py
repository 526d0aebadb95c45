"""Every tool writes under out/ (git-ignored) unless --out names another place, and an --out that
cannot be written stops the tool at once: exit status 2, one line naming --out, before any work."""
import hashlib
import os

import pytest

from testdata import REPO, load_script


def _load(name):
    return load_script(f"tools/{name}.py", f"tool_outputs_{name}")


def _parser(mod):
    return mod.build_parser() if hasattr(mod, "build_parser") else mod.parser


def _run(mod, argv):
    """Call the tool's main the way its ``__main__`` block does."""
    import inspect

    param = next(iter(inspect.signature(mod.main).parameters))
    return mod.main(argv) if param == "argv" else mod.main(_parser(mod).parse_args(argv))


TOOLS = ["drift_table", "eval_pasa", "check_kernels_offline", "bench_attention", "bench_window", "bench_models",
         "eval_imagenet", "eval_svd", "bench_svd_attention", "bench_train", "finetune", "bench_backward",
         "bench_cold_start", "bench_vggt"]
REQUIRED = {"eval_imagenet": ["--model", "vit_tiny_patch16_224", "--random-weights", "--synthetic-from",
                              os.path.join(REPO, "tests", "data", "photos"), "--device", "cpu"],
            "eval_svd": ["--model", "tiny-random", "--device", "cpu",
                         "--image", os.path.join(REPO, "tests", "data", "photos", "apple.jpg")],
            "bench_svd_attention": ["--device", "cpu"], "eval_pasa": ["--cpu"],
            "bench_models": ["--device", "cpu"], "bench_vggt": ["--device", "cpu", "--tiny"],
            "bench_train": ["--device", "cpu", "--cases", "vit_tiny_patch16_224:32:2"],
            "finetune": ["--data", os.path.join(REPO, "tests", "data", "photos"), "--device", "cpu"]}


@pytest.mark.parametrize("name", TOOLS)
def test_default_output_is_under_out(name):
    default = _parser(_load(name)).get_default("out")
    assert default is None or default.split(os.sep)[0] == "out", default


@pytest.mark.parametrize("name", TOOLS)
def test_unwritable_out_exits_2_before_any_work(name, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        _run(_load(name), REQUIRED.get(name, []) + ["--out", str(blocker / "sub" / "result")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0], err


def test_drift_table_quick_leaves_the_committed_table_alone(tmp_path, monkeypatch):
    committed = {ext: os.path.join(REPO, "docs", "benchmarks", f"drift_table1_cpu.{ext}") for ext in ("md", "json")}
    before = {ext: hashlib.sha256(open(p, "rb").read()).hexdigest() for ext, p in committed.items()}
    monkeypatch.chdir(tmp_path)
    _load("drift_table").main(["--quick"])
    assert sorted(os.listdir(tmp_path / "out")) == ["drift_table1_cpu.json", "drift_table1_cpu.md"]
    assert os.listdir(tmp_path) == ["out"]
    after = {ext: hashlib.sha256(open(p, "rb").read()).hexdigest() for ext, p in committed.items()}
    assert after == before
