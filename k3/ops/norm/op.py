"""RMSNorm as a ``torch.library`` op (``k3::rms_norm_fwd`` / ``k3::rms_norm_bwd``, fake + autograd registered, so
``torch.compile`` regions keep it as one node) and the dispatching entry ``rms_norm``."""

from __future__ import annotations

import torch

from k3.ops.norm.fused import MAX_D, rms_norm_bwd, rms_norm_fwd
from k3.ops.norm.naive import rms_norm_reference

__all__ = ["rms_norm", "rms_norm_fused"]

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.custom_op("k3::rms_norm_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_fwd(x, weight, eps)


@_fwd_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("k3::rms_norm_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_bwd(dy, x, weight, rstd)


@_bwd_op.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), x.new_empty(x.shape[1], dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _bwd_op(dy.contiguous(), x, weight, rstd)
    return dx, dw.to(weight.dtype), None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton path (any device the kernels run on; CPU tensors need ``TRITON_INTERPRET=1``)."""
    D = x.shape[-1]
    y, _ = _fwd_op(x.reshape(-1, D).contiguous(), weight, float(eps))
    return y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics: ``x [..., D]``, gain ``weight [D]`` (None: no gain) → ``[..., D]`` in x.dtype.
    CUDA tensors (fp32/bf16/fp16, D ≤ 16384, with a gain) run the fused Triton kernels; others the reference."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a [..., D] tensor, got {type(x).__name__}")
    D = x.shape[-1]
    if weight is not None and (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (D,)):
        raise ValueError(f"weight must be [D] = [{D}], got {tuple(getattr(weight, 'shape', ())) or weight!r}")
    if weight is not None and x.is_cuda and x.dtype in _FUSED_DTYPES and D <= MAX_D and weight.device == x.device:
        return rms_norm_fused(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
