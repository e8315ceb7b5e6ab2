"""Quantile Balancing (single process): histogram bias vs the exact sorted quantile, the balance it produces,
and input checks."""

import math

import pytest
import torch

from k3.ops.moe.qb import qb_bias_update, qb_exact_bias, qb_histogram, qb_range


def _skewed_scores(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(m, n, generator=g) * 2 + torch.linspace(-3, 3, n))


@pytest.mark.parametrize("m,n,k,nb", [(1, 8, 2, 1000), (97, 16, 3, 1000), (500, 40, 6, 300)])
def test_histogram_bias_within_one_bin_of_exact(m, n, k, nb):
    s = _skewed_scores(m, n, m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.3
    b = qb_bias_update(s, bias, k, nb)
    exact = qb_exact_bias(s, bias, k)
    _, span = qb_range(bias)
    assert b.shape == (n,) and b.dtype == torch.float32
    assert abs(float(b.mean())) < 1e-5  # mean-centred
    assert (b - exact).abs().max() <= float(span) / nb + 1e-6


def test_bias_steps_balance_a_skewed_batch():
    """Each step is one exact coordinate step of the balancing dual (α moves with b), so a few steps converge."""
    m, n, k = 2000, 32, 4
    s = _skewed_scores(m, n, 3)
    q = m * k / n
    b = torch.zeros(n)
    loads = []
    for _ in range(8):
        loads.append(torch.bincount(torch.topk(s + b, k, -1).indices.flatten(), minlength=n).float() / q)
        b = qb_bias_update(s, b, k, 4000)
    assert loads[0].max() > 3  # badly skewed to start with
    assert loads[1].max() < 1.5 and loads[-1].max() < 1.1 and loads[-1].min() > 0.9


def test_histogram_counts_every_token_once_per_expert():
    s = _skewed_scores(55, 12, 4)
    h = qb_histogram(s, torch.zeros(12), 2, 50)
    assert h.dtype == torch.int32 and torch.equal(h.sum(1), torch.full((12,), 55, dtype=torch.int32))
    h2 = qb_histogram(s, torch.zeros(12), 2, 50, out=h.clone())
    assert torch.equal(h2, 2 * h)  # accumulates


def test_empty_batch_keeps_bias_centred():
    bias = torch.tensor([0.3, -0.1, 0.4, 0.0])
    b = qb_bias_update(torch.empty(0, 4), bias, 1)
    assert torch.allclose(b, bias - bias.mean())


@pytest.mark.parametrize(
    "scores,bias,top_k,match",
    [
        (torch.full((3, 4), 0.5), torch.zeros(4), 4, "top_k"),
        (torch.full((3, 4), 0.5), torch.zeros(4), 0, "top_k"),
        (torch.full((3, 4), 1.5), torch.zeros(4), 1, "scores"),
        (torch.zeros(3, 4), torch.zeros(4), 1, "scores"),
        (torch.tensor([[0.5, float("nan"), 0.2, 0.1]]), torch.zeros(4), 1, "scores"),
        (torch.tensor([[0.5, float("inf"), 0.2, 0.1]]), torch.zeros(4), 1, "scores"),
        (torch.full((3,), 0.5), torch.zeros(3), 1, "scores"),
        (torch.full((3, 4), 0.5), torch.zeros(5), 1, "bias"),
    ],
)
def test_bad_input_raises(scores, bias, top_k, match):
    with pytest.raises(ValueError, match=match):
        qb_bias_update(scores, bias, top_k)


def test_num_bins_checked():
    with pytest.raises(ValueError, match="num_bins"):
        qb_bias_update(torch.full((3, 4), 0.5), torch.zeros(4), 1, num_bins=1)
    assert math.isfinite(float(qb_bias_update(torch.full((3, 4), 0.5), torch.zeros(4), 1, num_bins=2)[0]))
