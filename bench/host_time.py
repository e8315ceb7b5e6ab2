#!/usr/bin/env python3
"""Host time of one prefill call: how long after the call starts its first kernel starts on an idle GPU (the GPU
waits that long: ``do_bench`` counts it), the host time until the call returns, and where the host spends it
(``cProfile``, cumulative); then the call's ``do_bench`` median eagerly and as a CUDA-graph replay (no host time).

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
import triton  # noqa: E402
import triton.runtime.jit as tjit  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from knob_ab import add_variant_args, applied, prefill_inputs, run, variant_list  # noqa: E402


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


def first_launch_ms(case: str, x: dict, calls: int = 5) -> float:
    """Median host ms from the call's start to its first Triton launch (no profiler: the launcher is wrapped)."""
    stamps: list[float] = []
    orig = tjit.JITFunction.run

    def stamped(self, *a, **k):
        stamps.append(time.perf_counter())
        return orig(self, *a, **k)

    out = []
    tjit.JITFunction.run = stamped
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            stamps.clear()
            t0 = time.perf_counter()
            run(case, x, None)
            out.append((stamps[0] - t0) * 1e3 if stamps else float("nan"))
    finally:
        tjit.JITFunction.run = orig
    torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def graph_ms(case: str, x: dict) -> float:
    """do_bench median of a CUDA-graph replay of the call (nan if the capture fails)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(case, x, None)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run(case, x, None)
        return triton.testing.do_bench(g.replay, warmup=3, rep=300, return_mode="median")
    except Exception as e:  # noqa: BLE001 — report, do not stop the other rows
        print(f"graph capture failed: {type(e).__name__}: {e}", flush=True)
        return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    add_variant_args(ap, ["prefill32", "prefill8"], ["prefill32", "prefill8"])
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    variants = variant_list(a.variant)
    rows = []
    for case in a.cases:
        x = prefill_inputs(case)
        for name, knobs in variants:
            with applied(knobs):
                run(case, x, None)
                delay, ret = first_kernel_delay(case, x)
                launch = first_launch_ms(case, x)
                eager = triton.testing.do_bench(lambda: run(case, x, None), warmup=3, rep=300, return_mode="median")
                graph = graph_ms(case, x)
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
            rows.append((case, name, delay, ret, host, launch, eager, graph))
        del x
        torch.cuda.empty_cache()
    print("| case | variant | first kernel ms (profiled) | host return ms (profiled) | host return ms | first launch "
          "ms | eager ms | graph replay ms |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | " + " | ".join(f"{v:.3f}" for v in r[2:]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
