#!/usr/bin/env bash
# GPU checks of the training step and its benchmark on one H200 (about 8 minutes).
# Run from the repository root with $OUT set: logs and results land in $OUT/train/.
#   1. tests/train/test_train_gpu.py, test_graph_gpu.py, tests/ops/test_optim_adamw.py: the one-GPU step (bf16
#      parameters, fp32 masters) vs the autocast reference, the MoE layer under inductor in one graph, DCP resume on
#      CUDA, replayed vs eager steps, the master-weight AdamW kernel in bf16
#   2. python -m k3.bench train --preset small --seq-len 4096 --batch-size 8: fast (compiled, one CUDA graph, AdamW as
#      the baseline), fast-eager, fast-muon, fast-nocompile, reference; the fast path profiled
#   3. python -m k3.bench train --slice k3 --seq-len 4096 --batch-size 4 --optimizer muon (16 K tokens; 7.0 B
#      parameters: with AdamW the fp32 master and moments and the bf16 weights and gradients are 104 GiB): fast
#   4. bench/gpu/train_memory.py: where the step's peak memory falls
# The loss curve (200 steps of fast vs reference) is bench/gpu/train_curve.sh.
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
mkdir -p "$OUT/train"
status=0
timeout 180 python -m pytest -q -p no:cacheprovider tests/train/test_train_gpu.py tests/train/test_graph_gpu.py \
    tests/ops/test_optim_adamw.py -k "not compiled_sublayers" \
    2>&1 | tee "$OUT/train/tests.log" || status=$?
timeout 420 python -m k3.bench train --preset small --seq-len 4096 --batch-size 8 \
    --paths fast,fast-eager,fast-muon,fast-nocompile,reference --out "$OUT/train" 2>&1 \
    | tee "$OUT/train/bench_small.log" || status=$?
timeout 200 python -m k3.bench train --slice k3 --seq-len 4096 --batch-size 4 --warmup 2 --steps 4 --optimizer muon \
    --paths fast --no-profile --out "$OUT/train" 2>&1 | tee "$OUT/train/bench_slice.log" || status=$?
PYTHONPATH=. timeout 200 python bench/gpu/train_memory.py 2>&1 | tee "$OUT/train/memory.log" || status=$?
echo
echo "== scale summary =="
tail -n 1 "$OUT/train/tests.log" || true
for f in train train_slice; do
    [ -f "$OUT/train/$f.md" ] && sed -n '/^| path/,/^$/p' "$OUT/train/$f.md"
done
exit $status
