"""The warp-specialized Hopper fp16 / bf16 kernel (visionattn.kernels.half_gluon), and the dense
launcher's dispatch to both Gluon kernels.

Gluon does not run under TRITON_INTERPRET=1, so on CPU the kernel is compiled offline for sm_90 with
the installed Triton (in a child process with TRITON_INTERPRET=0) and the dispatch rules are checked;
the results are checked on a Hopper GPU (``pytest -m gpu``) against the float64 oracle.
"""
import warnings

import pytest
import torch

from offline_compile import compile_in_child
from visionattn.kernels import elsa_fwd, half_gluon, ieee_gluon

_CHILD = r"""
import json, torch
from visionattn.kernels import half_gluon
from visionattn.kernels.introspect import compile_for_arch
out = {}
for d in half_gluon.HEAD_DIMS:
    for (dt, tname), n_k, n_q in (((torch.float16, "fp16"), 4096, None), ((torch.bfloat16, "bf16"), 1066, None),
                                  ((torch.float16, "four"), 197, 197), ((torch.bfloat16, "three"), 4097, 4097),
                                  ((torch.float16, "short"), 300, None), ((torch.bfloat16, "one"), 100, None),
                                  ((torch.bfloat16, "pieces"), 1536, 1536), ((torch.bfloat16, "short3"), 300, 300)):
        if (d > 64 and n_q and tname not in ("pieces", "short3")) or (d == 64 and tname in ("short", "one", "pieces",
                                                                                             "short3")):
            continue
        # 1066 keys: a 42-key last tile (D = 64: 32 + 16 keys); ViT-B/16 at 1024 px on 132 SMs: three consumers;
        # 300 keys at D = 128: 64-key tiles, four stages and two Q buffers; 100 keys: one 128-key tile, two stages
        # and two Q buffers; Flux at 512 px (24 heads of 1536 tokens) on 132 SMs: key pieces for the last round;
        # 512 heads of 300 rows at D = 128 on 132 SMs: three consumers over 64-key tiles
        cfg = half_gluon.get_config(n_k, d, n_q=n_q, heads={4097: 96, 1536: 24, 300: 512}.get(n_q), sms=132)
        # O from registers, and (two Q buffers) by TMA stores, as the plan's own output takes it
        for tma in ((False, True) if half_gluon.tma_output(cfg, dt, dt, (4096 * d, d, 8 * d)) else (False,)):
            r = compile_for_arch(half_gluon._half_fwd_kernel, dict(half_gluon.descriptor_types(cfg, d, dt),
                                 O="*" + ("bf16" if dt == torch.bfloat16 else "fp16"), LSE="*fp32", Scales="*fp32"),
                                 half_gluon.kernel_constexprs(cfg, d, tname in ("bf16", "pieces"), tma_out=tma),
                                 num_warps=4, num_stages=1, float_args=("qk_scale",), maxnreg=cfg["maxnreg"])
            out[f"{d}_{tname}" + "_tma" * tma] = {
                "n_k": n_k, "n_q": n_q, "shared": r.shared_bytes, "wgmma": r.wgmma, "regs": r.registers,
                "local": r.local_bytes, "warps": r.num_warps, "ws": r.ttgir.count("ttg.warp_specialize"),
                "programs": r.programs_per_sm, "consumers": cfg["consumers"], "pieces": cfg["pieces"],
                "bulk_store": r.ttgir.count("ttng.async_tma_copy_local_to_global")}
print(json.dumps(out))
"""


needs_gluon = pytest.mark.skipif(half_gluon._IMPORT_ERROR is not None, reason="this Triton has no Gluon Hopper API")


@pytest.mark.timeout(600)
@needs_gluon
def test_compiles_for_hopper_warp_specialized_with_at_most_a_few_spilled_words():
    """With the installed Triton the kernel builds for sm_90 at both head dims and dtypes (the bfloat16 builds with
    the LSE write the backward needs): wgmma products,
    one warp-specialized region (two consumer warpgroups + the producer's at 4096 keys; at D = 64 and 1066
    keys one consumer warpgroup, 128 registers and two CTAs per SM, and a last key tile in two parts; at 197
    rows and keys four consumer warpgroups at 96 registers), the
    launch register cap (three consumer warpgroups at 4097 rows, 96 heads and 132 SMs: 128 registers, 16 warps), the
    build with key pieces (head dim 128, 24 heads of 1536 rows on 132 SMs: the pieces' partial-state epilogue beside
    the whole tiles' and the LSE write), the Q / K / V tiles within the 227 KiB of shared memory, and no spills beyond
    a few words: none with Triton 3.6 (the GPU runs'), while the ptxas of Triton 3.8 keeps 4 words in the stack frame
    at D = 128 (8 in the build with key pieces, 12 in the three-consumer build over 64-key tiles: 512 heads of 300
    rows on 132 SMs) and 16 in the four-consumer build (112-120 registers per consumer
    thread), 22 in the three-consumer one (160 registers per consumer thread; none with Triton 3.6; lengths are not
    specialised on, as at run time, where 197 keys are not a multiple of 16 either). The builds that write O by TMA
    stores (two Q buffers: head dim 64, and head dim 128 at 100 and 300 keys; :func:`.half_gluon.tma_output`) issue
    one per consumer and take no more shared memory or CTAs per SM than those storing from registers, and at most 12
    words more of stack frame (Triton 3.8: 6 in the four-consumer build, 12 in the three-consumer one; none with
    Triton 3.6). Every pointer argument is typed as a launch passes it (``Scales`` a float32 pointer: the pieces'
    workspace, else the output's address standing in)."""
    from visionattn.kernels.introspect import HOPPER_SHARED_LIMIT

    r = compile_in_child(_CHILD)
    plain = {"64_fp16", "64_bf16", "64_four", "64_three", "128_fp16", "128_bf16", "128_short", "128_one",
             "128_pieces", "128_short3"}
    short = ("128_short", "128_one", "128_short3")
    assert set(r) == plain | {f"{key}_tma" for key in plain if key.startswith("64") or key in short}
    for key, v in r.items():
        # O by TMA stores (two Q buffers: one per consumer, staged in its Q tile, no more shared memory or
        # registers), else from registers
        if key.endswith("_tma"):
            plain_build = r[key[:-4]]
            assert v["bulk_store"] == v["consumers"] and v["shared"] <= plain_build["shared"], (key, v)
            assert v["local"] <= plain_build["local"] + 48 and v["programs"] == plain_build["programs"], (key, v)
            continue
        assert v["bulk_store"] == 0, (key, v)
        d = int(key.split("_")[0])
        # the shape the child compiled
        cfg = half_gluon.get_config(v["n_k"], d, n_q=v["n_q"], heads={4097: 96, 1536: 24, 300: 512}.get(v["n_q"]),
                                    sms=132)
        assert cfg["consumers"] == {"four": 4, "three": 3, "short3": 3}.get(key.split("_")[1], cfg["consumers"])
        assert (v["pieces"] > 1) is (key == "128_pieces"), (key, v)
        tiles = 2 * (cfg["q_buffers"] * cfg["BLOCK_M"] * d + cfg["STAGES"] * 2 * cfg["BLOCK_N"] * d)  # Q, K / V ring
        assert tiles < v["shared"] <= HOPPER_SHARED_LIMIT, (key, v)
        warps = 4 * cfg["consumers"] + 4  # the producer warp is padded to a warpgroup
        assert v["wgmma"] > 0 and v["ws"] == 1 and v["warps"] == warps, (key, v)
        assert v["local"] <= (0 if key in ("64_fp16", "64_bf16") else 96 if key == "64_three" else 64), (key, v)
        assert v["regs"] == cfg["maxnreg"] and v["programs"] == cfg["ctas_per_sm"], (key, v)


