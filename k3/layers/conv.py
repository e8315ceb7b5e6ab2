"""Depthwise causal short convolution (kernel 4, no bias, SiLU after), with a decode tail; its place in KDA:
docs/architecture.md#kimi-delta-attention.

The tail is the last ``W−1`` *inputs* of the stream: prepending it to the next piece makes piecewise and
token-by-token calls give exactly the one-shot result. Weights are fp32 (as released); the convolution accumulates
in fp32 and the result is in the input dtype. The op is ``k3.ops.conv.short_conv``: fused Triton kernels on CUDA
(x read in bf16 in place, the SiLU fused, the backward recomputing the pre-activation), ``F.conv1d`` in fp32
elsewhere.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3.ops.conv import short_conv

__all__ = ["ShortConv"]


class ShortConv(nn.Module):
    """``weight [C, 1, W]`` fp32 (the checkpoint's ``*_conv1d.weight``), depthwise, causal, optional SiLU."""

    def __init__(self, channels: int, kernel_size: int = 4, activation: bool = True) -> None:
        super().__init__()
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Conv1d's default for fan_in = W (kaiming-uniform with a = √5 → U(±1/√W)).
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, C]``, ``tail [B, W−1, C]`` (previous inputs, zeros at sequence start) →
        ``(y [B, T, C] in x.dtype, new_tail [B, W−1, C] in x.dtype)``."""
        return short_conv(x, self.weight, tail, self.activation)

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel_size={self.kernel_size}, activation={'silu' if self.activation else None}"
