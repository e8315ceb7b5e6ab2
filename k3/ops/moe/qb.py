"""Quantile Balancing: per-expert routing bias from a histogram of required biases, no sort over tokens
(docs/architecture.md#quantile-balancing).

For m tokens, n experts, top-k: route with top-(k+1) on s + b; α_i is token i's (k+1)-th largest biased score and
r_ij = α_i − s_ij is the bias expert j would need to take token i. The new bias b̂_j is the ⌈q⌉-th smallest r_ij
(q = m·k/n), so exactly q tokens of the batch would pick expert j; then b ← b̂ − mean(b̂).

Every r lies in [min(b) − 1, max(b) + 1] (s ∈ (0, 1)), so an int32 histogram ``[n, num_bins]`` over that range
finds b̂ to within one bin width. Histograms add: summing them over micro-batches, layers' steps and ranks (one
all-reduce) gives the pooled-batch quantile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from k3.ops.moe._backend import use_triton

__all__ = [
    "qb_range",
    "qb_accumulate",
    "qb_histogram",
    "qb_bias_from_histogram",
    "qb_bias_update",
    "qb_all_reduce",
    "qb_exact_bias",
    "check_scores",
]


def check_scores(scores: torch.Tensor, bias: torch.Tensor, top_k: int, num_bins: int = 1000) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        raise ValueError(f"scores must be a 2-D tensor [m tokens, n experts], got {getattr(scores, 'shape', scores)}")
    m, n = scores.shape
    if not isinstance(bias, torch.Tensor) or bias.shape != (n,):
        raise ValueError(f"bias must be [n_experts] = [{n}], got {tuple(getattr(bias, 'shape', ()))}")
    if not isinstance(top_k, int) or not 0 < top_k < n:
        raise ValueError(f"top_k must be an integer in [1, n_experts={n}), got {top_k!r}")
    if not isinstance(num_bins, int) or num_bins < 2:
        raise ValueError(f"num_bins must be an integer >= 2, got {num_bins!r}")
    if m and not bool(torch.isfinite(scores).all()):
        raise ValueError("scores must be finite (sigmoid router scores in (0, 1)); found NaN or inf")
    if m and not bool(((scores > 0) & (scores < 1)).all()):
        raise ValueError("scores must lie in (0, 1): pass sigmoid router scores, not logits")
    if not bool(torch.isfinite(bias).all()):
        raise ValueError("bias must be finite")


def qb_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, bin-span) of the histogram: [min(b) − 1, max(b) + 1], as fp32 0-d tensors (no host sync)."""
    b = bias.float()
    lo = b.min() - 1.0
    return lo, (b.max() + 1.0) - lo


def qb_histogram(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, num_bins: int = 1000, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Accumulate the int32 histogram ``[n, num_bins]`` of r_ij = α_i − s_ij into ``out`` (created when None)."""
    m, n = scores.shape
    if out is None:
        out = torch.zeros(n, num_bins, dtype=torch.int32, device=scores.device)
    if m == 0:
        return out
    if use_triton(scores):  # fused: top-(k+1) and atomic bin counts in one pass, no [m, n] bin tensor
        from k3.ops.moe.router_triton import qb_histogram_fused

        return qb_histogram_fused(scores, bias, top_k, out, qb_range(bias))
    s = scores.float()
    alpha = torch.topk(s + bias.float(), top_k + 1, dim=-1).values[:, -1:]  # [m, 1] cutoff
    return qb_accumulate(alpha - s, bias, out)


def qb_accumulate(r: torch.Tensor, bias: torch.Tensor, hist: torch.Tensor) -> torch.Tensor:
    """Add the required biases ``r [m, n]`` into ``hist [n, num_bins]`` (int32, in place)."""
    n, num_bins = hist.shape
    lo, span = qb_range(bias)
    idx = ((r.float() - lo) * (num_bins / span)).floor().clamp_(0, num_bins - 1).long()
    idx += torch.arange(n, device=r.device) * num_bins
    hist.view(-1).add_(torch.bincount(idx.view(-1), minlength=n * num_bins).to(hist.dtype))
    return hist


def qb_bias_from_histogram(hist: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """New mean-centred bias [n] (fp32) from a (pooled) histogram. m is read off the counts: each token adds one
    count to every expert's row."""
    n, num_bins = hist.shape
    h = hist.to(torch.float64)
    m = h[0].sum()
    target = torch.ceil(m * top_k / n).clamp(min=1)  # ⌈q⌉
    cum = h.cumsum(1)
    b = (cum < target).sum(1).clamp(max=num_bins - 1)  # first bin whose cumulative count reaches ⌈q⌉
    c_before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(m))
    h_bin = h.gather(1, b[:, None])[:, 0]
    frac = ((target - c_before) / h_bin.clamp(min=1)).clamp(0, 1)
    lo, span = qb_range(bias)
    b_hat = lo.double() + (b.double() + frac) * (span.double() / num_bins)
    return (b_hat - b_hat.mean()).float()


