"""Block Attention Residuals mix (docs/architecture.md#block-attention-residuals), the plain fp32 reference.

    mix(w, γ; v_1..v_N) = Σ_i softmax_i(⟨γ ⊙ w, RMS(v_i)⟩) · v_i,    RMS(v) = v / sqrt(mean(v²) + eps)

No 1/√d; the raw v_i are mixed; all in fp32, cast back to the sources' dtype.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["attn_res"]


def attn_res(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor] | torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Mix ``sources`` (a list of ``[..., D]`` tensors, or one stacked ``[N, ..., D]``) with pseudo-query ``query [D]``."""
    if isinstance(sources, torch.Tensor):
        if sources.dim() < 2:
            raise ValueError(f"sources as a tensor must be [N, ..., D], got shape {tuple(sources.shape)}")
        sources = list(sources.unbind(0))
    if len(sources) == 0:
        raise ValueError("sources must hold at least one tensor")
    shape = sources[0].shape
    for i, s in enumerate(sources):
        if s.shape != shape:
            raise ValueError(f"sources[{i}] has shape {tuple(s.shape)}, expected {tuple(shape)} like sources[0]")
    D = shape[-1]
    if query.shape != (D,):
        raise ValueError(f"query must be [D] = [{D}], got {tuple(query.shape)}")
    if norm_weight is not None and norm_weight.shape != (D,):
        raise ValueError(f"norm_weight must be [D] = [{D}], got {tuple(norm_weight.shape)}")
    # fp32 mixing (fp64 when the sources are fp64, so the op can serve as its own fp64 reference)
    acc = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    w = query.to(acc) if norm_weight is None else query.to(acc) * norm_weight.to(acc)
    v = torch.stack([s.to(acc) for s in sources])  # [N, ..., D]
    r = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax((r * w).sum(-1), dim=0)  # over sources
    return (p.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)
