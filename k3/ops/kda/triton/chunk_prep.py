"""Chunked KDA forward prep as three kernels with many small independent programs (``FwdConfig.prep_mode = "rows"``,
the default).

Same outputs as ``chunk_fwd._kda_fwd_prep`` (+ ``_kda_fwd_wu``): per chunk of BT = 64 rows (four 16-row sub-blocks)
A_qk, qg = scale·Q e^G, T = (I + A_kk)^{-1} (training), W = T(β K e^G), U = T(β V), kg = K e^{G_C − G}, γ = e^{G_C}.

``_prep_rows`` — grid (4·chunks, H): one program per 16-row sub-block I of a chunk (a row block of A). Reference
row = the last row of block I−1 (carry c_I), one for the whole row block:

    A[i, j] = Σ_d (x_id e^{G_id − c_I}) · (k_jd e^{c_I − G_jd})

The left factor is ≤ 1 for every row of block I; the right one is ≤ 1 for every earlier block J < I and
≤ e^{5·15} (bounded gate) inside block I. Row i reads gates of rows ≤ i only, so future inputs cannot reach earlier
outputs even through rounding (fla issue #1240). Exponents are partial sums taken directly (within-block cumsum s,
block totals summed backwards from block I), never differences of whole-chunk cumsums. Unbounded gates
(``EXACT_DIAG``) take an exact per-column loop for the diagonal block. Writes a row block of A_qk (bf16 tiles, zero
above the diagonal), of L = β A_kk (fp32 scratch ``LK [BT, BT]``) and of qg. ``_prep_rows_qk`` (the default,
``FwdConfig.rows_stack``) is the same with q and k of the row block interleaved into one [32, K] left operand: one
product per block pair. Programs: light (4 warps, ~170 registers on sm_90), 4 per chunk and head.

``_prep_blocks`` (``FwdConfig.rows_pre``, on) runs first — grid (4·chunks, H), one program per 16-row block J:
kr_J = k̂_J e^{tot_J − s_J} (≤ 1, into the kg buffer) and the block's gate total tot_J (fp32, ``TOT``). The rows
kernel then loads kr_J and scales it by e^{d} (d = the totals of the blocks in between, ≤ 0) instead of recomputing
block J's gate, cumsum and norm (6 times per chunk), and writes X = β k̂ e^G into the W buffer; the solve forms
W = T X and kg_J = kr_J e^{Σ_{J' > J} tot_J'} in place, without the gate or the norm (H200, 1M tokens at H = 32:
prep 92.6 → 73.2 ms with the rows kernel capped at 128 registers). With ``FwdConfig.rows_pre_e`` (bounded gates,
bf16/fp32 buffers) the pre-pass also stores E_J = e^{s_J} in the block's qg rows, and the rows kernel loads it
instead of recomputing its own block's gate, cumsum and exponentials (E_i depends on rows ≤ i only, so causality
holds bitwise), then overwrites those rows with qg (H200: prep 57.9 → 53.8 ms per 1M at H = 32). With
``FwdConfig.rows_kg`` (session 9) kr goes to a scratch of its own (``KR``: U's buffer when V = K, which the solve
overwrites only after the rows kernel has read it; the last block's kr is already its kg and goes straight into the
kg buffer), and the rows program of each chunk's last block — which loads every earlier
kr_J anyway — writes kg_J and γ, so the solve forms W only (H200: solve 22.4 → 16.1 ms per 1M at H = 32, prefill
66.9 → 64.7 ms). ``FwdConfig.rows_prefetch`` loads the next earlier block's kr and total one loop step ahead.

``_prep_solve`` — grid (chunks, H): T = (I + L)^{-1} from the scratch: the four 16×16 diagonal inverses by forward
substitution on one stacked [64, 16] tile (built transposed: column s of D_bᵀ = e_s − D_bᵀ L_b[s, :]ᵀ, the row read
from memory, the reduction inside a tile row), D written back over L's diagonal blocks, then the block merge by
16×16 blocks (T_IJ = −D_I Σ_{J≤M<I} L_IM T_MJ, fp32 mma.sync like the v3 prep), written back over L's lower blocks
(store → barrier → reload, the hand-off the v3 prep uses), and T reloaded as one [64, 64] tile; then W = T X,
U = T Y as [64, 64] × [64, 128] products, and — unless the rows kernel wrote them — kg and γ (from the pre-pass
buffers, or, without it, from a fresh whole-chunk gate cumsum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BC,
    BT,
    ChunkTable,
    _chunk_beta,
    _chunk_pos,
    _chunk_tile,
    _eye,
    _gate_fwd,
    _l2norm,
    _merge_T,
    _rows_gate,
    _sigmoid,
    _sigmoid_fast,
    dot_precision,
    maxnreg_kw,
)


@triton.jit
def _rows_x(x, i_h, t0, eos, H, K, BC: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    """Tokens [t0, t0 + BC) of q or k [T, H, K], fp32 [BC, BK], L2-normalized if asked; zero outside."""
    b_x, _ = _l2norm(_chunk_tile(x, i_h, t0, eos, H, K, BC, BK).to(tl.float32), L2NORM)
    return b_x


@triton.jit
def _rows_beta(beta, i_h, t0, eos, H, BC: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    t = t0 + tl.arange(0, BC)
    m_t = t < eos
    b_b = tl.load(beta + t * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if BETA_SIGMOID:
        b_b = _sigmoid(b_b)
    return tl.where(m_t, b_b, 0.)


@triton.jit
def _op(x, AB_BF16: tl.constexpr):
    """Tensor-core operand: bf16 (fp32 accumulation) for bf16 inputs when asked; bf16 keeps fp32's exponent range,
    so the diagonal block's right factor (≤ e^{5·15}) stays finite."""
    if AB_BF16:
        return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _tile_ptr(ptr, base, r0, c0, BT: tl.constexpr, BC: tl.constexpr):
    """Pointers of the [BC, BC] tile at rows r0.., columns c0.. of the [BT, BT] chunk matrix number ``base``."""
    o_s = tl.arange(0, BC)
    return ptr + (base * BT + r0 + o_s[:, None]) * BT + c0 + o_s[None, :]


