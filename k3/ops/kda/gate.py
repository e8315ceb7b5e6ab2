"""KDA's bounded forget gate (SPEC §2): g = lower_bound · sigmoid(exp(A_log_h) · (f + dt_bias_h)) ∈ (lower_bound, 0).

α = exp(g) ∈ (e^lower_bound, 1): the bound is what keeps 16-token decay products representable in bf16.
"""

from __future__ import annotations

import torch

__all__ = ["kda_gate", "check_lower_bound"]


def check_lower_bound(lower_bound: float) -> float:
    lb = float(lower_bound)
    if not (-5.0 <= lb < 0.0):
        raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    return lb


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Log-decay g (fp32) from raw gate pre-activations ``f [..., H, K]``; ``A_log [H]``, ``dt_bias [H*K]``."""
    lb = check_lower_bound(lower_bound)
    H, K = f.shape[-2], f.shape[-1]
    x = f.float()
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must have H*K = {H * K} elements, got shape {tuple(dt_bias.shape)}")
        x = x + dt_bias.float().reshape(H, K)
    if A_log is not None:
        if A_log.numel() != H:
            raise ValueError(f"A_log must have H = {H} elements, got shape {tuple(A_log.shape)}")
        x = x * A_log.float().reshape(H, 1).exp()
    return lb * torch.sigmoid(x)
