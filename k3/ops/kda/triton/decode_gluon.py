"""One-token KDA decode step in Gluon (Triton's language with explicit register layouts), CUDA only.

Why a second decode kernel: a decode step is bound by reading and writing the fp32 state once. The Triton kernel of
``decode.py`` leaves the register layout of a state tile to the compiler, which splits the K rows over warps, so the
two K reductions per tile cross warps through shared memory and barriers. Here the layout is chosen: the warps of a
program split the tile's V columns, each thread holds 4 adjacent columns (16-byte loads) of a contiguous run of K
rows, and 8 threads of a warp share a column, so both reductions finish inside a warp (in-thread adds, then 3
shuffles). One tile per program: 8 programs of 2 warps per SM at the 128-register cap; each program also prefetches
into L2 (evict_last) the state tile of the program 2 × SMs ahead, so the later programs (the grid's last wave above
all) find it there. H200, B=64, H=32, K=V=128: 0.071 ms per step (CUDA-graph replay), a ``copy_`` of the same bytes
0.068.

Gluon does not run in Triton's interpreter, and its API changes between Triton releases: the kernel is used with the
release it is tested on (3.6.x) on CUDA; elsewhere the Triton kernel serves, with a note on stderr once. The GPU
tests check it against the fp64 recurrence; on CPU it compiles for sm_90. ``K3_KDA_GLUON=0`` turns it off.
"""

from __future__ import annotations

import torch

from k3.ops.kda.triton._common import HAVE_GLUON, LaunchCache, gluon_enabled, gluon_unavailable, sm_count

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

# V columns per program (16 per warp: 32 → 2 warps); register cap (128: 8 programs of 2 warps per SM without spills
# on sm_90; the compiler alone takes 149, 6 programs); L2 prefetch distance in programs per SM (H200: 0.0720 ms at
# 2 against 0.0733 without), with the evict_last priority
_BV = 32
_MAXNREG = 128
_PREFETCH_PER_SM = 2
_PREFETCH_EVICT_LAST = 1


