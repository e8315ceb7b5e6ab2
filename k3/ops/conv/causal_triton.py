"""The short causal convolution of a whole piece in Triton, forward and backward (``causal.py`` has the contract).

Rows are indexed in the padded input ``xp = tail ‖ x`` (row p of xp is ``tail[p]`` for p < W−1, else
``x[p − (W−1)]``; zeros before the tail or without one), which the kernels never build: each load picks its rows
from x or the tail by mask. x is read in its own dtype and ``[B, T, C]`` layout (any row stride: the q, k, v column
slices of one fused projection are read in place), everything is accumulated in fp32.

    pre[t] = Σ_w w[w] · xp[t + w]          y[t] = SiLU(pre[t])  (or pre[t])
    dpre[t] = dy[t] · σ(pre[t]) (1 + pre[t] (1 − σ(pre[t])))
    dxp[p] = Σ_j w[W−1−j] · dpre[p − (W−1) + j]       dw[w] = Σ_t dpre[t] · xp[t + w]

The backward recomputes ``pre`` from x (no fp32 pre-activation is kept between the passes: only x is saved). A
program owns a [BT, BC] tile of padded rows and loads the 2W−1 shifted x tiles and the W shifted dy tiles it needs
once each (neighbouring rows come from L1/L2); ``dx`` rows p ≥ W−1 go to ``dx``, rows p < W−1 to the tail's
gradient. Each backward program walks ROWS padded rows and writes one fp32 ``[W, BC]`` partial of ``dw``, summed
after in a fixed order (deterministic, no atomics).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["short_conv_fwd", "short_conv_bwd", "short_conv_op"]


def _configs(quads: tuple[tuple[int, int, int, int | None], ...]) -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":  # small tiles: the tests' shapes still span several of them
        return [triton.Config({"BT": 16, "BC": 16}, num_warps=4)]
    return [triton.Config({"BT": bt, "BC": bc}, num_warps=w, maxnreg=r) for bt, bc, w, r in quads]


# (BT, BC, warps, register cap). Every thread holds 8 consecutive channels of a row (16-byte bf16 loads). sm_90
# builds (ptxas): forward 55–90 registers, no spills. The backward keeps the 2W−1 shifted x tiles, W dy tiles,
# the W taps and the W partial dw sums of its channels in registers: 168–190 registers, no spills, 3 programs of
# 4 warps per SM, 11 independent 16-byte loads in flight per thread; capped at 128 (4 programs per SM) it spills
# 8–12 bytes.
_FWD = _configs(((16, 128, 4, None), (32, 128, 4, None), (64, 64, 4, None), (64, 128, 8, None)))
_BWD = _configs(((8, 128, 4, None), (16, 64, 4, None), (16, 128, 8, None), (8, 256, 8, None), (8, 128, 4, 128)))
_BWD_MAX_BT = max(c.kwargs["BT"] for c in _BWD)


@triton.jit
def _load_xp(x, tail, p0, o_r, o_c, m_c, T, s_xt, C, W: tl.constexpr, HAS_TAIL: tl.constexpr):
    """Padded rows ``p0 + o_r`` of ``tail ‖ x`` as fp32 (zeros outside it), ``[BT, BC]``. The row start is a scalar
    added to the base pointer: the tile's int32 offsets are the same for every shift, computed once."""
    t0 = p0 - (W - 1)
    o_t = t0 + o_r
    b_x = tl.load(x + t0 * s_xt + (o_r[:, None] * s_xt + o_c[None, :]),
                  mask=((o_t >= 0) & (o_t < T))[:, None] & m_c[None, :], other=0.)
    if HAS_TAIL:  # the tail has x's dtype (the caller casts): both loads round the same way
        o_p = p0 + o_r
        b_x += tl.load(tail + p0 * C + (o_r[:, None] * C + o_c[None, :]),
                       mask=((o_p >= 0) & (o_p < W - 1))[:, None] & m_c[None, :], other=0.)
    return b_x.to(tl.float32)


