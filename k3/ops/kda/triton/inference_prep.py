"""The 16-token inference prep (FlashKDA's data flow): one light program per 16-token block and head.

Per block (bounded gates only: the right factor k e^{−G} reaches e^{5·16} within a block): the gate activation and
its cumsum G (fp32, log2; from the block start), the L2 norms, β; A_kk and A_qk against the row before the block
(a past row, so no future gate reaches an earlier row even through rounding — fla issue #1240); T = (I + β A_kk)^{-1}
by four-factor products at fp32 accuracy (``_inv_pow``); then what the state pass reads of the block:

    [−W; qw]  (W = Tβ X, X = k̂ e^G; qw = qg − A_qk W, qg = scale·q̂ e^G)   stacked [32, K] per block   → ``X``
    U = Tβ v                                                            row-major [16, V] per block → ``U``
    [I | A_qkᵀ]  (scale·, causal)                                       [16, 32] per block          → ``AQ``
    kg = k̂ e^{G_C − G}                                                  [16, K]                     → ``KG``
    γ = e^{G_C}                                                         [K] fp32                    → ``GAM``

so that the state pass folds the output's A_qk term into one product (``inference_state``). With ``DEC`` it also
writes the block's decay bound (``decay_bound``) for the split's span pass. In the K3 setting on CUDA (bf16,
K = V = 128, the in-kernel norm, β sigmoid and bounded gate) the same prep runs written in Gluon
(``inference_prep_gluon``); every other call takes ``_c16_prep``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton import inference_prep_gluon
from k3.ops.kda.triton._common import (
    BC,
    BT,
    ChunkTable,
    _chunk_pos,
    _chunk_tile,
    _eye,
    _gate_of,
    _l2norm,
    _op,
    _rows_beta,
    dot_precision,
    next_pow2,
)


@triton.jit
def decay_bound(b_g, m_k, BC: tl.constexpr):
    """log2 of an upper bound on the spectral norm of a 16-token block's state transition: BC · the largest log2
    decay in the block (b_g [BC, BK], columns past K masked by ``m_k``; rows past the sequence's end are 0, so a
    partial block claims no decay). Each token's transition (I − β k̂ k̂ᵀ) Diag(α_t) has norm ≤ max_c α_t,c when
    ‖k̂‖ ≤ 1 and β ∈ [0, 1] (the in-kernel L2 norm and β sigmoid), so the block's is ≤ ∏_t max_c α_t,c ≤ (max_t,c
    α_t,c)^BC."""
    return tl.max(tl.max(tl.where(m_k[None, :], b_g, float("-inf")), axis=1), axis=0) * BC


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
def _inv_pow(L, PREC: tl.constexpr):
    """(I + L)^{-1} of a strictly lower-triangular 16×16 block as (I − L)(I + L²)(I + L⁴)(I + L⁸) (L^16 = 0): six
    products instead of a 15-step substitution. The partial products can hold entries far above the result's
    (binomials up to ~3.4e3 when L is all ones: β ≈ 1, repeated keys, no decay), so they run at ~fp32 accuracy
    (``_mm_acc``: 'tf32x3', 'ieee' or, while those entries stay inside fp16's range, 'fp16x3'), never plain tf32
    (FlashKDA's fp16 version returned NaN there)."""
    N = -L
    N2 = _mm_acc(N, N, PREC)
    N4 = _mm_acc(N2, N2, PREC)
    N8 = _mm_acc(N4, N4, PREC)
    D = _eye(L.shape[-1]) + N
    D = D + _mm_acc(D, N2, PREC)
    D = D + _mm_acc(D, N4, PREC)
    return D + _mm_acc(D, N8, PREC)


@triton.jit(do_not_specialize=['c0', 'NCw', 'T', 'NT', 'H'])
def _c16_prep(
    q, k, v, g, beta, A_log, dt_bias, X, KG, GAM, AQ, U,
    cu, chunk_seq, chunk_off, c0, NCw, T, NT, H, K, V, scale, lb,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BVP: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, FAST_GATE: tl.constexpr,
    PREC: tl.constexpr, AB_BF16: tl.constexpr, INV_PREC: tl.constexpr, DEC=None, DEC_OUT: tl.constexpr = False,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    NB: tl.constexpr = BT // BC
    i_c = i_b // NB
    blk = i_b % NB
    bos, eos = _chunk_pos(c0 + i_c, cu, chunk_seq, chunk_off, T, NT, BT, IS_VARLEN)
    t0 = bos + blk * BC
    # Written in the order that keeps few [16, K] fp32 tiles live at once (each is 32 registers per thread at 2
    # warps): every operand is stored or narrowed to the store dtype as soon as it is formed
    base = (i_h * NCw + i_c).to(tl.int64)
    bidx = base * NB + blk  # the block's index in the window buffers
    o_s = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    row = base * BT + blk * BC + o_s
    p = row[:, None] * BK + o_k[None, :]
    DT = X.dtype.element_ty
    # every input load issued before the first use: one DRAM latency per program, not four
    r_g = _chunk_tile(g, i_h, t0, eos, H, K, BC, BK)
    r_k = _chunk_tile(k, i_h, t0, eos, H, K, BC, BK)
    r_q = _chunk_tile(q, i_h, t0, eos, H, K, BC, BK)
    r_v = _chunk_tile(v, i_h, t0, eos, H, V, BC, BVP)
    b_b = _rows_beta(beta, i_h, t0, eos, H, BC, BETA_SIGMOID)
    b_g = _gate_of(r_g, A_log, dt_bias, i_h, t0, eos, K, lb, BC, BK, USE_GATE, HAS_LB, HAS_A, HAS_DT, FAST_GATE)
    G = tl.cumsum(b_g, axis=0)  # log2 decay from the block start through row i (padding rows add 0)
    gam = tl.exp2(tl.sum(b_g, axis=0))  # ... through the block's last row: γ = e^{G_C}
    tl.store(GAM + bidx * BK + o_k, gam)
    if DEC_OUT:  # the block's decay bound for the split's span pass (``decay_bound``)
        tl.store(DEC + bidx, decay_bound(b_g, o_k < K, BC))
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
    qe = _l2norm(r_q.to(tl.float32), L2NORM)[0] * e
    aq = tl.dot(_op(qe, AB_BF16), kd, input_precision=PREC)
    aq = tl.where(o_s[:, None] >= o_s[None, :], aq, 0.) * scale
    qg_dt = (qe * scale).to(DT)
    lk = tl.where(o_s[:, None] > o_s[None, :], ak * b_b[:, None], 0.)
    tm = _inv_pow(lk, INV_PREC)
    tb = tm * b_b[None, :]
    o_v = tl.arange(0, BVP)
    tbo = tb.to(DT)
    w_dt = tl.dot(tbo, x_dt, input_precision=PREC).to(DT)
    u32 = tl.dot(tbo, r_v.to(DT), input_precision=PREC)
    u = u32.to(DT)
    # stacked per block: rows [32·b, 32·b + 16) −W, rows [32·b + 16, 32·b + 32) qw
    row2 = bidx * (2 * BC) + o_s
    aqo = aq.to(DT)
    qw = qg_dt.to(tl.float32) - tl.dot(aqo, w_dt, input_precision=PREC)
    tl.store(X + row2[:, None] * BK + o_k[None, :], -w_dt)
    tl.store(X + (row2 + BC)[:, None] * BK + o_k[None, :], qw.to(DT))
    # U row-major [16, BVP] and [I | A_qkᵀ] [16, 32] per block: the state pass forms A_qk U itself
    tl.store(U + bidx * (BC * BVP) + o_s[:, None] * BVP + o_v[None, :], u)
    p_ia = AQ + bidx * (BC * 2 * BC) + o_s[:, None] * (2 * BC) + o_s[None, :]
    tl.store(p_ia, _eye(BC).to(DT))
    tl.store(AQ + bidx * (BC * 2 * BC) + o_s[None, :] * (2 * BC) + BC + o_s[:, None], aqo)  # A_qkᵀ


# ---------------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------------


def inv_prec(flags: dict, lower_bound) -> str:
    """The inverse's product precision: 'fp16x3' needs |β A_kk| ≤ 1 — unit keys (the in-kernel L2 norm), β in (0, 1)
    (the in-kernel sigmoid) and decays ≤ 1 (the bounded in-kernel gate) — so the partial sums stay ≤ 2^14, inside
    fp16's range (H200, prep per 1M tokens at H = 32: 27.4 ms at tf32x3, 24.9 at fp16x3); other calls use
    'tf32x3'."""
    bounded = flags["l2norm"] and flags["beta_sigmoid"] and flags["use_gate"] and lower_bound is not None
    return "fp16x3" if bounded else "tf32x3"


def alloc_c16_buffers(H: int, NC: int, BK: int, BVP: int, dt: torch.dtype, device,
                      decay_bound: bool = False) -> dict:
    """The window buffers of ``NC`` chunks (see the module docstring); ``decay_bound``: also "DEC" [H, NC, BT / BC]
    fp32, each block's ``decay_bound``, which the preps then write (the split's span pass reads it)."""
    e = dict(dtype=dt, device=device)
    bufs = {
        "X": torch.empty(H, NC, 2 * BT, BK, **e),
        "KG": torch.empty(H, NC, BT, BK, **e),
        "GAM": torch.empty(H, NC, BT // BC, BK, dtype=torch.float32, device=device),
        "U": torch.empty(H, NC, BT, BVP, **e),
        "AQ": torch.empty(H, NC, BT, 2 * BC, **e),
    }
    if decay_bound:
        bufs["DEC"] = torch.empty(H, NC, BT // BC, dtype=torch.float32, device=device)
    return bufs


def c16_chunk_bytes(H: int, BK: int, BVP: int, dt: torch.dtype) -> int:
    """Bytes of window buffers per 64-token chunk (all heads)."""
    es = torch.finfo(dt).bits // 8
    return H * (BT * (3 * BK + BVP + 2 * BC) * es + (BT // BC) * BK * 4)


def c16_window_chunks(NC: int, budget: int, H: int, BK: int, BVP: int, dt: torch.dtype) -> int:
    """Chunks per window of buffers within ``budget`` bytes: at least 1, at most NC and 16383."""
    return max(1, min(NC, 16383, budget // c16_chunk_bytes(H, BK, BVP, dt)))


def launch_c16_prep(q, k, v, g, beta, A_log, dt_bias, bufs: dict, tab: ChunkTable, c0: int, n: int, scale: float,
                    lower_bound, flags: dict) -> None:
    """The prep over chunks [c0, c0 + n) of ``tab`` into the window buffers: the Gluon kernel where it applies
    (``inference_prep_gluon.usable``), else ``_c16_prep``."""
    _, _, H, K = q.shape
    V = v.shape[-1]
    prec = inv_prec(flags, lower_bound)
    if inference_prep_gluon.usable(q, K, V, flags, lower_bound, prec):
        inference_prep_gluon.launch(q, k, v, g, beta, A_log, dt_bias, bufs, tab, c0, n, scale, lower_bound, BT, BC)
        return
    BK = bufs["X"].shape[-1]
    dummy = bufs["GAM"]
    _c16_prep[(n * (BT // BC), H)](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        bufs["X"], bufs["KG"], bufs["GAM"], bufs["AQ"], bufs["U"],
        tab.cu, tab.chunk_seq, tab.chunk_off, c0, bufs["X"].shape[1], tab.T, tab.NT, H, K, V, scale,
        float(lower_bound) if lower_bound is not None else 0.0,
        BT=BT, BC=BC, BK=BK, BVP=next_pow2(V), USE_GATE=flags["use_gate"], HAS_LB=lower_bound is not None,
        HAS_A=A_log is not None, HAS_DT=dt_bias is not None, L2NORM=flags["l2norm"],
        BETA_SIGMOID=flags["beta_sigmoid"], IS_VARLEN=tab.varlen, FAST_GATE=lower_bound is not None,
        PREC=dot_precision(q.dtype), AB_BF16=q.dtype == torch.bfloat16, INV_PREC=prec,
        DEC=bufs.get("DEC"), DEC_OUT="DEC" in bufs, num_warps=2, num_stages=1,
    )
