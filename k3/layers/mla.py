"""Gated Multi-head Latent Attention with no positional encoding, released parameter names
(docs/architecture.md#gated-mla).

    c_q  = RMSNorm(q_a_proj x)                 q = q_b_proj c_q  → per head [q_nope (n) ‖ q_pe (r)]
    c_kv ‖ k_pe = kv_a_proj_with_mqa x         c_kv ← RMSNorm(c_kv); k_pe shared by all heads, not normalised
    kv_b_proj c_kv → per head [k_nope (n) ‖ v (v)]      k = [k_nope ‖ k_pe]   (the "rope" dims are never rotated)
    o    = causal softmax(q kᵀ / sqrt(n + r)) v   (fp32 softmax statistics)
    y    = o_proj[ σ(g_proj x) ⊙ o ]              (channel-wise gate on the concatenated heads)

Three attention paths (``k3.ops.mla``; the math and the measurements: ``docs/mla.md``):

- no state (training, one-call prefill): keys and values expanded, flash attention (Triton on CUDA, bf16 in,
  fp32 statistics; the fp32 reference on CPU);
- a state and T ≤ ``ABSORB_MAX_T`` under no_grad (decode): kv_b_proj absorbed — q_nope is mapped into the latent
  space by the k_nope rows and the latent output back through the v rows, so attention reads the bf16 latent cache
  ``c_kv ‖ k_pe`` directly, once per step for all heads;
- a state otherwise (chunked prefill): the piece's queries over every cached token, the cache re-expanded segment
  by segment and merged by log-sum-exp (working memory independent of the cache length).

The decode cache (``MLACache``) holds the normalised ``c_kv ‖ k_pe`` per token (kv_lora + rope values).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.layers.fused import FusedProjections
from k3.layers.norm import RMSNorm
from k3.ops.gemv import gate_linear, linear
from k3.ops.mla import attention, expand_latent, mla_decode, mla_prefill
from k3.state import MLACache

__all__ = ["GatedMLA", "ABSORB_MAX_T"]

# Pieces up to this length attend over the latent cache in absorbed form. Below ~150 queries per row the absorbed
# form is cheaper: it reads each cached latent once for all T·H query rows, while the expanded form re-expands
# every cached latent through kv_b_proj (c·(n + v) multiply-adds per token and head) for the piece.
ABSORB_MAX_T = 16


class GatedMLA(nn.Module):
    """Gated MLA (NoPE) token mixer."""

    def __init__(self, config: K3Config, layer_idx: int = 0) -> None:
        super().__init__()
        d, H = config.hidden_size, config.mla_num_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.max_seq_len = config.max_seq_len
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
        self.fused: FusedProjections | None = None  # serving: q_a, kv_a and g from one GEMM

    def fuse_projections(self) -> None:
        """Inference forwards run q_a_proj, kv_a_proj_with_mqa and g_proj from one GEMM (``k3.layers.fused``)."""
        self.fused = FusedProjections(self.q_a_proj, self.kv_a_proj_with_mqa, self.g_proj)

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.rope

    def init_state(self, batch_size: int, dtype: torch.dtype, device: torch.device | str | None = None,
                   capacity: int | None = None) -> MLACache:
        """An empty cache for ``batch_size`` sequences of up to ``capacity`` tokens (default: ``max_seq_len``)."""
        return MLACache(batch_size, self.max_seq_len if capacity is None else capacity, self.cache_dim, dtype, device)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d]`` → the cached per-token latent ``[B, T, kv_lora + rope]`` = RMSNorm(c_kv) ‖ k_pe."""
        return self._latent(self.kv_a_proj_with_mqa(x))

    def _latent(self, kv: torch.Tensor) -> torch.Tensor:
        c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)

    def forward(self, x: torch.Tensor, state: MLACache | None = None) -> torch.Tensor:
        """``x [B, T, d]`` → ``[B, T, d]``. With ``state``: this piece's latents are written at positions
        ``state.start + t`` and the piece attends over everything cached up to itself (``start`` is not moved)."""
        B, T, _ = x.shape
        H = self.num_heads
        inference = not torch.is_grad_enabled()
        if inference and self.fused is not None:
            qa, kv, g = self.fused(x)
        else:
            qa, kv, g = self.q_a_proj(x), self.kv_a_proj_with_mqa(x), self.g_proj(x)
        cq = self.q_a_layernorm(qa)
        q = (linear(cq, self.q_b_proj.weight) if inference else self.q_b_proj(cq)).view(B, T, H, self.nope + self.rope)
        lat = self._latent(kv)
        if state is None:
            k, v = expand_latent(lat, self.kv_b_proj.weight, H, self.nope, self.v_dim)
            o, _ = attention(q, k, v, self.scale)
        else:
            start = state.write(lat)
            if T <= self.absorb_max_t and not torch.is_grad_enabled():
                o = self._absorbed(q, state, start + T)
            else:
                o = mla_prefill(q, state.buf, state.slots, start, self.kv_b_proj.weight, self.nope, self.v_dim,
                                self.scale)
        o = o.reshape(B, T, H * self.v_dim)
        if inference:  # the gate and o_proj in one kernel for a decode row (k3.ops.gemv)
            return gate_linear(o, g, self.o_proj.weight)
        return self.o_proj(o * torch.sigmoid(g))

    def _absorbed(self, q: torch.Tensor, state: MLACache, lengths: torch.Tensor) -> torch.Tensor:
        """Attention over the latent cache with kv_b_proj folded into both sides (views of its weight, in its own
        dtype). ``q [B, T, H, n + r]`` → ``[B, T, H, v]``."""
        H, c = self.num_heads, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, c)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w[:, : self.nope])  # q_nope·k_nope = (W_UKᵀ q_nope)·c_kv
        o_lat = mla_decode(q_lat.contiguous(), q_pe.contiguous(), state.buf, state.slots, lengths, self.scale)
        return torch.einsum("bthc,hvc->bthv", o_lat, w[:, self.nope :])  # o = W_UV o_lat
