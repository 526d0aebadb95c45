"""Mode fp32's forward on the Hopper Gluon kernel (visionattn.kernels.fp32_gluon: split-FP16 operands scaled per
head, ``PARTS = 2`` of visionattn.kernels.half_gluon) and its operand pass (visionattn.kernels.scaled_fp16).

On CPU the operand kernels run under the interpreter against float64, the kernel is compiled offline for sm_90
and the dispatch is checked; ``pytest -m gpu`` checks the results on a Hopper GPU against the float64 oracle.
"""
import warnings

import pytest
import torch

from offline_compile import compile_in_child
from visionattn.kernels import elsa_fwd, fp32_gluon, half_gluon, scaled_fp16

# each head's magnitudes (q, k, v) span 1e-6 .. 1e6 over the heads; the logits stay moderate (q * k = 1)
_MAGNITUDES = ((1e-6, 1e6, 1e-6), (1e-2, 1e2, 1.0), (1.0, 1.0, 1e6), (1e5, 1e-5, 1e-4))


def _magnitude_heads(n_q, n_k, d=64, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    m = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=device).T[:, None, :, None, None]
    return tuple(torch.randn(1, len(_MAGNITUDES), n, d, device=device, generator=g) * m[i]
                 for i, n in enumerate((n_q, n_k, n_k)))


def test_forward_operands_keep_22_bits_of_each_head_and_its_multipliers():
    """The operand pass (interpreter): each head of q, k, v scaled by one power of two to below 2^14 (its largest
    at least 2^13), hi + lo equal to the scaled FP32 input within 2^-22 of each entry (or the lo part's subnormal
    floor, 2^-38 of the head's largest), strided inputs read in place, an all-zero head left unscaled, and each
    head's Scales row: the logit multiplier ``scale log2(e) 2^-(s_q + s_k)`` and the output's ``2^-(s_v + 15)``."""
    n_q, n_k = 70, 130
    q, k, v = _magnitude_heads(n_q, n_k)
    q = q.transpose(2, 3).contiguous().transpose(2, 3)  # strided: head dim not contiguous
    k[0, 1] = 0.0
    scale = 0.125
    q16, k16, v16, scales = scaled_fp16.ForwardOperands(1, 4, n_q, n_k, 64)(q, k, v, scale)
    T = scaled_fp16.FORWARD_SCALE_EXPONENT
    shifts = []
    for x, x16 in ((q, q16), (k, k16), (v, v16)):
        assert x16.dtype == torch.float16 and x16.shape == (*x.shape[:3], 128) and x16.is_contiguous()
        hi, lo = x16[..., :64].double(), x16[..., 64:].double()
        split = hi + lo
        head_max = x.double().abs().amax(dim=(2, 3))[0]
        s = []
        for h in range(4):
            if head_max[h] == 0:
                assert (split[0, h] == 0).all()
                s.append(0)
                continue
            m = split[0, h].abs().max().item()
            assert 2 ** (T - 1) <= m <= 2 ** T, (h, m)
            shift = round(torch.log2(split[0, h].abs().max() / head_max[h]).item())
            s.append(shift)
            err = (split[0, h] * 2.0 ** -shift - x[0, h].double()).abs()
            bound = x[0, h].double().abs() * 2.0 ** -22 + head_max[h] * 2.0 ** -(T + 23)
            assert (err <= bound).all(), (h, (err / bound).max())
        shifts.append(s)
    log2e = 1.4426950408889634
    for h in range(4):
        sq, sk, sv = shifts[0][h], shifts[1][h], shifts[2][h]
        assert scales[h, 0].item() == pytest.approx(scale * log2e * 2.0 ** -(sq + sk), rel=1e-6)
        assert scales[h, 1].item() == 2.0 ** -(sv + scaled_fp16.P_SPLIT_EXP)


