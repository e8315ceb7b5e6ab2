"""The progress line (live on a TTY, plain lines otherwise) and the loss.png writers."""

import io
import struct
import zlib

import numpy as np
import pytest

from k3.train.plot import plot_loss, render_loss_png, write_png
from k3.train.progress import Progress


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_tty():
    out = io.StringIO()
    p = Progress(25, log_every=10, stream=out)
    for s in range(1, 26):
        p.update(s, 5.0 - s * 0.1, 1234.0, 1e-3, 1.5)
    p.close()
    lines = out.getvalue().splitlines()
    assert [l.split()[1] for l in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert "\r" not in out.getvalue()
    assert "loss 2.5000" in lines[-1] and "1234 tok/s" in lines[-1] and "lr 1.0e-03" in lines[-1]
    assert "load max/mean 1.50" in lines[-1]


def test_live_line_on_a_tty():
    out = _TTY()
    p = Progress(3, stream=out)
    for s in range(1, 4):
        p.update(s, 1.0, 10.0, 1e-3, float("nan"))  # NaN imbalance (no MoE yet) is left out
    p.write("done")
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\ndone\n") and "load" not in text and "[####" in text


def _decode_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    w, h = struct.unpack(">II", chunks[b"IHDR"][:8])
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, 3)


def test_builtin_png_writer_draws_the_curve(tmp_path):
    img = np.zeros((4, 5, 3), np.uint8)
    img[1, 2] = (255, 0, 0)
    assert np.array_equal(_decode_png(write_png(img)), img)
    steps = list(range(1, 51))
    png = _decode_png(render_loss_png(steps, [5.0 / s**0.3 for s in steps], val=[(50, 2.0)]))
    assert png.shape == (420, 720, 3)
    blue = (png == (31, 119, 180)).all(-1)
    assert blue.sum() > 300  # the line is there
    assert plot_loss(tmp_path / "l.png", steps, [1.0] * 50, backend="builtin") == "builtin"
    _decode_png((tmp_path / "l.png").read_bytes())
    with pytest.raises(ValueError, match="same length"):
        plot_loss(tmp_path / "x.png", [1, 2], [1.0])
