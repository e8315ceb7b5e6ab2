"""Block Attention Residuals mix (docs/architecture.md#block-attention-residuals), the plain fp32 reference (and fla's
``naive_attnres`` entry over it).

    mix(w, γ; v_1..v_N) = Σ_i softmax_i(c · ⟨γ ⊙ w, RMS(v_i)⟩) · v_i,    RMS(v) = v / sqrt(mean(v²) + eps)

No 1/√d (c = 1 in K3); the raw v_i are mixed; all in fp32 (fp64 for fp64 sources, so the reference can check itself
in fp64), cast back to the sources' dtype. With ``out_norm_weight`` the RMSNorm that follows the mix is applied to
the fp32 mix before the cast: RMS(mix) · out_norm_weight, same eps.
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3.ops.attnres.checks import check_inputs

__all__ = ["attn_res_reference", "naive_attnres"]


def attn_res_reference(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    out_norm_weight: torch.Tensor | None = None,
    scale: float = 1.0,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mix the equally shaped ``[..., D]`` ``sources`` with pseudo-query ``query [D]`` (no input checks: see
    ``k3.ops.attn_res``). ``return_weights`` adds the fp32 softmax weights ``[N, ...]``."""
    acc = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    w = query.to(acc) if norm_weight is None else query.to(acc) * norm_weight.to(acc)
    v = torch.stack([s.to(acc) for s in sources])  # [N, ..., D]
    r = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax((r * w).sum(-1) * scale, dim=0)  # over sources
    o = (p.unsqueeze(-1) * v).sum(0)
    if out_norm_weight is not None:
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * out_norm_weight.to(acc)
    o = o.to(sources[0].dtype)
    return (o, p) if return_weights else o


def naive_attnres(
    query: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    rms_weight: torch.Tensor,
    output_rms_weight: torch.Tensor | None = None,
    rms_eps: float = 1e-6,
    scale: float = 1.0,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's ``naive_attnres`` (same signature and meaning): ``query [D]`` or ``[D, 1]``, ``residuals`` a non-empty
    sequence of ``[..., D]`` tensors, key-norm weight ``rms_weight [D]``, optional output norm → ``o [..., D]`` in
    the residuals' dtype (and the fp32 depth weights ``[L, ...]`` with ``return_weights``)."""
    srcs = check_inputs(query.reshape(-1), residuals, rms_weight.reshape(-1), output_rms_weight, rms_eps,
                        names=("query", "residuals", "rms_weight", "output_rms_weight", "rms_eps"))
    return attn_res_reference(query.reshape(-1), srcs, rms_weight.reshape(-1), rms_eps, output_rms_weight, scale,
                              return_weights)
