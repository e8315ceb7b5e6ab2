#!/usr/bin/env bash
# GPU checks and benchmark of the AttnRes / RMSNorm / fused-loss kernels (about 3 minutes on one H200).
# Run from the repository root with $OUT set: logs and results land in $OUT/kernels/.
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
mkdir -p "$OUT/kernels"
status=0
python -m pytest -q -p no:cacheprovider tests/ops/test_kernels_gpu.py tests/ops/test_attnres_fused.py \
    tests/ops/test_norm_fused.py tests/ops/test_loss_fused.py tests/layers/test_attnres.py \
    2>&1 | tee "$OUT/kernels/tests.log" || status=$?
timeout 180 python -m k3.bench attnres --out "$OUT/kernels" 2>&1 | tee "$OUT/kernels/bench.log" || status=$?
echo
echo "== kernels summary (tests exit status: see tests.log; benchmark: kernels.md) =="
tail -n 1 "$OUT/kernels/tests.log"
[ -f "$OUT/kernels/kernels.md" ] && sed -n '/^## AttnRes/,$p' "$OUT/kernels/kernels.md"
exit $status
