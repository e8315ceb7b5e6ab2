#!/usr/bin/env bash
# MLA on one GPU: the GPU tests of the MLA ops and layer, then `python -m k3.bench mla` (JSON + markdown in
# $OUT/mla/): prefill (one `small` layer, 128K and 1M tokens), training attention (K3 dims, T = 8192, 96 heads:
# ours vs the former fp32 SDPA path vs SDPA's bf16 backends), decode (`small` and K3 dims, batch 1/64, cache
# 4K/128K). Each benchmark section runs in its own process, so a fault in one leaves the others' rows.
# About 3 minutes on an H200, kernel compilation and autotuning included. Exits non-zero if a test or the
# benchmark failed (the benchmark still runs after failed tests).
# Usage (repo root):  OUT=/path/to/logs bash bench/gpu/mla.sh
set -euo pipefail
: "${OUT:?set OUT to a folder for the logs and results}"
mkdir -p "$OUT/mla"
rc=0
t0=$SECONDS
python -m pytest -q -rs --durations=8 tests/ops/test_mla.py tests/layers/test_mla.py > "$OUT/mla/tests.log" 2>&1 \
  || rc=1
t1=$SECONDS
python -m k3.bench mla --budget-s 110 --out "$OUT/mla" > "$OUT/mla/bench.log" 2>&1 \
  || { tail -30 "$OUT/mla/bench.log"; rc=1; }
grep -E "passed|failed|rror" "$OUT/mla/tests.log" | tail -15
echo "tests $((t1 - t0)) s, benchmark $((SECONDS - t1)) s"
sed -n '/^# MLA attention benchmark/,$p' "$OUT/mla/bench.log"
exit $rc
