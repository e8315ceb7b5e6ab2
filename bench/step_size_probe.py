#!/usr/bin/env python3
"""What the 16-token flow's state pass would cost with 32- or 64-token steps: ``chunk16._c16_state`` (mode 2, the
pointer loop, [U; A_qk U] row-major) launched with its step size ``BC`` = 16 / 32 / 64 over one window of random,
bounded operands (B=1, T=128K, H=32, K = V = 128, bf16) — a timing of the step's data flow only: no prep exists
for BC > 16, so the outputs mean nothing. Per step the products grow ([64, 128] × [128, 2·BC] and
[64, BC] × [BC, 128]) while the per-step costs (Sᵀ's conversion, the decay, γ's loads, addresses, barriers) stay:
``bench/wgmma_probe.py`` measured both halves.

    python bench/step_size_probe.py [--sets 16:8 32:4 32:6 64:2 64:3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.ops.kda.triton import chunk16 as c16  # noqa: E402
from k3.ops.kda.triton._common import BT, make_chunk_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["16:8", "32:4", "32:6", "64:2", "64:3"], help="BC:stages")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--H", type=int, default=32)
    a = ap.parse_args()
    T, H, D = 1 << 17, a.H, 128
    dev = "cuda"
    tab = make_chunk_table(1, T, None, torch.device(dev))
    g = torch.Generator(device=dev).manual_seed(0)
    X = (torch.randn(H, tab.NC, 2 * BT, D, generator=g, device=dev) * 0.01).bfloat16()
    U = (torch.randn(H, tab.NC, 2 * BT, D, generator=g, device=dev) * 0.01).bfloat16()
    KG = (torch.randn(H, tab.NC, BT, D, generator=g, device=dev) * 0.01).bfloat16()
    GAM = torch.rand(H, tab.NC, BT // 16, D, generator=g, device=dev) * 0.1 + 0.9
    v = torch.zeros(1, T, H, D, device=dev, dtype=torch.bfloat16)
    o = torch.empty(1, T, H, D, device=dev, dtype=torch.bfloat16)
    ht = torch.zeros(1, H, D, D, device=dev)
    times: dict[str, list[float]] = {s: [] for s in a.sets}
    for _ in range(a.rounds):
        for spec in a.sets:
            bc, stages = (int(x) for x in spec.split(":"))

            def state(bc: int = bc, stages: int = stages) -> None:
                c16._c16_state[(2, H)](
                    X, GAM, KG, GAM, GAM, GAM, U, v, o, ht, tab.cu, tab.chunk_off, 0, tab.NC, tab.NC, tab.T, tab.NT,
                    H, K=D, V=D, BT=BT, BC=bc, BK=D, BV=64, BVP=D, IS_VARLEN=False, PREC="tf32", STAGES=stages,
                    MODE=2, PTR_INC=True, U_EYE=True, U_RM=True, RING=0, num_warps=4, num_stages=1)

            try:
                times[spec].append(triton.testing.do_bench(state, warmup=3, rep=200, return_mode="median"))
            except Exception as e:  # noqa: BLE001 (a step size whose tiles do not fit)
                print(spec, type(e).__name__, str(e)[:200], flush=True)
                times[spec].append(float("nan"))
            print(spec, f"{times[spec][-1]:.3f} ms", flush=True)
    print(f"\n| step (tokens) | stages | ms per 128K (rounds), H={H} | ms per 1M |\n|---:|---:|---|---:|")
    for spec in a.sets:
        bc, stages = spec.split(":")
        ts = times[spec]
        print(f"| {bc} | {stages} | {' / '.join(f'{t:.3f}' for t in ts)} | {min(ts) * 8:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
