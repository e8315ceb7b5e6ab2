#!/usr/bin/env python3
"""Quick GPU check of ``BwdConfig.wy_split`` (the WY backward as two launches) against the fused kernel: every
gradient at B=8 T=4096 H=32 (bf16, the K3 call), then forward+backward timed for both; then the block pre-pass at
1/2/4 blocks per program, and prep + state pass with and without the folded output, on one prefill window.
Prints one line per step.  python bench/wy_split_quick.py"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from k3.bench.kda import K3_FLAGS, _inputs  # noqa: E402
from k3.ops.kda import chunk_kda  # noqa: E402
from k3.ops.kda.triton.chunk_bwd import BwdConfig  # noqa: E402
from k3.ops.kda.triton.chunk_fwd import FwdConfig  # noqa: E402


def fwd_bwd(x: dict, do: torch.Tensor) -> list[torch.Tensor]:
    for n in ("q", "k", "v", "g", "beta"):
        x[n].grad = None
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                     output_final_state=True, **K3_FLAGS)
    o.backward(do)
    return [x[n].grad for n in ("q", "k", "v", "g", "beta")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main() -> int:
    x = _inputs(8, 4096, 32, grad=True)
    do = torch.randn_like(x["v"])
    out, ms = {}, {}
    for split in (False, True):
        BwdConfig.wy_split = split
        out[split] = [t.clone() for t in fwd_bwd(x, do)]
        torch.cuda.synchronize()
    errs = [rel(a, b) for a, b in zip(out[True], out[False])]
    ok = all(e < 2e-2 for e in errs)
    print("wy_split vs fused, dq dk dv dg dbeta:", [f"{e:.1e}" for e in errs], "OK" if ok else "FAIL", flush=True)
    if not ok:
        return 1
    for split in (False, True):
        BwdConfig.wy_split = split
        ms[split] = triton.testing.do_bench(lambda: fwd_bwd(x, do), warmup=5, rep=100, return_mode="median")
        print(f"fwd+bwd B=8 T=4096 H=32, wy_split={split}: {ms[split]:.3f} ms", flush=True)
    BwdConfig.wy_split = False
    del x, do, out
    torch.cuda.empty_cache()
    from k3.bench.kda import _window_1m
    from k3.ops.kda.triton import chunk_fwd as cf

    T, H, flags, x, tab, ncw, bufs, o, ht, args = _window_1m()
    for per in (1, 2, 4):
        FwdConfig.blocks_per_program = per
        t = triton.testing.do_bench(lambda: cf.launch_prep(*args, bufs, tab, 0, ncw, 128**-0.5, -5.0, flags, False),
                                    warmup=3, rep=50, return_mode="median")
        print(f"prep per 1M (H=32), pre-pass {per} block(s) per program: {t * tab.NC / ncw:.1f} ms", flush=True)
    FwdConfig.blocks_per_program = 1
    for fold in (False, True):  # prep + state pass of the window, unfolded vs folded output
        FwdConfig.fold_output = fold
        bw = cf.alloc_chunk_buffers(H, ncw, 128, 128, torch.bfloat16, "cuda", store_t=False)

        def window(bw=bw) -> None:
            cf.launch_prep(*args, bw, tab, 0, ncw, 128**-0.5, -5.0, flags, False)
            cf.launch_state(bw, o, None, ht, tab, 0, ncw, H, 128, 128)

        t = triton.testing.do_bench(window, warmup=3, rep=50, return_mode="median")
        print(f"prep + state per 1M (H=32), fold_output={fold}: {t * tab.NC / ncw:.1f} ms", flush=True)
        del bw
    FwdConfig.fold_output = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
