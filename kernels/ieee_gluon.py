"""FP32-IEEE attention forward in Gluon: FMA products on a register-blocked layout.

Mode ``fp32-ieee`` computes every product with FP32 FMAs, no tensor cores. Triton's
``tl.dot(..., input_precision="ieee")`` picks its own thread layout for FMA dots, in which each
thread re-reads far more operands from shared memory than it multiplies, whatever the tile, which
caps its throughput well below the FP32 FMA peak. Gluon (Triton's explicit-layout dialect) lets the
layout be chosen: each thread owns ``SPT_M x 4`` scores per 32-column repeat, reads 16-byte vectors
of Q / K (or P / V) chunks of 16 along the reduction dim, and multiplies them with ``gl.dot_fma``. The
shared tiles are swizzled so the lanes of a warp hit distinct banks. Same (m, S, W) fold as
:func:`kernels.elsa_fwd._fold_tile`'s ``"ieee"`` path, including one rounding per tile for
``P @ V`` (the tile's sum is formed apart and added once).

Scope (:func:`unsupported_reason`): CUDA tensors of compute capability >= 8.0 (``cp.async``),
head dim 32, 64 or 128 for both Q/K and V, no bias / mask / causal, no split-KV,
16-byte-aligned rows with a contiguous head dim. Other calls take the Triton kernel. Gluon cannot
run under ``TRITON_INTERPRET=1``; CPU tests compile it offline for sm_90 and check the dispatch,
``pytest -m gpu`` checks its results against the float64 oracle. It runs about twice as fast as
Triton's IEEE loop at the same error (docs/tuning.md: fp32-ieee on a Gluon register-blocked FMA
kernel (not `tl.dot(..., "ieee")`)).
"""
from __future__ import annotations

import torch

from ._gluon import checked_call, scope_reason
from ._launch import KernelCall, PlannedLaunch, cdiv, heads_inner_layout

try:  # Gluon is experimental: its API moves between Triton releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from ._gluon import cta_barrier as _cta_barrier, online_softmax

    _IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as exc:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = f"Gluon unavailable in this Triton ({exc})"

__all__ = ["ieee_attention", "launch", "planned_launch", "unsupported_reason", "get_config", "config_for",
           "kernel_constexprs", "HEAD_DIMS"]

HEAD_DIMS = (32, 64, 128)


def get_config(n_k: int, head_dim: int = 64) -> dict:
    """Launch config by key count and head dim, tuned on an H100. D <= 64: 32-key tiles waste less on
    ViT-sized tails, 64-key tiles win on long sequences (docs/tuning.md: fp32-ieee D <= 64: 32-key tiles up
    to 2048 keys, 64-key tiles beyond). D = 128: 32 x 32 tiles, 2 rows per thread, as 64-row tiles spill
    registers (docs/tuning.md: fp32-ieee D=128: 32 x 32 tiles, 2 rows per thread)."""
    if head_dim > 64:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "KC": 16, "STAGES": 2, "SPT_M": 2, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 32 if n_k <= 2048 else 64, "KC": 16, "STAGES": 2, "SPT_M": 4,
            "num_warps": 4}


def unsupported_reason(q, k, v, bias, attn_mask, is_causal: bool, scale: float, num_splits: int) -> str | None:
    """Why :func:`ieee_attention` cannot run this call (the Triton kernel then does), or ``None``.

    Inputs as the dense launcher sees them: q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv], float32 (Hkv
    dividing H: grouped-query attention reads K / V head ``h // (H / Hkv)`` in place); ``num_splits`` 0 =
    automatic (the launcher splits only when the grid cannot fill the GPU).
    """
    return scope_reason(q, k, v, bias, attn_mask, is_causal, scale, num_splits, dtypes=(torch.float32,),
                        head_dims=HEAD_DIMS, stride_elems=4,
                        stride_text="rows are not 16-byte aligned with a contiguous head dim",
                        capable=lambda cc: cc >= (8, 0), capable_text="compute capability below 8.0 (no cp.async)",
                        import_error=_IMPORT_ERROR)