@triton.jit
def _exact_diag_loop(qI, kI, sI, BC: tl.constexpr):
    """Diagonal block without a reference row (unbounded gates): column by column,
    aq[i, j] = Σ_d q_id k_jd e^{s_id − s_jd} (j ≤ i), ak the same with k_i (j < i); only exponents ≤ 0."""
    o_s = tl.arange(0, BC)
    aq = tl.zeros([BC, BC], dtype=tl.float32)
    ak = tl.zeros([BC, BC], dtype=tl.float32)
    for j in tl.static_range(BC):
        sel = (o_s == j)[:, None]
        k_j = tl.sum(tl.where(sel, kI, 0.), axis=0)
        s_j = tl.sum(tl.where(sel, sI, 0.), axis=0)
        keep = (o_s >= j)[:, None]
        e = tl.exp2(tl.where(keep, sI - s_j[None, :], float("-inf"))) * k_j[None, :]
        col = (o_s == j)[None, :]
        aq = tl.where(col, tl.sum(qI * e, axis=1)[:, None], aq)
        ak = tl.where(col, tl.sum(kI * e, axis=1)[:, None], ak)
    return aq, ak


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _prep_rows(
    q, k, g, beta, A_log, dt_bias, QG, AQK, LK,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, scale, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr,
    EXACT_DIAG: tl.constexpr, PREC: tl.constexpr, AB_BF16: tl.constexpr,
):
    NB: tl.constexpr = BT // BC
    pid = tl.program_id(0)
    i_c = pid // NB
    I = pid % NB  # row block (adjacent programs share a chunk: its k, g tiles stay in L2)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NCw + i_c).to(tl.int64)
    o_s = tl.arange(0, BC)
    r0 = I * BC
    t0 = bos + r0

    # ---- own rows: s = within-block cumsum of the log2 gate, so G_i − c_I = s_i exactly as summed
    b_g = _rows_gate(g, A_log, dt_bias, i_h, t0, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT)
    b_q = _rows_x(q, i_h, t0, eos, H, K, BC, BK, L2NORM)
    b_k = _rows_x(k, i_h, t0, eos, H, K, BC, BK, L2NORM)
    b_b = _rows_beta(beta, i_h, t0, eos, H, BC, BETA_SIGMOID)
    s = tl.cumsum(b_g, axis=0)
    e = tl.exp2(s)  # ≤ 1
    ql = _op(b_q * e, AB_BF16)
    kl = _op(b_k * e, AB_BF16)

    # ---- diagonal block (I, I)
    if EXACT_DIAG:
        aq, ak = _exact_diag_loop(b_q, b_k, s, BC)
    else:
        kd = _op(tl.trans(b_k * tl.exp2(-s)), AB_BF16)  # ≤ e^{5·15} under the bounded gate
        aq = tl.dot(ql, kd, input_precision=PREC)
        ak = tl.dot(kl, kd, input_precision=PREC)
    aq = tl.where(o_s[:, None] >= o_s[None, :], aq, 0.)
    ak = tl.where(o_s[:, None] > o_s[None, :], ak, 0.)
    tl.store(_tile_ptr(AQK, base, r0, r0, BT, BC), (aq * scale).to(AQK.dtype.element_ty))
    tl.store(_tile_ptr(LK, base, r0, r0, BT, BC), ak * b_b[:, None])

    # ---- earlier blocks J = I−1 … 0: right factor k_j e^{c_I − G_j} = k_j e^{(tot_J − s_j) + d}, d = Σ_{J<J'<I} tot_J'
    d = tl.zeros([BK], dtype=tl.float32)
    for jj in range(0, I):
        J = I - 1 - jj
        tJ = bos + J * BC
        g_J = _rows_gate(g, A_log, dt_bias, i_h, tJ, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT)
        k_J = _rows_x(k, i_h, tJ, eos, H, K, BC, BK, L2NORM)
        tot = tl.sum(g_J, axis=0)
        kr = _op(tl.trans(k_J * tl.exp2((tot[None, :] - tl.cumsum(g_J, axis=0)) + d[None, :])), AB_BF16)  # ≤ 1
        tl.store(_tile_ptr(AQK, base, r0, J * BC, BT, BC),
                 (tl.dot(ql, kr, input_precision=PREC) * scale).to(AQK.dtype.element_ty))
        tl.store(_tile_ptr(LK, base, r0, J * BC, BT, BC), tl.dot(kl, kr, input_precision=PREC) * b_b[:, None])
        d += tot
    # d is now c_I (G at the last row of block I−1): qg = scale · q e^{c_I + s}
    o_k = tl.arange(0, BK)
    tl.store(QG + (base * BT + r0 + o_s[:, None]) * BK + o_k[None, :],
             (b_q * tl.exp2(d[None, :] + s) * scale).to(QG.dtype.element_ty))
    zt = tl.zeros([BC, BC], dtype=tl.float32).to(AQK.dtype.element_ty)
    for J in range(I + 1, NB):  # A_qk is read whole by the state pass: zero above the diagonal
        tl.store(_tile_ptr(AQK, base, r0, J * BC, BT, BC), zt)


