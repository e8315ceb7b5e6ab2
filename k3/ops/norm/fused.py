"""Triton kernels of RMSNorm: fp32 statistics, x.dtype in and out, a whole row per program (any width ≤ 16384).

    y = x · r · w,  r = rsqrt(mean(x²) + eps)          (x, w upcast to fp32; y cast back to x.dtype)
    ∂x = r (w ⊙ dy − x̂ · mean(x̂ ⊙ w ⊙ dy)),  x̂ = x · r        ∂w = Σ_rows x̂ ⊙ dy

The forward keeps r ([T] fp32) for the backward. Each backward program walks a run of consecutive rows, software
pipelined (the next rows' x and dy are copied into shared memory while the current row is reduced), and writes one
fp32 partial ∂w row (at most about 4 programs per SM), summed after: no [T, D] fp32 buffer.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from k3.ops._device import on_device_of

__all__ = ["rms_norm_fwd", "rms_norm_bwd", "MAX_D"]

MAX_D = 16384


def _per_thread(c: triton.Config, bd: int) -> int:
    return c.kwargs["BT"] * bd // (32 * c.num_warps)


def _pruner(most: int):
    """Keep configs whose fp32 [BT, BD] tiles are 4..``most`` values per thread; else the closest one below."""
    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        bd = kwargs.get("BD", named_args.get("BD"))
        keep = [c for c in configs if 4 <= _per_thread(c, bd) <= most]
        return keep or [max((c for c in configs if _per_thread(c, bd) <= most), key=lambda c: _per_thread(c, bd),
                            default=configs[0])]
    return prune


def _configs(pairs: tuple[tuple[int, int], ...]) -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [triton.Config({"BT": 2}, num_warps=4)]
    return [triton.Config({"BT": bt}, num_warps=w) for bt, w in pairs]


# sm_90, D 7168 (BD 8192): forward (1, 8) / (1, 16) 40–59 registers; backward (1, 16) 115 registers and 64 KB of
# shared memory for its software pipeline (x and dy of the next two rows in flight), no spills
_FWD = _configs(((1, 4), (2, 8), (4, 8), (1, 8), (1, 16), (16, 4)))
_BWD = _configs(((1, 8), (2, 4), (4, 8), (1, 16), (16, 4)))
_BWD_MAX_BT = max(c.kwargs["BT"] for c in _BWD)


@triton.autotune(configs=_FWD, key=["BD"], prune_configs_by={"early_config_prune": _pruner(32)})
@triton.jit(do_not_specialize=["T"])  # one binary for every token count
def rms_norm_fwd_kernel(x, w, y, rstd, T, eps, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)[None, :]  # row vectors as [1, BD]: the tiles' own layout, no conversions
    m_t = o_t < T
    m_d = o_d < D
    m_td = m_t[:, None] & m_d
    o_td = o_t[:, None] * D + o_d
    b_x = tl.load(x + o_td, mask=m_td, other=0.0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(rstd + o_t, b_r, mask=m_t)
    tl.store(y + o_td, (b_x * b_r[:, None] * b_w).to(y.dtype.element_ty), mask=m_td)


@triton.autotune(configs=_BWD, key=["BD"], prune_configs_by={"early_config_prune": _pruner(16)})
@triton.jit(do_not_specialize=["T"])
def rms_norm_bwd_kernel(x, w, rstd, dy, dx, dw, T, D: tl.constexpr, ROWS: tl.constexpr, BT: tl.constexpr,
                        BD: tl.constexpr):
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)[None, :]
    m_d = o_d < D
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BT, BD], tl.float32)  # per-row partials, reduced over the rows once at the end
    # software-pipelined over the rows (cp.async into shared memory): the next rows' x and dy are on their way while
    # this one is reduced. Rows past T re-read the last row with dy taken as zero: they add nothing, and the
    # pipeline carries row indices rather than [BD] offsets and masks.
    for i_j in tl.range(0, ROWS // BT, num_stages=3):
        o_t = i_p.to(tl.int64) * ROWS + i_j * BT + tl.arange(0, BT)
        o_c = tl.minimum(o_t, T - 1)
        b_r = tl.load(rstd + o_c)
        b_xh = tl.load(x + o_c[:, None] * D + o_d, mask=m_d, other=0.0).to(tl.float32) * b_r[:, None]
        b_dy = tl.load(dy + o_c[:, None] * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_dy = tl.where((o_t < T)[:, None], b_dy, 0.0)
        b_gw = b_dy * b_w
        b_dx = (b_gw - b_xh * (tl.sum(b_xh * b_gw, 1) / D)[:, None]) * b_r[:, None]
        tl.store(dx + o_t[:, None] * D + o_d, b_dx.to(dx.dtype.element_ty), mask=(o_t < T)[:, None] & m_d)
        b_dw += b_xh * b_dy
    tl.store(dw + i_p * D + o_d, tl.sum(b_dw, 0)[None, :], mask=m_d)


@functools.lru_cache(maxsize=8)
def _num_programs_cap(device: torch.device) -> int:
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, D]`` contiguous, ``weight [D]`` → ``(y [T, D] in x.dtype, rstd [T] fp32)``."""
    T, D = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(T, dtype=torch.float32, device=x.device)
    if T > 0:
        with on_device_of(x):
            rms_norm_fwd_kernel[lambda meta: (triton.cdiv(T, meta["BT"]),)](
                x, weight, y, rstd, T, float(eps), D=D, BD=triton.next_power_of_2(D))
    return y, rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``dy [T, D]`` → ``(∂x [T, D] in x.dtype, ∂w [D] fp32)``."""
    T, D = x.shape
    dx = torch.empty_like(x)
    # ROWS (a power of two ≥ every tuned BT): at most ``cap`` programs, a grid independent of the tuned BT
    rows = max(_BWD_MAX_BT, triton.next_power_of_2(triton.cdiv(max(T, 1), _num_programs_cap(x.device))))
    n_p = triton.cdiv(max(T, 1), rows)
    dw = torch.empty(n_p, D, dtype=torch.float32, device=x.device)
    if T == 0:
        dw.zero_()
    else:
        with on_device_of(x):
            rms_norm_bwd_kernel[(n_p,)](x, weight, rstd, dy, dx, dw, T, D=D, ROWS=rows, BD=triton.next_power_of_2(D))
    return dx, dw.sum(0)
