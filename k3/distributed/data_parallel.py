"""Data parallel training over a ``torch.distributed`` group (``torchrun --nproc_per_node N k3 train …``).

The model stays a plain single-device module (so ``qb_step``, ``num_parameters`` and checkpointing see the same
object on one process or many); after each step's backward, :func:`all_reduce_grads` averages the gradients over
the group in a few flat buckets. Every rank draws the same global batch from an identically seeded loader and keeps
its own rows (:func:`rank_rows`), so the loader state — and therefore a checkpoint written by rank 0 — is the same
on every rank, and N ranks × B rows reproduce one process with N·B rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

__all__ = ["DataParallel", "init_from_env", "all_reduce_grads", "rank_rows", "mean_over"]

_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class DataParallel:
    """Where this process sits: ``group`` is None for a single process."""

    group: Any = None
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env(device: torch.device) -> tuple[DataParallel, torch.device]:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1), NCCL on CUDA and gloo on CPU.

    Returns the layout and this rank's device (``cuda:LOCAL_RANK`` when ``device`` is CUDA). A single process
    (no ``WORLD_SIZE`` or 1) gets ``DataParallel()`` and ``device`` unchanged.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DataParallel(), device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DataParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size()), device


def _buckets(grads: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """Consecutive same-dtype gradients, at most ~64 MiB per bucket."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or size + g.numel() * g.element_size() > _BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        yield bucket


def all_reduce_grads(params: Iterable[torch.nn.Parameter], dp: DataParallel) -> None:
    """Average ``.grad`` over the group, in place. Parameters without a gradient are skipped: which ones have none
    is fixed by the model's structure (e.g. layer 0's unused AttnRes pair), so it is the same on every rank."""
    if dp.group is None:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=dp.group)
        flat /= dp.world_size
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def rank_rows(x: torch.Tensor, dp: DataParallel) -> torch.Tensor:
    """This rank's rows of a global batch ``[world·B, …]``."""
    if dp.group is None:
        return x
    b = x.shape[0] // dp.world_size
    return x[dp.rank * b:(dp.rank + 1) * b]


def mean_over(value: float, dp: DataParallel) -> float:
    """The mean of a per-rank scalar over the group (for logging)."""
    if dp.group is None:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend(dp.group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, group=dp.group)
    return float(t.item()) / dp.world_size
