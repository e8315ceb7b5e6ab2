"""Weighted combine of expert outputs followed by the latent RMSNorm (SPEC §5 step 4):
u = Σ_{i∈T} p_i E_i(z),  then RMSNorm(u) (with gain, eps 1e-5) — the norm that keeps the four chained matmuls
W↓ → W1/W3 → W2 → W↑ from blowing up."""

from __future__ import annotations

import torch

__all__ = ["combine_norm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics, result in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def combine_norm(
    y_rows: torch.Tensor,
    order: torch.Tensor,
    p: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``y_rows [m*k, ℓ]`` expert outputs in expert-sorted order, ``order [m*k]`` from ``sort_by_expert``,
    ``p [m, k]`` fp32 routing weights → ``RMSNorm(u) [m, ℓ]`` in y_rows.dtype.

    The bf16 expert output is rounded before the fp32 weight is applied, as in the reference implementation.
    """
    m, k = p.shape
    y = torch.empty_like(y_rows)
    y[order] = y_rows  # back to (token, slot) order
    u = (y.view(m, k, -1).float() * p.unsqueeze(-1)).sum(1)
    return rms_norm(u.to(y_rows.dtype), norm_weight, eps)