if HAVE_GLUON:

    @gluon.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + gl.exp(-x))

    @gluon.jit
    def _prefetch_l2(ptrs, EVICT_LAST: gl.constexpr):
        """``prefetch.global.L2`` of the line at each pointer (the dummy result only carries the side effect)."""
        if EVICT_LAST:
            asm: gl.constexpr = "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;"
        else:
            asm: gl.constexpr = "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;"
        return gl.inline_asm_elementwise(asm, "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _log_decay(b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K: gl.constexpr, USE_GATE: gl.constexpr,
                   HAS_LB: gl.constexpr, HAS_A: gl.constexpr, HAS_DT: gl.constexpr):
        """The same gate as ``_common._gate_fwd``: bounded lb·σ(e^A (f + dt)), unbounded −e^A·softplus(f + dt),
        or g itself without the in-kernel gate."""
        if USE_GATE:
            x = b_f
            if HAS_DT:
                x = x + gl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.).to(gl.float32)
            if HAS_LB:
                if HAS_A:
                    x = x * gl.exp(gl.load(A_log + i_h).to(gl.float32))
                g = lb * _sigmoid(x)
            else:
                sp = gl.where(x > 20.0, x, gl.log(1.0 + gl.exp(gl.minimum(x, 20.0))))  # torch's threshold 20
                if HAS_A:
                    g = -gl.exp(gl.load(A_log + i_h).to(gl.float32)) * sp
                else:
                    g = -sp
        else:
            g = b_f
        return g

    @gluon.jit
    def _kda_decode_gluon(
        q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, idx, H, scale, lb,
        K: gl.constexpr, V: gl.constexpr, BK: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr,
        USE_GATE: gl.constexpr, HAS_LB: gl.constexpr, HAS_A: gl.constexpr, HAS_DT: gl.constexpr,
        L2NORM: gl.constexpr, BETA_SIGMOID: gl.constexpr, USE_IDX: gl.constexpr, USE_S0: gl.constexpr,
        STORE_S: gl.constexpr, PF: gl.constexpr = 0, PF_MODE: gl.constexpr = 0,
    ):
        """Grid (N·H·NV,): program i updates V-block i % NV of sequence-head i // NV (sequence n's token is row n;
        adjacent programs share a head, so the state is read in address order)."""
        # [BK, BV] tile: a thread holds BK/8 consecutive rows × 4 columns; 8 threads × 4 threads per warp; warps
        # side by side along V (16 columns each) — the K reductions never leave a warp
        L: gl.constexpr = gl.BlockedLayout([BK // 8, 4], [8, 4], [1, BV // 16], [1, 0])
        LK: gl.constexpr = gl.SliceLayout(1, L)
        LV: gl.constexpr = gl.SliceLayout(0, L)
        i = gl.program_id(0)
        i_nh = i // NV
        i_v = i % NV
        i_n = i_nh // H
        i_h = i_nh % H
        o_k = gl.arange(0, BK, layout=LK)
        o_v = i_v * BV + gl.arange(0, BV, layout=LV)
        m_k = o_k < K
        m_v = o_v < V
        m_s = m_k[:, None] & m_v[None, :]
        if USE_IDX:  # a pool slot per sequence; a negative slot starts from zero and writes nothing
            slot = gl.load(idx + i_n).to(gl.int64)
            m_s = m_s & (slot >= 0)
            base = (slot * H + i_h) * (K * V)
        else:  # state row i_nh of [N·H, K, V]
            base = i_nh.to(gl.int64) * (K * V)
        off = o_k[:, None] * V + o_v[None, :]  # int32 within one (slot, head) state
        if USE_S0:
            S = gl.load(s_in + base + off, mask=m_s, other=0.).to(gl.float32)
        else:
            S = gl.zeros([BK, BV], gl.float32, layout=L)
        if PF > 0 and USE_S0 and not USE_IDX:
            j = i + PF
            if j < gl.num_programs(0):  # one prefetch per row of tile j (its BV columns: a 128-byte line at BV 32)
                LP: gl.constexpr = gl.BlockedLayout([1], [32], [BV // 16], [0])
                r = gl.minimum(gl.arange(0, BK, layout=LP), K - 1)
                _prefetch_l2(s_in + ((j // NV).to(gl.int64) * (K * V) + (j % NV) * BV) + r * V, PF_MODE == 1)
        p = i_nh.to(gl.int64) * K + o_k  # token row n of [N, 1, H, K]
        b_k = gl.load(k + p, mask=m_k, other=0.).to(gl.float32)
        b_q = gl.load(q + p, mask=m_k, other=0.).to(gl.float32)
        b_f = gl.load(g + p, mask=m_k, other=0.).to(gl.float32)
        b_v = gl.load(v + i_nh.to(gl.int64) * V + o_v, mask=m_v, other=0.).to(gl.float32)
        b_b = gl.load(beta + i_nh).to(gl.float32)
        # this statement order (gate before the norms, S' before the output) and the dense base above keep the K3
        # kernel at the 128-register cap without spills (an 8-byte spill cost 1.5 %)
        if BETA_SIGMOID:
            b_b = _sigmoid(b_b)
        b_g = _log_decay(b_f, i_h, A_log, dt_bias, lb, o_k, m_k, K, USE_GATE, HAS_LB, HAS_A, HAS_DT)
        b_a = gl.exp(gl.where(m_k, b_g, 0.))
        # the norms scale the reduced vectors, not the K-long k and q: the S products need only the raw loads
        if L2NORM:
            rk = 1.0 / gl.sqrt(gl.sum(b_k * b_k, axis=0) + 1e-6)
            rq = 1.0 / gl.sqrt(gl.sum(b_q * b_q, axis=0) + 1e-6)
        else:
            rk = 1.0
            rq = 1.0
        # S' = D S + k (β r)ᵀ with r = v − (D S)ᵀk  ⇒  S'ᵀq = (D S)ᵀq + β r (k·q): both sums read the loaded S
        u = gl.sum(S * (b_k * b_a)[:, None], axis=0) * rk
        w = gl.sum(S * (b_q * b_a)[:, None], axis=0) * rq
        r = (b_v - u) * b_b
        S = S * b_a[:, None] + b_k[:, None] * (r * rk)[None, :]
        b_o = (w + r * (gl.sum(b_k * b_q, axis=0) * (rk * rq))) * scale
        gl.store(o + i_nh.to(gl.int64) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if STORE_S:
            gl.store(s_out + base + off, S, mask=m_s)


def usable(q: torch.Tensor, T: int, varlen: bool, N: int) -> bool:
    """Whether the Gluon kernel takes this call: CUDA tensors, a dense one-token step, Gluon on and available."""
    return q.is_cuda and T == 1 and not varlen and N > 0 and gluon_enabled() and not gluon_unavailable("decode")


_PLANS: dict[tuple, tuple[int, dict, dict]] = {}  # (V, device) → (NV, BV/NV/PF constexprs, options)
_FLAG_NAMES = ("USE_GATE", "HAS_LB", "HAS_A", "HAS_DT", "L2NORM", "BETA_SIGMOID", "USE_IDX", "USE_S0", "STORE_S")


def _plan(device: torch.device, V: int) -> tuple[int, dict, dict]:
    """The launch's V- and device-dependent part (computed once per V and device: host time per step)."""
    key = (V, device)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    BV = max(16, min(_BV, 1 << (max(V, 16) - 1).bit_length()))
    NV = -(-V // BV)
    options = dict(num_warps=BV // 16, maxnreg=_MAXNREG)
    consts = dict(BV=BV, NV=NV, PF=int(round(float(_PREFETCH_PER_SM) * sm_count(device))),
                  PF_MODE=_PREFETCH_EVICT_LAST)
    _PLANS[key] = plan = (NV, consts, options)
    return plan


def decode_step(ptrs: tuple, flags: dict, N: int, H: int, K: int, V: int, BK: int, scale: float, lb: float) -> None:
    """Launch over the ``(q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, idx)`` pointers of
    ``decode.fused_recurrent_kda_triton`` (same flag names)."""
    NV, consts, options = _plan(ptrs[0].device, V)
    consts = dict(K=K, V=V, BK=BK, **consts, **{n: flags[n] for n in _FLAG_NAMES})
    _launch(N * H * NV, (*ptrs, H, scale, lb), consts, options)


if HAVE_GLUON:
    _launch = LaunchCache(_kda_decode_gluon)
