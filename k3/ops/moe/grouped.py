"""Grouped GEMM for stacked experts and the token ↔ expert-row permutation.

Rows of ``a`` are sorted by expert; ``offs [E]`` (int32) holds each group's cumulative END row, so group e is rows
``offs[e-1]:offs[e]``. Rows past ``offs[-1]`` belong to no group: their output is unspecified (zero on CPU), and
nothing may read it. ``torch.nn.functional.grouped_mm`` does this on CUDA (bf16, SM80+); its CPU kernel needs
16-byte-aligned strides and has no reliable backward, so CPU runs a per-expert loop (same math).

Letters: R rows, E experts, ℓ latent width, F expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops.moe._backend import use_triton
from k3.ops.moe.experts_small import SMALL_ROWS
from k3.ops.moe.situ import situ_glu, situ_glu_packed

__all__ = ["grouped_mm", "sort_by_expert", "expert_rows", "permute_rows", "grouped_ffn", "grouped_ffn_gemms",
           "grouped_ffn_packed", "expert_counts"]

_gmm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        outs.append(a[start:end] @ b[e])
        start = end
    if start < a.shape[0]:  # rows past the last group: no expert, zero output (keeps the row count static)
        outs.append(a.new_zeros(a.shape[0] - start, b.shape[-1]))
    return torch.cat(outs, 0) if outs else a.new_zeros(0, b.shape[-1])


# The per-expert loop reads the group ends on the host; as a torch.library op it is one opaque node, so a compiled
# layer keeps a single graph on every device (the loop runs where grouped_mm has no kernel: CPU, fp32).
@torch.library.custom_op("k3::grouped_mm_loop", mutates_args=())
def _loop_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _loop(a, b, offs)


@_loop_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("k3::grouped_mm_loop_bwd", mutates_args=())
def _loop_mm_bwd(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(da, db)`` of ``out = a·b`` per group: da = grad·b[e]ᵀ, db[e] = a_eᵀ·grad_e (zero for empty groups)."""
    da = _loop(grad, b.transpose(-2, -1), offs)
    db = torch.zeros(b.shape, dtype=b.dtype, device=b.device)  # contiguous, as the fake impl says
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            db[e] = a[start:end].t() @ grad[start:end]
        start = end
    return da, db


@_loop_mm_bwd.register_fake
def _(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor):  # noqa: ANN202
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _loop_setup(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    ctx.save_for_backward(*inputs)


def _loop_backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    a, b, offs = ctx.saved_tensors
    da, db = _loop_mm_bwd(grad.contiguous(), a, b, offs)
    return da, db, None


_loop_mm.register_autograd(_loop_backward, setup_context=_loop_setup)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [R, K]`` (rows grouped by expert) × ``b [E, K, N]`` → ``[R, N]``."""
    if torch.is_autocast_enabled(a.device.type):
        # a custom op is opaque to autocast: cast as it casts a matmul, so the backward sees one dtype too
        dt = torch.get_autocast_dtype(a.device.type)
        a, b = a.to(dt), b.to(dt)
    if a.is_cuda and _gmm is not None and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return _gmm(a, b, offs=offs)
    return _loop_mm(a, b, offs)


def expert_counts(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert ``[E]`` int64 from ``idx [...]`` without a host sync (``bincount`` on CUDA syncs)."""
    flat = idx.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=idx.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))


def sort_by_expert(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten routing ``idx [m, k]`` into expert-sorted rows.

    Returns ``(order [m*k], token_of_row [m*k], offs [E] int32)``: row r of the sorted layout is the
    (token, slot) pair ``order[r]`` of the flattened idx, belonging to token ``token_of_row[r]``.
    """
    flat = idx.reshape(-1)
    keys, order = torch.sort(flat, stable=True)
    token_of_row = order // idx.shape[1]
    # group ends by binary search over the sorted keys, not by counting: inductor has no int64 atomic add, and its
    # fallback for an int64 scatter-add walks each expert's thousands of repeats serially (18–32 ms of a `small`
    # training step; the search is one small kernel)
    offs = torch.searchsorted(keys, torch.arange(n_experts, device=flat.device, dtype=flat.dtype), right=True,
                              out_int32=True)
    return order, token_of_row, offs


def expert_rows(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert-sorted layout of routing ``idx [m, k]`` addressed from the token side.

    Returns ``(row_of [m, k] int64, token_of_row [m*k] int64, offs [E] int32)``: entry (t, j) is row ``row_of[t, j]``
    of the layout of ``sort_by_expert`` (same stable order, same ``token_of_row`` and ``offs``), i.e. ``row_of`` is
    the inverse of its ``order``. On CUDA, small routings (decode batches, m·k ≤ ``rows_triton.MAX_ROWS``) take one
    Triton launch instead of the sort's ten.
    """
    if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be an integer tensor [m, k], got {idx.dtype} {tuple(idx.shape)}")
    if use_triton(idx):
        from k3.ops.moe.rows_triton import MAX_ROWS, expert_rows_fused

        if idx.numel() <= MAX_ROWS:
            return expert_rows_fused(idx, n_experts)
    order, token_of_row, offs = sort_by_expert(idx, n_experts)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=order.device)
    return row_of.view(idx.shape), token_of_row, offs


