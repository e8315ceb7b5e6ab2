#!/usr/bin/env python3
"""Decode-step probe: does the state tile arrive late? (NOTES_kda.md v21.)

Compiled for sm_90, the one-tile Gluon decode kernel issues its 16 state loads per thread in a trickle: ptxas puts
the k / q / g loads first, then waits on them (the L2 norms and the gate) before most of the state loads leave, so
each program pays about two memory latencies instead of one, and the first wave starts the DRAM late. ptxas sinks
the state loads whatever we write (PTX order, volatile loads, a 160-register cap: the state's 64 registers cannot be
live across the prologue at the 128 cap). Here the state tile goes global → shared memory by ``cp.async`` (no
registers held while in flight), the prologue runs, then the tile is read into the same register layout; the
shared layout's swizzle phase follows row // 16, the row block of each thread, so both the copy and the read are
free of bank conflicts. ptxas sinks those copies below the prologue too, so a second kernel also copies k, q, g
and dt_bias by ``cp.async`` (v, β and A_log as register loads above the wait): its SASS issues every copy before
one wait. Beside them: the public kernel, the bare one-tile kernel of ``decode_gluon_probe.py`` (A) and ``copy_``;
K3's flags, B=64 H=32 K=V=128, fp32 state.

Result (H200, session 19): the state by cp.async 0.0746–0.0755 ms, everything by cp.async (one wait, one memory
latency per program) 0.0733 — the bare register kernel's own time; the late issue does not cost. The same call
found the public kernel 1 % faster once the L2 norms scale the reduced vectors (0.0726).

    python bench/decode_async_probe.py [--B 64] [--H 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from decode_gluon_probe import A, _tile_offsets, decode_case, launch, timed_table  # noqa: E402
from k3.ops.kda.triton.decode_gluon import _sigmoid  # noqa: E402


@gluon.jit
def _tile(H, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr, L: gl.constexpr):
    """This program's tile: sequence-head, V-block, head, row and column offsets in layout L, state offsets."""
    i = gl.program_id(0)
    i_nh = i // NV
    i_v = i % NV
    o_k, o_b, off = _tile_offsets(K, V, BV, L)
    return i_nh, i_v, i_nh % H, o_k, o_b, off, i_nh.to(gl.int64) * (K * V) + i_v * BV


@gluon.jit
def _decay(b_f, dt, a_log, lb):
    """K3's bounded gate as a decay: exp(lb·σ(e^A (f + dt)))."""
    return gl.exp(lb * _sigmoid((b_f + dt) * gl.exp(a_log)))


@gluon.jit
def _prologue(i_nh, i_h, q, k, g, beta, A_log, dt_bias, lb, o_k, K: gl.constexpr):
    """K3 flags: raw k and q, the decay a = exp(lb·σ(e^A (g + dt))), β = σ(b), and the two inverse L2 norms."""
    p = i_nh.to(gl.int64) * K + o_k
    b_k = gl.load(k + p).to(gl.float32)
    b_q = gl.load(q + p).to(gl.float32)
    b_f = gl.load(g + p).to(gl.float32)
    b_b = _sigmoid(gl.load(beta + i_nh).to(gl.float32))
    b_a = _decay(b_f, gl.load(dt_bias + i_h * K + o_k), gl.load(A_log + i_h), lb)
    rk = 1.0 / gl.sqrt(gl.sum(b_k * b_k, axis=0) + 1e-6)
    rq = 1.0 / gl.sqrt(gl.sum(b_q * b_q, axis=0) + 1e-6)
    return b_k, b_q, b_a, b_b, rk, rq


@gluon.jit
def _update_store(S, b_k, b_q, b_a, b_b, b_v, rk, rq, scale, o, s_out, base, off, i_nh, i_v, o_b,
                  V: gl.constexpr, BV: gl.constexpr):
    """The public kernel's step on a loaded tile (norms on the reduced vectors), then o and S' stored."""
    u = gl.sum(S * (b_k * b_a)[:, None], axis=0) * rk
    w = gl.sum(S * (b_q * b_a)[:, None], axis=0) * rq
    r = (b_v - u) * b_b
    S = S * b_a[:, None] + b_k[:, None] * (r * rk)[None, :]
    b_o = (w + r * (gl.sum(b_k * b_q, axis=0) * (rk * rq))) * scale
    gl.store(o + i_nh.to(gl.int64) * V + i_v * BV + o_b, b_o.to(o.dtype.element_ty))
    gl.store(s_out + base + off, S)


