"""Fused router epilogue (Triton): sigmoid → top-(k+1) of score+bias → renormalised weights → QB histogram.

The logits ``x @ Wᵀ`` come from cuBLAS in fp32 (bf16 operands, fp32 accumulate and output — the products of bf16
numbers are exact in fp32, so this equals an fp32 matmul up to summation order). One program then handles BM tokens
with all n experts in registers:
  s = σ(logits) (fp32), selection = k (+1 with a histogram) rounds of arg-max on s + b,
  p_j = scaling · s_j / Σ_{selected} s,
  with a histogram: α = the (k+1)-th biased score, r_ij = α_i − s_ij, and one int32 atomic add per (token, expert)
  into ``hist[j, bin(r_ij)]`` — no ``[tokens, experts]`` bin-index tensor is ever written.
The bin is ``clamp(floor((r − lo)·scale), 0, B − 1)`` with ``lo, scale`` read from device memory (no host sync),
the same expression as ``k3.ops.moe.qb.qb_accumulate``; the caller passes ``(lo, span) = qb_range(bias)``.

Backward (torch, cheap): only the k selected logits of each token get a gradient,
  ∂L/∂s_j = (c/S)·dp_j − (c/S²)·Σ_i dp_i s_i  (S = Σ_selected s, c = scaling),  ∂L/∂logit_j = ∂L/∂s_j · s_j(1 − s_j),
then dx = dlogits·W and dW = dlogitsᵀ·x through cuBLAS (bf16 operands on CUDA, fp32 accumulate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of
from k3.ops.gemv import use_gemv
from k3.ops.gemv.gemv_triton import gemv
from k3.ops.moe._backend import alloc

__all__ = ["route_fused", "qb_histogram_fused", "router_logits", "moe_route", "qb_histogram_logits"]


@triton.jit
def _router_kernel(l_ptr, b_ptr, idx_ptr, p_ptr, ssel_ptr, h_ptr, lo_ptr, scale_ptr, w_ptr, M, N, s_l, scaling,
                   TOP_K: tl.constexpr, K1: tl.constexpr, KP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
                   NUM_BINS: tl.constexpr, APPLY_SIGMOID: tl.constexpr, WRITE_ROUTE: tl.constexpr,
                   HIST: tl.constexpr):
    i_m = tl.program_id(0)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_n = tl.arange(0, NP)
    o_k = tl.arange(0, KP)
    m_m = o_m < M
    m_n = o_n < N
    m_x = m_m[:, None] & m_n[None, :]
    b_x = tl.load(l_ptr + o_m[:, None] * s_l + o_n[None, :], mask=m_x, other=0.0).to(tl.float32)
    if APPLY_SIGMOID:
        b_s = 1.0 / (1.0 + tl.exp(-b_x))
    else:
        b_s = b_x
    b_b = tl.load(b_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_z = tl.where(m_n[None, :], b_s + b_b[None, :], float("-inf"))
    b_idx = tl.zeros([BM, KP], dtype=tl.int32)
    b_sel = tl.zeros([BM, KP], dtype=tl.float32)
    b_alpha = tl.zeros([BM], dtype=tl.float32)
    for i in tl.static_range(K1):  # K1 = k, or k + 1 when the (k+1)-th score α is needed
        b_max = tl.max(b_z, axis=1)
        b_arg = tl.argmax(b_z, axis=1, tie_break_left=True)
        b_arg = tl.minimum(tl.maximum(b_arg, 0), N - 1)  # NaN scores must never produce an out-of-range id
        b_hit = o_n[None, :] == b_arg[:, None]
        if i < TOP_K:
            b_si = tl.sum(tl.where(b_hit, b_s, 0.0), axis=1)
            b_idx = tl.where(o_k[None, :] == i, b_arg[:, None], b_idx)
            b_sel = tl.where(o_k[None, :] == i, b_si[:, None], b_sel)
        else:
            b_alpha = b_max
        b_z = tl.where(b_hit, float("-inf"), b_z)
    if WRITE_ROUTE:
        m_k = m_m[:, None] & (o_k[None, :] < TOP_K)
        b_p = b_sel / tl.sum(b_sel, axis=1)[:, None] * scaling
        o_out = o_m[:, None] * TOP_K + o_k[None, :]
        tl.store(idx_ptr + o_out, b_idx.to(tl.int64), mask=m_k)
        tl.store(p_ptr + o_out, b_p, mask=m_k)
        tl.store(ssel_ptr + o_out, b_sel, mask=m_k)
    if HIST:
        lo = tl.load(lo_ptr)
        scale = tl.load(scale_ptr)
        w = tl.load(w_ptr)  # the count each (token, expert) adds: 1, or 0 while a checkpointed forward recomputes
        b_v = ((b_alpha[:, None] - b_s) - lo) * scale
        b_v = tl.minimum(tl.maximum(b_v, 0.0), NUM_BINS - 1.0)  # clamp first: NaN/huge never become wild ints
        b_bin = tl.floor(b_v).to(tl.int32)
        tl.atomic_add(h_ptr + o_n[None, :].to(tl.int64) * NUM_BINS + b_bin, tl.full([BM, NP], 1, tl.int32) * w,
                      mask=m_x & (w != 0), sem="relaxed")


HistRange = tuple[torch.Tensor, torch.Tensor]  # (lo, span) of the histogram: ``k3.ops.moe.qb.qb_range(bias)``


def _launch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, hist: torch.Tensor | None,
            hist_range: HistRange | None, apply_sigmoid: bool, write_route: bool, count: torch.Tensor | None = None):
    M, N = logits.shape
    dev = logits.device
    idx = alloc((M, top_k), torch.int64, dev) if write_route else None
    p = alloc((M, top_k), torch.float32, dev) if write_route else None
    ssel = alloc((M, top_k), torch.float32, dev) if write_route else None
    if hist is not None:
        if hist_range is None:
            raise ValueError("hist_range (k3.ops.moe.qb.qb_range(bias)) is required with hist")
        lo, span = hist_range
        scale = hist.shape[1] / span
        lo, scale = lo.reshape(1).float(), scale.reshape(1).float()
        count = count if count is not None else torch.ones(1, dtype=torch.int32, device=dev)
    else:
        lo = scale = count = bias
    if M:
        NP = triton.next_power_of_2(N)
        # decode-sized rows get a program of their own size: one token's 128 scores in one warp take 3 µs, in a
        # 16-row program of four warps 7 µs (each of the k arg-max rounds is a chain of reductions)
        BM = min(max(1, min(16, 4096 // NP)), triton.next_power_of_2(M))
        nw = max(1, min(4, BM * NP // 128))
        dummy = logits
        _router_kernel[(triton.cdiv(M, BM),)](
            logits, bias, idx if write_route else dummy, p if write_route else dummy,
            ssel if write_route else dummy, hist if hist is not None else dummy, lo, scale, count,
            M, N, logits.stride(0), float(scaling),
            TOP_K=top_k, K1=top_k + (1 if hist is not None else 0), KP=triton.next_power_of_2(top_k + 1), NP=NP, BM=BM,
            NUM_BINS=hist.shape[1] if hist is not None else 1, APPLY_SIGMOID=apply_sigmoid,
            WRITE_ROUTE=write_route, HIST=hist is not None, num_warps=nw)
    return idx, p, ssel


def _logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``x [m, d] @ weight[n, d]ᵀ`` (bf16 operands stay bf16 on CUDA: exact products, fp32 sums); a decode
    row through the decode-sized kernel (``k3.ops.gemv``), which also writes fp32."""
    if use_gemv(x.shape[0], x, weight) and weight.dtype == x.dtype and x.stride(-1) == 1:
        return gemv(x, weight, out_dtype=torch.float32)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        try:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # torch without mm(out_dtype=)
            pass
    return x.float() @ weight.float().t()


