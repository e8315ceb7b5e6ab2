"""SiTU-GLU: [β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)]; every output lies in (−β1·β2, β1·β2)
(docs/architecture.md#situ-glu).

Computed in fp32 and cast back; SwiGLU to first order near 0. ``situ_glu_reference`` is the plain PyTorch ground
truth; ``situ_glu`` dispatches to the fused Triton forward/backward (``situ_triton.py``) on CUDA tensors
(``K3_MOE_BACKEND`` overrides, see ``_backend.py``). ``situ_glu_packed`` takes one ``[..., 2F]`` tensor holding
gate then up, as produced by a single packed gate/up GEMM.
"""

from __future__ import annotations

import torch

from k3.ops._device import on_device_of
from k3.ops.moe._backend import use_triton

__all__ = ["situ_glu", "situ_glu_packed", "situ_glu_reference", "situ_bound"]


def situ_bound(beta1: float, beta2: float, dtype: torch.dtype) -> float:
    """The largest ``dtype`` value strictly below β1·β2. Both tanh factors round to exactly 1 for large inputs, so
    the formula alone would return ±β1·β2 and break the open bound |y| < β1·β2; outputs are clamped to this."""
    top = torch.tensor(float(beta1) * float(beta2), dtype=dtype)
    return float(torch.nextafter(top, torch.zeros((), dtype=dtype)))


def _check_betas(beta1: float, beta2: float) -> None:
    if not (beta1 > 0 and beta2 > 0):
        raise ValueError(f"beta1 and beta2 must be > 0, got {beta1}, {beta2}")


def situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """Plain PyTorch SiTU-GLU of ``gate, up [..., F]`` → ``[..., F]`` in gate.dtype (fp32 inside)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    _check_betas(beta1, beta2)
    dtype = gate.dtype
    g, u = gate.float(), up.float()
    y = (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    lim = situ_bound(beta1, beta2, dtype)
    y = y + (y.clamp(-lim, lim) - y).detach()  # value strictly inside the bound; gradient of the formula
    return y.to(dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of ``gate, up [..., F]`` → ``[..., F]`` (fused Triton kernels on CUDA, reference elsewhere)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    _check_betas(beta1, beta2)
    if use_triton(gate):
        from k3.ops.moe.situ_triton import situ_glu_fused

        with on_device_of(gate):
            return situ_glu_fused(gate, up, beta1, beta2, situ_bound(beta1, beta2, gate.dtype))
    return situ_glu_reference(gate, up, beta1, beta2)


def situ_glu_packed(gu: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of a packed ``gu [..., 2F]`` (gate = first F columns, up = last F) → ``[..., F]``."""
    if gu.dim() < 1 or gu.shape[-1] % 2:
        raise ValueError(f"gu must have an even last dim [..., 2F], got {tuple(gu.shape)}")
    _check_betas(beta1, beta2)
    if use_triton(gu):
        from k3.ops.moe.situ_triton import situ_glu_fused_packed

        with on_device_of(gu):
            return situ_glu_fused_packed(gu, beta1, beta2, situ_bound(beta1, beta2, gu.dtype))
    g, u = gu.chunk(2, dim=-1)
    return situ_glu_reference(g, u, beta1, beta2)
