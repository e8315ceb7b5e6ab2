"""``y = RMSNorm(o; w) ⊙ σ(g)`` per head, in fp32, cast to ``out_dtype`` — the output stage of a KDA layer.

o ``[..., K]`` (one head's output per row), g ``[..., K]`` the gate logits of the same rows, w ``[K]`` the norm gain
(fp32 in the checkpoint): ``y = ((o · rsqrt(mean(o²) + eps)) · w) · sigmoid(g)``. ``rms_norm_gate_reference`` is the
plain PyTorch form (the layer's training path computes the same thing op by op); ``rms_norm_gate`` runs one Triton
kernel on CUDA tensors without autograd — a decode step otherwise pays about ten launches for it per KDA layer.
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm_gate", "rms_norm_gate_reference"]


def rms_norm_gate_reference(o: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float,
                            out_dtype: torch.dtype) -> torch.Tensor:
    of = o.float()
    y = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(g.float())).to(out_dtype)


def rms_norm_gate(o: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, eps: float,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`rms_norm_gate_reference`; one Triton kernel for CUDA tensors when no gradient is needed."""
    if o.shape != g.shape or weight.shape != (o.shape[-1],):
        raise ValueError(f"o and g must share a shape [..., K] and weight be [K], got {tuple(o.shape)}, "
                         f"{tuple(g.shape)}, {tuple(weight.shape)}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (o, g, weight))
    if o.is_cuda and not needs_grad:
        from k3.ops.norm_gate.norm_gate_triton import rms_norm_gate_triton

        return rms_norm_gate_triton(o, g, weight, eps, out_dtype)
    return rms_norm_gate_reference(o, g, weight, eps, out_dtype)
