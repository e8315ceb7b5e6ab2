#!/usr/bin/env bash
# The README's non-KDA numbers again on one GPU, with the same commands as bench/results/: the MoE and MXFP4 GPU
# tests, `python -m k3.bench moe` (bench/results/moe/) and the released-layout layer (bench/results/released_layer/).
# About 4 minutes on an H200. Exits non-zero if a test or a benchmark failed (later steps still run).
# Usage (repo root):  OUT=/path/to/logs bash bench/gpu/moe.sh
set -euo pipefail
: "${OUT:?set OUT to a folder for the logs and results}"
D="$OUT/moe"
mkdir -p "$D/moe" "$D/released_layer"
rc=0
t0=$SECONDS
timeout 45 python -m pytest -q tests/ops/test_moe_ops.py tests/ops/test_mxfp4.py -k gpu > "$D/tests.log" 2>&1 || rc=1
t1=$SECONDS
# the GEMM-layout section is informational and the slowest: skipped to fit the time; the small-row section is
# bench/gpu/moedecode.sh's
timeout 110 python -m k3.bench moe --skip gemms,small --rep-ms 800 --out "$D/moe" > "$D/moe/bench.log" 2>&1 \
  || { tail -20 "$D/moe/bench.log"; rc=1; }
t2=$SECONDS
K3_KDA_BACKEND=torch timeout 85 python bench/gpu_released_layer.py --out "$D/released_layer" \
  > "$D/released_layer/bench.log" 2>&1 || { tail -20 "$D/released_layer/bench.log"; rc=1; }
grep -E "passed|failed|error" "$D/tests.log" | tail -5 || true
echo "tests $((t1 - t0)) s, moe $((t2 - t1)) s, released layer $((SECONDS - t2)) s"
cat "$D/moe/moe_bench.md" 2>/dev/null || true
grep -E "loaded in|rel err|MoE layer forward" "$D/released_layer/bench.log" || true
exit $rc
