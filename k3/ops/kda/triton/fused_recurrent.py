"""Recurrent (token-by-token) KDA for decoding: fp32 state tiles ``[BK, BV]`` in registers, one tile per program
(or, with ``DecodeConfig.persist``, a persistent grid that loops over tiles with the next tiles' loads in flight).
On CUDA, a dense one-token step goes to the Gluon kernel of ``decode_gluon.py`` (explicit layouts: 0.075 vs
0.079 ms at B=64 H=32); these kernels serve every other call, and every call in the interpreter.

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

from k3.ops.kda.triton._common import _gate_fwd, _seq_bounds, _sigmoid, maxnreg_kw, sm_count
from k3.ops.kda.triton.decode_gluon import decode_step_gluon, usable


class DecodeConfig:
    """Launch knobs (switched by ``bench/kda_sweep.py``; defaults = its fastest correct variant, see below):

    - ``fused_out``: Sᵀ(e^g∘k) and Sᵀ(e^g∘q) from the LOADED state in one pass, o = scale·(Sᵀ(e^g∘q) + βr·(k·q));
      one reduction phase per token instead of two dependent ones (the state store no longer waits on o's sum).
    - ``base_ptr``: one int64 base pointer per (slot, head) plus int32 tile offsets, instead of int64 offsets per
      element (fewer address registers; loads/stores keep their immediate row offsets).
    - ``evict``: ``evict_first`` on the state load and store (each byte is touched once per step).
    - ``persist``: > 0 → persistent grid of ``persist`` programs per SM, each looping over (V-block, sequence, head)
      tiles with a ``persist_stages``-deep cp.async pipeline, so the next tiles' state is in flight (in shared
      memory, not registers) while one is computed. Dense T = 1 decode only (other calls use the tiled kernel).
      The register cap follows from ``persist`` (every program must be resident: 4 programs of 4 warps → 128).
    - ``maxnreg``: register cap per thread (None = the compiler's choice for the tiled kernel, the fitting cap for
      the persistent one); e.g. 80 gives the tiled kernel (BV 32, 4 warps, base_ptr) 6 programs per SM instead of
      5 (sm_90: 32 B of spill stack).
    """

    # sweep run 4b (one H200, bench/results/kda_sweep_v4/): the persistent grid at 8 programs of 2 warps per SM,
    # BV 32, fused output and base pointers was the fastest correct variant, 0.079 ms (3.38 TB/s of state traffic)
    # for B=64 H=32 (BV 16: 0.083; v2's tiled kernel 0.098; 10/SM at 1 warp 0.094; 4 pipeline stages 0.112)
    bv = 32
    warps = 2
    stages = 1
    fused_out = True
    base_ptr = True
    evict = False
    persist = 8
    persist_stages = 3
    maxnreg: int | None = None
    programs: int | None = None  # persistent grid size (None: programs per SM × SMs); must all be resident


# sm_90 per-SM limits: 64 K registers (allocated per warp in units of 256, i.e. 8 per thread), 228 KiB of shared
# memory of which 1 KiB is reserved per resident program
_REGS_PER_SM = 65536
_SMEM_PER_SM = 233472


def _persistent_fit(persist: int, warps: int, stages: int, BK: int, BV: int,
                    maxnreg: int | None) -> tuple[int, int]:
    """(programs per SM, register cap) for the persistent grid. Every program must be resident at once — a
    program that waits for a free slot would run its whole share of tiles after the others — so the register cap
    is derived from ``persist`` (unless given) and the count is lowered to what the pipeline buffers'
    shared memory allows ((stages − 1) state tiles in flight, fp32, plus ≤ 4 KiB of vectors and scratch)."""
    smem = (max(stages, 2) - 1) * BK * BV * 4 + 4096 + 1024
    per_sm = max(1, min(persist, _SMEM_PER_SM // smem, 64 // warps, 32))
    cap = min(255, _REGS_PER_SM // (per_sm * warps * 32) // 8 * 8)
    return per_sm, cap if maxnreg is None else min(cap, maxnreg)


def _pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two ≥ max(n, lo), in plain Python (``triton.next_power_of_2`` is a constexpr function
    costing microseconds per host call)."""
    return max(lo, 1 << (int(n) - 1).bit_length())