# The ops are registered with torch.library so torch.compile treats each as one opaque node (fake impls give the
# output shapes, the autograd formulas are plain torch code it can trace). The QB histogram is its own op that
# mutates the accumulator in place (a mutating op cannot carry an autograd formula); it re-reads the logits.
@torch.library.custom_op("k3::router_logits", mutates_args=())
def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _logits(x, weight)


@router_logits.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def _router_logits_setup(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    ctx.save_for_backward(*inputs)


def _router_logits_bwd(ctx, dlogits: torch.Tensor):  # noqa: ANN001, ANN202
    x, weight = ctx.saved_tensors
    # bf16 operands multiply in bf16 as in the forward; a mix (bf16 activations, fp32 master weight: the eager
    # autocast trainer) in fp32
    low = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
    dl = dlogits.to(x.dtype) if low else dlogits.float()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = (dl @ (weight if low else weight.float())).to(x.dtype)
    if ctx.needs_input_grad[1]:
        dw = (dl.t() @ (x if low else x.float())).to(weight.dtype)
    return dx, dw


router_logits.register_autograd(_router_logits_bwd, setup_context=_router_logits_setup)


@torch.library.custom_op("k3::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [m, n]`` fp32 → ``(p [m, k] fp32, s_sel [m, k] fp32, idx [m, k] int64)``."""
    with on_device_of(logits):
        idx, p, ssel = _launch(logits.contiguous(), bias.float().contiguous(), top_k, scaling, None, None, True,
                               True)
    return p, ssel, idx


@moe_route.register_fake
def _(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):  # noqa: ANN202
    m = logits.shape[0]
    return logits.new_empty(m, top_k), logits.new_empty(m, top_k), logits.new_empty(m, top_k, dtype=torch.int64)


def _moe_route_setup(ctx, inputs, output) -> None:  # noqa: ANN001
    logits, _, _, scaling = inputs
    _, ssel, idx = output
    ctx.save_for_backward(idx, ssel)
    ctx.scaling, ctx.n = scaling, logits.shape[1]
    ctx.mark_non_differentiable(idx, ssel)


def _moe_route_bwd(ctx, dp, _dssel, _didx):  # noqa: ANN001, ANN202
    idx, ssel = ctx.saved_tensors
    c = ctx.scaling
    S = ssel.sum(-1, keepdim=True)
    ds = (c / S) * dp - (c / (S * S)) * (dp * ssel).sum(-1, keepdim=True)
    dsel = ds * ssel * (1.0 - ssel)
    dlogits = torch.zeros(idx.shape[0], ctx.n, dtype=torch.float32, device=idx.device).scatter_(1, idx, dsel)
    return dlogits, None, None, None


moe_route.register_autograd(_moe_route_bwd, setup_context=_moe_route_setup)


@torch.library.custom_op("k3::qb_histogram_logits", mutates_args=("hist",))
def qb_histogram_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, hist: torch.Tensor,
                        lo: torch.Tensor, span: torch.Tensor, count: torch.Tensor) -> None:
    """Add ``count`` (int32 ``[1]``) per (token, expert) to the QB histogram ``hist [n, B]`` over
    ``[lo, lo + span)`` of router ``logits [m, n]`` (sigmoid taken in the kernel)."""
    with on_device_of(logits):
        _launch(logits.contiguous(), bias.float().contiguous(), top_k, 1.0, hist, (lo, span), True, False, count)


@qb_histogram_logits.register_fake
def _(logits: torch.Tensor, bias: torch.Tensor, top_k: int, hist: torch.Tensor, lo: torch.Tensor,
      span: torch.Tensor, count: torch.Tensor) -> None:
    return None


def route_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                hist: torch.Tensor | None = None, scaling: float = 1.0, hist_range: HistRange | None = None,
                count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``k3.ops.moe.router.route_reference`` (inputs already validated); with ``hist`` also
    ``hist_range = qb_range(bias)``."""
    logits = router_logits(x, weight)
    p, _, idx = moe_route(logits, bias, top_k, float(scaling))
    if hist is not None:
        if hist_range is None:
            raise ValueError("hist_range (k3.ops.moe.qb.qb_range(bias)) is required with hist")
        if count is None:
            count = torch.ones(1, dtype=torch.int32, device=x.device)
        qb_histogram_logits(logits.detach(), bias, top_k, hist, *hist_range, count)
    return idx, p


def qb_histogram_fused(scores: torch.Tensor, bias: torch.Tensor, top_k: int, hist: torch.Tensor,
                       hist_range: HistRange) -> torch.Tensor:
    """Accumulate the QB histogram of sigmoid ``scores [m, n]`` into ``hist [n, B]`` int32 (in place) over
    ``hist_range = qb_range(bias)``."""
    s = scores if scores.dtype == torch.float32 and scores.stride(-1) == 1 else scores.float().contiguous()
    _launch(s, bias.float().contiguous(), top_k, 1.0, hist, hist_range, False, False)
    return hist
