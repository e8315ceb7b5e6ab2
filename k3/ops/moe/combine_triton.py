"""Fused weighted combine + RMSNorm (Triton), forward and backward (docs/architecture.md#latent-rmsnorm).

Forward, one program per token t, the whole ℓ-row in registers:
    u_t = Σ_j p_tj · y[row(t, j)]   (fp32 sum of the k expert rows, read straight from the expert-sorted buffer
                                     through the inverse permutation — no unpermuted copy is written)
    u_t is rounded to y.dtype (as the reference does), then out_t = u_t · rstd_t · w with fp32 statistics.
Saved for backward: the rounded u [m, ℓ] (small: m rows, not m·k) and rstd [m].
Backward, one program per 16 consecutive tokens:
    g = dout·w,  du = rstd·(g − û·mean(g·û))  (û = u·rstd),   dw = Σ_t dout·û  (per-program partials, summed after)
    dy[row(t, j)] = p_tj·du,  dp_tj = ⟨du, y[row(t, j)]⟩.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of
from k3.ops.moe._backend import alloc

__all__ = ["combine_norm_fused", "rows_sum_fused", "permute_rows_fused"]


@triton.jit
def _combine_fwd_kernel(y_ptr, row_ptr, p_ptr, w_ptr, out_ptr, u_ptr, rstd_ptr, L, s_y, s_o, s_u, eps,
                        K: tl.constexpr, BL: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_l = tl.arange(0, BL)
    m_l = o_l < L
    b_acc = tl.zeros([BL], dtype=tl.float32)
    for j in range(K):
        r = tl.load(row_ptr + i_t * K + j).to(tl.int64)
        p = tl.load(p_ptr + i_t * K + j).to(tl.float32)
        b_y = tl.load(y_ptr + r * s_y + o_l, mask=m_l, other=0.0).to(tl.float32)
        b_acc += b_y * p
    b_u = b_acc.to(u_ptr.dtype.element_ty)
    tl.store(u_ptr + i_t * s_u + o_l, b_u, mask=m_l)
    b_uf = b_u.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_uf * b_uf, axis=0) / L + eps)
    tl.store(rstd_ptr + i_t, rstd)
    b_w = tl.load(w_ptr + o_l, mask=m_l, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_t * s_o + o_l, (b_uf * rstd * b_w).to(out_ptr.dtype.element_ty), mask=m_l)


@triton.jit
def _combine_bwd_kernel(do_ptr, u_ptr, rstd_ptr, w_ptr, y_ptr, row_ptr, p_ptr, dy_ptr, dp_ptr, dwp_ptr,
                        M, L, s_do, s_u, s_y, s_dy, K: tl.constexpr, BL: tl.constexpr, TPB: tl.constexpr):
    pid = tl.program_id(0)
    o_l = tl.arange(0, BL)
    m_l = o_l < L
    b_w = tl.load(w_ptr + o_l, mask=m_l, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BL], dtype=tl.float32)
    for it in range(TPB):  # TPB consecutive tokens per program keep the dw partials small
        i_t = (pid * TPB + it).to(tl.int64)
        m_t = i_t < M
        m_x = m_l & m_t
        b_do = tl.load(do_ptr + i_t * s_do + o_l, mask=m_x, other=0.0).to(tl.float32)
        b_u = tl.load(u_ptr + i_t * s_u + o_l, mask=m_x, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + i_t, mask=m_t, other=0.0)
        b_un = b_u * rstd
        b_dw += b_do * b_un
        b_g = b_do * b_w
        b_du = rstd * (b_g - b_un * (tl.sum(b_g * b_un, axis=0) / L))
        for j in range(K):
            r = tl.load(row_ptr + i_t * K + j, mask=m_t, other=0).to(tl.int64)
            p = tl.load(p_ptr + i_t * K + j, mask=m_t, other=0.0).to(tl.float32)
            b_y = tl.load(y_ptr + r * s_y + o_l, mask=m_x, other=0.0).to(tl.float32)
            tl.store(dy_ptr + r * s_dy + o_l, (b_du * p).to(dy_ptr.dtype.element_ty), mask=m_x)
            tl.store(dp_ptr + i_t * K + j, tl.sum(b_du * b_y, axis=0), mask=m_t)
    tl.store(dwp_ptr + pid.to(tl.int64) * L + o_l, b_dw, mask=m_l)


def _warps(BL: int) -> int:
    return 4 if BL <= 1024 else 8


_TPB = 16  # tokens per backward program

# torch.library ops: one opaque node each under torch.compile; the backward is its own op.
@torch.library.custom_op("k3::combine_norm", mutates_args=())
def _combine_op(y_rows: torch.Tensor, row_of: torch.Tensor, p: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ ``(out [m, ℓ], u [m, ℓ] (the rounded mix, saved for backward), rstd [m] fp32)``."""
    m, k = p.shape
    L = y_rows.shape[1]
    dev = y_rows.device
    out = alloc((m, L), y_rows.dtype, dev)
    u = alloc((m, L), y_rows.dtype, dev)
    rstd = alloc((m,), torch.float32, dev)
    BL = triton.next_power_of_2(L)
    if m:
        with on_device_of(y_rows):
            _combine_fwd_kernel[(m,)](y_rows, row_of, p, weight, out, u, rstd, L, y_rows.stride(0),
                                      out.stride(0), u.stride(0), float(eps), K=k, BL=BL, num_warps=_warps(BL))
    return out, u, rstd


@_combine_op.register_fake
def _(y_rows: torch.Tensor, row_of: torch.Tensor, p: torch.Tensor, weight: torch.Tensor, eps: float):  # noqa: ANN202
    m, L = p.shape[0], y_rows.shape[1]
    return y_rows.new_empty(m, L), y_rows.new_empty(m, L), y_rows.new_empty(m, dtype=torch.float32)


