#!/usr/bin/env python
"""Randomized conformance suite: every public attention entry point, every mode, shapes at tile boundaries and odd
memory layouts, each case checked against a float64 oracle.

The cases, the float64 oracle and the pass rules are :mod:`visionattn.testing.conformance`'s (its docstring states
them). Case ``s:i`` depends on its id alone: ``--families`` / ``--modes`` choose which ids run, ``--jobs`` and
``--isolate`` change nothing in a case, and ``--case s:i`` re-runs exactly one, as its failure line prints it.

Crashes. Without ``--isolate`` a CUDA error that poisons the context stops the run (the cases after it could not
run); with ``--isolate`` chunks of cases run in subprocesses, a chunk whose process dies (or hangs past
``--case-timeout``) is re-run without the cases it finished and bisected down to the case(s) that kill a process
alone, and a case whose CUDA error left the context unusable is re-run alone to confirm it is the culprit
(:func:`_harness.run_chunks`).

Parallel runs. Nearly every case of a fresh run compiles new Triton kernel variants (seconds of one CPU core each,
the GPU idle meanwhile), so ``--isolate`` runs up to ``--jobs`` chunk subprocesses at once (default: 12 or the CPU
cores available, the fewer; ``--jobs`` above 1 implies ``--isolate``; without either the cases run in this
process). Chunks are consecutive ids (``--chunk-size``; default with more than one job
``max(5, cases // (jobs * 8))``, so the jobs finish together, else 200), started in id order as jobs free up: a run
the time budget stops has run about a prefix of the ids, and the report lists the results in id order. Every
worker shares Triton's on-disk kernel cache (``TRITON_CACHE_DIR``; this tool moves no cache) and the GPU: each runs
with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (and ``OMP_NUM_THREADS`` = cores / jobs; each unless
set), hands its cached blocks back after every case, and re-runs a case that ran out of memory (up to twice, after
a pause) before reporting it. Each process pays Python, torch and CUDA start-up (seconds): for cheap cases (the CPU
interpreter's ``tiny`` profile) one in-process run is faster than several jobs.

On the CPU (``--device cpu``) the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by this tool
before Triton is imported) with ``--backend triton``: a smoke test; GPU-only bugs do not show there.

Writes ``<out>/gpu_conformance.md`` and ``.json``: cases per family and mode, failures with their reproduce
lines, refusals, the worst error and error / bound per mode and quantity, fallbacks, the time and, if the time
budget stopped the run, how many cases did not run. Exit status 1 if any case failed or crashed; Ctrl-C or SIGTERM
(an outer time limit) stops the run, writes the report of the cases that finished and exits 130.

Usage: python tools/gpu_conformance.py [--seed 0] [--cases 2000] [--time-budget 480] [--isolate [--jobs 12]] --out DIR
       python tools/gpu_conformance.py --case 0:123          # one case again, as its failure line printed it
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tools' shared helpers
from _harness import (ToolParser, check_device, check_output, cores, default_out, environment,  # noqa: E402
                      markdown_table, nonnegative_float, output_files, positive_int, run_chunks, run_worker, worker_env,
                      write_results)
from visionattn.testing import conformance as conf  # noqa: E402
from visionattn.testing.conformance import (FAMILIES, MODES, PROFILES, QUANTITIES, SHARED_SKELETONS,  # noqa: E402
                                            describe, draw_case, run_case)

__all__ = ["build_parser", "main", "select_cases", "reproduce_line", "run_in_process", "default_jobs",
           "default_chunk_size", "markdown"]

OOM_WORDS = "out of memory"
OOM_RETRIES = 2  # an --isolate worker re-runs a case that ran out of GPU memory (the other workers share it)
# a cold cache makes the suite compile-bound, one job per core: 44 jobs on a 64-core H200 host ran 1997 cases in
# 506 s (16 on 16 cores: 1076); 48 workers' CUDA contexts and cases fit the H200's memory with the OOM retries
MAX_DEFAULT_JOBS = 48
TOOL = "tools/gpu_conformance.py"


# ----------------------------------------------------------------------------- selecting, running
def parse_case_id(text: str) -> tuple[int, int]:
    """``"S:I"`` -> (seed, index); an argparse error otherwise."""
    try:
        return conf.parse_case_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def select_cases(args) -> list[dict]:
    """The cases of this run, in order: ``--case`` / ``--only`` as given, else the first ``--cases`` ids of
    ``--seed`` whose family and mode pass the filters."""
    _normalize(args)
    if args.case:
        return [draw_case(s, i, args.profile) for s, i in args.case]
    if args.only:
        return [draw_case(args.seed, i, args.profile) for i in args.only]
    return conf.select_cases(args.seed, args.cases, args.profile, args.families, args.modes)


def reproduce_line(spec: dict, args) -> str:
    """The command that re-runs exactly this case (on the same device kind, profile and backend)."""
    cmd = f"python {TOOL} --case {spec['id']}"
    if args.device != "cuda":
        cmd += f" --device {args.device}"
    if args.profile != _default_profile(args.device):
        cmd += f" --profile {args.profile}"
    if args.backend != "triton":
        cmd += f" --backend {args.backend}"
    return cmd


def _default_profile(device: str) -> str:
    return "tiny" if device.startswith("cpu") else "full"


def _print_result(res: dict, spec: dict, args) -> None:
    """A failure's reproduce line, description and errors, in one write (parallel workers share the output)."""
    if res["status"] in ("fail", "harness-error", "crash"):
        lines = [f"{res['status'].upper()} {reproduce_line(spec, args)}", f"    {res['desc']}"]
        print("\n".join(lines + [f"    {e}" for e in res["errors"]]), flush=True)


