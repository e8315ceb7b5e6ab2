#!/usr/bin/env bash
# The decode-sized linear kernels on one GPU: their GPU tests (every prologue in bf16, the model's decode step against
# cuBLAS), then `python -m k3.bench gemv` (JSON + markdown in $OUT/gemv/): `small`'s decode step at batch 1 and 2
# with the kernels and with cuBLAS + the unfused elementwise ops, the fused prologues, and every projection shape at
# 1, 2 and 4 rows. About 2 minutes on an H200. Exits non-zero if a test or the benchmark failed.
# Usage (repo root):  OUT=/path/to/logs bash bench/gpu/gemv.sh
set -euo pipefail
: "${OUT:?set OUT to a folder for the logs and results}"
mkdir -p "$OUT/gemv"
rc=0
timeout 120 python -m pytest -q tests/ops/test_gemv.py > "$OUT/gemv/tests.log" 2>&1 || rc=1
timeout 240 python -m k3.bench gemv --out "$OUT/gemv" > "$OUT/gemv/bench.log" 2>&1 || { tail -30 "$OUT/gemv/bench.log"; rc=1; }
grep -E "passed|failed" "$OUT/gemv/tests.log" | tail -2 || true
sed -n '/^## `small`.s decode/,/^## `small`.s projections/p' "$OUT/gemv/gemv.md" 2>/dev/null || true
exit $rc
