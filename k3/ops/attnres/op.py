"""The AttnRes mix as a ``torch.library`` op (``k3::attn_res_fwd`` / ``k3::attn_res_bwd`` with a registered fake and
autograd formula, so ``torch.compile`` regions keep it as one node) and its public entries.

``attn_res``        K3's entry: fused Triton kernels on CUDA, the fp32 reference elsewhere.
``fused_attnres``   fla's signature and meaning (``fla.ops.attnres.fused_attnres``), over the same op.
``attn_res_fused``  the Triton path whatever the device (CPU tensors need ``TRITON_INTERPRET=1``): for tests.
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3.ops.attnres.checks import check_inputs
from k3.ops.attnres.fused import MAX_D, attn_res_bwd, attn_res_fwd
from k3.ops.attnres.naive import attn_res_reference

__all__ = ["attn_res", "attn_res_fused", "fused_attnres", "uses_fused"]

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.custom_op("k3::attn_res_fwd", mutates_args=())
def _fwd_op(sources: list[torch.Tensor], qw: torch.Tensor, out_norm_weight: torch.Tensor | None, eps: float,
            scale: float, save_pre: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return attn_res_fwd(sources, qw, out_norm_weight, eps, scale, save_pre)


@_fwd_op.register_fake
def _(sources, qw, out_norm_weight, eps, scale, save_pre):
    s0 = sources[0]
    T = s0.shape[0]
    o_pre = torch.empty_like(s0) if save_pre else s0.new_empty(0)
    return (torch.empty_like(s0), o_pre, s0.new_empty(T, dtype=torch.float32),
            s0.new_empty(len(sources), T, dtype=torch.float32), s0.new_empty(len(sources), T, dtype=torch.float32))


@torch.library.custom_op("k3::attn_res_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, sources: list[torch.Tensor], qw: torch.Tensor, out_norm_weight: torch.Tensor | None,
            o_pre: torch.Tensor, lse: torch.Tensor, logit: torch.Tensor, rstd: torch.Tensor, eps: float, scale: float,
            save_pre: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    return attn_res_bwd(do, sources, qw, out_norm_weight, o_pre, lse, logit, rstd, eps, scale, save_pre)


@_bwd_op.register_fake
def _(do, sources, qw, out_norm_weight, o_pre, lse, logit, rstd, eps, scale, save_pre):
    D = do.shape[-1]
    dow = do.new_empty(D if out_norm_weight is not None else 0, dtype=torch.float32)
    return [torch.empty_like(s) for s in sources], do.new_empty(D, dtype=torch.float32), dow


def _setup_context(ctx, inputs, output) -> None:
    sources, qw, out_norm_weight, eps, scale, save_pre = inputs
    _, o_pre, lse, logit, rstd = output
    ctx.save_for_backward(qw, out_norm_weight, o_pre, lse, logit, rstd, *sources)
    ctx.eps, ctx.scale, ctx.save_pre = eps, scale, save_pre


def _backward(ctx, dy, _do_pre, _dlse, _dlogit, _drstd):
    qw, out_norm_weight, o_pre, lse, logit, rstd, *sources = ctx.saved_tensors
    dsrc, dqw, dow = _bwd_op(dy.contiguous(), sources, qw, out_norm_weight, o_pre, lse, logit, rstd, ctx.eps,
                             ctx.scale, ctx.save_pre)
    d_onw = dow.to(out_norm_weight.dtype) if out_norm_weight is not None else None
    return list(dsrc), dqw, d_onw, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def uses_fused(s0: torch.Tensor) -> bool:
    """Whether ``attn_res`` runs the fused kernels for sources like ``s0`` (CUDA, fp32/bf16/fp16, D ≤ MAX_D)."""
    return s0.is_cuda and s0.dtype in _FUSED_DTYPES and s0.shape[-1] <= MAX_D


def attn_res_fused(
    query: torch.Tensor, sources: Sequence[torch.Tensor], norm_weight: torch.Tensor | None, eps: float,
    out_norm_weight: torch.Tensor | None = None, scale: float = 1.0, save_pre: bool = False,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The Triton path on validated inputs (any device the kernels run on). ``save_pre`` keeps the pre-norm mix for
    the backward (one read of the sources there instead of two, one [..., D] activation more)."""
    shape = sources[0].shape
    D = shape[-1]
    flat = [s.reshape(-1, D).contiguous() for s in sources]
    qw = query.float() if norm_weight is None else query.float() * norm_weight.float()
    y, _, lse, logit, _ = _fwd_op(flat, qw, out_norm_weight, float(eps), float(scale), bool(save_pre))
    y = y.view(shape)
    if not return_weights:
        return y
    p = torch.exp(logit.detach() * scale - lse.detach()).view(len(sources), *shape[:-1])
    return y, p


def attn_res(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor] | torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    out_norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The AttnRes mix ``Σ_i softmax_i(⟨γ ⊙ w, RMS(v_i)⟩) v_i`` of ``sources`` (N equally shaped ``[..., D]``
    tensors, or one stacked ``[N, ..., D]``) with pseudo-query ``query [D]`` (w) and key gain ``norm_weight [D]``
    (γ; None = ones), math in fp32, result in the sources' dtype.

    ``out_norm_weight [D]``: the RMSNorm that follows the mix, fused in: returns RMS(mix) · out_norm_weight (same
    eps), from the fp32 mix. Differentiable in every tensor argument. CUDA tensors (fp32/bf16/fp16, D ≤ 16384) run
    the fused Triton kernels; others the fp32 reference.
    """
    srcs = check_inputs(query, sources, norm_weight, out_norm_weight, eps)
    if uses_fused(srcs[0]):
        return attn_res_fused(query, srcs, norm_weight, eps, out_norm_weight)
    return attn_res_reference(query, srcs, norm_weight, eps, out_norm_weight)


def fused_attnres(
    query: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    rms_weight: torch.Tensor,
    output_rms_weight: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    scale: float = 1.0,
    return_weights: bool = False,
    checkpoint_level: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's ``fused_attnres`` (same signature and meaning). ``query [D]`` or ``[D, 1]``; ``residuals`` a non-empty
    sequence of same-shape ``[..., D]`` tensors; keys are ``rms_norm(v) · rms_weight`` scored against
    ``query · scale``; ``output_rms_weight`` fuses the following RMSNorm (same ``rms_eps``); ``return_weights`` adds
    the fp32 depth weights ``[L, ...]``; ``checkpoint_level`` 0 keeps the pre-norm mix for the backward, 1 recomputes
    it from the residuals. Returns ``o [..., D]`` in the residuals' dtype (and the weights)."""
    if checkpoint_level not in (0, 1):
        raise ValueError(f"checkpoint_level must be 0 or 1, got {checkpoint_level}")
    q, w = query.reshape(-1), rms_weight.reshape(-1)
    srcs = check_inputs(q, residuals, w, output_rms_weight, rms_eps,
                        names=("query", "residuals", "rms_weight", "output_rms_weight", "rms_eps"))
    if uses_fused(srcs[0]):
        return attn_res_fused(q, srcs, w, rms_eps, output_rms_weight, scale, checkpoint_level == 0, return_weights)
    return attn_res_reference(q, srcs, w, rms_eps, output_rms_weight, scale, return_weights)
