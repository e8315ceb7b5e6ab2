#!/usr/bin/env python3
"""Where a split prefill call's host time goes: cProfile of one ``chunk_kda`` call (B=1, H=8 by default, the K3
call, warmed up first), the top functions by cumulative and by own time.

    python bench/split_host_profile.py [--T 1048576] [--H 8] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from k3.bench.kda import _inputs, _ours  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1 << 20)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    x = _inputs(1, a.T, a.H)
    with torch.no_grad():
        for _ in range(3):
            _ours(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _ours(x)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        _ours(x)
        prof.disable()
        torch.cuda.synchronize()
    print(f"host time of one call (enqueue only): {host * 1e3:.2f} ms")
    st = pstats.Stats(prof)
    st.sort_stats("cumulative").print_stats(a.top)
    st.sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
