#!/usr/bin/env bash
# DRAM bytes of the split prefill's kernels (B=1 H=8 T=128K, 8 segments, one window), per kernel name, from Nsight
# Compute's counters: what the data flow moves per token and head (NOTES_kda.md v25). On the GPU machine, from the
# repository root:  OUT=/some/dir bash bench/split_bytes.sh
set -euo pipefail
R=$OUT/split8_bytes
ncu --clock-control none --profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
    --csv --page raw python bench/ncu_kda.py --case split8 > $R.csv 2> $R.log || { tail -20 $R.log; exit 1; }
python - "$R.csv" <<'PY'
import csv, sys
from collections import defaultdict
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head = rows[0]
ki, mi = head.index("Kernel Name"), {m: head.index(m) for m in ("dram__bytes_read.sum", "dram__bytes_write.sum",
                                                                 "gpu__time_duration.sum")}
units = rows[1]
tot = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-6, "us": 1e-3, "ms": 1, "nsecond": 1e-6,
         "usecond": 1e-3, "msecond": 1}  # to bytes and ms
for r in rows[2:]:
    t = tot[r[ki].split("(")[0][:40]]
    for j, m in enumerate(("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")):
        t[j] += float(r[mi[m]].replace(",", "")) * scale.get(units[mi[m]], float("nan"))
    t[3] += 1
tok_heads = (1 << 17) * 8
print("(the at:: kernels make the inputs; ncu runs every kernel alone, caches flushed)")
print(f"{'kernel':40s} {'n':>3s} {'read GB':>8s} {'write GB':>8s} {'B/tok-head':>10s} {'ms (serial)':>11s}")
R = W = 0.0
for k, (rd, wr, ms, n) in sorted(tot.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
    R, W = R + rd, W + wr
    print(f"{k:40s} {n:3d} {rd / 1e9:8.3f} {wr / 1e9:8.3f} {(rd + wr) / tok_heads:10.0f} {ms:11.3f}")
print(f"{'total':40s} {'':3s} {R / 1e9:8.3f} {W / 1e9:8.3f} {(R + W) / tok_heads:10.0f}")
kda = [v for k, v in tot.items() if not k.startswith("void at::")]
r, w, ms = (sum(v[j] for v in kda) for j in range(3))
print(f"{'the call (kernels not at::)':40s} {'':3s} {r / 1e9:8.3f} {w / 1e9:8.3f} {(r + w) / tok_heads:10.0f} {ms:11.3f}")
PY