def _model_of_the_build(q16, k16, v16, scales, block_n=64):
    """The split build's arithmetic in torch, one head at a time: S from the three FP16 x FP16 products (exact in
    FP32, summed in FP32), the base-2 online softmax with the head's logit multiplier, P times 2^15 split into hi
    and lo FP16 parts, each key tile's three P V products summed apart and added to the running output in FP32, the
    output multiplier and one division at the end."""
    B, H, Nq, W = q16.shape
    D = W // 2
    group = H // k16.shape[1]  # grouped-query attention: query head h reads K / V head h // group
    out = torch.empty(B, H, Nq, D)
    for b in range(B):
        for h in range(H):
            qh, ql = q16[b, h, :, :D].float(), q16[b, h, :, D:].float()
            qk, o_mult = scales[b * H + h].tolist()
            m = torch.full((Nq,), float("-inf"))
            l, acc = torch.zeros(Nq), torch.zeros(Nq, D)
            for t in range(0, k16.shape[2], block_n):
                kv = h // group
                kh, kl = k16[b, kv, t:t + block_n, :D].float(), k16[b, kv, t:t + block_n, D:].float()
                vh, vl = v16[b, kv, t:t + block_n, :D].float(), v16[b, kv, t:t + block_n, D:].float()
                s = ql @ kh.T + qh @ kl.T + qh @ kh.T
                m_new = torch.maximum(m, s.amax(1) * qk)
                p = torch.exp2(s * qk - m_new[:, None])
                alpha = torch.exp2(m - m_new)
                ps = p * 2.0 ** scaled_fp16.P_SPLIT_EXP
                p_hi = ps.half().float()
                p_lo = (ps - p_hi).half().float()
                acc = acc * alpha[:, None] + (p_lo @ vh + p_hi @ vl + p_hi @ vh)
                l, m = l * alpha + p.sum(1), m_new
            out[b, h] = acc * (o_mult / l)[:, None]
    return out


def test_grouped_operands_copy_each_key_value_head_once_with_the_query_heads_scales():
    """Grouped-query attention (interpreter): with K / V heads serving two query heads each, the operand pass gives
    bit for bit the query copies and Scales rows of the equal-heads pass on K / V repeated per query head, and one
    copy of each K / V head (the repeated run's copy of its first query head); a group count that does not divide
    the query heads is refused by name."""
    n_q, n_k, group = 40, 90, 2
    q, k, v = _magnitude_heads(n_q, n_k)
    k, v = k[:, ::group].clone(), v[:, ::group] * 3.0
    grouped = scaled_fp16.ForwardOperands(1, 4, n_q, n_k, 64, h_kv=2)(q, k, v, 0.125)
    repeated = scaled_fp16.ForwardOperands(1, 4, n_q, n_k, 64)(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), 0.125)
    assert grouped[1].shape == (1, 2, n_k, 128) and grouped[2].shape == (1, 2, n_k, 128)
    assert torch.equal(grouped[0], repeated[0]) and torch.equal(grouped[3], repeated[3])
    for i in (1, 2):
        assert torch.equal(grouped[i], repeated[i][:, ::group])
    with pytest.raises(ValueError, match="3 key / value heads do not divide the 4 query heads"):
        scaled_fp16.ForwardOperands(1, 4, n_q, n_k, 64, h_kv=3)


@pytest.mark.parametrize("n_q,n_k,d,h_kv", [(40, 300, 64, 4), (70, 1000, 64, 4), (33, 200, 128, 2)])
def test_the_operands_scales_and_products_reproduce_attention_within_the_contract(n_q, n_k, d, h_kv):
    """A model of the split build on the operand pass's output (interpreter): with each head's scales as the kernel
    applies them (the logit multiplier inside the base-2 softmax, the output multiplier at the end), the three-part
    products and P's 2^15 split give every head, of magnitudes 1e-6 .. 1e6, within mode fp32's 2e-6 of float64: the
    host's bookkeeping of the scales, which the GPU kernel trusts, checked where CI runs; at head dim 128 and with
    K / V heads serving several query heads (grouped-query attention) too."""
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    q, k, v = _magnitude_heads(n_q, n_k, d)
    group = len(_MAGNITUDES) // h_kv
    k, v = k[:, ::group], v[:, ::group]  # grouped-query attention at h_kv < 4
    q16, k16, v16, scales = scaled_fp16.ForwardOperands(1, len(_MAGNITUDES), n_q, n_k, d, h_kv)(q, k, v, 0.125)
    y = _model_of_the_build(q16, k16, v16, scales, fp32_gluon.TILES[d][0])
    ref = oracle_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale=0.125)
    for h in range(len(_MAGNITUDES)):
        assert rel_l2(y[:, h], ref[:, h]) <= 2e-6, h


