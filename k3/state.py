"""Decode state of the K3 decoder as a pool of slots: one row per sequence a server (or a caller) keeps alive.

- KDA layer: the recurrent state ``S [P, H, K, V]`` (fp32) and the last ``W−1`` inputs of each of the three short
  convolutions (q, k, v), ``[P, W−1, H·K]`` in the model dtype. Size independent of the context length.
- MLA layer (``MLACache``): the normalised ``c_kv ‖ k_pe`` per token, ``[P, capacity, kv_lora + rope]`` in the model
  dtype, preallocated.

A forward runs a batch of B sequences on B pool rows: ``K3State.slots [B]`` (int64) names them and
``K3State.start [B]`` (int32) is how many tokens each row had cached before this forward. ``begin()`` (at the start
of a model forward) gathers ``start = lengths[slots]`` on the device and hands ``slots``/``start`` to every layer's
state; ``advance(T)`` (at its end) writes ``lengths[slots] = start + T``. Nothing reads them on the host, so a
forward over a pool can be captured in a CUDA graph. ``reset(slots)`` empties rows for new sequences.

``K3ForCausalLM.init_state(B)`` makes a pool of exactly B rows bound to ``slots = arange(B)``: ``model(ids,
state=state)`` then continues B sequences together, as a plain per-batch decode state.

AttnRes needs no decode state: its mix runs over depth, per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["KDAState", "MLACache", "K3State"]


@dataclass
class KDAState:
    """One KDA layer's state pool: ``recurrent [P, H, K, V]`` fp32 and three conv tails ``[P, W−1, H·K]``.

    ``slots [B]`` (int64) are the pool rows of the current forward's B sequences (all rows by default)."""

    recurrent: torch.Tensor
    conv: list[torch.Tensor]
    slots: torch.Tensor
    start: torch.Tensor | None = None  # set with slots by K3State.begin (KDA does not need it)

    @classmethod
    def zeros(cls, pool_size: int, num_heads: int, head_dim: int, conv_size: int, dtype: torch.dtype,
              device: torch.device | str | None = None) -> "KDAState":
        S = torch.zeros(pool_size, num_heads, head_dim, head_dim, dtype=torch.float32, device=device)
        tails = [torch.zeros(pool_size, conv_size - 1, num_heads * head_dim, dtype=dtype, device=device)
                 for _ in range(3)]
        return cls(recurrent=S, conv=tails, slots=torch.arange(pool_size, device=device))

    @property
    def pool_size(self) -> int:
        return self.recurrent.shape[0]

    @property
    def batch_size(self) -> int:
        return self.slots.shape[0]

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the rows ``slots`` (a new sequence starts from S = 0 and an all-zero conv history)."""
        self.recurrent.index_fill_(0, slots, 0.0)
        for t in self.conv:
            t.index_fill_(0, slots, 0.0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.recurrent, *self.conv))


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
    """The whole model's decode state: one pool entry per decoder layer (``KDAState`` or ``MLACache``), the
    tokens cached per pool row (``lengths [P]`` int32, on the device) and the rows of the current forward.

    ``capacity``: tokens an MLA row holds (None when the model has no MLA layer: no limit). ``position`` counts the
    tokens fed through ``K3ForCausalLM.forward`` (host side, for the plain whole-batch use)."""

    layers: list[KDAState | MLACache]
    lengths: torch.Tensor
    slots: torch.Tensor
    capacity: int | None = None
    position: int = 0
    start: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def pool_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def batch_size(self) -> int:
        """Sequences of the current forward (the bound slots)."""
        return self.slots.shape[0]

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def bind(self, slots: torch.Tensor) -> None:
        """Run the next forwards on pool rows ``slots [B]`` (int64 on the state's device; distinct, in range: the
        caller checks, nothing here reads them on the host)."""
        self.slots = slots
        for s in self.layers:
            s.slots = slots

    def begin(self) -> None:
        """Start a forward: ``start = lengths[slots]`` for every layer (device ops only)."""
        self.start = self.lengths.index_select(0, self.slots)
        for s in self.layers:
            s.slots, s.start = self.slots, self.start

    def advance(self, T: int) -> None:
        """End a forward of T tokens per row: ``lengths[slots] = start + T`` (device ops only)."""
        assert self.start is not None, "advance() without begin()"
        self.lengths.index_copy_(0, self.slots, self.start + T)
        self.position += T

    def reset(self, slots: torch.Tensor) -> None:
        """Empty pool rows ``slots`` for new sequences: no cached tokens, zero KDA states and conv tails (an MLA
        row needs no clearing: attention only reads its first ``start`` positions)."""
        self.lengths.index_fill_(0, slots, 0)
        for s in self.layers:
            if isinstance(s, KDAState):
                s.reset(slots)

    def nbytes(self) -> int:
        """Bytes held (allocated capacity for MLA caches)."""
        return sum(s.nbytes() if isinstance(s, KDAState) else s.buf.numel() * s.buf.element_size()
                   for s in self.layers)
