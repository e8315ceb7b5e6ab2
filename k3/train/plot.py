"""``loss.png``: the training curve (and validation points). matplotlib when installed, else a self-contained
PNG writer (numpy canvas, a 3×5 bitmap font, zlib), so a plot appears with no extra dependency."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np

from k3.utils import atomic_write_bytes, atomic_write_with

__all__ = ["plot_loss", "write_png", "render_loss_png"]

# --- a minimal PNG encoder --------------------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(rgb: np.ndarray) -> bytes:
    """Encode an ``[H, W, 3]`` uint8 image as PNG bytes (8-bit RGB, filter 0 on every row)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"rgb must be [H, W, 3] uint8, got {rgb.shape} {rgb.dtype}")
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1).tobytes()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit, truecolour, deflate, filter 0, no interlace
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


# 3×5 glyphs: enough for numbers and the few words on the axes.
_FONT = {
    "0": "####.##.##.####", "1": ".#.##..#..#.###", "2": "###..#####..###", "3": "###..####..####",
    "4": "#.##.####..#..#", "5": "####..###..####", "6": "####..####.####", "7": "###..#..#..#..#",
    "8": "####.#####.####", "9": "####.####..####", ".": ".............#.", "-": "......###......",
    "e": "####..##.#..###", "s": ".###...#...###.", "t": "###.#..#..#..#.", "p": "##.#.###.#..#..",
    "l": "#..#..#..#..###", "o": ".#.#.##.##.#.#.", "a": ".#.#.#####.##.#", "r": "##.#.###.#.##.#",
    "i": "###.#..#..#.###", "n": "##.#.##.##.##.#", "v": "#.##.##.##.#.#.", " ": "...............",
}


class _Canvas:
    def __init__(self, w: int, h: int) -> None:
        self.img = np.full((h, w, 3), 255, np.uint8)
        self.w, self.h = w, h

    def dot(self, x: int, y: int, c: tuple[int, int, int], r: int = 0) -> None:
        self.img[max(y - r, 0):min(y + r + 1, self.h), max(x - r, 0):min(x + r + 1, self.w)] = c

    def line(self, x0: int, y0: int, x1: int, y1: int, c: tuple[int, int, int], r: int = 0) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for t in range(n + 1):
            self.dot(round(x0 + (x1 - x0) * t / n), round(y0 + (y1 - y0) * t / n), c, r)

    def text(self, x: int, y: int, s: str, c: tuple[int, int, int] = (0, 0, 0), scale: int = 2) -> None:
        for k, ch in enumerate(s):
            glyph = _FONT.get(ch, _FONT[" "]).ljust(15, ".")
            for i in range(15):
                if glyph[i] == "#":
                    gx, gy = x + k * 4 * scale + (i % 3) * scale, y + (i // 3) * scale
                    self.img[max(gy, 0):max(gy + scale, 0), max(gx, 0):max(gx + scale, 0)] = c


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    step = (hi - lo) / n if hi > lo else 1.0
    mag = 10 ** math.floor(math.log10(step))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= step)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 and abs(v) < 1e6 else f"{v:.3g}"


def render_loss_png(steps: list[int], losses: list[float], val: list[tuple[int, float]] | None = None,
                    width: int = 720, height: int = 420) -> bytes:
    """Draw the loss curve (blue) and validation points (orange) as PNG bytes."""
    cv = _Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 20, height - 50
    pts = [(s, l) for s, l in zip(steps, losses) if math.isfinite(l)]
    vals = [(s, l) for s, l in (val or []) if math.isfinite(l)]
    if not pts:
        return write_png(cv.img)
    xs = [s for s, _ in pts + vals]
    ys = [l for _, l in pts + vals]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.05 or 0.5
    y0, y1 = y0 - pad, y1 + pad

    def px(s: float) -> int:
        return round(left + (s - x0) / (x1 - x0) * (right - left))

    def py(l: float) -> int:
        return round(bottom - (l - y0) / (y1 - y0) * (bottom - top))

    grey, black = (225, 225, 225), (0, 0, 0)
    for t in _ticks(y0, y1):
        cv.line(left, py(t), right, py(t), grey)
        cv.text(left - 8 - 8 * len(_label(t)), py(t) - 5, _label(t))
    for t in _ticks(x0, x1):
        cv.line(px(t), top, px(t), bottom, grey)
        cv.text(px(t) - 4 * len(_label(t)), bottom + 8, _label(t))
    cv.line(left, top, left, bottom, black)
    cv.line(left, bottom, right, bottom, black)
    cv.text((left + right) // 2 - 16, height - 22, "step")
    cv.text(8, 6, "loss")
    blue, orange = (31, 119, 180), (255, 127, 14)
    for (sa, la), (sb, lb) in zip(pts, pts[1:]):
        cv.line(px(sa), py(la), px(sb), py(lb), blue, r=1)
    for s, l in vals:
        cv.dot(px(s), py(l), orange, r=3)
    cv.text(right - 90, top + 6, "train", blue)
    if vals:
        cv.text(right - 90, top + 22, "val", orange)
    return write_png(cv.img)


def _plot_matplotlib(path: Path, steps: list[int], losses: list[float],
                     val: list[tuple[int, float]] | None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except Exception:  # missing, or a broken install: fall back to our own writer
        return False
    fig, ax = plt.subplots(figsize=(7.2, 4.2), dpi=100)
    ax.plot(steps, losses, label="train", lw=1.2)
    if val:
        ax.plot([s for s, _ in val], [l for _, l in val], "o-", label="val", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return True


def plot_loss(path: str | Path, steps: list[int], losses: list[float], val: list[tuple[int, float]] | None = None,
              backend: str = "auto") -> str:
    """Write ``path`` (PNG). ``backend``: ``"auto"`` (matplotlib if importable), ``"matplotlib"`` or ``"builtin"``.
    Returns the backend used."""
    if backend not in ("auto", "matplotlib", "builtin"):
        raise ValueError(f"backend must be 'auto', 'matplotlib' or 'builtin', got {backend!r}")
    if len(steps) != len(losses):
        raise ValueError(f"steps and losses must have the same length, got {len(steps)} and {len(losses)}")
    path = Path(path)
    if backend != "builtin" and _plot_matplotlib(path, steps, losses, val):
        return "matplotlib"
    if backend == "matplotlib":
        raise ValueError("backend 'matplotlib' requested but matplotlib is not importable: pip install 'k3[plot]'")
    atomic_write_bytes(path, render_loss_png(steps, losses, val))
    return "builtin"
