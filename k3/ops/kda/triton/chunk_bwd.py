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

import os

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BC,
    BT,
    ChunkTable,
    _chunk_beta,
    _chunk_gate_cumsum,
    _chunk_tile,
    _chunk_pos,
    _chunk_range,
    _row,
    _rows_gate,
    _seq_bounds,
    _sigmoid,
    dot_precision,
    maxnreg_kw,
    next_pow2,
    store_dtype,
)
from k3.ops.kda.triton.chunk_bwd_intra import _gate_bwd, _seg_cumsum, launch_intra_split, launch_wy_kb, wy_u_operand
from k3.ops.kda.triton.chunk_fwd import _load_rows, _load_tile, _store_rows, state_stages
from k3.ops.kda.triton._common import _l2norm


class BwdConfig:
    """Launch knobs (class attributes, switched by ``bench/kda_sweep.py``; defaults = its fastest correct choice)."""

    state_bv = 64  # sweep v6b (H200, B=8 T=4096 H=32): whole backward 11.34 → 11.10 ms vs BV 32
    state_warps = 4
    state_stages = 3  # run 4b: 13.39 → 13.13 ms (split intra); fp32 buffers are capped at 2 (shared memory)
    # bench/knob_ab.py (H200, session 5), fwd+bwd B=8 T=4096 H=32: 1 / 2 / 3 stages 13.42 / 13.08 / 12.69 ms
    # (B=1 T=32K 14.25 / 13.92 / 13.54), bitwise the same results; 4 warps 18.0, 16 warps 15.6, BV 128 16.9.
    # fp32 buffers are capped at 2 stages (shared memory). BV 32 stops the fused kernel with an illegal memory
    # access on the H200 (correct in the interpreter), so the launcher refuses it
    wy_bv = 64
    wy_warps = 8
    wy_stages = 3
    intra_warps = 4  # measured (v3 sweep): 4 warps + bf16x3 19.98 ms for the whole backward, v2 (8, tf32x3) 22.39
    intra_stages = 1
    # precision of the intra-chunk backward's fp32 dots for half inputs. Plain tf32 once cost 4e-2 in dg with every
    # gate at the bound (H200): that was A_qk's diagonal cancelling through the products, which
    # ``intra_qk_diag_apart`` removes; since then tf32 gives the same errors as the 3-pass 'bf16x3' on every extreme
    # case of ``bench/bwd_variant_errors.py`` (worst: dβ 9.4e-3, dg 3.9e-3; bf16 inputs vs fp64) and, H200, session
    # 7, ``bench/knob_ab.py``: fwd+bwd B=8 T=4096 H=32 12.42 vs 13.11 ms, B=1 T=32K 13.19 vs 13.89. 'bf16' (one pass
    # on bf16-rounded operands, split intra kernel only) was faster still (12.44 vs 12.96 with the session-6
    # diagonal terms) but dt_bias's gradient reached 2.5e-2 (β ≈ 1, repeated keys).
    intra_prec_half = "tf32"
    # half inputs: the precision of the split intra kernel's off-diagonal block products (None = intra_prec_half);
    # their decay factors are ≤ 1, unlike the diagonal block's. One bf16 pass there (H200, session 8, knob_ab):
    # fwd+bwd B=8 T=4096 H=32 10.15 vs 10.33 ms, B=1 T=32K 10.80 vs 10.96; every gradient's error vs fp64 on the
    # extreme cases of bench/bwd_variant_errors.py as with tf32 (worst dβ 9.4e-3) except ddt 7.1e-3 vs 4.3e-3 on
    # random inputs (bf16 everywhere, the diagonal block too: ddt 2.5e-2 at β ≈ 1 with repeated keys)
    intra_prec_off_half = "bf16"
    # dq, dk shares from the WY kernel to the split intra kernel in bf16 (fp16 under Triton's interpreter, which
    # cannot load bf16) instead of fp32 when ``half_scratch`` allows: −1 GB of traffic at B=8 T=4096 H=32. DG (its
    # shares cancel in the reverse cumsum) and the gate cumsums stay fp32. H200, session 8, knob_ab: 10.09 vs 10.33
    # ms (B=8 T=4096), 10.73 vs 10.96 (32K); with the bf16 off-diagonal products 9.99 / 10.63. Errors vs fp64
    # (bwd_variant_errors.py): dk 4.1e-3 vs 3.9e-3 at worst, every other gradient as before
    dqk_scratch_half = True
    intra_recompute = False  # reload k̂ and recompute G at the end instead of keeping them live (fewer spills)
    # split intra backward (chunk_bwd_intra.py): one light program per (16-row sub-block, chunk, head) for the
    # A_qk / A_kk backward, then the reverse cumsum + gate backward per (chunk, head, K-slice). Measured (one H200,
    # sweep run 4b, B=8 T=4096 H=32, whole backward): 19.57 ms (v3 intra) → 13.39 (split) → 12.39 (+ maxnreg 128)
    intra_split = True
    # all of K in one slice at 8 warps (dq, dk finish in registers: no scratch round trip): with the tf32 dots it
    # compiles without spills at the 128-register cap (sm_90; 168 B of spill stack at K-slice 64, 4 warps) and on the
    # H200 (session 7, knob_ab) 12.22 vs 12.54 ms fwd+bwd at B=8 T=4096 H=32, 13.07 vs 13.37 at B=1 T=32K (K-slice
    # 32: 13.73; 64 at 8 warps: 14.03; cap 168: 12.53). With bf16x3 dots it had been slower (13.29 vs 13.08).
    intra_split_warps = 8
    intra_split_stages = 1
    intra_split_bk = 128  # K-slice walked at a time by the split kernel (128 = all of K: fewer loads, more registers)
    intra_split_maxnreg = 128  # > 0: cap the split kernel's registers (ptxas maxnreg) to fit more programs per SM
    # one MMA per walk step on stacked operands instead of two (half the staging rounds); sweep v6 (H200, B=8
    # T=4096 H=32): whole backward 11.69 → 11.22 ms
    intra_split_stack = True
    # A_qk's diagonal kept out of the split intra kernel's products (its dq/dk terms added exactly; its dG shares
    # cancel): dg with every log-decay at the bound 6e-5 → 5e-6 (exact diagonal) / 7e-6 (bounded fast path)
    # relative RMS in fp32 (interpreter, K = 16). H200 (session 7): with the terms added inside the K-slice loop it
    # cost 0.4 ms per B=8 T=4096 step (13.02 vs 12.64, spills); added at the full-row read-back, 12.42 vs 12.34 at tf32
    intra_qk_diag_apart = True
    intra_dg_bk = 32  # K-slice of the dG → dg pass
    # bench/knob_ab.py (H200, session 6): 2 warps 12.65 / 12.64 / 12.60 vs 12.71 / 12.71 / 12.70 ms fwd+bwd at B=8
    # T=4096 H=32 in three runs, B=1 T=32K 13.49 vs 13.55; bitwise the same results
    intra_dg_warps = 2
    # WY backward per (chunk, head, K-block) in one pass over V (chunk_bwd_intra.py): dL = −dY V'ᵀ, no dX Wᵀ and
    # no second pass; one more program per chunk-head writes dv, dL, dA_qk. Run 4b: no gain (whole backward 13.46
    # vs 13.39 ms with the split intra, 19.93 vs 19.57 with v3's): every program recomputes dY = Tᵀ dV', V' = U − W S.
    # With V' stored by the forward (``FwdConfig.store_vn``) the K-block programs no longer recompute U − W S, and
    # the small K-blocks pay: H200, session 8, bench/knob_ab.py, fwd+bwd B=8 T=4096 H=32 (B=1 T=32K): fused WY
    # 11.75 (12.38) ms; K-block 32 at 4 warps, 3 stages 10.76 (11.41); 2 stages 10.88, 1 stage 11.18, 4 stages
    # 13.06; K-block 64 at 8 warps 11.92 (2 stages 11.59); K-block 16 13.31; 32 at 2 / 8 warps 12.99 / 13.45;
    # V-block 32 11.67; register caps 128 / 168 12.73 / 11.30; two launches 10.78
    wy_kb = True
    wy_kb_bk = 32
    wy_kb_bv = 64
    wy_kb_warps = 4
    wy_kb_stages = 3
    wy_kb_maxnreg = 0  # > 0: ptxas register cap
    # grid (chunks, heads, K-blocks): a chunk-head's programs far apart in launch order, so its dO, dV', V', T are
    # read from HBM by each; off = the chunk-head's programs adjacent (axis 0 = chunk · NZ + block), sharing via L2
    wy_kb_z_major = False
    wy_kb_two_pass = False  # dv/dL/dA_qk launch first, handing dY, V' to the K-block launch (no recompute)
    # WY backward as two launches of ``_kda_bwd_wy`` (the dV' pass, then the V' pass), each program holding half the
    # accumulators. sm_90 at 8 warps: 255 registers and 80 / 40 B of spills per pass against the fused kernel's
    # 504 B (still one program per SM); the fused kernel is ~6.5 ms at B=8 T=4096 H=32 (session 3 profile).
    # H200 (session 4): no gain, 14.99 vs 14.81 ms fwd+bwd at B=8 T=4096 H=32, so off.
    wy_split = False
    # Not adopted (H200, session 7, code in commit 84315b1): the V' pass's dk, dG shares stored into two more fp32
    # buffers for the split intra kernel to add, instead of read back at the end of every WY program: 12.70 vs
    # 12.35 ms (B=8 T=4096), 13.57 vs 13.19 (B=1 T=32K); sm_90 472 vs 432 B of spill stack
    wy_split_warps = 8
    wy_split_stages = 1
    wy_split_maxnreg = 0  # > 0: ptxas register cap


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


