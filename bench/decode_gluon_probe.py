#!/usr/bin/env python3
"""Decode-step probe: where does the step lose to a copy of the same state bytes? Gluon kernels with explicit
register layouts (warps split along V so the K reduction stays inside a warp; or along K as Triton picks), with and
without a register prefetch of the next tile, with and without the arithmetic (a copy in the same tile pattern),
beside the default Triton kernel and ``copy_``. K3's flags (L2 norm, bounded gate with A_log / dt_bias, β sigmoid).

    python bench/decode_gluon_probe.py [--B 64] [--H 32]
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


@gluon.jit
def _gl_sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _gl_decode(q, k, v, g, beta, A_log, dt_bias, o, s_in, s_out, n_tiles, NP, H, scale, lb,
               K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, NV: gl.constexpr,
               SPT_K: gl.constexpr, SPT_V: gl.constexpr, TPW_K: gl.constexpr, W_K: gl.constexpr,
               W_V: gl.constexpr, PREFETCH: gl.constexpr, COMPUTE: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([SPT_K, SPT_V], [TPW_K, 32 // TPW_K], [W_K, W_V], [1, 0])
    LK: gl.constexpr = gl.SliceLayout(1, L)
    LV: gl.constexpr = gl.SliceLayout(0, L)
    o_k = gl.arange(0, K, layout=LK)
    o_b = gl.arange(0, BV, layout=LV)
    off = o_k[:, None] * V + o_b[None, :]
    pid = gl.program_id(0)
    n_my = (n_tiles - pid + NP - 1) // NP
    i = pid
    if PREFETCH:
        S_next = gl.load(s_in + ((i // NV).to(gl.int64) * (K * V) + (i % NV) * BV) + off)
    else:
        S_next = gl.zeros([K, BV], gl.float32, layout=L)
    for j in range(n_my):
        S = S_next
        if PREFETCH:
            i_n = i + NP
            lim = gl.where(i_n < n_tiles, K * V, 0)
            S_next = gl.load(s_in + ((i_n // NV).to(gl.int64) * (K * V) + (i_n % NV) * BV) + off, mask=off < lim)
        else:
            S = gl.load(s_in + ((i // NV).to(gl.int64) * (K * V) + (i % NV) * BV) + off)
        i_nh = i // NV
        i_v = i % NV
        if COMPUTE:
            i_h = i_nh % H
            p = i_nh.to(gl.int64) * K + o_k
            b_k = gl.load(k + p).to(gl.float32)
            b_q = gl.load(q + p).to(gl.float32)
            b_f = gl.load(g + p).to(gl.float32)
            b_v = gl.load(v + i_nh.to(gl.int64) * V + i_v * BV + o_b).to(gl.float32)
            b_b = _gl_sigmoid(gl.load(beta + i_nh).to(gl.float32))
            b_k = b_k / gl.sqrt(gl.sum(b_k * b_k, axis=0) + 1e-6)
            b_q = b_q / gl.sqrt(gl.sum(b_q * b_q, axis=0) + 1e-6)
            x = (b_f + gl.load(dt_bias + i_h * K + o_k)) * gl.exp(gl.load(A_log + i_h))
            b_a = gl.exp(lb * _gl_sigmoid(x))
            u = gl.sum(S * (b_k * b_a)[:, None], axis=0)
            w = gl.sum(S * (b_q * b_a)[:, None], axis=0)
            r = (b_v - u) * b_b
            S = S * b_a[:, None] + b_k[:, None] * r[None, :]
            b_o = (w + r * gl.sum(b_k * b_q, axis=0)) * scale
            gl.store(o + i_nh.to(gl.int64) * V + i_v * BV + o_b, b_o.to(o.dtype.element_ty))
        gl.store(s_out + (i_nh.to(gl.int64) * (K * V) + i_v * BV) + off, S)
        i += NP


def launch(x: dict, h0: torch.Tensor, hn: torch.Tensor, o: torch.Tensor, BV: int, spt: int, tpw_k: int, wk: int,
           wv: int, per_sm: int | None, prefetch: bool, compute: bool = True, contig_k: bool = True) -> None:
    B, T, H, K = x["q"].shape
    V = x["v"].shape[-1]
    NV = V // BV
    n_tiles = B * H * NV
    warps = wk * wv
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if per_sm is None:
        NP, cap = n_tiles, None
    else:
        NP = min(n_tiles, per_sm * sms)
        cap = min(255, 65536 // (per_sm * warps * 32) // 8 * 8)
    kw = dict(num_warps=warps) if cap is None else dict(num_warps=warps, maxnreg=cap)
    _gl_decode[(NP,)](x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], o, h0, hn, n_tiles, NP,
                      H, K ** -0.5, -5.0, K=K, V=V, BV=BV, NV=NV, SPT_K=K // (tpw_k * wk) if contig_k else 1, SPT_V=spt, TPW_K=tpw_k, W_K=wk, W_V=wv,
                      PREFETCH=prefetch, COMPUTE=compute, **kw)


def main() -> int:
    from k3.bench.kda import K3_FLAGS, _inputs
    from k3.ops.kda import fused_recurrent_kda

    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    a = ap.parse_args()
    x = _inputs(a.B, 1, a.H)
    h0 = torch.randn(a.B, a.H, 128, 128, device="cuda")
    hn = torch.empty_like(h0)
    o = torch.empty_like(x["v"])
    nbytes = 2 * h0.numel() * 4

    def ref():
        return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                   dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True, **K3_FLAGS)

    o_ref, s_ref = ref()
    # (name, BV, size/thread along V, threads along K, warps along K, warps along V, programs/SM or None, prefetch)
    variants = [
        ("bv32 wV2 tk8 pf p6", 32, 4, 8, 1, 2, 6, True),
        ("bv32 wV2 tk8 pf p8", 32, 4, 8, 1, 2, 8, True),
        ("bv32 wV2 tk8 pf p4", 32, 4, 8, 1, 2, 4, True),
        ("bv32 wV2 tk8 nopf p8", 32, 4, 8, 1, 2, 8, False),
        ("bv32 wV2 tk8 grid", 32, 4, 8, 1, 2, None, False),
        ("bv32 wK2 tk4 pf p6", 32, 4, 4, 2, 1, 6, True),
        ("bv32 wK2 tk4 grid", 32, 4, 4, 2, 1, None, False),
        ("bv16 w1 tk8 pf p12", 16, 4, 8, 1, 1, 12, True),
        ("bv16 w1 tk8 pf p16", 16, 4, 8, 1, 1, 16, True),
        ("bv16 w1 tk8 grid", 16, 4, 8, 1, 1, None, False),
        ("bv32 w1 tk4 pf p8", 32, 4, 4, 1, 1, 8, True),
        ("bv32 w1 tk4 grid", 32, 4, 4, 1, 1, None, False),
        ("bv64 wV2 tk4 grid", 64, 4, 4, 1, 2, None, False),
        ("bv64 wV4 tk8 grid", 64, 4, 8, 1, 4, None, False),
        ("bv64 wV4 tk8 pf p4", 64, 4, 8, 1, 4, 4, True),
        ("bv128 wV4 tk4 grid", 128, 4, 4, 1, 4, None, False),
        ("bv128 wV8 tk8 grid", 128, 4, 8, 1, 8, None, False),
        ("bv64 wV2 tk4 pf p3", 64, 4, 4, 1, 2, 3, True),
        ("bv32 wV2 tk8 pf p2", 32, 4, 8, 1, 2, 2, True),
        ("bv32 wV2 tk8 pf p3", 32, 4, 8, 1, 2, 3, True),
    ]
    rows = []
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")  # noqa: E731
    # clocks up before the first timing
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        m @ m
    torch.cuda.synchronize()
    rows.append(("triton default", bench(ref), 0.0, 0.0))
    rows.append(("copy_", bench(lambda: hn.copy_(h0)), 0.0, 0.0))
    for name, BV, spt, tk, wk, wv, per_sm, pf in variants:
        try:
            hn.fill_(float("nan"))
            o.fill_(float("nan"))
            launch(x, h0, hn, o, BV, spt, tk, wk, wv, per_sm, pf)
            torch.cuda.synchronize()
            eo = ((o.float() - o_ref.float()).pow(2).mean() / o_ref.float().pow(2).mean()).sqrt().item()
            es = ((hn - s_ref).pow(2).mean() / s_ref.pow(2).mean()).sqrt().item()
            t = bench(lambda: launch(x, h0, hn, o, BV, spt, tk, wk, wv, per_sm, pf))
            tc = bench(lambda: launch(x, h0, hn, o, BV, spt, tk, wk, wv, per_sm, pf, compute=False))
            rows.append((name, t, eo, es, tc))
        except Exception as e:  # noqa: BLE001 — a probe: report and go on
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    rows.append(("triton default (again)", bench(ref), 0.0, 0.0))
    print("| variant | ms | state TB/s | rel err o | rel err S | same tiles, copy only (ms) |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        tc = f"{r[4]:.4f}" if len(r) > 4 else ""
        print(f"| {r[0]} | {r[1]:.4f} | {nbytes / r[1] / 1e9:.2f} | {r[2]:.1e} | {r[3]:.1e} | {tc} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
