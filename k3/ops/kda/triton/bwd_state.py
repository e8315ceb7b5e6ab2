"""The backward's reverse state pass, one program per (V-block, sequence, head), chunks in reverse order.

With dS' the gradient of the state leaving chunk c (fp32, in registers) and the forward's buffers:

    dV' = A_qkᵀ dO + kg dS';    dS = Diag(γ) dS' + qgᵀ dO − Wᵀ dV'

It stores every chunk's dS' (``DHS``) and dV' (``DV``) for the chunk-parallel kernels, and the gradient of each
sequence's initial state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BT,
    ChunkTable,
    _chunk_range,
    _seq_bounds,
    dot_precision,
    next_pow2,
    state_bv,
    state_stages,
    store_dtype,
)

# BV 64 at 4 warps, 3 stages (H200, fwd+bwd B=8 T=4096 H=32: 1 / 2 / 3 stages 13.42 / 13.08 / 12.69 ms)
_STATE_BV = 64


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_state(
    do, AQK, KG, QG, W, GAM, DHS, DV, dht, dh0,
    cu, chunk_off, NC, T, NT,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    DT: tl.constexpr = W.dtype.element_ty
    cs, ce = _chunk_range(i_n, chunk_off, NT, IS_VARLEN)
    bos, eos = _seq_bounds(i_n, cu, T, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = ((i_n * H + i_h).to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    if USE_DHT:
        dS = tl.load(dht + p_s, mask=m_s, other=0.).to(tl.float32)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, ce - cs):
        c = ce - 1 - i
        base = (i_h * NC + c).to(tl.int64)
        t = bos + (c - cs).to(tl.int64) * BT + o_t
        b_do = tl.load(do + (t * H + i_h)[:, None] * V + o_v[None, :], mask=(t < eos)[:, None] & m_v[None, :],
                       other=0.).to(DT)
        p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
        b_a = tl.load(AQK + (base * BT + o_t[:, None]) * BT + o_t[None, :])
        b_kg = tl.load(KG + p_tk)
        b_qg = tl.load(QG + p_tk)
        b_w = tl.load(W + p_tk)
        b_gam = tl.load(GAM + base * BK + o_k)
        b_ds = dS.to(DT)
        tl.store(DHS + (base * BK + o_k[:, None]) * BVP + o_v[None, :], b_ds)
        b_dvn = (tl.dot(tl.trans(b_a), b_do, input_precision=PREC) +
                 tl.dot(b_kg, b_ds, input_precision=PREC)).to(DT)
        tl.store(DV + (base * BT + o_t[:, None]) * BVP + o_v[None, :], b_dvn)
        dS = dS * b_gam[:, None] + tl.dot(tl.trans(b_qg), b_do, input_precision=PREC) \
            - tl.dot(tl.trans(b_w), b_dvn, input_precision=PREC)
    tl.store(dh0 + p_s, dS, mask=m_s)

def bwd_state_pass(do, dht, saved: dict, tab: ChunkTable, H: int, K: int, V: int, dtype: torch.dtype,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The reverse state pass alone: ``(DHS, DV, dh0)`` — per-chunk state gradients, dV' and the gradient of each
    sequence's initial state. Context parallel runs it first with ``dht = None`` to learn the entry-state gradient
    it owes the previous rank, before the full backward. ``out = (DHS, DV)``: write into these (only the chunks of
    ``tab``'s sequences; a segment table over part of the chunks leaves the others as they are)."""
    dev = do.device
    N, NC = tab.N, tab.NC
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(dtype)
    dh0 = torch.zeros(N, H, K, V, dtype=torch.float32, device=dev)
    if out is None:
        DHS = torch.empty(H, NC, BK, BVP, dtype=dt, device=dev)
        DV = torch.empty(H, NC, BT, BVP, dtype=dt, device=dev)
    else:
        DHS, DV = out
    bv = min(state_bv(_STATE_BV, BK), BVP)
    s = saved
    _kda_bwd_state[(BVP // bv, N * H)](
        do, s["AQK"], s["KG"], s["QG"], s["W"], s["GAM"], DHS, DV, dht if dht is not None else dh0, dh0,
        tab.cu, tab.chunk_off, NC, tab.T, tab.NT, H, K, V, BT=BT, BK=BK, BV=bv, BVP=BVP,
        USE_DHT=dht is not None, IS_VARLEN=tab.varlen, PREC=dot_precision(dtype),
        num_warps=4, num_stages=state_stages(3, dtype, BK))
    return DHS, DV, dh0
