"""The decode-sized linear kernel of ``gemv.py``: one program per ``BN`` output columns of one row.

Each program streams its ``BN × K`` slice of the weight once (K is a compile-time constant, so the loop over it is
unrolled) against the row's inputs, which every program re-reads from L2 — a few KB. The prologue (``PRO``) forms
the inputs in registers: 0 plain, 1 SiTU-GLU of (gate, up), 2 per-head RMSNorm × σ(gate) over heads of ``D``
(``BK`` a multiple of ``D`` that divides K, so each tile holds whole heads), 3 ``a ⊙ σ(b)``. fp32 accumulation;
the optional ``add`` is summed in fp32 before the one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of
from k3.ops.moe._backend import alloc
from k3.ops.moe.situ import situ_bound
from k3.ops.moe.situ_triton import situ_tile

__all__ = ["gemv"]

# One warp per 4 output columns (256 programs for a 1024-wide output) pulls the weight at full speed. Every program
# re-forms the row's inputs, yet wider programs (8–32 columns, 2–4 warps) measured slower for every prologue too:
# `small`'s batch-1 decode step 0.876 ms as here against 0.88–1.04 ms (one H200, each variant in one process).
BN, BK_MAX, WARPS = 4, 512, 1


@triton.jit
def _gemv_kernel(a, b, nw, w, add, y, N, s_a, s_b, s_w, s_add, s_y, beta1, beta2, lim, eps,
                 K: tl.constexpr, PRO: tl.constexpr, D: tl.constexpr, HAS_ADD: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):
    i_n, i_m = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    p_w = w + o_n[:, None].to(tl.int64) * s_w
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        if PRO == 2:
            o_h = tl.arange(0, BK // D)
            o_d = tl.arange(0, D)
            off = k0 + o_h[:, None] * D + o_d[None, :]
            b_o = tl.load(a + i_m * s_a + off).to(tl.float32)
            b_g = tl.load(b + i_m * s_b + off).to(tl.float32)
            b_nw = tl.load(nw + o_d).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(b_o * b_o, axis=1) / D + eps)
            b_x = b_o * rstd[:, None] * b_nw[None, :] * (1.0 / (1.0 + tl.exp(-b_g)))
            b_x = tl.reshape(b_x.to(w.dtype.element_ty).to(tl.float32), [BK])
        elif PRO == 3:
            b_o = tl.load(a + i_m * s_a + o_k, mask=m_k, other=0.0)
            b_g = tl.load(b + i_m * s_b + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_s = (1.0 / (1.0 + tl.exp(-b_g))).to(a.dtype.element_ty).to(tl.float32)
            b_x = (b_o.to(tl.float32) * b_s).to(a.dtype.element_ty).to(tl.float32)
        elif PRO == 1:
            b_g = tl.load(a + i_m * s_a + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_u = tl.load(b + i_m * s_b + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_x = situ_tile(b_g, b_u, beta1, beta2, lim).to(a.dtype.element_ty).to(tl.float32)
        else:
            b_x = tl.load(a + i_m * s_a + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b_w * b_x[None, :], axis=1)
    if HAS_ADD:
        acc += tl.load(add + i_m * s_add + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(y + i_m * s_y + o_n, acc.to(y.dtype.element_ty), mask=m_n)


def _norm_bk(K: int, D: int) -> int:
    """The widest tile of whole heads (a power-of-two count of them, ≤ BK_MAX columns unless one head is wider)
    that divides K."""
    bk = D
    while bk * 2 <= BK_MAX and K % (bk * 2) == 0:
        bk *= 2
    return bk


# A torch.library op: one opaque node for torch.compile, as the other serving ops. Forward only.
@torch.library.custom_op("k3::gemv", mutates_args=())
def _gemv_op(a: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None, norm_weight: torch.Tensor | None,
             add: torch.Tensor | None, prologue: int, beta1: float, beta2: float, eps: float, head_dim: int,
             out_dtype: torch.dtype) -> torch.Tensor:
    M, K = a.shape
    N = weight.shape[0]
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = alloc((M, N), out_dtype, a.device)  # NaN-filled under K3_MOE_POISON=1 (tests)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if add is None else y.copy_(add)
    D, bk = 1, min(BK_MAX, triton.next_power_of_2(K))
    lim = situ_bound(beta1, beta2, a.dtype) if prologue == 1 else 0.0
    nw = a
    if prologue == 2:
        assert norm_weight is not None
        nw, D = norm_weight.contiguous(), head_dim
        bk = _norm_bk(K, D)
    bb = b if b is not None else a
    ad = add if add is not None else y
    with on_device_of(a):
        _gemv_kernel[(triton.cdiv(N, BN), M)](
            a, bb, nw, w, ad, y, N, a.stride(0), bb.stride(0), w.stride(0), ad.stride(0), y.stride(0),
            float(beta1), float(beta2), float(lim), float(eps),
            K=K, PRO=prologue, D=D, HAS_ADD=add is not None, BN=BN, BK=bk, num_warps=WARPS)
    return y


@_gemv_op.register_fake
def _(a, weight, b, norm_weight, add, prologue, beta1, beta2, eps, head_dim, out_dtype):  # noqa: ANN001, ANN202
    return a.new_empty(a.shape[0], weight.shape[0], dtype=out_dtype)


def gemv(a: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None = None,
         situ: tuple[float, float] | None = None, norm: tuple[torch.Tensor, float, int] | None = None,
         gate: bool = False, add: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """``[M, N]`` rows of ``prologue(a, b) · weightᵀ (+ add)``; ``a``/``b``/``add`` are 2-D with unit column
    stride. ``situ = (β1, β2)``, ``norm = (norm_weight [D], eps, D)`` or ``gate`` pick the prologue (``b`` its
    second input)."""
    beta1, beta2 = situ if situ is not None else (0.0, 0.0)
    norm_weight, eps, D = norm if norm is not None else (None, 0.0, 1)
    prologue = 1 if situ is not None else 2 if norm is not None else 3 if gate else 0
    return _gemv_op(a, weight, b, norm_weight, add, prologue, float(beta1), float(beta2), float(eps), int(D),
                    out_dtype or a.dtype)
