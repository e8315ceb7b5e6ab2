#!/usr/bin/env python3
"""The 16-token inference flow (``chunk16``) on a GPU: accuracy against the fp32 64-token path, bitwise
causality, then each kernel timed alone over one window (B=1, T=128K, H=32, bf16) for every launch variant.

    python bench/c16_quick.py [--skip-check] [--modes "0 1 2"] [--preps "2,1,1,tf32x3 …"] [--states "64,4,6,1 …"]
    python bench/c16_quick.py --skip-check --sets base: eye:state_u_eye=True [--rounds 2]

``--preps``: prep variants as warps,inverse-by-products,early-loads,products' precision; ``--states``: state-pass
variants as BV,warps,stages,pointers-advanced (mode 2).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.ops.kda.triton import chunk16 as c16  # noqa: E402
from k3.ops.kda.triton import chunk_kda_triton, prep_gluon  # noqa: E402
from k3.ops.kda.triton._common import make_chunk_table  # noqa: E402
from k3.ops.kda.triton.chunk_fwd import FwdConfig, alloc_output_state  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def call(x, dtype, flow, cu=None, lb=-5.0):
    with overridden_attrs(FwdConfig, inference_flow=flow), torch.no_grad():
        c = lambda t: t.to(dtype)  # noqa: E731
        K = x["q"].shape[-1]
        return chunk_kda_triton(c(x["q"]), c(x["k"]), c(x["v"]), c(x["g"]), c(x["beta"]), K ** -0.5, x.get("s0"),
                                True, True, True, True, lb, cu, x["A"], x["dt"])


def inputs(T, H, N=1, seed=0, g=None, beta=None, repeat=False, D=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    x = dict(q=r(1, T, H, D), k=r(1, T, H, D), v=r(1, T, H, D), g=r(1, T, H, D), beta=r(1, T, H), A=r(H) * 0.5,
             dt=r(H * D) * 0.5, s0=r(N, H, D, D))
    if g is not None:
        x["g"].fill_(g)
    if beta is not None:
        x["beta"].fill_(beta)
    if repeat:
        x["k"] = x["k"][:, :1].expand_as(x["k"]).contiguous()
    return x


def checks() -> None:
    cu = torch.tensor([0, 1, 100, 4097, 8191], device="cuda")
    cases = [("dense T=8191", dict(T=8191, H=4), None), ("varlen", dict(T=8191, H=4, N=4), cu),
             ("gates at bound, β≈1, repeated keys", dict(T=3001, H=2, g=30.0, beta=12.0, repeat=True), None),
             ("β≈0", dict(T=3001, H=2, beta=-12.0), None)]
    for name, kw, cus in cases:
        x = inputs(**kw)
        ro, rh = call(x, torch.float32, "c64", cus)
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            out = {"c64": call(x, dt, "c64", cus)}
            for mode in (0, 1, 2):
                with overridden_attrs(c16.C16Config, mode=mode, prep_inv_pow=mode == 2):
                    out[f"c16 mode {mode}"] = call(x, dt, "c16", cus)
            cells = []
            for f, (o, h) in out.items():
                nan = " NaN" if bool(o.isnan().any() or h.isnan().any()) else ""
                cells.append(f"{f}: o {rel(o, ro):.2e} ht {rel(h, rh):.2e}{nan}")
            print(f"{name:40s} {str(dt):15s} " + "  ".join(cells), flush=True)
    for mode in (0, 1, 2):
        with overridden_attrs(c16.C16Config, mode=mode, prep_inv_pow=mode == 2):
            x = inputs(T=5000, H=2)
            o1, _ = call(x, torch.bfloat16, "c16")
            for n in ("q", "k", "v", "g", "beta"):
                x[n][:, 2345:] = torch.randn_like(x[n][:, 2345:]) * 3
            o2, _ = call(x, torch.bfloat16, "c16")
        print(f"mode {mode}: causality bitwise (prefix 2345 unchanged):", torch.equal(o1[:, :2345], o2[:, :2345]),
              flush=True)


def one_window(T: int = 1 << 17, H: int = 32):
    """bf16 inputs of one 128K-token window at H=32 (the K3 call), its chunk table, flags, output and state."""
    x = inputs(T, H, seed=1)
    x = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}
    tab = make_chunk_table(1, T, None, x["q"].device)
    flags = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)
    o, ht = alloc_output_state(x["q"], x["v"], None, tab)
    return x, tab, flags, o, ht


def kernel_times(states: list[tuple[int, int, int, int]], preps: list[tuple[int, int, int, str]],
                 modes: list[int]) -> list[str]:
    H = 32
    x, tab, flags, o, ht = one_window(H=H)
    rows = []
    for mode in modes:
        with overridden_attrs(c16.C16Config, mode=mode):
            bufs = c16.alloc_c16_buffers(H, tab.NC, 128, 128, torch.bfloat16, x["q"].device)

            def prep():
                c16.launch_c16_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A"], x["dt"], bufs, tab, 0,
                                    tab.NC, 128 ** -0.5, -5.0, flags)

            for w, pw, early, prec in preps:
                with overridden_attrs(c16.C16Config, prep_warps=w, prep_inv_pow=bool(pw), prep_early_loads=bool(early),
                                      prep_inv_prec=prec):
                    t = triton.testing.do_bench(prep, warmup=5, rep=200, return_mode="median")
                rows.append(f"| prep | mode {mode}, warps {w}, inverse {'pow' if pw else 'subst'}, "
                            f"{prec}, early loads {bool(early)} | {t:.3f} | {t * 8:.1f} |")
                print(rows[-1], flush=True)
            prep()
            for bv, warps, stages, inc in states:
                opts = dict(state_bv=bv, state_warps=warps, state_stages=stages, state_ptr_inc=bool(inc))
                with overridden_attrs(c16.C16Config, **opts):
                    try:
                        t = triton.testing.do_bench(lambda: c16.launch_c16_state(bufs, x["v"], o, ht, tab, 0, tab.NC,
                                                                                 H, 128, 128),
                                                    warmup=3, rep=300, return_mode="median")
                        cell = f"{t:.3f} | {t * 8:.1f}"
                    except Exception as e:  # noqa: BLE001 (a variant that does not compile or launch)
                        cell = f"{type(e).__name__} |"
                rows.append(f"| state | mode {mode}, BV {bv}, {warps} warps, {stages} stages, pointers advanced {bool(inc)} | {cell} |")
                print(rows[-1], flush=True)
            del bufs
    return rows


def knob_sets(sets: list[tuple[str, dict]], rounds: int) -> list[str]:
    """Each named set of ``C16Config`` knobs at the default launch: the prep and the state pass alone over one window,
    every set timed ``rounds`` times, interleaved (drift shows as spread within a set)."""
    H = 32
    x, tab, flags, o, ht = one_window(H=H)
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n, _ in sets}
    for _ in range(rounds):
        for name, knobs in sets:
            # knobs named gluon_*: GluonPrepConfig's (gluon_prep = its ``enabled``, gluon_maxnreg = ``maxnreg``)
            c16_knobs = {n: v for n, v in knobs.items() if not n.startswith("gluon_")}
            gl_knobs = {("enabled" if n == "gluon_prep" else n[len("gluon_"):]): v for n, v in knobs.items()
                        if n.startswith("gluon_")}
            with overridden_attrs(c16.C16Config, **c16_knobs), \
                    overridden_attrs(prep_gluon.GluonPrepConfig, **{"enabled": False, **gl_knobs}):  # off unless named
                bufs = c16.alloc_c16_buffers(H, tab.NC, 128, 128, torch.bfloat16, x["q"].device)  # per mode
                def prep():
                    c16.launch_c16_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A"], x["dt"], bufs, tab, 0,
                                        tab.NC, 128 ** -0.5, -5.0, flags)

                def state():
                    c16.launch_c16_state(bufs, x["v"], o, ht, tab, 0, tab.NC, H, 128, 128)

                times[name][0].append(triton.testing.do_bench(prep, warmup=5, rep=200, return_mode="median"))
                prep()
                times[name][1].append(triton.testing.do_bench(state, warmup=3, rep=300, return_mode="median"))
                del bufs
            print(f"{name}: prep {times[name][0][-1]:.3f} state {times[name][1][-1]:.3f} ms", flush=True)
    rows = []
    for name, knobs in sets:
        kn = ", ".join(f"{k}={v!r}" for k, v in knobs.items()) or "default"
        cells = [" / ".join(f"{t * 8:.2f}" for t in ts) for ts in times[name]]
        rows.append(f"| {name} | {kn} | {cells[0]} | {cells[1]} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--states", default="64,4,3,0 64,4,4,0 64,4,5,0 128,8,3,0 128,8,4,0",
                    help="state-pass variants BV,warps,stages,pointer-increments (mode 2)")
    ap.add_argument("--modes", default="0 1 2", help="C16Config.mode values to time")
    ap.add_argument("--preps", default="2,1,0,ieee 2,1,1,ieee 4,1,1,ieee",
                    help="prep variants warps,inverse-by-products,early-loads,products' precision")
    ap.add_argument("--sets", nargs="*", default=None, metavar="NAME:KNOB=VALUE,…",
                    help="instead of the variant lists: named sets of C16Config knobs (Python literals), each prep "
                         "and state pass timed at the default launch, e.g. base: eye:state_u_eye=True")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over --sets, interleaved")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    if not a.skip_check:
        checks()
    if a.sets is not None:
        sets = []
        for spec in a.sets:
            name, _, kv = spec.partition(":")
            sets.append((name, {k: ast.literal_eval(v) for k, v in (i.split("=", 1) for i in kv.split(",") if i)}))
        rows = knob_sets(sets, a.rounds)
        print("\n| set | knobs | prep per 1M (ms, each round) | state pass per 1M (ms, each round) |")
        print("|---|---|---:|---:|")
        print("\n".join(rows))
        return 0
    rows = kernel_times([tuple(int(v) for v in st.split(',')) for st in a.states.split()],
                        [(int(w), int(pw), int(e), prec) for w, pw, e, prec in (p.split(',') for p in a.preps.split())],
                        [int(m) for m in a.modes.split()])
    print("\n| kernel | variant | ms (T=128K, H=32) | ×8 (per 1M) |\n|---|---|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
