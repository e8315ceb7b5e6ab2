"""Inference forward of KDA in 16-token steps (the FlashKDA data flow, research/kda.md §4): two kernels, and the
split prefill's span pass in the same form.

``_c16_prep`` — token-parallel, one program per 16-token block and head: gate activation and cumsum (fp32, log2),
L2 norm, β; the block's A_kk / A_qk (reference = the row before the block, a past row, so no future gate reaches
an earlier row even through rounding — fla issue #1240); T = (I + β A_kk)^{-1} (four-factor products at fp32
accuracy, or forward substitution); then the step operands of its block: per ``C16Config.mode`` W = T Diag(β) X
with X = k̂ e^G, U = T Diag(β) v, qg = scale·q̂ e^G, kg = k̂ e^{G_C − G} ([16, K] or [16, V] each), scale·A_qk
([16, 16]) and γ = e^{G_C} ([K] fp32) — mode 1; mode 0 hands over X and T Diag(β) instead of W and U; mode 2
folds the output's A_qk term into them, and mode 3 (the default) does the same but leaves the product A_qk U to the
state pass, which reads [I | A_qkᵀ] (1 KiB per block) instead of A_qk U (4 KiB) (see ``_c16_prep``).

``_c16_state`` — the sequential pass, grid (V-blocks, N·H), the state kept TRANSPOSED in registers (Sᵀ [BV, K],
fp32) so that every product of the step has the V-block (64 rows) as its M dimension — Hopper's wgmma needs
M ≥ 64, a 16-row step would otherwise run on the older mma.sync — and the serial chain never leaves registers
(Sᵀ and V'ᵀ are the left operands):
    V'ᵀ = Uᵀ − Sᵀ Wᵀ,  Oᵀ = Sᵀ qgᵀ + V'ᵀ (scale·A_qk)ᵀ,  Sᵀ ← Sᵀ Diag(γ) + V'ᵀ kg.

``_c16_span_rows`` — the same step on the extended state [S_ext | M]ᵀ without the output, for the split prefill's
span summaries (``span.split_prefill_triton`` with ``SplitConfig.flow = "c16"``); ``_c16_span_rows_rev`` (the
default, ``C16Config.span_reverse``) computes the same (M, S_ext) by the chain run backwards from each segment's end,
three products per step instead of four (see ``_span_rev``).

In the K3 setting on CUDA (bf16, K = V = 128, mode 2 or 3) ``launch_c16_prep`` runs the same prep written in Gluon
(``prep_gluon``: layouts chosen so the cumsum and γ stay in registers; 22.6 against 24.8 ms per 1M at H = 32);
every other call takes ``_c16_prep``.

Why: the 64-token flow (``chunk_fwd``) writes W, U, kg, qg, A_qk and fp32 scratch per 64-token chunk through
three prep kernels (49 ms of the whole H200 per 1M tokens at H = 32); this prep is one light kernel (28 ms in mode
2; 25 with the inverse at fp16x3). Its state pass costs about as much per token as the 64-token one in mode 2 (1.6
µs per 64 tokens and program; mode 1 2.1), and the flow was measured to pay from ~64 state-pass programs
(``FwdConfig.inference_flow = "auto"``). Bounded gates only
(``lower_bound`` set): the prep's right factor k e^{−G} reaches e^{5·16} within a block, like FlashKDA's.
Inference only (no backward), windowed like ``chunk_fwd`` so memory does not grow with T.
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
    _chunk_tile,
    _eye,
    _gate_of,
    _l2norm,
    _span_row_program,
    _state_program,
    dot_precision,
    maxnreg_kw,
    next_pow2,
    ptxas_kw,
)
from k3.ops.kda.triton import prep_gluon
from k3.ops.kda.triton.chunk_fwd import _inv16, state_stages
from k3.ops.kda.triton.chunk_prep import _inv_pow, _op, _rows_beta


@triton.jit
def decay_bound(b_g, m_k, BC: tl.constexpr):
    """log2 of an upper bound on the spectral norm of a 16-token block's state transition: BC · the largest log2
    decay in the block (b_g [BC, BK], columns past K masked by ``m_k``; rows past the sequence's end are 0, so a
    partial block claims no decay). Each token's transition (I − β k̂ k̂ᵀ) Diag(α_t) has norm ≤ max_c α_t,c when
    ‖k̂‖ ≤ 1 and β ∈ [0, 1] (the in-kernel L2 norm and β sigmoid), so the block's is ≤ ∏_t max_c α_t,c ≤ (max_t,c
    α_t,c)^BC."""
    return tl.max(tl.max(tl.where(m_k[None, :], b_g, float("-inf")), axis=1), axis=0) * BC


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _c16_prep(
    q, k, v, g, beta, A_log, dt_bias, X, QG, KG, GAM, TB, AQ, U,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT, H, K, V, scale, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, FAST_GATE: tl.constexpr,
    PREC: tl.constexpr, AB_BF16: tl.constexpr, MODE: tl.constexpr, INV_POW: tl.constexpr,
    INV_PREC: tl.constexpr = "ieee", HEAD_MAJOR: tl.constexpr = False, EARLY_LOADS: tl.constexpr = False,
    U_RM: tl.constexpr = False, RING: tl.constexpr = 0, DEC=None, DEC_OUT: tl.constexpr = False,
):
    # MODE (``C16Config.mode``) — what the state pass is handed per 16-token block:
    #   0: X = k̂ e^G, Tβ, qg, A_qk, kg (the state pass forms W = Tβ X and U = Tβ v);
    #   1: W, U, qg, A_qk, kg;
    #   2: [−W; qw] stacked (qw = qg − A_qk W), [U; A_qk U] stacked, kg — the output folds into
    #      Oᵀ = Sᵀ qwᵀ + (A_qk U)ᵀ, so the state pass runs one product Sᵀ [−W; qw]ᵀ (accumulating onto [U; A_qk U]ᵀ)
    #      and the kg update per step;
    #   3: as 2, but U alone and [I | A_qkᵀ]: the state pass forms [U; A_qk U]ᵀ = Uᵀ [I | A_qkᵀ] (fewer bytes)
    if HEAD_MAJOR:  # adjacent programs read adjacent heads of the same tokens (contiguous rows of q, k, g, v)
        i_h = tl.program_id(0)
        i_b = tl.program_id(1)
    else:
        i_b = tl.program_id(0)
        i_h = tl.program_id(1)
    NB: tl.constexpr = BT // BC
    i_c = i_b // NB
    blk = i_b % NB
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    t0 = bos + blk * BC
    # Written in the order that keeps few [16, K] fp32 tiles live at once (each is 32 registers per thread at 2
    # warps): every operand is stored or narrowed to the store dtype as soon as it is formed
    if RING > 0:  # measurement only (``C16Config.probe_ring``): outputs wrap over RING chunks, overwritten
        base = (i_h * NCw + i_c % RING).to(tl.int64)
    else:
        base = (i_h * NCw + i_c).to(tl.int64)
    bidx = base * NB + blk  # the block's index in the window buffers
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    row = base * BT + blk * BC + o_s
    p = row[:, None] * BK + o_k[None, :]
    DT = X.dtype.element_ty
    r_g = _chunk_tile(g, i_h, t0, eos, H, K, BC, BK)
    if EARLY_LOADS:  # every input load issued before the first use: one DRAM latency per program, not four
        r_k = _chunk_tile(k, i_h, t0, eos, H, K, BC, BK)
        r_q = _chunk_tile(q, i_h, t0, eos, H, K, BC, BK)
        if MODE != 0:
            r_v = _chunk_tile(v, i_h, t0, eos, H, V, BC, BVP)
        b_b = _rows_beta(beta, i_h, t0, eos, H, BC, BETA_SIGMOID)
    b_g = _gate_of(r_g, A_log, dt_bias, i_h, t0, eos, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT, FAST_GATE)
    G = tl.cumsum(b_g, axis=0)  # log2 decay from the block start through row i (padding rows add 0)
    gam = tl.exp2(tl.sum(b_g, axis=0))  # ... through the block's last row: γ = e^{G_C}
    tl.store(GAM + bidx * BK + o_k, gam)
    if DEC_OUT:  # the block's decay bound for the split's span pass (``decay_bound``)
        tl.store(DEC + bidx, decay_bound(b_g, o_k < K, BC))
    if not EARLY_LOADS:
        r_k = _chunk_tile(k, i_h, t0, eos, H, K, BC, BK)
    b_k, _ = _l2norm(r_k.to(tl.float32), L2NORM)
    # A[i, j] = Σ_d a_id k_jd e^{G_id − G_jd} = (a_i e^{G_i}) · (k_j e^{−G_j}): the left factor ≤ |a|, the right
    # ≤ e^{5·16} under the bound (finite in fp32 and bf16; fp16 inputs keep fp32 operands here)
    en = tl.exp2(-G)
    kd = _op(tl.trans(b_k * en), AB_BF16)
    tl.store(KG + p, (b_k * (gam[None, :] * en)).to(DT))  # e^{G_C − G} ≤ 1 as e^{G_C} · e^{−G}: one MUFU op less
    e = tl.exp2(G)
    x = b_k * e
    ak = tl.dot(_op(x, AB_BF16), kd, input_precision=PREC)
    x_dt = x.to(DT)
    if not EARLY_LOADS:
        r_q = _chunk_tile(q, i_h, t0, eos, H, K, BC, BK)
    qe = _l2norm(r_q.to(tl.float32), L2NORM)[0] * e
    aq = tl.dot(_op(qe, AB_BF16), kd, input_precision=PREC)
    aq = tl.where(o_s[:, None] >= o_s[None, :], aq, 0.) * scale
    qg_dt = (qe * scale).to(DT)
    if not EARLY_LOADS:
        b_b = _rows_beta(beta, i_h, t0, eos, H, BC, BETA_SIGMOID)
    lk = tl.where(o_s[:, None] > o_s[None, :], ak * b_b[:, None], 0.)
    if INV_POW:
        tm = _inv_pow(lk, INV_PREC)
    else:
        tm = _inv16(lk)
    tb = tm * b_b[None, :]
    if MODE == 0:
        tl.store(TB + row[:, None] * BC + o_s[None, :], tb.to(DT))
        tl.store(AQ + row[:, None] * BC + o_s[None, :], aq.to(DT))
        tl.store(X + p, x_dt)
        tl.store(QG + p, qg_dt)
    else:
        o_v = tl.arange(0, BVP)
        if not EARLY_LOADS:
            r_v = _chunk_tile(v, i_h, t0, eos, H, V, BC, BVP)
        tbo = tb.to(DT)
        w_dt = tl.dot(tbo, x_dt, input_precision=PREC).to(DT)
        u32 = tl.dot(tbo, r_v.to(DT), input_precision=PREC)
        u = u32.to(DT)
        # U (and A_qk U) stored transposed per block, [BVP, 16] (or [BVP, 32]): the state pass reads them as [BV, ·]
        # tiles contiguous along their rows, which its pipeline can copy asynchronously (2-byte strided ones not) —
        # or, mode 2 with U_RM, row-major [32, BVP] per block, transposed by the state pass's identity product
        if MODE == 1:
            tl.store(X + p, w_dt)
            tl.store(U + bidx * (BVP * BC) + o_v[None, :] * BC + o_s[:, None], u)
            tl.store(AQ + row[:, None] * BC + o_s[None, :], aq.to(DT))
            tl.store(QG + p, qg_dt)
        else:
            # stacked per block: rows [32·b, 32·b + 16) −W (U), rows [32·b + 16, 32·b + 32) qw (A_qk U)
            row2 = bidx * (2 * BC) + o_s
            aqo = aq.to(DT)
            qw = qg_dt.to(tl.float32) - tl.dot(aqo, w_dt, input_precision=PREC)
            tl.store(X + row2[:, None] * BK + o_k[None, :], -w_dt)
            tl.store(X + (row2 + BC)[:, None] * BK + o_k[None, :], qw.to(DT))
            if MODE == 3:  # U row-major [16, BVP] and [I | A_qkᵀ] [16, 32] per block: A_qk U left to the state pass
                tl.store(U + bidx * (BC * BVP) + o_s[:, None] * BVP + o_v[None, :], u)
                p_ia = AQ + bidx * (BC * 2 * BC) + o_s[:, None] * (2 * BC) + o_s[None, :]
                tl.store(p_ia, _eye(BC).to(DT))
                tl.store(AQ + bidx * (BC * 2 * BC) + o_s[None, :] * (2 * BC) + BC + o_s[:, None], aqo)  # A_qkᵀ
            elif U_RM:  # row-major [U; A_qk U]: plain stores; the state pass transposes by its identity product
                p_u = U + bidx * (BVP * 2 * BC) + o_s[:, None] * BVP + o_v[None, :]
                tl.store(p_u, u)
                tl.store(p_u + BC * BVP, tl.dot(aqo, u, input_precision=PREC).to(DT))
            else:  # transposed [U; A_qk U]ᵀ per block
                p_u = U + bidx * (BVP * 2 * BC) + o_v[None, :] * (2 * BC) + o_s[:, None]
                tl.store(p_u, u)
                tl.store(p_u + BC, tl.dot(aqo, u, input_precision=PREC).to(DT))


@triton.jit
def _u_acc(b_ua, PREC: tl.constexpr, BC: tl.constexpr, U_RM: tl.constexpr):
    """[U; A_qk U]ᵀ in fp32 as the exact product [U; A_qk U]ᵀ·I (one nonzero term per entry) from its tile in the load
    dtype: the tensor cores read it from shared memory instead of a conversion element by element in registers.
    ``U_RM``: the tile was loaded row-major [2·BC, BV] and the product transposes it."""
    eye = _eye(2 * BC).to(b_ua.dtype)
    if U_RM:
        b_ua = tl.trans(b_ua)
    return tl.dot(b_ua, eye, input_precision=PREC)


@triton.jit
def _folded_step(s_dt, b_wq, b_ua, PREC: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr):
    """Mode 2's product: [V'ᵀ | Oᵀ] = [Uᵀ | (A_qk U)ᵀ] + Sᵀ [−W; qw]ᵀ, one product whose accumulator starts from
    [U; A_qk U]ᵀ (fp32, ``b_ua``); returns V'ᵀ in the operand dtype and Oᵀ in fp32."""
    acc = tl.dot(s_dt, tl.trans(b_wq), acc=b_ua, input_precision=PREC)
    b_vnt, b_ot = tl.split(tl.permute(tl.reshape(acc, [BV, 2, BC]), (0, 2, 1)))
    return b_vnt.to(s_dt.dtype), b_ot


