"""tools/gpu_conformance.py and its library (visionattn.testing.conformance) on the CPU: a short run through
Triton's interpreter (every family, forward and backward, zero failures, the report's counts and files),
reproducibility by case id, the checker flagging wrong outputs and gradients (so a run cannot pass vacuously),
refusals, the time budget, --isolate's bisection of cases whose process dies, and --jobs: parallel chunks give the
same results in the same order, bisect their own dead processes and start nothing after the time budget."""
import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest
import torch

import visionattn as va
from visionattn.testing import conformance as conf

from testdata import REPO, load_script

tool = load_script("tools/gpu_conformance.py", "gpu_conformance_under_test")
import _harness as harness  # noqa: E402  (tools/ is on sys.path once a tool is loaded)
CPU = torch.device("cpu")


def _args(*argv):
    return tool.build_parser().parse_args(["--device", "cpu", *argv])


def _first_case(family, mode=None, grad=None, start=0, seed=0, **want):
    """The first tiny-profile case of ``family`` (and ``mode`` / ``grad`` / spec entries) from index ``start``."""
    for i in range(start, start + 5000):
        spec = conf.draw_case(seed, i, "tiny")
        if spec["family"] == family and (mode is None or spec["mode"] == mode) and \
                (grad is None or spec["grad"] == grad) and all(spec.get(k) == v for k, v in want.items()):
            return spec
    raise AssertionError(f"no {family} {mode} case")


@pytest.fixture(scope="module")
def serial_run(tmp_path_factory):
    """20 cases of seed 0 run in this process (--jobs 1): (the report, its folder)."""
    out = tmp_path_factory.mktemp("serial") / "conf"
    return tool.main(_args("--cases", "20", "--time-budget", "0", "--jobs", "1", "--out", str(out))), out


def test_short_run_has_no_failures_and_reports_every_case(serial_run):
    """20 cases of seed 0 in the interpreter (Triton backend forced): every case passes, is refused as documented or
    is skipped with a reason; the counts, the files and the JSON agree."""
    report, out = serial_run
    assert not report["environment"]["isolate"] and report["environment"]["jobs"] == 1
    s = report["summary"]
    assert s["cases_selected"] == s["cases_run"] == 20 and s["stopped_early"] is None
    assert s["failed"] == 0, report["failures"]
    assert s["pass"] + s["refused"] + s["skipped"] == 20 and s["pass"] >= 15
    cells = [c for fam in report["counts"].values() for c in fam.values()]
    assert sum(sum(c.values()) for c in cells) == 20
    assert len(report["counts"]) >= 5  # families
    ran = [r for r in report["results"] if r["status"] == "pass"]
    assert any(r["grad"] for r in ran) and any(not r["grad"] for r in ran)
    assert any(q in r["metrics"] for r in ran for q in ("dq", "dk", "dv"))
    assert all(m["ok"] and m["ratio"] <= 1 for r in ran for m in r["metrics"].values())
    assert report["environment"]["TRITON_INTERPRET"] == "1" and report["environment"]["backend"] == "triton"
    assert json.load(open(out / "gpu_conformance.json"))["summary"] == s
    md = open(out / "gpu_conformance.md").read()
    assert "## Cases per family and mode" in md and "## Worst error per mode and quantity" in md
    assert "20 of 20 cases run" in md


def test_case_ids_reproduce_the_same_case():
    """A case depends on its id alone: drawn twice, selected through filters or not, run twice."""
    a, b = conf.draw_case(7, 123, "tiny"), conf.draw_case(7, 123, "tiny")
    assert a == b and conf.describe(a) == conf.describe(b)
    assert conf.draw_case(7, 124, "tiny") != a
    # cases sharing a skeleton: the same kernel-variant choices, their own lengths and values
    twins: dict = {}
    for i in range(400):
        s = conf.draw_case(7, i, "tiny")
        if s["skeleton"] is not None:
            twins.setdefault((s["family"], s["mode"], s["skeleton"]), []).append(s)
    groups = [g for g in twins.values() if len(g) > 1]
    assert len(groups) >= 10 and sum(s["skeleton"] is None for s in map(lambda i: conf.draw_case(7, i, "tiny"),
                                                                         range(400))) > 120
    for group in groups:
        assert len({json.dumps(_skeleton_of(s), sort_keys=True) for s in group}) == 1, group
    assert any(len({(s["Nq"], s["Nk"], s["B"], s["H"], s["tensor_seed"]) for s in g}) > 1 for g in groups)
    picked = tool.select_cases(_args("--seed", "7", "--cases", "5", "--families", "window", "--modes", "fp16"))
    assert [p["family"] for p in picked] == ["window"] * 5 and {p["mode"] for p in picked} == {"fp16"}
    for p in picked:
        seed, index = tool.parse_case_id(p["id"])
        assert conf.draw_case(seed, index, "tiny") == p
    spec = _first_case("dense", "fp32", grad=True)
    one, two = (conf.run_case(spec, CPU) for _ in range(2))
    assert one["status"] == two["status"] == "pass"
    assert {q: m["err"] for q, m in one["metrics"].items()} == {q: m["err"] for q, m in two["metrics"].items()}
    # the reproduce line names the case, and --case runs exactly it
    line = tool.reproduce_line(spec, _args("--profile", "tiny"))
    assert line == f"python tools/gpu_conformance.py --case {spec['id']} --device cpu"
    args = _args("--case", spec["id"])
    tool._prepare(args, tool.build_parser())
    (again,) = tool.select_cases(args)
    assert conf.describe(again) == conf.describe(spec)


