"""Gated Multi-head Latent Attention with no positional encoding, released parameter names
(docs/architecture.md#gated-mla).

    c_q  = RMSNorm(q_a_proj x)                 q = q_b_proj c_q  → per head [q_nope (n) ‖ q_pe (r)]
    c_kv ‖ k_pe = kv_a_proj_with_mqa x         c_kv ← RMSNorm(c_kv); k_pe shared by all heads, not normalised
    kv_b_proj c_kv → per head [k_nope (n) ‖ v (v)]      k = [k_nope ‖ k_pe]   (the "rope" dims are never rotated)
    o    = causal softmax(q kᵀ / sqrt(n + r)) v   (fp32)
    y    = o_proj[ σ(g_proj x) ⊙ o ]              (channel-wise gate on the concatenated heads)

The decode cache holds the normalised ``c_kv ‖ k_pe`` per token (kv_lora + rope values). Short pieces against a
cache (decode, T ≤ ``ABSORB_MAX_T``) absorb kv_b_proj: q_nope is mapped into the latent space by the k_nope rows
and the latent output back through the v rows, so attention runs directly over the cache — the same sums in a
different order, O(H·(kv_lora + rope)) per cached token instead of re-expanding every cached token. Longer pieces
expand the keys and values and use SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.layers.norm import RMSNorm
from k3.state import MLACache

__all__ = ["GatedMLA", "causal_attention", "ABSORB_MAX_T"]

ABSORB_MAX_T = 16  # pieces up to this length attend over the latent cache directly (scores are [B, H, T, L])


def _visible(T: int, L: int, device: torch.device) -> torch.Tensor:
    """``[T, L]`` bool: the T queries sit at the last T of L positions; key j is visible to query i iff j ≤ L−T+i."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    return j <= (L - T + i)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, H, T, E]``, ``k [B, H, L, E]``, ``v [B, H, L, V]`` with the T queries at the LAST T positions of
    the L keys (L ≥ T) → ``[B, H, T, V]`` in fp32. Softmax in fp32 (inputs upcast)."""
    T, L = q.shape[2], k.shape[2]
    qf, kf, vf = q.float(), k.float(), v.float()
    if T == L:
        return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=_visible(T, L, q.device), scale=scale)


class GatedMLA(nn.Module):
    """Gated MLA (NoPE) token mixer."""

    def __init__(self, config: K3Config, layer_idx: int = 0) -> None:
        super().__init__()
        d, H = config.hidden_size, config.mla_num_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        self.absorb_max_t = ABSORB_MAX_T  # 0 forces the expanded path (tests compare the two)
        qk = self.nope + self.rope
        self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.mla_lowrank_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, config.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=config.mla_lowrank_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.rope

    def init_state(self, batch_size: int, dtype: torch.dtype, device: torch.device | str | None = None,
                   capacity: int = 256) -> MLACache:
        return MLACache(batch_size, self.cache_dim, dtype, device, capacity)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d]`` → the cached per-token latent ``[B, T, kv_lora + rope]`` = RMSNorm(c_kv) ‖ k_pe."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def forward(self, x: torch.Tensor, state: MLACache | None = None) -> torch.Tensor:
        """``x [B, T, d]`` → ``[B, T, d]``; appends this piece's latents to ``state`` when given."""
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, self.nope + self.rope)
        lat = self.latent(x)
        if state is not None:
            lat = state.append(lat)  # all cached tokens, this piece last
        if state is not None and T <= self.absorb_max_t:
            o = self._absorbed(q, lat)
        else:
            o = self._expanded(q, lat)
        return self.o_proj((o * torch.sigmoid(self.g_proj(x).float())).to(x.dtype))

    def _expanded(self, q: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
        """Keys/values re-expanded through kv_b_proj, SDPA in fp32. ``q [B, T, H, n + r]``, ``lat [B, L, c + r]``
        → ``[B, T, H·v]`` (fp32, before the output gate)."""
        B, T, H, _ = q.shape
        L = lat.shape[1]
        c_kv, k_pe = lat.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).view(B, L, H, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, L, H, self.rope)], dim=-1)
        o = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.scale)  # [B,H,T,V]
        return o.transpose(1, 2).reshape(B, T, H * self.v_dim)

    def _absorbed(self, q: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
        """Attention over the latent cache, fp32. ``q [B, T, H, n + r]``, ``lat [B, L, c + r]`` →
        ``[B, T, H·v]`` (fp32, before the output gate)."""
        B, T, H, _ = q.shape
        L, c = lat.shape[1], self.kv_lora_rank
        w = self.kv_b_proj.weight.float().view(H, self.nope + self.v_dim, c)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [H, n, c], [H, v, c]
        q_nope, q_pe = q.float().split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = lat.float().split([c, self.rope], dim=-1)
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # q_nope · k_nope = (W_UKᵀ q_nope) · c_kv
        s = torch.einsum("bthc,blc->bhtl", q_lat, c_kv) + torch.einsum("bthr,blr->bhtl", q_pe, k_pe)
        s = (s * self.scale).masked_fill(~_visible(T, L, q.device), float("-inf"))
        o_lat = torch.einsum("bhtl,blc->bthc", torch.softmax(s, dim=-1), c_kv)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * self.v_dim)