def run_in_process(specs: list[dict], device, args, deadline: float | None, emit=None) -> tuple[list, str | None]:
    """Run ``specs`` here, in order, until ``deadline`` (time.time()); ``emit(result)`` after each. Returns the
    results and why the run stopped early (None if it did not)."""
    results = []
    for n, spec in enumerate(specs):
        if deadline is not None and time.time() > deadline:
            return results, f"time budget exceeded: {len(specs) - n} of {len(specs)} cases not run"
        res = run_case(spec, device, args.backend)
        results.append(res)
        if emit is not None:
            emit(res)
        if res["cuda_error"]:
            return results, (f"CUDA error in case {spec['id']} left the context unusable: {len(specs) - n - 1} "
                             f"cases not run (rerun with --isolate)")
    return results, None


def _spawn_worker(ids: list[str], args, deadline: float | None) -> tuple[list[dict], int | str, bool]:
    """Run the case ids in a fresh process of this tool (:func:`_harness.run_worker`)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--profile", args.profile,
           "--backend", args.backend]
    if deadline is not None:
        cmd += ["--worker-deadline", repr(deadline)]
    return run_worker(cmd, ids, env=worker_env(getattr(args, "jobs", None) or 1), case_timeout=args.case_timeout,
                      tmp_prefix="gpu_conformance_")


# ----------------------------------------------------------------------------- report
def markdown(report: dict, env: dict) -> str:
    """The report as markdown."""
    s = report["summary"]
    lines = ["# visionattn GPU conformance", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", f"**{s['cases_run']} of {s['cases_selected']} cases run in {s['seconds']} s: {s['pass']} passed, "
                  f"{s['failed']} failed ({s['fail']} fail, {s['crash']} crash, {s['harness-error']} harness error), "
                  f"{s['refused']} refused as documented, {s['skipped']} skipped.**"]
    if s["stopped_early"]:
        lines += ["", f"Stopped early: {s['stopped_early']}."]
    rows = []
    for fam, modes in report["counts"].items():
        for mode, c in modes.items():
            rows.append((fam, mode, sum(c.values()), c["pass"], c["fail"] + c["crash"] + c["harness-error"],
                         c["refused"], c["skipped"]))
    lines += ["", "## Cases per family and mode", "",
              markdown_table(sorted(rows), ["family", "mode", "cases", "pass", "fail", "refused", "skipped"])]
    lines += ["## Failures", ""]
    if not report["failures"]:
        lines += ["None.", ""]
    for f in report["failures"]:
        lines += [f"- `{f['reproduce']}` ({f['status']})", f"  - {f['desc']}"]
        lines += [f"  - {e}" for e in f["errors"]]
    lines += ["", "## Worst error per mode and quantity", "",
              "err: relative L2 error vs the float64 oracle; beyond floor: the part of it above the gradients' "
              "cancellation floor; bound: the rule's bound in the same units; ratio = beyond floor / bound (<= 1 "
              "passes; the worst ratio is shown); PyTorch err: PyTorch's attention at the mode's precision.", ""]
    rows = []
    for mode in MODES:
        for q in QUANTITIES:
            w = report["worst"].get(mode, {}).get(q)
            if w:
                rows.append((mode, q, w["err"], w["beyond_floor"], w["bound"], w["ratio"],
                             w["ref_err"] if w["ref_err"] is not None else "-", w["case"]))
    lines += [markdown_table(rows, ["mode", "quantity", "err", "beyond floor", "bound", "ratio", "PyTorch err",
                                    "case"])]
    if report["refused"]:
        lines += ["## Refused as documented", ""]
        lines += [f"- `{r['reproduce']}`: {r['refusal']} -- {'; '.join(r['errors'])}" for r in report["refused"]]
        lines += [""]
    if report["skipped"]:
        lines += ["## Skipped", ""]
        reasons: dict = {}
        for r in report["skipped"]:
            reasons.setdefault("; ".join(r["errors"]), []).append(r["id"])
        lines += [f"- {why}: {len(ids)} cases ({', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''})"
                  for why, ids in reasons.items()]
        lines += [""]
    if report["fallbacks"]:
        lines += ["## Reference fallbacks (warned, correct by contract)", ""]
        lines += [f"- {k}: {v['cases']} cases, e.g. {', '.join(v['first'])}" for k, v in report["fallbacks"].items()]
        lines += [""]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- command line
def _names(choices):
    def parse(text: str) -> list[str]:
        names = [t for t in text.replace(" ", ",").split(",") if t]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: expected names from {', '.join(choices)}, "
                                             f"comma-separated")
        return names
    return parse


def _indices(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t]
        if not out or min(out) < 0:
            raise ValueError
        return out
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected case indices like 12 or 3,17,42, got {text!r}") from None


def _case_ids(text: str) -> list[tuple[int, int]]:
    return [parse_case_id(t) for t in text.split(",") if t]


def build_parser() -> ToolParser:
    p = ToolParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=default_out("gpu_conformance"),
                   help="folder: writes gpu_conformance.md and gpu_conformance.json there (default: "
                        "out/gpu_conformance)")
    p.add_argument("--seed", type=int, default=0, help="seed of the case ids SEED:INDEX drawn (default 0)")
    p.add_argument("--cases", type=positive_int, default=2000,
                   help="how many cases to run: the first that pass --families / --modes (default 2000)")
    p.add_argument("--time-budget", type=nonnegative_float, default=480.0,
                   help="seconds; no new case starts after it (the report says how many did not run); 0 = no "
                        "limit (default 480)")
    p.add_argument("--families", nargs="+", type=_names(FAMILIES), default=[list(FAMILIES)],
                   help="families to run (space or comma separated): " + ", ".join(FAMILIES) + " (default: all)")
    p.add_argument("--modes", nargs="+", type=_names(MODES), default=[list(MODES)],
                   help="modes to run: " + ", ".join(MODES) + " (default: all)")
    p.add_argument("--case", type=_case_ids, default=None, metavar="SEED:INDEX[,...]",
                   help="run exactly these cases (as a failure's reproduce line names them); ignores --seed, "
                        "--cases and the filters")
    p.add_argument("--only", type=_indices, default=None, metavar="INDEX[,...]",
                   help="run exactly these case indices of --seed (ignores --cases and the filters)")
    p.add_argument("--device", default="cuda", help="device: cuda (default) or cpu (Triton's interpreter, for tests)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="shape distribution: full (N up to 4100, the default on CUDA) or tiny (N up to 66, the "
                        "default on the CPU)")
    p.add_argument("--backend", choices=("triton", "auto", "reference"), default="triton",
                   help="visionattn backend for every call (default triton: the kernels, in the interpreter on the "
                        "CPU)")
    p.add_argument("--isolate", action="store_true",
                   help="run chunks of cases in subprocesses; a process that dies (a CUDA illegal address kills "
                        "the context) is bisected to the case(s) that kill it")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help=f"with --isolate: chunk subprocesses run at once, sharing the device and Triton's kernel "
                        f"cache (they compile kernels on their own CPU cores); default with --isolate: "
                        f"{MAX_DEFAULT_JOBS} or the CPU cores available, the fewer ({default_jobs()} here), else 1; "
                        f"above 1 it implies --isolate")
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="cases per subprocess with --isolate (each process pays Python, torch and CUDA start-up); "
                        "default: max(5, cases // (jobs * 8)) with more than one job, about 8 chunks per job so that "
                        "they finish together, else 200")
    p.add_argument("--case-timeout", type=nonnegative_float, default=300.0,
                   help="with --isolate: seconds one case may take in its subprocess (its compiles included, the "
                        "process start-up not) before the process is killed as hung and its cases bisected; 0 = "
                        "wait forever (default 300)")
    p.add_argument("--worker-ids", default=None, help="internal (--isolate): file of case ids this process runs")
    p.add_argument("--worker-out", default=None, help="internal (--isolate): JSON-lines file of its results")
    p.add_argument("--worker-deadline", type=float, default=None,
                   help="internal (--isolate): time.time() after which it starts no case")
    return p


def _flatten(lists):
    """``[["a", "b"], ["c"]]`` (``nargs="+"`` of comma lists) or ``["a", "c"]`` -> names in table order."""
    names = {x for part in lists for x in ([part] if isinstance(part, str) else part)}
    return sorted(names, key=lambda x: (FAMILIES + MODES).index(x))


def default_jobs() -> int:
    """--jobs with --isolate when not given: the CPU cores this process may use, at most MAX_DEFAULT_JOBS."""
    return min(MAX_DEFAULT_JOBS, cores())


def default_chunk_size(cases: int, jobs: int) -> int:
    """--chunk-size when not given: about 8 chunks per job (so the jobs finish together), at least 5 cases each;
    200 with one job."""
    return max(5, cases // (jobs * 8)) if jobs > 1 else 200


def _normalize(args) -> None:
    """Flatten --families / --modes and fill the device's default --profile (idempotent)."""
    args.families = _flatten(args.families)
    args.modes = _flatten(args.modes)
    if args.profile is None:
        args.profile = _default_profile(args.device)


