"""``attention``: MLA's expanded-form attention with autograd — the Triton flash kernels on CUDA (registered as
``torch.library`` custom ops, so ``torch.compile`` keeps them as single graph nodes), the fp32 reference on CPU.

``K3_MLA_BACKEND=triton`` forces the kernels (on CPU tensors that needs ``TRITON_INTERPRET=1`` set before triton is
imported), ``K3_MLA_BACKEND=torch`` forces the reference.
"""

from __future__ import annotations

import os

import torch

from k3.ops.mla.flash import flash_attention_bwd, flash_attention_fwd
from k3.ops.mla.naive import attention_ref

__all__ = ["attention", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernels should run on tensor ``t``."""
    mode = os.environ.get("K3_MLA_BACKEND", "").lower()
    if mode in ("torch", "triton"):
        return mode == "triton"
    return t.is_cuda


@torch.library.custom_op("k3::mla_attn_fwd", mutates_args=())
def _attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shift: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_fwd(q, k, v, scale, shift)


@_attn_fwd.register_fake
def _(q, k, v, shift, scale):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("k3::mla_attn_bwd", mutates_args=())
def _attn_bwd(do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, shift: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attention_bwd(do, dlse, q, k, v, o, lse, scale, shift)


@_attn_bwd.register_fake
def _(do, dlse, q, k, v, o, lse, shift, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, shift, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, shift)
    ctx.scale = scale


def _backward(ctx, do: torch.Tensor, dlse: torch.Tensor | None):
    q, k, v, o, lse, shift = ctx.saved_tensors
    dq, dk, dv = _attn_bwd(do, dlse, q, k, v, o, lse, shift, ctx.scale)
    return dq, dk, dv, None, None


_attn_fwd.register_autograd(_backward, setup_context=_setup)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, T, H, D]``, ``k [B, L, H, D]``, ``v [B, L, H, Dv]`` → ``(o [B, T, H, Dv]`` in q's dtype,
    ``lse [B, H, T]`` fp32); differentiable in q, k, v (through o and lse). Key j is visible to query i of batch
    row b iff ``j ≤ i + shift[b]`` (``shift`` int32 ``[B]`` on q's device; None = 0: causal with T = L)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, T|L, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, _, H, D = q.shape
    if k.shape[0] != B or k.shape[2] != H or k.shape[3] != D:
        raise ValueError(f"k must be [B={B}, L, H={H}, D={D}], got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, L, H, Dv] with k's [B, L, H] = {tuple(k.shape[:3])}, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")
    if shift is not None and (shift.shape != (B,) or shift.is_floating_point() or shift.device != q.device):
        raise ValueError(f"shift must be an integer tensor [B={B}] on {q.device}, got "
                         f"{shift.dtype} {tuple(shift.shape)} on {shift.device}")
    if not use_triton(q):
        return attention_ref(q, k, v, scale, 0 if shift is None else shift)
    return _attn_fwd(q, k, v, None if shift is None else shift.to(torch.int32), float(scale))
