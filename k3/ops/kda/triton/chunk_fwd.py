"""Chunked KDA forward (SPEC §2, chunk BT = 64 in 16-row sub-blocks): two kernels.

``_kda_fwd_prep`` — chunk-parallel, grid (chunks, H). Fuses gate activation + cumsum (fp32, log2 units), L2 norm,
β sigmoid, the intra-chunk matrices A_kk / A_qk, T = (I + A_kk)^{-1}, and writes per chunk
W = T(β K e^G), U = T(β V), kg = K e^{G_C − G}, qg = scale · Q e^G, A_qk, γ = e^{G_C} (and T when training).

``_kda_fwd_state`` — the sequential pass, grid (V-blocks, N·H), fp32 state in registers:
V' = U − W S;  O = qg S + A_qk V';  S ← Diag(γ) S + kgᵀ V'.

``FwdConfig.prep_mode = "rows"`` (the default since session 3: faster on an H200 and equal within rounding)
replaces the prep by ``chunk_prep``'s three kernels (a block pre-pass; A by 16-row blocks, one light program per row
block; then T, W, U, kg, γ per chunk) writing the same buffers; ``"v3"`` keeps the single fused prep below.

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

from typing import Any, Callable

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
    _eye,
    _l2norm,
    _merge_T,
    _rows_gate,
    _sigmoid,
    _state_program,
    dot_precision,
    next_pow2,
    store_dtype,
)
from k3.ops.kda.triton.chunk_prep import launch_prep_rows


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
def _sub_qkb(q, k, beta, i_h, bos, eos, H, K, I: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
             L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Rows [I·BC, I·BC + BC): L2-normalized q, k [BC, BK] fp32 and β [BC] (zero on padding)."""
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    t = bos + I * BC + o_s
    m_t = t < eos
    m = m_t[:, None] & (o_k < K)[None, :]
    p = t[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_k, _ = _l2norm(tl.load(k + p, mask=m, other=0.).to(tl.float32), L2NORM)
    b_q, _ = _l2norm(tl.load(q + p, mask=m, other=0.).to(tl.float32), L2NORM)
    b_b = tl.load(beta + t * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b_b = _sigmoid(b_b)
    return b_q, b_k, tl.where(m_t, b_b, 0.)


@triton.jit
def _sub_state(q, k, g, beta, A_log, dt_bias, i_h, bos, eos, H, K, lb, c, I: tl.constexpr,
               BC: tl.constexpr, BK: tl.constexpr,
               USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
               L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """One sub-block: normalized q, k, β, the gate cumsum G = c + cumsum(g) (log2) and the next carry."""
    b_g = _rows_gate(g, A_log, dt_bias, i_h, bos + I * BC, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A,
                     HAS_DT)
    b_q, b_k, b_b = _sub_qkb(q, k, beta, i_h, bos, eos, H, K, I, BC, BK, L2NORM, BETA_SIGMOID)
    G = c[None, :] + tl.cumsum(b_g, axis=0)
    return b_q, b_k, b_b, G, c + tl.sum(b_g, axis=0)


@triton.jit
def _opnd(x, AB_BF16: tl.constexpr):
    """Tensor-core operand of the A-block products: bf16 (fp32 accumulation) when AB_BF16, else fp32 (tf32/ieee).
    bf16 keeps fp32's exponent range, so the diagonal block's right factor (≤ e^{5·16} ≈ 6e34) stays finite."""
    if AB_BF16:
        return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _diag_A(b_q, b_k, G, c, EXACT_DIAG: tl.constexpr, PREC: tl.constexpr, AB_BF16: tl.constexpr = False):
    """Diagonal sub-block of A_qk-like (j ≤ i) and A_kk-like (j < i, without β). Reference = the last row of the
    previous sub-block (a past row): (x_i e^{G_i − c}) · (k_j e^{c − G_j}), the right factor ≤ e^{5·16}."""
    o_s = tl.arange(0, b_q.shape[0])
    if EXACT_DIAG:
        aq = _exact_diag(b_q, b_k, G, False)
        ak = _exact_diag(b_k, b_k, G, True)
    else:
        e = tl.exp2(G - c[None, :])
        kd = _opnd(tl.trans(b_k * tl.exp2(c[None, :] - G)), AB_BF16)
        aq = tl.dot(_opnd(b_q * e, AB_BF16), kd, input_precision=PREC)
        ak = tl.dot(_opnd(b_k * e, AB_BF16), kd, input_precision=PREC)
    aq = tl.where(o_s[:, None] >= o_s[None, :], aq, 0.)
    ak = tl.where(o_s[:, None] > o_s[None, :], ak, 0.)
    return aq, ak


@triton.jit
def _off_A(xl, kdJ, cI, cJ1, PREC: tl.constexpr, AB_BF16: tl.constexpr = False):
    """Off-diagonal sub-block (row block I > column block J), reference = last row of block J (carry c_{J+1});
    both factors ≤ 1 for any gate: (x_i e^{G_i − c_I}) e^{c_I − c_{J+1}} · (k_j e^{c_{J+1} − G_j})."""
    return tl.dot(_opnd(xl * tl.exp2(cI - cJ1)[None, :], AB_BF16), _opnd(tl.trans(kdJ), AB_BF16),
                  input_precision=PREC)


@triton.jit
def _store_tile(ptr, base, x, I: tl.constexpr, J: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Store a [BC, BC] tile at sub-block (I, J) of the [BT, BT] chunk matrix number ``base``."""
    o_s = tl.arange(0, BC)
    tl.store(ptr + (base * BT + I * BC + o_s[:, None]) * BT + J * BC + o_s[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _load_tile(ptr, base, I: tl.constexpr, J: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    o_s = tl.arange(0, BC)
    return tl.load(ptr + (base * BT + I * BC + o_s[:, None]) * BT + J * BC + o_s[None, :]).to(tl.float32)


@triton.jit
def _store_rows(ptr, base, x, I: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, N: tl.constexpr):
    """Store [BC, N] rows at sub-block I of the [BT, N] chunk tile number ``base``."""
    o_s = tl.arange(0, BC)
    o_n = tl.arange(0, N)
    tl.store(ptr + (base * BT + I * BC + o_s[:, None]) * N + o_n[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _load_rows(ptr, base, I: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, N: tl.constexpr):
    o_s = tl.arange(0, BC)
    o_n = tl.arange(0, N)
    return tl.load(ptr + (base * BT + I * BC + o_s[:, None]) * N + o_n[None, :])


@triton.jit
def _inv16(L):
    """(I + L)^{-1} of a strictly lower-triangular 16×16 block by forward substitution (fp32)."""
    R: tl.constexpr = L.shape[0]
    o_s = tl.arange(0, R)
    Tm = _eye(R)
    for s in range(1, R):
        row = tl.sum(tl.where((o_s == s)[:, None], L, 0.), axis=0)  # L[s, :]
        new = tl.where(o_s == s, 1.0, 0.0) - tl.sum(row[:, None] * Tm, axis=0)
        Tm = tl.where((o_s == s)[:, None], new[None, :], Tm)
    return Tm


@triton.jit
def _inv16x4(LD, base, BC: tl.constexpr):
    """(I + L_I)^{-1} of the four strictly lower-triangular diagonal blocks, whose rows were stored to the fp32
    scratch ``LD[base]`` ([4, BC, BC]) before a barrier. Same forward substitution as ``_inv16`` but built
    transposed, column s of Dᵀ = e_s − Dᵀ L[s, :]ᵀ: the row L[s, :] comes straight from memory (an L1 hit) instead
    of a cross-warp row extraction, and the remaining reduction runs along a tile row, inside one warp — no
    barrier per step. The four blocks share each step (independent chains, more instructions in flight)."""
    o_s = tl.arange(0, BC)
    p = LD + base * (4 * BC * BC) + o_s
    eye = _eye(BC)
    U0 = eye
    U1 = eye
    U2 = eye
    U3 = eye
    for s in tl.static_range(1, BC):
        e_s = tl.where(o_s == s, 1.0, 0.0)
        sel = (o_s == s)[None, :]
        r0 = tl.load(p + s * BC)
        r1 = tl.load(p + (BC * BC + s * BC))
        r2 = tl.load(p + (2 * BC * BC + s * BC))
        r3 = tl.load(p + (3 * BC * BC + s * BC))
        U0 = tl.where(sel, (e_s - tl.sum(U0 * r0[None, :], axis=1))[:, None], U0)
        U1 = tl.where(sel, (e_s - tl.sum(U1 * r1[None, :], axis=1))[:, None], U1)
        U2 = tl.where(sel, (e_s - tl.sum(U2 * r2[None, :], axis=1))[:, None], U2)
        U3 = tl.where(sel, (e_s - tl.sum(U3 * r3[None, :], axis=1))[:, None], U3)
    return tl.trans(U0), tl.trans(U1), tl.trans(U2), tl.trans(U3)


@triton.jit
def _store_L(LD, base, x, I: tl.constexpr, BC: tl.constexpr):
    o_s = tl.arange(0, BC)
    tl.store(LD + (base * 4 + I) * (BC * BC) + o_s[:, None] * BC + o_s[None, :], x)


@triton.jit
def _sub_v(v, i_h, bos, eos, H, V, b_b, I: tl.constexpr, BC: tl.constexpr, BVP: tl.constexpr, DT: tl.constexpr):
    """β · V for rows [I·BC, I·BC + BC), in the store dtype."""
    o_s = tl.arange(0, BC)
    o_v = tl.arange(0, BVP)
    t = bos + I * BC + o_s
    b_v = tl.load(v + (t * H + i_h)[:, None] * V + o_v[None, :], mask=(t < eos)[:, None] & (o_v < V)[None, :],
                  other=0.).to(tl.float32)
    return (b_v * b_b[:, None]).to(DT)


@triton.jit
def _tx(t0, t1, t2, t3, x0, x1, x2, x3, PREC: tl.constexpr):
    """Σ_J T_IJ X_J for one row block (t_J = T_IJ, zero tiles passed as None-equivalents by the caller)."""
    return (tl.dot(t0, x0, input_precision=PREC) + tl.dot(t1, x1, input_precision=PREC)
            + tl.dot(t2, x2, input_precision=PREC) + tl.dot(t3, x3, input_precision=PREC))


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _kda_fwd_prep(
    q, k, v, g, beta, A_log, dt_bias,
    W, U, KG, QG, AQK, GAM, TM, LD,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_T: tl.constexpr,
    EXACT_DIAG: tl.constexpr, PREC: tl.constexpr, AB_BF16: tl.constexpr, INV_SCRATCH: tl.constexpr,
    STORE_WU: tl.constexpr,
):
    # Explicit 16-row sub-blocks (BT = 4·BC): every tile is loaded straight from memory, nothing is sliced out of
    # register tensors. Sub-block I has carry c_I = G at the last row of block I−1 (c_0 = 0).
    DT: tl.constexpr = W.dtype.element_ty
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NCw + i_c).to(tl.int64)
    o_k = tl.arange(0, BK)
    c_0 = tl.zeros([BK], dtype=tl.float32)

    # ---- sub-block 0
    q0, k0, b0, G0, c_1 = _sub_state(q, k, g, beta, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_0, 0, BC, BK,
                                     USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM, BETA_SIGMOID)
    e = tl.exp2(G0)
    _store_rows(QG, base, q0 * e * scale, 0, BT, BC, BK)
    x0 = (k0 * e * b0[:, None]).to(DT)
    kd0 = k0 * tl.exp2(c_1[None, :] - G0)  # ≤ 1: reference = the block's last row
    aq, L00 = _diag_A(q0, k0, G0, c_0, EXACT_DIAG, PREC, AB_BF16)
    _store_tile(AQK, base, aq * scale, 0, 0, BT, BC)
    L00 = L00 * b0[:, None]
    if INV_SCRATCH:  # only the inverse needs it: park it in the scratch now (fewer live registers)
        _store_L(LD, base, L00, 0, BC)
    # ---- sub-block 1
    q1, k1, b1, G1, c_2 = _sub_state(q, k, g, beta, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_1, 1, BC, BK,
                                     USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM, BETA_SIGMOID)
    e = tl.exp2(G1 - c_1[None, :])
    ql = q1 * e
    kl = k1 * e
    _store_rows(QG, base, ql * tl.exp2(c_1)[None, :] * scale, 1, BT, BC, BK)
    x1 = (kl * tl.exp2(c_1)[None, :] * b1[:, None]).to(DT)
    kd1 = k1 * tl.exp2(c_2[None, :] - G1)
    aq, L11 = _diag_A(q1, k1, G1, c_1, EXACT_DIAG, PREC, AB_BF16)
    _store_tile(AQK, base, aq * scale, 1, 1, BT, BC)
    L11 = L11 * b1[:, None]
    if INV_SCRATCH:
        _store_L(LD, base, L11, 1, BC)
    _store_tile(AQK, base, _off_A(ql, kd0, c_1, c_1, PREC, AB_BF16) * scale, 1, 0, BT, BC)
    L10 = _off_A(kl, kd0, c_1, c_1, PREC, AB_BF16) * b1[:, None]
    # ---- sub-block 2
    q2, k2, b2, G2, c_3 = _sub_state(q, k, g, beta, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_2, 2, BC, BK,
                                     USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM, BETA_SIGMOID)
    e = tl.exp2(G2 - c_2[None, :])
    ql = q2 * e
    kl = k2 * e
    _store_rows(QG, base, ql * tl.exp2(c_2)[None, :] * scale, 2, BT, BC, BK)
    x2 = (kl * tl.exp2(c_2)[None, :] * b2[:, None]).to(DT)
    kd2 = k2 * tl.exp2(c_3[None, :] - G2)
    aq, L22 = _diag_A(q2, k2, G2, c_2, EXACT_DIAG, PREC, AB_BF16)
    _store_tile(AQK, base, aq * scale, 2, 2, BT, BC)
    L22 = L22 * b2[:, None]
    if INV_SCRATCH:
        _store_L(LD, base, L22, 2, BC)
    _store_tile(AQK, base, _off_A(ql, kd0, c_2, c_1, PREC, AB_BF16) * scale, 2, 0, BT, BC)
    _store_tile(AQK, base, _off_A(ql, kd1, c_2, c_2, PREC, AB_BF16) * scale, 2, 1, BT, BC)
    L20 = _off_A(kl, kd0, c_2, c_1, PREC, AB_BF16) * b2[:, None]
    L21 = _off_A(kl, kd1, c_2, c_2, PREC, AB_BF16) * b2[:, None]
    # ---- sub-block 3
    q3, k3, b3, G3, c_4 = _sub_state(q, k, g, beta, A_log, dt_bias, i_h, bos, eos, H, K, lb, c_3, 3, BC, BK,
                                     USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM, BETA_SIGMOID)
    e = tl.exp2(G3 - c_3[None, :])
    ql = q3 * e
    kl = k3 * e
    _store_rows(QG, base, ql * tl.exp2(c_3)[None, :] * scale, 3, BT, BC, BK)
    x3 = (kl * tl.exp2(c_3)[None, :] * b3[:, None]).to(DT)
    kd3 = k3 * tl.exp2(c_4[None, :] - G3)
    aq, L33 = _diag_A(q3, k3, G3, c_3, EXACT_DIAG, PREC, AB_BF16)
    _store_tile(AQK, base, aq * scale, 3, 3, BT, BC)
    L33 = L33 * b3[:, None]
    if INV_SCRATCH:
        _store_L(LD, base, L33, 3, BC)
    _store_tile(AQK, base, _off_A(ql, kd0, c_3, c_1, PREC, AB_BF16) * scale, 3, 0, BT, BC)
    _store_tile(AQK, base, _off_A(ql, kd1, c_3, c_2, PREC, AB_BF16) * scale, 3, 1, BT, BC)
    _store_tile(AQK, base, _off_A(ql, kd2, c_3, c_3, PREC, AB_BF16) * scale, 3, 2, BT, BC)
    L30 = _off_A(kl, kd0, c_3, c_1, PREC, AB_BF16) * b3[:, None]
    L31 = _off_A(kl, kd1, c_3, c_2, PREC, AB_BF16) * b3[:, None]
    L32 = _off_A(kl, kd2, c_3, c_3, PREC, AB_BF16) * b3[:, None]
    zt = tl.zeros([BC, BC], dtype=tl.float32)
    _store_tile(AQK, base, zt, 0, 1, BT, BC)
    _store_tile(AQK, base, zt, 0, 2, BT, BC)
    _store_tile(AQK, base, zt, 0, 3, BT, BC)
    _store_tile(AQK, base, zt, 1, 2, BT, BC)
    _store_tile(AQK, base, zt, 1, 3, BT, BC)
    _store_tile(AQK, base, zt, 2, 3, BT, BC)

    # ---- kg = k e^{G_C − G} = (k e^{c_{J+1} − G}) · e^{G_C − c_{J+1}};  γ = e^{G_C}
    _store_rows(KG, base, kd0 * tl.exp2(c_4 - c_1)[None, :], 0, BT, BC, BK)
    _store_rows(KG, base, kd1 * tl.exp2(c_4 - c_2)[None, :], 1, BT, BC, BK)
    _store_rows(KG, base, kd2 * tl.exp2(c_4 - c_3)[None, :], 2, BT, BC, BK)
    _store_rows(KG, base, kd3, 3, BT, BC, BK)
    tl.store(GAM + base * BK + o_k, tl.exp2(c_4))

    # ---- T = (I + L)^{-1}: diagonal blocks by forward substitution, then the block merge
    if INV_SCRATCH:
        tl.debug_barrier()  # the scratch rows written above are read by other threads
        D0, D1, D2, D3 = _inv16x4(LD, base, BC)
    else:
        D0 = _inv16(L00)
        D1 = _inv16(L11)
        D2 = _inv16(L22)
        D3 = _inv16(L33)
    T10, T20, T21, T30, T31, T32 = _merge_T(D0, D1, D2, D3, L10, L20, L21, L30, L31, L32, PREC)
    t00, t11, t22, t33 = D0.to(DT), D1.to(DT), D2.to(DT), D3.to(DT)
    t10, t20, t21, t30, t31, t32 = T10.to(DT), T20.to(DT), T21.to(DT), T30.to(DT), T31.to(DT), T32.to(DT)
    if STORE_T or not STORE_WU:  # split variant: ``_kda_fwd_wu`` forms W, U from the stored T
        _store_tile(TM, base, t00, 0, 0, BT, BC)
        _store_tile(TM, base, t11, 1, 1, BT, BC)
        _store_tile(TM, base, t22, 2, 2, BT, BC)
        _store_tile(TM, base, t33, 3, 3, BT, BC)
        _store_tile(TM, base, t10, 1, 0, BT, BC)
        _store_tile(TM, base, t20, 2, 0, BT, BC)
        _store_tile(TM, base, t21, 2, 1, BT, BC)
        _store_tile(TM, base, t30, 3, 0, BT, BC)
        _store_tile(TM, base, t31, 3, 1, BT, BC)
        _store_tile(TM, base, t32, 3, 2, BT, BC)
        _store_tile(TM, base, zt, 0, 1, BT, BC)
        _store_tile(TM, base, zt, 0, 2, BT, BC)
        _store_tile(TM, base, zt, 0, 3, BT, BC)
        _store_tile(TM, base, zt, 1, 2, BT, BC)
        _store_tile(TM, base, zt, 1, 3, BT, BC)
        _store_tile(TM, base, zt, 2, 3, BT, BC)

    # ---- W = T X, U = T (β V), by sub-block rows
    if STORE_WU:
        _store_wu(v, W, U, base, i_h, bos, eos, H, V, x0, x1, x2, x3, b0, b1, b2, b3,
                  t00, t10, t11, t20, t21, t22, t30, t31, t32, t33, BT, BC, BK, BVP, PREC)


@triton.jit
def _store_wu(v, W, U, base, i_h, bos, eos, H, V, x0, x1, x2, x3, b0, b1, b2, b3,
              t00, t10, t11, t20, t21, t22, t30, t31, t32, t33,
              BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr, PREC: tl.constexpr):
    """W = T X and U = T (β V) by 16-row sub-blocks, from the T tiles held in registers (fused prep)."""
    DT: tl.constexpr = W.dtype.element_ty
    _store_rows(W, base, tl.dot(t00, x0, input_precision=PREC), 0, BT, BC, BK)
    _store_rows(W, base, tl.dot(t10, x0, input_precision=PREC) + tl.dot(t11, x1, input_precision=PREC),
                1, BT, BC, BK)
    _store_rows(W, base, tl.dot(t20, x0, input_precision=PREC) + tl.dot(t21, x1, input_precision=PREC)
                + tl.dot(t22, x2, input_precision=PREC), 2, BT, BC, BK)
    _store_rows(W, base, _tx(t30, t31, t32, t33, x0, x1, x2, x3, PREC), 3, BT, BC, BK)
    y0 = _sub_v(v, i_h, bos, eos, H, V, b0, 0, BC, BVP, DT)
    y1 = _sub_v(v, i_h, bos, eos, H, V, b1, 1, BC, BVP, DT)
    y2 = _sub_v(v, i_h, bos, eos, H, V, b2, 2, BC, BVP, DT)
    y3 = _sub_v(v, i_h, bos, eos, H, V, b3, 3, BC, BVP, DT)
    _store_rows(U, base, tl.dot(t00, y0, input_precision=PREC), 0, BT, BC, BVP)
    _store_rows(U, base, tl.dot(t10, y0, input_precision=PREC) + tl.dot(t11, y1, input_precision=PREC),
                1, BT, BC, BVP)
    _store_rows(U, base, tl.dot(t20, y0, input_precision=PREC) + tl.dot(t21, y1, input_precision=PREC)
                + tl.dot(t22, y2, input_precision=PREC), 2, BT, BC, BVP)
    _store_rows(U, base, _tx(t30, t31, t32, t33, y0, y1, y2, y3, PREC), 3, BT, BC, BVP)


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _kda_fwd_wu(
    k, v, g, beta, A_log, dt_bias, W, U, TM,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, V: tl.constexpr, lb,
    BT: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """Split prep, second half: W = T (β K e^G), U = T (β V) as two whole-chunk [BT, BT] × [BT, ·] products from
    the T stored by ``_kda_fwd_prep`` (STORE_WU=False); the gate cumsum and L2 norm are recomputed (cheap)."""
    DT: tl.constexpr = W.dtype.element_ty
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NCw + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVP)
    t = bos + o_t
    b_t = tl.load(TM + (base * BT + o_t[:, None]) * BT + o_t[None, :])
    b_b = _chunk_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)
    b_v = tl.load(v + (t * H + i_h)[:, None] * V + o_v[None, :], mask=(t < eos)[:, None] & (o_v < V)[None, :],
                  other=0.).to(tl.float32)
    b_u = tl.dot(b_t, (b_v * b_b[:, None]).to(DT), input_precision=PREC)
    tl.store(U + (base * BT + o_t[:, None]) * BVP + o_v[None, :], b_u.to(DT))
    b_k, _ = _l2norm(_chunk_tile(k, i_h, bos, eos, H, K, BT, BK).to(tl.float32), L2NORM)
    G = _chunk_gate_cumsum(g, i_h, bos, eos, A_log, dt_bias, H, K, lb, BT, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    b_x = (b_k * tl.exp2(G) * b_b[:, None]).to(DT)
    tl.store(W + (base * BT + o_t[:, None]) * BK + o_k[None, :],
             tl.dot(b_t, b_x, input_precision=PREC).to(DT))


@triton.jit(do_not_specialize=['c0', 'c1', 'NCw', 'NCh', 'T', 'NT', 'H'])
def _kda_fwd_state(
    W, U, KG, QG, AQK, GAM, o, HS, ht,
    cu, chunk_off, c0, c1, NCw, NCh, T, NT,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    STORE_H: tl.constexpr, STORE_O: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
    AU=None, FOLDED: tl.constexpr = False, VN=None, STORE_VN: tl.constexpr = False,
):
    # STORE_VN (training, ``FwdConfig.store_vn``): V' of every chunk goes to VN for the WY backward, which then
    # loads it instead of recomputing U − W S (the same bf16 values: S is rounded to the store dtype either way).
    # FOLDED (inference, ``FwdConfig.fold_output``): QG holds qw = qg − A_qk W and AU = A_qk U, so the output is
    # O = qw S + AU (``chunk_prep._prep_solve``): three products per chunk on the serial pass instead of four
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
                if FOLDED:
                    b_o = tl.dot(b_qg, b_s, input_precision=PREC) + tl.load(
                        AU + (base * BT + o_t[:, None]) * BVP + o_v[None, :]).to(tl.float32)
                else:
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
    """Launch knobs and kernel variants (class attributes, so a benchmark can switch them; ``bench/kda_sweep.py``
    measures them on an H200 and the defaults here are its fastest correct choice)."""

    # measured on one H200 (bench/results/kda_h200.md, v3 sweep): p7 = split + scratch inverse + bf16 A operands at
    # 4 warps, 115 ms of prep per 1M tokens at H = 32 (v2: 182); the fused p2 at 8 warps was within 1 %
    prep_warps = 4
    prep_stages = 1
    prep_ab_bf16 = True  # bf16 operands for the A-block products (bf16 inputs only)
    prep_inv_scratch = True  # diagonal inverses through an fp32 scratch, no barrier per substitution step
    prep_split = True  # two kernels: A blocks + T (+ A_qk, qg, kg, γ), then W, U from the stored T
    wu_warps = 4
    wu_stages = 1
    # "v3": ``_kda_fwd_prep`` (+ ``_kda_fwd_wu`` if prep_split), the knobs above. "rows": ``chunk_prep``'s
    # kernels — a block pre-pass, A by 16-row blocks (one light program per row block, chunk and head), then T + W, U
    # per (chunk, head) (prep_split / prep_inv_scratch / prep_warps do not apply; prep_ab_bf16 does). Sweep run 4a (H200): wrong
    # (NaN, T off) with T merged by chained [64, 64] tf32 wgmma products; merged by 16×16 blocks since, it matches
    # v3 on an H200 (session 3: every buffer ≤ 3e-4, fwd+bwd ≤ 3.2e-4) and is faster: 1M H=32 prep 110.9 → 92.0
    # ms, training prep 3.84 → 2.91 ms (bench/profile_kernels.py) — the default since
    prep_mode = "rows"
    rows_stack = True  # rows: q and k of a row block as one [32, K] left operand (one product per block pair)
    # rows (stacked): a first light kernel per 16-row block stores kr = k̂ e^{tot − s} and the block's gate total, so
    # later row blocks load one tile per earlier block instead of recomputing its gate, cumsum and norm (6 times per
    # chunk), and the solve reads X = β k̂ e^G and kr instead of recomputing the gate and norm over the whole chunk.
    # H200, 1M tokens at H=32: rows kernel 58.2 → 35.4 ms, solve 34.4 → 30.1, + pre-pass 15.0 (session 3)
    rows_pre = True
    blocks_warps = 2  # sweep v6 (H200): 2 warps 66.0 vs 4 warps 72.0 ms of prep per 1M tokens at H = 32
    blocks_per_program = 1  # 16-row blocks per pre-pass program (1, 2, 4): v6 sweep 72.4 / 72.8 / 75.0 ms of prep
    # rows (stacked): bounded gate and β sigmoid as rsqrt(1 + 2^{−x·log2 e})² with the scalars folded (no div.full,
    # no tl.exp subnormal fix-ups); sm_90 SASS per thread: pre-pass 1504 → 1248, rows 1968 → 1800; a few ulp off
    # the plain σ. Sweep v6b (H200): prep 61.3 → 59.0 ms per 1M tokens at H = 32, training prep 1.95 → 1.88 ms
    prep_fast_gate = True
    # rows with the pre-pass (bounded gates): the pre-pass also stores E = e^s (within-block decay, rows ≤ i) in the
    # qg rows, so the rows kernel loads it instead of recomputing its block's gate, cumsum and exponentials (E is
    # rounded to the buffer dtype: bf16 for bf16 inputs; fp16 buffers keep the recomputation, their range is
    # short). H200 (bench/pre_e_quick.py, session 4): prep 57.9 → 53.8 ms per 1M at H = 32 (sm_90 rows kernel
    # 1792 → 1504 instructions per thread), prefill H=32 1M 69.4 → 68.2 ms
    rows_pre_e = True
    # rows with the pre-pass: the rows kernel's last-block program writes kg and γ (it loads every earlier block's
    # kr anyway), kr goes through a scratch of its own (U's buffer, which the solve fills only afterwards, when
    # V = K), and the solve forms W only — ncu (H200, session 9): the solve's kg pass (load kr, scale, store) was
    # its longest load wait
    rows_kg = True
    # rows with the pre-pass: the next earlier block's kr and total loaded one step ahead in the rows kernel's loop
    # (the first before the block's own work), so their memory latency overlaps the products
    rows_prefetch = True
    # (the pre-pass and the rows kernel as ONE program per (chunk, head) running its four row blocks in order — no
    # E / kr / k, g round trip — measured slower on the H200 in session 9: prefill 1M H=32 77.0 ms at 4 warps, 69.9
    # at 2 warps, vs 63.7 for the two launches; a program per 16-row block hides latency better. Removed.)
    # inference, rows prep: the solve folds the output's A_qk V' term into chunk-local buffers (qw = qg − A_qk W in
    # place of qg, AU = A_qk U), so the serial state pass has three products per chunk instead of four (sm_90:
    # three wgmma waits per step instead of four; +16 KB of window buffers per chunk and head). Measured slower
    # (H200, sweep v6: 1M prefill at H = 32 82.3 vs 71.7 ms; prep + state of a window 112.5 vs 103.0), so off.
    fold_output = False
    rows_warps = 4
    rows_stages = 1
    solve_warps = 4
    solve_stages = 1
    # rows: W, U, kg formed by column slices of this width; sweep v6 (H200): 64 → prep 66.4 vs 72.0 ms per 1M at
    # H = 32 (32 had fewer live registers, but twice the slice loops)
    solve_bkw = 64
    rows_maxnreg = 128  # rows: register cap per thread (session 3, H200: 154 → 128, 4 CTAs/SM, 35.4 → 30.7 ms/1M)
    # sm_90: 130 → 128 without spills at 4 warps, bkw 32: 4 CTAs per SM instead of 3; with kg in the rows kernel
    # (``rows_kg``) 96 → 5 CTAs per SM: H200 (knob_ab, session 9) prefill 1M H=32 64.7 → 63.3 ms, H=8 22.4 → 22.1
    # (loading each U / W column slice's operand one product ahead, the first before T is formed, measured no gain:
    # 64.5 vs 65.0 ms at 128 registers, and it spills at 96)
    solve_maxnreg = 96
    # rows prep: the solve's four 16×16 diagonal inverses by forward substitution ("subst": 15 dependent steps,
    # each a row load and a reduction; ncu, session 9: ~17 % of the solve's stall samples) or as the product
    # (I − L)(I + L²)(I + L⁴)(I + L⁸) of the stacked blocks ("pow": 6 tf32x3 products, no dependent loads; sm_90
    # 2336 vs 1720 instructions per thread). H200 (knob_ab, session 10): prefill 1M H=32 62.22 vs 62.11 ms, training
    # B=8 T=4096 9.77 vs 9.79 — no gain, so "subst"
    solve_inverse = "subst"
    # sweep v6 (H200, one window at H = 32): BV 64 at 4 warps 25.3 ms per 1M vs BV 32 30.7 (BV 64 at 8 warps 43.2):
    # half the re-reads of W, kg, qg, A_qk, and 64 programs at B·H = 32 still overlap the next window's prep
    state_bv = 64
    state_warps = 4
    state_stages = 3  # v2: 2; 3 stages: 39.6 → 31.2 ms per 1M, 1.14 → 0.81 ms at B=8 T=4096
    # training: the forward state pass stores V' (``VN``, the size of U, which the backward then no longer needs),
    # so the WY backward loads V' instead of recomputing U − W S per chunk
    store_vn = True
    window_bytes = 1 << 30  # inference: bytes of chunk intermediates per window
    # inference on CUDA: the prep of window w+1 on a side stream while the state pass of window w runs (two window
    # buffers, +window_bytes of memory); the serial state pass fills ~one CTA per SM, so prep can share the SMs.
    # Sweep run 4b (one H200): 1M-token prefill H=32 144.1 → 131.2 ms, H=8 57.0 → 47.9 ms (unsplit)
    overlap_windows = True
    # inference with a bounded gate: "c16", the 16-token flow of ``chunk16`` (FlashKDA's data flow: a light
    # token-parallel prep, a state pass whose products all have the V-block as M), "c64", the prep + state pass of
    # this module, or "auto": c16 when its state pass has ``C16Config.min_programs`` programs or more. H200
    # (bench/knob_ab.py, session 12), prefill B=1 T=1M: H = 32 (64 programs) c64 62.4 ms, c16 49.4 (session 13:
    # 41.2); H = 8 unsplit (16 programs) c64 29.9, c16 52.1 (session 12, mode 1) — with few programs the 64-token
    # state pass wins; session 13's c16_shapes (mode 2): at 32 programs c64 4.91 vs c16 5.11 ms, from 64 c16 1.4×
    inference_flow = "auto"
    # overlapped windows: the serial state pass on a high-priority stream, so that the block scheduler places its
    # few programs before the next window's prep programs (whose grid is large) take every free slot. H200: the
    # c16 prefill above 73.4 → 57.3 ms (mode 0); c64 62.1 vs 62.5 (no change)
    state_priority = True
    # overlapped windows: buffers in the ring (the prep runs up to window_buffers − 1 windows ahead of the state pass;
    # each buffer is window_bytes)
    window_buffers = 2


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
    rows = FwdConfig.prep_mode == "rows"
    need_t = store_t or (FwdConfig.prep_split and not rows)
    bufs["TM"] = torch.empty(H, NC, BT, BT, **e) if need_t else bufs["AQK"]
    # fp32 scratch: v3, the diagonal blocks of L (``_inv16x4``), written and read back by the same program;
    # rows, the whole L = β A_kk handed from ``_prep_rows`` to ``_prep_solve``
    shape = (H, NC, BT, BT) if rows else (H, NC, BT // BC, BC, BC)
    bufs["LD"] = torch.empty(*shape, dtype=torch.float32, device=device)
    if rows:  # per 16-row block gate totals (fp32), handed from the first rows kernel to the later ones
        bufs["TOT"] = torch.empty(H, NC, BT // BC, BK, dtype=torch.float32, device=device)
    if _kr_scratch():  # kr is read by the rows kernel before the solve writes U: U's memory serves when it fits
        bufs["KR"] = bufs["U"] if BVP == BK else torch.empty(H, NC, BT, BK, **e)
    if rows and FwdConfig.fold_output and not store_t:  # inference only: training keeps qg and A_qk for backward
        bufs["AU"] = torch.empty(H, NC, BT, BVP, **e)
    return bufs


def _kr_scratch() -> bool:
    """Whether the rows prep hands kr over through its own scratch (``FwdConfig.rows_kg``)."""
    return (FwdConfig.prep_mode == "rows" and bool(FwdConfig.rows_stack) and bool(FwdConfig.rows_pre)
            and bool(FwdConfig.rows_kg))


def chunk_bytes(H: int, BK: int, BVP: int, dt: torch.dtype) -> int:
    """Bytes of intermediates per chunk (all heads)."""
    es = torch.finfo(dt).bits // 8
    if FwdConfig.prep_mode == "rows":  # T is not stored at inference; L goes through a [BT, BT] fp32 scratch
        au = BT * BVP * es if FwdConfig.fold_output else 0  # inference windows (the only user of this size)
        kr = BT * BK * es if _kr_scratch() and BVP != BK else 0
        return H * (BT * (3 * BK + BVP + BT) * es + BK * 4 + BT * BT * 4 + (BT // BC) * BK * 4 + au + kr)
    t_bytes = BT * BT * es if FwdConfig.prep_split else 0  # the split prep hands T over through memory
    return H * (BT * (3 * BK + BVP + BT) * es + BK * 4 + BT * BC * 4 + t_bytes)


def launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs: dict, tab: ChunkTable, c0: int, n: int, scale: float,
                lower_bound, flags: dict, store_t: bool) -> None:
    if FwdConfig.prep_mode == "rows":
        launch_prep_rows(q, k, v, g, beta, A_log, dt_bias, bufs, tab, c0, n, scale, lower_bound, flags, store_t,
                         FwdConfig)
        return
    if FwdConfig.prep_mode != "v3":
        raise ValueError(f"FwdConfig.prep_mode: expected 'v3' or 'rows', got {FwdConfig.prep_mode!r}")
    _, _, H, K = q.shape
    V = v.shape[-1]
    BK = bufs["W"].shape[-1]
    BVP = bufs["U"].shape[-1]
    dummy = bufs["GAM"]
    split = bool(FwdConfig.prep_split)
    if split and bufs["TM"] is bufs["AQK"]:
        raise RuntimeError("prep_split needs a T buffer: allocate the chunk buffers after setting FwdConfig")
    _kda_fwd_prep[(n, H)](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        bufs["W"], bufs["U"], bufs["KG"], bufs["QG"], bufs["AQK"], bufs["GAM"], bufs["TM"], bufs["LD"],
        tab.cu, tab.chunk_seq, tab.chunk_off, c0, bufs["W"].shape[1], tab.T, tab.NT,
        H, K, V, scale, float(lower_bound) if lower_bound is not None else 0.0,
        BT=BT, BC=BC, BK=BK, BVP=BVP,
        USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None, HAS_A=A_log is not None,
        HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"], BETA_SIGMOID=flags["beta_sigmoid"],
        IS_VARLEN=tab.varlen, STORE_T=store_t, EXACT_DIAG=flags["exact_diag"], PREC=dot_precision(q.dtype),
        AB_BF16=bool(FwdConfig.prep_ab_bf16) and q.dtype == torch.bfloat16,
        INV_SCRATCH=bool(FwdConfig.prep_inv_scratch), STORE_WU=not split,
        num_warps=FwdConfig.prep_warps, num_stages=FwdConfig.prep_stages,
    )
    if split:
        _kda_fwd_wu[(n, H)](
            k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
            bufs["W"], bufs["U"], bufs["TM"], tab.cu, tab.chunk_seq, tab.chunk_off, c0, bufs["W"].shape[1], tab.T,
            tab.NT, H, K, V, float(lower_bound) if lower_bound is not None else 0.0, BT=BT, BK=BK, BVP=BVP,
            USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None, HAS_A=A_log is not None,
            HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"], BETA_SIGMOID=flags["beta_sigmoid"],
            IS_VARLEN=tab.varlen, PREC=dot_precision(q.dtype),
            num_warps=FwdConfig.wu_warps, num_stages=FwdConfig.wu_stages)


def launch_state(bufs: dict, o, hs, ht, tab: ChunkTable, c0: int, c1: int, H: int, K: int, V: int,
                 store_o: bool = True, vn: torch.Tensor | None = None) -> None:
    """The serial state pass over chunks [c0, c1) of ``tab``; ``hs`` / ``vn`` (``[H, tab.NC, ·, BVP]``): also store
    every chunk's entry state / V' there (training)."""
    BK = bufs["W"].shape[-1]
    BVP = bufs["U"].shape[-1]
    BV = min(FwdConfig.state_bv, BVP)
    _kda_fwd_state[(BVP // BV, tab.N * H)](
        bufs["W"], bufs["U"], bufs["KG"], bufs["QG"], bufs["AQK"], bufs["GAM"],
        o if o is not None else ht, hs if hs is not None else ht, ht,
        tab.cu, tab.chunk_off, c0, c1, bufs["W"].shape[1], tab.NC, tab.T, tab.NT,
        H, K, V, BT=BT, BK=BK, BV=BV, BVP=BVP, STORE_H=hs is not None, STORE_O=store_o,
        IS_VARLEN=tab.varlen, PREC=dot_precision(bufs["W"].dtype),
        **(dict(AU=bufs["AU"], FOLDED=True) if "AU" in bufs else {}),
        **(dict(VN=vn, STORE_VN=True) if vn is not None else {}),
        num_warps=FwdConfig.state_warps, num_stages=state_stages(FwdConfig.state_stages, bufs["W"].dtype),
    )


def state_stages(stages: int, dtype: torch.dtype) -> int:
    """Pipeline depth of a kernel whose stages hold chunk-buffer tiles (state passes, span passes, the WY backward):
    fp32 buffers (the fp32 path) take twice the shared memory per stage, so at K = V = 128 more than 2 stages
    exceed the 227 KiB of an H200 SM (the forward state pass at 3 stages: 256 KiB, a launch failure)."""
    return min(stages, 2) if dtype == torch.float32 else stages


def prep_all(q, k, v, g, beta, A_log, dt_bias, scale: float, tab: ChunkTable, lower_bound, flags: dict) -> dict:
    """Training: the chunk buffers (W, U, kg, qg, A_qk, γ, T) of every chunk at once, kept for the backward."""
    BK, BVP = next_pow2(q.shape[-1]), next_pow2(v.shape[-1])
    bufs = alloc_chunk_buffers(q.shape[2], tab.NC, BK, BVP, store_dtype(q.dtype), q.device, store_t=True)
    launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs, tab, 0, tab.NC, scale, lower_bound, flags, True)
    bufs.pop("LD")  # the backward does not need the scratches
    bufs.pop("TOT", None)
    bufs.pop("KR", None)
    return bufs


def state_all(bufs: dict, o, ht, tab: ChunkTable, H: int, K: int, V: int) -> dict:
    """Training: the state pass over every chunk from ``ht`` (updated in place to the final states), writing ``o``
    and the per-chunk entry states; returns what the backward needs (the buffers plus ``HS``, and with
    ``FwdConfig.store_vn`` every chunk's V' as ``VN`` in place of U, which the backward then does not read)."""
    BK, BVP = bufs["W"].shape[-1], bufs["U"].shape[-1]
    hs = torch.empty(H, tab.NC, BK, BVP, dtype=bufs["W"].dtype, device=o.device)
    vn = torch.empty_like(bufs["U"]) if FwdConfig.store_vn else None
    launch_state(bufs, o, hs, ht, tab, 0, tab.NC, H, K, V, vn=vn)
    if vn is None:
        return dict(bufs, HS=hs)
    return dict({n: b for n, b in bufs.items() if n != "U"}, HS=hs, VN=vn)


def alloc_output_state(q, v, initial_state, tab: ChunkTable) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's output ``o [B, T, H, V]`` (q's dtype, to be written) and the running states ``ht [N, H, K, V]``
    fp32: a copy of ``initial_state`` (the passes update it in place into the final states), else zeros."""
    B, Tq, H, K = q.shape
    o = torch.empty(B, Tq, H, v.shape[-1], dtype=q.dtype, device=q.device)
    if initial_state is not None:
        return o, initial_state.detach().to(torch.float32).clone()
    return o, torch.zeros(tab.N, H, K, v.shape[-1], dtype=torch.float32, device=q.device)


def kda_fwd(q, k, v, g, beta, A_log, dt_bias, scale: float, initial_state, tab: ChunkTable, lower_bound,
            flags: dict, training: bool):
    """Run the forward. Returns (o [B,T,H,V], ht [N,H,K,V] fp32, saved dict or None).

    ``training``: one window; keep chunk buffers, T and per-chunk states for backward. Inference: windows of chunks
    (``FwdConfig.window_bytes``), by the 16-token flow (``chunk16``) where :func:`use_c16` says so (bounded gate,
    enough state-pass programs), else by the 64-token prep + state pass.
    """
    B, Tq, H, K = q.shape
    V = v.shape[-1]
    BK, BVP = next_pow2(K), next_pow2(V)
    dt = store_dtype(q.dtype)
    o, ht = alloc_output_state(q, v, initial_state, tab)
    if tab.NC == 0:
        return o, ht, None
    if training:
        bufs = prep_all(q, k, v, g, beta, A_log, dt_bias, scale, tab, lower_bound, flags)
        return o, ht, state_all(bufs, o, ht, tab, H, K, V)
    if use_c16(lower_bound, flags, tab.N * H, BVP):
        from k3.ops.kda.triton import chunk16 as c16  # noqa: PLC0415 (chunk16 imports this module's helpers)

        ncw = c16.c16_window_chunks(tab.NC, FwdConfig.window_bytes, H, BK, BVP, dt)
        run_windows(tab.NC, ncw, q.device,
                    lambda: c16.alloc_c16_buffers(H, ncw, BK, BVP, dt, q.device),
                    lambda b, c0, n: c16.launch_c16_prep(q, k, v, g, beta, A_log, dt_bias, b, tab, c0, n, scale,
                                                         lower_bound, flags),
                    lambda b, c0, n: c16.launch_c16_state(b, v, o, ht, tab, c0, c0 + n, H, K, V))
        return o, ht, None
    ncw = max(1, min(tab.NC, FwdConfig.window_bytes // chunk_bytes(H, BK, BVP, dt)))
    run_windows(tab.NC, ncw, q.device,
                lambda: alloc_chunk_buffers(H, ncw, BK, BVP, dt, q.device, store_t=False),
                lambda b, c0, n: launch_prep(q, k, v, g, beta, A_log, dt_bias, b, tab, c0, n, scale, lower_bound,
                                             flags, False),
                lambda b, c0, n: launch_state(b, o, None, ht, tab, c0, c0 + n, H, K, V))
    return o, ht, None


def use_c16(lower_bound, flags: dict, heads: int, BVP: int) -> bool:
    """Whether inference runs the 16-token flow: a bounded gate (its prep's right factor k e^{−G} needs the bound),
    and ``FwdConfig.inference_flow`` "c16", or "auto" with enough state-pass programs: ``heads`` (sequences ×
    heads) × V-blocks of the padded V width ``BVP`` ≥ ``C16Config.min_programs``."""
    flow = FwdConfig.inference_flow
    if flow not in ("auto", "c16", "c64"):
        raise ValueError(f"FwdConfig.inference_flow: expected 'auto', 'c16' or 'c64', got {flow!r}")
    if flow == "c64" or lower_bound is None or flags["exact_diag"]:
        return False
    if flow == "c16":
        return True
    from k3.ops.kda.triton.chunk16 import C16Config, state_blocks  # noqa: PLC0415 (chunk16 imports this module)

    return heads * state_blocks(BVP) >= C16Config.min_programs


def run_windows(NC: int, ncw: int, device: torch.device, alloc: Callable[[], dict],
                prep: Callable[[dict, int, int], None], state: Callable[[dict, int, int], None]) -> None:
    """The windowed inference forward: ``prep(bufs, c0, n)`` fills a window's buffers, ``state(bufs, c0, n)``
    runs the state pass over them. On CUDA with ``FwdConfig.overlap_windows`` and more than one window, the prep
    runs on a side stream one window ahead of the state pass.

    ``FwdConfig.window_buffers`` window buffers then take turns; the prep of window w waits until the state pass
    that last read its buffer (window w − window_buffers) is done, and the state pass of window w waits for that
    prep. The state passes run on the caller's stream, or with ``FwdConfig.state_priority`` on a high-priority
    stream that the caller's stream waits for at the end; either way every side-stream launch is ordered before
    later work on the caller's stream, so the buffers may be freed (reused by the caching allocator) when this
    returns, and a CUDA-graph capture sees every forked stream joined back."""
    nb = FwdConfig.window_buffers
    if not (isinstance(nb, int) and nb >= 2):
        raise ValueError(f"FwdConfig.window_buffers: expected an int ≥ 2, got {nb!r}")
    if not (FwdConfig.overlap_windows and device.type == "cuda" and NC > ncw):
        bufs = alloc()
        for c0 in range(0, NC, ncw):
            n = min(ncw, NC - c0)
            prep(bufs, c0, n)
            state(bufs, c0, n)
        return
    spans = [(c0, min(ncw, NC - c0)) for c0 in range(0, NC, ncw)]
    pipelined(spans, [alloc() for _ in range(nb)], lambda sp, b: prep(b, *sp), lambda sp, b: state(b, *sp), device,
              bool(FwdConfig.state_priority))


def pipelined(items: list, bufs: list[dict], prep: Callable[[Any, dict], None], serial: Callable[[Any, dict], None],
              device: torch.device, priority: bool) -> None:
    """``prep(item, buf)`` of each item on a side stream, up to len(bufs) − 1 items ahead of ``serial(item, buf)``
    on the caller's stream (``priority``: on a high-priority stream, joined back into the caller's at the end), the
    buffers taking turns: the prep of item i waits until the serial work that last read its buffer (item
    i − len(bufs)) is done, the serial work of item i waits for its prep. Every side-stream launch is ordered before
    later work on the caller's stream, so the buffers may be freed (reused by the caching allocator) when this
    returns, and a CUDA-graph capture sees every forked stream joined back. (The windowed inference forward and
    the split prefill.)"""
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(main)  # the inputs, the buffers and the outputs were produced on the main stream
    run = main
    if priority:  # the block scheduler then places the serial work's few programs before the prep's many
        run = torch.cuda.Stream(device, priority=-1)
        run.wait_stream(main)
    freed: list[torch.cuda.Event | None] = [None] * len(bufs)
    for i, item in enumerate(items):
        b = i % len(bufs)
        with torch.cuda.stream(side):
            if freed[b] is not None:
                side.wait_event(freed[b])
            prep(item, bufs[b])
            ready = torch.cuda.Event()
            ready.record(side)
        run.wait_event(ready)
        with torch.cuda.stream(run):
            serial(item, bufs[b])
        freed[b] = torch.cuda.Event()
        freed[b].record(run)
    if run is not main:
        main.wait_stream(run)  # later main-stream work (and reuse of the buffers' memory) follows both streams
