"""Decode: token-by-token KDA, forward only, fp32 state tiles ``[BK, BV]`` in registers, one tile per program.

On CUDA a dense one-token step goes to the Gluon kernel of ``decode_gluon.py``; this kernel serves every other call
(several tokens, varlen, and the interpreter) and the dense step where Gluon is unavailable.

Per token: S ← Diag(e^g) S;  r = β (v − Sᵀk);  S ← S + k rᵀ;  o = Sᵀ (scale · q), with the gate, L2 norm and β
sigmoid fused. Both sums read the loaded S: with D = Diag(e^g), u = (DS)ᵀk, w = (DS)ᵀq and r = β(v − u),
S' = DS + k rᵀ and o = scale·(w + r (k·q)) — one reduction phase per token. A decode step is bound by reading and
writing the state once (64 KiB per head at K = V = 128, fp32): the grid spreads each head's state over V-blocks so
that enough bytes are in flight. With ``ssm_state_indices`` the state lives in a pool ``[P, H, K, V]`` that is read
and updated IN PLACE at the given slots (batched serving); a negative slot means "no state": start from zero and
write nothing back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from k3.ops.kda.triton import decode_gluon
from k3.ops.kda.triton._common import _gate_fwd, _seq_bounds, _sigmoid

# 32 state columns per program at 2 warps
_BV = 32
_WARPS = 2

if TYPE_CHECKING:
    from k3.ops.kda.args import KDAArgs


def _pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two ≥ max(n, lo), in plain Python (``triton.next_power_of_2`` is a constexpr function
    costing microseconds per host call)."""
    return max(lo, 1 << (int(n) - 1).bit_length())


# ---------------------------------------------------------------------------------------------------------------
# @triton.jit pieces
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _state_ptrs(s, slot, i_h, H, o_k, o_v, K: tl.constexpr, V: tl.constexpr, VFIRST: tl.constexpr = False):
    """Pointers of the state tile rows o_k, columns o_v of (slot, head i_h); ``slot`` is int64. One int64 base per
    (slot, head) plus int32 tile offsets (fewer address registers than int64 offsets per element). ``VFIRST``: the
    states are stored [.., V, K] (fla's ``state_v_first``, vLLM's pool layout)."""
    if VFIRST:
        return s + (slot * H + i_h) * (K * V) + (o_v[None, :] * K + o_k[:, None])
    return s + (slot * H + i_h) * (K * V) + (o_k[:, None] * V + o_v[None, :])


