"""Chunked KDA backward: the forward's mirror, three kernels.

Per chunk (natural-log units; G = within-chunk cumsum of g, γ = e^{G_C}, S = state entering the chunk,
dS' = gradient of the state leaving it), with V' = U − W S, O = qg S + A_qk V', S' = Diag(γ) S + kgᵀ V':

``_kda_bwd_state`` (sequential, reverse): dV' = A_qkᵀ dO + kg dS';  dS = Diag(γ) dS' + qgᵀ dO − Wᵀ dV'.
``_kda_bwd_wy`` (chunk-parallel): through the WY form W = T X, U = T Y (X = β K e^G, Y = β V):
    dqg = dO Sᵀ, dA_qk = dO V'ᵀ, dkg = V' dS'ᵀ, dW = −dV' Sᵀ, dY = Tᵀ dV', dX = Tᵀ dW,
    dT = dW Xᵀ + dV' Yᵀ, and γ's share Σ_v S ⊙ dS'.
``_kda_bwd_intra`` (chunk-parallel): dL = −Tᵀ dT Tᵀ (strictly lower), then A_qk / A_kk back to q, k, G, β with
    the forward's column-block references, the reverse within-chunk cumsum dG → dg, and the fused gate, L2-norm and
    β-sigmoid backward (dA_log, ddt_bias reduced per chunk, summed on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BC,
    BT,
    ChunkTable,
    _chunk_pos,
    _chunk_range,
    _row,
    _rows,
    _seq_bounds,
    _sigmoid,
    _softplus,
    dot_precision,
    next_pow2,
    store_dtype,
)
from k3.ops.kda.triton.chunk_fwd import (
    _bcast_rows,
    _block_first,
    _gate_cumsum,
    _load_beta,
    _load_tile,
    _place_rows,
)


class BwdConfig:
    state_bv = 32
    state_warps = 4
    state_stages = 2
    wy_bv = 64
    wy_warps = 8
    intra_warps = 8


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


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_wy(
    k, v, g, beta, A_log, dt_bias, do,
    W, U, QG, TM, HS, DHS, DV,
    dv, DQ, DK, DG, DB, DTT, DAQ,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    DT: tl.constexpr = W.dtype.element_ty
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    t = bos + o_t
    m_t = t < eos
    b_k = _load_tile(k, i_h, bos, eos, H, K, 0, BT, BK).to(tl.float32)
    if L2NORM:
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    G = _gate_cumsum(_load_tile(g, i_h, bos, eos, H, K, 0, BT, BK), i_h, 0, bos, eos, A_log, dt_bias, lb, K,
                     BT, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    b_b = _load_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)
    p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
    p_tt = (base * BT + o_t[:, None]) * BT + o_t[None, :]
    b_w = tl.load(W + p_tk)
    b_tm = tl.load(TM + p_tt)

    dqg = tl.zeros([BT, BK], dtype=tl.float32)
    dkg = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    daq = tl.zeros([BT, BT], dtype=tl.float32)
    dtt = tl.zeros([BT, BT], dtype=tl.float32)
    dgam = tl.zeros([BK], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, BVP // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_kv = (base * BK + o_k[:, None]) * BVP + o_v[None, :]
        p_tv = (base * BT + o_t[:, None]) * BVP + o_v[None, :]
        b_s = tl.load(HS + p_kv)
        b_ds = tl.load(DHS + p_kv)
        b_vn = (tl.load(U + p_tv).to(tl.float32) - tl.dot(b_w, b_s, input_precision=PREC)).to(DT)
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = (t * H + i_h)[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(DT)
        b_dvn = tl.load(DV + p_tv)
        dqg += tl.dot(b_do, tl.trans(b_s), input_precision=PREC)
        daq += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        dkg += tl.dot(b_vn, tl.trans(b_ds), input_precision=PREC)
        dw -= tl.dot(b_dvn, tl.trans(b_s), input_precision=PREC)
        b_dy = tl.dot(tl.trans(b_tm), b_dvn, input_precision=PREC)
        b_vv = tl.load(v + p_v, mask=m_tv, other=0.).to(tl.float32)
        tl.store(dv + p_v, (b_dy * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        db += tl.sum(b_dy * b_vv, axis=1)
        dtt += tl.dot(b_dvn, tl.trans((b_vv * b_b[:, None]).to(DT)), input_precision=PREC)
        dgam += tl.sum(b_s.to(tl.float32) * b_ds.to(tl.float32), axis=1)

    Glast = _row(G, BT - 1, o_t)
    eG = tl.exp2(G)
    eL = tl.exp2(Glast[None, :] - G)
    b_x = b_k * eG * b_b[:, None]
    b_dw = dw.to(DT)
    dx = tl.dot(tl.trans(b_tm), b_dw, input_precision=PREC)
    dtt += tl.dot(b_dw, tl.trans(b_x.to(DT)), input_precision=PREC)
    b_qg = tl.load(QG + p_tk).to(tl.float32)
    dG = dx * b_x - dkg * b_k * eL + dqg * b_qg
    dG += tl.where((o_t == BT - 1)[:, None], (tl.sum(dkg * b_k * eL, axis=0) + tl.exp2(Glast) * dgam)[None, :], 0.)
    tl.store(DQ + p_tk, dqg * eG * scale)
    tl.store(DK + p_tk, dx * eG * b_b[:, None] + dkg * eL)
    tl.store(DG + p_tk, dG)
    tl.store(DB + base * BT + o_t, db + tl.sum(dx * b_k * eG, axis=1))
    tl.store(DTT + p_tt, dtt)
    tl.store(DAQ + p_tt, tl.where(o_t[:, None] >= o_t[None, :], daq * scale, 0.))


@triton.jit
def _cols(x, J, NB: tl.constexpr, BC: tl.constexpr):
    """Column block J of a [M, NB*BC] tensor → [M, BC]."""
    M: tl.constexpr = x.shape[0]
    o_b = tl.arange(0, NB)
    return tl.sum(tl.where((o_b == J)[None, :, None], tl.reshape(x, (M, NB, BC)), 0.), axis=1)


@triton.jit
def _intra_bwd(b_q, b_k, G, dAq, dAk, dL, o_t, NB: tl.constexpr, BC: tl.constexpr, EXACT_DIAG: tl.constexpr,
               PREC: tl.constexpr):
    """Backward of A_qk = Σ q k e^{ΔG} (gradient dAq) and A_kk-like Ã = Σ k k e^{ΔG} (gradient dAk), with the
    forward's column-block references. Returns dq, dk (row side), dk (column side), dβ share (Σ_j dL Ã)."""
    BT_: tl.constexpr = NB * BC
    BKS: tl.constexpr = G.shape[1]
    blk = o_t // BC
    Gf = _block_first(G, NB, BC)
    Gfr = _bcast_rows(Gf, NB, BC)
    e1 = tl.exp2(G - Gfr)
    einv = tl.exp2(Gfr - G)
    ql = b_q * e1
    kl = b_k * e1
    kd = b_k * einv
    o_b = tl.arange(0, NB)
    o_s = tl.arange(0, BC)
    dq = tl.zeros([BT_, BKS], dtype=tl.float32)
    dkr = tl.zeros([BT_, BKS], dtype=tl.float32)
    dkc = tl.zeros([BT_, BKS], dtype=tl.float32)
    db = tl.zeros([BT_], dtype=tl.float32)
    for J in range(NB):
        GJ = tl.sum(tl.where((o_b == J)[:, None], Gf, 0.), axis=0)
        f = _bcast_rows(tl.exp2(tl.where((o_b >= J)[:, None], Gf - GJ[None, :], float("-inf"))), NB, BC)
        kdJ = _rows(kd, J, NB, BC)
        einvJ = _rows(einv, J, NB, BC)
        dAqJ = _cols(dAq, J, NB, BC)
        dAkJ = _cols(dAk, J, NB, BC)
        dLJ = _cols(dL, J, NB, BC)
        if EXACT_DIAG:
            # factored products cover the rows below block J only; the diagonal block goes exact below
            below = (blk > J)[:, None]
            dAqJ_f = tl.where(below, dAqJ, 0.)
            dAkJ_f = tl.where(below, dAkJ, 0.)
            dLJ_f = tl.where(below, dLJ, 0.)
        else:
            dAqJ_f = dAqJ
            dAkJ_f = dAkJ
            dLJ_f = dLJ
        qlf = ql * f
        klf = kl * f
        lf = e1 * f
        dq += tl.dot(dAqJ_f, kdJ, input_precision=PREC) * lf
        dkr += tl.dot(dAkJ_f, kdJ, input_precision=PREC) * lf
        dkcJ = (tl.dot(tl.trans(dAqJ_f), qlf, input_precision=PREC) +
                tl.dot(tl.trans(dAkJ_f), klf, input_precision=PREC)) * einvJ
        db += tl.sum(dLJ_f * tl.dot(klf, tl.trans(kdJ), input_precision=PREC), axis=1)
        if EXACT_DIAG:
            gJ = _rows(G, J, NB, BC)
            kJ = _rows(b_k, J, NB, BC)
            qJ = _rows(b_q, J, NB, BC)
            dAqd = _rows(dAqJ, J, NB, BC)  # [BC, BC] diagonal block
            dAkd = _rows(dAkJ, J, NB, BC)
            dLd = _rows(dLJ, J, NB, BC)
            keep = o_s[:, None] >= o_s[None, :]
            E = tl.exp2(tl.where(keep[:, :, None], gJ[:, None, :] - gJ[None, :, :], float("-inf")))
            kE = kJ[None, :, :] * E  # [i, j, d] = k_j e^{G_i − G_j}
            dq += _place_rows(tl.sum(dAqd[:, :, None] * kE, axis=1), J, NB, BC)
            dkr += _place_rows(tl.sum(dAkd[:, :, None] * kE, axis=1), J, NB, BC)
            dkcJ += tl.sum((dAqd[:, :, None] * qJ[:, None, :] + dAkd[:, :, None] * kJ[:, None, :]) * E, axis=0)
            At = tl.sum(kJ[:, None, :] * kE, axis=2)  # Ã diagonal block
            db += tl.reshape(tl.where((o_b == J)[:, None], tl.sum(dLd * At, axis=1)[None, :], 0.), (BT_,))
        dkc += _place_rows(dkcJ, J, NB, BC)
    return dq, dkr, dkc, db


