"""Latent MoE vs a per-token loop over the selected experts; gradients; Quantile Balancing through the layer
(histogram bias vs the exact sorted quantile, repeated updates balance a skewed batch, eval / no-grad forwards
never touch the bias)."""

import pytest
import torch

from k3.config import K3Config
from k3.layers.moe import LatentMoE
from k3.ops.moe.qb import qb_exact_bias


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def situ(g: torch.Tensor, u: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * b2 * torch.tanh(u / b2)


def make_moe(seed: int = 0, n_experts: int = 6, top_k: int = 2, scale: float = 0.5, **kw) -> LatentMoE:
    torch.manual_seed(seed)
    c = K3Config.from_preset("tiny", hidden_size=16, n_experts=n_experts, top_k=top_k, expert_dim=12,
                             latent_dim=8, **kw)
    moe = LatentMoE(c)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0.0, scale) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
        moe.gate.e_score_correction_bias.copy_(torch.randn(n_experts) * 0.1)
    return moe


def per_token_reference(P: dict, bias: torch.Tensor, x: torch.Tensor, top_k: int, eps: float) -> torch.Tensor:
    """fp64: for each token, pick top-k of s + b, weight by renormalised unbiased s, run the selected experts."""
    outs = []
    for t in range(x.shape[0]):
        xt = x[t]
        s = torch.sigmoid(P["gate.weight"] @ xt)
        sel = torch.topk(s.detach() + bias, top_k).indices
        p = s[sel] / s[sel].sum()
        z = P["routed_expert_down_proj.weight"] @ xt
        u = sum(p[i] * (P["experts.w2"][j] @ situ(P["experts.w1"][j] @ z, P["experts.w3"][j] @ z))
                for i, j in enumerate(sel.tolist()))
        u = u / (u.pow(2).mean() + eps).sqrt() * P["routed_expert_norm.weight"]
        y = P["routed_expert_up_proj.weight"] @ u
        if "shared_experts.gate_proj.weight" in P:
            y = y + P["shared_experts.down_proj.weight"] @ situ(P["shared_experts.gate_proj.weight"] @ xt,
                                                                P["shared_experts.up_proj.weight"] @ xt)
        outs.append(y)
    return torch.stack(outs)


def run_ref(moe: LatentMoE, x: torch.Tensor, P: dict | None = None) -> torch.Tensor:
    P = P or {n: p.detach().double() for n, p in moe.named_parameters()}
    xf = x.reshape(-1, x.shape[-1]).double()
    return per_token_reference(P, moe.gate.e_score_correction_bias.double(), xf, moe.gate.top_k,
                               moe.eps).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("shared", [2, 0])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_latent_moe_matches_per_token_loop(T: int, shared: int) -> None:
    moe = make_moe(T, n_shared_experts=shared)
    assert (moe.shared_experts is None) == (shared == 0)
    x = torch.randn(2, T, 16)
    assert rel(moe(x), run_ref(moe, x)) < 1e-5


def test_latent_moe_gradients_match_per_token_loop() -> None:
    moe = make_moe(1)
    x = torch.randn(19, 16, requires_grad=True)
    y = moe(x)
    gy = torch.randn_like(y)
    names = [n for n, _ in moe.named_parameters()]
    got = torch.autograd.grad(y, [x, *moe.parameters()], gy)
    P = {n: p.detach().double().requires_grad_() for n, p in moe.named_parameters()}
    xd = x.detach().double().requires_grad_()
    want = torch.autograd.grad(run_ref(moe, xd, P), [xd, *P.values()], gy.double())
    for name, a, b in zip(["x", *names], got, want):
        assert torch.isfinite(a).all() and rel(a, b) < 1e-5, name
    assert moe.gate.e_score_correction_bias.grad is None and not moe.gate.e_score_correction_bias.requires_grad


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves while ``fn`` runs (what the backward keeps alive)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_recomputed_experts_give_the_same_gradients_and_keep_less() -> None:
    """The "experts" checkpointing policy: the routed experts' rows are recomputed in the backward from z. Same
    output and gradients (bitwise on CPU), the QB histogram recorded once, fewer saved bytes."""
    x = torch.randn(2, 29, 16)
    runs = []
    for recompute in (False, True):
        moe = make_moe(3, n_experts=8, top_k=4).train()
        moe.recompute_experts = recompute
        xi = x.clone().requires_grad_()
        out: list[torch.Tensor] = []
        saved = _saved_bytes(lambda: out.append(moe(xi)))
        grads = torch.autograd.grad(out[0], [xi, *moe.parameters()], torch.ones_like(out[0]))
        runs.append((out[0].detach(), grads, saved, moe.gate.qb_hist.clone(), moe.last_load.clone()))
    (y0, g0, s0, h0, l0), (y1, g1, s1, h1, l1) = runs
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert torch.equal(h0, h1) and int(h1.sum()) == 2 * 29 * 8 and torch.equal(l0, l1)
    assert s1 < s0, (s0, s1)