@torch.library.custom_op("k3::combine_norm_bwd", mutates_args=())
def _combine_bwd_op(dout: torch.Tensor, y_rows: torch.Tensor, row_of: torch.Tensor, p: torch.Tensor,
                    weight: torch.Tensor, u: torch.Tensor, rstd: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """→ ``(dy_rows, dp [m, k] fp32, dweight)``."""
    m, k = p.shape
    L = y_rows.shape[1]
    dout = dout.contiguous()
    # rows no (token, slot) points at get a zero gradient; when every row is used none needs clearing
    dy = alloc(y_rows.shape, y_rows.dtype, y_rows.device) if y_rows.shape[0] == m * k else torch.zeros_like(y_rows)
    dp = alloc((m, k), torch.float32, p.device)
    G = triton.cdiv(m, _TPB)
    dwp = alloc((G, L), torch.float32, p.device)
    BL = triton.next_power_of_2(L)
    if m:
        with on_device_of(y_rows):
            _combine_bwd_kernel[(G,)](dout, u, rstd, weight, y_rows, row_of, p, dy, dp, dwp, m, L,
                                      dout.stride(0), u.stride(0), y_rows.stride(0), dy.stride(0), K=k, BL=BL,
                                      TPB=_TPB, num_warps=_warps(BL))
    dw = dwp.sum(0).to(weight.dtype) if m else torch.zeros_like(weight)
    return dy, dp, dw


@_combine_bwd_op.register_fake
def _(dout, y_rows, row_of, p, weight, u, rstd):  # noqa: ANN001, ANN202
    return y_rows.new_empty(y_rows.shape), p.new_empty(p.shape, dtype=torch.float32), weight.new_empty(weight.shape)


def _combine_setup(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    y_rows, row_of, p, weight, _ = inputs
    _, u, rstd = output
    ctx.save_for_backward(y_rows, row_of, p, weight, u, rstd)
    ctx.mark_non_differentiable(u, rstd)


def _combine_backward(ctx, dout, _du, _drstd):  # noqa: ANN001, ANN202
    y_rows, row_of, p, weight, u, rstd = ctx.saved_tensors
    dy, dp, dw = _combine_bwd_op(dout, y_rows, row_of, p, weight, u, rstd)
    return dy, None, dp.to(p.dtype), dw, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


def combine_norm_fused(y_rows: torch.Tensor, row_of: torch.Tensor, p: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """``y_rows [R, ℓ]`` (R ≥ m·k), ``row_of [m, k]`` int64 = the y row of each (token, slot), ``p [m, k]`` fp32,
    ``weight [ℓ]`` → RMSNorm(Σ_j p·y) ``[m, ℓ]`` in y_rows.dtype. Inputs already validated, rows unique."""
    y_rows = y_rows if y_rows.stride(-1) == 1 else y_rows.contiguous()
    return _combine_op(y_rows, row_of.contiguous(), p.float().contiguous(), weight.contiguous(), float(eps))[0]


@triton.jit
def _rows_sum_kernel(src_ptr, row_ptr, out_ptr, L, s_src, s_out, K: tl.constexpr, BL: tl.constexpr):
    # out[t] = Σ_j src[row(t, j)] in fp32: the adjoint of gathering each token's latent into its k expert rows
    i_t = tl.program_id(0).to(tl.int64)
    o_l = tl.arange(0, BL)
    m_l = o_l < L
    b_acc = tl.zeros([BL], dtype=tl.float32)
    for j in range(K):
        r = tl.load(row_ptr + i_t * K + j).to(tl.int64)
        b_acc += tl.load(src_ptr + r * s_src + o_l, mask=m_l, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_t * s_out + o_l, b_acc.to(out_ptr.dtype.element_ty), mask=m_l)


@torch.library.custom_op("k3::rows_sum", mutates_args=())
def _rows_sum_op(src: torch.Tensor, row_of: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = row_of.shape
    L = src.shape[1]
    src = src if src.stride(-1) == 1 else src.contiguous()
    out = alloc((m, L), out_dtype, src.device)
    if m:
        BL = triton.next_power_of_2(L)
        with on_device_of(src):
            _rows_sum_kernel[(m,)](src, row_of.contiguous(), out, L, src.stride(0), out.stride(0), K=k, BL=BL,
                                   num_warps=_warps(BL))
    return out


@_rows_sum_op.register_fake
def _(src: torch.Tensor, row_of: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return src.new_empty(row_of.shape[0], src.shape[1], dtype=out_dtype)


def rows_sum_fused(src: torch.Tensor, row_of: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``src [R, ℓ]``, ``row_of [m, k]`` → ``[m, ℓ]`` with row t = Σ_j src[row_of[t, j]] (fp32 sum, no atomics)."""
    return _rows_sum_op(src, row_of, out_dtype)


@torch.library.custom_op("k3::permute_rows", mutates_args=())
def permute_rows_fused(z: torch.Tensor, token_of_row: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """``z[token_of_row]``: the expert-sorted copy of the tokens. Its backward is the gather-sum ``rows_sum`` over
    ``row_of [m, k]`` (each token's k rows), not autograd's scatter-add with atomics."""
    return z.index_select(0, token_of_row)


@permute_rows_fused.register_fake
def _(z: torch.Tensor, token_of_row: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    return z.new_empty(token_of_row.shape[0], z.shape[1])


def _permute_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    z, _, row_of = inputs
    ctx.save_for_backward(row_of)
    ctx.dtype = z.dtype


def _permute_backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202
    (row_of,) = ctx.saved_tensors
    return _rows_sum_op(grad.contiguous(), row_of, ctx.dtype), None, None


permute_rows_fused.register_autograd(_permute_backward, setup_context=_permute_setup)
