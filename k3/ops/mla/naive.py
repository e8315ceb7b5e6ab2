"""Plain PyTorch references of the MLA attention ops (fp32 math; the CPU path of the layer and the tests' ground truth).

Positions: the queries of batch row b sit at key positions ``i + shift[b]`` (i = 0..T−1), so key j is visible to
query i iff ``j ≤ i + shift[b]``. Training has ``shift = 0`` (T = L, causal); T queries at the last T of L keys
have ``shift = L − T``; a key segment that starts at position s0 of a cache filled up to ``start`` has
``shift = start − s0``.
"""

from __future__ import annotations

import torch

__all__ = ["attention_ref", "mla_decode_ref", "visible_mask"]


def visible_mask(T: int, L: int, shift: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    """``[B or 1, T, L]`` bool: key j visible to query i iff ``j ≤ i + shift[b]``."""
    i = torch.arange(T, device=device)[None, :, None]
    j = torch.arange(L, device=device)[None, None, :]
    s = torch.as_tensor(shift, device=device).reshape(-1, 1, 1)
    return j <= i + s


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  shift: torch.Tensor | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, T, H, D]``, ``k [B, L, H, D]``, ``v [B, L, H, Dv]`` → ``(o [B, T, H, Dv]`` in q's dtype,
    ``lse [B, H, T]`` fp32, natural log; ``−inf`` with ``o = 0`` for a query that sees no key)."""
    T, L = q.shape[1], k.shape[1]
    s = torch.einsum("bthd,blhd->bhtl", q.float(), k.float()) * scale
    vis = visible_mask(T, L, shift, q.device)[:, None]  # [B|1, 1, T, L]
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    o = torch.einsum("bhtl,blhv->bthv", p, v.float())
    return o.to(q.dtype), lse


def mla_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor | None,
                   lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA over a latent cache pool, fp32. ``q_lat [B, T, H, c]``, ``q_pe [B, T, H, r]``,
    ``buf [P, capacity, c + r]``, ``slots [B]`` (pool row per batch row; None = rows 0..B−1), ``lengths [B]``
    (valid cached tokens incl. this piece's T) → ``o_lat [B, T, H, c]`` in q_lat's dtype. The T queries sit at the
    last T valid positions of their row (causal among them)."""
    B, T, _, c = q_lat.shape
    L = int(lengths.max())  # host sync: the reference only
    rows = buf[:B] if slots is None else buf[slots.long()]
    c_kv, k_pe = rows[:, :L].float().split([c, buf.shape[-1] - c], dim=-1)
    s = torch.einsum("bthc,blc->bthl", q_lat.float(), c_kv) + torch.einsum("bthr,blr->bthl", q_pe.float(), k_pe)
    vis = visible_mask(T, L, lengths.to(q_lat.device).long() - T, q_lat.device)[:, :, None]  # [B, T, 1, L]
    p = torch.softmax((s * scale).masked_fill(~vis, float("-inf")), dim=-1)
    return torch.einsum("bthl,blc->bthc", p, c_kv).to(q_lat.dtype)
