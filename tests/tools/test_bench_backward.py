"""tools/bench_backward.py on CPU (Triton's interpreter): a dense and a window shape with a bias gradient, the
bias-splits sweep, the rows and their files, the graph columns (no CUDA graph on the CPU: "-"; a stand-in graph
timer for their numbers and n/a), the first call apart, and the argument checks."""
import json

import pytest
import torch

from testdata import load_script

tool = load_script("tools/bench_backward.py")
import _harness as harness  # noqa: E402  (tools/ is on sys.path once a tool is loaded)


def test_tiny_dense_and_window_rows(tmp_path, monkeypatch):
    """Shapes small enough for the interpreter, in the table's format (B, H, N, D, bias, windows per image):
    every (shape, mode, bias splits) cell runs and lands in the JSON and the markdown."""
    monkeypatch.setitem(tool.SHAPES, "tiny-dense", (2, 2, 24, 8, True, 0))
    monkeypatch.setitem(tool.SHAPES, "tiny-window", (6, 2, 20, 8, True, 3))
    out = tmp_path / "bwd"
    args = tool.build_parser().parse_args([
        "--device", "cpu", "--shapes", "tiny-dense", "tiny-window", "--modes", "fp32", "bf16", "--bias-splits", "2",
        "--configs", "16,32,4,1/32,16,4,1", "--fp32-products", "tf32x3", "--calls", "1", "--repeats", "1",
        "--warmup", "0", "--no-sdpa", "--out", str(out)])
    res = tool.main(args)
    ours = [(r["shape"], r["mode"], r["kernel"], r["bias_splits"]) for r in res["rows"]]
    expected = [(s, m, name + ("" if g is None else f" splits={g}"), g) for m in ("fp32", "bf16")
                for s, name in (("tiny-dense", "visionattn"), ("tiny-window", "visionattn-fused"),
                                ("tiny-window", "visionattn-split")) for g in (None, 2)]
    expected += [(s, m, name + " tiles=16,32,4,1/32,16,4,1", None) for m in ("fp32", "bf16")
                 for s, name in (("tiny-dense", "visionattn"), ("tiny-window", "visionattn-split"))]
    expected += [(s, "fp32", name + " products=tf32x3", None) for s, name in (
        ("tiny-dense", "visionattn"), ("tiny-window", "visionattn-fused"), ("tiny-window", "visionattn-split"))]
    expected += [(s, "fp32", name + " tiles=16,32,4,1/32,16,4,1 products=tf32x3", None)  # tiles x products
                 for s, name in (("tiny-dense", "visionattn"), ("tiny-window", "visionattn-split"))]
    assert sorted(ours, key=str) == sorted(expected, key=str)
    assert all(r["ms"] > 0 and r["error"] is None for r in res["rows"])
    assert {r["windows_per_image"] for r in res["rows"]} == {0, 3}
    assert json.load(open(str(out) + ".json"))["rows"] == res["rows"]
    assert all(r["graph_ms"] is None and r["eager_over_graph"] is None and r["graph_error"] is None
               for r in res["rows"])
    md = open(str(out) + ".md").read()
    assert "visionattn-split splits=2" in md and "CPU wall clock" in md and "no CUDA graph" in md
    table = _table(md)
    assert list(table[0]) == ["shape", "mode", "kernel", "ms", "TFLOP/s", "graph ms", "eager / graph",
                              "first call ms", "x SDPA-efficient", "peak extra MiB"]
    assert len(table) == len(res["rows"]) and all(r["graph ms"] == r["eager / graph"] == "-" for r in table)
    # the first call of each cell timed apart (it compiles: longer than a timed call of the same cell)
    assert all(r["first_ms"] > 0 for r in res["rows"])
    assert [t["first call ms"] for t in table] == [f"{r['first_ms']:.1f}" for r in res["rows"]]


def _table(md):
    """The markdown table's rows as dicts by column name."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def test_graph_columns_numbers_and_na(tmp_path, monkeypatch):
    """The graph ms / eager / graph cells and JSON keys from the timer's answers: a time (ratio = eager over it)
    for one row, n/a with graph_error for a row whose capture failed; the eager columns stay."""
    monkeypatch.setitem(tool.SHAPES, "tiny-dense", (2, 2, 24, 8, True, 0))
    answers = iter([(0.5, 0.25, None), (0.75, None, "RuntimeError: not capturable")])

    def timings(make, timer, device, calls, repeats, graph, warmup):
        assert callable(make()) and device.type == "cpu" and graph and warmup == 3
        return next(answers)

    monkeypatch.setattr(tool, "eager_graph_timings", timings)
    out = tmp_path / "bwd"
    rows = tool.main(tool.build_parser().parse_args([
        "--device", "cpu", "--shapes", "tiny-dense", "--modes", "fp32", "--bias-splits", "1", "--calls", "1",
        "--repeats", "1", "--no-sdpa", "--out", str(out)]))["rows"]
    assert [r["kernel"] for r in rows] == ["visionattn", "visionattn splits=1"]
    assert [r["ms"] for r in rows] == [0.5, 0.75] and all(r["error"] is None for r in rows)
    assert [(r["graph_ms"], r["eager_over_graph"], r["graph_error"]) for r in rows] == [
        (0.25, 2.0, None), (None, None, "RuntimeError: not capturable")]
    assert json.load(open(str(out) + ".json"))["rows"] == rows
    table = _table(open(str(out) + ".md").read())
    assert [(r["graph ms"], r["eager / graph"]) for r in table] == [("0.25", "2.00"), ("n/a", "n/a")]


def test_timings_off_and_failures(monkeypatch):
    """On the CPU or with --no-graph the eager timer alone; on CUDA the paired timer's eager and graph readings,
    and a capture that fails gives (eager, None, the first error of its chain)."""
    def must_not_run(*a):
        raise AssertionError("eager_graph_ms called")

    def chained():
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
        except RuntimeError:
            try:
                raise RuntimeError("capture invalidated")
            except RuntimeError as exc:
                return exc

    timer = lambda fn: 1.5  # noqa: E731
    timings = harness.eager_graph_timings
    monkeypatch.setattr(harness, "eager_graph_ms", must_not_run)
    assert timings(lambda: None, timer, torch.device("cpu"), 2, 3) == (1.5, None, None)
    assert timings(lambda: None, timer, torch.device("cuda"), 2, 3, graph=False) == (1.5, None, None)
    monkeypatch.setattr(harness, "eager_graph_ms", lambda make, calls, repeats, warmup: (2.0, None, chained()))
    assert timings(lambda: None, timer, torch.device("cuda"), 2, 3) == (
        2.0, None, "RuntimeError: CUDA error: operation not permitted when stream is capturing")
    monkeypatch.setattr(harness, "eager_graph_ms",
                        lambda make, calls, repeats, warmup: (2.0, calls * repeats * 10.0 + warmup, None))
    assert timings(lambda: None, timer, torch.device("cuda"), 2, 3) == (2.0, 63.0, None)
    assert timings(lambda: None, timer, torch.device("cuda"), 2, 3, warmup=0) == (2.0, 60.0, None)
    assert tool.build_parser().parse_args(["--no-graph"]).no_graph


@pytest.mark.parametrize("argv", [["--shapes", "swin-b-s9"], ["--bias-splits", "0"], ["--modes", "fp8"],
                                  ["--configs", "64,64,4"], ["--configs", "48,64,4,2/64,64,4,2"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.build_parser().parse_args(argv)
    assert exc.value.code == 2 and "error" in capsys.readouterr().err
