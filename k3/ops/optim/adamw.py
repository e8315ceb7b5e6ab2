"""AdamW on an fp32 master weight whose model copy is bf16: one pass over a parameter's five tensors.

A model trained in bf16 on one GPU keeps its parameters in bf16 (what the forward and backward read and write) and
their fp32 master weights beside them (``k3.distributed.master_weights``). One update reads the gradient in the
model's dtype (or an fp32 accumulation of several), the master and the two moments, and writes the master, the
moments and the bf16 copy, rounded from the new master:

    g  = grad / grad_scale                        (the clip coefficient's reciprocal, or 1)
    w  = w · (1 − lr · wd)
    m  = β1 · m + (1 − β1) · g,   v = β2 · v + (1 − β2) · g²
    w  = w − lr / (1 − β1^t) · m / (sqrt(v) / sqrt(1 − β2^t) + eps),   copy = bf16(w)

— torch's AdamW (decoupled weight decay) on the master, with the step count t, the lr and grad_scale read on the
device (a captured CUDA graph replays them). 28 bytes a parameter (2 + 3·4 in, 3·4 + 2 out): the bytes torch's fused
AdamW moves on an fp32 gradient, with no separate pass that casts the gradient up or the weights down.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["adamw_master_step", "adamw_master_reference"]

BLOCK = 4096


@triton.jit
def _adamw_master_kernel(w_ptr, copy_ptr, g_ptr, m_ptr, v_ptr, n, step_ptr, lr_ptr, scale_ptr, beta1, beta2, eps,
                         weight_decay, HAS_COPY: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    t = tl.load(step_ptr)
    lr = tl.load(lr_ptr)
    bc1 = 1.0 - tl.exp(t * tl.log(beta1))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp(t * tl.log(beta2)))
    g = tl.load(g_ptr + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    w = tl.load(w_ptr + i, mask=mask, other=0.0)
    m = tl.load(m_ptr + i, mask=mask, other=0.0)
    v = tl.load(v_ptr + i, mask=mask, other=0.0)
    w = w * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    w = w - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(w_ptr + i, w, mask=mask)
    tl.store(m_ptr + i, m, mask=mask)
    tl.store(v_ptr + i, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + i, w.to(copy_ptr.dtype.element_ty), mask=mask)


def _check(master: torch.Tensor, copy: torch.Tensor | None, grad: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, step: torch.Tensor) -> None:
    if master.dtype != torch.float32 or exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise ValueError(f"master, exp_avg and exp_avg_sq must be float32, got {master.dtype}, {exp_avg.dtype}, "
                         f"{exp_avg_sq.dtype}")
    for name, t in (("copy", copy), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t is not None and (t.shape != master.shape or t.device != master.device):
            raise ValueError(f"{name} must have the master's shape {tuple(master.shape)} and device {master.device}, "
                             f"got {tuple(t.shape)} on {t.device}")
    if step.numel() != 1 or step.device != master.device:
        raise ValueError(f"step must be a one-element tensor on {master.device}, got {tuple(step.shape)} on "
                         f"{step.device}")


def adamw_master_reference(master: torch.Tensor, copy: torch.Tensor | None, grad: torch.Tensor,
                           exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: torch.Tensor,
                           lr: float | torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                           grad_scale: torch.Tensor | None = None) -> None:
    """The update in plain torch ops (fp32), in place; ``step`` is the count after this update (1 for the first)."""
    _check(master, copy, grad, exp_avg, exp_avg_sq, step)
    g = grad.float()
    if grad_scale is not None:
        g = g / grad_scale
    t = step.float().reshape(())
    bc1 = 1 - beta1 ** t
    bc2_sqrt = (1 - beta2 ** t).sqrt()
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    master.sub_((lr / bc1) * exp_avg / (exp_avg_sq.sqrt() / bc2_sqrt + eps))
    if copy is not None:
        copy.copy_(master)


def adamw_master_step(master: torch.Tensor, copy: torch.Tensor | None, grad: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, step: torch.Tensor, lr: float | torch.Tensor, beta1: float,
                      beta2: float, eps: float, weight_decay: float, grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW update of ``master`` (fp32, in place) from ``grad`` (any float dtype), writing ``copy`` (the model's
    parameter, e.g. bf16; None: the master is the parameter). ``step``: one-element fp32 tensor holding the count
    after this update; ``lr``: float or one-element tensor; ``grad_scale``: a one-element divisor or None. Contiguous
    tensors take the Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``); others the reference."""
    _check(master, copy, grad, exp_avg, exp_avg_sq, step)
    tensors = [t for t in (master, copy, grad, exp_avg, exp_avg_sq) if t is not None]
    kernel = master.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not kernel or not all(t.is_contiguous() for t in tensors):
        adamw_master_reference(master, copy, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
                               grad_scale)
        return
    n = master.numel()
    if n == 0:
        return
    lr_t = lr if isinstance(lr, torch.Tensor) else torch.full((), float(lr), device=master.device)
    step_t = step if step.dtype == torch.float32 else step.float()
    _adamw_master_kernel[(triton.cdiv(n, BLOCK),)](
        master, copy if copy is not None else master, grad, exp_avg, exp_avg_sq, n, step_t, lr_t,
        grad_scale if grad_scale is not None else step_t, float(beta1), float(beta2), float(eps),
        float(weight_decay), HAS_COPY=copy is not None, HAS_SCALE=grad_scale is not None, BLOCK=BLOCK,
        num_warps=8)
