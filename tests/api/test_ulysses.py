"""visionattn.distributed with ``scheme="ulysses"`` (all-to-all head parallelism) and the rule of ``"auto"``: gloo
with 2 and 4 CPU processes (unequal and empty shards), a one-rank group in this process, NCCL with one GPU.

Ulysses' all-to-alls permute the data: each rank runs :func:`visionattn.attention` on all tokens of its heads, so
its output is single-process attention's on the gathered tensors, head by head. The bounds: against that call
``EXACT`` (max abs, every mode: the same arithmetic on the same values), against the float64 oracle the mode's
``rel_tol``; gradients ``EXACT`` against single-process autograd and ``GRAD_TOL`` against the float64 oracle
(tests/api/test_distributed.py's FP32 bound). Errors on one rank and dead ranks: tests/api/test_distributed_hostile.py.
"""
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import visionattn as va
from visionattn.distributed import SCHEMES, _context_parallel, context_parallel_attention
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention

EXACT = 1e-6
GRAD_TOL = 1e-5
SCHEME_OF = {"_HeadExchangeBackward": "ulysses", "_RingFunctionBackward": "ring"}  # the output's autograd node


def _inputs(n_q: int, n_k: int, h: int, seed: int = 0, b: int = 2, d: int = 16, dv: int = 8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=g, dtype=dtype)
    k, v = torch.randn(b, h, n_k, d, generator=g, dtype=dtype), torch.randn(b, h, n_k, dv, generator=g, dtype=dtype)
    return q, k, v


def _bounds(lens: list[int], rank: int) -> tuple[int, int]:
    return sum(lens[:rank]), sum(lens[:rank + 1])


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# ----------------------------------------------------------------------------- workers (run in the spawned ranks)
def _forward_cases(rank: int, lens: list[int], heads: int) -> list:
    """Every mode x (plain, causal): Ulysses vs single-process attention and the float64 oracle."""
    n = sum(lens)
    q, k, v = _inputs(n, n, heads)
    s, e = _bounds(lens, rank)
    rows = []
    for mode in va.mode_names():
        for name, kw in (("plain", {}), ("causal", {"is_causal": True}), ("scale", {"scale": 0.3})):
            out = context_parallel_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], mode=mode, scheme="ulysses",
                                             **kw)
            assert out.shape == (2, heads, e - s, 8) and out.dtype == torch.float32
            single = va.attention(q, k, v, mode=mode, **kw)[:, :, s:e]
            rows.append((f"{mode} {name} vs attention", _max_abs(out, single), EXACT))
            if e > s:
                rows.append((f"{mode} {name} vs oracle", rel_l2(out, oracle_attention(q, k, v, **kw)[:, :, s:e]),
                             va.MODES[mode].rel_tol))
    return rows


def _offset_and_dtype_cases(rank: int, heads: int) -> list:
    """Query and key shards of different lengths under is_causal; float64 and bfloat16 inputs (the all-to-alls
    carry q's dtype)."""
    world = dist.get_world_size()
    q_lens, k_lens = [3 + r for r in range(world)], [6 - r for r in range(world)]
    q, k, v = _inputs(sum(q_lens), sum(k_lens), heads, seed=2)
    qs, qe = _bounds(q_lens, rank)
    ks, ke = _bounds(k_lens, rank)
    out = context_parallel_attention(q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], is_causal=True, scheme="ulysses")
    rows = [("offset causal vs attention", _max_abs(out, va.attention(q, k, v, is_causal=True)[:, :, qs:qe]), EXACT),
            ("offset causal vs oracle", rel_l2(out, oracle_attention(q, k, v, is_causal=True)[:, :, qs:qe]),
             va.MODES["fp32"].rel_tol)]
    n = 4 * world + 1
    s, e = _bounds([5] + [4] * (world - 1), rank)
    for dtype, mode in ((torch.float64, "fp32"), (torch.bfloat16, "bf16")):
        q, k, v = _inputs(n, n, heads, seed=3, dtype=dtype)
        out = context_parallel_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], mode=mode, scheme="ulysses")
        assert out.dtype == dtype
        rows.append((f"{dtype} inputs vs attention", _max_abs(out, va.attention(q, k, v, mode=mode)[:, :, s:e]),
                     EXACT))
    return rows