@triton.jit(do_not_specialize=['c0', 'c1', 'NCw', 'T', 'NT', 'H'])
def _c16_state(
    X, QG, KG, GAM, TB, AQ, U, v, o, ht,
    cu, chunk_off, c0, c1, NCw, T, NT, H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr, MODE: tl.constexpr,
    PTR_INC: tl.constexpr = False, U_EYE: tl.constexpr = False, U_RM: tl.constexpr = False,
    RING: tl.constexpr = 0,
):
    i_v, i_n, i_h, cs, bos, eos, lo, hi = _state_program(cu, chunk_off, c0, c1, T, NT, H, IS_VARLEN)
    if lo < hi:
        NB: tl.constexpr = BT // BC
        DT: tl.constexpr = KG.dtype.element_ty
        o_s = tl.arange(0, BC)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        # Sᵀ: row = value column, column = key dimension
        p_s = ht + ((i_n * H + i_h).to(tl.int64) * K + o_k[None, :]) * V + o_v[:, None]
        St = tl.load(p_s, mask=m_v[:, None] & m_k[None, :], other=0.)
        # step j (block j of the sequence's chunks, counted from the window's first chunk c0) reads block
        # boff + j of the window buffers and writes tokens tok0 + j·BC ...: every address is affine in j
        boff = (i_h * NCw - c0).to(tl.int64) * NB
        tok0 = bos - cs.to(tl.int64) * BT
        if PTR_INC:  # mode 2 with the tile pointers carried across steps, advanced by each buffer's block stride
            b0 = boff + lo * NB
            o_r = tl.arange(0, 2 * BC)
            q_kg = KG + (b0 * BC + o_s)[:, None] * BK + o_k[None, :]
            q_gam = GAM + b0 * BK + o_k
            q_wq = X + (b0 * (2 * BC) + o_r)[:, None] * BK + o_k[None, :]
            if MODE == 3:
                q_ua = U + b0 * (BC * BVP) + o_s[:, None] * BVP + o_v[None, :]  # U [16, BV]
                q_ia = AQ + b0 * (BC * 2 * BC) + o_s[:, None] * (2 * BC) + o_r[None, :]  # [I | A_qkᵀ] [16, 32]
            elif U_RM:
                q_ua = U + b0 * (BVP * 2 * BC) + o_r[:, None] * BVP + o_v[None, :]
            else:
                q_ua = U + b0 * (BVP * 2 * BC) + o_v[:, None] * (2 * BC) + o_r[None, :]
            t = tok0 + lo * NB * BC + o_s
            for j in tl.range(lo * NB, hi * NB, num_stages=STAGES):
                b_kg = tl.load(q_kg)
                b_gam = tl.load(q_gam)
                if MODE == 3:  # [Uᵀ | (A_qk U)ᵀ] = Uᵀ [I | A_qkᵀ]: one K = 16 product from shared memory
                    b_ua = tl.dot(tl.trans(tl.load(q_ua)), tl.load(q_ia), input_precision=PREC)
                    q_ia += BC * 2 * BC
                elif U_EYE:  # issued before Sᵀ's conversion, which then runs under the product's latency
                    b_ua = _u_acc(tl.load(q_ua), PREC, BC, U_RM)
                else:
                    b_ua = tl.load(q_ua).to(tl.float32)
                vn_dt, b_ot = _folded_step(St.to(DT), tl.load(q_wq), b_ua, PREC, BV, BC)
                tl.store(o + (t[None, :] * H + i_h) * V + o_v[:, None], b_ot.to(o.dtype.element_ty),
                         mask=m_v[:, None] & (t < eos)[None, :])
                St = St * b_gam[None, :] + tl.dot(vn_dt, b_kg, input_precision=PREC)
                if RING > 0:  # measurement only (``C16Config.probe_ring``): reads wrap over RING chunks
                    nb = 1 - tl.where((j + 1) % (RING * NB) == 0, RING * NB, 0)  # blocks to advance
                else:
                    nb = 1
                q_kg += BC * BK * nb
                q_gam += BK * nb
                q_wq += 2 * BC * BK * nb
                q_ua += (BVP * 2 * BC if MODE == 2 else BVP * BC) * nb
                t += BC
        else:
            for j in tl.range(lo * NB, hi * NB, num_stages=STAGES):
                bidx = boff + j  # the block's index in the window buffers
                row = bidx * BC + o_s
                p = row[:, None] * BK + o_k[None, :]
                b_kg = tl.load(KG + p)
                b_gam = tl.load(GAM + bidx * BK + o_k)
                t = tok0 + j * BC + o_s
                m_t = t < eos
                p_v = (t[None, :] * H + i_h) * V + o_v[:, None]  # [BV, BC]: vᵀ and Oᵀ
                s_dt = St.to(DT)
                if MODE == 2:
                    o_r = tl.arange(0, 2 * BC)
                    b_wq = tl.load(X + (bidx * (2 * BC) + o_r)[:, None] * BK + o_k[None, :])  # [−W; qw]
                    b_ua = tl.load(U + bidx * (BVP * 2 * BC) + o_v[:, None] * (2 * BC) + o_r[None, :]).to(
                        tl.float32)  # [U; A_qk U]ᵀ
                    vn_dt, b_ot = _folded_step(s_dt, b_wq, b_ua, PREC, BV, BC)
                else:
                    b_qg = tl.load(QG + p)
                    b_aq = tl.load(AQ + row[:, None] * BC + o_s[None, :])
                    if MODE == 0:
                        b_x = tl.load(X + p)
                        b_tb = tl.load(TB + row[:, None] * BC + o_s[None, :])
                        b_vt = tl.load(v + p_v, mask=m_v[:, None] & m_t[None, :], other=0.).to(DT)
                        b_wt = tl.trans(tl.dot(b_tb, b_x, input_precision=PREC).to(DT))  # Wᵀ [BK, BC]
                        b_vnt = tl.dot(b_vt, tl.trans(b_tb), input_precision=PREC) - tl.dot(s_dt, b_wt,
                                                                                            input_precision=PREC)
                    else:
                        b_wt = tl.trans(tl.load(X + p))
                        b_ut = tl.load(U + bidx * (BVP * BC) + o_v[:, None] * BC + o_s[None, :])
                        b_vnt = b_ut.to(tl.float32) - tl.dot(s_dt, b_wt, input_precision=PREC)
                    vn_dt = b_vnt.to(DT)
                    b_ot = tl.dot(s_dt, tl.trans(b_qg), input_precision=PREC) + tl.dot(vn_dt, tl.trans(b_aq),
                                                                                        input_precision=PREC)
                tl.store(o + p_v, b_ot.to(o.dtype.element_ty), mask=m_v[:, None] & m_t[None, :])
                St = St * b_gam[None, :] + tl.dot(vn_dt, b_kg, input_precision=PREC)
        tl.store(p_s, St, mask=m_v[:, None] & m_k[None, :])


