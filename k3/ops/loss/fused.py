"""Fused linear + cross-entropy: the loss of ``hidden @ weightᵀ`` against ``targets`` without ever holding the
[tokens, vocab] logits, as a ``torch.library`` op (``k3::linear_cross_entropy``, fake + autograd registered).

The tokens go through in chunks sized so one chunk of logits (in the compute dtype) stays near 256 MiB. Per chunk:
logits = h_c Wᵀ (one GEMM, fp32 accumulation inside it); the cross-entropy step (``ce_triton``: fp32 statistics)
writes each row's loss and overwrites the logits with ∂loss/∂logits; then ∂h_c = ∂logits · W and ∂W += ∂logitsᵀ h_c
(fp32 accumulator). The gradients are therefore computed in the forward and only scaled by the incoming gradient in
the backward (the loss is a scalar). The mean divides by the number of non-ignored targets read on the device: no
host synchronisation.
"""

from __future__ import annotations

import torch

from k3.ops.loss.ce_triton import cross_entropy_chunk_

__all__ = ["linear_cross_entropy_fused", "chunk_rows"]

_CHUNK_BYTES = 256 << 20


def chunk_rows(vocab: int, elem_size: int) -> int:
    """Rows per chunk: a multiple of 64 with ≤ 256 MiB of logits (at least 64 rows)."""
    return max(64, _CHUNK_BYTES // (vocab * elem_size) // 64 * 64)


def _ce_chunk_torch(logits: torch.Tensor, targets: torch.Tensor, n_valid: torch.Tensor, loss: torch.Tensor,
                    ignore_index: int, grad: bool) -> None:
    """The same step as ``cross_entropy_chunk_`` in PyTorch (devices without the Triton kernel)."""
    x = logits.float()
    lse = torch.logsumexp(x, -1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    loss.copy_(torch.where(valid, lse - x.gather(1, safe[:, None])[:, 0], 0.0))
    if grad:
        g = torch.exp(x - lse[:, None])
        g[torch.arange(len(safe), device=g.device), safe] -= 1.0
        g *= (valid.float() / n_valid.clamp(min=1).float())[:, None]
        logits.copy_(g)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, with a/b in the compute dtype: fp32 output straight from the GEMM on CUDA."""
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def linear_cross_entropy_fwd(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                             need_grad: bool, use_triton: bool, chunk: int = 0
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [N, d]``, ``weight [V, d]``, ``targets [N]`` → ``(loss fp32 scalar, ∂loss/∂hidden [N, d] in
    hidden.dtype, ∂loss/∂weight [V, d] in weight.dtype)`` (the gradients empty when not ``need_grad``)."""
    N, d = hidden.shape
    V = weight.shape[0]
    w = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
    n_valid = (targets != ignore_index).sum()
    loss_rows = torch.empty(N, dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if need_grad else hidden.new_empty(0)
    grad_w = torch.zeros(V, d, dtype=torch.float32, device=hidden.device) if need_grad else None
    C = chunk or chunk_rows(V, hidden.element_size())
    step = cross_entropy_chunk_ if use_triton else _ce_chunk_torch
    for c0 in range(0, N, C):
        h_c = hidden[c0:c0 + C]
        logits = h_c @ w.t()
        step(logits, targets[c0:c0 + C], n_valid, loss_rows[c0:c0 + C], ignore_index, need_grad)
        if need_grad:
            torch.mm(logits, w, out=grad_h[c0:c0 + C])
            _accumulate(grad_w, logits.t(), h_c)
    loss = loss_rows.sum() / n_valid.clamp(min=1)
    return loss, grad_h, (grad_w.to(weight.dtype) if need_grad else weight.new_empty(0))


@torch.library.custom_op("k3::linear_cross_entropy", mutates_args=())
def _op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, need_grad: bool,
        use_triton: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return linear_cross_entropy_fwd(hidden, weight, targets, ignore_index, need_grad, use_triton, chunk)


@_op.register_fake
def _(hidden, weight, targets, ignore_index, need_grad, use_triton, chunk):
    loss = hidden.new_empty((), dtype=torch.float32)
    if not need_grad:
        return loss, hidden.new_empty(0), weight.new_empty(0)
    return loss, torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    _, grad_h, grad_w = output
    ctx.save_for_backward(grad_h, grad_w)


def _backward(ctx, d_loss, _dgh, _dgw):
    grad_h, grad_w = ctx.saved_tensors
    if grad_h.numel() == 0 and grad_w.numel() == 0:
        raise RuntimeError("linear_cross_entropy: backward through a call made without gradients")
    return (grad_h * d_loss.to(grad_h.dtype), grad_w * d_loss.to(grad_w.dtype), None, None, None, None, None)


_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy_fused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               ignore_index: int = -100, use_triton: bool | None = None, chunk: int = 0
                               ) -> torch.Tensor:
    """The chunked path on validated 2-D inputs. ``use_triton`` (default: CUDA) picks the Triton cross-entropy step
    (CPU tensors need ``TRITON_INTERPRET=1``); ``chunk`` overrides the rows per chunk (tests)."""
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    use_triton = hidden.is_cuda if use_triton is None else use_triton
    loss, _, _ = _op(hidden.contiguous(), weight.contiguous(), targets.contiguous(), int(ignore_index), need_grad,
                     use_triton, int(chunk))
    return loss
