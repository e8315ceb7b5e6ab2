"""Chunked KDA forward (SPEC §2, chunk BT = 64 in 16-row sub-blocks): two kernels.

``_kda_fwd_prep`` — chunk-parallel, grid (chunks, H). Fuses gate activation + cumsum (fp32, log2 units), L2 norm,
β sigmoid, the intra-chunk matrices A_kk / A_qk, T = (I + A_kk)^{-1}, and writes per chunk
W = T(β K e^G), U = T(β V), kg = K e^{G_C − G}, qg = scale · Q e^G, A_qk, γ = e^{G_C} (and T when training).

``_kda_fwd_state`` — the sequential pass, grid (V-blocks, N·H), fp32 state in registers:
V' = U − W S;  O = qg S + A_qk V';  S ← Diag(γ) S + kgᵀ V'.

Inference (no grad) runs the pair over windows of chunks with window-sized buffers, so working memory does not
grow with T; training runs one window over everything and keeps the buffers (and the per-chunk states) for backward.

Decay factoring (why 16-row sub-blocks): A[i, j] = Σ_d a_id b_jd e^{G_id − G_jd} cannot be one matmul; for the
16 rows of sub-block I we use the reference row r = 16·I, a PAST row for every row i of the block:
(a_i e^{G_i − G_r}) · (b_j e^{G_r − G_j}). For j < r both factors are ≤ 1; inside the diagonal block the right
factor is ≤ e^{5·15} under the bounded gate. Row i then depends on g at rows ≤ i only, so future gates cannot
reach earlier outputs even through rounding (fla issue #1240). Unbounded gates take an exact per-element path
for the diagonal blocks (``EXACT_DIAG``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BC,
    BT,
    RCP_LN2,
    ChunkTable,
    _chunk_pos,
    _chunk_range,
    _gate_fwd,
    _row,
    _rows,
    _seq_bounds,
    _sigmoid,
    dot_precision,
    next_pow2,
    store_dtype,
)


@triton.jit
def _place_rows(x, I, NB: tl.constexpr, BC: tl.constexpr):
    """[BC, N] block → [NB*BC, N] tensor holding it at row block I, zeros elsewhere."""
    N: tl.constexpr = x.shape[1]
    o_b = tl.arange(0, NB)
    return tl.reshape(tl.where((o_b == I)[:, None, None], x[None, :, :], 0.), (NB * BC, N))


@triton.jit
def _place_cols(x, I, NB: tl.constexpr, BC: tl.constexpr):
    """[M, BC] block → [M, NB*BC] tensor holding it at column block I, zeros elsewhere."""
    M: tl.constexpr = x.shape[0]
    o_b = tl.arange(0, NB)
    return tl.reshape(tl.where((o_b == I)[None, :, None], x[:, None, :], 0.), (M, NB * BC))


@triton.jit
def _exact_diag(aI, bI, gI, STRICT: tl.constexpr):
    """Σ_d a_id b_jd e^{G_id − G_jd} for j ≤ i (j < i if STRICT) inside one sub-block; only exponents ≤ 0."""
    R: tl.constexpr = aI.shape[0]
    o_s = tl.arange(0, R)
    if STRICT:
        keep = o_s[:, None] > o_s[None, :]
    else:
        keep = o_s[:, None] >= o_s[None, :]
    e = tl.exp2(tl.where(keep[:, :, None], gI[:, None, :] - gI[None, :, :], float("-inf")))
    return tl.sum(aI[:, None, :] * bI[None, :, :] * e, axis=2)


@triton.jit
def _bcast_rows(t, NB: tl.constexpr, BC: tl.constexpr):
    """[NB, N] per-block values → [NB*BC, N] (each block's row repeated over its BC rows)."""
    N: tl.constexpr = t.shape[1]
    return tl.reshape(tl.broadcast_to(t[:, None, :], (NB, BC, N)), (NB * BC, N))


@triton.jit
def _block_first(G, NB: tl.constexpr, BC: tl.constexpr):
    """First row of every sub-block of G [NB*BC, N] → [NB, N]."""
    N: tl.constexpr = G.shape[1]
    o_s = tl.arange(0, BC)
    return tl.sum(tl.where((o_s == 0)[None, :, None], tl.reshape(G, (NB, BC, N)), 0.), axis=1)


@triton.jit
def _intra_A(b_q, b_k, G, o_t, NB: tl.constexpr, BC: tl.constexpr, EXACT_DIAG: tl.constexpr,
             PREC: tl.constexpr):
    """A_qk-like Σ_d q_id k_jd e^{G_id − G_jd} and A_kk-like (k for q) [BT, BT] fp32 for j ≤ i (zeros above).

    Column block J uses reference row r = 16·J, a past row for every entry it serves (j ≥ r, i ≥ j):
    left factor x_i e^{G_i − G_r} ≤ 1 for rows i ≥ r, right factor k_j e^{G_r − G_j} ∈ [1, e^{5·15}].
    One [BT, BKS]·[BKS, BC] product per column block covers its diagonal and all rows below it.
    With EXACT_DIAG the diagonal blocks are recomputed with exponents ≤ 0 only (unbounded gates)."""
    BT_: tl.constexpr = NB * BC
    blk = o_t // BC
    Gf = _block_first(G, NB, BC)  # [NB, BKS]
    Gfr = _bcast_rows(Gf, NB, BC)
    e1 = tl.exp2(G - Gfr)  # ≤ 1: decay from the block's first row
    ql = b_q * e1
    kl = b_k * e1
    kd = b_k * tl.exp2(Gfr - G)  # ≥ 1, ≤ e^{5·15} under the bounded gate
    o_b = tl.arange(0, NB)
    Aq = tl.zeros([BT_, BT_], dtype=tl.float32)
    Ak = tl.zeros([BT_, BT_], dtype=tl.float32)
    for J in range(NB):  # a run-time loop: unrolling hoists all four blocks' temporaries (register spills)
        GJ = tl.sum(tl.where((o_b == J)[:, None], Gf, 0.), axis=0)
        f = _bcast_rows(tl.exp2(tl.where((o_b >= J)[:, None], Gf - GJ[None, :], float("-inf"))), NB, BC)
        kdJ = _rows(kd, J, NB, BC)
        aq = tl.dot(ql * f, tl.trans(kdJ), input_precision=PREC)
        ak = tl.dot(kl * f, tl.trans(kdJ), input_precision=PREC)
        if EXACT_DIAG:
            # the diagonal block again, exactly; the product above may have overflowed there
            gJ = _rows(G, J, NB, BC)
            kJ = _rows(b_k, J, NB, BC)
            qJ = _rows(b_q, J, NB, BC)
            ondiag = (blk == J)[:, None]
            aq = tl.where(ondiag, _rows_place(_exact_diag(qJ, kJ, gJ, False), J, NB, BC), aq)
            ak = tl.where(ondiag, _rows_place(_exact_diag(kJ, kJ, gJ, True), J, NB, BC), ak)
        Aq += _place_cols(aq, J, NB, BC)
        Ak += _place_cols(ak, J, NB, BC)
    return Aq, Ak


@triton.jit
def _rows_place(x, I, NB: tl.constexpr, BC: tl.constexpr):
    return _place_rows(x, I, NB, BC)


@triton.jit
def _solve_unit_lower(L, o_t, NB: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """T = (I + L)^{-1} for strictly lower-triangular L [BT, BT] (fp32).

    Forward substitution on the four 16×16 diagonal blocks at once (D = blockdiag inverse), then the block merge
    T = (I + N)^{-1} D with N = D·L_offdiag nilpotent of order 4: (I + N)^{-1} = (I − N)(I + N²).
    """
    BT_: tl.constexpr = NB * BC
    o_b = tl.arange(0, NB)
    o_s = tl.arange(0, BC)
    same = (o_b[:, None, None, None] == o_b[None, None, :, None])
    Ld = tl.sum(tl.where(same, tl.reshape(L, (NB, BC, NB, BC)), 0.), axis=2)  # [NB, BC, BC]
    eye = tl.where(o_s[:, None] == o_s[None, :], 1.0, 0.0)
    Td = tl.zeros([NB, BC, BC], dtype=tl.float32) + eye[None, :, :]
    for s in range(1, BC):
        row = tl.sum(tl.where((o_s == s)[None, :, None], Ld, 0.), axis=1)  # [NB, BC] = Ld[:, s, :]
        new = tl.where((o_s == s)[None, :], 1.0, 0.0) - tl.sum(row[:, :, None] * Td, axis=1)
        Td = tl.where((o_s == s)[None, :, None], new[:, None, :], Td)
    D = tl.reshape(tl.where(same, Td[:, :, None, :], 0.), (BT_, BT_))
    blk = o_t // BC
    Lo = tl.where(blk[:, None] != blk[None, :], L, 0.)
    N1 = tl.dot(D, Lo, input_precision=PREC)
    N2 = tl.dot(N1, N1, input_precision=PREC)
    X1 = D + tl.dot(N2, D, input_precision=PREC)
    return X1 - tl.dot(N1, X1, input_precision=PREC)


@triton.jit
def _load_tile(x, i_h, bos, eos, H, K, i_k, BT: tl.constexpr, BKS: tl.constexpr):
    """Raw columns [i_k·BKS, (i_k+1)·BKS) of one chunk of x [T, H, K] (zeros outside)."""
    o_t = tl.arange(0, BT)
    o_k = i_k * BKS + tl.arange(0, BKS)
    m = ((bos + o_t) < eos)[:, None] & (o_k < K)[None, :]
    return tl.load(x + (bos + o_t)[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m, other=0.)


@triton.jit
def _sumsq(x):
    x = x.to(tl.float32)
    return tl.sum(x * x, axis=1)


@triton.jit
def _gate_cumsum(b_f, i_h, i_k, bos, eos, A_log, dt_bias, lb, K, BT: tl.constexpr, BKS: tl.constexpr,
                 USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr):
    """Gate activation + within-chunk cumsum, fp32, log2 units; padded rows/columns decay nothing."""
    o_t = tl.arange(0, BT)
    o_k = i_k * BKS + tl.arange(0, BKS)
    m_k = o_k < K
    b_g = _gate_fwd(b_f.to(tl.float32), i_h, A_log, dt_bias, lb, o_k, m_k, K, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    m = ((bos + o_t) < eos)[:, None] & m_k[None, :]
    return tl.cumsum(tl.where(m, b_g, 0.) * 1.4426950408889634, axis=0)


@triton.jit
def _load_beta(beta, i_h, bos, eos, H, BT: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    o_t = tl.arange(0, BT)
    m_t = (bos + o_t) < eos
    b_b = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b_b = _sigmoid(b_b)
    return tl.where(m_t, b_b, 0.)


@triton.jit
def _prep_cols(b_q, b_k, G, b_b, o_t, KG, QG, GAM, base, i_k, scale,
               BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
               EXACT_DIAG: tl.constexpr, PREC: tl.constexpr):
    """One column slice: store kg, qg, γ; return its share of A_qk, A_kk and X = β k e^G (store dtype)."""
    DT: tl.constexpr = KG.dtype.element_ty
    NB: tl.constexpr = BT // BC
    o_k = i_k * BKS + tl.arange(0, BKS)
    p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
    Glast = _row(G, BT - 1, o_t)
    eG = tl.exp2(G)
    tl.store(KG + p_tk, (b_k * tl.exp2(Glast[None, :] - G)).to(DT))
    tl.store(QG + p_tk, (b_q * eG * scale).to(DT))
    tl.store(GAM + base * BK + o_k, tl.exp2(Glast))
    b_x = (b_k * eG * b_b[:, None]).to(DT)
    aq, ak = _intra_A(b_q, b_k, G, o_t, NB, BC, EXACT_DIAG, PREC)
    return aq, ak, b_x


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _kda_fwd_prep(
    q, k, v, g, beta, A_log, dt_bias,
    W, U, KG, QG, AQK, GAM, TM,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_T: tl.constexpr,
    EXACT_DIAG: tl.constexpr, PREC: tl.constexpr,
):
    # All raw loads are issued first (one memory latency per chunk); the columns are then processed in at most
    # two BKS-wide slices to bound register pressure (A sums over d; G is per column).
    NB: tl.constexpr = BT // BC
    TWO: tl.constexpr = BK > BKS
    DT: tl.constexpr = W.dtype.element_ty
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    base = (i_h * NCw + i_c).to(tl.int64)
    k0 = _load_tile(k, i_h, bos, eos, H, K, 0, BT, BKS)
    q0 = _load_tile(q, i_h, bos, eos, H, K, 0, BT, BKS)
    g0 = _load_tile(g, i_h, bos, eos, H, K, 0, BT, BKS)
    if TWO:
        k1 = _load_tile(k, i_h, bos, eos, H, K, 1, BT, BKS)
        q1 = _load_tile(q, i_h, bos, eos, H, K, 1, BT, BKS)
        g1 = _load_tile(g, i_h, bos, eos, H, K, 1, BT, BKS)
    o_v = tl.arange(0, BVP)
    m_t = (bos + o_t) < eos
    b_v = tl.load(v + ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :],
                  mask=m_t[:, None] & (o_v < V)[None, :], other=0.)
    b_b = _load_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)
    if L2NORM:
        sk = _sumsq(k0)
        sq = _sumsq(q0)
        if TWO:
            sk += _sumsq(k1)
            sq += _sumsq(q1)
        rk = 1.0 / tl.sqrt(sk + 1e-6)
        rq = 1.0 / tl.sqrt(sq + 1e-6)
    else:
        rk = tl.full([BT], 1.0, tl.float32)
        rq = tl.full([BT], 1.0, tl.float32)

    G0 = _gate_cumsum(g0, i_h, 0, bos, eos, A_log, dt_bias, lb, K, BT, BKS, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    Aq, Ak, x0 = _prep_cols(q0.to(tl.float32) * rq[:, None], k0.to(tl.float32) * rk[:, None], G0, b_b, o_t,
                            KG, QG, GAM, base, 0, scale, BT, BC, BK, BKS, EXACT_DIAG, PREC)
    if TWO:
        G1 = _gate_cumsum(g1, i_h, 1, bos, eos, A_log, dt_bias, lb, K, BT, BKS, USE_GATE, HAS_LB, HAS_A, HAS_DT)
        aq, ak, x1 = _prep_cols(q1.to(tl.float32) * rq[:, None], k1.to(tl.float32) * rk[:, None], G1, b_b, o_t,
                                KG, QG, GAM, base, 1, scale, BT, BC, BK, BKS, EXACT_DIAG, PREC)
        Aq += aq
        Ak += ak
    p_tt = (base * BT + o_t[:, None]) * BT + o_t[None, :]
    tl.store(AQK + p_tt, tl.where(o_t[:, None] >= o_t[None, :], Aq * scale, 0.).to(DT))
    L = tl.where(o_t[:, None] > o_t[None, :], Ak * b_b[:, None], 0.)
    b_tm = _solve_unit_lower(L, o_t, NB, BC, PREC).to(DT)
    if STORE_T:
        tl.store(TM + p_tt, b_tm)
    o_k = tl.arange(0, BKS)
    tl.store(W + (base * BT + o_t[:, None]) * BK + o_k[None, :], tl.dot(b_tm, x0, input_precision=PREC).to(DT))
    if TWO:
        tl.store(W + (base * BT + o_t[:, None]) * BK + BKS + o_k[None, :],
                 tl.dot(b_tm, x1, input_precision=PREC).to(DT))
    b_u = tl.dot(b_tm, (b_v.to(tl.float32) * b_b[:, None]).to(DT), input_precision=PREC)
    tl.store(U + (base * BT + o_t[:, None]) * BVP + o_v[None, :], b_u.to(DT))


@triton.jit(do_not_specialize=['c0', 'c1', 'NCw', 'NCh', 'T', 'NT', 'H'])
def _kda_fwd_state(
    W, U, KG, QG, AQK, GAM, o, HS, ht,
    cu, chunk_off, c0, c1, NCw, NCh, T, NT,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    STORE_H: tl.constexpr, STORE_O: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    cs, ce = _chunk_range(i_n, chunk_off, NT, IS_VARLEN)
    bos, eos = _seq_bounds(i_n, cu, T, IS_VARLEN)
    lo = tl.maximum(cs, c0)
    hi = tl.minimum(ce, c1)
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
            if STORE_O:
                b_qg = tl.load(QG + p_tk)
                b_a = tl.load(AQK + (base * BT + o_t[:, None]) * BT + o_t[None, :])
                b_o = tl.dot(b_qg, b_s, input_precision=PREC) + tl.dot(b_a, b_vn, input_precision=PREC)
                t = bos + (c - cs).to(tl.int64) * BT + o_t
                tl.store(o + (t * H + i_h)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty),
                         mask=(t < eos)[:, None] & m_v[None, :])
            S = S * b_gam[:, None] + tl.dot(tl.trans(b_kg), b_vn, input_precision=PREC)
        tl.store(p_s, S, mask=m_k[:, None] & m_v[None, :])


# ----------------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------------


class FwdConfig:
    """Launch knobs (tuned on H200; overridable for benchmarking)."""

    prep_warps = 8
    prep_stages = 1
    prep_bks = 64
    state_bv = 32
    state_warps = 4
    state_stages = 2
    window_bytes = 1 << 30  # inference: bytes of chunk intermediates per window


def alloc_chunk_buffers(H: int, NC: int, BK: int, BVP: int, dt: torch.dtype, device, store_t: bool) -> dict:
    e = dict(dtype=dt, device=device)
    bufs = {
        "W": torch.empty(H, NC, BT, BK, **e),
        "U": torch.empty(H, NC, BT, BVP, **e),
        "KG": torch.empty(H, NC, BT, BK, **e),
        "QG": torch.empty(H, NC, BT, BK, **e),
        "AQK": torch.empty(H, NC, BT, BT, **e),
        "GAM": torch.empty(H, NC, BK, dtype=torch.float32, device=device),
    }
    bufs["TM"] = torch.empty(H, NC, BT, BT, **e) if store_t else bufs["AQK"]
    return bufs


def chunk_bytes(H: int, BK: int, BVP: int, dt: torch.dtype) -> int:
    """Bytes of intermediates per chunk (all heads)."""
    es = torch.finfo(dt).bits // 8
    return H * (BT * (3 * BK + BVP + BT) * es + BK * 4)


def launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs: dict, tab: ChunkTable, c0: int, n: int, scale: float,
                lower_bound, flags: dict, store_t: bool) -> None:
    _, _, H, K = q.shape
    V = v.shape[-1]
    BK = bufs["W"].shape[-1]
    BVP = bufs["U"].shape[-1]
    dummy = bufs["GAM"]
    _kda_fwd_prep[(n, H)](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        bufs["W"], bufs["U"], bufs["KG"], bufs["QG"], bufs["AQK"], bufs["GAM"], bufs["TM"],
        tab.cu, tab.chunk_seq, tab.chunk_off, c0, bufs["W"].shape[1], tab.T, tab.NT,
        H, K, V, scale, float(lower_bound) if lower_bound is not None else 0.0,
        BT=BT, BC=BC, BK=BK, BKS=BK if BK <= FwdConfig.prep_bks else BK // 2, BVP=BVP,
        USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None, HAS_A=A_log is not None,
        HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"], BETA_SIGMOID=flags["beta_sigmoid"],
        IS_VARLEN=tab.varlen, STORE_T=store_t, EXACT_DIAG=flags["exact_diag"], PREC=dot_precision(q.dtype),
        num_warps=FwdConfig.prep_warps, num_stages=FwdConfig.prep_stages,
    )


def launch_state(bufs: dict, o, hs, ht, tab: ChunkTable, c0: int, c1: int, H: int, K: int, V: int,
                 store_o: bool = True) -> None:
    BK = bufs["W"].shape[-1]
    BVP = bufs["U"].shape[-1]
    BV = min(FwdConfig.state_bv, BVP)
    _kda_fwd_state[(BVP // BV, tab.N * H)](
        bufs["W"], bufs["U"], bufs["KG"], bufs["QG"], bufs["AQK"], bufs["GAM"],
        o if o is not None else ht, hs if hs is not None else ht, ht,
        tab.cu, tab.chunk_off, c0, c1, bufs["W"].shape[1], tab.NC, tab.T, tab.NT,
        H, K, V, BT=BT, BK=BK, BV=BV, BVP=BVP, STORE_H=hs is not None, STORE_O=store_o,
        IS_VARLEN=tab.varlen, PREC=dot_precision(bufs["W"].dtype),
        num_warps=FwdConfig.state_warps, num_stages=FwdConfig.state_stages,
    )


def kda_fwd(q, k, v, g, beta, A_log, dt_bias, scale: float, initial_state, tab: ChunkTable, lower_bound,
            flags: dict, training: bool):
    """Run the forward. Returns (o [B,T,H,V], ht [N,H,K,V] fp32, saved dict or None).

    ``training``: one window; keep chunk buffers, T and per-chunk states for backward.
    """
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    o = torch.empty(B, Tq, H, V, dtype=q.dtype, device=q.device)
    if initial_state is not None:
        ht = initial_state.detach().to(torch.float32).clone()
    else:
        ht = torch.zeros(tab.N, H, K, V, dtype=torch.float32, device=q.device)
    if tab.NC == 0:
        return o, ht, None
    if training:
        bufs = alloc_chunk_buffers(H, tab.NC, BK, BVP, dt, q.device, store_t=True)
        hs = torch.empty(H, tab.NC, BK, BVP, dtype=dt, device=q.device)
        launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs, tab, 0, tab.NC, scale, lower_bound, flags, True)
        launch_state(bufs, o, hs, ht, tab, 0, tab.NC, H, K, V)
        return o, ht, dict(bufs, HS=hs)
    ncw = max(1, min(tab.NC, FwdConfig.window_bytes // chunk_bytes(H, BK, BVP, dt)))
    bufs = alloc_chunk_buffers(H, ncw, BK, BVP, dt, q.device, store_t=False)
    for c0 in range(0, tab.NC, ncw):
        n = min(ncw, tab.NC - c0)
        launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs, tab, c0, n, scale, lower_bound, flags, False)
        launch_state(bufs, o, None, ht, tab, c0, c0 + n, H, K, V)
    return o, ht, None