def _skeleton_of(spec: dict) -> dict:
    """What cases sharing a skeleton share: the entries Triton compiles variants for, without lengths or shapes."""
    keep = ("dtype", "D", "Dv", "grad", "causal", "scale", "cosine", "form", "max_seqlen", "num_splits", "needs",
            "rpb", "shift", "logit_scale", "overflow", "expect_refusal")
    out = {k: spec.get(k) for k in keep}
    for aux in ("bias", "mask"):
        out[aux] = spec.get(aux) and {k: v for k, v in spec[aux].items() if k not in ("shape", "layout")}
    return out


def test_interpreted_bf16_underflow_is_not_counted():
    """The interpreter casts FP32 values below 2^-126 to bfloat16 values up to ~2^-126 away (module docstring):
    a gradient whose exact value is ~1e-42 everywhere comes out ~1e-38. On the interpreter in bf16 those
    differences are not counted; on a GPU, in another mode, or at any size a real defect has, they still fail."""
    g = torch.Generator().manual_seed(0)
    gold = 1e-42 * torch.rand(2, 1, 31, 8, generator=g, dtype=torch.float64)
    ours = gold + 2.7e-38 * torch.rand(gold.shape, generator=g, dtype=torch.float64)
    zero = torch.zeros_like(gold)  # PyTorch's bf16 gradient: flushed to 0
    assert conf.check_quantity("dk", ours, gold, zero, "bf16", interpreted=True)["ok"]
    assert not conf.check_quantity("dk", ours, gold, zero, "bf16")["ok"]
    assert not conf.check_quantity("dk", ours, gold, zero, "fp16", interpreted=True)["ok"]
    assert not conf.check_quantity("dk", gold + 1e-30, gold, zero, "bf16", interpreted=True)["ok"]


def test_interpreted_bf16_rounding_term_truncates():
    """``r``'s casts: to nearest for a GPU (torch's cast), the FP32 value's low 16 bits dropped for the interpreter's
    bfloat16 (always toward zero, never farther than one bfloat16 step)."""
    x = torch.tensor([1 + 3 * 2.0 ** -9, -(1 + 3 * 2.0 ** -9), 3.0e-3, 0.0], dtype=torch.float64)
    assert conf._to_half(x, torch.bfloat16, False).tolist() == x.to(torch.bfloat16).double().tolist()
    t = conf._to_half(x, torch.bfloat16, True)
    assert t[:2].tolist() == [1.0, -1.0] and t[3] == 0
    assert bool((t.abs() <= x.abs()).all()) and bool(((x - t).abs() <= x.abs() * 2.0 ** -7).all())
    assert t.float().to(torch.bfloat16).double().tolist() == t.tolist()  # a bfloat16 value


def test_cancelling_bf16_cases_pass_in_the_interpreter(tmp_path):
    """bf16 cases whose dQ / dK / dBias cancel (6161:602: varlen, one-query sequences; 8080:148: ring, a -100
    bias; 8080:985: one query, 16 keys, a 4x bias with its gradient): the interpreter's truncating casts of O and dS
    moved them 1.06-1.6x past a bound whose ``r`` rounded to nearest. Runs here in a few seconds."""
    report = tool.main(_args("--case", "6161:602,8080:148,8080:985", "--out", str(tmp_path / "cancel")))
    assert report["summary"]["failed"] == 0 and report["summary"]["pass"] == 3, report["failures"]


def test_case_behind_a_minus_100_bias_passes_in_the_interpreter(tmp_path):
    """Case 4242:260 (ring, bf16, one key of 31 not behind a -100 bias): its exact dQ / dK are ~1e-41, which the
    interpreter's bfloat16 casts of the underflowing dS turn into ~1e-38. Runs here in about two seconds."""
    report = tool.main(_args("--case", "4242:260", "--out", str(tmp_path / "c260")))
    assert report["summary"]["failed"] == 0, report["failures"]


def test_ring_cases_with_float64_inputs_pass_in_the_interpreter(tmp_path):
    """Ring cases with float64 inputs in bf16 (2026:266, 31337:97, 31337:277): the ring backward hands the kernels
    the output and its gradient in the compute dtype, as the single-device backward does; in float64 they met the
    interpreter's float64 -> bfloat16 cast (1.0 -> 0, -2.5 -> NaN) and gave NaN gradients."""
    report = tool.main(_args("--case", "2026:266,31337:97,31337:277", "--out", str(tmp_path / "ring64")))
    assert report["summary"]["failed"] == 0 and report["summary"]["pass"] == 3, report["failures"]


