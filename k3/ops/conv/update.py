"""One decode step of up to three depthwise causal short convolutions whose histories live in a pool of tails.

For conv i and sequence b of a batch, in pool row ``slots[b]``: the window is ``[tails[i, slot] (W−1 previous
inputs), xs[i][b]]``; the output is ``act(Σ_j w_i[:, j] · window[j])`` computed in fp32 (``act`` = SiLU or identity)
and cast to x's dtype, and the tail becomes the window's last W−1 inputs, written back IN PLACE. The same numbers
as ``ShortConv.forward`` on a one-token piece with that tail, without gathering the tails, concatenating,
convolving and scattering them back (eight launches and a ``[B, W, C]`` copy per convolution); KDA's q, k and v
convolutions go in one launch.

``short_conv_update_reference`` is the plain PyTorch form (CPU, ground truth); ``short_conv_update`` runs the
Triton kernel on CUDA tensors (``update_triton.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["short_conv_update", "short_conv_update_reference"]

MAX_CONVS = 3


def _check(xs: Sequence[torch.Tensor], tails: torch.Tensor, slots: torch.Tensor,
           weights: Sequence[torch.Tensor]) -> None:
    if not 1 <= len(xs) <= MAX_CONVS or len(weights) != len(xs):
        raise ValueError(f"xs and weights must hold the same number (1 to {MAX_CONVS}) of convolutions, got "
                         f"{len(xs)} and {len(weights)}")
    B, C = xs[0].shape if xs[0].dim() == 2 else (None, None)
    if B is None or any(x.shape != (B, C) or x.dtype != xs[0].dtype for x in xs):
        raise ValueError(f"xs must be [B, C] tensors of one shape and dtype (one token per sequence), got "
                         f"{[tuple(x.shape) for x in xs]}")
    if tails.dim() != 4 or tails.shape[0] != len(xs) or tails.shape[3] != C:
        raise ValueError(f"tails must be [n={len(xs)}, P, W-1, C={C}], got {tuple(tails.shape)}")
    W = tails.shape[2] + 1
    for w in weights:
        if w.shape not in ((C, 1, W), (C, W)):
            raise ValueError(f"weights must be [C, 1, W] = [{C}, 1, {W}], got {tuple(w.shape)}")
    if slots.shape != (B,) or slots.is_floating_point():
        raise ValueError(f"slots must be an integer tensor [B={B}], got {slots.dtype} {tuple(slots.shape)}")
    if any(t.device != tails.device for t in (*xs, slots, *weights)):
        raise ValueError("xs, tails, slots and weights must share a device")
    if not tails.is_contiguous():
        raise ValueError("tails must be contiguous (the pool is updated in place)")


def short_conv_update_reference(xs: Sequence[torch.Tensor], tails: torch.Tensor, slots: torch.Tensor,
                                weights: Sequence[torch.Tensor], activation: bool = True) -> torch.Tensor:
    """``xs``: n tensors ``[B, C]``; ``tails [n, P, W−1, C]`` (updated in place at ``slots [B]``); ``weights``: n
    tensors ``[C, 1, W]`` → ``[n, B, C]`` in the xs' dtype."""
    _check(xs, tails, slots, weights)
    out = []
    for i, (x, w) in enumerate(zip(xs, weights)):
        window = torch.cat([tails[i].index_select(0, slots).to(x.dtype), x[:, None]], dim=1)  # [B, W, C]
        y = (window.float() * w.reshape(w.shape[0], -1).float().t()[None]).sum(1)
        out.append((F.silu(y) if activation else y).to(x.dtype))
        tails[i].index_copy_(0, slots, window[:, 1:].to(tails.dtype))
    return torch.stack(out)


def short_conv_update(xs: Sequence[torch.Tensor], tails: torch.Tensor, slots: torch.Tensor,
                      weights: Sequence[torch.Tensor], activation: bool = True) -> torch.Tensor:
    """:func:`short_conv_update_reference`, one Triton launch on CUDA."""
    _check(xs, tails, slots, weights)
    if tails.is_cuda:
        from k3.ops.conv.update_triton import short_conv_update_triton

        return short_conv_update_triton(xs, tails, slots, weights, activation)
    return short_conv_update_reference(xs, tails, slots, weights, activation)
