"""The Gluon fp32-ieee backward kernel (visionattn.kernels.ieee_gluon_bwd).

Gluon does not run under TRITON_INTERPRET=1, so on CPU the kernel is compiled offline for sm_90 with the
installed Triton (in a child process with TRITON_INTERPRET=0) and the scope rules are checked; the gradients are
checked on a GPU (``pytest -m gpu``) against the float64 oracle and against the Triton IEEE kernels.
"""

import pytest
import torch

from offline_compile import compile_in_child
from visionattn.kernels import ieee_gluon_bwd

needs_gluon = pytest.mark.skipif(ieee_gluon_bwd._IMPORT_ERROR is not None, reason="this Triton has no usable Gluon")

_CHILD = r"""
import json
from visionattn.kernels import ieee_gluon_bwd as g
from visionattn.kernels.introspect import compile_for_arch
out = {}
types = {p: "*fp32" for p in ("Q", "K", "V", "DO", "Delta", "LseRow", "DK", "DV", "DQ")}
types["Sem"] = "*i32"
for d in g.HEAD_DIMS:
    cfg = g.get_config(d)
    r = compile_for_arch(g._ieee_dkdv_kernel, types, g.kernel_constexprs(cfg, d), num_warps=cfg["num_warps"],
                         num_stages=1, float_args=("scale",))
    out[d] = {"wgmma": r.wgmma, "regs": r.registers, "local": r.local_bytes, "programs": r.programs_per_sm,
              "shared": r.shared_bytes}
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
@needs_gluon
def test_compiles_for_hopper_as_fma_products_without_spills():
    """The kernel builds for sm_90 at every head dim in scope: FMA products only (no wgmma), no register spills,
    at least two programs per SM (one at head dim 128, whose 32 x 32 tiles measured faster than the two-per-SM
    ones)."""
    r = compile_in_child(_CHILD)
    assert set(r) == {str(d) for d in ieee_gluon_bwd.HEAD_DIMS}
    for key, v in r.items():
        assert v["wgmma"] == 0, key
        assert v["local"] == 0 and 0 < v["regs"] <= 255, (key, v)
        assert v["programs"] >= (1 if key == "128" else 2), (key, v)


def _qkv(n_q=64, n_k=64, d=64, device="cpu"):
    return tuple(torch.randn(1, 2, n, d, device=device) for n in (n_q, n_k, n_k, n_q))


@needs_gluon
def test_unsupported_reasons_name_the_cause():
    q, k, v, do = _qkv()
    reason = ieee_gluon_bwd.unsupported_reason
    assert "bias" in reason(q, k, v, do, torch.zeros(64, 64), None, False, 0.125)
    assert "causal" in reason(q, k, v, do, None, None, True, 0.125)
    q8, k8, v8, do8 = _qkv(d=256)
    assert "head dims (256, 256)" in reason(q8, k8, v8, do8, None, None, False, 0.125)
    assert "dtypes" in reason(q.half(), k.half(), v.half(), do, None, None, False, 0.125)
    assert reason(q, k, v, do, None, None, False, 0.125) == "tensors on cpu"  # everything else fits
    if torch.cuda.is_available():
        qc, kc, vc, doc = (t.cuda() for t in (q, k, v, do))
        assert reason(qc, kc, vc, doc, None, None, False, 0.125) is None
        assert "grad_out" in reason(qc, kc, vc, doc.half(), None, None, False, 0.125)
        assert "grad_out" in reason(qc, kc, vc, doc.transpose(-1, -2).contiguous().transpose(-1, -2), None, None,
                                    False, 0.125)


# --------------------------------------------------------------------------------------- GPU
def _oracle(q, k, v, do, scale):
    """(out, lse, dq, dk, dv) by float64 autograd."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * scale
    out = s.softmax(-1) @ v64
    grads = torch.autograd.grad(out, (q64, k64, v64), do.double())
    return out.detach(), torch.logsumexp(s.detach(), -1).float(), grads


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,Nq,Nk,D", [(1, 8, 4096, 4096, 64), (2, 3, 1025, 1000, 64), (3, 2, 129, 7, 32),
                                         (1, 1, 1, 5, 64), (2, 4, 300, 2000, 32), (64, 12, 197, 197, 64),
                                         (2, 4, 1000, 777, 128), (1, 2, 33, 4100, 128)])
