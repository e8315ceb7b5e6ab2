#!/usr/bin/env python3
"""Where one prefill call's GPU time goes: kernel times per name from ``torch.profiler``, beside the call's
``do_bench`` median, for the default and each knob variant (same syntax as ``bench/knob_ab.py``).

    python bench/split_parts.py --cases prefill8 --variant w4g SplitConfig.window_cap=4294967296

Per variant: the call's median (ms), then per kernel name the summed device time of one call (ms), the launch
count, and the busy time of the union of all kernels (overlapping kernels count once) against the call's span on
the GPU — the gap is idle time between launches (host waits, serial tails) — and the host time of one call started
on an idle GPU. ``--gaps-us N`` also lists every stretch of at least N µs in which no kernel ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from knob_ab import add_variant_args, applied, prefill_inputs, run, variant_list  # noqa: E402


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs in, ms out)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def idle_gaps(kernels: list[tuple[float, float, str]], min_us: float) -> list[tuple[float, float, str, str]]:
    """Stretches of at least ``min_us`` with no kernel running: (start µs from the first kernel, length µs, the
    kernel that ended last before it, the kernel after it)."""
    out, end, last = [], None, ""
    t0 = min(s for s, _, _ in kernels) if kernels else 0.0
    for s, e, name in sorted(kernels):
        if end is not None and s - end >= min_us:
            out.append((end - t0, s - end, last, name))
        if end is None or e > end:
            end, last = e, name
    return out


def profile_call(case: str, x: dict, calls: int,
                 gaps_us: float = 0.0) -> tuple[dict[str, list[float]], float, float]:
    """Kernel name → [ms per call, launches per call]; union busy ms and first-to-last span ms per call.
    ``gaps_us`` > 0: also prints every idle stretch of the GPU at least that long (``idle_gaps``)."""
    run(case, x, None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run(case, x, None)
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    spans = []
    kernels = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start = ev.time_range.start
        dur = ev.time_range.end - start
        spans.append((start, start + dur))
        name = ev.name if len(ev.name) < 60 else ev.name[:57] + "..."
        kernels.append((start, start + dur, name[:30]))
        per[name][0] += dur / 1e3 / calls
        per[name][1] += 1 / calls
    if gaps_us > 0:
        gaps = idle_gaps(kernels, gaps_us)
        print(f"idle stretches ≥ {gaps_us:g} µs over {calls} calls: {len(gaps)}, {sum(g[1] for g in gaps):.0f} µs")
        for at, length, before, after in gaps:
            print(f"  at {at:9.1f} µs: {length:7.1f} µs idle, after {before} / before {after}")
    busy = union_ms(spans) / calls
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 / calls if spans else 0.0
    return per, busy, span


def host_ms(case: str, x: dict, calls: int = 5) -> float:
    """Median host time to return from one call started on an idle GPU: launches plus any host waits inside it."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(case, x, None)
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    add_variant_args(ap, ["prefill32", "prefill8"], ["prefill8"])
    ap.add_argument("--rep", type=float, default=300.0)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--gaps-us", type=float, default=0.0, help="print the GPU's idle stretches at least this long")
    a = ap.parse_args()
    variants = variant_list(a.variant)
    summary = []
    for case in a.cases:
        x = prefill_inputs(case)
        for name, knobs in variants:
            with applied(knobs):
                t = triton.testing.do_bench(lambda: run(case, x, None), warmup=3, rep=a.rep, return_mode="median")
                per, busy, span = profile_call(case, x, a.calls, a.gaps_us)
                host = host_ms(case, x)
            print(f"\n## {case} {name}: {t:.3f} ms (do_bench median); kernels' union {busy:.3f} ms, "
                  f"first-to-last {span:.3f} ms per call; host time of a call on an idle GPU {host:.3f} ms")
            print("| kernel | ms per call | launches |\n|---|---:|---:|")
            rows = sorted(per.items(), key=lambda kv: -kv[1][0])
            for kname, (ms, n) in rows[:a.top]:
                print(f"| {kname} | {ms:.3f} | {n:.0f} |")
            rest = rows[a.top:]
            if rest:
                print(f"| ({len(rest)} others) | {sum(r[1][0] for r in rest):.3f} | "
                      f"{sum(r[1][1] for r in rest):.0f} |")
            summary.append((case, name, t, busy, span, sum(v[1] for v in per.values())))
        del x
        torch.cuda.empty_cache()
    print("\n| case | variant | median ms | kernels' union ms | span ms | launches |\n|---|---|---:|---:|---:|---:|")
    for case, name, t, busy, span, n in summary:
        print(f"| {case} | {name} | {t:.3f} | {busy:.3f} | {span:.3f} | {n:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
