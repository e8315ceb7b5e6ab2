#!/usr/bin/env python3
"""How much of a decode step's measured time is host time: the same step timed by ``do_bench`` as the bench does,
and replayed from a CUDA graph (no Python, no launch overhead), for the Gluon kernel and the persistent Triton one,
beside a plain copy of the same state bytes (after 5 s of matrix products: clocks up).

    python bench/decode_host_check.py [--B 64] [--H 32]
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
from k3.ops.kda.triton.decode_gluon import GluonDecodeConfig  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    a = ap.parse_args()
    x = _inputs(a.B, 1, a.H)
    h0 = torch.randn(a.B, a.H, 128, 128, device="cuda")
    out = torch.empty_like(h0)

    def step():
        return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                                   initial_state=h0, output_final_state=True, **K3_FLAGS)

    warm_clocks(5.0)
    rows = []
    with torch.no_grad():
        for gluon in (True, False):  # the Gluon kernel (default on CUDA), then the persistent Triton one
            tag = "gluon" if gluon else "triton"
            with overridden_attrs(GluonDecodeConfig, enabled=gluon):
                step()
                torch.cuda.synchronize()
                rows.append((f"do_bench(step), {tag}", triton.testing.do_bench(step, warmup=25, rep=300,
                                                                                return_mode="median")))
                replay = _cuda_graph(step)
                rows.append((f"do_bench(graph.replay), {tag}", triton.testing.do_bench(replay, warmup=25, rep=300,
                                                                                        return_mode="median")))
        rows.append(("copy_ of the state", triton.testing.do_bench(lambda: out.copy_(h0), warmup=25, rep=300,
                                                                   return_mode="median")))
    nbytes = 2 * h0.numel() * 4
    print("| timing | ms | state TB/s |\n|---|---:|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.4f} | {nbytes / ms / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
