"""Decode-sized linear layers with their neighbouring elementwise op fused in (see ``__init__``).

A decode step at batch 1 multiplies one row by each weight. cuBLAS runs those products at 2.8–7.3 µs each for the
0.3–9 MB weights of a ~1B model (its tiles are built for more rows), and the SiTU-GLU or RMSNorm-gate before a down
or output projection costs another launch of 2–5 µs. One Triton program per four output columns, reading the row's
inputs, applying the prologue in registers and streaming the weight once, takes 1.4–4.3 µs for all of it
(``python -m k3.bench gemv``).

Numerics: fp32 accumulation as cuBLAS; a prologue's result is rounded to the activation dtype before the product,
as the unfused ops store it, so fused and unfused differ only in summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops._fastpath import triton_version
from k3.ops.moe.situ import situ_glu
from k3.ops.norm_gate import rms_norm_gate

__all__ = ["MAX_ROWS", "use_gemv", "linear", "situ_linear", "gate_linear", "norm_gate_linear"]

MAX_ROWS = 2  # beyond it cuBLAS's tiles win (one program re-reads the weight per row)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_gemv(rows: int, *tensors: torch.Tensor) -> bool:
    """Whether the Triton kernel takes these operands: CUDA, ``rows ≤ MAX_ROWS``, no gradient to record."""
    if rows > MAX_ROWS or not tensors[0].is_cuda or triton_version() is None:
        return False
    if any(t.dtype not in _DTYPES for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]`` with a unit column stride (a view when the layout allows)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check_weight(weight: torch.Tensor, K: int, name: str = "weight") -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"{name} must be [N, {K}], got {tuple(getattr(weight, 'shape', ()))}")


def _check_add(add: torch.Tensor | None, lead: torch.Size, N: int) -> None:
    if add is not None and (not isinstance(add, torch.Tensor) or add.shape != (*lead, N)):
        raise ValueError(f"add must be [{', '.join(map(str, (*lead, N)))}], got {tuple(getattr(add, 'shape', ()))}")


def _linear_add(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
    """The unfused product: cuBLAS, with a 2-D ``add`` inside the GEMM."""
    if add is None:
        return F.linear(x, weight)
    if x.dim() == 2:
        return torch.addmm(add, x, weight.t())
    return F.linear(x, weight) + add


def linear(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] · weight[N, K]ᵀ (+ add [..., N])`` in ``out_dtype`` (default x's; fp32 accumulation)."""
    K = x.shape[-1]
    _check_weight(weight, K)
    _check_add(add, x.shape[:-1], weight.shape[0])
    out_dtype = out_dtype or x.dtype
    rows = x.numel() // max(K, 1)
    if use_gemv(rows, x, weight) and x.dtype == weight.dtype:
        from k3.ops.gemv.gemv_triton import gemv

        y = gemv(_rows(x, K), weight, add=None if add is None else _rows(add, weight.shape[0]), out_dtype=out_dtype)
        return y.view(*x.shape[:-1], weight.shape[0])
    if out_dtype == x.dtype:
        return _linear_add(x, weight, add)
    return _linear_add(x.to(out_dtype), weight.to(out_dtype), add)


def situ_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, beta1: float, beta2: float,
                add: torch.Tensor | None = None) -> torch.Tensor:
    """``SiTU-GLU(gate, up) [..., F] · weight[N, F]ᵀ (+ add [..., N])`` in gate's dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must share a shape and dtype, got {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    Fw = gate.shape[-1]
    _check_weight(weight, Fw)
    _check_add(add, gate.shape[:-1], weight.shape[0])
    rows = gate.numel() // max(Fw, 1)
    if use_gemv(rows, gate, up, weight) and gate.dtype == weight.dtype:
        from k3.ops.gemv.gemv_triton import gemv

        y = gemv(_rows(gate, Fw), weight, b=_rows(up, Fw), situ=(float(beta1), float(beta2)),
                 add=None if add is None else _rows(add, weight.shape[0]), out_dtype=gate.dtype)
        return y.view(*gate.shape[:-1], weight.shape[0])
    return _linear_add(situ_glu(gate, up, beta1, beta2), weight, add)


def gate_linear(o: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(o ⊙ σ(g)) [..., K] · weight[N, K]ᵀ`` in o's dtype (σ(g) and the product rounded to it, as the unfused
    ops store them)."""
    if o.shape != g.shape or o.dtype != g.dtype:
        raise ValueError(f"o and g must share a shape and dtype, got {tuple(o.shape)} {o.dtype} and "
                         f"{tuple(g.shape)} {g.dtype}")
    K = o.shape[-1]
    _check_weight(weight, K)
    rows = o.numel() // max(K, 1)
    if use_gemv(rows, o, g, weight) and o.dtype == weight.dtype:
        from k3.ops.gemv.gemv_triton import gemv

        y = gemv(_rows(o, K), weight, b=_rows(g, K), gate=True, out_dtype=o.dtype)
        return y.view(*o.shape[:-1], weight.shape[0])
    return F.linear(o * torch.sigmoid(g), weight)


def norm_gate_linear(o: torch.Tensor, g: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor) -> torch.Tensor:
    """``(RMSNorm(o; norm_weight) ⊙ σ(g))`` per head ``[..., H, D]``, flattened to ``[..., H·D]``, times
    ``weight[N, H·D]ᵀ``, in weight's dtype (the normed product is rounded to it first, as ``rms_norm_gate`` stores
    it)."""
    if o.dim() < 2 or o.shape != g.shape or norm_weight.shape != (o.shape[-1],):
        raise ValueError(f"o and g must share a shape [..., H, D] and norm_weight be [D], got {tuple(o.shape)}, "
                         f"{tuple(g.shape)}, {tuple(norm_weight.shape)}")
    H, D = o.shape[-2], o.shape[-1]
    _check_weight(weight, H * D)
    rows = o.numel() // max(H * D, 1)
    if use_gemv(rows, o, g, norm_weight, weight) and D & (D - 1) == 0 and D <= 512:
        from k3.ops.gemv.gemv_triton import gemv

        y = gemv(_rows(o, H * D), weight, b=_rows(g, H * D), norm=(norm_weight, float(eps), D),
                 out_dtype=weight.dtype)
        return y.view(*o.shape[:-2], weight.shape[0])
    y = rms_norm_gate(o, g, norm_weight, eps, weight.dtype)
    return F.linear(y.reshape(*o.shape[:-2], H * D), weight)