@gluon.jit
def _gl_decode_cp(q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, H, scale, lb,
                  K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr, PER_PHASE: gl.constexpr,
                  CM: gl.constexpr, V_FIRST: gl.constexpr):
    """One tile per program; the state tile global → shared by cp.async before anything else."""
    L: gl.constexpr = gl.BlockedLayout([K // 8, 4], [8, 4], [1, BV // 16], [1, 0])
    SL: gl.constexpr = gl.SwizzledSharedLayout(4, PER_PHASE, 8, [1, 0])
    i_nh, i_v, i_h, o_k, o_b, off, base = _tile(H, K, V, BV, NV, L)
    buf = gl.allocate_shared_memory(gl.float32, [K, BV], SL)
    async_copy.async_copy_global_to_shared(buf, s_in + base + off, cache_modifier=CM)
    async_copy.commit_group()
    if V_FIRST:
        b_v = gl.load(v + i_nh.to(gl.int64) * V + i_v * BV + o_b).to(gl.float32)
    b_k, b_q, b_a, b_b, rk, rq = _prologue(i_nh, i_h, q, k, g, beta, A_log, dt_bias, lb, o_k, K)
    if not V_FIRST:
        b_v = gl.load(v + i_nh.to(gl.int64) * V + i_v * BV + o_b).to(gl.float32)
    async_copy.wait_group(0)
    S = buf.load(L)  # each thread reads back exactly the chunks it copied: no barrier needed
    _update_store(S, b_k, b_q, b_a, b_b, b_v, rk, rq, scale, o, s_out, base, off, i_nh, i_v, o_b, V, BV)


@gluon.jit
def _gl_decode_cp_all(q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, H, scale, lb,
                      K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr, PER_PHASE: gl.constexpr,
                      CM: gl.constexpr):
    """As ``_gl_decode_cp``, but k, q, g and dt_bias also go global → shared by cp.async (4-byte pieces), so no
    register load precedes the state's copies for ptxas to wait on; one barrier, then everything from shared."""
    NW: gl.constexpr = BV // 16
    L: gl.constexpr = gl.BlockedLayout([K // 8, 4], [8, 4], [1, NW], [1, 0])
    LK: gl.constexpr = gl.SliceLayout(1, L)
    L1: gl.constexpr = gl.BlockedLayout([2], [32], [NW], [0])
    SL: gl.constexpr = gl.SwizzledSharedLayout(4, PER_PHASE, 8, [1, 0])
    S1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    i_nh, i_v, i_h, o_k, o_b, off, base = _tile(H, K, V, BV, NV, L)
    o_1 = gl.arange(0, K, layout=L1)
    # the small register loads first: ptxas keeps them above the barrier, so the wait covers their latency too
    b_v = gl.load(v + i_nh.to(gl.int64) * V + i_v * BV + o_b).to(gl.float32)
    b_b = gl.load(beta + i_nh).to(gl.float32)
    e_a = gl.load(A_log + i_h)
    buf = gl.allocate_shared_memory(gl.float32, [K, BV], SL)
    kb = gl.allocate_shared_memory(k.dtype.element_ty, [K], S1)
    qb = gl.allocate_shared_memory(q.dtype.element_ty, [K], S1)
    gb = gl.allocate_shared_memory(g.dtype.element_ty, [K], S1)
    db = gl.allocate_shared_memory(gl.float32, [K], S1)
    async_copy.async_copy_global_to_shared(buf, s_in + base + off, cache_modifier=CM)
    p1 = i_nh.to(gl.int64) * K + o_1
    async_copy.async_copy_global_to_shared(kb, k + p1)
    async_copy.async_copy_global_to_shared(qb, q + p1)
    async_copy.async_copy_global_to_shared(gb, g + p1)
    async_copy.async_copy_global_to_shared(db, dt_bias + i_h * K + o_1)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()  # the vectors were copied by other threads
    b_k = kb.load(LK).to(gl.float32)
    b_q = qb.load(LK).to(gl.float32)
    b_f = gb.load(LK).to(gl.float32)
    b_b = _sigmoid(b_b)
    b_a = _decay(b_f, db.load(LK), e_a, lb)
    rk = 1.0 / gl.sqrt(gl.sum(b_k * b_k, axis=0) + 1e-6)
    rq = 1.0 / gl.sqrt(gl.sum(b_q * b_q, axis=0) + 1e-6)
    S = buf.load(L)
    _update_store(S, b_k, b_q, b_a, b_b, b_v, rk, rq, scale, o, s_out, base, off, i_nh, i_v, o_b, V, BV)


def launch_cp(x: dict, h0: torch.Tensor, hn: torch.Tensor, o: torch.Tensor, per_phase: int = 16, cm: str = ".cg",
              v_first: bool = False, cap: int | None = 128, BV: int = 32, all_async: bool = False):
    B, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    NV = V // BV
    kw = dict(num_warps=BV // 16) if cap is None else dict(num_warps=BV // 16, maxnreg=cap)
    if all_async:
        return _gl_decode_cp_all[(B * H * NV,)](x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"],
                                                o, h0, hn, H, K ** -0.5, -5.0, K=K, V=V, BV=BV, NV=NV,
                                                PER_PHASE=per_phase, CM=cm, **kw)
    return _gl_decode_cp[(B * H * NV,)](x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], o, h0,
                                        hn, H, K ** -0.5, -5.0, K=K, V=V, BV=BV, NV=NV, PER_PHASE=per_phase, CM=cm,
                                        V_FIRST=v_first, **kw)


VARIANTS = {
    "all by cp.async (state, k, q, g, dt)": dict(all_async=True),
    "all by cp.async, compiler's registers": dict(all_async=True, cap=None),
    "all by cp.async, BV 64 (4 warps)": dict(all_async=True, BV=64),
    "cp.async, phase row//16, .cg": dict(),
    "cp.async, phase row//16, .ca": dict(cm=".ca"),
    "cp.async, phase row//16, v first": dict(v_first=True),
    "cp.async, phase row % 8 (8-way conflicts)": dict(per_phase=1),
    "cp.async, compiler's registers": dict(cap=None),
    "cp.async, BV 64 (4 warps)": dict(BV=64),
}


def main() -> int:
    from k3.bench.kda import warm_clocks
    from k3.ops.kda.triton.decode_gluon import GluonDecodeConfig
    from k3.utils import overridden_attrs

    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    x, h0, hn, o, public = decode_case(a.B, a.H)
    with overridden_attrs(GluonDecodeConfig, enabled=False):  # the Triton kernel as the reference
        o_ref, s_ref = public()
    torch.cuda.synchronize()
    warm_clocks(5.0)
    fns = {"fused_recurrent_kda (public)": public, "A bare (decode_gluon_probe)": lambda: launch(
        x, h0, hn, o, *A, None, False, cap=128), "copy_": lambda: hn.copy_(h0)}
    info: dict[str, str] = {n: "" for n in fns}
    for name, kw in {"fused_recurrent_kda (public)": None, **VARIANTS}.items():
        try:
            hn.fill_(float("nan"))
            o.fill_(float("nan"))
            if kw is None:
                o_p, s_p = public()
                o.copy_(o_p)
                hn.copy_(s_p)
                ck = None
            else:
                ck = launch_cp(x, h0, hn, o, **kw)
            torch.cuda.synchronize()
            eo = ((o.float() - o_ref.float()).pow(2).mean() / o_ref.float().pow(2).mean()).sqrt().item()
            es = ((hn - s_ref).pow(2).mean() / s_ref.pow(2).mean()).sqrt().item()
            if ck is None:
                info[name] = f"{eo:.1e} | {es:.1e} | "
                continue
            fns[name] = lambda kw=kw: launch_cp(x, h0, hn, o, **kw)
            info[name] = f"{eo:.1e} | {es:.1e} | {ck.n_regs} / {ck.n_spills}"
        except Exception as e:  # noqa: BLE001 — a probe: report and go on
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    timed_table(fns, info, a.rounds, 2 * h0.numel() * 4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
