"""The routed experts' FFN for few rows (decode), in two Triton launches — vLLM's fused_moe idea.

Letters: R rows sorted by expert, E experts, ℓ latent width, F expert width; ``offs [E]`` int32 cumulative group
ends, so rows ``offs[e-1]:offs[e]`` go through expert e (``k3.ops.moe.grouped``):

    h = SiTU-GLU(x W1_eᵀ, x W3_eᵀ)    [R, F]   launch 1: both fp32 accumulators from one pass over x, SiTU in fp32
    y = h W2_eᵀ                       [R, ℓ]   launch 2: fp32 accumulator

h and y are stored in x.dtype, as the grouped_mm path of ``grouped_ffn`` rounds them (that path also rounds the
gate and up products before SiTU; here they stay fp32, which only removes a rounding). Rows from ``offs[-1]`` to R belong to no expert and are
written as zeros.

Why: at a decode step R = batch·top-k rows spread over all experts (8 rows over 128 experts at batch 1), and
``grouped_mm`` launches three GEMMs over E mostly empty groups plus the SiTU kernel; the work is reading the active
experts' weights, which this reads once per row chunk.

Schedule: program (r, n) computes output columns n·BN … n·BN + BN − 1 of the BM rows starting at row r, if r
starts a BM-row chunk of its expert's group. Its expert e = #{j : offs[j] ≤ r} and the group's first row (the
largest offs[j] ≤ r) come from reading ``offs`` in BE-wide vectors; every other program stops there. The grid
(R, ⌈N/BN⌉) depends on shapes only — no host sync, no schedule kernel — so a CUDA graph captured once serves any
routing. Group ends are clamped to [0, R] in the kernel, so a bad ``offs`` on the device never reads or writes
outside x, h and y.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of
from k3.ops.moe._backend import alloc
from k3.ops.moe.experts_small import check_ffn_inputs
from k3.ops.moe.situ import situ_bound
from k3.ops.moe.situ_triton import situ_tile

__all__ = ["grouped_ffn_small"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# group ends read per step: one step for small's 128 experts, 7 for K3's 896, one compiled variant for every E; the
# interpreter pays per element, and its tests (E = 130) still cross chunks
_BE = 16 if _INTERPRET else 128


def _configs() -> list[triton.Config]:
    """(BN columns, BK reduction step, warps, stages). Small rows make every config memory-bound: what matters is
    how many programs stream weights at once (BN 32: 16 column tiles per expert at width 512) against how long each
    stream is; the autotuner picks per (N, K, row bucket)."""
    if _INTERPRET:  # the interpreter runs every config when autotuning: one is enough there
        return [triton.Config({"BN": 16, "BK": 16}, num_warps=4, num_stages=1)]
    q = [(32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3)]
    return [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in q]


def _bench(kernel_call, quantiles):  # noqa: ANN001, ANN202 - the autotuner's do_bench signature
    """Short timing windows: each candidate runs in microseconds, Triton's default 25 + 100 ms per candidate would
    make the first call of every row bucket (every decode batch size) take seconds."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