@triton.jit
def _forgotten_prefix(DEC, lo, hi, lim, SB: tl.constexpr):
    """(b*, found): the latest block b* in [lo, hi) whose suffix bound Σ_{b* ≤ b < hi} DEC[b] is ≤ lim, scanning
    ``DEC`` (log2 decay bounds per block, ≤ 0 for decaying gates) backwards SB blocks at a time; (lo, False) if no
    suffix reaches lim."""
    o = tl.arange(0, SB)
    acc = 0.0  # Σ DEC over [b, hi)
    start = lo
    found = lo < 0  # False, as a tensor the loop can carry
    b = hi
    while b > lo:
        n0 = tl.maximum(b - SB, lo)
        idx = n0 + o
        m = idx < b
        d = tl.load(DEC + idx, mask=m, other=0.)
        rc = tl.cumsum(d, axis=0, reverse=True) + acc  # suffix sums from each block of the tile to hi
        hit = tl.max(tl.where(m & (rc <= lim), idx, -1), axis=0)
        found = hit >= 0
        start = tl.where(found, hit, start)
        acc += tl.sum(d, axis=0)
        b = tl.where(found, lo, n0)
    return start, found


@triton.jit
def _span_tiles(X, KG, GAM, U, b, col, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr, U_RM: tl.constexpr,
                U_ROWS: tl.constexpr):
    """Pointers to block b's span-step operands in the window buffers: −W and kg [16, BK] (−W: the first 16 rows of
    [−W; qw]), γ [BK], and U's columns ``col`` [16, len(col)] (row-major, or read from Uᵀ [BVP, U_ROWS])."""
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    q_w = X + (b * (2 * BC) + o_s)[:, None] * BK + o_k[None, :]
    q_kg = KG + (b * BC + o_s)[:, None] * BK + o_k[None, :]
    if U_RM:
        q_u = U + b * (BVP * U_ROWS) + o_s[:, None] * BVP + col[None, :]
    else:
        q_u = U + b * (BVP * U_ROWS) + col[None, :] * U_ROWS + o_s[:, None]
    return q_w, q_kg, GAM + b * BK + o_k, q_u


