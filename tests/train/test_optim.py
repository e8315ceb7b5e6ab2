"""Muon's Newton–Schulz orthogonalisation, the optimizer split, and the lr schedules."""

import math

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.train.optim import Muon, build_optimizer, clip_grad_norm, clipped_step, is_matrix, lr_factor, newton_schulz


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


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((7,), (3, 5), (1, 9))]


@pytest.mark.parametrize("lr_tensor", [False, True])
def test_muons_adamw_half_matches_torch_adamw(lr_tensor):
    """Muon's AdamW groups (device-side step counts and bias corrections) step as torch's AdamW does, with a float
    lr or a 0-dim tensor one, including a parameter that misses a step."""
    ours, ref = _params(0), _params(0)
    lr = torch.tensor(3e-2) if lr_tensor else 3e-2
    opt = Muon([{"params": ours}], lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95))
    opt.param_groups[0]["lr"] = lr
    torch_opt = torch.optim.AdamW(ref, lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        grads = [torch.randn(p.shape, generator=g) * 10 ** (step % 3 - 1) for p in ours]
        for i, (a, b, gr) in enumerate(zip(ours, ref, grads)):
            skip = i == 2 and step == 3  # this one gets no gradient at step 3: its own step count lags
            a.grad, b.grad = (None, None) if skip else (gr.clone(), gr.clone())
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    assert [float(opt.state[p]["step"]) for p in ours] == [6.0, 6.0, 5.0]


@pytest.mark.parametrize("max_norm", [1e-2, 1e3], ids=["clipped", "unclipped"])
def test_clipped_step_folds_the_clip_into_fused_adamw(max_norm):
    """``clipped_step`` with torch's fused AdamW (the clip as its ``grad_scale``) steps as clipping first and then
    a plain AdamW step does, over several steps (the moments see the clipped gradients), returns the unclipped
    norm, leaves the clipped gradients behind and no ``grad_scale`` on the optimizer."""
    ours, ref = _params(0), _params(0)
    opt = torch.optim.AdamW(ours, lr=3e-2, weight_decay=0.1, fused=True)
    torch_opt = torch.optim.AdamW(ref, lr=3e-2, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=g) * 10 ** (step - 1) for p in ours]
        for a, b, gr in zip(ours, ref, grads):
            a.grad, b.grad = gr.clone(), gr.clone()
        got = clipped_step(opt, ours, max_norm)
        want = clip_grad_norm(ref, max_norm)
        torch_opt.step()
        assert abs(float(got) - float(want)) <= 1e-6 * float(want)
        assert getattr(opt, "grad_scale", None) is None
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    if max_norm < 1:  # the clip did bite: the step differs from an unclipped one
        assert float(got) > 10 * max_norm


def test_capturable_optimizer_keeps_lr_tensors_and_saves_floats():
    """``capturable=True``: each group's lr is a tensor that ``set_lr`` writes in place; ``state_dict`` holds floats
    (a checkpoint loads into either kind), and loading writes into the same tensor objects."""
    from k3.train.optim import set_lr

    model = K3ForCausalLM(K3Config.from_preset("tiny"))
    opt = build_optimizer(model, "muon", lr=1e-3, capturable=True)
    tensors = [g["lr"] for g in opt.param_groups]
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 0 for t in tensors)
    assert set_lr(opt, 0.5) == pytest.approx(5e-4)
    assert all(g["lr"] is t and float(t) == pytest.approx(5e-4) for g, t in zip(opt.param_groups, tensors))
    sd = opt.state_dict()
    assert all(type(g["lr"]) is float for g in sd["param_groups"])
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)  # the live groups are untouched
    sd["param_groups"][0]["lr"] = 7e-4
    opt.load_state_dict(sd)
    assert all(g["lr"] is t for g, t in zip(opt.param_groups, tensors))
    assert float(tensors[0]) == pytest.approx(7e-4)
    plain = build_optimizer(model, "muon", lr=1e-3)
    plain.load_state_dict(opt.state_dict())
    assert plain.param_groups[0]["lr"] == pytest.approx(7e-4)
    assert set_lr(plain, 2.0) == pytest.approx(2e-3) and plain.param_groups[1]["lr"] == pytest.approx(2e-3)
