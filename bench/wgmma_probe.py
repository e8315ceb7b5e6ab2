#!/usr/bin/env python3
"""How long one warpgroup's wgmma products take on this GPU, alone and with a second warpgroup beside it — the
question behind the serial passes' step (``chunk16._c16_state``: per 16 tokens and 64 value columns a [64, 128] ×
[128, 32] product, a [64, 32] × [32, 32] identity product and a [64, 16] × [16, 128] update, each waited on).

One program per SM (grid = SM count), ``ITERS`` times: ``INDEP`` products issued back to back into the accumulator,
then a wait — with INDEP = 1 the latency of one waited product (the serial passes' case), with 4 the pipe's
throughput (the hardware pipelines products into the same accumulator). W = 4 warps (one warpgroup) or 8 (two
warpgroups, each its own chain on the same SM). A from registers (bf16), B from shared memory, fp32 accumulators;
MAC per cycle assumes the 1.98 GHz maximum SM clock.

    python bench/wgmma_probe.py [--iters 4000]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _chain(out, ITERS: gl.constexpr, N: gl.constexpr, K: gl.constexpr, W: gl.constexpr, INDEP: gl.constexpr):
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, N, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L, k_width=2)
    LB: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    SB: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, N], gl.bfloat16)
    M: gl.constexpr = 16 * W
    o_r = gl.arange(0, K, layout=gl.SliceLayout(1, LB))
    o_c = gl.arange(0, N, layout=gl.SliceLayout(0, LB))
    b = gl.allocate_shared_memory(gl.bfloat16, [K, N], SB, ((o_r[:, None] + o_c[None, :]) % 3 - 1).to(gl.bfloat16)
                                  * 0.001)
    o_m = gl.arange(0, M, layout=gl.SliceLayout(1, A))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, A))
    a = ((o_m[:, None] * 7 + o_k[None, :]) % 5 - 2).to(gl.bfloat16) * 0.01
    acc = gl.zeros([M, N], gl.float32, L)
    for _ in range(ITERS):
        for _i in gl.static_range(INDEP):
            acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
    o_mo = gl.arange(0, M, layout=gl.SliceLayout(1, L))
    o_n = gl.arange(0, N, layout=gl.SliceLayout(0, L))
    gl.store(out + gl.program_id(0) * (M * N) + o_mo[:, None] * N + o_n[None, :], acc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=4000)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = ["| product [M per warpgroup = 64] | K | N | warps | products per wait | ns per wait (one SM) | ns per product | "
            "MAC per cycle per SM at 1.98 GHz |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for K, N in ((128, 32), (128, 16), (32, 32), (16, 128), (128, 64), (128, 128)):
        for W in (4, 8):
            for indep in (1, 4):
                out = torch.empty(sms, 16 * W, N, device="cuda")
                fn = lambda: _chain[(sms,)](out, a.iters, N, K, W, indep, num_warps=W)  # noqa: E731
                fn()
                ms = triton.testing.do_bench(fn, warmup=3, rep=100, return_mode="median")
                ns = ms * 1e6 / a.iters
                mac = 16 * W * N * K * indep / (ns * 1.98)
                rows.append(f"| [{16 * W}, {K}] × [{K}, {N}] | {K} | {N} | {W} | {indep} | {ns:.1f} | "
                            f"{ns / indep:.1f} | {mac:.0f} |")
                print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
