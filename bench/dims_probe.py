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


def main() -> None:
    dims = [tuple(int(n) for n in d.split("x")) for d in (sys.argv[1:] or ["16x128", "16x16", "16x64", "32x128"])]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for (K, V), dt, grad, gate in itertools.product(dims, ["bfloat16", "float32"], ["1", "0"], ["1"]):
        r = subprocess.run([sys.executable, "-c", CASE, str(K), str(V), dt, grad, gate], capture_output=True,
                           text=True, env=env, timeout=120)
        tail = (r.stdout + r.stderr).strip().splitlines()
        msg = tail[-1] if r.returncode == 0 else " | ".join(l.strip() for l in tail if "File" in l and "k3/" in l)[-400:]
        print(f"K={K:3d} V={V:3d} {dt:8s} grad={grad} gate={gate} rc={r.returncode} {msg}", flush=True)


if __name__ == "__main__":
    main()
