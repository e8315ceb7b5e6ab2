"""Where a training process sits in a run, and the data side of parallel training.

``init_distributed`` joins (or, for one process on a GPU, creates) the process group and builds the run's
``DeviceMesh`` from a validated ``ParallelDims``. Every rank draws the same global batch from an identically seeded
loader and keeps its own part (:func:`local_batch`): its rows (``mesh["dp"]``) and, with context parallel, its
contiguous slice of every sequence (``mesh["cp"]``). The loader state is therefore the same on every rank, and N
ranks reproduce one process on the same global batch. Gradients are reduced by FSDP2 (``k3.distributed.parallelize``),
overlapped with the backward.
"""

from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from k3.distributed.parallel_dims import ParallelDims, ParallelMesh

__all__ = ["Distributed", "init_distributed", "world_size_from_env", "local_batch", "agree", "destroy_distributed"]

T = TypeVar("T")


@dataclass
class Distributed:
    """This process's place in the run. ``mesh`` is None for a single CPU process (no process group)."""

    dims: ParallelDims
    device: torch.device
    mesh: ParallelMesh | None = None
    rank: int = 0
    owns_group: bool = False  # the process group was created here (destroy it at the end)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def local_rank(self, view: str) -> int:
        return self.mesh.local_rank(view) if self.mesh is not None else 0

    def group(self, view: str) -> Any:
        return self.mesh.group(view) if self.mesh is not None else None


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 outside torchrun)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {raw!r}") from None
    if world < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1, got {world}")
    return world


def init_distributed(device: torch.device, dims: ParallelDims) -> Distributed:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU) and build the mesh.

    One process on a GPU gets a world-size-1 NCCL group of its own, so it runs the same FSDP2 code path as N ranks.
    One process on the CPU gets none (``mesh=None``): the plain fp32 module, no collective overhead.
    """
    world = dims.world_size
    if world == 1 and device.type == "cpu":
        return Distributed(dims=dims, device=device)
    if device.type == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else (device.index or 0)
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend)
        owns = True
        atexit.register(_free_groups)
    if dist.get_world_size() != world:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE says {world}")
    mesh = dims.build_mesh(device.type)
    if world > 1:
        # The mesh's subgroups are built through rank 0's store: a rank that fails (and exits) right after joining
        # must not take the store away from one that is still joining, or that one dies of a reset connection
        # instead of reporting the same error.
        dist.barrier()
    return Distributed(dims=dims, device=device, mesh=mesh, rank=dist.get_rank(), owns_group=owns)


def _free_groups() -> None:
    """Free the process groups while the interpreter is still whole. ``destroy_process_group`` unregisters them, but
    reference cycles (the device mesh, a traceback) can keep their C++ objects alive until the interpreter's
    teardown, when a gloo worker thread still releasing the tensors of the last collective needs the GIL that is
    gone: the process aborts ("terminate called without an active exception") after it has done its work. Freed
    here, each group joins its worker threads first."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def destroy_distributed(d: Distributed) -> None:
    if d.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def local_batch(t: torch.Tensor, d: Distributed) -> torch.Tensor:
    """This rank's part of a global batch ``[B, T, …]``: rows ``dp_rank·B/dp …``, tokens ``cp_rank·T/cp …``."""
    dp, cp = d.dims.dp, d.dims.cp
    if dp > 1:
        b = t.shape[0] // dp
        i = d.local_rank("dp")
        t = t[i * b:(i + 1) * b]
    if cp > 1:
        n = t.shape[1] // cp
        j = d.local_rank("cp")
        t = t[:, j * n:(j + 1) * n]
    return t


def agree(fn: Callable[[], T], d: Distributed) -> T:
    """Run ``fn`` on every rank; if it raises ``ValueError`` on any rank, raise it on every rank.

    A setup error seen by one rank only (a file it cannot read) would otherwise leave the others waiting in the next
    collective; this way each rank prints the same one-line error and exits 2."""
    mine: ValueError | None = None
    result: Any = None
    try:
        result = fn()
    except ValueError as e:
        mine = e
    if d.mesh is not None and d.world_size > 1:
        errors: list[Any] = [None] * d.world_size
        dist.all_gather_object(errors, None if mine is None else (str(mine) or type(mine).__name__))
        if mine is None and any(e is not None for e in errors):
            r, e = next((r, e) for r, e in enumerate(errors) if e is not None)
            raise ValueError(f"rank {r}: {e}")
    if mine is not None:
        raise mine
    return result