@triton.autotune(configs=_FWD, key=["C", "W", "ACT", "HAS_TAIL"])
@triton.jit(do_not_specialize=["T"])
def short_conv_fwd_kernel(x, w, tail, y, T, C, s_xb, s_xt, W: tl.constexpr, ACT: tl.constexpr,
                          HAS_TAIL: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = i_t.to(tl.int64) * BT
    o_r = tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    x += i_b.to(tl.int64) * s_xb
    tail += i_b.to(tl.int64) * (W - 1) * C
    b_y = tl.zeros([BT, BC], dtype=tl.float32)
    for i_w in tl.static_range(W):  # output row t reads padded rows t .. t + W − 1
        b_w = tl.load(w + o_c * W + i_w, mask=m_c, other=0.)
        b_y += b_w[None, :] * _load_xp(x, tail, t0 + i_w, o_r, o_c, m_c, T, s_xt, C, W, HAS_TAIL)
    if ACT:  # the decode update's SiLU expression
        b_y = b_y / (1.0 + tl.exp(-b_y))
    p_y = y + (i_b.to(tl.int64) * T + t0) * C + (o_r[:, None] * C + o_c[None, :])
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=(t0 + o_r < T)[:, None] & m_c[None, :])


@triton.autotune(configs=_BWD, key=["C", "W", "ACT", "HAS_TAIL", "DTAIL"])
@triton.jit(do_not_specialize=["T"])
def short_conv_bwd_kernel(x, w, tail, dy, dx, dtail, dw, T, C, s_xb, s_xt, W: tl.constexpr, ACT: tl.constexpr,
                          HAS_TAIL: tl.constexpr, DTAIL: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr,
                          BC: tl.constexpr):
    i_r, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    x += i_b.to(tl.int64) * s_xb
    tail += i_b.to(tl.int64) * (W - 1) * C
    dy += i_b.to(tl.int64) * T * C
    dx += i_b.to(tl.int64) * T * C
    dtail += i_b.to(tl.int64) * (W - 1) * C
    b_ws = ()  # the W taps of this channel block, [BC] fp32 each
    for i_w in tl.static_range(W):
        b_ws = b_ws + (tl.load(w + o_c * W + i_w, mask=m_c, other=0.),)
    b_dw = ()  # per-tap partial sums of dw over the rows walked here
    for i_w in tl.static_range(W):
        b_dw = b_dw + (tl.zeros([BC], dtype=tl.float32),)
    o_r = tl.arange(0, BT)
    o_rc = o_r[:, None] * C + o_c[None, :]  # the int32 offsets of a [BT, BC] tile of dy / dx / dtail rows
    for i_j in range(0, ROWS // BT):
        p0 = i_r.to(tl.int64) * ROWS + i_j * BT  # the first padded row of dxp owned by this tile
        # xp rows p0 − (W−1) + s + o_r for s = 0 … 2W−2: enough for pre at rows p0 − (W−1) + j + o_r, j < W
        b_xs = ()
        for s in tl.static_range(2 * W - 1):
            b_xs = b_xs + (_load_xp(x, tail, p0 - (W - 1) + s, o_r, o_c, m_c, T, s_xt, C, W, HAS_TAIL),)
        b_dxp = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):  # dpre at rows r = p0 − (W−1) + j + o_r, read back by tap W−1−j
            r0 = p0 - (W - 1) + j
            m_r = (r0 + o_r >= 0) & (r0 + o_r < T)
            b_dpre = tl.load(dy + r0 * C + o_rc, mask=m_r[:, None] & m_c[None, :], other=0.).to(tl.float32)
            if ACT:
                b_pre = tl.zeros([BT, BC], dtype=tl.float32)
                for i_w in tl.static_range(W):
                    b_pre += b_ws[i_w][None, :] * b_xs[j + i_w]
                b_sig = 1.0 / (1.0 + tl.exp(-b_pre))
                b_dpre = b_dpre * b_sig * (1.0 + b_pre * (1.0 - b_sig))
            b_dxp += b_ws[W - 1 - j][None, :] * b_dpre
        # b_dpre is now at rows r = p0 + o_r: every output row is counted once, by the program owning its padded row
        b_new = ()
        for i_w in tl.static_range(W):
            b_new = b_new + (b_dw[i_w] + tl.sum(b_dpre * b_xs[W - 1 + i_w], 0),)
        b_dw = b_new
        t0 = p0 - (W - 1)
        tl.store(dx + t0 * C + o_rc, b_dxp.to(dx.dtype.element_ty),
                 mask=((t0 + o_r >= 0) & (t0 + o_r < T))[:, None] & m_c[None, :])
        if DTAIL:
            tl.store(dtail + p0 * C + o_rc, b_dxp.to(dtail.dtype.element_ty),
                     mask=(p0 + o_r < W - 1)[:, None] & m_c[None, :])
    p_dw = dw + ((i_b * tl.num_programs(0) + i_r).to(tl.int64) * W) * C + o_c
    for i_w in tl.static_range(W):
        tl.store(p_dw + i_w * C, b_dw[i_w], mask=m_c)


