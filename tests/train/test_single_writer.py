"""One writer per run directory; readers that survive pruning; a run killed before its first checkpoint restarts.

Real processes: a training runs in a child while this process tries to train, resume and read the same directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import k3_runs
from k3.ckpt import run as run_ckpt
from k3.ckpt.manifest import write_manifest
from k3.ckpt.run import find_checkpoint, load_checkpoint, verify_checkpoint

FAST = k3_runs.FAST


def _spawn(code: str, *argv: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(k3_runs.REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code, *argv], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def _wait(proc: subprocess.Popen, until, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not until():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline, f"the child never {what}"
        time.sleep(0.05)


_TRAIN = "import sys, torch; torch.set_num_threads(1); from k3.cli import main; sys.exit(main(sys.argv[1:]))"


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_second_writer_and_resume_refused_while_a_run_trains_and_readers_survive_pruning(tmp_path):
    run = tmp_path / "run"
    a = _spawn(_TRAIN, "train", "--out", str(run), "--steps", "100000", "--save-every", "2", "--keep", "1", *FAST,
               cwd=tmp_path)
    try:
        _wait(a, lambda: list(run.glob("checkpoints/step-*/checkpoint.json")), "saved a checkpoint")
        busy = f"{run} is being trained by another process (pid {a.pid})"
        code, _, err = k3_runs.run_cli("train", "--out", str(run), "--steps", "3", *FAST)
        assert code == 2 and err.count("\n") == 1 and busy in err, err
        code, _, err = k3_runs.run_cli("train", "--resume", str(run), "--steps", "100001")
        assert code == 2 and err.count("\n") == 1 and busy in err, err
        # readers while the run saves every 2 steps and keeps 1: each load gets a whole checkpoint
        steps = [load_checkpoint(run)["step"] for _ in range(6)]
        assert steps == sorted(steps) and steps[0] >= 2, steps
        code, out, err = k3_runs.run_cli("generate", "--run", str(run), "--max-new-tokens", "3")
        assert code == 0, err
        seen = _steps(run)[-1]
        _wait(a, lambda: _steps(run)[-1] >= seen + 4, "kept training")  # unharmed by the refused writers
    finally:
        a.send_signal(signal.SIGINT)
        a.wait(60)
    assert a.returncode == 130, a.stderr.read().decode()
    steps = _steps(run)
    assert steps == list(range(1, len(steps) + 1))  # every step logged once, by one writer
    ck = find_checkpoint(run)
    verify_checkpoint(ck)
    assert len(list((run / "checkpoints").glob("step-*"))) == 1
    # the lock died with the process: the run continues
    done = json.loads((ck / "checkpoint.json").read_text())["step"]
    code, out, err = k3_runs.run_cli("train", "--resume", str(run), "--steps", str(done + 1))
    assert code == 0, err
    assert not list((run / "checkpoints").glob(".*"))  # leftovers of the interrupted save/prune cleaned


def test_reader_retries_when_the_newest_checkpoint_is_pruned(tiny_run, tmp_path, monkeypatch):
    """The race made deterministic: the reader lists step 6, then the writer saves step 8 and prunes step 6."""
    run = k3_runs.copy_run(tiny_run, tmp_path / "r")
    root = run / "checkpoints"

    def checkpoint(step: int, src: Path) -> Path:
        tmp = root / f".tmp-step-{step:08d}-1"
        shutil.copytree(src, tmp)
        fields = json.loads((tmp / "checkpoint.json").read_text())
        write_manifest(tmp, {**{k: v for k, v in fields.items() if k not in ("files", "time")}, "step": step})
        return tmp.rename(root / f"step-{step:08d}")

    checkpoint(6, root / "step-00000004")
    real, calls, plan = run_ckpt.verify_checkpoint, [], [lambda ck: (checkpoint(8, ck), run_ckpt._discard(ck))]

    def racing(ck):
        calls.append(Path(ck).name)
        if plan:
            plan.pop(0)(Path(ck))
        return real(ck)

    monkeypatch.setattr(run_ckpt, "verify_checkpoint", racing)
    code, out, err = k3_runs.run_cli("generate", "--run", str(run), "--max-new-tokens", "3")
    assert code == 0, err
    assert calls == ["step-00000006", "step-00000008"]
    calls.clear()  # a checkpoint directory named explicitly is not swapped for another one
    plan.append(run_ckpt._discard)
    code, _, err = k3_runs.run_cli("generate", "--run", str(root / "step-00000008"))
    assert code == 2 and "step-00000008" in err and calls == ["step-00000008"], err


_HANG_FIRST_SAVE = textwrap.dedent("""
    import sys, time
    import safetensors.torch as st
    import torch
    torch.set_num_threads(1)
    marker = sys.argv[1]
    def hanging_save(model, path, **kw):   # the first checkpoint: half a file, then hang until killed
        with open(path, "wb") as f:
            f.write(b"partial")
        open(marker, "w").close()
        time.sleep(600)
    st.save_model = hanging_save
    from k3.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def test_run_killed_before_its_first_checkpoint_restarts_in_place(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "saving"
    child = _spawn(_HANG_FIRST_SAVE, str(marker), "train", "--out", str(run), "--steps", "3", *FAST, cwd=tmp_path)
    try:
        _wait(child, marker.exists, "reached its first save")
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
    assert {p.name for p in run.iterdir()} == {"run.json", "config.json", "metrics.jsonl", ".lock", "checkpoints"}
    assert [p.name[:10] for p in (run / "checkpoints").iterdir()] == [".tmp-step-"]
    before = k3_runs.tree_digest(run)
    for argv in (["train", "--resume", str(run), "--steps", "6"], ["generate", "--run", str(run)]):
        code, _, err = k3_runs.run_cli(*argv)
        assert code == 2 and err.count("\n") == 1, err
        assert "holds no checkpoint yet" in err and f"k3 train --out {run}" in err, err
    assert k3_runs.tree_digest(run) == before
    code, out, err = k3_runs.run_cli("train", "--out", str(run), "--steps", "2", *FAST)
    assert code == 0, err
    assert "starting it afresh" in out
    assert _steps(run) == [1, 2]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000002"]
    # anything that is not the run's own bookkeeping is never overwritten
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "run.json").write_text("{}")
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    code, _, err = k3_runs.run_cli("train", "--out", str(tmp_path / "other"), "--steps", "2", *FAST)
    assert code == 2 and "already exists and is not empty" in err
