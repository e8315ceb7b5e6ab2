#!/usr/bin/env bash
# GPU benchmark and checks of the AttnRes / RMSNorm / fused-loss kernels (about 3-4 minutes on one H200, most of it
# Triton compiling and autotuning, fla's included). Run from the repository root with $OUT set: results and logs
# land in $OUT/kernels/ (kernels.json, kernels.md, bench.log, tests.log). The benchmark runs first: its numbers are
# the ones the targets are judged by.
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
mkdir -p "$OUT/kernels"
status=0
timeout 180 python -m k3.bench attnres --out "$OUT/kernels" 2>&1 | tee "$OUT/kernels/bench.log" || status=$?
timeout 120 python -m pytest -q -p no:cacheprovider tests/ops/test_kernels_gpu.py tests/ops/test_attnres_fused.py \
    tests/ops/test_norm_fused.py tests/ops/test_loss_fused.py 2>&1 | tee "$OUT/kernels/tests.log" || status=$?
echo
echo "== kernels summary =="
echo "tests: $(tail -n 1 "$OUT/kernels/tests.log")"
if [ -f "$OUT/kernels/kernels.md" ]; then sed -n '/^## AttnRes/,$p' "$OUT/kernels/kernels.md"; fi
exit $status