def test_check_quantity_flags_perturbed_results():
    """The comparison itself: an error above the rule's bound fails, below passes; NaN, a wrong shape and nonzero
    values where the oracle is exactly 0 fail; the cancellation floor absorbs only a residue of its own size."""
    g = torch.Generator().manual_seed(0)
    gold = torch.randn(2, 3, 17, 16, generator=g, dtype=torch.float64)
    noise = torch.randn(gold.shape, generator=g, dtype=torch.float64)
    ref = gold + 1e-3 * noise.roll(1, -1)  # PyTorch's error ~1e-3
    assert conf.check_quantity("out", gold + 1e-3 * noise, gold, ref, "fp16")["ok"]
    bad = conf.check_quantity("out", gold + 1e-2 * noise, gold, ref, "fp16")
    assert not bad["ok"] and bad["ratio"] > 1 and "out: rel err" in bad["why"]
    # fp32: the contract 2e-6 where PyTorch's own error is smaller
    exact = gold + 1e-9 * noise
    assert conf.check_quantity("out", gold + 1e-7 * noise, gold, exact, "fp32")["ok"]
    assert not conf.check_quantity("out", gold + 1e-5 * noise, gold, exact, "fp32")["ok"]
    nan = gold.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert "non-finite" in conf.check_quantity("out", nan, gold, ref, "bf16")["why"]
    assert "shape" in conf.check_quantity("dq", gold[:1], gold, ref, "bf16")["why"]
    # gradients: 2x PyTorch's error (+ 1e-6 relative)
    assert conf.check_quantity("dv", gold + 1.9e-3 * noise.roll(1, -1), gold, ref, "fp16")["ok"]
    assert not conf.check_quantity("dv", gold + 3e-3 * noise, gold, ref, "fp16")["ok"]
    # an exactly-zero gradient (a row seeing one key): a residue within 8 u |c| passes, anything above fails
    zero = torch.zeros_like(gold)
    c = torch.ones_like(gold)
    residue = 4 * conf.UNIT_ROUNDOFF["fp16"] * noise.clamp(-1, 1)
    assert conf.check_quantity("dq", residue, zero, zero, "fp16", floor=c)["ok"]
    big = conf.check_quantity("dq", 1e-4 * noise, zero, zero, "fp16", floor=c)
    assert not big["ok"] and "exactly 0" in big["why"]
    assert not conf.check_quantity("dq", residue, zero, zero, "fp16")["ok"]  # no floor: nothing absorbed
    # fully masked rows must be exactly zero
    dead = torch.zeros(2, 3, 17, dtype=torch.bool)
    dead[1, 2, 5] = True
    out = gold.clone()
    assert "fully masked rows" in conf.dead_rows_ok("out", out, dead)
    out[1, 2, 5] = 0
    assert conf.dead_rows_ok("out", out, dead) is None


class _DenseProblem:
    """The two attributes :func:`conformance.oracle` reads: theta and ref_args (dense q, k, v, scale)."""

    def __init__(self, q, k, v, mask=None, scale=0.3):
        self.theta = {"q": q.requires_grad_(), "k": k.requires_grad_(), "v": v.requires_grad_()}
        self.mask, self.scale = mask, scale

    def ref_args(self, th):
        return {"q": th["q"], "k": th["k"], "v": th["v"], "bias": None, "attn_mask": self.mask, "is_causal": False,
                "scale": self.scale}


def test_cancellation_floor_does_not_shrink_with_the_value_head_dim():
    """Rows that see one key (exact dQ = dK = 0): the floor's scale is the size of a length-Dv FP32 dot product's
    rounding, ``u ||dO|| ||v||``, which does not shrink as Dv grows (an H200 left residues up to 0.66 u w at
    Dv = 160 in fp32-ieee, above the old ``/ sqrt(Dv)`` floor): the same norms at Dv = 16 and 256 give the same
    floor."""
    g = torch.Generator().manual_seed(3)
    mask = torch.full((5, 7), False)
    mask[torch.arange(5), torch.tensor([0, 2, 2, 4, 6])] = True  # each query sees exactly one key
    q, k = (torch.randn(1, 2, n, 32, generator=g, dtype=torch.float64) for n in (5, 7))
    floors = []
    for dv in (16, 256):
        v = torch.randn(1, 2, 7, dv, generator=g, dtype=torch.float64)
        v = v / v.norm(dim=-1, keepdim=True)
        go = torch.randn(1, 2, 5, dv, generator=g, dtype=torch.float64)
        go = go / go.norm(dim=-1, keepdim=True)
        gold = conf.oracle(_DenseProblem(q.clone(), k.clone(), v, mask), go, True)
        assert float(gold["grads"]["k"].abs().max()) < 1e-12  # the exact gradient is 0
        floors.append(gold["floors"]["k"].norm())
    assert math.isclose(floors[0], floors[1], rel_tol=1e-9), floors


