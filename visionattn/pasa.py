"""PASA reference (being written: issue 4)."""


def pasa_attention_reference(*args, **kwargs):
    raise NotImplementedError("PASA is being written (issue 4)")
