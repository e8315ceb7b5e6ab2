"""Progress while training: one live line on a terminal, plain log lines otherwise.

On a TTY the line is redrawn in place (``\\r``) every step; when stdout is a file or a pipe, one plain line is
printed every ``log_every`` steps (and at the last step), so logs stay readable.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_line"]


def _fmt_num(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e4:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def format_line(step: int, total: int, loss: float, tok_s: float, lr: float, imbalance: float | None,
                elapsed: float, bar_width: int = 0, start: int = 0) -> str:
    """``step 12/300 [###.....] loss 3.214 | 12.3k tok/s | lr 2.0e-03 | load max/mean 1.31 | 0:04<1:35``."""
    frac = step / total if total else 1.0
    bar = ""
    if bar_width > 0:
        filled = int(round(frac * bar_width))
        bar = " [" + "#" * filled + "." * (bar_width - filled) + "]"
    done = step - start  # steps run by this process (a resumed run starts at its checkpoint)
    eta = elapsed / done * (total - step) if done > 0 else float("nan")
    imb = f" | load max/mean {imbalance:.2f}" if imbalance is not None and math.isfinite(imbalance) else ""
    eta_s = _fmt_time(eta) if math.isfinite(eta) else "?"
    return (f"step {step:>{len(str(total))}}/{total}{bar} loss {loss:.4f} | {_fmt_num(tok_s)} tok/s | lr {lr:.1e}"
            f"{imb} | {_fmt_time(elapsed)}<{eta_s}")


class Progress:
    """Call ``update(...)`` after every optimizer step and ``close()`` at the end."""

    def __init__(self, total: int, log_every: int = 10, stream: TextIO | None = None,
                 live: bool | None = None, start: int = 0) -> None:
        self.total, self.log_every, self.start = total, max(1, log_every), start
        self.stream = stream if stream is not None else sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.t0 = time.perf_counter()
        self._last_len = 0
        self._open = False

    def update(self, step: int, loss: float, tok_s: float, lr: float, imbalance: float | None) -> None:
        elapsed = time.perf_counter() - self.t0
        if self.live:
            width = shutil.get_terminal_size((100, 20)).columns
            for bar in (20, 10, 0):  # shrink the bar rather than wrap: a wrapped line cannot be redrawn
                line = format_line(step, self.total, loss, tok_s, lr, imbalance, elapsed, bar, self.start)
                if len(line) < width:
                    break
            line = line[: width - 1]
            pad = max(self._last_len - len(line), 0)
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
            self._last_len = len(line)
            self._open = True
        elif step % self.log_every == 0 or step == self.total or step == self.start + 1:
            self.stream.write(format_line(step, self.total, loss, tok_s, lr, imbalance, elapsed, 0, self.start) + "\n")
            self.stream.flush()

    def write(self, text: str) -> None:
        """Print a message without tearing the live line."""
        self.close()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
            self._last_len = 0
