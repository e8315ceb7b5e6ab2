#!/usr/bin/env bash
# one-H200 checks of expert parallel, context parallel and the expert-sharded release (about 4 minutes).
# Run from the repository root with $OUT set: logs and results land in $OUT/parallel/.
#   1. the gloo tests (CPU tensors) under the device's torch: EP layer 2/4 ranks, whole-model CP 2
#   2. bench/multi_gpu/moe_ep.py on 1 rank: the Latent MoE at K3 widths (896 experts, 8192 tokens), the one-GPU
#      layer (the baseline of the multi-GPU measurement) vs the EP path over a 1-rank NCCL group; exactness on CUDA; host syncs / forward
#   3. bench/multi_gpu/cp_long.py on 1 rank: small at 262,144 tokens fwd+bwd (the one-GPU time CP is measured against)
#   4. bench/multi_gpu/generate_sharded.py: a 2-layer K3-width MXFP4 checkpoint (vocab 32K) written, loaded,
#      decoded (1 rank)
#   5. k3 plan beside these measurements
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
R=$OUT/parallel
mkdir -p "$R"
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
trun() { python -m torch.distributed.run --standalone --nproc_per_node 1 "$@"; }
status=0
timeout 45 python -m pytest -q -p no:cacheprovider tests/distributed/test_ep.py tests/distributed/test_cp.py \
    2>&1 | tee "$R/tests.log" || status=$?
timeout 70 trun bench/multi_gpu/moe_ep.py --out "$R" --iters 3 2>&1 | tee "$R/moe_ep.log" || status=$?
timeout 45 trun bench/multi_gpu/cp_long.py --out "$R" --iters 2 2>&1 | tee "$R/cp_long.log" || status=$?
timeout 90 bash -c "python bench/multi_gpu/generate_sharded.py make --layers 2 --vocab 32768 --out '$R/k3_mini' && \
    python -m torch.distributed.run --standalone --nproc_per_node 1 bench/multi_gpu/generate_sharded.py run \
    --model '$R/k3_mini' --out '$R' --new-tokens 32" 2>&1 | tee "$R/generate.log" || status=$?
rm -rf "$R/k3_mini"
timeout 20 python bench/multi_gpu/plan_vs_measured.py --results "$R" 2>&1 | tee "$R/plan.log" || status=$?
echo
echo "== parallel summary =="
tail -n 1 "$R/tests.log" || true
for f in moe_ep cp_long_cp1 generate_sharded_1 plan_vs_measured; do
    [ -f "$R/$f.md" ] && sed -n '/^| /p' "$R/$f.md"
done
exit $status
