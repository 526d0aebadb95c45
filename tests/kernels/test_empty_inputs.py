"""Calls with nothing to compute: no query rows, no keys, or an empty batch. Every launcher returns
the heads-inner output without a kernel launch: empty, or zeros where there are no keys (the (m, S, W)
fold over no keys leaves W = 0)."""
import pytest
import torch

from visionattn.kernels import elsa_attention, pasa_attention
from visionattn.kernels._launch import allocate_output

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("B,H,Nq,Nk,Dv,needs_kernel", [(2, 3, 5, 7, 4, True), (2, 3, 5, 0, 4, False),
                                                       (2, 3, 0, 7, 4, False), (0, 3, 5, 7, 4, False),
                                                       (2, 3, 5, 7, 0, False)])
def test_allocate_output_says_when_a_kernel_must_run(B, H, Nq, Nk, Dv, needs_kernel):
    q = torch.randn(B, H, Nq, 8)
    out, needs = allocate_output(q, Nk, Dv, torch.float16)
    assert needs == needs_kernel
    assert out.shape == (B, H, Nq, Dv) and out.dtype == torch.float16
    assert out.transpose(1, 2).is_contiguous()  # heads-inner: [B, Nq, H, Dv] underneath
    if Nk == 0:
        assert (out == 0).all()
    with pytest.raises(TypeError, match="output dtype torch.int8"):
        allocate_output(q, Nk, Dv, torch.int8)


@pytest.mark.parametrize("mode", ["fp32", "fp32-ieee", "fp16", "bf16", "pasa"])
def test_keyless_and_queryless_calls_return_zeros_and_empty(mode):
    dtype = {"fp32": torch.float32, "fp32-ieee": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
             "pasa": torch.float16}[mode]

    def run(n_q, n_k):
        q = torch.randn(1, 2, n_q, 16, device=DEV).to(dtype)
        k, v = (torch.randn(1, 2, n_k, 16, device=DEV).to(dtype) for _ in range(2))
        if mode == "pasa":
            return pasa_attention(q, k, v, None, None, False, 0.25)
        return elsa_attention(q, k, v, None, None, False, 0.25, mode)

    keyless = run(5, 0)
    assert keyless.shape == (1, 2, 5, 16) and (keyless == 0).all()
    assert run(0, 7).shape == (1, 2, 0, 16)
