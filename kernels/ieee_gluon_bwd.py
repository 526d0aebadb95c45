"""FP32-IEEE attention backward in Gluon: dK/dV (+ dQ) and dQ kernels with FMA products on a register-blocked layout.

Mode ``fp32-ieee`` multiplies with FP32 FMAs, no tensor cores. Triton's ``tl.dot(..., input_precision="ieee")``
chooses a thread layout in which each thread re-reads far more operands from shared memory than it multiplies,
and in the backward's register-heavy kernels (two accumulators, four products per tile) it runs at a fraction
of the FMA peak. As in the forward (:mod:`.ieee_gluon`), the layout is chosen here instead: each thread owns
``SPT_M x 4`` elements of a tile per 32-column repeat and multiplies 16-wide chunks of the reduction dim read
as vectors from swizzled shared tiles (``gl.dot_fma``).

Same algebra as the Triton backward (:mod:`.elsa_bwd`, FlashAttention-2's Alg. 2 from the saved log-sum-exp):

* :func:`_ieee_dkdv_kernel`: one program per (key tile, head, batch) holds ``K_j, V_j`` in shared memory and the
  ``dK_j, dV_j`` accumulators in registers and streams the query tiles (``Q_i``, ``dO_i`` through a cp.async
  ring): ``S^T = K Q^T``, ``P^T = exp(scale S^T - lse)``, ``dP^T = V dO^T``, ``dS^T = P^T (dP^T - delta)``,
  ``dV += P^T dO``, ``dK += dS^T Q``.
* :func:`_ieee_dq_kernel`: one program per (query tile, head, batch) holds ``Q_i, dO_i`` and the ``dQ_i``
  accumulator and streams the key tiles: ``S = Q K^T``, ``P``, ``dP = dO V^T``, ``dS``, ``dQ += dS K``.

By default one pass does all (``get_config()["single_pass"]``): the dK/dV kernel also forms each query tile's
``dS K`` and adds it into the FP32 dQ, so the dQ kernel and its recomputation of ``S`` and ``dP`` go (five
tile products per tile pair instead of seven). The adds into a query tile run in key-tile order, handed on
through an int32 counter per query tile, as in :mod:`.elsa_bwd`'s single pass: key tile ``j`` waits only for
key tile ``j - 1`` of its head, a lower program id, so the wait ends as long as the GPU starts programs in id
order. FMA products are slow enough that the ordered adds cost little next to the two products they save,
unlike half precision on tensor cores.

Each tile's product into an accumulator is formed apart and added once (one rounding per tile, as the
Triton kernels' FP32 products), every sum in a fixed order: the gradients are bit-for-bit reproducible.
``delta`` and the row ``lse`` come from :mod:`.elsa_bwd`'s preprocess kernel.

Scope (:func:`unsupported_reason`): the forward Gluon kernel's (CUDA, compute capability >= 8.0, no bias / mask /
causal, 16-byte-aligned rows with a contiguous head dim), for the output gradient too, at head dim 32, 64 or 128 for
Q/K and V. Other calls take the Triton kernels. Gluon cannot run under ``TRITON_INTERPRET=1``; CPU tests
compile these kernels offline for sm_90, ``pytest -m gpu`` checks their gradients against the float64 oracle.
"""
from __future__ import annotations

import torch

from ._gluon import scope_reason
from ._host import cdiv
from ._launch import SPIN_UNTIL_EQUAL_PTX, KernelCall

try:  # Gluon is experimental: its API moves between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from .ieee_gluon import fma_layout, issue_pair, row_load_layout

    # renamed from thread_barrier to barrier after triton 3.6
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _SPIN_PTX = gl.constexpr(SPIN_UNTIL_EQUAL_PTX)
    _IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = f"Gluon unavailable in this Triton ({exc})"

__all__ = ["unsupported_reason", "get_config", "kernel_constexprs", "planned_launch", "HEAD_DIMS", "TWO_PASS_HEAD_DIMS"]

HEAD_DIMS = (32, 64, 128)
# where the two-kernel path (single_pass=False) is spill-free too: at 128 every dQ tile tried spills registers,
# so head dim 128 runs in one pass only
TWO_PASS_HEAD_DIMS = (32, 64)
_LOG2E = 1.4426950408889634


