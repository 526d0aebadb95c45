"""The op layer: custom ops (opcheck), cached launch plans, and the inputs the public functions refuse.

Kernels run in the Triton interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` without a GPU).
"""
import pytest
import torch

import visionattn as va
from visionattn import ops  # noqa: F401  (registers the custom ops)
from visionattn.kernels import elsa_fwd, pasa_fwd
from visionattn.kernels._launch import PlanCache
from visionattn.metrics import rel_l2
from visionattn.modes import get_mode
from visionattn.reference import oracle_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(B=1, H=2, Nq=17, Nk=33, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g).to(DEV, dtype) for n in (Nq, Nk, Nk))


# ----------------------------------------------------------------------------- opcheck
def test_every_custom_op_passes_opcheck():
    """Schema, fake (meta) implementation and dispatcher of each op: dense, dense with LSE, PASA, window."""
    q, k, v = _qkv()
    mask = (torch.rand(17, 33) > 0.3).to(DEV).expand(1, 2, 17, 33)
    bias = torch.randn(2, 17, 33, device=DEV).expand(1, 2, 17, 33)
    checks = ("test_schema", "test_faketensor")
    for op in (torch.ops.visionattn.attention.default, torch.ops.visionattn.attention_lse.default):
        torch.library.opcheck(op, (q, k, v, bias, mask, False, 0.25, "fp32", 0, None), test_utils=checks)
    qh, kh, vh = (t.half() for t in (q, k, v))
    torch.library.opcheck(torch.ops.visionattn.pasa_attention.default,
                          (qh, kh, vh, None, mask, False, 0.25, True, torch.float32), test_utils=checks)
    qw, kw, vw = _qkv(B=8, H=2, Nq=16, Nk=16, D=16)
    rpb = torch.randn(2, 16, 16, device=DEV)
    shift = torch.zeros(4, 16, 16, device=DEV)
    shift[:, :, 8:] = -100.0
    torch.library.opcheck(torch.ops.visionattn.window_attention.default,
                          (qw, kw, vw, rpb, shift, None, 4, False, 0.25, "fp32"), test_utils=checks)
    ls = torch.full((2,), 2.3, device=DEV)
    torch.library.opcheck(torch.ops.visionattn.window_attention.default,
                          (qw, kw, vw, rpb, None, ls, 4, True, 0.25, "fp16"), test_utils=checks)


def test_the_ops_compute_what_the_public_functions_compute():
    """The custom op (what torch.compile sees) and the eager path give the same output, bit for bit."""
    q, k, v = _qkv(seed=3)
    eager = va.attention(q, k, v, mode="fp32", backend="triton")
    op = torch.ops.visionattn.attention(q, k, v, None, None, False, 16 ** -0.5, "fp32", 0, torch.float32)
    assert torch.equal(eager, op)
    out, lse = torch.ops.visionattn.attention_lse(q, k, v, None, None, False, 16 ** -0.5, "fp32", 0, None)
    assert torch.equal(out, eager)
    ref = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * 16 ** -0.5, dim=-1)
    assert (lse.double() - ref).abs().max() <= 1e-5