@triton.jit
def _span_fwd(X, KG, GAM, U, SE, M, i_b, i_r, i_h, cs, ce, is_m, c0, NCw, H, K: tl.constexpr, V: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
              PREC: tl.constexpr, STAGES: tl.constexpr, U_RM: tl.constexpr, U_ROWS: tl.constexpr, DEC, lim,
              FORGET: tl.constexpr, SB: tl.constexpr):
    """Column block ``i_b`` of row ``i_r``'s [S_ext | M] (transposed, [BV, K] fp32) through the row's chunks, forward
    in 16-token steps from its contents (see ``_c16_span_rows``)."""
    NB: tl.constexpr = BT // BC
    DT: tl.constexpr = KG.dtype.element_ty
    o_k = tl.arange(0, BK)
    # (arithmetic, not tl.where: the compiler then knows the block start is a multiple of BV, so the tile loads
    # stay vectorised and asynchronous)
    col = i_b * BV - is_m.to(tl.int32) * BVP + tl.arange(0, BV)
    ncol = tl.where(is_m, K, V)
    m_s = (col < ncol)[:, None] & (o_k < K)[None, :]
    p_s = ((i_r * H + i_h).to(tl.int64) * K + o_k[None, :]) * ncol + col[:, None]  # Sᵀ: row = column
    start = cs * NB  # the row's first 16-token block (global numbering)
    forgot = False
    if FORGET:
        start, forgot = _forgotten_prefix(DEC + (i_h * NCw - c0).to(tl.int64) * NB, cs * NB, ce * NB, lim, SB)
    if forgot:  # the row's history before ``start`` is scaled by ≤ 2^lim: S_ext from zero, M = 0
        St = tl.zeros([BV, BK], dtype=tl.float32)
    elif is_m:
        St = tl.load(M + p_s, mask=m_s, other=0.)
    else:
        St = tl.load(SE + p_s, mask=m_s, other=0.)
    if is_m and forgot:
        start = ce * NB  # M needs no steps: it stays 0
    m_u = (col < BVP)[None, :] & (i_b * BV < BVP)  # M columns: V' = 0 − W M
    q_w, q_kg, q_gam, q_u = _span_tiles(X, KG, GAM, U, (i_h * NCw - c0).to(tl.int64) * NB + start, col, BC, BK,
                                        BVP, U_RM, U_ROWS)
    eye = _eye(BC).to(DT)
    for _ in tl.range(start, ce * NB, num_stages=STAGES):
        # Uᵀ (zero for M's blocks) into the accumulator by the exact product Uᵀ·I (U stored in fp32: as is),
        # then V'ᵀ = Uᵀ + Sᵀ (−W)ᵀ
        b_u = tl.trans(tl.load(q_u, mask=m_u, other=0.))
        if U.dtype.element_ty == tl.float32:
            acc = b_u
        else:
            acc = tl.dot(b_u, eye, input_precision=PREC)
        vn = tl.dot(St.to(DT), tl.trans(tl.load(q_w)), acc=acc, input_precision=PREC).to(DT)
        St = St * tl.load(q_gam)[None, :] + tl.dot(vn, tl.load(q_kg), input_precision=PREC)
        q_kg += BC * BK
        q_gam += BK
        q_w += 2 * BC * BK
        q_u += BVP * U_ROWS
    if is_m:
        tl.store(M + p_s, St, mask=m_s)
    else:
        tl.store(SE + p_s, St, mask=m_s)


