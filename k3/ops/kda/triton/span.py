"""Span summaries for the exact parallel prefix (SPEC §2): per sequence, the affine map S_out = M·S_in + S_ext.

The state pass runs on the extended columns [S_ext | M] (``[K, V + K]``): chunk by chunk
V' = [U | 0] − W [S_ext | M];  [S_ext | M] ← Diag(γ) [S_ext | M] + kgᵀ V', from [0 | I]. Column blocks of the
extended state are independent programs, so the M chain costs one more state pass of K columns. fp32 state,
windowed like the inference forward (memory does not grow with T).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import BT, _chunk_range, dot_precision, make_chunk_table, next_pow2, store_dtype
from k3.ops.kda.triton.chunk_fwd import FwdConfig, alloc_chunk_buffers, chunk_bytes, launch_prep


class SpanConfig:
    bv = 32
    warps = 4
    stages = 2


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
        DT: tl.constexpr = W.dtype.element_ty
        is_m = i_b * BV >= BVP  # this block holds columns of M (else of S_ext)
        o_t = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        col = tl.where(is_m, i_b * BV - BVP, i_b * BV) + tl.arange(0, BV)
        NCOL = tl.where(is_m, K, V)
        m_s = (o_k < K)[:, None] & (col < NCOL)[None, :]
        p_s = ((i_n * H + i_h).to(tl.int64) * K + o_k[:, None]) * NCOL + col[None, :]
        if is_m:
            S = tl.load(M + p_s, mask=m_s, other=0.)
        else:
            S = tl.load(SE + p_s, mask=m_s, other=0.)
        for c in range(lo, hi):
            base = (i_h * NCw + (c - c0)).to(tl.int64)
            p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
            b_w = tl.load(W + p_tk)
            b_kg = tl.load(KG + p_tk)
            b_gam = tl.load(GAM + base * BK + o_k)
            b_u = tl.load(U + (base * BT + o_t[:, None]) * BVP + col[None, :],
                          mask=(col < BVP)[None, :] & (not is_m), other=0.)
            b_vn = (b_u.to(tl.float32) - tl.dot(b_w, S.to(DT), input_precision=PREC)).to(DT)
            S = S * b_gam[:, None] + tl.dot(tl.trans(b_kg), b_vn, input_precision=PREC)
        if is_m:
            tl.store(M + p_s, S, mask=m_s)
        else:
            tl.store(SE + p_s, S, mask=m_s)


def span_summaries_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: ``M [N, H, K, K]`` fp32 (product over chunks of Diag(e^{G_C}) − kgᵀW) and ``S_ext [N, H, K, V]``
    fp32 (the final state from a zero initial state). Forward only (no autograd)."""
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    tab = make_chunk_table(B, Tq, cu_seqlens, q.device)
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    S_ext = torch.zeros(tab.N, H, K, V, dtype=torch.float32, device=q.device)
    M = torch.eye(K, dtype=torch.float32, device=q.device).repeat(tab.N, H, 1, 1).contiguous()
    if tab.NC == 0:
        return M, S_ext
    flags = dict(l2norm=bool(use_qk_l2norm_in_kernel), use_gate=bool(use_gate_in_kernel),
                 beta_sigmoid=bool(use_beta_sigmoid_in_kernel), exact_diag=lower_bound is None)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    ncw = max(1, min(tab.NC, FwdConfig.window_bytes // chunk_bytes(H, BK, BVP, dt)))
    bufs = alloc_chunk_buffers(H, ncw, BK, BVP, dt, q.device, store_t=False)
    bv = min(SpanConfig.bv, BVP, BK)
    for c0 in range(0, tab.NC, ncw):
        n = min(ncw, tab.NC - c0)
        launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs, tab, c0, n, float(scale), lower_bound, flags, False)
        _kda_span_state[((BVP + BK) // bv, tab.N * H)](
            bufs["W"], bufs["U"], bufs["KG"], bufs["GAM"], S_ext, M, tab.chunk_off, c0, c0 + n, ncw, tab.NT,
            H, K, V, BT=BT, BK=BK, BV=bv, BVP=BVP, IS_VARLEN=tab.varlen, PREC=dot_precision(q.dtype),
            num_warps=SpanConfig.warps, num_stages=SpanConfig.stages)
    return M, S_ext
