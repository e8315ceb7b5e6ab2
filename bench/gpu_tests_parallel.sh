#!/usr/bin/env bash
# Run the GPU tests of one pytest marker as parallel processes (one per test id): most of `pytest -m gpu_quick`'s
# time is Triton compiling kernels on one CPU core, and separate processes compile in parallel.
#   bash bench/gpu_tests_parallel.sh [marker=gpu_quick] [jobs=8] [logdir=/tmp/gpu_tests] [test paths...]
# e.g. every GPU test of two files: bash bench/gpu_tests_parallel.sh "not gpu_quick" 14 /tmp/g tests/ops/test_kda_train.py
set -u
marker=${1:-gpu_quick}; jobs=${2:-8}; logdir=${3:-/tmp/gpu_tests}; shift 3 2>/dev/null || shift $#
mkdir -p "$logdir"
python -m pytest -m "$marker" --collect-only -q "$@" 2>/dev/null | grep '::' > "$logdir/ids.txt"
echo "$(wc -l < "$logdir/ids.txt") tests, $jobs at a time"
run_one() {
  id=$1; logdir=$2
  log="$logdir/$(echo "$id" | md5sum | cut -c1-10).log"
  python -m pytest -q -p no:cacheprovider "$id" > "$log" 2>&1
  rc=$?
  echo "rc=$rc $id"
}
export -f run_one
tr '\n' '\0' < "$logdir/ids.txt" | xargs -0 -P "$jobs" -I{} bash -c 'run_one "$1" "$2"' _ {} "$logdir" \
  | sort | tee "$logdir/summary.txt"
! grep -qv '^rc=0 ' "$logdir/summary.txt"
