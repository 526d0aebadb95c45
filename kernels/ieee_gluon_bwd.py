"""FP32-IEEE attention backward in Gluon: one kernel forms dK, dV and dQ with FMA products on a register-blocked layout.

Mode ``fp32-ieee`` multiplies with FP32 FMAs, no tensor cores. Triton's ``tl.dot(..., input_precision="ieee")``
chooses a thread layout in which each thread re-reads far more operands from shared memory than it multiplies,
and in the backward's register-heavy kernels (two accumulators, four products per tile) it runs at a fraction
of the FMA peak. As in the forward (:mod:`.ieee_gluon`), the layout is chosen here instead: each thread owns
``SPT_M x 4`` elements of a tile per 32-column repeat and multiplies 16-wide chunks of the reduction dim read
as vectors from swizzled shared tiles (``gl.dot_fma``).

Same algebra as the Triton backward (:mod:`.elsa_bwd`, FlashAttention-2's Alg. 2 from the saved log-sum-exp),
in one pass: :func:`_ieee_dkdv_kernel` runs one program per (key tile, head, batch), holds ``K_j, V_j`` in
shared memory and the ``dK_j, dV_j`` accumulators in registers, and streams the query tiles (``Q_i``, ``dO_i``
through a cp.async ring): ``S^T = K Q^T``, ``P^T = exp(scale S^T - lse)``, ``dP^T = V dO^T``,
``dS^T = P^T (dP^T - delta)``, ``dV += P^T dO``, ``dK += dS^T Q``, and it adds each query tile's ``dS K`` into
the FP32 dQ, so no dQ kernel recomputes ``S`` and ``dP`` (five tile products per tile pair instead of seven;
a separate dQ kernel measured 1.1-1.5x slower from 1024 keys on and no faster at ViT-B/16 224, and spills
registers at head dim 128: docs/tuning.md, fp32-ieee backward in one pass). The adds into a query tile run in
key-tile order, handed on through an int32 counter per query tile, as in :mod:`.elsa_bwd`'s single pass: key
tile ``j`` waits only for key tile ``j - 1`` of its head, a lower program id, so the wait ends as long as the
GPU starts programs in id order. FMA products are slow enough that the ordered adds cost little next to the
two products they save, unlike half precision on tensor cores.

Each tile's product into an accumulator is formed apart and added once (one rounding per tile, as the
Triton kernels' FP32 products), every sum in a fixed order: the gradients are bit-for-bit reproducible.
``delta`` and the row ``lse`` come from :mod:`.elsa_bwd`'s preprocess kernel.

Scope (:func:`unsupported_reason`): the forward Gluon kernel's (CUDA, compute capability >= 8.0, no bias / mask /
causal, 16-byte-aligned rows with a contiguous head dim), for the output gradient too, at head dim 32, 64 or 128 for
Q/K and V. Other calls take the Triton kernels. Gluon cannot run under ``TRITON_INTERPRET=1``; CPU tests
compile the kernel offline for sm_90, ``pytest -m gpu`` checks its gradients against the float64 oracle.
"""
from __future__ import annotations

import torch

from ._gluon import scope_reason
from ._launch import SPIN_UNTIL_EQUAL_PTX, KernelCall, cdiv

try:  # Gluon is experimental: its API moves between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from .ieee_gluon import fma_layout, issue_pair, row_load_layout

    from ._gluon import cta_barrier as _cta_barrier
    _SPIN_PTX = gl.constexpr(SPIN_UNTIL_EQUAL_PTX)
    _IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = f"Gluon unavailable in this Triton ({exc})"

__all__ = ["unsupported_reason", "get_config", "kernel_constexprs", "planned_launch", "HEAD_DIMS"]

HEAD_DIMS = (32, 64, 128)


