"""The backward through the WY form, one program per (chunk, head, K-block) plus one per chunk-head for dv.

With W = T X (X = β k̂ e^G), U = T Y (Y = β v), V' = U − W S (stored by the forward) and dY = Tᵀ dV', every
[BT, K] output is column-local in K:

    dqg = dO Sᵀ,  dX = −dY Sᵀ,  dkg = V' dS'ᵀ,  γ's share Σ_v S ⊙ dS'     (programs 0 … K/BKW − 1, one K-block)

and the two [BT, BT] outputs need no dX: dL = −Tᵀ (dW Xᵀ + dV' Yᵀ) Tᵀ = −(dX Wᵀ + dY Uᵀ) = −dY V'ᵀ and
dA_qk = dO V'ᵀ (the last program, with dv = β dY). Axis 0 of the grid is chunk · NZ + block, so a chunk-head's
programs run side by side and share its dO, dV', V', T through L2. The K-block programs finish the shares of dq,
dk and dG that go through qg, X and kg (the gate cumsum of their columns recomputed), and store the within-block
gate cumsums and the rows' 1/‖q‖, 1/‖k‖ that the intra-chunk backward reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import _chunk_beta, _chunk_pos, _gate_fwd, state_stages

# K-blocks of 32 columns, V-blocks of 64, 4 warps, 3 stages (H200, fwd+bwd B=8 T=4096 H=32: 10.76 ms against
# 11.75 for one program per chunk-head; 2 stages 10.88, K-block 64 at 8 warps 11.92)
_BKW = 32
_BV = 64


@triton.jit
def _seg_cumsum(x, BC: tl.constexpr):
    """Cumsum of a [BT, N] tile along rows, restarting at every BC-row sub-block (small magnitudes: the intra
    backward builds every decay exponent from these and the sub-block totals, never as a difference of two
    whole-chunk cumsums, which at the gate bound reach −460 and lose ~1e-5 absolute)."""
    BT: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    return tl.reshape(tl.cumsum(tl.reshape(x, [BT // BC, BC, N]), axis=1), [BT, N])


@triton.jit
def _row_rnorm(x, i_h, bos, eos, H, K, BT: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr):
    """1/sqrt(Σ_d x² + 1e-6) of the chunk's rows of x [T, H, K] (full rows, summed in BKW-column slices to keep
    the tiles small; padding rows give 1e3)."""
    o_t = tl.arange(0, BT)
    m_t = (bos + o_t) < eos
    acc = tl.zeros([BT], dtype=tl.float32)
    for i in range(0, BK // BKW):
        o_k = i * BKW + tl.arange(0, BKW)
        m = m_t[:, None] & (o_k < K)[None, :]
        b = tl.load(x + (bos + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m, other=0.).to(tl.float32)
        acc += tl.sum(b * b, axis=1)
    return 1.0 / tl.sqrt(acc + 1e-6)


@triton.jit
def _wy_dy_vn(TM, VN, DV, base, o_t, o_v, BT: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr):
    """One V-block of dY = Tᵀ dV' (fp32) and V' (store dtype). T is re-read per V-block (an L1/L2 hit) rather than
    held in registers across the V loop."""
    p_tv = (base * BT + o_t[:, None]) * BVP + o_v[None, :]
    b_tt = tl.load(TM + (base * BT + o_t[None, :]) * BT + o_t[:, None])  # Tᵀ by the addressing
    b_dy = tl.dot(b_tt, tl.load(DV + p_tv), input_precision=PREC)
    return b_dy, tl.load(VN + p_tv)


@triton.jit
def _wy_dv_dl(v, do, TM, VN, DV, dv, DL, DAQ, DBP, b_b, base, i_h, t, m_t, o_t, H, V: tl.constexpr, scale,
              NKW: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr):
    """The chunk-head's [BT, BT] outputs dL = −dY V'ᵀ (strictly lower), dA_qk = dO V'ᵀ (lower, × scale), plus
    dv = β dY and dY's share of dβ (partial number NKW)."""
    DT: tl.constexpr = VN.dtype.element_ty
    db = tl.zeros([BT], dtype=tl.float32)
    dL = tl.zeros([BT, BT], dtype=tl.float32)
    daq = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, BVP // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (t * H + i_h)[:, None] * V + o_v[None, :]
        b_dy, b_vn = _wy_dy_vn(TM, VN, DV, base, o_t, o_v, BT, BVP, PREC)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(DT)
        b_vv = tl.load(v + p_v, mask=m_tv, other=0.).to(tl.float32)
        tl.store(dv + p_v, (b_dy * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        db += tl.sum(b_dy * b_vv, axis=1)
        dL -= tl.dot(b_dy.to(DT), tl.trans(b_vn), input_precision=PREC)
        daq += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
    p_tt = (base * BT + o_t[:, None]) * BT + o_t[None, :]
    tl.store(DL + p_tt, tl.where(o_t[:, None] > o_t[None, :], dL, 0.))
    tl.store(DAQ + p_tt, tl.where(o_t[:, None] >= o_t[None, :], daq * scale, 0.))
    tl.store(DBP + (base * (NKW + 1) + NKW) * BT + o_t, db)


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_wy(
    q, k, v, g, beta, A_log, dt_bias, do, RN, GS,
    VN, QG, TM, HS, DHS, DV,
    dv, DQ, DK, DG, DBP, DL, DAQ,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BT: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Grid (chunks · (K/BKW + 1), heads); see the module docstring. dβ comes out as K/BKW + 1 partials (``DBP``)."""
    NKW: tl.constexpr = BK // BKW
    NZ: tl.constexpr = NKW + 1
    i_h = tl.program_id(1)
    i_c = tl.program_id(0) // NZ
    i_k = tl.program_id(0) % NZ
    DT: tl.constexpr = VN.dtype.element_ty
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    t = bos + o_t
    m_t = t < eos
    b_b = _chunk_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)
    if i_k == NKW:
        _wy_dv_dl(v, do, TM, VN, DV, dv, DL, DAQ, DBP, b_b, base, i_h, t, m_t, o_t, H, V, scale, NKW, BT, BV, BVP,
                  PREC)
        if L2NORM:
            tl.store(RN + base * (2 * BT) + o_t, _row_rnorm(q, i_h, bos, eos, H, K, BT, BK, BKW))
            tl.store(RN + base * (2 * BT) + BT + o_t, _row_rnorm(k, i_h, bos, eos, H, K, BT, BK, BKW))
    else:
        o_kc = i_k * BKW + tl.arange(0, BKW)
        dqg = tl.zeros([BT, BKW], dtype=tl.float32)
        dx = tl.zeros([BT, BKW], dtype=tl.float32)
        dkg = tl.zeros([BT, BKW], dtype=tl.float32)
        dgam = tl.zeros([BKW], dtype=tl.float32)
        for i_v in range(0, BVP // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            p_kc = (base * BK + o_kc[:, None]) * BVP + o_v[None, :]
            b_dy, b_vn = _wy_dy_vn(TM, VN, DV, base, o_t, o_v, BT, BVP, PREC)
            b_do = tl.load(do + (t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
            b_sk = tl.load(HS + p_kc)
            b_dsk = tl.load(DHS + p_kc)
            dqg += tl.dot(b_do, tl.trans(b_sk), input_precision=PREC)
            dx -= tl.dot(b_dy.to(DT), tl.trans(b_sk), input_precision=PREC)
            dkg += tl.dot(b_vn, tl.trans(b_dsk), input_precision=PREC)
            dgam += tl.sum(b_sk.to(tl.float32) * b_dsk.to(tl.float32), axis=1)
        # ---- this K-block's columns: gate cumsum (whole chunk, its columns), normalized k, finishing products
        m_k = o_kc < K
        m = m_t[:, None] & m_k[None, :]
        p_x = t[:, None] * (H * K) + i_h * K + o_kc[None, :]
        b_g = _gate_fwd(tl.load(g + p_x, mask=m, other=0.).to(tl.float32), i_h, A_log, dt_bias, lb, o_kc, m_k, K,
                        USE_GATE, HAS_LB, HAS_A, HAS_DT)
        b_g = tl.where(m, b_g, 0.) * 1.4426950408889634
        G = tl.cumsum(b_g, axis=0)
        b_k = tl.load(k + p_x, mask=m, other=0.).to(tl.float32)
        if L2NORM:
            b_k = b_k * _row_rnorm(k, i_h, bos, eos, H, K, BT, BK, BKW)[:, None]
        p_tk = (base * BT + o_t[:, None]) * BK + o_kc[None, :]
        tl.store(GS + p_tk, _seg_cumsum(b_g, 16))
        eG = tl.exp2(G)
        Glast = tl.sum(tl.where((o_t == BT - 1)[:, None], G, 0.), axis=0)
        eL = tl.exp2(Glast[None, :] - G)
        kL = b_k * eL
        dgl = tl.sum(dkg * kL, axis=0) + tl.exp2(Glast) * dgam
        tl.store(DQ + p_tk, (dqg * eG * scale).to(DQ.dtype.element_ty))
        tl.store(DK + p_tk, (dx * eG * b_b[:, None] + dkg * eL).to(DK.dtype.element_ty))
        tl.store(DG + p_tk, dqg * tl.load(QG + p_tk).to(tl.float32) + dx * (b_k * eG * b_b[:, None]) - dkg * kL
                 + tl.where((o_t == BT - 1)[:, None], dgl[None, :], 0.))
        tl.store(DBP + (base * (NKW + 1) + i_k) * BT + o_t, tl.sum(dx * b_k * eG, axis=1))


def launch_wy(q, k, v, g, beta, a_log, dtb, do, RN: torch.Tensor, GS: torch.Tensor, saved: dict, DHS, DV,
              dv, DQ, DK, DG, DL, DAQ, tab, H: int, K: int, V: int, scale: float, lb: float, BT: int, BK: int,
              BVP: int, prec: str, flag_kw: dict) -> torch.Tensor:
    """Run ``_kda_bwd_wy``; returns DB [H, NC, BT] (the partials of dβ summed)."""
    NC = tab.NC
    bkw = min(_BKW, BK)
    nkw = BK // bkw
    DBP = torch.empty(H, NC, nkw + 1, BT, dtype=torch.float32, device=q.device)
    s = saved
    _kda_bwd_wy[(NC * (nkw + 1), H)](
        q, k, v, g, beta, a_log, dtb, do, RN, GS, s["VN"], s["QG"], s["TM"], s["HS"],
        DHS, DV, dv, DQ, DK, DG, DBP, DL, DAQ, tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT,
        H, K, V, scale, lb, BT=BT, BK=BK, BKW=bkw, BV=min(_BV, BVP), BVP=BVP, PREC=prec, **flag_kw,
        num_warps=4, num_stages=state_stages(3, s["VN"].dtype, BK))
    return DBP.sum(2)
