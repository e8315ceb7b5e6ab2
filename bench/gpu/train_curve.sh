#!/usr/bin/env bash
# the loss of preset small over its first 200 steps on the fast path and on the eager reference path (same
# seed, same text batches), one plot + JSON in $OUT/train/ (about 4 minutes on one H200).
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
mkdir -p "$OUT/train"
timeout 230 python -m k3.bench train --preset small --seq-len 2048 --batch-size 8 --steps 0 --loss-curve 200 \
    --optimizer muon \
    --out "$OUT/train" 2>&1 | tee "$OUT/train/curve.log"
echo
echo "== scale loss curve =="
tail -n 2 "$OUT/train/train_curve.md"
