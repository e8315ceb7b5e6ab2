"""The 64-token state pass: the only serial part of the forward, one program per (V-block, sequence, head).

Per chunk c of the program's sequence, with the fp32 state S [BK, BV] in registers and the prep's buffers:

    V' = U − W S;    O = qg S + A_qk V';    S ← Diag(γ) S + kgᵀ V'

Training also stores every chunk's entry state (``HS``) and V' (``VN``) for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import BT, ChunkTable, _state_program, dot_precision, state_bv, state_stages

# BV 64 at 4 warps, 3 stages (H200: half the re-reads of W, kg, qg, A_qk of BV 32; 3 stages 39.6 → 31.2 ms per 1M)
_STATE_BV = 64


@triton.jit(do_not_specialize=['c0', 'c1', 'NCw', 'NCh', 'T', 'NT', 'H'])
def _kda_fwd_state(
    W, U, KG, QG, AQK, GAM, o, HS, ht,
    cu, chunk_off, c0, c1, NCw, NCh, T, NT,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    STORE_H: tl.constexpr, STORE_O: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
    VN=None, STORE_VN: tl.constexpr = False,
):
    # STORE_VN (training): V' of every chunk goes to VN for the WY backward, which then loads it instead of
    # recomputing U − W S (the same values: S is rounded to the store dtype either way)
    i_v, i_n, i_h, cs, bos, eos, lo, hi = _state_program(cu, chunk_off, c0, c1, T, NT, H, IS_VARLEN)
    if lo < hi:
        DT: tl.constexpr = W.dtype.element_ty
        o_t = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        p_s = ht + ((i_n * H + i_h).to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
        S = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.)
        for c in range(lo, hi):
            base = (i_h * NCw + (c - c0)).to(tl.int64)
            p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
            b_w = tl.load(W + p_tk)
            b_kg = tl.load(KG + p_tk)
            b_u = tl.load(U + (base * BT + o_t[:, None]) * BVP + o_v[None, :])
            b_gam = tl.load(GAM + base * BK + o_k)
            b_s = S.to(DT)
            if STORE_H:
                tl.store(HS + ((i_h * NCh + c).to(tl.int64) * BK + o_k[:, None]) * BVP + o_v[None, :], b_s)
            b_vn = (b_u.to(tl.float32) - tl.dot(b_w, b_s, input_precision=PREC)).to(DT)
            if STORE_VN:
                tl.store(VN + ((i_h * NCh + c).to(tl.int64) * BT + o_t[:, None]) * BVP + o_v[None, :], b_vn)
            if STORE_O:
                b_qg = tl.load(QG + p_tk)
                b_a = tl.load(AQK + (base * BT + o_t[:, None]) * BT + o_t[None, :])
                b_o = tl.dot(b_qg, b_s, input_precision=PREC) + tl.dot(b_a, b_vn, input_precision=PREC)
                t = bos + (c - cs).to(tl.int64) * BT + o_t
                tl.store(o + (t * H + i_h)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty),
                         mask=(t < eos)[:, None] & m_v[None, :])
            S = S * b_gam[:, None] + tl.dot(tl.trans(b_kg), b_vn, input_precision=PREC)
        tl.store(p_s, S, mask=m_k[:, None] & m_v[None, :])


def launch_state(bufs: dict, o, hs, ht, tab: ChunkTable, c0: int, c1: int, H: int, K: int, V: int,
                 store_o: bool = True, vn: torch.Tensor | None = None) -> None:
    """The serial state pass over chunks [c0, c1) of ``tab`` from the states ``ht`` (updated in place); ``hs`` /
    ``vn`` (``[H, tab.NC, ·, BVP]``): also store every chunk's entry state / V' there (training)."""
    BK = bufs["W"].shape[-1]
    BVP = bufs["U"].shape[-1]
    BV = min(state_bv(_STATE_BV, BK), BVP)
    _kda_fwd_state[(BVP // BV, tab.N * H)](
        bufs["W"], bufs["U"], bufs["KG"], bufs["QG"], bufs["AQK"], bufs["GAM"],
        o if o is not None else ht, hs if hs is not None else ht, ht,
        tab.cu, tab.chunk_off, c0, c1, bufs["W"].shape[1], tab.NC, tab.T, tab.NT,
        H, K, V, BT=BT, BK=BK, BV=BV, BVP=BVP, STORE_H=hs is not None, STORE_O=store_o,
        IS_VARLEN=tab.varlen, PREC=dot_precision(bufs["W"].dtype),
        **(dict(VN=vn, STORE_VN=True) if vn is not None else {}),
        num_warps=4, num_stages=state_stages(3, bufs["W"].dtype, BK),
    )
