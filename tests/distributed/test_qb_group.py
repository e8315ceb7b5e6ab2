"""Quantile Balancing over a process group: the pooled histogram equals one process on all ranks' scores."""

import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist

from k3.ops.moe.qb import qb_all_reduce, qb_bias_from_histogram, qb_bias_update, qb_histogram

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", pathlib.Path(__file__).with_name("_gloo.py"))
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)
run_ranks = _gloo.run_ranks


def _scores(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(m, n, generator=g) * 1.5 + torch.linspace(-2, 2, n))


def _check_group(rank: int, world: int) -> None:
    n, k, nb = 24, 3, 100
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7)) * 0.2
    sizes = [37 + 11 * r for r in range(world)]  # uneven token counts per rank
    all_scores = _scores(sum(sizes), n, seed=1)
    mine = all_scores[sum(sizes[:rank]): sum(sizes[: rank + 1])]
    b_group = qb_bias_update(mine, bias, k, nb, group=dist.group.WORLD)
    b_single = qb_bias_update(all_scores, bias, k, nb)
    assert torch.equal(b_group, b_single), (rank, (b_group - b_single).abs().max())
    gathered = [torch.empty_like(b_group) for _ in range(world)]
    dist.all_gather(gathered, b_group)
    assert all(torch.equal(g, b_group) for g in gathered)  # every rank gets the same bias

    # Training: two layers (different n), two micro-batches each, one collective for everything.
    layers = [(24, 3, bias), (10, 2, torch.zeros(10))]
    hists, singles = [], []
    for i, (n_l, k_l, b_l) in enumerate(layers):
        h = torch.zeros(n_l, nb, dtype=torch.int32)
        full = torch.zeros(n_l, nb, dtype=torch.int32)
        for mb in range(2):
            per_rank = [_scores(20 + r, n_l, seed=100 * i + 10 * mb + r) for r in range(world)]
            qb_histogram(per_rank[rank], b_l, k_l, nb, out=h)
            for s in per_rank:
                qb_histogram(s, b_l, k_l, nb, out=full)
        hists.append(h)
        singles.append(full)
    qb_all_reduce(hists, group=dist.group.WORLD)
    for h, full, (n_l, k_l, b_l) in zip(hists, singles, layers):
        assert torch.equal(h, full)
        assert torch.equal(qb_bias_from_histogram(h, b_l, k_l), qb_bias_from_histogram(full, b_l, k_l))


@pytest.mark.parametrize("world", [2, 4])
def test_qb_bias_update_group_equals_single_process(world):
    run_ranks(_check_group, world)
