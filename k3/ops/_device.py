"""Which GPU a kernel launch goes to: Triton launches on the CURRENT device, the tensors may live on another."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["on_device_of"]


def on_device_of(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """``x``'s GPU as the current device while a call launches its kernels. Without it, tensors on another GPU than
    the current one (a model placed on ``cuda:1`` while ``cuda:0`` is current) would be handed to kernels launched
    on the wrong one. A no-op for CPU tensors and when ``x``'s GPU is already current (~0.3 µs)."""
    if x.is_cuda and x.get_device() != torch.cuda.current_device():
        return torch.cuda.device(x.get_device())
    return contextlib.nullcontext()
