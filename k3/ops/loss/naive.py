"""Linear + cross-entropy, the plain reference: logits = h Wᵀ in the weights' dtype, cross entropy in fp32, mean over
the targets that are not ``ignore_index`` (0 when there are none)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy_reference"]


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """``hidden [N, d]``, ``weight [V, d]``, ``targets [N]`` → fp32 scalar."""
    logits = F.linear(hidden, weight).float()
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    return total / (targets != ignore_index).sum().clamp(min=1)