@triton.jit
def _token_inputs(q, k, v, g, beta, A_log, dt_bias, t, i_h, H, o_k, o_v, m_k, m_v, lb,
                  K: tl.constexpr, V: tl.constexpr, USE_GATE: tl.constexpr, HAS_LB: tl.constexpr,
                  HAS_A: tl.constexpr, HAS_DT: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    """Token t, head i_h in fp32: (q̂, k̂ [BK] (L2-normalised if asked), decay e^g [BK] (1 on padding), v [BV], β)."""
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
    b_g = _gate_fwd(b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K, USE_GATE, HAS_LB, HAS_A, HAS_DT, ROWS=False)
    b_a = tl.exp(tl.where(m_k, b_g, 0.))
    return b_q, b_k, b_a, b_v, b_b


@triton.jit
def _token_update(S, b_q, b_k, b_a, b_v, b_b, scale):
    """One token on the state tile S [BK, BV]: returns (new S, o [BV]). S' = D S + k (β r)ᵀ with r = v − (D S)ᵀk
    ⇒ S'ᵀq = (D S)ᵀq + β r (k·q): both sums read the loaded S (the state store does not wait on o's sum)."""
    u = tl.sum(S * (b_k * b_a)[:, None], axis=0)
    w = tl.sum(S * (b_q * b_a)[:, None], axis=0)
    r = (b_v - u) * b_b
    S = S * b_a[:, None] + b_k[:, None] * r[None, :]
    b_o = (w + r * tl.sum(b_k * b_q)) * scale
    return S, b_o


@triton.jit
def _load_state(s_in, idx, i_n, i_h, H, o_k, o_v, m_k, m_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, USE_IDX: tl.constexpr, USE_S0: tl.constexpr, VFIRST: tl.constexpr = False):
    """Sequence i_n's state tile (rows o_k, columns o_v of head i_h) in fp32, its slot (``idx[i_n]`` in the pool, else
    i_n; a negative slot reads and writes nothing) and the tile's mask; zeros without an initial state."""
    m_s = m_k[:, None] & m_v[None, :]
    if USE_IDX:
        slot = tl.load(idx + i_n).to(tl.int64)
        m_s = m_s & (slot >= 0)
    else:
        slot = i_n.to(tl.int64)
    if USE_S0:
        S = tl.load(_state_ptrs(s_in, slot, i_h, H, o_k, o_v, K, V, VFIRST), mask=m_s, other=0.).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    return S, slot, m_s


@triton.jit(do_not_specialize=['T', 'H'])
def _kda_recurrent(
    q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, idx, cu, T,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IS_VARLEN: tl.constexpr, USE_IDX: tl.constexpr,
    USE_S0: tl.constexpr, STORE_S: tl.constexpr, VFIRST: tl.constexpr = False,
):
    """Grid (V-blocks, N·H): one state tile per program, all tokens of its sequence."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos, eos = _seq_bounds(i_n, cu, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    S, slot, m_s = _load_state(s_in, idx, i_n, i_h, H, o_k, o_v, m_k, m_v, K, V, BK, BV, USE_IDX, USE_S0, VFIRST)
    for t in range(bos, eos):
        b_q, b_k, b_a, b_v, b_b = _token_inputs(q, k, v, g, beta, A_log, dt_bias, t, i_h, H, o_k, o_v, m_k, m_v,
                                                lb, K, V, USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM, BETA_SIGMOID)
        S, b_o = _token_update(S, b_q, b_k, b_a, b_v, b_b, scale)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_S:
        tl.store(_state_ptrs(s_out, slot, i_h, H, o_k, o_v, K, V, VFIRST), S, mask=m_s)


# ---------------------------------------------------------------------------------------------------------------
# host wrapper
# ---------------------------------------------------------------------------------------------------------------


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    args: KDAArgs,
    ssm_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward-only recurrent KDA (validated inputs, fla shapes). Returns ``(o [B, T, H, V], final_state)``.

    Without ``ssm_state_indices``: ``initial_state [N, H, K, V]`` is read (not modified) and a new final state is
    returned when ``output_final_state``. With ``ssm_state_indices [N]``: ``initial_state`` is a pool
    ``[P, H, K, V]`` fp32 updated in place at those slots and returned as the final state.
    Host cost per call (a decode step is ~0.07 ms of GPU time): the output (and final state) allocations and the
    launch (through ``LaunchCache`` on the Gluon path); no other torch op runs for contiguous inputs.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    # no-ops (no launch) for the contiguous tensors of a decode step
    q, k, v, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous()
    cu_seqlens, N = args.cu_seqlens, args.N
    use_idx = ssm_state_indices is not None
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=q.device)  # v's dtype, as fla (the kernels cast on store)
    vfirst = False
    if use_idx:
        pool = initial_state
        # the kernels index the pool densely: a strided view is updated through a dense copy, written back below,
        # except the transposed view of a dense V-first pool ([P, H, V, K] in memory: fla's ``state_v_first``),
        # which the Triton kernel indexes in place
        vfirst = not pool.is_contiguous() and pool.transpose(-1, -2).is_contiguous()
        s_in = s_out = pool if vfirst else pool.contiguous()
        idx = ssm_state_indices
        if idx.device != q.device or idx.dtype not in (torch.int32, torch.int64) or not idx.is_contiguous():
            idx = idx.to(device=q.device, dtype=torch.int64).contiguous()
        store = True
    else:
        s_in = initial_state.contiguous() if initial_state is not None else None
        s_out = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if args.output_final_state else None
        idx = None
        store = args.output_final_state
    BK = _pow2(K)
    BV = min(_BV, _pow2(V))
    dummy = o
    gate, lower_bound = args.use_gate_in_kernel, args.lower_bound
    flags = dict(USE_GATE=gate, HAS_LB=lower_bound is not None, HAS_A=gate and A_log is not None,
                 HAS_DT=gate and dt_bias is not None, L2NORM=args.use_qk_l2norm_in_kernel,
                 BETA_SIGMOID=args.use_beta_sigmoid_in_kernel,
                 USE_IDX=use_idx, USE_S0=s_in is not None, STORE_S=store)
    ptrs = (q, k, v, g, beta, A_log.contiguous() if A_log is not None else dummy,
            dt_bias.contiguous() if dt_bias is not None else dummy, o,
            s_in if s_in is not None else dummy, s_out if s_out is not None else dummy,
            idx if idx is not None else dummy)
    scale, lb = args.scale, float(lower_bound) if lower_bound is not None else 0.0
    if not vfirst and decode_gluon.usable(q, T, cu_seqlens is not None, N):  # dense one-token step: Gluon
        decode_gluon.decode_step(ptrs, flags, N, H, K, V, BK, scale, lb)
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous() if cu_seqlens is not None else dummy
        _kda_recurrent[(-(-V // BV), N * H)](*ptrs, cu, T, H, K, V, scale, lb, BK=BK, BV=BV,
                                             IS_VARLEN=cu_seqlens is not None, **flags, num_warps=_WARPS,
                                             num_stages=1, **({"VFIRST": True} if vfirst else {}))
    if use_idx:
        if s_out is not pool:
            pool.copy_(s_out)
        return o, pool
    return o, s_out