_CHILD = r"""
import json, torch
from visionattn.kernels import fp32_gluon, half_gluon
from visionattn.kernels.introspect import compile_for_arch
out = {}
for n_k, parts, d in ((4096, 2, 64), (1066, 2, 64), (100, 2, 64), (4096, 1, 64), (4096, 2, 128), (1066, 2, 128),
                      (4096, 1, 128)):
    cfg = fp32_gluon.get_config(n_k, d) if parts == 2 else half_gluon.get_config(n_k, d)
    r = compile_for_arch(half_gluon._half_fwd_kernel, dict(half_gluon.descriptor_types(cfg, d, torch.float16),
                         O="*fp32", LSE="*fp32", Scales="*fp32"), half_gluon.kernel_constexprs(cfg, d, True),
                         num_warps=4, num_stages=1, float_args=("qk_scale",), maxnreg=cfg["maxnreg"])
    out[f"{n_k}_{parts}_{d}"] = {"shared": r.shared_bytes, "wgmma": r.wgmma, "regs": r.registers,
                                 "local": r.local_bytes, "ws": r.ttgir.count("ttg.warp_specialize"),
                                 "programs": r.programs_per_sm}
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
@pytest.mark.skipif(half_gluon._IMPORT_ERROR is not None, reason="this Triton has no Gluon Hopper API")
def test_the_split_build_compiles_with_three_wgmmas_per_product_within_shared_memory():
    """With the installed Triton the ``PARTS = 2`` build compiles for sm_90 at head dims 64 and 128 (full tiles, a
    last tile cut in two parts, one cut tile): three wgmmas for each of the half build's, the hi and lo tiles of Q
    and of the K / V ring within the 227 KiB of shared memory, one program per SM at the launch register cap. Head
    dim 64 spills nothing (the consumers hold S, P's hi and lo parts, the output and P V's fresh accumulator: at
    128-key tiles they spilled 160 bytes); head dim 128 at most 96 bytes a thread (two 64 x 128 FP32 accumulators:
    its 64-key tiles spill 160)."""
    from visionattn.kernels.introspect import HOPPER_SHARED_LIMIT

    r = compile_in_child(_CHILD)
    half = {d: r.pop(f"4096_1_{d}") for d in (64, 128)}
    for key, v in r.items():
        n_k, _, d = map(int, key.split("_"))
        cfg = fp32_gluon.get_config(n_k, d)
        tiles = 2 * 2 * (cfg["q_buffers"] * cfg["BLOCK_M"] * d + cfg["STAGES"] * 2 * cfg["BLOCK_N"] * d)
        assert tiles < v["shared"] <= HOPPER_SHARED_LIMIT, (key, v)
        assert v["ws"] == 1 and v["regs"] == cfg["maxnreg"] and v["programs"] == 1, (key, v)
        assert v["local"] <= (0 if d == 64 else 96), (key, v)
    for d in (64, 128):
        assert r[f"4096_2_{d}"]["wgmma"] == 3 * half[d]["wgmma"], (d, r, half)


def test_config_and_preference():
    """The split build takes two consumer warpgroups of 64 rows, ``parts = 2`` and its head dim's key tiles (64 keys
    in 4 stages at head dim 64, 32 keys in 4 stages with one Q buffer and ping-pong at 128) at every key count, its
    last key tile cut to the keys it holds (in 16-key steps, one or two parts at head dim 64, one at 128, up to 2048
    keys); other head dims are refused; the launcher prefers it from MIN_KEYS keys."""
    for n_k, one_tile, tail in ((20, True, (32, 0)), (100, False, (32, 16)), (1066, False, (32, 16)),
                                (4096, False, (64, 0)), (4097, False, (64, 0)), (65536, False, (64, 0))):
        cfg = fp32_gluon.get_config(n_k)
        assert cfg["parts"] == 2 and cfg["STAGES"] == 4 and cfg["consumers"] == 2 and cfg["BLOCK_N"] == 64
        assert cfg["BLOCK_M"] == 128 and not cfg["PINGPONG"] and cfg["q_buffers"] == 2
        assert (cfg["one_tile"], cfg["tail_keys"]) == (one_tile, tail), n_k
        assert half_gluon.kernel_constexprs(cfg, 64)["PARTS"] == 2
    for n_k, one_tile, tail in ((20, True, (32, 0)), (100, False, (16, 0)), (1066, False, (16, 0)),
                                (4096, False, (32, 0)), (65536, False, (32, 0))):
        cfg = fp32_gluon.get_config(n_k, 128)
        # one Q buffer at every length, also where the fp16 / bf16 config takes two (up to 1024 keys): two
        # hi / lo Q buffers do not fit beside the ring
        assert cfg["parts"] == 2 and (cfg["BLOCK_N"], cfg["STAGES"], cfg["q_buffers"]) == fp32_gluon.TILES[128]
        assert fp32_gluon.TILES[128] == (32, 4, 1) and cfg["BLOCK_M"] == 128 and cfg["consumers"] == 2
        assert cfg["PINGPONG"], n_k  # at every length, also where the fp16 / bf16 64-key tiles go without
        assert (cfg["one_tile"], cfg["tail_keys"]) == (one_tile, tail), n_k
    with pytest.raises(ValueError, match="head dim 96"):
        fp32_gluon.get_config(4096, 96)
    assert not fp32_gluon.preferred(4096, fp32_gluon.MIN_KEYS - 1, 64)
    assert fp32_gluon.preferred(1, fp32_gluon.MIN_KEYS, 64)


def test_large_calls_run_in_chunks_whose_copies_fit_the_budget(monkeypatch):
    """A call whose split copies pass CHUNK_BYTES runs in near-equal chunks covering every (batch, head) once, each
    within the budget (or one head): whole batch items while a chunk holds all heads, else heads of one batch item;
    calls within the budget run in one chunk. A call whose chunks would hold fewer than CHUNK_MIN_WAVES waves of work
    tiles (few query rows, very many keys) is refused by name (the Triton kernel's split-KV takes it)."""
    cases = [(8, 12, 4097, 4097), (1, 16, 16384, 16384), (64, 12, 197, 197), (1, 16, 208200, 208200),
             (200, 16, 1041, 1041), (2, 16, 1_000_000, 1_000_000), (3, 5, 70000, 70000), (1, 1, 4_000_000, 4_000_000),
             (4, 16, 20000, 20000), (64, 12, 1025, 200), (2, 8, 300, 600_000)]
    for B, H, Nq, Nk in cases:
        parts = fp32_gluon.chunks(B, H, Nq, Nk, 64)
        covered = sorted((b, h) for bs, hs in parts for b in range(B)[bs] for h in range(H)[hs])
        assert covered == [(b, h) for b in range(B) for h in range(H)], (B, H)
        assert all(len(range(B)[bs]) == 1 or len(range(H)[hs]) == H for bs, hs in parts)
        sizes = [len(range(B)[bs]) * len(range(H)[hs]) for bs, hs in parts]
        head_bytes = 4 * 64 * (Nq + 2 * Nk)
        assert all(n * head_bytes <= fp32_gluon.CHUNK_BYTES or n == 1 for n in sizes), (B, H, Nq, sizes)
        assert len(set(sizes)) <= 2 and max(sizes) - min(sizes) <= 1 + max(sizes) // 8, (B, H, sizes)
        assert (len(parts) == 1) is (B * H * head_bytes <= fp32_gluon.CHUNK_BYTES or B * H == 1), (B, H, Nq)
    assert len(fp32_gluon.chunks(1, 16, 208200, 208200, 64)) == 6  # VGGT's global attention at 200 frames
    for B, H, group, Nq, Nk in ((1, 32, 4, 300_000, 300_000), (3, 16, 8, 70000, 70000), (2, 8, 2, 4096, 4096),
                                (5, 12, 3, 100_000, 100_000)):
        parts = fp32_gluon.chunks(B, H, Nq, Nk, 128, group)
        covered = sorted((b, h) for bs, hs in parts for b in range(B)[bs] for h in range(H)[hs])
        assert covered == [(b, h) for b in range(B) for h in range(H)], (B, H, group)
        assert all(hs.start % group == 0 and hs.stop % group == 0 for _, hs in parts)  # whole groups
        unit = 4 * 128 * (group * Nq + 2 * Nk)  # a K / V head and its query heads
        assert all(len(range(B)[bs]) * len(range(H)[hs]) // group * unit <= fp32_gluon.CHUNK_BYTES
                   or len(range(H)[hs]) == group for bs, hs in parts), (B, H, group, parts)
    monkeypatch.setattr(fp32_gluon, "hopper_copies_scope_reason", lambda *a, **kw: None)  # as if on a Hopper GPU
    monkeypatch.setattr(fp32_gluon, "sm_count", lambda device: 132)
    for (Nq, Nk), refused in (((208200, 208200), False), ((1024, 1_000_000), True), ((300, 2048), False)):
        q, k = torch.empty(1, 16, Nq, 64, device="meta"), torch.empty(1, 16, Nk, 64, device="meta")
        reason = fp32_gluon.unsupported_reason(q, k, k, None, None, False, 0.125, 0)
        assert (reason is not None and "too few query tiles" in reason) is refused, (Nq, Nk, reason)


def test_unsupported_reasons_name_the_cause():
    """float32 with a contiguous head dim (other strides any) and key / value heads dividing the query heads is in
    scope on a capable GPU; fp16 inputs, head dim 96, head counts that do not divide, bias / causal, split-KV, a
    strided head dim and tensors off CUDA are refused by name."""
    q, k, v = (torch.randn(1, 2, n, 64) for n in (64, 2048, 2048))
    reason = fp32_gluon.unsupported_reason
    assert "dtypes" in reason(q.half(), k.half(), v.half(), None, None, False, 0.125, 0)
    q96 = torch.randn(1, 2, 64, 96)
    assert "head dims" in reason(q96, q96, q96, None, None, False, 0.125, 0)
    q128 = torch.randn(1, 2, 64, 128)
    assert "tensors on cpu" in reason(q128, q128, q128, None, None, False, 0.125, 0)
    assert "tensors on cpu" in reason(q, k[:, :1], v[:, :1], None, None, False, 0.125, 0)  # grouped: in scope
    q3 = torch.randn(1, 3, 64, 64)
    assert "do not divide the 3 query heads" in reason(q3, k, v, None, None, False, 0.125, 0)
    assert "causal" in reason(q, k, v, None, None, True, 0.125, 0)
    assert "split-KV" in reason(q, k, v, None, None, False, 0.125, 2)
    assert "head-dim stride" in reason(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None, None, False,
                                       0.125, 0)
    assert "tensors on cpu" in reason(q, torch.randn(1, 2048, 2, 64).transpose(1, 2), v, None, None, False, 0.125, 0)
    with pytest.raises(ValueError, match="fp32_attention: tensors on cpu"):
        fp32_gluon.fp32_attention(q, k, v, 0.125)


def test_fp32_calls_take_the_split_build_where_preferred(monkeypatch):
    """The launcher hands an in-scope fp32 call (float32, head dim 64) from MIN_KEYS keys to the split build with
    its config (and the LSE wish of a training call); fewer keys, tf32 / fp32-ieee and an explicit product precision
    keep their kernels."""
    taken = []
    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    monkeypatch.setattr(elsa_fwd, "_gluon_device", lambda device: True)  # as if on a Hopper GPU
    monkeypatch.setattr(fp32_gluon, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(fp32_gluon, "planned_launch",
                        lambda q, k, v, cfg, lse=False: taken.append((k.shape[2], cfg["parts"], lse)) or
                        (lambda *a: None))
    monkeypatch.setattr(elsa_fwd, "choose_num_splits", lambda *a: 1)  # as if the grid fills the GPU
    for n_k in (fp32_gluon.MIN_KEYS - 1, fp32_gluon.MIN_KEYS):
        q, k, v = (torch.randn(1, 2, n, 64) for n in (64, n_k, n_k))
        plan = elsa_fwd._gluon_plan("fp32", q, k, v, None, None, False, 0.125, 0, torch.float32, True)
        assert (plan is not None) is (n_k >= fp32_gluon.MIN_KEYS)
    assert taken == [(fp32_gluon.MIN_KEYS, 2, True)]
    seen = []
    monkeypatch.setattr(elsa_fwd, "_gluon_plan", lambda kernel, *a: seen.append(kernel))
    q, k, v = (torch.randn(1, 2, 16, 64) for _ in range(3))
    for mode in ("fp32", "tf32", "fp32-ieee"):
        elsa_fwd._plan_and_run(q, k, v, None, None, False, 0.125, mode, 0, None, False)
    elsa_fwd._plan_and_run(q, k, v, None, None, False, 0.125, "fp32", 0, None, False, precision="f16x3")
    assert seen == ["fp32", "fp32-ieee"]


def test_a_failing_split_build_warns_once_and_the_triton_kernel_takes_over(monkeypatch):
    """No silent fallback: if the split build cannot run, the first call it would take warns with the reason and
    that call and every later one run on the Triton kernel."""
    calls = []
    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    monkeypatch.setattr(elsa_fwd, "_gluon_device", lambda device: True)
    monkeypatch.setattr(fp32_gluon, "unsupported_reason", lambda *a: None)

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("no such Gluon op")

    monkeypatch.setattr(fp32_gluon, "planned_launch", lambda *a: broken)
    q, k, v = (torch.randn(1, 2, n, 64) for n in (16, 1024, 1024))
    with pytest.warns(RuntimeWarning, match="Gluon fp32 kernel cannot run .RuntimeError: no such Gluon op"):
        plan, (out, _) = elsa_fwd._plan_and_run(q, k, v, None, None, False, 0.125, "fp32", 1, None, False)
    assert isinstance(plan, elsa_fwd._TritonPlan) and torch.isfinite(out).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan, _ = elsa_fwd._plan_and_run(q, k, v, None, None, False, 0.125, "fp32", 1, None, False)
    assert isinstance(plan, elsa_fwd._TritonPlan) and calls == [1]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the kernel is Hopper-only (wgmma, TMA)")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("B,H,Nq,Nk,D,group", [
    (1, 8, 4096, 4096, 64, 1), (2, 3, 1000, 2049, 64, 1), (1, 1, 1, 2048, 64, 1), (2, 3, 300, 1066, 64, 1),
    (1, 2, 500, 10410, 64, 1), (8, 12, 4097, 4097, 64, 1), (1, 4, 129, 65536, 64, 1), (2, 70, 1000, 2049, 64, 1),
    (2, 3, 300, 100, 64, 1), (1, 2, 64, 1024, 64, 1), (2, 3, 257, 129, 64, 1),
    (1, 8, 4096, 4096, 128, 1), (2, 3, 1000, 2049, 128, 1), (2, 3, 300, 1066, 128, 1), (1, 4, 129, 20000, 128, 1),
    (2, 3, 257, 129, 128, 1), (1, 2, 70, 40, 128, 1),
    (1, 32, 1024, 8192, 128, 4), (2, 16, 1000, 2049, 64, 8), (4, 16, 700, 4096, 64, 16), (2, 6, 300, 1066, 128, 3)])
