#!/usr/bin/env python3
"""Decode-step probe (the study behind ``k3/ops/kda/triton/decode_gluon.py``; numbers in ``NOTES_kda.md`` v13):
where does a step lose to a copy of the same state bytes? Gluon kernels launched bare with explicit register
layouts (warps along V so the K reductions stay inside a warp, or along K as Triton picks), tile sizes, register
caps and residency, persistent grids (register prefetch, cp.async ring), cache hints, the output's placement, in
place, and the scaling with B — beside the public call, the persistent Triton kernel and ``copy_``. K3's flags
(L2 norm, bounded gate with A_log / dt_bias, β sigmoid). Each variant is checked once (NaN-poisoned outputs) against
the Triton kernel, then timed in 3 interleaved rounds.

    python bench/decode_gluon_probe.py [--B 64] [--H 32] \
        [--groups layouts,persistent,occupancy,hints,async,placement,scaling]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from k3.ops.kda.triton.decode_gluon import _sigmoid as _gl_sigmoid  # noqa: E402 — the kernel's own σ


@gluon.jit
def _pad1(KB: gl.constexpr):
    return gl.allocate_shared_memory(gl.int32, [KB, 256], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


@gluon.jit
def _pad(A: gl.constexpr, B: gl.constexpr, C: gl.constexpr, WARPS: gl.constexpr, never):
    """Hold A + B + C KiB of shared memory (powers of 2 or 0; only to lower the programs per SM). The three buffers
    are all stored to at the end, under ``never`` (a runtime value the caller makes false), so they are live
    together (not aliased) and the stores cost nothing."""
    P1: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
    if A > 0:
        pa = _pad1(A)
    if B > 0:
        pb = _pad1(B)
    if C > 0:
        pc = _pad1(C)
    if never:
        if A > 0:
            pa.store(gl.zeros([A, 256], gl.int32, layout=P1))
        if B > 0:
            pb.store(gl.zeros([B, 256], gl.int32, layout=P1))
        if C > 0:
            pc.store(gl.zeros([C, 256], gl.int32, layout=P1))


@gluon.jit
def _tile_offsets(K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, L: gl.constexpr):
    """Row and column offsets of a [K, BV] state tile in layout L, and the tile's offsets in a [K, V] state."""
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, L))
    o_b = gl.arange(0, BV, layout=gl.SliceLayout(0, L))
    return o_k, o_b, o_k[:, None] * V + o_b[None, :]


@gluon.jit
def _gl_tile_update(S, i, q, k, v, g, beta, A_log, dt_bias, o, H, scale, lb, o_k, o_b,
                    K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr, FAST: gl.constexpr = False):
    """K3 flags: one token on the state tile of tile index i; returns the new tile (o is stored here). FAST: one
    rsqrt per norm and σ as rsqrt² of 1 + 2^(−x·log2 e) — no divisions."""
    i_nh = i // NV
    i_v = i % NV
    i_h = i_nh % H
    p = i_nh.to(gl.int64) * K + o_k
    b_k = gl.load(k + p).to(gl.float32)
    b_q = gl.load(q + p).to(gl.float32)
    b_f = gl.load(g + p).to(gl.float32)
    b_v = gl.load(v + i_nh.to(gl.int64) * V + i_v * BV + o_b).to(gl.float32)
    b_b = _gl_sigmoid(gl.load(beta + i_nh).to(gl.float32))
    x = (b_f + gl.load(dt_bias + i_h * K + o_k)) * gl.exp(gl.load(A_log + i_h))
    if FAST:
        b_k = b_k * gl.rsqrt(gl.sum(b_k * b_k, axis=0) + 1e-6)
        b_q = b_q * gl.rsqrt(gl.sum(b_q * b_q, axis=0) + 1e-6)
        sg = gl.rsqrt(1.0 + gl.exp2(x * -1.4426950408889634))
        b_a = gl.exp2((lb * 1.4426950408889634) * (sg * sg))
    else:
        b_k = b_k / gl.sqrt(gl.sum(b_k * b_k, axis=0) + 1e-6)
        b_q = b_q / gl.sqrt(gl.sum(b_q * b_q, axis=0) + 1e-6)
        b_a = gl.exp(lb * _gl_sigmoid(x))
    u = gl.sum(S * (b_k * b_a)[:, None], axis=0)
    w = gl.sum(S * (b_q * b_a)[:, None], axis=0)
    r = (b_v - u) * b_b
    S = S * b_a[:, None] + b_k[:, None] * r[None, :]
    b_o = (w + r * gl.sum(b_k * b_q, axis=0)) * scale
    gl.store(o + i_nh.to(gl.int64) * V + i_v * BV + o_b, b_o.to(o.dtype.element_ty))
    return S


