#!/usr/bin/env python3
"""Where a training step's time goes: every CUDA kernel of one forward+backward (the bench's closure,
``o.backward(do)`` with bf16 ``do``), ours beside fla 0.6.0's, in one process.

    python bench/train_profile.py [--shape 8,4096,32] [--no-fla] [--json out.json]

Per implementation: the do_bench median of the whole step, the sum of its kernels' times per step (the gap between
the two is host time or launch gaps), and each kernel's time per step, largest first (``profile_kernels.profile``:
kernels above 2 µs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from k3.bench.kda import _bench, _fla, _fla_module, _inputs, _ours  # noqa: E402
from profile_kernels import profile as kernel_table  # noqa: E402  (kernel, ms per step, launches per step)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,4096,32", help="B,T,H")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    B, T, H = (int(s) for s in a.shape.split(","))
    impls = [("k3", _ours)]
    if not a.no_fla and _fla_module() is not None:
        impls.append(("fla", _fla))
    res = {}
    for name, f in impls:
        x = _inputs(B, T, H, grad=True)
        do = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16)

        def step(x=x, do=do, f=f) -> None:
            o, _ = f(x)
            o.backward(do)

        ms = _bench(step, 300.0)
        rows = kernel_table(step)
        tot = sum(r[1] for r in rows)
        print(f"\n== {name} fwd+bwd B={B} T={T} H={H}: do_bench {ms:.3f} ms, kernels {tot:.3f} ms", flush=True)
        for k, t, c in rows:
            if t > 0.005:
                print(f"  {t:8.3f} ms  x{c:<4.1f} {k}", flush=True)
        res[name] = dict(ms=ms, kernels_ms=tot, rows=rows)
        del x, do
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(shape=[B, T, H], gpu=torch.cuda.get_device_name(), torch=torch.__version__, **res), fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
