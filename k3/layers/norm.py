"""RMSNorm with fp32 statistics: y = x / sqrt(mean(x²) + eps) · γ, computed in fp32, cast back to x.dtype
(docs/architecture.md#numerics); the fused Triton kernels of ``k3.ops.norm`` on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.norm import rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``weight [dim]`` (ones at init). Also used as the bare gain γ of the AttnRes pairs (``*_res_norm``)."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` → ``[..., dim]`` in x.dtype."""
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
