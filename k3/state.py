"""Decode state of the K3 decoder: fixed-size KDA state per KDA layer, a growing latent cache per MLA layer.

- KDA layer: the recurrent state ``S [B, H, K, V]`` (fp32) and the last ``W−1`` inputs of each of the three short
  convolutions (q, k, v), ``[B, W−1, H·K]`` in the model dtype. Size independent of the context length.
- MLA layer: the normalised ``c_kv ‖ k_pe`` per token, ``[B, L, kv_lora + rope]`` in the model dtype, preallocated
  and grown by doubling (amortised O(1) appends).

AttnRes needs no decode state: its mix runs over depth, per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["KDAState", "MLACache", "K3State"]


@dataclass
class KDAState:
    """One KDA layer's decode state for a batch of B sequences."""

    recurrent: torch.Tensor  # [B, H, K, V] fp32
    conv: list[torch.Tensor]  # [q, k, v] tails, each [B, W−1, H·K]

    @classmethod
    def zeros(cls, batch_size: int, num_heads: int, head_dim: int, conv_size: int, dtype: torch.dtype,
              device: torch.device | str | None = None) -> "KDAState":
        S = torch.zeros(batch_size, num_heads, head_dim, head_dim, dtype=torch.float32, device=device)
        tails = [torch.zeros(batch_size, conv_size - 1, num_heads * head_dim, dtype=dtype, device=device)
                 for _ in range(3)]
        return cls(recurrent=S, conv=tails)

    @property
    def batch_size(self) -> int:
        return self.recurrent.shape[0]


class MLACache:
    """Latent KV cache of one MLA layer: ``[B, capacity, dim]`` preallocated; ``length`` tokens are valid."""

    def __init__(self, batch_size: int, dim: int, dtype: torch.dtype, device: torch.device | str | None = None,
                 capacity: int = 256) -> None:
        self.buf = torch.zeros(batch_size, max(1, capacity), dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.buf.shape[0]

    def append(self, latent: torch.Tensor) -> torch.Tensor:
        """Store ``latent [B, T, dim]`` after the valid tokens; return all valid tokens ``[B, length, dim]``."""
        B, T, D = latent.shape
        need = self.length + T
        if need > self.buf.shape[1]:  # grow by doubling: O(1) amortised per token
            cap = max(need, 2 * self.buf.shape[1])
            grown = self.buf.new_zeros(B, cap, D)
            grown[:, : self.length] = self.buf[:, : self.length]
            self.buf = grown
        self.buf[:, self.length : need] = latent.to(self.buf.dtype)
        self.length = need
        return self.buf[:, :need]


@dataclass
class K3State:
    """The whole model's decode state: one entry per decoder layer (``KDAState`` or ``MLACache``)."""

    layers: list[KDAState | MLACache]
    batch_size: int
    position: int = 0  # tokens consumed so far
    extra: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes held (allocated capacity for MLA caches)."""
        n = 0
        for s in self.layers:
            if isinstance(s, KDAState):
                n += s.recurrent.numel() * s.recurrent.element_size()
                n += sum(t.numel() * t.element_size() for t in s.conv)
            else:
                n += s.buf.numel() * s.buf.element_size()
        return n
