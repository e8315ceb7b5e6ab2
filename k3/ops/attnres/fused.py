"""Triton kernels of the AttnRes mix: the sources streamed through shared memory, the mix math in fp32 registers.

Per token (one row of D channels), with sources v_1..v_N, score vector qw = γ ⊙ w (fp32) and logit scale c:

    r_i = rsqrt(mean(v_i²) + eps)      l_i = r_i ⟨qw, v_i⟩      p = softmax(c · l)      o = Σ_i p_i v_i
    y   = o · rsqrt(mean(o²) + eps) · ow          (only with an output norm weight ow; else y = o)

Both kernels are one flat loop over (rows, tile) steps: a program owns ROWS consecutive rows (BD = next power of two
≥ D lanes, the tail masked, so any D works) and every step loads one [BT, BD] tile. The loop is software pipelined
(``tl.range(num_stages=STAGES)``): the tiles of the next STAGES − 1 steps are already on their way into shared
memory (cp.async) while the current one is reduced, across row boundaries too, so the copy engine never waits for
the reductions and a program keeps 2–4 tiles (28–56 KB) in flight. The source of a tile is picked from the pointer
tuple with ``_pick`` (a runtime index): unrolled source loops make the compiler hoist every load into registers and
spill. Rows past T re-read the last row and are not stored, so the loads need no row mask and the pipeline carries
row indices, not [BD] offsets and masks.

Forward (``attn_res_fwd_kernel``): per row, the N sources once, with an online softmax (offset raised lazily, sum,
fp32 accumulator o); at the row's last source o is normalised (and output-normed) and stored. Nothing of size
[N, tokens, D] is ever written; besides y it writes lse = log Σ exp(c·l) ([T] fp32) and the per-source row scalars
l_i and r_i ([N, T] fp32 each, kept for the backward and ``return_weights``), and, when asked (``save_pre``), the
pre-norm mix o in the sources' dtype.

Backward (``attn_res_bwd_kernel``; ``attn_res_bwd_held_kernel`` below does the same math from one register tile
of a step's sources, for narrow rows of few sources: see ``holds_rows``): per row the tiles [v_1..v_N or the saved
o: only with the output norm], dy, v_1..v_N (⟨g, v_i⟩), v_1..v_N (∂v_i):

    o = Σ_i p_i v_i (fp32, p_i = exp(c · l_i − lse) from the forward's scalars, no reductions)
    g = ∂L/∂o = dy, or through the output norm g = ro (ow ⊙ dy − x̂ · mean(x̂ ⊙ ow ⊙ dy)), x̂ = o · ro
    ∂s_i = c · p_i (⟨g, v_i⟩ − δ),  δ = Σ_i p_i ⟨g, v_i⟩  (the same ⟨g, v_i⟩ values: Σ_i ∂s_i vanishes to rounding)
    ∂v_i = p_i g + ∂s_i · r_i (qw − v_i · r_i l_i / D)        ∂qw = Σ_tokens Σ_i ∂s_i r_i v_i

so each source is read two or three times per row (the later reads mostly from L2) and dy once; ∂v_i is written
once. Each program writes one fp32 [D] partial row of ∂qw (and ∂ow), summed after: T / ROWS rows, not [T, D].
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["attn_res_fwd", "attn_res_bwd", "holds_rows", "MAX_D"]

# Widest row kept in registers (BD lanes per row); wider rows take the reference path.
MAX_D = 16384
# Slack of the forward's lazy softmax offset (natural-log units): p_i = e^(s_i − m) ≤ e^8 ≈ 3e3.
E_SLACK: tl.constexpr = tl.constexpr(8.0)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _row_values(c: triton.Config, bd: int) -> int:
    """fp32 values of one [BD] row vector per thread."""
    return max(1, bd // (32 * c.num_warps))


def _fallback(configs: list[triton.Config], bd: int) -> list[triton.Config]:
    """Rows narrower than the tuned ones: the fewest warps, most rows per step; wider: the most warps."""
    return [min(configs, key=lambda c: (_row_values(c, bd) > 32, c.num_warps if _row_values(c, bd) <= 32
                                        else -c.num_warps, -c.kwargs.get("BT", 1), -c.kwargs["STAGES"]))]


def _prune_fwd(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Configs whose BT rows per step divide the program's rows, with 8..32 values of a row and 16..64 of a step's
    tile per thread (16-byte loads of half types, registers to spare, per-step overheads shared by enough bytes),
    each step width at the fewest warps that hold its rows in ≤ 32 values per thread."""
    bd = kwargs.get("BD", named_args.get("BD"))
    rows = kwargs.get("ROWS", named_args.get("ROWS"))
    fit = [c for c in configs if rows % c.kwargs["BT"] == 0]

    def fewest(c: triton.Config) -> bool:
        return not any(d.kwargs["BT"] == c.kwargs["BT"] and d.num_warps < c.num_warps and _row_values(d, bd) <= 32
                       for d in fit)

    keep = [c for c in fit if 8 <= _row_values(c, bd) <= 32 and 16 <= c.kwargs["BT"] * _row_values(c, bd) <= 64
            and fewest(c)]
    return keep or _fallback(fit, bd)


