"""The short causal convolution of a whole piece in Triton, forward and backward (``causal.py`` has the contract).

Rows are indexed in the padded input ``xp = tail ‖ x`` (row p of xp is ``tail[p]`` for p < W−1, else
``x[p − (W−1)]``; zeros before the tail or without one), which the kernels never build: each load picks its rows
from x or the tail by mask. x is read in its own dtype and ``[B, T, C]`` layout (any row stride: the q, k, v column
slices of one fused projection are read in place), everything is accumulated in fp32.

    pre[t] = Σ_w w[w] · xp[t + w]          y[t] = SiLU(pre[t])  (or pre[t])
    dpre[t] = dy[t] · σ(pre[t]) (1 + pre[t] (1 − σ(pre[t])))
    dxp[p] = Σ_j w[W−1−j] · dpre[p − (W−1) + j]       dw[w] = Σ_t dpre[t] · xp[t + w]

The backward recomputes ``pre`` from x (no fp32 pre-activation is kept between the passes: only x is saved). A
program owns ROWS consecutive padded rows of a BC-channel block and walks them one row at a time, each thread
keeping its channels' last W−1 x rows and W−1 dpre rows in registers: every x and dy row is read once (plus W−1
warm-up rows per program) and dpre is computed once per element, so the pass runs at memory speed. Rows are
loaded R at a time, all loads of a batch issued before its math. ``dx`` rows p ≥ W−1 go to ``dx``, rows p < W−1
to the tail's gradient. Each program writes one fp32 ``[W, BC]`` partial of ``dw``, summed after in a fixed order
(deterministic, no atomics).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["short_conv_fwd", "short_conv_bwd", "short_conv_op"]


def _configs(keys: tuple[str, ...], rows: tuple[tuple[int, ...], ...], interpreted: tuple[int, ...]
             ) -> list[triton.Config]:
    """(values of ``keys``…, warps) tuples as configs; the interpreter, which cannot autotune, gets the one
    ``interpreted`` (small tiles: the tests' shapes still span several of them)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        rows = (interpreted,)
    return [triton.Config(dict(zip(keys, r[:-1])), num_warps=r[-1]) for r in rows]


# Forward (BT, BC, warps): every thread holds 8 consecutive channels of a row (16-byte bf16 loads); sm_90 builds
# (ptxas) 55–90 registers, no spills.
_FWD = _configs(("BT", "BC"), ((16, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8)), (16, 16, 4))
# Backward (R rows per load batch, BC, warps): a [BC] row vector spreads 4 channels over each thread (8-byte bf16
# accesses); with R = 8 rows in flight that is ~128 registers on sm_90, no spills. One warp per 128 channels gives
# the most programs per SM; wider blocks fewer, longer-lived ones. The GPU's autotuner picks.
_BWD = _configs(("R", "BC"), ((8, 128, 1), (8, 256, 2), (8, 512, 4), (4, 512, 4), (8, 1024, 8)), (4, 16, 4))
_BWD_MAX_R = max(c.kwargs["R"] for c in _BWD)


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


@triton.jit
def _x_row(x, tail, s, o_c, m_c, T, s_xt, C, W: tl.constexpr, HAS_TAIL: tl.constexpr):
    """x row s as a ``[BC]`` vector in x's dtype: s < 0 is the tail's row s + W − 1 (zeros without a tail), rows
    past T are zeros."""
    v = tl.load(x + s * s_xt + o_c, mask=m_c & (s >= 0) & (s < T), other=0.)
    if HAS_TAIL:
        v += tl.load(tail + (s + (W - 1)) * C + o_c, mask=m_c & (s < 0) & (s + (W - 1) >= 0), other=0.)
    return v


@triton.jit
def _dpre(pre, dy, ACT: tl.constexpr):
    """∂L/∂pre from ∂L/∂y: dy · SiLU'(pre), or dy."""
    if ACT:
        sig = 1.0 / (1.0 + tl.exp(-pre))
        dy = dy * sig * (1.0 + pre * (1.0 - sig))
    return dy


@triton.jit
def _shift(h, v, N: tl.constexpr):
    """The window ``h`` of N − 1 rows moved on by one: (h[1], …, h[N−2], v)."""
    out = ()
    for i in tl.static_range(1, N):
        out = out + (h[i],)
    return out + (v,)


@triton.autotune(configs=_BWD, key=["C", "W", "ACT", "HAS_TAIL", "DTAIL"])
@triton.jit(do_not_specialize=["T"])
def short_conv_bwd_kernel(x, w, tail, dy, dx, dtail, dw, T, C, s_xb, s_xt, W: tl.constexpr, ACT: tl.constexpr,
                          HAS_TAIL: tl.constexpr, DTAIL: tl.constexpr, ROWS: tl.constexpr, R: tl.constexpr,
                          BC: tl.constexpr):
    i_r, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    x += i_b.to(tl.int64) * s_xb
    tail += i_b.to(tl.int64) * (W - 1) * C
    dy += i_b.to(tl.int64) * T * C
    dx += i_b.to(tl.int64) * T * C
    dtail += i_b.to(tl.int64) * (W - 1) * C
    ws = ()  # the W taps of this channel block, [BC] fp32 each
    for i_w in tl.static_range(W):
        ws = ws + (tl.load(w + o_c * W + i_w, mask=m_c, other=0.),)
    # Step t takes x[t] and dy[t] and gives dpre[t] and the padded row t of dxp (dx[t − (W−1)], or the tail's row
    # t). The W − 1 previous x rows (hx[i] = x[t − (W−1) + i]) and dpre rows (hd[i] = dpre[t − (W−1) + i]) ride
    # along in registers; the W − 1 steps before the program's first row are recomputed, uncounted, to fill them.
    t_first = i_r.to(tl.int64) * ROWS
    hx = ()
    for i in tl.static_range(W - 1):
        hx = hx + (_x_row(x, tail, t_first - 2 * (W - 1) + i, o_c, m_c, T, s_xt, C, W, HAS_TAIL),)
    hd = ()
    for h in tl.static_range(W - 1):  # own names: a name reused in the row loop below would be loop-carried
        t_h = t_first - (W - 1) + h
        x_h = _x_row(x, tail, t_h, o_c, m_c, T, s_xt, C, W, HAS_TAIL)
        pre_h = ws[W - 1] * x_h.to(tl.float32)
        for i in tl.static_range(W - 1):
            pre_h += ws[i] * hx[i].to(tl.float32)
        d_h = tl.load(dy + t_h * C + o_c, mask=m_c & (t_h >= 0) & (t_h < T), other=0.).to(tl.float32)
        hd = hd + (_dpre(pre_h, d_h, ACT),)
        hx = _shift(hx, x_h, W - 1)
    b_dw = ()  # per-tap partial sums of dw over this program's rows
    for i_w in tl.static_range(W):
        b_dw = b_dw + (tl.zeros([BC], dtype=tl.float32),)
    for k in range(0, ROWS // R):
        t0 = t_first + k * R
        xs = ()  # R rows of x and dy, every load issued before the math
        ds = ()
        for i in tl.static_range(R):
            m = m_c & (t0 + i < T)
            xs = xs + (tl.load(x + (t0 + i) * s_xt + o_c, mask=m, other=0.),)
            ds = ds + (tl.load(dy + (t0 + i) * C + o_c, mask=m, other=0.),)
        for i in tl.static_range(R):
            t = t0 + i
            xt = xs[i].to(tl.float32)
            pre = ws[W - 1] * xt
            for j in tl.static_range(W - 1):
                pre += ws[j] * hx[j].to(tl.float32)
            d = _dpre(pre, ds[i].to(tl.float32), ACT)
            dxp = ws[0] * d
            for j in tl.static_range(1, W):
                dxp += ws[j] * hd[W - 1 - j]
            new = ()
            for j in tl.static_range(W - 1):
                new = new + (b_dw[j] + d * hx[j].to(tl.float32),)
            b_dw = new + (b_dw[W - 1] + d * xt,)
            s = t - (W - 1)
            tl.store(dx + s * C + o_c, dxp.to(dx.dtype.element_ty), mask=m_c & (s >= 0) & (s < T))
            if DTAIL:
                tl.store(dtail + t * C + o_c, dxp.to(dtail.dtype.element_ty), mask=m_c & (t < W - 1))
            hx = _shift(hx, xs[i], W - 1)
            hd = _shift(hd, d, W - 1)
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
    """(ROWS, groups): padded rows per backward program (a power of two, at least 32: each program recomputes
    W − 1 rows before its first, a few percent at 32) and their count, at most about 512 (batch, group) pairs: ``dw``
    partials of a few MB, and (times C / BC) several waves of programs on any GPU, so that the last, partly filled
    one costs little (``small``: 8 batches × 33 groups of 128 rows × C / BC channel blocks)."""
    rows = max(32, _BWD_MAX_R, triton.next_power_of_2(triton.cdiv(B * Tp, 512)))
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
