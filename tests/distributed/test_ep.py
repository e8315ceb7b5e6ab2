"""Expert parallel: the device planner (single process) and the LatentMoE on 2 and 4 gloo ranks against the
single-process layer — outputs and every gradient (inputs, replicated parameters, routed experts after the replica
gradients are reduced to their home rank), exactly S·k rows per rank under random and skewed routing (50 % of the
tokens to 3 experts), the bytes each forward moves against the ideal, MXFP4 experts, replicated-token decode."""

import copy
import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch._dynamo  # noqa: F401  (DTensor imports it on first use: once here, not after the fork in every rank)
import torch.distributed.tensor  # noqa: F401

from k3.config import K3Config
from k3.distributed.expert_parallel import (apply_expert_parallel, default_n_hot, plan_rows, recv_splits,
                                            row_targets, source_prefix)
from k3.layers.experts_mxfp4 import MXFP4GroupedExperts
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
                                          (8, 64, 5, 4, 0.3), (4, 16, 6, 2, 0.0)])
def test_plan_fills_every_buffer_exactly_once(R, E, S, k, frac):
    idx = _skewed_idx(R, S, k, E, [0, 1, 2, 3][:max(3, k)], frac, seed=R + E)
    counts = torch.stack([torch.bincount(idx[r].flatten(), minlength=E) for r in range(R)])
    C = S * k
    plan = plan_rows(counts, C, default_n_hot(E, R))
    prefix = source_prefix(counts)
    assert bool(plan.ok)
    filled = torch.zeros(R, C, dtype=torch.int64)
    sent = torch.zeros(R, R, dtype=torch.int64)  # [source, destination]
    for s in range(R):
        dest, pos = row_targets(plan, prefix, s, idx[s])
        assert (dest < R).all()  # nothing dropped
        filled.index_put_((dest, pos), torch.ones_like(pos), accumulate=True)
        sent[s] = torch.bincount(dest, minlength=R)
    assert torch.equal(filled, torch.ones(R, C, dtype=torch.int64))  # exactly C rows per rank, each row once
    for d in range(R):  # a receiver derives what every source sends it from the plan alone
        assert torch.equal(recv_splits(plan, counts, prefix, d), sent[:, d])
    assert torch.equal(plan.keep + plan.overlap.sum(0).view(R, -1).new_zeros(E).index_add_(
        0, plan.hot.reshape(-1), plan.overlap.sum(0)), plan.load)  # kept at home + replica rows = each load
    assert torch.equal(plan.n_home + plan.overlap.sum(1), torch.full((R,), C))
    assert ((plan.overlap.sum(0) > 0) <= (plan.spill > 0)).all()  # replicas only of experts that spill


def test_plan_flags_an_infeasible_pool():
    R, E, S, k = 4, 16, 9, 3
    idx = _skewed_idx(R, S, k, E, [0, 1, 2], 1.0, seed=0)  # all rows on rank 0's experts
    counts = torch.stack([torch.bincount(idx[r].flatten(), minlength=E) for r in range(R)])
    assert not bool(plan_rows(counts, S * k, 1).ok)
    assert bool(plan_rows(counts, S * k, default_n_hot(E, R)).ok)


# ---------------------------------------------------------------------------------------------- layer on gloo
def _make_moe(n_experts: int, top_k: int, seed: int = 0) -> LatentMoE:
    torch.manual_seed(seed)
    c = K3Config.from_preset("tiny", hidden_size=16, n_experts=n_experts, top_k=top_k, expert_dim=32, latent_dim=32)
    moe = LatentMoE(c)
    with torch.no_grad():
        for _, p in moe.named_parameters():
            p.normal_(0.0, 0.3) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
        moe.gate.e_score_correction_bias.copy_(torch.randn(n_experts) * 0.1)
    return moe.train()