# ----------------------------------------------------------------------------- plan cache
def test_the_plan_is_built_once_per_key_and_rebuilt_when_the_key_changes(monkeypatch):
    """Second call with the same signature: the public call's runner is found (no validation, no new plan). A new
    stride pattern, dtype, length or mode: a new runner and a new launch plan. Outputs stay equal to the oracle
    throughout, the default scale included after a call that passed its own."""
    calls, plans = PlanCache(), PlanCache()
    monkeypatch.setattr(va.api, "CALLS", calls)
    monkeypatch.setattr(elsa_fwd, "PLANS", plans)
    q, k, v = _qkv()

    def call(q, k, v, mode="fp32", scale=None):
        y = va.attention(q, k, v, mode=mode, backend="triton", scale=scale)
        assert rel_l2(y, oracle_attention(q, k, v, scale=scale)) <= get_mode(mode).rel_tol
        return y

    call(q, k, v, scale=0.3)
    assert (calls.builds, calls.hits, plans.builds) == (1, 0, 1)
    q2, k2, v2 = _qkv(seed=1)  # new tensors, same signature
    call(q2, k2, v2)
    assert (calls.builds, calls.hits, plans.builds, plans.hits) == (1, 1, 1, 0)
    qt = torch.randn(1, 17, 2, 16, device=DEV).transpose(1, 2)  # same shape, other strides
    call(qt, k, v)
    assert (calls.builds, plans.builds) == (2, 2)
    call(*_qkv(Nk=300))  # another length (and length bucket of the tile configs)
    assert (calls.builds, plans.builds) == (3, 3)
    call(q.half(), k.half(), v.half(), mode="fp16")  # another dtype and mode
    assert (calls.builds, plans.builds) == (4, 4)
    call(q, k, v, mode="fp16")  # FP32 inputs cast to the mode, FP32 output written by the kernel: a new plan
    assert (calls.builds, plans.builds) == (5, 5)
    call(q2, k2, v2)
    assert (calls.builds, calls.hits) == (5, 2)
    with torch.no_grad():  # nothing needs a gradient either way: the same runner
        call(q2, k2, v2)
    assert (calls.builds, calls.hits) == (5, 3)
    qg = q2.clone().requires_grad_(True)  # a call that needs gradients gets a runner of its own: the autograd path
    y = va.attention(qg, k2, v2, backend="triton")
    assert y.grad_fn is not None and (calls.builds, calls.hits) == (6, 3)
    qg2 = q.clone().requires_grad_(True)
    y2 = va.attention(qg2, k, v, backend="triton")
    assert y2.grad_fn is not None and (calls.builds, calls.hits) == (6, 4)
    do = torch.randn_like(y2)
    (dq,) = torch.autograd.grad(y2, qg2, do)
    q64 = q.double().requires_grad_(True)
    (dq_ref,) = torch.autograd.grad(oracle_attention(q64, k.double(), v.double()), q64, do.double())
    assert rel_l2(dq, dq_ref) <= 1e-5


