"""One GPU: bf16 parameters with their fp32 master weights beside them, instead of FSDP2 on one rank.

The precision policy is FSDP2's (``parallelize``): bf16 forward and backward, fp32 master weights and optimizer
state, gradients reduced in fp32. On one rank FSDP2 carries it out with copies that move nothing between ranks —
every step it casts each fp32 weight to bf16 and copies it twice (into its all-gather buffer and out to the layer),
and casts every bf16 gradient up into an fp32 buffer: ~9 ms of ``small``'s ~180 ms step on an H200. Here the
parameters *are* the bf16 compute weights, autograd writes bf16 gradients straight into ``.grad``, and each
parameter carries its fp32 master (``master_of``); the optimizer updates the master from the bf16 gradient and
writes the new bf16 weight in the same pass (``k3.ops.optim.adamw_master_step``; Muon updates the masters and copies
them over).

Gradients of several micro-batches are summed in fp32 (``accumulate_grads`` after each backward moves ``.grad``
into the master's ``.grad``); ``grad_of`` is the gradient the optimizer and the clipping read. Checkpoints hold the
masters under the parameters' names (``masters_by_name``, used by ``k3.distributed.checkpoint``): the same files as
FSDP2's fp32 shards, so a run resumes on either path. The parameters K3 keeps in fp32 (``k3.model.keeps_fp32``)
have no master: they are their own.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.model import keeps_fp32

__all__ = ["apply_master_weights", "master_of", "has_masters", "grad_of", "accumulate_grads", "release_grads",
           "sync_from_masters", "masters_by_name"]

_ATTR = "_k3_master"


def apply_master_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Turn ``model``'s fp32 parameters (but those kept in fp32) into ``dtype`` compute weights in place (the same
    ``Parameter`` objects), each keeping its fp32 values as its master."""
    for name, p in model.named_parameters():
        if keeps_fp32(name) or p.dtype != torch.float32:
            continue
        master = p.detach()  # the fp32 storage itself: the parameter takes a new one in ``dtype``
        with torch.no_grad():
            p.data = master.to(dtype)
        setattr(p, _ATTR, master)


def master_of(p: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master weight of a compute parameter, or None (the parameter is its own master)."""
    return getattr(p, _ATTR, None)


def has_masters(params: list[torch.Tensor]) -> bool:
    return any(master_of(p) is not None for p in params)


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient to step on: the fp32 sum of the micro-batches when ``accumulate_grads`` ran, else ``.grad``."""
    m = master_of(p)
    if m is not None and m.grad is not None:
        return m.grad
    return p.grad


@torch.no_grad()
def accumulate_grads(params: list[torch.Tensor]) -> None:
    """Move every compute parameter's ``.grad`` into an fp32 sum on its master (call after each micro-batch's
    backward when there are several: the next backward then starts from no gradient, and the sum is exact to fp32
    instead of rounded to bf16 at every micro-batch)."""
    into, rest = [], []
    for p in params:
        m = master_of(p)
        if m is None or p.grad is None:
            continue
        if m.grad is None:
            m.grad = p.grad.float()
        else:
            into.append(m.grad)
            rest.append(p.grad)
        p.grad = None
    if into:
        torch._foreach_add_(into, rest)


def release_grads(params: list[torch.Tensor]) -> None:
    """Drop the fp32 gradient sums (after the optimizer step)."""
    for p in params:
        m = master_of(p)
        if m is not None:
            m.grad = None


@torch.no_grad()
def sync_from_masters(params: list[torch.Tensor]) -> None:
    """Round every master into its compute parameter (after the masters changed outside the fused update)."""
    pairs = [(p, m) for p in params if (m := master_of(p)) is not None]
    if pairs:
        torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])


def masters_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: fp32 master}`` for the parameters that have one."""
    return {n: m for n, p in model.named_parameters() if (m := master_of(p)) is not None}
