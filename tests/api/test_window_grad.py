"""Training through the window kernels: gradients of :func:`visionattn.window_attention` (q, k, v, the relative
position bias, Swin-v2's ``logit_scale``) against float64 autograd, and patched timm Swin / Swin-v2 blocks giving
the parameter gradients of the unpatched blocks.

The oracle (tests/window_oracle.py) expands bias and mask to [B*nW, H, N, N] in float64 and is differentiated by
autograd with the loss ``(out * grad_out).sum()``. Bounds as tests/kernels/test_window_bwd.py: rel L2 1e-5 for the
FP32 modes, 2x PyTorch's own autograd in the same precision (same formula in that dtype) for fp16 / bf16. CPU:
interpreter, small shapes, bf16 included (the interpreter's bf16 ``tl.dot`` is wrong, so there the window kernels
multiply bf16 operands in FP32, exactly, as the tensor cores do: the ``DOT_UPCAST`` constexpr, False on the GPU);
``gpu``: Swin-B and Swin-v2-B stage-1 sizes.
"""
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.swin_transformer_v2 import SwinTransformerV2Block

import visionattn
from visionattn.kernels import window_fwd
from visionattn.metrics import rel_l2
from visionattn.window import window_attention
from window_oracle import expanded_window_oracle

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = 1e-5
NAMES = ("dq", "dk", "dv", "dbias", "dlogit_scale")


@pytest.fixture
def lse_calls(monkeypatch):
    """A list that grows by one per forward kernel call writing the LSE (the training path)."""
    calls, real = [], window_fwd.window_forward_planned  # window_forward runs through it too

    def counting(*args, **kw):
        if kw.get("with_lse"):
            calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(window_fwd, "window_forward_planned", counting)
    return calls


