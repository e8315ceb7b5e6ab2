#!/usr/bin/env bash
# The routed experts' small-row path on one GPU: its tests (tests/ops/test_moe_small.py on CUDA tensors: fp32 and
# bf16 against the references, the layer captured in a CUDA graph and replayed with new routing; the CUDA-graph
# decode = eager step test, whose MoE layers now run it), then `python -m k3.bench moe --only small` (JSON + markdown
# in $OUT/moedecode/): fused kernels vs grouped_mm + SiTU-GLU at `small`'s widths (R = 8 … 2048 rows) and at one
# GPU's share of K3's experts (R = 16, 512), eager and from a CUDA graph. About 2 minutes on an H200, Triton compiles
# and autotuning included. Exits non-zero if a test or the benchmark failed (the benchmark still runs).
# Usage (repo root):  OUT=/path/to/logs bash bench/gpu/moedecode.sh
set -euo pipefail
: "${OUT:?set OUT to a folder for the logs and results}"
D="$OUT/moedecode"
mkdir -p "$D"
rc=0
t0=$SECONDS
timeout 120 python -m pytest -q -rs --durations=6 tests/ops/test_moe_small.py \
  tests/infer/test_runner.py::test_cuda_graph_decode_equals_eager_step_bitwise > "$D/tests.log" 2>&1 || rc=1
t1=$SECONDS
timeout 110 python -m k3.bench moe --only small --rep-ms 800 --out "$D" > "$D/bench.log" 2>&1 \
  || { grep -v "^{" "$D/bench.log" | tail -30; rc=1; }
grep -E "passed|failed|rror" "$D/tests.log" | tail -8 || true
echo "tests $((t1 - t0)) s, benchmark $((SECONDS - t1)) s"
sed -n '/^| case/,/^$/p' "$D/moe_bench.md" 2>/dev/null || true
exit $rc
