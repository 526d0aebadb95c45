"""visionattn.distributed under hostile inputs: a collective call fails on every rank, never hangs.

One rank's inputs are invalid (a meta ``scale``, float16-overflowing q / k, another head dim, dtype or
device, a value length that is not the key length, a bias over the wrong key count, ...): every rank
must raise the same error class with the same message, naming the failing rank, at once (well within
``BOUND_S``). Then the group must still be in step: a valid call after the errors equals single-process
attention, with either scheme. A rank that dies (before the call, inside a ring step or a Ulysses all-to-all,
inside either backward) must not leave the others hanging: they raise a RuntimeError naming the exchange, the
ring step or the all-to-all. The CPU ranks use gloo
with a short group timeout, and the parent joins them with a deadline, so a hang fails the test instead
of holding CI.
"""
import datetime
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import visionattn as va
import visionattn.distributed as vd
from visionattn.distributed import _agree, context_parallel_attention, gather_sequence
from visionattn.metrics import rel_l2

BOUND_S = 5.0  # one hostile call, every rank: the exchange answers in milliseconds; a hang waits GROUP_TIMEOUT_S
GROUP_TIMEOUT_S = 20  # gloo's wait for a peer (a regression that hangs raises after it, in the ranks)
DEADLINE_S = 90  # the parent's join: past it the ranks are killed and the test fails


def _inputs(n: int, seed: int = 0, d: int = 16, dv: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, d, generator=g), torch.randn(2, 3, n, d, generator=g), torch.randn(2, 3, n, dv,
                                                                                                     generator=g)