def test_cancellation_floor_holds_every_element_near_its_expected_rms():
    """The floor's random-sign term estimates, per element, the RMS ``sqrt(sum_i (W_i a_i)^2)`` of a residue that
    rounds each ``dP_ij`` independently. Over the 2048 elements of a dK summed over 64 rows of one key (one query
    each: the exact gradient is 0), every element's floor stays above a quarter of that RMS (computed here in
    closed form); with 4 draws some fall below it, which failed a tf32 case whose kernel residue was 1e-4 of the
    median floor."""
    g = torch.Generator().manual_seed(5)
    B, H, D, Dv = 64, 2, 1024, 8
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, H, 1, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, 1, Dv, generator=g, dtype=torch.float64)
    go = torch.randn(B, H, 1, Dv, generator=g, dtype=torch.float64)

    class Shared(_DenseProblem):
        def ref_args(self, th):
            return dict(super().ref_args(th), k=th["k"].expand(B, H, 1, D))

    scale = D ** -0.5
    gold = conf.oracle(Shared(q.clone(), k.clone(), v, None, scale), go, True)
    assert float(gold["grads"]["k"].abs().max()) < 1e-12  # one key: the exact gradient is 0
    w = go.norm(dim=-1) * v.norm(dim=-1)  # [B, H, 1]: P = 1
    rms = ((w[..., None] * q * scale) ** 2).sum(0, keepdim=True).sqrt()  # [1, H, 1, D]
    assert float((gold["floors"]["k"] / rms).min()) > 0.25
    few = conf._cancellation_floors  # the same floors from 4 draws fall below it somewhere
    th = {"q": q.clone().requires_grad_(), "k": k.clone().requires_grad_()}
    live = scale * th["q"] @ th["k"].expand(B, H, 1, D).transpose(-1, -2)
    assert float((few(th, live, w[..., None], draws=4)["k"] / rms).min()) < 0.25


def test_half_ds_rounding_term_is_the_gradient_of_a_rounded_ds():
    """``r`` of the gradient rule (fp16 / bf16): dQ and dK from the dS a FlashAttention-style half backward forms
    (D_i from the stored half output, dS rounded to the half dtype), minus the exact ones, formed independently here
    as scale * err K and scale * err^T Q; and the rule's bound grows by 2 ||r||."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, n, 64, generator=g, dtype=torch.float64) for n in (4, 19, 19))
    go = torch.randn(1, 1, 4, 64, generator=g, dtype=torch.float64)
    scale = 0.4
    for dtype in (torch.float16, torch.bfloat16):
        gold = conf.oracle(_DenseProblem(q.clone(), k.clone(), v.clone(), scale=scale), go, True, dtype)
        p = torch.softmax(scale * q @ k.transpose(-1, -2), -1)
        dp = go @ v.transpose(-1, -2)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        stored_out = (p @ v).to(dtype).double()  # the output the kernel stored, in the half dtype
        err = (p * (dp - (go * stored_out).sum(-1, keepdim=True))).to(dtype).double() - ds
        want = {"q": scale * err @ k, "k": scale * err.transpose(-1, -2) @ q}
        for name in ("q", "k"):
            got = gold["ds_rounding"][name]
            assert torch.allclose(got, want[name], rtol=1e-9, atol=1e-15), name
            assert float(got.norm()) > 0
        assert "v" not in gold["ds_rounding"]  # dV does not go through dS
        gq = gold["grads"]["q"]
        plain = conf.check_quantity("dq", gq, gq, gq, "fp16")["bound"]
        moved = conf.check_quantity("dq", gq, gq, gq, "fp16", ds_rounding=want["q"])["bound"]
        assert math.isclose(moved - plain, 2 * float(want["q"].norm() / gq.norm()), rel_tol=1e-9)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the output gradient by 1.01 (a wrong backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.01


@pytest.mark.parametrize("sabotage", ["output", "gradient", "dead-row", "runtime-error", "value-error"])
def test_a_wrong_attention_fails_its_case(sabotage, monkeypatch):
    """visionattn.attention replaced by a slightly wrong one: the case that calls it fails, naming the quantity."""
    want = {"needs": ["q", "k", "v"]} if sabotage == "gradient" else {}
    spec = _first_case("dense", "fp32", grad=sabotage == "gradient", **want)
    if sabotage == "dead-row":
        spec = _first_case("dense", "fp32", grad=False, start=0, causal=False)
        spec["mask"] = {"pattern": "QK", "shape": [spec["Nq"], spec["Nk"]], "layout": "contiguous", "keep": 0.9,
                        "dead": 1}
    real = va.attention

    def wrong(q, k, v, **kw):
        out = real(q, k, v, **kw)
        if sabotage == "output":
            return out * (1 + 1e-4)
        if sabotage == "gradient":
            return _ScaleGrad.apply(out)
        if sabotage == "dead-row":
            return out + 1e-3
        raise (RuntimeError if sabotage == "runtime-error" else ValueError)("sabotaged")

    assert conf.run_case(spec, CPU)["status"] == "pass"
    monkeypatch.setattr(va, "attention", wrong)
    res = conf.run_case(spec, CPU)
    assert res["status"] == "fail", res
    text = " | ".join(res["errors"])
    expected = {"output": "out: rel err", "gradient": "dq: rel err", "dead-row": "fully masked rows",
                "runtime-error": "RuntimeError: sabotaged", "value-error": "unexpected refusal"}[sabotage]
    assert expected in text, text
    if sabotage == "gradient":
        assert res["metrics"]["out"]["ok"] and not res["metrics"]["dq"]["ok"]


def test_documented_refusals_are_listed_apart():
    """varlen in a PASA mode raises ValueError as documented: refused, not failed; a call that should refuse
    and returns is a failure."""
    spec = _first_case("varlen", "pasa")
    res = conf.run_case(spec, CPU)
    assert res["status"] == "refused" and "no PASA path" in res["refusal"] and "ValueError" in res["errors"][0]
    spec = dict(_first_case("dense", "fp16", grad=False), expect_refusal="a made-up refusal")
    res = conf.run_case(spec, CPU)
    assert res["status"] == "fail" and "expected a documented refusal" in res["errors"][0]


def test_parallel_isolate_matches_serial_and_bisects_a_dead_worker(serial_run, tmp_path, monkeypatch):
    """--isolate --jobs 3 on the same 20 cases (chunks of 5, 3 worker processes at a time): every case has the
    status and description of the in-process --jobs 1 run, in the same order, except one whose worker process dies
    mid-chunk (the test hook): it alone is a crash, bisected out of its chunk, while the other chunks complete."""
    serial, _ = serial_run
    ids = [r["id"] for r in serial["results"]]
    dead = ids[7]  # the third case of the second chunk
    monkeypatch.setenv("GPU_CONFORMANCE_TEST_CRASH", dead)
    t0 = time.time()
    report = tool.main(_args("--cases", "20", "--time-budget", "0", "--isolate", "--jobs", "3",
                             "--out", str(tmp_path / "par")))
    took = time.time() - t0
    env = report["environment"]
    assert env["isolate"] and env["jobs"] == 3 and env["chunk_size"] == 5
    got = [(r["id"], r["status"], r["desc"]) for r in report["results"]]
    want = [(r["id"], "crash" if r["id"] == dead else r["status"], r["desc"]) for r in serial["results"]]
    assert [g[0] for g in got] == ids
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(g[2] == w[2] for g, w in zip(got, want) if g[0] != dead)
    assert report["summary"]["crash"] == 1 and report["summary"]["cases_run"] == 20
    (fail,) = report["failures"]
    assert fail["id"] == dead and "died (exit status 134)" in fail["errors"][0]
    assert took < 120


class _StandIn:
    """A stand-in spawner: each call takes ``seconds``; a process dies on the ids in ``dies`` (after finishing the
    ones before them). Records each call's ids, start time and the most calls running at once."""

    def __init__(self, seconds=0.05, dies=()):
        self.seconds, self.dies = seconds, set(dies)
        self.calls, self.starts, self.running, self.most = [], [], 0, 0
        self.lock = threading.Lock()

    def __call__(self, ids, deadline):
        with self.lock:
            self.calls.append(list(ids))
            self.starts.append(time.time())
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.seconds)
            done = []
            for i in ids:
                if i in self.dies:
                    return done, -6, False
                done.append({"id": i, "status": "pass", "cuda_error": False, "errors": []})
            return done, 0, False
        finally:
            with self.lock:
                self.running -= 1