def _grad_cases(rank: int, lens: list[int], heads: int, kernels: bool = False) -> list:
    """q / k / v gradients through the Ulysses backward vs single-process autograd and the float64 oracle; with
    ``kernels`` the forward and backward kernels (interpreter) run, fp32 only."""
    n = sum(lens)
    q, k, v = _inputs(n, n, heads, seed=5, b=1 if kernels else 2)
    w = torch.randn(*q.shape[:3], 8, generator=torch.Generator().manual_seed(6))
    s, e = _bounds(lens, rank)
    rows = []
    tag = "kernel " if kernels else ""
    for mode in ("fp32",) if kernels else ("fp32", "bf16", "pasa"):
        for name, kw in (("plain", {}), ("causal", {"is_causal": True})):
            leaves = [t[:, :, s:e].clone().requires_grad_() for t in (q, k, v)]
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            with va.use_backend("triton" if kernels else "auto"):
                out = context_parallel_attention(*leaves, mode=mode, scheme="ulysses", **kw)
                assert type(out.grad_fn).__name__ == "_HeadExchangeBackward"
                (out * w[:, :, s:e]).sum().backward()
                (va.attention(*full, mode=mode, **kw) * w).sum().backward()
            for label, leaf, one in zip(("dq", "dk", "dv"), leaves, full):
                rows.append((f"{tag}{mode} grad {name} {label} vs attention", _max_abs(leaf.grad, one.grad[:, :, s:e]),
                             EXACT))
            if mode != "fp32" or e == s:
                continue
            gold = [t.double().requires_grad_() for t in (q, k, v)]
            (oracle_attention(*gold, **kw) * w.double()).sum().backward()
            for label, leaf, ref in zip(("dq", "dk", "dv"), leaves, gold):
                rows.append((f"{tag}fp32 grad {name} {label} vs oracle", rel_l2(leaf.grad, ref.grad[:, :, s:e]),
                             GRAD_TOL))
    return rows


def _auto_cases(rank: int, lens: list[int], heads: int) -> tuple[list, dict]:
    """``"auto"``: the scheme each call takes (read from the output's autograd node) and its result. Ulysses where
    the heads split evenly and no rank has a bias or mask, else the ring; a bias on rank 0 alone sends every
    rank to the ring."""
    n = sum(lens)
    s, e = _bounds(lens, rank)
    uneven = heads + 1  # heads % world == 0 here, so heads + 1 does not split
    q, k, v = _inputs(n, n, heads, seed=7)
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(heads, n, n, generator=g)  # rank 0 passes its rows, every other rank none
    mask = torch.rand(1, 1, n, n, generator=g) > 0.3
    cases = {"plain": (heads, {}), "causal": (heads, {"is_causal": True}), "mask": (heads, {"attn_mask": mask}),
             "bias on rank 0": (heads, {"bias": bias} if rank == 0 else {}),
             f"{uneven} heads": (uneven, {}), "ring asked": (heads, {"scheme": "ring"})}
    rows, taken = [], {}
    ref_kw = {"plain": {}, "causal": {"is_causal": True}, "mask": {"attn_mask": mask},
              "bias on rank 0": {"bias": torch.where(torch.arange(n)[:, None] < lens[0], bias, 0.0)}}
    for name, (h, kw) in cases.items():
        kw = {"scheme": "auto", **kw}
        qh, kh, vh = _inputs(n, n, h, seed=7) if h != heads else (q, k, v)
        local = {key: t[..., s:e, :] if torch.is_tensor(t) else t for key, t in kw.items()}
        leaves = [t[:, :, s:e].clone().requires_grad_() for t in (qh, kh, vh)]
        out = context_parallel_attention(*leaves, **local)
        taken[name] = SCHEME_OF.get(type(out.grad_fn).__name__, type(out.grad_fn).__name__)
        out.sum().backward()  # either backward is a collective: every rank runs it
        single = va.attention(qh, kh, vh, **ref_kw.get(name, {}))[:, :, s:e]
        if e > s:
            rows.append((f"auto {name} vs attention", rel_l2(out.detach(), single), 2 * va.MODES["fp32"].rel_tol))
    try:
        context_parallel_attention(*(t[:, :, s:e] for t in _inputs(n, n, uneven, seed=7)), scheme="ulysses")
    except ValueError as err:
        taken["ulysses asked, heads uneven"] = str(err)
    return rows, taken


def _worker(rank: int, world: int, init: str, out_dir: str, tasks: list, lens: list[int], heads: int):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = {"rows": [], "taken": {}}
        for task in tasks:
            if task == "forward":
                result["rows"] += _forward_cases(rank, lens, heads)
            elif task == "offset":
                result["rows"] += _offset_and_dtype_cases(rank, heads)
            elif task == "grad":
                result["rows"] += _grad_cases(rank, lens, heads)
            elif task == "grad-kernel":
                result["rows"] += _grad_cases(rank, lens, heads, kernels=True)
            elif task == "auto":
                rows, result["taken"] = _auto_cases(rank, lens, heads)
                result["rows"] += rows
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        gc.collect()  # free gloo works held in cycles before the group goes (else: abort at exit)
        dist.destroy_process_group()


