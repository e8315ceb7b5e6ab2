"""Test-wide setup.

- With no GPU, Triton kernels run in the interpreter on CPU tensors (fp32/fp16 only). This must happen before any
  module decorates a kernel with @triton.jit, hence here at collection start.
- One intra-op thread: every test uses tiny shapes, whose thousands of small ops each pay an OpenMP barrier with
  more threads — 3-10x slower on a busy 2-core machine.
- Fixtures shared by the CLI/train/infer tests (helpers in ``tests/train/k3_runs.py``), and ``nan_empty``.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

_spec = importlib.util.spec_from_file_location("k3_runs", Path(__file__).parent / "train" / "k3_runs.py")
k3_runs = sys.modules.setdefault("k3_runs", importlib.util.module_from_spec(_spec))
if not hasattr(k3_runs, "run_cli"):
    _spec.loader.exec_module(k3_runs)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The whole suite on a CPU machine (`python -m pytest`, no paths, no ``-n``): one test process per core, at most
    4, with pytest-xdist when it is installed (the ``test`` extra). Every test runs on one intra-op thread, so the
    processes do not compete for cores; a module's tests stay in one process, so module-scoped fixtures (a trained
    run, a server) are built once. ``-n 0`` or ``-p no:xdist`` runs serially; GPU machines always do."""
    if hasattr(config, "workerinput") or "PYTEST_XDIST_WORKER" in os.environ:  # a worker runs its share serially
        return
    if (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None) is None
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("collectonly")
            and not torch.cuda.is_available()):
        config.option.numprocesses, config.option.maxprocesses, config.option.dist = "auto", 4, "loadscope"


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a GPU machine no test module may turn the interpreter on: kernels decorated after that would run
    interpreted on CUDA tensors (the GPU tests then take hours instead of seconds, as they once did)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1":
        raise pytest.UsageError("TRITON_INTERPRET=1 was set on a machine with a GPU (by a test module at import, or "
                                "by the caller): the GPU tests would run in Triton's interpreter")


@pytest.fixture(scope="session")
def runs_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "k3_runs"


@pytest.fixture(scope="session")
def tiny_run(runs_base: Path) -> Path:
    """A 4-step text run of preset tiny (checkpoint at step 4), trained once per session. Do not modify it."""
    with k3_runs.one_thread():
        return k3_runs.cached_run(runs_base, "tiny_text", "--steps", "4", *k3_runs.FAST)


@pytest.fixture
def nan_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Poison uninitialised memory: torch.empty / torch.empty_like return NaN-filled float tensors, so an element a
    kernel should write but does not shows up in the comparison instead of hiding as a plausible value."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            with torch.no_grad():  # also a leaf made with requires_grad=True (checkpointing's placeholder)
                x.fill_(float("nan"))
        return x

    def empty(*a, **kw):
        return poison(real_empty(*a, **kw))

    def empty_like(*a, **kw):
        return poison(real_like(*a, **kw))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
