"""RMSNorm (fp32 statistics) and the depthwise causal short conv with its decode tail."""

import pytest
import torch
import torch.nn.functional as F

from k3.layers.conv import ShortConv
from k3.layers.norm import RMSNorm


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def conv_loop(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    """y_t[c] = Σ_j w[c, 0, j] · x_{t − (W−1) + j}[c] with zeros before the start (fp64)."""
    B, T, C = x.shape
    W = w.shape[-1]
    y = torch.zeros(B, T, C, dtype=torch.float64)
    for t in range(T):
        for j in range(W):
            s = t - (W - 1) + j
            if s >= 0:
                y[:, t] += w[:, 0, j].double() * x[:, s].double()
    return F.silu(y) if silu else y


@pytest.mark.parametrize("T", [1, 2, 7, 63])
def test_short_conv_matches_tap_loop(T: int) -> None:
    torch.manual_seed(T)
    conv = ShortConv(12, 4)
    assert conv.weight.dtype == torch.float32 and conv.weight.shape == (12, 1, 4)
    x = torch.randn(3, T, 12)
    y, tail = conv(x)
    assert rel(y, conv_loop(x, conv.weight, True)) < 1e-6
    xp = torch.cat([torch.zeros(3, 3, 12), x], 1)
    assert torch.equal(tail, xp[:, -3:])


def test_short_conv_piecewise_and_token_by_token_equal_one_shot() -> None:
    torch.manual_seed(0)
    conv = ShortConv(8, 4)
    x = torch.randn(2, 11, 8)
    full, _ = conv(x)
    tail, outs = None, []
    for a, b in [(0, 1), (1, 3), (3, 4), (4, 10), (10, 11)]:
        y, tail = conv(x[:, a:b], tail)
        outs.append(y)
    assert rel(torch.cat(outs, 1), full) < 1e-6  # same taps; only the summation order may differ


def test_short_conv_gradient_vs_loop() -> None:
    torch.manual_seed(1)
    conv = ShortConv(5, 4)
    x = torch.randn(2, 9, 5, requires_grad=True)
    y, _ = conv(x)
    gy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, [x, conv.weight], gy)
    xd = x.detach().double().requires_grad_()
    wd = conv.weight.detach().double().requires_grad_()
    rx, rw = torch.autograd.grad(conv_loop(xd, wd, True), [xd, wd], gy.double())
    assert rel(gx, rx) < 1e-6 and rel(gw, rw) < 1e-6


def test_short_conv_rejects_bad_tail() -> None:
    conv = ShortConv(4, 4)
    with pytest.raises(ValueError, match="tail"):
        conv(torch.randn(1, 2, 4), torch.zeros(1, 2, 4))


def test_rms_norm_fp32_statistics() -> None:
    torch.manual_seed(0)
    n = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        n.weight.normal_()
    x = torch.randn(4, 16) * 300
    ref = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * n.weight.double()
    assert rel(n(x), ref) < 1e-6
    xb = x.bfloat16()
    yb = n(xb)
    assert yb.dtype == torch.bfloat16
    refb = xb.double() / (xb.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * n.weight.double()
    assert rel(yb, refb) < 1e-2  # one bf16 rounding of the output, statistics exact
