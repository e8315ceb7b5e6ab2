#!/usr/bin/env bash
# GPU benchmark and checks of the AttnRes / RMSNorm / fused-loss kernels, about a minute on one H200. Run from the
# repository root with $OUT set: results and logs land in $OUT/kernels/ (kernels.json and kernels.md, rewritten after
# every row, bench.log, tests.log). Order: the AttnRes rows (ours with and without the output norm, fla, eager), the
# RMSNorm and loss rows, then the essential GPU tests (bf16 numerics of each kernel at the benchmark's shapes, whose
# compiled kernels they reuse, and the device-independent AttnRes checks). A timeout loses only what comes after it.
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
mkdir -p "$OUT/kernels"
status=0
start=$SECONDS
timeout 52 python -m k3.bench attnres --out "$OUT/kernels" 2>&1 | tee "$OUT/kernels/bench.log" || status=$?
left=$((68 - (SECONDS - start)))
if [ "$left" -gt 5 ]; then
    timeout "$left" python -m pytest -q -p no:cacheprovider --durations=0 \
        "tests/ops/test_kernels_gpu.py::test_attn_res_fused[k3-width]" \
        "tests/ops/test_kernels_gpu.py::test_attn_res_fused[k3-width-out-norm]" \
        "tests/ops/test_kernels_gpu.py::test_rms_norm_fused[k3-width]" \
        "tests/ops/test_kernels_gpu.py::test_linear_cross_entropy_fused[small]" \
        tests/ops/test_attnres_fused.py::test_peaked_weights_stay_accurate \
        tests/ops/test_attnres_fused.py::test_zero_query_gives_the_plain_mean \
        2>&1 | tee "$OUT/kernels/tests.log" || status=$?
else
    echo "no time left for the GPU tests" | tee "$OUT/kernels/tests.log"
    status=124
fi
echo
echo "== kernels summary ($((SECONDS - start)) s) =="
echo "tests: $(grep -E '(passed|failed|error)' "$OUT/kernels/tests.log" | tail -n 1)"
if [ -f "$OUT/kernels/kernels.md" ]; then sed -n '/^## AttnRes/,$p' "$OUT/kernels/kernels.md"; fi
exit $status
