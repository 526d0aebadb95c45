"""visionattn.distributed: context-parallel ring attention (``scheme="ring"``) on gloo (2 and 3 CPU processes) and
NCCL (1 GPU); Ulysses and the scheme rule: tests/api/test_ulysses.py.

Each world size is spawned once; its workers run every case, return (name, error, bound) rows and the
error messages they caught through files, and the test asserts here. Tolerances are the modes' contracts
(:data:`visionattn.modes.MODES`): the ring's output against the float64 oracle within ``rel_tol``, against
single-process :func:`visionattn.attention` within ``2 * rel_tol`` (two roundings of the same contract,
as tests/api/test_varlen.py), gradients within 1e-5 (tests/api/test_window_grad.py's FP32 bound).
"""
import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import visionattn as va
from visionattn.distributed import _context_parallel, context_parallel_attention, merge_partials
from visionattn.metrics import rel_l2
from visionattn.reference import oracle_attention

GRAD_TOL = 1e-5


def _inputs(n_q: int, n_k: int, seed: int = 0, b: int = 2, h: int = 3, d: int = 16, dv: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=g)
    k, v = torch.randn(b, h, n_k, d, generator=g), torch.randn(b, h, n_k, dv, generator=g)
    bias = torch.randn(h, n_q, n_k, generator=g)  # [H, Nq, Nk]: broadcast over the batch
    mask = torch.rand(b, 1, n_q, n_k, generator=g) > 0.3
    mask[:, :, 1] = False  # a row masked everywhere: zeros, not NaN
    return q, k, v, bias, mask


def _rows(t, start, stop):
    """Query rows [start, stop) of a full-length bias / mask (dim -2)."""
    return t[..., start:stop, :]


# ----------------------------------------------------------------------------- workers (run in the spawned ranks)
def _attention_cases(rank: int, lens: list[int], modes) -> list:
    """Every mode x (plain, bias, mask, causal, all three): ring vs oracle and vs single-process attention."""
    n = sum(lens)
    q, k, v, bias, mask = _inputs(n, n)
    s, e = sum(lens[:rank]), sum(lens[:rank + 1])
    cases = {"plain": {}, "bias": {"bias": bias}, "mask": {"attn_mask": mask}, "causal": {"is_causal": True},
             "bias+mask+causal": {"bias": bias, "attn_mask": mask, "is_causal": True}}
    rows = []
    for mode in modes:
        tol = va.MODES[mode].rel_tol
        for name, kw in cases.items():
            local = {key: _rows(t, s, e) if torch.is_tensor(t) else t for key, t in kw.items()}
            out = context_parallel_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], mode=mode, scheme="ring",
                                             **local)
            assert out.shape == (2, 3, e - s, 8) and out.dtype == torch.float32
            if e == s:
                continue
            assert torch.isfinite(out).all(), (mode, name)
            if "attn_mask" in kw and s <= 1 < e:
                assert (out[:, :, 1 - s] == 0).all(), (mode, name)
            rows.append((f"{mode} {name} vs oracle", rel_l2(out, oracle_attention(q, k, v, **kw)[:, :, s:e]), tol))
            single = va.attention(q, k, v, mode=mode, **kw)[:, :, s:e]
            rows.append((f"{mode} {name} vs attention", rel_l2(out, single), 2 * tol))
    return rows


def _kernel_cases(rank: int, lens: list[int]) -> list:
    """The dense forward kernel with LSE (Triton interpreter on CPU): ring vs the reference path."""
    n = sum(lens)
    q, k, v, bias, mask = _inputs(n, n, seed=1, b=1, h=2)
    s, e = sum(lens[:rank]), sum(lens[:rank + 1])
    rows = []
    for mode in ("fp32", "fp16"):
        for name, kw in (("plain", {}), ("bias+mask+causal", {"bias": bias, "attn_mask": mask, "is_causal": True})):
            local = {key: _rows(t, s, e) if torch.is_tensor(t) else t for key, t in kw.items()}
            with va.use_backend("triton"):
                out = context_parallel_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], mode=mode,
                                                 scheme="ring", **local)
            ref = va.attention(q, k, v, mode=mode, backend="reference", **kw)[:, :, s:e]
            rows.append((f"kernel {mode} {name} vs attention", rel_l2(out, ref), 2 * va.MODES[mode].rel_tol))
    return rows


