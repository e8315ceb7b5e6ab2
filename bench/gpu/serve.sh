#!/usr/bin/env bash
# Serving on one GPU: the CUDA-graph decode = eager step test, the prefill warm-up test and the new kernels' CUDA checks
# (expert rows without a sort, the conv update and norm gate reading column slices), then `python -m k3.bench serve`
# (decode at batch 1/8/64, the server at 1/16/64 streams under two loads, prefill at 32K and 1M for all-KDA and hybrid
# `small`; every unit in its own process, so a fault in one leaves the others' numbers; JSON + markdown in
# $OUT/serve/). About 6 minutes on an H200, compilation included: the benchmark stops itself at its budget. Exits
# non-zero if the test or a unit failed. SECTIONS=decode,server runs those alone (about 4 minutes).
# Needs fastapi, uvicorn (httptools and uvloop when installed), httpx.
# Usage (repo root):  OUT=/path/to/logs bash bench/gpu/serve.sh
set -euo pipefail
: "${OUT:?set OUT to a folder for the logs and results}"
mkdir -p "$OUT/serve"
rc=0
t0=$SECONDS
timeout 150 python -m pytest -q tests/infer/test_runner.py::test_cuda_graph_decode_equals_eager_step_bitwise \
  "tests/infer/test_runner.py::test_warmup_leaves_no_trace[cuda]" \
  tests/ops/test_moe_ops.py::test_expert_rows_fused_equals_the_sort \
  tests/ops/test_conv_update.py::test_triton_kernel_reads_column_slices_of_one_projection \
  tests/ops/test_norm_gate.py::test_kernel_reads_a_gate_sliced_from_a_wider_projection \
  > "$OUT/serve/tests.log" 2>&1 || rc=1
t1=$SECONDS
python -m k3.bench serve --sections "${SECTIONS:-decode,server,prefill}" --budget-s $((480 - t1)) --out "$OUT/serve" > "$OUT/serve/bench.log" 2>&1 \
  || { grep -v "^{" "$OUT/serve/bench.log" | tail -30; rc=1; }
grep -E "passed|failed|error" "$OUT/serve/tests.log" | tail -5 || true
echo "tests $((t1 - t0)) s, benchmark $((SECONDS - t1)) s"
cat "$OUT/serve/serve_bench.md" 2>/dev/null || true
exit $rc
