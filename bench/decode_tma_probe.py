#!/usr/bin/env python3
"""Decode-step probe, round 2 (after ``decode_gluon_probe.py``; numbers in ``NOTES_kda.md`` v20): a persistent
Gluon kernel whose state tiles arrive by TMA (``cp.async.bulk.tensor``, one thread issues a 16 KiB tile, an
mbarrier per ring slot), so a program streams its share of the state with no per-thread copy instructions and the
grid ends together (no last wave of one-tile programs draining under the DRAM queue — the ~3.5 µs that v13 found
between the one-tile kernel and a copy). The next tile's q / k / g / v / β are loaded into registers one tile
ahead. Timed beside the public call (one-tile Gluon kernel), that kernel launched bare and ``copy_``, in
interleaved rounds; each variant checked once on NaN-poisoned outputs against the public call.

    python bench/decode_tma_probe.py [--B 64] [--H 32]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: E402

from decode_gluon_probe import _tile_offsets, grid  # noqa: E402
from k3.ops.kda.triton.decode_gluon import _sigmoid as _gl_sigmoid  # noqa: E402 — the kernel's own σ


@gluon.jit
def _vecs(i, n_tiles, q, k, g, v, beta, o_k, o_b, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
          NV: gl.constexpr):
    """Tile i's token vectors, left in their input dtype (registers: they wait a whole tile); zeros past the end."""
    ok = i < n_tiles
    i_nh = i // NV
    p = i_nh.to(gl.int64) * K + o_k
    mk = (o_k < K) & ok
    b_k = gl.load(k + p, mask=mk, other=0.)
    b_q = gl.load(q + p, mask=mk, other=0.)
    b_f = gl.load(g + p, mask=mk, other=0.)
    b_v = gl.load(v + i_nh.to(gl.int64) * V + (i % NV) * BV + o_b, mask=(o_b < BV) & ok, other=0.)
    b_b = gl.load(beta + i_nh, mask=ok, other=0.)
    return b_k, b_q, b_f, b_v, b_b


@gluon.jit
def _update(S, i, b_k, b_q, b_f, b_v, b_b, A_log, dt_bias, o, H, scale, lb, o_k, o_b, K: gl.constexpr,
            V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr):
    """K3 flags (L2 norm, bounded gate with A_log / dt_bias, β sigmoid): one token on tile i; stores o."""
    i_nh = i // NV
    i_h = i_nh % H
    b_k = b_k.to(gl.float32)
    b_q = b_q.to(gl.float32)
    b_k = b_k / gl.sqrt(gl.sum(b_k * b_k, axis=0) + 1e-6)
    b_q = b_q / gl.sqrt(gl.sum(b_q * b_q, axis=0) + 1e-6)
    x = (b_f.to(gl.float32) + gl.load(dt_bias + i_h * K + o_k)) * gl.exp(gl.load(A_log + i_h))
    b_a = gl.exp(lb * _gl_sigmoid(x))
    u = gl.sum(S * (b_k * b_a)[:, None], axis=0)
    w = gl.sum(S * (b_q * b_a)[:, None], axis=0)
    r = (b_v.to(gl.float32) - u) * _gl_sigmoid(b_b.to(gl.float32))
    S = S * b_a[:, None] + b_k[:, None] * r[None, :]
    b_o = (w + r * gl.sum(b_k * b_q, axis=0)) * scale
    gl.store(o + i_nh.to(gl.int64) * V + (i % NV) * BV + o_b, b_o.to(o.dtype.element_ty))
    return S


