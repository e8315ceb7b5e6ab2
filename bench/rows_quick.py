#!/usr/bin/env python3
"""Quick GPU check of the rows prep (FwdConfig.prep_mode = "rows", the default since session 3) against v3: every
chunk buffer on random inputs (bf16, K = V = 128, a ragged last chunk), then one 1M-token window of prep at H = 32
timed for both.
Prints one line per step; stops at the first failure.  python bench/rows_quick.py"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.ops.kda.triton import chunk_fwd as cf  # noqa: E402
from k3.ops.kda.triton._common import make_chunk_table  # noqa: E402

FLAGS = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)


def inputs(T: int, H: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return [r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H, 128), r(1, T, H),
            torch.zeros(H, device="cuda"), torch.zeros(H * 128, device="cuda")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> int:
    a = inputs(1000, 4, 3)
    tab = make_chunk_table(1, 1000, None, a[0].device)
    out = {}
    for mode in ("v3", "rows"):
        cf.FwdConfig.prep_mode = mode
        out[mode] = cf.prep_all(*a, 128 ** -0.5, tab, -5.0, FLAGS)
    torch.cuda.synchronize()
    errs = {k: rel(out["rows"][k], out["v3"][k]) for k in ("AQK", "QG", "TM", "W", "U", "KG", "GAM")}
    ok = all(e < 2e-2 for e in errs.values())
    print("buffers rows vs v3:", {k: f"{e:.1e}" for k, e in errs.items()}, "OK" if ok else "FAIL", flush=True)
    if not ok:
        return 1
    ncw = 4096
    x = inputs(ncw * 64, 32, 1)
    tabw = make_chunk_table(1, ncw * 64, None, x[0].device)
    for mode in ("v3", "rows"):
        cf.FwdConfig.prep_mode = mode
        bufs = cf.alloc_chunk_buffers(32, ncw, 128, 128, torch.bfloat16, "cuda", store_t=False)
        ms = triton.testing.do_bench(lambda: cf.launch_prep(*x, bufs, tabw, 0, ncw, 128 ** -0.5, -5.0, FLAGS, False),
                                     warmup=5, rep=50, return_mode="median")
        print(f"prep {mode}: {ms:.3f} ms per {ncw} chunks × 32 heads → {ms * (1 << 20) / (ncw * 64):.1f} ms per 1M",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