@triton.jit(do_not_specialize=['c0', 'NCw', 'H'])
def _c16_span_rows(
    X, KG, GAM, U, SE, M,
    row_cs, row_ce, row_m, c0, NCw,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr, U_RM: tl.constexpr, U_ROWS: tl.constexpr = 32,
    DEC=None, lim=0.0, FORGET: tl.constexpr = False, SB: tl.constexpr = 256,
):
    """The split prefill's span pass on mode 2's (or mode 3's) window buffers: row r's extended state [S_ext | M]
    through the chunks [row_cs[r], row_ce[r]) (global numbers, inside the window that starts at chunk c0), in
    16-token steps with each column block held TRANSPOSED ([BV, K] fp32, the state pass's form):
        V'ᵀ = [U | 0]ᵀ − [S_ext | M]ᵀ Wᵀ,  [S_ext | M]ᵀ ← [S_ext | M]ᵀ Diag(γ) + V'ᵀ kg.
    One program per (column block, row, head); blocks below BVP are S_ext (``SE [R, H, K, V]``), the others M
    (``M [R, H, K, K]``), each started from its contents and written back; rows with ``row_m[r] == 0`` skip their
    M blocks, an empty range leaves the row as it was (``span._kda_span_rows``'s contract). ``U_ROWS``: rows of U
    per block, 2·BC in mode 2 ([U; A_qk U]; only U is read) and BC in mode 3 (U alone, row-major).

    ``FORGET``: each row first looks for the latest block b* of its range whose suffix [b*, end) has a decay bound
    (``DEC``, log2 per block, see ``decay_bound``) ≤ ``lim``. If there is one, the transition of that suffix has
    norm ≤ 2^lim, so the row's M is stored as 0 and its S_ext runs from zero over the suffix alone: what enters
    before b* reaches the row's end scaled by ≤ 2^lim (``SplitConfig.forget_log2``)."""
    i_b, i_r, i_h, cs, ce, live = _span_row_program(row_cs, row_ce, row_m, H, BV, BVP)
    if live:
        _span_fwd(X, KG, GAM, U, SE, M, i_b, i_r, i_h, cs, ce, i_b * BV >= BVP, c0, NCw, H, K, V, BT, BC, BK, BV,
                  BVP, PREC, STAGES, U_RM, U_ROWS, DEC, lim, FORGET, SB)


@triton.jit
def _span_rev(X, KG, GAM, U, SE, M, i_b, i_r, i_h, cs, ce, c0, NCw, H, K: tl.constexpr, V: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr, BR: tl.constexpr,
              PREC: tl.constexpr, STAGES: tl.constexpr, U_RM: tl.constexpr, U_ROWS: tl.constexpr, DEC, lim,
              FORGET: tl.constexpr, SB: tl.constexpr):
    """Rows [i_b·BR, i_b·BR + BR) of a span row's (M, S_ext) from [0 | I], by the chain run BACKWARDS from the
    row's last block: with A_b = Diag(γ_b) − kg_bᵀ W_b (a block's transition) and R = A_n ⋯ A_{b+1},
        Y = R kg_bᵀ,  S_ext += Y U_b,  R ← R Diag(γ_b) − Y W_b,
    so that at the row's first block R = M and S_ext = Σ_b A_n ⋯ A_{b+1} kg_bᵀ U_b (the state from zero). Rows of R
    are independent, and S_ext is only accumulated: three [BR, 16]-wide products per step against the forward
    chain's four (two on S_ext, two on M). ``FORGET`` as in ``_c16_span_rows``: the chain stops at b*, M = 0."""
    NB: tl.constexpr = BT // BC
    DT: tl.constexpr = KG.dtype.element_ty
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVP)
    rows = i_b * BR + tl.arange(0, BR)
    start = cs * NB
    forgot = False
    if FORGET:
        start, forgot = _forgotten_prefix(DEC + (i_h * NCw - c0).to(tl.int64) * NB, cs * NB, ce * NB, lim, SB)
    R = tl.where(rows[:, None] == o_k[None, :], 1.0, 0.0)  # [BR, BK] fp32: rows of A_n ⋯ A_{b+1}, from I
    E = tl.zeros([BR, BVP], dtype=tl.float32)
    last = (i_h * NCw - c0).to(tl.int64) * NB + ce * NB - 1  # the row's last block
    q_w, q_kg, q_gam, q_u = _span_tiles(X, KG, GAM, U, last, o_v, BC, BK, BVP, U_RM, U_ROWS)
    for _ in tl.range(start, ce * NB, num_stages=STAGES):
        y = tl.dot(R.to(DT), tl.trans(tl.load(q_kg)), input_precision=PREC).to(DT)  # [BR, 16]
        E = tl.dot(y, tl.load(q_u), acc=E, input_precision=PREC)
        R = R * tl.load(q_gam)[None, :] + tl.dot(y, tl.load(q_w), input_precision=PREC)
        q_kg -= BC * BK
        q_gam -= BK
        q_w -= 2 * BC * BK
        q_u -= BVP * U_ROWS
    if forgot:
        R = tl.zeros([BR, BK], dtype=tl.float32)
    base = (i_r * H + i_h).to(tl.int64) * K + rows[:, None]
    m_r = rows[:, None] < K
    tl.store(M + base * K + o_k[None, :], R, mask=m_r & (o_k < K)[None, :])
    tl.store(SE + base * V + o_v[None, :], E, mask=m_r & (o_v < V)[None, :])


