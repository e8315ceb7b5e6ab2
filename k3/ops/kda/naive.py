"""Step-by-step KDA reference (SPEC §2), computed in fp32 (or fp64 when the inputs are fp64).

    S_t = (I − β_t k_t k_tᵀ) · Diag(α_t) · S_{t−1} + β_t k_t v_tᵀ,     o_t = S_tᵀ (scale · q_t),   g = log α.

Shapes follow fla: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g ``[B, T, H, K]``; beta ``[B, T, H]``;
states ``[N, H, K, V]``.
"""

from __future__ import annotations

import torch

__all__ = ["naive_recurrent_kda"]


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA. Returns ``(o [B,T,H,V] in q.dtype, final_state [B,H,K,V] fp32 or None)``."""
    from k3.ops.kda.checks import check_kda_inputs

    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state)
    if scale is None:
        scale = K**-0.5
    out_dtype = q.dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(acc).clone()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # Diag(α_t) S
        k_t, v_t, b_t = k[:, t], v[:, t], beta[:, t]
        r = v_t - torch.einsum("bhk,bhkv->bhv", k_t, S)  # residual v − Sᵀk
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * r)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    final = S.float() if acc == torch.float32 else S
    return o.to(out_dtype), (final if output_final_state else None)
