"""Expert parallel: the device planner (single process) and the wrapped LatentMoE on 2 and 4 gloo ranks against
the single-process layer — outputs and every gradient (inputs, replicated parameters, routed experts after the
replica gradients are reduced to their home rank), exact S·k rows per rank under skewed routing."""

import copy
import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist

from k3.config import K3Config
from k3.distributed.expert_parallel import (ExpertParallelMoE, default_n_hot, plan_rows, rank_groups,
                                            row_targets)
from k3.layers.moe import LatentMoE

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", pathlib.Path(__file__).with_name("_gloo.py"))
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)
run_ranks = _gloo.run_ranks


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


# ---------------------------------------------------------------------------------------------- planner
def _skewed_idx(R: int, S: int, k: int, E: int, hot: list[int], frac: float, seed: int) -> torch.Tensor:
    """[R, S, k] distinct experts per token; a fraction ``frac`` of all tokens take their k experts from ``hot``."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(R, S, k, dtype=torch.int64)
    for r in range(R):
        for t in range(S):
            pool = torch.tensor(hot) if torch.rand((), generator=g) < frac else torch.arange(E)
            out[r, t] = pool[torch.randperm(len(pool), generator=g)[:k]]
    return out


@pytest.mark.parametrize("R,E,S,k,frac", [(2, 8, 7, 2, 0.5), (4, 16, 9, 3, 0.5), (4, 16, 9, 3, 1.0),
                                          (8, 64, 5, 4, 0.3)])
def test_plan_places_every_row_and_gives_each_rank_exactly_C(R, E, S, k, frac):
    idx = _skewed_idx(R, S, k, E, [0, 1, 2, 3][:max(3, k)], frac, seed=R + E)
    counts = torch.stack([torch.bincount(idx[r].flatten(), minlength=E) for r in range(R)])
    C = S * k
    plan = plan_rows(counts, C, default_n_hot(E, R))
    assert bool(plan.ok)
    filled = [torch.zeros(2 * C + 1, dtype=torch.int64) for _ in range(R)]
    for r in range(R):
        oh, orp = rank_groups(plan, r)
        assert int(oh[-1]) + int(orp[-1]) == C  # exact volume
        dest, pos = row_targets(plan, counts, r, idx[r])
        assert (pos < 2 * C).all()  # nothing dropped
        for d, p in zip(dest.tolist(), pos.tolist()):
            filled[d][p] += 1
    for r in range(R):
        oh, orp = rank_groups(plan, r)
        used = torch.zeros(2 * C + 1, dtype=torch.int64)
        used[: int(oh[-1])] = 1
        used[C: C + int(orp[-1])] = 1
        assert torch.equal(filled[r], used)  # each buffer row filled by exactly one token-expert row
    # every expert's rows: kept at home + the replica stretches = its load
    rep = torch.zeros(E, dtype=torch.int64)
    for r in range(R):
        _, orp = rank_groups(plan, r)
        rep.index_add_(0, plan.hot.reshape(-1), torch.diff(orp.long(), prepend=orp.new_zeros(1).long()))
    assert torch.equal(plan.keep + rep, plan.load)


def test_plan_flags_an_infeasible_pool():
    R, E, S, k = 4, 16, 9, 3
    idx = _skewed_idx(R, S, k, E, [0, 1, 2], 1.0, seed=0)  # all rows on rank 0's experts
    counts = torch.stack([torch.bincount(idx[r].flatten(), minlength=E) for r in range(R)])
    assert not bool(plan_rows(counts, S * k, 1).ok)
    assert bool(plan_rows(counts, S * k, default_n_hot(E, R)).ok)


# ---------------------------------------------------------------------------------------------- layer on gloo
def _make_moe(n_experts: int, top_k: int, seed: int = 0) -> LatentMoE:
    torch.manual_seed(seed)
    c = K3Config.from_preset("tiny", hidden_size=16, n_experts=n_experts, top_k=top_k, expert_dim=12, latent_dim=8)
    moe = LatentMoE(c)
    with torch.no_grad():
        for _, p in moe.named_parameters():
            p.normal_(0.0, 0.5) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
        moe.gate.e_score_correction_bias.copy_(torch.randn(n_experts) * 0.1)
    return moe.train()


def _skew_router(moe: LatentMoE, x: torch.Tensor, hot: list[int]) -> None:
    """Half of the tokens (x[:, 0] > 0) strongly prefer the experts in ``hot``."""
    with torch.no_grad():
        cold = [e for e in range(moe.gate.n_experts) if e not in hot]
        moe.gate.weight[:, 1:] *= 0.3
        moe.gate.weight[hot, 0] = 3.0
        moe.gate.weight[cold, 0] = -1.0  # mild: the other half still spreads over all experts
        x[:, 0] = torch.where(torch.arange(x.shape[0]) % 2 == 0, 2.0, -2.0)


def _check_ep(rank: int, world: int, n_experts: int, top_k: int, S: int, skew: bool) -> None:
    group = dist.group.WORLD
    moe = _make_moe(n_experts, top_k)
    x_all = torch.randn(world * S, 16, generator=torch.Generator().manual_seed(1))
    if skew:
        _skew_router(moe, x_all, [0, 1, 2])
    g_all = torch.randn(world * S, 16, generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(moe)
    x_ref = x_all.clone().requires_grad_(True)
    (ref(x_ref) * g_all).sum().backward()
    out_ref = ref(x_all.clone())  # same parameters again (no optimizer step), for the output comparison

    ep = ExpertParallelMoE(moe, group)
    sl = slice(rank * S, (rank + 1) * S)
    x = x_all[sl].clone().requires_grad_(True)
    out = ep(x)
    (out * g_all[sl]).sum().backward()
    C = S * top_k
    assert int(ep.last_stats.rows) == C and bool(ep.last_stats.ok)
    assert rel(out, out_ref[sl]) <= 1e-5
    assert rel(x.grad, x_ref.grad[sl]) <= 1e-5
    M = n_experts // world
    ref_params = dict(ref.named_parameters())
    for name, p in moe.named_parameters():
        if name.startswith("experts."):
            want = ref_params[name].grad[rank * M:(rank + 1) * M]
        else:  # replicated: data-parallel gradient = sum over ranks
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            want = ref_params[name].grad
        assert rel(p.grad, want) <= 1e-5, name
    replicas = torch.tensor([int(ep.last_stats.replicas)])
    dist.all_reduce(replicas, group=group)
    if skew:
        assert int(replicas) > 0  # the spill path really ran
        loads = ep.last_stats.load.view(world, M).sum(1)
        assert int(loads.max()) > C  # and the routing really overloaded a home rank
        _check_infeasible(ep, x_all[sl])


def _check_infeasible(ep: ExpertParallelMoE, x: torch.Tensor) -> None:
    ep.n_hot = 0  # no replica pool: a skewed batch cannot be balanced
    with torch.no_grad():
        ep(x)
    with pytest.raises(RuntimeError, match="infeasible"):
        ep.check()


def _ep_cases(rank: int, world: int) -> None:
    _check_ep(rank, world, n_experts=8, top_k=2, S=7, skew=False)
    _check_ep(rank, world, n_experts=8, top_k=2, S=6, skew=True)
    _check_ep(rank, world, n_experts=4 * world, top_k=3, S=5, skew=True)
    with pytest.raises(ValueError, match="divide n_experts"):
        ExpertParallelMoE(_make_moe(4 * world + 1, 2), dist.group.WORLD)
    with pytest.raises(ValueError, match="n_hot"):
        ExpertParallelMoE(_make_moe(8, 2), dist.group.WORLD, n_hot=99)


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_equals_single_process(world):
    run_ranks(_ep_cases, world)
