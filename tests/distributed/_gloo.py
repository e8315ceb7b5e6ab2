"""Run a function on N gloo ranks (CPU processes) for the distributed tests."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args) -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` forked processes joined in one gloo group; a failing
    assertion in any rank fails the caller.

    Fork, not spawn: pytest runs with ``--import-mode=importlib``, so test modules cannot be re-imported by name in
    a spawned child. Children set one intra-op thread before any torch work (no OpenMP pool after fork)."""
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="fork")
