"""Shared by the tests (loaded by path from tests/conftest.py): tiny training runs, made once, and a tiny model whose
AttnRes mixes all matter."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from k3.cli import main
from k3.config import K3Config
from k3.model import K3ForCausalLM

def tiny_model(seed: int = 0, device: str = "cpu", **kw) -> K3ForCausalLM:
    """Preset ``tiny`` (``kw`` overrides config fields) with its AttnRes pseudo-queries and norm gains away from the
    zero / ones init, so that every mix depends on all of its sources."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = K3ForCausalLM(K3Config.from_preset("tiny", **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("_res_norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


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


_BATCH = """
import contextlib, io, json, sys
import torch
torch.set_num_threads(1)
from k3.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
sys.stdout.write(json.dumps(results))
"""
REPO = Path(__file__).resolve().parents[2]


def run_cli_child(*argvs: list[str], cwd: Path | None = None) -> tuple[list[tuple[int, str, str]], int]:
    """Run several ``k3`` commands one after another in ONE child interpreter (one start-up for all); returns
    ``[(exit code, stdout, stderr), …]`` and the child's peak resident memory in bytes (``wait4``'s rusage)."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen([sys.executable, "-c", _BATCH, json.dumps([list(a) for a in argvs])], cwd=cwd, env=env,
                             stdout=out, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text, errors = out.read().decode(), err.read().decode()
    assert p.returncode == 0, errors[-3000:]
    return [tuple(r) for r in json.loads(text)], usage.ru_maxrss * 1024


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
    """``relative path -> sha256`` of every file under ``path`` (to show nothing on disk changed); files over 64 MiB
    (sparse test files) by size and modification time instead of a second full read."""
    def sig(f: Path) -> str:
        st = f.stat()
        if st.st_size > 64 << 20:
            return f"{st.st_size}:{st.st_mtime_ns}"
        return hashlib.sha256(f.read_bytes()).hexdigest()

    return {str(f.relative_to(path)): sig(f) for f in sorted(path.rglob("*")) if f.is_file()}


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
