"""Muon's Newton–Schulz orthogonalisation, the optimizer split, and the lr schedules."""

import math

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.train.optim import Muon, build_optimizer, is_matrix, lr_factor, newton_schulz


def test_newton_schulz_orthogonalises_batched_matrices():
    g = torch.randn(3, 20, 48, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g)
    s = torch.linalg.svdvals(o)
    # the quintic iteration trades exactness for speed: singular values land in a band around 1, not exactly 1
    assert s.min() > 0.5 and s.max() < 1.3, (s.min(), s.max())
    # same singular vectors as the exact polar factor U Vᵀ: o is close to it in direction
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = (o * (u @ vh)).sum((-2, -1)) / (o.norm(dim=(-2, -1)) * (u @ vh).norm(dim=(-2, -1)))
    assert (cos > 0.95).all()
    assert torch.allclose(newton_schulz(g.mT), o.mT, atol=1e-5)  # tall and wide agree
    with pytest.raises(ValueError, match="g must"):
        newton_schulz(torch.ones(3))


def test_parameter_split_of_the_tiny_model():
    model = K3ForCausalLM(K3Config.from_preset("tiny"))
    names = {n for n, p in model.named_parameters() if is_matrix(n, p)}
    assert any(n.endswith("experts.w1") for n in names) and any(n.endswith("q_proj.weight") for n in names)
    assert not any("embed_tokens" in n or "lm_head" in n or "conv1d" in n or "_res_proj" in n for n in names)
    opt = build_optimizer(model, "muon", lr=1e-3)
    assert isinstance(opt, Muon) and [g["name"] for g in opt.param_groups][0] == "muon"
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_opt == sum(p.numel() for p in model.parameters())  # every parameter in exactly one group


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizers_fit_a_batch(name):
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny"))
    opt = build_optimizer(model, name, lr=3e-3, weight_decay=0.0)
    x = torch.randint(0, 256, (2, 17))
    first = None
    for _ in range(12):
        loss = model(x[:, :-1], labels=x[:, :-1]).loss
        first = first if first is not None else float(loss.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert float(loss.detach()) < 0.8 * first


def test_lr_schedules():
    assert [lr_factor(s, 10, 2, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, 100, 10, "cosine", min_ratio=0.1) for s in range(100)]
    assert cos[9] == 1.0 and cos[10] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(cos[10:], cos[11:]))
    wsd = [lr_factor(s, 100, 10, "wsd", min_ratio=0.0) for s in range(100)]
    assert wsd[50] == 1.0 and wsd[79] == 1.0 and wsd[-1] == 0.0 and 0 < wsd[90] < 1
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, 10, 1, "linear")
    with pytest.raises(ValueError, match="lr"):
        build_optimizer(torch.nn.Linear(2, 2), "adamw", lr=-1.0)
    with pytest.raises(ValueError, match="optimizer"):
        build_optimizer(torch.nn.Linear(2, 2), "sgd", lr=1.0)
    assert math.isclose(lr_factor(0, 1, 0, "cosine"), 1.0)
