"""The Latent MoE router (SPEC §5): fp32 sigmoid scores on the full-d token, selection by top-k of score + bias,
weights renormalised from the UNBIASED scores, and (in training) the Quantile Balancing histogram of the step.

Letters: m tokens, d hidden, n experts, k top-k.
"""

from __future__ import annotations

import torch

from k3.ops.moe.qb import qb_accumulate

__all__ = ["route", "route_reference"]


def route_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    hist: torch.Tensor | None = None,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch router.

    x ``[m, d]``, weight ``[n, d]``, bias ``[n]`` fp32 (no gradient). Returns ``(idx [m, k] int64,
    p [m, k] fp32)`` with ``p`` renormalised over the selected experts from the unbiased sigmoid scores.
    When ``hist [n, num_bins] int32`` is given, the QB histogram of r_ij = α_i − s_ij (α_i = the (k+1)-th largest
    biased score of token i) is accumulated into it in place.
    """
    m = x.shape[0]
    s = torch.sigmoid(x.float() @ weight.float().t())  # [m, n] fp32
    biased = s.detach() + bias.float()
    want = top_k + 1 if hist is not None else top_k
    top = torch.topk(biased, want, dim=-1)
    idx = top.indices[:, :top_k]
    p = s.gather(1, idx)
    p = p / p.sum(-1, keepdim=True) * scaling
    if hist is not None and m > 0:
        qb_accumulate(top.values[:, top_k:top_k + 1] - s.detach(), bias, hist)  # r_ij = α_i − s_ij
    return idx, p


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    hist: torch.Tensor | None = None,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point used by the MoE layer (fused kernels on CUDA are plugged in here)."""
    return route_reference(x, weight, bias, top_k, hist=hist, scaling=scaling)
