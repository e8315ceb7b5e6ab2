"""Which implementation the MoE ops dispatch to.

``K3_MOE_BACKEND=triton`` forces the Triton kernels (on CPU tensors that needs ``TRITON_INTERPRET=1`` set before
triton is imported), ``K3_MOE_BACKEND=torch`` forces the plain references; unset, CUDA tensors take the Triton
kernels when triton imports and everything else takes the references.
"""

from __future__ import annotations

import os

import torch

from k3.ops._fastpath import fallback_notice, triton_version

__all__ = ["use_triton", "triton_available"]


def triton_available() -> bool:
    return triton_version() is not None


def use_triton(t: torch.Tensor) -> bool:
    """True when the fused kernel should run on tensor ``t``."""
    mode = os.environ.get("K3_MOE_BACKEND", "").lower()
    if mode == "torch":
        return False
    if mode == "triton":
        return triton_available()
    if t.is_cuda and not triton_available():
        fallback_notice("the MoE Triton kernels", "need triton (pip install 'triton>=3.6,<3.7'), which does not import",
                        "the PyTorch references")
        return False
    return t.is_cuda


def alloc(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; with ``K3_MOE_POISON=1`` (tests) filled with NaN (floats) or -1 (ints)
    so that any element a kernel forgets to write fails the comparison."""
    if os.environ.get("K3_MOE_POISON") == "1":
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)
