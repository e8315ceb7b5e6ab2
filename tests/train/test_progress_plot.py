"""The progress line (live on a TTY, plain lines otherwise) and loss.png."""

import io
import sys

import pytest

from k3.train.plot import plot_loss
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


def test_loss_png(tmp_path):
    pytest.importorskip("matplotlib")
    steps = list(range(1, 51))
    assert plot_loss(tmp_path / "l.png", steps, [5.0 / s**0.3 for s in steps], val=[(50, 2.0)])
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="same length"):
        plot_loss(tmp_path / "x.png", [1, 2], [1.0])


def test_no_matplotlib_skips_the_plot_with_one_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib.* now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    note = io.StringIO()
    assert plot_loss(tmp_path / "l.png", [1, 2], [2.0, 1.0], note=note) is False
    assert not (tmp_path / "l.png").exists()
    assert note.getvalue().count("\n") == 1 and "k3[plot]" in note.getvalue()
