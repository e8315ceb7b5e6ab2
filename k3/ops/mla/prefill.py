"""Chunked prefill over the latent cache: a piece's queries against every cached token, in bounded memory.

Per (query, key) pair the expanded form costs H·(n + r + v) multiply-adds and the absorbed form H·(c + r + c)
(``small``: 224 vs 544; K3: 320 vs 1,088), so long pieces run expanded: the cached latents are re-expanded through
kv_b_proj segment by segment (a [S, c] × [c, H·(n + v)] matmul per segment, amortised over the piece's T queries),
each segment attended with the flash kernel, which returns its log-sum-exp, and the segments merged exactly:

    lse = log(e^{lse_a} + e^{lse_b}),   o = e^{lse_a − lse} o_a + e^{lse_b − lse} o_b

Working memory: one expanded segment (sized to ``SEGMENT_BYTES``) + the piece's fp32 accumulator — it does not
grow with the cache; the cache itself is read in its own dtype (bf16), never copied to fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.mla.attention import attention

__all__ = ["mla_prefill", "expand_latent", "segment_for"]

SEGMENT_BYTES = 256 << 20  # expanded keys + values per segment


def expand_latent(lat: torch.Tensor, w_kv: torch.Tensor, num_heads: int, nope: int,
                  v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lat [B, S, c + r]`` (normalised c_kv ‖ k_pe) → keys ``[B, S, H, n + r]`` (k_nope ‖ k_pe, k_pe shared
    by the heads) and values ``[B, S, H, v]`` (a view into the kv_b_proj output)."""
    B, S, _ = lat.shape
    c = w_kv.shape[1]
    c_kv, k_pe = lat.split([c, lat.shape[-1] - c], dim=-1)
    kv = F.linear(c_kv, w_kv).view(B, S, num_heads, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, num_heads, k_pe.shape[-1])], dim=-1)
    return k, v


def segment_for(batch: int, num_heads: int, qk_dim: int, v_dim: int, elt: int) -> int:
    """Cached tokens per segment: ``SEGMENT_BYTES`` of expanded k + v (+ the kv_b_proj output), a multiple of 1024."""
    per_token = batch * num_heads * (2 * qk_dim + 2 * v_dim) * elt
    return max(1024, SEGMENT_BYTES // per_token // 1024 * 1024)


def _merge(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
           lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attentions over disjoint key sets (``lse_acc`` finite: the first segment holds key 0)."""
    lse_new = torch.logaddexp(lse_acc, lse)
    w_a = torch.exp(lse_acc - lse_new).transpose(1, 2)[..., None]  # [B, T, H, 1]
    w_b = torch.exp(lse - lse_new).transpose(1, 2)[..., None]
    return o_acc * w_a + o.float() * w_b, lse_new


def mla_prefill(q: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor | None, start: torch.Tensor,
                w_kv: torch.Tensor, nope: int, v_dim: int, scale: float, segment: int | None = None) -> torch.Tensor:
    """``q [B, T, H, n + r]`` of a piece already written to the cache at positions ``start[b] .. start[b] + T − 1``
    of pool rows ``slots`` (None = rows 0..B−1) of ``buf [P, capacity, c + r]``; ``w_kv`` = kv_b_proj's weight
    ``[H·(n + v), c]`` → ``o [B, T, H, v]`` in q's dtype: each query over its row's cached tokens up to itself.

    One host sync (the longest row decides how many segments to read); differentiable through ``attention``.
    """
    B, T, H, D = q.shape
    if start.shape != (B,) or start.is_floating_point():
        raise ValueError(f"start must be an integer tensor [B={B}], got {start.dtype} {tuple(start.shape)}")
    if w_kv.shape[0] != H * (nope + v_dim) or buf.shape[-1] - w_kv.shape[1] != D - nope:
        raise ValueError(f"w_kv [{tuple(w_kv.shape)}] and buf [{tuple(buf.shape)}] do not match q {tuple(q.shape)}")
    start = start.to(torch.int32)
    L = int((start + T).max())
    seg = segment or segment_for(B, H, D, v_dim, q.element_size())
    rows = buf[:B] if slots is None else None
    o_acc = lse_acc = None
    for s0 in range(0, L, seg):
        lat = rows[:, s0:s0 + seg] if slots is None else buf[slots, s0:min(L, s0 + seg)]
        k, v = expand_latent(lat[:, : L - s0], w_kv, H, nope, v_dim)
        o, lse = attention(q, k, v, scale, shift=start - s0)
        if o_acc is None:
            if s0 + seg >= L:
                return o
            o_acc, lse_acc = o.float(), lse
        else:
            o_acc, lse_acc = _merge(o_acc, lse_acc, o, lse)
    return o_acc.to(q.dtype)