@gluon.jit
def _gl_decode(q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, n_tiles, NP, H, scale, lb,
               K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr,
               SPT_K: gl.constexpr, SPT_V: gl.constexpr, TPW_K: gl.constexpr, W_K: gl.constexpr,
               W_V: gl.constexpr, PREFETCH: gl.constexpr, COMPUTE: gl.constexpr,
               LOAD_CM: gl.constexpr = "", LOAD_EV: gl.constexpr = "", STORE_CM: gl.constexpr = "",
               VMAJOR: gl.constexpr = False, PAD_A: gl.constexpr = 0, PAD_B: gl.constexpr = 0,
               PAD_C: gl.constexpr = 0, FAST: gl.constexpr = False):
    L: gl.constexpr = gl.BlockedLayout([SPT_K, SPT_V], [TPW_K, 32 // TPW_K], [W_K, W_V], [1, 0])
    o_k, o_b, off = _tile_offsets(K, V, BV, L)
    pid = gl.program_id(0)
    # shared memory held (never written) only to lower the programs per SM: KiB, powers of 2
    _pad(PAD_A, PAD_B, PAD_C, W_K * W_V, n_tiles < 0)
    n_my = (n_tiles - pid + NP - 1) // NP
    i = pid
    if PREFETCH:
        S_next = gl.load(s_in + ((i // NV).to(gl.int64) * (K * V) + (i % NV) * BV) + off, cache_modifier=LOAD_CM,
                         eviction_policy=LOAD_EV)
    else:
        S_next = gl.zeros([K, BV], gl.float32, layout=L)
    for j in range(n_my):
        S = S_next
        if VMAJOR:  # tile i: sequence-head i % (n_tiles / NV), V-block i // (n_tiles / NV)
            i = (pid + j * NP) % (n_tiles // NV) * NV + (pid + j * NP) // (n_tiles // NV)
        if PREFETCH:
            i_n = i + NP
            lim = gl.where(i_n < n_tiles, K * V, 0)
            S_next = gl.load(s_in + ((i_n // NV).to(gl.int64) * (K * V) + (i_n % NV) * BV) + off, mask=off < lim,
                             cache_modifier=LOAD_CM, eviction_policy=LOAD_EV)
        else:
            S = gl.load(s_in + ((i // NV).to(gl.int64) * (K * V) + (i % NV) * BV) + off, cache_modifier=LOAD_CM,
                        eviction_policy=LOAD_EV)
        i_nh = i // NV
        i_v = i % NV
        if COMPUTE:  # else: a copy in the same tile pattern
            S = _gl_tile_update(S, i, q, k, v, g, beta, A_log, dt_bias, o, H, scale, lb, o_k, o_b, K, V, BV, NV,
                                FAST)
        gl.store(s_out + (i_nh.to(gl.int64) * (K * V) + i_v * BV) + off, S, cache_modifier=STORE_CM)
        i += NP


@gluon.jit
def _gl_decode_async(q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, n_tiles, NP, H, scale, lb,
                     K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr,
                     SPT_K: gl.constexpr, SPT_V: gl.constexpr, TPW_K: gl.constexpr, W_K: gl.constexpr,
                     W_V: gl.constexpr, STAGES: gl.constexpr, SWZ: gl.constexpr):
    """Persistent: the next STAGES − 1 tiles of this program move global → shared by cp.async while one is
    computed from registers (no register double buffer)."""
    L: gl.constexpr = gl.BlockedLayout([SPT_K, SPT_V], [TPW_K, 32 // TPW_K], [W_K, W_V], [1, 0])
    if SWZ:
        SL: gl.constexpr = gl.SwizzledSharedLayout(SPT_V, 1, 8, [1, 0])
    else:
        SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    o_k, o_b, off = _tile_offsets(K, V, BV, L)
    pid = gl.program_id(0)
    n_my = (n_tiles - pid + NP - 1) // NP
    buf = gl.allocate_shared_memory(gl.float32, [STAGES, K, BV], SL)
    for st in gl.static_range(STAGES - 1):
        i_s = pid + st * NP
        lim = gl.where(i_s < n_tiles, K * V, 0)
        async_copy.async_copy_global_to_shared(buf.index(st), s_in + ((i_s // NV).to(gl.int64) * (K * V)
                                               + (i_s % NV) * BV) + off, mask=off < lim)
        async_copy.commit_group()
    for j in range(n_my):
        i = pid + j * NP
        i_n = i + (STAGES - 1) * NP
        lim = gl.where(i_n < n_tiles, K * V, 0)
        async_copy.async_copy_global_to_shared(buf.index((j + STAGES - 1) % STAGES),
                                               s_in + ((i_n // NV).to(gl.int64) * (K * V) + (i_n % NV) * BV) + off,
                                               mask=off < lim)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        S = buf.index(j % STAGES).load(L)
        S = _gl_tile_update(S, i, q, k, v, g, beta, A_log, dt_bias, o, H, scale, lb, o_k, o_b, K, V, BV, NV)
        gl.store(s_out + ((i // NV).to(gl.int64) * (K * V) + (i % NV) * BV) + off, S)


def grid(x: dict, BV: int, per_sm: int | None, warps: int, cap: int | None = None) -> tuple[int, ...]:
    """A decode grid over [K, BV] state tiles → (H, K, V, NV, tiles, programs, register cap): one tile per program
    (per_sm None; the cap as given), or per_sm persistent programs per SM with the cap that fits them."""
    B, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    NV = V // BV
    n_tiles = B * H * NV
    if per_sm is None:
        return H, K, V, NV, n_tiles, n_tiles, cap
    NP = min(n_tiles, per_sm * torch.cuda.get_device_properties(0).multi_processor_count)
    return H, K, V, NV, n_tiles, NP, cap or min(255, 65536 // (per_sm * warps * 32) // 8 * 8)


def launch_async(x: dict, h0: torch.Tensor, hn: torch.Tensor, o: torch.Tensor, BV: int, tpw_k: int, wv: int,
                 per_sm: int, stages: int, cap: int | None = None, swz: bool = True):
    H, K, V, NV, n_tiles, NP, cap = grid(x, BV, per_sm, wv, cap)
    return _gl_decode_async[(NP,)](x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], o, h0, hn,
                                   n_tiles, NP, H, K ** -0.5, -5.0, K=K, V=V, BV=BV, NV=NV, SPT_K=K // tpw_k,
                                   SPT_V=4, TPW_K=tpw_k, W_K=1, W_V=wv, STAGES=stages, SWZ=swz, num_warps=wv,
                                   maxnreg=cap)


def launch(x: dict, h0: torch.Tensor, hn: torch.Tensor, o: torch.Tensor, BV: int, spt: int, tpw_k: int, wk: int,
           wv: int, per_sm: int | None, prefetch: bool, compute: bool = True, contig_k: bool = True,
           cap: int | None = None, **mods: str):
    warps = wk * wv
    H, K, V, NV, n_tiles, NP, cap = grid(x, BV, per_sm, warps, cap)
    kw = dict(num_warps=warps) if cap is None else dict(num_warps=warps, maxnreg=cap)
    return _gl_decode[(NP,)](x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], o, h0, hn,
                             n_tiles, NP, H, K ** -0.5, -5.0, K=K, V=V, BV=BV, NV=NV,
                             SPT_K=K // (tpw_k * wk) if contig_k else 1, SPT_V=spt, TPW_K=tpw_k, W_K=wk, W_V=wv,
                             PREFETCH=prefetch, COMPUTE=compute, **mods, **kw)


A = (32, 4, 8, 1, 2)  # the adopted layout: BV 32, 16-byte columns, 8 threads along K, 2 warps along V
# group → {name: (BV, size/thread along V, threads along K, warps along K, warps along V, programs/SM or None = one
# tile per program, register prefetch, extra launch options: cap = maxnreg, contig_k, LOAD_CM / LOAD_EV / STORE_CM
# cache hints, VMAJOR tile order, PAD_A/B/C KiB of held shared memory, FAST math)}
GROUPS: dict[str, dict[str, tuple]] = {
    "layouts": {
        "A bv32 wV2 tk8, cap 128 (8/SM)": (*A, None, False, dict(cap=128)),
        "A, compiler's registers": (*A, None, False, {}),
        "A cap 120": (*A, None, False, dict(cap=120)),
        "A cap 112": (*A, None, False, dict(cap=112)),
        "A, rows interleaved across threads": (*A, None, False, dict(cap=128, contig_k=False)),
        "A, V-major tile order": (*A, None, False, dict(cap=128, VMAJOR=True)),
        "bv64 wV4 tk8 cap 128": (64, 4, 8, 1, 4, None, False, dict(cap=128)),
        "bv64 wV2 tk4": (64, 4, 4, 1, 2, None, False, {}),
        "bv32 w1 tk4": (32, 4, 4, 1, 1, None, False, {}),
        "bv16 w1 tk8 cap 128": (16, 4, 8, 1, 1, None, False, dict(cap=128)),
        "bv32 wK2 tk4 cap 128 (cross-warp sums)": (32, 4, 4, 2, 1, None, False, dict(cap=128)),
        "bv32 wK2 wV2 tk8 cap 80": (32, 4, 8, 2, 2, None, False, dict(cap=80)),
        "bv32 wV4 tk16 cap 80 (32 / thread)": (32, 4, 16, 1, 4, None, False, dict(cap=80)),
        "bv128 wV8 tk8 cap 128": (128, 4, 8, 1, 8, None, False, dict(cap=128)),
        "bv128 wK8, 512 B rows, cap 128": (128, 4, 1, 8, 1, None, False, dict(cap=128)),
        "A, FAST math": (*A, None, False, dict(cap=128, FAST=True)),
        "A, copy only (same tiles, no arithmetic)": (*A, None, False, dict(cap=128, compute=False)),
    },
    "persistent": {
        "A, register prefetch, 6/SM": (*A, 6, True, {}),
        "A, register prefetch, 8/SM cap 128": (*A, 8, True, dict(cap=128)),
        "A, no prefetch, 8/SM": (*A, 8, False, {}),
    },
    "occupancy": {
        "A 8/SM (registers)": (*A, None, False, dict(cap=128)),
        "A 7/SM (held shared memory)": (*A, None, False, dict(cap=128, PAD_A=16, PAD_B=8, PAD_C=4)),
        "A 6/SM": (*A, None, False, dict(cap=128, PAD_A=32, PAD_B=4)),
        "A 5/SM": (*A, None, False, dict(cap=128, PAD_A=32, PAD_B=8)),
        "A 4/SM": (*A, None, False, dict(cap=128, PAD_A=32, PAD_B=16)),
    },
    "hints": {
        "A": (*A, None, False, dict(cap=128)),
        "A ld.cg": (*A, None, False, dict(cap=128, LOAD_CM=".cg")),
        "A loads evict_first": (*A, None, False, dict(cap=128, LOAD_EV="evict_first")),
        "A st.cs": (*A, None, False, dict(cap=128, STORE_CM=".cs")),
        "A st.wt": (*A, None, False, dict(cap=128, STORE_CM=".wt")),
    },
}
# persistent with a cp.async ring: name → (BV, threads along K, warps along V, programs/SM, stages, cap, swizzle)
ASYNC = {
    "async A, 2 stages, 6/SM": (32, 8, 2, 6, 2, None, True),
    "async A, 3 stages, 4/SM": (32, 8, 2, 4, 3, None, True),
    "async bv64 wV4, 2 stages, 3/SM": (64, 8, 4, 3, 2, None, True),
}


def decode_case(B: int, H: int):
    """The K3 decode step's inputs (bf16, K = V = 128), an fp32 state, output buffers, and the public call on them
    → (x, h0, hn, o, public)."""
    from k3.bench.kda import K3_FLAGS, _inputs
    from k3.ops.kda import fused_recurrent_kda

    x = _inputs(B, 1, H)
    h0 = torch.randn(B, H, 128, 128, device="cuda")

    def public():
        return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                   dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True, **K3_FLAGS)

    return x, h0, torch.empty_like(h0), torch.empty_like(x["v"]), public


def timed_table(fns: dict, info: dict, rounds: int, nbytes: int) -> None:
    """Each function timed in ``rounds`` interleaved rounds (clock drift hits every variant alike; best of the
    ``do_bench`` medians) and printed as a table with the state's rate."""
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")  # noqa: E731
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(bench(f))
    print("| variant | ms (best of medians) | worst | state TB/s | rel err o | rel err S | regs / spills |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n, ts in times.items():
        print(f"| {n} | {min(ts):.4f} | {max(ts):.4f} | {nbytes / min(ts) / 1e9:.2f} | {info.get(n) or ' | | '} |")


def main() -> int:
    from k3.bench.kda import K3_FLAGS, _inputs, warm_clocks
    from k3.ops.kda import fused_recurrent_kda
    from k3.ops.kda.triton.decode_gluon import GluonDecodeConfig
    from k3.utils import overridden_attrs

    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--groups", default="layouts,scaling",
                    help="comma list of: " + ",".join([*GROUPS, "async", "placement", "scaling"]))
    a = ap.parse_args()
    groups = a.groups.split(",")
    x, h0, hn, o, public = decode_case(a.B, a.H)
    nbytes = 2 * h0.numel() * 4

    def triton_kernel():
        with overridden_attrs(GluonDecodeConfig, enabled=False):
            return public()

    o_ref, s_ref = triton_kernel()
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")  # noqa: E731
    warm_clocks(5.0)
    fns = {"fused_recurrent_kda (Gluon)": public, "Triton persistent kernel": triton_kernel,
           "copy_": lambda: hn.copy_(h0)}
    info = {n: "" for n in fns}

    def check(name: str, fn) -> None:
        """One launch on NaN-poisoned outputs against the Triton kernel, then the variant joins the timing."""
        try:
            hn.fill_(float("nan"))
            o.fill_(float("nan"))
            ck = fn()
            torch.cuda.synchronize()
            eo = ((o.float() - o_ref.float()).pow(2).mean() / o_ref.float().pow(2).mean()).sqrt().item()
            es = ((hn - s_ref).pow(2).mean() / s_ref.pow(2).mean()).sqrt().item()
            fns[name] = fn
            info[name] = f"{eo:.1e} | {es:.1e} | {ck.n_regs} / {ck.n_spills}"
        except Exception as e:  # noqa: BLE001 — a probe: report and go on
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)

    for g in groups:
        for name, (BV, spt, tk, wk, wv, per_sm, pf, opt) in GROUPS.get(g, {}).items():
            check(name, lambda a_=(BV, spt, tk, wk, wv, per_sm, pf), o_=opt: launch(x, h0, hn, o, *a_, **o_))
    if "async" in groups:
        for name, args in ASYNC.items():
            check(name, lambda a_=args: launch_async(x, h0, hn, o, *a_))
    if "placement" in groups:  # the output state at other offsets from a 2 MiB boundary, and in place
        n = h0.numel()
        big = torch.empty(n + (8 << 20) // 4, device="cuda")
        base = (-big.data_ptr() % (2 << 20)) // 4
        for off in (0, 4096, 1 << 20, (2 << 20) + 512):
            dst = big[base + off // 4: base + off // 4 + n].view_as(h0)
            fns[f"A, output at +{off} B from a 2 MiB boundary"] = (lambda d_=dst: launch(x, h0, d_, o, *A, None, False,
                                                                                         cap=128))
        s_place = h0.clone()
        for name, opt in (("A in place", {}), ("A in place, st.wt", dict(STORE_CM=".wt")),
                          ("A in place, ld.cg", dict(LOAD_CM=".cg"))):
            fns[name] = (lambda o_=opt: launch(x, s_place, s_place, o, *A, None, False, cap=128, **o_))
        for name in fns:
            info.setdefault(name, "")
    timed_table(fns, info, 3, nbytes)
    if "scaling" in groups:  # fixed cost vs steady bandwidth: the same three at several batch sizes
        print("\n| B | copy_ ms | Triton persistent ms | Gluon (A) ms |\n|---:|---:|---:|---:|")
        for Bs in (16, 32, 64, 128, 256):
            xs = _inputs(Bs, 1, a.H)
            s0 = torch.randn(Bs, a.H, 128, 128, device="cuda")
            s1 = torch.empty_like(s0)
            os_ = torch.empty_like(xs["v"])

            def trit(xs=xs, s0=s0):
                with overridden_attrs(GluonDecodeConfig, enabled=False):
                    return fused_recurrent_kda(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], A_log=xs["A_log"],
                                               dt_bias=xs["dt_bias"], initial_state=s0, output_final_state=True,
                                               **K3_FLAGS)

            fs = [lambda: s1.copy_(s0), trit, lambda: launch(xs, s0, s1, os_, *A, None, False, cap=128)]
            ts = [min(bench(f) for _ in range(2)) for f in fs]
            print(f"| {Bs} | " + " | ".join(f"{t:.4f}" for t in ts) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
