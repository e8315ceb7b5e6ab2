#!/usr/bin/env python3
"""Why a state-pool decode step (in place, through slot indices) is slower than the dense one (B=64, H=32, K3
flags, CUDA-graph replays, same process): the dense step out of place, the pool step at slots 0..B−1 of a pool of
B (the dense layout, in place), of 2B in order, at the bench's random distinct slots of 2B, and ``copy_`` of the
state bytes, out of place and onto itself.

    python bench/decode_pool_probe.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.bench.kda import K3_FLAGS, _cuda_graph, _inputs, warm_clocks  # noqa: E402
from k3.ops.kda import fused_recurrent_kda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    B, H = 64, 32
    x = _inputs(B, 1, H)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], **K3_FLAGS)
    h0 = torch.randn(B, H, 128, 128, device="cuda")
    pool_b = torch.randn(B, H, 128, 128, device="cuda")
    pool_2b = torch.randn(2 * B, H, 128, 128, device="cuda")
    ar = torch.arange(B, device="cuda")
    perm = torch.randperm(2 * B, device="cuda")[:B]
    srt = perm.sort().values
    dst = torch.empty_like(h0)
    cases = {
        "dense, out of place": lambda: fused_recurrent_kda(*args, initial_state=h0, output_final_state=True, **kw),
        "pool of B, slots 0..B-1 (in place)": lambda: fused_recurrent_kda(*args, initial_state=pool_b,
                                                                          ssm_state_indices=ar, **kw),
        "pool of 2B, slots 0..B-1": lambda: fused_recurrent_kda(*args, initial_state=pool_2b,
                                                                ssm_state_indices=ar, **kw),
        "pool of 2B, random distinct slots (bench)": lambda: fused_recurrent_kda(*args, initial_state=pool_2b,
                                                                                 ssm_state_indices=perm, **kw),
        "pool of 2B, the same slots sorted": lambda: fused_recurrent_kda(*args, initial_state=pool_2b,
                                                                         ssm_state_indices=srt, **kw),
        "copy_ out of place": lambda: dst.copy_(h0),
        "x.mul_(1) in place": lambda: h0.mul_(1.0),
    }
    warm_clocks(3.0)
    times: dict[str, list[float]] = {n: [] for n in cases}
    with torch.inference_mode():
        graphs = {n: _cuda_graph(f) for n, f in cases.items()}
        for _ in range(a.rounds):
            for n, g in graphs.items():
                times[n].append(triton.testing.do_bench(g, warmup=25, rep=200, return_mode="median"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| case | ms (graph replays, rounds) |\n|---|---:|")
    for n, t in times.items():
        print(f"| {n} | {' / '.join(f'{v:.4f}' for v in t)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