def _qkv(n_q=64, n_k=2048, d=64, dtype=torch.float16, device="cpu"):
    return tuple(torch.randn(1, 2, n, d, device=device).to(dtype) for n in (n_q, n_k, n_k))


@needs_gluon
def test_unsupported_reasons_name_the_cause():
    q, k, v = _qkv()
    reason = half_gluon.unsupported_reason
    assert "bias" in reason(q, k, v, torch.zeros(64, 2048), None, False, 0.125, 0)
    assert "causal" in reason(q, k, v, None, None, True, 0.125, 0)
    assert "scale" in reason(q, k, v, None, None, False, -0.125, 0)
    assert "dtypes" in reason(q.float(), k.float(), v.float(), None, None, False, 0.125, 0)
    assert "dtypes" in reason(q, k.bfloat16(), v, None, None, False, 0.125, 0)
    q8, k8, v8 = _qkv(d=80)
    assert "head dims (80, 80)" in reason(q8, k8, v8, None, None, False, 0.125, 0)
    assert "head dims (64, 32)" in reason(q, k, v[..., :32], None, None, False, 0.125, 0)
    assert "split" in reason(q, k, v, None, None, False, 0.125, 4)
    assert "k strides" in reason(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, None, None, False, 0.125, 0)
    odd = torch.randn(1, 2, 2048, 68).half()[..., :64]  # rows of 136 bytes: not a TMA stride
    assert "v strides" in reason(q, k, odd, None, None, False, 0.125, 0)
    assert reason(q, k, v, None, None, False, 0.125, 1) == "tensors on cpu"  # everything else fits


def test_the_last_key_tile_is_cut_to_the_keys_it_holds():
    """Up to TAIL_CUT_MAX_KEYS keys the last of 2+ key tiles multiplies its remainder rounded up to 16 keys, in
    power-of-two parts of 16-128 (Triton shapes, wgmma's 16-key steps): two parts at D = 64 where that saves keys,
    one at D = 128 (ping-pong counts one part); a call of one key tile cuts that tile the same way. Past it the
    whole tile runs masked, so every longer length builds one and the same kernel per config."""
    limit = half_gluon.TAIL_CUT_MAX_KEYS
    for d, n_q in ((64, None), (64, 200), (128, None)):  # 200 rows at D = 64: four consumers, 64-key tiles
        long_variants = set()
        for n_k in range(1, 4200):
            cfg = half_gluon.get_config(n_k, d, n_q=n_q)
            first, second = cfg["tail_keys"]
            assert cfg["one_tile"] is (n_k <= cfg["BLOCK_N"])  # then the one tile is cut the same way
            if n_k > limit:
                assert cfg["tail_keys"] == (cfg["BLOCK_N"], 0)
                long_variants.add(tuple(sorted(half_gluon.kernel_constexprs(cfg, d).items())))
                continue
            rem = n_k - (n_k - 1) // cfg["BLOCK_N"] * cfg["BLOCK_N"]
            for part in (first, second) if second else (first,):
                assert 16 <= part <= cfg["BLOCK_N"] and part & (part - 1) == 0, (n_k, d, cfg["tail_keys"])
            assert rem <= first + second <= max(16, 1 << (rem - 1).bit_length()), (n_k, d, cfg["tail_keys"])
            assert second == 0 or d == 64
        assert len(long_variants) == 1, (d, n_q, long_variants)
    assert half_gluon.get_config(197, 64)["tail_keys"] == (64, 16)  # 197 keys, one consumer: 128 + 64 + 16 keys
    assert half_gluon.get_config(197, 64, n_q=197)["tail_keys"] == (16, 0)  # ViT-B/16 224, four: 3 x 64 + 16 keys
    assert half_gluon.get_config(1025, 64)["tail_keys"] == (16, 0)  # ViT-B/16 512: 8 tiles + 16 keys


def test_consumer_warpgroups_per_cta_by_length_within_the_register_file():
    """D = 64: four consumer warpgroups (a whole head, 64-key tiles) at 193-224 query rows and <= 256 keys, else
    one (64 query rows) per CTA and two CTAs per SM below ONE_CONSUMER_BELOW keys; three (192 rows) where
    ``three_consumers_faster`` says so, at D = 128 only over 64-key tiles (129 to D128_SHORT_KEYS keys); two
    consumers (128 rows), one CTA per SM, otherwise. Launch registers fit the register file, and after
    ``setmaxnreg`` the default partition (a consumer) keeps at least what the other consumers get."""
    below = half_gluon.ONE_CONSUMER_BELOW
    cases = [(64, below - 1, None, (1, 2, 64)), (64, below, None, (2, 1, 128)), (128, 256, None, (2, 1, 128)),
             (64, 197, 197, (4, 1, 256)), (64, 256, 224, (4, 1, 256)), (64, 197, 192, (1, 2, 64)),
             (64, 257, 200, (1, 2, 64)), (64, 197, 225, (1, 2, 64)), (128, 197, 197, (2, 1, 128))]
    # with the heads (batch x heads) and SMs: three consumers (192 rows) where their waves finish first (ViT-B/16 at
    # 1024 px, 16 heads of 16384 rows); 8 heads of 16384 or 4096 rows keep two; four only where the heads fill the SMs
    sized = [(64, 4097, 4097, 96, (3, 1, 192)), (64, 16384, 16384, 16, (3, 1, 192)), (64, 16384, 16384, 8, (2, 1, 128)),
             (64, 4096, 4096, 8, (2, 1, 128)), (128, 4097, 4097, 96, (2, 1, 128)), (64, 1024, 4097, 96, (1, 2, 64)),
             (64, 197, 197, 768, (4, 1, 256)), (64, 197, 197, 96, (1, 2, 64)),
             # D = 128 over 64-key tiles: 512 heads of 129-384 rows and 256 of 513 take three; 128 heads of 577, 64 of
             # 1024 and 256 of 449 keep two; one key tile (97) and 128-key tiles (1025) always two
             (128, 129, 129, 512, (3, 1, 192)), (128, 257, 257, 512, (3, 1, 192)), (128, 384, 384, 512, (3, 1, 192)),
             (128, 513, 513, 256, (3, 1, 192)), (128, 449, 449, 256, (2, 1, 128)), (128, 577, 577, 128, (2, 1, 128)),
             (128, 1024, 1024, 64, (2, 1, 128)), (128, 97, 97, 512, (2, 1, 128)), (128, 1025, 1025, 512, (2, 1, 128))]
    for d, n_k, n_q, heads, expected in [(d, n_k, n_q, None, e) for d, n_k, n_q, e in cases] + sized:
        cfg = half_gluon.get_config(n_k, d, n_q=n_q, heads=heads, sms=132)
        assert (cfg["consumers"], cfg["ctas_per_sm"], cfg["BLOCK_M"]) == expected, (d, n_k, n_q, heads)
        threads = 32 * (4 * cfg["consumers"] + 4)  # the producer warp is padded to a warpgroup
        assert cfg["maxnreg"] * threads * cfg["ctas_per_sm"] <= 65536
        workers = 128 * (24 + (cfg["consumers"] - 1) * cfg["consumer_regs"])
        assert (cfg["maxnreg"] * threads - workers) // 128 >= min(cfg["consumer_regs"], 232), (d, n_k, n_q)


