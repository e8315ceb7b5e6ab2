"""The released checkpoint across GPUs: expert-sharded loading and ``torchrun … -m k3 generate --model PATH``.

Each of the R ranks of an expert-parallel group opens only its own E/R experts' tensors from the safetensors
shards (``load_pretrained(..., experts=range(r·E/R, (r+1)·E/R))``: the other experts' bytes are never read) and
keeps them as they are stored (MXFP4: packed 4-bit codes + scales); the dense part — embeddings, KDA and MLA,
routers, shared experts, norms, lm_head — is loaded whole on every rank. Per-rank memory ≈ dense + experts / R.

The MoE layers then run expert parallel with replicated tokens (every rank decodes the same sequences): each rank
applies its experts to the rows routed to them and one fp32 all-reduce of ``[tokens, latent]`` per MoE layer sums
the partial outputs (``k3.distributed.expert_parallel``). Everything else is computed redundantly on every rank, so
every rank holds identical logits and samples the same token from the same seeded generator; rank 0 prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import atexit

import torch
import torch.distributed as dist
from torch import nn

from k3.ckpt.released import load_pretrained, read_released_config
from k3.distributed.data_parallel import destroy_distributed, init_distributed, world_size_from_env
from k3.distributed.expert_parallel import _group_of, apply_expert_parallel
from k3.distributed.parallel_dims import ParallelDims

__all__ = ["load_expert_sharded", "load_released_distributed"]


def load_expert_sharded(path: str | Path, ep_mesh: Any = None, device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None, dequantize: bool = False, verbose: bool = True,
                        tokens: str = "replicated", force_memory: bool = False) -> nn.Module:
    """``K3ForCausalLM`` from a released folder with this rank's share of the experts, expert parallel over
    ``ep_mesh`` (a 1-D DeviceMesh or a process group; None = the world). ``tokens``: see
    ``apply_expert_parallel`` ("replicated" for generation, "sharded" when each rank holds its own tokens)."""
    group, _ = _group_of(ep_mesh)
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    config, _ = read_released_config(path)
    E = config.n_experts
    if E % R:
        raise ValueError(f"the expert-parallel ranks ({R}) must divide the checkpoint's {E} experts "
                         f"(torchrun --nproc_per_node)")
    M = E // R
    model = load_pretrained(path, device=device, dtype=dtype, dequantize=dequantize, verbose=verbose and rank == 0,
                            force_memory=force_memory, experts=range(rank * M, (rank + 1) * M))
    apply_expert_parallel(model, ep_mesh, tokens=tokens)
    return model


def load_released_distributed(path: str | Path, device: torch.device, dtype: torch.dtype | None = None,
                              force_memory: bool = False) -> nn.Module:
    """For ``k3 generate --model PATH`` under torchrun (``WORLD_SIZE`` > 1): join the process group (NCCL on CUDA,
    gloo on CPU; left at exit), load expert-sharded over all ranks onto this rank's device."""
    world = world_size_from_env()
    d = init_distributed(device, ParallelDims(world_size=world, ep=world))
    atexit.register(destroy_distributed, d)
    return load_expert_sharded(path, d.mesh["ep"], device=d.device, dtype=dtype, force_memory=force_memory)
