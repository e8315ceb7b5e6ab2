"""Which (K, V, dtype, grad, flags) KDA calls fail on the GPU: each case in its own process (an illegal address
poisons the CUDA context), CUDA_LAUNCH_BLOCKING=1 so the failing kernel is the one named."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

CASE = r'''
import sys, torch
sys.path.insert(0, "tests/ops")
import test_kda_triton as t
import os
from k3.ops.kda.triton import chunk_fwd
for kv in filter(None, os.environ.get("KNOBS", "").split(";")):  # e.g. "FwdConfig.rows_kg=False"
    name, val = kv.split("=")
    cls, attr = name.split(".")
    setattr(getattr(chunk_fwd, cls), attr, eval(val))
K, V, dt, grad, gate = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
cu = [0, 5, 70, 71, 200]
x = t.make_inputs(1, 200, 2, K, V, N=4, gate=gate)
lb = -5.0 if gate else None
if grad:
    e = t.errors_against_reference(x, dt, gate=gate, lb=lb, cu=cu)
else:
    o, ht, *_ = t.run_chunk(x, dt, gate=gate, lb=lb, cu=cu, grad=False)
    ro, rh = t.reference(x, K ** -0.5, True, gate, True, lb, cu)
    e = {"o": t.rel(o, ro), "ht": t.rel(ht, rh)}
torch.cuda.synchronize()
print("max err %.2e" % max(e.values()))
'''


def knobs() -> None:
    """The failing case (K=16, V=128, bf16, training) under one FwdConfig change at a time."""
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    variants = ["", "FwdConfig.rows_kg=False", "FwdConfig.rows_pre=False", "FwdConfig.rows_stack=False",
                "FwdConfig.prep_mode='v3'", "FwdConfig.solve_bkw=16", "FwdConfig.prep_ab_bf16=False",
                "FwdConfig.solve_inverse='pow'", "FwdConfig.solve_stages=2", "FwdConfig.rows_prefetch=False",
                "FwdConfig.prep_fast_gate=False", "FwdConfig.rows_pre_e=False"]
    for var in variants:
        for dt in ("bfloat16", "float16"):
            r = subprocess.run([sys.executable, "-c", CASE, "16", "128", dt, "1", "1"], capture_output=True, text=True,
                               env=dict(env, KNOBS=var), timeout=120)
            tail = (r.stdout + r.stderr).strip().splitlines()
            print(f"{var or 'default':34s} {dt:8s} rc={r.returncode} {tail[-1][:150] if tail else ''}", flush=True)


def sanitize() -> None:
    """The failing case under compute-sanitizer's memcheck: the kernel and the address it faults on."""
    r = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--print-limit", "3", sys.executable, "-c", CASE,
                        "16", "128", "bfloat16", "1", "1"], capture_output=True, text=True, timeout=300)
    lines = (r.stdout + r.stderr).splitlines()
    print("\n".join(lines[:60]))


def main() -> None:
    if sys.argv[1:] == ["knobs"]:
        return knobs()
    if sys.argv[1:] == ["sanitize"]:
        return sanitize()
    dims = [tuple(int(n) for n in d.split("x")) for d in (sys.argv[1:] or ["16x128", "16x16", "16x64", "32x128", "64x16", "128x16", "128x32", "8x8", "24x128"])]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for (K, V), dt, grad, gate in itertools.product(dims, ["bfloat16", "float32"], ["1", "0"], ["1"]):
        r = subprocess.run([sys.executable, "-c", CASE, str(K), str(V), dt, grad, gate], capture_output=True,
                           text=True, env=env, timeout=120)
        tail = (r.stdout + r.stderr).strip().splitlines()
        msg = tail[-1] if r.returncode == 0 else " | ".join(l.strip() for l in tail if "File" in l and "k3/" in l)[-400:]
        print(f"K={K:3d} V={V:3d} {dt:8s} grad={grad} gate={gate} rc={r.returncode} {msg}", flush=True)


if __name__ == "__main__":
    main()
