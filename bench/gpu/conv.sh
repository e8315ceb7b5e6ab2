#!/usr/bin/env bash
# The KDA short convolution on one GPU: its GPU tests (bf16 against the fp64 reference, inductor fullgraph regions,
# the decode update), then `python -m k3.bench conv` (JSON + markdown in $OUT/conv/): the `small` training shape
# (8 × 4096 × 1024, forward and forward+backward, activation memory kept for the backward) and a K3-width prefill
# piece, the fused Triton op against the fp32 F.conv1d reference path. About 1–2 minutes on an H200, autotuning and
# inductor compiles included. Exits non-zero if a test or the benchmark failed (the benchmark still runs after
# failed tests).
# Usage (repo root):  OUT=/path/to/logs bash bench/gpu/conv.sh
set -euo pipefail
: "${OUT:?set OUT to a folder for the logs and results}"
mkdir -p "$OUT/conv"
rc=0
t0=$SECONDS
# one process per test id (every test of the two files: the marker expression selects all), so their Triton
# compiles (autotuning candidates) and inductor compiles overlap
timeout 100 bash bench/gpu_tests_parallel.sh "gpu_quick or not gpu_quick" 12 "$OUT/conv/tests" tests/ops/test_conv_causal.py \
    tests/ops/test_conv_update.py > "$OUT/conv/tests.log" 2>&1 || rc=1
t1=$SECONDS
timeout 90 python -m k3.bench conv --out "$OUT/conv" > "$OUT/conv/bench.log" 2>&1 \
    || { tail -30 "$OUT/conv/bench.log"; rc=1; }
echo
echo "== conv summary (tests $((t1 - t0)) s, benchmark $((SECONDS - t1)) s) =="
echo "tests: $(grep -c '^rc=0 ' "$OUT/conv/tests/summary.txt" 2>/dev/null || true) of \
$(wc -l < "$OUT/conv/tests/ids.txt" 2>/dev/null || true) test ids passed (or skipped: the CPU-only ones)"
grep -v '^rc=0 ' "$OUT/conv/tests/summary.txt" 2>/dev/null || true
if [ -f "$OUT/conv/conv.md" ]; then sed -n '/^## Training/,$p' "$OUT/conv/conv.md"; fi
exit $rc
