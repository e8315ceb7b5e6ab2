#!/usr/bin/env python3
"""Host vs GPU time of one decode step (B=64, H=32, K3 flags): ``do_bench`` under ``no_grad`` and
``inference_mode``, with and without fla imported, and the host's time per call (1000 calls, one sync), for the
Gluon kernel and the Triton one (``GluonDecodeConfig.enabled = False``).

    python bench/decode_host_time.py
"""

from __future__ import annotations

import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.bench.kda import K3_FLAGS, _inputs, warm_clocks  # noqa: E402
from k3.ops.kda import fused_recurrent_kda  # noqa: E402
from k3.ops.kda.triton.decode_gluon import GluonDecodeConfig  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402


def main() -> int:
    x = _inputs(64, 1, 32)
    h0 = torch.randn(64, 32, 128, 128, device="cuda")
    step = lambda: fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],  # noqa: E731
                                       dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True, **K3_FLAGS)
    warm_clocks(5.0)
    rows = []
    for with_fla in (False, True):
        if with_fla:
            importlib.import_module("fla.ops.kda")  # what the bench process has loaded
        for gluon in (True, False):
            for mode in ("no_grad", "inference_mode"):
                ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
                with ctx, overridden_attrs(GluonDecodeConfig, enabled=gluon):
                    step()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
                    t = time.perf_counter()
                    for _ in range(1000):
                        step()
                    host = (time.perf_counter() - t) / 1000 * 1e3
                    torch.cuda.synchronize()
                rows.append((with_fla, gluon, mode, ms, host))
    print("| fla imported | kernel | mode | do_bench ms | host ms per call |\n|---|---|---|---:|---:|")
    for with_fla, gluon, mode, ms, host in rows:
        print(f"| {with_fla} | {'gluon' if gluon else 'triton'} | {mode} | {ms:.4f} | {host:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
