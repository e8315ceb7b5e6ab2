#!/usr/bin/env bash
# Robustness checks that need the GPU: the memory estimate against real CUDA allocations and the refusal of a
# model that cannot fit the GPU's free memory; plus what verifying every checkpoint byte costs on this host.
# Run from the repo root with $OUT set; writes $OUT/robust/. About a minute on an H200 host.
set -euo pipefail
mkdir -p "$OUT/robust"
python -m pytest -q tests/test_memory.py 2>&1 | tee "$OUT/robust/pytest.txt"
python - <<'PY' | tee "$OUT/robust/hash.md"
import os, tempfile, time
import torch
from k3.utils import sha256_file
from k3.memory import available_memory, human_bytes, model_footprint
from k3.config import K3Config
path = os.path.join(tempfile.mkdtemp(), "blob")
with open(path, "wb") as f:  # real bytes, not a sparse file: the page cache holds them as after a save
    for _ in range(8):
        f.write(os.urandom(128 << 20))
sha256_file(path)
t = time.perf_counter(); sha256_file(path); dt = time.perf_counter() - t
os.unlink(path)
gb = 1 << 30
print("| what | value |\n|---|---|")
print(f"| sha256 of a cached 1 GiB file (k3.utils.sha256_file) | {gb / dt / 1e9:.2f} GB/s |")
print(f"| free GPU memory (k3.memory.available_memory) | {human_bytes(available_memory('cuda'))} |")
print(f"| preset small, bf16 weights (model_footprint) | {human_bytes(model_footprint(K3Config.from_preset('small')).bytes)} |")
print(f"| torch {torch.__version__}, {torch.cuda.get_device_name()} | |")
PY
