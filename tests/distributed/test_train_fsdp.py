"""`k3 train` on gloo ranks (CPU, real process groups, torchrun's environment): FSDP2 ranks reproduce one process on
the same global batch, and checkpoints move between layouts (2 ranks ↔ 1 process; 4 ranks with expert parallel → 2
ranks → 1 process) with the same losses."""

import contextlib
import importlib.util
import io
import json
import os
import shutil
from pathlib import Path

import k3_runs
from k3.ckpt.run import load_checkpoint
from k3.cli import main

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", Path(__file__).with_name("_gloo.py"))
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)

ARGS = ["--batch-size", "4", "--seq-len", "16", "--no-plot", "--sample-tokens", "0", "--eval-batches", "1",
        "--log-every", "1", "--warmup", "2"]


def _cli_rank(rank: int, world: int, argv: list[str]) -> None:
    """``k3 ARGV`` on one rank of a forked gloo group (torchrun's environment, without its start-up cost)."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert rank > 0 or f"× {world} ranks" in out.getvalue(), out.getvalue()


def metric(run: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run / "metrics.jsonl").read_text().splitlines()]


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_dp_shard_2_equals_one_process_and_checkpoints_reshard(tmp_path: Path) -> None:
    one, dp2 = tmp_path / "one", tmp_path / "dp2"
    with k3_runs.one_thread():
        code, _, err = k3_runs.run_cli("train", "--out", str(one), "--steps", "10", "--save-every", "5", *ARGS)
    assert code == 0, err
    _gloo.run_ranks(_cli_rank, 2, ["train", "--out", str(dp2), "--steps", "10", "--save-every", "5",
                                   "--dp-shard", "2", *ARGS])
    # the first 10 losses (and gradient norms: the reduced gradient is the global batch's) of 2 FSDP ranks
    for key in ("loss", "grad_norm"):
        assert close(metric(dp2, key), metric(one, key)), (key, metric(dp2, key), metric(one, key))
    assert metric(one, "loss")[-1] < metric(one, "loss")[0]
    # rank 0 published one DCP checkpoint per save; `k3 generate --run` (one process) reads it
    ckpt = dp2 / "checkpoints" / "step-00000010"
    assert (ckpt / "dcp" / ".metadata").is_file() and sorted(p.name for p in (ckpt / "rng").iterdir()) == [
        "rank-00000.pt", "rank-00001.pt"]
    wa, wb = load_checkpoint(dp2)["model"].state_dict(), load_checkpoint(one)["model"].state_dict()
    assert wa.keys() == wb.keys()
    for name in wa:
        err = (wa[name].double() - wb[name].double()).norm() / wb[name].double().norm().clamp(min=1e-12)
        assert err < 1e-3, (name, float(err))  # bf16 storage of the loaded models; QB biases included
    code, out, err = k3_runs.run_cli("generate", "--run", str(dp2), "--max-new-tokens", "4", "--device", "cpu")
    assert code == 0, err

    # 2 ranks → 1 process: resume the DCP checkpoint of step 5 without a process group
    to1 = tmp_path / "to1"
    shutil.copytree(dp2, to1)
    shutil.rmtree(to1 / "checkpoints" / "step-00000010")
    with k3_runs.one_thread():
        code, out, err = k3_runs.run_cli("train", "--resume", str(to1), "--steps", "10")
    assert code == 0 and "resuming from step 5" in out, err
    assert close(metric(to1, "loss"), metric(one, "loss"))
    # 1 process → 2 ranks: the single-process format (model.safetensors + trainer.pt) sharded on load
    to2 = tmp_path / "to2"
    shutil.copytree(one, to2)
    shutil.rmtree(to2 / "checkpoints" / "step-00000010")
    _gloo.run_ranks(_cli_rank, 2, ["train", "--resume", str(to2), "--steps", "10", "--dp-shard", "2"])
    assert close(metric(to2, "loss"), metric(one, "loss"))


def test_checkpoints_reshard_across_expert_parallel_layouts(tmp_path: Path) -> None:
    """4 ranks (dp_shard 4 × ep 2: experts split 2 ways and FSDP-sharded 2 ways) → 2 ranks (dp_shard 2) → one
    process: each resumes the previous layout's DCP checkpoint, and the 9 losses equal an uninterrupted process's."""
    args = [*ARGS, "--save-every", "3", "--schedule", "constant"]  # the lr must not depend on each leg's --steps
    one = tmp_path / "one"
    with k3_runs.one_thread():
        code, _, err = k3_runs.run_cli("train", "--out", str(one), "--steps", "9", *args)
    assert code == 0, err
    run = tmp_path / "run"
    _gloo.run_ranks(_cli_rank, 4, ["train", "--out", str(run), "--steps", "3", "--ep", "2", *args])
    _gloo.run_ranks(_cli_rank, 2, ["train", "--resume", str(run), "--steps", "6"])
    with k3_runs.one_thread():
        code, out, err = k3_runs.run_cli("train", "--resume", str(run), "--steps", "9")
    assert code == 0 and "resuming from step 6" in out, err
    assert close(metric(run, "loss"), metric(one, "loss")), (metric(run, "loss"), metric(one, "loss"))