@triton.jit
def _gate_bwd(dgt, b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K,
              USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr):
    """Gradient through the gate activation. Returns (d raw f, per-element share of dA_log)."""
    if USE_GATE:
        x = b_f
        if HAS_DT:
            x = x + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)[None, :]
        a = 1.0
        if HAS_A:
            a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if HAS_LB:
            z = x * a
            dz = dgt * lb * _sigmoid(z) * _sigmoid(-z)  # σ(z)σ(−z), not s(1 − s): no cancellation near |z| ≫ 1
            df = dz * a
            dA = dz * z
        else:
            df = dgt * (-a) * _sigmoid(x)
            dA = dgt * (-a) * _softplus(x)
    else:
        df = dgt
        dA = tl.zeros_like(dgt)
    return df, dA


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_intra(
    q, k, g, beta, A_log, dt_bias,
    TM, DQ, DK, DG, DB, DTT, DAQ,
    dq, dk, dg, dbeta, DA, DDT,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT_DIAG: tl.constexpr,
    PREC: tl.constexpr,
):
    NB: tl.constexpr = BT // BC
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = (bos + o_t) < eos
    m_k = o_k < K
    m = m_t[:, None] & m_k[None, :]
    p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
    p_tt = (base * BT + o_t[:, None]) * BT + o_t[None, :]
    b_kr = _load_tile(k, i_h, bos, eos, H, K, 0, BT, BK).to(tl.float32)
    b_qr = _load_tile(q, i_h, bos, eos, H, K, 0, BT, BK).to(tl.float32)
    if L2NORM:
        rk = 1.0 / tl.sqrt(tl.sum(b_kr * b_kr, axis=1) + 1e-6)
        rq = 1.0 / tl.sqrt(tl.sum(b_qr * b_qr, axis=1) + 1e-6)
    else:
        rk = tl.full([BT], 1.0, tl.float32)
        rq = tl.full([BT], 1.0, tl.float32)
    b_k = b_kr * rk[:, None]
    b_q = b_qr * rq[:, None]
    b_f = _load_tile(g, i_h, bos, eos, H, K, 0, BT, BK).to(tl.float32)
    G = _gate_cumsum(b_f, i_h, 0, bos, eos, A_log, dt_bias, lb, K, BT, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    b_b = _load_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)

    Tm = tl.load(TM + p_tt).to(tl.float32)
    dL = -tl.dot(tl.dot(tl.trans(Tm), tl.load(DTT + p_tt), input_precision=PREC), tl.trans(Tm),
                 input_precision=PREC)
    dL = tl.where(o_t[:, None] > o_t[None, :], dL, 0.)
    dAq = tl.load(DAQ + p_tt)
    dqi, dkr, dkc, dbi = _intra_bwd(b_q, b_k, G, dAq, dL * b_b[:, None], dL, o_t, NB, BC, EXACT_DIAG, PREC)
    b_dq = tl.load(DQ + p_tk) + dqi
    b_dk = tl.load(DK + p_tk) + dkr + dkc
    dG = tl.load(DG + p_tk) + b_q * dqi + b_k * (dkr - dkc)
    b_db = tl.load(DB + base * BT + o_t) + dbi

    dgt = tl.cumsum(dG, axis=0, reverse=True)
    df, dA = _gate_bwd(dgt, b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    df = tl.where(m, df, 0.)
    p = (bos + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :]
    tl.store(dg + p, df.to(dg.dtype.element_ty), mask=m)
    if USE_GATE:
        tl.store(DDT + base * BK + o_k, tl.sum(df, axis=0))
        tl.store(DA + base, tl.sum(tl.sum(tl.where(m, dA, 0.), axis=1), axis=0))
    if L2NORM:
        b_dq = rq[:, None] * (b_dq - b_q * tl.sum(b_dq * b_q, axis=1)[:, None])
        b_dk = rk[:, None] * (b_dk - b_k * tl.sum(b_dk * b_k, axis=1)[:, None])
    tl.store(dq + p, b_dq.to(dq.dtype.element_ty), mask=m)
    tl.store(dk + p, b_dk.to(dk.dtype.element_ty), mask=m)
    if BETA_SIGMOID:
        b_r = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_db = b_db * _sigmoid(b_r) * _sigmoid(-b_r)
    tl.store(dbeta + (bos + o_t) * H + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_t)


def kda_bwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale: float, do, dht, saved: dict, tab: ChunkTable,
            lower_bound, flags: dict):
    """Gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) of chunk KDA; ``saved`` from the training forward."""
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    N, NC = tab.N, tab.NC
    dq, dk, dg = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(g)
    dv, db = torch.zeros_like(v), torch.zeros_like(beta)
    dh0 = torch.zeros(N, H, K, V, dtype=torch.float32, device=dev)
    dA = torch.zeros_like(A_log) if A_log is not None else None
    ddt = torch.zeros_like(dt_bias) if dt_bias is not None else None
    if NC == 0:
        if dht is not None:
            dh0.copy_(dht)
        return dq, dk, dv, dg, db, dA, ddt, (dh0 if initial_state is not None else None)
    do = do.contiguous()
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    prec = dot_precision(q.dtype)
    s = saved
    flag_kw = dict(USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None, HAS_A=A_log is not None,
                   HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"], BETA_SIGMOID=flags["beta_sigmoid"],
                   IS_VARLEN=tab.varlen)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    f32 = dict(dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, **f32)
    a_log = A_log if A_log is not None else dummy
    dtb = dt_bias if dt_bias is not None else dummy

    DHS = torch.empty(H, NC, BK, BVP, dtype=dt, device=dev)
    DV = torch.empty(H, NC, BT, BVP, dtype=dt, device=dev)
    bv = min(BwdConfig.state_bv, BVP)
    _kda_bwd_state[(BVP // bv, N * H)](
        do, s["AQK"], s["KG"], s["QG"], s["W"], s["GAM"], DHS, DV, dht if dht is not None else dh0, dh0,
        tab.cu, tab.chunk_off, NC, tab.T, tab.NT, H, K, V, BT=BT, BK=BK, BV=bv, BVP=BVP,
        USE_DHT=dht is not None, IS_VARLEN=tab.varlen, PREC=prec,
        num_warps=BwdConfig.state_warps, num_stages=BwdConfig.state_stages)

    DQ, DK, DG = (torch.empty(H, NC, BT, BK, **f32) for _ in range(3))
    DB = torch.empty(H, NC, BT, **f32)
    DTT, DAQ = (torch.empty(H, NC, BT, BT, **f32) for _ in range(2))
    _kda_bwd_wy[(NC, H)](
        k, v, g, beta, a_log, dtb, do, s["W"], s["U"], s["QG"], s["TM"], s["HS"], DHS, DV,
        dv, DQ, DK, DG, DB, DTT, DAQ, tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT,
        H, K, V, scale, lb, BT=BT, BK=BK, BV=min(BwdConfig.wy_bv, BVP), BVP=BVP, PREC=prec, **flag_kw,
        num_warps=BwdConfig.wy_warps, num_stages=1)

    DAP = torch.empty(H, NC, **f32)
    DDT = torch.empty(H, NC, BK, **f32)
    _kda_bwd_intra[(NC, H)](
        q, k, g, beta, a_log, dtb, s["TM"], DQ, DK, DG, DB, DTT, DAQ, dq, dk, dg, db, DAP, DDT,
        tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT, H, K, lb, BT=BT, BC=BC, BK=BK,
        EXACT_DIAG=flags["exact_diag"], PREC=prec, **flag_kw,
        num_warps=BwdConfig.intra_warps, num_stages=1)
    if flags["use_gate"]:
        if dA is not None:
            dA = DAP.sum(1).to(A_log.dtype).reshape(A_log.shape)
        if ddt is not None:
            ddt = DDT.sum(1)[:, :K].to(dt_bias.dtype).reshape(dt_bias.shape)
    return dq, dk, dv, dg, db, dA, ddt, (dh0 if initial_state is not None else None)
