#!/usr/bin/env python3
"""The 16-token flow's state pass alone over one window (B=1, T=128K, bf16, K = V = 128): the Triton kernel
(``chunk16._c16_state``) against the Gluon one (``state_gluon``) at each ring depth, from the same prep buffers —
outputs and final states compared with the Triton kernel's, then ``do_bench`` medians in interleaved rounds.

    python bench/state_gluon_quick.py [--H 32 8] [--variants s8:stages=8 c1:chains=1,stages=10] [--rounds 2]

Each variant is a name and ``GluonStateConfig`` knobs (Python literals) on top of ``enabled=True``.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.c16_quick import one_window  # noqa: E402
from k3.ops.kda.triton import chunk16 as c16  # noqa: E402
from k3.ops.kda.triton.state_gluon import GluonStateConfig  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--H", type=int, nargs="+", default=[32])
    ap.add_argument("--variants", nargs="+", default=["s8:stages=8", "s10:stages=10"])
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rows = ["| H | state pass | max rel. error o / state vs Triton | ms per 128K (rounds) | ms per 1M |", "|---|---|---|---|---|"]
    for H in a.H:
        x, tab, flags, o, ht = one_window(H=H)
        bufs = c16.alloc_c16_buffers(H, tab.NC, 128, 128, torch.bfloat16, x["q"].device)
        c16.launch_c16_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A"], x["dt"], bufs, tab, 0, tab.NC,
                            128 ** -0.5, -5.0, flags)
        h0 = ht.clone()
        variants = [("triton", dict(enabled=False))]
        for spec in a.variants:
            name, _, knobs = spec.partition(":")
            kw = dict(enabled=True)
            for kv in filter(None, knobs.split(",")):
                k, v = kv.split("=")
                kw[k] = ast.literal_eval(v)
            variants.append((f"gluon {name}", kw))

        def state() -> None:
            c16.launch_c16_state(bufs, x["v"], o, ht, tab, 0, tab.NC, H, 128, 128)

        ref, errs, times = None, {}, {n: [] for n, _ in variants}
        for name, knobs in variants:
            with overridden_attrs(GluonStateConfig, **knobs):
                ht.copy_(h0)
                o.fill_(float("nan"))
                state()
                torch.cuda.synchronize()
                if ref is None:
                    ref = (o.clone(), ht.clone())
                errs[name] = (rel(o, ref[0]), rel(ht, ref[1]))
                print(name, "errors", errs[name], flush=True)
        for _ in range(a.rounds):
            for name, knobs in variants:
                with overridden_attrs(GluonStateConfig, **knobs):
                    times[name].append(triton.testing.do_bench(state, warmup=3, rep=300, return_mode="median"))
                print(name, f"{times[name][-1]:.3f} ms", flush=True)
        for name, _ in variants:
            ts = times[name]
            rows.append(f"| {H} | {name} | {errs[name][0]:.1e} / {errs[name][1]:.1e} | "
                        f"{' / '.join(f'{t:.3f}' for t in ts)} | {min(ts) * 8:.2f} |")
        del bufs
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