def test_run_chunks_runs_chunks_at_once_and_bisects_each_on_its_own():
    ids = [f"0:{i}" for i in range(24)]
    spawn = _StandIn(dies={"0:9"})
    seen = []
    results, stopped = harness.run_chunks(ids, spawn, None, chunk_size=4, jobs=3, on_chunk=seen.append)
    assert not stopped and [r["id"] for r in results] == ids
    assert {r["id"]: r["status"] for r in results if r["status"] != "pass"} == {"0:9": "crash"}
    assert spawn.most == 3 and len(seen) == 6 and sum(map(len, seen)) == 24
    assert ["0:9"] in spawn.calls and all("0:9" not in c for c in spawn.calls if c[0] not in ("0:8", "0:9"))
    # one job: the chunks one after another, the same results
    again, _ = harness.run_chunks(ids, _StandIn(seconds=0, dies={"0:9"}), None, chunk_size=4, jobs=1)
    assert again == results


def test_time_budget_stops_new_chunks():
    """No chunk starts after the deadline; the ones started finish (their workers get the deadline); the results
    are the started chunks', in id order."""
    ids = [f"0:{i}" for i in range(40)]
    spawn = _StandIn(seconds=0.2)
    deadline = time.time() + 0.3
    results, stopped = harness.run_chunks(ids, spawn, deadline, chunk_size=4, jobs=2)
    assert stopped and all(t <= deadline for t in spawn.starts)
    assert 2 <= len(spawn.calls) < 10 and len(results) == 4 * len(spawn.calls)
    assert [r["id"] for r in results] == [i for c in sorted(spawn.calls, key=lambda c: ids.index(c[0])) for i in c]


