#!/usr/bin/env python3
"""Per-kernel GPU times (torch.profiler) of k3's KDA forward/backward beside fla 0.6.0's, plus a rows-prep check.

    python bench/profile_kernels.py [--no-fla] [--json out.json]

1. check: the rows prep (``FwdConfig.prep_mode = "rows"``) against v3 through ``chunk_kda`` forward+backward
   (bf16, B=2, T=1000, H=4: output, final state, every gradient; relative RMS ≤ 2e-2).
2. profile: every kernel's mean time per call for (a) one inference window of the 1M-token H=32 prefill (k3 v3
   and rows prep), (b) forward+backward B=8 T=4096 H=32 (k3 v3, k3 rows, fla), (c) fla's inference forward at
   B=1 T=131072 H=32 (its kernels scaled ×8 to 1M). A table per case, largest first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from k3.bench.kda import K3_FLAGS, _fla, _fla_module, _inputs, _window_1m  # noqa: E402
from k3.ops.kda import chunk_kda  # noqa: E402
from k3.ops.kda.triton import chunk_fwd as cf  # noqa: E402
from k3.utils import overridden_attrs  # noqa: E402


DEFAULT_MODE = cf.FwdConfig.prep_mode


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def fwd_bwd(x: dict, do: torch.Tensor, impl) -> list[torch.Tensor]:
    for n in ("q", "k", "v", "g", "beta"):
        x[n].grad = None
    o, ht = impl(x)
    (o.float() * do).sum().backward()
    return [o, ht] + [x[n].grad for n in ("q", "k", "v", "g", "beta")]


def ours(x: dict) -> tuple:
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                     output_final_state=True, **K3_FLAGS)


def check_rows() -> dict:
    x = _inputs(2, 1000, 4, grad=True, seed=5)
    do = torch.randn_like(x["v"]).float()
    out = {}
    for mode in ("v3", "rows"):
        cf.FwdConfig.prep_mode = mode
        out[mode] = fwd_bwd(x, do, ours)
    cf.FwdConfig.prep_mode = DEFAULT_MODE
    names = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta")
    errs = {n: rel(a, b) for n, a, b in zip(names, out["rows"], out["v3"])}
    ok = all(e < 2e-2 for e in errs.values())
    print("rows vs v3 fwd+bwd:", {k: f"{e:.1e}" for k, e in errs.items()}, "OK" if ok else "FAIL", flush=True)
    return dict(errs=errs, ok=ok)


def profile(fn, n: int = 5) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile as prof_ctx

    fn()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA":
            us = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)) / n
            if us > 2:
                rows.append((ev.key[:70], us / 1e3, ev.count / n))
    return sorted(rows, key=lambda r: -r[1])


def show(case: str, rows: list, scale: float = 1.0) -> None:
    tot = sum(r[1] for r in rows)
    print(f"\n== {case}: {tot * scale:.2f} ms total (×{scale:g})", flush=True)
    for name, ms, cnt in rows:
        print(f"  {ms * scale:9.3f} ms  x{cnt:<5.1f} {name}", flush=True)


def window_case(label: str, **over) -> dict:
    with overridden_attrs(cf.FwdConfig, **over):
        T, H, flags, x, tab, ncw, bufs, o, ht, args = _window_1m()

        def f() -> None:
            cf.launch_prep(*args, bufs, tab, 0, ncw, 128**-0.5, -5.0, flags, False)
            cf.launch_state(bufs, o, None, ht, tab, 0, ncw, H, 128, 128)

        rows = profile(f)
    show(f"1M H=32 window prep+state, {label}", rows, tab.NC / ncw)
    return dict(rows=rows, scale=tab.NC / ncw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    res: dict = {"check_rows": check_rows()}
    with_fla = not a.no_fla and _fla_module() is not None
    # (a) one inference window at 1M, H=32
    cases = {"rows (default)": dict(), "rows, folded output (3 products per state step)": dict(fold_output=True),
             "rows, 4-warp block pre-pass": dict(blocks_warps=4),
             "rows, solve stages 2": dict(solve_stages=2)}
    if os.environ.get("K3_PROFILE_ALL") == "1":  # the comparisons of session 3's first run
        cases.update({"prep v3": dict(prep_mode="v3"), "rows, no block pre-pass": dict(rows_pre=False),
                      "rows, uncapped rows kernel": dict(rows_maxnreg=None),
                      "rows, 8-warp solve": dict(solve_warps=8, solve_maxnreg=None)})
    for label, over in cases.items():
        try:
            res[f"window {label}"] = window_case(label, **over)
        except Exception as e:  # noqa: BLE001
            print(f"{label}: {e!r}"[:300], flush=True)
        torch.cuda.empty_cache()
    cf.FwdConfig.prep_mode = DEFAULT_MODE
    # (b) training shape
    x = _inputs(8, 4096, 32, grad=True)
    do = torch.randn_like(x["v"]).float()
    impls = [("k3 rows", ours, "rows")] + ([("fla", _fla, None)] if with_fla else [])
    for name, impl, mode in impls:
        if mode:
            cf.FwdConfig.prep_mode = mode
        try:
            rows = profile(lambda: fwd_bwd(x, do, impl))
            show(f"fwd+bwd B=8 T=4096 H=32, {name}", rows)
            res[f"train_{name}"] = rows
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {e!r}"[:300], flush=True)
    cf.FwdConfig.prep_mode = DEFAULT_MODE
    del x
    torch.cuda.empty_cache()
    # (c) fla's inference forward at 128K
    if with_fla:
        x = _inputs(1, 131072, 32)
        with torch.inference_mode():
            rows = profile(lambda: _fla(x), n=3)
        show("fla inference B=1 T=128K H=32 (×8 → 1M)", rows, 8.0)
        res["fla_infer_128k"] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["check_rows"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