def test_entries_a_cuda_graph_captured_are_never_dropped(monkeypatch):
    """A cache whose plans hold device tables (graph_safe) keeps every entry found or stored while a CUDA graph is
    captured through its evictions (the graph reads those tables at every replay); other entries go oldest first,
    as in a cache without graph safety."""
    from visionattn.kernels import _launch

    capturing = [False]
    monkeypatch.setattr(_launch, "graph_capturing", lambda: capturing[0])
    safe, plain = PlanCache(max_size=4, graph_safe=True), PlanCache(max_size=4)
    for cache in (safe, plain):
        for i in range(3):
            cache.put(i, f"plan {i}")
        capturing[0] = True
        cache.get(0)  # a capture launches with plan 0
        cache.put("captured", "built during the capture")
        capturing[0] = False
        for i in range(3, 12):
            cache.put(i, f"plan {i}")
    assert {0, "captured"} <= set(safe.plans) and safe.pinned == {0, "captured"}
    assert 0 not in plain.plans and "captured" not in plain.plans and not plain.pinned
    assert len(safe.plans) <= 4 + len(safe.pinned) and len(plain.plans) <= 4
    safe.clear()
    assert not safe.plans and not safe.pinned


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_the_eager_backward_reuses_its_plan_through_the_forwards(monkeypatch, mode):
    """An eager training call finds its backward plan through the forward plan: built once, hit on the next call,
    rebuilt for another output-gradient layout or bias shape; the gradients are the same bits as
    :func:`elsa_backward`'s, which validates and keys every tensor, and they match the float64 oracle."""
    from visionattn.kernels import elsa_bwd

    after = PlanCache()
    monkeypatch.setattr(elsa_bwd, "AFTER_FORWARD", after)
    dtype = get_mode(mode).compute_dtype
    q, k, v = (t.to(dtype) for t in _qkv(B=2, Nq=20, Nk=40))
    bias = torch.randn(2, 20, 40, device=DEV)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]

    def grads(do, b=None):
        b = leaves[3] if b is None else b
        y = va.attention(*leaves[:3], bias=b, mode=mode, backend="triton")
        return torch.autograd.grad(y, leaves[:3] + [b], do)

    do = torch.randn(2, 2, 20, 16, device=DEV).to(dtype)
    first = grads(do)
    assert (after.builds, after.hits) == (1, 0)
    again = grads(do)
    assert (after.builds, after.hits) == (1, 1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    grads(do.transpose(1, 2).contiguous().transpose(1, 2))  # other output-gradient strides: a new plan
    assert after.builds == 2
    grads(do.transpose(2, 3).contiguous().transpose(2, 3))  # a non-unit last stride: laid out, the first plan
    assert after.builds == 2
    b4 = leaves[3].detach()[None].clone().requires_grad_(True)  # [1, H, Nq, Nk]: its gradient keeps that shape
    g4 = grads(do, b4)
    assert after.builds == 3 and g4[3].shape == (1, 2, 20, 40)
    assert torch.equal(g4[3][0], first[3])
    y, lse = elsa_fwd.dense_forward(q, k, v, bias.expand(2, 2, 20, 40), None, False, 0.25, mode, with_lse=True)
    direct = elsa_bwd.elsa_backward(q, k, v, y, do, lse, bias, None, False, 0.25, mode, bias_requires_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(first, direct))
    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v, bias)]
    ref = torch.autograd.grad(oracle_attention(*leaves64[:3], bias=leaves64[3]), leaves64, do.double())
    tol = 1e-5 if mode == "fp32" else 2e-2
    assert all(rel_l2(a.double(), r) <= tol for a, r in zip(first, ref))


def test_training_calls_launch_from_the_forward_plan_their_runner_keeps(monkeypatch):
    """The runner of a training signature keeps the forward plan it found on its first call: later calls launch
    from it without looking the plan key up again, with the same outputs and gradients bit for bit."""
    plans = PlanCache()
    monkeypatch.setattr(elsa_fwd, "PLANS", plans)
    monkeypatch.setattr(va.api, "CALLS", PlanCache())
    q, k, v = _qkv(B=2, Nq=20, Nk=40)
    do = torch.randn(2, 2, 20, 16, device=DEV)

    def step():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        y = va.attention(*leaves, mode="fp32", backend="triton")
        return (y, *torch.autograd.grad(y, leaves, do))

    first = step()  # validates, builds the plan and the signature's runner
    second = step()  # the runner: finds the plan once and keeps it
    assert (plans.builds, plans.hits) == (1, 1)
    third = step()  # from the kept plan: no lookup
    assert (plans.builds, plans.hits) == (1, 1)
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("nq,nk", [(0, 5), (4, 0)])
def test_the_eager_backward_of_an_empty_call_gives_zero_gradients(nq, nk):
    """No queries or no keys: the backward after the forward launches nothing and hands back zeros in each
    input's shape, the bias's included."""
    leaves = [t.requires_grad_(True) for t in _qkv(Nq=nq, Nk=nk)] + [torch.randn(2, nq, nk, device=DEV,
                                                                                 requires_grad=True)]
    y = va.attention(*leaves[:3], bias=leaves[3], backend="triton")
    grads = torch.autograd.grad(y.sum(), leaves, allow_unused=True)
    for g, t in zip(grads, leaves):
        assert g.shape == t.shape and not g.any()