def _catch(fn) -> tuple[str, str, float]:
    """(error class, message, seconds) of one call; ("none", "", s) when it returns."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001: the class is what the test compares
        return type(e).__name__, str(e), time.perf_counter() - t0
    return "none", "", time.perf_counter() - t0


# ----------------------------------------------------------------------------- workers (run in the spawned ranks)
def _hostile_cases(rank: int) -> dict:
    """name -> (class, message, seconds) of each hostile call; rank 1 is the hostile one unless named."""
    q, k, v = _inputs(4)
    bad = rank == 1
    cpa = context_parallel_attention
    huge = q * 1e6  # beyond float16's 65504
    q2, k2, v2 = q[:, :2], k[:, :2], v[:, :2]  # 2 heads: Ulysses can split them over 2 ranks
    cases = {
        "meta scale": lambda: cpa(q, k, v, scale=torch.tensor(0.3, device="meta") if bad else 0.3),
        "fp16 overflow q": lambda: cpa(huge if bad else q, k, v, mode="fp16"),
        "fp16 overflow k, ring backward": lambda: cpa(q.clone().requires_grad_(), huge if bad else k, v, mode="fp16"),
        "fp16 overflow q, gathering backward": lambda: cpa(huge if bad else q, k, v, mode="fp16",
                                                          bias=torch.zeros(8).requires_grad_()),
        "fp16 overflow q, pasa": lambda: cpa(huge if bad else q, k, v, mode="pasa"),
        "head dim across ranks": lambda: cpa(q[..., :15] if bad else q, k[..., :15] if bad else k, v),
        "head dim in rank 1": lambda: cpa(q, k[..., :15] if bad else k, v),
        "dtype across ranks": lambda: cpa(*((t.double() for t in (q, k, v)) if bad else (q, k, v))),
        "dtype in rank 1": lambda: cpa(q, k.half() if bad else k, v),
        "device: meta shard": lambda: cpa(*((t.to("meta") for t in (q, k, v)) if bad else (q, k, v))),
        "device: meta key": lambda: cpa(q, k.to("meta") if bad else k, v),
        "value length": lambda: cpa(q, k, v[:, :, :3] if bad else v),
        "bias key count": lambda: cpa(q, k, v, bias=torch.zeros(4 if bad else 8)),
        "is_causal not a bool": lambda: cpa(q, k, v, is_causal="yes" if bad else True),
        "unknown mode": lambda: cpa(q, k, v, mode="fp8" if bad else "fp32"),
        "both ranks": lambda: cpa(q[0] if bad else q, k, v, scale=0.3 if bad else torch.tensor(0.3, device="meta")),
        "other error class": lambda: _agree(dist.group.WORLD, "probe", None if bad else [1.0], KeyError("boom")
                                            if bad else None, 1),
        "gather: dims": lambda: gather_sequence(q[0] if bad else q, dim=2),
        "gather: not a tensor": lambda: gather_sequence([1, 2] if bad else q, dim=2),
        "gather: dtype": lambda: gather_sequence(q.double() if bad else q, dim=2),
        "gather: grad on rank 1": lambda: gather_sequence(q.clone().requires_grad_(bad), dim=2),
        "scheme across ranks": lambda: cpa(q, k, v, scheme="ring" if bad else "ulysses"),
        "unknown scheme": lambda: cpa(q, k, v, scheme="ulisses" if bad else "auto"),
        "ulysses: heads": lambda: cpa(q, k, v, scheme="ulysses"),  # 3 heads, 2 ranks
        "ulysses: bias on rank 1": lambda: cpa(q2, k2, v2, scheme="ulysses", bias=torch.zeros(8) if bad else None),
        "ulysses: fp16 overflow q": lambda: cpa(huge[:, :2] if bad else q2, k2, v2, mode="fp16", scheme="ulysses"),
    }
    caught = {name: _catch(fn) for name, fn in cases.items()}
    # the group is still in step after every error: a valid call equals single-process attention
    qf, kf, vf = _inputs(8, seed=1)
    s, e = 4 * rank, 4 * rank + 4
    out = cpa(qf[:, :, s:e], kf[:, :, s:e], vf[:, :, s:e], is_causal=True)
    caught["valid call after the errors"] = rel_l2(out, va.attention(qf, kf, vf, is_causal=True)[:, :, s:e])
    out = cpa(qf[:, :2, s:e], kf[:, :2, s:e], vf[:, :2, s:e], is_causal=True, scheme="ulysses")
    caught["valid ulysses call after the errors"] = rel_l2(out, va.attention(qf[:, :2], kf[:, :2], vf[:, :2],
                                                                             is_causal=True)[:, :, s:e])
    return caught


def _split_frames_cases(rank: int) -> dict:
    """models/context_parallel.py: rank 1 refuses its model or inputs; every rank raises the same error."""
    from visionattn.models import VGGT, vggt_tiny_config
    from visionattn.models.context_parallel import split_frames

    torch.manual_seed(0)
    model = VGGT(**vggt_tiny_config(), attn_mode="fp32").eval()
    bad = rank == 1
    images = torch.rand(1, 1, 3, 42, 56, generator=torch.Generator().manual_seed(1))
    caught = {}
    model.merging = {"start_block": 0} if bad else None
    caught["split: merging on rank 1"] = _catch(lambda: split_frames(model))
    model.merging = None
    with torch.no_grad(), split_frames(model):
        caught["split: image size"] = _catch(lambda: model(images[..., :41, :] if bad else images))
        caught["split: images 3-dim"] = _catch(lambda: model(images[0, 0] if bad else images))
        caught["split: no frames"] = _catch(lambda: model(images[:, :0] if bad else images))
        caught["split: query points"] = _catch(
            lambda: model(images, query_points=torch.tensor([[10.0, 12.0]]) if bad else None))
        caught["split: batch"] = _catch(lambda: model(images.expand(2, -1, -1, -1, -1) if bad else images))
        ok = _catch(lambda: model(images))  # still in step
    caught["split: valid call after the errors"] = ok
    return caught


def _die(rank: int, where: str) -> dict:
    """Rank 1 dies (before the call, in the ring's first transfer or Ulysses' first all-to-all, in the backward's);
    rank 0's error. The ring's calls have 3 heads (auto: the ring), Ulysses' 2."""
    ulysses = "ulysses" in where
    scheme = "auto"
    q, k, v = (t[:, :2] if ulysses else t for t in _inputs(4))
    collective = "_all_to_all" if ulysses else "_pass_on"
    if where == "before the call":
        # the group set up on both ranks first: the death is the call's to meet, not init_process_group's
        dist.barrier()
        if rank == 1:
            os._exit(0)
    if rank == 1 and where in ("in the ring", "in the ulysses all-to-all"):
        setattr(vd, collective, lambda *a: os._exit(0))
    backward = where.endswith("backward")
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    if not backward:
        return {where: _catch(lambda: context_parallel_attention(*leaves, scheme=scheme))}
    out = context_parallel_attention(*leaves, scheme=scheme)
    if rank == 1:
        setattr(vd, collective, lambda *a: os._exit(0))
    return {where: _catch(lambda: out.sum().backward())}


def _nccl_cases(rank: int) -> dict:
    """NCCL, one GPU per rank: the exchange's buffer lives on the GPU; rank 1 hostile, then a valid call."""
    dev = torch.device("cuda", rank)
    q, k, v = (t.to(dev) for t in _inputs(4))
    bad = rank == 1
    cpa = context_parallel_attention
    cases = {
        "meta scale": lambda: cpa(q, k, v, scale=torch.tensor(0.3, device="meta") if bad else 0.3),
        "fp16 overflow q": lambda: cpa(q * 1e6 if bad else q, k, v, mode="fp16"),
        "head dim across ranks": lambda: cpa(q[..., :15] if bad else q, k[..., :15] if bad else k, v),
        "device: CPU shard": lambda: cpa(*((t.cpu() for t in (q, k, v)) if bad else (q, k, v))),
    }
    caught = {name: _catch(fn) for name, fn in cases.items()}
    qf, kf, vf = (t.to(dev) for t in _inputs(8, seed=1))
    s, e = 4 * rank, 4 * rank + 4
    out = cpa(qf[:, :, s:e], kf[:, :, s:e], vf[:, :, s:e], is_causal=True)
    caught["valid call after the errors"] = rel_l2(out, va.attention(qf, kf, vf, is_causal=True)[:, :, s:e])
    return caught


def _worker(rank: int, world: int, init: str, out_dir: str, task: str):
    if task == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if task == "nccl" else "gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
                            **({"device_id": torch.device("cuda", rank)} if task == "nccl" else {}))
    died = task.startswith("die:")
    try:
        if task == "hostile":
            result = _hostile_cases(rank)
        elif task == "split_frames":
            result = _split_frames_cases(rank)
        elif task == "nccl":
            result = _nccl_cases(rank)
        else:
            result = _die(rank, task[4:])
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if died:
            # a group whose peer died cannot be destroyed cleanly, and gloo's teardown at interpreter exit may abort
            # the process after its result is written: the rank leaves without it
            os._exit(0)
    finally:
        gc.collect()
        if not died:
            dist.destroy_process_group()


