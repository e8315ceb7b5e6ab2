"""Triton kernels of the AttnRes mix: each source read once from HBM per pass, the mix math in fp32 registers.

Per token (one row of D channels), with sources v_1..v_N, score vector qw = γ ⊙ w (fp32) and logit scale c:

    r_i = rsqrt(mean(v_i²) + eps)      s_i = c · r_i ⟨qw, v_i⟩      p = softmax(s)      o = Σ_i p_i v_i
    y   = o · rsqrt(mean(o²) + eps) · ow          (only with an output norm weight ow; else y = o)

Forward (``attn_res_fwd_kernel``): a program owns BT whole rows (BD = next power of two ≥ D lanes, the tail masked,
so any D works) and streams the N sources once with an online softmax, keeping o in fp32 registers: nothing of size
[N, tokens, D] is ever written. Outputs: y, lse = log Σ exp(s) (fp32, [T]), the logits s ([N, T] fp32, tiny; read
back only for ``return_weights``) and, when asked (``save_pre``), the pre-norm mix o in the sources' dtype.

Backward (``attn_res_bwd_kernel``), with g = ∂L/∂o (= dy, or through the output norm
g = ro (ow ⊙ dy − x̂ · mean(x̂ ⊙ ow ⊙ dy)), x̂ = o · ro) and δ = Σ_i p_i ⟨g, v_i⟩:

    ∂s_i = p_i (⟨g, v_i⟩ − δ) · c
    ∂v_i = p_i g + ∂s_i · r_i (qw − v_i · r_i ⟨qw, v_i⟩ / D)        ∂qw = Σ_tokens Σ_i ∂s_i r_i v_i

Per row: (only with the output norm) o again from the sources and the forward's lse, or read back when it was
saved; then the per-source scalars r_i, ⟨qw, v_i⟩, p_i, ⟨g, v_i⟩ (δ from these same values, so Σ_i ∂s_i vanishes to
rounding — δ = ⟨g, o⟩ would leave a residue that swamps a small ∂qw when the depth weights are peaked); then ∂v_i.
A row's source tiles come from HBM once; the later passes over the same row find them in L1/L2. Each backward
program walks a run of consecutive rows (at most about 4 programs per SM), so the ∂qw / ∂ow partial sums are one
fp32 [D] row per program, summed after, not [T, D].

The loops over the sources are runtime loops (``_pick`` selects the source's pointer): unrolled, the compiler
hoists every source's load to the top and spills. Register counts at D 7168 on sm_90 are in the config lists.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["attn_res_fwd", "attn_res_bwd", "MAX_D"]

# Widest row kept in registers (BD lanes per row); wider rows take the reference path.
MAX_D = 16384


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Keep configs whose fp32 [BT, BD] row vectors are 8..32 values per thread (one tile in registers at most 32
    wide, enough bytes in flight); narrow rows take the config that comes closest."""
    bd = kwargs.get("BD", named_args.get("BD"))

    def per_thread(c: triton.Config) -> int:
        return c.kwargs["BT"] * bd // (32 * c.num_warps)

    keep = [c for c in configs if 8 <= per_thread(c) <= 32]
    return keep or [max((c for c in configs if per_thread(c) <= 32), key=per_thread, default=configs[0])]


def _fwd_configs() -> list[triton.Config]:
    """sm_90 at D 7168 (ptxas register counts): (1 row, 8 warps) 126 registers, two programs per SM; (1, 16,
    prefetch) 84–93; (2, 32, prefetch) 64 with 8–16 spilled bytes, four tiles in flight per SM. The GPU picks."""
    if _interpreting():  # the interpreter runs every config when autotuning: one is enough there
        return [triton.Config({"BT": 2, "PF": True}, num_warps=4)]
    return [triton.Config({"BT": bt, "PF": pf}, num_warps=w)
            for bt, w, pf in ((1, 8, False), (1, 16, True), (2, 32, True), (4, 4, False), (8, 4, False))]


def _bwd_configs() -> list[triton.Config]:
    """sm_90 at D 7168: (1, 8) 219 registers (255 and ~50 spilled bytes with the output norm), (1, 16) 127 (~120
    spilled bytes with the output norm), (1, 32) 64 (70–180 spilled bytes)."""
    if _interpreting():
        return [triton.Config({"BT": 2}, num_warps=4)]
    return [triton.Config({"BT": bt}, num_warps=w) for bt, w in ((1, 8), (1, 16), (1, 32), (4, 4), (8, 4))]


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _pick(ptrs, i, NS: tl.constexpr):
    """``ptrs[i]`` for a runtime ``i``. The source loops are runtime loops on purpose: unrolled, the compiler hoists
    every source's tile load to the top and runs out of registers."""
    p = ptrs[0]
    for j in tl.static_range(1, NS):
        p = tl.where(i == j, ptrs[j], p)
    return p