def permute_rows(z: torch.Tensor, token_of_row: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """Expert-sorted copy of the tokens: ``z [m, ℓ]`` → ``z[token_of_row] [m*k, ℓ]``, with ``token_of_row`` and
    ``row_of [m, k]`` from :func:`expert_rows`. On CUDA its backward gathers each token's k row gradients and sums
    them (``rows_sum``) instead of scattering them with atomics."""
    if row_of.dim() != 2 or row_of.numel() != token_of_row.shape[0] or row_of.shape[0] != z.shape[0]:
        raise ValueError(f"row_of must be [m={z.shape[0]}, k] with m*k = {token_of_row.shape[0]} entries, got "
                         f"{tuple(row_of.shape)}")
    if use_triton(z):
        from k3.ops.moe.combine_triton import permute_rows_fused

        return permute_rows_fused(z, token_of_row, row_of)
    return z[token_of_row]


def _small_rows_path(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``grouped_ffn`` runs the fused small-row kernels: an inference call (no gradient to record) with at
    most ``SMALL_ROWS`` rows, one dtype and no autocast, on the Triton backend."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, w3, w2))
    return (x.shape[0] <= SMALL_ROWS and not needs_grad and x.dtype == w1.dtype == w3.dtype == w2.dtype
            and not torch.is_autocast_enabled(x.device.type) and use_triton(x))


def grouped_ffn(
    x: torch.Tensor,
    offs: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    beta1: float = 4.0,
    beta2: float = 25.0,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-group expert FFN ``W2·SiTU-GLU(W1 x, W3 x)``: ``x [R, ℓ]``, ``offs [E]`` int32, ``w1, w3 [E, F, ℓ]``,
    ``w2 [E, ℓ, F]`` → ``[R, ℓ]``. With ``rows [R]`` (int64) the FFN's input row r is ``x[rows[r]]`` (``x`` holds
    the tokens, unsorted). Inference calls with few rows (decode) run the two fused kernels of
    ``experts_small_triton`` (which read the rows in place); everything else three grouped GEMMs and SiTU-GLU (the
    transposed weight views are what grouped_mm wants: K-major B)."""
    R = x.shape[0] if rows is None else rows.shape[0]
    if R <= SMALL_ROWS and _small_rows_path(x, w1, w3, w2):
        from k3.ops.moe.experts_small_triton import grouped_ffn_small

        return grouped_ffn_small(x, offs, w1, w3, w2, beta1, beta2, rows)
    if rows is not None:
        x = x.index_select(0, rows)
    return grouped_ffn_gemms(x, offs, w1, w3, w2, beta1, beta2)


def grouped_ffn_gemms(
    x: torch.Tensor,
    offs: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """:func:`grouped_ffn` by three grouped GEMMs and SiTU-GLU whatever the row count (training's path)."""
    g = grouped_mm(x, w1.transpose(1, 2), offs)
    u = grouped_mm(x, w3.transpose(1, 2), offs)
    return grouped_mm(situ_glu(g, u, beta1, beta2), w2.transpose(1, 2), offs)


def grouped_ffn_packed(
    x: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """Same FFN with gate/up packed in one GEMM: ``w13 [E, 2F, ℓ]`` (rows 0:F = W1, F:2F = W3)."""
    h = grouped_mm(x, w13.transpose(1, 2), offs)
    return grouped_mm(situ_glu_packed(h, beta1, beta2), w2.transpose(1, 2), offs)
