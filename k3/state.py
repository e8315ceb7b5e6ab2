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
    """One KDA layer's state pool: ``recurrent [P, H, K, V]`` fp32 and the q, k, v conv tails stacked in
    ``tails [3, P, W−1, H·K]`` (``conv`` lists them). ``slots [B]`` (int64) are the pool rows of the current
    forward's B sequences (all rows by default)."""

    recurrent: torch.Tensor
    tails: torch.Tensor
    slots: torch.Tensor
    start: torch.Tensor | None = None  # set with slots by K3State.begin (KDA does not need it)

    @classmethod
    def zeros(cls, pool_size: int, num_heads: int, head_dim: int, conv_size: int, dtype: torch.dtype,
              device: torch.device | str | None = None) -> "KDAState":
        S = torch.zeros(pool_size, num_heads, head_dim, head_dim, dtype=torch.float32, device=device)
        tails = torch.zeros(3, pool_size, conv_size - 1, num_heads * head_dim, dtype=dtype, device=device)
        return cls(recurrent=S, tails=tails, slots=torch.arange(pool_size, device=device))

    @property
    def conv(self) -> list[torch.Tensor]:
        """The q, k, v conv tails, each ``[P, W−1, H·K]`` (views of ``tails``)."""
        return list(self.tails.unbind(0))

    @property
    def pool_size(self) -> int:
        return self.recurrent.shape[0]

    @property
    def batch_size(self) -> int:
        return self.slots.shape[0]

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the rows ``slots`` (a new sequence starts from S = 0 and an all-zero conv history)."""
        self.recurrent.index_fill_(0, slots, 0.0)
        self.tails.index_fill_(1, slots, 0.0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.recurrent, self.tails))


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
