"""The Latent MoE router (docs/architecture.md#router): fp32 sigmoid scores on the full-d token, selection by
top-k of score + bias, weights renormalised from the UNBIASED scores, and (in training) the Quantile Balancing
histogram of the step.

Letters: m tokens, d hidden, n experts, k top-k.

``route_reference`` is the plain PyTorch ground truth. ``route`` validates its inputs and dispatches to the fused
Triton epilogue (``router_triton.py``) on CUDA tensors; both return the same ``(idx, p)`` and accumulate the same
histogram. Neither synchronises with the host, so the MoE forward stays CUDA-graph friendly.
"""

from __future__ import annotations

import torch

from k3.ops._device import on_device_of
from k3.ops.moe._backend import use_triton
from k3.ops.moe.qb import qb_accumulate, qb_range

__all__ = ["route", "route_reference", "check_route_inputs"]


def check_route_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, hist: torch.Tensor | None, scaling: float
) -> None:
    """Shape/dtype checks only (no data-dependent checks: those would synchronise with the host)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [m tokens, d], got {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [n_experts, d={x.shape[1]}], got {tuple(getattr(weight, 'shape', ()))}")
    n = weight.shape[0]
    if not isinstance(bias, torch.Tensor) or bias.shape != (n,):
        raise ValueError(f"bias must be [n_experts] = [{n}], got {tuple(getattr(bias, 'shape', ()))}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 < top_k < n:
        raise ValueError(f"top_k must be an integer in [1, n_experts={n}), got {top_k!r}")
    if hist is not None:
        if not isinstance(hist, torch.Tensor) or hist.dim() != 2 or hist.shape[0] != n or hist.dtype != torch.int32:
            raise ValueError(f"hist must be an int32 tensor [n_experts={n}, num_bins], got "
                             f"{getattr(hist, 'dtype', None)} {tuple(getattr(hist, 'shape', ()))}")
        if hist.shape[1] < 2 or not hist.is_contiguous() or hist.device != x.device:
            raise ValueError("hist must be contiguous, on x's device, with num_bins >= 2")
    if not isinstance(scaling, (int, float)) or not scaling == scaling or scaling in (float("inf"), float("-inf")):
        raise ValueError(f"scaling must be a finite number, got {scaling!r}")


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
    """The router used by the MoE layer: same contract as ``route_reference``; fused Triton epilogue on CUDA."""
    check_route_inputs(x, weight, bias, top_k, hist, scaling)
    if use_triton(x):
        from k3.ops.moe.router_triton import route_fused

        with on_device_of(x):
            hist_range = qb_range(bias) if hist is not None else None
            return route_fused(x, weight, bias, top_k, hist=hist, scaling=scaling, hist_range=hist_range)
    return route_reference(x, weight, bias, top_k, hist=hist, scaling=scaling)
