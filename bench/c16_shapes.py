#!/usr/bin/env python3
"""The two inference flows (``FwdConfig.inference_flow`` "c16" / "c64") side by side over batch shapes, to check
the "auto" rule (c16 from ``C16Config.min_programs`` state-pass programs): no-grad ``chunk_kda`` with the K3 flags,
bf16, K = V = 128, splits off; ``do_bench`` medians and the two outputs' relative difference.

    python bench/c16_shapes.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["K3_KDA_SPLITS"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from k3.bench.kda import K3_FLAGS, _inputs  # noqa: E402
from k3.ops.kda import chunk_kda  # noqa: E402
from k3.ops.kda.triton.chunk_fwd import FwdConfig  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402

SHAPES = [(2, 1 << 18, 32, None), (8, 4096, 32, None), (32, 1024, 32, None), (1, 1 << 16, 64, None),
          (4, 1 << 15, 16, None), (1, 1 << 17, 16, None), (1, 1 << 17, 32, 16)]  # (B, T, H, varlen pieces)


def main() -> int:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for B, T, H, pieces in SHAPES:
        x = _inputs(B, T, H)
        cu = None
        if pieces:
            cu = torch.linspace(0, B * T, pieces + 1, device="cuda").long()
        out, ms = {}, {}
        for flow in ("c64", "c16", "auto"):
            with overridden_attrs(FwdConfig, inference_flow=flow), torch.no_grad():
                f = lambda: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],  # noqa: E731
                                      dt_bias=x["dt_bias"], output_final_state=True, cu_seqlens=cu, **K3_FLAGS)
                out[flow] = f()[0].float()
                ms[flow] = triton.testing.do_bench(f, warmup=3, rep=200, return_mode="median")
        d = float((out["c16"] - out["c64"]).norm() / out["c64"].norm())
        name = f"B={B} T={T} H={H}" + (f" varlen×{pieces}" if pieces else "")
        rows.append(f"| {name} | {ms['c64']:.3f} | {ms['c16']:.3f} | {ms['auto']:.3f} | {ms['c64'] / ms['c16']:.2f} | "
                    f"{d:.1e} |")
        print(rows[-1], flush=True)
    print("\n| shape (no grad, bf16) | c64 ms | c16 ms | auto ms | c64/c16 | rel diff |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