def test_head_dim_128_calls_of_up_to_1024_keys_double_buffer_q():
    """D = 128 at up to D128_SHORT_KEYS keys: two Q buffers, so that O can leave by TMA stores through the Q tiles
    (the plan's own output in the inputs' dtype), beside 64-key tiles in four K / V stages with the consumers not in
    ping-pong, or, for a call of one key tile (up to 128 keys), that 128-key tile in two stages; from one key more
    128-key tiles in three stages and one Q buffer. The 128-key tiles keep ping-pong. Either way the Q tiles and the
    ring fit the SM's shared memory (64 x 128 x 2 bytes a consumer's Q tile, BLOCK_N x 128 x 2 a K or V tile), also
    with three consumers (512 heads of as many rows as keys on 132 SMs); D = 64 keeps its two Q buffers at every
    length."""
    from visionattn.kernels.introspect import HOPPER_SHARED_LIMIT

    bound = half_gluon.D128_SHORT_KEYS
    # keys -> (key tile, K / V stages, Q buffers)
    for n_k, expected in ((1, (128, 2, 2)), (97, (128, 2, 2)), (128, (128, 2, 2)), (129, (64, 4, 2)),
                          (300, (64, 4, 2)), (577, (64, 4, 2)), (bound, (64, 4, 2)), (bound + 1, (128, 3, 1)),
                          (1536, (128, 3, 1)), (4096, (128, 3, 1))):
        for cfg in (half_gluon.get_config(n_k, 128), half_gluon.get_config(n_k, 128, n_q=n_k, heads=512, sms=132)):
            assert (cfg["BLOCK_N"], cfg["STAGES"], cfg["q_buffers"]) == expected, n_k
            assert cfg["PINGPONG"] is (cfg["BLOCK_N"] == 128), n_k
            assert cfg["one_tile"] is (n_k <= 128) and sum(cfg["tail_keys"]) <= cfg["BLOCK_N"], n_k
            short = n_k <= bound
            assert half_gluon.tma_output(cfg, torch.bfloat16, torch.bfloat16, (8 * n_k * 128, 128, 8 * 128)) is short
            tiles = 2 * (cfg["q_buffers"] * cfg["BLOCK_M"] * 128 + cfg["STAGES"] * 2 * cfg["BLOCK_N"] * 128)
            assert tiles <= HOPPER_SHARED_LIMIT, (n_k, tiles)
    assert all(half_gluon.get_config(n_k, 64)["q_buffers"] == 2 for n_k in (100, 300, 1066, 4096))