def test_matches_the_oracle_and_is_what_fp32_dispatches_to(B, H, Nq, Nk, D, group):
    """Within mode fp32's contract and near the Triton kernel's error vs the float64 oracle at head dims 64 and 128,
    odd row / key counts (TMA zero-fills the tails; the last key tile masked, cut, or split in two parts; one key
    tile), K / V heads serving ``group`` query heads each (grouped-query attention, against the oracle on K / V
    repeated), with programs that take several work tiles; ``elsa_attention`` returns exactly this kernel's output
    where it dispatches to it, and a training call's LSE is as close to float64 as the Triton kernel's."""
    from visionattn.kernels._launch import GluonForwardPlan
    from visionattn.kernels.elsa_fwd import _launch, elsa_attention, get_config
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, h, n, D, device="cuda", generator=g) for h, n in ((H, Nq), (H // group, Nk),
                                                                                (H // group, Nk)))
    scale = D ** -0.5
    y = fp32_gluon.fp32_attention(q, k, v, scale)
    rows = torch.randperm(Nq, device="cuda")[:256]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    ref = oracle_attention(q[:, :, rows], k_rep, v_rep, scale=scale)
    err = rel_l2(y[:, :, rows], ref)
    triton_y = _launch(q, k, v, None, None, False, scale, "fp32", 1, config=get_config("fp32", D, D, Nk))
    triton_err = rel_l2(triton_y[:, :, rows], ref)
    assert torch.isfinite(y).all() and err <= 2e-6 and err <= 1.5 * triton_err + 1e-7, (err, triton_err)
    assert torch.equal(fp32_gluon.fp32_attention(q, k, v, scale), y)  # bit-identical repeats
    if group > 1:  # each query head's output is the equal-heads build's on its repeated K / V head
        assert torch.equal(fp32_gluon.fp32_attention(q, k_rep, v_rep, scale), y)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if fp32_gluon.preferred(Nq, Nk, D) and B * H * -(-Nq // 128) >= sms:
        assert torch.equal(elsa_attention(q, k, v, None, None, False, scale, "fp32"), y)
        plan, (y_lse, lse) = elsa_fwd.plan_for(q, k, v, None, None, False, scale, "fp32", 0, None, True)
        assert isinstance(plan, GluonForwardPlan) and torch.equal(y_lse, y)
        lse_ref = torch.logsumexp(scale * q[:, :, rows].double() @ k_rep.double().transpose(-1, -2), dim=-1)
        _, (_, triton_lse) = elsa_fwd._plan_and_run(q, k, v, None, None, False, scale, "fp32", 1, None, True,
                                                    config=get_config("fp32", D, D, Nk))
        lse_err = (lse[:, :, rows].double() - lse_ref).abs().max().item()
        triton_lse_err = (triton_lse[:, :, rows].double() - lse_ref).abs().max().item()
        assert lse_err <= 2 * triton_lse_err + 1e-6, (lse_err, triton_lse_err)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("B,H,group,D", [(4, 3, 1, 64), (1, 6, 1, 64), (2, 6, 3, 128)])
def test_chunked_calls_equal_the_whole_call(monkeypatch, B, H, group, D):
    """A call run in chunks (of batch items; of heads; of whole query-head groups with their K / V head) gives bit
    for bit the output and LSE of the same call in one launch: each head's scales and work tiles do not depend on
    the other heads."""
    q, k, v = (torch.randn(B, h, n, D, device="cuda") for h, n in ((H, 300), (H // group, 1100), (H // group, 1100)))
    cfg = fp32_gluon.config_for(q, k)
    out, lse = (torch.empty(B, 300, H, D, device="cuda").transpose(1, 2), torch.empty(B, H, 300, device="cuda"))
    fp32_gluon.planned_launch(q, k, v, cfg, True)(q, k, v, 0.125, out, lse)
    monkeypatch.setattr(fp32_gluon, "CHUNK_BYTES", 1)
    assert len(fp32_gluon.chunks(B, H, 300, 1100, D, group)) == B * H // group
    out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    fp32_gluon.planned_launch(q, k, v, cfg, True)(q, k, v, 0.125, out2, lse2)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("n_q,n_k,d", [(1000, 4100, 64), (4096, 16384, 64), (1000, 4100, 128)])
def test_heads_of_any_magnitude_stay_within_the_contract(n_q, n_k, d):
    """Heads whose q, k, v magnitudes span 1e-6 .. 1e6 (each head scaled by its own powers of two), strided
    ``unbind`` views of a packed qkv, and long key counts (P V summed per tile in a fresh accumulator): every head
    within 2e-6 of float64."""
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    q, k, v = _magnitude_heads(n_q, n_k, d, device="cuda")
    k = torch.stack([k, v], 0).permute(1, 2, 3, 0, 4).unbind(3)[0]  # a strided view (stride 2 d between keys)
    y = fp32_gluon.fp32_attention(q, k, v, 0.125)
    rows = torch.arange(0, n_q, 7, device="cuda")
    ref = oracle_attention(q[:, :, rows], k, v, scale=0.125)
    for h in range(len(_MAGNITUDES)):
        assert rel_l2(y[:, h, rows], ref[:, h]) <= 2e-6, h