# ---------------------------------------------------------------------------------------------------------------
# @triton.jit pieces
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _state_ptrs(s, slot, i_h, H, o_k, o_v, K: tl.constexpr, V: tl.constexpr, BASE_PTR: tl.constexpr):
    """Pointers of the state tile rows o_k, columns o_v of (slot, head i_h); ``slot`` is int64."""
    if BASE_PTR:
        return s + (slot * H + i_h) * (K * V) + (o_k[:, None] * V + o_v[None, :])
    else:
        return s + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]


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
def _token_update(S, b_q, b_k, b_a, b_v, b_b, scale, FUSED: tl.constexpr):
    """One token on the state tile S [BK, BV]: returns (new S, o [BV])."""
    if FUSED:
        # S' = D S + k (β r)ᵀ with r = v − (D S)ᵀk  ⇒  S'ᵀq = (D S)ᵀq + β r (k·q): both sums read the loaded S
        u = tl.sum(S * (b_k * b_a)[:, None], axis=0)
        w = tl.sum(S * (b_q * b_a)[:, None], axis=0)
        r = (b_v - u) * b_b
        S = S * b_a[:, None] + b_k[:, None] * r[None, :]
        b_o = (w + r * tl.sum(b_k * b_q)) * scale
    else:
        S = S * b_a[:, None]
        r = b_v - tl.sum(S * b_k[:, None], axis=0)
        S += b_k[:, None] * (b_b * r)[None, :]
        b_o = tl.sum(S * (b_q * scale)[:, None], axis=0)
    return S, b_o


@triton.jit
def _load_state(s_in, idx, i_n, i_h, H, o_k, o_v, m_k, m_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, USE_IDX: tl.constexpr, USE_S0: tl.constexpr, BASE_PTR: tl.constexpr,
                EVICT: tl.constexpr):
    """Sequence i_n's state tile (rows o_k, columns o_v of head i_h) in fp32, its slot (``idx[i_n]`` in the pool, else
    i_n; a negative slot reads and writes nothing) and the tile's mask; zeros without an initial state."""
    m_s = m_k[:, None] & m_v[None, :]
    if USE_IDX:
        slot = tl.load(idx + i_n).to(tl.int64)
        m_s = m_s & (slot >= 0)
    else:
        slot = i_n.to(tl.int64)
    if USE_S0:
        S = tl.load(_state_ptrs(s_in, slot, i_h, H, o_k, o_v, K, V, BASE_PTR), mask=m_s, other=0.,
                    eviction_policy=EVICT).to(tl.float32)
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
    USE_S0: tl.constexpr, STORE_S: tl.constexpr,
    FUSED: tl.constexpr, BASE_PTR: tl.constexpr, EVICT: tl.constexpr,
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
    S, slot, m_s = _load_state(s_in, idx, i_n, i_h, H, o_k, o_v, m_k, m_v, K, V, BK, BV, USE_IDX, USE_S0, BASE_PTR,
                               EVICT)
    for t in range(bos, eos):
        b_q, b_k, b_a, b_v, b_b = _token_inputs(q, k, v, g, beta, A_log, dt_bias, t, i_h, H, o_k, o_v, m_k, m_v,
                                                lb, K, V, USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM, BETA_SIGMOID)
        S, b_o = _token_update(S, b_q, b_k, b_a, b_v, b_b, scale, FUSED)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_S:
        tl.store(_state_ptrs(s_out, slot, i_h, H, o_k, o_v, K, V, BASE_PTR), S, mask=m_s, eviction_policy=EVICT)


