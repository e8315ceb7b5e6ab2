"""The expert-sorted row layout of a small routing (decode batches) in one Triton launch, without a sort.

Row r of the sorted layout is the (token, slot) entry of flat index i whose key (expert, i) has rank r among all
keys: ``rank(i) = #{j : idx_j < idx_i or (idx_j = idx_i and j < i)}`` — the stable sort's position. Program p
computes the ranks of entries p·BR … p·BR + BR − 1 by comparing them with every entry in BJ-wide tiles (R² / BR
compares per program: a few µs for the R ≤ ``MAX_ROWS`` it is used for), stores ``row_of`` and scatters the token
of each row; the same program counts ``offs[e] = #{j : idx_j ≤ e}`` for experts p·BR … p·BR + BR − 1. The general
path (``grouped.sort_by_expert``: argsort, counting, cumsum, the inverse permutation) is about ten launches, which
is most of a decode step's routing glue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of
from k3.ops.moe._backend import alloc

__all__ = ["expert_rows_fused", "MAX_ROWS"]

MAX_ROWS = 4096  # R = m·k up to which the rank kernel runs (R²/BR compares per program stays small)


@triton.jit
def _expert_rows_kernel(idx_ptr, row_ptr, tok_ptr, offs_ptr, R, E, K: tl.constexpr, NJ: tl.constexpr,
                        BR: tl.constexpr, BJ: tl.constexpr):
    i_p = tl.program_id(0)
    o_r = i_p * BR + tl.arange(0, BR)
    m_r = o_r < R
    b_key = tl.load(idx_ptr + o_r, mask=m_r, other=0).to(tl.int32)
    o_e = i_p * BR + tl.arange(0, BR)
    b_rank = tl.zeros([BR], dtype=tl.int32)
    b_cnt = tl.zeros([BR], dtype=tl.int32)
    for i_j in range(NJ):  # NJ: tiles of BJ covering R, rounded up to a power of two (few compiled variants)
        o_j = i_j * BJ + tl.arange(0, BJ)
        m_j = o_j < R
        b_kj = tl.load(idx_ptr + o_j, mask=m_j, other=0).to(tl.int32)
        tie = (b_kj[None, :] == b_key[:, None]) & (o_j[None, :] < o_r[:, None])
        before = (b_kj[None, :] < b_key[:, None]) | tie
        b_rank += tl.sum((before & m_j[None, :]).to(tl.int32), axis=1)
        b_cnt += tl.sum(((b_kj[None, :] <= o_e[:, None]) & m_j[None, :]).to(tl.int32), axis=1)
    tl.store(row_ptr + o_r, b_rank.to(tl.int64), mask=m_r)
    tl.store(tok_ptr + b_rank, (o_r // K).to(tl.int64), mask=m_r)
    tl.store(offs_ptr + o_e, b_cnt, mask=o_e < E)


def expert_rows_fused(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``idx [m, k]`` (expert ids in [0, n_experts)) → ``(row_of [m, k] int64, token_of_row [m·k] int64,
    offs [n_experts] int32)``, as ``grouped.expert_rows``. Inputs already validated, m·k ≤ ``MAX_ROWS``."""
    m, k = idx.shape
    R = m * k
    flat = idx.reshape(-1).contiguous()
    row_of = alloc((R,), torch.int64, idx.device)
    token_of_row = alloc((R,), torch.int64, idx.device)
    offs = alloc((n_experts,), torch.int32, idx.device)
    BR, BJ = 64, 64
    NJ = triton.next_power_of_2(triton.cdiv(R, BJ)) if R else 0
    with on_device_of(idx):
        _expert_rows_kernel[(triton.cdiv(max(R, n_experts), BR),)](flat, row_of, token_of_row, offs, R, n_experts,
                                                                     K=k, NJ=NJ, BR=BR, BJ=BJ, num_warps=4)
    return row_of.view(m, k), token_of_row, offs
