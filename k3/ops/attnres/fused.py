"""Triton kernels of the AttnRes mix: one read of every source per pass, the mix math in fp32 registers.

Per token (one row of D channels), with sources v_1..v_N, score vector qw = γ ⊙ w (fp32) and logit scale c:

    r_i = rsqrt(mean(v_i²) + eps)      s_i = c · r_i ⟨qw, v_i⟩      p = softmax(s)      o = Σ_i p_i v_i
    y   = o · rsqrt(mean(o²) + eps) · ow          (only with an output norm weight ow; else y = o)

Forward (``attn_res_fwd_kernel``): a program owns BT whole rows (BD = next power of two ≥ D lanes, the tail masked,
so any D works) and streams the N sources once with an online softmax, keeping o in fp32 registers: nothing of size
[N, tokens, D] is ever written. Outputs: y, lse = log Σ exp(s) (fp32, [T]), the logits s ([N, T] fp32, tiny; read
back only for ``return_weights``) and, when asked (``save_pre``), the pre-norm mix o in the sources' dtype.

Backward (``attn_res_bwd_kernel``), with g = ∂L/∂o (through the output norm when there is one) and δ = ⟨g, o⟩:

    ∂s_i = p_i (⟨g, v_i⟩ − δ) · c
    ∂v_i = p_i g + ∂s_i · r_i (qw − v_i · r_i ⟨qw, v_i⟩ / D)        ∂qw = Σ_tokens Σ_i ∂s_i r_i v_i

(∂qw subtracts (Σ_i ∂s_i) · Σ_i p_i r_i v_i, zero in exact arithmetic, so that it does not carry the rounding
residue of δ: the same as taking δ = Σ_i p_i ⟨g, v_i⟩.)

δ and g need o before the first ∂v_i, so the backward either reads the saved o (``save_pre``: sources read once) or
recomputes it from the sources and lse first (sources read twice, no [T, D] activation kept). r_i and s_i are
recomputed from v_i, which is loaded anyway. Each backward program walks a run of consecutive rows (at most about
4 programs per SM), so the ∂qw / ∂ow partial sums are one fp32 [D] row per program, summed after, not [T, D].
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["attn_res_fwd", "attn_res_bwd", "MAX_D"]

# Widest row kept in registers (BD lanes per row); wider rows take the reference path.
MAX_D = 16384


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Keep configs whose [BT, BD] fp32 tile is 8..64 values per thread (register pressure vs. bytes in flight)."""
    bd = kwargs.get("BD", named_args.get("BD"))
    keep = [c for c in configs if 8 * 32 * c.num_warps <= c.kwargs["BT"] * bd <= 64 * 32 * c.num_warps]
    return keep or [min(configs, key=lambda c: c.kwargs["BT"] * c.num_warps)]


