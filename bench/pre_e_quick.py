#!/usr/bin/env python3
"""Quick GPU check of ``FwdConfig.rows_pre_e`` (the rows kernel reads E = e^s from the block pre-pass instead of
recomputing its block's gate): every gradient at B=8 T=4096 H=32 (bf16, the K3 call) against the default, then
the prep of one 1M-token window (H=32) and the whole 1M-token prefill at H=32 and H=8, each with the knob off and
on, in one process. Prints one line per step.  python bench/pre_e_quick.py"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.bench.kda import _inputs, _ours  # noqa: E402
from k3.ops.kda.triton.chunk_fwd import FwdConfig  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def grads(x: dict, do: torch.Tensor) -> list[torch.Tensor]:
    for n in ("q", "k", "v", "g", "beta"):
        x[n].grad = None
    o, h = _ours(x)
    o.backward(do)
    return [o.detach(), h] + [x[n].grad for n in ("q", "k", "v", "g", "beta")]


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=3, rep=60, return_mode="median")


def training() -> bool:
    """Every output and gradient with the knob on vs off, then fwd+bwd time for both."""
    x = _inputs(8, 4096, 32, grad=True)
    do = torch.randn_like(x["v"])
    out = {}
    for e in (False, True):
        FwdConfig.rows_pre_e = e
        out[e] = [t.detach().clone() for t in grads(x, do)]
    errs = [rel(a, b) for a, b in zip(out[True], out[False])]
    ok = all(e < 2e-2 for e in errs) and all(bool(torch.isfinite(t).all()) for t in out[True])
    print("rows_pre_e vs default, o h dq dk dv dg dbeta:", [f"{e:.1e}" for e in errs], "OK" if ok else "FAIL",
          flush=True)
    if ok:
        for e in (False, True):
            FwdConfig.rows_pre_e = e
            print(f"fwd+bwd B=8 T=4096 H=32, rows_pre_e={e}: {ms(lambda: grads(x, do)):.3f} ms", flush=True)
    return ok


def prep_window() -> None:
    """The prep of one 1M-token window at H=32, scaled to the sequence."""
    from k3.bench.kda import _window_1m
    from k3.ops.kda.triton import chunk_fwd as cf

    T, H, flags, x, tab, ncw, bufs, o, ht, args = _window_1m()
    for e in (False, True):
        FwdConfig.rows_pre_e = e
        t = ms(lambda: cf.launch_prep(*args, bufs, tab, 0, ncw, 128**-0.5, -5.0, flags, False))
        print(f"prep per 1M (H=32), rows_pre_e={e}: {t * tab.NC / ncw:.1f} ms", flush=True)


def prefill(H: int) -> None:
    x = _inputs(1, 1 << 20, H)
    with torch.no_grad():
        for e in (False, True):
            FwdConfig.rows_pre_e = e
            print(f"prefill B=1 H={H} T=1M, rows_pre_e={e}: {ms(lambda: _ours(x)):.2f} ms", flush=True)


def main() -> int:
    default = FwdConfig.rows_pre_e
    try:
        if not training():
            return 1
        for step in (prep_window, lambda: prefill(32), lambda: prefill(8)):
            torch.cuda.empty_cache()
            step()
    finally:
        FwdConfig.rows_pre_e = default
    return 0


if __name__ == "__main__":
    sys.exit(main())
