"""The 64-token prep: per chunk of BT = 64 tokens (four 16-row blocks), the buffers the state passes read.

Outputs per (chunk, head), into window buffers ``[H, NC, ...]``: qg = scale·q̂ e^G, A_qk (scale·, lower), W = T X
with X = β k̂ e^G, U = T (β v), kg = k̂ e^{G_C − G}, γ = e^{G_C}, and T = (I + β A_kk)^{-1} when training (the
backward needs it). G is the within-chunk cumsum of the log2 gate (fp32).

Three kernels, each with many light programs:

``_prep_blocks`` — one program per 16-row block J (grid (4·chunks, H)): the gate (fused activation, fp32 log2), the
block total tot_J, kr_J = k̂_J e^{tot_J − s_J} (≤ 1; s = within-block cumsum) into the ``KR`` scratch (the last
block's kr is already its kg: straight into ``KG``), and — bounded gates, bf16/fp32 buffers — E_J = e^{s_J} into
the block's qg rows, so the rows kernel need not recompute the gate, cumsum and exponentials.

``_prep_rows`` — one program per row block I of A (grid (4·chunks, H)), q and k of the block interleaved into ONE
[32, K] left operand (one tensor-core product per block pair). The reference row of block I is the last row of
block I − 1 (carry c_I), a PAST row:

    A[i, j] = Σ_d (x_id e^{G_id − c_I}) · (k_jd e^{c_I − G_jd})

The left factor is ≤ 1; the right one is ≤ 1 for earlier blocks J < I and ≤ e^{5·15} inside block I under the
bounded gate. Row i reads gates of rows ≤ i only, so future inputs cannot reach earlier outputs even through
rounding (fla issue #1240). Exponents are partial sums taken directly (within-block cumsums, block totals summed
backwards from block I), never differences of whole-chunk cumsums. Unbounded gates (``EXACT_DIAG``) take an exact
per-column loop for the diagonal block. Writes A_qk's row block, L = β A_kk (fp32 scratch ``LK [BT, BT]``), qg,
X (into W's rows, solved in place), and — the program of the chunk's last block, which loads every earlier kr_J
anyway — kg_J = kr_J e^{Σ_{J' > J} tot_J'} and γ.

``_prep_solve`` — one program per (chunk, head): T = (I + L)^{-1} from the scratch (the four 16×16 diagonal inverses
by forward substitution on one stacked [64, 16] tile, then the block merge by 16×16 blocks), W = T X, U = T (β v)
by column slices of one width.
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
    _l2norm,
    _merge_T,
    _op,
    _rows_gate,
    _sigmoid_fast,
    dot_precision,
)

# Launch settings (H200, 1M tokens at H = 32): the rows kernel at 4 warps capped at 128 registers (4 programs per
# SM), the solve at 96 (5 per SM), the pre-pass at 2 warps; W and U formed by 64-column slices.
_ROWS_MAXNREG = 128
_SOLVE_MAXNREG = 96
_SOLVE_SLICE = 64


@triton.jit
def _rows_x(x, i_h, t0, eos, H, K, BC: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    """Tokens [t0, t0 + BC) of q or k [T, H, K], fp32 [BC, BK], L2-normalized if asked; zero outside."""
    b_x, _ = _l2norm(_chunk_tile(x, i_h, t0, eos, H, K, BC, BK).to(tl.float32), L2NORM)
    return b_x


@triton.jit
def _tile_ptr(ptr, base, r0, c0, BT: tl.constexpr, BC: tl.constexpr):
    """Pointers of the [BC, BC] tile at rows r0.., columns c0.. of the [BT, BT] chunk matrix number ``base``."""
    o_s = tl.arange(0, BC)
    return ptr + (base * BT + r0 + o_s[:, None]) * BT + c0 + o_s[None, :]


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _prep_blocks(
    k, g, A_log, dt_bias, KR, TOT, KG, E,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_E: tl.constexpr,
):
    """Per 16-row block J of a chunk (grid (4·chunks, H)), what later row blocks need of it, computed once instead of
    once per (row block, J) pair: kr_J = k̂_J e^{tot_J − s_J} (≤ 1, relative to the block's last row) and
    tot_J = Σ_{j∈J} g_j (log2, fp32, into ``TOT``). The chunk's last block's kr is its kg (no later block decays it):
    into ``KG``; the others into ``KR``. ``STORE_E``: also E_J = e^{s_J} (≤ 1, the within-block decay of each row:
    rows ≤ i only) into the block's rows of ``E`` (the qg buffer, which the rows kernel reads and then overwrites
    with qg). The bounded gate's σ runs as ``_sigmoid_fast`` with the gate scale folded in."""
    NB: tl.constexpr = BT // BC
    pid = tl.program_id(0)
    i_c = pid // NB
    J = pid % NB
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NCw + i_c).to(tl.int64)
    tJ = bos + J * BC
    g_J = _rows_gate(g, A_log, dt_bias, i_h, tJ, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT, True)
    k_J = _rows_x(k, i_h, tJ, eos, H, K, BC, BK, L2NORM)
    tot = tl.sum(g_J, axis=0)
    s_J = tl.cumsum(g_J, axis=0)
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    p = (base * BT + J * BC + o_s[:, None]) * BK + o_k[None, :]
    kr = (k_J * tl.exp2(tot[None, :] - s_J)).to(KR.dtype.element_ty)
    tl.store(tl.where(J == NB - 1, KG + p, KR + p), kr)
    tl.store(TOT + (base * NB + J) * BK + o_k, tot)
    if STORE_E:
        tl.store(E + p, tl.exp2(s_J).to(E.dtype.element_ty))


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
def _prep_rows(
    q, k, g, beta, A_log, dt_bias, QG, AQK, LK, KR, TOT, X, KG, GAM,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, K: tl.constexpr, scale, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr,
    EXACT_DIAG: tl.constexpr, PREC: tl.constexpr, AB_BF16: tl.constexpr, LOAD_E: tl.constexpr,
):
    """Row block I of one chunk's A_qk and L = β A_kk (see the module docstring). ``LOAD_E``: E = e^s of the block
    from the pre-pass (the qg rows, overwritten here with qg) instead of the gate, its cumsum and the exponentials
    again (bounded gates with bf16/fp32 buffers: E reaches 2^-115 within a block, below fp16's range)."""
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
    # block I−1's kr and total (the first earlier block) loaded ahead of any use; each loop step loads the next
    n_tot, n_kr = _kr_tot(KR, TOT, base, I - 1, I > 0, BT, BC, BK)
    b_b2 = tl.load(beta + (t0 + tok) * H + i_h, mask=(t0 + tok) < eos, other=0.).to(tl.float32)  # β of token(r)
    if BETA_SIGMOID:
        b_b2 = _sigmoid_fast(b_b2)

    # ---- own rows: s = within-block cumsum (G_i − c_I exactly as summed); gate and exponentials on the 16
    # tokens, then repeated onto rows 2i and 2i+1 of the interleaved tile
    x = _rows_qk(q, k, i_h, t0, eos, H, K, BC, BK, L2NORM)
    if LOAD_E:
        e16 = e_raw.to(tl.float32)
    else:
        s16 = tl.cumsum(_rows_gate(g, A_log, dt_bias, i_h, t0, eos, H, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A,
                                   HAS_DT, True), axis=0)
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

    # ---- earlier blocks J = I−1 … 0 (right factor k_j e^{c_I − G_j} = kr_J e^{d} ≤ 1, d = Σ_{J<J'<I} tot_J')
    d = tl.zeros([BK], dtype=tl.float32)
    allk = (o_r >= 0)[:, None] & (o_j >= 0)[None, :]
    last = I == NB - 1
    for jj in range(0, I):
        J = I - 1 - jj
        p_kr = (base * BT + J * BC + o_j[:, None]) * BK + o_k[None, :]
        tot, kJ = n_tot, n_kr.to(tl.float32)
        n_tot, n_kr = _kr_tot(KR, TOT, base, J - 1, jj + 1 < I, BT, BC, BK)
        kr = _op(tl.trans(kJ * tl.exp2(d)[None, :]), AB_BF16)
        # the last block's program: d + block I's total = every later block of the chunk → kg_J (block I's total
        # reloaded here, an L1 hit, rather than held across the loop)
        if last:
            tot_i = tl.load(TOT + (base * NB + I) * BK + o_k)
            tl.store(KG + p_kr, (kJ * tl.exp2(d + tot_i)[None, :]).to(KG.dtype.element_ty))
        _store_qk_rows(AQK, LK, base, r0, J * BC, tl.dot(xo, kr, input_precision=PREC), b_b2, scale, allk, o_j,
                       o_j >= 0, BT, BC)
        d += tot
    if last:
        tl.store(GAM + base * BK + o_k, tl.exp2(d + tl.load(TOT + (base * NB + I) * BK + o_k)))
    # qg = scale · q e^{c_I + s} from the even rows (d = c_I now), X = β k̂ e^{s + c_I} from the odd rows, for the
    # solve's W = T X (into W, solved in place): one scaled tile, two masked stores
    p_out = (base * BT + r0 + tok[:, None]) * BK + o_k[None, :]
    even = (o_r % 2 == 0)[:, None] & (o_k >= 0)[None, :]
    if LOAD_E:
        tl.debug_barrier()  # every thread has read its E rows before qg overwrites them (other layouts, other threads)
    y = (xl * tl.exp2(d)[None, :]) * tl.where(o_r % 2 == 0, scale, b_b2)[:, None]
    tl.store(QG + p_out, y.to(QG.dtype.element_ty), mask=even)
    tl.store(X + p_out, y.to(X.dtype.element_ty), mask=(o_r % 2 == 1)[:, None] & (o_k >= 0)[None, :])
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
def _block_merge(LK, base, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Below-diagonal blocks of T = (I + L)^{-1} from the scratch ``LK[base]`` (D_J = T_JJ on the diagonal blocks,
    L below them), by 16×16 blocks: T_IJ = −D_I Σ_{J≤M<I} L_IM T_MJ. Written back over L's blocks, so that the
    caller reloads the whole T as one [BT, BT] tile.

    Why 16×16 blocks and not the [64, 64] product chain (I − M)(I + M²) D: on sm_90 the whole-tile fp32 products
    become tf32 wgmma with the left operand in registers, fed from the previous product's accumulator; that chain
    gave garbage (NaN, T off by O(1)) on an H200 while the interpreter was right. 16×16 fp32 products lower to
    mma.sync, which is correct on the same GPU."""
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


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _prep_solve(
    v, beta, W, U, TM, LK,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT,
    H, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr, BKW: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, STORE_T: tl.constexpr, PREC: tl.constexpr,
):
    """T = (I + L)^{-1}, W = T X (X read from W's own rows, solved in place), U = T (β v), by column slices of BKW
    (one width for both products: T [BT, BT] times slices of two widths, e.g. 64 and 16 at K = 16, V = 128, made
    Triton 3.6's 16-bit build read shared memory out of range on an H200). ``STORE_T``: also T (training)."""
    DT: tl.constexpr = W.dtype.element_ty
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    base = (i_h * NCw + i_c).to(tl.int64)
    o_t = tl.arange(0, BT)
    t = bos + o_t

    # ---- T
    _diag_inverses(LK, base, BT, BC)
    _block_merge(LK, base, BT, BC, PREC)
    rb = o_t // BC
    # T's block-lower part is now in the scratch; the upper blocks were never written: masked, read as zeros
    b_t = tl.load(LK + (base * BT + o_t[:, None]) * BT + o_t[None, :], mask=rb[:, None] >= rb[None, :],
                  other=0.).to(DT)
    if STORE_T:
        tl.store(TM + (base * BT + o_t[:, None]) * BT + o_t[None, :], b_t)

    # ---- U = T (β V)
    b_b = _chunk_beta(beta, i_h, bos, eos, H, BT, BETA_SIGMOID)
    for sl in tl.static_range(BVP // BKW):  # by column slices (fewer live registers)
        o_v = sl * BKW + tl.arange(0, BKW)
        b_v = tl.load(v + (t * H + i_h)[:, None] * V + o_v[None, :], mask=(t < eos)[:, None] & (o_v < V)[None, :],
                      other=0.).to(tl.float32)
        p_tv = (base * BT + o_t[:, None]) * BVP + o_v[None, :]
        tl.store(U + p_tv, tl.dot(b_t, (b_v * b_b[:, None]).to(DT), input_precision=PREC).to(DT))

    # ---- W = T X, in place over X
    for sl in tl.static_range(BK // BKW):
        o_k = sl * BKW + tl.arange(0, BKW)
        p_tk = (base * BT + o_t[:, None]) * BK + o_k[None, :]
        tl.store(W + p_tk, tl.dot(b_t, tl.load(W + p_tk), input_precision=PREC).to(DT))


# ---------------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------------


def alloc_chunk_buffers(H: int, NC: int, BK: int, BVP: int, dt: torch.dtype, device, store_t: bool) -> dict:
    """The buffers of ``NC`` chunks: W, U, KG, QG, AQK in the store dtype, GAM fp32; TM (T, training only); the
    prep's fp32 scratches LD (L = β A_kk, [BT, BT] per chunk) and TOT (block gate totals), and KR (kr of the
    earlier blocks: U's memory when V = K, which the solve fills only after the rows kernel has read it)."""
    e = dict(dtype=dt, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    bufs = {
        "W": torch.empty(H, NC, BT, BK, **e),
        "U": torch.empty(H, NC, BT, BVP, **e),
        "KG": torch.empty(H, NC, BT, BK, **e),
        "QG": torch.empty(H, NC, BT, BK, **e),
        "AQK": torch.empty(H, NC, BT, BT, **e),
        "GAM": torch.empty(H, NC, BK, **f32),
    }
    bufs["TM"] = torch.empty(H, NC, BT, BT, **e) if store_t else bufs["AQK"]
    bufs["LD"] = torch.empty(H, NC, BT, BT, **f32)
    bufs["TOT"] = torch.empty(H, NC, BT // BC, BK, **f32)
    bufs["KR"] = bufs["U"] if BVP == BK else torch.empty(H, NC, BT, BK, **e)
    return bufs


def chunk_bytes(H: int, BK: int, BVP: int, dt: torch.dtype) -> int:
    """Bytes of window buffers per chunk (all heads), T not stored (inference)."""
    es = torch.finfo(dt).bits // 8
    kr = BT * BK * es if BVP != BK else 0
    return H * (BT * (3 * BK + BVP + BT) * es + BK * 4 + BT * BT * 4 + (BT // BC) * BK * 4 + kr)


def launch_prep(q, k, v, g, beta, A_log, dt_bias, bufs: dict, tab: ChunkTable, c0: int, n: int, scale: float,
                lower_bound, flags: dict, store_t: bool) -> None:
    """The three prep kernels over chunks [c0, c0 + n) of ``tab`` into the window buffers ``bufs``."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    BK = bufs["W"].shape[-1]
    BVP = bufs["U"].shape[-1]
    if store_t and bufs["TM"] is bufs["AQK"]:
        raise RuntimeError("storing T needs its own buffer")
    dummy = bufs["GAM"]
    a_log = A_log if A_log is not None else dummy
    dtb = dt_bias if dt_bias is not None else dummy
    lb = float(lower_bound) if lower_bound is not None else 0.0
    ncw = bufs["W"].shape[1]
    gate = dict(USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None, HAS_A=A_log is not None,
                HAS_DT=dt_bias is not None)
    common = dict(L2NORM=flags["l2norm"], IS_VARLEN=tab.varlen)
    # E = e^s from the pre-pass through the qg buffer (the exact diagonal of unbounded gates needs s itself). Only
    # where the buffer keeps fp32's exponent range: E reaches 2^-115 within a block under the bound, which fp16
    # flushes to zero (and the diagonal divides by E)
    use_e = not flags["exact_diag"] and bufs["QG"].dtype in (torch.float32, torch.bfloat16)
    nb = BT // BC
    table = (tab.cu, tab.chunk_seq, tab.chunk_off, c0, ncw, tab.T, tab.NT)
    _prep_blocks[(n * nb, H)](
        k, g, a_log, dtb, bufs["KR"], bufs["TOT"], bufs["KG"], bufs["QG"], *table, H, K, lb, BT=BT, BC=BC, BK=BK,
        **gate, **common, STORE_E=use_e, num_warps=2, num_stages=1)
    _prep_rows[(n * nb, H)](
        q, k, g, beta, a_log, dtb, bufs["QG"], bufs["AQK"], bufs["LD"], bufs["KR"], bufs["TOT"], bufs["W"],
        bufs["KG"], bufs["GAM"], *table, H, K, scale, lb, BT=BT, BC=BC, BK=BK, **gate, **common,
        BETA_SIGMOID=flags["beta_sigmoid"], EXACT_DIAG=flags["exact_diag"], PREC=dot_precision(q.dtype),
        AB_BF16=q.dtype == torch.bfloat16, LOAD_E=use_e, num_warps=4, num_stages=1, maxnreg=_ROWS_MAXNREG)
    _prep_solve[(n, H)](
        v, beta, bufs["W"], bufs["U"], bufs["TM"], bufs["LD"], *table, H, V, BT=BT, BC=BC, BK=BK, BVP=BVP,
        BKW=min(BK, BVP, _SOLVE_SLICE), BETA_SIGMOID=flags["beta_sigmoid"], IS_VARLEN=tab.varlen,
        STORE_T=store_t, PREC=dot_precision(q.dtype), num_warps=4, num_stages=1, maxnreg=_SOLVE_MAXNREG)
