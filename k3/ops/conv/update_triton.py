"""The short-conv decode update in one Triton launch for up to three convolutions (``update.py`` has the
contract): program (sequence, channel block, conv) reads the W−1 tail rows and the new input once, writes the
output and shifts the tail in place. The conv's input, weight and output are picked by masked loads/stores from the
three pointer sets (a false mask touches no memory), its tail by offset into the stacked pool."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["short_conv_update_triton"]


@triton.jit
def _pick(p0, p1, p2, off, m, i_s):
    """The value at ``off`` of the i_s-th of three tensors (masked loads: only one touches memory)."""
    v = tl.load(p0 + off, mask=m & (i_s == 0), other=0.).to(tl.float32)
    v += tl.load(p1 + off, mask=m & (i_s == 1), other=0.).to(tl.float32)
    v += tl.load(p2 + off, mask=m & (i_s == 2), other=0.).to(tl.float32)
    return v


@triton.jit
def _conv_update(x0, x1, x2, w0, w1, w2, y0, y1, y2, tails, slots, P, C, s_x, W: tl.constexpr, ACT: tl.constexpr,
                 BC: tl.constexpr):
    i_b, i_c, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    slot = tl.load(slots + i_b).to(tl.int64)
    p_t = tails + ((i_s * P + slot) * (W - 1)) * C + o_c  # row j of this conv's tail: + j * C
    b_x = _pick(x0, x1, x2, i_b * s_x + o_c, m_c, i_s).to(x0.dtype.element_ty)  # exact: one load, the others 0
    acc = _pick(w0, w1, w2, o_c * W + (W - 1), m_c, i_s) * b_x.to(tl.float32)
    prev = b_x.to(tails.dtype.element_ty)  # what the last tail row becomes
    for j in tl.static_range(W - 2, -1, -1):  # newest tail row first: each row is read before it is overwritten
        b_t = tl.load(p_t + j * C, mask=m_c, other=0.)
        acc += _pick(w0, w1, w2, o_c * W + j, m_c, i_s) * b_t.to(x0.dtype.element_ty).to(tl.float32)
        tl.store(p_t + j * C, prev, mask=m_c)
        prev = b_t
    if ACT:
        acc = acc / (1.0 + tl.exp(-acc))
    out = acc.to(y0.dtype.element_ty)
    tl.store(y0 + i_b * C + o_c, out, mask=m_c & (i_s == 0))
    tl.store(y1 + i_b * C + o_c, out, mask=m_c & (i_s == 1))
    tl.store(y2 + i_b * C + o_c, out, mask=m_c & (i_s == 2))


def short_conv_update_triton(xs: Sequence[torch.Tensor], tails: torch.Tensor, slots: torch.Tensor,
                             weights: Sequence[torch.Tensor], activation: bool = True) -> torch.Tensor:
    """One launch for up to three convolutions; ``tails`` updated in place (the ``k3::short_conv_update`` op:
    ``torch.compile`` keeps it as one graph node that mutates the pool)."""
    return _conv_update_op(list(xs), tails, slots, list(weights), bool(activation))


@torch.library.custom_op("k3::short_conv_update", mutates_args=("tails",))
def _conv_update_op(xs: list[torch.Tensor], tails: torch.Tensor, slots: torch.Tensor, weights: list[torch.Tensor],
                    activation: bool) -> torch.Tensor:
    n = len(xs)
    B, C = xs[0].shape
    P, W = tails.shape[1], tails.shape[2] + 1
    y = torch.empty(n, B, C, dtype=xs[0].dtype, device=xs[0].device)
    if B:
        # the inputs may be column slices of one projection (FusedProjections): one row stride for the three
        x = list(xs) if len({(t.stride(0), t.stride(1)) for t in xs}) == 1 and xs[0].stride(1) == 1 else \
            [t.contiguous() for t in xs]
        x += [x[0]] * (3 - n)
        w = [t.reshape(C, W).contiguous() for t in weights] + [weights[0]] * (3 - n)
        out = [y[i] for i in range(n)] + [y[0]] * (3 - n)
        BC = min(1024, triton.next_power_of_2(C))
        with on_device_of(tails):
            _conv_update[(B, triton.cdiv(C, BC), n)](*x, *w, *out, tails, slots, P, C, x[0].stride(0), W=W,
                                                      ACT=bool(activation), BC=BC, num_warps=4)
    return y


@_conv_update_op.register_fake
def _(xs, tails, slots, weights, activation):
    return xs[0].new_empty(len(xs), *xs[0].shape)
