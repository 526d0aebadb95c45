"""Triton window attention kernels: interpreter tests at small shapes (CPU CI) and real Swin sizes on a GPU.

The oracle expands bias and mask explicitly to [B*nW, H, N, N] in float64 (independent of the kernel
and of visionattn.window's reference); tolerances are the modes' contracts (visionattn.modes).
"""
import copy
import math

import pytest
import torch

import visionattn
from visionattn.kernels import window_fwd
from visionattn.kernels.window_fwd import get_config, window_attention_fwd
from visionattn.metrics import rel_l2
from visionattn.modes import get_mode
from visionattn.window import window_attention
from window_oracle import expanded_window_oracle

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(n_img, nw, h, n, d, dtype=torch.float32, seed=0, mask_fill=-100.0, device=DEV, mean=0.0):
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(n_img * nw, n, 3, h, d, generator=g, device=device) + mean
    q, k, v = qkv.to(dtype).permute(2, 0, 3, 1, 4).unbind(0)  # timm's strided views
    bias = torch.randn(n, n, h, generator=g, device=device).permute(2, 0, 1)  # non-contiguous [H, N, N]
    region = torch.randint(0, 3, (nw, n), generator=g, device=device)
    mask = torch.zeros(nw, n, n, device=device).masked_fill(region[:, None] != region[:, :, None], mask_fill)
    ls = torch.log(torch.rand(h, 1, 1, generator=g, device=device) * 40 + 5)
    return q, k, v, bias, mask, ls


def _tol(mode, cosine, ls, d):
    # cosine logits are amplified by exp(logit_scale): half-precision input rounding grows with it
    md = get_mode(mode)
    if cosine and md.compute_dtype != torch.float32:
        return md.rel_tol * max(1.0, float(torch.exp(ls).max()) * d ** 0.5 / 8)
    return md.rel_tol


# ----------------------------------------------------------------------------- interpreter (CPU) and GPU
@pytest.mark.parametrize("n", [49, 64])
@pytest.mark.parametrize("cosine", [False, True])
@pytest.mark.parametrize("mode", ["fp32", "fp16", "pasa"])
def test_small_kernel_matches_oracle(n, cosine, mode):
    q, k, v, bias, mask, ls = inputs(2, 3, 2, n, 32, seed=n)
    out = window_attention_fwd(q, k, v, bias, mask, 3, cosine, ls if cosine else None, 32 ** -0.5, mode,
                               config={"kernel": "small", "imgs": 2, "num_warps": 4, "num_stages": 1})
    gold = expanded_window_oracle(q, k, v, bias, mask, 3, cosine, ls, 32 ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_l2(out, gold) <= _tol(mode, cosine, ls, 32)


@pytest.mark.parametrize("cosine", [False, True])
@pytest.mark.parametrize("mode", ["fp32", "fp16", "pasa"])
def test_tiled_kernel_folds_key_blocks(cosine, mode):
    # N=49 with 16x16 blocks: 4 key blocks per row, last one partial -> the (m, S, W) merge is exercised.
    q, k, v, bias, mask, ls = inputs(2, 2, 2, 49, 16, seed=7, mask_fill=float("-inf"))
    out = window_attention_fwd(q, k, v, bias, mask, 2, cosine, ls if cosine else None, 0.3, mode,
                               config={"kernel": "tiled", "block_m": 16, "block_n": 16, "num_warps": 4,
                                       "num_stages": 1})
    gold = expanded_window_oracle(q, k, v, bias, mask, 2, cosine, ls, 0.3)
    assert rel_l2(out, gold) <= _tol(mode, cosine, ls, 16)


def test_no_bias_no_mask_head_dim_not_power_of_two_and_dv_differs():
    g = torch.Generator(device=DEV).manual_seed(3)
    q, k = (torch.randn(4, 2, 49, 20, generator=g, device=DEV) for _ in range(2))
    v = torch.randn(4, 2, 49, 24, generator=g, device=DEV)
    out = window_attention(q, k, v, num_windows=1, backend="triton")
    assert rel_l2(out, expanded_window_oracle(q, k, v, None, None, 1, scale=20 ** -0.5)) <= 2e-6


def test_fully_masked_row_is_zero_and_output_layout_makes_timm_reshape_free():
    q, k, v, bias, mask, _ = inputs(2, 2, 2, 49, 16, seed=9, mask_fill=float("-inf"))
    mask[1, 4, :] = float("-inf")
    out = window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=2, backend="triton")
    assert torch.isfinite(out).all()
    assert out[1::2, :, 4].abs().max() == 0 and out[0::2, :, 4].abs().max() > 0
    flat = out.transpose(1, 2).reshape(out.shape[0], 49, -1)
    assert flat.data_ptr() == out.data_ptr() and flat.is_contiguous()


