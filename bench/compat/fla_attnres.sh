#!/usr/bin/env bash
# fla's own AttnRes tests with fla's fused_attnres replaced by k3's (needs CUDA and fla installed).
# Usage: bench/compat/fla_attnres.sh <path to fla's tests/ops/test_attnres.py>   (run from the repository root)
set -euo pipefail
test_file="${1:?give the path to tests/ops/test_attnres.py of an fla checkout}"
PYTHONPATH=".:bench/compat${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -p k3_fla_attnres -q -p no:cacheprovider "$test_file"
