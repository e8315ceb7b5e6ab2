"""The short-conv decode update in one Triton kernel: per (sequence, channel block) the W−1 tail rows and the new
input are read once, the output written, the tail shifted in place. See ``update.py`` for the contract."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["short_conv_update_triton"]


@triton.jit
def _conv_update(x, tails, slots, w, y, C, W: tl.constexpr, ACT: tl.constexpr, BC: tl.constexpr):
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    slot = tl.load(slots + i_b).to(tl.int64)
    p_t = tails + slot * (W - 1) * C + o_c  # row j of the tail: + j * C
    b_x = tl.load(x + i_b * C + o_c, mask=m_c, other=0.)
    acc = tl.load(w + o_c * W + (W - 1), mask=m_c, other=0.).to(tl.float32) * b_x.to(tl.float32)
    prev = b_x  # what the last tail row becomes
    for j in tl.static_range(W - 2, -1, -1):  # newest tail row first: each row is read before it is overwritten
        b_t = tl.load(p_t + j * C, mask=m_c, other=0.)
        acc += tl.load(w + o_c * W + j, mask=m_c, other=0.).to(tl.float32) * b_t.to(x.dtype.element_ty).to(tl.float32)
        tl.store(p_t + j * C, prev.to(tails.dtype.element_ty), mask=m_c)
        prev = b_t
    if ACT:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y + i_b * C + o_c, acc.to(y.dtype.element_ty), mask=m_c)


def short_conv_update_triton(x: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                             activation: bool = True) -> torch.Tensor:
    B, C = x.shape
    W = tails.shape[1] + 1
    x = x.contiguous()
    y = torch.empty_like(x)
    if B:
        BC = min(1024, triton.next_power_of_2(C))
        _conv_update[(B, triton.cdiv(C, BC))](x, tails, slots, weight.reshape(C, W).contiguous(), y, C, W=W,
                                               ACT=bool(activation), BC=BC, num_warps=4)
    return y