@triton.jit
def _block_kr(k, g, A_log, dt_bias, KR, TOT, base, i_h, bos, eos, J, H, K, lb, BT: tl.constexpr, BC: tl.constexpr,
              BK: tl.constexpr, USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr,
              HAS_DT: tl.constexpr, L2NORM: tl.constexpr, FAST_GATE: tl.constexpr = False, E=None,
              STORE_E: tl.constexpr = False, KG=None, SPLIT_KR: tl.constexpr = False):
    """kr_J = k̂_J e^{tot_J − s_J} and tot_J of 16-row block J of the chunk at ``bos`` (see ``_prep_blocks``);
    ``STORE_E``: also E_J = e^{s_J} (≤ 1, the within-block decay of each row: rows ≤ i only) into the block's rows
    of ``E`` (the qg buffer, which the rows kernel reads and then overwrites with qg). ``SPLIT_KR``: kr of the
    chunk's last block is already its kg (no later block decays it) and goes straight into ``KG``; the others into
    their own scratch ``KR`` (the rows kernel of the last block turns them into kg, see ``_prep_rows_qk``)."""
    NB: tl.constexpr = BT // BC
    tJ = bos + J * BC
    g_J = _rows_gate(g, A_log, dt_bias, i_h, tJ, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT,
                     FAST_GATE)
    k_J = _rows_x(k, i_h, tJ, eos, H, K, BC, BK, L2NORM)
    tot = tl.sum(g_J, axis=0)
    s_J = tl.cumsum(g_J, axis=0)
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    p = (base * BT + J * BC + o_s[:, None]) * BK + o_k[None, :]
    kr = (k_J * tl.exp2(tot[None, :] - s_J)).to(KR.dtype.element_ty)
    if SPLIT_KR:
        tl.store(tl.where(J == NB - 1, KG + p, KR + p), kr)
    else:
        tl.store(KR + p, kr)
    tl.store(TOT + (base * NB + J) * BK + o_k, tot)
    if STORE_E:
        tl.store(E + p, tl.exp2(s_J).to(E.dtype.element_ty))


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _prep_blocks(
    k, g, A_log, dt_bias, KR, TOT,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, PER: tl.constexpr = 1, FAST_GATE: tl.constexpr = False,
    E=None, STORE_E: tl.constexpr = False, KG=None, SPLIT_KR: tl.constexpr = False,
):
    """Per 16-row block J of a chunk (grid (4·chunks / PER, H); PER blocks per program, each its own [16, K] tile),
    what later row blocks and the solve need of it, computed once instead of once per (row block, J) pair:
    kr_J = k̂_J e^{tot_J − s_J} (≤ 1, the right factor relative to the block's last row; into the KG buffer's rows)
    and tot_J = Σ_{j∈J} g_j (log2, fp32, into ``TOT``). One program per chunk as a [4, 16, K] reshape + cumsum
    measured 2× slower on an H200 (30 vs 15 ms per 1M at PER = 1)."""
    NB: tl.constexpr = BT // BC
    pid = tl.program_id(0)
    i_c = pid // (NB // PER)
    J0 = (pid % (NB // PER)) * PER
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NCw + i_c).to(tl.int64)
    for j in tl.static_range(PER):
        _block_kr(k, g, A_log, dt_bias, KR, TOT, base, i_h, bos, eos, J0 + j, H, K, lb, BT, BC, BK, USE_GATE,
                  HAS_LB, HAS_A, HAS_DT, L2NORM, FAST_GATE, E, STORE_E, KG, SPLIT_KR)


@triton.jit
def _rows_qk(q, k, i_h, t0, eos, H, K, R: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    """[2·R, BK] fp32, rows interleaved: row 2i = q, row 2i+1 = k of token t0 + i (L2-normalized; zero outside)."""
    o_r = tl.arange(0, 2 * R)
    o_k = tl.arange(0, BK)
    t = t0 + o_r // 2
    m = (t < eos)[:, None] & (o_k < K)[None, :]
    off = t[:, None] * (H * K) + i_h * K + o_k[None, :]
    p = tl.where((o_r % 2 == 0)[:, None], q + off, k + off)
    b_x, _ = _l2norm(tl.load(p, mask=m, other=0.).to(tl.float32), L2NORM)
    return b_x


@triton.jit
def _kr_tot(KR, TOT, base, J, valid, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """Block J's total (fp32 [BK]) and kr tile ([BC, BK], the buffer's dtype) from the pre-pass, or zeros if not
    ``valid`` (no load issued)."""
    NB: tl.constexpr = BT // BC
    o_j = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    tot = tl.load(TOT + (base * NB + J) * BK + o_k, mask=(o_k >= 0) & valid, other=0.)
    kr = tl.load(KR + (base * BT + J * BC + o_j[:, None]) * BK + o_k[None, :],
                 mask=((o_j >= 0)[:, None] & (o_k >= 0)[None, :]) & valid, other=0.)
    return tot, kr


@triton.jit
def _rows2(y, R: tl.constexpr, BK: tl.constexpr):
    """[R, BK] → [2·R, BK] with row i repeated on rows 2i and 2i+1 (bit-exact copies)."""
    return tl.reshape(tl.broadcast_to(y[:, None, :], [R, 2, BK]), [2 * R, BK])


@triton.jit
def _exact_diag_stacked(x, s, BC: tl.constexpr):
    """Diagonal block without a reference row (unbounded gates) on the interleaved rows (q_i on 2i, k_i on 2i+1):
    out[r, j] = Σ_d x_rd k_jd e^{s_rd − s_jd} for token(r) ≥ j, column by column; only exponents ≤ 0."""
    o_r = tl.arange(0, 2 * BC)
    o_j = tl.arange(0, BC)
    out = tl.zeros([2 * BC, BC], dtype=tl.float32)
    for j in tl.static_range(BC):
        sel = (o_r == 2 * j + 1)[:, None]
        k_j = tl.sum(tl.where(sel, x, 0.), axis=0)
        s_j = tl.sum(tl.where(sel, s, 0.), axis=0)
        e = tl.exp2(tl.where((o_r // 2 >= j)[:, None], s - s_j[None, :], float("-inf"))) * k_j[None, :]
        out = tl.where((o_j == j)[None, :], tl.sum(x * e, axis=1)[:, None], out)
    return out


@triton.jit
def _store_qk_rows(AQK, LK, base, r0, c0, val, b_b2, scale, keep, col, colmask, BT: tl.constexpr, BC: tl.constexpr):
    """Interleaved [2·BC, N] result → A_qk rows (even rows, × scale, half) and L rows (odd rows, × β, fp32) of the
    tile at (r0, c0); result column n lands in tile column ``col[n]`` where ``colmask[n]``; entries outside
    ``keep`` are written as zeros."""
    o_r = tl.arange(0, 2 * BC)
    off = (base * BT + r0 + o_r // 2)[:, None] * BT + c0 + col[None, :]
    even = (o_r % 2 == 0)[:, None]
    tl.store(AQK + off, tl.where(keep, val * scale, 0.).to(AQK.dtype.element_ty), mask=even & colmask[None, :])
    tl.store(LK + off, tl.where(keep, val * b_b2[:, None], 0.), mask=(o_r % 2 == 1)[:, None] & colmask[None, :])


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _prep_rows_qk(
    q, k, g, beta, A_log, dt_bias, QG, AQK, LK,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, scale, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr,
    EXACT_DIAG: tl.constexpr, PREC: tl.constexpr, AB_BF16: tl.constexpr,
    KR=None, TOT=None, X=None, PRE: tl.constexpr = False, FAST_GATE: tl.constexpr = False,
    LOAD_E: tl.constexpr = False, KG=None, GAM=None, KG_OUT: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """``_prep_rows`` with q and k of the row block stacked into ONE [32, K] left operand (rows interleaved), so
    each product is [32, K] × [K, 16]: one tensor-core product per block pair instead of two, and at 2 warps each
    warp owns 16 rows of the left operand instead of every warp holding all of it.

    ``KG_OUT`` (with ``PRE``): the program of the chunk's last row block, which loads every earlier block's kr_J
    anyway, also writes kg_J = kr_J e^{Σ_{J' > J} tot_J'} and γ = e^{Σ_J tot_J}, so the solve does not read kr
    and rewrite kg (−512 B of traffic per token and head, and the solve's longest load wait)."""
    NB: tl.constexpr = BT // BC
    pid = tl.program_id(0)
    i_c = pid // NB
    I = pid % NB
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NCw + i_c).to(tl.int64)
    o_r = tl.arange(0, 2 * BC)
    o_j = tl.arange(0, BC)
    tok = o_r // 2
    r0 = I * BC
    t0 = bos + r0
    o_k = tl.arange(0, BK)
    if LOAD_E:  # issued first: ncu (H200) put a quarter of this kernel's stall samples on waiting for E, q, k
        e_raw = tl.load(QG + (base * BT + r0 + o_j[:, None]) * BK + o_k[None, :])
    if PRE and PREFETCH:  # block I−1's kr and total (the first earlier block), also ahead of any use
        n_tot, n_kr = _kr_tot(KR, TOT, base, I - 1, I > 0, BT, BC, BK)
    b_b2 = tl.load(beta + (t0 + tok) * H + i_h, mask=(t0 + tok) < eos, other=0.).to(tl.float32)  # β of token(r)
    if BETA_SIGMOID:
        if FAST_GATE:
            b_b2 = _sigmoid_fast(b_b2)
        else:
            b_b2 = _sigmoid(b_b2)

    # ---- own rows: s = within-block cumsum (G_i − c_I exactly as summed); gate and exponentials on the 16
    # tokens, then repeated onto rows 2i and 2i+1 of the interleaved tile. LOAD_E: E = e^s from the pre-pass (the
    # qg rows of this block, overwritten below), instead of the gate, its cumsum and the exponentials again
    x = _rows_qk(q, k, i_h, t0, eos, H, K, BC, BK, L2NORM)
    if LOAD_E:
        e16 = e_raw.to(tl.float32)
    else:
        s16 = tl.cumsum(_rows_gate(g, A_log, dt_bias, i_h, t0, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A,
                                   HAS_DT, FAST_GATE), axis=0)
        e16 = tl.exp2(s16)
    xl = x * _rows2(e16, BC, BK)  # ≤ 1; kept in fp32 for qg
    xo = _op(xl, AB_BF16)

    # ---- diagonal block (columns = the block's own k rows)
    keep = (tok[:, None] >= o_j[None, :]) & ((o_r % 2 == 0)[:, None] | (tok[:, None] > o_j[None, :]))
    if EXACT_DIAG:  # (never with LOAD_E: the exact loop needs s itself)
        dg = _exact_diag_stacked(x, _rows2(s16, BC, BK), BC)
    else:
        k16 = _rows_x(k, i_h, t0, eos, H, K, BC, BK, L2NORM)
        if LOAD_E:
            kd = k16 / e16  # E ≥ 2^{−16·5·log2 e}: finite, and ≤ e^{5·15} after the division like e^{−s}
        else:
            kd = k16 * tl.exp2(-s16)
        dg = tl.dot(xo, _op(tl.trans(kd), AB_BF16), input_precision=PREC)  # right ≤ e^{5·15}
    _store_qk_rows(AQK, LK, base, r0, r0, dg, b_b2, scale, keep, o_j, o_j >= 0, BT, BC)

    # ---- earlier blocks J = I−1 … 0 (right factor ≤ 1, see _prep_rows)
    d = tl.zeros([BK], dtype=tl.float32)
    allk = (o_r >= 0)[:, None] & (o_j >= 0)[None, :]
    if KG_OUT:
        last = I == NB - 1
    for jj in range(0, I):
        J = I - 1 - jj
        if PRE:  # kr_J and tot_J from ``_prep_blocks``: one tile load instead of the gate, cumsum and norm again
            p_kr = (base * BT + J * BC + o_j[:, None]) * BK + o_k[None, :]
            if PREFETCH:  # this block's were loaded one step ahead; load the next one's now
                tot, kJ = n_tot, n_kr.to(tl.float32)
                n_tot, n_kr = _kr_tot(KR, TOT, base, J - 1, jj + 1 < I, BT, BC, BK)
            else:
                tot = tl.load(TOT + (base * NB + J) * BK + o_k)
                kJ = tl.load(KR + p_kr).to(tl.float32)
            kr = _op(tl.trans(kJ * tl.exp2(d)[None, :]), AB_BF16)
            if KG_OUT:  # d = Σ_{J < J' < I}: with block I's own total, every later block of the chunk
                if last:  # (block I's total reloaded here, an L1 hit, rather than held across the loop)
                    tot_i = tl.load(TOT + (base * NB + I) * BK + o_k)
                    tl.store(KG + p_kr, (kJ * tl.exp2(d + tot_i)[None, :]).to(KG.dtype.element_ty))
        else:
            tJ = bos + J * BC
            g_J = _rows_gate(g, A_log, dt_bias, i_h, tJ, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT,
                             FAST_GATE)
            k_J = _rows_x(k, i_h, tJ, eos, H, K, BC, BK, L2NORM)
            tot = tl.sum(g_J, axis=0)
            kr = _op(tl.trans(k_J * tl.exp2((tot[None, :] - tl.cumsum(g_J, axis=0)) + d[None, :])), AB_BF16)
        _store_qk_rows(AQK, LK, base, r0, J * BC, tl.dot(xo, kr, input_precision=PREC), b_b2, scale, allk, o_j,
                       o_j >= 0, BT, BC)
        d += tot
    if KG_OUT:
        if last:
            tl.store(GAM + base * BK + o_k, tl.exp2(d + tl.load(TOT + (base * NB + I) * BK + o_k)))
    # qg = scale · q e^{c_I + s} from the even rows (d = c_I now); with PRE also X = β k̂ e^{s + c_I} from the odd
    # rows, for the solve's W = T X (into W, solved in place): one scaled tile, two masked stores
    p_out = (base * BT + r0 + tok[:, None]) * BK + o_k[None, :]
    even = (o_r % 2 == 0)[:, None] & (o_k >= 0)[None, :]
    if LOAD_E:
        tl.debug_barrier()  # every thread has read its E rows before qg overwrites them (other layouts, other threads)
    if PRE:
        y = (xl * tl.exp2(d)[None, :]) * tl.where(o_r % 2 == 0, scale, b_b2)[:, None]
        tl.store(QG + p_out, y.to(QG.dtype.element_ty), mask=even)
        tl.store(X + p_out, y.to(X.dtype.element_ty), mask=(o_r % 2 == 1)[:, None] & (o_k >= 0)[None, :])
    else:
        tl.store(QG + p_out, (xl * tl.exp2(d)[None, :] * scale).to(QG.dtype.element_ty), mask=even)
    zt = tl.zeros([BC, BC], dtype=tl.float32).to(AQK.dtype.element_ty)
    for J in range(I + 1, NB):  # A_qk is read whole by the state pass: zero above the diagonal
        tl.store(_tile_ptr(AQK, base, r0, J * BC, BT, BC), zt)


@triton.jit
def _diag_inverses(LK, base, BT: tl.constexpr, BC: tl.constexpr):
    """(I + L_b)^{-1} of the four strictly lower-triangular diagonal blocks of the scratch ``LK[base]`` by forward
    substitution, all four stacked in one [BT, BC] tile: row (b, i), column m holds D_b[m, i] (built transposed,
    column s of D_bᵀ = e_s − D_bᵀ L_b[s, :]ᵀ). The row L_b[s, :] is loaded (an L1 hit) instead of extracted by a
    cross-warp reduction, and the remaining reduction runs along a tile row. Then D_b is written back over the
    diagonal block (the caller reloads the whole matrix)."""
    o_t = tl.arange(0, BT)
    o_m = tl.arange(0, BC)
    blk = (o_t // BC) * BC  # first row (= column) of the stacked row's diagonal block
    ii = o_t % BC
    p_row = LK + (base * BT + blk[:, None]) * BT + blk[:, None] + o_m[None, :]  # + s·BT: row s of block b
    U = tl.where(ii[:, None] == o_m[None, :], 1.0, 0.0)
    for s in tl.static_range(1, BC):
        r = tl.load(p_row + s * BT)
        new = tl.where(ii == s, 1.0, 0.0) - tl.sum(U * r, axis=1)
        U = tl.where((o_m == s)[None, :], new[:, None], U)
    tl.debug_barrier()  # every thread is done reading L's diagonal rows before D overwrites them
    tl.store(LK + (base * BT + blk[:, None] + o_m[None, :]) * BT + blk[:, None] + ii[:, None], U)
    tl.debug_barrier()  # ... and D is visible to every thread of the program before the reload


@triton.jit
def _inv_pow(L, PREC: tl.constexpr):
    """(I + L)^{-1} of strictly lower-triangular 16×16 blocks ([16, 16] or stacked [n, 16, 16]) as
    (I − L)(I + L²)(I + L⁴)(I + L⁸) (L^16 = 0): six products instead of a 15-step substitution. The partial products
    can hold entries far above the result's (binomials up to ~3.4e3 when L is all ones: β ≈ 1, repeated keys, no
    decay), so they run at ~fp32 accuracy (``_mm_acc``: 'tf32x3', 'ieee' or, while those entries stay inside fp16's
    range, 'fp16x3'), never plain tf32 (FlashKDA's fp16 version returned NaN there)."""
    N = -L
    N2 = _mm_acc(N, N, PREC)
    N4 = _mm_acc(N2, N2, PREC)
    N8 = _mm_acc(N4, N4, PREC)
    D = _eye(L.shape[-1]) + N
    D = D + _mm_acc(D, N2, PREC)
    D = D + _mm_acc(D, N4, PREC)
    return D + _mm_acc(D, N8, PREC)


@triton.jit
def _mm_acc(a, b, PREC: tl.constexpr):
    """fp32 product of fp32 operands at ~fp32 accuracy. PREC 'ieee' / 'tf32x3': ``tl.dot``'s own; 'fp16x3': each
    operand split into fp16 hi + lo (22 significant bits together) and three fp16 tensor-core products
    (hi·hi + hi·lo + lo·hi) — half the bytes of tf32x3's operands through shared memory, for values below fp16's
    65504 (``_inv_pow``'s partial products stay below ~6.5e3)."""
    if PREC == "fp16x3":
        a_hi = a.to(tl.float16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.float16)
        b_hi = b.to(tl.float16)
        b_lo = (b - b_hi.to(tl.float32)).to(tl.float16)
        acc = tl.dot(a_hi, b_lo)
        acc = tl.dot(a_lo, b_hi, acc=acc)
        return tl.dot(a_hi, b_hi, acc=acc)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _diag_inverses_pow(LK, base, BT: tl.constexpr, BC: tl.constexpr):
    """``_diag_inverses`` by products instead of a 15-step substitution: ``_inv_pow`` on the four stacked blocks
    ([4, 16, 16] tensor-core products at tf32x3, ~fp32 accuracy; plain fp32 FMA products spilled 216–560 B on
    sm_90), no dependent loads. Written back over the diagonal blocks like ``_diag_inverses``."""
    NB: tl.constexpr = BT // BC
    o_b = tl.arange(0, NB)
    o_i = tl.arange(0, BC)
    p = (LK + (base * BT + (o_b * BC)[:, None, None] + o_i[None, :, None]) * BT + (o_b * BC)[:, None, None]
         + o_i[None, None, :])
    D = _inv_pow(tl.load(p), "tf32x3")
    tl.debug_barrier()  # every thread is done reading L's diagonal blocks before D overwrites them
    tl.store(p, D)
    tl.debug_barrier()  # ... and D is visible to every thread of the program before the merge reloads it


@triton.jit
def _block_merge(LK, base, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Below-diagonal blocks of T = (I + L)^{-1} from the scratch ``LK[base]`` (D_J = T_JJ on the diagonal blocks,
    L below them), by 16×16 blocks: T_IJ = −D_I Σ_{J≤M<I} L_IM T_MJ. Written back over L's blocks, so that the
    caller reloads the whole T as one [BT, BT] tile.

    Why 16×16 blocks and not the [64, 64] product chain (I − M)(I + M²) D: on sm_90 the whole-tile fp32 products
    become tf32 wgmma with the left operand in registers, fed from the previous product's accumulator; that chain
    gave garbage (NaN, T off by O(1)) on an H200 while the interpreter was right. 16×16 fp32 products lower to
    mma.sync like the v3 prep's merge, which is correct on the same GPU."""
    D0 = tl.load(_tile_ptr(LK, base, 0, 0, BT, BC))
    D1 = tl.load(_tile_ptr(LK, base, BC, BC, BT, BC))
    D2 = tl.load(_tile_ptr(LK, base, 2 * BC, 2 * BC, BT, BC))
    D3 = tl.load(_tile_ptr(LK, base, 3 * BC, 3 * BC, BT, BC))
    L10 = tl.load(_tile_ptr(LK, base, BC, 0, BT, BC))
    L20 = tl.load(_tile_ptr(LK, base, 2 * BC, 0, BT, BC))
    L21 = tl.load(_tile_ptr(LK, base, 2 * BC, BC, BT, BC))
    L30 = tl.load(_tile_ptr(LK, base, 3 * BC, 0, BT, BC))
    L31 = tl.load(_tile_ptr(LK, base, 3 * BC, BC, BT, BC))
    L32 = tl.load(_tile_ptr(LK, base, 3 * BC, 2 * BC, BT, BC))
    T10, T20, T21, T30, T31, T32 = _merge_T(D0, D1, D2, D3, L10, L20, L21, L30, L31, L32, PREC)
    tl.debug_barrier()  # every thread has read L's blocks before T overwrites them
    tl.store(_tile_ptr(LK, base, BC, 0, BT, BC), T10)
    tl.store(_tile_ptr(LK, base, 2 * BC, 0, BT, BC), T20)
    tl.store(_tile_ptr(LK, base, 2 * BC, BC, BT, BC), T21)
    tl.store(_tile_ptr(LK, base, 3 * BC, 0, BT, BC), T30)
    tl.store(_tile_ptr(LK, base, 3 * BC, BC, BT, BC), T31)
    tl.store(_tile_ptr(LK, base, 3 * BC, 2 * BC, BT, BC), T32)
    tl.debug_barrier()  # ... and T is visible to every thread of the program before the reload


@triton.jit
def _store_w(W, QG, b_aq, w, p_tk, FOLD: tl.constexpr, PREC: tl.constexpr):
    """Store a column slice of W; with FOLD also fold it into qg's slice: qw = qg − A_qk W (``_prep_solve``)."""
    DT: tl.constexpr = W.dtype.element_ty
    w = w.to(DT)
    tl.store(W + p_tk, w)
    if FOLD:
        tl.store(QG + p_tk, (tl.load(QG + p_tk).to(tl.float32) - tl.dot(b_aq, w, input_precision=PREC)).to(DT))


@triton.jit
def _solve_w_kg(W, KG, GAM, TOT, base, b_t, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                BKW: tl.constexpr, PREC: tl.constexpr, QG=None, b_aq=None, FOLD: tl.constexpr = False,
                KG_DONE: tl.constexpr = False):
    """The solve's W, kg, γ from ``_prep_blocks`` / ``_prep_rows_qk``'s buffers (no gate, cumsum or norm here):
    W = T X with X = β k̂ e^G read from W's own rows (solved in place); kg_J = kr_J e^{Σ_{J' > J} tot_J'}
    (≤ 1: kr_J is relative to block J's last row) in place over kr; γ = e^{Σ_J tot_J}. ``KG_DONE``: kg and γ
    were written by the rows kernel (``KG_OUT``): W only."""
    NB: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    rb = o_t // BC
    for sl in tl.static_range(BK // BKW):
        o_k = sl * BKW + tl.arange(0, BKW)
        p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
        _store_w(W, QG, b_aq, tl.dot(b_t, tl.load(W + p_tk), input_precision=PREC), p_tk, FOLD, PREC)
        if not KG_DONE:
            # e^{Σ_{J' > block(row)} tot_J'} takes one value per (row block, column): exponentials of [BKW] vectors,
            # then selected per row block (bitwise the per-element form: the same sums, summed in the same order)
            fac = tl.full([BT, BKW], 1.0, tl.float32)  # the last block: e^0
            acc = tl.zeros([BKW], dtype=tl.float32)
            for jj in tl.static_range(NB - 1):  # summed from the last block down, like the rows kernel's d
                J = NB - 1 - jj
                acc += tl.load(TOT + (base * NB + J) * BK + o_k)  # Σ_{J' ≥ J}: the suffix of block J − 1
                fac = tl.where((rb == J - 1)[:, None], tl.exp2(tl.minimum(acc, 0.))[None, :], fac)
            tl.store(KG + p_tk, (tl.load(KG + p_tk).to(tl.float32) * fac).to(KG.dtype.element_ty))
            tl.store(GAM + base * BK + o_k, tl.exp2(acc + tl.load(TOT + base * NB * BK + o_k)))


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _prep_solve(
    k, v, g, beta, A_log, dt_bias, W, U, KG, GAM, TM, LK,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, V: tl.constexpr, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr, BKW: tl.constexpr,
    BVW: tl.constexpr, USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_T: tl.constexpr,
    PREC: tl.constexpr, TOT=None, PRE: tl.constexpr = False, QG=None, AQK=None, AU=None,
    FOLD: tl.constexpr = False, KG_DONE: tl.constexpr = False, INV_POW: tl.constexpr = False,
):
    # FOLD (inference, ``FwdConfig.fold_output``): the state pass's output O = qg S + A_qk V' with V' = U − W S is
    # (qg − A_qk W) S + A_qk U, both chunk-local: qg is replaced by qw = qg − A_qk W in place and AU = A_qk U is
    # stored, so the serial pass runs three products per chunk instead of four
    DT: tl.constexpr = W.dtype.element_ty
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NCw + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    t = bos + o_t

    # ---- T
    if INV_POW:
        _diag_inverses_pow(LK, base, BT, BC)
    else:
        _diag_inverses(LK, base, BT, BC)
    _block_merge(LK, base, BT, BC, PREC)
    rb = o_t // BC
    # T's block-lower part is now in the scratch; the upper blocks were never written: masked, read as zeros
    b_t = tl.load(LK + (base * BT + o_t[:, None]) * BT + o_t[None, :], mask=rb[:, None] >= rb[None, :],
                  other=0.).to(DT)
    if STORE_T:
        tl.store(TM + (base * BT + o_t[:, None]) * BT + o_t[None, :], b_t)
    if FOLD:
        b_aq = tl.load(AQK + (base * BT + o_t[:, None]) * BT + o_t[None, :])
    else:
        b_aq = tl.zeros([BT, BT], dtype=DT)  # unused

    # ---- U = T (β V)
    b_b = _chunk_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)
    for sl in tl.static_range(BVP // BVW):  # by column slices too (fewer live registers)
        o_v = sl * BVW + tl.arange(0, BVW)
        b_v = tl.load(v + (t * H + i_h)[:, None] * V + o_v[None, :], mask=(t < eos)[:, None] & (o_v < V)[None, :],
                      other=0.).to(tl.float32)
        p_tv = (base * BT + o_t[:, None]) * BVP + o_v[None, :]
        b_u = tl.dot(b_t, (b_v * b_b[:, None]).to(DT), input_precision=PREC).to(DT)
        tl.store(U + p_tv, b_u)
        if FOLD:
            tl.store(AU + p_tv, tl.dot(b_aq, b_u, input_precision=PREC).to(DT))

    if PRE:
        _solve_w_kg(W, KG, GAM, TOT, base, b_t, BT, BC, BK, BKW, PREC, QG, b_aq, FOLD, KG_DONE)
    else:
        # ---- W = T (β K e^G), kg = K e^{G_C − G}, γ = e^{G_C}: by column slices of BKW (gate and cumsum are per
        # column; the L2 norm needs the whole row first), fewer live registers
        rstd = tl.full([BT], 1.0, tl.float32)
        if L2NORM:
            _, rstd = _l2norm(_chunk_tile(k, i_h, bos, eos, H, K, BT, BK).to(tl.float32), True)
        for sl in tl.static_range(BK // BKW):
            o_k = sl * BKW + tl.arange(0, BKW)
            m_k = o_k < K
            m = (t < eos)[:, None] & m_k[None, :]
            p_in = (t * H + i_h)[:, None] * K + o_k[None, :]
            b_g = _gate_fwd(tl.load(g + p_in, mask=m, other=0.).to(tl.float32), i_h, A_log, dt_bias, lb, o_k, m_k, K,
                            USE_GATE, HAS_LB, HAS_A, HAS_DT)
            b_g = tl.where(m, b_g, 0.) * 1.4426950408889634
            G = tl.cumsum(b_g, axis=0)
            gc = tl.sum(b_g, axis=0)
            b_k = tl.load(k + p_in, mask=m, other=0.).to(tl.float32) * rstd[:, None]
            p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
            _store_w(W, QG, b_aq, tl.dot(b_t, (b_k * tl.exp2(G) * b_b[:, None]).to(DT), input_precision=PREC), p_tk,
                     FOLD, PREC)
            tl.store(KG + p_tk, (b_k * tl.exp2(tl.minimum(gc[None, :] - G, 0.))).to(DT))
            tl.store(GAM + base * BK + o_k, tl.exp2(gc))


def _solve_inverse(cfg) -> str:
    """``FwdConfig.solve_inverse``, checked."""
    mode = cfg.solve_inverse
    if mode not in ("subst", "pow"):
        raise ValueError(f"FwdConfig.solve_inverse: expected 'subst' or 'pow', got {mode!r}")
    return mode


def _launch(warps: int, stages: int, maxnreg: int | None) -> dict:
    """Launch options; ``maxnreg`` caps registers per thread (e.g. 128 → 4 CTAs of 4 warps per SM)."""
    return dict(num_warps=warps, num_stages=stages, **maxnreg_kw(maxnreg))


def launch_prep_rows(q, k, v, g, beta, A_log, dt_bias, bufs: dict, tab: ChunkTable, c0: int, n: int, scale: float,
                     lower_bound, flags: dict, store_t: bool, cfg) -> None:
    """Both kernels over chunks [c0, c0 + n) into the window buffers ``bufs`` (``LD`` = the fp32 [BT, BT] scratch).
    ``cfg``: the FwdConfig class (rows_stack, rows_warps/stages/maxnreg, solve_warps/stages/maxnreg/bkw,
    prep_ab_bf16)."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    BK = bufs["W"].shape[-1]
    BVP = bufs["U"].shape[-1]
    LK = bufs["LD"]
    if tuple(LK.shape[-2:]) != (BT, BT):
        raise RuntimeError("prep_mode 'rows' needs the [BT, BT] scratch: allocate the chunk buffers after setting "
                           "FwdConfig")
    if store_t and bufs["TM"] is bufs["AQK"]:
        raise RuntimeError("storing T needs its own buffer")
    dummy = bufs["GAM"]
    a_log = A_log if A_log is not None else dummy
    dtb = dt_bias if dt_bias is not None else dummy
    lb = float(lower_bound) if lower_bound is not None else 0.0
    ncw = bufs["W"].shape[1]
    common = dict(USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None, HAS_A=A_log is not None,
                  HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"], BETA_SIGMOID=flags["beta_sigmoid"],
                  IS_VARLEN=tab.varlen, PREC=dot_precision(q.dtype))
    pre = bool(cfg.rows_stack and cfg.rows_pre)
    fast = bool(cfg.prep_fast_gate)  # bounded gate and β: σ by rsqrt (pre-pass and stacked rows kernels)
    # E = e^s from the pre-pass through the qg buffer (the exact diagonal of unbounded gates needs s itself). Only
    # where the buffer keeps fp32's exponent range: E reaches 2^-115 within a block under the bound, which fp16
    # flushes to zero (and the diagonal divides by E)
    use_e = (pre and bool(cfg.rows_pre_e) and not flags["exact_diag"]
             and bufs["QG"].dtype in (torch.float32, torch.bfloat16))
    nb = BT // BC
    # kg and γ from the rows kernel's last-block programs; kr of the earlier blocks through its own scratch
    kg_rows = pre and "KR" in bufs
    if pre:
        per = int(cfg.blocks_per_program)
        if per not in (1, 2, 4):
            raise ValueError(f"FwdConfig.blocks_per_program: expected 1, 2 or 4, got {per!r}")
        _prep_blocks[(n * nb // per, H)](
            k, g, a_log, dtb, bufs["KR"] if kg_rows else bufs["KG"], bufs["TOT"],
            tab.cu, tab.chunk_seq, tab.chunk_off, c0, ncw, tab.T, tab.NT, H, K, lb, BT=BT, BC=BC, BK=BK,
            USE_GATE=common["USE_GATE"], HAS_LB=common["HAS_LB"], HAS_A=common["HAS_A"], HAS_DT=common["HAS_DT"],
            L2NORM=common["L2NORM"], IS_VARLEN=common["IS_VARLEN"], PER=per, FAST_GATE=fast,
            E=bufs["QG"], STORE_E=use_e, KG=bufs["KG"], SPLIT_KR=kg_rows, **_launch(cfg.blocks_warps, 1, None))
    extra = dict(KR=bufs["KR"] if kg_rows else bufs["KG"], TOT=bufs["TOT"], X=bufs["W"], PRE=True,
                 LOAD_E=use_e) if pre else {}
    if kg_rows:
        extra.update(KG=bufs["KG"], GAM=bufs["GAM"], KG_OUT=True)
    if cfg.rows_stack:
        extra["FAST_GATE"] = fast
        if pre:
            extra["PREFETCH"] = bool(cfg.rows_prefetch)
    kernel = _prep_rows_qk if cfg.rows_stack else _prep_rows
    kernel[(n * nb, H)](
        q, k, g, beta, a_log, dtb, bufs["QG"], bufs["AQK"], LK,
        tab.cu, tab.chunk_seq, tab.chunk_off, c0, ncw, tab.T, tab.NT, H, K, scale, lb,
        BT=BT, BC=BC, BK=BK, EXACT_DIAG=flags["exact_diag"],
        AB_BF16=bool(cfg.prep_ab_bf16) and q.dtype == torch.bfloat16,
        **extra, **_launch(cfg.rows_warps, cfg.rows_stages, cfg.rows_maxnreg), **common)
    # One column-slice width for U's and W's products: with T [BT, BT] multiplied by slices of two widths (e.g.
    # V-slices of 64 and K-slices of 16 at K = 16, V = 128) Triton 3.6's 16-bit build of this kernel reads shared
    # memory out of range (compute-sanitizer: "Out-of-range shared or local address" at the W product; an illegal
    # address on the H200). Equal widths are what K = V = 128 (64 and 64) always had.
    width = min(BK, BVP, cfg.solve_bkw)
    _prep_solve[(n, H)](
        k, v, g, beta, a_log, dtb, bufs["W"], bufs["U"], bufs["KG"], bufs["GAM"], bufs["TM"], LK,
        tab.cu, tab.chunk_seq, tab.chunk_off, c0, ncw, tab.T, tab.NT, H, K, V, lb,
        BT=BT, BC=BC, BK=BK, BVP=BVP, BKW=width, BVW=width, STORE_T=store_t,
        INV_POW=_solve_inverse(cfg) == "pow",
        **(dict(TOT=bufs["TOT"], PRE=True, KG_DONE=kg_rows) if pre else {}),
        **(dict(QG=bufs["QG"], AQK=bufs["AQK"], AU=bufs["AU"], FOLD=True) if "AU" in bufs else {}),
        **_launch(cfg.solve_warps, cfg.solve_stages, cfg.solve_maxnreg), **common)