def _resolve_jobs(args) -> str | None:
    """Fill --jobs (and --isolate, which --jobs above 1 implies); returns the note to print when it was implied."""
    note = None
    if args.jobs is not None and args.jobs > 1 and not args.isolate:
        args.isolate = True
        note = f"--jobs {args.jobs} implies --isolate"
    if args.jobs is None:
        args.jobs = default_jobs() if args.isolate else 1
    return note


def _prepare(args, parser):
    """Check the arguments; set TRITON_INTERPRET before Triton is imported for the CPU; return the device."""
    _normalize(args)
    if args.case and args.only:
        parser.error("--case and --only: pass one of them")
    cpu = args.device.startswith("cpu")
    if cpu and args.backend == "triton":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            parser.error("--device cpu --backend triton: Triton was imported without TRITON_INTERPRET=1; set it")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return check_device(parser, args.device)


def _worker(args, device) -> int:
    """--isolate's subprocess: run the listed ids, one JSON line per result; exit 3 after a CUDA error."""
    with open(args.worker_ids) as f:
        ids = [line.strip() for line in f if line.strip()]
    specs = [draw_case(*parse_case_id(i), args.profile) for i in ids]
    # tests: simulate a case that kills its process (a CUDA illegal address) or never returns (a deadlock)
    crash_on = os.environ.get("GPU_CONFORMANCE_TEST_CRASH", "").split(",")
    hang_on = os.environ.get("GPU_CONFORMANCE_TEST_HANG", "").split(",")
    with open(args.worker_out, "a") as out:
        def emit(res):
            out.write(json.dumps(res, default=str) + "\n")
            out.flush()

        for spec in specs:
            if args.worker_deadline is not None and time.time() > args.worker_deadline:
                emit({"stopped": "time budget"})
                return 0
            emit({"begin": spec["id"]})  # progress for --case-timeout
            if spec["id"] in crash_on:
                os._exit(134)
            if spec["id"] in hang_on:
                time.sleep(3600)
            res = _run_shared(spec, device, args.backend)
            emit(res)
            _print_result(res, spec, args)
            if res["cuda_error"]:
                return 3
    conf.release_ring_group()
    return 0


