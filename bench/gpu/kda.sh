#!/usr/bin/env bash
# GPU run of the KDA kernels' defaults (about 7 minutes on one H200, much of it Triton compiling): the benchmark
# rows the README shows (k3 and fla 0.6.0 in one process: prefill B=1 H=32/8 T=128K/1M with memory, the automatic
# split with the benchmark's gates and with a never-forgetting channel, unsplit; fwd+bwd B=8 T=4096 and B=1 T=32K
# at H=32; decode B=64 H=32 eager and from a CUDA graph), then the GPU tests of the default paths (`gpu_quick`),
# test processes in parallel so their compiles overlap. Run from the repository root with $OUT set; results and logs
# land in $OUT/kda/ (kda_bench.json, kda_bench.md, bench.log, tests/). A summary table is printed last.
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
dir="$OUT/kda"
mkdir -p "$dir"
status=0
# --budget-s skips the sections left once it is spent and still writes kda_bench.json; the timeout is the backstop
timeout 330 python -m k3.bench kda --out "$dir" --sections decode,train,prefill --T 131072 1048576 --H 32 8 \
    --budget-s 200 2>&1 | tee "$dir/bench.log" || status=$?
timeout 110 bash bench/gpu_tests_parallel.sh gpu_quick 12 "$dir/tests" tests/ops/test_kda_train.py \
    tests/ops/test_kda_inference.py tests/ops/test_kda_split.py tests/ops/test_kda_decode.py tests/ops/test_kda_compile.py \
    > "$dir/tests.log" 2>&1 || status=$?
echo
echo "== kda summary =="
echo "gpu_quick tests: $(grep -c '^rc=0 ' "$dir/tests/summary.txt" 2>/dev/null || echo 0) passed," \
     "$(grep -vc '^rc=0 ' "$dir/tests/summary.txt" 2>/dev/null || echo '?') failed (log: $dir/tests/)"
grep -v '^rc=0 ' "$dir/tests/summary.txt" 2>/dev/null || true
python - "$dir/kda_bench.json" <<'EOF' || status=$?
import json, sys
# the published KDA rows (README, bench/results/kda*/README.md): (case, k3 impl) → ms
readme = {("prefill B=1 H=32 T=1048576", "k3 chunk_kda (auto split)"): 37.7,
          ("prefill B=1 H=8 T=1048576", "k3 chunk_kda (auto split)"): 9.52,
          ("prefill B=1 H=8 T=1048576", "k3 unsplit"): 29.27,
          ("prefill B=1 H=8 T=131072", "k3 unsplit"): 4.35,
          ("prefill B=1 H=8 T=1048576", "k3 chunk_kda (auto split), a never-forgetting channel per head"): 12.04,
          ("prefill B=1 H=32 T=131072", "k3 chunk_kda (auto split)"): 4.99,
          ("prefill B=1 H=8 T=131072", "k3 chunk_kda (auto split)"): 1.24,
          ("prefill B=1 H=8 T=131072", "k3 chunk_kda (auto split), a never-forgetting channel per head"): 1.62,
          ("fwd+bwd B=8 T=4096 H=32", "k3 chunk_kda"): 10.53,
          ("fwd+bwd B=1 T=32768 H=32", "k3 chunk_kda"): 11.21,
          ("decode B=64 H=32 fp32 state", "k3 fused_recurrent_kda"): 0.0708,
          ("decode B=64 H=32 fp32 state, CUDA graph", "k3 fused_recurrent_kda"): 0.0713,
          ("decode B=64 H=32 fp32 state", "k3 fused_recurrent_kda (pool, in place)"): 0.0801,
          ("decode B=64 H=32 fp32 state, CUDA graph", "k3 fused_recurrent_kda (pool, in place)"): 0.0805}
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except FileNotFoundError:  # the run was stopped: the rows it streamed to kda_bench.jsonl
    rows = [r for r in map(json.loads, open(sys.argv[1] + "l")) if "case" in r]
fla = {r["case"]: r["ms"] for r in rows if r["impl"].startswith("fla") and "ms" in r}
print("| case | impl | k3 ms | published ms | fla ms | fla/k3 | extra GiB | beyond out GiB |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for r in rows:
    if r["impl"].startswith("fla") or "ms" not in r:
        continue
    f = fla.get(r["case"])
    ms, extra, beyond = r["ms"], r.get("extra_gib"), r.get("beyond_out_gib")
    cells = [r["case"], r["impl"], f"{ms:.4g}", str(readme.get((r["case"], r["impl"]), "")),
             "" if f is None else f"{f:.4g}", "" if f is None else f"{f / ms:.2f}",
             "" if extra is None else f"{extra:.2f}", "" if beyond is None else f"{beyond:.2f}"]
    print("| " + " | ".join(cells) + " |")
for r in rows:
    if "error" in r:
        print(f"ERROR {r['case']} / {r['impl']}: {r['error']}")
EOF
exit $status