@triton.jit(do_not_specialize=['H', 'n_tiles', 'NP'])
def _kda_decode_persistent(
    q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, idx, n_tiles, NP,
    H, K: tl.constexpr, V: tl.constexpr, scale, lb,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    USE_GATE: tl.constexpr, HAS_LB: tl.constexpr, HAS_A: tl.constexpr, HAS_DT: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, USE_IDX: tl.constexpr,
    USE_S0: tl.constexpr, STORE_S: tl.constexpr,
    FUSED: tl.constexpr, BASE_PTR: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr,
):
    """Dense T = 1: NP programs loop over the n_tiles = N·H·NV tiles (tile i: V-block i % NV of sequence-head
    i // NV; sequence n's token is row n). The loop body has no inner loop, so the compiler software-pipelines it:
    the loads of the next STAGES − 1 tiles go to shared memory by cp.async while this one is reduced and stored."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    for i in tl.range(tl.program_id(0), n_tiles, NP, num_stages=STAGES):
        i_v = i % NV
        i_nh = i // NV
        i_n = i_nh // H
        i_h = i_nh % H
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        S, slot, m_s = _load_state(s_in, idx, i_n, i_h, H, o_k, o_v, m_k, m_v, K, V, BK, BV, USE_IDX, USE_S0,
                                   BASE_PTR, EVICT)
        t = i_n.to(tl.int64)
        b_q, b_k, b_a, b_v, b_b = _token_inputs(q, k, v, g, beta, A_log, dt_bias, t, i_h, H, o_k, o_v, m_k, m_v,
                                                lb, K, V, USE_GATE, HAS_LB, HAS_A, HAS_DT, L2NORM, BETA_SIGMOID)
        S, b_o = _token_update(S, b_q, b_k, b_a, b_v, b_b, scale, FUSED)
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if STORE_S:
            tl.store(_state_ptrs(s_out, slot, i_h, H, o_k, o_v, K, V, BASE_PTR), S, mask=m_s,
                     eviction_policy=EVICT)


# ---------------------------------------------------------------------------------------------------------------
# host wrapper
# ---------------------------------------------------------------------------------------------------------------


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
    Host cost per call (a decode step is ~0.07 ms of GPU time): the output (and final state) allocations and the
    launch (through ``LaunchCache`` on the Gluon path); no other torch op runs for contiguous inputs.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    # no-ops (no launch) for the contiguous tensors of a decode step
    q, k, v, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous()
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    use_idx = ssm_state_indices is not None
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=q.device)  # v's dtype, as fla (the kernels cast on store)
    if use_idx:
        pool = initial_state
        # the kernels index the pool densely: a strided view is updated through a dense copy, written back below
        s_in = s_out = pool.contiguous()
        idx = ssm_state_indices
        if idx.device != q.device or idx.dtype not in (torch.int32, torch.int64) or not idx.is_contiguous():
            idx = idx.to(device=q.device, dtype=torch.int64).contiguous()
        store = True
    else:
        s_in = initial_state.contiguous() if initial_state is not None else None
        s_out = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
        idx = None
        store = output_final_state
    cfg = DecodeConfig
    BK = _pow2(K)
    BV = min(cfg.bv, _pow2(V))
    dummy = o
    flags = dict(USE_GATE=bool(use_gate_in_kernel), HAS_LB=lower_bound is not None,
                 HAS_A=bool(use_gate_in_kernel) and A_log is not None,
                 HAS_DT=bool(use_gate_in_kernel) and dt_bias is not None,
                 L2NORM=bool(use_qk_l2norm_in_kernel), BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel),
                 USE_IDX=use_idx, USE_S0=s_in is not None, STORE_S=store,
                 FUSED=bool(cfg.fused_out), BASE_PTR=bool(cfg.base_ptr), EVICT="evict_first" if cfg.evict else "")
    ptrs = (q, k, v, g, beta, A_log.contiguous() if A_log is not None else dummy,
            dt_bias.contiguous() if dt_bias is not None else dummy, o,
            s_in if s_in is not None else dummy, s_out if s_out is not None else dummy,
            idx if idx is not None else dummy)
    scale, lb = float(scale), float(lower_bound) if lower_bound is not None else 0.0
    NV = -(-V // BV)
    if usable(q, T, cu_seqlens is not None, N):  # dense one-token step on CUDA: the Gluon kernel
        decode_step_gluon(ptrs, flags, N, H, K, V, BK, scale, lb)
    elif cfg.persist > 0 and cu_seqlens is None and T == 1 and N > 0:
        n_tiles = N * H * NV
        per_sm, maxnreg = _persistent_fit(cfg.persist, cfg.warps, cfg.persist_stages, BK, BV, cfg.maxnreg)
        if cfg.programs is not None and int(cfg.programs) < 1:
            raise ValueError(f"DecodeConfig.programs: expected None or a positive int, got {cfg.programs!r}")
        NP = min(n_tiles, int(cfg.programs or per_sm * sm_count(q.device)))
        _kda_decode_persistent[(NP,)](*ptrs, n_tiles, NP, H, K, V, scale, lb, BK=BK, BV=BV, NV=NV,
                                      STAGES=cfg.persist_stages, **flags, num_warps=cfg.warps, maxnreg=maxnreg,
                                      num_stages=cfg.persist_stages)
    else:
        launch = dict(num_warps=cfg.warps, **maxnreg_kw(cfg.maxnreg))
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous() if cu_seqlens is not None else dummy
        _kda_recurrent[(NV, N * H)](*ptrs, cu, T, H, K, V, scale, lb, BK=BK, BV=BV,
                                    IS_VARLEN=cu_seqlens is not None, **flags, **launch, num_stages=cfg.stages)
    if use_idx:
        if s_out is not pool:
            pool.copy_(s_out)
        return o, pool
    return o, s_out