def _out_of_memory(res: dict) -> bool:
    return res["status"] in ("fail", "harness-error") and any(OOM_WORDS in e for e in res["errors"])


def _release_memory(device) -> None:
    """Hand this process's cached GPU blocks back, for the other workers on the device."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _run_shared(spec: dict, device, backend: str) -> dict:
    """:func:`run_case` in a worker that shares the device with others: the cached memory is handed back after
    the case, and a case that ran out of memory (another worker may have held it) runs again, up to
    OOM_RETRIES times after a pause, before its failure is reported."""
    res = run_case(spec, device, backend)
    _release_memory(device)
    for attempt in range(1, OOM_RETRIES + 1):
        if device.type != "cuda" or not _out_of_memory(res):
            break
        time.sleep(2.0 * attempt)
        res = run_case(spec, device, backend)
        _release_memory(device)
        res["oom_retries"] = attempt
        if _out_of_memory(res) and attempt == OOM_RETRIES:
            res["errors"].append(f"out of memory on each of {attempt + 1} tries while other --jobs shared the "
                                 f"device: re-run it alone (its reproduce line) or with fewer --jobs")
    return res


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(args) -> dict:
    """Run the suite; write the markdown and JSON reports; return the JSON report."""
    parser = build_parser()
    device = _prepare(args, parser)
    if args.worker_ids:
        sys.exit(_worker(args, device))
    implied = _resolve_jobs(args)
    if implied:
        print(f"gpu_conformance: {implied}", flush=True)
    args.out = check_output(parser, args.out, folder=True)
    prefix = os.path.join(args.out, "gpu_conformance")
    outputs = output_files(parser, [prefix + ".md", prefix + ".json"], tool="gpu_conformance")  # before any case
    specs = select_cases(args)
    t0 = time.time()
    deadline = t0 + args.time_budget if args.time_budget > 0 and not (args.case or args.only) else None
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    which = f"case {','.join(s['id'] for s in specs)}" if args.case else f"seed {args.seed}"
    if args.isolate and args.chunk_size is None:
        args.chunk_size = default_chunk_size(len(specs), args.jobs)
    isolated = f", isolated: {args.jobs} jobs, chunks of {args.chunk_size}" if args.isolate else ""
    print(f"gpu_conformance: {len(specs)} cases ({which}, profile {args.profile}, device {args.device}, "
          f"backend {args.backend}{isolated})", flush=True)
    collected: list[dict] = []  # every finished result, so an interrupted run still reports them
    interrupted = False
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.isolate:
            ids = [s["id"] for s in specs]
            by_id = {s["id"]: s for s in specs}
            done = {"n": 0}

            def spawn(chunk, dl):
                return _spawn_worker(chunk, args, dl)

            def on_chunk(part):
                for r in part:  # a crash's entry (made here: its process died) names its case like the others
                    spec = by_id[r["id"]]
                    for key, value in (("family", spec["family"]), ("mode", spec["mode"]), ("grad", spec["grad"]),
                                       ("desc", describe(spec))):
                        r.setdefault(key, value)
                    if r["status"] == "crash":
                        _print_result(r, spec, args)
                collected.extend(part)
                if part:
                    done["n"] += len(part)
                    print(f"  {done['n']} / {len(ids)} cases, {time.time() - t0:.0f} s", flush=True)

            results, halted = run_chunks(ids, spawn, deadline, args.chunk_size, args.jobs, on_chunk)
            stopped = (f"time budget exceeded: {len(ids) - len(results)} of {len(ids)} cases not run" if halted
                       else None)
        else:
            progress = {"n": 0}
            by_id = {s["id"]: s for s in specs}

            def emit(res):
                collected.append(res)
                progress["n"] += 1
                _print_result(res, by_id[res["id"]], args)
                if progress["n"] % 100 == 0:
                    print(f"  {progress['n']} / {len(specs)} cases, {time.time() - t0:.0f} s", flush=True)

            results, stopped = run_in_process(specs, device, args, deadline, emit)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (an outer time limit): report what finished, then exit 130
        interrupted = True
        order = {s["id"]: n for n, s in enumerate(specs)}
        results = sorted(collected, key=lambda r: order.get(r["id"], len(order)))
        stopped = f"interrupted: {len(specs) - len(results)} of {len(specs)} cases not run"
        print(f"gpu_conformance: {stopped}; writing the report of the {len(results)} that ran", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
        if not args.isolate:
            conf.release_ring_group()
    by_id = {s["id"]: s for s in specs}
    report = conf.summarize(specs, results, time.time() - t0, stopped,
                            lambda i: reproduce_line(by_id[i], args) if i in by_id else f"python {TOOL} --case {i}")
    env = environment({"seed": args.seed, "profile": args.profile, "backend": args.backend,
                       "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), "isolate": args.isolate,
                       "jobs": args.jobs, "chunk_size": args.chunk_size if args.isolate else None,
                       "shared_skeletons": f"{SHARED_SKELETONS[0]:g} of the cases, {SHARED_SKELETONS[1]} per family "
                                           f"and mode (visionattn.testing.conformance)",
                       "time_budget_s": args.time_budget, "families": ",".join(args.families),
                       "modes": ",".join(args.modes), "allow_tf32": False,
                       "rules": "out: max(contract, 2 x PyTorch same-precision err + 2 x storage rounding + 1e-6); "
                                "grads: beyond 8 u |c| cancellation floor <= 2 x PyTorch + 2 x storage rounding + "
                                "1e-5 (fp32, fp32-ieee) / 1e-6 relative; tf32 >= contract "
                                "(visionattn.testing.conformance)"})
    report["environment"] = env
    write_results(outputs, prefix, report, markdown(report, env))
    s = report["summary"]
    print(f"gpu_conformance: {s['cases_run']} cases in {s['seconds']} s: {s['pass']} passed, {s['failed']} failed, "
          f"{s['refused']} refused, {s['skipped']} skipped" + (f"; stopped early: {s['stopped_early']}"
                                                                if s["stopped_early"] else "")
          + f"; report in {args.out}", flush=True)
    if interrupted:
        sys.exit(130)
    return report


if __name__ == "__main__":
    report = main(build_parser().parse_args())
    sys.exit(1 if report["summary"]["failed"] else 0)
