"""Intra-chunk KDA backward as two light kernels (``BwdConfig.intra_split``): fla's shape, our own code.

The fused ``_kda_bwd_intra`` walks a whole chunk per program and keeps every sub-block's accumulators live
(255 registers, spills, ~490 barriers per program). Here the WY kernel also stores the gate cumsum restarted at every
16-row sub-block, s (fp32, log2 units), and the per-row 1/‖q‖, 1/‖k‖, so nothing below recomputes the gate, a cumsum
or a norm; every decay exponent is built from s and the sub-block totals (G_t − c_I = s_t inside block I,
c_I − c_J = Σ_{J≤m<I} s_m,last), never as a difference of two whole-chunk cumsums:

``_kda_bwd_intra_sub`` — one program per (16-row sub-block I, chunk, head); grid axis 0 = chunk·4 + I, so the four
programs of a chunk run side by side and share its q, k, s through L2. K is walked in slices of ``BKS`` columns
(everything except the L2-norm and β reductions is column-local) and, per slice, the blocks J = 0…3 once, with two
[16, BKS] accumulators at a time (c_J = G at the last row of block J − 1, c_0 = 0, as in the forward):

* row side (rows of block I of A_qk and A_kk, column blocks J ≤ I), reference c_I: with kd_J = k̂_J e^{c_I − G_J}
  (≤ 1 for J < I), dq_I = e^{G_I − c_I} ⊙ Σ_J dA_qk[I, J] kd_J and R_I = e^{G_I − c_I} ⊙ Σ_J dL[I, J] kd_J;
  dk (row share) = β R, dβ = Σ_d k̂ ⊙ R.
* column side (columns of block I, row blocks M ≥ I), reference c_{I+1}: dk (column share) =
  e^{c_{I+1} − G_I} ⊙ Σ_M dA_qk[M, I]ᵀ (q̂_M e^{G_M − c_{I+1}}) + dL[M, I]ᵀ (β_M k̂_M e^{G_M − c_{I+1}}),
  every factor ≤ 1 except inside the diagonal block, where the bounded gate keeps it ≤ e^{5·16} (unbounded gates
  take the exact per-element diagonal, ``EXACT_DIAG``).

dG = DG + q̂ ⊙ dq_intra + k̂ ⊙ (dk_row − dk_col) goes back in place into the ``DG`` scratch rows (no other program
touches them), the pre-norm dq, dk into ``DQ`` / ``DK``; after a barrier the full rows go through the L2-norm
backward and dβ through the β-sigmoid backward.

``_kda_bwd_dg`` — one program per (chunk, head, K-slice): the reverse within-chunk cumsum dG → dg, the gate
backward, and the per-chunk partial sums of dA_log and ddt_bias (summed on the host).

``_kda_bwd_wy_kb`` (``BwdConfig.wy_kb``, usable with either intra path) — the WY backward per (chunk, head,
K-block) in ONE pass over V, using dL = −dY V'ᵀ (no dX Wᵀ, no second pass), plus one program per chunk-head for
dv, dL and dA_qk; see its docstring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import _chunk_beta, _chunk_pos, _gate_fwd, _sigmoid, _softplus, maxnreg_kw
from k3.ops.kda.triton.chunk_fwd import state_stages


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
def _tile_t(ptr, I, J, BT: tl.constexpr, BC: tl.constexpr):
    """Tile (I, J) transposed by the addressing (no shuffle)."""
    o_s = tl.arange(0, BC)
    return tl.load(ptr + (I * BC + o_s[None, :]) * BT + J * BC + o_s[:, None]).to(tl.float32)


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
    bf16 (fp32 accumulation; an option only: dt_bias's gradient reached 2.5e-2 with β ≈ 1 and repeated keys);
    otherwise Triton's input_precision (tf32, tf32x3, bf16x3, ieee)."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _intra_block(q, k, beta, RN, GS, DQ, DK, DG, DB, DL, DAQ, dq, dk, dbeta,
                 base, i_h, bos, eos, H, K, I,
                 BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                 L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, EXACT_DIAG: tl.constexpr, PREC: tl.constexpr,
                 STACK: tl.constexpr, DIAG_APART: tl.constexpr = True, PREC_OFF: tl.constexpr = "ieee"):
    """Sub-block I of one chunk: see the module docstring. PREC_OFF: the precision of the off-diagonal blocks'
    products (every decay factor ≤ 1 there; the diagonal block, whose factors reach e^{5·16}, keeps PREC).
    STACK: the two products of a walk step that share an operand run as one MMA with the other operands stacked
    ([dA_qk; dL] rows on the row side, [q̂; βk̂] rows on the column side): half the operand staging rounds.
    Register economy: K is walked in slices of BKS columns (everything but the L2-norm and β reductions is
    column-local), the block walks are run-time loops (one block's loads in flight at a time), addresses are a
    scalar base + 32-bit offsets. With one slice dq, dk finish in registers (their WY shares read from ``DQ``,
    ``DK``, fp32 or 16-bit); with several the pre-norm dq, dk land in their fp32 scratch rows and, after a barrier,
    the full rows go through the L2-norm backward."""
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
    Sb = GS + sk  # within-sub-block gate cumsums s (log2), stored by the WY kernel
    r = I * BC + o_s
    m_t = r < L
    bI = _blk_beta(bb, L, H, I, BC, BETA_SIGMOID)
    # A_qk's diagonal (i = j, decay e^0) adds dA_ii k̂_i to dq_i and dA_ii q̂_i to dk_i, whose shares of dG,
    # q̂ ⊙ dA_ii k̂ and − k̂ ⊙ dA_ii q̂, cancel exactly. Taken through the products they cancel only to rounding of
    # the largest terms in play, which the reverse cumsum then sums over the chunk: with every decay at the bound
    # (where dg itself is small) that was 6e-5 of dg in fp32 (2e-6 without). So the products skip the diagonal and
    # its exact terms go to dq and dk alone (DIAG_APART; ``BwdConfig.intra_qk_diag_apart``).
    dAq = _tile(DAQ + sa, I, I, BT, BC)
    # With several K-slices the exact terms join dq, dk where the full rows are read back for the L2-norm backward:
    # inside the slice loop their [BC]-vector broadcasts cost spills and barriers (0.4 ms of a B=8 T=4096 step at
    # K-slice 64, 4 warps). With one slice (the default: 8 warps, no spills) they are added in registers.
    ONE: tl.constexpr = BKS == BK  # one slice: dq, dk finish in registers (no scratch round trip, no barrier)
    if DIAG_APART:
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
        accq = tl.zeros([BC, BKS], dtype=tl.float32)
        accr = tl.zeros([BC, BKS], dtype=tl.float32)
        acc2 = tl.zeros([2 * BC, BKS], dtype=tl.float32)
        # ---- row side, column blocks J < I, visited I−1 … 0 (reference c_I: kd ≤ 1); run = c_I − c_{J+1}
        run = tl.zeros([BKS], dtype=tl.float32)
        for jj in range(0, I):
            J = I - 1 - jj
            o_j = (J * BC + o_s)[:, None] * BK + o_k[None, :]
            tJ = tl.load(Sb + (J * BC + BC - 1) * BK + o_k)
            kJ = _blk_x(kb, rnk, L, HK, K, J, o_k, BC, L2NORM)
            kd = kJ * tl.exp2((run + tJ)[None, :] - tl.load(Sb + o_j))
            if STACK:
                acc2 = _mm(_tile2(DAQ + sa, DL + sa, I, J, BT, BC), kd, acc2, PREC=PREC_OFF)
            else:
                accq = _mm(_tile(DAQ + sa, I, J, BT, BC), kd, accq, PREC=PREC_OFF)
                accr = _mm(_tile(DL + sa, I, J, BT, BC), kd, accr, PREC=PREC_OFF)
            run += tJ
        # ---- the diagonal block: finish the row side
        o_sk = r[:, None] * BK + o_k[None, :]
        qI = _blk_x(qb, rnq, L, HK, K, I, o_k, BC, L2NORM)
        kI = _blk_x(kb, rnk, L, HK, K, I, o_k, BC, L2NORM)
        sI = tl.load(Sb + o_sk)  # G − c_I
        e = tl.exp2(sI)  # ≤ 1
        if EXACT_DIAG:
            if STACK:
                accq, accr = _unstack(acc2, BC)
            dq_d, r_d, dkc_d = _exact_diag_bwd(dAq, dL, qI, kI, bI, sI)
            dq_a = accq * e + dq_d
            R = accr * e + r_d
            cacc = tl.zeros([BC, BKS], dtype=tl.float32)
        else:
            kd = kI * tl.exp2(-sI)  # ≤ e^{5·16} under the bounded gate
            if STACK:
                o2 = tl.arange(0, 2 * BC) % BC
                t2 = _tile2(DAQ + sa, DL + sa, I, I, BT, BC)
                if DIAG_APART:  # dL's diagonal is zero (strictly lower): one mask for both halves
                    t2 = tl.where(o2[:, None] == o_s[None, :], 0., t2)
                accq, accr = _unstack(_mm(t2, kd, acc2, PREC=PREC), BC)
                dq_a = accq * e
                R = accr * e
                s2 = tl.load(Sb + (I * BC + o2)[:, None] * BK + o_k[None, :])
                x2 = _blk_x2(qb, kb, rnq, rnk, bb, L, H, HK, K, I, o_k, BC, L2NORM, BETA_SIGMOID)
                t2t = _tile2_t(DAQ + sa, DL + sa, I, I, BT, BC)
                if DIAG_APART:
                    t2t = tl.where(o_s[:, None] == o2[None, :], 0., t2t)
                cacc = _mm(t2t, x2 * tl.exp2(s2 - tI[None, :]), PREC=PREC)
            else:
                dq_a = _mm(dAq, kd, accq, PREC=PREC) * e
                R = _mm(dL, kd, accr, PREC=PREC) * e
                up = tl.exp2(sI - tI[None, :])  # ≥ 1, ≤ e^{5·16}: the column side's reference is c_{I+1}
                aqt = _tile_t(DAQ + sa, I, I, BT, BC)
                if DIAG_APART:
                    aqt = tl.where(eye, 0., aqt)
                cacc = _mm(aqt, qI * up, PREC=PREC)
                cacc = _mm(_tile_t(DL + sa, I, I, BT, BC), kI * (bI[:, None] * up), cacc, PREC=PREC)
        dkr = R * bI[:, None]
        db += tl.sum(R * kI, axis=1)
        if ONE:
            b_dq = tl.load(DQ + sk + o_sk).to(tl.float32) + dq_a
            if DIAG_APART:  # the diagonal's exact term (not in dG, see above); dk's below
                b_dq += dd[:, None] * kI
            if L2NORM:  # q̂ = qI here (the slice is the whole row)
                b_dq = tl.load(rnq + r)[:, None] * (b_dq - qI * tl.sum(b_dq * qI, axis=1)[:, None])
            m = m_t[:, None] & (o_k < K)[None, :]
            tl.store(dq + row0 + r[:, None] * HK + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m)
        else:
            tl.store(DQ + sk + o_sk, tl.load(DQ + sk + o_sk) + dq_a)
        dg_part = tl.load(DG + sk + o_sk) + qI * dq_a + kI * dkr
        dk_part = tl.load(DK + sk + o_sk).to(tl.float32) + dkr
        if DIAG_APART and ONE:
            dk_part += dd[:, None] * qI
        fI = tl.exp2(tI[None, :] - sI)  # ≤ 1
        # ---- column side, row blocks M > I (reference c_{I+1}: every factor ≤ 1); run = c_M − c_{I+1}
        run = tl.zeros([BKS], dtype=tl.float32)
        for M in range(I + 1, BT // BC):
            if STACK:
                o_m2 = (M * BC + tl.arange(0, 2 * BC) % BC)[:, None] * BK + o_k[None, :]
                lf2 = tl.exp2(tl.load(Sb + o_m2) + run[None, :])
                x2 = _blk_x2(qb, kb, rnq, rnk, bb, L, H, HK, K, M, o_k, BC, L2NORM, BETA_SIGMOID)
                cacc = _mm(_tile2_t(DAQ + sa, DL + sa, M, I, BT, BC), x2 * lf2, cacc, PREC=PREC_OFF)
            else:
                o_m = (M * BC + o_s)[:, None] * BK + o_k[None, :]
                lf = tl.exp2(tl.load(Sb + o_m) + run[None, :])
                qM = _blk_x(qb, rnq, L, HK, K, M, o_k, BC, L2NORM)
                kM = _blk_x(kb, rnk, L, HK, K, M, o_k, BC, L2NORM)
                bM = _blk_beta(bb, L, H, M, BC, BETA_SIGMOID)
                cacc = _mm(_tile_t(DAQ + sa, M, I, BT, BC), qM * lf, cacc, PREC=PREC_OFF)
                cacc = _mm(_tile_t(DL + sa, M, I, BT, BC), kM * (bM[:, None] * lf), cacc, PREC=PREC_OFF)
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
        if L2NORM or DIAG_APART:
            qI = tl.load(qb + o_x, mask=m, other=0.).to(tl.float32)
            kI = tl.load(kb + o_x, mask=m, other=0.).to(tl.float32)
            if L2NORM:
                rq = tl.load(rnq + r)
                rk = tl.load(rnk + r)
                qI = qI * rq[:, None]
                kI = kI * rk[:, None]
            if DIAG_APART:  # the diagonal's exact terms (see above), into the pre-norm dq, dk
                dd = tl.load(DAQ + sa + r * (BT + 1))  # dA_qk[i, i] (× scale)
                b_dq += dd[:, None] * kI
                b_dk += dd[:, None] * qI
            if L2NORM:
                b_dq = rq[:, None] * (b_dq - qI * tl.sum(b_dq * qI, axis=1)[:, None])
                b_dk = rk[:, None] * (b_dk - kI * tl.sum(b_dk * kI, axis=1)[:, None])
        tl.store(dq + row0 + o_x, b_dq.to(dq.dtype.element_ty), mask=m)
        tl.store(dk + row0 + o_x, b_dk.to(dk.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=['NC', 'T', 'NT', 'H'])
def _kda_bwd_intra_sub(
    q, k, beta, RN, GS,
    DQ, DK, DG, DB, DL, DAQ,
    dq, dk, dbeta,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT_DIAG: tl.constexpr,
    PREC: tl.constexpr, STACK: tl.constexpr, DIAG_APART: tl.constexpr = True, PREC_OFF: tl.constexpr = "ieee",
):
    NB: tl.constexpr = BT // BC
    i_ci = tl.program_id(0)
    i_h = tl.program_id(1)
    i_c = i_ci // NB
    i_i = i_ci % NB
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    # A sub-block made only of padding has q̂ = k̂ = 0: no share, and its DG rows (which may carry γ's share at the
    # chunk's last row) are already right; the dg pass reads them as they are.
    if bos + i_i * BC < eos:
        _intra_block(q, k, beta, RN, GS, DQ, DK, DG, DB, DL, DAQ, dq, dk, dbeta, base, i_h, bos, eos, H, K, i_i,
                     BT, BC, BK, BKS, L2NORM, BETA_SIGMOID, EXACT_DIAG, PREC, STACK, DIAG_APART, PREC_OFF)


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


@triton.jit
def _seg_cumsum(x, BC: tl.constexpr):
    """Cumsum of a [BT, N] tile along rows, restarting at every BC-row sub-block (small magnitudes: the split
    intra backward builds every decay exponent from these and the sub-block totals, never as a difference of
    two whole-chunk cumsums, which at the gate bound reach −460 and lose ~1e-5 absolute)."""
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
def _wy_dy_vn(TM, W, U, HS, DV, base, o_t, o_kf, o_v, BT: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr,
              PREC: tl.constexpr, VN_SAVED: tl.constexpr):
    """One V-block of dY = Tᵀ dV' (fp32) and V' (store dtype): loaded from ``U`` when the forward stored V' there
    (VN_SAVED, ``FwdConfig.store_vn``), else recomputed as U − W S. T and W are re-read per V-block (L1/L2 hits)
    rather than held in registers across the V loop."""
    DT: tl.constexpr = W.dtype.element_ty
    p_tv = (base * BT + o_t[:, None]) * BVP + o_v[None, :]
    b_tt = tl.load(TM + (base * BT + o_t[None, :]) * BT + o_t[:, None])  # Tᵀ by the addressing
    b_dy = tl.dot(b_tt, tl.load(DV + p_tv), input_precision=PREC)
    if VN_SAVED:
        b_vn = tl.load(U + p_tv)
    else:
        b_s = tl.load(HS + (base * BK + o_kf[:, None]) * BVP + o_v[None, :])
        b_w = tl.load(W + (base * BT + o_t[:, None]) * BK + o_kf[None, :])
        b_vn = (tl.load(U + p_tv).to(tl.float32) - tl.dot(b_w, b_s, input_precision=PREC)).to(DT)
    return b_dy, b_vn


@triton.jit
def _wy_dv_dl(v, do, TM, W, U, HS, DV, dv, DL, DAQ, DBP, DYS, VNS, b_b, base, i_h, t, m_t, o_t, o_kf, H,
              V: tl.constexpr, scale, NKW: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              BVP: tl.constexpr, PREC: tl.constexpr, STORE_DYVN: tl.constexpr, VN_SAVED: tl.constexpr):
    """The chunk-head's [BT, BT] outputs dL = −dY V'ᵀ (strictly lower), dA_qk = dO V'ᵀ (lower, × scale), plus
    dv = β dY and dY's share of dβ (partial number NKW). STORE_DYVN: also hand dY, V' (store dtype) to the
    K-block programs of a second launch through ``DYS`` / ``VNS`` ``[H, NC, BT, BVP]``."""
    DT: tl.constexpr = W.dtype.element_ty
    db = tl.zeros([BT], dtype=tl.float32)
    dL = tl.zeros([BT, BT], dtype=tl.float32)
    daq = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, BVP // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (t * H + i_h)[:, None] * V + o_v[None, :]
        b_dy, b_vn = _wy_dy_vn(TM, W, U, HS, DV, base, o_t, o_kf, o_v, BT, BK, BVP, PREC, VN_SAVED)
        if STORE_DYVN:
            p_tv = (base * BT + o_t[:, None]) * BVP + o_v[None, :]
            tl.store(DYS + p_tv, b_dy.to(DT))
            tl.store(VNS + p_tv, b_vn)
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
def _kda_bwd_wy_kb(
    q, k, v, g, beta, A_log, dt_bias, do, RN, GS,
    W, U, QG, TM, HS, DHS, DV,
    dv, DQ, DK, DG, DBP, DL, DAQ, DYS, VNS,
    cu, chunk_seq, chunk_off, NC, T, NT,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BT: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
    STORE_RN: tl.constexpr, STORE_G: tl.constexpr, MODE: tl.constexpr, VN_SAVED: tl.constexpr = False,
    Z_MAJOR: tl.constexpr = False,
):
    """WY backward, grid (chunks · NZ, heads) with NZ = K/BKW + 1 programs per chunk-head (axis 0 = chunk · NZ +
    block, so a chunk-head's programs run side by side and share its dO, dV', V', T through L2; ``Z_MAJOR``: grid
    (chunks, heads, NZ) instead, the layout before session 8), one pass over V-blocks per program.

    With T X = W, T Y = U, V' = U − W S and dY = Tᵀ dV': the [BT, K] outputs are column-local in K,
    dqg = dO Sᵀ, dX = −dY Sᵀ, dkg = V' dS'ᵀ, γ's share Σ_v S ⊙ dS' (programs 0 … K/BKW − 1, one K-block each),
    and the two [BT, BT] outputs need no dX: dL = −Tᵀ (dW Xᵀ + dV' Yᵀ) Tᵀ = −(dX Wᵀ + dY Uᵀ) = −dY (U − W S)ᵀ
    = −dY V'ᵀ and dA_qk = dO V'ᵀ (the last program, with dv). MODE 0: every program recomputes its dY (and V' unless
    the forward stored it) blocks. Two launches instead: MODE 1 (grid z = 1) runs only
    the last program and stores dY, V'; MODE 2 (grid z = K/BKW) runs the K-block programs, which load them.
    dβ comes out as K/BKW + 1 partials (``DBP``)."""
    NKW: tl.constexpr = BK // BKW
    NZ: tl.constexpr = NKW + 1 if MODE == 0 else (1 if MODE == 1 else NKW)
    i_h = tl.program_id(1)
    if Z_MAJOR:
        i_c = tl.program_id(0)
        i_z = tl.program_id(2)
    else:
        i_c = tl.program_id(0) // NZ
        i_z = tl.program_id(0) % NZ
    if MODE == 1:
        i_k = NKW
    else:
        i_k = i_z
    DT: tl.constexpr = W.dtype.element_ty
    bos, eos = _chunk_pos(i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NC + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_kf = tl.arange(0, BK)
    t = bos + o_t
    m_t = t < eos
    b_b = _chunk_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)
    if i_k == NKW:
        _wy_dv_dl(v, do, TM, W, U, HS, DV, dv, DL, DAQ, DBP, DYS, VNS, b_b, base, i_h, t, m_t, o_t, o_kf, H, V,
                  scale, NKW, BT, BK, BV, BVP, PREC, MODE == 1, VN_SAVED)
        if L2NORM:
            if STORE_RN:
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
            if MODE == 2:
                p_tv = (base * BT + o_t[:, None]) * BVP + o_v[None, :]
                b_dy = tl.load(DYS + p_tv).to(tl.float32)
                b_vn = tl.load(VNS + p_tv)
            else:
                b_dy, b_vn = _wy_dy_vn(TM, W, U, HS, DV, base, o_t, o_kf, o_v, BT, BK, BVP, PREC, VN_SAVED)
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
        if STORE_G:
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


def wy_u_operand(saved: dict) -> tuple[torch.Tensor, bool]:
    """What the WY backward kernels read as ``U``: the forward's V' when it stored it (``FwdConfig.store_vn``; the
    kernels then load V' instead of recomputing U − W S, and U is not kept), else U. Returns (tensor, VN_SAVED)."""
    return (saved["VN"], True) if "VN" in saved else (saved["U"], False)


def launch_wy_kb(q, k, v, g, beta, a_log, dtb, do, RN: torch.Tensor, GS: torch.Tensor, saved: dict, DHS, DV,
                 dv, DQ, DK, DG, DL, DAQ, tab, H: int, K: int, V: int, scale: float, lb: float, BT: int, BK: int,
                 BVP: int, prec: str, flag_kw: dict, store_rn: bool, store_g: bool, cfg) -> torch.Tensor:
    """Run ``_kda_bwd_wy_kb``; returns DB [H, NC, BT] (the partials of dβ summed)."""
    NC = tab.NC
    bkw = min(int(cfg.wy_kb_bk), BK)
    nkw = BK // bkw
    DBP = torch.empty(H, NC, nkw + 1, BT, dtype=torch.float32, device=q.device)
    s = saved
    cap = maxnreg_kw(cfg.wy_kb_maxnreg)
    two = bool(cfg.wy_kb_two_pass)
    zmaj = bool(cfg.wy_kb_z_major)
    u_or_vn, vn_saved = wy_u_operand(s)
    if two:  # dY, V' through memory (store dtype): the K-block programs do no T·dV' / W·S products
        DYS, VNS = (torch.empty(H, NC, BT, BVP, dtype=s["W"].dtype, device=q.device) for _ in range(2))
    else:
        DYS = VNS = DV
    for mode, nz in ((1, 1), (2, nkw)) if two else ((0, nkw + 1),):
        grid = (NC, H, nz) if zmaj else (NC * nz, H)
        _kda_bwd_wy_kb[grid](
            q, k, v, g, beta, a_log, dtb, do, RN, GS, s["W"], u_or_vn, s["QG"], s["TM"], s["HS"],
            DHS, DV, dv, DQ, DK, DG, DBP, DL, DAQ, DYS, VNS, tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT,
            H, K, V, scale, lb, BT=BT, BK=BK, BKW=bkw, BV=min(int(cfg.wy_kb_bv), BVP), BVP=BVP, PREC=prec,
            STORE_RN=store_rn, STORE_G=store_g, MODE=mode, VN_SAVED=vn_saved, Z_MAJOR=zmaj, **flag_kw,
            num_warps=cfg.wy_kb_warps, num_stages=state_stages(cfg.wy_kb_stages, s["W"].dtype), **cap)
    return DBP.sum(2)


def launch_intra_split(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, a_log: torch.Tensor,
                       dtb: torch.Tensor, RN: torch.Tensor, GS: torch.Tensor, DQ: torch.Tensor, DK: torch.Tensor,
                       DG: torch.Tensor, DB: torch.Tensor, DL: torch.Tensor, DAQ: torch.Tensor, dq: torch.Tensor,
                       dk: torch.Tensor, dg: torch.Tensor, db: torch.Tensor, tab, H: int, K: int, lb: float, BT: int,
                       BC: int, BK: int, prec: str, flag_kw: dict, exact_diag: bool,
                       cfg, prec_off: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the two kernels on the WY kernel's scratch (``RN [H, NC, 2, BT]`` 1/‖q‖, 1/‖k‖; ``GS``, ``DQ``, ``DK``,
    ``DG [H, NC, BT, BK]``; ``DB [H, NC, BT]``; ``DL``, ``DAQ [H, NC, BT, BT]``, all fp32 except DQ, DK in 16 bits
    under ``chunk_bwd.half_scratch``), writing dq, dk, dg, db. ``prec_off``: the off-diagonal blocks' precision.
    Returns the per-chunk partial sums ``(DAP [H, NC, NKG], DDT [H, NC, BK])`` (fp32; meaningful only with the
    fused gate). ``cfg`` is ``BwdConfig``. DQ, DK, DG are overwritten (DG becomes dG)."""
    NC = tab.NC
    cap = maxnreg_kw(cfg.intra_split_maxnreg)
    _kda_bwd_intra_sub[(NC * (BT // BC), H)](
        q, k, beta, RN, GS, DQ, DK, DG, DB, DL, DAQ, dq, dk, db,
        tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT, H, K, BT=BT, BC=BC, BK=BK,
        BKS=min(int(cfg.intra_split_bk), BK), EXACT_DIAG=exact_diag, PREC=prec, STACK=bool(cfg.intra_split_stack),
        PREC_OFF=prec_off or prec,
        DIAG_APART=bool(cfg.intra_qk_diag_apart),
        L2NORM=flag_kw["L2NORM"], BETA_SIGMOID=flag_kw["BETA_SIGMOID"], IS_VARLEN=flag_kw["IS_VARLEN"],
        num_warps=cfg.intra_split_warps, num_stages=cfg.intra_split_stages, **cap)
    bkg = min(int(cfg.intra_dg_bk), BK)
    nkg = BK // bkg
    f32 = dict(dtype=torch.float32, device=q.device)
    DAP = torch.empty(H, NC, nkg, **f32)
    DDT = torch.empty(H, NC, BK, **f32)
    gate_kw = {n: flag_kw[n] for n in ("USE_GATE", "HAS_LB", "HAS_A", "HAS_DT", "IS_VARLEN")}
    _kda_bwd_dg[(NC, H, nkg)](
        g, a_log, dtb, DG, dg, DAP, DDT, tab.cu, tab.chunk_seq, tab.chunk_off, NC, tab.T, tab.NT, H, K, lb,
        BT=BT, BK=BK, BKG=bkg, **gate_kw, num_warps=cfg.intra_dg_warps)
    return DAP, DDT