@triton.jit
def _wy_through_dvn(do, v, dv, U, TM, HS, DV, base, i_h, bos, eos, H, V: tl.constexpr, b_b,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr):
    """WY backward, pass through dV' over V-blocks: dY = Tᵀ dV' → dv (= β dY) and dβ's V share; returns
    dqg = Σ dO Sᵀ, dX = −Σ dY Sᵀ, Σ dY Uᵀ and dβ (V share)."""
    DT: tl.constexpr = HS.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    t = bos + o_t
    m_t = t < eos
    b_tm = tl.load(TM + (base * BT + o_t[:, None]) * BT + o_t[None, :])
    dqg = tl.zeros([BT, BK], dtype=tl.float32)
    dx = tl.zeros([BT, BK], dtype=tl.float32)
    dlu = tl.zeros([BT, BT], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, BVP // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (t * H + i_h)[:, None] * V + o_v[None, :]
        p_tv = (base * BT + o_t[:, None]) * BVP + o_v[None, :]
        b_s = tl.load(HS + (base * BK + o_k[:, None]) * BVP + o_v[None, :])
        b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(DT)
        b_dy = tl.dot(tl.trans(b_tm), tl.load(DV + p_tv), input_precision=PREC)
        b_vv = tl.load(v + p_v, mask=m_tv, other=0.).to(tl.float32)
        tl.store(dv + p_v, (b_dy * b_b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        db += tl.sum(b_dy * b_vv, axis=1)
        b_dyd = b_dy.to(DT)
        dqg += tl.dot(b_do, tl.trans(b_s), input_precision=PREC)
        dx -= tl.dot(b_dyd, tl.trans(b_s), input_precision=PREC)
        dlu += tl.dot(b_dyd, tl.trans(tl.load(U + p_tv)), input_precision=PREC)
    return dqg, dx, dlu, db


@triton.jit
def _wy_store_dvn(q, k, g, A_log, dt_bias, RN, GS, b_w, QG, DQ, DK, DG, DB, DL, dqg, dx, dlu, db, b_b, base, i_h,
                  bos, eos, H, K, scale, lb, BT: tl.constexpr, BK: tl.constexpr,
                  USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
                  L2NORM: tl.constexpr, PREC: tl.constexpr, STORE_RN: tl.constexpr, STORE_G: tl.constexpr,
                  VN_SAVED: tl.constexpr):
    """After the dV' pass: dL = −(dX Wᵀ + Σ dY Uᵀ) (strictly lower; = −Σ dY V'ᵀ, which ``dlu`` already is when
    V' was loaded: VN_SAVED), dq (= dqg e^G scale), dk and dg's shares through X = β K e^G and qg, dβ; the split
    intra backward's 1/‖q‖, 1/‖k‖ and within-sub-block gate cumsums. Returns (k̂, G) for the V' pass."""
    DT: tl.constexpr = b_w.dtype
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
    if VN_SAVED:
        dL = -dlu
    else:
        dL = -(tl.dot(dx.to(DT), tl.trans(b_w), input_precision=PREC) + dlu)
    tl.store(DL + (base * BT + o_t[:, None]) * BT + o_t[None, :], tl.where(o_t[:, None] > o_t[None, :], dL, 0.))
    b_k, rk = _l2norm(_chunk_tile(k, i_h, bos, eos, H, K, BT, BK).to(tl.float32), L2NORM)
    if STORE_RN:  # per-row 1/‖q‖, 1/‖k‖ for the split intra backward, which walks K in slices
        _, rq = _l2norm(_chunk_tile(q, i_h, bos, eos, H, K, BT, BK).to(tl.float32), L2NORM)
        tl.store(RN + base * (2 * BT) + o_t, rq)
        tl.store(RN + base * (2 * BT) + BT + o_t, rk)
    # the log2 gate once (the same values ``_chunk_gate_cumsum`` would sum): G, and for the split intra backward
    # the within-sub-block cumsums it reads instead of recomputing the gate
    b_gl = _rows_gate(g, A_log, dt_bias, i_h, bos, eos, H, K, lb, BT, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    G = tl.cumsum(b_gl, axis=0)
    if STORE_G:
        tl.store(GS + p_tk, _seg_cumsum(b_gl, 16))
    eG = tl.exp2(G)
    tl.store(DQ + p_tk, dqg * eG * scale)
    kb = b_k * eG * b_b[:, None]  # X = β K e^G
    tl.store(DG + p_tk, dqg * tl.load(QG + p_tk).to(tl.float32) + dx * kb)
    tl.store(DK + p_tk, dx * eG * b_b[:, None])
    tl.store(DB + base * BT + o_t, db + tl.sum(dx * b_k * eG, axis=1))
    return b_k, G


@triton.jit
def _wy_through_vn(do, U, b_w, HS, DHS, base, i_h, bos, eos, H, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr,
                   VN_SAVED: tl.constexpr):
    """WY backward, pass through V' = U − W S over V-blocks (V' loaded from ``U`` when VN_SAVED): returns
    dkg = Σ V' dS'ᵀ, dA_qk = Σ dO V'ᵀ (unscaled) and γ's share Σ S ⊙ dS'."""
    DT: tl.constexpr = b_w.dtype
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    t = bos + o_t
    m_t = t < eos
    dkg = tl.zeros([BT, BK], dtype=tl.float32)
    daq = tl.zeros([BT, BT], dtype=tl.float32)
    dgam = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, BVP // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_kv = (base * BK + o_k[:, None]) * BVP + o_v[None, :]
        b_s = tl.load(HS + p_kv)
        b_ds = tl.load(DHS + p_kv)
        if VN_SAVED:
            b_vn = tl.load(U + (base * BT + o_t[:, None]) * BVP + o_v[None, :])
        else:
            b_vn = (tl.load(U + (base * BT + o_t[:, None]) * BVP + o_v[None, :]).to(tl.float32)
                    - tl.dot(b_w, b_s, input_precision=PREC)).to(DT)
        b_do = tl.load(do + (t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.).to(DT)
        dkg += tl.dot(b_vn, tl.trans(b_ds), input_precision=PREC)
        daq += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        dgam += tl.sum(b_s.to(tl.float32) * b_ds.to(tl.float32), axis=1)
    return dkg, daq, dgam


@triton.jit
def _wy_store_vn(DAQ, DK, DG, dkg, daq, dgam, b_k, G, base, scale, BT: tl.constexpr, BK: tl.constexpr):
    """After the V' pass: dA_qk (lower, × scale), and dkg's shares of dk and dg (kg = k e^{G_C − G}), γ's share on
    the last row of dg; dk, dg are read back and updated (the dV' pass stored their first shares)."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
    tl.store(DAQ + (base * BT + o_t[:, None]) * BT + o_t[None, :],
             tl.where(o_t[:, None] >= o_t[None, :], daq * scale, 0.))
    Glast = _row(G, BT - 1, o_t)
    eL = tl.exp2(Glast[None, :] - G)
    kL = b_k * eL
    dgl = tl.sum(dkg * kL, axis=0) + tl.exp2(Glast) * dgam
    tl.store(DK + p_tk, tl.load(DK + p_tk) + dkg * eL)
    tl.store(DG + p_tk, tl.load(DG + p_tk) - dkg * kL + tl.where((o_t == BT - 1)[:, None], dgl[None, :], 0.))


@triton.jit
def _w_tile(p_w, BT: tl.constexpr, BK: tl.constexpr, VN_SAVED: tl.constexpr):
    """The chunk's W tile (pointers ``p_w``), or — when V' was saved (no W needed) — zeros that only carry the dtype
    (never read, the compiler drops them)."""
    if VN_SAVED:
        b_w = tl.zeros([BT, BK], dtype=p_w.dtype.element_ty)
    else:
        b_w = tl.load(p_w)
    return b_w


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_wy(
    q, k, v, g, beta, A_log, dt_bias, do, RN, GS,
    W, U, QG, TM, HS, DHS, DV,
    dv, DQ, DK, DG, DB, DL, DAQ,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
    STORE_RN: tl.constexpr, STORE_G: tl.constexpr, PASSES: tl.constexpr = 3, VN_SAVED: tl.constexpr = False,
):
    # VN_SAVED: ``U`` holds V' (stored by the forward), so dL = −Σ dY V'ᵀ and the V' pass loads V': no W at all.
    # Two passes over V-blocks, each with few accumulators (register pressure). With T X = W and T Y = U:
    # dX = Tᵀ dW = −dY Sᵀ and dL = −Tᵀ (dW Xᵀ + dV' Yᵀ) Tᵀ = −(dX Wᵀ + dY Uᵀ), so neither dT nor X is formed.
    # PASSES: 3 = both in one program; 1 = only the dV' pass, 2 = only the V' pass (``BwdConfig.wy_split``: two
    # launches, the second after the first, each program with half the live accumulators).
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    p_w = W + (base * BT + tl.arange(0, BT)[:, None]) * BK + tl.arange(0, BK)[None, :]
    if PASSES & 1:
        b_b = _chunk_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)
        dqg, dx, dlu, db = _wy_through_dvn(do, v, dv, U, TM, HS, DV, base, i_h, bos, eos, H, V, b_b,
                                           BT, BK, BV, BVP, PREC)
        b_w = _w_tile(p_w, BT, BK, VN_SAVED)  # after the dV' pass (fewer live registers there)
        b_k, G = _wy_store_dvn(q, k, g, A_log, dt_bias, RN, GS, b_w, QG, DQ, DK, DG, DB, DL, dqg, dx, dlu, db, b_b,
                               base, i_h, bos, eos, H, K, scale, lb, BT, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT,
                               L2NORM, PREC, STORE_RN, STORE_G, VN_SAVED)
    else:
        b_w = _w_tile(p_w, BT, BK, VN_SAVED)
        b_k, _ = _l2norm(_chunk_tile(k, i_h, bos, eos, H, K, BT, BK).to(tl.float32), L2NORM)
        G = _chunk_gate_cumsum(g, i_h, bos, eos, A_log, dt_bias, H, K, lb, BT, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    if PASSES & 2:
        dkg, daq, dgam = _wy_through_vn(do, U, b_w, HS, DHS, base, i_h, bos, eos, H, V, BT, BK, BV, BVP, PREC,
                                         VN_SAVED)
        _wy_store_vn(DAQ, DK, DG, dkg, daq, dgam, b_k, G, base, scale, BT, BK)


@triton.jit
def _sub_raw(q, k, i_h, bos, eos, H, K, I: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
             L2NORM: tl.constexpr):
    """Rows [I·BC, I·BC + BC): normalized q, k and their 1/‖·‖ (for the L2-norm backward)."""
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    t = bos + I * BC + o_s
    m = (t < eos)[:, None] & (o_k < K)[None, :]
    p = t[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_q, rq = _l2norm(tl.load(q + p, mask=m, other=0.).to(tl.float32), L2NORM)
    b_k, rk = _l2norm(tl.load(k + p, mask=m, other=0.).to(tl.float32), L2NORM)
    return b_q, b_k, rq, rk


@triton.jit
def _diag_bwd(dAq, dL, b_b, b_q, b_k, G, c, EXACT_DIAG: tl.constexpr, PREC: tl.constexpr):
    """Backward of one diagonal sub-block (forward reference = carry c). Returns the row-side dq, dk, the
    column-side dk (factor applied) and the β share Σ_j dL_ij Ã_ij."""
    dAk = dL * b_b[:, None]
    if EXACT_DIAG:
        o_s = tl.arange(0, b_q.shape[0])
        keep = o_s[:, None] >= o_s[None, :]
        E = tl.exp2(tl.where(keep[:, :, None], G[:, None, :] - G[None, :, :], float("-inf")))
        kE = b_k[None, :, :] * E  # [i, j, d] = k_jd e^{G_id − G_jd}
        dq = tl.sum(dAq[:, :, None] * kE, axis=1)
        dkr = tl.sum(dAk[:, :, None] * kE, axis=1)
        dkc = tl.sum((dAq[:, :, None] * b_q[:, None, :] + dAk[:, :, None] * b_k[:, None, :]) * E, axis=0)
        db = tl.sum(dL * tl.sum(b_k[:, None, :] * kE, axis=2), axis=1)
    else:
        e = tl.exp2(G - c[None, :])
        einv = tl.exp2(c[None, :] - G)
        kd = b_k * einv
        kl = b_k * e
        P = tl.dot(dL, kd, input_precision=PREC)  # Σ_j dL_ij kd_j: gives dk (×β) and dβ without forming Ã
        dq = tl.dot(dAq, kd, input_precision=PREC) * e
        dkr = P * b_b[:, None] * e
        dkc = (tl.dot(tl.trans(dAq), b_q * e, input_precision=PREC)
               + tl.dot(tl.trans(dAk), kl, input_precision=PREC)) * einv
        db = tl.sum(P * kl, axis=1)  # Σ_j dL_ij Ã_ij = Σ_d kl_id (dL·kd)_id
    return dq, dkr, dkc, db


@triton.jit
def _off_bwd(dAq, dL, b_b, ql, kl, e, kdJ, cI, cJ1, PREC: tl.constexpr):
    """Backward of sub-block pair (I, J < I) with the forward's reference c_{J+1}. Returns row-side dq, dk for
    block I, the column-side dk for block J WITHOUT its factor e^{c_{J+1} − G_J}, and block I's β share."""
    s = tl.exp2(cI - cJ1)[None, :]
    dAk = dL * b_b[:, None]
    kls = kl * s
    es = e * s
    P = tl.dot(dL, kdJ, input_precision=PREC)
    dq = tl.dot(dAq, kdJ, input_precision=PREC) * es
    dkr = P * b_b[:, None] * es
    dkc = tl.dot(tl.trans(dAq), ql * s, input_precision=PREC) + tl.dot(tl.trans(dAk), kls, input_precision=PREC)
    db = tl.sum(P * kls, axis=1)
    return dq, dkr, dkc, db


@triton.jit
def _finish_rows(DQ, DK, DG, DB, dq, dbeta, beta, base, i_h, bos, eos, H, K, q_hat, k_hat, rq,
                 dq_a, dkr, dkcd, db_a, I: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                 L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Sub-block I once its row side is complete: write dq and dβ; fold the intra-chunk shares of dk and dG into
    the DK / DG scratch rows (the column side of later blocks is still to come)."""
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    t = bos + I * BC + o_s
    m_t = t < eos
    m = m_t[:, None] & (o_k < K)[None, :]
    b_dq = _load_rows(DQ, base, I, BT, BC, BK) + dq_a
    if L2NORM:
        b_dq = rq[:, None] * (b_dq - q_hat * tl.sum(b_dq * q_hat, axis=1)[:, None])
    tl.store(dq + t[:, None] * (H * K) + i_h * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m)
    _store_rows(DK, base, _load_rows(DK, base, I, BT, BC, BK) + dkr + dkcd, I, BT, BC, BK)
    _store_rows(DG, base, _load_rows(DG, base, I, BT, BC, BK) + q_hat * dq_a + k_hat * (dkr - dkcd), I, BT, BC, BK)
    b_db = tl.load(DB + base * BT + I * BC + o_s) + db_a
    if BETA_SIGMOID:
        b_r = tl.load(beta + t * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_db = b_db * _sigmoid(b_r) * _sigmoid(-b_r)
    tl.store(dbeta + t * H + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_t)


@triton.jit
def _finish_cols(DK, DG, dk, dg, g, A_log, dt_bias, base, i_h, bos, eos, H, K, lb, k_hat, rk, dkc, suffix,
                 I: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                 USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
                 L2NORM: tl.constexpr):
    """Sub-block I with every share in (visited last to first): dk, the reverse within-chunk cumsum dG → dg (suffix =
    Σ dG of the later sub-blocks), the gate backward. Returns (new suffix, Σ_rows d raw f, Σ dA_log share)."""
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    t = bos + I * BC + o_s
    m_k = o_k < K
    m = (t < eos)[:, None] & m_k[None, :]
    p = t[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_dk = _load_rows(DK, base, I, BT, BC, BK) + dkc
    if L2NORM:
        b_dk = rk[:, None] * (b_dk - k_hat * tl.sum(b_dk * k_hat, axis=1)[:, None])
    tl.store(dk + p, b_dk.to(dk.dtype.element_ty), mask=m)
    dG = _load_rows(DG, base, I, BT, BC, BK) - k_hat * dkc
    dgt = tl.cumsum(dG, axis=0, reverse=True) + suffix[None, :]
    b_f = tl.load(g + p, mask=m, other=0.).to(tl.float32)
    df, dA = _gate_bwd(dgt, b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    df = tl.where(m, df, 0.)
    tl.store(dg + p, df.to(dg.dtype.element_ty), mask=m)
    return suffix + tl.sum(dG, axis=0), tl.sum(df, axis=0), tl.sum(tl.sum(tl.where(m, dA, 0.), axis=1), axis=0)


@triton.jit
def _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c, I: tl.constexpr, BC: tl.constexpr,
             BK: tl.constexpr, USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr,
             HAS_DT: tl.constexpr, L2NORM: tl.constexpr):
    b_q, b_k, rq, rk = _sub_raw(q, k, i_h, bos, eos, H, K, I, BC, BK, L2NORM)
    b_g = _rows_gate(g, A_log, dt_bias, i_h, bos + I * BC, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A,
                     HAS_DT)
    G = c[None, :] + tl.cumsum(b_g, axis=0)
    return b_q, b_k, rq, rk, G, c + tl.sum(b_g, axis=0)


@triton.jit
def _sub_beta(beta, i_h, bos, eos, H, I: tl.constexpr, BC: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    o_s = tl.arange(0, BC)
    t = bos + I * BC + o_s
    m_t = t < eos
    b_b = tl.load(beta + t * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b_b = _sigmoid(b_b)
    return tl.where(m_t, b_b, 0.)


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_intra(
    q, k, g, beta, A_log, dt_bias,
    DQ, DK, DG, DB, DL, DAQ,
    dq, dk, dg, dbeta, DA, DDT,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT_DIAG: tl.constexpr,
    PREC: tl.constexpr, RECOMPUTE: tl.constexpr,
):
    # Sub-blocks in order (row side of every pair (I, J ≤ I) is done when block I is visited; column-side shares
    # for blocks J < I accumulate in dkc_J), then backwards for dk, the reverse cumsum and the gate.
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    c_0 = tl.zeros([BK], dtype=tl.float32)

    # ---- sub-block 0
    q0, k0, rq, rk0, G0, c_1 = _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_0, 0, BC, BK,
                                        USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    b0 = _sub_beta(beta, i_h, bos, eos, H, 0, BC, BETA_SIGMOID)
    f0 = tl.exp2(c_1[None, :] - G0)
    kf0 = k0 * f0
    dqa, dkr, dkcd, dba = _diag_bwd(_load_tile(DAQ, base, 0, 0, BT, BC), _load_tile(DL, base, 0, 0, BT, BC), b0,
                                    q0, k0, G0, c_0, EXACT_DIAG, PREC)
    _finish_rows(DQ, DK, DG, DB, dq, dbeta, beta, base, i_h, bos, eos, H, K, q0, k0, rq, dqa, dkr, dkcd, dba, 0,
                 BT, BC, BK, L2NORM, BETA_SIGMOID)
    # ---- sub-block 1
    q1, k1, rq, rk1, G1, c_2 = _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_1, 1, BC, BK,
                                        USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    b1 = _sub_beta(beta, i_h, bos, eos, H, 1, BC, BETA_SIGMOID)
    f1 = tl.exp2(c_2[None, :] - G1)
    kf1 = k1 * f1
    e = tl.exp2(G1 - c_1[None, :])
    ql = q1 * e
    kl = k1 * e
    dqa, dkr, dkcd, dba = _diag_bwd(_load_tile(DAQ, base, 1, 1, BT, BC), _load_tile(DL, base, 1, 1, BT, BC), b1,
                                    q1, k1, G1, c_1, EXACT_DIAG, PREC)
    a, b, dkc0, d = _off_bwd(_load_tile(DAQ, base, 1, 0, BT, BC), _load_tile(DL, base, 1, 0, BT, BC), b1, ql, kl, e,
                             kf0, c_1, c_1, PREC)
    _finish_rows(DQ, DK, DG, DB, dq, dbeta, beta, base, i_h, bos, eos, H, K, q1, k1, rq, dqa + a, dkr + b, dkcd,
                 dba + d, 1, BT, BC, BK, L2NORM, BETA_SIGMOID)
    # ---- sub-block 2
    q2, k2, rq, rk2, G2, c_3 = _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_2, 2, BC, BK,
                                        USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    b2 = _sub_beta(beta, i_h, bos, eos, H, 2, BC, BETA_SIGMOID)
    f2 = tl.exp2(c_3[None, :] - G2)
    kf2 = k2 * f2
    e = tl.exp2(G2 - c_2[None, :])
    ql = q2 * e
    kl = k2 * e
    dqa, dkr, dkcd, dba = _diag_bwd(_load_tile(DAQ, base, 2, 2, BT, BC), _load_tile(DL, base, 2, 2, BT, BC), b2,
                                    q2, k2, G2, c_2, EXACT_DIAG, PREC)
    a, b, c, d = _off_bwd(_load_tile(DAQ, base, 2, 0, BT, BC), _load_tile(DL, base, 2, 0, BT, BC), b2, ql, kl, e,
                          kf0, c_2, c_1, PREC)
    dqa += a
    dkr += b
    dkc0 += c
    dba += d
    a, b, dkc1, d = _off_bwd(_load_tile(DAQ, base, 2, 1, BT, BC), _load_tile(DL, base, 2, 1, BT, BC), b2, ql, kl, e,
                             kf1, c_2, c_2, PREC)
    _finish_rows(DQ, DK, DG, DB, dq, dbeta, beta, base, i_h, bos, eos, H, K, q2, k2, rq, dqa + a, dkr + b, dkcd,
                 dba + d, 2, BT, BC, BK, L2NORM, BETA_SIGMOID)
    # ---- sub-block 3
    q3, k3, rq, rk3, G3, c_4 = _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_3, 3, BC, BK,
                                        USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    b3 = _sub_beta(beta, i_h, bos, eos, H, 3, BC, BETA_SIGMOID)
    e = tl.exp2(G3 - c_3[None, :])
    ql = q3 * e
    kl = k3 * e
    dqa, dkr, dkcd, dba = _diag_bwd(_load_tile(DAQ, base, 3, 3, BT, BC), _load_tile(DL, base, 3, 3, BT, BC), b3,
                                    q3, k3, G3, c_3, EXACT_DIAG, PREC)
    a, b, c, d = _off_bwd(_load_tile(DAQ, base, 3, 0, BT, BC), _load_tile(DL, base, 3, 0, BT, BC), b3, ql, kl, e,
                          kf0, c_3, c_1, PREC)
    dqa += a
    dkr += b
    dkc0 += c
    dba += d
    a, b, c, d = _off_bwd(_load_tile(DAQ, base, 3, 1, BT, BC), _load_tile(DL, base, 3, 1, BT, BC), b3, ql, kl, e,
                          kf1, c_3, c_2, PREC)
    dqa += a
    dkr += b
    dkc1 += c
    dba += d
    a, b, dkc2, d = _off_bwd(_load_tile(DAQ, base, 3, 2, BT, BC), _load_tile(DL, base, 3, 2, BT, BC), b3, ql, kl, e,
                             kf2, c_3, c_3, PREC)
    _finish_rows(DQ, DK, DG, DB, dq, dbeta, beta, base, i_h, bos, eos, H, K, q3, k3, rq, dqa + a, dkr + b, dkcd,
                 dba + d, 3, BT, BC, BK, L2NORM, BETA_SIGMOID)

    # ---- backwards: dk, dG → dg (reverse cumsum), gate
    # With RECOMPUTE, k̂, 1/‖k‖ and the factors f_J are reloaded / recomputed just before each block's turn (same
    # operations in the same order as above: bitwise the same values) instead of staying live through the row loop.
    if RECOMPUTE:
        _, k3, _, rk3, _, _ = _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_3, 3, BC, BK,
                                       USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    suffix, ddt, dA = _finish_cols(DK, DG, dk, dg, g, A_log, dt_bias, base, i_h, bos, eos, H, K, lb, k3, rk3,
                                   tl.zeros_like(k3), c_0, 3, BT, BC, BK,
                                   USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    if RECOMPUTE:
        _, k2, _, rk2, G2, _ = _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_2, 2, BC, BK,
                                        USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
        f2 = tl.exp2(c_3[None, :] - G2)
    suffix, x, y = _finish_cols(DK, DG, dk, dg, g, A_log, dt_bias, base, i_h, bos, eos, H, K, lb, k2, rk2,
                                dkc2 * f2, suffix, 2, BT, BC, BK,
                                USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    ddt += x
    dA += y
    if RECOMPUTE:
        _, k1, _, rk1, G1, _ = _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_1, 1, BC, BK,
                                        USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
        f1 = tl.exp2(c_2[None, :] - G1)
    suffix, x, y = _finish_cols(DK, DG, dk, dg, g, A_log, dt_bias, base, i_h, bos, eos, H, K, lb, k1, rk1,
                                dkc1 * f1, suffix, 1, BT, BC, BK,
                                USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    ddt += x
    dA += y
    if RECOMPUTE:
        _, k0, _, rk0, G0, _ = _sub_fwd(q, k, g, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_0, 0, BC, BK,
                                        USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
        f0 = tl.exp2(c_1[None, :] - G0)
    suffix, x, y = _finish_cols(DK, DG, dk, dg, g, A_log, dt_bias, base, i_h, bos, eos, H, K, lb, k0, rk0,
                                dkc0 * f0, suffix, 0, BT, BC, BK,
                                USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM)
    ddt += x
    dA += y
    if USE_GATE:
        tl.store(DDT + base * BK + tl.arange(0, BK), ddt)
        tl.store(DA + base, dA)


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
    bv = min(BwdConfig.state_bv, BVP)
    s = saved
    _kda_bwd_state[(BVP // bv, N * H)](
        do, s["AQK"], s["KG"], s["QG"], s["W"], s["GAM"], DHS, DV, dht if dht is not None else dh0, dh0,
        tab.cu, tab.chunk_off, NC, tab.T, tab.NT, H, K, V, BT=BT, BK=BK, BV=bv, BVP=BVP,
        USE_DHT=dht is not None, IS_VARLEN=tab.varlen, PREC=dot_precision(dtype),
        num_warps=BwdConfig.state_warps, num_stages=state_stages(BwdConfig.state_stages, dtype))
    return DHS, DV, dh0


def half_scratch(dtype: torch.dtype, BK: int) -> bool:
    """Whether the WY kernel hands its dq, dk shares to the intra kernel in 16 bits (``BwdConfig.dqk_scratch_half``):
    half inputs, the K-block WY kernel (it writes them once; the fused one reads them back) and the split intra kernel
    over all of K in one slice (it reads them once and adds its own share in fp32; with several slices it would
    write partial sums back)."""
    c = BwdConfig
    return (bool(c.dqk_scratch_half) and dtype in (torch.bfloat16, torch.float16) and bool(c.wy_kb)
            and bool(c.intra_split) and c.intra_split_bk >= BK)


def _wy_launch(passes: int, cfg, dtype: torch.dtype) -> dict:
    """Launch options of one WY-backward launch: the fused kernel's (wy_warps/stages), or the split passes'
    (wy_split_warps/stages/maxnreg). fp32 buffers double the tiles: sm_90 needs 246 KB of shared memory for the
    fused kernel at 3 stages (147 KB at 2), so their stages are capped like the state passes'."""
    if passes == 3:
        return dict(num_warps=cfg.wy_warps, num_stages=state_stages(cfg.wy_stages, dtype))
    return dict(num_warps=cfg.wy_split_warps, num_stages=state_stages(cfg.wy_split_stages, dtype),
                **maxnreg_kw(cfg.wy_split_maxnreg))


def kda_bwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale: float, do, dht, saved: dict, tab: ChunkTable,
            lower_bound, flags: dict, state_grads: tuple | None = None):
    """Gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) of chunk KDA; ``saved`` from the training forward.
    ``state_grads``: the result of :func:`bwd_state_pass` for this ``do``/``dht`` when the caller already ran it."""
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    N, NC = tab.N, tab.NC
    # empty, not zeros: every kernel writes each element it owns once, so a missed write shows up as garbage (NaN
    # in the tests, which poison torch.empty) instead of hiding as a plausible zero gradient
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g)
    dv, db = torch.empty_like(v), torch.empty_like(beta)
    dA = torch.zeros_like(A_log) if A_log is not None else None
    ddt = torch.zeros_like(dt_bias) if dt_bias is not None else None
    if NC == 0:
        dh0 = torch.zeros(N, H, K, V, dtype=torch.float32, device=dev)
        if dht is not None:
            dh0.copy_(dht)
        return dq, dk, dv, dg, db, dA, ddt, (dh0 if initial_state is not None else None)
    do = do.contiguous()  # e.g. o.sum().backward() hands over a stride-0 gradient: the kernels index densely
    dht = dht.contiguous() if dht is not None else None
    BK, BVP = next_pow2(K), next_pow2(V)
    prec = dot_precision(q.dtype)
    # dG is a sum of row and column shares that cancel strongly when decays are strong (all gates at the bound):
    # fp32 inputs keep exact dots there; half inputs take ``BwdConfig.intra_prec_half``
    prec_intra = "ieee" if prec == "ieee" else BwdConfig.intra_prec_half
    prec_off = "ieee" if prec == "ieee" else (BwdConfig.intra_prec_off_half or prec_intra)
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if interp:  # no bf16x3 there (it computes the dots in fp32 anyway)
        prec_intra, prec_off = ("tf32x3" if p.startswith("bf16") else p for p in (prec_intra, prec_off))
    s = saved
    flag_kw = dict(USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None, HAS_A=A_log is not None,
                   HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"], BETA_SIGMOID=flags["beta_sigmoid"],
                   IS_VARLEN=tab.varlen)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    f32 = dict(dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, **f32)
    a_log = A_log if A_log is not None else dummy
    dtb = dt_bias if dt_bias is not None else dummy

    if state_grads is None:
        state_grads = bwd_state_pass(do, dht, saved, tab, H, K, V, q.dtype)
    DHS, DV, dh0 = state_grads

    sdt = torch.float32  # the dq, dk shares of the WY kernel; in 16 bits when read once by the intra kernel
    if half_scratch(q.dtype, BK):
        sdt = torch.float16 if interp else torch.bfloat16
    DQ, DK = (torch.empty(H, NC, BT, BK, dtype=sdt, device=dev) for _ in range(2))
    DG = torch.empty(H, NC, BT, BK, **f32)
    DB = torch.empty(H, NC, BT, **f32)
    DL, DAQ = (torch.empty(H, NC, BT, BT, **f32) for _ in range(2))
    split = bool(BwdConfig.intra_split)
    RN = torch.empty(H, NC, 2, BT, **f32) if split and flags["l2norm"] else dummy
    GS = torch.empty(H, NC, BT, BK, **f32) if split else dummy
    store_rn = split and flags["l2norm"]
    u_or_vn, vn_saved = wy_u_operand(s)
    if BwdConfig.wy_kb:
        DB = launch_wy_kb(q, k, v, g, beta, a_log, dtb, do, RN, GS, s, DHS, DV, dv, DQ, DK, DG, DL, DAQ, tab, H, K,
                          V, scale, lb, BT, BK, BVP, prec, flag_kw, store_rn, split, BwdConfig)
    else:
        # wy_split: the dV' pass, then the V' pass (it updates the dk, dg the first stored) as two launches
        if not BwdConfig.wy_split and BwdConfig.wy_bv < 64 and q.is_cuda:
            raise ValueError(f"BwdConfig.wy_bv: the fused WY backward needs 64 or 128 on CUDA (32 faults on sm_90), "
                             f"got {BwdConfig.wy_bv}")
        for passes in ((1, 2) if BwdConfig.wy_split else (3,)):
            _kda_bwd_wy[(NC, H)](
                q, k, v, g, beta, a_log, dtb, do, RN, GS, s["W"], u_or_vn, s["QG"], s["TM"], s["HS"], DHS, DV,
                dv, DQ, DK, DG, DB, DL, DAQ, tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT,
                H, K, V, scale, lb, BT=BT, BK=BK, BV=min(BwdConfig.wy_bv, BVP), BVP=BVP, PREC=prec,
                STORE_RN=store_rn, STORE_G=split, PASSES=passes, VN_SAVED=vn_saved, **flag_kw,
                **_wy_launch(passes, BwdConfig, s["W"].dtype))

    if split:
        DAP, DDT = launch_intra_split(q, k, g, beta, a_log, dtb, RN, GS, DQ, DK, DG, DB, DL, DAQ, dq, dk, dg, db,
                                      tab, H, K, lb, BT, BC, BK, prec_intra, flag_kw, flags["exact_diag"], BwdConfig,
                                      prec_off=prec_off)
    else:
        DAP = torch.empty(H, NC, **f32)
        DDT = torch.empty(H, NC, BK, **f32)
        _kda_bwd_intra[(NC, H)](
            q, k, g, beta, a_log, dtb, DQ, DK, DG, DB, DL, DAQ, dq, dk, dg, db, DAP, DDT,
            tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT, H, K, lb, BT=BT, BC=BC, BK=BK,
            EXACT_DIAG=flags["exact_diag"], PREC="bf16x3" if prec_intra == "bf16" else prec_intra,
            RECOMPUTE=bool(BwdConfig.intra_recompute), **flag_kw,
            num_warps=BwdConfig.intra_warps, num_stages=BwdConfig.intra_stages)
    if flags["use_gate"]:
        if dA is not None:
            dA = DAP.reshape(H, -1).sum(1).to(A_log.dtype).reshape(A_log.shape)
        if ddt is not None:
            ddt = DDT.sum(1)[:, :K].to(dt_bias.dtype).reshape(dt_bias.shape)
    return dq, dk, dv, dg, db, dA, ddt, (dh0 if initial_state is not None else None)
