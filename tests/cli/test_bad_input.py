"""Every kind of bad input: exit code 2, ONE line on stderr saying what is wrong, and nothing on disk changed."""

import json
import os

import pytest

import k3_runs

FAST = k3_runs.FAST


def _check(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("k3: error: ") and err.count("\n") == 1, repr(err)  # one line, no traceback
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize("argv,needle", [
    (["train", "--steps", "0"], "--steps: must be a positive integer"),
    (["train", "--steps", "-3"], "--steps: must be a positive integer"),
    (["train", "--batch-size", "-1"], "--batch-size: must be a positive integer"),
    (["train", "--seq-len", "0"], "--seq-len"),
    (["train", "--lr", "-0.1"], "--lr"),
    (["train", "--steps", "ten"], "expected a positive integer"),
    (["train", "--preset", "huge"], "unknown preset 'huge'"),
    (["train", "--optimizer", "sgd"], "invalid choice"),
    (["train", "--cuda-graph", "maybe"], "invalid choice"),
    (["train", "--cuda-graph", "on", "--device", "cpu"], "--cuda-graph on needs a CUDA device and bf16 compute"),
    (["train", "--bogus-flag"], "unrecognized arguments"),
    (["generate", "--prompt", "x"], "one of the arguments --run --model is required"),
    (["generate", "--run", "r", "--max-new-tokens", "-5"], "--max-new-tokens"),
    (["generate", "--run", "r", "--chat"], "apply to --model only"),
    (["eval"], "--run"),
])
def test_bad_flags(tmp_path, argv, needle):
    code, out, err = k3_runs.run_cli(*argv, cwd=tmp_path)
    _check(code, err, needle)
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_config_with_wrong_fields(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"hidden_sise": 64}))
    code, _, err = k3_runs.run_cli("train", "--config", "c.json", cwd=tmp_path)
    _check(code, err, "unknown field(s) ['hidden_sise']")
    (tmp_path / "c.json").write_text(json.dumps({"hidden_size": -4}))
    _check(*k3_runs.run_cli("train", "--config", "c.json", cwd=tmp_path)[::2], "hidden_size must be a positive")
    (tmp_path / "c.json").write_text("{not json")
    _check(*k3_runs.run_cli("train", "--config", "c.json", cwd=tmp_path)[::2], "not valid JSON")
    _check(*k3_runs.run_cli("train", "--config", "missing.json", cwd=tmp_path)[::2], "missing.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_empty_or_missing_data(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    _check(*k3_runs.run_cli("train", "--data", "empty.txt", cwd=tmp_path)[::2], "empty.txt is empty")
    (tmp_path / "e.jsonl").write_text("\n")
    _check(*k3_runs.run_cli("train", "--data", "e.jsonl", cwd=tmp_path)[::2], "is empty")
    _check(*k3_runs.run_cli("train", "--data", "nope.txt", cwd=tmp_path)[::2], "nope.txt' is not a file")
    (tmp_path / "small.txt").write_text("tiny")
    _check(*k3_runs.run_cli("train", "--data", "small.txt", cwd=tmp_path)[::2], "too few", "--seq-len")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.jsonl", "empty.txt", "small.txt"]


def test_missing_or_unusable_run_dir(tmp_path):
    for cmd in (["generate", "--run"], ["eval", "--run"], ["train", "--resume"]):
        _check(*k3_runs.run_cli(*cmd, str(tmp_path / "nope"))[::2], "does not exist")
    (tmp_path / "file").write_text("x")
    _check(*k3_runs.run_cli("eval", "--run", str(tmp_path / "file"))[::2], "is not a directory")
    (tmp_path / "emptyrun").mkdir()
    _check(*k3_runs.run_cli("generate", "--run", str(tmp_path / "emptyrun"))[::2], "no complete checkpoint")
    _check(*k3_runs.run_cli("train", "--resume")[::2], "--resume needs the run directory")


def _corrupt_cases():
    def truncate(ck):
        f = ck / "model.safetensors"
        f.write_bytes(f.read_bytes()[:1000])

    def flip(ck):
        f = ck / "trainer.pt"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    def manifest(ck):
        (ck / "checkpoint.json").write_text('{"format": "k3-run-chec')

    def missing(ck):
        (ck / "config.json").unlink()

    return [(truncate, "truncated or corrupt"), (flip, "sha256"), (manifest, "not JSON"), (missing, "missing")]


@pytest.mark.parametrize("damage,needle", _corrupt_cases(), ids=["truncated", "bitflip", "manifest", "missing"])
def test_corrupt_or_truncated_checkpoint(tiny_run, tmp_path, damage, needle):
    run = k3_runs.copy_run(tiny_run, tmp_path / "r")
    damage(run / "checkpoints" / "step-00000004")
    before = k3_runs.tree_digest(run)
    for argv in (["generate", "--run", str(run)], ["eval", "--run", str(run)],
                 ["train", "--resume", str(run), "--steps", "6"]):
        _check(*k3_runs.run_cli(*argv)[::2], needle, "step-00000004", "delete that directory")
    assert k3_runs.tree_digest(run) == before


def test_existing_run_dir_is_never_overwritten(tiny_run, tmp_path):
    run = k3_runs.copy_run(tiny_run, tmp_path / "r")
    before = k3_runs.tree_digest(run)
    code, _, err = k3_runs.run_cli("train", "--out", str(run), "--steps", "2", *FAST)
    _check(code, err, "already exists", "--resume")
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "notes.txt").write_text("keep me")
    _check(*k3_runs.run_cli("train", "--name", "mine", cwd=tmp_path)[::2], "already exists")
    assert (tmp_path / "runs" / "mine" / "notes.txt").read_text() == "keep me"
    assert k3_runs.tree_digest(run) == before


def test_bench_unknown_name_from_the_command_line(tmp_path):
    """``python -m k3.bench nope``: one line on stderr, exit 2, no traceback."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "k3.bench", "nope"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown benchmark 'nope'" in r.stderr, repr(r.stderr)
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["kda", "--sections", "decode,bogus"], "--sections must be a comma list"),
    (["kda", "--T", "0"], "--T/--H positive"),
    (["kda", "--T", "ten"], "invalid int value"),
    (["moe", "--bogus-flag"], "unrecognized arguments"),
])
def test_bench_bad_input(tmp_path, capsys, argv, needle):
    """``k3.bench`` flags: a bad one is one line on stderr, exit 2, no traceback, nothing written."""
    from k3.bench.__main__ import main

    try:
        code = main([*argv, "--out", str(tmp_path / "o")])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and needle in err, repr(err)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("exc,code,needles", [
    (RuntimeError("boom"), 1, ["unexpected RuntimeError: boom", "full traceback in", "please report it"]),
    (RecursionError("deep"), 1, ["unexpected RecursionError: deep", "full traceback in"]),
    (MemoryError(), 1, ["out of memory", "--batch-size"]),
])
def test_unexpected_failure_is_one_line_with_the_traceback_in_a_file(tmp_path, monkeypatch, exc, code, needles):
    import k3.cli

    def broken(*a, **kw):
        raise exc

    monkeypatch.setattr(k3.cli, "evaluate_run", broken)
    got, _, err = k3_runs.run_cli("eval", "--run", str(tmp_path))
    assert got == code and err.startswith("k3: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    if "full traceback in" in err:
        path = err.split("full traceback in ")[1].split(";")[0]
        text = open(path).read()
        assert "Traceback" in text and type(exc).__name__ in text and "broken" in text
        os.unlink(path)