def test_jobs_defaults_and_implied_isolate(capsys):
    assert tool.default_chunk_size(2000, 12) == 20 and tool.default_chunk_size(40, 4) == 5
    assert tool.default_chunk_size(2000, 1) == 200
    assert 1 <= tool.default_jobs() <= tool.MAX_DEFAULT_JOBS
    args = _args("--isolate")
    assert tool._resolve_jobs(args) is None and args.jobs == tool.default_jobs()
    args = _args("--jobs", "4")
    assert "implies --isolate" in tool._resolve_jobs(args) and args.isolate and args.jobs == 4
    args = _args()
    assert tool._resolve_jobs(args) is None and args.jobs == 1 and not args.isolate
    assert "--jobs" in tool.build_parser().format_help() and "--jobs" in tool.__doc__
    with pytest.raises(SystemExit):
        tool.build_parser().parse_args(["--jobs", "0"])
    assert "--jobs" in capsys.readouterr().err


def test_workers_share_the_triton_cache(monkeypatch):
    """The workers' environment moves no Triton cache (every worker and run share one) and asks PyTorch for
    expandable segments unless the caller chose otherwise."""
    for name in ("TRITON_CACHE_DIR", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    env = harness.worker_env()
    assert "TRITON_CACHE_DIR" not in env and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert {k: v for k, v in env.items() if k != "PYTORCH_CUDA_ALLOC_CONF"} == dict(os.environ)
    assert int(harness.worker_env(jobs=64)["OMP_NUM_THREADS"]) >= 1
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere")
    env = harness.worker_env(jobs=4)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64" and env["TRITON_CACHE_DIR"] == "/somewhere"


def test_time_budget_stops_drawing_cases(tmp_path):
    report = tool.main(_args("--cases", "50", "--time-budget", "1e-9", "--out", str(tmp_path / "tb")))
    s = report["summary"]
    assert s["cases_run"] < 50 and "time budget exceeded" in s["stopped_early"]
    assert "Stopped early: time budget exceeded" in open(tmp_path / "tb" / "gpu_conformance.md").read()


def test_isolation_bisects_to_the_cases_that_kill_a_process():
    """run_isolated with a stand-in spawner: processes die on c and f (after finishing the cases before them);
    e poisons its process with a CUDA error (exit status 3) and is re-run alone; every other case keeps its
    result."""
    calls = []

    def spawn(ids, deadline):
        calls.append(list(ids))
        done = []
        for i in ids:
            if i in ("c", "f"):
                return done, -6, False
            done.append({"id": i, "status": "fail" if i == "e" else "pass", "cuda_error": i == "e", "errors": []})
            if i == "e":
                return done, 3, False
        return done, 0, False

    ids = list("abcdefgh")
    results, stopped = harness.run_isolated(ids, spawn)
    assert not stopped and [r["id"] for r in results] == ids
    status = {r["id"]: r["status"] for r in results}
    assert status == {"a": "pass", "b": "pass", "c": "crash", "d": "pass", "e": "fail", "f": "crash", "g": "pass",
                      "h": "pass"}
    assert ["e"] in calls and ["c"] in calls and ["f"] in calls
    assert "re-run alone in a fresh process: fails alone too" in " ".join(results[4]["errors"])
    assert len(calls) <= 10


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_isolate_runs_workers_and_reports_a_dead_one(fault, tmp_path, monkeypatch):
    """--isolate in real subprocesses: a worker killed on one case (the test hook stands in for a CUDA illegal
    address), or one that stops making progress (a deadlocked kernel; killed after --case-timeout), leaves that
    case as a crash and the other case's result intact."""
    specs = tool.select_cases(_args("--cases", "2", "--families", "dense", "--modes", "fp16"))
    monkeypatch.setenv("GPU_CONFORMANCE_TEST_" + fault.upper(), specs[1]["id"])
    ids = [s["id"] for s in specs] if fault == "crash" else [specs[1]["id"]]  # one process-start for the hang
    report = tool.main(_args("--case", ",".join(ids), "--isolate", "--case-timeout", "2" if fault == "hang" else "0",
                             "--out", str(tmp_path / "iso")))
    status = {r["id"]: r["status"] for r in report["results"]}
    assert status == {**({specs[0]["id"]: "pass"} if fault == "crash" else {}), specs[1]["id"]: "crash"}
    assert report["summary"]["crash"] == 1 and report["summary"]["failed"] == 1
    (fail,) = report["failures"]
    assert fail["reproduce"] == f"python tools/gpu_conformance.py --case {specs[1]['id']} --device cpu"
    assert ("hung" if fault == "hang" else "died (exit status 134)") in fail["errors"][0]


@pytest.mark.parametrize("argv, words", [(["--families", "dense,nope"], "--families"),
                                         (["--case", "12"], "--case"), (["--modes", "fp8"], "--modes"),
                                         (["--cases", "0"], "--cases")])
def test_bad_arguments_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        tool.build_parser().parse_args(["--device", "cpu", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_profiles_respect_their_caps():
    """Every drawn case fits its profile's work and oracle caps; N covers the tile boundaries' neighbours."""
    for profile in ("tiny", "full"):
        prof = conf.PROFILES[profile]
        ns = set()
        for i in range(400):
            s = conf.draw_case(3, i, profile)
            work = s["B"] * s["H"] * s["Nq"] * s["Nk"]
            allowance = conf.GLUON_WORK_ALLOWANCE if s.get("gluon_backward") or s.get("gluon_forward") else 1
            assert work * max(s["D"], s["Dv"]) <= allowance * prof.work_cap and work <= prof.elem_cap, s
            assert s["B"] * s["H"] * max(s["Nq"], s["Nk"]) * max(s["D"], s["Dv"]) <= prof.tensor_cap, s
            ns.update((s["Nq"], s["Nk"]))
        assert {b + d for b in prof.boundaries[:3] for d in (-1, 1)} <= ns
    assert math.isclose(conf.UNIT_ROUNDOFF["tf32"], 2.0 ** -11)


def test_some_dense_cases_reach_the_gluon_backward():
    """A share of the dense fwd+bwd cases in the modes with a Hopper Gluon backward lies in that kernel's scope, where
    the backward plans' own rules (at an H200's 132 SMs) run it: head dim 64 / 128 for q, k and v, no bias / mask /
    causal, TMA-legal layouts, the input in the mode's compute dtype, equal or grouped-query heads; the scope's least
    lengths are the plans' thresholds (one less is not routed), and every listed length and, in every mode, the
    grouped heads are reached."""
    from visionattn.kernels import half_gluon_bwd as hg

    routes = {"fp16": lambda B, H, nq, nk, d: hg.preferred(nq, nk),
              "bf16": lambda B, H, nq, nk, d: hg.preferred(nq, nk),
              "tf32": lambda B, H, nq, nk, d: hg.tf32_preferred(B, H, nq, nk, d, 132),
              "fp32": lambda B, H, nq, nk, d: hg.fp32_preferred(B, H, nq, nk, d, 132)}
    for mode, dims in conf.GLUON_BACKWARD_SCOPE.items():
        for d, lows in dims.items():
            low = min(lows)
            assert routes[mode](1, 1, low, low, d) and not routes[mode](1, 1, low - 1, low - 1, d), (mode, d, low)
    reached, grouped = {}, set()
    for i in range(2000):
        s = conf.draw_case(0, i, "full")
        if not s.get("gluon_backward"):
            continue
        assert s["family"] == "dense" and s["grad"] and s["mode"] in conf.GLUON_BACKWARD_SCOPE, s
        assert s["D"] == s["Dv"] in conf.GLUON_BACKWARD_SCOPE[s["mode"]], s
        assert not s["bias"] and not s["mask"] and not s["causal"], s
        if "Hkv" in s:
            assert s["H"] % s["Hkv"] == 0 and s["Hkv"] < s["H"], s
            assert s["layouts"] != "packed", s
            grouped.add(s["mode"])
        assert s["layouts"] == "packed" or set(s["layouts"].values()) <= {"contiguous", "transposed"}, s
        assert s["dtype"] == str(va.get_mode(s["mode"]).compute_dtype).removeprefix("torch."), s
        B, H, nq, nk, d = s["B"], s["H"], s["Nq"], s["Nk"], s["D"]
        assert routes[s["mode"]](B, H, nq, nk, d), s
        low = max(x for x in conf.GLUON_BACKWARD_SCOPE[s["mode"]][d] if x <= min(nq, nk))
        reached.setdefault(s["mode"], set()).add((d, low))
    assert reached == {m: {(d, x) for d, xs in dims.items() for x in xs}
                       for m, dims in conf.GLUON_BACKWARD_SCOPE.items()}, reached
    assert grouped == set(conf.GLUON_BACKWARD_SCOPE)


def test_some_dense_fp32_cases_reach_the_gluon_forward():
    """A share of the other dense fp32 cases lies in the scope of fp32's Gluon forward, where the forward plans' own
    rules run it on an H200: the scope's head dims and least key count are the kernel's (one key less is not
    preferred), the call is in the kernel's scope but for the device (CPU tensors built as the suite builds them,
    grouped-query heads included), and its query tiles give each of the 132 SMs one, so the plan splits no keys
    (elsa_fwd.choose_num_splits with the kernel's tiles); head dims 64 and 128, grouped and equal heads and
    forward-only and fwd+bwd cases all occur."""
    from visionattn.kernels import elsa_fwd, fp32_gluon

    assert conf.GLUON_FORWARD_SCOPE == {"fp32": {d: fp32_gluon.MIN_KEYS for d in fp32_gluon.HEAD_DIMS}}
    assert not fp32_gluon.preferred(1, fp32_gluon.MIN_KEYS - 1, 64)
    seen = set()
    for i in range(6000):
        s = conf.draw_case(0, i, "full")
        if not s.get("gluon_forward"):
            continue
        assert s["family"] == "dense" and s["mode"] == "fp32" and not s.get("gluon_backward"), s
        assert not s["bias"] and not s["mask"] and not s["causal"] and s["dtype"] == "float32", s
        B, H, nq, nk, d = s["B"], s["H"], s["Nq"], s["Nk"], s["D"]
        assert s["Dv"] == d and fp32_gluon.preferred(nq, nk, d), s
        cfg = fp32_gluon.get_config(nk, d)
        assert B * H * -(-nq // cfg["BLOCK_M"]) >= conf.GLUON_FORWARD_SMS, s
        prob = conf._dense_problem(s, torch.Generator().manual_seed(0), "cpu")
        q, k, v = (prob.theta[n] for n in ("q", "k", "v"))
        reason = fp32_gluon.unsupported_reason(q, k, v, None, None, False, d ** -0.5, 0)
        assert reason == "tensors on cpu", (s, reason)
        tiles = elsa_fwd.TileConfig(cfg["BLOCK_M"], cfg["BLOCK_N"], 4, cfg["STAGES"])
        cuda = torch.device("cuda")
        with mock.patch.object(elsa_fwd, "sm_count", lambda device: conf.GLUON_FORWARD_SMS):
            assert elsa_fwd.choose_num_splits(B * H, nq, nk, tiles, cuda, "half") == 1, s
        seen.add((d, "Hkv" in s, s["grad"]))
    assert seen == {(d, g, grad) for d in (64, 128) for g in (False, True) for grad in (False, True)}, seen


def test_some_varlen_cases_reach_the_stream_k_schedule():
    """A share of the forward-only varlen cases lies in the stream-K schedule's scope, where the list path's rule
    takes it on an H200 (stream_k.ragged_prefers at 132 SMs with the mode's tile config), with jobs cut between
    programs at the default program count in most of them (the merge's path)."""
    from visionattn.kernels import stream_k
    from visionattn.kernels.elsa_fwd import _precision, get_config

    seen, cut = 0, 0
    for i in range(3000):
        s = conf.draw_case(0, i, "full")
        if not s.get("stream_k"):
            continue
        assert s["family"] == "varlen" and not s["grad"] and s["form"] == "list" and not s["causal"], s
        assert max(s["lens_q"]) <= stream_k.MAX_QUERY_ROWS and len(s["lens_q"]) == len(s["lens_k"]) >= 2, s
        assert "stream-k-scope" in conf.describe(s)
        cfg = get_config(s["mode"], s["D"], s["Dv"], max(s["lens_k"]))
        assert stream_k.ragged_prefers(s["lens_q"], s["lens_k"], s["H"], cfg.block_m, cfg.block_n, 132), s
        block_m = stream_k.query_block(max(s["lens_q"]), cfg.block_m)
        block_n = stream_k.key_block(_precision(s["mode"], None), block_m, s["D"], s["Dv"], cfg.block_n)
        part = stream_k.partition(s["lens_q"], s["lens_k"], s["H"], block_m, block_n, False, 264)
        seen += 1
        cut += part.split_jobs > 0
    assert seen >= 20 and cut >= 0.8 * seen, (seen, cut)


# describe() of cases 0:0 .. 0:299 per profile: the case ids are stable (a change to the drawing changes these)
CASE_DIGESTS = {"full": "647e5c1ffa108e0a789ec07ff3da8fc609429e1632369548d06b0b81cf3f787c",
                "tiny": "a59a1b410a3ce08d99234c7a8e444c83664686afa5f13b768f4baf92a2f8439d"}


@pytest.mark.parametrize("profile", sorted(CASE_DIGESTS))
def test_case_ids_are_stable(profile):
    text = "\n".join(conf.describe(conf.draw_case(0, i, profile)) for i in range(300))
    assert hashlib.sha256(text.encode()).hexdigest() == CASE_DIGESTS[profile]


def test_library_imports_neither_triton_nor_pytest_nor_tools():
    """visionattn.testing.conformance stands alone, and a CPU run can still switch Triton to its interpreter after
    importing it."""
    code = ("import sys, visionattn.testing.conformance; "
            "print(sorted(m for m in ('triton', 'pytest', '_harness') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("index", [0, 42, 54])
def test_oracle_of_a_half_cosine_window_with_logit_scale_gradient(index):
    """Half-mode cosine windows whose logit scale needs a gradient: the oracle's rounding term and its gradients
    go back through the same normalisation graph, and the reference backend passes its case (the oracle once
    freed that graph first and reported a harness error on every such case, CPU and GPU alike)."""
    spec = conf.draw_case(0, index, "tiny")
    words = conf.describe(spec)
    assert "cosine" in words and "logit_scale" in words and "bwd" in words
    assert spec["mode"] in ("fp16", "bf16")
    res = conf.run_case(spec, torch.device("cpu"), "reference")
    assert res["status"] == "pass", res


def test_sigterm_writes_the_report_of_the_cases_that_ran(tmp_path):
    """An outer time limit (SIGTERM) or Ctrl-C stops the run; the report of every case that finished is written
    and the exit status is 130 (the report was lost when the run was killed before its end)."""
    import signal

    out = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "gpu_conformance.py"), "--device", "cpu",
                             "--backend", "reference", "--cases", "3000", "--time-budget", "0", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines = []
    for line in proc.stdout:  # the first progress line: 100 cases ran
        lines.append(line)
        if "/ 3000 cases" in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, "".join(lines) + rest
    report = json.loads((out / "gpu_conformance.json").read_text())
    summary = report["summary"]
    assert "interrupted" in summary["stopped_early"]
    assert 100 <= summary["cases_run"] < 3000
    assert (out / "gpu_conformance.md").exists()