def get_config(head_dim: int) -> dict:
    """Tiles by head dim, one entry per kernel: ``BLOCK_HELD`` rows a program holds (keys in the dK/dV kernel,
    queries in the dQ kernel), ``BLOCK_STREAMED`` rows streamed per step, ``SPT_M`` rows per thread,
    ``num_warps``; ``KC`` (reduction chunk) and ``STAGES`` (cp.async ring depth) shared. The dQ kernel holds
    half the rows of the dK/dV kernel, which keeps two accumulators: with 64 held rows its operand chunks
    spill registers. ``single_pass``: the dK/dV kernel also adds dQ and no dQ kernel runs (five products per
    tile pair instead of seven): 1.1-1.5x faster from 1024 keys on and even at ViT-B/16 224 (docs/tuning.md:
    fp32-ieee backward in one pass), so on at every length (and the only path at head dim 128, see
    :data:`TWO_PASS_HEAD_DIMS`)."""
    # 64 held keys at D = 64; at D = 32 the 64-key tile spills (the compiler's occupancy choice), at D = 128
    # it spills too, and 32 x 32 (one program per SM) beats 32 x 16 and 16 x 32 (two per SM)
    held = 64 if head_dim == 64 else 32
    return {"dkdv": {"BLOCK_HELD": held, "BLOCK_STREAMED": 32, "SPT_M": held // 16, "num_warps": 4},
            "dq": {"BLOCK_HELD": 32, "BLOCK_STREAMED": 32, "SPT_M": 2, "num_warps": 4},
            "KC": 16, "STAGES": 2, "single_pass": True}


def unsupported_reason(q, k, v, grad_out, bias, attn_mask, is_causal: bool, scale: float) -> str | None:
    """Why the Gluon backward cannot run this call (the Triton kernels then do), or ``None``.

    Inputs as :func:`.elsa_bwd.launch_backward` sees them: q [B, H, Nq, D], k [B, H, Nk, D], v [B, H, Nk, Dv],
    grad_out [B, H, Nq, Dv], all float32.
    """
    reason = scope_reason(q, k, v, bias, attn_mask, is_causal, scale, 1, dtypes=(torch.float32,),
                          head_dims=HEAD_DIMS, stride_elems=4,
                          stride_text="rows are not 16-byte aligned with a contiguous head dim",
                          capable=lambda cc: cc >= (8, 0), capable_text="compute capability below 8.0 (no cp.async)",
                          import_error=_IMPORT_ERROR)
    if reason is None and (grad_out.dtype != torch.float32 or grad_out.stride(-1) != 1
                           or any(s % 4 for s in grad_out.stride()[:-1]) or grad_out.data_ptr() % 16):
        reason = "grad_out is not float32 with 16-byte-aligned rows and a contiguous head dim"
    return reason


if _IMPORT_ERROR is None:

    @gluon.jit
    def _program_tile(n, BLOCK: gl.constexpr, H):
        # (batch * H + head, head, batch, first row) of this program in a 1-D grid of cdiv(n, BLOCK) * H * B
        tiles = gl.cdiv(n, BLOCK)
        pid = gl.program_id(0)
        bh = (pid // tiles).to(gl.int64)
        return bh, bh % H, bh // H, (pid % tiles) * BLOCK

    @gluon.jit
    def _fma_nt(a_smem, b_smem, acc, a_l: gl.constexpr, b_l: gl.constexpr, HEAD_D: gl.constexpr, KC: gl.constexpr):
        # acc + A B^T for A [R, HEAD_D], B [C, HEAD_D] in shared memory: reduction over the head dim
        for kk in gl.static_range(0, HEAD_D, KC):
            b = b_smem.slice(kk, KC, dim=1).permute((1, 0)).load(b_l)
            acc = gl.dot_fma(a_smem.slice(kk, KC, dim=1).load(a_l), b, acc)
        return acc

    @gluon.jit
    def _fma_nn(a_smem, b_smem, acc, a_l: gl.constexpr, b_l: gl.constexpr, RED: gl.constexpr, KC: gl.constexpr):
        # acc + A B for A [R, RED], B [RED, HEAD_D] in shared memory: reduction over RED streamed or held rows
        for kk in gl.static_range(0, RED, KC):
            acc = gl.dot_fma(a_smem.slice(kk, KC, dim=1).load(a_l), b_smem.slice(kk, KC, dim=0).load(b_l), acc)
        return acc

    @gluon.jit
    def _dq_ordered_add(part, DQ, sem_ptr, seen, pid_n, rows, offs_d, Nq, HEAD_D: gl.constexpr):
        # add key tile pid_n's dQ share ``part`` [BLOCK_M, HEAD_D] into DQ's rows in key-tile order: wait until
        # the query tile's counter says every lower key tile has added, add, pass the turn on (the order, not
        # the timing, fixes the sums: dQ is bit-for-bit reproducible)
        gl.inline_asm_elementwise(_SPIN_PTX, "=r,r,l,r", [seen, sem_ptr, pid_n], dtype=gl.int32,
                                  is_pure=False, pack=1)
        offs = rows.to(gl.int64)[:, None] * HEAD_D + offs_d[None, :]
        gl.atomic_add(DQ + offs, part, mask=(rows < Nq)[:, None], sem="relaxed")
        _cta_barrier()  # every thread's adds are issued before the turn passes (the release orders them)
        gl.atomic_xchg(sem_ptr, pid_n + 1, sem="release")

    @gluon.jit(do_not_specialize=["Nq", "Nk"])  # a new length compiles nothing new
    def _ieee_dkdv_kernel(Q, K, V, DO, Delta, LseRow, DK, DV, DQ, Sem, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                          sdb, sdh, sdm, H, Nq, Nk, scale,
                          BLOCK_HELD: gl.constexpr, BLOCK_STREAMED: gl.constexpr, HEAD_D: gl.constexpr,
                          KC: gl.constexpr, STAGES: gl.constexpr, SPT_M: gl.constexpr, NUM_WARPS: gl.constexpr,
                          DQ_ORDERED: gl.constexpr):
        # One (key tile, head, batch) program, 1-D grid cdiv(Nk, BLOCK_HELD) * H * B; [keys, queries] tiles.
        # DK, DV contiguous [B, H, Nk, D]. Keys >= Nk read zeros and only reach their own, unstored rows; queries
        # >= Nq read zeros and lse = +inf, so their P and dS are 0. DQ_ORDERED (single pass): also add each query
        # tile's scale * dS K into DQ (contiguous [B, H, Nq, D] FP32, zeroed) in key-tile order through the
        # int32 counters Sem [B * H, >= cdiv(Nq, BLOCK_STREAMED)] (zeroed); key tile j waits only for key tile
        # j - 1 of its head, a lower program id.
        BLOCK_N: gl.constexpr = BLOCK_HELD
        BLOCK_M: gl.constexpr = BLOCK_STREAMED
        blk: gl.constexpr = fma_layout(SPT_M, NUM_WARPS)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=blk, k_width=0)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=blk, k_width=0)
        # the dQ share [BLOCK_M, HEAD_D]: BLOCK_M // 16 rows per thread cover its rows once
        blk_q: gl.constexpr = fma_layout(BLOCK_M // 16, NUM_WARPS)
        a_q: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=blk_q, k_width=0)
        b_q: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=blk_q, k_width=0)
        ld: gl.constexpr = row_load_layout(HEAD_D, NUM_WARPS)
        # left operands (K, V, P^T, dS^T) are read SPT_M rows apart by the lanes of a warp, Q / dO rows 4 apart
        # (read transposed) or along their rows in KC-row slices: XOR-swizzle the 16-byte vectors accordingly, the
        # latter with a pattern of KC rows (a row slice may not cut one)
        swz_a: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=SPT_M, max_phase=8, order=[1, 0])
        swz_b: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=4, max_phase=KC // 4, order=[1, 0])

        bh, off_h, off_b, start_n = _program_tile(Nk, BLOCK_N, H)

        k_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, HEAD_D], swz_a)
        v_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, HEAD_D], swz_a)
        q_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M, HEAD_D], swz_b)
        do_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M, HEAD_D], swz_b)
        pt_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], swz_a)
        dst_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], swz_a)
        # the dQ share reads dS^T (transposed) and K in KC-row slices, which the left operands' swizzle pattern
        # (SPT_M * 8 rows) may not cut: copies of both swizzled as Q / dO
        SP_ROWS: gl.constexpr = BLOCK_N if DQ_ORDERED else 1
        dsq_smem = gl.allocate_shared_memory(gl.float32, [SP_ROWS, BLOCK_M], swz_b)
        kq_smem = gl.allocate_shared_memory(gl.float32, [SP_ROWS, HEAD_D], swz_b)

        offs_ld = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld))
        offs_lm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        k_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        k_ok = (k_rows < Nk)[:, None]
        k_rows64 = k_rows.to(gl.int64)[:, None]
        async_copy.async_copy_global_to_shared(
            k_smem, K + off_b * skb + off_h * skh + k_rows64 * skn + offs_ld[None, :], mask=k_ok)
        async_copy.async_copy_global_to_shared(
            v_smem, V + off_b * svb + off_h * svh + k_rows64 * svn + offs_ld[None, :], mask=k_ok)
        if DQ_ORDERED:
            async_copy.async_copy_global_to_shared(
                kq_smem, K + off_b * skb + off_h * skh + k_rows64 * skn + offs_ld[None, :], mask=k_ok)
        q_base = Q + off_b * sqb + off_h * sqh
        do_base = DO + off_b * sdb + off_h * sdh
        for st in gl.static_range(STAGES - 1):  # K and V travel in query tile 0's commit group
            issue_pair(q_smem, do_smem, q_base, do_base, sqm, sdm, st, Nq, offs_lm, offs_ld, BLOCK_M, STAGES)

        offs_sm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, blk))
        row_base = bh * Nq
        pid_n = start_n // BLOCK_N
        sem_base = Sem + bh * gl.cdiv(Nq, BLOCK_M)
        dq_base = DQ + bh * Nq * HEAD_D
        offs_qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk_q))
        offs_qd = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, blk_q))
        dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=blk)
        dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=blk)
        n_m = gl.cdiv(Nq, BLOCK_M)
        for t in range(0, n_m):
            _cta_barrier()  # every warp is done with ring slot (t - 1) % STAGES and with P^T, dS^T
            issue_pair(q_smem, do_smem, q_base, do_base, sqm, sdm, t + STAGES - 1, Nq, offs_lm, offs_ld, BLOCK_M,
                        STAGES)
            async_copy.wait_group(STAGES - 1)  # tile t has landed (this thread's copies) ...
            _cta_barrier()  # ... and every thread's
            if DQ_ORDERED:  # read at the step's start: in the steady state the turn has come by the add
                seen = gl.load(sem_base + t, volatile=True)
            q_t = q_smem.index(t % STAGES)
            do_t = do_smem.index(t % STAGES)
            rows = t * BLOCK_M + offs_sm
            lse = gl.load(LseRow + row_base + rows, mask=rows < Nq, other=float("inf"))
            delta = gl.load(Delta + row_base + rows, mask=rows < Nq, other=0.0)
            s_t = _fma_nt(k_smem, q_t, gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=blk), a_l, b_l, HEAD_D, KC)
            pt = gl.exp2((s_t * scale - lse[None, :]) * 1.4426950408889634)
            dpt = _fma_nt(v_smem, do_t, gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=blk), a_l, b_l, HEAD_D, KC)
            pt_smem.store(pt)
            dst = pt * (dpt - delta[None, :])
            dst_smem.store(dst)
            if DQ_ORDERED:
                dsq_smem.store(dst)
            _cta_barrier()
            dv += _fma_nn(pt_smem, do_t, gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=blk), a_l, b_l, BLOCK_M, KC)
            dk += _fma_nn(dst_smem, q_t, gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=blk), a_l, b_l, BLOCK_M, KC)
            if DQ_ORDERED:
                part = _fma_nn(dsq_smem.permute((1, 0)), kq_smem, gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=blk_q),
                               a_q, b_q, BLOCK_N, KC)
                _dq_ordered_add(part * scale, dq_base, sem_base + t, seen, pid_n, t * BLOCK_M + offs_qm, offs_qd, Nq,
                                HEAD_D)
        async_copy.wait_group(0)
        offs_on = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk))
        offs_od = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, blk))
        out = bh * Nk * HEAD_D + offs_on.to(gl.int64)[:, None] * HEAD_D + offs_od[None, :]
        ok = (offs_on < Nk)[:, None]
        gl.store(DK + out, dk * scale, mask=ok)
        gl.store(DV + out, dv, mask=ok)

    @gluon.jit
    def _dq_step(dq, t, q_smem, do_smem, k_smem, v_smem, ds_smem, lse, delta, Nk, scale, offs_sn,
                 blk: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, KC: gl.constexpr, STAGES: gl.constexpr,
                 TAIL: gl.constexpr):
        # dq + dS K of key tile t; TAIL zeroes P of keys >= Nk (the last tile only: their K rows read zeros)
        k_t = k_smem.index(t % STAGES)
        v_t = v_smem.index(t % STAGES)
        s = _fma_nt(q_smem, k_t, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=blk), a_l, b_l, HEAD_D, KC)
        p = gl.exp2((s * scale - lse[:, None]) * 1.4426950408889634)
        if TAIL:
            p = gl.where(((t * BLOCK_N + offs_sn) < Nk)[None, :], p, 0.0)
        dp = _fma_nt(do_smem, v_t, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=blk), a_l, b_l, HEAD_D, KC)
        ds_smem.store(p * (dp - delta[:, None]))
        _cta_barrier()
        return dq + _fma_nn(ds_smem, k_t, gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=blk), a_l, b_l, BLOCK_N, KC)

    @gluon.jit(do_not_specialize=["Nq", "Nk"])
    def _ieee_dq_kernel(Q, K, V, DO, Delta, LseRow, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                        sdb, sdh, sdm, H, Nq, Nk, scale,
                        BLOCK_HELD: gl.constexpr, BLOCK_STREAMED: gl.constexpr, HEAD_D: gl.constexpr,
                        KC: gl.constexpr, STAGES: gl.constexpr, SPT_M: gl.constexpr, NUM_WARPS: gl.constexpr):
        # One (query tile, head, batch) program, 1-D grid cdiv(Nq, BLOCK_HELD) * H * B; DQ contiguous [B, H, Nq, D].
        BLOCK_M: gl.constexpr = BLOCK_HELD
        BLOCK_N: gl.constexpr = BLOCK_STREAMED
        blk: gl.constexpr = fma_layout(SPT_M, NUM_WARPS)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=blk, k_width=0)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=blk, k_width=0)
        ld: gl.constexpr = row_load_layout(HEAD_D, NUM_WARPS)
        swz_a: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=SPT_M, max_phase=8, order=[1, 0])
        swz_b: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=4, max_phase=KC // 4, order=[1, 0])

        bh, off_h, off_b, start_m = _program_tile(Nq, BLOCK_M, H)

        q_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D], swz_a)
        do_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D], swz_a)
        k_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, HEAD_D], swz_b)
        v_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, HEAD_D], swz_b)
        ds_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], swz_a)

        offs_ld = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld))
        offs_ln = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        q_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        q_ok = (q_rows < Nq)[:, None]
        q_rows64 = q_rows.to(gl.int64)[:, None]
        async_copy.async_copy_global_to_shared(
            q_smem, Q + off_b * sqb + off_h * sqh + q_rows64 * sqm + offs_ld[None, :], mask=q_ok)
        async_copy.async_copy_global_to_shared(
            do_smem, DO + off_b * sdb + off_h * sdh + q_rows64 * sdm + offs_ld[None, :], mask=q_ok)
        k_base = K + off_b * skb + off_h * skh
        v_base = V + off_b * svb + off_h * svh
        for st in gl.static_range(STAGES - 1):  # Q and dO travel in key tile 0's commit group
            issue_pair(k_smem, v_smem, k_base, v_base, skn, svn, st, Nk, offs_ln, offs_ld, BLOCK_N, STAGES)

        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
        row_base = bh * Nq
        lse = gl.load(LseRow + row_base + rows, mask=rows < Nq, other=float("inf"))
        delta = gl.load(Delta + row_base + rows, mask=rows < Nq, other=0.0)
        offs_sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, blk))
        dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=blk)
        n_n = gl.cdiv(Nk, BLOCK_N)
        for t in range(0, n_n - 1):
            _cta_barrier()  # every warp is done with ring slot (t - 1) % STAGES and with dS
            issue_pair(k_smem, v_smem, k_base, v_base, skn, svn, t + STAGES - 1, Nk, offs_ln, offs_ld, BLOCK_N,
                        STAGES)
            async_copy.wait_group(STAGES - 1)
            _cta_barrier()
            dq = _dq_step(dq, t, q_smem, do_smem, k_smem, v_smem, ds_smem, lse, delta, Nk, scale, offs_sn, blk, a_l,
                          b_l, BLOCK_M, BLOCK_N, HEAD_D, KC, STAGES, False)
        _cta_barrier()
        async_copy.wait_group(0)
        _cta_barrier()
        dq = _dq_step(dq, n_n - 1, q_smem, do_smem, k_smem, v_smem, ds_smem, lse, delta, Nk, scale, offs_sn, blk,
                      a_l, b_l, BLOCK_M, BLOCK_N, HEAD_D, KC, STAGES, True)
        offs_od = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, blk))
        gl.store(DQ + bh * Nq * HEAD_D + rows.to(gl.int64)[:, None] * HEAD_D + offs_od[None, :], dq * scale,
                 mask=(rows < Nq)[:, None])


