"""The fused RMSNorm × sigmoid gate (``norm_gate.py``): ``BR`` rows of K per program, fp32 inside.

Row r is head ``r % H`` of token ``r // H``; o and g are read with their own token strides, so a gate that is a
column slice of a wider projection (``FusedProjections``) is read in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["rms_norm_gate_triton"]


@triton.jit
def _rms_norm_gate(o, g, w, y, R, H, s_o, s_g, eps, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r[:, None] < R) & (o_k[None, :] < K)
    i_t, i_h = o_r.to(tl.int64) // H, o_r.to(tl.int64) % H
    p = o_r[:, None].to(tl.int64) * K + o_k[None, :]
    b_o = tl.load(o + (i_t * s_o + i_h * K)[:, None] + o_k[None, :], mask=m, other=0.).to(tl.float32)
    b_g = tl.load(g + (i_t * s_g + i_h * K)[:, None] + o_k[None, :], mask=m, other=0.).to(tl.float32)
    b_w = tl.load(w + o_k, mask=o_k < K, other=0.).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_o * b_o, axis=1) / K + eps)
    b_y = b_o * rstd[:, None] * b_w[None, :] * (1.0 / (1.0 + tl.exp(-b_g)))
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)


@torch.library.custom_op("k3::rms_norm_gate", mutates_args=())
def rms_norm_gate_triton(o: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """One launch; a ``torch.library`` op (``torch.compile`` keeps it as one graph node)."""
    K = o.shape[-1]
    H = o.shape[-2] if o.dim() >= 2 else 1
    o3, g3 = _tokens(o, H, K), _tokens(g, H, K)
    R = o3.shape[0] * H
    y = torch.empty(R, K, dtype=out_dtype, device=o.device)
    if R:
        BK = triton.next_power_of_2(K)
        BR = max(1, min(16, 4096 // BK))
        with on_device_of(o):
            _rms_norm_gate[(triton.cdiv(R, BR),)](o3, g3, weight.contiguous(), y, R, H, o3.stride(0), g3.stride(0),
                                                  float(eps), K=K, BK=BK, BR=BR, num_warps=4)
    return y.view(o.shape)


@rms_norm_gate_triton.register_fake
def _(o, g, weight, eps, out_dtype):
    return o.new_empty(o.shape, dtype=out_dtype)


def _tokens(t: torch.Tensor, H: int, K: int) -> torch.Tensor:
    """``[tokens, H, K]`` with heads K apart and unit element stride (a view when the layout allows, else a copy)."""
    t3 = t.reshape(-1, H, K)
    return t3 if t3.stride(2) == 1 and (t3.stride(1) == K or H == 1) else t3.contiguous()
