#!/usr/bin/env bash
# fla's own tests/ops/test_kda.py and tests/ops/test_attnres.py pointed at k3 (bench/compat/k3_fla_kda.py,
# k3_fla_attnres.py rebind fla's names to k3's), then k3's GPU tests of the fla arguments, head dims to 256 and fp16
# hard resets. fla-core 0.6.0 must be installed; fla's test files are read from .fla/ (git-ignored), which
# bench/compat/fla_tests.sh fills from an fla repository before the run (carry .fla to the device).
# Run from the repository root with $OUT set; logs land in $OUT/fla/logs/ (one per test id), the per-id results in
# $OUT/fla/results.txt. A summary table comes last.
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

# one process per test id, 14 at a time (most of the time is Triton compiling, one CPU core per process): fla's two
# files, then k3's GPU tests of the same ground (fla's arguments, fp16 hard resets, head dims to 256)
# FLA_TESTS_K / K3_TESTS_K: optional pytest -k filters (a quick subset)
python -m pytest "${plugins[@]}" --collect-only -q ${FLA_TESTS_K:+-k "$FLA_TESTS_K"} .fla/tests/ops/test_kda.py \
    .fla/tests/ops/test_attnres.py 2>/dev/null | grep '::' > "$dir/ids.txt" || true
python -m pytest -p no:cacheprovider --collect-only -q ${K3_TESTS_K:+-k "$K3_TESTS_K"} tests/ops/test_kda_fla.py \
    tests/ops/test_kda_headdim.py 2>/dev/null | grep '::' | grep -E 'gpu|head_dim_limit' > "$dir/k3_ids.txt" || true
run_one() {
    log="$2/logs/$(echo "$1" | md5sum | cut -c1-10).log"
    timeout 170 python -m pytest -q -rs "${@:3}" "$1" > "$log" 2>&1
    rc=$?
    res=$(grep -Eo '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -1 | awk '{print $2}')
    echo "${res:-rc$rc} $1"
}
export -f run_one
t0=$(date +%s)
# results appended as each id finishes, so a run stopped at a time limit keeps what it finished
cat "$dir/k3_ids.txt" "$dir/ids.txt" | tr '\n' '\0' | xargs -0 -P 14 -I{} bash -c 'run_one "$@"' _ {} "$dir" \
    "${plugins[@]}" >> "$dir/results.raw" || true
sort "$dir/results.raw" > "$dir/results.txt"
t1=$(date +%s)
grep -F '.fla/' "$dir/results.txt" > "$dir/fla_results.txt" || true
grep -vF '.fla/' "$dir/results.txt" > "$dir/k3_results.txt" || true

echo
echo "== fla summary (fla's tests at $(cat "$dir/fla_tests_commit.txt" 2>/dev/null) against k3; $((t1 - t0)) s) =="
printf '%-8s %6s %6s\n' result fla k3
for r in passed failed skipped error; do
    printf '%-8s %6s %6s\n' "$r" "$(grep -c "^$r " "$dir/fla_results.txt" || true)" "$(grep -c "^$r " "$dir/k3_results.txt" || true)"
done
echo "-- not passed (fla's expected exclusions: bench/compat/README.md; logs: $dir/logs/<md5 of the id>.log) --"
grep -hv '^passed ' "$dir/fla_results.txt" "$dir/k3_results.txt" || true