def _prune_bwd(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """One row per step with 16..32 values of a row vector per thread (at K3's width: 8 warps at ~230 registers and
    16 at ≤ 128, each one program per SM; the GPU picks). Narrower rows (``small``'s 1,024) would spend a step's
    fixed work — the row reductions, the scalar loads, the pass logic — on a 2 KB tile: there the autotuner also
    measures BT = 2..8 rows per step (≤ 32 values of a row and ≤ 64 of a tile per thread) beside one row."""
    bd = kwargs.get("BD", named_args.get("BD"))
    rows = kwargs.get("ROWS", named_args.get("ROWS"))
    fit = [c for c in configs if rows % c.kwargs["BT"] == 0]
    wide = [c for c in fit if c.kwargs["BT"] == 1 and 16 <= _row_values(c, bd) <= 32]
    narrow = [c for c in fit if _row_values(c, bd) <= 32 and c.kwargs["BT"] * _row_values(c, bd) <= 64]
    return wide or narrow or _fallback(fit, bd)


def _configs(triples: tuple[tuple[int, int, int], ...], interpreted: tuple[int, int, int]) -> list[triton.Config]:
    """(BT rows per step, num_warps, STAGES) triples as configs; the interpreter, which cannot autotune, gets the
    single ``interpreted`` one."""
    if _interpreting():
        triples = (interpreted,)
    return [triton.Config({"BT": b, "STAGES": s}, num_warps=w) for b, w, s in triples]


# (BT rows per step, num_warps, STAGES), from the sm_90 build at D 7168 (ptxas register counts and SASS
# instructions per tile). Forward: 1 row × 8 warps needs ~120 registers, two programs per SM with 2–3 tiles each in
# flight (32–48 KB of shared memory per program); 2 rows × 8 warps, ~230 registers, one program per SM, a quarter
# fewer instructions per tile. Backward: the loop carries two fp32 row vectors and the tile: 16 warps at ≤ 128
# registers or 8 warps at ~215–250 (a third fewer instructions per tile), one program per SM either way. The GPU's autotuner picks; 4 warps (and 4 rows per forward
# step) narrow rows, 16 warps rows wider than K3's.
_FWD_CONFIGS = _configs(((1, 8, 3), (1, 8, 4), (2, 8, 3), (4, 4, 3), (1, 4, 3), (1, 16, 4)), (1, 4, 1))
_BWD_CONFIGS = _configs(((1, 16, 5), (1, 8, 3), (1, 8, 4), (1, 4, 3), (2, 4, 3), (4, 4, 3), (8, 4, 3), (4, 8, 3),
                         (8, 8, 3)), (2, 4, 1))


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fwd_rows(T: int, device: torch.device) -> int:
    """Rows per forward program: 4 once there are enough rows to fill the GPU several times over (the pipeline then
    runs across row boundaries), else 1 (short inputs, e.g. decoding: more programs, shorter latency)."""
    return 4 if T >= 16 * _sm_count(device) else 1


def _bwd_rows(T: int, device: torch.device) -> int:
    """Rows per backward program: 16 for long inputs (the ∂qw / ∂ow partials are then T/16 rows), else 1 (2 in the
    interpreter, whose one config takes two rows per step: the tests then cover the multi-row code)."""
    return 16 if T >= 32 * _sm_count(device) else (2 if _interpreting() else 1)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _pick(ptrs, i, NS: tl.constexpr):
    """``ptrs[i]`` for a runtime ``i`` (a chain of scalar selects)."""
    p = ptrs[0]
    for j in tl.static_range(1, NS):
        p = tl.where(i == j, ptrs[j], p)
    return p


@triton.autotune(configs=_FWD_CONFIGS, key=["NS", "BD", "ROWS", "HAS_ONORM", "SAVE_PRE", "HAS_PRIOR"],
                 prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit(do_not_specialize=["T"])  # one binary for every token count (T only bounds rows and strides logits)
def attn_res_fwd_kernel(
    src, qw, ow, o, o_pre, lse, logit, rstd, o1, lse1, T, eps, scale,
    D: tl.constexpr, NS: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_ONORM: tl.constexpr, SAVE_PRE: tl.constexpr, HAS_PRIOR: tl.constexpr, STAGES: tl.constexpr,
):
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)[None, :]
    m_d = o_d < D
    b_qw = tl.load(qw + o_d, mask=m_d, other=0.0)
    # online softmax state of the current BT rows: exponent offset m (the running max, raised lazily), Σ, o
    b_m = tl.full([BT], float("-inf"), tl.float32)
    b_z = tl.zeros([BT], tl.float32)
    b_o = tl.zeros([BT, BD], tl.float32)
    # one iteration per (BT rows, source)
    for k in tl.range(0, (ROWS // BT) * NS, num_stages=STAGES):
        i_s = k % NS
        o_t = i_p.to(tl.int64) * ROWS + (k // NS) * BT + tl.arange(0, BT)
        m_t = o_t < T
        # rows past T re-read the last row (their results are not stored): the loads need no row mask
        o_c = tl.minimum(o_t, T - 1)
        b_v = tl.load(_pick(src, i_s, NS) + o_c[:, None] * D + o_d, mask=m_d, other=0.0,
                      eviction_policy="evict_first").to(tl.float32)
        b_ss, b_vq = tl.reduce((b_v * b_v, b_v * b_qw), 1, _add2)  # both row sums in one cross-warp reduction
        b_r = tl.rsqrt(b_ss / D + eps)
        tl.store(logit + i_s * T + o_t, b_vq * b_r, mask=m_t)
        tl.store(rstd + i_s * T + o_t, b_r, mask=m_t)
        b_s = b_vq * b_r * scale
        if HAS_PRIOR:
            if i_s == 0:  # two-phase merge: continue from the mix o¹ of earlier sources and its lse ℓ¹
                b_m = tl.load(lse1 + o_c)
                b_z = tl.full([BT], 1.0, tl.float32)
                b_o = tl.load(o1 + o_c[:, None] * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        # the offset is raised only when a score exceeds it by more than E_SLACK (each p ≤ e^E_SLACK, far from
        # overflow): most sources skip the rescale of o. Rows start from m = -inf, o = 0: their first source
        # rescales by e^-inf = 0.
        if tl.max(b_s - b_m, 0) > E_SLACK:
            b_mn = tl.where(b_s > b_m + E_SLACK, b_s, b_m)
            b_a = tl.exp(b_m - b_mn)
            b_z = b_z * b_a
            b_o = b_o * b_a[:, None]
            b_m = b_mn
        b_p = tl.exp(b_s - b_m)
        b_z = b_z + b_p
        b_o += b_p[:, None] * b_v
        if i_s == NS - 1:  # the rows' last source: normalise, output-norm, store; reset the state
            m_y = m_t[:, None] & m_d
            o_y = o_t[:, None] * D + o_d
            tl.store(lse + o_t, b_m + tl.log(b_z), mask=m_t)
            b_c = 1.0 / b_z
            if SAVE_PRE:
                tl.store(o_pre + o_y, (b_o * b_c[:, None]).to(o_pre.dtype.element_ty), mask=m_y)
            if HAS_ONORM:  # ow re-read from L1 (masked by the rows: not hoisted out of the loop into registers)
                b_c = b_c * tl.rsqrt(tl.sum(b_o * b_o, 1) * (b_c * b_c) / D + eps)  # masked lanes hold zeros
                b_y = b_o * b_c[:, None] * tl.load(ow + o_d, mask=m_y, other=0.0).to(tl.float32)
            else:
                b_y = b_o * b_c[:, None]
            tl.store(o + o_y, b_y.to(o.dtype.element_ty), mask=m_y)
            b_m = tl.full([BT], float("-inf"), tl.float32)
            b_z = tl.zeros([BT], tl.float32)
            b_o = tl.zeros([BT, BD], tl.float32)


@triton.autotune(configs=_BWD_CONFIGS, key=["NS", "BD", "ROWS", "HAS_ONORM", "SAVE_PRE"],
                 prune_configs_by={"early_config_prune": _prune_bwd})
@triton.jit(do_not_specialize=["T", "ACC"])
def attn_res_bwd_kernel(
    src, dsrc, qw, ow, o_pre, do, lse, logit, rstd, dqw, dow, T, eps, scale, ACC,
    D: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, NO: tl.constexpr, NG: tl.constexpr, ROWS: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, HAS_ONORM: tl.constexpr, SAVE_PRE: tl.constexpr, STAGES: tl.constexpr,
):
    # Per row NJ = NO + 1 + NG + NS tiles: the NO tiles that give o (the N sources, or the saved o; none without
    # the output norm), dy, the N sources for ⟨g, v_i⟩ (none for one source), the N sources for ∂v. The forward's
    # per-source scalars l_i = r_i ⟨qw, v_i⟩ and r_i come with each source tile (p_i = exp(c · l_i − lse)): no
    # reduction but ⟨g, v_i⟩. They and ⟨g, v_i⟩ live in three [NSP] register tables, which then become the
    # coefficients of ∂v_i; qw and ow are re-read from L1 where used rather than held: the loop carries two fp32 row
    # vectors (o then g, and the ∂qw partial sum). The tile's source index is integer arithmetic on j and each pass
    # condition is computed where it is used: the software pipeline then carries j between its stages, not a set of
    # predicates.
    NJ: tl.constexpr = NO + 1 + NG + NS
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)[None, :]
    m_d = o_d < D
    o_s = tl.arange(0, NSP)[None, :]
    b_x = tl.zeros([BT, BD], tl.float32)  # o while the first NO tiles stream in, then g = ∂L/∂o
    b_dqw = tl.zeros([1, BD], tl.float32)
    # r_i, l_i, ⟨g, v_i⟩ per row; at the end of the ⟨g, v_i⟩ pass they become a_i, b_i, c_i with
    # ∂v_i = a_i g + b_i qw − c_i v_i and ∂qw += b_i v_i  (one source: p ≡ 1, no score gradient, exactly)
    b_T0 = tl.full([BT, NSP], 1.0, tl.float32)
    b_T1 = tl.zeros([BT, NSP], tl.float32)
    b_T2 = tl.zeros([BT, NSP], tl.float32)
    for k in tl.range(0, (ROWS // BT) * NJ, num_stages=STAGES):
        j = k % NJ
        i_t = i_p.to(tl.int64) * ROWS + (k // NJ) * BT + tl.arange(0, BT)
        i_c = tl.minimum(i_t, T - 1)  # rows past T re-read the last row, with dy taken as zero: they add nothing
        # the tile's source: j for the o tiles, then j − NO − 1 modulo N (dy and the saved o take another pointer).
        # Computed twice in two forms: i_l for the loads, i_s for the passes, so that the compiler does not merge
        # them and the pipeline carries neither i_s nor the [NSP] masks derived from it.
        if NO == NS:
            i_l = (j - tl.minimum(j // NS, 1)) % NS
            i_s = (j + NS - tl.minimum(j // NS, 1)) % NS
        else:
            i_l = (j + NS - NO - 1) % NS
            i_s = (j + 2 * NS - NO - 1) % NS
        p_x = tl.where(j == NO, do, _pick(src, i_l, NS))
        if SAVE_PRE:
            p_x = tl.where(j == 0, o_pre, p_x)
        b_v = tl.load(p_x + i_c[:, None] * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        o_c = i_l * T + i_c  # the tile's source scalars (those of a source for dy and o_pre)
        b_l = tl.load(logit + o_c)
        b_r = tl.load(rstd + o_c)
        b_p = tl.exp(b_l * scale - tl.load(lse + i_c))
        if j < NO:  # o = Σ_i p_i v_i in fp32 (or the saved o)
            if SAVE_PRE:
                b_x = b_v
            elif j == 0:
                b_x = b_p[:, None] * b_v
            else:
                b_x += b_p[:, None] * b_v
        elif j == NO:  # dy → g = ∂L/∂o
            b_v = tl.where((i_t < T)[:, None], b_v, 0.0)
            if HAS_ONORM:  # through y = o · ro · ow
                b_ro = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
                b_xh = b_x * b_ro[:, None]
                # the program's ∂ow partial row lives in memory (L1: the tiles bypass it), updated once per BT
                # rows: one fp32 row vector fewer in registers
                p_dow = dow + i_p * D + o_d
                b_dow = tl.sum(b_xh * b_v, 0)[None, :]
                if k == NO:
                    tl.store(p_dow, b_dow, mask=m_d)
                else:
                    tl.store(p_dow, tl.load(p_dow, mask=m_d, other=0.0) + b_dow, mask=m_d)
                b_u = b_v * tl.load(ow + o_d, mask=m_d & (j >= 0), other=0.0).to(tl.float32)
                b_x = (b_u - b_xh * (tl.sum(b_xh * b_u, 1) / D)[:, None]) * b_ro[:, None]
            else:
                b_x = b_v
        elif j < NO + 1 + NG:  # ⟨g, v_i⟩
            m_i = o_s == i_s
            b_T0 = tl.where(m_i, b_r[:, None], b_T0)
            b_T1 = tl.where(m_i, b_l[:, None], b_T1)
            b_T2 = tl.where(m_i, tl.sum(b_x * b_v, 1)[:, None], b_T2)
            if i_s == NS - 1:  # p = softmax(c · l) and ∂s_i = c p_i (⟨g, v_i⟩ − δ) with δ = Σ_i p_i ⟨g, v_i⟩ from these
                # same values, so Σ_i ∂s_i vanishes to rounding (δ = ⟨g, o⟩ would leave a residue that swamps a
                # small ∂qw when the depth weights are peaked)
                b_sc = tl.where(o_s < NS, b_T1 * scale, float("-inf"))
                b_P = tl.exp(b_sc - tl.max(b_sc, 1)[:, None])
                b_P = b_P / tl.sum(b_P, 1)[:, None]
                b_B = b_P * (b_T2 - tl.sum(b_P * b_T2, 1)[:, None]) * scale * b_T0
                b_T2 = b_B * b_T0 * b_T1 / D
                b_T0 = b_P
                b_T1 = b_B
        else:  # ∂v_i, and the rows' share of ∂qw
            m_i = o_s == i_s
            b_a = tl.sum(tl.where(m_i, b_T0, 0.0), 1)[:, None]
            b_b = tl.sum(tl.where(m_i, b_T1, 0.0), 1)[:, None]
            b_c = tl.sum(tl.where(m_i, b_T2, 0.0), 1)[:, None]
            b_qw = tl.load(qw + o_d, mask=m_d & (j >= 0), other=0.0)
            b_dv = b_a * b_x + b_b * b_qw - b_c * b_v
            p_dv = _pick(dsrc, i_s, NS) + i_t[:, None] * D + o_d
            m_dv = m_d & (i_t < T)[:, None]
            # bit i of ACC: ∂v_i adds to what its buffer holds (the other mixes' gradients of the same tensor); a
            # clear bit masks the load off, so no bytes move
            b_dv += tl.load(p_dv, mask=m_dv & (((ACC >> i_s) & 1) != 0), other=0.0).to(tl.float32)
            tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), mask=m_dv)
            b_dqw += tl.sum(b_b * b_v, 0)[None, :]  # rows past T have g = 0, hence b = 0
    tl.store(dqw + i_p * D + o_d, b_dqw, mask=m_d)


# --- the backward with a step's sources held in registers ---------------------------------------------------------
# Narrow rows (BD ≤ 2,048) of a step's N sources fit in registers when N (to the next power of two) × BD ≤
# HELD_VALUES: ``small``'s 1,024-wide rows with up to 8 sources (sm_90: ≤ 32 values of the tile per thread, 55–240
# registers, no spills; 16 sources, or K3's 7,168-wide rows, spill, and those rows are wide enough for the streamed
# kernel). Each source tile is then read once per row instead of two or three times (o, ⟨g, v_i⟩, ∂v_i), and the
# row's math is a few tensor reductions instead of a pass schedule.
HELD_VALUES = 8192
# HELD_FASTER: where holding the rows also measured faster on the H200 (``python -m k3.bench attnres --backward``, d
# 1024, 32 K tokens, bf16): 1.3–2.1× at 2–4 sources (4,096 values a step), 0.5–1.0× at 5–8 (8,192: the 32 values a
# thread leave the kernel short of registers for its reductions' temporaries).
HELD_FASTER = 4096


def fits_registers(n: int, d: int) -> bool:
    """Whether a step's ``n`` source rows of width ``d`` fit ``attn_res_bwd_held_kernel``'s registers."""
    bd = triton.next_power_of_2(d)
    return bd <= 2048 and triton.next_power_of_2(n) * bd <= HELD_VALUES


def holds_rows(n: int, d: int) -> bool:
    """Whether the backward of an ``n``-source mix of ``d``-wide rows runs ``attn_res_bwd_held_kernel``.

    ``K3_ATTNRES_BACKWARD``: ``auto`` (default) where it measured faster (a step of at most ``HELD_FASTER`` values),
    ``held`` wherever the rows fit the registers, ``streamed`` never."""
    mode = os.environ.get("K3_ATTNRES_BACKWARD", "auto")
    if mode not in ("auto", "held", "streamed"):
        raise ValueError(f"K3_ATTNRES_BACKWARD must be 'auto', 'held' or 'streamed', got {mode!r}")
    if mode == "streamed" or not fits_registers(n, d):
        return False
    return mode == "held" or triton.next_power_of_2(n) * triton.next_power_of_2(d) <= HELD_FASTER


def _prune_held(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Configs whose BT rows divide the program's rows, with at most 32 values of a step's [BT, N, BD] tile per
    thread (the tile, its fp32 gradient and the row vectors then stay in ≤ 255 registers without spilling)."""
    nsp, bd = kwargs.get("NSP", named_args.get("NSP")), kwargs.get("BD", named_args.get("BD"))
    rows = kwargs.get("ROWS", named_args.get("ROWS"))
    fit = [c for c in configs if rows % c.kwargs["BT"] == 0]
    keep = [c for c in fit if c.kwargs["BT"] * nsp * bd <= 32 * 32 * c.num_warps]
    return keep or [max(fit, key=lambda c: (c.num_warps, -c.kwargs["BT"]))]


_HELD_CONFIGS = _configs(((1, 4, 2), (1, 8, 2), (2, 8, 2), (1, 4, 3), (1, 8, 3), (2, 4, 2), (4, 8, 2)),
                         (2, 4, 1))


@triton.jit
def _ptr_table(ptrs, o_s, NS: tl.constexpr):
    """``ptrs[o_s]`` as a pointer tensor of ``o_s``'s shape (entries past NS point at source 0; their lanes are
    masked by the caller)."""
    p = ptrs[0] + o_s * 0
    for j in tl.static_range(1, NS):
        p = tl.where(o_s == j, ptrs[j], p)
    return p


@triton.autotune(configs=_HELD_CONFIGS, key=["NS", "BD", "ROWS", "HAS_ONORM"],
                 prune_configs_by={"early_config_prune": _prune_held})
@triton.jit(do_not_specialize=["T", "ACC"])
def attn_res_bwd_held_kernel(
    src, dsrc, qw, ow, do, lse, logit, rstd, dqw, dow, T, eps, scale, ACC,
    D: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_ONORM: tl.constexpr, STAGES: tl.constexpr,
):
    # The same gradients as attn_res_bwd_kernel (see the module docstring), one [BT, NSP, BD] tile of sources a step.
    i_p = tl.program_id(0)
    o_d2 = tl.arange(0, BD)[None, :]
    m_d2 = o_d2 < D
    o_d = o_d2[:, None, :]  # [1, 1, BD]
    m_d = o_d < D
    o_s2 = tl.arange(0, NSP)[None, :]  # [1, NSP]
    m_s2 = o_s2 < NS
    o_s = o_s2[:, :, None]  # [1, NSP, 1]
    m_s = o_s < NS
    p_src = _ptr_table(src, o_s, NS)
    p_dsrc = _ptr_table(dsrc, o_s, NS)
    m_acc = ((ACC >> o_s) & 1) != 0  # ∂v_i adds to what its buffer holds (see attn_res_bwd's ``into``)
    b_qw = tl.load(qw + o_d, mask=m_d, other=0.0)
    b_dqw = tl.zeros([BD], tl.float32)
    b_dow = tl.zeros([BD], tl.float32)
    for k in tl.range(0, ROWS // BT, num_stages=STAGES):
        i_t = i_p.to(tl.int64) * ROWS + k * BT + tl.arange(0, BT)
        i_c = tl.minimum(i_t, T - 1)  # rows past T re-read the last row, with dy taken as zero: they add nothing
        b_v = tl.load(p_src + i_c[:, None, None] * D + o_d, mask=m_s & m_d, other=0.0).to(tl.float32)
        o_c = o_s2 * T + i_c[:, None]
        b_l = tl.load(logit + o_c, mask=m_s2, other=0.0)
        b_r = tl.load(rstd + o_c, mask=m_s2, other=0.0)
        b_dy = tl.load(do + i_c[:, None] * D + o_d2, mask=m_d2, other=0.0).to(tl.float32)
        b_dy = tl.where((i_t < T)[:, None], b_dy, 0.0)
        if HAS_ONORM:  # g through y = o · ro · ow, o = Σ_i p_i v_i from the forward's scalars
            b_p = tl.where(m_s2, tl.exp(b_l * scale - tl.load(lse + i_c)[:, None]), 0.0)
            b_o = tl.sum(b_p[:, :, None] * b_v, 1)
            b_ro = tl.rsqrt(tl.sum(b_o * b_o, 1) / D + eps)
            b_xh = b_o * b_ro[:, None]
            b_dow += tl.sum(b_xh * b_dy, 0)
            b_u = b_dy * tl.load(ow + o_d2, mask=m_d2, other=0.0).to(tl.float32)
            b_g = (b_u - b_xh * (tl.sum(b_xh * b_u, 1) / D)[:, None]) * b_ro[:, None]
        else:
            b_g = b_dy
        # ∂s_i = c p_i (⟨g, v_i⟩ − δ), δ = Σ_i p_i ⟨g, v_i⟩ from the same values (Σ_i ∂s_i vanishes to rounding)
        b_gv = tl.sum(b_g[:, None, :] * b_v, 2)
        b_sc = tl.where(m_s2, b_l * scale, float("-inf"))
        b_P = tl.exp(b_sc - tl.max(b_sc, 1)[:, None])
        b_P = b_P / tl.sum(b_P, 1)[:, None]
        b_B = b_P * (b_gv - tl.sum(b_P * b_gv, 1)[:, None]) * scale * b_r
        b_C = b_B * b_r * b_l / D
        b_dv = b_P[:, :, None] * b_g[:, None, :] + b_B[:, :, None] * b_qw - b_C[:, :, None] * b_v
        p_dv = p_dsrc + i_t[:, None, None] * D + o_d
        m_dv = m_s & m_d & (i_t < T)[:, None, None]
        b_dv += tl.load(p_dv, mask=m_dv & m_acc, other=0.0).to(tl.float32)
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), mask=m_dv)
        b_dqw += tl.sum(tl.sum(b_B[:, :, None] * b_v, 1), 0)  # rows past T have g = 0, hence B = 0
    tl.store(dqw + i_p * D + o_d2, b_dqw[None, :], mask=m_d2)
    if HAS_ONORM:
        tl.store(dow + i_p * D + o_d2, b_dow[None, :], mask=m_d2)


def attn_res_fwd(
    sources: Sequence[torch.Tensor], qw: torch.Tensor, out_norm_weight: torch.Tensor | None, eps: float,
    scale: float, save_pre: bool, prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sources``: N contiguous ``[T, D]`` tensors of one dtype; ``qw [D]`` fp32 → ``(y [T, D], o_pre [T, D] or
    [0], lse [T] fp32, logits l [N, T] fp32 (unscaled: p = exp(scale · l − lse)), rstd [N, T] fp32)``.
    ``prior = (o¹ [T, D], ℓ¹ [T] fp32)``: continue the softmax of an earlier normalised mix (two-phase inference;
    forward only)."""
    s0 = sources[0]
    T, D = s0.shape
    y = torch.empty_like(s0)
    o_pre = torch.empty_like(s0) if save_pre else s0.new_empty(0)
    lse = torch.empty(T, dtype=torch.float32, device=s0.device)
    logit = torch.empty(len(sources), T, dtype=torch.float32, device=s0.device)
    rstd = torch.empty(len(sources), T, dtype=torch.float32, device=s0.device)
    if T == 0:
        return y, o_pre, lse, logit, rstd
    ow = out_norm_weight if out_norm_weight is not None else qw
    o1, lse1 = prior if prior is not None else (y, lse)  # placeholders when there is no prior (never read)
    rows = _fwd_rows(T, s0.device)
    with on_device_of(s0):
        attn_res_fwd_kernel[(triton.cdiv(T, rows),)](
            tuple(sources), qw, ow, y, o_pre, lse, logit, rstd, o1, lse1, T, float(eps), float(scale),
            D=D, NS=len(sources), ROWS=rows, BD=triton.next_power_of_2(D),
            HAS_ONORM=out_norm_weight is not None, SAVE_PRE=save_pre, HAS_PRIOR=prior is not None)
    return y, o_pre, lse, logit, rstd


# backward launch shapes seen in this process (a superset of the autotuner's keys)
_BWD_SEEN: set[tuple] = set()


def attn_res_bwd(
    do: torch.Tensor, sources: Sequence[torch.Tensor], qw: torch.Tensor, out_norm_weight: torch.Tensor | None,
    o_pre: torch.Tensor, lse: torch.Tensor, logit: torch.Tensor, rstd: torch.Tensor, eps: float, scale: float,
    save_pre: bool, into: Sequence[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Gradients ``([∂v_i [T, D]], ∂qw [D] fp32, ∂ow [D] fp32 or [0])`` for ``do = ∂L/∂y [T, D]``, from the forward's
    ``lse``, ``logit``, ``rstd`` (and ``o_pre``, read when ``save_pre`` and there is an output norm).

    ``into``: per source, None or a contiguous ``[T, D]`` buffer (the sources' dtype) that ∂v_i is added to in place
    and returned as it (gradient accumulation inside the kernel)."""
    s0 = sources[0]
    T, D = s0.shape
    into = list(into) if into is not None else [None] * len(sources)
    dsrc = [torch.empty_like(s) if b is None else b for s, b in zip(sources, into)]
    acc = sum(1 << i for i, b in enumerate(into) if b is not None)
    has_onorm = out_norm_weight is not None
    save_pre = save_pre and has_onorm  # without the output norm the backward never needs o
    rows = _bwd_rows(T, s0.device)
    n_p = triton.cdiv(max(T, 1), rows)
    dqw = torch.empty(n_p, D, dtype=torch.float32, device=s0.device)
    dow = torch.empty(n_p if has_onorm else 0, D, dtype=torch.float32, device=s0.device)
    if T == 0:
        dqw.zero_(), dow.zero_()
    else:
        N = len(sources)

        held = holds_rows(N, D)

        def launch(dsrc: list[torch.Tensor], acc: int) -> None:
            if held:
                attn_res_bwd_held_kernel[(n_p,)](
                    tuple(sources), tuple(dsrc), qw, out_norm_weight if has_onorm else qw, do, lse, logit, rstd, dqw,
                    dow, T, float(eps), float(scale), acc, D=D, NS=N, NSP=triton.next_power_of_2(N), ROWS=rows,
                    BD=triton.next_power_of_2(D), HAS_ONORM=has_onorm)
                return
            attn_res_bwd_kernel[(n_p,)](
                tuple(sources), tuple(dsrc), qw, out_norm_weight if has_onorm else qw, o_pre if save_pre else do,
                do, lse, logit, rstd, dqw, dow, T, float(eps), float(scale), acc,
                D=D, NS=N, NSP=triton.next_power_of_2(N), NO=(1 if save_pre else N) if has_onorm else 0,
                NG=N if N > 1 else 0, ROWS=rows, BD=triton.next_power_of_2(D), HAS_ONORM=has_onorm,
                SAVE_PRE=save_pre)

        key = (held, N, D, rows, has_onorm, save_pre, s0.dtype, s0.device)
        with on_device_of(s0):
            if acc and key not in _BWD_SEEN:
                # the autotuner runs every candidate several times on the first launch of its key: an accumulating
                # launch would add ∂v that many times, so that first launch writes to scratch buffers instead
                launch([torch.empty_like(s) for s in sources], 0)
            _BWD_SEEN.add(key)
            launch(dsrc, acc)
    return dsrc, dqw.sum(0), (dow.sum(0) if has_onorm else dow.new_empty(0))
