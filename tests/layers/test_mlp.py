"""Dense SiTU-GLU MLP: formula, the (−100, 100) bound for huge inputs, and the gradient vs the closed form."""

import torch

from k3.layers.mlp import SiTUMLP
from k3.ops.moe.situ import situ_glu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def test_situ_mlp_matches_formula() -> None:
    torch.manual_seed(0)
    mlp = SiTUMLP(16, 40)
    x = torch.randn(3, 5, 16) * 3
    xd = x.double()
    g, u = xd @ mlp.gate_proj.weight.double().t(), xd @ mlp.up_proj.weight.double().t()
    h = (4 * torch.tanh(g / 4) * torch.sigmoid(g)) * (25 * torch.tanh(u / 25))
    assert rel(mlp(x), h @ mlp.down_proj.weight.double().t()) < 1e-6


def test_situ_bound_for_huge_inputs() -> None:
    big = torch.tensor([1e4, -1e4, 1e30, -1e30, 3e38, -3e38, 0.0, 50.0, -50.0])
    g, u = torch.meshgrid(big, big, indexing="ij")
    y = situ_glu(g, u)
    # Mathematically |y| < β1·β2 = 100; in fp32 both tanh branches round to exactly ±1 for huge inputs, so
    # situ_glu clamps to the largest value below 100 to keep the open bound in floating point too.
    assert torch.isfinite(y).all() and (y.abs() < 100).all()
    assert float(y.abs().max()) > 99  # the bound is approached, not just respected by a vanishing function
    mlp = SiTUMLP(8, 16)
    with torch.no_grad():
        mlp.down_proj.weight.fill_(1.0 / 16)  # mean over the hidden units
    out = mlp(torch.full((2, 8), 1e6))
    assert torch.isfinite(out).all() and (out.abs() < 100).all()
    for dt in (torch.bfloat16, torch.float16):  # the open bound holds in every storage dtype
        assert (situ_glu(g.to(dt), u.to(dt)).abs() < 100).all()


def test_situ_gradient_vs_closed_form() -> None:
    torch.manual_seed(1)
    g = (torch.randn(4000) * 20).requires_grad_()
    u = (torch.randn(4000) * 60).requires_grad_()
    y = situ_glu(g, u)
    dg, du = torch.autograd.grad(y.sum(), [g, u])
    gd, ud = g.detach().double(), u.detach().double()
    b1, b2 = 4.0, 25.0
    tg, tu, sg = torch.tanh(gd / b1), torch.tanh(ud / b2), torch.sigmoid(gd)
    gate, up = b1 * tg * sg, b2 * tu
    d_gate = (1 - tg**2) * sg + b1 * tg * sg * (1 - sg)  # ∂/∂g of β1·tanh(g/β1)·σ(g)
    d_up = 1 - tu**2
    assert rel(dg, d_gate * up) < 1e-5
    assert rel(du, gate * d_up) < 1e-5
