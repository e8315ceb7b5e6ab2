"""Next-token loss: fused linear + cross-entropy (no [tokens, vocab] logits held) beside the plain reference.

``linear_cross_entropy``            the fused chunked op on CUDA, the reference elsewhere.
``linear_cross_entropy_reference``  logits, then fp32 ``F.cross_entropy``.
"""

from __future__ import annotations

import torch

from k3.ops.loss.fused import linear_cross_entropy_fused
from k3.ops.loss.naive import linear_cross_entropy_reference

__all__ = ["linear_cross_entropy", "linear_cross_entropy_fused", "linear_cross_entropy_reference"]


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy (fp32) of ``hidden [..., d] @ weight [V, d]ᵀ`` against ``targets [...]`` over the targets
    that are not ``ignore_index`` (0 when there are none). Differentiable in ``hidden`` and ``weight``."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1 or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be a floating-point [..., d] tensor, got {getattr(hidden, 'dtype', hidden)}")
    d = hidden.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight must be [V, d={d}], got {tuple(getattr(weight, 'shape', ()))}")
    if not isinstance(targets, torch.Tensor) or targets.shape != hidden.shape[:-1] or targets.dtype.is_floating_point:
        raise ValueError(f"targets must be an integer tensor shaped {tuple(hidden.shape[:-1])}, got "
                         f"{getattr(targets, 'dtype', None)} {tuple(getattr(targets, 'shape', ()))}")
    h, t = hidden.reshape(-1, d), targets.reshape(-1)
    if hidden.is_cuda:
        return linear_cross_entropy_fused(h, weight, t, ignore_index)
    return linear_cross_entropy_reference(h, weight, t, ignore_index)
