"""`python -m k3 train` → generate → eval in a fresh directory, as a newcomer runs them; and bringing own data."""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import k3_runs

REPO = Path(__file__).resolve().parents[2]


def _k3(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "k3", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_default_job_trains_then_generate_and_eval(tmp_path):
    """`python -m k3 train` as a newcomer runs it (the default job, at a fraction of its steps): the progress lines,
    a clearly falling loss (last-5 mean < 0.7 × first-5 mean), validation, a sample, the run directory; then
    `k3 generate` from it and a one-line error from `k3 eval` on a missing run."""
    r = _k3("train", "--steps", "20", "--sample-tokens", "20", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("k3: training in runs/tiny/") and "tiny" in lines[0] and "cpu" in lines[0]
    assert any(l.startswith("step 20/20") and "tok/s" in l and "lr" in l and "load max/mean" in l for l in lines)
    assert any("validation loss" in l for l in lines) and any(l.startswith("k3: sample") for l in lines)
    run = tmp_path / "runs" / "tiny"
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    losses = [r["loss"] for r in rows]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (run / "checkpoints" / "step-00000020" / "checkpoint.json").is_file()
    code, out, err = k3_runs.run_cli("generate", "--run", "runs/tiny", "--prompt", "The", "--max-new-tokens", "8",
                                     "--seed", "1", cwd=tmp_path)
    assert code == 0 and out.startswith("The") and "tok/s" in err, err
    code, _, err = k3_runs.run_cli("eval", "--run", "runs/nope", cwd=tmp_path)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err


def test_own_text_bin_shard_and_tiktoken_tokenizer(tmp_path):
    text = "The delta rule writes a value under a key and forgets by a gate. " * 40
    (tmp_path / "corpus.txt").write_text(text)
    code, out, err = k3_runs.run_cli("tokenize", "corpus.txt", "--out", "corpus.bin", cwd=tmp_path)
    assert code == 0 and "corpus.bin" in out, err
    code, out, err = k3_runs.run_cli("train", "--data", "corpus.bin", "--steps", "2", "--name", "bin",
                                     *k3_runs.FAST, cwd=tmp_path)
    assert code == 0, err
    assert "corpus.bin" in out.splitlines()[0]
    # a tiktoken BPE file: the tiny preset's vocabulary follows the tokenizer
    tokens = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the", b" t", b" the"]
    (tmp_path / "bpe.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    code, out, err = k3_runs.run_cli("train", "--data", "corpus.txt", "--tokenizer", "bpe.model", "--steps", "2",
                                     "--name", "bpe", *k3_runs.FAST, cwd=tmp_path)
    assert code == 0, err
    cfg = json.loads((tmp_path / "runs" / "bpe" / "config.json").read_text())
    assert cfg["vocab_size"] == 320 and cfg["eos_token_id"] == 262  # 261 BPE ranks + bos, eos, pad → ×64
    (tmp_path / "bpe.model").unlink()  # the run keeps its own copy of the tokenizer
    code, out, err = k3_runs.run_cli("generate", "--run", "runs/bpe", "--prompt", "the", "--max-new-tokens", "5",
                                     cwd=tmp_path)
    assert code == 0 and out.startswith("the"), err


def test_default_run_names_never_collide_and_empty_out_is_fine(tmp_path):
    for _ in range(2):
        code, out, err = k3_runs.run_cli("train", "--steps", "1", *k3_runs.FAST, cwd=tmp_path)
        assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny", "tiny-2"]
    (tmp_path / "empty").mkdir()
    code, out, err = k3_runs.run_cli("train", "--steps", "1", "--out", "empty", *k3_runs.FAST, cwd=tmp_path)
    assert code == 0 and out.startswith("k3: training in empty/"), err
    # paths in run.json are absolute, so eval works from anywhere
    (tmp_path / "t.txt").write_text("some words to train on. " * 30)
    code, _, err = k3_runs.run_cli("train", "--steps", "1", "--data", "t.txt", "--name", "t", *k3_runs.FAST,
                                   cwd=tmp_path)
    assert code == 0, err
    code, out, err = k3_runs.run_cli("eval", "--run", str(tmp_path / "runs" / "t"))
    assert code == 0 and "val loss" in out, err
