"""Fixtures shared with the other CLI/train/infer tests (``tests/train/k3_runs.py``)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("k3_runs", Path(__file__).parents[1] / "train" / "k3_runs.py")
k3_runs = sys.modules.setdefault("k3_runs", importlib.util.module_from_spec(_spec))
if not hasattr(k3_runs, "run_cli"):
    _spec.loader.exec_module(k3_runs)


@pytest.fixture(autouse=True)
def _one_thread():
    with k3_runs.one_thread():
        yield


@pytest.fixture(scope="session")
def runs_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "k3_runs"


@pytest.fixture(scope="session")
def tiny_run(runs_base: Path) -> Path:
    """A 4-step text run of preset tiny (checkpoint at step 4), trained once per session. Do not modify it."""
    with k3_runs.one_thread():
        return k3_runs.cached_run(runs_base, "tiny_text", "--steps", "4", *k3_runs.FAST)
