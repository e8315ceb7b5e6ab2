"""The intra-chunk backward: from dL and dA_qk (the WY backward's outputs) back to q, k, g, β, in two kernels.

The WY kernel also stored the gate cumsum restarted at every 16-row block, s (fp32, log2), and the per-row 1/‖q‖,
1/‖k‖, so nothing here recomputes the gate, a cumsum or a norm; every decay exponent is built from s and the block
totals (G_t − c_I = s_t inside block I, c_I − c_J = Σ_{J≤m<I} s_m,last), never as a difference of two whole-chunk
cumsums.

``_kda_bwd_intra`` — one program per (16-row block I, chunk, head); grid axis 0 = chunk·4 + I, so the four programs
of a chunk run side by side and share its q, k, s through L2. K is walked in slices of ``BKS`` columns (all of K
up to 128; everything except the L2-norm and β reductions is column-local) and, per slice, the blocks J = 0…3
once, the two products of a step that share an operand run as one MMA on stacked operands (c_J = G at the last
row of block J − 1, c_0 = 0, as in the forward):

* row side (rows of block I of A_qk and A_kk, column blocks J ≤ I), reference c_I: with kd_J = k̂_J e^{c_I − G_J}
  (≤ 1 for J < I), dq_I = e^{G_I − c_I} ⊙ Σ_J dA_qk[I, J] kd_J and R_I = e^{G_I − c_I} ⊙ Σ_J dL[I, J] kd_J;
  dk (row share) = β R, dβ = Σ_d k̂ ⊙ R.
* column side (columns of block I, row blocks M ≥ I), reference c_{I+1}: dk (column share) =
  e^{c_{I+1} − G_I} ⊙ Σ_M dA_qk[M, I]ᵀ (q̂_M e^{G_M − c_{I+1}}) + dL[M, I]ᵀ (β_M k̂_M e^{G_M − c_{I+1}}),
  every factor ≤ 1 except inside the diagonal block, where the bounded gate keeps it ≤ e^{5·16} (unbounded gates
  take the exact per-element diagonal, ``EXACT_DIAG``).

dG = DG + q̂ ⊙ dq_intra + k̂ ⊙ (dk_row − dk_col) goes back in place into the ``DG`` scratch rows (no other program
touches them); dq, dk go through the L2-norm backward and dβ through the β-sigmoid backward.

``_kda_bwd_dg`` — one program per (chunk, head, K-slice): the reverse within-chunk cumsum dG → dg, the gate
backward, and the per-chunk partial sums of dA_log and ddt_bias (summed on the host).

Precision for half inputs: tf32 on the diagonal block (A_qk's diagonal kept out of the products, see
``_intra_block``); on the off-diagonal blocks, whose decay factors are all ≤ 1, one bf16 pass for bf16 inputs and
tf32 for fp16 ones (fp16's extra mantissa bits are what fla's fp16 tolerances measure); fp32 inputs: 'ieee'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import _chunk_pos, _sigmoid, _softplus

# all of K (≤ 128) in one slice at 8 warps, capped at 128 registers: dq, dk finish in registers (no scratch round
# trip); the dG → dg pass in K-slices of 32 at 2 warps
_INTRA_BK = 128
_INTRA_MAXNREG = 128
_DG_BK = 32



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


@triton.jit
def _tile(ptr, I, J, BT: tl.constexpr, BC: tl.constexpr):
    """Tile (I, J) of a [BT, BT] chunk matrix at ``ptr`` (I, J may be run-time values)."""
    o_s = tl.arange(0, BC)
    return tl.load(ptr + (I * BC + o_s[:, None]) * BT + J * BC + o_s[None, :]).to(tl.float32)


@triton.jit
def _blk_x(xb, rn, L, HK, K, J, o_k, BC: tl.constexpr, L2NORM: tl.constexpr):
    """Chunk rows [J·BC, J·BC + BC), columns o_k, of q or k, L2-normalized with the stored per-row 1/‖·‖ ``rn``
    (fp32 [BC, len(o_k)], 0 on padding)."""
    r = J * BC + tl.arange(0, BC)
    m = (r < L)[:, None] & (o_k < K)[None, :]
    x = tl.load(xb + r[:, None] * HK + o_k[None, :], mask=m, other=0.).to(tl.float32)
    if L2NORM:
        x = x * tl.load(rn + r)[:, None]
    return x


@triton.jit
def _blk_beta(bb, L, H, J, BC: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    r = J * BC + tl.arange(0, BC)
    m_t = r < L
    b_b = tl.load(bb + r * H, mask=m_t, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b_b = _sigmoid(b_b)
    return tl.where(m_t, b_b, 0.)


@triton.jit
def _tile2(A, B, I, J, BT: tl.constexpr, BC: tl.constexpr):
    """Tiles (I, J) of two [BT, BT] chunk matrices stacked along rows: [A_IJ; B_IJ], [2·BC, BC] (one MMA operand
    for two products that share the other operand)."""
    o2 = tl.arange(0, 2 * BC)
    off = (I * BC + (o2 % BC)[:, None]) * BT + J * BC + tl.arange(0, BC)[None, :]
    return tl.load(tl.where((o2 < BC)[:, None], A + off, B + off)).to(tl.float32)


@triton.jit
def _tile2_t(A, B, M, I, BT: tl.constexpr, BC: tl.constexpr):
    """[A_MIᵀ | B_MIᵀ], [BC, 2·BC], transposed by the addressing."""
    o2 = tl.arange(0, 2 * BC)
    off = (M * BC + (o2 % BC)[None, :]) * BT + I * BC + tl.arange(0, BC)[:, None]
    return tl.load(tl.where((o2 < BC)[None, :], A + off, B + off)).to(tl.float32)


@triton.jit
def _blk_x2(qb, kb, rnq, rnk, bb, L, H, HK, K, M, o_k, BC: tl.constexpr, L2NORM: tl.constexpr,
            BETA_SIGMOID: tl.constexpr):
    """Rows of block M stacked: [q̂_M; β_M k̂_M], [2·BC, len(o_k)] fp32 (0 on padding)."""
    o2 = tl.arange(0, 2 * BC)
    rr = M * BC + o2 % BC
    isq = o2 < BC
    m_r = rr < L
    off = rr[:, None] * HK + o_k[None, :]
    x = tl.load(tl.where(isq[:, None], qb + off, kb + off), mask=m_r[:, None] & (o_k < K)[None, :],
                other=0.).to(tl.float32)
    if L2NORM:
        x = x * tl.load(tl.where(isq, rnq + rr, rnk + rr))[:, None]
    b = tl.load(bb + rr * H, mask=m_r, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b = _sigmoid(b)
    return x * tl.where(isq, 1.0, tl.where(m_r, b, 0.))[:, None]


@triton.jit
def _unstack(x, BC: tl.constexpr):
    """[2·BC, N] → (rows [0, BC), rows [BC, 2·BC))."""
    N: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [2, BC, N]), [1, 2, 0]))


@triton.jit
def _exact_diag_bwd(dAq, dL, b_q, b_k, b_b, G):
    """Diagonal sub-block, exact per element (unbounded gates): only exponents ≤ 0. Returns the row-side dq, the
    row-side R = Σ_j dL_ij k_j e^{G_i − G_j} (no β), the column-side dk."""
    o_s = tl.arange(0, b_q.shape[0])
    keep = o_s[:, None] >= o_s[None, :]
    E = tl.exp2(tl.where(keep[:, :, None], G[:, None, :] - G[None, :, :], float("-inf")))
    kE = b_k[None, :, :] * E  # [i, j, d] = k_jd e^{G_id − G_jd}
    dq = tl.sum(dAq[:, :, None] * kE, axis=1)
    r = tl.sum(dL[:, :, None] * kE, axis=1)
    dkc = tl.sum((dAq[:, :, None] * b_q[:, None, :] + (dL * b_b[:, None])[:, :, None] * b_k[:, None, :]) * E,
                 axis=0)
    return dq, r, dkc


@triton.jit
def _mm(a, b, acc=None, PREC: tl.constexpr = "ieee"):
    """tl.dot of fp32 operands at the intra backward's precision. "bf16": one bf16 MMA on operands rounded to
    bf16 (fp32 accumulation; the off-diagonal blocks only: on the diagonal block dt_bias's gradient reached 2.5e-2
    with β ≈ 1 and repeated keys); otherwise Triton's input_precision (tf32, tf32x3, ieee)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _intra_block(q, k, beta, RN, GS, DQ, DK, DG, DB, DL, DAQ, dq, dk, dbeta,
                 base, i_h, bos, eos, H, K, I,
                 BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                 L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, EXACT_DIAG: tl.constexpr, PREC: tl.constexpr,
                 PREC_OFF: tl.constexpr):
    """Block I of one chunk: see the module docstring. PREC_OFF: the precision of the off-diagonal blocks' products
    (every decay factor ≤ 1 there; the diagonal block, whose factors reach e^{5·16}, keeps PREC). Register economy:
    K is walked in slices of BKS columns, the block walks are run-time loops (one block's loads in flight at a
    time), addresses are a scalar base + 32-bit offsets. With one slice dq, dk finish in registers (their WY shares
    read from ``DQ``, ``DK``, fp32 or 16-bit); with several (K > 128) the pre-norm dq, dk land in their fp32
    scratch rows and, after a barrier, the full rows go through the L2-norm backward."""
    o_s = tl.arange(0, BC)
    HK = H * K
    L = tl.minimum(eos - bos, BT).to(tl.int32)  # valid rows of this chunk
    row0 = bos * HK + i_h * K  # int64 element offset of the chunk's first row of this head
    qb = q + row0
    kb = k + row0
    bb = beta + bos * H + i_h
    rnq = RN + base * (2 * BT)  # per-row 1/‖q‖, then 1/‖k‖
    rnk = rnq + BT
    sk = base * (BT * BK)  # chunk scratch rows [BT, BK]
    sa = base * (BT * BT)  # chunk matrices [BT, BT]
    Sb = GS + sk  # within-block gate cumsums s (log2), stored by the WY kernel
    r = I * BC + o_s
    m_t = r < L
    bI = _blk_beta(bb, L, H, I, BC, BETA_SIGMOID)
    # A_qk's diagonal (i = j, decay e^0) adds dA_ii k̂_i to dq_i and dA_ii q̂_i to dk_i, whose shares of dG,
    # q̂ ⊙ dA_ii k̂ and − k̂ ⊙ dA_ii q̂, cancel exactly. Taken through the products they cancel only to rounding of
    # the largest terms in play, which the reverse cumsum then sums over the chunk: with every decay at the bound
    # (where dg itself is small) that was 6e-5 of dg in fp32 (2e-6 without). So the products skip the diagonal and
    # its exact terms go to dq and dk alone.
    dAq = _tile(DAQ + sa, I, I, BT, BC)
    # With several K-slices the exact terms join dq, dk where the full rows are read back for the L2-norm backward
    # (inside the slice loop their [BC]-vector broadcasts cost spills and barriers); with one they are added in
    # registers.
    ONE: tl.constexpr = BKS == BK  # one slice: dq, dk finish in registers (no scratch round trip, no barrier)
    eye = o_s[:, None] == o_s[None, :]
    dAq = tl.where(eye, 0., dAq)
    if ONE:
        dd = tl.load(DAQ + sa + r * (BT + 1))  # dA_qk[i, i] (× scale), read as a vector
    dL = _tile(DL + sa, I, I, BT, BC)
    db = tl.load(DB + base * BT + r)
    for ks in range(0, BK // BKS):
        o_k = ks * BKS + tl.arange(0, BKS)
        # G_t − c_I = s_t inside block I, and c_I − c_J = Σ_{J≤m<I} tot_m (tot_m = s at block m's last row):
        # every exponent is built from small numbers
        tI = tl.load(Sb + (I * BC + BC - 1) * BK + o_k)  # tot_I = c_{I+1} − c_I
        acc2 = tl.zeros([2 * BC, BKS], dtype=tl.float32)
        # ---- row side, column blocks J < I, visited I−1 … 0 (reference c_I: kd ≤ 1); run = c_I − c_{J+1}
        run = tl.zeros([BKS], dtype=tl.float32)
        for jj in range(0, I):
            J = I - 1 - jj
            o_j = (J * BC + o_s)[:, None] * BK + o_k[None, :]
            tJ = tl.load(Sb + (J * BC + BC - 1) * BK + o_k)
            kJ = _blk_x(kb, rnk, L, HK, K, J, o_k, BC, L2NORM)
            kd = kJ * tl.exp2((run + tJ)[None, :] - tl.load(Sb + o_j))
            acc2 = _mm(_tile2(DAQ + sa, DL + sa, I, J, BT, BC), kd, acc2, PREC=PREC_OFF)
            run += tJ
        # ---- the diagonal block: finish the row side
        o_sk = r[:, None] * BK + o_k[None, :]
        qI = _blk_x(qb, rnq, L, HK, K, I, o_k, BC, L2NORM)
        kI = _blk_x(kb, rnk, L, HK, K, I, o_k, BC, L2NORM)
        sI = tl.load(Sb + o_sk)  # G − c_I
        e = tl.exp2(sI)  # ≤ 1
        if EXACT_DIAG:
            accq, accr = _unstack(acc2, BC)
            dq_d, r_d, dkc_d = _exact_diag_bwd(dAq, dL, qI, kI, bI, sI)
            dq_a = accq * e + dq_d
            R = accr * e + r_d
            cacc = tl.zeros([BC, BKS], dtype=tl.float32)
        else:
            kd = kI * tl.exp2(-sI)  # ≤ e^{5·16} under the bounded gate
            o2 = tl.arange(0, 2 * BC) % BC
            t2 = _tile2(DAQ + sa, DL + sa, I, I, BT, BC)
            t2 = tl.where(o2[:, None] == o_s[None, :], 0., t2)  # dL's diagonal is zero: one mask for both halves
            accq, accr = _unstack(_mm(t2, kd, acc2, PREC=PREC), BC)
            dq_a = accq * e
            R = accr * e
            s2 = tl.load(Sb + (I * BC + o2)[:, None] * BK + o_k[None, :])
            x2 = _blk_x2(qb, kb, rnq, rnk, bb, L, H, HK, K, I, o_k, BC, L2NORM, BETA_SIGMOID)
            t2t = _tile2_t(DAQ + sa, DL + sa, I, I, BT, BC)
            t2t = tl.where(o_s[:, None] == o2[None, :], 0., t2t)
            cacc = _mm(t2t, x2 * tl.exp2(s2 - tI[None, :]), PREC=PREC)
        dkr = R * bI[:, None]
        db += tl.sum(R * kI, axis=1)
        if ONE:
            b_dq = tl.load(DQ + sk + o_sk).to(tl.float32) + dq_a
            b_dq += dd[:, None] * kI  # the diagonal's exact term (not in dG, see above); dk's below
            if L2NORM:  # q̂ = qI here (the slice is the whole row)
                b_dq = tl.load(rnq + r)[:, None] * (b_dq - qI * tl.sum(b_dq * qI, axis=1)[:, None])
            m = m_t[:, None] & (o_k < K)[None, :]
            tl.store(dq + row0 + r[:, None] * HK + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m)
        else:
            tl.store(DQ + sk + o_sk, tl.load(DQ + sk + o_sk) + dq_a)
        dg_part = tl.load(DG + sk + o_sk) + qI * dq_a + kI * dkr
        dk_part = tl.load(DK + sk + o_sk).to(tl.float32) + dkr
        if ONE:
            dk_part += dd[:, None] * qI
        fI = tl.exp2(tI[None, :] - sI)  # ≤ 1
        # ---- column side, row blocks M > I (reference c_{I+1}: every factor ≤ 1); run = c_M − c_{I+1}
        run = tl.zeros([BKS], dtype=tl.float32)
        for M in range(I + 1, BT // BC):
            o_m2 = (M * BC + tl.arange(0, 2 * BC) % BC)[:, None] * BK + o_k[None, :]
            lf2 = tl.exp2(tl.load(Sb + o_m2) + run[None, :])
            x2 = _blk_x2(qb, kb, rnq, rnk, bb, L, H, HK, K, M, o_k, BC, L2NORM, BETA_SIGMOID)
            cacc = _mm(_tile2_t(DAQ + sa, DL + sa, M, I, BT, BC), x2 * lf2, cacc, PREC=PREC_OFF)
            run += tl.load(Sb + (M * BC + BC - 1) * BK + o_k)
        dkc = cacc * fI
        if EXACT_DIAG:
            dkc += dkc_d
        if ONE:
            b_dk = dk_part + dkc
            if L2NORM:
                b_dk = tl.load(rnk + r)[:, None] * (b_dk - kI * tl.sum(b_dk * kI, axis=1)[:, None])
            tl.store(dk + row0 + r[:, None] * HK + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m)
        else:
            tl.store(DK + sk + o_sk, dk_part + dkc)
        tl.store(DG + sk + o_sk, dg_part - kI * dkc)
    # ---- full rows: L2-norm backward of dq, dk (several slices); β (sigmoid) backward
    if BETA_SIGMOID:
        b_r = tl.load(bb + r * H, mask=m_t, other=0.).to(tl.float32)
        db = db * _sigmoid(b_r) * _sigmoid(-b_r)
    tl.store(dbeta + bos * H + i_h + r * H, db.to(dbeta.dtype.element_ty), mask=m_t)
    if BKS < BK:
        tl.debug_barrier()  # the scratch rows were written in K-slices, possibly by other threads
        o_k = tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        o_x = r[:, None] * HK + o_k[None, :]
        o_sk = r[:, None] * BK + o_k[None, :]
        b_dq = tl.load(DQ + sk + o_sk)
        b_dk = tl.load(DK + sk + o_sk)
        qI = tl.load(qb + o_x, mask=m, other=0.).to(tl.float32)
        kI = tl.load(kb + o_x, mask=m, other=0.).to(tl.float32)
        if L2NORM:
            rq = tl.load(rnq + r)
            rk = tl.load(rnk + r)
            qI = qI * rq[:, None]
            kI = kI * rk[:, None]
        dd = tl.load(DAQ + sa + r * (BT + 1))  # dA_qk[i, i] (× scale): the diagonal's exact terms (see above)
        b_dq += dd[:, None] * kI
        b_dk += dd[:, None] * qI
        if L2NORM:
            b_dq = rq[:, None] * (b_dq - qI * tl.sum(b_dq * qI, axis=1)[:, None])
            b_dk = rk[:, None] * (b_dk - kI * tl.sum(b_dk * kI, axis=1)[:, None])
        tl.store(dq + row0 + o_x, b_dq.to(dq.dtype.element_ty), mask=m)
        tl.store(dk + row0 + o_x, b_dk.to(dk.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_intra(
    q, k, beta, RN, GS,
    DQ, DK, DG, DB, DL, DAQ,
    dq, dk, dbeta,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT_DIAG: tl.constexpr,
    PREC: tl.constexpr, PREC_OFF: tl.constexpr,
):
    NB: tl.constexpr = BT // BC
    i_ci = tl.program_id(0)
    i_h = tl.program_id(1)
    i_c = i_ci // NB
    i_i = i_ci % NB
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    # A block made only of padding has q̂ = k̂ = 0: no share, and its DG rows (which may carry γ's share at the
    # chunk's last row) are already right; the dg pass reads them as they are.
    if bos + i_i * BC < eos:
        _intra_block(q, k, beta, RN, GS, DQ, DK, DG, DB, DL, DAQ, dq, dk, dbeta, base, i_h, bos, eos, H, K, i_i,
                     BT, BC, BK, BKS, L2NORM, BETA_SIGMOID, EXACT_DIAG, PREC, PREC_OFF)


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_dg(
    g, A_log, dt_bias, DG, dg, DA, DDT,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr, lb,
    BT: tl.constexpr, BK: tl.constexpr, BKG: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """dg = gate backward of the reverse within-chunk cumsum of dG, for one K-slice of one chunk-head."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_k = tl.program_id(2)
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = i_k * BKG + tl.arange(0, BKG)
    m_k = o_k < K
    t = bos + o_t
    m = (t < eos)[:, None] & m_k[None, :]
    dG = tl.load(DG + (base * BT + o_t[:, None]) * BK + o_k[None, :])
    dgt = tl.cumsum(dG, axis=0, reverse=True)
    p = t[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_f = tl.load(g + p, mask=m, other=0.).to(tl.float32)
    df, dA = _gate_bwd(dgt, b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    df = tl.where(m, df, 0.)
    tl.store(dg + p, df.to(dg.dtype.element_ty), mask=m)
    if USE_GATE:
        tl.store(DDT + base * BK + o_k, tl.sum(df, axis=0))
        tl.store(DA + base * tl.num_programs(2) + i_k, tl.sum(tl.sum(tl.where(m, dA, 0.), axis=1), axis=0))


def launch_intra(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, a_log: torch.Tensor,
                 dtb: torch.Tensor, RN: torch.Tensor, GS: torch.Tensor, DQ: torch.Tensor, DK: torch.Tensor,
                 DG: torch.Tensor, DB: torch.Tensor, DL: torch.Tensor, DAQ: torch.Tensor, dq: torch.Tensor,
                 dk: torch.Tensor, dg: torch.Tensor, db: torch.Tensor, tab, H: int, K: int, lb: float, BT: int,
                 BC: int, BK: int, prec: str, prec_off: str, flag_kw: dict, exact_diag: bool,
                 intra_bk: int = _INTRA_BK) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the two kernels on the WY kernel's scratch (``RN [H, NC, 2, BT]`` 1/‖q‖, 1/‖k‖; ``GS``, ``DQ``, ``DK``,
    ``DG [H, NC, BT, BK]``; ``DB [H, NC, BT]``; ``DL``, ``DAQ [H, NC, BT, BT]``, all fp32 except DQ, DK in 16 bits
    when the caller chose so), writing dq, dk, dg, db. ``intra_bk``: the K-slice (128 = all of K up to 128).
    Returns the per-chunk partial sums ``(DAP [H, NC, NKG], DDT [H, NC, BK])`` (fp32; meaningful only with the
    fused gate). DQ, DK, DG are overwritten (DG becomes dG)."""
    NC = tab.NC
    _kda_bwd_intra[(NC * (BT // BC), H)](
        q, k, beta, RN, GS, DQ, DK, DG, DB, DL, DAQ, dq, dk, db,
        tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT, H, K, BT=BT, BC=BC, BK=BK,
        BKS=min(intra_bk, BK), L2NORM=flag_kw["L2NORM"], BETA_SIGMOID=flag_kw["BETA_SIGMOID"],
        IS_VARLEN=flag_kw["IS_VARLEN"], EXACT_DIAG=exact_diag, PREC=prec, PREC_OFF=prec_off,
        num_warps=8, num_stages=1, maxnreg=_INTRA_MAXNREG)
    bkg = min(_DG_BK, BK)
    nkg = BK // bkg
    f32 = dict(dtype=torch.float32, device=q.device)
    DAP = torch.empty(H, NC, nkg, **f32)
    DDT = torch.empty(H, NC, BK, **f32)
    gate_kw = {n: flag_kw[n] for n in ("USE_GATE", "HAS_LB", "HAS_A", "HAS_DT", "IS_VARLEN")}
    _kda_bwd_dg[(NC, H, nkg)](
        g, a_log, dtb, DG, dg, DAP, DDT, tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT, H, K, lb,
        BT=BT, BK=BK, BKG=bkg, **gate_kw, num_warps=2)
    return DAP, DDT
