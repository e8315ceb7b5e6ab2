"""Shared by the multi-GPU benchmark scripts: process group from torchrun's environment (NCCL on CUDA, gloo on
CPU for ``--smoke``), timing (CUDA events; wall clock on CPU), the slowest rank's value, results as JSON + markdown
with the hardware, versions and exact command."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (see the device notes)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def init(smoke: bool) -> tuple[int, int, torch.device]:
    """Join torchrun's group (a single process without torchrun gets a 1-rank group). Returns rank, world, device."""
    cuda = torch.cuda.is_available() and not smoke
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


def log(*a: Any) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def gather_ints(x: int) -> list[int]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, int(x))
    return out


def timed(fn: Callable[[], Any], device: torch.device, n: int = 5, warmup: int = 2) -> float:
    """Median milliseconds over ``n`` runs, every rank in step; the slowest rank's median."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        dist.barrier()
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return slowest(statistics.median(ts))


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "world_size": dist.get_world_size(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}


def write(out: Path, name: str, report: dict[str, Any], markdown: list[str]) -> None:
    """``out/name.json`` and ``out/name.md`` (rank 0)."""
    if dist.get_rank() != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    env = report["env"]
    head = [f"# {name} ({env['world_size']} × {env['device']})", "",
            f"torch {env['torch']}, triton {env['triton']}, Python {env['python']}; command: "
            f"`torchrun --nproc_per_node {env['world_size']} bench/multi_gpu/{env['command']}`", ""]
    (out / f"{name}.md").write_text("\n".join(head + markdown) + "\n")
    print("\n".join(markdown), flush=True)
