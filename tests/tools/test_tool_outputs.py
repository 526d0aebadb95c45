"""Every tool writes under out/ (git-ignored) unless --out names another place, and an --out that
cannot be written stops the tool at once: exit status 2, one line naming --out, before any work. bench_attention's
report (it needs a GPU to run) from stand-in records: its forward and forward + backward tables carry the graph
timing beside the eager one, the first call apart, and (--kernel-times) each backend's kernels. The index of
docs/benchmarks names every committed result."""
import hashlib
import os

import pytest

from testdata import REPO, load_script


def _load(name):
    name = name.split()[0]  # "tool --flag": the tool run with that flag
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
         "bench_cold_start", "bench_vggt", "bench_window --train"]
REQUIRED = {"eval_imagenet": ["--model", "vit_tiny_patch16_224", "--random-weights", "--synthetic-from",
                              os.path.join(REPO, "tests", "data", "photos"), "--device", "cpu"],
            "eval_svd": ["--model", "tiny-random", "--device", "cpu",
                         "--image", os.path.join(REPO, "tests", "data", "photos", "apple.jpg")],
            "bench_svd_attention": ["--device", "cpu"], "eval_pasa": ["--cpu"],
            "bench_models": ["--device", "cpu"], "bench_window --train": ["--train", "--device", "cpu"],
            "bench_vggt": ["--device", "cpu", "--tiny"],
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
    assert sorted(os.listdir(tmp_path / "out")) == [".visionattn-drift_table.json",  # its manifest: what it wrote
                                                    "drift_table1_cpu.json", "drift_table1_cpu.md"]
    assert os.listdir(tmp_path) == ["out"]
    after = {ext: hashlib.sha256(open(p, "rb").read()).hexdigest() for ext, p in committed.items()}
    assert after == before


def _md_tables(md):
    """Every markdown table of ``md``: a list of rows, each a dict by column name."""
    tables, lines = [], md.splitlines() + [""]
    rows = []
    for line in lines:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            tables.append([dict(zip(rows[0], r, strict=True)) for r in rows[2:]])
            rows = []
    return tables


@pytest.mark.parametrize("backward", [False, True])
def test_bench_attention_report_has_graph_columns(backward, tmp_path):
    """Eager ms beside graph ms and their ratio in both tables: numbers where the graph replay was timed, n/a where the
    capture failed (the reason in the JSON's graph_error), - for a skipped backend."""
    mod = _load("bench_attention")
    flops = 2e9
    shape = {"shape": "tiny", "B": 2, "H": 2, "N": 64, "D": 16, "dtype": "fp16"}
    timed = {"first": 1234.5, "eager": 0.5, "graph": 0.25}
    failed = {"first": 3.25, "eager": 0.5,
              "graph_error": "RuntimeError: operation not permitted when stream is capturing"}
    records = []
    for backend, timings in (("fp16", timed), ("sdpa-flash", failed)):
        rec = {**shape, "backend": backend, "ours": backend == "fp16", "ms": timings["eager"],
               "tflops": flops / timings["eager"] / 1e9, "ms_first": timings["first"], "peak_mib": 1.0}
        rec.update({"rel_err_dq": 1e-3, "rel_err_dk": 1e-3, "rel_err_dv": 1e-3, "rel_err": 1e-3} if backward
                   else {"rel_err": 1e-3})
        rec.update(mod._graph_fields(timings, flops))
        records.append(rec)
    records.append({**shape, "backend": "sdpa-cudnn", "ours": False, "skipped": "RuntimeError: no kernel"})
    assert records[0]["ms_graph"] == 0.25 and records[0]["eager_over_graph"] == 2.0
    assert "ms_graph" not in records[1] and records[1]["graph_error"].startswith("RuntimeError")
    env = {k: "x" for k in ("device", "command", "torch", "cuda", "triton", "timm", "python")}
    result = {"environment": env, "tf32_matmul": "off", "records": records, "targets": [],
              "timing": "eager ...; " + mod.GRAPH_TIMING}
    if backward:
        result.update(title="Attention forward + backward", flops="3.5 x 4*B*H*N*N*D", files="fwd_bwd")
    paths = mod.write_report(result, str(tmp_path))
    assert os.path.basename(paths["md"]) == ("fwd_bwd.md" if backward else "bench.md")
    md = open(paths["md"]).read()
    assert "graph ms column, n/a where the calls cannot be captured" in md
    table = _md_tables(md)[0]
    assert list(table[0])[:7] == ["inputs", "backend", "ms", "TFLOP/s", "graph ms", "eager / graph", "first call ms"]
    assert [(r["ms"], r["graph ms"], r["eager / graph"], r["first call ms"]) for r in table] == [
        ("0.5", "0.25", "2.00", "1234.5"), ("0.5", "n/a", "n/a", "3.2"), ("-", "-", "-", "-")]
    assert table[2][list(table[2])[-1]] == "RuntimeError: no kernel"


def test_bench_attention_kernel_times_follow_the_call_and_reach_the_report(tmp_path):
    """``--kernel-times``: the profiler helper counts what one call runs (here on the CPU: two matmuls and one
    softmax a call, by their ATen operators), and the report adds a per-kernel table under the shape's table, each
    backend's rows largest first and their sum, and draws the kernel times as its plot."""
    import torch

    mod = _load("bench_attention")
    a = torch.randn(256, 256)

    def call():
        torch.softmax(torch.mm(torch.mm(a, a), a), dim=-1)

    rows = mod.kernel_times(call, "cpu", calls=4, warmup=1)
    by_name = {r["name"]: r for r in rows}
    assert by_name["aten::mm"]["calls"] == 2 and by_name["aten::softmax"]["calls"] == 1
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True) and rows[0]["us"] > 0

    env = {k: "x" for k in ("device", "command", "torch", "cuda", "triton", "timm", "python")}
    shape = {"shape": "tiny", "B": 2, "H": 2, "N": 64, "D": 16, "dtype": "fp16"}
    timings = {"first": 2.0, "eager": 0.5, "graph": 0.25}
    records = [{**shape, "backend": "fp16", "ours": True, "ms": 0.5, "tflops": 4.0, "ms_first": 2.0, "peak_mib": 1.0,
                "rel_err": 1e-3, **mod._graph_fields(timings, 2e9), "kernels": rows},
               {**shape, "backend": "sdpa-cudnn", "ours": False, "skipped": "RuntimeError: no kernel"}]
    paths = mod.write_report({"environment": env, "tf32_matmul": "off", "records": records, "targets": [],
                              "timing": "eager"}, str(tmp_path))
    assert os.path.getsize(paths["png"]) > 0  # the stacked kernel-time bars
    table = _md_tables(open(paths["md"]).read())[1]
    assert [r["kernel"] for r in table] == [r["name"] for r in rows] + ["**all kernels**"]
    assert {r["backend"] for r in table} == {"visionattn fp16"}
    assert float(table[-1]["us"]) == pytest.approx(sum(float(r["us"]) for r in table[:-1]), abs=0.01 * len(rows))


