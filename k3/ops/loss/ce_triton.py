"""Triton kernel of the cross-entropy step on one chunk of logits: the loss of each row and, in place of its logits,
the gradient of the mean loss. fp32 statistics (online max / sum of exponentials over the vocabulary), logits read
twice and written once in their own dtype: no fp32 copy of the chunk.

    lse = log Σ_v exp(x_v)      loss = lse − x_y      ∂x_v = (exp(x_v − lse) − [v = y]) / n_valid

Rows whose target is ``ignore_index`` get loss 0 and gradient 0. ``n_valid`` is read from device memory, so nothing
waits for the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["cross_entropy_chunk_"]


@triton.jit
def ce_chunk_kernel(x, y, n_valid, loss, ignore_index, V: tl.constexpr, BV: tl.constexpr, HAS_GRAD: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    p_x = x + i_n * V
    b_y = tl.load(y + i_n).to(tl.int64)
    valid = b_y != ignore_index
    b_m = tl.full([], float("-inf"), tl.float32)
    b_z = tl.zeros([], tl.float32)
    for i_v in range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        b_x = tl.load(p_x + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
        b_mn = tl.maximum(b_m, tl.max(b_x, 0))
        b_z = b_z * tl.exp(b_m - b_mn) + tl.sum(tl.exp(b_x - b_mn), 0)
        b_m = b_mn
    b_lse = b_m + tl.log(b_z)
    b_xy = tl.load(p_x + tl.where(valid, b_y, 0)).to(tl.float32)
    tl.store(loss + i_n, tl.where(valid, b_lse - b_xy, 0.0))
    if HAS_GRAD:
        b_scale = tl.where(valid, 1.0 / tl.maximum(tl.load(n_valid).to(tl.float32), 1.0), 0.0)
        for i_v in range(0, V, BV):
            o_v = i_v + tl.arange(0, BV)
            m_v = o_v < V
            b_x = tl.load(p_x + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_g = (tl.exp(b_x - b_lse) - tl.where(o_v == b_y, 1.0, 0.0)) * b_scale
            tl.store(p_x + o_v, b_g.to(x.dtype.element_ty), mask=m_v)


def cross_entropy_chunk_(logits, targets, n_valid, loss, ignore_index: int, grad: bool) -> None:
    """``logits [C, V]`` contiguous (overwritten by the gradient when ``grad``), ``targets [C]``, ``n_valid`` a
    one-element device tensor, ``loss [C]`` fp32 (written)."""
    C, V = logits.shape
    BV = min(8192, triton.next_power_of_2(V))
    with on_device_of(logits):
        ce_chunk_kernel[(C,)](logits, targets, n_valid, loss, ignore_index, V=V, BV=BV, HAS_GRAD=grad,
                              num_warps=16 if BV >= 4096 else 4)
