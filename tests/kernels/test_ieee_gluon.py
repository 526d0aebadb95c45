"""The Gluon fp32-ieee kernel (visionattn.kernels.ieee_gluon).

Gluon does not run under TRITON_INTERPRET=1, so on CPU the kernel is compiled offline for
sm_90 with the installed Triton (in a child process with TRITON_INTERPRET=0) and the dispatch
rules are checked; the results are checked on a GPU (``pytest -m gpu``) against the float64 oracle.
"""

import pytest
import torch

from offline_compile import compile_in_child
from visionattn.kernels import ieee_gluon

_CHILD = r"""
import json
from visionattn.kernels import ieee_gluon
from visionattn.kernels.introspect import compile_for_arch
out = {}
for d, n_k in ((64, 4096), (64, 197), (32, 4096), (128, 4096)):
    cfg = ieee_gluon.get_config(n_k, d)
    r = compile_for_arch(ieee_gluon._ieee_fwd_kernel, {n: "*fp32" for n in ("Q", "K", "V", "O", "LSE")},
                         ieee_gluon.kernel_constexprs(cfg, d), num_warps=cfg["num_warps"], num_stages=1,
                         float_args=("qk_scale",))
    out[f"{d}_{cfg['BLOCK_N']}_{cfg['BLOCK_M']}"] = {
        "shared": r.shared_bytes, "wgmma": r.wgmma, "dots": r.ttgir.count("tt.dot "), "regs": r.registers,
        "local": r.local_bytes, "programs": r.programs_per_sm}
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
@pytest.mark.skipif(ieee_gluon._IMPORT_ERROR is not None, reason="this Triton has no usable Gluon")
def test_compiles_for_hopper_as_fma_products_without_spills():
    """With the installed Triton the kernel builds for sm_90: FMA dots only (no wgmma), one per
    16-wide chunk of D (QK^T) and of the KV tile (P V), no register spills, two programs per SM."""
    r = compile_in_child(_CHILD)
    assert set(r) == {"64_64_64", "64_32_64", "32_64_64", "128_32_32"}
    for key, v in r.items():
        d, bn, bm = map(int, key.split("_"))
        assert v["wgmma"] == 0
        assert v["dots"] == 2 * (d // 16 + bn // 16)  # the loop body and the peeled tail tile
        assert v["local"] == 0 and 0 < v["regs"] <= 255
        assert v["programs"] >= 2
        assert v["shared"] == 4 * (bm * d + 2 * 2 * bn * d + bm * bn)  # Q, 2 stages of K and V, P (FP32)


def _qkv(n_q=64, n_k=64, d=64, device="cpu"):
    return (torch.randn(1, 2, n_q, d, device=device), torch.randn(1, 2, n_k, d, device=device),
            torch.randn(1, 2, n_k, d, device=device))


@pytest.mark.skipif(ieee_gluon._IMPORT_ERROR is not None, reason="this Triton has no usable Gluon")
def test_unsupported_reasons_name_the_cause():
    q, k, v = _qkv()
    reason = lambda *a, **kw: ieee_gluon.unsupported_reason(*a, **kw)  # noqa: E731
    assert "bias" in reason(q, k, v, torch.zeros(64, 64), None, False, 0.125, 0)
    assert "causal" in reason(q, k, v, None, None, True, 0.125, 0)
    assert "scale" in reason(q, k, v, None, None, False, -0.125, 0)
    q8, k8, v8 = _qkv(d=80)
    assert "head dims (80, 80)" in reason(q8, k8, v8, None, None, False, 0.125, 0)
    assert "head dims (64, 32)" in reason(q, k, v[..., :32], None, None, False, 0.125, 0)
    assert "split" in reason(q, k, v, None, None, False, 0.125, 4)
    assert "k rows" in reason(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, None, None, False, 0.125, 0)
    wide = torch.randn(1, 2, 64, 66)[..., :64]  # rows of 66 floats: not 16-byte aligned
    assert "v rows" in reason(q, k, wide, None, None, False, 0.125, 0)
    assert reason(q, k, v, None, None, False, 0.125, 1) == "tensors on cpu"  # everything else fits


def test_interpreted_fp32_ieee_calls_keep_the_triton_kernel():
    """On CPU (TRITON_INTERPRET=1) fp32-ieee runs the Triton kernel and matches the float64 oracle."""
    from visionattn.kernels.elsa_fwd import elsa_attention
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    q, k, v = _qkv(33, 70, 32)
    y = elsa_attention(q, k, v, None, None, False, 32 ** -0.5, "fp32-ieee")
    assert rel_l2(y, oracle_attention(q, k, v)) <= 2e-6


# --------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("B,H,Nq,Nk,D", [(1, 8, 4096, 4096, 64), (2, 3, 1025, 1000, 64), (3, 2, 129, 7, 32),
                                         (1, 1, 1, 1, 64), (2, 4, 300, 5000, 32), (1, 8, 2048, 2048, 128),
                                         (2, 3, 1025, 1000, 128)])
def test_matches_the_oracle_and_is_what_fp32_ieee_dispatches_to(B, H, Nq, Nk, D):
    from visionattn.kernels.elsa_fwd import TileConfig, _launch, elsa_attention
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device="cuda", generator=g) for n in (Nq, Nk, Nk))
    scale = D ** -0.5
    y = ieee_gluon.ieee_attention(q, k, v, scale)
    rows = torch.randperm(Nq, device="cuda")[:256]
    err = rel_l2(y[:, :, rows], oracle_attention(q[:, :, rows], k, v, scale=scale))
    assert torch.isfinite(y).all() and err <= 2e-6, err
    triton_y = _launch(q, k, v, None, None, False, scale, "fp32-ieee", 1, config=TileConfig(64, 64, 4, 2))
    assert rel_l2(triton_y[:, :, rows], y[:, :, rows]) <= 2e-6
    if B * H * -(-Nq // 64) >= torch.cuda.get_device_properties(0).multi_processor_count:
        assert torch.equal(elsa_attention(q, k, v, None, None, False, scale, "fp32-ieee"), y)


@pytest.mark.gpu
def test_vit_unbind_views_and_half_output():
    """timm's qkv.unbind views (strided, no copy) and a float16 output rounded once from W / S."""
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    B, N, H, D = 64, 197, 12, 64
    q, k, v = torch.randn(B, N, 3, H, D, device="cuda").permute(2, 0, 3, 1, 4).unbind(0)
    assert ieee_gluon.unsupported_reason(q, k, v, None, None, False, 0.125, 0) is None
    ref = oracle_attention(q, k, v)
    assert rel_l2(ieee_gluon.ieee_attention(q, k, v, D ** -0.5), ref) <= 2e-6
    y16 = ieee_gluon.ieee_attention(q, k, v, D ** -0.5, out_dtype=torch.float16)
    assert y16.dtype == torch.float16 and rel_l2(y16, ref) <= 1e-3