def _offset_causal_case(rank: int) -> list:
    """Query and key shards of different lengths: the causal diagonal crosses a shard at another offset."""
    q_lens, k_lens = (3, 4), (6, 2)
    q, k, v, bias, _ = _inputs(sum(q_lens), sum(k_lens), seed=2)
    qs, qe = sum(q_lens[:rank]), sum(q_lens[:rank + 1])
    ks, ke = sum(k_lens[:rank]), sum(k_lens[:rank + 1])
    out = context_parallel_attention(q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], bias=_rows(bias, qs, qe),
                                     is_causal=True, scheme="ring")
    gold = oracle_attention(q, k, v, bias=bias, is_causal=True)[:, :, qs:qe]
    return [("offset causal vs oracle", rel_l2(out, gold), va.MODES["fp32"].rel_tol)]


def _grad_case(rank: int, lens: list[int]) -> list:
    """fp32: gradients of q, k, v and the bias on 2 ranks vs single-process autograd and the float64 oracle."""
    n = sum(lens)
    q, k, v, bias, mask = _inputs(n, n, seed=3)
    w = torch.randn(2, 3, n, 8, generator=torch.Generator().manual_seed(4))
    s, e = sum(lens[:rank]), sum(lens[:rank + 1])

    def mine(t, label):  # this rank's part of a full-sequence tensor or gradient
        return _rows(t, s, e) if label == "dbias" else t[:, :, s:e]

    rows = []
    for name, kw in (("bias+mask", {"attn_mask": mask}), ("bias+causal", {"is_causal": True})):
        local_kw = {key: _rows(t, s, e) if torch.is_tensor(t) else t for key, t in kw.items()}
        leaves = [mine(t, label).clone().requires_grad_()
                  for t, label in zip((q, k, v, bias), ("dq", "dk", "dv", "dbias"))]
        out = context_parallel_attention(*leaves[:3], bias=leaves[3], mode="fp32", scheme="ring", **local_kw)
        (out * w[:, :, s:e]).sum().backward()
        full = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        single = va.attention(*full[:3], bias=full[3], mode="fp32", **kw)
        (single * w).sum().backward()
        gold = [t.double().requires_grad_() for t in (q, k, v, bias)]
        (oracle_attention(*gold[:3], bias=gold[3], **kw) * w.double()).sum().backward()
        rows.append((f"grad {name} forward vs attention", rel_l2(out.detach(), single.detach()[:, :, s:e]),
                     2 * va.MODES["fp32"].rel_tol))
        for label, leaf, one, ref in zip(("dq", "dk", "dv", "dbias"), leaves, full, gold):
            rows.append((f"grad {name} {label} vs attention", rel_l2(leaf.grad, mine(one.grad, label)), GRAD_TOL))
            rows.append((f"grad {name} {label} vs oracle", rel_l2(leaf.grad, mine(ref.grad, label)), GRAD_TOL))
    return rows


def _ring_grad_case(rank: int, lens: list[int], kernels: bool = False) -> list:
    """q / k / v gradients through the ring backward (a bias and mask that need no gradient, causal): vs
    single-process autograd and the float64 oracle; with ``kernels`` the backward kernels (interpreter) run."""
    n = sum(lens)
    q, k, v, bias, mask = _inputs(n, n, seed=5, b=1 if kernels else 2, h=2 if kernels else 3)
    w = torch.randn(*q.shape[:3], 8, generator=torch.Generator().manual_seed(6))
    s, e = sum(lens[:rank]), sum(lens[:rank + 1])
    rows = []
    for name, kw in (("bias+mask", {"bias": bias, "attn_mask": mask}), ("causal", {"is_causal": True}),
                     ("bias+causal", {"bias": bias, "is_causal": True})):
        local_kw = {key: _rows(t, s, e) if torch.is_tensor(t) else t for key, t in kw.items()}
        leaves = [t[:, :, s:e].clone().requires_grad_() for t in (q, k, v)]
        with va.use_backend("triton" if kernels else "auto"):
            out = context_parallel_attention(*leaves, mode="fp32", scheme="ring", **local_kw)
            assert type(out.grad_fn).__name__ == "_RingFunctionBackward"
            (out * w[:, :, s:e]).sum().backward()
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        (va.attention(*full, mode="fp32", backend="reference", **kw) * w).sum().backward()
        gold = [t.double().requires_grad_() for t in (q, k, v)]
        kw64 = {key: t.double() if torch.is_tensor(t) and t.is_floating_point() else t for key, t in kw.items()}
        (oracle_attention(*gold, **kw64) * w.double()).sum().backward()
        tag = "ring kernel" if kernels else "ring"
        for label, leaf, one, ref in zip(("dq", "dk", "dv"), leaves, full, gold):
            if leaf.numel() == 0:
                continue
            rows.append((f"{tag} grad {name} {label} vs attention", rel_l2(leaf.grad, one.grad[:, :, s:e]), GRAD_TOL))
            rows.append((f"{tag} grad {name} {label} vs oracle", rel_l2(leaf.grad, ref.grad[:, :, s:e]), GRAD_TOL))
    return rows