def window_case(n_img, nw, h, n, d, seed=0, device=DEV, cosine=False, shift=True):
    """(qkv [B*nW, N, 3, H, D] as timm's linear output, bias [H, N, N], shift mask [nW, N, N] of 0 / -100 or
    None, logit_scale [H, 1, 1] in log(5..45), grad_out [B*nW, H, N, D])."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(n_img * nw, n, 3, h, d, generator=g, device=device)
    bias = torch.randn(h, n, n, generator=g, device=device)
    if cosine:
        bias = 16 * torch.sigmoid(bias)  # Swin-v2's CPB range
    mask = None
    if shift:
        region = torch.randint(0, 3, (nw, n), generator=g, device=device)
        mask = torch.zeros(nw, n, n, device=device).masked_fill(region[:, None] != region[:, :, None], -100.0)
    ls = torch.log(torch.rand(h, 1, 1, generator=g, device=device) * 40 + 5)
    do = torch.randn(n_img * nw, h, n, d, generator=g, device=device)
    return qkv, bias, mask, ls, do


def _leaves(qkv, bias, ls, dtype, cosine):
    return (qkv.detach().to(dtype).requires_grad_(), bias.detach().to(dtype).requires_grad_(),
            ls.detach().to(dtype).requires_grad_() if cosine else None)


def _grads(qkv, bias, ls, out, do):
    (out.double() * do.double()).sum().backward()
    dq, dk, dv = qkv.grad.permute(2, 0, 3, 1, 4).unbind(0)
    return [dq, dk, dv, bias.grad, None if ls is None else ls.grad]


def oracle_grads(qkv, bias, mask, ls, do, nw, cosine, scale):
    """float64 autograd of the expanded oracle."""
    q64, b64, ls64 = _leaves(qkv, bias, ls, torch.float64, cosine)
    q, k, v = q64.permute(2, 0, 3, 1, 4).unbind(0)
    out = expanded_window_oracle(q, k, v, b64, mask, nw, cosine, ls64, scale)
    return _grads(q64, b64, ls64, out, do)


def torch_same_precision_grads(qkv, bias, mask, ls, do, nw, cosine, scale, dtype):
    """PyTorch's own autograd of the same formula in ``dtype`` (timm's non-fused path: products, bias, mask,
    softmax and P @ V all in ``dtype``): the yardstick of the half modes."""
    qd, bd, lsd = _leaves(qkv, bias, ls, dtype, cosine)
    q, k, v = qd.permute(2, 0, 3, 1, 4).unbind(0)
    BW, H, N, _ = q.shape
    if cosine:
        s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
        s = s * torch.exp(torch.clamp(lsd, max=math.log(100)))
    else:
        s = (q * scale) @ k.transpose(-1, -2)
    s = s + bd
    if mask is not None:
        s = s + mask.to(dtype).repeat(BW // nw, 1, 1).unsqueeze(1)
    out = torch.softmax(s, -1) @ v
    return _grads(qd, bd, lsd, out, do)


def kernel_grads(qkv, bias, mask, ls, do, nw, cosine, scale, mode, dtype, bias_4d=False):
    """Gradients through ``window_attention`` on the Triton path (no fallback warning allowed)."""
    qd, bd, lsd = _leaves(qkv, bias, ls, dtype, cosine)
    q, k, v = qd.permute(2, 0, 3, 1, 4).unbind(0)  # timm's strided qkv.unbind views
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a reference fallback would warn
        out = window_attention(q, k, v, relative_position_bias=bd[None] if bias_4d else bd, shift_mask=mask,
                               num_windows=nw, cosine=cosine, logit_scale=lsd, scale=None if cosine else scale,
                               mode=mode, backend="triton")
    assert out.dtype == dtype and out.grad_fn is not None
    return _grads(qd, bd, lsd, out, do)


def check_grads(mode, dtype, qkv, bias, mask, ls, do, nw, cosine, scale=None, bias_4d=False):
    scale = qkv.shape[-1] ** -0.5 if scale is None else scale
    gold = oracle_grads(qkv, bias, mask, ls, do, nw, cosine, scale)
    got = kernel_grads(qkv, bias, mask, ls, do, nw, cosine, scale, mode, dtype, bias_4d)
    if dtype == torch.float32:
        bounds = [FP32_TOL] * 5
    else:
        same = torch_same_precision_grads(qkv, bias, mask, ls, do, nw, cosine, scale, dtype)
        bounds = [None if s is None else 2 * rel_l2(s, g) + 1e-6 for s, g in zip(same, gold)]
    errs = {}
    for name, x, g, bound in zip(NAMES, got, gold, bounds):
        if g is None:
            assert x is None, name
            continue
        assert x.shape == g.shape and x.dtype == dtype, f"{name}: {tuple(x.shape)} {x.dtype}"
        assert torch.isfinite(x).all(), f"{mode} {name}: non-finite"
        errs[name] = rel_l2(x, g)
        assert errs[name] <= bound, f"{mode} {name}: rel err {errs[name]:.3e} > {bound:.3e}"
    return errs


# ----------------------------------------------------------------------------- window_attention (CPU: interpreter)
@pytest.mark.parametrize("mode,dtype", [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_swin_v1_gradients(mode, dtype, lse_calls):
    """Swin: 49-token windows, shift mask (-100) of 3 windows over 2 images, bias [1, H, N, N] (timm's
    ``_get_rel_pos_bias()`` shape: its gradient comes back in that shape, summed over every window)."""
    qkv, bias, mask, _, do = window_case(2, 3, 2, 49, 16, seed=1)
    check_grads(mode, dtype, qkv, bias, mask, None, do, 3, cosine=False, bias_4d=True)
    assert len(lse_calls) == 1


@pytest.mark.parametrize("mode,dtype", [("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_swin_v2_gradients(mode, dtype, lse_calls):
    """Swin-v2: 64-token windows, cosine attention with per-head logit scales up to 45 (gradients through the
    L2 normalisation and ``logit_scale``), CPB-range bias, shift mask."""
    qkv, bias, mask, ls, do = window_case(2, 2, 2, 64, 16, seed=2, cosine=True)
    check_grads(mode, dtype, qkv, bias, mask, ls, do, 2, cosine=True)
    assert len(lse_calls) == 1


@pytest.mark.parametrize("mode,n,fused", [("fp16", 64, True), ("fp32", 64, False), ("fp16", 144, False)])
def test_cosine_windows_normalise_in_the_kernels_up_to_64_tokens(monkeypatch, mode, n, fused):
    """Eager cosine windows of at most 64 tokens in half modes: both kernels normalise q and k themselves (no
    separate normalisation, one autograd node for the whole call, gradients of the raw q and k and of
    ``logit_scale``); FP32 products and larger windows (the split backward) normalise first. Either way the
    gradients meet the mode's bound."""
    from visionattn.kernels import l2norm

    calls = []
    real = l2norm.l2_normalize
    monkeypatch.setattr(l2norm, "l2_normalize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    qkv, bias, mask, ls, do = window_case(1, 2, 2, n, 16, seed=5, cosine=True, shift=False)
    check_grads(mode, torch.float16 if mode == "fp16" else torch.float32, qkv, bias, None, ls, do, 2, cosine=True)
    assert (len(calls) == 0) == fused


@pytest.mark.parametrize("cosine", [False, True])
def test_second_call_runs_the_backward_found_through_the_forward_plan(monkeypatch, cosine):
    """A signature's first training call validates and builds; the second goes from the runner its first call kept
    straight to the autograd function, whose backward finds the fused plan through the forward's (no second
    validation either way), and gives bit-identical gradients on the same inputs, those of a bias passed as a
    [1, H, N, N] view and of ``logit_scale`` included."""
    import visionattn.window as window_module
    from visionattn.kernels import window_bwd
    from visionattn.kernels._launch import PlanCache

    monkeypatch.setattr(window_bwd, "AFTER_FORWARD", PlanCache())
    monkeypatch.setattr(window_module, "CALLS", PlanCache())
    qkv, bias, mask, ls, do = window_case(1, 2, 2, 49, 16, seed=6, cosine=cosine)
    runs = [kernel_grads(qkv, bias, mask, ls, do, 2, cosine, None, "fp32", torch.float32, bias_4d=not cosine)
            for _ in range(2)]
    assert (window_bwd.AFTER_FORWARD.builds, window_bwd.AFTER_FORWARD.hits) == (1, 1)
    assert (window_module.CALLS.builds, window_module.CALLS.hits) == (1, 1)
    for name, a, b in zip(NAMES, *runs):
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("n,cosine", [(49, False), (144, False), (64, True), (144, True)])
def test_bf16_windows_forward_and_backward_on_the_interpreter(n, cosine):
    """bf16 through the small (49 / 64 tokens) and tiled (144) forward kernels and the fused / split backward on the
    CPU (the interpreter's ``DOT_UPCAST`` path): the output within bf16's contract (1e-2 relative L2) of the float64
    oracle, the cosine logits' amplification by ``exp(logit_scale)`` allowed for as tests/api/test_window.py does,
    and the gradients within 2x PyTorch's own bf16 autograd."""
    qkv, bias, mask, ls, do = window_case(1, 2, 2, n, 16, seed=7, cosine=cosine)
    q, k, v = qkv.to(torch.bfloat16).permute(2, 0, 3, 1, 4).unbind(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no reference fallback
        out = window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=2, cosine=cosine,
                               logit_scale=ls if cosine else None, mode="bf16", backend="triton")
    gold = expanded_window_oracle(q, k, v, bias, mask, 2, cosine, ls, 0.25)
    amp = float(torch.exp(ls).max()) * q.shape[-1] ** 0.5 / 8 if cosine else 1.0
    assert out.dtype == torch.bfloat16 and rel_l2(out, gold) <= visionattn.MODES["bf16"].rel_tol * max(amp, 1.0)
    check_grads("bf16", torch.bfloat16, qkv, bias, mask, ls, do, 2, cosine)


def test_fp32_inputs_in_a_half_mode_get_fp32_gradients():
    """A FP32 caller of ``fp16`` (no mask): the kernels compute in FP16, the gradients come back in FP32 within
    2x PyTorch's own FP16 autograd error."""
    qkv, bias, _, ls, do = window_case(1, 2, 2, 49, 16, seed=3, cosine=True, shift=False)
    gold = oracle_grads(qkv, bias, None, ls, do, 2, True, None)
    got = kernel_grads(qkv, bias, None, ls, do, 2, True, None, "fp16", torch.float32)
    same = torch_same_precision_grads(qkv, bias, None, ls, do, 2, True, None, torch.float16)
    for name, x, g, s in zip(NAMES, got, gold, same):
        assert x.dtype == torch.float32 and rel_l2(x, g) <= 2 * rel_l2(s, g), name


def test_only_bias_and_logit_scale_need_gradients_after_a_no_grad_call():
    """q, k, v frozen, the bias and ``logit_scale`` trained: a no-grad call of the same signature first (which
    keeps a forward-only runner) must not serve the later call that needs their gradients."""
    qkv, bias, mask, ls, do = window_case(1, 2, 2, 16, 16, seed=4, cosine=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    b, lsd = bias.clone().requires_grad_(), ls.clone().requires_grad_()
    kw = dict(shift_mask=mask, num_windows=2, cosine=True, mode="fp32", backend="triton")
    with torch.no_grad():
        window_attention(q, k, v, relative_position_bias=b, logit_scale=lsd, **kw)
    out = window_attention(q, k, v, relative_position_bias=b, logit_scale=lsd, **kw)
    (out * do).sum().backward()
    gold = oracle_grads(qkv, bias, mask, ls, do, 2, True, 0.25)
    assert rel_l2(b.grad, gold[3]) <= FP32_TOL and rel_l2(lsd.grad, gold[4]) <= FP32_TOL


def test_pasa_gradients_run_the_reference_with_a_warning():
    qkv, bias, mask, _, do = window_case(1, 2, 2, 16, 16, seed=5)
    q, k, v = qkv.requires_grad_().permute(2, 0, 3, 1, 4).unbind(0)
    with pytest.warns(RuntimeWarning, match="forward-only"):
        out = window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=2, mode="pasa",
                               backend="triton")
    (out * do).sum().backward()
    assert torch.isfinite(qkv.grad).all() and qkv.grad.abs().max() > 0


def test_forward_only_calls_keep_the_kernel_without_lse():
    """The LSE is a separate plan (``with_lse`` in the key): a no-grad call after a training call of the same
    shapes builds its own forward-only plan, with the same output."""
    qkv, bias, mask, _, _ = window_case(1, 2, 2, 16, 16, seed=6)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    _, (out_lse, lse) = window_fwd.plan_for(q, k, v, bias, mask, None, 2, False, 0.25, "fp32", with_lse=True)
    plan, out = window_fwd.plan_for(q, k, v, bias, mask, None, 2, False, 0.25, "fp32")
    assert isinstance(out, torch.Tensor) and plan.lse_shape is None
    assert torch.equal(out, out_lse) and lse.shape == (2, 2, 16) and lse.dtype == torch.float32
    with pytest.raises(ValueError, match="log-sum-exp"):
        window_fwd.window_forward(q.half(), k.half(), v.half(), bias, mask, None, 2, False, 0.25, "pasa",
                                  with_lse=True)


def test_window_lse_op_opcheck():
    """``visionattn::window_attention_lse`` (schema, fake implementation, autograd registration) and
    ``visionattn::window_attention_backward`` (schema, fake implementation)."""
    from visionattn import ops

    qkv, bias, mask, ls, _ = window_case(1, 2, 2, 16, 16, seed=7, cosine=True)
    q, k, v = (t.requires_grad_() for t in qkv.clone().permute(2, 0, 3, 1, 4).unbind(0))
    hs = torch.exp(ls.reshape(2)).requires_grad_()
    args = (F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, bias.requires_grad_(), mask, ls.reshape(2), hs, 2,
            True, 1.0, "fp32")
    torch.library.opcheck(ops._window_lse_op, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out, lse = ops._window_lse_op(*(t.detach() if isinstance(t, torch.Tensor) else t for t in args))
    bwd_args = (args[0].detach(), args[1].detach(), v.detach(), bias.detach(), mask, hs.detach(), out, lse,
                torch.randn_like(out), 2, 1.0, "fp32", True, True)
    torch.library.opcheck(ops._window_bwd_op, bwd_args, test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------- patched timm blocks
def _v1_block(shift):
    torch.manual_seed(10)
    blk = SwinTransformerBlock(32, (14, 14), num_heads=2, window_size=7, shift_size=3 if shift else 0)
    with torch.no_grad():
        blk.attn.relative_position_bias_table.normal_(0, 1)
    return blk


def _v2_block(shift):
    torch.manual_seed(11)
    blk = SwinTransformerV2Block(32, (16, 16), num_heads=2, window_size=8, shift_size=4 if shift else 0)
    with torch.no_grad():
        blk.attn.logit_scale.copy_(torch.log(torch.tensor([8.0, 30.0])).view(2, 1, 1))
        blk.attn.q_bias.normal_(0, 0.5)
        blk.attn.v_bias.normal_(0, 0.5)
    return blk


def _param_grads(block, x, do):
    block.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_()
    (block(xi) * do).sum().backward()
    grads = {name: p.grad for name, p in block.named_parameters() if p.requires_grad}
    grads["input"] = xi.grad
    return grads


@pytest.mark.parametrize("family", ["v1", "v2"])
def test_patched_timm_block_gradients_equal_unpatched(family, lse_calls):
    """A shifted Swin (49-token windows) / Swin-v2 (64-token windows) block in training mode, patched with
    ``mode="fp32"``: every parameter gradient (qkv, proj, relative position bias table / CPB MLP, logit_scale,
    norms, MLP) and the input gradient equal the unpatched block's (rel L2 <= 1e-5)."""
    blk = _v1_block(True) if family == "v1" else _v2_block(True)
    size = 14 if family == "v1" else 16
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, size, size, 32, generator=g)
    do = torch.randn(2, size, size, 32, generator=g)
    gold = _param_grads(blk.train(), x, do)
    patched = visionattn.patch_model(copy.deepcopy(blk), mode="fp32", backend="triton")
    assert patched.visionattn_report.num_patched == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no reference fallback
        got = _param_grads(patched.train(), x, do)
    assert len(lse_calls) == 1  # the kernels ran (a reference fallback warns only once per process)
    assert got.keys() == gold.keys()
    for name in gold:
        assert got[name] is not None, name
        assert rel_l2(got[name], gold[name]) <= FP32_TOL, f"{name}: {rel_l2(got[name], gold[name]):.3e}"


def test_compiled_patched_swin_v2_block_trains_like_eager():
    """``torch.compile(fullgraph=True)`` (AOT autograd, eager backend: no C++ toolchain needed) of a patched Swin-v2
    block: ``visionattn::window_attention_lse`` and its backward op trace as opaque nodes, and the parameter
    gradients equal the eager patched block's within the FP32 bound (compiled, q and k are normalised by
    PyTorch's ``F.normalize``; eagerly by the row-normalisation kernel, which rounds differently)."""
    torch._dynamo.reset()
    blk = visionattn.patch_model(_v2_block(True).train(), mode="fp32", backend="triton")
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 16, 16, 32, generator=g)
    do = torch.randn(2, 16, 16, 32, generator=g)
    eager = _param_grads(blk, x, do)
    blk.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    (torch.compile(blk, backend="aot_eager", fullgraph=True)(xi) * do).sum().backward()
    for name, p in blk.named_parameters():
        assert rel_l2(p.grad, eager[name]) <= FP32_TOL, name
    assert rel_l2(xi.grad, eager["input"]) <= FP32_TOL


# ----------------------------------------------------------------------------- GPU (real sizes)
GPU_MODES = [("fp32", torch.float32), ("fp32-ieee", torch.float32), ("fp16", torch.float16),
             ("bf16", torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,dtype", GPU_MODES)
def test_gpu_swin_b_stage1_gradients(mode, dtype):
    """Swin-B stage 1: 7x7 windows (49 tokens), 64 windows per image (56x56), 4 heads, D = 32, shift mask,
    16 images."""
    qkv, bias, mask, _, do = window_case(16, 64, 4, 49, 32, seed=20, device="cuda")
    check_grads(mode, dtype, qkv, bias, mask, None, do, 64, cosine=False, bias_4d=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,dtype", GPU_MODES)
def test_gpu_swin_v2_b_stage1_gradients(mode, dtype):
    """Swin-v2-B stage 1 at 256 px: 16x16 windows (256 tokens, the tiled kernel), 16 windows per image (64x64),
    4 heads, D = 32, cosine, shift mask, 8 images."""
    qkv, bias, mask, ls, do = window_case(8, 16, 4, 256, 32, seed=21, device="cuda", cosine=True)
    check_grads(mode, dtype, qkv, bias, mask, ls, do, 16, cosine=True)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["v1", "v2"])
def test_gpu_patched_stage1_block_gradients(family, lse_calls):
    """Full-size stage-1 blocks (Swin-B: dim 128, 56x56, window 7; Swin-v2-B: dim 128, 64x64, window 16),
    shifted, fp32: parameter gradients within 1e-5 of a float64 copy of the block, or within 2x the unpatched
    FP32 block's own error where that is larger."""
    torch.manual_seed(30)
    if family == "v1":
        blk, size = SwinTransformerBlock(128, (56, 56), num_heads=4, window_size=7, shift_size=3), 56
    else:
        blk, size = SwinTransformerV2Block(128, (64, 64), num_heads=4, window_size=16, shift_size=8), 64
    blk = blk.cuda().train()
    g = torch.Generator(device="cuda").manual_seed(31)
    x = torch.randn(4, size, size, 128, generator=g, device="cuda")
    do = torch.randn(4, size, size, 128, generator=g, device="cuda")
    gold = _param_grads(copy.deepcopy(blk).double(), x.double(), do.double())
    timm = _param_grads(blk, x, do)
    patched = visionattn.patch_model(copy.deepcopy(blk), mode="fp32")
    got = _param_grads(patched, x, do)
    assert len(lse_calls) == 1
    for name in gold:
        bound = max(FP32_TOL, 2 * rel_l2(timm[name], gold[name]))
        assert rel_l2(got[name], gold[name]) <= bound, f"{name}: {rel_l2(got[name], gold[name]):.3e} > {bound:.3e}"