def test_gradients_match_the_oracle_and_fp32_ieee_runs_them(B, H, Nq, Nk, D):
    """Gradients within the FP32 bound of the float64 oracle, bit-identical over runs (dQ added in key-tile
    order), equal to the Triton IEEE kernels' within the bound, and what ``elsa_backward(mode="fp32-ieee")``
    runs."""
    from visionattn.kernels import elsa_bwd
    from visionattn.metrics import rel_l2

    elsa_bwd.PLANS.clear()
    g = torch.Generator(device="cuda").manual_seed(Nq + Nk)
    q, k, v, do = (torch.randn(B, H, n, D, device="cuda", generator=g) for n in (Nq, Nk, Nk, Nq))
    scale = D ** -0.5
    out64, lse, gold = _oracle(q, k, v, do, scale)
    out = out64.float()
    runs = [elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, "fp32-ieee") for _ in range(3)]
    assert torch.equal(runs[0][0], runs[2][0])
    for x, y, ref in zip(runs[0][:3], runs[1][:3], gold):
        assert torch.equal(x, y)
        assert torch.isfinite(x).all() and rel_l2(x, ref) <= 1e-5, rel_l2(x, ref)
    assert any(p.dims == (B, H, Nq, Nk, D, D) and p.gluon is not None for p in elsa_bwd.PLANS.plans.values())
    triton = elsa_bwd.elsa_backward(q, k, v, out, do, lse, None, None, False, scale, "fp32-ieee",
                                    config=elsa_bwd.get_config("fp32-ieee", D))
    for x, y in zip(runs[0][:3], triton[:3]):
        assert rel_l2(x, y) <= 2e-6


@pytest.mark.gpu
def test_vit_unbind_views_through_autograd():
    """timm's qkv.unbind views (strided, no copy) through ``visionattn.attention``'s autograd: the float64
    oracle's gradients."""
    import visionattn as va
    from visionattn.metrics import rel_l2

    B, N, H, D = 8, 197, 12, 64
    qkv = torch.randn(B, N, 3, H, D, device="cuda", requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    do = torch.randn(B, H, N, D, device="cuda")
    (got,) = torch.autograd.grad(va.attention(q, k, v, mode="fp32-ieee"), qkv, do)
    qkv64 = qkv.detach().double().requires_grad_()
    q64, k64, v64 = qkv64.permute(2, 0, 3, 1, 4).unbind(0)
    (ref,) = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q64, k64, v64), qkv64,
                                 do.double())
    assert rel_l2(got, ref) <= 1e-5


@pytest.mark.gpu
def test_a_gluon_build_failure_warns_once_and_trains_on_the_triton_kernels(monkeypatch):
    """A Triton whose Gluon cannot build the backward kernels (simulated: the first launch raises) keeps the
    gradients right through the Triton IEEE kernels, warns once naming the cause, and plans no Gluon launch
    afterwards."""
    from visionattn.kernels import elsa_bwd, elsa_fwd
    from visionattn.metrics import rel_l2

    def failing(*args, **kwargs):
        def launch(*a):
            raise RuntimeError("simulated Gluon build failure")
        return launch

    monkeypatch.setattr(ieee_gluon_bwd, "planned_launch", failing)
    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    elsa_bwd.PLANS.clear()
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 300, 64, device="cuda", generator=g) for _ in range(4))
    out64, lse, gold = _oracle(q, k, v, do, 0.125)
    with pytest.warns(RuntimeWarning, match="simulated Gluon build failure"):
        got = elsa_bwd.elsa_backward(q, k, v, out64.float(), do, lse, None, None, False, 0.125, "fp32-ieee")
    for x, ref in zip(got[:3], gold):
        assert rel_l2(x, ref) <= 1e-5
    q2 = q[:, :, :200]
    elsa_bwd.elsa_backward(q2, k, v, out64.float()[:, :, :200], do[:, :, :200], lse[:, :, :200], None, None, False,
                           0.125, "fp32-ieee")
    assert all(p.gluon is None for p in elsa_bwd.PLANS.plans.values())
    assert "simulated" in elsa_fwd._GLUON_FAILED["fp32-ieee backward"]