def _error_cases(rank: int) -> dict:
    """The messages every rank raises for shards that disagree or a rank's invalid input (nobody hangs)."""
    q, k, v, bias, _ = _inputs(4, 4)
    caught = {}

    def run(name, fn):
        try:
            fn()
        except (TypeError, ValueError) as e:
            caught[name] = f"{type(e).__name__}: {e}"
        else:
            caught[name] = "no error"

    heads = 3 if rank == 0 else 2
    run("heads", lambda: context_parallel_attention(q[:, :heads], k[:, :heads], v[:, :heads]))
    run("head_dim", lambda: context_parallel_attention(q[..., :16 - rank], k[..., :16 - rank], v))
    run("rank1 3d", lambda: context_parallel_attention(q[0] if rank else q, k, v))
    run("bias cols", lambda: context_parallel_attention(q, k, v, bias=bias))  # 4 columns of 8 keys
    run("mode", lambda: context_parallel_attention(q, k, v, mode="fp32" if rank == 0 else "fp16"))
    run("grad on one rank", lambda: context_parallel_attention(q.clone().requires_grad_(rank == 0), k, v))
    return caught


def _worker(rank: int, world: int, init: str, out_dir: str, tasks: list, lens: list[int]):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = {"rows": [], "errors": {}}
        for task in tasks:
            if task == "attention":
                result["rows"] += _attention_cases(rank, lens, va.mode_names())
            elif task == "kernel":
                result["rows"] += _kernel_cases(rank, lens)
            elif task == "offset":
                result["rows"] += _offset_causal_case(rank)
            elif task == "grad":
                result["rows"] += _grad_case(rank, lens)
            elif task == "ring-grad":
                result["rows"] += _ring_grad_case(rank, lens)
            elif task == "ring-grad-kernel":
                result["rows"] += _ring_grad_case(rank, lens, kernels=True)
            elif task == "errors":
                result["errors"] = _error_cases(rank)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        gc.collect()  # free gloo p2p works held in cycles before the group goes (else: abort at exit)
        dist.destroy_process_group()


