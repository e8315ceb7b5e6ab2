"""Exact two-phase AttnRes for inference (a block's pseudo-queries are known before the block runs).

Phase 1 (``attn_res_phase1``): all Q score vectors of a block against its closed blocks b_0..b_{n-1} in one pass —
each block's RMS is computed once and each block is read once per token chunk — giving per query the normalised
mix o¹ = Σ_i softmax_i(s) v_i and its log-sum-exp ℓ¹ = log Σ_i exp(s_i).

Phase 2 (``attn_res_merge``): a layer's mix over [b_0..b_{n-1}, p] (p = the open block's partial sum) is the
online-softmax merge of (o¹, ℓ¹) with p's own score s_p:

    m = max(ℓ¹, s_p),   h = (e^{ℓ¹−m} o¹ + e^{s_p−m} p) / (e^{ℓ¹−m} + e^{s_p−m})

which is the per-layer mix exactly (up to rounding); the RMSNorm that follows is fused in as in ``attn_res``.
Math in fp32 (fp64 for fp64 inputs); o¹ is stored in the sources' dtype. On CUDA without autograd (inference) the
merge is one launch of the fused forward kernel started from the state (m = ℓ¹, Σ = 1, o = o¹) — registered as
``k3::attn_res_merge``; elsewhere it runs in PyTorch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3.ops.attnres.fused import MAX_D, attn_res_fwd

__all__ = ["attn_res_phase1", "attn_res_merge", "attn_res_merge_fused", "attn_res_merge_reference"]

_CHUNK_ELEMS = 1 << 26  # fp32 elements of one token chunk's stacked sources (256 MiB)


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def attn_res_phase1(scores: torch.Tensor, sources: Sequence[torch.Tensor], eps: float, scale: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [Q, D]`` (each γ ⊙ w), ``sources`` N equally shaped ``[..., D]`` closed blocks →
    ``(o¹ [Q, ..., D] in the sources' dtype, ℓ¹ [Q, ...] fp32 (fp64 for fp64 sources))``."""
    shape, D = sources[0].shape, sources[0].shape[-1]
    acc = _acc(sources[0])
    flat = [s.reshape(-1, D) for s in sources]
    T, Q = flat[0].shape[0], scores.shape[0]
    w = scores.to(acc)
    o1 = sources[0].new_empty(Q, T, D)
    lse = torch.empty(Q, T, dtype=acc, device=sources[0].device)
    step = max(1, _CHUNK_ELEMS // max(1, len(flat) * D))
    for t0 in range(0, T, step):
        v = torch.stack([f[t0:t0 + step].to(acc) for f in flat])  # [N, C, D]
        r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [N, C]
        s = torch.einsum("ncd,qd->qnc", v, w) * r * scale  # [Q, N, C]
        lse_c = torch.logsumexp(s, 1)  # [Q, C]
        p = torch.exp(s - lse_c[:, None])
        o1[:, t0:t0 + step] = torch.einsum("qnc,ncd->qcd", p, v).to(o1.dtype)
        lse[:, t0:t0 + step] = lse_c
    return o1.view(Q, *shape), lse.view(Q, *shape[:-1])


@torch.library.custom_op("k3::attn_res_merge", mutates_args=())
def _merge_op(o1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor, score: torch.Tensor, eps: float,
              out_norm_weight: torch.Tensor | None, scale: float) -> torch.Tensor:
    y, *_ = attn_res_fwd([partial], score, out_norm_weight, eps, scale, False, (o1, lse1))
    return y


@_merge_op.register_fake
def _(o1, lse1, partial, score, eps, out_norm_weight, scale):
    return torch.empty_like(partial)


def attn_res_merge_fused(o1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor, score: torch.Tensor, eps: float,
                         out_norm_weight: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """The Triton merge (forward only) on any device the kernel runs on (CPU needs ``TRITON_INTERPRET=1``)."""
    D = partial.shape[-1]
    y = _merge_op(o1.reshape(-1, D).to(partial.dtype).contiguous(), lse1.reshape(-1).float().contiguous(),
                  partial.reshape(-1, D).contiguous(), score.float().contiguous(), float(eps), out_norm_weight,
                  float(scale))
    return y.view(partial.shape)


def attn_res_merge(o1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor, score: torch.Tensor, eps: float,
                   out_norm_weight: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """Phase 2 for one query: ``o1 [..., D]``, ``lse1 [...]`` from phase 1, the partial sum ``partial [..., D]``,
    this query's ``score [D]`` (γ ⊙ w) → the mix (normed by ``out_norm_weight`` when given) in partial's dtype."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (o1, lse1, partial, score, out_norm_weight))
    if (partial.is_cuda and not grad and partial.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and partial.shape[-1] <= MAX_D):
        return attn_res_merge_fused(o1, lse1, partial, score, eps, out_norm_weight, scale)
    return attn_res_merge_reference(o1, lse1, partial, score, eps, out_norm_weight, scale)


def attn_res_merge_reference(o1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor, score: torch.Tensor,
                             eps: float, out_norm_weight: torch.Tensor | None = None, scale: float = 1.0
                             ) -> torch.Tensor:
    """``attn_res_merge`` in PyTorch (differentiable)."""
    acc = _acc(partial)
    p = partial.to(acc)
    s = (p * score.to(acc)).sum(-1) * torch.rsqrt(p.pow(2).mean(-1) + eps) * scale
    l1 = lse1.to(acc)
    m = torch.maximum(l1, s)
    a, b = torch.exp(l1 - m), torch.exp(s - m)
    h = (a[..., None] * o1.to(acc) + b[..., None] * p) / (a + b)[..., None]
    if out_norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * out_norm_weight.to(acc)
    return h.to(partial.dtype)