if _IMPORT_ERROR is None:

    @gluon.constexpr_function
    def fma_layout(spt_m, num_warps):
        """The FMA products' register blocking (forward and backward kernels): each thread holds ``spt_m`` rows x 4
        columns of a tile per 32-column repeat, 8 lanes share a row."""
        return gl.BlockedLayout(size_per_thread=[spt_m, 4], threads_per_warp=[4, 8], warps_per_cta=[num_warps, 1],
                                order=[1, 0])

    @gluon.constexpr_function
    def row_load_layout(head_d, num_warps):
        """cp.async of [rows, head_d] FP32 tiles in 16-byte vectors: head_d // 4 lanes per row."""
        tpw = head_d // 4
        return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // tpw, tpw],
                                warps_per_cta=[num_warps, 1], order=[1, 0])

    @gluon.jit
    def issue_pair(a_smem, b_smem, a_base, b_base, sa, sb, tile, n, offs_l, offs_ld,
                   BLOCK: gl.constexpr, STAGES: gl.constexpr):
        """cp.async rows [tile * BLOCK, +BLOCK) of two [n, D] operands (K and V; Q and dO in the backward) into
        ring slot ``tile % STAGES`` of ``a_smem`` / ``b_smem`` (rows >= n read 0), one commit group."""
        slot = tile % STAGES
        rows = tile * BLOCK + offs_l
        ok = (rows < n)[:, None]
        rows64 = rows.to(gl.int64)[:, None]
        async_copy.async_copy_global_to_shared(a_smem.index(slot), a_base + rows64 * sa + offs_ld[None, :], mask=ok)
        async_copy.async_copy_global_to_shared(b_smem.index(slot), b_base + rows64 * sb + offs_ld[None, :], mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _fold_tile(acc, m_i, l_i, t, q_smem, k_smem, v_smem, p_smem, Nk, qk_scale, offs_sn,
                   blk: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, KC: gl.constexpr,
                   STAGES: gl.constexpr, TAIL: gl.constexpr):
        # fold KV tile t into (acc, m_i, l_i); TAIL masks keys >= Nk (the last tile only)
        slot = t % STAGES
        k_t = k_smem.index(slot)
        v_t = v_smem.index(slot)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=blk)
        for kk in gl.static_range(0, HEAD_D, KC):
            s = gl.dot_fma(q_smem.slice(kk, KC, dim=1).load(a_l),
                           k_t.slice(kk, KC, dim=1).permute((1, 0)).load(b_l), s)
        p, m_new, l_i, alpha = online_softmax(s, m_i, l_i, t, Nk, qk_scale, offs_sn, BLOCK_N, TAIL)
        p_smem.store(p)
        _cta_barrier()
        pv = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=blk)
        for kk in gl.static_range(0, BLOCK_N, KC):
            pv = gl.dot_fma(p_smem.slice(kk, KC, dim=1).load(a_l), v_t.slice(kk, KC, dim=0).load(b_l), pv)
        return acc * alpha[:, None] + pv, m_new, l_i

    @gluon.jit(do_not_specialize=["Nq", "Nk"])  # a new length compiles nothing new
    def _ieee_fwd_kernel(Q, K, V, O, LSE, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
                         H, GROUP, Nq, Nk, qk_scale,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, KC: gl.constexpr,
                         STAGES: gl.constexpr, SPT_M: gl.constexpr, NUM_WARPS: gl.constexpr,
                         WRITE_LSE: gl.constexpr):
        # One (query tile, head, batch) program, 1-D grid as the Triton kernel. Scores / output: each
        # thread holds SPT_M rows x 4 columns per 32-column repeat, 8 lanes share a row. WRITE_LSE: also the
        # natural-log log-sum-exp of each row into LSE, contiguous float32 [B, H, Nq] (what the backward reads).
        blk: gl.constexpr = fma_layout(SPT_M, NUM_WARPS)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=blk, k_width=0)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=blk, k_width=0)
        ld: gl.constexpr = row_load_layout(HEAD_D, NUM_WARPS)
        # Q / P rows are read SPT_M apart by the lanes of a warp, K rows 4 apart: XOR-swizzle the 16-byte
        # vectors by row // SPT_M (row // 4) so those reads hit distinct banks; V is read along its rows
        swz: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=SPT_M, max_phase=8, order=[1, 0])
        swz_k: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=4, max_phase=8, order=[1, 0])
        plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

        tiles_m = gl.cdiv(Nq, BLOCK_M)
        pid = gl.program_id(0)
        bh = (pid // tiles_m).to(gl.int64)
        off_h = bh % H
        off_b = bh // H
        start_m = (pid % tiles_m) * BLOCK_M

        q_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, HEAD_D], swz)
        k_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, HEAD_D], swz_k)
        v_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, HEAD_D], plain)
        p_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], swz)

        offs_ln = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        offs_ld = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ld))
        q_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        async_copy.async_copy_global_to_shared(
            q_smem, Q + off_b * sqb + off_h * sqh + q_rows.to(gl.int64)[:, None] * sqm + offs_ld[None, :],
            mask=(q_rows < Nq)[:, None])
        off_kv = off_h // GROUP  # grouped-query attention: query head h reads K / V head h // GROUP (1 folds away)
        k_base = K + off_b * skb + off_kv * skh
        v_base = V + off_b * svb + off_kv * svh
        n_tiles = gl.cdiv(Nk, BLOCK_N)
        for st in gl.static_range(STAGES - 1):  # Q travels in tile 0's commit group
            issue_pair(k_smem, v_smem, k_base, v_base, skn, svn, st, Nk, offs_ln, offs_ld, BLOCK_N, STAGES)

        offs_sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, blk))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, blk))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, blk))
        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=blk)
        for t in range(0, n_tiles - 1):
            _cta_barrier()  # every warp is done with ring slot (t - 1) % STAGES and with P
            issue_pair(k_smem, v_smem, k_base, v_base, skn, svn, t + STAGES - 1, Nk, offs_ln, offs_ld,
                      BLOCK_N, STAGES)
            async_copy.wait_group(STAGES - 1)  # tile t has landed (this thread's copies) ...
            _cta_barrier()  # ... and every thread's
            acc, m_i, l_i = _fold_tile(acc, m_i, l_i, t, q_smem, k_smem, v_smem, p_smem, Nk, qk_scale, offs_sn,
                                       blk, a_l, b_l, BLOCK_M, BLOCK_N, HEAD_D, KC, STAGES, False)
        _cta_barrier()
        async_copy.wait_group(0)
        _cta_barrier()
        acc, m_i, l_i = _fold_tile(acc, m_i, l_i, n_tiles - 1, q_smem, k_smem, v_smem, p_smem, Nk, qk_scale,
                                   offs_sn, blk, a_l, b_l, BLOCK_M, BLOCK_N, HEAD_D, KC, STAGES, True)
        out = acc / l_i[:, None]
        offs_om = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
        offs_od = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, blk))
        gl.store(O + off_b * sob + off_h * soh + offs_om.to(gl.int64)[:, None] * som + offs_od[None, :],
                 out.to(O.dtype.element_ty), mask=(offs_om < Nq)[:, None])
        if WRITE_LSE:  # sum_j exp(scale s_j) = 2^m * l, m the base-2 running max
            gl.store(LSE + bh * Nq + offs_om, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=offs_om < Nq)


