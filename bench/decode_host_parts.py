#!/usr/bin/env python3
"""Where the host time of one eager decode step goes (B=64, H=32, K3 flags, inference mode): host µs per call of
the whole ``fused_recurrent_kda``, of its argument checks, of the Triton-side wrapper, of the bare Gluon launch
through ``JITFunction.run`` and of fla's call; then a ``cProfile`` of 2000 whole calls (top entries by own time)
and the eager ``do_bench`` medians beside the CUDA-graph replay.

    python bench/decode_host_parts.py [--profile-rows 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.bench.kda import K3_FLAGS, _cuda_graph, _inputs, warm_clocks  # noqa: E402
from k3.ops.kda import fused_recurrent_kda  # noqa: E402
from k3.ops.kda.checks import check_kda_call  # noqa: E402
from k3.ops.kda.triton.fused_recurrent import fused_recurrent_kda_triton  # noqa: E402


def host_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """Host µs per call: ``calls`` calls, one sync at the end (the GPU queue absorbs the launches)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def graph_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(_cuda_graph(fn), warmup=25, rep=200, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile-rows", type=int, default=25)
    args = ap.parse_args()
    x = _inputs(64, 1, 32)
    h0 = torch.randn(64, 32, 128, 128, device="cuda")
    q, k, v, g, beta, A, dt = (x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"))
    rows: list[tuple[str, float, float | None, float | None]] = []
    with torch.inference_mode():
        full = lambda: fused_recurrent_kda(q, k, v, g, beta, A_log=A, dt_bias=dt, initial_state=h0,  # noqa: E731
                                           output_final_state=True, **K3_FLAGS)
        checks = lambda: check_kda_call(q, k, v, g, beta, None, h0, True, True, -5.0, None, A, dt)  # noqa: E731
        wrapper = lambda: fused_recurrent_kda_triton(q, k, v, g, beta, 128**-0.5, h0, True, True, True,  # noqa: E731
                                                     True, -5.0, None, A, dt)
        empty = lambda: (torch.empty(64, 1, 32, 128, dtype=q.dtype, device=q.device),  # noqa: E731
                         torch.empty(64, 32, 128, 128, dtype=torch.float32, device=q.device))
        warm_clocks(3.0)
        for name, fn in (("k3 fused_recurrent_kda", full), ("k3 check_kda_call", checks),
                         ("k3 fused_recurrent_kda_triton", wrapper), ("two torch.empty", empty)):
            eager = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") if name != "k3 check_kda_call" else None
            rows.append((name, host_us(fn), eager, graph_ms(fn) if eager is not None and "empty" not in name else None))
        try:
            from fla.ops.kda import fused_recurrent_kda as fla_fr

            fla = lambda: fla_fr(q, k, v, g, beta, A_log=A, dt_bias=dt, initial_state=h0,  # noqa: E731
                                 output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
            rows.append(("fla fused_recurrent_kda", host_us(fla),
                         triton.testing.do_bench(fla, warmup=25, rep=200, return_mode="median"), graph_ms(fla)))
        except ImportError as e:
            print(f"fla not importable: {e}")
        # the full call again last (fla's import can add host time)
        rows.append(("k3 fused_recurrent_kda (again)", host_us(full),
                     triton.testing.do_bench(full, warmup=25, rep=200, return_mode="median"), None))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            full()
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile_rows)
    print(buf.getvalue())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| call | host µs per call | eager do_bench ms | graph ms |\n|---|---:|---:|---:|")
    for name, h, e, gms in rows:
        print(f"| {name} | {h:.1f} | {'' if e is None else f'{e:.4f}'} | {'' if gms is None else f'{gms:.4f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