@triton.autotune(configs=_fwd_configs(), key=["NS", "BD", "HAS_ONORM", "SAVE_PRE", "HAS_PRIOR"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def attn_res_fwd_kernel(
    src, qw, ow, o, o_pre, lse, logit, o1, lse1, T, eps, scale,
    D: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE_PRE: tl.constexpr, HAS_PRIOR: tl.constexpr, PF: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, BD)[None, :]  # row vectors as [1, BD]: the tiles' own layout, no conversions
    m_d = o_d < D
    m_td = m_t[:, None] & m_d
    o_td = o_t[:, None] * D + o_d
    b_qw = tl.load(qw + o_d, mask=m_d, other=0.0)

    # online softmax over the sources; rows past T load zeros and stay finite (p = 1 over zero vectors)
    if HAS_PRIOR:  # two-phase merge: start from a mix o¹ (normalised) of earlier sources and its lse ℓ¹
        b_m = tl.load(lse1 + o_t, mask=m_t, other=0.0)
        b_z = tl.full([BT], 1.0, tl.float32)
        b_o = tl.load(o1 + o_td, mask=m_td, other=0.0).to(tl.float32)
    else:
        b_m = tl.full([BT], float("-inf"), tl.float32)
        b_z = tl.zeros([BT], tl.float32)
        b_o = tl.zeros([BT, BD], tl.float32)
    b_vn = tl.load(src[0] + o_td, mask=m_td, other=0.0, eviction_policy="evict_first")
    for i in range(NS):
        b_v = b_vn.to(tl.float32)
        if PF:  # the next source's tile is requested before this one's reductions: two tiles in flight
            b_vn = tl.load(_pick(src, i + 1, NS) + o_td, mask=m_td & (i + 1 < NS), other=0.0,
                           eviction_policy="evict_first")
        b_ss, b_vq = tl.reduce((b_v * b_v, b_v * b_qw), 1, _add2)
        b_s = b_vq * tl.rsqrt(b_ss / D + eps) * scale
        tl.store(logit + i * T + o_t, b_s, mask=m_t)
        b_mn = tl.maximum(b_m, b_s)
        b_a = tl.exp(b_m - b_mn)
        b_p = tl.exp(b_s - b_mn)
        b_z = b_z * b_a + b_p
        b_o = b_o * b_a[:, None] + b_p[:, None] * b_v
        b_m = b_mn
        if not PF:
            b_vn = tl.load(_pick(src, i + 1, NS) + o_td, mask=m_td & (i + 1 < NS), other=0.0,
                           eviction_policy="evict_first")
    tl.store(lse + o_t, b_m + tl.log(b_z), mask=m_t)
    b_o = b_o / b_z[:, None]
    if SAVE_PRE:
        tl.store(o_pre + o_td, b_o.to(o_pre.dtype.element_ty), mask=m_td)
    if HAS_ONORM:
        b_ro = tl.rsqrt(tl.sum(b_o * b_o, 1) / D + eps)  # masked lanes hold zeros
        b_ow = tl.load(ow + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_o = b_o * b_ro[:, None] * b_ow
    tl.store(o + o_td, b_o.to(o.dtype.element_ty), mask=m_td)


@triton.autotune(configs=_bwd_configs(), key=["NS", "BD", "HAS_ONORM", "SAVE_PRE"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def attn_res_bwd_kernel(
    src, dsrc, qw, ow, o_pre, do, lse, dqw, dow, T, eps, scale,
    D: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE_PRE: tl.constexpr,
):
    # A row's N source tiles are read up to three times (o for the output norm, the per-source scalars, ∂v), the
    # first from HBM and the others while they are still in L1/L2. Registers are the constraint (rows of up to 8192
    # lanes): qw and ow are re-read from the cache where used rather than held, so at most six row vectors are live.
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)[None, :]  # row vectors as [1, BD]: the tiles' own layout, no conversions
    m_d = o_d < D
    o_s = tl.arange(0, NSP)
    # per-row partial sums, reduced over the rows once at the end (no cross-row reduction per step)
    b_dqw = tl.zeros([BT, BD], tl.float32)
    b_dow = tl.zeros([BT, BD], tl.float32)
    # ROWS consecutive rows per program, BT at a time (rows past T load zeros and add nothing)
    for i_j in range(ROWS // BT):
        o_t = i_p.to(tl.int64) * ROWS + i_j * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_td = m_t[:, None] & m_d
        o_td = o_t[:, None] * D + o_d
        b_lse = tl.load(lse + o_t, mask=m_t, other=0.0)
        b_g = tl.load(do + o_td, mask=m_td, other=0.0).to(tl.float32)
        if HAS_ONORM:  # through y = o · ro · ow: g = ro (ow ⊙ dy − x̂ mean(x̂ ⊙ ow ⊙ dy)), x̂ = o · ro
            if SAVE_PRE:
                b_op = tl.load(o_pre + o_td, mask=m_td, other=0.0).to(tl.float32)
            else:  # the fp32 mix o = Σ p_i v_i again, from the forward's lse
                b_op = tl.zeros([BT, BD], tl.float32)
                for i in range(NS):
                    b_v = tl.load(_pick(src, i, NS) + o_td, mask=m_td, other=0.0).to(tl.float32)
                    b_qw = tl.load(qw + o_d, mask=m_d, other=0.0)
                    b_ss, b_vq = tl.reduce((b_v * b_v, b_v * b_qw), 1, _add2)
                    b_op += tl.exp(b_vq * tl.rsqrt(b_ss / D + eps) * scale - b_lse)[:, None] * b_v
            b_ro = tl.rsqrt(tl.sum(b_op * b_op, 1) / D + eps)
            b_xh = b_op * b_ro[:, None]
            b_dow += b_xh * b_g
            b_g = b_g * tl.load(ow + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_g = (b_g - b_xh * (tl.sum(b_xh * b_g, 1) / D)[:, None]) * b_ro[:, None]
        if NS == 1:  # p ≡ 1: the score gets no gradient (exactly zero, not a rounding residue)
            tl.store(dsrc[0] + o_td, b_g.to(dsrc[0].dtype.element_ty), mask=m_td)
        else:
            # per-source row scalars r_i, ⟨qw, v_i⟩ r_i, p_i, ⟨g, v_i⟩ in [BT, NSP] tables; δ = Σ_i p_i ⟨g, v_i⟩ from
            # the same values, so Σ_i ∂s_i vanishes to rounding (δ = ⟨g, o⟩ would leave a residue that swamps a
            # small ∂qw when the depth weights are peaked)
            b_R = tl.zeros([BT, NSP], tl.float32)
            b_L = tl.zeros([BT, NSP], tl.float32)
            b_P = tl.zeros([BT, NSP], tl.float32)
            b_G = tl.zeros([BT, NSP], tl.float32)
            for i in range(NS):
                b_v = tl.load(_pick(src, i, NS) + o_td, mask=m_td, other=0.0).to(tl.float32)
                b_qw = tl.load(qw + o_d, mask=m_d, other=0.0)
                b_ss, b_vq, b_vg = tl.reduce((b_v * b_v, b_v * b_qw, b_v * b_g), 1, _add3)
                b_r = tl.rsqrt(b_ss / D + eps)
                m_i = (o_s == i)[None, :]
                b_R = tl.where(m_i, b_r[:, None], b_R)
                b_L = tl.where(m_i, (b_vq * b_r)[:, None], b_L)
                b_P = tl.where(m_i, tl.exp(b_vq * b_r * scale - b_lse)[:, None], b_P)
                b_G = tl.where(m_i, b_vg[:, None], b_G)
            b_DS = b_P * (b_G - tl.sum(b_P * b_G, 1)[:, None]) * scale
            for i in range(NS):
                p_v = _pick(src, i, NS) + o_td
                b_v = tl.load(p_v, mask=m_td, other=0.0, eviction_policy="evict_first").to(tl.float32)
                m_i = (o_s == i)[None, :]
                b_r = tl.sum(tl.where(m_i, b_R, 0.0), 1)
                b_l = tl.sum(tl.where(m_i, b_L, 0.0), 1)
                b_p = tl.sum(tl.where(m_i, b_P, 0.0), 1)
                b_dsr = tl.sum(tl.where(m_i, b_DS, 0.0), 1) * b_r
                b_qw = tl.load(qw + o_d, mask=m_d, other=0.0)
                b_dv = b_p[:, None] * b_g + b_dsr[:, None] * (b_qw - b_v * (b_r * b_l / D)[:, None])
                p_dv = _pick(dsrc, i, NS)
                tl.store(p_dv + o_td, b_dv.to(p_dv.dtype.element_ty), mask=m_td)
                b_dqw += b_dsr[:, None] * b_v
    tl.store(dqw + i_p * D + o_d, tl.sum(b_dqw, 0)[None, :], mask=m_d)
    if HAS_ONORM:
        tl.store(dow + i_p * D + o_d, tl.sum(b_dow, 0)[None, :], mask=m_d)


_BWD_MAX_BT = max(c.kwargs["BT"] for c in _bwd_configs())


@functools.lru_cache(maxsize=8)
def _num_programs_cap(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def attn_res_fwd(
    sources: Sequence[torch.Tensor], qw: torch.Tensor, out_norm_weight: torch.Tensor | None, eps: float,
    scale: float, save_pre: bool, prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sources``: N contiguous ``[T, D]`` tensors of one dtype; ``qw [D]`` fp32 → ``(y [T, D], o_pre [T, D] or
    [0], lse [T] fp32, logits [N, T] fp32)``. ``prior = (o¹ [T, D], ℓ¹ [T] fp32)``: continue the softmax of an
    earlier normalised mix (two-phase inference; forward only)."""
    s0 = sources[0]
    T, D = s0.shape
    y = torch.empty_like(s0)
    o_pre = torch.empty_like(s0) if save_pre else s0.new_empty(0)
    lse = torch.empty(T, dtype=torch.float32, device=s0.device)
    logit = torch.empty(len(sources), T, dtype=torch.float32, device=s0.device)
    if T == 0:
        return y, o_pre, lse, logit
    ow = out_norm_weight if out_norm_weight is not None else qw
    o1, lse1 = prior if prior is not None else (y, lse)  # placeholders when there is no prior (never read)
    with on_device_of(s0):
        attn_res_fwd_kernel[lambda meta: (triton.cdiv(T, meta["BT"]),)](
            tuple(sources), qw, ow, y, o_pre, lse, logit, o1, lse1, T, float(eps), float(scale),
            D=D, NS=len(sources), BD=triton.next_power_of_2(D),
            HAS_ONORM=out_norm_weight is not None, SAVE_PRE=save_pre, HAS_PRIOR=prior is not None)
    return y, o_pre, lse, logit


def attn_res_bwd(
    do: torch.Tensor, sources: Sequence[torch.Tensor], qw: torch.Tensor, out_norm_weight: torch.Tensor | None,
    o_pre: torch.Tensor, lse: torch.Tensor, eps: float, scale: float, save_pre: bool,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Gradients ``([∂v_i [T, D]], ∂qw [D] fp32, ∂ow [D] fp32 or [0])`` for ``do = ∂L/∂y [T, D]``."""
    s0 = sources[0]
    T, D = s0.shape
    dsrc = [torch.empty_like(s) for s in sources]
    cap = _num_programs_cap(s0.device)
    has_onorm = out_norm_weight is not None
    # ROWS (a power of two ≥ every tuned BT) rows per program, enough that the programs number at most ``cap``:
    # the ∂qw / ∂ow partials are ``cap`` rows at most, and the grid does not depend on the tuned BT
    rows = max(_BWD_MAX_BT, triton.next_power_of_2(triton.cdiv(max(T, 1), cap)))
    n_p = triton.cdiv(max(T, 1), rows)
    dqw = torch.empty(n_p, D, dtype=torch.float32, device=s0.device)
    dow = torch.empty(n_p if has_onorm else 0, D, dtype=torch.float32, device=s0.device)
    if T == 0:
        dqw.zero_(), dow.zero_()
    else:
        with on_device_of(s0):
            attn_res_bwd_kernel[(n_p,)](
                tuple(sources), tuple(dsrc), qw, out_norm_weight if has_onorm else qw, o_pre if save_pre else do, do,
                lse, dqw, dow, T, float(eps), float(scale),
                D=D, NS=len(sources), NSP=triton.next_power_of_2(len(sources)), ROWS=rows,
                BD=triton.next_power_of_2(D), HAS_ONORM=has_onorm, SAVE_PRE=save_pre)
    return dsrc, dqw.sum(0), (dow.sum(0) if has_onorm else dow.new_empty(0))
