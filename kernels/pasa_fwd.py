"""PASA forward (being written: issue 4)."""


def pasa_attention(q, k, v, bias, attn_mask, is_causal, scale, shift=True, beta=None):
    raise NotImplementedError("PASA kernel is being written (issue 4)")