def _configs() -> list[triton.Config]:
    if _interpreting():  # the interpreter runs every config when autotuning: one is enough there
        return [triton.Config({"BT": 2}, num_warps=4)]
    return [triton.Config({"BT": bt}, num_warps=w) for bt, w in ((1, 8), (1, 16), (2, 16), (4, 4))]


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.autotune(configs=_configs(), key=["NS", "BD", "HAS_ONORM", "SAVE_PRE"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def attn_res_fwd_kernel(
    src, qw, ow, o, o_pre, lse, logit, T, eps, scale,
    D: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE_PRE: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    o_td = o_t[:, None] * D + o_d[None, :]
    b_qw = tl.load(qw + o_d, mask=m_d, other=0.0)

    # online softmax over the sources; rows past T load zeros and stay finite (p = 1 over zero vectors). The next
    # source's tile is loaded before this one's reductions so a load is always in flight.
    b_vn = tl.load(src[0] + o_td, mask=m_td, other=0.0, eviction_policy="evict_first")
    for i in tl.static_range(NS):
        b_v = b_vn.to(tl.float32)
        if i + 1 < NS:
            b_vn = tl.load(src[i + 1] + o_td, mask=m_td, other=0.0, eviction_policy="evict_first")
        b_ss, b_vq = tl.reduce((b_v * b_v, b_v * b_qw[None, :]), 1, _add2)
        b_r = tl.rsqrt(b_ss / D + eps)
        b_s = b_vq * b_r * scale
        tl.store(logit + i * T + o_t, b_s, mask=m_t)
        if i == 0:
            b_m = b_s
            b_z = tl.full([BT], 1.0, tl.float32)
            b_o = b_v
        else:
            b_mn = tl.maximum(b_m, b_s)
            b_a = tl.exp(b_m - b_mn)
            b_p = tl.exp(b_s - b_mn)
            b_z = b_z * b_a + b_p
            b_o = b_o * b_a[:, None] + b_p[:, None] * b_v
            b_m = b_mn
    tl.store(lse + o_t, b_m + tl.log(b_z), mask=m_t)
    b_o = b_o / b_z[:, None]
    if SAVE_PRE:
        tl.store(o_pre + o_td, b_o.to(o_pre.dtype.element_ty), mask=m_td)
    if HAS_ONORM:
        b_ro = tl.rsqrt(tl.sum(b_o * b_o, 1) / D + eps)  # masked lanes hold zeros
        b_ow = tl.load(ow + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_o = b_o * b_ro[:, None] * b_ow[None, :]
    tl.store(o + o_td, b_o.to(o.dtype.element_ty), mask=m_td)


@triton.autotune(configs=_configs(), key=["NS", "BD", "HAS_ONORM", "SAVE_PRE"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def attn_res_bwd_kernel(
    src, dsrc, qw, ow, o_pre, do, lse, dqw, dow, T, eps, scale,
    D: tl.constexpr, NS: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE_PRE: tl.constexpr,
):
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_qw = tl.load(qw + o_d, mask=m_d, other=0.0)
    if HAS_ONORM:
        b_ow = tl.load(ow + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dqw = tl.zeros([BD], tl.float32)
    b_dow = tl.zeros([BD], tl.float32)
    # ROWS consecutive rows per program, BT at a time (rows past T load zeros and add nothing)
    for i_j in range(ROWS // BT):
        o_t = i_p.to(tl.int64) * ROWS + i_j * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_td = m_t[:, None] & m_d[None, :]
        o_td = o_t[:, None] * D + o_d[None, :]
        b_lse = tl.load(lse + o_t, mask=m_t, other=0.0)
        b_do = tl.load(do + o_td, mask=m_td, other=0.0).to(tl.float32)
        if SAVE_PRE:
            b_op = tl.load(o_pre + o_td, mask=m_td, other=0.0).to(tl.float32)
        else:  # first pass: the mix o = Σ p_i v_i from the forward's lse
            b_op = tl.zeros([BT, BD], tl.float32)
            b_vn = tl.load(src[0] + o_td, mask=m_td, other=0.0)
            for i in tl.static_range(NS):
                b_v = b_vn.to(tl.float32)
                if i + 1 < NS:
                    b_vn = tl.load(src[i + 1] + o_td, mask=m_td, other=0.0)
                b_ss, b_vq = tl.reduce((b_v * b_v, b_v * b_qw[None, :]), 1, _add2)
                b_p = tl.exp(b_vq * tl.rsqrt(b_ss / D + eps) * scale - b_lse)
                b_op += b_p[:, None] * b_v
        if HAS_ONORM:  # through y = o · ro · ow: g = ro (ow ⊙ dy − x̂ mean(x̂ ⊙ ow ⊙ dy)), x̂ = o · ro
            b_ro = tl.rsqrt(tl.sum(b_op * b_op, 1) / D + eps)
            b_xh = b_op * b_ro[:, None]
            b_dow += tl.sum(b_xh * b_do, 0)
            b_gw = b_do * b_ow[None, :]
            b_g = (b_gw - b_xh * (tl.sum(b_xh * b_gw, 1) / D)[:, None]) * b_ro[:, None]
        else:
            b_g = b_do
        b_delta = tl.sum(b_g * b_op, 1)
        # Σ_i ∂s_i is 0 in exact arithmetic; with δ from the fp32 mix it is a rounding residue that, times the keys,
        # would swamp a small ∂qw (peaked weights): remove it, i.e. use δ' = Σ_i p_i ⟨g, v_i⟩ for ∂qw
        b_sds = tl.zeros([BT], tl.float32)
        b_kbar = tl.zeros([BT, BD], tl.float32)
        b_vn = tl.load(src[0] + o_td, mask=m_td, other=0.0, eviction_policy="evict_first")
        for i in tl.static_range(NS):
            b_v = b_vn.to(tl.float32)
            if i + 1 < NS:
                b_vn = tl.load(src[i + 1] + o_td, mask=m_td, other=0.0, eviction_policy="evict_first")
            if NS == 1:  # p ≡ 1: the logit gets no gradient (exactly zero, not a rounding residue)
                b_dv = b_g
            else:
                b_ss, b_vq, b_vg = tl.reduce((b_v * b_v, b_v * b_qw[None, :], b_v * b_g), 1, _add3)
                b_r = tl.rsqrt(b_ss / D + eps)
                b_l = b_vq * b_r
                b_p = tl.exp(b_l * scale - b_lse)
                b_ds = b_p * (b_vg - b_delta) * scale
                b_dsr = b_ds * b_r
                b_dv = b_p[:, None] * b_g + b_dsr[:, None] * (b_qw[None, :] - b_v * (b_r * b_l / D)[:, None])
                b_dqw += tl.sum(b_dsr[:, None] * b_v, 0)
                b_sds += b_ds
                b_kbar += (b_p * b_r)[:, None] * b_v
            tl.store(dsrc[i] + o_td, b_dv.to(dsrc[i].dtype.element_ty), mask=m_td)
        b_dqw -= tl.sum(b_sds[:, None] * b_kbar, 0)
    tl.store(dqw + i_p * D + o_d, b_dqw, mask=m_d)
    if HAS_ONORM:
        tl.store(dow + i_p * D + o_d, b_dow, mask=m_d)


@functools.lru_cache(maxsize=8)
def _num_programs_cap(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def attn_res_fwd(
    sources: Sequence[torch.Tensor], qw: torch.Tensor, out_norm_weight: torch.Tensor | None, eps: float,
    scale: float, save_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sources``: N contiguous ``[T, D]`` tensors of one dtype; ``qw [D]`` fp32 → ``(y [T, D], o_pre [T, D] or
    [0], lse [T] fp32, logits [N, T] fp32)``."""
    s0 = sources[0]
    T, D = s0.shape
    y = torch.empty_like(s0)
    o_pre = torch.empty_like(s0) if save_pre else s0.new_empty(0)
    lse = torch.empty(T, dtype=torch.float32, device=s0.device)
    logit = torch.empty(len(sources), T, dtype=torch.float32, device=s0.device)
    if T == 0:
        return y, o_pre, lse, logit
    ow = out_norm_weight if out_norm_weight is not None else qw
    attn_res_fwd_kernel[lambda meta: (triton.cdiv(T, meta["BT"]),)](
        tuple(sources), qw, ow, y, o_pre, lse, logit, T, float(eps), float(scale),
        D=D, NS=len(sources), BD=triton.next_power_of_2(D),
        HAS_ONORM=out_norm_weight is not None, SAVE_PRE=save_pre)
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
    rows = max(4, triton.next_power_of_2(triton.cdiv(max(T, 1), cap)))
    n_p = triton.cdiv(max(T, 1), rows)
    dqw = torch.empty(n_p, D, dtype=torch.float32, device=s0.device)
    dow = torch.empty(n_p if has_onorm else 0, D, dtype=torch.float32, device=s0.device)
    if T == 0:
        dqw.zero_(), dow.zero_()
    else:
        attn_res_bwd_kernel[(n_p,)](
            tuple(sources), tuple(dsrc), qw, out_norm_weight if has_onorm else qw, o_pre if save_pre else do, do,
            lse, dqw, dow, T, float(eps), float(scale),
            D=D, NS=len(sources), ROWS=rows, BD=triton.next_power_of_2(D), HAS_ONORM=has_onorm, SAVE_PRE=save_pre)
    return dsrc, dqw.sum(0), (dow.sum(0) if has_onorm else dow.new_empty(0))