@pytest.mark.parametrize("name, part", [
    ("_half_fwd_kernel", "forward"), ("_half_bwd_kernel", "backward"), ("_bwd_head_kernel", "backward"),
    ("_bwd_preprocess_kernel", "passes"), ("_dq_combine_kernel", "passes"), ("Memset (Device)", "passes"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0",
     "forward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0",
     "backward"),
    ("void cudnn::fusion::convert_dq_to_16bits<false>(void const*, void*, unsigned int)", "passes"),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64, 128, 128, 8> >(Params)",
     "passes"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64> >(Params)",
     "backward"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(Params)", "forward"),
    ("fmha_cutlassB_f16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>::Params)",
     "backward"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "forward")])
def test_bench_attention_kernel_parts_name_the_kernels_of_every_backend(name, part):
    """The kernel-time plot stacks each call's forward, backward and passes: profiled names of visionattn's, cuDNN's,
    FlashAttention's and the memory-efficient kernels; a pass's name holds its direction too (flash_bwd_dot_do_o,
    _bwd_preprocess), and the template and argument lists (other kernels' traits) do not decide."""
    assert _load("bench_attention").kernel_part(name).split()[0] == part


def test_bench_attention_plots_named_shapes_as_bars(tmp_path, monkeypatch):
    """A table of named shapes (no B=1 H=8 D=64 sweep of two or more lengths) gets bars of graph-replay TFLOP/s per
    shape and backend (eager where the capture failed); a sweep gets its TFLOP/s-vs-N lines; both a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mod = _load("bench_attention")
    env = {k: "x" for k in ("device", "command", "torch", "cuda", "triton", "timm", "python")}
    drawn = []
    real_bars = mod.bars

    def spy(ax, labels, series, **kw):
        drawn.append((list(labels), {k: list(v) for k, v in series.items()}))
        real_bars(ax, labels, series, **kw)

    monkeypatch.setattr(mod, "bars", spy)
    for sweep, out in ((False, "named"), (True, "sweep")):
        records = []
        for shape, n in (("ViT-B/16 384", 577), ("GQA4-8k", 8192)):
            dims = {"B": 1, "H": 8, "D": 64} if sweep else {"B": 32, "H": 12, "D": 64}
            for backend, graph in (("bf16", 300.0), ("sdpa-cudnn", None)):
                rec = {"shape": shape, "N": n, "dtype": "bf16", "backend": backend, "ours": backend == "bf16",
                       "ms": 1.0, "tflops": 100.0, "ms_first": 1.0, "peak_mib": 1.0, "rel_err": 1e-3, **dims}
                if graph is not None:
                    rec["tflops_graph"] = graph
                records.append(rec)
        result = {"environment": env, "tf32_matmul": "off", "records": records, "targets": [], "timing": "t"}
        paths = mod.write_report(result, str(tmp_path / out))
        assert os.path.getsize(paths["png"]) > 0 and plt.imread(paths["png"]).ndim == 3
    # bars for the named shapes only: graph TFLOP/s where timed, eager's otherwise; ours labelled as visionattn
    assert drawn == [(["ViT-B/16 384", "GQA4-8k"], {"visionattn bf16": [300.0, 300.0],
                                                     "sdpa-cudnn": [100.0, 100.0]})]


def test_bench_attention_backward_targets_use_graph_replay_and_the_bars():
    """Forward + backward targets: the ratio to cuDNN by graph replay where both sides were captured (eager
    otherwise), against 1.05x at long sequences and 1.0x at ViT-B/16 224; fp32 / tf32 against 3x / 5x
    SDPA-efficient."""
    mod = _load("bench_attention")

    def rec(backend, dtype, n, b, eager, graph=None):
        r = {"shape": f"N={n}", "B": b, "H": 12 if n == 197 else 8, "N": n, "D": 64, "dtype": dtype,
             "backend": backend, "ms": 1.0, "tflops": eager, "peak_mib": 1.0}
        return r if graph is None else {**r, "tflops_graph": graph}

    records = [rec("bf16", "bf16", 4096, 1, 300.0, 420.0), rec("sdpa-cudnn", "bf16", 4096, 1, 400.0, 400.0),
               rec("bf16", "bf16", 197, 64, 50.0), rec("sdpa-cudnn", "bf16", 197, 64, 49.0, 80.0),
               rec("fp32", "fp32", 4096, 1, 90.0, 90.0), rec("sdpa-efficient", "fp32", 4096, 1, 31.0, 31.0),
               rec("tf32", "fp32", 4096, 1, 150.0, 150.0)]
    got = {(t["shape"], t["mode"], t["vs"]): t for t in mod._targets_backward(records) if "ratio" in t}
    long = got[("N=4096", "bf16", "sdpa-cudnn")]
    assert (long["timing"], long["need_ratio"], long["met"]) == ("graph", 1.05, True)  # 1.05x by graph, 0.75 eager
    vit = got[("N=197", "bf16", "sdpa-cudnn")]
    assert (vit["timing"], vit["need_ratio"], vit["met"]) == ("eager", 1.0, True)  # no graph of ours: eager
    assert not got[("N=4096", "fp32", "sdpa-efficient")]["met"]  # 2.9x < 3x
    assert got[("N=4096", "tf32", "sdpa-efficient")]["need_ratio"] == 5.0
    # grouped-query shapes (fewer K / V heads), at every length: >= 1.0x SDPA enable_gqa (cuDNN, flash) in half
    # precision, >= 2.5x SDPA-efficient on repeated K / V in fp32; not the equal-heads bars
    grouped = []
    for n in (1025, 16384):
        for backend, dtype, graph in (("bf16", "bf16", 408.0), ("sdpa-cudnn", "bf16", 400.0),
                                      ("sdpa-flash", "bf16", 300.0), ("fp32", "fp32", 100.0),
                                      ("sdpa-efficient-repeat-kv", "fp32", 41.0)):
            grouped.append({**rec(backend, dtype, n, 1, graph, graph), "shape": f"GQA N={n}", "H": 16, "Hkv": 4})
    got = {(t["shape"], t["mode"], t["vs"]): t for t in mod._targets_backward(grouped) if "ratio" in t}
    for n in (1025, 16384):
        assert [(t["vs"], t["need_ratio"], t["met"]) for (shape, _, _), t in got.items() if shape == f"GQA N={n}"] == [
            ("sdpa-efficient-repeat-kv", 2.5, False), ("sdpa-flash", 1.0, True), ("sdpa-cudnn", 1.0, True)]


def test_bench_attention_forward_targets_use_graph_replay_where_both_sides_have_it(tmp_path):
    """Forward targets from 4096 tokens: the ratio by graph replay where ours and the baseline were both captured (a
    slow host moves the eager columns of every backend), eager otherwise and below 4096 tokens (the launch path is a
    part of a ViT-sized call's time); the table names which."""
    mod = _load("bench_attention")

    def rec(backend, dtype, eager, graph=None):
        r = {"shape": "L-4k", "B": 1, "H": 8, "N": 4096, "D": 64, "dtype": dtype, "backend": backend, "ms": 1.0,
             "tflops": eager, "peak_mib": 1.0, "rel_err": 1e-3, "ours": backend in ("bf16", "tf32")}
        return r if graph is None else {**r, "tflops_graph": graph}

    # eager: ours 0.9x cuDNN (a slow launch path), graph: 1.02x; flash has no graph reading
    records = [rec("bf16", "bf16", 360.0, 440.0), rec("sdpa-cudnn", "bf16", 400.0, 431.0),
               rec("sdpa-flash", "bf16", 290.0), rec("tf32", "fp32", 200.0, 210.0)]
    got = {(t["mode"], t["vs"]): t for t in mod._targets(records) if "ours_tflops" in t}
    cudnn = got[("bf16", "sdpa-cudnn")]
    assert (cudnn["timing"], cudnn["ours_tflops"], cudnn["base_tflops"], cudnn["met"]) == ("graph", 440.0, 431.0,
                                                                                           True)
    flash = got[("bf16", "sdpa-flash")]
    assert (flash["timing"], flash["ours_tflops"], flash["met"]) == ("eager", 360.0, True)  # 1.24x >= 1.2x
    absolute = got[("tf32", "flex-tf32")]  # no flex record: the absolute bar, on our graph reading
    assert (absolute["timing"], absolute["ours_tflops"], absolute["met"]) == ("graph", 210.0, True)
    short = [{**r, "shape": "ViT", "N": 197} for r in records[:2]]
    (vit,) = [t for t in mod._targets(short) if t["vs"] == "sdpa-cudnn"]
    assert (vit["timing"], vit["ratio"], vit["met"]) == ("eager", 0.9, False)
    env = {k: "x" for k in ("device", "command", "torch", "cuda", "triton", "timm", "python")}
    paths = mod.write_report({"environment": env, "tf32_matmul": "off", "records": records,
                              "targets": mod._targets(records)}, str(tmp_path))
    rows = {(r["mode"], r["vs"]): r for r in _md_tables(open(paths["md"]).read())[-1]}
    assert rows[("bf16", "sdpa-cudnn")]["TFLOP/s or memory"] == "440.0 vs 431.0 (graph)"
    assert rows[("bf16", "sdpa-flash")]["TFLOP/s or memory"] == "360.0 vs 290.0 (eager)"
    assert rows[("tf32", "absolute")]["TFLOP/s or memory"] == "210.0 (graph)"


def test_every_committed_result_is_indexed():
    """docs/benchmarks/README.md indexes every committed result: each file there is named by the index or by a
    result page it links (in a table cell, ``(.json, .png)`` after links to ``.md`` pages names their siblings), and
    every link the pages hold resolves to a committed file."""
    import re

    folder = os.path.join(REPO, "docs", "benchmarks")
    files = set(os.listdir(folder))
    named, broken = set(), []
    for page in sorted(f for f in files if f.endswith(".md")):
        with open(os.path.join(folder, page), encoding="utf-8") as fh:
            for cell in fh.read().replace("\n", "|").split("|"):
                targets = [t for t in re.findall(r"\]\(([^)#\s]+)\)", cell) if "/" not in t and ":" not in t]
                siblings = [ext for group in re.findall(r"\((\.[a-z]+(?:, \.[a-z]+)*)\)", cell)
                            for ext in re.findall(r"\.([a-z]+)", group)]
                targets += [f"{t[:-3]}.{ext}" for t in targets if t.endswith(".md") for ext in siblings]
                for target in targets:
                    if target in files:
                        named.add(target)
                    else:
                        broken.append(f"{page} -> {target}")
    assert not broken, f"links to files that are not committed: {broken}"
    unindexed = sorted(files - named - {"README.md"})
    assert not unindexed, f"results no index page names: {unindexed}"
