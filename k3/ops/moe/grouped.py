"""Grouped GEMM for stacked experts and the token ↔ expert-row permutation.

Rows of ``a`` are sorted by expert; ``offs [E]`` (int32) holds each group's cumulative END row, so group e is rows
``offs[e-1]:offs[e]``. ``torch.nn.functional.grouped_mm`` does this on CUDA (bf16, SM80+); its CPU kernel needs
16-byte-aligned strides and has no reliable backward, so CPU runs a per-expert loop (same math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm", "sort_by_expert"]

_gmm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _loop_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        outs.append(a[start:end] @ b[e])
        start = end
    return torch.cat(outs, 0) if outs else a.new_zeros(0, b.shape[-1])


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [R, K]`` (rows grouped by expert) × ``b [E, K, N]`` → ``[R, N]``."""
    if a.is_cuda and _gmm is not None and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return _gmm(a, b, offs=offs)
    return _loop_mm(a, b, offs)


def sort_by_expert(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten routing ``idx [m, k]`` into expert-sorted rows.

    Returns ``(order [m*k], token_of_row [m*k], offs [E] int32)``: row r of the sorted layout is the
    (token, slot) pair ``order[r]`` of the flattened idx, belonging to token ``token_of_row[r]``.
    """
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_row = order // idx.shape[1]
    offs = torch.cumsum(torch.bincount(flat, minlength=n_experts), 0).to(torch.int32)
    return order, token_of_row, offs
