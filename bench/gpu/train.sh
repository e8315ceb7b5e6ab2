#!/usr/bin/env bash
# GPU checks of the training step and its benchmark on one H200 (about 4 minutes).
# Run from the repository root with $OUT set: logs and results land in $OUT/train/.
#   1. tests/train/test_train_gpu.py: the 1-rank FSDP2 step vs the autocast reference, the MoE layer under inductor
#      in one graph, DCP resume on CUDA (compiled vs eager training is compared by the benchmark's paths below)
#   2. python -m k3.bench train --preset small --seq-len 4096 --batch-size 8: fast (compiled, one CUDA graph, AdamW as
#      the baseline), fast-eager, fast-muon, fast-nocompile, bf16copy, reference; the fast path profiled
#   3. python -m k3.bench train --slice k3 --seq-len 4096 --batch-size 4 --optimizer muon (16 K tokens; 7.0 B
#      parameters: AdamW's fp32 master, gradient and two moments alone are 104 GiB): fast, reference
# The loss curve (200 steps of fast vs reference) is bench/gpu/train_curve.sh.
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
mkdir -p "$OUT/train"
status=0
timeout 120 python -m pytest -q -p no:cacheprovider tests/train/test_train_gpu.py tests/train/test_graph_gpu.py \
    -k "not compiled_sublayers" \
    2>&1 | tee "$OUT/train/tests.log" || status=$?
timeout 160 python -m k3.bench train --preset small --seq-len 4096 --batch-size 8 \
    --paths fast,fast-eager,fast-muon,fast-nocompile,bf16copy,reference --out "$OUT/train" 2>&1 \
    | tee "$OUT/train/bench_small.log" || status=$?
timeout 60 python -m k3.bench train --slice k3 --seq-len 4096 --batch-size 4 --warmup 2 --steps 4 --optimizer muon \
    --paths fast,reference --no-profile --out "$OUT/train" 2>&1 | tee "$OUT/train/bench_slice.log" || status=$?
echo
echo "== scale summary =="
tail -n 1 "$OUT/train/tests.log" || true
for f in train train_slice; do
    [ -f "$OUT/train/$f.md" ] && sed -n '/^| path/,/^$/p' "$OUT/train/$f.md"
done
exit $status
