"""Decode state of the K3 decoder: fixed-size KDA state per KDA layer, a preallocated latent cache per MLA layer.

- KDA layer: the recurrent state ``S [B, H, K, V]`` (fp32) and the last ``W−1`` inputs of each of the three short
  convolutions (q, k, v), ``[B, W−1, H·K]`` in the model dtype. Size independent of the context length.
- MLA layer: the normalised ``c_kv ‖ k_pe`` per token, ``[P, capacity, kv_lora + rope]`` in the model dtype,
  preallocated (``MLACache``); writes and reads are indexed by per-row position tensors.

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
    """Latent cache of one MLA layer over a pool of sequences: ``buf [P, capacity, dim]`` (``dim`` = kv_lora + rope,
    the normalised ``c_kv ‖ k_pe`` per token), allocated once — the serving path never grows or reallocates it.

    Per forward the caller sets which pool rows the batch rows use and how much each holds already:
    ``slots`` integer ``[B]`` (None = rows 0..B−1) and ``start`` int32 ``[B]`` (tokens cached per row before this
    forward). ``GatedMLA.forward`` writes its piece's latents at positions ``start[b] + t`` and attends over
    ``start + T`` tokens; it does not move ``start``: the model-level state advances it once per model forward
    (``advance``), so all MLA layers of one forward see the same positions.
    """

    def __init__(self, pool_size: int, capacity: int, dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        for name, v in (("pool_size", pool_size), ("capacity", capacity), ("dim", dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.buf = torch.zeros(pool_size, capacity, dim, dtype=dtype, device=device)
        self.slots: torch.Tensor | None = None
        self.start = torch.zeros(pool_size, dtype=torch.int32, device=self.buf.device)

    @property
    def capacity(self) -> int:
        return self.buf.shape[1]

    @property
    def batch_size(self) -> int:
        return self.start.shape[0]

    @property
    def length(self) -> int:
        """The longest row's cached tokens (reads ``start`` on the host: a device sync; for checks and tests)."""
        return int(self.start.max()) if self.start.numel() else 0

    def write(self, latent: torch.Tensor) -> torch.Tensor:
        """Store ``latent [B, T, dim]`` at positions ``start[b] + t`` of pool rows ``slots[b]``; return ``start``
        (int32 ``[B]``). An index_put on the device: no host sync (positions are checked on CPU only)."""
        B, T, D = latent.shape
        if self.start.shape != (B,):
            raise ValueError(f"start must be [B={B}] (tokens cached per batch row), got {tuple(self.start.shape)}")
        if self.slots is not None and self.slots.shape != (B,):
            raise ValueError(f"slots must be [B={B}] (a pool row per batch row), got {tuple(self.slots.shape)}")
        if D != self.buf.shape[2]:
            raise ValueError(f"latent must be [B, T, {self.buf.shape[2]}], got {tuple(latent.shape)}")
        dev = self.buf.device
        if dev.type == "cpu" and B > 0 and not torch.compiler.is_compiling():
            if int(self.start.min()) < 0 or int(self.start.max()) + T > self.capacity:
                raise ValueError(f"start + T must be within the cache capacity {self.capacity}, got start="
                                 f"{self.start.tolist()}, T={T}")
            if self.slots is not None and not bool(((self.slots >= 0) & (self.slots < self.buf.shape[0])).all()):
                raise ValueError(f"slots must be in [0, {self.buf.shape[0]}), got {self.slots.tolist()}")
        rows = self.slots.long() if self.slots is not None else torch.arange(B, device=dev)
        pos = self.start.long()[:, None] + torch.arange(T, device=dev)
        self.buf.index_put_((rows[:, None].expand(B, T), pos), latent.to(self.buf.dtype))
        return self.start

    def advance(self, n: int) -> None:
        """``start += n`` in place (the same tensor stays referenced, e.g. by a captured CUDA graph)."""
        self.start += n


@dataclass
class K3State:
    """The whole model's decode state: one entry per decoder layer (``KDAState`` or ``MLACache``)."""

    layers: list[KDAState | MLACache]
    batch_size: int
    position: int = 0  # tokens consumed so far
    extra: dict = field(default_factory=dict)

    def advance(self, n: int) -> None:
        """After a model forward of ``n`` tokens: ``position`` and every MLA cache's ``start`` (each distinct
        ``start`` tensor once, so caches may share one) move on by ``n``."""
        self.position += n
        seen: set[int] = set()
        for s in self.layers:
            if isinstance(s, MLACache) and id(s.start) not in seen:
                seen.add(id(s.start))
                s.advance(n)

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