def _skew_router(moe: LatentMoE, x: torch.Tensor, hot: list[int]) -> None:
    """Half of the tokens (even rows: x[:, 0] = 2) take the experts in ``hot``; the rest spread over all."""
    with torch.no_grad():
        cold = [e for e in range(moe.gate.n_experts) if e not in hot]
        moe.gate.weight[:, 1:] *= 0.3
        moe.gate.weight[hot, 0] = 3.0
        moe.gate.weight[cold, 0] = -1.0
        x[:, 0] = torch.where(torch.arange(x.shape[0]) % 2 == 0, 2.0, -2.0)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))


def _check_ep(rank: int, world: int, mesh, n_experts: int, top_k: int, S: int, skew: bool) -> dict:
    moe = _make_moe(n_experts, top_k)
    x_all = torch.randn(world * S, 16, generator=torch.Generator().manual_seed(1))
    if skew:
        _skew_router(moe, x_all, [0, 1, 2])
    g_all = torch.randn(world * S, 16, generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(moe)
    x_ref = x_all.clone().requires_grad_(True)
    out_ref = ref(x_ref)
    (out_ref * g_all).sum().backward()

    (ep,) = apply_expert_parallel(moe, mesh)
    sl = slice(rank * S, (rank + 1) * S)
    x = x_all[sl].clone().requires_grad_(True)
    with torch.no_grad():
        moe(torch.randn_like(x))  # another batch first: nothing of it may leak into the next call
    out = moe(x)
    (out * g_all[sl]).sum().backward()
    st = ep.last_stats
    C = S * top_k
    assert st.rows == C and st.ok
    assert rel(out, out_ref[sl]) <= 1e-5
    assert rel(x.grad, x_ref.grad[sl]) <= 1e-5
    M = n_experts // world
    ref_params = dict(ref.named_parameters())
    for name, p in moe.named_parameters():
        if name.startswith("experts."):
            got, want = p.grad.to_local(), ref_params[name].grad[rank * M:(rank + 1) * M]
        else:  # replicated: the data-parallel gradient is the sum over ranks
            got = p.grad.clone()
            dist.all_reduce(got)
            want = ref_params[name].grad
        assert rel(got, want) <= 1e-5, name
    # bytes: every routed row goes there and back exactly once; replica weights only of the spilled experts, only
    # to the ranks that compute their rows
    assert st.bytes["rows"] == st.ideal_bytes
    totals = torch.tensor([st.bytes[k] for k in ("rows", "rows_remote", "positions", "counts", "replica_weights")]
                          + [st.ideal_bytes, st.replicas])
    dist.all_reduce(totals)
    counts = torch.stack([torch.bincount(t.flatten(), minlength=n_experts) for t in
                          ref.gate(x_all)[0].view(world, S, top_k)])  # the same routing, recomputed
    plan = plan_rows(counts, C, ep.n_hot)
    pairs = plan.overlap > 0  # [receiver, slot]
    assert int(totals[-1]) == int(pairs.sum())
    per_expert = 3 * 32 * 32 * 4
    assert int(totals[4]) == int(pairs.sum()) * per_expert  # donors never receive, so no pair is rank-local
    if skew:
        assert int(pairs.sum()) > 0 and int(plan.load.view(world, M).sum(1).max()) > C  # spills really happened
    padded = 2 * world * world * C * 32 * 4 + world * world * ep.n_hot * per_expert  # fixed slabs + whole pool
    return {"world": world, "skew": skew, "rows": int(totals[0]), "remote_rows": int(totals[1]),
            "ideal": int(totals[5]), "meta": int(totals[2] + totals[3]), "replicas": int(totals[4]),
            "padded_design": padded}


def _ep_cases(rank: int, world: int) -> None:
    mesh = _mesh(world)
    rows = [_check_ep(rank, world, mesh, n_experts=8, top_k=2, S=7, skew=False),
            _check_ep(rank, world, mesh, n_experts=8, top_k=2, S=6, skew=True),
            _check_ep(rank, world, mesh, n_experts=4 * world, top_k=3, S=5, skew=True)]
    if rank == 0:
        print("\nEP bytes per forward, all ranks (backward moves the same rows and replica weights once more):")
        print("world skew  rows(=ideal)  of which remote  positions+counts  replica weights  padded-slab design")
        for r in rows:
            print(f"{r['world']:5d} {r['skew']!s:5} {r['rows']:12d} {r['remote_rows']:16d} {r['meta']:17d} "
                  f"{r['replicas']:16d} {r['padded_design']:19d}")
    _check_infeasible(rank, world, mesh)
    with pytest.raises(ValueError, match="--ep"):
        apply_expert_parallel(_make_moe(4 * world + 1, 2), mesh)
    with pytest.raises(ValueError, match="n_hot"):
        apply_expert_parallel(_make_moe(8, 2), mesh, n_hot=99)
    moe = _make_moe(8, 2)
    apply_expert_parallel(moe, mesh)
    with pytest.raises(ValueError, match="same number of tokens"):  # raised on every rank: nobody hangs
        moe(torch.randn(3 + rank, 16))


def _check_infeasible(rank: int, world: int, mesh) -> None:
    moe = _make_moe(8, 2)
    x = torch.randn(world * 6, 16, generator=torch.Generator().manual_seed(1))
    _skew_router(moe, x, [0, 1, 2])
    (ep,) = apply_expert_parallel(moe, mesh, n_hot=0)  # no reserve: a skewed batch cannot be balanced
    with torch.no_grad():
        y = moe(x[rank * 6:(rank + 1) * 6])
    assert torch.isfinite(y).all()
    with pytest.raises(RuntimeError, match="infeasible"):
        ep.check()


@pytest.mark.parametrize("world", [2, 4])
def test_ep_layer_equals_single_process(world):
    run_ranks(_ep_cases, world)


# ---------------------------------------------------------------------------------------------- MXFP4, decode
def _mxfp4(moe: LatentMoE) -> LatentMoE:
    e = moe.experts
    moe.experts = MXFP4GroupedExperts.from_dense(e.w1.detach(), e.w3.detach(), e.w2.detach(), e.beta1, e.beta2)
    return moe.eval()


def _mxfp4_and_replicated(rank: int, world: int) -> None:
    mesh = _mesh(world)
    S = 6
    x_all = torch.randn(world * S, 16, generator=torch.Generator().manual_seed(1))
    moe = _make_moe(8, 2)
    _skew_router(moe, x_all, [0, 1, 2])
    moe = _mxfp4(moe)
    ref = copy.deepcopy(moe)
    with torch.no_grad():
        want = ref(x_all)
        (ep,) = apply_expert_parallel(moe, mesh)
        got = moe(x_all[rank * S:(rank + 1) * S])
        assert moe.experts.w1_packed.shape[0] == 8 // world
        assert ep.last_stats.rows == S * 2 and ep.last_stats.ok
        assert rel(got, want[rank * S:(rank + 1) * S]) <= 1e-5
        replicas = torch.tensor([ep.last_stats.replicas, ep.last_stats.bytes["replica_weights"]])
        dist.all_reduce(replicas)
        assert int(replicas[0]) > 0  # spilled MXFP4 experts really moved …
        assert int(replicas[1]) == int(replicas[0]) * 3 * 32 * (16 + 1)  # … as packed bytes + scales
        ep.tokens = "replicated"  # decode: every rank the same tokens, no rows or weights move
        assert rel(moe(x_all), want) <= 1e-5
    # replicated tokens with gradients (dense experts): the all-reduce passes the gradient through
    dense = _make_moe(8, 2)
    ref = copy.deepcopy(dense)
    xr = x_all.clone().requires_grad_(True)
    ref(xr).pow(2).sum().backward()
    (ep,) = apply_expert_parallel(dense, mesh, tokens="replicated")
    xe = x_all.clone().requires_grad_(True)
    dense(xe).pow(2).sum().backward()
    assert rel(xe.grad, xr.grad) <= 1e-5
    M = 8 // world
    assert rel(dense.experts.w1.grad.to_local(), ref.experts.w1.grad[rank * M:(rank + 1) * M]) <= 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_ep_mxfp4_and_replicated_tokens(world):
    run_ranks(_mxfp4_and_replicated, world)
