#!/usr/bin/env python3
"""What would an L2-resident hand-off between the 16-token prep and the state pass buy? (NOTES_kda.md, next steps
after v17.) Before building the synchronisation, time each kernel over a 1M-token sequence with its window buffers
replaced by a ring of R chunks (``C16Config.probe_ring``: the prep's stores and the state pass's loads wrap, so the
hand-off's bytes stay in L2 once R chunks fit there; the outputs are garbage, the timing is the point): the prep
alone, the state pass alone, and both at once on two streams (the state pass on a high-priority stream, as the
prefill runs them) — against the same with full-length buffers (every byte through DRAM). A large R is the control.

    python bench/l2_probe.py [--H 32 8] [--rings 4 8 16 64] [--rounds 2] [--kinds prep state both prep_ring]

A ring of R chunks also sets the distance between the heads' regions of the buffers ([H, R, …]), so rings larger
than L2 time the prep's stores at other address strides (a 1 GiB window at H=32 is ~390 chunks).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.c16_quick import one_window  # noqa: E402
from k3.ops.kda.triton import chunk16 as c16  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402


def kernels(H: int, bufs: dict, ring: int, x: dict, tab, flags: dict, o: torch.Tensor, ht: torch.Tensor,
            full: dict) -> dict[str, Callable[[], None]]:
    """The prep, the state pass and both together over the whole sequence, on ``bufs`` wrapped at ``ring`` chunks;
    ``prep_ring``: the prep on the ring beside the state pass on the ``full`` buffers (its reads unwrapped: the
    prep's gain from a small store footprint without the ring's per-step arithmetic in the state pass)."""
    def prep() -> None:
        with overridden_attrs(c16.C16Config, probe_ring=ring):
            c16.launch_c16_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A"], x["dt"], bufs, tab, 0, tab.NC,
                                128 ** -0.5, -5.0, flags)

    def state() -> None:
        with overridden_attrs(c16.C16Config, probe_ring=ring):
            c16.launch_c16_state(bufs, x["v"], o, ht, tab, 0, tab.NC, H, 128, 128)

    hi = torch.cuda.Stream(priority=-1)
    side = torch.cuda.Stream()

    def corun(serial: Callable[[], None], other: Callable[[], None]) -> None:
        """``serial`` on the high-priority stream beside ``other`` on a side stream; the current stream waits."""
        cur = torch.cuda.current_stream()
        hi.wait_stream(cur)
        side.wait_stream(cur)
        with torch.cuda.stream(hi):
            serial()
        with torch.cuda.stream(side):
            other()
        cur.wait_stream(hi)
        cur.wait_stream(side)

    def state_full() -> None:
        c16.launch_c16_state(full, x["v"], o, ht, tab, 0, tab.NC, H, 128, 128)

    return {"prep": prep, "state": state, "both": lambda: corun(state, prep),
            "prep_ring": lambda: corun(state_full, prep)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--H", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--rings", type=int, nargs="+", default=[4, 8, 16, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--T", type=int, default=1 << 20)
    ap.add_argument("--kinds", nargs="+", default=["prep", "state", "both"],
                    choices=["prep", "state", "both", "prep_ring"])
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    rows = []
    for H in a.H:
        x, tab, flags, o, ht = one_window(T=a.T, H=H)
        sets = {"full": (c16.alloc_c16_buffers(H, tab.NC, 128, 128, torch.bfloat16, x["q"].device), 0)}
        for r in a.rings:
            sets[f"R={r}"] = (c16.alloc_c16_buffers(H, r, 128, 128, torch.bfloat16, x["q"].device), r)
        mb = {n: c16.c16_chunk_bytes(H, 128, 128, torch.bfloat16) * (r or tab.NC) / 2 ** 20 for n, (_, r) in sets.items()}
        fns = {n: kernels(H, b, r, x, tab, flags, o, ht, sets["full"][0]) for n, (b, r) in sets.items()}
        for n in fns:
            fns[n]["prep"]()  # compile, and fill the buffers the state pass reads
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(a.rounds):
            for kind in a.kinds:
                for n, f in fns.items():
                    t = triton.testing.do_bench(f[kind], warmup=2, rep=300, return_mode="median")
                    times.setdefault((kind, n), []).append(t)
                    print(f"H={H} {kind} {n} ({mb[n]:.0f} MiB): {t:.2f} ms", flush=True)
        for kind in a.kinds:
            rows.append(f"| {H} | {kind} | " + " | ".join(" / ".join(f"{t:.2f}" for t in times[(kind, n)])
                                                         for n in fns) + " |")
        head = "| H | kernel | " + " | ".join(f"{n} ({mb[n]:.0f} MiB)" for n in fns) + " |"
        rows.insert(len(rows) - len(a.kinds), head + "\n|---|---|" + "---:|" * len(fns))
        del sets, fns, x, o, ht
        torch.cuda.empty_cache()
    print(f"\nT={a.T}, ms per call (do_bench medians, each round):")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
