#!/usr/bin/env python3
"""Every gradient's error against the fp64 recurrence for backward-knob variants, on the extreme inputs of the GPU
tests (bf16, K = V = 128): the margins behind a knob change, printed as one table (worst gradient per case).

    python bench/bwd_variant_errors.py --variant bf16x3 BwdConfig.intra_prec_half=bf16x3 \\
        --variant bf16 BwdConfig.intra_prec_half=bf16
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.knob_ab import applied, parse  # noqa: E402
from tests.ops.test_kda_triton import errors_against_reference, make_inputs  # noqa: E402

CASES = {  # name → (make_inputs kwargs, reference kwargs, cu_seqlens)
    "random": (dict(), dict(), None),
    "gates_at_bound": (dict(gate=False, g_override=-5.0), dict(gate=False), None),
    "beta1_repeated_keys": (dict(beta_logit=12.0, repeat_keys=True), dict(), None),
    "beta0": (dict(beta_logit=-12.0), dict(), None),
    "varlen": (dict(N=5), dict(), [0, 1, 100, 100, 613, 1000]),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "KNOB"))
    a = ap.parse_args()
    variants = [("default", {})] + [(v[0], parse(v[1:])) for v in a.variant]
    rows = []
    for name, knobs in variants:
        cells = []
        for case, (kw, rkw, cu) in CASES.items():
            x = make_inputs(1, 1000 if cu else 300, 4 if cu else 2, 128, 128, **kw)
            with applied(knobs):
                errs = errors_against_reference(x, torch.bfloat16, cu=cu, **rkw)
            worst = max(errs, key=lambda n: errs[n] if errs[n] == errs[n] else float("inf"))
            cells.append(f"{errs[worst]:.1e} ({worst}, dg {errs['dg']:.1e})")
            print(name, case, {n: f"{e:.1e}" for n, e in errs.items()}, flush=True)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n| variant | " + " | ".join(CASES) + " |\n|---|" + "---|" * len(CASES))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
