"""AttnRes mixes that sum their sources' gradients in one buffer per source tensor, inside the backward kernel.

In a model every closed block is a source of every later mix (``small``: up to 24 mixes read one block), so
autograd would receive one ``∂v`` tensor per mix and add them pairwise: a full read-read-write pass over ``[B, T, d]``
per extra mix, about 3 % of ``small``'s training step. Here each source tensor has a :class:`GradSink`; the first
mix to run its backward writes ``∂v`` into a new buffer, every later one adds to it in the kernel (one extra read
instead of a separate add), and only the sink's *owner* — the tensor's earliest consumer in the forward — hands the
buffer to autograd. The others return no gradient for that source.

Why the owner runs last: each mix's output feeds a sublayer whose output joins the residual stream that every later
mix reads, so autograd runs the mixes' backwards in exactly the reverse of their forward order. Non-reentrant
activation checkpointing re-runs forwards inside the backward; those re-runs find the owner already set and
their nodes never run a backward, so recomputation changes nothing. A sink lives as long as its tensor's forward
graph; a backward that stops before reaching the owner (``torch.autograd.grad`` of an intermediate) leaves a
partial sum behind, which the next backward through the same graph would add to — call the forward again instead.
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3.ops.attnres.checks import check_inputs
from k3.ops.attnres import op as _op  # noqa: F401  (registers torch.ops.k3.attn_res_fwd)
from k3.ops.attnres.fused import attn_res_bwd

__all__ = ["GradSink", "attn_res_sinked"]


class GradSink:
    """The gradient of one source tensor, summed over the mixes that read it."""

    __slots__ = ("buf", "owner")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.owner: object | None = None


class _SinkedMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qw: torch.Tensor, onw: torch.Tensor | None, eps: float, sinks: tuple[GradSink, ...],
                *sources: torch.Tensor) -> torch.Tensor:
        shape, D = sources[0].shape, sources[0].shape[-1]
        flat = [s.reshape(-1, D).contiguous() for s in sources]
        # the registered op (not the kernel wrapper): selective activation checkpointing saves k3 ops' outputs
        y, _, lse, logit, rstd = torch.ops.k3.attn_res_fwd(flat, qw, onw, eps, 1.0, False)
        ctx.save_for_backward(qw, onw, lse, logit, rstd, *flat)
        ctx.eps, ctx.shape, ctx.sinks, ctx.token = eps, shape, sinks, object()
        for sink in sinks:
            if sink.owner is None:  # the earliest consumer; a checkpoint's re-run finds it set
                sink.owner = ctx.token
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # noqa: ANN205
        qw, onw, lse, logit, rstd, *flat = ctx.saved_tensors
        into = [s.buf for s in ctx.sinks]
        dsrc, dqw, dow = attn_res_bwd(dy.reshape(flat[0].shape).contiguous(), flat, qw, onw, lse.new_empty(0), lse,
                                      logit, rstd, ctx.eps, 1.0, False, into=into)
        grads: list[torch.Tensor | None] = []
        for sink, buf in zip(ctx.sinks, dsrc):
            if sink.owner is ctx.token:
                sink.buf = None
                grads.append(buf.view(ctx.shape))
            else:
                sink.buf = buf
                grads.append(None)
        return dqw, (dow.to(onw.dtype) if onw is not None else None), None, None, *grads


def attn_res_sinked(query: torch.Tensor, sources: Sequence[torch.Tensor], sinks: Sequence[GradSink],
                    norm_weight: torch.Tensor | None, eps: float,
                    out_norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`k3.ops.attn_res` (same arguments and checks) on the fused kernels whatever the device, with ``sinks[i]``
    collecting ``sources[i]``'s gradient across every mix given that sink; the sources must be distinct tensors."""
    sources = check_inputs(query, sources, norm_weight, out_norm_weight, eps)
    if len(sinks) != len(sources):
        raise ValueError(f"sinks must have one entry per source, got {len(sinks)} for {len(sources)} sources")
    if len({id(s) for s in sources}) != len(sources) or len({id(s) for s in sinks}) != len(sinks):
        raise ValueError("sources must be distinct tensors, each with its own sink")
    qw = query.float() if norm_weight is None else query.float() * norm_weight.float()
    return _SinkedMix.apply(qw, out_norm_weight, float(eps), tuple(sinks), *sources)
