"""``loss.png``: the training curve and the validation points, drawn by matplotlib (the ``plot`` extra).

Without matplotlib a run skips the plot with one note; ``metrics.jsonl`` holds the same numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from k3.utils import atomic_write_with

__all__ = ["plot_loss"]


def plot_loss(path: str | Path, steps: list[int], losses: list[float], val: list[tuple[int, float]] | None = None,
              note: TextIO | None = None) -> bool:
    """Write the loss curve to ``path`` (PNG, atomically). Returns False, after one line on ``note`` (stderr by
    default), when matplotlib is not installed."""
    if len(steps) != len(losses):
        raise ValueError(f"steps and losses must have the same length, got {len(steps)} and {len(losses)}")
    try:
        from matplotlib.figure import Figure  # optional (the `plot` extra); Figure needs no GUI backend
    except ImportError:
        (note or sys.stderr).write("k3: matplotlib is not installed, so no loss.png (pip install 'k3[plot]'); "
                                   "metrics.jsonl has the numbers\n")
        return False
    fig = Figure(figsize=(7.2, 4.2), dpi=100, layout="tight")
    ax = fig.subplots()
    ax.plot(steps, losses, label="train", lw=1.2)
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="val", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    atomic_write_with(Path(path), lambda tmp: fig.savefig(tmp, format="png"))
    return True
