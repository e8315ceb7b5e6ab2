"""Span passes on the 64-token buffers: the affine map of a span of chunks, S_out = M·S_in + S_ext.

The state pass runs on the extended columns [S_ext | M] (``[K, V + K]``): chunk by chunk
V' = [U | 0] − W [S_ext | M];  [S_ext | M] ← Diag(γ) [S_ext | M] + kgᵀ V', from [0 | I]. Column blocks of the
extended state are independent programs, so the M chain costs one more state pass of K columns; fp32 state.

``span_summaries_triton``: per-sequence summaries with their own prep, windowed like the inference forward (the
summaries of split prefill on any gate, and context parallel without gradients). ``span_from_buffers`` /
``span_rows``: the same pass over a training forward's kept buffers (context parallel's training step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BT,
    ChunkTable,
    _chunk_range,
    _span_row_program,
    dot_precision,
    make_chunk_table,
    next_pow2,
    state_bv,
    state_stages,
    store_dtype,
)
from k3.ops.kda.triton.inference import InferencePlan
from k3.ops.kda.triton.prep import alloc_chunk_buffers, chunk_bytes, launch_prep

# summaries: 32 columns per program at 4 warps, 2 stages; the span rows of context parallel's halves: 64 columns,
# 3 stages (H200, a half of 256K tokens at H = 32: 2.07 ms against 2.39 at 32 columns)
_SUMMARY_BV = 32
_ROWS_BV = 64

if TYPE_CHECKING:
    from k3.ops.kda.args import KDAArgs


@triton.jit
def _span_columns(W, U, KG, GAM, SE, M, i_b, i_r, i_h, lo, hi, c0, NCw, H, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr):
    """Column block ``i_b`` of row ``i_r``'s extended state [S_ext | M] through chunks [lo, hi) of the window of
    buffers that starts at chunk c0: V' = [U | 0] − W S;  S ← Diag(γ) S + kgᵀ V', started from the row's contents
    and written back. Blocks below BVP are S_ext (``SE [R, H, K, V]``), the others M (``M [R, H, K, K]``)."""
    DT: tl.constexpr = W.dtype.element_ty
    is_m = i_b * BV >= BVP
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    col = tl.where(is_m, i_b * BV - BVP, i_b * BV) + tl.arange(0, BV)
    ncol = tl.where(is_m, K, V)
    m_s = (o_k < K)[:, None] & (col < ncol)[None, :]
    p_s = ((i_r * H + i_h).to(tl.int64) * K + o_k[:, None]) * ncol + col[None, :]
    if is_m:
        S = tl.load(M + p_s, mask=m_s, other=0.)
    else:
        S = tl.load(SE + p_s, mask=m_s, other=0.)
    m_u = (col < BVP)[None, :] & (i_b * BV < BVP)  # M columns: V' = 0 − W M
    for c in range(lo, hi):
        base = (i_h * NCw + (c - c0)).to(tl.int64)
        p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
        b_w = tl.load(W + p_tk)
        b_kg = tl.load(KG + p_tk)
        b_gam = tl.load(GAM + base * BK + o_k)
        b_u = tl.load(U + (base * BT + o_t[:, None]) * BVP + col[None, :], mask=m_u, other=0.)
        b_vn = (b_u.to(tl.float32) - tl.dot(b_w, S.to(DT), input_precision=PREC)).to(DT)
        S = S * b_gam[:, None] + tl.dot(tl.trans(b_kg), b_vn, input_precision=PREC)
    if is_m:
        tl.store(M + p_s, S, mask=m_s)
    else:
        tl.store(SE + p_s, S, mask=m_s)


@triton.jit(do_not_specialize=['c0', 'c1', 'NCw', 'NT', 'H'])
def _kda_span_state(
    W, U, KG, GAM, SE, M,
    chunk_off, c0, c1, NCw, NT,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    cs, ce = _chunk_range(i_n, chunk_off, NT, IS_VARLEN)
    lo = tl.maximum(cs, c0)
    hi = tl.minimum(ce, c1)
    if lo < hi:
        _span_columns(W, U, KG, GAM, SE, M, i_b, i_n, i_h, lo, hi, c0, NCw, H, K, V, BT, BK, BV, BVP, PREC)


@triton.jit(do_not_specialize=['c0', 'NCw', 'H'])
def _kda_span_rows(
    W, U, KG, GAM, SE, M,
    row_cs, row_ce, row_m, c0, NCw,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr,
):
    """Extended state pass over the chunk range [row_cs[r], row_ce[r]) of each row r (global chunk numbers, inside
    the window of buffers that starts at chunk c0), one program per (column block, row, head). Column blocks
    [0, BVP) are S (``SE [R, H, K, V]``, started from its contents), blocks [BVP, BVP + BK) are M (``M [R, H, K,
    K]``, started from its contents); rows with ``row_m[r] == 0`` skip their M blocks (their entry state is known,
    so only S is needed). An empty range leaves the row as it was."""
    i_b, i_r, i_h, cs, ce, live = _span_row_program(row_cs, row_ce, row_m, H, BV, BVP)
    if live:
        _span_columns(W, U, KG, GAM, SE, M, i_b, i_r, i_h, cs, ce, c0, NCw, H, K, V, BT, BK, BV, BVP, PREC)


def span_summaries_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    args: KDAArgs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: ``M [N, H, K, K]`` fp32 (product over chunks of Diag(e^{G_C}) − kgᵀW) and ``S_ext [N, H, K, V]``
    fp32 (the final state from a zero initial state). Forward only (no autograd)."""
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    tab = make_chunk_table(B, Tq, args.cu_host, q.device)
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    S_ext = torch.zeros(tab.N, H, K, V, dtype=torch.float32, device=q.device)
    M = torch.eye(K, dtype=torch.float32, device=q.device).repeat(tab.N, H, 1, 1).contiguous()
    if tab.NC == 0:
        return M, S_ext
    flags, lower_bound = args.flags, args.lower_bound
    if not args.use_gate_in_kernel:
        A_log = dt_bias = None
    ncw = max(1, min(tab.NC, InferencePlan().window_bytes // chunk_bytes(H, BK, BVP, dt)))
    bufs = alloc_chunk_buffers(H, ncw, BK, BVP, dt, q.device, store_t=False)
    bv = min(_SUMMARY_BV, BVP, BK)
    for c0 in range(0, tab.NC, ncw):
        n = min(ncw, tab.NC - c0)
        launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs, tab, c0, n, args.scale, lower_bound, flags, False)
        _kda_span_state[((BVP + BK) // bv, tab.N * H)](
            bufs["W"], bufs["U"], bufs["KG"], bufs["GAM"], S_ext, M, tab.chunk_off, c0, c0 + n, ncw, tab.NT,
            H, K, V, BT=BT, BK=BK, BV=bv, BVP=BVP, IS_VARLEN=tab.varlen, PREC=dot_precision(q.dtype),
            num_warps=4, num_stages=state_stages(2, q.dtype, BK))
    return M, S_ext


def span_from_buffers(bufs: dict, tab: ChunkTable, H: int, K: int, V: int, need_M: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence of ``tab`` ``(M [N, H, K, K], S_ext [N, H, K, V])`` fp32 from a training forward's kept chunk
    buffers (no second prep): the extended state pass over every chunk at once; the M columns only when
    ``need_M``."""
    BK, BVP = bufs["W"].shape[-1], bufs["U"].shape[-1]
    dev = bufs["W"].device
    S_ext = torch.zeros(tab.N, H, K, V, dtype=torch.float32, device=dev)
    M = torch.eye(K, dtype=torch.float32, device=dev).repeat(tab.N, H, 1, 1).contiguous()
    bv = min(_SUMMARY_BV, BVP, BK)
    cols = BVP + (BK if need_M else 0)
    _kda_span_state[(cols // bv, tab.N * H)](
        bufs["W"], bufs["U"], bufs["KG"], bufs["GAM"], S_ext, M, tab.chunk_off, 0, tab.NC, tab.NC, tab.NT,
        H, K, V, BT=BT, BK=BK, BV=bv, BVP=BVP, IS_VARLEN=tab.varlen, PREC=dot_precision(bufs["W"].dtype),
        num_warps=4, num_stages=state_stages(2, bufs["W"].dtype, BK))
    return M, S_ext


def span_rows(bufs: dict, SE: torch.Tensor, Mt: torch.Tensor, row_cs: torch.Tensor, row_ce: torch.Tensor,
              row_m: torch.Tensor, H: int, K: int, V: int) -> None:
    """``_kda_span_rows`` over a training forward's kept buffers: row r of ``SE [R, H, K, V]`` / ``Mt [R, H, K, K]``
    (fp32, updated in place) through chunks [row_cs[r], row_ce[r]), its M columns only where ``row_m[r]``."""
    BK, BVP = bufs["W"].shape[-1], bufs["U"].shape[-1]
    bv = min(state_bv(_ROWS_BV, BK), BVP, BK)
    _kda_span_rows[((BVP + BK) // bv, row_cs.numel() * H)](
        bufs["W"], bufs["U"], bufs["KG"], bufs["GAM"], SE, Mt, row_cs, row_ce, row_m, 0, bufs["W"].shape[1], H, K,
        V, BT=BT, BK=BK, BV=bv, BVP=BVP, PREC=dot_precision(bufs["W"].dtype),
        num_warps=4, num_stages=state_stages(3, bufs["W"].dtype, BK))
