"""Window attention (being written: issue 5)."""


def window_attention(*args, **kwargs):
    raise NotImplementedError("window_attention is being written (issue 5)")
