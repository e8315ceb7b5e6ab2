"""The fused RMSNorm × sigmoid gate (``norm_gate.py``): ``BR`` rows of K per program, fp32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["rms_norm_gate_triton"]


@triton.jit
def _rms_norm_gate(o, g, w, y, R, eps, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r[:, None] < R) & (o_k[None, :] < K)
    p = o_r[:, None].to(tl.int64) * K + o_k[None, :]
    b_o = tl.load(o + p, mask=m, other=0.).to(tl.float32)
    b_g = tl.load(g + p, mask=m, other=0.).to(tl.float32)
    b_w = tl.load(w + o_k, mask=o_k < K, other=0.).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_o * b_o, axis=1) / K + eps)
    b_y = b_o * rstd[:, None] * b_w[None, :] * (1.0 / (1.0 + tl.exp(-b_g)))
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)


def rms_norm_gate_triton(o: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float,
                         out_dtype: torch.dtype) -> torch.Tensor:
    K = o.shape[-1]
    o2, g2 = o.reshape(-1, K).contiguous(), g.reshape(-1, K).contiguous()
    R = o2.shape[0]
    y = torch.empty(R, K, dtype=out_dtype, device=o.device)
    if R:
        BK = triton.next_power_of_2(K)
        BR = max(1, min(16, 4096 // BK))
        with on_device_of(o):
            _rms_norm_gate[(triton.cdiv(R, BR),)](o2, g2, weight.contiguous(), y, R, float(eps), K=K, BK=BK, BR=BR,
                                                  num_warps=4)
    return y.view(o.shape)
