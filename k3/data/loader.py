"""Batches of token windows with a resumable position.

``TokenStream`` joins token arrays (memory-mapped shards or in-memory text) into one virtual sequence.
``WindowLoader`` cuts it into non-overlapping windows of ``seq_len + 1`` tokens and visits them in a seeded
random order, one permutation per epoch; its whole position is ``(epoch, index)``, so ``state_dict()`` after
step n and ``load_state_dict()`` in a new process yield exactly the batches an uninterrupted run would.
``RecallLoader`` does the same for the synthetic recall task (batch i is a pure function of (seed, i)).
Both return ``(inputs [B, T] int64, targets [B, T] int64)``: ``targets[:, t]`` is the token after ``inputs[:, t]``.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from k3.data.recall import RecallTask

__all__ = ["TokenStream", "WindowLoader", "RecallLoader", "eval_windows"]


class TokenStream:
    """Several 1-D token arrays read as one sequence; ``[start, stop)`` restricts it to a sub-range (a view)."""

    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None) -> None:
        if not parts:
            raise ValueError("parts must hold at least one token array")
        self.parts = parts
        self.ends = np.cumsum([len(p) for p in parts])
        total = int(self.ends[-1])
        self.start = int(start)
        self.stop = total if stop is None else int(stop)
        if not 0 <= self.start <= self.stop <= total:
            raise ValueError(f"start/stop must satisfy 0 <= {start} <= {stop} <= {total}")

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, start: int, stop: int) -> "TokenStream":
        return TokenStream(self.parts, self.start + start, self.start + stop)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of this view as int64 (may span arrays)."""
        a, b = self.start + start, self.start + start + length
        if start < 0 or b > self.stop:
            raise IndexError(f"read [{start}, {start + length}) outside a stream of {len(self)} tokens")
        out = np.empty(length, dtype=np.int64)
        pos = 0
        i = int(np.searchsorted(self.ends, a, side="right"))
        while pos < length:
            begin = 0 if i == 0 else int(self.ends[i - 1])
            lo = a + pos - begin
            hi = min(len(self.parts[i]), b - begin)
            out[pos:pos + hi - lo] = self.parts[i][lo:hi]
            pos += hi - lo
            i += 1
        return out

    def split(self, val_fraction: float, min_val: int) -> tuple["TokenStream", "TokenStream"]:
        """``(train, val)``: the last ``max(val_fraction · n, min_val)`` tokens are held out."""
        n_val = max(int(len(self) * val_fraction), min_val)
        if n_val >= len(self):
            raise ValueError(f"data has {len(self)} tokens: too few to hold out {n_val} for validation and "
                             "still train; bring more data or lower --seq-len")
        return self.view(0, len(self) - n_val), self.view(len(self) - n_val, len(self))


class WindowLoader:
    """Random non-overlapping windows of ``seq_len + 1`` tokens; position ``(epoch, index)``."""

    def __init__(self, stream: TokenStream, batch_size: int, seq_len: int, seed: int) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.n_windows = (len(stream) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"data has {len(stream)} tokens: fewer than one window of seq_len + 1 = {seq_len + 1}; "
                             "bring more data or lower --seq-len")
        self.stream, self.batch_size, self.seq_len, self.seed = stream, batch_size, seq_len, int(seed)
        self.epoch, self.index = 0, 0
        self._perm_epoch, self._perm = -1, np.zeros(0, dtype=np.int64)

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch, 0x4B33]).permutation(self.n_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(self.batch_size):
            w = int(self._order()[self.index])
            rows.append(self.stream.read(w * self.seq_len, self.seq_len + 1))
            self.index += 1
            if self.index == self.n_windows:
                self.epoch, self.index = self.epoch + 1, 0
        batch = torch.from_numpy(np.stack(rows))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "windows", "epoch": self.epoch, "index": self.index, "seed": self.seed,
                "n_windows": self.n_windows, "batch_size": self.batch_size, "seq_len": self.seq_len}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("kind") != "windows" or d.get("n_windows") != self.n_windows or d.get("seq_len") != self.seq_len:
            raise ValueError(f"data position {d} does not match this data ({self.n_windows} windows of "
                             f"{self.seq_len}); resume with the same --data, --seq-len and --tokenizer")
        self.epoch, self.index, self.seed = int(d["epoch"]), int(d["index"]), int(d["seed"])


class RecallLoader:
    """Batches of the recall task; position = the batch index."""

    def __init__(self, task: RecallTask, batch_size: int, seed: int) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.task, self.batch_size, self.seed, self.index = task, batch_size, int(seed), 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = self.task.batch(self.batch_size, self.seed, self.index)
        self.index += 1
        return tokens, targets

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "recall", "index": self.index, "seed": self.seed}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("kind") != "recall":
            raise ValueError(f"data position {d} is not a recall-task position; resume with the same --task")
        self.index, self.seed = int(d["index"]), int(d["seed"])


def eval_windows(stream: TokenStream, batch_size: int, seq_len: int,
                 max_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``max_batches`` batches of consecutive windows of ``stream`` (the same every time)."""
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"validation data has {len(stream)} tokens: fewer than one window of {seq_len + 1}")
    windows = range(min(n, batch_size * max_batches))
    for b in range(0, len(windows), batch_size):
        rows = [stream.read(w * seq_len, seq_len + 1) for w in windows[b:b + batch_size]]
        batch = torch.from_numpy(np.stack(rows))
        yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