def test_experts_forward_signature_and_shapes() -> None:
    moe = make_moe(2)
    e = moe.experts
    assert e.w1.shape == (6, 12, 8) and e.w3.shape == (6, 12, 8) and e.w2.shape == (6, 8, 12)
    z = torch.randn(5, 8)
    offs = torch.tensor([1, 1, 3, 3, 5, 5], dtype=torch.int32)  # experts 0: row 0; 2: rows 1-2; 4: rows 3-4
    y = e(z, offs)
    groups = [0, 2, 2, 4, 4]
    ref = torch.stack([e.w2[j] @ situ(e.w1[j] @ z[r], e.w3[j] @ z[r]) for r, j in enumerate(groups)])
    assert rel(y, ref) < 1e-6


def train_forward(moe: LatentMoE, x: torch.Tensor) -> None:
    moe.train()
    with torch.enable_grad():
        moe(x)


def apply_qb(moe: LatentMoE) -> None:
    moe.gate.apply_histogram(moe.gate.qb_hist)
    moe.gate.qb_hist.zero_()


def test_qb_bias_within_one_bin_of_exact_quantile() -> None:
    moe = make_moe(3, n_experts=16, top_k=3, qb_num_bins=1000)
    x = torch.randn(500, 16)
    bias0 = moe.gate.e_score_correction_bias.clone()
    train_forward(moe, x)
    assert int(moe.gate.qb_hist.sum()) == 500 * 16
    scores = torch.sigmoid(x @ moe.gate.weight.detach().float().t())
    exact = qb_exact_bias(scores, bias0, 3)
    apply_qb(moe)
    width = float(bias0.max() - bias0.min() + 2) / 1000
    assert (moe.gate.e_score_correction_bias - exact).abs().max() <= width
    assert abs(float(moe.gate.e_score_correction_bias.mean())) < 1e-6


def test_qb_repeated_updates_balance_a_skewed_batch() -> None:
    n, k, m = 8, 2, 1024
    moe = make_moe(4, n_experts=n, top_k=k, scale=0.3)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        # experts 0 and 1 favoured by the mean token direction. (Not so strongly that their sigmoid scores
        # saturate: r_ij would then all fall inside one histogram bin, the method's resolution limit.)
        moe.gate.weight[:2] += 0.2
    x = torch.randn(m, 16) + 0.5
    train_forward(moe, x)
    target = m * k / n
    first = moe.last_load.float()
    assert first.max() > 1.5 * target  # really skewed before balancing
    for _ in range(5):
        apply_qb(moe)
        train_forward(moe, x)
    load = moe.last_load.float()
    assert int(load.sum()) == m * k
    assert ((load - target).abs() <= 0.15 * target).all(), load.tolist()


def test_qb_bias_untouched_by_eval_and_no_grad_forwards() -> None:
    moe = make_moe(5)
    b0 = moe.gate.e_score_correction_bias.clone()
    x = torch.randn(40, 16)
    moe.eval()
    moe(x)
    with torch.enable_grad():
        moe(x)
    moe.train()
    with torch.no_grad():
        moe(x)
    with torch.inference_mode():
        moe(x)
    assert int(moe.gate.qb_hist.abs().sum()) == 0 and int(moe.last_load.abs().sum()) == 0  # nothing recorded
    assert torch.equal(moe.gate.e_score_correction_bias, b0)
    moe.gate.apply_histogram(moe.gate.histogram(x.device))  # an empty histogram leaves the bias as it is
    assert torch.equal(moe.gate.e_score_correction_bias, b0)
    train_forward(moe, x)
    assert int(moe.gate.qb_hist.sum()) == 40 * 6
    assert torch.equal(moe.gate.e_score_correction_bias, b0)  # applied only by qb_step / apply_histogram
