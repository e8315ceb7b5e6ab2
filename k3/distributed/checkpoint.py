"""Checkpoints of runs with a process group (any GPU run, torchrun on CPUs): ``torch.distributed.checkpoint``.

Layout of ``checkpoints/step-NNNNNNNN/`` (published by ``k3.ckpt.run.publish_checkpoint``: staged in a hidden
directory, manifest written last, one atomic rename — a rank killed mid-save leaves the previous step intact)::

    dcp/                 model + optimizer state, each rank writing its own shards (``dcp.save``); any layout —
                         other degrees, another world size, one process without a process group — reads them back
                         (``dcp.load`` reshards), and ``k3.ckpt.run.load_checkpoint`` (``k3 generate --run``)
                         reads the model part in one process
    trainer.pt           step, data position, rank 0's RNG states (the loader state is the same on every rank)
    rng/rank-NNNNN.pt    every rank's RNG states (a resumed rank takes its own, or rank 0's when the world grew)
    config.json, run.json, tokenizer_spec.json, checkpoint.json (manifest)

Model and optimizer state go through ``get_state_dict`` / ``set_state_dict`` (FQN-keyed, DTensor shards as they are
on this rank), so FSDP2 shards, expert-parallel shards and plain tensors are all handled by PyTorch's own code. One
GPU's bf16 parameters are saved as, and loaded into, their fp32 masters (``k3.distributed.master_weights``): the
model part is fp32 on every layout.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from k3.ckpt.run import (DCP_DIR, CheckpointError, publish_checkpoint, rng_state, set_rng_state,
                         stage_checkpoint, torch_save_hashed)
from k3.distributed.data_parallel import Distributed
from k3.distributed.master_weights import masters_by_name
from k3.utils import interrupts_deferred, sha256_file

__all__ = ["is_distributed_checkpoint", "save_distributed_checkpoint", "load_distributed_checkpoint",
           "shard_optimizer_state"]

_OWNER = "ranks"  # the staging directory's writer: the run's process group (one per run, under its lock)


def is_distributed_checkpoint(ckpt: Path) -> bool:
    return (Path(ckpt) / DCP_DIR / ".metadata").is_file()


def _barrier(d: Distributed) -> None:
    if d.mesh is not None and d.world_size > 1:
        dist.barrier()


def save_distributed_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                                config: Any, tokenizer: Any, trainer_state: dict[str, Any],
                                run_args: dict[str, Any], keep: int, d: Distributed) -> Path:
    """Collective: every rank calls it. ``trainer_state`` (rank 0's) must not hold the optimizer. A Ctrl-C
    during it stops the run after it (``interrupts_deferred``), every rank having finished the collective save."""
    with interrupts_deferred():
        tmp = Path(run_dir) / "checkpoints" / f".tmp-step-{step:08d}-{_OWNER}"
        if d.is_main:
            tmp = stage_checkpoint(run_dir, step, owner=_OWNER)
        _barrier(d)  # the staging directory exists (and a killed save's is gone) before anyone writes
        model_sd, optim_sd = get_state_dict(model, opt)
        model_sd.update(masters_by_name(model))  # one GPU's bf16 parameters are saved as their fp32 masters
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
        (tmp / "rng").mkdir(exist_ok=True)
        rng = tmp / "rng" / f"rank-{d.rank:05d}.pt"
        # each rank hashes the files it wrote, in parallel; rank 0's manifest reads only the rest
        mine = {f.relative_to(tmp).as_posix(): sha256_file(f) for f in (tmp / DCP_DIR).glob(f"__{d.rank}_*")}
        mine[rng.relative_to(tmp).as_posix()] = torch_save_hashed(rng, rng_state())
        digests = _gather_digests(mine, d)
        final = Path(run_dir) / "checkpoints" / f"step-{step:08d}"
        if d.is_main:
            digests["trainer.pt"] = torch_save_hashed(tmp / "trainer.pt", trainer_state)
            final = publish_checkpoint(tmp, step, config, tokenizer, run_args, keep, digests)
        _barrier(d)  # nobody moves on (or exits) before the checkpoint is published
        return final


def _gather_digests(mine: dict[str, str], d: Distributed) -> dict[str, str]:
    """Every rank's file digests, on every rank (the gather is also the barrier: all files are complete)."""
    if d.mesh is None or d.world_size == 1:
        return mine
    every: list[Any] = [None] * d.world_size
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def _saved_keys(path: Path) -> set[str]:
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _only_saved(state: dict[str, Any], saved: set[str], prefix: str) -> dict[str, Any]:
    """The optimizer state entries the checkpoint holds. Parameters that never received a gradient (the first
    layer's unused AttnRes pair) have no optimizer state in a run, but ``get_state_dict`` initialises one for every
    parameter; those entries are dropped so the optimizer resumes exactly as it was."""
    kept = {}
    for fqn, entries in state["state"].items():
        entries = {k: v for k, v in entries.items() if f"{prefix}.state.{fqn}.{k}" in saved}
        if entries:
            kept[fqn] = entries
    return {**state, "state": kept}


def load_distributed_checkpoint(ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                                d: Distributed) -> None:
    """Load a ``dcp/`` checkpoint into this rank's (parallelized) model and optimizer, whatever layout wrote it;
    restore this rank's RNG states. Collective when there is a process group."""
    path = Path(ckpt) / DCP_DIR
    model_sd, optim_sd = get_state_dict(model, opt)
    model_sd.update(masters_by_name(model))  # read into the fp32 masters; set_state_dict rounds them into the model
    optim_sd = _only_saved(optim_sd, _saved_keys(path), "optim")
    try:
        with warnings.catch_warnings():  # one process without a group: DCP warns that it loads locally
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=d.mesh is None)
    except Exception as e:  # DCP raises several types for missing keys and unreadable shards
        raise CheckpointError(f"checkpoint {ckpt}: {DCP_DIR}/ does not match this model and optimizer "
                              f"({type(e).__name__}: {str(e)[:300]})") from None
    # not strict: parameters that never had a gradient keep no optimizer state (see _only_saved)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(strict=False))
    rng = Path(ckpt) / "rng" / f"rank-{d.rank:05d}.pt"
    if not rng.is_file():
        rng = Path(ckpt) / "rng" / "rank-00000.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, map_location="cpu", weights_only=True))


@torch.no_grad()
def shard_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """After ``opt.load_state_dict`` of a single-process checkpoint: turn the full state tensors of sharded
    (DTensor) parameters into this rank's shards, laid out like the parameter (local slicing, no communication)."""
    for p, state in opt.state.items():
        if not isinstance(p, DTensor):
            continue
        for k, v in list(state.items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape):
                state[k] = distribute_tensor(v.to(p.to_local().device), p.device_mesh, p.placements,
                                             src_data_rank=None)