def _spawn(tmp_path, lens: list[int], tasks: list[str]) -> list[dict]:
    world = len(lens)
    mp.spawn(_worker, args=(world, f"file://{tmp_path / 'init'}", str(tmp_path), tasks, lens), nprocs=world)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _check_rows(results: list[dict]):
    bad = [f"rank {r}: {name}: {err:.3g} > {bound:.3g}" for r, res in enumerate(results)
           for name, err, bound in res["rows"] if not err <= bound]
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- tests
def test_two_ranks_every_mode_kernel_path_gradients_and_errors(tmp_path):
    # the kernel path on CPU tensors runs in the Triton interpreter: TRITON_INTERPRET=1 (set by tests/conftest.py
    # on a machine without CUDA) is inherited by the spawned ranks
    tasks = ["attention", "offset", "grad", "ring-grad", "errors"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        tasks += ["kernel", "ring-grad-kernel"]
    results = _spawn(tmp_path, [6, 1], tasks)
    _check_rows(results)
    names = {name for name, _, _ in results[1]["rows"]}
    assert {"grad bias+causal dk vs oracle", "offset causal vs oracle", "pasa causal vs attention"} <= names
    assert ("kernel fp16 bias+mask+causal vs attention" in names) == ("kernel" in tasks)
    assert "ring grad bias+causal dk vs oracle" in names
    assert ("ring kernel grad causal dq vs oracle" in names) == ("kernel" in tasks)
    errors = [res["errors"] for res in results]
    for r in range(2):
        assert "ValueError" in errors[r]["heads"] and "heads differ across ranks" in errors[r]["heads"]
        assert "head_dim differs across ranks" in errors[r]["head_dim"]
        assert "bias of rank(s) [0, 1] has [4, 4] key columns" in errors[r]["bias cols"]
        assert "mode differs across ranks" in errors[r]["mode"]
        assert "gradients are needed on some ranks" in errors[r]["grad on one rank"]
    # one rank's own error: every rank raises it, naming the rank (tests/api/test_distributed_hostile.py: more)
    assert errors[0]["rank1 3d"] == errors[1]["rank1 3d"]
    assert errors[0]["rank1 3d"].startswith("ValueError: context_parallel_attention: rank 1: query must have 4 dims")


def test_three_ranks_unequal_and_empty_shards_every_mode(tmp_path):
    results = _spawn(tmp_path, [5, 0, 9], ["attention", "ring-grad"])
    assert results[1]["rows"] == []  # the empty rank returns [B, H, 0, Dv] and still relays the ring
    _check_rows([results[0], results[2]])


def test_one_rank_group_runs_the_ring_forward_and_backward(tmp_path):
    """gloo with one rank, in this process: the ring (no transfers) and its backward (the accumulator stays with
    its owner) give attention's output and gradients."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        q, k, v, bias, mask = _inputs(7, 7, seed=7)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = _context_parallel(*leaves, None, "fp32", bias, mask, True, None, "ring")
        assert type(out.grad_fn).__name__ == "_RingFunctionBackward"
        out.square().sum().backward()
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        single = va.attention(*full, bias=bias, attn_mask=mask, is_causal=True, mode="fp32")
        single.square().sum().backward()
        assert rel_l2(out.detach(), single.detach()) <= 2 * va.MODES["fp32"].rel_tol
        for mine, ref in zip(leaves, full):
            assert rel_l2(mine.grad, ref.grad) <= GRAD_TOL
    finally:
        dist.destroy_process_group()


def test_single_process_is_exactly_attention():
    assert not dist.is_initialized()
    q, k, v, bias, mask = _inputs(7, 7)
    for kw in ({}, {"bias": bias, "attn_mask": mask, "is_causal": True, "scale": 0.3}):
        expected = va.attention(q, k, v, mode="fp16", **kw)
        assert torch.equal(context_parallel_attention(q, k, v, mode="fp16", **kw), expected)
    with pytest.raises(ValueError, match="query must have 4 dims"):
        context_parallel_attention(q[0], k, v)


def test_merge_partials_identity_empty_rows_and_gradients():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (4, 10, 10))
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    s[:, :, 2] = float("-inf")  # row 2 sees no key
    parts = []
    for a, b in ((0, 3), (3, 10)):
        lse = torch.logsumexp(s[..., a:b], -1)
        p = torch.nan_to_num(torch.softmax(s[..., a:b], -1))
        parts.append((p @ v[:, :, a:b], lse))
    out, lse = merge_partials(*parts[0], *parts[1])
    ident = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    torch.testing.assert_close(out, torch.nan_to_num(torch.softmax(s, -1)) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    assert (out[:, :, 2] == 0).all() and torch.isneginf(lse[:, :, 2]).all()
    assert torch.equal(merge_partials(out, lse, *ident)[0], out)
    # gradients through a merge with empty rows stay finite
    leaves = [t.clone().requires_grad_() for t in (*parts[0], *parts[1])]
    o, l_ = merge_partials(*leaves)
    (o.sum() + torch.where(torch.isfinite(l_), l_, 0).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_import_visionattn_does_not_import_distributed():
    code = "import sys, visionattn; assert 'visionattn.distributed' not in sys.modules; import visionattn.distributed"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stderr


@pytest.mark.gpu
def test_gpu_one_rank_ring_equals_attention(tmp_path):
    """NCCL with one rank: the ring machinery (exchange, kernel with LSE, merge) and the ring backward (the
    backward kernels) equal visionattn.attention; the public function with one rank is attention itself."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        q, k, v, bias, mask = (t.cuda() for t in _inputs(300, 300, b=2, h=4, d=64, dv=64))
        for mode in va.mode_names():
            tol = va.MODES[mode].rel_tol
            for kw in ({}, {"bias": bias, "attn_mask": mask, "is_causal": True}):
                ring = _context_parallel(q, k, v, None, mode, kw.get("bias"), kw.get("attn_mask"),
                                         kw.get("is_causal", False), None, "ring")
                single = va.attention(q, k, v, mode=mode, **kw)
                assert rel_l2(ring, single) <= 2 * tol, (mode, list(kw))
                assert rel_l2(ring, oracle_attention(q, k, v, **kw)) <= tol, (mode, list(kw))
                assert torch.equal(context_parallel_attention(q, k, v, mode=mode, **kw), single)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = _context_parallel(*leaves, None, "fp32", None, None, True, None, "ring")
        out.square().sum().backward()
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        va.attention(*full, is_causal=True, mode="fp32").square().sum().backward()
        for mine, ref in zip(leaves, full):
            assert rel_l2(mine.grad, ref.grad) <= GRAD_TOL
    finally:
        dist.destroy_process_group()
