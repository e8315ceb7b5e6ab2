"""Recurrent (token-by-token) KDA for decoding: one program per (V-block, sequence, head), fp32 state in registers.

Per token: S ← Diag(e^g) S;  S ← S + β k (v − Sᵀk)ᵀ;  o = Sᵀ (scale · q), with the gate, L2 norm and β sigmoid fused.
A decode step is bound by reading and writing the state once (64 KiB per head at K = V = 128, fp32): the grid
spreads each head's state over V-blocks so that enough bytes are in flight to run near copy bandwidth.
With ``ssm_state_indices`` the state lives in a pool ``[P, H, K, V]`` that is read and updated IN PLACE at the
given slots (batched serving); a negative slot means "no state": start from zero and write nothing back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton._common import _gate_fwd, _seq_bounds, _sigmoid, next_pow2


class DecodeConfig:
    """Launch knobs (switched by ``bench/kda_sweep.py``). Kept at v2's: the sweep's fastest (BV 32, 1 warp: 0.092 ms
    vs 0.099) was 0.104 vs 0.102 when timed again in the same run — within the decode step's run-to-run spread."""

    bv = 32
    warps = 4
    stages = 1


@triton.jit(do_not_specialize=['T', 'H'])
def _kda_recurrent(
    q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, idx, cu, T,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, USE_IDX: tl.constexpr,
    USE_S0: tl.constexpr, STORE_S: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos = _seq_bounds(i_n, cu, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    if USE_IDX:
        slot = tl.load(idx + i_n).to(tl.int64)
        m_s = m_s & (slot >= 0)
    else:
        slot = i_n.to(tl.int64)
    p_s = ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    if USE_S0:
        S = tl.load(s_in + p_s, mask=m_s, other=0.).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(bos, eos):
        p = (t * H + i_h) * K + o_k
        b_k = tl.load(k + p, mask=m_k, other=0.).to(tl.float32)
        b_q = tl.load(q + p, mask=m_k, other=0.).to(tl.float32)
        b_f = tl.load(g + p, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_b = tl.load(beta + t * H + i_h).to(tl.float32)
        if L2NORM:
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        if BETA_SIGMOID:
            b_b = _sigmoid(b_b)
        b_g = tl.sum(_gate_fwd(b_f[None, :], i_h, A_log, dt_bias, lb, o_k, m_k, K, USE_GATE, HAS_LB, HAS_A, HAS_DT),
                     axis=0)
        S = S * tl.exp(tl.where(m_k, b_g, 0.))[:, None]
        r = b_v - tl.sum(S * b_k[:, None], axis=0)
        S += b_k[:, None] * (b_b * r)[None, :]
        b_o = tl.sum(S * (b_q * scale)[:, None], axis=0)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_S:
        tl.store(s_out + p_s, S, mask=m_s)


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward-only recurrent KDA (validated inputs, fla shapes). Returns ``(o [B, T, H, V], final_state)``.

    Without ``ssm_state_indices``: ``initial_state [N, H, K, V]`` is read (not modified) and a new final state is
    returned when ``output_final_state``. With ``ssm_state_indices [N]``: ``initial_state`` is a pool
    ``[P, H, K, V]`` fp32 updated in place at those slots and returned as the final state.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    use_idx = ssm_state_indices is not None
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    if use_idx:
        pool = initial_state
        if not pool.is_contiguous():
            raise ValueError("initial_state (the state pool) must be contiguous to be updated in place")
        s_in = s_out = pool
        idx = ssm_state_indices.to(device=q.device, dtype=torch.int64).contiguous()
        store = True
    else:
        s_in = initial_state.contiguous() if initial_state is not None else None
        s_out = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
        idx = None
        store = output_final_state
    BK = next_pow2(K)
    BV = min(DecodeConfig.bv, next_pow2(V))
    dummy = o
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous() if cu_seqlens is not None else o
    _kda_recurrent[(triton.cdiv(V, BV), N * H)](
        q, k, v, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy, o,
        s_in if s_in is not None else dummy, s_out if s_out is not None else dummy,
        idx if idx is not None else dummy, cu, T, H, K, V, float(scale),
        float(lower_bound) if lower_bound is not None else 0.0, BK=BK, BV=BV,
        USE_GATE=bool(use_gate_in_kernel), HAS_LB=lower_bound is not None,
        HAS_A=bool(use_gate_in_kernel) and A_log is not None, HAS_DT=bool(use_gate_in_kernel) and dt_bias is not None,
        L2NORM=bool(use_qk_l2norm_in_kernel), BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel),
        IS_VARLEN=cu_seqlens is not None, USE_IDX=use_idx, USE_S0=s_in is not None, STORE_S=store,
        num_warps=DecodeConfig.warps, num_stages=DecodeConfig.stages,
    )
    if use_idx:
        return o, pool
    return o, s_out
