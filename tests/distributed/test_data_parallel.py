"""`torchrun --nproc_per_node 2 k3 train` (gloo, CPU) equals one process training on the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "5", "--seq-len", "16", "--no-plot", "--sample-tokens", "0", "--eval-batches", "1",
        "--log-every", "1"]


def _run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def _metric(run: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_equal_one_process_on_the_global_batch(tmp_path: Path) -> None:
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          "-m", "k3", "train", "--batch-size", "2", "--out", "dp2", *ARGS], tmp_path)
    _run([sys.executable, "-m", "k3", "train", "--batch-size", "4", "--out", "one", *ARGS], tmp_path)
    dp2, one = tmp_path / "dp2", tmp_path / "one"
    for key in ("loss", "grad_norm"):  # grad_norm: the all-reduced gradient is the global batch's mean gradient
        a, b = _metric(dp2, key), _metric(one, key)
        assert len(a) == len(b) == 5
        assert max(abs(x - y) / max(abs(y), 1.0) for x, y in zip(a, b)) < 1e-5, (key, a, b)
    # rank 0 alone wrote the run; its weights (QB biases included) equal the single process's
    wa = load_file(str(dp2 / "checkpoints" / "step-00000005" / "model.safetensors"))
    wb = load_file(str(one / "checkpoints" / "step-00000005" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        err = (wa[name].double() - wb[name].double()).norm() / wb[name].double().norm().clamp(min=1e-12)
        assert err < 1e-4, (name, float(err))
    biases = [n for n in wa if n.endswith("e_score_correction_bias")]
    assert biases and any(float(wa[n].abs().max()) > 0 for n in biases)  # QB ran and pooled both ranks' histograms
    assert sorted(p.name for p in dp2.iterdir()) == sorted(p.name for p in one.iterdir())