def _grid_fwd(B: int, T: int, C: int):
    return lambda meta: (triton.cdiv(T, meta["BT"]), triton.cdiv(C, meta["BC"]), B)


def short_conv_fwd(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None, activation: bool
                   ) -> torch.Tensor:
    """``x [B, T, C]`` (channels contiguous), ``weight [C, 1, W]`` fp32, ``tail [B, W−1, C]`` contiguous in x's dtype
    or None → ``y [B, T, C]`` contiguous, x's dtype."""
    B, T, C = x.shape
    W = weight.shape[-1]
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    if y.numel():
        with on_device_of(x):
            short_conv_fwd_kernel[_grid_fwd(B, T, C)](
                x, weight.reshape(C, W).contiguous(), x if tail is None else tail, y, T, C, x.stride(0), x.stride(1),
                W=W, ACT=bool(activation), HAS_TAIL=tail is not None)
    return y


@functools.lru_cache(maxsize=8)
def _row_groups(B: int, Tp: int) -> tuple[int, int]:
    """(ROWS, groups): padded rows per backward program (a power of two ≥ every tuned BT) and their count, at most
    about 512 (batch, group) pairs: ``dw`` partials of a few MB, and (times C / BC) several waves of programs on any
    GPU, so that the last, partly filled one costs little (``small``: 8 × 33 × 8 programs of 128 rows)."""
    rows = max(_BWD_MAX_BT, triton.next_power_of_2(triton.cdiv(B * Tp, 512)))
    return rows, triton.cdiv(Tp, rows)


def short_conv_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None,
                   activation: bool, tail_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dy [B, T, C]`` contiguous → ``(dx [B, T, C] in x's dtype, dweight [C, 1, W] fp32, dtail)``: ``dtail`` is
    ``[B, W−1, C]`` in the tail's dtype when ``tail_grad`` (and a tail was given), else an empty tensor."""
    B, T, C = x.shape
    W = weight.shape[-1]
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    tail_grad = tail_grad and tail is not None
    dtail = torch.empty(B, W - 1, C, dtype=tail.dtype, device=x.device) if tail_grad else x.new_empty(0)
    rows, groups = _row_groups(B, T + W - 1)
    dw = torch.empty(B, groups, W, C, dtype=torch.float32, device=x.device)
    if B * C == 0:
        dw.zero_()
    else:
        with on_device_of(x):
            short_conv_bwd_kernel[lambda meta: (groups, triton.cdiv(C, meta["BC"]), B)](
                x, weight.reshape(C, W).contiguous(), x if tail is None else tail, dy, dx, dtail if tail_grad else dx,
                dw, T, C, x.stride(0), x.stride(1), W=W, ACT=bool(activation), HAS_TAIL=tail is not None,
                DTAIL=tail_grad, ROWS=rows)
    # contiguous, as the fake says: compiled graphs assert the strides the fake promised
    return dx, dw.sum((0, 1)).t().contiguous().view(C, 1, W), dtail


@torch.library.custom_op("k3::short_conv_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None, activation: bool) -> torch.Tensor:
    return short_conv_fwd(x, weight, tail, activation)


@_fwd_op.register_fake
def _(x, weight, tail, activation):
    return x.new_empty(x.shape)


@torch.library.custom_op("k3::short_conv_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None, activation: bool,
            tail_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return short_conv_bwd(dy, x, weight, tail, activation, tail_grad)


@_bwd_op.register_fake
def _(dy, x, weight, tail, activation, tail_grad):
    C, W = x.shape[2], weight.shape[-1]
    dtail = tail.new_empty(tail.shape) if tail_grad and tail is not None else x.new_empty(0)
    return x.new_empty(x.shape), x.new_empty(C, 1, W, dtype=torch.float32), dtail


def _setup_context(ctx, inputs, output) -> None:
    x, weight, tail, activation = inputs
    ctx.save_for_backward(x, weight, tail)  # x only: the backward recomputes the pre-activation from it
    ctx.activation = activation


def _backward(ctx, dy):
    x, weight, tail = ctx.saved_tensors
    tail_grad = tail is not None and ctx.needs_input_grad[2]
    dx, dw, dtail = _bwd_op(dy.contiguous(), x, weight, tail, ctx.activation, tail_grad)
    return dx, dw.to(weight.dtype), dtail if tail_grad else None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def short_conv_op(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None, activation: bool
                  ) -> torch.Tensor:
    """``y`` of the convolution as the differentiable ``k3::short_conv_fwd`` op (a ``torch.compile`` region keeps it
    as one node); x's channels contiguous, the tail contiguous in x's dtype."""
    return _fwd_op(x, weight, tail, activation)
