#!/usr/bin/env python3
"""The split prefill (B=1, H=8 by default, T=1M, the K3 call) when only some heads forget: channel 0 of the first
``m`` heads never forgets (dt_bias −20), the others keep the benchmark's random gates, for m = 0 … H; each against
``SplitConfig.forget_log2 = None`` in the same process (do_bench medians, ms).

    python bench/forget_mix_probe.py [--H 8] [--T 1048576] [--m 0 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.bench.kda import _inputs, _ours  # noqa: E402
from k3.ops.kda.triton.span import SplitConfig  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--T", type=int, default=1 << 20)
    ap.add_argument("--m", type=int, nargs="+", default=[0, 2, 4, 8])
    a = ap.parse_args()
    x = _inputs(1, a.T, a.H)
    print("| heads remembering | forget_log2 = 128 | off |\n|---:|---:|---:|")
    for m in a.m:
        dt = torch.zeros(a.H, 128, device="cuda")
        dt[:m, 0] = -20.0
        xm = dict(x, dt_bias=dt.flatten())
        with torch.no_grad():
            on = triton.testing.do_bench(lambda: _ours(xm), warmup=3, rep=300, return_mode="median")
            with overridden_attrs(SplitConfig, forget_log2=None):
                off = triton.testing.do_bench(lambda: _ours(xm), warmup=3, rep=300, return_mode="median")
        print(f"| {m} of {a.H} | {on:.2f} | {off:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
