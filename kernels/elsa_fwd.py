"""Dense ELSA forward (being written: issue 3)."""


def unsupported_reason(q, k, v, bias, attn_mask, mode):
    return "the Triton ELSA kernels are not built yet"


def elsa_attention(q, k, v, bias, attn_mask, is_causal, scale, mode, num_splits=None):
    raise NotImplementedError("Triton ELSA kernels are being written (issue 3)")