def test_a_bias_that_needs_a_gradient_is_never_served_by_a_no_grad_runner(monkeypatch):
    """The runner a call under ``torch.no_grad()`` leaves behind does not serve the same signature once gradients
    are on: a bias that requires grad (and nothing else does) still gets its gradient, in its own shape."""
    monkeypatch.setattr(va.api, "CALLS", PlanCache())
    q, k, v = _qkv()
    bias = torch.randn(2, 17, 33, device=DEV, requires_grad=True)
    with torch.no_grad():
        va.attention(q, k, v, bias=bias, backend="triton")
    y = va.attention(q, k, v, bias=bias, backend="triton")
    assert y.grad_fn is not None
    do = torch.randn_like(y)
    (db,) = torch.autograd.grad(y, bias, do)
    b64 = bias.detach().double().requires_grad_(True)
    (db_ref,) = torch.autograd.grad(oracle_attention(q.double(), k.double(), v.double(), bias=b64), b64, do.double())
    assert db.shape == bias.shape and rel_l2(db, db_ref) <= 1e-5


def test_a_cached_signature_still_refuses_bad_flags(monkeypatch):
    """The runner of a validated signature is not taken for a call whose flags are bad."""
    q, k, v = _qkv()
    va.attention(q, k, v, backend="triton")
    for kwargs in ({"is_causal": 1}, {"is_causal": "no"}, {"scale": "0.5"}, {"num_splits": True}):
        with pytest.raises((TypeError, ValueError)):
            va.attention(q, k, v, backend="triton", **kwargs)
    with pytest.raises(ValueError, match="finite"):
        va.attention(q, k, v, backend="triton", scale=float("inf"))


def test_a_reused_plan_never_reads_a_misaligned_pointer_as_aligned(monkeypatch):
    """Triton specialises pointers on 16-byte alignment: a view starting mid-row is another plan."""
    cache = PlanCache()
    monkeypatch.setattr(elsa_fwd, "PLANS", cache)
    monkeypatch.setattr(va.api, "CALLS", PlanCache())
    base = torch.randn(1, 2, 18, 16, device=DEV)
    q_aligned, q_shifted = base[:, :, :17], base.flatten()[1:].view(-1)[: 1 * 2 * 17 * 16].view(1, 2, 17, 16)
    _, k, v = _qkv()
    for q in (q_aligned, q_shifted):
        y = va.attention(q, k, v, backend="triton")
        assert rel_l2(y, oracle_attention(q, k, v)) <= 2e-6
    assert cache.builds == 2


# ----------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("bad", ["no", 1, None, torch.tensor(True)])
def test_is_causal_must_be_a_bool(bad):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        va.attention(q, k, v, is_causal=bad)


@pytest.mark.parametrize("bad", ["0.5", "abc", torch.tensor([0.5, 0.5]), 1j])
def test_scale_must_be_a_real_number(bad):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="scale must be a real number"):
        va.attention(q, k, v, scale=bad)
    with pytest.raises(TypeError, match="scale must be a real number"):
        va.window_attention(q, q, q, num_windows=1, scale=bad)


def test_scale_accepts_numbers_and_one_element_tensors():
    q, k, v = _qkv()
    ref = va.attention(q, k, v, scale=0.3)
    assert torch.equal(va.attention(q, k, v, scale=torch.tensor(0.3)), ref)
    with pytest.raises(ValueError, match="finite"):
        va.attention(q, k, v, scale=float("nan"))


def test_head_dim_zero_is_a_value_error():
    q = torch.randn(1, 1, 4, 0)
    with pytest.raises(ValueError, match="head_dim 0"):
        va.attention(q, q, q)


@pytest.mark.parametrize("mode", ["fp16", "pasa"])
def test_fp32_inputs_beyond_the_fp16_range_raise_in_fp16_modes(mode):
    """Casting 1e5 to float16 gives inf and an all-NaN output; the call names the range and the fix instead."""
    q, k, v = _qkv()
    q = q.clone()
    q[0, 0, 0, 0] = 1e5
    with pytest.raises(ValueError, match=r"float16's range.*'fp32', 'tf32' or 'bf16'"):
        va.attention(q, k, v, mode=mode, backend="triton")
    assert torch.isfinite(va.attention(q, k, v, mode="bf16", backend="triton")).all()