def _spawn(tmp_path, lens: list[int], heads: int, tasks: list[str]) -> list[dict]:
    world = len(lens)
    mp.spawn(_worker, args=(world, f"file://{tmp_path / 'init'}", str(tmp_path), tasks, lens, heads), nprocs=world)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _check_rows(results: list[dict]):
    bad = [f"rank {r}: {name}: {err:.3g} > {bound:.3g}" for r, res in enumerate(results)
           for name, err, bound in res["rows"] if not err <= bound]
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- tests
def test_two_ranks_every_mode_gradients_and_the_auto_rule(tmp_path):
    # the kernel case runs in the Triton interpreter: TRITON_INTERPRET=1 (tests/conftest.py, no CUDA) is inherited
    tasks = ["forward", "offset", "grad", "auto"]
    kernels = os.environ.get("TRITON_INTERPRET") == "1"
    results = _spawn(tmp_path, [6, 1], 4, tasks + (["grad-kernel"] if kernels else []))
    _check_rows(results)
    names = {name for name, _, _ in results[1]["rows"]}
    assert {"pasa causal vs attention", "fp32 grad causal dk vs oracle", "offset causal vs oracle",
            "torch.float64 inputs vs attention", "auto 5 heads vs attention"} <= names
    assert ("kernel fp32 grad causal dq vs attention" in names) == kernels
    for res in results:
        taken = res["taken"]
        assert {name: taken[name] for name in ("plain", "causal", "mask", "bias on rank 0", "5 heads",
                                               "ring asked")} == {
            "plain": "ulysses", "causal": "ulysses", "mask": "ring", "bias on rank 0": "ring", "5 heads": "ring",
            "ring asked": "ring"}
        assert taken["ulysses asked, heads uneven"].startswith(
            "scheme='ulysses' cannot take this call: the 5 heads do not split evenly over 2 ranks")


def test_four_ranks_unequal_and_empty_shards(tmp_path):
    results = _spawn(tmp_path, [5, 0, 9, 3], 4, ["forward", "offset", "grad", "auto"])
    _check_rows(results)
    names = {name for name, _, _ in results[1]["rows"]}  # the empty rank: its [B, H, 0, Dv] outputs, no gradients
    assert "fp32 plain vs attention" in names and "fp32 plain vs oracle" not in names
    assert "fp32 grad causal dk vs oracle" not in names and "offset causal vs oracle" in names
    for res in results:
        assert res["taken"]["plain"] == "ulysses" and res["taken"]["5 heads"] == "ring"
        assert res["taken"]["bias on rank 0"] == "ring"
        assert "the 5 heads do not split evenly over 4 ranks" in res["taken"]["ulysses asked, heads uneven"]


def test_one_rank_group_runs_ulysses_forward_backward_and_double_backward(tmp_path):
    """gloo with one rank, in this process: the all-to-alls (to itself) around attention give attention's output
    and gradients, the second derivative included (the reference backend differentiates twice)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        q, k, v = _inputs(7, 7, 3, seed=9)
        with va.use_backend("reference"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = _context_parallel(*leaves, None, "fp32", None, None, True, None, "ulysses")
            assert type(out.grad_fn).__name__ == "_HeadExchangeBackward"
            (dq,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
            dq.square().sum().backward()
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            (dq_ref,) = torch.autograd.grad(va.attention(*full, is_causal=True).square().sum(), full[0],
                                            create_graph=True)
            dq_ref.square().sum().backward()
        assert _max_abs(dq, dq_ref) <= EXACT
        for mine, ref in zip(leaves, full):
            assert _max_abs(mine.grad, ref.grad) <= EXACT
    finally:
        dist.destroy_process_group()


def test_single_process_checks_the_scheme():
    assert not dist.is_initialized()
    assert SCHEMES == ("auto", "ring", "ulysses")
    q, k, v = _inputs(7, 7, 2)
    for scheme in SCHEMES:
        assert torch.equal(context_parallel_attention(q, k, v, is_causal=True, scheme=scheme),
                           va.attention(q, k, v, is_causal=True))
    with pytest.raises(ValueError, match="scheme='ulisses' is not one of 'auto', 'ring', 'ulysses'"):
        context_parallel_attention(q, k, v, scheme="ulisses")
    with pytest.raises(ValueError, match=r"cannot take this call: it takes no bias or attn_mask, got attn_mask"):
        context_parallel_attention(q, k, v, attn_mask=torch.ones(7, 7, dtype=torch.bool), scheme="ulysses")


@pytest.mark.gpu
def test_gpu_one_rank_ulysses_equals_attention(tmp_path):
    """NCCL with one rank: the all-to-alls and attention's kernels, forward and backward, equal attention."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        q, k, v = (t.cuda() for t in _inputs(300, 300, 4, d=64, dv=64))
        for mode in va.mode_names():
            for kw in ({}, {"is_causal": True}):
                out = _context_parallel(q, k, v, None, mode, None, None, kw.get("is_causal", False), None, "ulysses")
                assert _max_abs(out, va.attention(q, k, v, mode=mode, **kw)) <= EXACT, (mode, kw)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        _context_parallel(*leaves, None, "fp32", None, None, True, None, "ulysses").square().sum().backward()
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        va.attention(*full, is_causal=True, mode="fp32").square().sum().backward()
        for mine, ref in zip(leaves, full):
            assert _max_abs(mine.grad, ref.grad) <= EXACT
    finally:
        dist.destroy_process_group()