def qb_all_reduce(hists: Sequence[torch.Tensor], group: "torch.distributed.ProcessGroup | None" = None) -> None:
    """Sum the QB histograms of every rank IN PLACE with one ``all_reduce`` for the whole list.

    ``hists``: the int32 ``[n_experts, num_bins]`` histograms of all MoE layers (each already summed over the step's
    micro-batches). They are packed into one flat buffer, reduced once, and unpacked — one collective per training
    step whatever the number of layers. Pass the group of ranks that see *different* tokens (data × expert ×
    context parallel), never a tensor-parallel group whose ranks see the same scores.
    """
    import torch.distributed as dist

    hists = list(hists)
    if not hists:
        return
    for i, h in enumerate(hists):
        if not isinstance(h, torch.Tensor) or h.dtype != torch.int32 or h.dim() != 2:
            raise ValueError(f"hists[{i}] must be an int32 tensor [n_experts, num_bins], got "
                             f"{getattr(h, 'dtype', type(h))} {tuple(getattr(h, 'shape', ()))}")
        if h.device != hists[0].device:
            raise ValueError(f"hists must share one device, hists[{i}] is on {h.device}, hists[0] on {hists[0].device}")
    if len(hists) == 1 and hists[0].is_contiguous():
        dist.all_reduce(hists[0], op=dist.ReduceOp.SUM, group=group)
        return
    flat = torch.cat([h.reshape(-1) for h in hists])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    start = 0
    for h in hists:
        h.copy_(flat[start:start + h.numel()].view_as(h))
        start += h.numel()


def qb_bias_update(
    scores: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    num_bins: int = 1000,
    group: "torch.distributed.ProcessGroup | None" = None,
) -> torch.Tensor:
    """One Quantile Balancing step: the new mean-centred bias ``[n]`` from sigmoid ``scores [m, n]``.

    With ``group``, every rank's histogram is summed by one all-reduce, so all ranks get the same bias — the one
    a single process would compute on the concatenated scores.
    """
    check_scores(scores, bias, top_k, num_bins)
    hist = qb_histogram(scores, bias, top_k, num_bins)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(hist, op=dist.ReduceOp.SUM, group=group)
    if int(hist[0].sum()) == 0:
        return bias.float() - bias.float().mean()
    return qb_bias_from_histogram(hist, bias, top_k)


def qb_exact_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """The exact (sorted) quantile: the reference the histogram is tested against."""
    m, n = scores.shape
    s = scores.double()
    alpha = torch.topk(s + bias.double(), top_k + 1, dim=-1).values[:, -1:]
    r = torch.sort(alpha - s, dim=0).values
    q = max(1, math.ceil(m * top_k / n))
    b_hat = r[q - 1]
    return (b_hat - b_hat.mean()).float()
