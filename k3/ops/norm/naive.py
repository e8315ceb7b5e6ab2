"""RMSNorm with fp32 statistics, the plain reference: y = x · rsqrt(mean(x²) + eps) · w, in fp32, cast to x.dtype."""

from __future__ import annotations

import torch

__all__ = ["rms_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x [..., D]``, ``weight [D]`` or None (no gain) → ``[..., D]`` in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)
