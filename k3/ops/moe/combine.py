"""Weighted combine of expert outputs followed by the latent RMSNorm (docs/architecture.md#latent-rmsnorm):
u = Σ_{i∈T} p_i E_i(z),  then RMSNorm(u) (with gain, eps 1e-5) — the norm that keeps the four chained matmuls
W↓ → W1/W3 → W2 → W↑ from blowing up.

``combine_norm_reference`` is the plain PyTorch ground truth; ``combine_norm`` dispatches to the fused Triton
kernels (``combine_triton.py``) on CUDA tensors. ``combine_norm_rows`` takes the row of each (token, slot) directly
(e.g. ``arange`` when the expert outputs already come back in token order, as after the expert-parallel combine).
"""

from __future__ import annotations

import torch

from k3.ops._device import on_device_of
from k3.ops.moe._backend import use_triton
from k3.ops.norm import rms_norm_reference

__all__ = ["combine_norm", "combine_norm_reference", "combine_norm_rows"]


def _check(y_rows: torch.Tensor, index: torch.Tensor, p: torch.Tensor, norm_weight: torch.Tensor | None,
           eps: float, name: str) -> None:
    if not isinstance(p, torch.Tensor) or p.dim() != 2:
        raise ValueError(f"p must be [m tokens, k] routing weights, got {tuple(getattr(p, 'shape', ()))}")
    m, k = p.shape
    if not isinstance(y_rows, torch.Tensor) or y_rows.dim() != 2 or y_rows.shape[0] < m * k:
        raise ValueError(f"y_rows must be [R >= m*k = {m * k}, ℓ], got {tuple(getattr(y_rows, 'shape', ()))}")
    if not isinstance(index, torch.Tensor) or index.numel() != m * k or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an integer tensor with m*k = {m * k} entries, got "
                         f"{getattr(index, 'dtype', None)} {tuple(getattr(index, 'shape', ()))}")
    if norm_weight is not None and norm_weight.shape != (y_rows.shape[1],):
        raise ValueError(f"norm_weight must be [ℓ={y_rows.shape[1]}], got {tuple(norm_weight.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")


def combine_norm_reference(
    y_rows: torch.Tensor, order: torch.Tensor, p: torch.Tensor, norm_weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``y_rows [m*k, ℓ]`` expert outputs in expert-sorted order, ``order [m*k]`` from ``sort_by_expert``,
    ``p [m, k]`` fp32 routing weights → ``RMSNorm(u) [m, ℓ]`` in y_rows.dtype.

    The bf16 expert output is rounded before the fp32 weight is applied, as in the reference implementation.
    """
    m, k = p.shape
    y = torch.empty_like(y_rows[: m * k])
    y[order] = y_rows[: m * k]  # back to (token, slot) order
    u = (y.view(m, k, -1).float() * p.unsqueeze(-1)).sum(1)
    return rms_norm_reference(u.to(y_rows.dtype), norm_weight, eps)


def combine_norm_rows(
    y_rows: torch.Tensor, row_of: torch.Tensor, p: torch.Tensor, norm_weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Like ``combine_norm`` but ``row_of [m, k]`` names the y row of each (token, slot) directly."""
    _check(y_rows, row_of, p, norm_weight, eps, "row_of")
    m, k = p.shape
    if norm_weight is None:
        norm_weight = torch.ones(y_rows.shape[1], device=y_rows.device)
    if use_triton(y_rows):
        from k3.ops.moe.combine_triton import combine_norm_fused

        with on_device_of(y_rows):
            return combine_norm_fused(y_rows, row_of.reshape(m, k).long(), p, norm_weight, eps)
    y = y_rows[row_of.reshape(-1).long()]
    u = (y.view(m, k, -1).float() * p.unsqueeze(-1)).sum(1)
    return rms_norm_reference(u.to(y_rows.dtype), norm_weight, eps)


def combine_norm(
    y_rows: torch.Tensor, order: torch.Tensor, p: torch.Tensor, norm_weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Same contract as ``combine_norm_reference``; fused Triton kernels on CUDA (no unpermuted copy)."""
    _check(y_rows, order, p, norm_weight, eps, "order")
    if not use_triton(y_rows):
        return combine_norm_reference(y_rows, order, p, norm_weight, eps)
    m, k = p.shape
    row_of = torch.empty(m * k, dtype=torch.int64, device=order.device)
    row_of[order.long()] = torch.arange(m * k, device=order.device)  # inverse permutation, on device
    return combine_norm_rows(y_rows, row_of, p, norm_weight, eps)
