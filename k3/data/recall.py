"""Multi-query associative recall (MQAR): the synthetic task delta-rule memories are known to be good at.

A sequence first lists ``num_pairs`` key→value pairs, then asks ``num_queries`` of the keys again; after each
queried key the model must produce that key's value. Only those answers are scored (every other target is
``IGNORE``). With the byte tokenizer, keys are the bytes ``KEY_OFFSET …`` and values the bytes
``VALUE_OFFSET …``, disjoint from each other and from the specials.

    bos k₁ v₁ k₂ v₂ … k_P v_P  q₁ a₁ q₂ a₂ … q_Q a_Q        (length 1 + 2P + 2Q)

Every batch is a pure function of ``(seed, index)``, so a resumed run sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["RecallTask", "IGNORE", "recall_accuracy"]

IGNORE = -100  # target value that the loss and the accuracy skip


@dataclass(frozen=True)
class RecallTask:
    """Generator of MQAR batches over token ids.

    Keys are ``key_offset + [0, num_keys)``, values ``value_offset + [0, num_values)``.
    """

    num_pairs: int = 16
    num_queries: int = 16
    num_keys: int = 64
    num_values: int = 64
    key_offset: int = 128
    value_offset: int = 192
    bos_id: int | None = 256

    def __post_init__(self) -> None:
        for name in ("num_pairs", "num_queries", "num_keys", "num_values"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"RecallTask.{name} must be a positive integer, got {v!r}")
        if self.num_pairs > self.num_keys:
            raise ValueError(f"RecallTask.num_pairs ({self.num_pairs}) must be <= num_keys ({self.num_keys}): "
                             "keys within one sequence are distinct")
        keys = range(self.key_offset, self.key_offset + self.num_keys)
        values = range(self.value_offset, self.value_offset + self.num_values)
        if self.key_offset < 0 or self.value_offset < 0 or set(keys) & set(values):
            raise ValueError(f"RecallTask key ids {keys} and value ids {values} must be non-negative and disjoint")
        if self.bos_id is not None and (self.bos_id in keys or self.bos_id in values):
            raise ValueError(f"RecallTask.bos_id {self.bos_id} must not be a key or value id")

    @property
    def seq_len(self) -> int:
        """Tokens per sequence, the leading bos included."""
        return int(self.bos_id is not None) + 2 * (self.num_pairs + self.num_queries)

    @property
    def max_id(self) -> int:
        ids = [self.key_offset + self.num_keys - 1, self.value_offset + self.num_values - 1]
        return max(ids + ([self.bos_id] if self.bos_id is not None else []))

    @classmethod
    def for_seq_len(cls, seq_len: int, vocab_size: int, bos_id: int | None = None) -> "RecallTask":
        """The largest task (pairs = queries) whose sequences fit in ``seq_len`` tokens of a ``vocab_size``
        vocabulary."""
        if seq_len < 4 + int(bos_id is not None):
            raise ValueError(f"seq_len must be >= {4 + int(bos_id is not None)} for the recall task, got {seq_len}")
        # Keys and values take the upper half of the byte range when it exists (readable text stays below 128).
        if vocab_size >= 256:
            nk = nv = 64
            ko, vo = 128, 192
        else:
            nk = nv = (vocab_size - (1 if bos_id is not None else 0)) // 2
            ko, vo = 0, nk
            if bos_id is not None and bos_id < 2 * nk:
                raise ValueError(f"bos_id {bos_id} collides with recall ids [0, {2 * nk}) in vocab {vocab_size}")
        if nk < 2:
            raise ValueError(f"vocab_size {vocab_size} is too small for the recall task")
        pairs = min((seq_len - int(bos_id is not None)) // 4, nk)
        return cls(num_pairs=pairs, num_queries=pairs, num_keys=nk, num_values=nv, key_offset=ko, value_offset=vo,
                   bos_id=bos_id)

    def sample(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One batch: ``(tokens [B, L] int64, targets [B, L] int64)``; ``targets[:, t]`` is what the model should
        predict after reading ``tokens[:, :t+1]`` (``IGNORE`` where nothing is scored)."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        B, P, Q = batch_size, self.num_pairs, self.num_queries
        keys = np.argsort(rng.random((B, self.num_keys)), axis=1)[:, :P]  # distinct keys per row
        vals = rng.integers(0, self.num_values, size=(B, P))
        which = rng.integers(0, P, size=(B, Q))  # queries may repeat a key: recall, not a permutation
        q_keys = np.take_along_axis(keys, which, axis=1)
        q_vals = np.take_along_axis(vals, which, axis=1)
        ctx = np.stack([keys + self.key_offset, vals + self.value_offset], axis=2).reshape(B, 2 * P)
        qry = np.stack([q_keys + self.key_offset, q_vals + self.value_offset], axis=2).reshape(B, 2 * Q)
        parts = [ctx, qry]
        if self.bos_id is not None:
            parts.insert(0, np.full((B, 1), self.bos_id))
        tokens = np.concatenate(parts, axis=1).astype(np.int64)
        targets = np.full_like(tokens, IGNORE)
        off = int(self.bos_id is not None) + 2 * P
        targets[:, off:off + 2 * Q:2] = q_vals + self.value_offset  # after reading q_i, predict its value
        return tokens, targets

    def batch(self, batch_size: int, seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``index`` of the stream seeded by ``seed`` (deterministic, order-free)."""
        tokens, targets = self.sample(batch_size, np.random.default_rng([int(seed), int(index), 0x4B33]))
        return torch.from_numpy(tokens), torch.from_numpy(targets)


def recall_accuracy(logits_or_preds: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of scored positions (``targets != IGNORE``) where the prediction equals the target.

    ``logits_or_preds``: logits ``[B, L, V]`` (argmax taken) or predicted ids ``[B, L]``; ``targets`` ``[B, L]``.
    """
    if logits_or_preds.dim() == targets.dim() + 1:
        preds = logits_or_preds.argmax(-1)
    elif logits_or_preds.shape == targets.shape:
        preds = logits_or_preds
    else:
        raise ValueError(f"logits_or_preds must be [B, L, V] or [B, L] matching targets {tuple(targets.shape)}, "
                         f"got {tuple(logits_or_preds.shape)}")
    mask = targets != IGNORE
    n = int(mask.sum())
    if n == 0:
        raise ValueError("targets has no scored position (all IGNORE)")
    return float((preds[mask] == targets[mask]).sum()) / n
