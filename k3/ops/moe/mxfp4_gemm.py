"""W4A16 grouped GEMM: activations (bf16/fp16/fp32) × MXFP4 expert weights dequantised in the kernel, fp32 accumulate.

Letters: R rows (token-expert pairs, sorted by expert), E experts, N output features, K input features.

``mxfp4_grouped_mm(x [R,K], packed [E,N,K/2] u8, scale [E,N,K/32] u8, offs [E] int32) -> y [R,N]``
    rows ``offs[e-1]:offs[e]`` (offs = cumulative ends, offs[-1] = 0 before the first) go through expert e:
    y = x · dequant(W_e)ᵀ.  Rows from ``offs[-1]`` to R belong to no expert and come back as zeros.
``mxfp4_grouped_glu(x, w1 (packed, scale), w3 (packed, scale), offs, beta1, beta2) -> [R,N]``
    the experts' first half fused: SiTU-GLU(x·W1ᵀ, x·W3ᵀ) from the two fp32 accumulators, one read of x.

MXFP4 (see ``k3.ops.moe.mxfp4``): two E2M1 codes per byte, low nibble first; one E8M0 scale 2^(s−127) per 32 inputs.
The weights stay 4-bit in memory (0.53 B per weight instead of 2), which is what lets the released model's 2.72 T
expert weights fit in ~1.45 TB of accelerator memory.

Work split: the host picks BM from the mean rows per expert; a few torch ops on the device (no host sync) cut every
expert's rows into BM-row tiles and list them (``_tile_schedule``); program (t, n) computes tile t × columns
n·BN…  Unused tile slots exit at once.  Offsets are clamped to [0, R] and made non-decreasing on the device, so bad
offsets on a GPU can never read or write out of bounds (they are checked exactly when ``offs`` is on the CPU).

``*_reference`` are the plain torch versions (dequantise, fp32 matmul) the kernels are tested against; on CPU
tensors the public functions run them unless ``K3_MXFP4_BACKEND=triton`` (with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from k3.ops._device import on_device_of
from k3.ops._fastpath import fallback_notice
from k3.ops.moe.mxfp4 import GROUP, check_mxfp4, dequantize_mxfp4
from k3.ops.moe.situ import situ_glu

__all__ = [
    "mxfp4_grouped_mm",
    "mxfp4_grouped_glu",
    "mxfp4_grouped_mm_reference",
    "mxfp4_grouped_glu_reference",
    "check_grouped_inputs",
]

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False


# ----------------------------------------------------------------------------------------------------------------
# input checks and the torch reference
# ----------------------------------------------------------------------------------------------------------------
def check_grouped_inputs(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor) -> None:
    """``ValueError`` naming the argument unless x [R,K] float, packed [E,N,K/2] u8, scale [E,N,K/32] u8, offs [E] int32."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be a bf16/fp16/fp32 tensor [R, K], got {getattr(x, 'dtype', type(x))} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if packed.dim() != 3:
        raise ValueError(f"packed must be [E, N, K/2] uint8, got shape {tuple(packed.shape)}")
    _, k = check_mxfp4(packed, scale)
    if k != x.shape[1]:
        raise ValueError(f"packed [E, N, K/2] implies K = {k}, but x has K = {x.shape[1]}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.shape != (packed.shape[0],):
        raise ValueError(f"offs must be an int32 tensor [E={packed.shape[0]}] of cumulative row ends, got "
                         f"{getattr(offs, 'dtype', type(offs))} {tuple(getattr(offs, 'shape', ()))}")
    if x.device != packed.device or x.device != scale.device or x.device != offs.device:
        raise ValueError(f"x, packed, scale and offs must be on one device, got {x.device}, {packed.device}, "
                         f"{scale.device}, {offs.device}")
    if offs.device.type == "cpu" and offs.numel():  # exact check where it costs no device sync
        o = offs.long()
        if (o[0] < 0) or bool((o[1:] < o[:-1]).any()) or o[-1] > x.shape[0]:
            raise ValueError(f"offs must be non-decreasing in [0, R={x.shape[0]}], got {offs.tolist()[:16]}…")


def _group_bounds(offs: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    ends = offs.long().tolist()
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def mxfp4_grouped_mm_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                               offs: torch.Tensor) -> torch.Tensor:
    """Dequantise each expert to fp32 and multiply in fp32; rows past ``offs[-1]`` are zero.  Returns x.dtype."""
    check_grouped_inputs(x, packed, scale, offs)
    y = torch.zeros(x.shape[0], packed.shape[1], dtype=torch.float32, device=x.device)
    for e, (a, b) in enumerate(_group_bounds(offs.cpu(), x.shape[0])):
        if b > a:
            y[a:b] = x[a:b].float() @ dequantize_mxfp4(packed[e], scale[e], torch.float32).T
    return y.to(x.dtype)


def mxfp4_grouped_glu_reference(x: torch.Tensor, w1: tuple[torch.Tensor, torch.Tensor],
                                w3: tuple[torch.Tensor, torch.Tensor], offs: torch.Tensor,
                                beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU(x·W1ᵀ, x·W3ᵀ) with both products in fp32 (not rounded in between); returns x.dtype."""
    _check_glu_pair(w1, w3)
    check_grouped_inputs(x, *w1, offs)
    g = torch.zeros(x.shape[0], w1[0].shape[1], dtype=torch.float32, device=x.device)
    u = torch.zeros_like(g)
    for e, (a, b) in enumerate(_group_bounds(offs.cpu(), x.shape[0])):
        if b > a:
            xf = x[a:b].float()
            g[a:b] = xf @ dequantize_mxfp4(w1[0][e], w1[1][e], torch.float32).T
            u[a:b] = xf @ dequantize_mxfp4(w3[0][e], w3[1][e], torch.float32).T
    return situ_glu(g, u, beta1, beta2).to(x.dtype)


def _check_glu_pair(w1: tuple[torch.Tensor, torch.Tensor], w3: tuple[torch.Tensor, torch.Tensor]) -> None:
    if len(w1) != 2 or len(w3) != 2:
        raise ValueError("w1 and w3 must each be a (packed, scale) pair")
    if w1[0].shape != w3[0].shape or w1[1].shape != w3[1].shape:
        raise ValueError(f"w1 and w3 must have the same shapes, got {tuple(w1[0].shape)} and {tuple(w3[0].shape)}")


# ----------------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _e2m1_times_scale(p, s, BN: tl.constexpr, BK: tl.constexpr):
        """Packed bytes p [BN, BK/2] u8 and E8M0 bytes s [BN, BK/32] u8 → fp32 weights [BN, BK] (exact)."""
        c = tl.interleave(p & 0x0F, p >> 4).to(tl.int32)  # [BN, BK], low nibble = even input
        ex = (c >> 1) & 3
        m = c & 1
        # E2M1 → fp32 bits: exponent field ex-1+127, one mantissa bit; ex == 0 is the subnormal 0 / 0.5 (= 2^-1).
        bits = tl.where(ex == 0, m * (126 << 23), ((ex + 126) << 23) | (m << 22))
        bits = bits | ((c >> 3) << 31)
        v = bits.to(tl.float32, bitcast=True)
        si = s.to(tl.int32)
        sf = tl.where(si == 0, 0x00400000, si << 23).to(tl.float32, bitcast=True)  # 2^(s-127), s=0 subnormal
        v = tl.reshape(v, (BN, BK // 32, 32)) * sf[:, :, None]
        return tl.reshape(v, (BN, BK))

    @triton.jit
    def _tanh(z):
        # tanh(z) = sign·(1 − e^{−2|z|})/(1 + e^{−2|z|}); the cubic keeps relative accuracy near 0.
        a = tl.abs(z)
        t = tl.exp(-2.0 * a)
        r = (1.0 - t) / (1.0 + t)
        r = tl.where(a < 1e-2, a - a * a * a / 3.0, r)
        return tl.where(z < 0, -r, r)

    @triton.jit
    def _mxfp4_grouped_kernel(
        x_ptr, p1_ptr, s1_ptr, p3_ptr, s3_ptr, y_ptr,
        tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
        N, K: tl.constexpr, E,  # K constexpr: numpy-2 interpreter cannot loop to a runtime bound; K3 has 2 values
        stride_xm, stride_pe, stride_pn, stride_se, stride_sn, stride_ym,
        beta1, beta2,
        GLU: tl.constexpr, IEEE: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        i_t = tl.program_id(0)
        i_n = tl.program_id(1)
        e = tl.load(tile_e_ptr + i_t)
        if e >= 0:
            r0 = tl.load(tile_r0_ptr + i_t)
            r1 = tl.load(tile_r1_ptr + i_t)
            o_m = r0 + tl.arange(0, BM)
            o_n = i_n * BN + tl.arange(0, BN)
            m_m = o_m < r1
            m_n = o_n < N
            acc1 = tl.zeros((BM, BN), dtype=tl.float32)
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
            if e < E:  # e == E is the tail of rows that belong to no expert: stays zero
                p_x = x_ptr + o_m[:, None].to(tl.int64) * stride_xm
                o_pw = e.to(tl.int64) * stride_pe + o_n[:, None].to(tl.int64) * stride_pn
                o_sw = e.to(tl.int64) * stride_se + o_n[:, None].to(tl.int64) * stride_sn
                for k0 in range(0, K, BK):
                    o_k = k0 + tl.arange(0, BK)
                    o_kp = k0 // 2 + tl.arange(0, BK // 2)
                    o_ks = k0 // 32 + tl.arange(0, BK // 32)
                    m_kp = m_n[:, None] & (o_kp[None, :] < K // 2)
                    m_ks = m_n[:, None] & (o_ks[None, :] < K // 32)
                    b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & (o_k[None, :] < K), other=0.0)
                    b_p = tl.load(p1_ptr + o_pw + o_kp[None, :], mask=m_kp, other=0)
                    b_s = tl.load(s1_ptr + o_sw + o_ks[None, :], mask=m_ks, other=127)
                    b_w = _e2m1_times_scale(b_p, b_s, BN, BK).to(b_x.dtype)
                    if IEEE:
                        acc1 += tl.dot(b_x, tl.trans(b_w), input_precision="ieee")
                    else:
                        acc1 += tl.dot(b_x, tl.trans(b_w))
                    if GLU:
                        b_p3 = tl.load(p3_ptr + o_pw + o_kp[None, :], mask=m_kp, other=0)
                        b_s3 = tl.load(s3_ptr + o_sw + o_ks[None, :], mask=m_ks, other=127)
                        b_w3 = _e2m1_times_scale(b_p3, b_s3, BN, BK).to(b_x.dtype)
                        if IEEE:
                            acc3 += tl.dot(b_x, tl.trans(b_w3), input_precision="ieee")
                        else:
                            acc3 += tl.dot(b_x, tl.trans(b_w3))
                if GLU:  # SiTU-GLU(g, u) = β1·tanh(g/β1)·σ(g) · β2·tanh(u/β2), in fp32 on the accumulators
                    acc1 = (beta1 * _tanh(acc1 / beta1) * tl.sigmoid(acc1)) * (beta2 * _tanh(acc3 / beta2))
            p_y = y_ptr + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
            tl.store(p_y, acc1.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _pick_bm(rows: int, experts: int) -> int:
    """Rows per tile from the mean rows per expert: 16 for decode-like loads, up to 128 for prefill."""
    mean = max(1, rows // max(1, experts))
    bm = 16
    while bm < 128 and bm < mean:
        bm *= 2
    return bm


def _tile_schedule(offs: torch.Tensor, rows: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """List the BM-row tiles of every expert (plus the no-expert tail as group E), on the device, without a sync.

    Returns int32 ``(expert, row_start, row_end)`` of length T = min(R, ⌈R/BM⌉ + E + 1) + 1 ≥ the true tile count;
    unused slots have expert −1.
    """
    dev, n_exp = offs.device, offs.numel()
    ends = torch.cummax(offs.long().clamp(0, rows), 0).values
    ends = torch.cat((ends, torch.full((1,), rows, dtype=torch.long, device=dev)))  # group E: the tail
    starts = torch.cat((torch.zeros(1, dtype=torch.long, device=dev), ends[:-1]))
    ntiles = (ends - starts + bm - 1) // bm
    cum = torch.cumsum(ntiles, 0)
    slots = min(rows, (rows + bm - 1) // bm + n_exp + 1) + 1
    t = torch.arange(slots, device=dev)
    g = torch.searchsorted(cum, t, right=True)
    valid = g <= n_exp
    gc = g.clamp(max=n_exp)
    local = t - (cum[gc] - ntiles[gc])
    row0 = starts[gc] + local * bm
    expert = torch.where(valid, gc, torch.full_like(gc, -1))
    return expert.to(torch.int32), row0.to(torch.int32), ends[gc].to(torch.int32)


def use_triton(x: torch.Tensor) -> bool:
    """True when the Triton kernels should run for x: on CUDA, or anywhere when forced.

    ``K3_MXFP4_BACKEND=triton|torch`` forces one (on CPU, Triton needs ``TRITON_INTERPRET=1``); unset, the MoE-wide
    ``K3_MOE_BACKEND`` applies.
    """
    backend = (os.environ.get("K3_MXFP4_BACKEND") or os.environ.get("K3_MOE_BACKEND") or "").lower()
    if backend not in ("", "triton", "torch"):
        raise ValueError(f"K3_MXFP4_BACKEND / K3_MOE_BACKEND must be 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return False
    if not HAS_TRITON:
        if x.is_cuda:
            fallback_notice("the W4A16 expert kernel", "needs triton (pip install 'triton>=3.6,<3.7'), which does "
                            "not import", "dequantise-per-expert in PyTorch")
        return False
    return backend == "triton" or x.is_cuda


def _launch(x: torch.Tensor, p1: torch.Tensor, s1: torch.Tensor, p3: torch.Tensor | None, s3: torch.Tensor | None,
            offs: torch.Tensor, beta1: float, beta2: float, block: tuple[int, int] | None,
            out: torch.Tensor | None) -> torch.Tensor:
    rows, k = x.shape
    n_exp, n = p1.shape[0], p1.shape[1]
    y = _check_out(out, x, n)
    if rows == 0 or n == 0:
        return y
    x, p1, s1 = x.contiguous(), p1.contiguous(), s1.contiguous()
    glu = p3 is not None
    p3 = p3.contiguous() if glu else p1
    s3 = s3.contiguous() if glu else s1
    bm = _pick_bm(rows, n_exp)
    bn, bk = block or _default_block(x, n, k, glu)
    tile_e, tile_r0, tile_r1 = _tile_schedule(offs, rows, bm)
    grid = (tile_e.numel(), triton.cdiv(n, bn))
    _mxfp4_grouped_kernel[grid](
        x, p1, s1, p3, s3, y, tile_e, tile_r0, tile_r1,
        n, k, n_exp,
        x.stride(0), p1.stride(0), p1.stride(1), s1.stride(0), s1.stride(1), y.stride(0),
        float(beta1), float(beta2),
        GLU=glu, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BK=bk,
        num_warps=4 if bm <= 64 else 8, num_stages=3 if x.is_cuda else 1,
    )
    return y


def _check_out(out: torch.Tensor | None, x: torch.Tensor, n: int) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if out.shape != (x.shape[0], n) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor [{x.shape[0]}, {n}] on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _default_block(x: torch.Tensor, n: int, k: int, glu: bool) -> tuple[int, int]:
    """(BN, BK): 128-wide K steps (4 scales) when K allows, narrower N for the fused GLU (two accumulators)."""
    bk = 128 if k % 128 == 0 else (64 if k % 64 == 0 else 32)
    if not x.is_cuda:
        return 32, min(bk, 64)  # interpreter: small tiles keep numpy fast
    return (64 if glu else 128), bk


def mxfp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                     block: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [R,N] = x [R,K] · dequant(W_e)ᵀ per expert group; see the module docstring.

    ``block`` = (BN, BK) overrides the tile shape; ``out`` [R,N] (x.dtype, contiguous) receives the result.
    """
    check_grouped_inputs(x, packed, scale, offs)
    if not use_triton(x):
        return _copy_out(mxfp4_grouped_mm_reference(x, packed, scale, offs), out)
    with on_device_of(x):
        return _launch(x, packed, scale, None, None, offs, 1.0, 1.0, block, out)


def mxfp4_grouped_glu(x: torch.Tensor, w1: tuple[torch.Tensor, torch.Tensor], w3: tuple[torch.Tensor, torch.Tensor],
                      offs: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0,
                      block: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiTU-GLU(x·W1ᵀ, x·W3ᵀ) [R,N] per expert group, W1/W3 given as (packed [E,N,K/2], scale [E,N,K/32])."""
    _check_glu_pair(w1, w3)
    check_grouped_inputs(x, *w1, offs)
    if not (beta1 > 0 and beta2 > 0):
        raise ValueError(f"beta1 and beta2 must be > 0, got {beta1}, {beta2}")
    if not use_triton(x):
        return _copy_out(mxfp4_grouped_glu_reference(x, w1, w3, offs, beta1, beta2), out)
    with on_device_of(x):
        return _launch(x, w1[0], w1[1], w3[0], w3[1], offs, beta1, beta2, block, out)


def _copy_out(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    return _check_out(out, y, y.shape[1]).copy_(y)


assert GROUP == 32  # the kernel hard-codes 32 inputs per scale