def test_pasa_stays_finite_where_fp16_score_accumulation_overflows():
    # keys with a large common offset (PASA paper Sec. 4: large mean): q.k exceeds the FP16 range
    q, k, v, bias, mask, _ = inputs(1, 2, 2, 49, 32, seed=11)
    k = k + 120.0
    q = q + 20.0
    cfg = {"kernel": "small", "imgs": 1, "num_warps": 4, "num_stages": 1}
    args = (bias, mask, 2, False, None, 1.0)
    base = window_attention_fwd(q, k, v, *args, "fp16-acc16", config=cfg)
    pasa = window_attention_fwd(q, k, v, *args, "pasa", config=cfg)
    fp16 = window_attention_fwd(q, k, v, *args, "fp16", config=cfg)
    # same input rounding as the modes
    gold = expanded_window_oracle(q.half(), k.half(), v.half(), bias, mask, 2, scale=1.0)
    assert not torch.isfinite(base).all()
    assert torch.isfinite(pasa).all()
    assert rel_l2(pasa, gold) <= 2 * rel_l2(fp16, gold) + get_mode("pasa").rel_tol


def test_get_config_uses_small_kernel_for_swin_windows_and_tiles_large_ones():
    dev = torch.device("cpu")
    for mode in ("fp16", "fp32"):
        assert get_config(4096, 4, 49, 32, 64, dev, mode=mode)["kernel"] == "small"
        assert get_config(4096, 4, 64, 32, 64, dev, mode=mode)["kernel"] == "small"
        assert get_config(1024, 4, 144, 32, 64, dev, mode=mode)["kernel"] == "tiled"
        assert get_config(64, 4, 576, 32, 1, dev, mode=mode)["kernel"] == "tiled"
    # the image chunk is the longest that still leaves the target number of programs per SM (or the cap)
    from visionattn.kernels import window_fwd

    sms = window_fwd._num_sms(dev)
    for mode, kind in (("fp16", "half"), ("bf16", "half"), ("fp32", "fp32"), ("tf32", "fp32")):
        target = window_fwd._SMALL_PROGRAMS_PER_SM[kind] * sms
        for n_img, heads, n_slot in ((64, 4, 64), (1, 4, 64), (8, 3, 64), (128, 24, 1), (2, 6, 16)):
            imgs = get_config(n_img * n_slot, heads, 49, 32, n_slot, dev, mode=mode)["imgs"]
            programs = lambda c: heads * n_slot * -(-n_img // c)  # noqa: E731
            assert imgs == 1 or programs(imgs) >= target
            assert imgs == window_fwd._SMALL_MAX_IMGS[kind] or programs(imgs * 2) < target
    with pytest.raises(ValueError, match="mode="):
        get_config(4096, 4, 49, 32, 64, dev, mode="fp8")


# ----------------------------------------------------------------------------- split-FP16 products (fp32 / tf32)
SMALL = {"kernel": "small", "imgs": 2, "num_warps": 4, "num_stages": 1}
TILED = {"kernel": "tiled", "block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}  # 4 key blocks at N=49


def _run(q, k, v, bias, mask, nw, cosine, ls, mode, cfg, precision=None, scale=32 ** -0.5):
    out = window_attention_fwd(q, k, v, bias, mask, nw, cosine, ls if cosine else None, scale, mode,
                               config=cfg, precision=precision)
    return out, expanded_window_oracle(q, k, v, bias, mask, nw, cosine, ls, scale)


def test_fp32_and_tf32_modes_use_split_fp16_products():
    assert window_fwd._MODE_TABLE["fp32"][1] == get_mode("fp32").input_precision == "f16x3"
    assert window_fwd._MODE_TABLE["tf32"][1] == get_mode("tf32").input_precision == "f16x1"


@pytest.mark.parametrize("cfg", [SMALL, TILED], ids=["small", "tiled"])
@pytest.mark.parametrize("cosine", [False, True])
@pytest.mark.parametrize("extreme", [False, True], ids=["unit", "extreme"])
def test_fp32_f16x3_matches_oracle_with_bias_mask_and_extreme_scales(cfg, cosine, extreme):
    # q * 1e-20, k * 1e20, v * 1e-30: far outside FP16's range; the exact power-of-two scalings keep every
    # FP16 part in range. Cosine: q * 1e25 (sum of squares overflows FP32 unless the rows are prescaled) and
    # k * 1e-5 (a tiny q would hit normalize's eps = 1e-12 and give uniform attention, hiding errors).
    q, k, v, bias, mask, ls = inputs(1, 2, 2, 49, 32, seed=21, mask_fill=float("-inf"))
    if extreme:
        sq, sk = (1e25, 1e-5) if cosine else (1e-20, 1e20)
        q, k, v = q * sq, k * sk, v * 1e-30
    out, gold = _run(q, k, v, bias, mask, 2, cosine, ls, "fp32", cfg)
    assert torch.isfinite(out).all()
    assert rel_l2(out, gold) <= get_mode("fp32").rel_tol


@pytest.mark.parametrize("cfg", [SMALL, TILED], ids=["small", "tiled"])
def test_tf32_f16x1_within_contract_and_coarser_than_f16x3(cfg):
    q, k, v, bias, mask, ls = inputs(1, 2, 2, 49, 32, seed=22)
    out1, gold = _run(q, k, v, bias, mask, 2, False, ls, "tf32", cfg)
    out3, _ = _run(q, k, v, bias, mask, 2, False, ls, "fp32", cfg)
    err1, err3 = rel_l2(out1, gold), rel_l2(out3, gold)
    assert err1 <= get_mode("tf32").rel_tol
    assert err1 > 10 * err3  # hi*hi alone: 11-bit operands, so the override really selects another product


def test_tiled_running_v_exponent_rescales_across_key_blocks():
    # |v| grows by ~1e12 from the first key block to the last, and columns differ by 1e6: the running
    # per-column V exponent must rescale the accumulator when a larger block arrives.
    q, k, v, bias, mask, ls = inputs(1, 2, 2, 49, 16, seed=23)
    rows = 10.0 ** torch.linspace(-6, 6, 49, device=DEV)
    cols = 10.0 ** torch.linspace(-3, 3, 16, device=DEV)
    q = q * 0.1  # flatter softmax: small-|v| blocks still carry weight
    v = v * rows[:, None] * cols
    out, gold = _run(q, k, v, bias, mask, 2, False, ls, "fp32", TILED)
    assert rel_l2(out, gold) <= get_mode("fp32").rel_tol
    # per column too: the small columns are not swamped by the large ones
    dims = (0, 1, 2)
    colerr = torch.linalg.vector_norm(out.double() - gold, dim=dims) / torch.linalg.vector_norm(gold, dim=dims)
    assert colerr.max() <= 4 * get_mode("fp32").rel_tol


@pytest.mark.parametrize("precision", ["tf32x3", "ieee", "tf32"])
def test_precision_override_keeps_tl_dot_products(precision):
    q, k, v, bias, mask, ls = inputs(1, 2, 2, 49, 32, seed=24)
    out, gold = _run(q, k, v, bias, mask, 2, True, ls, "fp32", SMALL, precision=precision)
    assert rel_l2(out, gold) <= (get_mode("tf32") if precision == "tf32" else get_mode("fp32")).rel_tol


def test_precision_override_is_validated():
    q, k, v, bias, mask, ls = inputs(1, 2, 1, 49, 16, seed=25)
    with pytest.raises(ValueError, match="precision"):
        window_attention_fwd(q, k, v, bias, mask, 2, False, None, 0.25, "fp32", precision="bf16x9")
    with pytest.raises(ValueError, match="FP32 modes"):
        window_attention_fwd(q, k, v, bias, mask, 2, False, None, 0.25, "fp16", precision="f16x3")


# ----------------------------------------------------------------------------- per-row log-sum-exp (training)
def _logits64(q, k, bias, mask, nw, ls, scale, cosine, dtype, normalize=True):
    """float64 logits ``c q.k + bias + mask[b % nW]`` [B*nW, H, N, N] from q, k rounded to ``dtype`` as the kernel
    rounds them (cosine: normalised after the rounding, then rounded again, unless ``normalize`` is False)."""
    BW, H, N, _ = q.shape
    qd, kd = q.to(dtype).double(), k.to(dtype).double()
    if cosine:
        if normalize:
            qd, kd = (torch.nn.functional.normalize(t, dim=-1).to(dtype).double() for t in (qd, kd))
        c = torch.exp(torch.clamp(ls.double().reshape(1, H, 1, 1), max=math.log(100)))
    else:
        c = scale
    return (qd @ kd.transpose(-1, -2)) * c + bias.double() + mask.double().repeat(BW // nw, 1, 1).unsqueeze(1)


TILED32 = dict(TILED, block_m=32, block_n=32)  # 2 key blocks at N=49, the last one partial


@pytest.mark.parametrize("cfg", [SMALL, TILED32], ids=["small", "tiled"])
@pytest.mark.parametrize("cosine", [False, True])
@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "fp16"])
def test_lse_is_the_logsumexp_of_the_logits(cfg, cosine, mode):
    """``with_lse``: the natural-log log-sum-exp of each row's logits (split-FP16 scales, cosine and half inputs
    included) next to an unchanged output; -inf for a fully masked row (-inf shift mask)."""
    q, k, v, bias, mask, ls = inputs(2, 2, 2, 49, 16, seed=40, mask_fill=float("-inf"))
    mask[1, 5, :] = float("-inf")
    dtype = torch.float16 if mode == "fp16" else torch.float32
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = window_attention_fwd(q, k, v, bias, mask, 2, cosine, ls if cosine else None, 0.3, mode, config=cfg,
                                    with_lse=True)
    assert torch.equal(out, window_attention_fwd(q, k, v, bias, mask, 2, cosine, ls if cosine else None, 0.3, mode,
                                                 config=cfg))
    s = _logits64(q, k, bias, mask, 2, ls, 0.3, cosine, dtype)
    gold = torch.logsumexp(s, -1)
    assert lse.shape == (4, 2, 49) and lse.dtype == torch.float32 and lse.is_contiguous()
    dead = torch.isneginf(gold)
    assert dead.sum() == 2 * 2 and torch.isneginf(lse[dead]).all()
    # the logits' own FP32 / FP16-rounding scale: relative to the row's largest |logit|
    tol = (2e-6 if dtype == torch.float32 else 5e-4) * (1 + s.abs().masked_fill(s.isinf(), 0).amax(-1))
    assert ((lse.double() - gold).abs()[~dead] <= tol[~dead]).all()


@pytest.mark.parametrize("cfg", [SMALL, TILED32], ids=["small", "tiled"])
def test_lse_of_prenormalised_half_rows_is_that_of_the_given_rows(cfg):
    """``normalized=True`` (the training path): cosine q, k come L2-normalised in FP16 and are not normalised
    again, so the LSE is that of exactly the logits the backward recomputes from them (to FP32 rounding)."""
    q, k, v, bias, mask, ls = inputs(2, 2, 2, 49, 16, seed=41)
    q, k = (torch.nn.functional.normalize(t.half(), dim=-1) for t in (q, k))
    _, lse = window_attention_fwd(q, k, v.half(), bias, mask, 2, True, ls, 1.0, "fp16", config=cfg, with_lse=True,
                                  normalized=True)
    s = _logits64(q, k, bias, mask, 2, ls, 1.0, True, torch.float16, normalize=False)
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() <= 2e-6 * (1 + s.abs().max())


# ----------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "tf32", "fp16", "bf16", "pasa"])
@pytest.mark.parametrize("cosine", [False, True])
def test_gpu_swin_b_stage1_all_modes(mode, cosine):
    q, k, v, bias, mask, ls = inputs(64, 64, 4, 49, 32, seed=1)
    out = window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=64, cosine=cosine,
                           logit_scale=ls if cosine else None, mode=mode)
    sl = slice(0, 512)  # oracle on 8 images (512 windows) to bound memory; the kernel ran the full batch
    gold = expanded_window_oracle(q[sl], k[sl], v[sl], bias, mask, 64, cosine, ls, 32 ** -0.5)
    assert torch.isfinite(out).all()
    assert rel_l2(out[sl], gold) <= _tol(mode, cosine, ls, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("n,nw", [(64, 64), (144, 16), (256, 16), (576, 4)])
@pytest.mark.parametrize("dtype,mode", [(torch.float32, "fp32"), (torch.float16, "fp16"), (torch.float16, "pasa")])
def test_gpu_window_sizes_8_12_16_24(n, nw, dtype, mode):
    q, k, v, bias, mask, ls = inputs(4, nw, 4, n, 32, dtype=dtype, seed=n)
    for cosine in (False, True):
        out = window_attention(q, k, v, relative_position_bias=bias, shift_mask=mask, num_windows=nw,
                               cosine=cosine, logit_scale=ls if cosine else None, mode=mode)
        gold = expanded_window_oracle(q, k, v, bias, mask, nw, cosine, ls, 32 ** -0.5)
        assert out.dtype == dtype
        assert rel_l2(out, gold) <= _tol(mode, cosine, ls, 32) + (1e-3 if dtype == torch.float16 else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("n,nw", [(49, 64), (144, 16)])
@pytest.mark.parametrize("precision", ["f16x3", "tf32x3", "f16x1"])
@pytest.mark.parametrize("extreme", [False, True], ids=["unit", "extreme"])
def test_gpu_fp32_split16_products_real_size(n, nw, precision, extreme):
    # Swin-B stage 1 (small kernel) and a 12x12 window (tiled); split-FP16 vs Triton's 3xTF32 on the tensor cores
    q, k, v, bias, mask, ls = inputs(8, nw, 4, n, 32, seed=31)
    if extreme:
        q, k, v = q * 1e-20, k * 1e20, v * 1e-30
    out = window_attention_fwd(q, k, v, bias, mask, nw, False, None, 32 ** -0.5, "fp32", precision=precision)
    gold = expanded_window_oracle(q, k, v, bias, mask, nw, scale=32 ** -0.5)
    assert torch.isfinite(out).all()
    assert rel_l2(out, gold) <= get_mode("tf32" if precision == "f16x1" else "fp32").rel_tol


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["v1", "v2"])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16"])
def test_gpu_equivalence_with_timm_modules_real_size(family, shift, mode):
    from timm.models.swin_transformer import SwinTransformerBlock
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block

    torch.manual_seed(0)
    if family == "v1":  # Swin-B stage 1
        blk = SwinTransformerBlock(128, (56, 56), num_heads=4, window_size=7, shift_size=3 if shift else 0)
    else:  # Swin-v2-B (window 16) stage 1
        blk = SwinTransformerV2Block(128, (64, 64), num_heads=4, window_size=16, shift_size=8 if shift else 0)
    attn, mask = blk.attn.to(DEV).eval(), None if blk.attn_mask is None else blk.attn_mask.to(DEV)
    if family == "v1":
        with torch.no_grad():
            attn.relative_position_bias_table.normal_(0, 1)
    n = attn.relative_position_index.shape[0]
    nw = 64 if family == "v1" else 16
    x = torch.randn(8 * nw, n, 128, device=DEV)
    patched = visionattn.patch_model(copy.deepcopy(attn), mode=mode)
    assert patched.visionattn_report.num_patched == 1
    with torch.no_grad():
        gold = copy.deepcopy(attn).double()(x.double(), mask=None if mask is None else mask.double())
        ours = patched(x, mask)
    assert rel_l2(ours, gold) <= get_mode(mode).rel_tol * (4 if family == "v2" else 1)


def test_default_config_drops_stages_on_out_of_shared_memory_and_remembers(monkeypatch):
    """A default small-kernel config over the GPU's shared memory (simulated: 3 stages refused) runs with
    fewer stages, gives the oracle's answer, and later calls go straight to the config that fitted."""
    import triton.runtime.errors as terr

    from visionattn.kernels._launch import PlanCache

    q, k, v, bias, mask, _ = inputs(4, 2, 2, 49, 32, seed=31)
    monkeypatch.setattr(window_fwd, "PLANS", PlanCache())
    monkeypatch.setattr(window_fwd, "get_config", lambda *a, **kw: {"kernel": "small", "imgs": 2, "num_warps": 4,
                                                                   "num_stages": 3})
    real, stages = window_fwd._window_small_kernel, []

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, num_stages, **kw):
                stages.append(num_stages)
                if num_stages > 2:
                    raise terr.OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*args, num_stages=num_stages, **kw)
            return launch

    monkeypatch.setattr(window_fwd, "_window_small_kernel", Refusing())
    gold = expanded_window_oracle(q, k, v, bias, mask, 2, False, None, 0.2)
    for _ in range(2):
        out = window_attention_fwd(q, k, v, bias, mask, 2, False, None, 0.2, "fp16")
        assert rel_l2(out, gold) <= get_mode("fp16").rel_tol
    assert stages == [3, 2, 2]  # the second call did not try 3 stages again


def test_float64_inputs_are_refused_with_the_output_dtype_named():
    """A direct FP64 caller of the window kernel (no out_dtype argument) gets an error naming the
    output dtype and the dtypes the kernels write, not a bare reference to an argument it never passed."""
    import torch
    from visionattn.kernels._launch import heads_inner_output

    q = torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"output dtype torch.float64 .*write one of"):
        heads_inner_output(q, 4, 8, q.dtype)
