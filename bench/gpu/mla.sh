#!/usr/bin/env bash
# MLA on one GPU: the GPU tests of the MLA ops and layer, then `python -m k3.bench mla` (JSON + markdown in
# $OUT/mla/). About 4 minutes on an H200, kernel compilation and autotuning included. Exits non-zero if a test or
# the benchmark failed (the benchmark still runs after failed tests).
# Usage (repo root):  OUT=/path/to/logs bash bench/gpu/mla.sh
set -euo pipefail
: "${OUT:?set OUT to a folder for the logs and results}"
mkdir -p "$OUT/mla"
rc=0
t0=$SECONDS
python -m pytest -q tests/ops/test_mla.py tests/layers/test_mla.py > "$OUT/mla/tests.log" 2>&1 || rc=1
t1=$SECONDS
# decode and prefill first: FlexAttention's compilation (last in the train section) is the slowest part
python -m k3.bench mla --sections decode,prefill,train --budget-s 120 --out "$OUT/mla" > "$OUT/mla/bench.log" 2>&1 \
  || { tail -30 "$OUT/mla/bench.log"; rc=1; }
grep -E "passed|failed|error" "$OUT/mla/tests.log" | tail -15
echo "tests $((t1 - t0)) s, benchmark $((SECONDS - t1)) s"
sed -n '/^# MLA attention benchmark/,$p' "$OUT/mla/bench.log"
exit $rc
