"""One decode step of a depthwise causal short convolution whose history lives in a pool of tails.

For sequence b of a batch, in pool row ``slots[b]``: the window is ``[tail (W−1 previous inputs), x_b]``; the output
is ``act(Σ_j w[:, j] · window[j])`` computed in fp32 (``act`` = SiLU or identity) and cast to x's dtype, and the
tail becomes the window's last W−1 inputs, written back IN PLACE. The same numbers as ``ShortConv.forward`` on a
one-token piece with that tail, without gathering the tails, concatenating, convolving and scattering them back
(eight launches and a ``[B, W, C]`` copy per convolution, where a decode step has three per KDA layer).

``short_conv_update_reference`` is the plain PyTorch form (CPU, ground truth); ``short_conv_update`` runs the
Triton kernel on CUDA tensors (``update_triton.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["short_conv_update", "short_conv_update_reference"]


def _check(x: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [B, C] (one token per sequence), got {tuple(x.shape)}")
    B, C = x.shape
    if tails.dim() != 3 or tails.shape[2] != C:
        raise ValueError(f"tails must be [P, W-1, C={C}], got {tuple(tails.shape)}")
    W = tails.shape[1] + 1
    if weight.shape not in ((C, 1, W), (C, W)):
        raise ValueError(f"weight must be [C, 1, W] = [{C}, 1, {W}], got {tuple(weight.shape)}")
    if slots.shape != (B,) or slots.is_floating_point():
        raise ValueError(f"slots must be an integer tensor [B={B}], got {slots.dtype} {tuple(slots.shape)}")
    if not (x.device == tails.device == slots.device == weight.device):
        raise ValueError("x, tails, slots and weight must share a device")
    if not tails.is_contiguous():
        raise ValueError("tails must be contiguous (the pool is updated in place)")


def short_conv_update_reference(x: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                                activation: bool = True) -> torch.Tensor:
    """``x [B, C]``, ``tails [P, W−1, C]`` (updated in place at ``slots [B]``), ``weight [C, 1, W]`` → ``[B, C]``."""
    _check(x, tails, slots, weight)
    window = torch.cat([tails.index_select(0, slots).to(x.dtype), x[:, None]], dim=1)  # [B, W, C]
    y = (window.float() * weight.reshape(weight.shape[0], -1).float().t()[None]).sum(1)
    if activation:
        y = F.silu(y)
    tails.index_copy_(0, slots, window[:, 1:].to(tails.dtype))
    return y.to(x.dtype)


def short_conv_update(x: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                      activation: bool = True) -> torch.Tensor:
    """:func:`short_conv_update_reference`, one Triton kernel on CUDA."""
    if x.is_cuda:
        _check(x, tails, slots, weight)
        from k3.ops.conv.update_triton import short_conv_update_triton

        return short_conv_update_triton(x, tails, slots, weight, activation)
    return short_conv_update_reference(x, tails, slots, weight, activation)