def get_config(head_dim: int) -> dict:
    """Tiles by head dim: ``BLOCK_HELD`` keys a program holds, ``BLOCK_STREAMED`` queries streamed per step,
    ``SPT_M`` rows per thread, ``num_warps``, ``KC`` (reduction chunk), ``STAGES`` (cp.async ring depth).
    64 held keys at head dim 64; at 32 the 64-key tile spills (the compiler's occupancy choice), at 128 it
    spills too, and 32 x 32 (one program per SM) beats 32 x 16 and 16 x 32 (two per SM)."""
    held = 64 if head_dim == 64 else 32
    return {"BLOCK_HELD": held, "BLOCK_STREAMED": 32, "SPT_M": held // 16, "num_warps": 4, "KC": 16, "STAGES": 2}


def unsupported_reason(q, k, v, grad_out, bias, attn_mask, is_causal: bool, scale: float) -> str | None:
    """Why the Gluon backward cannot run this call (the Triton kernels then do), or ``None``.

    Inputs as :func:`.elsa_bwd.launch_backward` sees them: q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv],
    grad_out [B, H, Nq, Dv], all float32; Hkv < H (grouped-query attention) is refused, the Triton kernels take it.
    """
    if k.shape[1] != q.shape[1]:
        return "grouped-query attention (fewer key / value heads than query heads)"
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
                          KC: gl.constexpr, STAGES: gl.constexpr, SPT_M: gl.constexpr, NUM_WARPS: gl.constexpr):
        # One (key tile, head, batch) program, 1-D grid cdiv(Nk, BLOCK_HELD) * H * B; [keys, queries] tiles.
        # DK, DV contiguous [B, H, Nk, D]. Keys >= Nk read zeros and only reach their own, unstored rows; queries
        # >= Nq read zeros and lse = +inf, so their P and dS are 0. Each query tile's scale * dS K goes into DQ
        # (contiguous [B, H, Nq, D] FP32, zeroed) in key-tile order through the int32 counters
        # Sem [B * H, >= cdiv(Nq, BLOCK_STREAMED)] (zeroed); key tile j waits only for key tile j - 1 of its
        # head, a lower program id.
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
        dsq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], swz_b)
        kq_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_N, HEAD_D], swz_b)

        offs_ld = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld))
        offs_lm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        k_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        k_ok = (k_rows < Nk)[:, None]
        k_rows64 = k_rows.to(gl.int64)[:, None]
        async_copy.async_copy_global_to_shared(
            k_smem, K + off_b * skb + off_h * skh + k_rows64 * skn + offs_ld[None, :], mask=k_ok)
        async_copy.async_copy_global_to_shared(
            v_smem, V + off_b * svb + off_h * svh + k_rows64 * svn + offs_ld[None, :], mask=k_ok)
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
            seen = gl.load(sem_base + t, volatile=True)  # early: in the steady state the turn has come by the add
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
            dsq_smem.store(dst)
            _cta_barrier()
            dv += _fma_nn(pt_smem, do_t, gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=blk), a_l, b_l, BLOCK_M, KC)
            dk += _fma_nn(dst_smem, q_t, gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=blk), a_l, b_l, BLOCK_M, KC)
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


def kernel_constexprs(cfg: dict, head_dim: int) -> dict:
    """The constexpr arguments of :func:`_ieee_dkdv_kernel` for a :func:`get_config` dict (launches and offline
    compiles)."""
    return dict(BLOCK_HELD=cfg["BLOCK_HELD"], BLOCK_STREAMED=cfg["BLOCK_STREAMED"], HEAD_D=head_dim, KC=cfg["KC"],
                STAGES=cfg["STAGES"], SPT_M=cfg["SPT_M"], NUM_WARPS=cfg["num_warps"])


def planned_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, cfg: dict | None = None):
    """The kernel's launch for this call signature (shapes, strides), as a callable
    ``(q, k, v, grad_out, delta, lse_row, dq, dk, dv, sem, scale) -> None`` for any later call with the same
    shapes and strides, without checks: for a caller that ran :func:`unsupported_reason` (the backward plans of
    :mod:`.elsa_bwd`). ``delta``, ``lse_row``: FP32 [B * H, Nq] from the preprocess kernel; dq [B, H, Nq, D]
    (zeroed: the kernel adds into it), dk, dv [B, H, Nk, D] contiguous FP32 outputs; ``sem``: zeroed int32, at
    least ``B * H * cdiv(Nq, cfg["BLOCK_STREAMED"])``; ``cfg``: :func:`get_config`'s layout (tools sweep
    others)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg = cfg or get_config(D)
    call = KernelCall(_ieee_dkdv_kernel, (cdiv(Nk, cfg["BLOCK_HELD"]) * B * H,), kernel_constexprs(cfg, D),
                      dict(num_warps=cfg["num_warps"]))
    fixed = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], H, Nq, Nk)

    def launch(q, k, v, grad_out, delta, lse_row, dq, dk, dv, sem, scale):
        call(q, k, v, grad_out, delta, lse_row, dk, dv, dq, sem, *fixed, scale)

    return launch
