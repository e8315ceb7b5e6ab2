#!/usr/bin/env bash
# Every multi-GPU measurement on one host: bench/multi_gpu/run.sh [N GPUs, default all visible]   (results in $OUT/multi_gpu)
#                                     bench/multi_gpu/run.sh --smoke   (CPU, gloo, tiny sizes: checks the scripts)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to a folder for the results}
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
SMOKE=()
if [[ "${1:-}" == "--smoke" ]]; then
  SMOKE=(--smoke); N=2; export OMP_NUM_THREADS=1
else
  N=${1:-$(python -c "import torch; print(torch.cuda.device_count())")}
fi
R=$OUT/multi_gpu
mkdir -p "$R"
counts=(); for n in 1 2 4 8; do (( n <= N )) && counts+=("$n"); done
trun() { python -m torch.distributed.run --standalone --nproc_per_node "$@"; }

# 1. k3 train scaling (FSDP2 dp-shard 1/2/4/8)
python bench/multi_gpu/train_scaling.py "${SMOKE[@]}" --gpus "${counts[@]}" --out "$R"
# 2. the Latent MoE layer at K3 widths under EP, random and skewed routing
trun "$N" bench/multi_gpu/moe_ep.py "${SMOKE[@]}" --out "$R"
# 3. whole-model context parallel, small at 256K tokens: one GPU, then cp 2 and cp 4
for n in "${counts[@]}"; do
  (( n == 8 )) && continue
  trun "$n" bench/multi_gpu/cp_long.py "${SMOKE[@]}" --out "$R"
done
# 4. the release expert-sharded: a 3-layer K3-width MXFP4 checkpoint, 1 GPU then 2/4/8
CKPT=$OUT/k3_mini
[[ -f $CKPT/config.json ]] || python bench/multi_gpu/generate_sharded.py make "${SMOKE[@]}" --out "$CKPT"
for n in "${counts[@]}"; do
  trun "$n" bench/multi_gpu/generate_sharded.py run "${SMOKE[@]}" --model "$CKPT" --out "$R"
done
trun "$N" -m k3 generate --model "$CKPT" --prompt "The " --max-new-tokens 16 --temperature 0 \
  $([[ ${#SMOKE[@]} -gt 0 ]] && echo --device cpu)
# 5. k3 plan beside the measurements
python bench/multi_gpu/plan_vs_measured.py --results "$R"
