#!/usr/bin/env bash
# scale: the loss of preset small over its first 200 steps on the fast path and on the eager reference path (same
# seed, same text batches), one plot + JSON in $OUT/scale/ (about 4 minutes on one H200).
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
mkdir -p "$OUT/scale"
timeout 230 python -m k3.bench train --preset small --seq-len 2048 --batch-size 8 --steps 0 --loss-curve 200 \
    --optimizer muon \
    --out "$OUT/scale" 2>&1 | tee "$OUT/scale/curve.log"
echo
echo "== scale loss curve =="
tail -n 2 "$OUT/scale/train_curve.md"