def test_window_attention_with_only_key_requiring_grad_is_differentiable():
    """A gradient for k alone must not be dropped by a forward-only path: it comes from the backward kernel and
    matches the float64 oracle."""
    q, k, v = _qkv(B=4, Nq=16, Nk=16)
    k = k.clone().requires_grad_(True)
    y = va.window_attention(q, k, v, num_windows=2, mode="fp32", backend="triton")
    assert y.grad_fn is not None
    g = torch.randn_like(y)
    (dk,) = torch.autograd.grad(y, (k,), g)
    kd = k.detach().double().requires_grad_(True)
    ref = va.window_attention(q.double(), kd, v.double(), num_windows=2, backend="reference")
    (dk_ref,) = torch.autograd.grad(ref, (kd,), g.double())
    assert rel_l2(dk, dk_ref) <= 1e-5


def test_dense_training_compiles_with_the_backward_as_an_op():
    """torch.compile (AOT autograd) of a training call: the backward graph holds the backward op, not the
    kernels' data pointers; gradients equal the eager ones."""
    q, k, v = (t.clone().requires_grad_(True) for t in _qkv(seed=7))
    bias = torch.randn(2, 17, 33, device=DEV, requires_grad=True)

    def f(q, k, v, bias):
        return va.attention(q, k, v, bias=bias, backend="triton").square().sum()

    eager = torch.autograd.grad(f(q, k, v, bias), (q, k, v, bias))
    compiled = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, bias),
                                   (q, k, v, bias))
    for a, b in zip(eager, compiled):
        assert a.shape == b.shape and rel_l2(b, a) <= 1e-6


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa"])
def test_later_calls_launch_the_compiled_kernel_directly_with_the_same_result(monkeypatch, mode):
    """After the first call of a signature (Triton's JIT path) the plan launches the compiled kernel directly;
    outputs are bit-identical across calls and match the oracle, also for fresh inputs of the same signature
    and for a bias / mask call."""
    cache, pcache = PlanCache(), PlanCache()
    monkeypatch.setattr(elsa_fwd, "PLANS", cache)
    monkeypatch.setattr(pasa_fwd, "PLANS", pcache)
    monkeypatch.setattr(va.api, "CALLS", PlanCache())
    for B, H, N, D in ((64, 12, 197, 64), (1, 8, 1025, 128), (2, 3, 77, 40)):
        q, k, v = (torch.randn(B, H, N, D, device="cuda") for _ in range(3))
        outs = [va.attention(q, k, v, mode=mode) for _ in range(3)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
        q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
        y = va.attention(q2, k2, v2, mode=mode)
        rows = slice(0, 32)
        assert rel_l2(y[:, :, rows], oracle_attention(q2[:, :, rows], k2, v2)) <= get_mode(mode).rel_tol
    bias = torch.randn(H, N, N, device="cuda")
    mask = torch.rand(N, N, device="cuda") > 0.2
    for _ in range(2):
        y = va.attention(q, k, v, bias=bias, attn_mask=mask, mode=mode)
    assert rel_l2(y, oracle_attention(q, k, v, bias=bias, attn_mask=mask)) <= get_mode(mode).rel_tol
    plans = list((pcache if mode == "pasa" else cache).plans.values())
    calls = [p.main for p in plans if hasattr(p, "main")]
    assert calls and all(c._fast is not None for c in calls)


@pytest.mark.gpu
def test_fullgraph_compile_of_patched_vit_and_swin_blocks():
    """torch.compile(fullgraph=True) traces a patched timm ViT block and Swin block without graph breaks (the ops
    are opaque custom ops), and the compiled output equals the eager patched output."""
    timm = pytest.importorskip("timm")
    from timm.models.swin_transformer import SwinTransformerBlock

    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False).blocks[0].cuda().eval()
    swin = SwinTransformerBlock(128, (56, 56), num_heads=4, window_size=7, shift_size=3).cuda().eval()
    for block, x in ((vit, torch.randn(8, 197, 768, device="cuda")),
                     (swin, torch.randn(8, 56, 56, 128, device="cuda"))):
        va.patch_model(block, mode="fp32")
        with torch.no_grad():
            eager = block(x)
            compiled = torch.compile(block, fullgraph=True)(x)
        assert rel_l2(compiled, eager) <= 1e-5


