"""The depthwise causal short convolution of a whole piece (training, prefill), with its decode tail.

For x ``[B, T, C]``, weight ``[C, 1, W]`` (fp32, as released) and the previous W−1 inputs ``tail [B, W−1, C]``
(zeros at a sequence start): with ``xp = tail ‖ x`` along time,

    y[t] = act(Σ_w weight[c, 0, w] · xp[t + w])        new_tail = xp[T:]  (the last W−1 inputs)

computed in fp32, ``y`` and ``new_tail`` in x's dtype (the tail is cast to x's dtype first). ``act`` is SiLU or the
identity. Prepending the returned tail to the next piece makes piecewise and token-by-token calls give the one-shot
result. Differentiable in x, the weight and the tail (context parallel trains with a tail: the previous rank's last
inputs).

``short_conv_reference``  the plain PyTorch form: ``F.conv1d`` in fp32 (CPU, ground truth).
``short_conv_fused``      the Triton kernels (``causal_triton.py``) on any device they run on (CPU tensors need
                          ``TRITON_INTERPRET=1``), as the ``k3::short_conv_fwd`` / ``_bwd`` ops: for tests.
``short_conv``            the Triton kernels on CUDA, the reference elsewhere; ``K3_KDA_BACKEND=triton|torch`` forces
                          one (the convolution is part of the KDA layer: one switch for both; on CPU tensors Triton
                          needs ``TRITON_INTERPRET=1`` set before triton is imported).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from k3.ops._fastpath import fallback_notice, forced_backend, triton_version

__all__ = ["short_conv", "short_conv_fused", "short_conv_reference"]

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ENV = "K3_KDA_BACKEND"


@torch.compiler.assume_constant_result  # a compiled forward bakes the answer in instead of tracing the import
def _triton_available() -> bool:
    return triton_version() is not None


def use_triton(x: torch.Tensor) -> bool:
    """True when the Triton kernels should run on ``x``: CUDA tensors of a float dtype they take, unless
    ``K3_KDA_BACKEND`` says otherwise (read at call time)."""
    forced = forced_backend(_ENV)
    if forced is not None:
        return forced == "triton" and x.dtype in _FUSED_DTYPES
    if not x.is_cuda or x.dtype not in _FUSED_DTYPES:
        return False
    if not _triton_available():
        fallback_notice("the short-conv Triton kernels", "need triton, which does not import", "the fp32 reference")
        return False
    return True


def _check(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [B, T, C] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    B, _, C = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[:2] != (C, 1) or weight.shape[2] < 1:
        raise ValueError(f"weight must be [C, 1, W] = [{C}, 1, W], got {tuple(getattr(weight, 'shape', ()))}")
    W = weight.shape[2]
    if tail is not None and (not isinstance(tail, torch.Tensor) or tail.shape != (B, W - 1, C)):
        raise ValueError(f"tail must be [B, W-1, C] = [{B}, {W - 1}, {C}], got {tuple(getattr(tail, 'shape', ()))}")
    if weight.device != x.device or (tail is not None and tail.device != x.device):
        raise ValueError("x, weight and tail must share a device")


def _new_tail(x: torch.Tensor, tail: torch.Tensor | None, W: int) -> torch.Tensor:
    """The last W−1 inputs of ``tail ‖ x``, a fresh tensor: a view would keep the whole (possibly 1M-token) input
    alive inside the decode state."""
    B, T, C = x.shape
    if T >= W - 1:
        return x[:, T - (W - 1):].clone()
    head = x.new_zeros(B, W - 1, C) if tail is None else tail
    return torch.cat([head, x], 1)[:, T:]


def short_conv_reference(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None,
                         activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [B, T, C], new_tail [B, W−1, C])``, both in x's dtype: ``F.conv1d`` over the fp32 padded input."""
    _check(x, weight, tail)
    B, T, C = x.shape
    W = weight.shape[2]
    head = x.new_zeros(B, W - 1, C) if tail is None else tail.to(x.dtype)
    xp = torch.cat([head, x], dim=1)  # [B, T+W-1, C]
    y = F.conv1d(xp.float().transpose(1, 2), weight.float(), groups=C).transpose(1, 2)  # [B, T, C]
    if activation:
        y = F.silu(y)
    return y.to(x.dtype), xp[:, T:].clone()


def short_conv_fused(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None,
                     activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`short_conv_reference` by the Triton kernels (x read in place when its channels are contiguous)."""
    from k3.ops.conv.causal_triton import short_conv_op

    _check(x, weight, tail)
    tail = None if tail is None else tail.to(x.dtype).contiguous()
    if x.stride(2) != 1:
        x = x.contiguous()
    y = short_conv_op(x, weight, tail, bool(activation))
    return y, _new_tail(x, tail, weight.shape[2])


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None,
               activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, T, C]``, ``weight [C, 1, W]``, ``tail [B, W−1, C]`` or None (zeros) → ``(y, new_tail)`` in x's
    dtype. CUDA tensors (fp32 / bf16 / fp16) run the Triton kernels, others the fp32 reference (see
    :func:`use_triton`)."""
    _check(x, weight, tail)
    if use_triton(x):
        return short_conv_fused(x, weight, tail, activation)
    return short_conv_reference(x, weight, tail, activation)
