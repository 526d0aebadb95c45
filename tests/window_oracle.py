"""Independent float64 oracle for window attention, shared by tests/api and tests/kernels.

Bias and shift mask are expanded explicitly to [B*nW, H, N, N] (test sizes only), so the oracle shares
nothing with visionattn.window's reference or the kernels. Importable as ``from window_oracle import ...``
(tests/ is on sys.path because tests/conftest.py lives there).
"""
import math

import torch
import torch.nn.functional as F

from visionattn.reference import oracle_attention


def expanded_window_oracle(q, k, v, bias, mask, nw, cosine=False, logit_scale=None, scale=None):
    """Window attention in float64 with bias [H, N, N] and mask [nW, N, N] expanded over B*nW windows."""
    BW, H, N, D = q.shape
    qd, kd = q.double(), k.double()
    if cosine:
        mult = torch.exp(torch.clamp(logit_scale.double().reshape(1, H, 1, 1), max=math.log(100)))
        qd, kd, scale = F.normalize(qd, dim=-1) * mult, F.normalize(kd, dim=-1), 1.0
    full = torch.zeros(BW, H, N, N, dtype=torch.float64, device=q.device)
    if bias is not None:
        full = full + bias.double().reshape(1, H, N, N)
    if mask is not None:
        full = full + mask.double().repeat(BW // nw, 1, 1).unsqueeze(1)
    return oracle_attention(qd, kd, v.double(), bias=full, scale=scale)
