#!/usr/bin/env bash
# fla's own tests/ops/test_kda.py and tests/ops/test_attnres.py pointed at k3 (bench/compat/k3_fla_kda.py,
# k3_fla_attnres.py rebind fla's names to k3's), then k3's GPU tests of the fla arguments, head dims to 256 and fp16
# hard resets. fla-core 0.6.0 must be installed; fla's test files are read from .fla/ (git-ignored), which
# bench/compat/fla_tests.sh fills from an fla repository before the run (carry .fla to the device).
# Run from the repository root with $OUT set; logs land in $OUT/fla/ (one per test id). A summary table comes last.
set -euo pipefail
: "${OUT:?set OUT to a folder for logs and results}"
dir="$OUT/fla"
mkdir -p "$dir/logs"
if [ ! -f .fla/tests/ops/test_kda.py ]; then
    echo "fla.sh: no .fla/tests: run bench/compat/fla_tests.sh <fla repository> here first and carry .fla" >&2
    exit 2
fi
cp .fla/COMMIT "$dir/fla_tests_commit.txt" 2>/dev/null || true
export PYTHONPATH=".:bench/compat${PYTHONPATH:+:$PYTHONPATH}"
plugins=(-p k3_fla_kda -p k3_fla_attnres -p no:cacheprovider)

# one process per test id, 14 at a time: most of the time is Triton compiling, one CPU core per process
# FLA_TESTS_K: an optional pytest -k filter (a quick subset)
python -m pytest "${plugins[@]}" --collect-only -q ${FLA_TESTS_K:+-k "$FLA_TESTS_K"} .fla/tests/ops/test_kda.py \
    .fla/tests/ops/test_attnres.py 2>/dev/null | grep '::' > "$dir/ids.txt" || true
run_one() {
    log="$2/logs/$(echo "$1" | md5sum | cut -c1-10).log"
    timeout 150 python -m pytest -q -rs "${@:3}" "$1" > "$log" 2>&1
    rc=$?
    res=$(grep -Eo '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -1 | awk '{print $2}')
    echo "${res:-rc$rc} $1"
}
export -f run_one
t0=$(date +%s)
tr '\n' '\0' < "$dir/ids.txt" | xargs -0 -P 14 -I{} bash -c 'run_one "$@"' _ {} "$dir" "${plugins[@]}" \
    | sort > "$dir/fla_results.txt" || true
t1=$(date +%s)
timeout 90 python -m pytest -q -p no:cacheprovider ${K3_TESTS_K:+-k "$K3_TESTS_K"} tests/ops/test_kda_fla.py \
    tests/ops/test_kda_headdim.py \
    > "$dir/k3_tests.log" 2>&1 || true

echo
echo "== fla summary (fla's tests against k3: $(cat "$dir/fla_tests_commit.txt" 2>/dev/null); $((t1 - t0)) s) =="
printf '%-8s %s\n' result count
cut -d' ' -f1 "$dir/fla_results.txt" | sort | uniq -c | awk '{printf "%-8s %s\n", $2, $1}'
echo "-- not passed (expected exclusions: bench/compat/README.md) --"
grep -v '^passed ' "$dir/fla_results.txt" || true
echo "-- k3's own GPU tests (tests/ops/test_kda_fla.py, test_kda_headdim.py) --"
tail -1 "$dir/k3_tests.log"
