"""Which implementation the MoE ops dispatch to.

``K3_MOE_BACKEND=triton`` forces the Triton kernels (on CPU tensors that needs ``TRITON_INTERPRET=1`` set before
triton is imported), ``K3_MOE_BACKEND=torch`` forces the plain references; unset, CUDA tensors take the Triton
kernels when triton imports and everything else takes the references.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["use_triton", "triton_available"]


@torch.compiler.assume_constant_result  # a compiled forward bakes the answer in instead of tracing the import
@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - triton is an optional dependency
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """True when the fused kernel should run on tensor ``t``."""
    mode = os.environ.get("K3_MOE_BACKEND", "").lower()
    if mode == "torch":
        return False
    if mode == "triton":
        return triton_available()
    return t.is_cuda and triton_available()


def alloc(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for kernel outputs; with ``K3_MOE_POISON=1`` (tests) filled with NaN (floats) or -1 (ints)
    so that any element a kernel forgets to write fails the comparison."""
    if os.environ.get("K3_MOE_POISON") == "1":
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(tuple(shape), fill, dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)