@triton.autotune(configs=_configs(), key=["N", "K", "RB", "BM", "GLU"], do_bench=_bench)
@triton.jit
def _grouped_small_kernel(x, w1, w3, y, offs, tok, R, E, N, RB, s_x, s_we, s_wn, s_y, beta1, beta2, lim,
                          K, GLU: tl.constexpr, GATHER: tl.constexpr, PREC: tl.constexpr, BE: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # RB (rows rounded up to a power of two) is only an autotuning key: batch 1 and batch 64 want other tiles.
    i_r, i_n = tl.program_id(0), tl.program_id(1)
    i_e = 0  # the expert of row i_r (E: past offs[-1])
    r0 = 0  # its group's first row
    r1 = R  # one past its last (R for the rows of no expert)
    for i_c in range(0, E, BE):
        o_e = i_c + tl.arange(0, BE)
        b_end = tl.load(offs + o_e, mask=o_e < E, other=R)
        b_end = tl.minimum(tl.maximum(b_end, 0), R)
        m_before = b_end <= i_r
        i_e += tl.sum(m_before.to(tl.int32), axis=0)
        r0 = tl.maximum(r0, tl.max(tl.where(m_before, b_end, 0), axis=0))
        r1 = tl.minimum(r1, tl.min(tl.where(m_before, R, b_end), axis=0))
    if (i_r - r0) % BM == 0:
        o_m = i_r + tl.arange(0, BM)
        m_m = o_m < r1
        o_n = i_n * BN + tl.arange(0, BN)
        m_n = o_n < N
        b_y = tl.zeros([BM, BN], dtype=tl.float32)
        if i_e < E:
            if GATHER:  # row r of the sorted rows is token tok[r] of x
                b_tok = tl.load(tok + o_m, mask=m_m, other=0)
                p_x = x + b_tok[:, None].to(tl.int64) * s_x
            else:
                p_x = x + o_m[:, None].to(tl.int64) * s_x
            o_w = i_e.to(tl.int64) * s_we + o_n[:, None].to(tl.int64) * s_wn
            b_a1 = tl.zeros([BM, BN], dtype=tl.float32)
            b_a3 = tl.zeros([BM, BN], dtype=tl.float32)
            for i_k in range(0, K, BK):
                o_k = i_k + tl.arange(0, BK)
                m_k = o_k < K
                b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
                m_w = m_n[:, None] & m_k[None, :]
                b_w1 = tl.load(w1 + o_w + o_k[None, :], mask=m_w, other=0.0)
                b_a1 += tl.dot(b_x, tl.trans(b_w1), input_precision=PREC)
                if GLU:
                    b_w3 = tl.load(w3 + o_w + o_k[None, :], mask=m_w, other=0.0)
                    b_a3 += tl.dot(b_x, tl.trans(b_w3), input_precision=PREC)
            if GLU:
                b_a1 = situ_tile(b_a1, b_a3, beta1, beta2, lim)
            b_y = b_a1
        p_y = y + o_m[:, None].to(tl.int64) * s_y + o_n[None, :]
        tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _block_rows(rows: int, experts: int) -> int:
    """BM: 16 (tl.dot's smallest) while the mean rows per expert fit in it, up to 64 when groups are larger."""
    mean = triton.cdiv(rows, max(experts, 1))
    return min(64, max(16, triton.next_power_of_2(mean)))


def _last_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, offs: torch.Tensor, beta1: float, beta2: float,
            bound: float, glu: bool, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``y [R, N]`` from ``x [R, K]`` (or ``x[rows]`` for ``rows [R]``) and ``wa`` (and ``wb`` when ``glu``)
    ``[E, N, K]`` with unit last strides."""
    K = x.shape[1]
    R = x.shape[0] if rows is None else rows.shape[0]
    E, N = wa.shape[0], wa.shape[1]
    y = alloc((R, N), x.dtype, x.device)
    if R == 0 or N == 0:
        return y
    _grouped_small_kernel[lambda meta: (R, triton.cdiv(N, meta["BN"]))](
        x, wa, wb, y, offs, offs if rows is None else rows, R, E, N, triton.next_power_of_2(R), x.stride(0),
        wa.stride(0), wa.stride(1), y.stride(0), float(beta1), float(beta2), float(bound),
        K=K, GLU=glu, GATHER=rows is not None, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        BE=_BE, BM=_block_rows(R, E))
    return y


# A torch.library op: one opaque node under torch.compile. Forward only (no autograd formula registered).
@torch.library.custom_op("k3::grouped_ffn_small", mutates_args=())
def _ffn_op(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
            beta1: float, beta2: float, bound: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    x, w1, w3, w2 = (_last_unit(t) for t in (x, w1, w3, w2))
    if w3.stride() != w1.stride():  # the kernel addresses both with w1's strides
        w1, w3 = w1.contiguous(), w3.contiguous()
    with on_device_of(x):
        h = _launch(x, w1, w3, offs, beta1, beta2, bound, True, rows)
        return _launch(h, w2, w2, offs, 1.0, 1.0, 0.0, False)


@_ffn_op.register_fake
def _(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
      beta1: float, beta2: float, bound: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0] if rows is None else rows.shape[0], w2.shape[1])


def grouped_ffn_small(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                      beta1: float = 4.0, beta2: float = 25.0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``W2·SiTU-GLU(W1 x, W3 x)`` per expert group, forward only: ``x [R, ℓ]`` (rows sorted by expert), ``offs [E]``
    int32 cumulative ends, ``w1, w3 [E, F, ℓ]``, ``w2 [E, ℓ, F]`` → ``[R, ℓ]`` (rows past ``offs[-1]``: zero).
    With ``rows [R]`` (int64 token of each sorted row) ``x [m, ℓ]`` holds the tokens and the first launch reads
    row r from ``x[rows[r]]``: the expert-sorted copy of the tokens is never written.

    Runs the Triton kernels on any device (CPU tensors need ``TRITON_INTERPRET=1``); ``grouped.grouped_ffn``
    chooses it for inference calls with few rows. ``ValueError`` when a gradient would be needed."""
    check_ffn_inputs(x, offs, w1, w3, w2, beta1, beta2, rows)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, w3, w2)):
        raise ValueError("grouped_ffn_small is forward-only: x, w1, w3 and w2 must not require grad while grad mode "
                         "is on (run it under torch.no_grad(), or use grouped_ffn)")
    if not (x.dtype == w1.dtype == w3.dtype == w2.dtype):
        raise ValueError(f"x, w1, w3 and w2 must share one dtype, got {x.dtype}, {w1.dtype}, {w3.dtype}, {w2.dtype}")
    return _ffn_op(x, offs, w1, w3, w2, float(beta1), float(beta2), situ_bound(beta1, beta2, x.dtype), rows)
