"""The 16-token inference state pass: one program per (V-block, sequence, head), 16-token steps.

The state is held TRANSPOSED in registers (Sᵀ [BV, K], fp32) so that every product of a step has the V-block (64
rows) as its M dimension — Hopper's wgmma needs M ≥ 64, a 16-row step would otherwise run on the older mma.sync —
and the serial chain never leaves registers (Sᵀ and V'ᵀ are the left operands). Per block, from the prep's buffers
(``inference_prep``):

    [Uᵀ | (A_qk U)ᵀ] = Uᵀ [I | A_qkᵀ]                     (one K = 16 product, off the chain)
    [V'ᵀ | Oᵀ] = [Uᵀ | (A_qk U)ᵀ] + Sᵀ [−W; qw]ᵀ           (V' = U − W S,  O = qg S + A_qk V' = qw S + A_qk U)
    Sᵀ ← Sᵀ Diag(γ) + V'ᵀ kg

The tile pointers are carried across steps and advanced by each buffer's block stride.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops.kda.triton._common import (
    BC,
    BT,
    ChunkTable,
    _state_program,
    dot_precision,
    next_pow2,
    state_bv,
    state_stages,
)

# BV 64 at 4 warps with an 8-stage load pipeline (H200, B=1 H=32 per 1M: 6 / 8 / 10 / 13 stages 43.6–44.9 /
# 42.9–43.6 / 43.5–43.6 / ~44 ms for the prefill; BV 128 at 8 warps 48)
_STATE_BV = 64
_STATE_STAGES = 8


@triton.jit
def _folded_step(s_dt, b_wq, b_ua, PREC: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr):
    """[V'ᵀ | Oᵀ] = [Uᵀ | (A_qk U)ᵀ] + Sᵀ [−W; qw]ᵀ, one product whose accumulator starts from [U; A_qk U]ᵀ (fp32,
    ``b_ua``); returns V'ᵀ in the operand dtype and Oᵀ in fp32."""
    acc = tl.dot(s_dt, tl.trans(b_wq), acc=b_ua, input_precision=PREC)
    b_vnt, b_ot = tl.split(tl.permute(tl.reshape(acc, [BV, 2, BC]), (0, 2, 1)))
    return b_vnt.to(s_dt.dtype), b_ot


@triton.jit(do_not_specialize=['c0', 'c1', 'NCw', 'T', 'NT', 'H'])
def _c16_state(
    X, KG, GAM, AQ, U, o, ht,
    cu, chunk_off, c0, c1, NCw, T, NT, H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVP: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
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
        b0 = boff + lo * NB
        o_r = tl.arange(0, 2 * BC)
        q_kg = KG + (b0 * BC + o_s)[:, None] * BK + o_k[None, :]
        q_gam = GAM + b0 * BK + o_k
        q_wq = X + (b0 * (2 * BC) + o_r)[:, None] * BK + o_k[None, :]
        q_ua = U + b0 * (BC * BVP) + o_s[:, None] * BVP + o_v[None, :]  # U [16, BV]
        q_ia = AQ + b0 * (BC * 2 * BC) + o_s[:, None] * (2 * BC) + o_r[None, :]  # [I | A_qkᵀ] [16, 32]
        t = tok0 + lo * NB * BC + o_s
        for j in tl.range(lo * NB, hi * NB, num_stages=STAGES):
            b_kg = tl.load(q_kg)
            b_gam = tl.load(q_gam)
            # [Uᵀ | (A_qk U)ᵀ] = Uᵀ [I | A_qkᵀ]: one K = 16 product from shared memory
            b_ua = tl.dot(tl.trans(tl.load(q_ua)), tl.load(q_ia), input_precision=PREC)
            q_ia += BC * 2 * BC
            vn_dt, b_ot = _folded_step(St.to(DT), tl.load(q_wq), b_ua, PREC, BV, BC)
            tl.store(o + (t[None, :] * H + i_h) * V + o_v[:, None], b_ot.to(o.dtype.element_ty),
                     mask=m_v[:, None] & (t < eos)[None, :])
            St = St * b_gam[None, :] + tl.dot(vn_dt, b_kg, input_precision=PREC)
            q_kg += BC * BK
            q_gam += BK
            q_wq += 2 * BC * BK
            q_ua += BVP * BC
            t += BC
        tl.store(p_s, St, mask=m_v[:, None] & m_k[None, :])


def state_blocks(BVP: int, BK: int) -> int:
    """V-blocks per (sequence, head) of the state pass: its programs are ``state_blocks(BVP, BK)`` × N·H."""
    return BVP // min(state_bv(_STATE_BV, BK), BVP)


def launch_c16_state(bufs: dict, o, ht, tab: ChunkTable, c0: int, c1: int, H: int, K: int, V: int) -> None:
    """The state pass over chunks [c0, c1) of ``tab`` from the states ``ht`` (updated in place), writing ``o``."""
    BK = bufs["X"].shape[-1]
    BVP = next_pow2(V)
    BV = min(state_bv(_STATE_BV, BK), BVP)
    _c16_state[(state_blocks(BVP, BK), tab.N * H)](
        bufs["X"], bufs["KG"], bufs["GAM"], bufs["AQ"], bufs["U"], o, ht, tab.cu, tab.chunk_off, c0, c1,
        bufs["X"].shape[1], tab.T, tab.NT, H, K, V, BT=BT, BC=BC, BK=BK, BV=BV, BVP=BVP, IS_VARLEN=tab.varlen,
        PREC=dot_precision(bufs["X"].dtype), STAGES=state_stages(_STATE_STAGES, bufs["X"].dtype, BK),
        num_warps=4,
        num_stages=1,
    )