@triton.jit(do_not_specialize=['c0', 'NCw', 'H'])
def _c16_span_rows_rev(
    X, KG, GAM, U, SE, M,
    row_cs, row_ce, row_m, c0, NCw,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr, BR: tl.constexpr,
    PREC: tl.constexpr, STAGES: tl.constexpr, U_RM: tl.constexpr, U_ROWS: tl.constexpr = 32,
    DEC=None, lim=0.0, FORGET: tl.constexpr = False, SB: tl.constexpr = 256,
):
    """``_c16_span_rows``'s results with the affine rows (``row_m[r] != 0``, which the split starts from [0 | I])
    computed by the backward chain of ``_span_rev``, BR rows of (M, S_ext) per program; a row without M (the
    piece's first, run from its known entry state) keeps the forward S_ext chain, BV columns per program. Grid
    (max(BK / BR, BVP / BV), rows·H)."""
    i_b = tl.program_id(0)
    i_r = tl.program_id(1) // H
    i_h = tl.program_id(1) % H
    cs = tl.load(row_cs + i_r)
    ce = tl.load(row_ce + i_r)
    if tl.load(row_m + i_r) != 0:
        if (cs < ce) & (i_b * BR < BK):
            _span_rev(X, KG, GAM, U, SE, M, i_b, i_r, i_h, cs, ce, c0, NCw, H, K, V, BT, BC, BK, BVP, BR, PREC,
                      STAGES, U_RM, U_ROWS, DEC, lim, FORGET, SB)
    elif (cs < ce) & (i_b * BV < BVP):  # S_ext columns only (``is_m`` False, as a tensor: ``i_b < 0``)
        _span_fwd(X, KG, GAM, U, SE, M, i_b, i_r, i_h, cs, ce, i_b < 0, c0, NCw, H, K, V, BT, BC, BK, BV, BVP,
                  PREC, STAGES, U_RM, U_ROWS, DEC, lim, FORGET, SB)


class C16Config:
    """Launch knobs of the 16-token inference flow (class attributes, for benchmarks to switch)."""

    # what the prep hands the state pass (see ``_c16_prep``). H200 (bench/c16_quick.py, B=1 H=32, per 1M tokens,
    # prep with early loads): prep 21.4 / 24.5 / 28.5 ms of the whole GPU, state pass 41.6 / 34.7 / 25.9 ms (6
    # stages) on its 64 programs for modes 0 / 1 / 2; the prefill (knob_ab) 56.7 / 47.2–47.4 / 43.9–46.7 ms.
    # Mode 3 (session 23, with the Gluon prep, which then skips its A_qk U product; 5 interleaved rounds, same
    # process): B=1 T=1M H=8 (split) 12.96–13.13 ms against 13.12–13.60 in mode 2, H=32 37.4–40.2 against
    # 38.6–44.1 — the prep writes and the state pass reads 192 fewer bytes per token and head (v16, with the
    # Triton prep, had measured mode 3 1.5–2 ms slower at H=32)
    mode = 3
    prep_warps = 2  # 4 warps: prep 28.5 → 37.0 ms (mode 2)
    prep_fast_gate = True  # bounded gate σ by rsqrt (``_rows_gate`` FAST): a few ulp off the plain σ
    # the 16×16 inverse by six fp32-accurate products instead of forward substitution; H200, mode 2, prep per 1M
    # tokens at H = 32: 31.4 ms by substitution, 28.5 by products at 'ieee', 27.4–27.6 at 'tf32x3'
    prep_inv_pow = True
    # the products' precision: "ieee" (FMA), "tf32x3" (tensor cores, fp32-accurate) or "fp16x3" (fp16 hi + lo
    # splits on tensor cores, ~22 bits: half the operand bytes through shared memory)
    # H200, B=1 H=32 per 1M (same process): prep alone 27.4 (tf32x3) → 24.9 ms (fp16x3); prefill 45.5–47.0 → 45.0–45.6
    prep_inv_prec = "fp16x3"
    prep_head_major = False  # prep grid (heads, blocks) instead of (blocks, heads)
    # issue the loads of q, k, v, g, β together at the program's start (the compiled code otherwise waits for each
    # in turn, between the gate, the norms and the products: four DRAM latencies per short program); H200, mode 1:
    # prep 31.9 → 24.5 ms per 1M at H = 32
    prep_early_loads = True
    # a register cap for the prep (None: the compiler's 167 in mode 2 at 2 warps, 6 programs per SM and 3 beside a
    # state-pass program); 144 compiles without spills (sm_90, ptxas) and fits 7 per SM, 4 beside the state pass —
    # but the prefill measured 42.0 / 43.3 ms against 41.2 / 42.0 uncapped (H200, same process)
    prep_maxnreg = None
    # measurement only (``bench/l2_probe.py``): the prep's outputs and the state pass's reads wrap over this many
    # chunks of the window buffers (the results are garbage), to time both with their hand-off resident in L2
    probe_ring = 0
    state_bv = 64  # 128 at 8 warps: 48 ms per 1M (the two warpgroups' steps do not overlap)
    # columns of [S_ext | M] per program of the split prefill's span pass (``_c16_span_rows``; fp32 buffers keep 64:
    # at 128 their 'ieee' step spills 592 B at sm_90). 128 with 4 stages (sm_90: 255 registers, 176 B of spills,
    # 51 KB of shared memory; at 64: 168 registers, 86 KB at 8 stages): at K = V = 128 a row is then two programs
    # (S_ext, M) reading W, kg and γ twice instead of four times, and at B=1 H=8 T=1M (8 segments) its 104
    # programs hold one SM each. H200, same process (knob_ab, 3 × 3 rounds, session 24): 12.28–12.82 ms against
    # 12.71–13.61 at 64 / 8 stages; 128 at 8 stages 12.36–13.25, at 8 warps 12.71–13.77
    span_bv = 128
    # the affine rows (M, S_ext) by the backward chain (``_c16_span_rows_rev``): three products per 16-token step on
    # span_rev_rows rows of both instead of two on each of S_ext and M (three quarters of the forward chain's work)
    # (sm_90, K = V = 128, 4 warps, 4 stages: 210 registers and no spills with the first rows' forward chain at
    # span_rev_bv = 64 columns; at 128 both kernels take 255 registers and spill ~280 B)
    span_reverse = True
    span_rev_rows = 64
    span_rev_bv = 64
    span_warps: int | None = None  # the span pass's warps and stages (None: ``state_warps`` / ``state_stages``)
    span_stages: int | None = 4
    # ``FwdConfig.inference_flow = "auto"`` takes this flow from this many state-pass programs (B·H·V / state_bv)
    min_programs = 64
    state_warps = 4
    # mode 2, state pass alone: 27.7 ms at 4 stages, 25.9 at 6; the prefill 45.6 at 4 vs 42.8 at 6. Session 14 (U
    # row-major, fp16x3): alone 29.5 (6) / 28.2 (8) / 28.5 (10) / 28.8 (13); the prefill 43.6–44.9 (6) against
    # 42.9–43.6 (8) and 43.5–43.6 (10), four interleaved rounds in one process
    state_stages = 8
    # mode 2: the step's tile pointers carried across steps and advanced by each buffer's block stride (sm_90: 281 →
    # 264 instructions per step); the prefill 41.15 / 41.96 ms against 42.73 / 43.24 (H200, same process)
    state_ptr_inc = True
    # mode 2 (pointer loop): [U; A_qk U]ᵀ enters the accumulator as the exact product [U; A_qk U]ᵀ·I on the tensor
    # cores instead of a bf16 → fp32 conversion in registers (sm_90: 266 → 245 instructions per step); H200 prefill
    # 44.7–45.5 ms against 45.5–47.0 without (same process), 44.0 with fp16x3
    state_u_eye = False
    # [U; A_qk U] stored row-major per block by the prep (plain stores instead of transposed ones) and transposed by
    # the state pass's identity product (implies state_u_eye). H200, B=1 H=32 per 1M, same process: alone the prep
    # 27.3 → 28.6 ms and the state pass 26.7 → 27.9 (the identity product's wait is on the step's chain), yet the
    # prefill 45.5–47.0 → 44.8–45.3 (the state pass issues 266 → 252 instructions per step beside the prep's
    # programs); with fp16x3 42.2–43.8 against 45.0–45.6 for fp16x3 alone. [U; A_qk U] stored in fp32 and loaded
    # as the accumulator as is (no identity product on the chain; 512 more bytes per token and head) measured
    # 46.6–47.9 against 40.7–42.0 (session 15, same process): removed
    u_rowmajor = True
    # extra ptxas flags for the state and span passes (a compile option: variants coexist in one process), e.g.
    # "--register-usage-level=0" (NOTES_kda.md v21)
    ptxas_options: str | None = None


