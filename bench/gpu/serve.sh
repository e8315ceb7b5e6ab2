#!/usr/bin/env bash
# Serving on one GPU (issue 36): the KDA first-call memory probe (a fresh process), the serving GPU tests (CUDA-graph
# decode = eager step bitwise, the bf16 conv-update and sampling kernels), then `python -m k3.bench serve` (decode,
# server, prefill; JSON + markdown in $OUT/serve/). About 4 minutes on an H200, compilation included. Exits non-zero
# if a test or the benchmark failed (the benchmark still runs after failed tests). Needs fastapi, uvicorn, httpx.
# Usage (repo root):  OUT=/path/to/logs bash bench/gpu/serve.sh
set -euo pipefail
: "${OUT:?set OUT to a folder for the logs and results}"
mkdir -p "$OUT/serve/probe"
rc=0
t0=$SECONDS
python -m k3.bench serve --sections kdaprobe --out "$OUT/serve/probe" > "$OUT/serve/probe.log" 2>&1 \
  || { tail -20 "$OUT/serve/probe.log"; rc=1; }
t1=$SECONDS
python -m pytest -q tests/infer/test_runner.py tests/infer/test_sampling.py tests/ops/test_conv_update.py \
  tests/ops/test_norm_gate.py tests/serve/test_engine.py::test_engine_on_gpu_with_graphs \
  > "$OUT/serve/tests.log" 2>&1 || rc=1
t2=$SECONDS
python -m k3.bench serve --sections decode,prefill,server --out "$OUT/serve" > "$OUT/serve/bench.log" 2>&1 \
  || { tail -30 "$OUT/serve/bench.log"; rc=1; }
grep -E "passed|failed|error" "$OUT/serve/tests.log" | tail -15
echo "probe $((t1 - t0)) s, tests $((t2 - t1)) s, benchmark $((SECONDS - t2)) s"
sed -n '/^## KDA prefill memory/,$p' "$OUT/serve/probe/serve_bench.md" 2>/dev/null || true
sed -n '/^# Serving benchmark/,$p' "$OUT/serve/bench.log"
exit $rc
