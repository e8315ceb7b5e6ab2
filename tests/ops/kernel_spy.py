"""A stand-in for a Triton or Gluon kernel in tests: the launch syntax ``kernel[grid](*args, **kw)``, recorded."""

from __future__ import annotations

from typing import Any


class KernelSpy:
    """Records every launch as ``(grid, args, kw)`` in ``launches``; with ``real``, also launches the real kernel
    (without, nothing runs: a test of what the launcher passes)."""

    def __init__(self, real: Any = None, launches: list | None = None) -> None:
        self.real = real
        self.launches: list[tuple[tuple, tuple, dict]] = [] if launches is None else launches

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((tuple(grid), args, kw))
            if self.real is not None:
                return self.real[grid](*args, **kw)
            return None

        return launch

    @property
    def grids(self) -> list[tuple]:
        return [g for g, _, _ in self.launches]
