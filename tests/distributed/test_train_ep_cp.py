"""`k3 train` with expert and context parallel (gloo, CPU, forked ranks with torchrun's environment): the first 10
losses and gradient norms of ep 2 (4 ranks: dp_shard 4, experts over 2), cp 2, and ep 2 × cp 2 (2 ranks) equal one
process on the same global batch (|Δ| < 1e-4)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (DTensor/FSDP import it on first use: once here, not in every forked rank)
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401

import k3_runs

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", Path(__file__).with_name("_gloo.py"))
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)

ARGS = ["--batch-size", "4", "--seq-len", "16", "--no-plot", "--sample-tokens", "0", "--eval-batches", "1",
        "--log-every", "1", "--warmup", "2", "--steps", "10"]


def _cli_rank(rank: int, world: int, argv: list[str]) -> None:
    from k3.cli import main

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    assert main(argv) == 0


def _metric(run: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ep_cp") / "one"
    with k3_runs.one_thread():
        code, _, err = k3_runs.run_cli("train", "--out", str(run), *ARGS)
    assert code == 0, err
    return run


@pytest.mark.parametrize("world, flags", [(4, ["--ep", "2"]), (2, ["--cp", "2"]), (2, ["--ep", "2", "--cp", "2"])],
                         ids=["ep2-of-dp4", "cp2", "ep2xcp2"])
def test_layout_equals_one_process(one_process: Path, tmp_path: Path, world: int, flags: list[str]) -> None:
    run = tmp_path / "run"
    _gloo.run_ranks(_cli_rank, world, ["train", "--out", str(run), *flags, *ARGS])
    for key in ("loss", "grad_norm"):
        got, want = _metric(run, key), _metric(one_process, key)
        assert len(got) == len(want) == 10 and max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (key, got, want)
