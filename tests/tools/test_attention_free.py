"""The harness's attention_free (tools/_harness.py): SDPA answers without attention inside, and only inside, the
context; the training-step tool's attention-free side and its bound."""
import json

import pytest
import torch
import torch.nn.functional as F

from testdata import load_script

bench_train = load_script("tools/bench_train.py")
import _harness as harness  # noqa: E402  (tools/ is on sys.path once a tool is loaded)


def test_sdpa_returns_the_value_rows_inside_and_attends_again_after():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v)
    with harness.attention_free() as free:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False)
        fewer = F.scaled_dot_product_attention(q[:, :, :3], k, v)
        more = F.scaled_dot_product_attention(torch.randn(2, 3, 7, 8), k, v)
    assert free.calls == 3
    assert torch.equal(out, v) and out.data_ptr() != v.data_ptr()  # a copy of V, not V itself
    assert torch.equal(fewer, v[:, :, :3]) and torch.equal(more, torch.zeros(2, 3, 7, 8))
    out.sum().backward()
    assert q.grad is None and k.grad is None and torch.equal(v.grad, torch.ones_like(v))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v), exact)  # restored on exit
    assert not torch.equal(exact, v)


def test_restored_after_an_error_and_not_reentrant():
    original = F.scaled_dot_product_attention
    free = harness.attention_free()
    with pytest.raises(ValueError, match="boom"):
        with free:
            raise ValueError("boom")
    assert F.scaled_dot_product_attention is original
    with free:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            free.__enter__()
    assert F.scaled_dot_product_attention is original


def test_training_tool_reports_the_attention_free_bound(tmp_path):
    """A tiny ViT calls SDPA once per block: the attention-free side counts them and its time gives the bound
    (unpatched / attention-free) on the visionattn row; a Swin-v2 (cosine attention, no SDPA) gets none."""
    out = tmp_path / "t"
    res = bench_train.main(["--device", "cpu", "--cases", "vit_tiny_patch16_224:32:2", "--model-kwargs",
                            '{"depth": 2}', "--modes", "fp32", "--warmup", "0", "--steps", "2", "--rounds", "1",
                            "--attention-free", "--out", str(out)])
    un, ours, free = res["rows"]
    assert free["variant"] == "attention-free" and free["sdpa_calls_per_step"] == 2
    assert ours["bound"] == pytest.approx(un["ms"] / free["ms"]) == pytest.approx(free["speedup"])
    md = (tmp_path / "t.md").read_text()
    assert "attention-free (SDPA answers V)" in md and "attention-free bound" in md
    assert json.loads((tmp_path / "t.json").read_text())["rows"][2]["sdpa_calls_per_step"] == 2
    swin = json.dumps({"window_size": 4, "embed_dim": 24, "depths": [1, 1], "num_heads": [2, 2]})
    common = ["--device", "cpu", "--model-kwargs", swin, "--modes", "fp32", "--warmup", "0", "--steps", "1",
              "--rounds", "1", "--attention-free"]
    # timm's Swin runs its own softmax unless its fused_attn switch is on: the attention-free side turns it on
    res = bench_train.main(common + ["--cases", "swin_tiny_patch4_window7_224:32:2", "--out", str(tmp_path / "s")])
    un, ours, free = res["rows"]
    assert free["sdpa_calls_per_step"] == 2 and "bound" in ours
    # Swin-v2's cosine attention never calls SDPA: that side runs patched, visionattn's window cores answering
    # (one call per block), and the bound is unpatched / that
    res = bench_train.main(common + ["--cases", "swinv2_tiny_window8_256:32:2", "--out", str(tmp_path / "v2")])
    un, ours, free = res["rows"]
    assert free["sdpa_calls_per_step"] == 0 and free["core_calls_per_step"] == 2
    assert ours["bound"] == pytest.approx(un["ms"] / free["ms"])
    assert "attention-free (patched, its cores answer V)" in (tmp_path / "v2.md").read_text()


def test_core_answers_value_rows_and_counts():
    """``AttentionFree.core`` (the stand-in for visionattn's cores) returns a copy of V whatever the options, and
    counts apart from the SDPA calls."""
    free = harness.AttentionFree()
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    out = free.core(q, k, v, cosine=True, logit_scale=torch.ones(3))
    assert torch.equal(out, v) and out.data_ptr() != v.data_ptr()
    assert (free.core_calls, free.calls) == (1, 0)


def test_position_bias_still_gets_its_backward():
    """A bias that needs a gradient (timm's Swin gathers it from a table, Swin-v2 computes it with an MLP) gets
    zeros from both stand-ins, so the table's backward still runs; the value rows get the output gradient."""
    table = torch.randn(7, 3, requires_grad=True)
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    v = torch.randn(2, 3, 5, 4, requires_grad=True)
    index = torch.randint(0, 7, (5, 5))
    with harness.attention_free() as free:
        for out in (F.scaled_dot_product_attention(q, k, v, attn_mask=table[index].permute(2, 0, 1)),
                    free.core(q, k, v, relative_position_bias=table[index].permute(2, 0, 1))):
            g = torch.randn_like(out)
            dtable, dv = torch.autograd.grad(out, (table, v), g)
            assert torch.equal(dtable, torch.zeros_like(table)) and torch.equal(dv, g)