def test_three_consumers_only_where_their_waves_of_work_tiles_finish_first():
    """The waves model behind the three-consumer choice: within one wave of SMs for both counts two consumers (128
    rows per CTA, a shorter chain each) always win; where both counts' work tiles fill whole waves, three do (their
    per-row speed); and the choice is what the model's two costs say, for lengths and head counts around the
    wave boundaries."""
    sms = 132
    for heads in (1, 8, 16, 33, 96, 140):
        for n_q in (1536, 2047, 4096, 4097, 8192, 16384, 32768):
            tiles2, tiles3 = heads * -(-n_q // 128), heads * -(-n_q // 192)
            three = half_gluon.three_consumers_faster(n_q, heads, sms)
            if tiles2 <= sms:
                assert not three, (heads, n_q)
            if tiles2 % sms == 0 and tiles3 % sms == 0:
                assert three, (heads, n_q)
            waves2, waves3 = -(-tiles2 // sms), -(-tiles3 // sms)
            assert three == (waves3 * 192 / half_gluon.THREE_CONSUMER_ROW_SPEED < waves2 * 128), (heads, n_q)
    assert half_gluon.THREE_CONSUMER_ROW_SPEED > 1  # else three never pay: 192 rows per tile, 1.5x 128


def test_key_pieces_cut_only_a_little_filled_last_round_of_long_head_dim_128_tiles():
    """key_pieces: pieces only for the long head-dim-128 build whose last key tile runs whole, and only where the
    persistent grid's last round is filled at most PIECE_MAX_FILL; the pieces cover the key tiles without an empty
    one, all of them fit the SMs in one round, and the cut is the cheapest by the stated cost (so never one that
    costs more than running the round whole). Head dim 64, short head-dim-128 calls and lengths whose last tile is
    cut keep whole work tiles."""
    sms = 132
    cut_any = False
    for heads in (1, 6, 8, 20, 24, 33, 40, 96):
        for n in (1025, 1100, 1500, 1536, 2048, 2100, 2304, 4096, 4608, 16384):
            cfg = half_gluon.get_config(n, 128, n_q=n, heads=heads, sms=sms)
            pieces, tiles = cfg["pieces"], cfg["piece_tiles"]
            n_kt = -(-n // 128)
            rem = -(-n // 128) * heads % sms
            if pieces == 1:
                assert tiles == 0
                continue
            cut_any = True
            assert cfg["BLOCK_N"] == 128 and cfg["q_buffers"] == 1 and cfg["tail_keys"] == (128, 0), (heads, n)
            assert 0 < rem <= sms * half_gluon.PIECE_MAX_FILL and rem * pieces <= sms, (heads, n)
            assert (pieces - 1) * tiles < n_kt <= pieces * tiles, (heads, n)
            assert tiles + half_gluon.PIECE_COST_TILES < n_kt, (heads, n)
            fitting = [-(-n_kt // p) for p in range(2, n_kt + 1) if rem * -(-n_kt // -(-n_kt // p)) <= sms]
            assert tiles == min(fitting), (heads, n)
    assert cut_any
    # Flux at 512 px on 132 SMs: 288 work tiles, 24 in the last round, 12 key tiles -> 4 pieces of 3
    flux = half_gluon.get_config(1536, 128, n_q=1536, heads=24, sms=sms)
    assert (flux["pieces"], flux["piece_tiles"]) == (4, 3)
    for cfg in (half_gluon.get_config(1536, 64, n_q=1536, heads=24, sms=sms),  # head dim 64
                half_gluon.get_config(1000, 128, n_q=1000, heads=24, sms=sms),  # the short build
                half_gluon.get_config(1040, 128, n_q=1040, heads=3, sms=sms),  # a last key tile cut to 16 keys
                half_gluon.get_config(1536, 128, n_q=1536, heads=40, sms=sms),  # 84 of 132 SMs: too full
                half_gluon.get_config(1536, 128)):  # no SM count
        assert cfg["pieces"] == 1 and cfg["piece_tiles"] == 0
    assert half_gluon.kernel_constexprs(flux, 128)["PIECES"] and not half_gluon.kernel_constexprs(cfg, 128)["PIECES"]


@pytest.mark.parametrize("write_lse", [False, True])
def test_the_piece_merge_gives_the_softmax_of_all_keys(write_lse):
    """_piece_merge_kernel (Triton; the interpreter on CPU) folds the partial states the forward kernel's pieces
    write (m in log2 units, S, O / S per piece, :func:`.half_gluon._store_piece`'s layout) into the rows of the split
    work tiles: their O equals the float64 softmax over all keys within float32 rounding, their LSE the float64 one;
    rows of whole work tiles and rows past Nq are left as they were."""
    from visionattn.kernels._launch import cdiv, pad_pow2

    torch.manual_seed(0)
    B, H, n_q, n_k, d, rows_t = 2, 3, 200, 300, 16, 128
    q, k, v = (torch.randn(B, H, n, d, dtype=torch.float64) for n in (n_q, n_k, n_k))
    scale = d ** -0.5
    s = scale * q @ k.transpose(-1, -2)
    tiles_m = cdiv(n_q, rows_t)
    n_work = B * H * tiles_m
    n_whole, pieces, piece_keys = 7, 3, 128  # work tiles 7..11 split into key ranges [0, 128), [128, 256), [256, 300)
    plane = (n_work - n_whole) * rows_t
    ws = torch.full((pieces * plane * (2 + d),), float("nan"), dtype=torch.float32)
    wm, wsum, wo = ws[:pieces * plane], ws[pieces * plane:2 * pieces * plane], ws[2 * pieces * plane:]
    log2e = 1.4426950408889634
    for j in range(n_work - n_whole):
        tile = n_whole + j
        bh, m0 = divmod(tile, tiles_m)
        b, h = divmod(bh, H)
        for p in range(pieces):
            keys = slice(p * piece_keys, min(n_k, (p + 1) * piece_keys))
            for r in range(rows_t):
                row = m0 * rows_t + r
                if row >= n_q:  # a row past Nq: the kernel writes what its zero query gives; any finite state
                    m, ssum, o = 0.0, 1.0, torch.zeros(d)
                else:
                    z = s[b, h, row, keys] * log2e
                    m = z.max().item()
                    pz = torch.exp2(z - m)
                    ssum, o = pz.sum().item(), (pz @ v[b, h, keys]) / pz.sum()
                rid = p * plane + j * rows_t + r
                wm[rid], wsum[rid], wo[rid * d:(rid + 1) * d] = m, ssum, o.float()
    out = torch.full((B, n_q, H, d), 7.0).transpose(1, 2)  # heads-inner, as the plans allocate it
    lse = torch.full((B, H, n_q), 7.0)
    block_p = pad_pow2(pieces)
    block_m = 8
    half_gluon._piece_merge_kernel[(cdiv(plane, block_m),)](
        ws, out, lse, out.stride(0), out.stride(1), out.stride(2), H, n_q, n_work, n_whole, pieces, ROWS=rows_t,
        HEAD_D=d, BLOCK_M=block_m, BLOCK_P=block_p, WRITE_LSE=write_lse)
    ref = torch.softmax(s, -1) @ v
    ref_lse = torch.logsumexp(s, -1)
    split = torch.zeros(B, H, n_q, dtype=torch.bool)
    for tile in range(n_whole, n_work):
        bh, m0 = divmod(tile, tiles_m)
        split[bh // H, bh % H, m0 * rows_t:(m0 + 1) * rows_t] = True
    assert split.any() and (~split).any()
    assert torch.allclose(out[split].double(), ref[split], rtol=1e-5, atol=1e-6)
    assert (out[~split] == 7.0).all()
    if write_lse:
        assert torch.allclose(lse[split].double(), ref_lse[split], rtol=1e-6, atol=1e-5)
        assert (lse[~split] == 7.0).all()
    else:
        assert (lse == 7.0).all()


@needs_gluon
def test_dispatch_takes_the_lengths_the_kernel_is_preferred_at(monkeypatch):
    """The launcher hands an in-scope fp16 / bf16 call to the Gluon kernel where ``preferred`` says it is ahead
    (D = 128: every length; D = 64: all but 65-128 keys, where one key tile is multiplied in full), keeps the
    Triton kernel elsewhere or when an explicit num_splits asks for split-KV, and plans the config of the
    call's query and key counts (193-224 rows: four consumer warpgroups)."""
    taken = []
    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    monkeypatch.setattr(elsa_fwd, "_gluon_device", lambda device: True)  # as if on a Hopper GPU
    monkeypatch.setattr(half_gluon, "unsupported_reason",
                        lambda *a: "split-KV requested" if a[-1] > 1 else None)
    monkeypatch.setattr(half_gluon, "planned_launch",
                        lambda q, k, v, cfg, *a, **kw: taken.append((q.shape, cfg)) or (lambda *a: None))
    monkeypatch.setattr(elsa_fwd, "choose_num_splits", lambda *a: 1)  # as if the grid fills the GPU
    cases = [(64, 64, 64, True), (64, 65, 64, False), (64, 128, 64, False), (64, 129, 64, True),
             (197, 197, 64, True), (64, 100, 128, True), (16, 16, 128, True)]
    for n_q, n_k, d, expected in cases:
        assert half_gluon.preferred(n_q, n_k, d) is expected
        q, k, v = _qkv(n_q=n_q, n_k=n_k, d=d)
        assert (elsa_fwd._gluon_plan("half", q, k, v, None, None, False, 0.125, 0, q.dtype) is not None) is expected
        assert elsa_fwd._gluon_plan("half", q, k, v, None, None, False, 0.125, 2, q.dtype) is None
    assert [shape[2:] for shape, _ in taken] == [(n_q, d) for n_q, _, d, e in cases if e]
    assert [cfg["consumers"] for _, cfg in taken] == [1, 1, 4, 2, 2]


def test_the_launcher_offers_each_mode_to_its_gluon_kernel(monkeypatch):
    """fp16 / bf16 calls go to the Hopper kernel's dispatch, fp32 calls to its split build's, fp32-ieee calls to the
    FMA kernel's, with the wish for the log-sum-exp (training) passed on; tf32 and explicit tile configs go straight
    to the Triton kernel, and so does an fp32-ieee call that wants the LSE (the FMA kernel does not write it)."""
    from visionattn.kernels._launch import PlanCache

    seen = []

    def gluon(kernel, q, k, v, *args):  # stands in for a Gluon kernel's plan: its output is all sevens
        seen.append((kernel, q.dtype, args[-1]))
        return lambda q, k, v, b, m, s: (torch.full((*q.shape[:3], v.shape[3]), 7.0, dtype=q.dtype),
                                         torch.zeros(q.shape[:3]) if args[-1] else None)

    monkeypatch.setattr(elsa_fwd, "_gluon_plan", gluon)
    monkeypatch.setattr(elsa_fwd, "PLANS", PlanCache())
    for mode, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32-ieee", torch.float32),
                        ("fp32", torch.float32)):
        q, k, v = _qkv(16, 16, 16, dtype)
        assert (elsa_fwd._launch(q, k, v, None, None, False, 0.25, mode, 0) == 7.0).all()
        out, lse = elsa_fwd.dense_forward(q, k, v, None, None, False, 0.25, mode, 0, None, with_lse=True)
        assert (out == 7.0).all() and lse.shape == q.shape[:3]
    assert seen == [("half", torch.float16, False), ("half", torch.float16, True), ("half", torch.bfloat16, False),
                    ("half", torch.bfloat16, True), ("fp32-ieee", torch.float32, False),
                    ("fp32-ieee", torch.float32, True), ("fp32", torch.float32, False), ("fp32", torch.float32, True)]
    q, k, v = _qkv(16, 16, 16, torch.float32)
    assert isinstance(elsa_fwd._launch(q, k, v, None, None, False, 0.25, "tf32", 0), torch.Tensor)
    q, k, v = _qkv(16, 16, 16, torch.float16)
    cfg = elsa_fwd.get_config("fp16", 16)
    assert isinstance(elsa_fwd._launch(q, k, v, None, None, False, 0.25, "fp16", 0, config=cfg), torch.Tensor)
    assert len(seen) == 8
    monkeypatch.undo()
    q, k, v = _qkv(16, 16, 16, torch.float32)  # the real dispatch: no LSE from the FMA kernel
    assert elsa_fwd._gluon_plan("fp32-ieee", q, k, v, None, None, False, 0.25, 0, torch.float32, True) is None


@needs_gluon
def test_a_bad_out_dtype_is_refused_before_any_gluon_kernel_is_tried(monkeypatch):
    """A caller's bad ``out_dtype`` raises TypeError before dispatch, so it neither reaches a Gluon kernel nor
    marks one as failed (which would warn and keep it off for the rest of the process)."""
    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    monkeypatch.setattr(elsa_fwd, "_gluon_device", lambda device: True)  # as if on a Hopper GPU
    monkeypatch.setattr(half_gluon, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(half_gluon, "planned_launch", lambda *a, **kw: pytest.fail("planned with a bad out_dtype"))
    q, k, v = _qkv(16, 2048)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="output dtype torch.int8"):
            elsa_fwd._launch(q, k, v, None, None, False, 0.125, "fp16", 0, out_dtype=torch.int8)
    assert elsa_fwd._GLUON_FAILED == {}


@needs_gluon
@pytest.mark.parametrize("kernel", ["fp32-ieee", "half"])
def test_a_failing_gluon_kernel_warns_once_and_the_triton_kernel_takes_over(monkeypatch, kernel):
    """No silent fallback: if this Triton's Gluon cannot build a kernel, the first call it would take
    warns with the reason and every call (that one included) goes to the Triton kernel."""
    module, mode, dtype = {"fp32-ieee": (ieee_gluon, "fp32-ieee", torch.float32),
                           "half": (half_gluon, "fp16", torch.float16)}[kernel]
    calls = []
    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    monkeypatch.setattr(elsa_fwd, "_gluon_device", lambda device: True)  # as if on a GPU, in scope
    monkeypatch.setattr(module, "unsupported_reason", lambda *a: None)

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("no such Gluon op")

    monkeypatch.setattr(module, "planned_launch", lambda *a, **kw: broken)
    q, k, v = _qkv(16, 256, 64, dtype)
    with pytest.warns(RuntimeWarning, match=f"Gluon {kernel} kernel cannot run .RuntimeError: no such Gluon op"):
        plan, (out, _) = elsa_fwd._plan_and_run(q, k, v, None, None, False, 0.125, mode, 1, None, False)
    assert isinstance(plan, elsa_fwd._TritonPlan) and torch.isfinite(out).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan, _ = elsa_fwd._plan_and_run(q, k, v, None, None, False, 0.125, mode, 1, None, False)
    assert isinstance(plan, elsa_fwd._TritonPlan)
    assert calls == [1]  # not retried


@pytest.mark.parametrize("kernel", ["fp32-ieee", "half"])
def test_a_missing_gluon_api_warns_once_only_for_calls_the_kernel_would_take(monkeypatch, kernel):
    """A Triton without the Gluon pieces a kernel needs: the launcher warns once, naming the import error,
    when a call would otherwise have been in scope (the error is the last reason); no warning for a call the
    kernel would not have taken anyway."""
    module, dtype = {"fp32-ieee": (ieee_gluon, torch.float32), "half": (half_gluon, torch.float16)}[kernel]
    monkeypatch.setattr(elsa_fwd, "_GLUON_FAILED", {})
    monkeypatch.setattr(elsa_fwd, "_gluon_device", lambda device: True)  # as if on a GPU
    monkeypatch.setattr(module, "_IMPORT_ERROR", "Gluon unavailable in this Triton (test)")
    q, k, v = _qkv(16, 2048, 64, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert elsa_fwd._gluon_plan(kernel, q, k, v, None, None, True, 0.125, 0, dtype) is None  # causal: out of scope
    monkeypatch.setattr(module, "unsupported_reason", lambda *a: module._IMPORT_ERROR)  # as if on a capable GPU
    with pytest.warns(RuntimeWarning, match=r"Gluon unavailable in this Triton \(test\)"):
        assert elsa_fwd._gluon_plan(kernel, q, k, v, None, None, False, 0.125, 0, dtype) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert elsa_fwd._gluon_plan(kernel, q, k, v, None, None, False, 0.125, 0, dtype) is None


# --------------------------------------------------------------------------------------- GPU
def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the kernel is Hopper-only (wgmma, TMA)")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,Nq,Nk,D", [(1, 8, 4096, 4096, 64), (2, 3, 1000, 2049, 64), (1, 1, 1, 2048, 64),
                                         (1, 2, 4097, 4100, 128), (2, 3, 300, 2100, 128), (1, 4, 129, 65536, 64),
                                         (4, 48, 300, 100, 64), (3, 40, 257, 200, 128), (2, 70, 1000, 2049, 64),
                                         (2, 3, 300, 1050, 64), (1, 2, 500, 10410, 64), (64, 12, 197, 197, 128),
                                         (8, 12, 197, 197, 64), (2, 3, 300, 1066, 64), (16, 12, 197, 197, 64),
                                         (2, 80, 210, 256, 64), (2, 70, 193, 100, 64), (1, 140, 224, 17, 64),
                                         (64, 12, 50, 50, 64), (8, 12, 80, 80, 64), (2, 6, 300, 25, 128),
                                         (2, 70, 1100, 2100, 64), (2, 70, 1700, 1570, 64), (1, 16, 16384, 16384, 64),
                                         (4, 40, 384, 384, 128), (4, 40, 385, 385, 128), (2, 70, 129, 129, 128),
                                         (2, 70, 1000, 1000, 128), (1, 80, 1025, 1025, 128), (8, 40, 513, 513, 128)])
def test_matches_the_oracle_and_is_what_half_modes_dispatch_to(B, H, Nq, Nk, D, dtype):
    """Same error vs the float64 oracle as the Triton kernel, odd row / key counts (TMA zero-fills the
    tails, the last key tile is masked and cut to 16 / 32 / 64 / 128 keys or split in two parts: 64 + 16, 32 + 16),
    one or two key tiles, one, two, three or four consumer warpgroups per CTA (four: 193-224 rows, 64-key tiles, where
    the heads fill the SMs; 8 x 12 heads at 197 rows take one consumer; three: 140 heads of 1100 or 1700 rows (a
    last key tile in two parts) and 16 heads of 16384 on 132 SMs), head dim 128 up to 1024 keys (64-key tiles,
    four stages, two Q buffers: 129-1000 keys; three consumers at 140 heads of 129 rows and 320 of 513 on 132 SMs)
    and just past them (1025), programs that take several work tiles (the
    persistent grid: barrier phases carried from tile to tile), and ``elsa_attention`` returns exactly this
    kernel's output where it dispatches to it, as does a call that wants the log-sum-exp, whose LSE is as accurate
    as the Triton kernel's."""
    from visionattn.kernels._launch import GluonForwardPlan
    from visionattn.kernels.elsa_fwd import _launch, elsa_attention, get_config
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    mode = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, device="cuda", generator=g).to(dtype) for n in (Nq, Nk, Nk))
    scale = D ** -0.5
    y = half_gluon.half_attention(q, k, v, scale)
    rows = torch.randperm(Nq, device="cuda")[:256]
    ref = oracle_attention(q[:, :, rows], k, v, scale=scale)
    err = rel_l2(y[:, :, rows], ref)
    triton_y = _launch(q, k, v, None, None, False, scale, mode, 1, config=get_config(mode, D, D, Nk))
    triton_err = rel_l2(triton_y[:, :, rows], ref)
    assert torch.isfinite(y).all() and err <= 1.25 * triton_err + 1e-5, (err, triton_err)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    four = D == 64 and Nq in half_gluon.FOUR_CONSUMER_ROWS and Nk <= half_gluon.FOUR_CONSUMER_MAX_KEYS and B * H >= sms
    assert (half_gluon.config_for(q, k)["consumers"] == 4) is four
    three = ((Nk >= half_gluon.ONE_CONSUMER_BELOW if D == 64 else 128 < Nk <= half_gluon.D128_SHORT_KEYS)
             and half_gluon.three_consumers_faster(Nq, B * H, sms))
    assert (half_gluon.config_for(q, k)["consumers"] == 3) is three
    if B * H * -(-Nq // 128) >= sms and half_gluon.preferred(Nq, Nk, D):
        assert torch.equal(elsa_attention(q, k, v, None, None, False, scale, mode), y)
        # training calls take the same kernel with the LSE write: the same output, and an LSE as close to the
        # float64 one as the Triton kernel's
        plan, (y_lse, lse) = elsa_fwd.plan_for(q, k, v, None, None, False, scale, mode, 0, None, True)
        assert isinstance(plan, GluonForwardPlan) and torch.equal(y_lse, y)
        lse_ref = torch.logsumexp(scale * q[:, :, rows].double() @ k.double().transpose(-1, -2), dim=-1)
        _, (_, triton_lse) = elsa_fwd._plan_and_run(q, k, v, None, None, False, scale, mode, 1, None, True,
                                                    config=get_config(mode, D, D, Nk))
        lse_err = (lse[:, :, rows].double() - lse_ref).abs().max().item()
        triton_lse_err = (triton_lse[:, :, rows].double() - lse_ref).abs().max().item()
        assert lse_err <= 2 * triton_lse_err + 1e-5, (lse_err, triton_lse_err)


def _launch_with_lse(q, k, v, scale, cfg):
    # (O, LSE) of one planned launch of config cfg into the plan's own output
    from visionattn.kernels._launch import allocate_output

    B, H, Nq, D = q.shape
    out, _ = allocate_output(q, Nq, v.shape[-1], q.dtype)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    half_gluon.planned_launch(q, k, v, cfg, write_lse=True, out_dtype=q.dtype)(q, k, v, scale, out, lse)
    return out, lse


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,H_kv,Nq,Nk", [(1, 24, 24, 1536, 1536), (2, 12, 12, 2304, 2304), (2, 3, 3, 300, 2100),
                                             (1, 24, 8, 1536, 1536), (2, 12, 12, 2200, 2500)])
def test_key_pieces_match_the_oracle_and_leave_whole_tiles_bit_equal(B, H, H_kv, Nq, Nk, dtype):
    """Head dim 128 with key pieces for a little-filled last round (the rule's P where it cuts on this GPU, else 4
    pieces forced): O within the whole-tile build's error vs the float64 oracle on the split tiles' rows, the rows of
    whole work tiles bit-equal to the whole-tile build's (the same kernel and fold), the LSE within the whole-tile
    build's error, repeated calls bit-identical; also with every work tile split (300 query rows: fewer work tiles
    than SMs), over grouped-query K / V heads, and with query rows and keys of different counts."""
    from visionattn.kernels._launch import cdiv
    from visionattn.metrics import rel_l2

    D = 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, Nq, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(B, H_kv, Nk, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    scale = D ** -0.5
    lib = half_gluon.config_for(q, k)
    n_kt = cdiv(Nk, 128)
    pieces = dict(lib, pieces=4, piece_tiles=cdiv(n_kt, 4)) if lib["pieces"] == 1 else lib
    whole = dict(lib, pieces=1, piece_tiles=0)

    def run(cfg):
        return _launch_with_lse(q, k, v, scale, cfg)

    (y, lse), (y_whole, lse_whole) = run(pieces), run(whole)
    y2, lse2 = run(pieces)
    assert torch.equal(y, y2) and torch.equal(lse, lse2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles_m = cdiv(Nq, 128)
    n_work = B * H * tiles_m
    n_whole = half_gluon.whole_tiles(pieces, n_work, q.device)
    assert n_whole == n_work // sms * sms
    split = torch.zeros(B, H, Nq, dtype=torch.bool, device="cuda")
    for tile in range(n_whole, n_work):
        bh, m0 = divmod(tile, tiles_m)
        split[bh // H, bh % H, m0 * 128:(m0 + 1) * 128] = True
    assert torch.equal(y[~split], y_whole[~split])
    assert torch.equal(lse[~split], lse_whole[~split])
    kr, vr = (t.repeat_interleave(H // H_kv, dim=1) for t in (k, v))
    rows = torch.nonzero(split[-1, -1]).flatten()[:256]  # the last work tile is always split
    assert rows.numel() > 0
    s64 = scale * q[-1:, -1:, rows].double() @ kr[-1:, -1:].double().transpose(-1, -2)
    ref = torch.softmax(s64, -1) @ vr[-1:, -1:].double()
    err, err_whole = rel_l2(y[-1:, -1:, rows], ref), rel_l2(y_whole[-1:, -1:, rows], ref)
    assert torch.isfinite(y).all() and err <= 1.25 * err_whole + 1e-5, (err, err_whole)
    lse_ref = torch.logsumexp(s64, -1)
    lse_err = (lse[-1:, -1:, rows].double() - lse_ref).abs().max().item()
    lse_err_whole = (lse_whole[-1:, -1:, rows].double() - lse_ref).abs().max().item()
    assert lse_err <= 2 * lse_err_whole + 1e-5, (lse_err, lse_err_whole)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,H_kv,N", [(8, 40, 10, 513), (4, 128, 128, 300)])
def test_three_consumers_at_head_dim_128_match_two_bit_for_bit(B, H, H_kv, N, dtype):
    """Head dim 128's 64-key tiles on three consumer warpgroups (the rule's config for these heads on 132 SMs):
    O and the LSE bit-equal to the two-consumer build's (each row folds the same key tiles in the same order), over
    grouped-query K / V heads and with a last work tile of 129 rows (513) or 108 (300), and O within the dtype's
    unit roundoff of the float64 oracle (rel. L2) on rows of the last work tile."""
    from visionattn.metrics import rel_l2

    D = 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, N, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(B, H_kv, N, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    scale = D ** -0.5
    three = half_gluon.get_config(N, D, n_q=N, heads=B * H, sms=132)
    two = half_gluon.get_config(N, D)
    assert (three["consumers"], two["consumers"]) == (3, 2) and not three["PINGPONG"] and not two["PINGPONG"]

    (y, lse), (y_two, lse_two) = _launch_with_lse(q, k, v, scale, three), _launch_with_lse(q, k, v, scale, two)
    assert torch.isfinite(y).all() and torch.equal(y, y_two) and torch.equal(lse, lse_two)
    rows = torch.arange(N // 192 * 192, N, device="cuda")
    kr, vr = (t.repeat_interleave(H // H_kv, dim=1)[-1:, -1:].double() for t in (k, v))
    ref = torch.softmax(scale * q[-1:, -1:, rows].double() @ kr.transpose(-1, -2), -1) @ vr
    assert rel_l2(y[-1:, -1:, rows], ref) <= 2.0 ** -(torch.finfo(dtype).nmant + 1)


@pytest.mark.gpu
@needs_hopper
def test_unbind_views_and_float32_output():
    """timm-style qkv.unbind views (strided, no copy) and a float32 output divided once from W / S."""
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    B, N, H, D = 2, 4096, 12, 64
    q, k, v = torch.randn(B, N, 3, H, D, device="cuda").half().permute(2, 0, 3, 1, 4).unbind(0)
    assert half_gluon.unsupported_reason(q, k, v, None, None, False, 0.125, 0) is None
    rows = torch.arange(0, N, 17, device="cuda")
    ref = oracle_attention(q[:, :, rows], k, v)
    y = half_gluon.half_attention(q, k, v, D ** -0.5)
    assert y.dtype == torch.float16 and rel_l2(y[:, :, rows], ref) <= 1e-3
    y32 = half_gluon.half_attention(q, k, v, D ** -0.5, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and rel_l2(y32[:, :, rows], ref) <= rel_l2(y[:, :, rows], ref)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("write_lse", [False, True])
def test_later_calls_encode_the_tensor_maps_themselves_with_the_same_results(write_lse):
    """After its first (compiling) call a planned launch hands Triton's launcher tensor maps it encodes itself
    (KernelCall.with_descriptors, no descriptor objects): outputs and LSE bit for bit those of the first call,
    on the same tensors and on other tensors of the plan's layout (other addresses: the maps follow them)."""
    from visionattn.kernels._launch import heads_inner_output

    B, N, H, D = 2, 1025, 12, 64
    cfg = half_gluon.get_config(N, D, n_q=N)

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return torch.randn(B, N, 3, H, D, device="cuda", generator=g).half().permute(2, 0, 3, 1, 4).unbind(0)

    def run(launch, q, k, v):
        out = heads_inner_output(q, N, D, torch.float16)
        lse = torch.empty(B, H, N, device="cuda") if write_lse else None
        launch(q, k, v, D ** -0.5, out, lse)
        return out, lse

    first, second = inputs(0), inputs(1)
    launch = half_gluon.planned_launch(*first, cfg, write_lse)
    a = run(launch, *first)
    assert launch.descriptors_direct()
    b, c = run(launch, *first), run(launch, *second)
    fresh = half_gluon.planned_launch(*second, cfg, write_lse)
    d = run(fresh, *second)  # a new plan's first call: descriptor objects through Triton's wrapper
    for x, y in ((a, b), (c, d)):
        assert torch.equal(x[0], y[0]) and (not write_lse or torch.equal(x[1], y[1]))
    assert not torch.equal(a[0], c[0])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("B, H, N, D, dtype", [(64, 12, 197, 64, torch.float16), (3, 12, 1025, 64, torch.bfloat16),
                                               (2, 8, 4097, 64, torch.float16), (2, 4, 100, 64, torch.bfloat16),
                                               (16, 12, 300, 128, torch.bfloat16), (3, 8, 384, 128, torch.float16),
                                               (2, 4, 97, 128, torch.float16)])
def test_o_by_tma_stores_equals_o_stored_from_registers(B, H, N, D, dtype):
    """The TMA_OUT build (O staged in the consumer's Q tile, one TMA store per consumer, rows past N clipped by the
    descriptor) writes the same bits as the build storing from registers, on every consumer count the shapes take
    (four at 197 rows, one at 1025, three at 4097 on an H100 / H200, the short call's one; head dim 128 up to 1024
    keys, two consumers), batches side by side in the heads-inner buffer (a row past N would land on the
    next batch item's rows), first and direct launches."""
    from visionattn.kernels._launch import heads_inner_layout, heads_inner_output

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = torch.randn(B, N, 3, H, D, device="cuda", generator=g).to(dtype).permute(2, 0, 3, 1, 4).unbind(0)
    cfg = half_gluon.config_for(q, k)
    tma = half_gluon.planned_launch(q, k, v, cfg)
    plain = half_gluon.planned_launch(q, k, v, cfg, out_strides=heads_inner_layout(B, H, N, D)[1][:3])
    assert tma.o_base == "out" and plain.o_base == "q"
    for _ in range(2):  # the first call, then the direct descriptor launch
        outs = [heads_inner_output(q, N, D, dtype) for _ in range(2)]
        tma(q, k, v, D ** -0.5, outs[0])
        plain(q, k, v, D ** -0.5, outs[1])
        assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@needs_hopper
def test_inside_torch_compile_and_a_cuda_graph():
    """The Gluon path through visionattn.attention under torch.compile (the custom op) and replayed from a
    captured CUDA graph with new inputs (the TMA descriptors are kernel parameters, captured by value)."""
    import visionattn
    from visionattn.metrics import rel_l2
    from visionattn.reference import oracle_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, N, D = 1, 8, 4096, 64
    q, k, v = (torch.randn(B, H, N, D, device="cuda", generator=g).half() for _ in range(3))
    rows = torch.arange(0, N, 31, device="cuda")

    def f(q, k, v):
        return visionattn.attention(q, k, v, mode="fp16", backend="triton") * 2.0

    y = torch.compile(f, fullgraph=True)(q, k, v)
    assert rel_l2(y[:, :, rows] / 2.0, oracle_attention(q[:, :, rows], k, v)) <= 1e-3
    assert torch.equal(y / 2.0, half_gluon.half_attention(q, k, v, D ** -0.5))  # it took the Gluon kernel

    static = [t.clone() for t in (q, k, v)]
    f(*static)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(*static)
    q2, k2, v2 = (torch.randn(B, H, N, D, device="cuda", generator=g).half() for _ in range(3))
    for s, t in zip(static, (q2, k2, v2)):
        s.copy_(t)
    graph.replay()
    assert rel_l2(out[:, :, rows] / 2.0, oracle_attention(q2[:, :, rows], k2, v2)) <= 1e-3


@needs_gluon
def test_a_cached_launch_plan_keeps_no_tensor_of_its_first_call_alive(monkeypatch):
    """The plan's TMA descriptor templates keep shapes, strides and layouts, not the first call's q / k / v: those
    (and the qkv buffer they view) are freed once the caller drops them, whatever stays in the plan cache."""
    import gc
    import weakref

    monkeypatch.setattr(half_gluon, "sm_count", lambda device: 132)  # the plan is built on CPU tensors here
    qkv = torch.randn(1, 256, 3, 2, 64).half()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # views of one buffer, as a timm / VGGT block makes them
    ref = weakref.ref(qkv)
    launch = half_gluon.planned_launch(q, k, v, half_gluon.get_config(256, 64, n_q=256), True)
    del qkv, q, k, v
    gc.collect()
    assert callable(launch) and ref() is None


@needs_gluon
def test_o_is_written_by_tma_stores_where_a_q_tile_can_hold_it(monkeypatch):
    """``tma_output``: head dim 64 (Q double-buffered: the consumer's Q tile holds O while the next work tile's Q
    loads into the other buffer), O in the inputs' dtype at 16-byte-aligned strides; not at head dim 128 (one Q
    buffer), for a float32 output, the split build or an unaligned row stride. A plan then rebases its fourth
    descriptor onto each call's output and builds the TMA_OUT kernel; otherwise q's descriptor stands in, unread,
    as for a plan writing into a view of a larger buffer (``out_strides``: its offset may be unaligned)."""
    from visionattn.kernels._launch import heads_inner_layout

    monkeypatch.setattr(half_gluon, "sm_count", lambda device: 132)  # the plans are built on CPU tensors here
    cfg64, cfg128 = half_gluon.get_config(4096, 64), half_gluon.get_config(4096, 128)
    s64, s128 = heads_inner_layout(1, 8, 4096, 64)[1][:3], heads_inner_layout(1, 8, 4096, 128)[1][:3]
    f16 = torch.float16
    assert half_gluon.tma_output(cfg64, f16, f16, s64)
    assert half_gluon.tma_output(cfg64, torch.bfloat16, torch.bfloat16, s64)
    assert not half_gluon.tma_output(cfg128, f16, f16, s128)
    assert not half_gluon.tma_output(cfg64, torch.float32, f16, s64)
    assert not half_gluon.tma_output(dict(cfg64, parts=2), f16, f16, s64)
    assert not half_gluon.tma_output(cfg64, f16, f16, (s64[0], s64[1], 8 * 64 + 4))  # rows 1032 bytes apart
    q, k, v = _qkv(n_q=4096, n_k=4096)
    for kwargs, o_base in (({}, "out"), ({"out_dtype": torch.float32}, "q"), ({"out_strides": s64}, "q")):
        plan = half_gluon.planned_launch(q, k, v, cfg64, **kwargs)
        assert plan.o_base == o_base and plan.call.constexprs["TMA_OUT"] == (o_base == "out"), kwargs
        assert len(plan.templates) == 4 and all(t.base is None for t in plan.templates)
    q, k, v = _qkv(n_q=4096, n_k=4096, d=128)
    plan = half_gluon.planned_launch(q, k, v, cfg128)
    assert plan.o_base == "q" and not plan.call.constexprs["TMA_OUT"]


def test_direct_descriptor_launches_are_offered_only_where_the_launcher_layout_is_known():
    """KernelCall.with_descriptors answers None, never raises, before the first launch and for launchers that do
    not wrap descriptors as Triton 3.4-3.6 do (a C launcher, another closure): the plan then keeps passing
    descriptor objects through Triton's own wrapper."""
    import types

    import triton
    import triton.language as tl

    from visionattn.kernels._launch import KernelCall

    @triton.jit
    def kernel(X, N, BLOCK: tl.constexpr):
        tl.store(X + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32), mask=tl.arange(0, BLOCK) < N)

    call = KernelCall(kernel, (1,), {"BLOCK": 16}, {})
    assert call.with_descriptors([]) is None  # nothing compiled yet

    def other_wrapper(*args):
        return args

    for launch in (len, other_wrapper, lambda *a, launcher=None: launcher):
        call._parts = (types.SimpleNamespace(launch=launch, launch_cooperative_grid=False, launch_pdl=False,
                                             global_scratch_size=0, profile_scratch_size=0), None, None, None, None)
        assert call.with_descriptors([]) is None