def _mode() -> int:
    m = C16Config.mode
    if m not in (0, 1, 2, 3):
        raise ValueError(f"C16Config.mode: expected 0, 1, 2 or 3, got {m!r}")
    return int(m)


def _inv_prec(flags: dict, lower_bound) -> str:
    """``C16Config.prep_inv_prec``, except that 'fp16x3' needs |β A_kk| ≤ 1 — unit keys (the in-kernel L2 norm), β in
    (0, 1) (the in-kernel sigmoid) and decays ≤ 1 (the bounded in-kernel gate) — so the inverse's partial sums stay
    ≤ 2^14, inside fp16's range; other calls use 'tf32x3'."""
    p = C16Config.prep_inv_prec
    if p not in ("ieee", "tf32x3", "fp16x3"):
        raise ValueError(f"C16Config.prep_inv_prec: expected 'ieee', 'tf32x3' or 'fp16x3', got {p!r}")
    bounded = flags["l2norm"] and flags["beta_sigmoid"] and flags["use_gate"] and lower_bound is not None
    return "tf32x3" if p == "fp16x3" and not bounded else p


def _u_form() -> tuple[bool, bool]:
    """(U_EYE, U_RM): whether mode 2's pointer loop takes [U; A_qk U] through the identity product (row-major
    [U; A_qk U] needs it to transpose), and whether U is stored row-major. Mode 3 stores U alone, row-major; its
    state pass forms A_qk U by a product of its own (no U_EYE)."""
    if _mode() == 3:
        return False, True
    loop = _mode() == 2 and bool(C16Config.state_ptr_inc)
    rm = loop and bool(C16Config.u_rowmajor)
    return rm or (loop and bool(C16Config.state_u_eye)), rm


