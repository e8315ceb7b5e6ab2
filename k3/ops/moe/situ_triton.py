"""Fused SiTU-GLU forward and backward (Triton): one pass over gate/up in, one pass out.

Math (docs/architecture.md#situ-glu), in fp32 whatever the storage dtype, with t_g = tanh(g/β1),
t_u = tanh(u/β2), σ = sigmoid(g) (each from one exponential; the forward puts them over one shared
denominator, ``_situ_exps``):
    y      = A·B,  A = β1·t_g·σ,  B = β2·t_u
    ∂A/∂g  = (1 − t_g²)·σ + β1·t_g·σ·(1 − σ),   ∂B/∂u = 1 − t_u²
    dg = dy·B·∂A/∂g,  du = dy·A·∂B/∂u
Gate and up may be strided views (e.g. the two halves of one packed ``[R, 2F]`` GEMM output): only the last dim
must be contiguous. ``situ_glu_fused_packed`` takes the packed tensor and returns its gradient packed as well, so
autograd never materialises a concatenation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of
from k3.ops.moe._backend import alloc

__all__ = ["situ_glu_fused", "situ_glu_fused_packed", "situ_tile"]


@triton.jit
def _tanh(x):
    # tanh from one exp: exact limits ±1 (exp overflows to inf or underflows to 0), |error| ~1e-7 near 0.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _situ_exps(b_g, b_u, beta1, beta2):
    """e1 = exp(−2|g|/β1), e2 = exp(−g), e3 = exp(−2|u|/β2), from which tanh(g/β1) = ±(1 − e1)/(1 + e1),
    σ(g) = 1/(1 + e2), tanh(u/β2) = ±(1 − e3)/(1 + e3): three exponentials and, once the factors are put over one
    denominator, one division per element (the forward is instruction-bound: sm_90 code of 62 instructions an
    element with one division per factor, 40 this way; 4.35 → 3.31 ms a `small` step on the H200). e2 stops at
    2^80 so that the product of the three denominators stays finite: σ is then ~1e-24 instead of a smaller positive
    number for g < −55, which no output dtype holds anyway."""
    e1 = tl.exp2(tl.abs(b_g) * (-2.8853900817779268 / beta1))  # −2·log2(e)/β1
    e2 = tl.exp2(tl.minimum(b_g * -1.4426950408889634, 80.0))
    e3 = tl.exp2(tl.abs(b_u) * (-2.8853900817779268 / beta2))
    return e1, e2, e3


@triton.jit
def situ_tile(b_g, b_u, beta1, beta2, lim):
    """SiTU-GLU of fp32 tiles, clamped strictly inside ±β1·β2 in the output dtype (``lim``, see situ_bound); shared
    with the fused expert kernels, which apply it to their GEMM accumulators."""
    e1, e2, e3 = _situ_exps(b_g, b_u, beta1, beta2)
    b_y = (beta1 * beta2) * ((1.0 - e1) * (1.0 - e3)) / ((1.0 + e1) * (1.0 + e2) * (1.0 + e3))
    b_y = tl.where((b_g < 0) != (b_u < 0), -b_y, b_y)
    return tl.minimum(tl.maximum(b_y, -lim), lim)


@triton.jit
def _situ_fwd_kernel(g_ptr, u_ptr, y_ptr, M, F, s_g, s_u, s_y, beta1, beta2, lim,
                     BM: tl.constexpr, BF: tl.constexpr):
    i_m, i_f = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_f = i_f * BF + tl.arange(0, BF)
    m_x = (o_m[:, None] < M) & (o_f[None, :] < F)
    b_g = tl.load(g_ptr + o_m[:, None] * s_g + o_f[None, :], mask=m_x, other=0.0).to(tl.float32)
    b_u = tl.load(u_ptr + o_m[:, None] * s_u + o_f[None, :], mask=m_x, other=0.0).to(tl.float32)
    b_y = situ_tile(b_g, b_u, beta1, beta2, lim)
    tl.store(y_ptr + o_m[:, None] * s_y + o_f[None, :], b_y.to(y_ptr.dtype.element_ty), mask=m_x)


@triton.jit
def _situ_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, M, F, s_g, s_u, s_dy, s_dg, s_du, beta1, beta2,
                     BM: tl.constexpr, BF: tl.constexpr):
    i_m, i_f = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_f = i_f * BF + tl.arange(0, BF)
    m_x = (o_m[:, None] < M) & (o_f[None, :] < F)
    b_g = tl.load(g_ptr + o_m[:, None] * s_g + o_f[None, :], mask=m_x, other=0.0).to(tl.float32)
    b_u = tl.load(u_ptr + o_m[:, None] * s_u + o_f[None, :], mask=m_x, other=0.0).to(tl.float32)
    b_dy = tl.load(dy_ptr + o_m[:, None] * s_dy + o_f[None, :], mask=m_x, other=0.0).to(tl.float32)
    # one division per factor here: the shared denominator of the forward needs ~2.5× the registers in this
    # three-input, two-output kernel (181 against 72 at 32 values a thread) and ran 27 % slower on the H200
    b_sig = 1.0 / (1.0 + tl.exp(-b_g))
    b_tg = _tanh(b_g / beta1)
    b_tu = _tanh(b_u / beta2)
    b_a = beta1 * b_tg * b_sig
    b_da = (1.0 - b_tg * b_tg) * b_sig + beta1 * b_tg * b_sig * (1.0 - b_sig)
    b_b = beta2 * b_tu
    b_db = 1.0 - b_tu * b_tu
    tl.store(dg_ptr + o_m[:, None] * s_dg + o_f[None, :], (b_dy * b_b * b_da).to(dg_ptr.dtype.element_ty), mask=m_x)
    tl.store(du_ptr + o_m[:, None] * s_du + o_f[None, :], (b_dy * b_a * b_db).to(du_ptr.dtype.element_ty), mask=m_x)


def _blocks(F: int, elements: int) -> tuple[int, int, int]:
    """(BM rows, BF columns, warps) of one program of ``elements`` values: 4,096 in the forward (16-byte bf16 vectors
    per thread), 2,048 in the backward, whose three inputs and two outputs ran 11 % faster at half the values a
    thread (H200, 262,144 × 512: 350 against 392 µs)."""
    bf = min(1024, triton.next_power_of_2(max(F, 1)))
    return max(1, elements // bf), bf, 4


def _rows(t: torch.Tensor) -> torch.Tensor:
    """2-D view ``[M, F]`` with a unit last stride (copies only when it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _fwd(g: torch.Tensor, u: torch.Tensor, beta1: float, beta2: float, bound: float) -> torch.Tensor:
    M, F = g.shape
    y = alloc((M, F), g.dtype, g.device)
    if M and F:
        BM, BF, nw = _blocks(F, 4096)
        _situ_fwd_kernel[(triton.cdiv(M, BM), triton.cdiv(F, BF))](
            g, u, y, M, F, g.stride(0), u.stride(0), y.stride(0), float(beta1), float(beta2),
            float(bound), BM=BM, BF=BF, num_warps=nw)
    return y


def _bwd(g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor, dg: torch.Tensor, du: torch.Tensor,
         beta1: float, beta2: float) -> None:
    M, F = g.shape
    if M and F:
        BM, BF, nw = _blocks(F, 2048)
        _situ_bwd_kernel[(triton.cdiv(M, BM), triton.cdiv(F, BF))](
            g, u, dy, dg, du, M, F, g.stride(0), u.stride(0), dy.stride(0), dg.stride(0), du.stride(0),
            float(beta1), float(beta2), BM=BM, BF=BF, num_warps=nw)


# torch.library ops (one opaque node each under torch.compile; the backward is a second op).
@torch.library.custom_op("k3::situ_glu", mutates_args=())
def _situ_op(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float, bound: float) -> torch.Tensor:
    g, u = _rows(gate), _rows(up)
    with on_device_of(gate):
        return _fwd(g, u, beta1, beta2, bound).view(gate.shape)


@_situ_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float, bound: float) -> torch.Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("k3::situ_glu_bwd", mutates_args=())
def _situ_bwd_op(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, beta1: float, beta2: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    g, u = _rows(gate), _rows(up)
    dg, du = alloc(g.shape, g.dtype, g.device), alloc(u.shape, u.dtype, u.device)
    with on_device_of(gate):
        _bwd(g, u, _rows(dy), dg, du, beta1, beta2)
    return dg.view(gate.shape), du.view(up.shape)


@_situ_bwd_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, beta1: float, beta2: float):  # noqa: ANN202
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _situ_setup(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    gate, up, beta1, beta2, _ = inputs
    ctx.save_for_backward(gate, up)
    ctx.betas = (beta1, beta2)


def _situ_backward(ctx, dy: torch.Tensor):  # noqa: ANN001, ANN202
    gate, up = ctx.saved_tensors
    dg, du = _situ_bwd_op(gate, up, dy, *ctx.betas)
    return dg, du, None, None, None


_situ_op.register_autograd(_situ_backward, setup_context=_situ_setup)


@torch.library.custom_op("k3::situ_glu_packed", mutates_args=())
def _situ_packed_op(gu: torch.Tensor, beta1: float, beta2: float, bound: float) -> torch.Tensor:
    h = _rows(gu)
    F = h.shape[1] // 2
    with on_device_of(gu):
        return _fwd(h[:, :F], h[:, F:], beta1, beta2, bound).view(*gu.shape[:-1], F)


@_situ_packed_op.register_fake
def _(gu: torch.Tensor, beta1: float, beta2: float, bound: float) -> torch.Tensor:
    return gu.new_empty(*gu.shape[:-1], gu.shape[-1] // 2)


@torch.library.custom_op("k3::situ_glu_packed_bwd", mutates_args=())
def _situ_packed_bwd_op(gu: torch.Tensor, dy: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    h = _rows(gu)
    F = h.shape[1] // 2
    dh = alloc(h.shape, h.dtype, h.device)
    with on_device_of(gu):
        _bwd(h[:, :F], h[:, F:], _rows(dy), dh[:, :F], dh[:, F:], beta1, beta2)
    return dh.view(gu.shape)


@_situ_packed_bwd_op.register_fake
def _(gu: torch.Tensor, dy: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    return gu.new_empty(gu.shape)


def _situ_packed_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    gu, beta1, beta2, _ = inputs
    ctx.save_for_backward(gu)
    ctx.betas = (beta1, beta2)


def _situ_packed_backward(ctx, dy: torch.Tensor):  # noqa: ANN001, ANN202
    (gu,) = ctx.saved_tensors
    return _situ_packed_bwd_op(gu, dy, *ctx.betas), None, None, None


_situ_packed_op.register_autograd(_situ_packed_backward, setup_context=_situ_packed_setup)


def situ_glu_fused(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float, bound: float) -> torch.Tensor:
    """SiTU-GLU of ``gate, up [..., F]`` (same shape and dtype) → ``[..., F]``; one fused kernel each way.
    Outputs are clamped to ±``bound`` (``k3.ops.moe.situ.situ_bound``: just inside ±β1·β2 in the output dtype)."""
    return _situ_op(gate, up, float(beta1), float(beta2), float(bound))


def situ_glu_fused_packed(gu: torch.Tensor, beta1: float, beta2: float, bound: float) -> torch.Tensor:
    """SiTU-GLU of a packed ``gu [..., 2F]`` (gate = first half, up = second half) → ``[..., F]``, clamped to
    ±``bound`` as ``situ_glu_fused``."""
    return _situ_packed_op(gu, float(beta1), float(beta2), float(bound))
