#!/usr/bin/env bash
# Copy fla's own test files (tests/conftest.py, tests/ops/test_kda.py, tests/ops/test_attnres.py) from an fla
# repository into .fla/ (git-ignored: fla's files are read for a run, never committed here).
# Usage (repository root): bench/compat/fla_tests.sh <fla checkout or bare git dir> [commit, default HEAD]
set -euo pipefail
src="${1:?give an fla-org/flash-linear-attention checkout or git directory}"
rev="${2:-HEAD}"
dst=.fla
rm -rf "$dst" && mkdir -p "$dst/tests/ops"
for f in tests/conftest.py tests/ops/test_kda.py tests/ops/test_attnres.py; do
    git --git-dir="$(git -C "$src" rev-parse --absolute-git-dir)" show "$rev:$f" > "$dst/$f"
done
git --git-dir="$(git -C "$src" rev-parse --absolute-git-dir)" rev-parse "$rev" > "$dst/COMMIT"
echo "fla tests at $(cat "$dst/COMMIT") in $dst/"
