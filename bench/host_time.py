#!/usr/bin/env python3
"""Host time of one prefill call: how long after the call starts its first kernel starts on an idle GPU (the GPU
waits that long: ``do_bench`` counts it), the host time until the call returns, and where the host spends it
(``cProfile``, cumulative).

    python bench/host_time.py --cases prefill32 prefill8 [--variant NAME Class.knob=value ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from k3.bench.kda import _inputs  # noqa: E402
from knob_ab import CASES, applied, parse, run  # noqa: E402


def first_kernel_delay(case: str, x: dict, calls: int = 5) -> tuple[float, float]:
    """(ms from the call's start to its first kernel's start, ms from the call's start to its return), medians
    over ``calls`` calls each made on an idle GPU."""
    delays, returns = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("k3_call"):
                run(case, x, None)
            torch.cuda.synchronize()
        evs = prof.events()
        call = next(e for e in evs if e.name == "k3_call")
        kern = [e.time_range.start for e in evs if e.device_type == torch.autograd.DeviceType.CUDA]
        delays.append((min(kern) - call.time_range.start) / 1e3)
        returns.append((call.time_range.end - call.time_range.start) / 1e3)
    delays.sort()
    returns.sort()
    return delays[len(delays) // 2], returns[len(returns) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["prefill32", "prefill8"], choices=["prefill32", "prefill8"])
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KNOB"))
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    variants = [("default", {})] + [(v[0], parse(v[1:])) for v in a.variant]
    rows = []
    for case in a.cases:
        B, T, H, _ = CASES[case]
        x = _inputs(B, T, H)
        x["h0"] = torch.randn(B, H, 128, 128, device="cuda")
        for name, knobs in variants:
            with applied(knobs):
                run(case, x, None)
                delay, ret = first_kernel_delay(case, x)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run(case, x, None)
                host = (time.perf_counter() - t0) * 1e3
                torch.cuda.synchronize()
                pr = cProfile.Profile()
                pr.enable()
                run(case, x, None)
                pr.disable()
                torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(a.top)
            print(f"\n## {case} {name}: first kernel {delay:.3f} ms after the call starts; returns after {ret:.3f} "
                  f"ms (profiled), {host:.3f} ms (plain)\n{s.getvalue()}", flush=True)
            rows.append((case, name, delay, ret, host))
        del x
        torch.cuda.empty_cache()
    print("| case | variant | first kernel ms | host return ms (profiled) | host return ms |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