def _spawn(tmp_path, task: str, world: int = 2) -> list:
    """Run ``task`` on ``world`` gloo ranks; kill them and fail past DEADLINE_S (a hang). Results of the ranks
    that wrote one."""
    ctx = mp.spawn(_worker, args=(world, f"file://{tmp_path / 'init'}", str(tmp_path), task), nprocs=world,
                   join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{task}: the ranks did not finish within {DEADLINE_S} s (a rank hangs)")
    return [torch.load(tmp_path / f"rank{r}.pt") if (tmp_path / f"rank{r}.pt").exists() else None
            for r in range(world)]


def _same_error_everywhere(results: list[dict], name: str, cls: str, *parts: str):
    """Every rank raised ``cls`` with one message that holds ``parts``, within BOUND_S."""
    got = [res[name] for res in results]
    assert {g[0] for g in got} == {cls}, (name, got)
    assert len({g[1] for g in got}) == 1, (name, got)
    for part in parts:
        assert part in got[0][1], (name, part, got[0][1])
    assert max(g[2] for g in got) < BOUND_S, (name, got)


# ----------------------------------------------------------------------------- tests
EXPECTED = {  # name -> (class, parts of the message)
    "meta scale": ("ValueError", "context_parallel_attention: rank 1: scale is a meta tensor"),
    "fp16 overflow q": ("ValueError", "rank 1: query has values beyond float16's range"),
    "fp16 overflow k, ring backward": ("ValueError", "rank 1: key has values beyond float16's range"),
    "fp16 overflow q, gathering backward": ("ValueError", "rank 1: query has values beyond float16's range"),
    "fp16 overflow q, pasa": ("ValueError", "rank 1: query has values beyond float16's range"),
    "head dim across ranks": ("ValueError", "head_dim differs across ranks", "rank 1: head_dim=15"),
    "head dim in rank 1": ("ValueError", "rank 1: head_dim mismatch: query has D=16, key has D=15"),
    "dtype across ranks": ("ValueError", "query dtype differs across ranks", "rank 1: torch.float64"),
    "dtype in rank 1": ("TypeError", "rank 1: query, key, value must share one dtype"),
    "device: meta shard": ("ValueError", "rank 1: query is a meta tensor"),
    "device: meta key": ("ValueError", "rank 1: all inputs must be on one device"),
    "value length": ("ValueError", "rank 1: key has Nk=4 tokens but value has 3"),
    "bias key count": ("ValueError", "bias of rank(s) [1] has [4] key columns", "total key length 8"),
    "is_causal not a bool": ("TypeError", "rank 1: is_causal must be a bool"),
    "unknown mode": ("ValueError", "rank 1:", "fp8"),
    "both ranks": ("ValueError", "rank 0: scale is a meta tensor", "; rank 1: query must have 4 dims"),
    "other error class": ("RuntimeError", "probe: rank 1: KeyError: 'boom'"),
    "gather: dims": ("ValueError", "gather_sequence: shards must agree", "rank 1: shape [3, 4, -1]"),
    "gather: not a tensor": ("TypeError", "gather_sequence: rank 1: x must be a torch.Tensor"),
    "gather: dtype": ("ValueError", "gather_sequence: shards must agree", "rank 1: shape [2, 3, -1, 16] (-1 marks "
                      "dim 2), torch.float64"),
    "gather: grad on rank 1": ("ValueError", "needs gradients on some ranks", "rank 1: True"),
    "scheme across ranks": ("ValueError", "scheme differs across ranks: rank 0: 'ulysses'; rank 1: 'ring'"),
    "unknown scheme": ("ValueError", "rank 1: scheme='ulisses' is not one of 'auto', 'ring', 'ulysses'"),
    "ulysses: heads": ("ValueError", "scheme='ulysses' cannot take this call: the 3 heads do not split evenly over "
                       "2 ranks", "pass scheme='ring'"),
    "ulysses: bias on rank 1": ("ValueError", "scheme='ulysses' cannot take this call: it takes no bias or "
                                "attn_mask, got bias (rank(s) [1])", "pass scheme='ring'"),
    "ulysses: fp16 overflow q": ("ValueError", "rank 1: query has values beyond float16's range"),
}


def test_one_hostile_rank_fails_every_rank_at_once(tmp_path):
    results = _spawn(tmp_path, "hostile")
    valid = {"valid call after the errors", "valid ulysses call after the errors"}
    assert set(EXPECTED) | valid == set(results[0])
    for name, (cls, *parts) in EXPECTED.items():
        _same_error_everywhere(results, name, cls, *parts)
    assert all(res[name] <= 2 * va.MODES["fp32"].rel_tol for res in results for name in valid)


def test_split_frames_hostile_rank_fails_every_rank(tmp_path):
    results = _spawn(tmp_path, "split_frames")
    _same_error_everywhere(results, "split: merging on rank 1", "ValueError", "split_frames: rank 1: FastVGGT token "
                           "merging")
    _same_error_everywhere(results, "split: image size", "ValueError", "split_frames: rank 1: image size 41x56")
    _same_error_everywhere(results, "split: images 3-dim", "ValueError", "split_frames: rank 1: images must be")
    _same_error_everywhere(results, "split: no frames", "ValueError", "split_frames: rank 1: no frames")
    _same_error_everywhere(results, "split: query points", "ValueError", "split_frames: rank 1: the track head")
    _same_error_everywhere(results, "split: batch", "ValueError", "same B, H and W", "(2, 1, 42, 56)")
    assert all(res["split: valid call after the errors"][0] == "none" for res in results)


@pytest.mark.parametrize("where", ["before the call", "in the ring", "in the backward", "in the ulysses all-to-all",
                                   "in the ulysses backward"])
def test_a_dead_rank_leaves_no_rank_hanging(tmp_path, where):
    """gloo reports the closed connection at once: rank 0 raises a RuntimeError naming the step, not gloo's bare
    message, well before the group's timeout."""
    cls, msg, seconds = _spawn(tmp_path, f"die:{where}")[0][where]
    assert cls == "RuntimeError" and seconds < GROUP_TIMEOUT_S / 2, (cls, msg, seconds)
    step = {"before the call": "context_parallel_attention: the exchange between the ranks failed",
            "in the ring": "context_parallel_attention: ring step 1 of 2 on rank 0: a transfer with rank 1 failed",
            "in the backward": "context_parallel_attention: backward ring step 1 of 2 on rank 0: a transfer with "
                               "rank 1 failed",
            "in the ulysses all-to-all": "context_parallel_attention: ulysses all-to-all of q, k, v on rank 0: it "
                                         "failed (a rank died",
            "in the ulysses backward": "context_parallel_attention: ulysses all-to-all of the output, backward on "
                                       "rank 0: it failed (a rank died"}[where]
    assert msg.startswith(step), msg


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL, one per rank)")
def test_nccl_hostile_rank_fails_every_rank(tmp_path):
    results = _spawn(tmp_path, "nccl")
    for name, (cls, *parts) in EXPECTED.items():
        if name in results[0]:
            _same_error_everywhere(results, name, cls, *parts)
    _same_error_everywhere(results, "device: CPU shard", "ValueError", "rank 1: query is on cpu; the NCCL group runs "
                           "on this rank's current CUDA device cuda:1")
    assert all(res["valid call after the errors"] <= 2 * va.MODES["fp32"].rel_tol for res in results)
