"""Exact parallel prefix for KDA (SPEC §2): span summaries, their composition and scan, and the split prefill."""

from __future__ import annotations

import torch

from k3.ops.kda.chunk import _preprocess
from k3.ops.kda.naive import naive_chunk_kda_summary

__all__ = ["maybe_split_chunk_kda"]


def _span_summaries_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    use_beta_sigmoid_in_kernel: bool,
    lower_bound: float | None,
    cu_seqlens: torch.Tensor | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence ``(M [N, H, K, K], S_ext [N, H, K, V])`` fp32 (fp64 for fp64 inputs); differentiable."""
    _, kp, gp, bp = _preprocess(q, k, g, beta, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                use_beta_sigmoid_in_kernel, lower_bound, A_log, dt_bias)
    return naive_chunk_kda_summary(kp, v.to(kp.dtype), gp, bp, cu_seqlens=cu_seqlens)


def maybe_split_chunk_kda(backend: str, *args: object) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Split path (filled in by step 2); ``None`` means: run unsplit."""
    return None