def alloc_c16_buffers(H: int, NC: int, BK: int, BVP: int, dt: torch.dtype, device,
                      decay_bound: bool = False) -> dict:
    """The window buffers of the 16-token flow's mode (see ``_c16_prep``); ``decay_bound``: also "DEC" [H, NC, BT /
    BC] fp32, each block's ``decay_bound``, which the preps then write (the split's span pass reads it)."""
    e = dict(dtype=dt, device=device)
    mode = _mode()
    rows = 2 * BT if mode >= 2 else BT  # modes 2 and 3 stack two 16-row tiles per block
    bufs = {
        "X": torch.empty(H, NC, rows, BK, **e),
        "KG": torch.empty(H, NC, BT, BK, **e),
        "GAM": torch.empty(H, NC, BT // BC, BK, dtype=torch.float32, device=device),
    }
    if mode in (0, 1):
        bufs["QG"] = torch.empty(H, NC, BT, BK, **e)
        bufs["AQ"] = torch.empty(H, NC, BT, BC, **e)
    if mode == 0:
        bufs["TB"] = torch.empty(H, NC, BT, BC, **e)
    elif mode == 3:  # U [16, BVP] and [I | A_qkᵀ] [16, 32] per block
        bufs["U"] = torch.empty(H, NC, BT, BVP, **e)
        bufs["AQ"] = torch.empty(H, NC, BT, 2 * BC, **e)
    else:
        bufs["U"] = torch.empty(H, NC, rows, BVP, **e)
    if decay_bound:
        bufs["DEC"] = torch.empty(H, NC, BT // BC, dtype=torch.float32, device=device)
    return bufs


def c16_chunk_bytes(H: int, BK: int, BVP: int, dt: torch.dtype) -> int:
    """Bytes of window buffers per 64-token chunk (all heads)."""
    es = torch.finfo(dt).bits // 8
    per = {0: 3 * BK + 2 * BC, 1: 3 * BK + BVP + BC, 2: 3 * BK + 2 * BVP, 3: 3 * BK + BVP + 2 * BC}[_mode()]
    return H * (BT * per * es + (BT // BC) * BK * 4)


def c16_window_chunks(NC: int, budget: int, H: int, BK: int, BVP: int, dt: torch.dtype) -> int:
    """Chunks per window of buffers within ``budget`` bytes: at least 1, at most NC and 16383 (the head-major prep
    grid puts 4 programs per chunk on grid axis 1, at most 65535)."""
    return max(1, min(NC, 16383, budget // c16_chunk_bytes(H, BK, BVP, dt)))


def _probe_ring() -> int:
    """``C16Config.probe_ring`` checked: 0 (off) or the ring's chunk count."""
    ring = C16Config.probe_ring
    if not isinstance(ring, int) or ring < 0:
        raise ValueError(f"C16Config.probe_ring: expected an int >= 0 (0 = off), got {ring!r}")
    return ring


def _or(bufs: dict, name: str) -> torch.Tensor:
    return bufs.get(name, bufs["GAM"])  # a buffer this mode does not use: any pointer


def launch_c16_prep(q, k, v, g, beta, A_log, dt_bias, bufs: dict, tab: ChunkTable, c0: int, n: int, scale: float,
                    lower_bound, flags: dict) -> None:
    _, _, H, K = q.shape
    V = v.shape[-1]
    fast = bool(C16Config.prep_fast_gate) and lower_bound is not None
    inv_prec, u_rm, ring = _inv_prec(flags, lower_bound), _u_form()[1], _probe_ring()
    if prep_gluon.usable(q, K, V, flags, lower_bound, inv_prec, _mode(), u_rm, ring,
                         bool(C16Config.prep_head_major), fast):
        prep_gluon.launch_prep_gluon(q, k, v, g, beta, A_log, dt_bias, bufs, tab, c0, n, scale, lower_bound, BT, BC)
        return
    BK = bufs["X"].shape[-1]
    dummy = bufs["GAM"]
    grid = (H, n * (BT // BC)) if C16Config.prep_head_major else (n * (BT // BC), H)
    _c16_prep[grid](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        bufs["X"], _or(bufs, "QG"), bufs["KG"], bufs["GAM"], _or(bufs, "TB"), _or(bufs, "AQ"), _or(bufs, "U"),
        tab.cu, tab.chunk_seq, tab.chunk_off, c0, bufs["X"].shape[1], tab.T, tab.NT, H, K, V, scale,
        float(lower_bound) if lower_bound is not None else 0.0,
        BT=BT, BC=BC, BK=BK, BVP=next_pow2(V), USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None,
        HAS_A=A_log is not None, HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"],
        BETA_SIGMOID=flags["beta_sigmoid"], IS_VARLEN=tab.varlen,
        FAST_GATE=fast, PREC=dot_precision(q.dtype),
        AB_BF16=q.dtype == torch.bfloat16, MODE=_mode(), INV_POW=bool(C16Config.prep_inv_pow),
        INV_PREC=inv_prec, HEAD_MAJOR=bool(C16Config.prep_head_major),
        EARLY_LOADS=bool(C16Config.prep_early_loads), U_RM=u_rm, RING=ring,
        DEC=bufs.get("DEC"), DEC_OUT="DEC" in bufs, num_warps=C16Config.prep_warps, num_stages=1,
        **maxnreg_kw(C16Config.prep_maxnreg),
    )


def state_blocks(BVP: int) -> int:
    """V-blocks per (sequence, head) of the state pass: its programs are ``state_blocks(BVP)`` × N·H."""
    return BVP // min(C16Config.state_bv, BVP)


def launch_c16_state(bufs: dict, v, o, ht, tab: ChunkTable, c0: int, c1: int, H: int, K: int, V: int) -> None:
    BK = bufs["X"].shape[-1]
    BVP = next_pow2(V)
    BV = min(C16Config.state_bv, BVP)
    ptr_inc = (bool(C16Config.state_ptr_inc) and _mode() == 2) or _mode() == 3  # mode 3: pointer loop only
    ring = _probe_ring()
    if ring and not (ptr_inc and _mode() == 2):
        raise ValueError("C16Config.probe_ring: the state pass wraps its reads only in mode 2's pointer loop "
                         "(C16Config.mode = 2, state_ptr_inc = True)")
    _c16_state[(state_blocks(BVP), tab.N * H)](
        bufs["X"], _or(bufs, "QG"), bufs["KG"], bufs["GAM"], _or(bufs, "TB"), _or(bufs, "AQ"), _or(bufs, "U"),
        v, o, ht, tab.cu, tab.chunk_off, c0, c1, bufs["X"].shape[1], tab.T, tab.NT, H, K, V,
        BT=BT, BC=BC, BK=BK, BV=BV, BVP=BVP, IS_VARLEN=tab.varlen, PREC=dot_precision(bufs["X"].dtype),
        STAGES=state_stages(C16Config.state_stages, bufs["X"].dtype), MODE=_mode(),
        PTR_INC=ptr_inc, U_EYE=_u_form()[0], U_RM=_u_form()[1], RING=ring, num_warps=C16Config.state_warps,
        num_stages=1, **ptxas_kw(C16Config.ptxas_options),
    )


def _or_none(value: int | None, default: int) -> int:
    return default if value is None else value


def launch_c16_span(bufs: dict, SE: torch.Tensor, Mt: torch.Tensor, rows: dict, c0: int, H: int, K: int,
                    V: int, forget_log2: float | None = None) -> None:
    """``_c16_span_rows`` over the window of mode-2 or mode-3 buffers that starts at chunk c0: ``SE [Q, R, H, K,
    V]`` and ``Mt [Q, R, H, K, K]`` (fp32, updated in place), ``rows`` the int32 tables row_cs, row_ce, row_m [Q·R].
    ``forget_log2``: rows drop the history that their decay bound scales by ≤ 2^−forget_log2 (the buffers need
    the prep's bounds: ``alloc_c16_buffers(..., decay_bound=True)``); None: every row runs its whole range.
    With ``C16Config.span_reverse`` (the default) the rows that have an M run ``_c16_span_rows_rev``'s backward
    chain and must hold [0 | I] (as the split's do); the others keep their contents' forward chain."""
    if _mode() not in (2, 3):
        raise ValueError(f"C16Config.mode: the 16-token span pass reads mode 2's or 3's buffers, got mode {_mode()}")
    if forget_log2 is not None and ("DEC" not in bufs or not forget_log2 > 0):
        raise ValueError(f"forget_log2: expected None, or a number > 0 with buffers that hold the prep's decay "
                         f"bounds (alloc_c16_buffers(..., decay_bound=True)), got {forget_log2!r}")
    BK, BVP = bufs["X"].shape[-1], next_pow2(V)
    cap = 64 if bufs["X"].dtype == torch.float32 else BVP  # (see ``C16Config.span_bv``)
    bv = min(C16Config.span_bv, cap, BVP, BK)
    if C16Config.span_reverse:  # its forward columns (a piece's first row) are capped: no spills (``C16Config``)
        bv = min(bv, C16Config.span_rev_bv)
    stages = state_stages(_or_none(C16Config.span_stages, C16Config.state_stages), bufs["X"].dtype)
    args = (bufs["X"], bufs["KG"], bufs["GAM"], bufs["U"], SE, Mt, rows["row_cs"], rows["row_ce"], rows["row_m"],
            c0, bufs["X"].shape[1], H, K, V)
    kw = dict(BT=BT, BC=BC, BK=BK, BV=bv, BVP=BVP, PREC=dot_precision(bufs["X"].dtype), STAGES=stages,
              U_RM=_u_form()[1], U_ROWS=BC if _mode() == 3 else 2 * BC,
              DEC=bufs.get("DEC"), lim=-float(forget_log2 or 0.0), FORGET=forget_log2 is not None,
              num_warps=_or_none(C16Config.span_warps, C16Config.state_warps),
              num_stages=1, **ptxas_kw(C16Config.ptxas_options))
    n_rows = rows["row_cs"].numel() * H
    if C16Config.span_reverse:
        br = min(int(C16Config.span_rev_rows), BK)
        _c16_span_rows_rev[(max(BK // br, BVP // bv), n_rows)](*args, BR=br, **kw)
    else:
        _c16_span_rows[((BVP + BK) // bv, n_rows)](*args, **kw)
