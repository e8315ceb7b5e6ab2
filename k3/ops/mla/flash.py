"""Flash attention for MLA's expanded form (q·k over nope + rope, v of its own width), forward and backward in Triton.

Layout ``[B, T, H, D]`` (the layer's natural one: no transposes), any strides with a contiguous last dimension.
Key j is visible to query i of batch row b iff ``j ≤ i + shift[b]`` (see ``naive.py``): training is ``shift = 0``,
a chunk over a cache segment is ``shift = start − segment start``. The forward returns the log-sum-exp so that
attention over several key segments can be merged exactly (``prefill.py``); the backward takes its gradient too.

The q·k head dim (192 at K3 = 128 nope + 64 rope, 96 at ``small``) is not a power of two: it is handled as two
power-of-two column blocks D1 + D2 (two dots into the same scores) instead of padding to 256, so no FLOP is spent
on padding; v keeps its own width (128), so nothing is padded on the output side either. Softmax statistics
(running max, sum, LSE) and accumulators are fp32 in registers; q, k, v are read in their own dtype (bf16).

Kernels (FlashAttention-2 schedule): ``attn_fwd_kernel`` (one program per (query block, batch·head), loops over
the visible key blocks, unmasked blocks first), ``attn_bwd_delta_kernel`` (δ = rowsum(o ∘ do) − dlse),
``attn_bwd_dkdv_kernel`` (one program per key block: loops over the query blocks that see it) and
``attn_bwd_dq_kernel`` (one program per query block) — no atomics, so the results are deterministic.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of
from k3.ops.kda.triton._common import RCP_LN2  # importing it also patches the interpreter's loop bounds

__all__ = ["flash_attention_fwd", "flash_attention_bwd", "head_blocks"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def head_blocks(D: int) -> tuple[int, int]:
    """A head dim as two power-of-two column blocks ``(D1, D2)``, each ≥ 16 (the MMA minimum), D1 + D2 ≥ D;
    D2 = 0 when one block is exact. 192 → (128, 64), 96 → (64, 32), 128 → (128, 0)."""
    D1 = max(16, 1 << (D.bit_length() - 1))
    rest = D - D1
    return D1, (0 if rest <= 0 else max(16, triton.next_power_of_2(rest)))


def _configs(pairs: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BM": 16, "BN": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in pairs]


# (BM, BN, warps, stages); few, so that tuning all three kernels costs seconds per head-dim pair
_FWD = _configs([(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)])
_DKDV = _configs([(64, 64, 8, 2), (32, 64, 4, 3)])
_DQ = _configs([(64, 64, 8, 2), (128, 32, 8, 2)])
_DELTA = [triton.Config({"BM": 16 if _INTERPRET else 64}, num_warps=4)]


# --------------------------------------------------------------------------------------------------- helpers
@triton.jit
def load_tile(base, o_r, o_c, stride_r, n_r, n_c, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    """Load ``base[o_r, o_c]`` (row stride ``stride_r``, contiguous columns), zero outside ``n_r`` × ``n_c``."""
    p = base + o_r[:, None].to(tl.int64) * stride_r + o_c[None, :]
    if MASK_R and MASK_C:
        x = tl.load(p, mask=(o_r[:, None] < n_r) & (o_c[None, :] < n_c), other=0.0)
    elif MASK_R:
        x = tl.load(p, mask=o_r[:, None] < n_r, other=0.0)
    elif MASK_C:
        x = tl.load(p, mask=o_c[None, :] < n_c, other=0.0)
    else:
        x = tl.load(p)
    return x


@triton.jit
def store_tile(base, x, o_r, o_c, stride_r, n_r, n_c, MASK_C: tl.constexpr):
    p = base + o_r[:, None].to(tl.int64) * stride_r + o_c[None, :]
    if MASK_C:
        tl.store(p, x, mask=(o_r[:, None] < n_r) & (o_c[None, :] < n_c))
    else:
        tl.store(p, x, mask=o_r[:, None] < n_r)


@triton.jit
def _scores(qa, qb, ka, kb, D2: tl.constexpr, PREC: tl.constexpr):
    """``qa·kaᵀ (+ qb·kbᵀ)``: the two column blocks of the q·k head dim into one fp32 score tile."""
    s = tl.dot(qa, tl.trans(ka), input_precision=PREC)
    if D2 > 0:
        s += tl.dot(qb, tl.trans(kb), input_precision=PREC)
    return s


@triton.jit
def _shift(shift_ptr, shift0, i_b, HAS_SHIFT: tl.constexpr):
    s = shift0
    if HAS_SHIFT:
        s += tl.load(shift_ptr + i_b)
    return s


# --------------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_blocks(acc, l_i, m_i, q1, q2, k_base, v_base, s_kt, s_vt, lo, hi, o_m, shift, L, qk_scale,
                D: tl.constexpr, DVR: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                BN: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Online softmax over key blocks [lo, hi); MASKED applies the causal/bounds mask (the diagonal blocks)."""
    o_d1 = tl.arange(0, D1)
    o_dv = tl.arange(0, DV)
    for start_n in range(lo, hi, BN):
        o_n = start_n + tl.arange(0, BN)
        k1 = load_tile(k_base, o_n, o_d1, s_kt, L, D, MASKED, D1 > D)
        k2 = k1
        if D2 > 0:
            k2 = load_tile(k_base + D1, o_n, tl.arange(0, D2), s_kt, L, D - D1, MASKED, D1 + D2 > D)
        s = _scores(q1, q2, k1, k2, D2, PREC) * qk_scale
        if MASKED:
            vis = (o_n[None, :] <= o_m[:, None] + shift) & (o_n[None, :] < L)
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:  # a row with no visible key so far keeps m = −inf; subtract 0 there instead of −inf
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.exp2(s - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = load_tile(v_base, o_n, o_dv, s_vt, L, DVR, MASKED, DV > DVR)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD, key=["D", "DVR", "HAS_SHIFT", "PREC"])
@triton.jit
def attn_fwd_kernel(q, k, v, o, lse, shift_ptr, T, L, H, shift0,
                    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_ob, s_ot, s_oh, qk_scale,
                    D: tl.constexpr, DVR: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                    HAS_SHIFT: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    shift = _shift(shift_ptr, shift0, i_b, HAS_SHIFT)
    q_base = q + i_b.to(tl.int64) * s_qb + i_h * s_qh
    k_base = k + i_b.to(tl.int64) * s_kb + i_h * s_kh
    v_base = v + i_b.to(tl.int64) * s_vb + i_h * s_vh
    o_m = i_m * BM + tl.arange(0, BM)
    q1 = load_tile(q_base, o_m, tl.arange(0, D1), s_qt, T, D, True, D1 > D)
    q2 = q1
    if D2 > 0:
        q2 = load_tile(q_base + D1, o_m, tl.arange(0, D2), s_qt, T, D - D1, True, D1 + D2 > D)

    acc = tl.zeros([BM, DV], dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    # keys [0, n_full) are visible to every row of the block; [n_full, n_end) need the mask
    n_full = tl.maximum(tl.minimum(i_m * BM + shift + 1, L), 0) // BN * BN
    n_end = tl.maximum(tl.minimum(tl.minimum(i_m * BM + BM, T) + shift, L), 0)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q1, q2, k_base, v_base, s_kt, s_vt, 0, n_full, o_m, shift, L,
                                qk_scale, D, DVR, D1, D2, DV, BN, False, PREC)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q1, q2, k_base, v_base, s_kt, s_vt, n_full, n_end, o_m, shift, L,
                                qk_scale, D, DVR, D1, D2, DV, BN, True, PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row that sees no key: o = 0, lse = −inf
    out = acc / l_safe[:, None]
    store_tile(o + i_b.to(tl.int64) * s_ob + i_h * s_oh, out.to(o.dtype.element_ty), o_m, tl.arange(0, DV), s_ot,
                T, DVR, DV > DVR)
    lse_v = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(lse + i_bh.to(tl.int64) * T + o_m, lse_v, mask=o_m < T)


# -------------------------------------------------------------------------------------------------- backward
@triton.autotune(configs=_DELTA, key=["DVR"])
@triton.jit
def attn_bwd_delta_kernel(o, do, dlse, delta, T, H, s_ob, s_ot, s_oh, s_db, s_dt, s_dh,
                          DVR: tl.constexpr, DV: tl.constexpr, HAS_DLSE: tl.constexpr, BM: tl.constexpr):
    """δ_i = Σ_v o_iv · do_iv − dlse_i (fp32): the softmax backward's row term (dlse enters as ∂lse/∂s = p)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_m = i_m * BM + tl.arange(0, BM)
    o_v = tl.arange(0, DV)
    oo = load_tile(o + i_b.to(tl.int64) * s_ob + i_h * s_oh, o_m, o_v, s_ot, T, DVR, True, DV > DVR)
    dd = load_tile(do + i_b.to(tl.int64) * s_db + i_h * s_dh, o_m, o_v, s_dt, T, DVR, True, DV > DVR)
    d = tl.sum(oo.to(tl.float32) * dd.to(tl.float32), 1)
    if HAS_DLSE:
        d -= tl.load(dlse + i_bh.to(tl.int64) * T + o_m, mask=o_m < T, other=0.0)
    tl.store(delta + i_bh.to(tl.int64) * T + o_m, d, mask=o_m < T)


@triton.jit
def _dkdv_blocks(dk1, dk2, dv, k1, k2, vv, q_base, do_base, lse_base, delta_base, s_qt, s_dt, lo, hi, o_n, shift,
                 T, qk_scale, D: tl.constexpr, DVR: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                 DV: tl.constexpr, BM: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Accumulate dk, dv of one key block over the query blocks [lo, hi) (transposed scores [BN, BM])."""
    o_d1 = tl.arange(0, D1)
    o_dv = tl.arange(0, DV)
    for start_m in range(lo, hi, BM):
        o_m = start_m + tl.arange(0, BM)
        q1 = load_tile(q_base, o_m, o_d1, s_qt, T, D, True, D1 > D)
        q2 = q1
        if D2 > 0:
            q2 = load_tile(q_base + D1, o_m, tl.arange(0, D2), s_qt, T, D - D1, True, D1 + D2 > D)
        do = load_tile(do_base, o_m, o_dv, s_dt, T, DVR, True, DV > DVR)
        # rows past T get lse = +inf → p = 0
        lse2 = tl.load(lse_base + o_m, mask=o_m < T, other=float("inf")) * 1.4426950408889634
        dlt = tl.load(delta_base + o_m, mask=o_m < T, other=0.0)
        sT = _scores(k1, k2, q1, q2, D2, PREC)
        pT = tl.exp2(sT * qk_scale - lse2[None, :])
        if MASKED:
            pT = tl.where(o_n[:, None] <= o_m[None, :] + shift, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PREC)
        dpT = tl.dot(vv, tl.trans(do), input_precision=PREC)
        dsT = (pT * (dpT - dlt[None, :])).to(q1.dtype)
        dk1 += tl.dot(dsT, q1, input_precision=PREC)
        if D2 > 0:
            dk2 += tl.dot(dsT, q2, input_precision=PREC)
    return dk1, dk2, dv


@triton.autotune(configs=_DKDV, key=["D", "DVR", "HAS_SHIFT", "PREC"])
@triton.jit
def attn_bwd_dkdv_kernel(q, k, v, do, lse, delta, dk, dv, shift_ptr, T, L, H, shift0,
                         s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_db, s_dt, s_dh,
                         s_kgb, s_kgt, s_kgh, s_vgb, s_vgt, s_vgh, qk_scale, scale,
                         D: tl.constexpr, DVR: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                         HAS_SHIFT: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    shift = _shift(shift_ptr, shift0, i_b, HAS_SHIFT)
    o_n = i_n * BN + tl.arange(0, BN)
    k_base = k + i_b.to(tl.int64) * s_kb + i_h * s_kh
    k1 = load_tile(k_base, o_n, tl.arange(0, D1), s_kt, L, D, True, D1 > D)
    k2 = k1
    if D2 > 0:
        k2 = load_tile(k_base + D1, o_n, tl.arange(0, D2), s_kt, L, D - D1, True, D1 + D2 > D)
    vv = load_tile(v + i_b.to(tl.int64) * s_vb + i_h * s_vh, o_n, tl.arange(0, DV), s_vt, L, DVR, True, DV > DVR)
    dk1 = tl.zeros([BN, D1], dtype=tl.float32)
    dk2 = tl.zeros([BN, D2 if D2 > 0 else 16], dtype=tl.float32)
    dv_acc = tl.zeros([BN, DV], dtype=tl.float32)

    q_base = q + i_b.to(tl.int64) * s_qb + i_h * s_qh
    do_base = do + i_b.to(tl.int64) * s_db + i_h * s_dh
    lse_base = lse + i_bh.to(tl.int64) * T
    delta_base = delta + i_bh.to(tl.int64) * T
    # query rows i see key n iff i ≥ n − shift: rows from i_lo on see some key of this block, rows from i_full
    # on see all of them (no mask needed)
    i_lo = tl.maximum(i_n * BN - shift, 0) // BM * BM
    i_full = tl.maximum(tl.cdiv(tl.maximum(tl.minimum(i_n * BN + BN, L) - 1 - shift, 0), BM) * BM, i_lo)
    dk1, dk2, dv_acc = _dkdv_blocks(dk1, dk2, dv_acc, k1, k2, vv, q_base, do_base, lse_base, delta_base, s_qt, s_dt,
                                    i_lo, tl.minimum(i_full, T), o_n, shift, T, qk_scale, D, DVR, D1, D2, DV, BM,
                                    True, PREC)
    dk1, dk2, dv_acc = _dkdv_blocks(dk1, dk2, dv_acc, k1, k2, vv, q_base, do_base, lse_base, delta_base, s_qt, s_dt,
                                    i_full, T, o_n, shift, T, qk_scale, D, DVR, D1, D2, DV, BM, False, PREC)
    dk_base = dk + i_b.to(tl.int64) * s_kgb + i_h * s_kgh
    store_tile(dk_base, (dk1 * scale).to(dk.dtype.element_ty), o_n, tl.arange(0, D1), s_kgt, L, D, D1 > D)
    if D2 > 0:
        store_tile(dk_base + D1, (dk2 * scale).to(dk.dtype.element_ty), o_n, tl.arange(0, D2), s_kgt, L, D - D1,
                    D1 + D2 > D)
    store_tile(dv + i_b.to(tl.int64) * s_vgb + i_h * s_vgh, dv_acc.to(dv.dtype.element_ty), o_n, tl.arange(0, DV),
                s_vgt, L, DVR, DV > DVR)


@triton.jit
def _dq_blocks(dq1, dq2, q1, q2, do, lse2, dlt, k_base, v_base, s_kt, s_vt, lo, hi, o_m, shift, L, qk_scale,
               D: tl.constexpr, DVR: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
               BN: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    o_d1 = tl.arange(0, D1)
    o_dv = tl.arange(0, DV)
    for start_n in range(lo, hi, BN):
        o_n = start_n + tl.arange(0, BN)
        k1 = load_tile(k_base, o_n, o_d1, s_kt, L, D, MASKED, D1 > D)
        k2 = k1
        if D2 > 0:
            k2 = load_tile(k_base + D1, o_n, tl.arange(0, D2), s_kt, L, D - D1, MASKED, D1 + D2 > D)
        vv = load_tile(v_base, o_n, o_dv, s_vt, L, DVR, MASKED, DV > DVR)
        p = tl.exp2(_scores(q1, q2, k1, k2, D2, PREC) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where((o_n[None, :] <= o_m[:, None] + shift) & (o_n[None, :] < L), p, 0.0)
        dp = tl.dot(do, tl.trans(vv), input_precision=PREC)
        ds = (p * (dp - dlt[:, None])).to(k1.dtype)
        dq1 += tl.dot(ds, k1, input_precision=PREC)
        if D2 > 0:
            dq2 += tl.dot(ds, k2, input_precision=PREC)
    return dq1, dq2


@triton.autotune(configs=_DQ, key=["D", "DVR", "HAS_SHIFT", "PREC"])
@triton.jit
def attn_bwd_dq_kernel(q, k, v, do, lse, delta, dq, shift_ptr, T, L, H, shift0,
                       s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_db, s_dt, s_dh,
                       s_qgb, s_qgt, s_qgh, qk_scale, scale,
                       D: tl.constexpr, DVR: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                       HAS_SHIFT: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    shift = _shift(shift_ptr, shift0, i_b, HAS_SHIFT)
    o_m = i_m * BM + tl.arange(0, BM)
    q_base = q + i_b.to(tl.int64) * s_qb + i_h * s_qh
    q1 = load_tile(q_base, o_m, tl.arange(0, D1), s_qt, T, D, True, D1 > D)
    q2 = q1
    if D2 > 0:
        q2 = load_tile(q_base + D1, o_m, tl.arange(0, D2), s_qt, T, D - D1, True, D1 + D2 > D)
    do = load_tile(do + i_b.to(tl.int64) * s_db + i_h * s_dh, o_m, tl.arange(0, DV), s_dt, T, DVR, True, DV > DVR)
    lse2 = tl.load(lse + i_bh.to(tl.int64) * T + o_m, mask=o_m < T, other=float("inf")) * 1.4426950408889634
    dlt = tl.load(delta + i_bh.to(tl.int64) * T + o_m, mask=o_m < T, other=0.0)
    dq1 = tl.zeros([BM, D1], dtype=tl.float32)
    dq2 = tl.zeros([BM, D2 if D2 > 0 else 16], dtype=tl.float32)
    k_base = k + i_b.to(tl.int64) * s_kb + i_h * s_kh
    v_base = v + i_b.to(tl.int64) * s_vb + i_h * s_vh
    n_full = tl.maximum(tl.minimum(i_m * BM + shift + 1, L), 0) // BN * BN
    n_end = tl.maximum(tl.minimum(tl.minimum(i_m * BM + BM, T) + shift, L), 0)
    dq1, dq2 = _dq_blocks(dq1, dq2, q1, q2, do, lse2, dlt, k_base, v_base, s_kt, s_vt, 0, n_full, o_m, shift, L,
                          qk_scale, D, DVR, D1, D2, DV, BN, False, PREC)
    dq1, dq2 = _dq_blocks(dq1, dq2, q1, q2, do, lse2, dlt, k_base, v_base, s_kt, s_vt, n_full, n_end, o_m, shift, L,
                          qk_scale, D, DVR, D1, D2, DV, BN, True, PREC)
    dq_base = dq + i_b.to(tl.int64) * s_qgb + i_h * s_qgh
    store_tile(dq_base, (dq1 * scale).to(dq.dtype.element_ty), o_m, tl.arange(0, D1), s_qgt, T, D, D1 > D)
    if D2 > 0:
        store_tile(dq_base + D1, (dq2 * scale).to(dq.dtype.element_ty), o_m, tl.arange(0, D2), s_qgt, T, D - D1,
                    D1 + D2 > D)


# --------------------------------------------------------------------------------------------------- launchers
def _last_contig(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _dims(q: torch.Tensor, v: torch.Tensor) -> dict:
    D, DVR = q.shape[-1], v.shape[-1]
    D1, D2 = head_blocks(D)
    return dict(D=D, DVR=DVR, D1=D1, D2=D2, DV=max(16, triton.next_power_of_2(DVR)),
                PREC="ieee" if q.dtype == torch.float32 else "tf32")


def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        shift: torch.Tensor | None = None, shift0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, T, H, D]``, ``k [B, L, H, D]``, ``v [B, L, H, Dv]`` → ``(o [B, T, H, Dv]`` in q's dtype,
    ``lse [B, H, T]`` fp32). Key j visible to query i of row b iff ``j ≤ i + shift[b] + shift0``."""
    q, k, v = _last_contig(q, k, v)
    B, T, H, _ = q.shape
    L = k.shape[1]
    o = torch.empty(B, T, H, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    if T == 0 or B * H == 0:
        return o, lse
    has_shift = shift is not None
    shift_t = shift if has_shift else lse  # a placeholder pointer, never read
    with on_device_of(q):
        attn_fwd_kernel[lambda m: (triton.cdiv(T, m["BM"]), B * H)](
            q, k, v, o, lse, shift_t, T, L, H, int(shift0), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *o.stride()[:3], scale * RCP_LN2, HAS_SHIFT=has_shift, **_dims(q, v))
    return o, lse


def flash_attention_bwd(do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, scale: float,
                        shift: torch.Tensor | None = None, shift0: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of ``flash_attention_fwd`` for output gradients ``do`` (and ``dlse`` or None)."""
    grads = [torch.empty_like(t) for t in (q, k, v)]  # the strides the fake op promises
    dq, dk, dv = _last_contig(*grads)  # the kernels store rows with unit column stride
    q, k, v, o, do = _last_contig(q, k, v, o, do)
    B, T, H, _ = q.shape
    L = k.shape[1]
    if B * H == 0 or T == 0 or L == 0:
        return tuple(g.zero_() for g in grads)
    dims = _dims(q, v)
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    has_dlse = dlse is not None
    dlse_t = dlse.contiguous() if has_dlse else delta
    has_shift = shift is not None
    shift_t = shift if has_shift else delta
    with on_device_of(q):
        attn_bwd_delta_kernel[lambda m: (triton.cdiv(T, m["BM"]), B * H)](
            o, do, dlse_t, delta, T, H, *o.stride()[:3], *do.stride()[:3], DVR=dims["DVR"], DV=dims["DV"],
            HAS_DLSE=has_dlse)
        common = (T, L, H, int(shift0), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
        attn_bwd_dkdv_kernel[lambda m: (triton.cdiv(L, m["BN"]), B * H)](
            q, k, v, do, lse, delta, dk, dv, shift_t, *common, *dk.stride()[:3], *dv.stride()[:3],
            scale * RCP_LN2, scale, HAS_SHIFT=has_shift, **dims)
        attn_bwd_dq_kernel[lambda m: (triton.cdiv(T, m["BM"]), B * H)](
            q, k, v, do, lse, delta, dq, shift_t, *common, *dq.stride()[:3], scale * RCP_LN2, scale,
            HAS_SHIFT=has_shift, **dims)
    for g, w in zip(grads, (dq, dk, dv)):
        if g is not w:
            g.copy_(w)
    return tuple(grads)
