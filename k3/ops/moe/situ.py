"""SiTU-GLU (SPEC §5): [β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)]; every output lies in (−β1·β2, β1·β2).

Computed in fp32 and cast back; SwiGLU to first order near 0.
"""

from __future__ import annotations

import torch

__all__ = ["situ_glu"]


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if not (beta1 > 0 and beta2 > 0):
        raise ValueError(f"beta1 and beta2 must be > 0, got {beta1}, {beta2}")
    dtype = gate.dtype
    g, u = gate.float(), up.float()
    y = (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    return y.to(dtype)