def kernel_constexprs(cfg: dict, kernel: str, head_dim: int) -> dict:
    """The constexpr arguments of ``kernel`` (``"dkdv"`` or ``"dq"``) for a :func:`get_config` dict (launches and
    offline compiles)."""
    part = cfg[kernel]
    extra = dict(DQ_ORDERED=bool(cfg.get("single_pass"))) if kernel == "dkdv" else {}
    return dict(BLOCK_HELD=part["BLOCK_HELD"], BLOCK_STREAMED=part["BLOCK_STREAMED"], HEAD_D=head_dim, KC=cfg["KC"],
                STAGES=cfg["STAGES"], SPT_M=part["SPT_M"], NUM_WARPS=part["num_warps"], **extra)


def planned_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, cfg: dict | None = None):
    """The kernels' launches for this call signature (shapes, strides), as a callable
    ``(q, k, v, grad_out, delta, lse_row, dq, dk, dv, sem, scale) -> None`` for any later call with the same
    shapes and strides, without checks: for a caller that ran :func:`unsupported_reason` (the backward plans of
    :mod:`.elsa_bwd`). ``delta``, ``lse_row``: FP32 [B * H, Nq] from the preprocess kernel; dq [B, H, Nq, D],
    dk, dv [B, H, Nk, D] contiguous FP32 outputs; ``cfg``: :func:`get_config`'s layout (tools sweep others).
    When ``cfg["single_pass"]`` the dK/dV kernel alone runs and adds into dq, which must then be zeroed, as
    must ``sem`` (int32, at least ``B * H * cdiv(Nq, cfg["dkdv"]["BLOCK_STREAMED"])``); else ``sem`` is not
    read.

    Raises:
        ValueError: a two-kernel ``cfg`` at a head dim outside :data:`TWO_PASS_HEAD_DIMS`."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg = cfg or get_config(D)
    if not cfg.get("single_pass") and D not in TWO_PASS_HEAD_DIMS:
        raise ValueError(f"head dim {D}: the two-kernel path (single_pass=False) runs at head dims "
                         f"{TWO_PASS_HEAD_DIMS} only (its dQ kernel spills registers above); use single_pass=True")
    dkdv = KernelCall(_ieee_dkdv_kernel, (cdiv(Nk, cfg["dkdv"]["BLOCK_HELD"]) * B * H,),
                      kernel_constexprs(cfg, "dkdv", D), dict(num_warps=cfg["dkdv"]["num_warps"]))
    fixed = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], H, Nq, Nk)
    if cfg.get("single_pass"):
        def launch(q, k, v, grad_out, delta, lse_row, dq, dk, dv, sem, scale):
            dkdv(q, k, v, grad_out, delta, lse_row, dk, dv, dq, sem, *fixed, scale)

        return launch
    dq_call = KernelCall(_ieee_dq_kernel, (cdiv(Nq, cfg["dq"]["BLOCK_HELD"]) * B * H,),
                         kernel_constexprs(cfg, "dq", D), dict(num_warps=cfg["dq"]["num_warps"]))

    def launch(q, k, v, grad_out, delta, lse_row, dq, dk, dv, sem, scale):
        dkdv(q, k, v, grad_out, delta, lse_row, dk, dv, dq, delta, *fixed, scale)  # dq, delta: not read
        dq_call(q, k, v, grad_out, delta, lse_row, dq, *fixed, scale)

    return launch