def ieee_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out_dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """``softmax(scale q k^T) v`` with FP32 FMA products (mode ``fp32-ieee``), Gluon kernel.

    Args:
        q: [B, H, Nq, D] float32 CUDA; k: [B, H, Nk, D]; v: [B, H, Nk, D]; D in :data:`HEAD_DIMS`;
            any strides with a contiguous head dim and 16-byte-aligned rows (see :func:`unsupported_reason`).
        scale: logit scale, > 0 (the row max is taken on the unscaled product).
        out_dtype: output dtype (float32 default, or float16 / bfloat16), rounded once from ``W / S``.
        config: launch-config override (keys of :func:`get_config`).

    Returns:
        [B, H, Nq, D], a view of a contiguous [B, Nq, H, D] buffer, as the Triton kernels return.

    Raises:
        ValueError: a call :func:`unsupported_reason` refuses (``scale <= 0`` among them).
        TypeError: an ``out_dtype`` the kernels do not write.
    """
    cfg = dict(get_config(k.shape[2], q.shape[3]), **(config or {}))
    return checked_call("ieee_attention", "'fp32-ieee'", unsupported_reason(q, k, v, None, None, False, scale, 1),
                        q, k, out_dtype or torch.float32, lambda out: launch(q, k, v, scale, out, cfg))


def config_for(q: torch.Tensor, k: torch.Tensor) -> dict:
    """:func:`get_config` for a call's q [B, H, Nq, D] and k [B, H, Nk, D] (the dispatcher's entry point)."""
    return get_config(k.shape[2], q.shape[3])


def kernel_constexprs(cfg: dict, head_dim: int, write_lse: bool = False) -> dict:
    """The constexpr arguments of :func:`_ieee_fwd_kernel` for a :func:`get_config` dict (launches,
    offline compiles and their tests build the kernel from this one mapping)."""
    return dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HEAD_D=head_dim, KC=cfg["KC"], STAGES=cfg["STAGES"],
                SPT_M=cfg["SPT_M"], NUM_WARPS=cfg["num_warps"], WRITE_LSE=write_lse)


def planned_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: dict, write_lse: bool = False):
    """The launch of :func:`ieee_attention`'s kernel for this call signature (shapes, strides, ``cfg``), as a
    callable ``(q, k, v, scale, out, lse=None) -> None`` for any later call with the same shapes and strides,
    without checks: for a caller that ran :func:`unsupported_reason` and :func:`get_config` already (the dense
    launcher's plans). ``out`` is a heads-inner [B, H, Nq, D] buffer (:func:`._launch.allocate_output`); with
    ``write_lse`` every call passes ``lse``, a contiguous float32 [B, H, Nq] buffer for the natural-log
    log-sum-exp of each row (the backward's input)."""
    B, H, Nq, D = q.shape
    o_stride = heads_inner_layout(B, H, Nq, D)[1][:3]  # out is the plan's heads-inner buffer
    call = KernelCall(_ieee_fwd_kernel, (cdiv(Nq, cfg["BLOCK_M"]) * B * H,), kernel_constexprs(cfg, D, write_lse),
                      dict(num_warps=cfg["num_warps"]))
    fixed = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o_stride, H, H // k.shape[1], Nq, k.shape[2])

    return PlannedLaunch(call, fixed)


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor, cfg: dict) -> None:
    """One :func:`planned_launch` into ``out`` (heads-inner, as :func:`._launch.allocate_output` makes it)."""
    planned_launch(q, k, v, cfg)(q, k, v, float(scale), out)
