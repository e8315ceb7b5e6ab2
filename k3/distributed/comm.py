"""Differentiable collectives shared by expert and context parallel (gloo on CPU, NCCL on CUDA).

``all_to_all_v(x, in_splits, out_splits, group)``  rows of ``x`` go to ranks by ``in_splits`` (host ints); its
    adjoint is the same call with the splits swapped.
``all_gather_rows(x, group)``  ``[R, *x.shape]``; backward sums every rank's gradient of row r onto rank r
    (reduce-scatter on NCCL; all-reduce + pick on gloo, which has no reduce-scatter).
``all_reduce_sum(x, group)``  forward sums over the group; backward passes the gradient through unchanged (every
    rank holds the same downstream loss, so d loss / d partial = d loss / d sum).
``reduce_grad(x, group)``  identity forward; backward sums the gradient over the group: the input of a computation
    every rank does a part of (Megatron's "copy to the parallel region"; the pair of ``all_reduce_sum``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_to_all_v", "all_gather_rows", "all_reduce_sum", "reduce_grad", "gather_tensor", "is_nccl"]


def is_nccl(group: Any) -> bool:
    return dist.get_backend(group) == "nccl"


def _a2a(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _a2a(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        in_splits, out_splits = ctx.splits
        return _a2a(grad, out_splits, in_splits, ctx.group), None, None, None


def all_to_all_v(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group: Any) -> torch.Tensor:
    """Variable all-to-all over dim 0: ``in_splits[r]`` leading rows of what is left go to rank r; ``out_splits[r]``
    rows arrive from rank r, in rank order. Differentiable when ``x`` needs grad."""
    if x.requires_grad and torch.is_grad_enabled():
        return _AllToAllV.apply(x, in_splits, out_splits, group)
    return _a2a(x, in_splits, out_splits, group)


def gather_tensor(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` → ``[R, *x.shape]`` (rank order), no autograd."""
    R = dist.get_world_size(group)
    x = x.contiguous()
    if is_nccl(group):
        out = x.new_empty((R, *x.shape))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(R)]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return gather_tensor(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        if is_nccl(ctx.group):
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
            return out, None
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[dist.get_rank(ctx.group)].clone(), None


def all_gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` → ``[R, *x.shape]``; differentiable (gradients reduce-scattered back to their owners)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _AllGatherRows.apply(x, group)
    return gather_tensor(x, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of ``x`` over the group (a new tensor); the gradient passes through (replicated downstream loss)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _AllReduceSum.apply(x, group)
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def reduce_grad(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` unchanged; its gradient is summed over the group in the backward."""
    if x.requires_grad and torch.is_grad_enabled():
        return _ReduceGrad.apply(x, group)
    return x
