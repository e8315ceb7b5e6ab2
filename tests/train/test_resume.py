"""Exact resume, and checkpoints that survive a kill at any moment."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

import k3_runs
from k3.ckpt.run import find_checkpoint, load_checkpoint, load_trainer_state, verify_checkpoint

CONST = ["--schedule", "constant", "--warmup", "5", *k3_runs.FAST]


def test_resume_10_to_20_equals_uninterrupted_20(tmp_path):
    """Muon (the default): weights, QB biases, momentum buffers, RNG and data position all carry over."""
    full = tmp_path / "full"
    code, out, err = k3_runs.run_cli("train", "--out", str(full), "--steps", "20", *CONST)
    assert code == 0, err
    half = tmp_path / "half"
    assert k3_runs.run_cli("train", "--out", str(half), "--steps", "10", *CONST)[0] == 0
    code, out, err = k3_runs.run_cli("train", "--resume", str(half), "--steps", "20")
    assert code == 0, err
    assert "resuming from step 10" in out
    a, b = k3_runs.losses(full), k3_runs.losses(half)
    assert sorted(b) == list(range(1, 21))  # every step logged once
    diffs = [abs(a[s] - b[s]) for s in range(11, 21)]
    assert max(diffs) < 1e-4, diffs
    assert a[20] < a[1]  # it did train
    # the QB biases moved during training and were restored exactly
    ma = load_checkpoint(full)["model"].state_dict()
    mb = load_checkpoint(half)["model"].state_dict()
    bias = [k for k in ma if k.endswith("e_score_correction_bias")]
    assert bias and any(ma[k].abs().max() > 0 for k in bias)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_resume_refuses_changed_flags_and_done_runs(tiny_run, tmp_path):
    run = k3_runs.copy_run(tiny_run, tmp_path / "r")
    before = k3_runs.tree_digest(run)
    code, _, err = k3_runs.run_cli("train", "--resume", str(run), "--steps", "8", "--seq-len", "32")
    assert code == 2 and "--seq-len cannot change" in err and err.count("\n") == 1
    code, _, err = k3_runs.run_cli("train", "--resume", str(run), "--steps", "4")
    assert code == 2 and "must exceed the checkpoint's step 4" in err
    assert k3_runs.tree_digest(run) == before


_CHILD = textwrap.dedent("""
    import os, sys, time
    import safetensors.torch as st
    import torch
    torch.set_num_threads(1)
    marker, real, calls = sys.argv[1], st.save_model, []
    def hanging_save(model, path, **kw):   # the 2nd checkpoint: write half a file, then hang until killed
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"partial")
            open(marker, "w").close()
            time.sleep(600)
        return real(model, path, **kw)
    st.save_model = hanging_save
    from k3.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def test_sigkill_during_checkpoint_write_keeps_the_previous_one(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "saving"
    args = ["train", "--out", str(run), "--steps", "4", "--save-every", "2", "--warmup", "2", "--optimizer", "adamw",
            *k3_runs.FAST]
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(marker), *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 90
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.time() < deadline, "the child never reached its second save"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
    # killed mid-save: a hidden partial directory, and the step-2 checkpoint intact and complete
    assert list((run / "checkpoints").glob(".tmp-step-*"))
    ckpt = find_checkpoint(run)
    assert ckpt.name == "step-00000002"
    verify_checkpoint(ckpt)
    assert load_trainer_state(ckpt)["step"] == 2 and load_checkpoint(run)["step"] == 2
    # and the run continues from it, ending exactly where an uninterrupted run ends (AdamW, cosine schedule)
    code, out, err = k3_runs.run_cli("train", "--resume", str(run))
    assert code == 0, err
    assert not list((run / "checkpoints").glob(".tmp-step-*"))
    ref = tmp_path / "ref"
    assert k3_runs.run_cli("train", "--out", str(ref), "--steps", "4", "--warmup", "2", "--optimizer", "adamw",
                           *k3_runs.FAST)[0] == 0
    a, b = k3_runs.losses(ref), k3_runs.losses(run)
    assert sorted(b) == list(range(1, 5)) and all(abs(a[s] - b[s]) < 1e-4 for s in range(1, 5))


def test_failure_at_the_final_rename_keeps_the_previous_checkpoint(tiny_run, tmp_path, monkeypatch):
    run = k3_runs.copy_run(tiny_run, tmp_path / "r")
    real = os.replace

    def failing(src, dst):
        if "step-00000006" in str(dst):  # the checkpoint directory's rename: everything inside is written
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    code, _, err = k3_runs.run_cli("train", "--resume", str(run), "--steps", "6")
    assert code == 2 and err.startswith("k3: error: No space left on device") and err.count("\n") == 1
    monkeypatch.undo()
    assert find_checkpoint(run).name == "step-00000004"  # the complete-but-unrenamed one is not picked up
    assert load_checkpoint(run)["step"] == 4