def test_warmup_checks_its_arguments_and_needs_a_gpu(capsys):
    from visionattn import warmup

    with pytest.raises(SystemExit) as exc:
        warmup.main(["--modes", "fp33"])
    assert exc.value.code == 2 and "fp33" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        warmup.main(["--head-dims", "0"])
    with pytest.raises(ValueError, match="mode"):
        warmup.warm_up(modes=("fp33",))
    with pytest.raises(SystemExit):
        warmup.main(["--jobs", "0"])
    if not torch.cuda.is_available():
        assert warmup.main(["--modes", "fp32"]) == 2
        assert warmup.main(["--modes", "fp32", "--jobs", "4"]) == 2  # refused before any process starts
        with pytest.raises(RuntimeError, match="CUDA"):
            warmup.warm_up(modes=("fp32",), device="cpu")


def test_warmup_jobs_cover_every_part_once():
    """``--jobs``: one process per (mode, head dim) for the dense kernels and one per mode for the window kernels,
    each a valid command line of the tool carrying the lengths, device and --training."""
    from visionattn import warmup

    jobs = warmup.job_arguments(("fp32", "bf16"), (64, 128), (197, 4096), training=True, device="cuda:1")
    parsed = [warmup.build_parser().parse_args(j) for j in jobs]
    dense = sorted((a.modes, a.head_dims) for a in parsed if not a.no_dense)
    assert dense == [("bf16", (64,)), ("bf16", (128,)), ("fp32", (64,)), ("fp32", (128,))]
    assert all(a.no_window for a in parsed if not a.no_dense)
    assert sorted(a.modes for a in parsed if a.no_dense) == ["bf16", "fp32"]
    assert all(a.training and a.lengths == (197, 4096) and a.device == "cuda:1" for a in parsed)
    only_window = warmup.job_arguments(("fp16",), (), (197,))
    assert len(only_window) == 1 and "--no-dense" in only_window[0]
    assert all("--no-dense" not in j for j in warmup.job_arguments(("fp16",), (64,), (197,), window=False))
    no_dense = warmup.job_arguments(("fp16",), (64,), (197,), dense=False)  # --no-dense: the window jobs alone
    assert len(no_dense) == 1 and "--no-dense" in no_dense[0]


def test_proxy_shapes_keep_small_calls_and_shrink_large_ones_to_unsplit_calls():
    """A proxy builds what the real call builds: same heads, head dim and (16384 or longer) length; a call with
    fewer than 1024 query tiles of 128 rows runs as it is; a larger one takes the fewest batch entries that
    keep 1024 tiles, so neither it nor the real call splits its keys on any GPU of up to 1024 SMs."""
    import math

    from visionattn import warmup

    small = [(1, 16, 100, 128), (4, 16, 1041, 64), (2, 3, 20000, 32)]  # 16, 576 and 942 tiles
    assert warmup.proxy_shapes(small) == small
    for b, h, n, d in [(100, 16, 1041, 64), (1, 16, 104100, 64), (32, 16, 1041, 64), (64, 12, 197, 64),
                       (3, 1, 70000, 16)]:
        (pb, ph, pn, pd), = warmup.proxy_shapes([(b, h, n, d)])
        tiles = lambda batch: batch * h * math.ceil(pn / 128)  # noqa: E731
        assert (ph, pd, pn) == (h, d, min(n, max(16384, 128 * math.ceil(1024 / (b * h))))) and 1 <= pb <= b
        assert tiles(pb) >= 1024 and (pb == 1 or tiles(pb - 1) < 1024)
    # VGGT's frame attention at 100 and at 32 frames builds one variant: one proxy call
    assert warmup.proxy_shapes([(100, 16, 1041, 64), (32, 16, 1041, 64)]) == [(8, 16, 1041, 64)]
    with pytest.raises(ValueError, match="must be positive"):
        warmup.proxy_shapes([(1, 16, 0, 64)])
    # an input dtype other than the mode's travels with its proxy (a kernel variant of its own)
    assert warmup.proxy_shapes([(1, 16, 100, 128, torch.float32), (1, 16, 100, 128)]) == [
        (1, 16, 100, 128, torch.float32), (1, 16, 100, 128)]
    assert warmup.proxy_shapes([(100, 16, 1041, 64, torch.float32)]) == [(8, 16, 1041, 64, torch.float32)]