@gluon.jit
def _issue(s_desc, smem, bar, i, pred, K: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr):
    mbarrier.expect(bar, K * BV * 4, pred=pred)
    tma.async_copy_global_to_shared(s_desc, [(i // NV) * K, (i % NV) * BV], bar, smem, pred=pred)


@gluon.jit
def _tma_decode(q, k, v, g, beta, A_log, dt_bias, o, s_desc, s_out, n_tiles, NP, H, scale, lb,
                K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr, STAGES: gl.constexpr,
                COMPUTE: gl.constexpr, FENCE: gl.constexpr):
    """Persistent: program pid takes tiles pid, pid + NP, … (adjacent programs on adjacent tiles, so the grid reads
    the state in address order); STAGES tiles in flight per program."""
    L: gl.constexpr = gl.BlockedLayout([K // 8, 4], [8, 4], [1, BV // 16], [1, 0])
    o_k, o_b, off = _tile_offsets(K, V, BV, L)
    pid = gl.program_id(0)
    n_my = (n_tiles - pid + NP - 1) // NP
    smem = gl.allocate_shared_memory(gl.float32, [STAGES, K, BV], s_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bar.index(st), count=1)
    for st in gl.static_range(STAGES):
        _issue(s_desc, smem.index(st), bar.index(st), pid + st * NP, st < n_my, K, BV, NV)
    nk, nq, nf, nv, nb = _vecs(pid, n_tiles, q, k, g, v, beta, o_k, o_b, K, V, BV, NV)
    for j in range(n_my):
        i = pid + j * NP
        slot = j % STAGES
        ck, cq, cf, cv, cb = nk, nq, nf, nv, nb
        nk, nq, nf, nv, nb = _vecs(i + NP, n_tiles, q, k, g, v, beta, o_k, o_b, K, V, BV, NV)
        mbarrier.wait(bar.index(slot), (j // STAGES) & 1)
        S = smem.index(slot).load(L)
        gl.thread_barrier()  # every warp has read slot s before the next tile may land in it
        if FENCE:
            fence_async_shared()
        _issue(s_desc, smem.index(slot), bar.index(slot), i + STAGES * NP, j + STAGES < n_my, K, BV, NV)
        if COMPUTE:
            S = _update(S, i, ck, cq, cf, cv, cb, A_log, dt_bias, o, H, scale, lb, o_k, o_b, K, V, BV, NV)
        gl.store(s_out + ((i // NV).to(gl.int64) * (K * V) + (i % NV) * BV) + off, S)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bar.index(st))


def launch_tma(x: dict, h0: torch.Tensor, hn: torch.Tensor, o: torch.Tensor, per_sm: int, stages: int,
               compute: bool = True, fence: bool = True, BV: int = 32):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    warps = BV // 16
    H, K, V, NV, n_tiles, NP, cap = grid(x, BV, per_sm, warps)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    desc = TensorDescriptor.from_tensor(h0.view(-1, V), [K, BV], layout)
    return _tma_decode[(NP,)](x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], o, desc, hn,
                              n_tiles, NP, H, K ** -0.5, -5.0, K=K, V=V, BV=BV, NV=NV, STAGES=stages,
                              COMPUTE=compute, FENCE=fence, num_warps=warps, maxnreg=cap)


# name → (programs per SM, ring stages, compute, fence)
VARIANTS = {
    "tma 1/SM x 8": (1, 8, True, True),
    "tma 1/SM x 12": (1, 12, True, True),
    "tma 2/SM x 4": (2, 4, True, True),
    "tma 2/SM x 6": (2, 6, True, True),
    "tma 3/SM x 4": (3, 4, True, True),
    "tma 4/SM x 3": (4, 3, True, True),
    "tma 4/SM x 2": (4, 2, True, True),
    "tma 6/SM x 2": (6, 2, True, True),
    "tma 4/SM x 3, no fence": (4, 3, True, False),
    "tma 2/SM x 6, copy only": (2, 6, False, True),
    "tma 4/SM x 3, copy only": (4, 3, False, True),
}


def main() -> int:
    from decode_gluon_probe import A, decode_case, launch, timed_table

    from k3.bench.kda import warm_clocks

    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-tma", action="store_true", help="time only the public call, the bare kernel and copy_")
    a = ap.parse_args()
    x, h0, hn, o, public = decode_case(a.B, a.H)
    nbytes = 2 * h0.numel() * 4

    o_ref, s_ref = public()
    warm_clocks(5.0)
    fns = {"fused_recurrent_kda (public)": public, "A bare (one tile per program)":
           lambda: launch(x, h0, hn, o, *A, None, False, cap=128), "copy_": lambda: hn.copy_(h0)}
    info = {n: "" for n in fns}
    for name, (per_sm, st, comp, fence) in ({} if a.no_tma else VARIANTS).items():
        fn = (lambda p_=per_sm, s_=st, c_=comp, f_=fence: launch_tma(x, h0, hn, o, p_, s_, c_, f_))
        try:
            hn.fill_(float("nan"))
            o.fill_(float("nan"))
            ck = fn()
            torch.cuda.synchronize()
            ref_s = s_ref if comp else h0
            es = ((hn - ref_s).pow(2).mean() / ref_s.pow(2).mean()).sqrt().item()
            eo = ((o.float() - o_ref.float()).pow(2).mean() / o_ref.float().pow(2).mean()).sqrt().item() if comp \
                else float("nan")
            fns[name] = fn
            info[name] = f"{eo:.1e} | {es:.1e} | {ck.n_regs} / {ck.n_spills}"
        except Exception as e:  # noqa: BLE001 — a probe: report and go on
            print(f"{name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
    timed_table(fns, info, a.rounds, nbytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
