"""FusedProjections: one GEMM equals the separate projections, the stacked copy follows every change of the weights,
and the layers that use it (KDA, gated MLA, Latent MoE with shared experts, dense MLP) give the same outputs and
decode states with it as without it; gradients never go through it."""

import pytest
import torch
from torch import nn

from k3.config import K3Config
from k3.layers.fused import FusedProjections
from k3.layers.kda import KimiDeltaAttention
from k3.layers.mla import GatedMLA
from k3.layers.mlp import SiTUMLP
from k3.layers.moe import LatentMoE


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def test_equals_the_separate_projections_and_follows_the_weights():
    torch.manual_seed(0)
    lins = [nn.Linear(24, n, bias=False) for n in (8, 5, 24)]
    fused = FusedProjections(*lins)
    x = torch.randn(2, 3, 24)
    with torch.no_grad():
        for got, lin in zip(fused(x), lins):
            assert got.shape == (2, 3, lin.out_features) and rel(got, lin(x)) <= 1e-6
        lins[1].weight.mul_(-2.0)  # in place: the copy is remade
        assert rel(fused(x)[1], lins[1](x)) <= 1e-6
        lins[2].weight.data = torch.randn(24, 24)  # replaced
        assert rel(fused(x)[2], lins[2](x)) <= 1e-6
        w = fused.stacked_weight()
        assert fused.stacked_weight() is w and fused.nbytes() == 37 * 24 * 4  # unchanged weights: no new copy
    with pytest.raises(ValueError, match="bias"):
        FusedProjections(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="input width"):
        FusedProjections(nn.Linear(4, 4, bias=False), nn.Linear(5, 4, bias=False))


def _twins(make):
    torch.manual_seed(1)
    a = make()
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0.0, 0.2)
    b = make()
    b.load_state_dict(a.state_dict())
    b.fuse_projections()
    return a, b


def test_kda_layer_fused_equals_unfused_prefill_and_decode():
    cfg = K3Config.from_preset("tiny", dtype="float32")
    a, b = _twins(lambda: KimiDeltaAttention(cfg, 0))
    x = torch.randn(3, 9, cfg.hidden_size)
    sa, sb = (m.init_state(3, torch.float32) for m in (a, b))
    with torch.no_grad():
        assert rel(b(x, sb), a(x, sa)) <= 1e-5  # chunked piece from zero states
        for t in range(2):  # decode steps continue the states in place
            assert rel(b(x[:, t:t + 1], sb), a(x[:, t:t + 1], sa)) <= 1e-5
    assert rel(sb.recurrent, sa.recurrent) <= 1e-5 and rel(sb.tails, sa.tails) <= 1e-5
    y = b(x)  # with gradients: the separate projections, gradients reach every weight
    y.sum().backward()
    assert all(p.grad is not None for p in (b.q_proj.weight, b.g_proj.weight, b.b_proj.weight))


@pytest.mark.parametrize("shared", [True, False])
def test_moe_and_mlp_fused_equal_unfused(shared):
    cfg = K3Config.from_preset("tiny", dtype="float32", n_shared_experts=1 if shared else 0)
    a, b = _twins(lambda: LatentMoE(cfg, 1).eval())
    x = torch.randn(2, 5, cfg.hidden_size)
    with torch.no_grad():
        assert rel(b(x), a(x)) <= 1e-5
    a, b = _twins(lambda: SiTUMLP(cfg.hidden_size, 48))
    with torch.no_grad():
        assert rel(b(x), a(x)) <= 1e-5


def test_mla_layer_fused_equals_unfused_prefill_and_decode():
    cfg = K3Config.from_preset("tiny", dtype="float32")
    a, b = _twins(lambda: GatedMLA(cfg, 3))
    x = torch.randn(2, 7, cfg.hidden_size)
    sa, sb = (m.init_state(2, torch.float32, capacity=16) for m in (a, b))
    with torch.no_grad():
        assert rel(b(x, sb), a(x, sa)) <= 1e-5  # a prefill piece writes its latents
        sa.advance(7), sb.advance(7)
        assert rel(b(x[:, :1], sb), a(x[:, :1], sa)) <= 1e-5  # a decode step over them (absorbed form)
    assert rel(sb.buf, sa.buf) <= 1e-6
    y = b(x)  # with gradients: the separate projections, gradients reach every weight
    y.sum().backward()
    assert all(p.grad is not None for p in (b.q_a_proj.weight, b.kv_a_proj_with_mqa.weight, b.g_proj.weight))
