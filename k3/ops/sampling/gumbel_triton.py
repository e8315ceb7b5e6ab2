"""Gumbel-max sampling in one Triton kernel: Philox noise generated in registers, running argmax over the row.

One program per row walks the vocabulary (a constexpr: one compile per model) in ``BLOCK`` columns:
``U`` = Philox4x32-10 (``tl.randint``, key = the row's seed, counter = column | step << 32), ``G = −log(−log U)``,
and keeps the first index of the largest ``x + G``. The same stream as :func:`k3.ops.sampling.gumbel.philox_uniform`;
a decode step at batch B reads the ``[B, V]`` scaled logits once and writes B ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["gumbel_argmax_triton"]


@triton.jit
def _gumbel_argmax(x, seeds, steps, out, stride, V: tl.constexpr, BLOCK: tl.constexpr):
    i_b = tl.program_id(0)
    seed = tl.load(seeds + i_b)
    step = tl.load(steps + i_b).to(tl.int64)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([BLOCK], dtype=tl.int32)
    for i_v in range(0, V, BLOCK):
        o_v = i_v + tl.arange(0, BLOCK)
        m_v = o_v < V
        b_x = tl.load(x + i_b * stride + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
        r = tl.randint(seed, o_v.to(tl.int64) + (step << 32))
        u = ((r >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
        b_s = b_x - tl.log(-tl.log(u))
        b_s = tl.where(m_v, b_s, float("-inf"))
        take = b_s > best  # strict: an earlier column keeps a tie
        best = tl.where(take, b_s, best)
        best_i = tl.where(take, o_v, best_i)
    m = tl.max(best, axis=0)
    # the first column holding the maximum (lanes hold increasing columns, each lane its first maximum)
    idx = tl.min(tl.where(best == m, best_i, V), axis=0)
    tl.store(out + i_b, idx.to(tl.int64))


@torch.library.custom_op("k3::gumbel_argmax", mutates_args=())
def gumbel_argmax_triton(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``x [B, V]`` fp32 (row stride any, unit column stride), ``seeds``, ``steps [B]`` int64 → ``[B]`` int64.
    A ``torch.library`` op (``torch.compile`` keeps the launch as one graph node)."""
    B, V = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B:
        with on_device_of(x):
            _gumbel_argmax[(B,)](x, seeds.to(torch.int64).contiguous(), steps.to(torch.int64).contiguous(), out,
                                 x.stride(0), V=V, BLOCK=1024, num_warps=4)
    return out


@gumbel_argmax_triton.register_fake
def _(x, seeds, steps):
    return x.new_empty(x.shape[0], dtype=torch.int64)