def test_compile_ahead_reports_a_failed_warm_up_once_in_the_callers_thread():
    """CompileAhead runs the warm-up in a thread; a failure there (here: no GPU) becomes one RuntimeWarning and an
    ``error`` entry when the caller waits, not an exception in the caller or a silent skip."""
    import warnings

    from visionattn import warmup

    ahead = warmup.CompileAhead("fp32", [(1, 2, 17, 16)], device="cpu")
    with pytest.warns(RuntimeWarning, match="compile on the first call instead"):
        info = ahead.wait()
    assert "needs a CUDA GPU" in info["error"] and info["waited"] >= 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failure was said once: waiting again only returns it
        assert ahead.wait()["error"] == info["error"]
    with pytest.raises(ValueError, match="fp33"):  # bad arguments fail at once, not in the thread
        warmup.CompileAhead("fp33", [(1, 1, 8, 16)])
    with pytest.raises(ValueError, match="must be positive"):
        warmup.CompileAhead("fp32", [(1, 0, 8, 16)])
    with pytest.raises(ValueError, match="fp33"):
        warmup.warm_up_shapes("fp33", [(1, 1, 8, 16)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            warmup.warm_up_shapes("fp32", [(1, 1, 8, 16)], device="cpu")


def test_direct_launch_skips_only_a_scratch_free_triton_3_6_launcher_wrapper():
    """KernelCall goes to the C launcher itself only where Triton's wrapper would add nothing: the 3.4-3.6
    ``CudaLauncher.__call__(gridX, gridY, gridZ, stream, function, *args)``, no scratch, an undecorated launch."""
    from visionattn.kernels._launch import _raw_launcher

    class Launcher36:  # Triton 3.6's CudaLauncher layout
        def __init__(self, launch, scratch=0):
            self.launch, self.global_scratch_size, self.profile_scratch_size = launch, scratch, 0
            self.launch_cooperative_grid, self.launch_pdl = False, False

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            pass

    class Launcher38(Launcher36):  # later releases pass metadata and hooks by name
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                      launch_enter_hook, launch_exit_hook, *args):
            pass

    c_launch = len  # a builtin stands in for the compiled module's launch (any builtin named otherwise is refused)
    assert _raw_launcher(Launcher36(c_launch)) is None  # the builtin is not called "launch"

    def launch(*args):  # a Python function: the tensor-descriptor wrapper, which must keep running
        pass

    assert _raw_launcher(Launcher36(launch)) is None

    class Named:  # a non-Python callable named "launch", as the compiled extension's function is
        __name__ = "launch"

        def __call__(self, *args):
            pass

    named = Named()
    assert _raw_launcher(Launcher36(named)) is named
    assert _raw_launcher(Launcher36(named, scratch=256)) is None  # scratch: the wrapper allocates it
    assert _raw_launcher(Launcher38(named)) is None
