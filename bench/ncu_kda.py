#!/usr/bin/env python3
"""Driver for Nsight Compute: one profiled call of each KDA kernel group after a warm-up (compiles outside the
profiled range). Run it under ncu on a GPU machine whose runtime exposes the counters, e.g.

    ncu --clock-control none --profile-from-start off --set full --import-source yes \\
        --kernel-name regex:"_prep_|_kda_fwd_state|_kda_bwd_wy|_kda_bwd_intra|_kda_dec" \\
        --export $OUT/kda --force-overwrite python bench/ncu_kda.py [--case prefill|train|decode]

Cases: ``prefill`` — the inference forward (rows prep + state pass) at B=1, H=32, T=64K (one window; the kernels'
per-chunk behaviour is the same as at 1M); ``prefill16`` — the same call through the 16-token flow (``chunk16``,
``bench/ncu_c16.sh``); ``split8`` — the split prefill at B=1, H=8, T=128K, 8 segments; ``train`` — forward +
backward at B=8, T=4096, H=32; ``decode`` — one step at B=64, H=32.
Without ncu it just runs them (a smoke test of the driver).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from k3.bench.kda import K3_FLAGS, _inputs  # noqa: E402
from k3.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: E402


def prefill() -> None:
    x = _inputs(1, 1 << 16, 32)
    with torch.inference_mode():
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  output_final_state=True, **K3_FLAGS)


def prefill16() -> None:
    """The 16-token inference flow (``chunk16``: ``_c16_prep``, ``_c16_state``) on the same call."""
    from k3.ops.kda.triton.chunk_fwd import FwdConfig
    from k3.utils import overridden_attrs

    with overridden_attrs(FwdConfig, inference_flow="c16"):
        prefill()


def split8() -> None:
    """The split prefill at B=1, H=8, T=128K forced into 8 segments (one window: the per-token bytes of the 1M call's
    data flow, ``bench/split_bytes.sh``)."""
    os.environ["K3_KDA_SPLITS"] = "8"
    x = _inputs(1, 1 << 17, 8)
    with torch.inference_mode():
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                  output_final_state=True, **K3_FLAGS)


def train() -> None:
    x = _inputs(8, 4096, 32, grad=True)
    o, ht = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                      output_final_state=True, **K3_FLAGS)
    (o.float().sum() + ht.sum()).backward()


def decode() -> None:
    x = _inputs(64, 1, 32)
    s0 = torch.randn(64, 32, 128, 128, device="cuda")
    with torch.inference_mode():
        fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                            initial_state=s0, output_final_state=True, **K3_FLAGS)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=("prefill", "prefill16", "split8", "train", "decode", "all"), default="all")
    ap.add_argument("--c16-mode", type=int, default=None, help="C16Config.mode for prefill16 (default: the library's)")
    a = ap.parse_args()
    if a.c16_mode is not None:
        from k3.ops.kda.triton.chunk16 import C16Config

        C16Config.mode = a.c16_mode
    cases = {"prefill": prefill, "prefill16": prefill16, "split8": split8, "train": train, "decode": decode}
    run = [c for c in cases if c not in ("prefill16", "split8")] if a.case == "all" else [a.case]
    for name in run:
        cases[name]()  # warm-up: compile and autotune outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name in run:
        cases[name]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(run), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
