"""Shared by the CLI, train and infer tests (loaded by path from their conftests): tiny training runs, made once."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import torch

from k3.cli import main

# Small enough that a step costs tens of milliseconds on a 2-core CPU; preset tiny, the real model.
FAST = ["--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--sample-tokens", "0", "--no-plot"]


def run_cli(*argv: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """``k3 ARGV`` in this process; returns ``(exit code, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        os.chdir(old)
    return code, out.getvalue(), err.getvalue()


def cached_run(base: Path, name: str, *argv: str) -> Path:
    """Train ``k3 train --out base/name ARGV`` once per session and return the run directory."""
    run = base / name
    if not (run / "checkpoints").is_dir():
        code, out, err = run_cli("train", "--out", str(run), *argv)
        assert code == 0, (out, err)
    return run


def copy_run(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def tree_digest(path: Path) -> dict[str, str]:
    """``relative path -> sha256`` of every file under ``path`` (to show nothing on disk changed)."""
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@contextlib.contextmanager
def one_thread():
    """The tiny model's ops are too small for intra-op threads; 1 thread is faster and immune to a busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
