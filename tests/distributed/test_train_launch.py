"""Launch-level behaviour of parallel `k3 train` with ranks started as torchrun starts them (env://, gloo, CPU):
a bad layout is one `k3: error:` line and exit 2 on every rank with no hang, a parallel flag outside torchrun is
refused, and a rank killed with SIGKILL leaves the last complete checkpoint loadable and resumable."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import k3_runs
from k3.ckpt.run import find_checkpoint, load_checkpoint, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
FAST = ["--batch-size", "4", "--seq-len", "16", "--no-plot", "--sample-tokens", "0", "--eval-batches", "1"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, *argv: str, cwd: Path) -> list[subprocess.Popen]:
    """``world`` ranks of ``python -m k3 ARGV`` with the environment torchrun gives its workers."""
    port = _port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, "-m", "k3", *argv], cwd=cwd, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def test_bad_degrees_are_refused_before_any_collective(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside torchrun, and on any rank of a launch: the degrees are checked against WORLD_SIZE first (the same
    deterministic check on every rank, before a process group exists: nothing to wait for)."""
    code, _, err = k3_runs.run_cli("train", "--out", str(tmp_path / "r"), "--dp-shard", "2", *FAST)
    assert code == 2 and err.count("\n") == 1 and "--dp-shard" in err and "torchrun --nproc_per_node 2" in err
    monkeypatch.setenv("WORLD_SIZE", "4")
    for flags, named in ((["--dp-shard", "3"], "--dp-shard 3"), (["--ep", "3"], "--ep 3 must divide"),
                         (["--cp", "3"], "--cp 3")):
        code, _, err = k3_runs.run_cli("train", "--out", str(tmp_path / "r"), *FAST, *flags)
        assert code == 2 and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "r").exists()


def test_a_layout_refused_once_the_model_is_known_exits_2_on_every_rank(tmp_path: Path) -> None:
    """After the process group exists (the sequence length against --cp needs the run's data): every rank prints
    the one line and exits 2, none is left waiting in a collective."""
    procs = launch(2, "train", "--out", str(tmp_path / "r"), *FAST, "--cp", "2", "--seq-len", "15", cwd=tmp_path)
    for p in procs:
        _, err = p.communicate(timeout=180)  # a rank left waiting in a collective would time out here
        assert p.returncode == 2, err[-2000:]
        lines = [line for line in err.splitlines() if line.startswith("k3: error:")]
        assert len(lines) == 1 and "--cp 2 must divide --seq-len" in lines[0] and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "r").exists()


def test_sigkill_of_a_rank_leaves_the_last_checkpoint_loadable(tmp_path: Path) -> None:
    run = tmp_path / "run"
    procs = launch(2, "train", "--out", str(run), "--steps", "400", "--save-every", "2", "--log-every", "1",
                   *FAST, cwd=tmp_path)
    try:
        deadline = time.time() + 240
        first = run / "checkpoints" / "step-00000002" / "checkpoint.json"
        while not first.exists():  # wait for one published checkpoint, then for training to be under way again
            assert time.time() < deadline and all(p.poll() is None for p in procs), "no checkpoint was published"
            time.sleep(0.2)
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGKILL)
        time.sleep(1.0)
        procs[0].send_signal(signal.SIGKILL)  # rank 0 now waits for rank 1 in a collective: gone with it
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    ckpt = find_checkpoint(run)
    verify_checkpoint(ckpt)  # complete: every file matches the manifest
    assert not any(p.name.startswith("step-") and not (p / "checkpoint.json").is_file()
                   for p in (run / "checkpoints").iterdir())
    step = load_checkpoint(run)["step"]
    with k3_runs.one_thread():  # resume on one process (a different layout) and finish a few more steps
        code, out, err = k3_runs.run_cli("train", "--resume", str(run), "--steps", str(step + 2))
    assert code == 0 and f"resuming from step {step}" in out, err


_CYCLE = r"""
import gc, weakref
import torch.distributed as dist
from k3.distributed.data_parallel import _free_groups

gc.disable()  # only the explicit collection may free the cycle
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
pg = dist.group.WORLD
ref = weakref.ref(pg)
cycle = [pg]
cycle.append(cycle)
del pg, cycle
dist.destroy_process_group()
assert ref() is not None, "nothing held the group: the check below would prove nothing"
_free_groups()
assert ref() is None, "the group outlived _free_groups"
print("freed", flush=True)
"""


def test_groups_kept_alive_by_reference_cycles_are_freed_at_exit() -> None:
    """The exit hook ``init_distributed`` registers frees groups that only a reference cycle still holds after
    ``destroy_process_group`` (the device mesh, a traceback): otherwise they die in the interpreter's teardown, where
    a gloo worker still releasing the last collective's tensors aborts the process after its work is done."""
    r = subprocess.run([sys.executable, "-c", _CYCLE], env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "freed" in r.stdout, r.stderr[-2000:]
