"""MXFP4: decoding against a hand-computed table (every code, nibble order, extreme scales), round-to-nearest
quantisation, and the W4A16 grouped GEMM (Triton, in the interpreter on CPU; bf16 on GPU) against
dequantise-then-multiply."""

from __future__ import annotations

import math

import pytest
import torch

from k3.layers.experts_mxfp4 import MXFP4GroupedExperts
from k3.layers.moe import GroupedExperts
from k3.ops.moe.mxfp4 import dequantize_mxfp4, e8m0_to_float, quantize_mxfp4
from k3.ops.moe.mxfp4_gemm import (
    mxfp4_grouped_glu,
    mxfp4_grouped_glu_reference,
    mxfp4_grouped_mm,
    mxfp4_grouped_mm_reference,
)

# E2M1 by hand: code = s·8 + e·2 + m; value (−1)^s · (e == 0 ? m/2 : (1 + m/2)·2^(e−1)).
HAND = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0,
        8: -0.0, 9: -0.5, 10: -1.0, 11: -1.5, 12: -2.0, 13: -3.0, 14: -4.0, 15: -6.0}
SCALES = (0, 1, 2, 100, 126, 127, 128, 200, 253, 254)


def _hand_value(code: int, s: int) -> float:
    return math.ldexp(HAND[code], s - 127)  # exact in Python floats (doubles)


def test_dequantize_matches_hand_table_all_codes_and_extreme_scales():
    # one row per scale; 32 inputs = codes 0..15 then 15..0, packed low nibble first
    codes = list(range(16)) + list(range(15, -1, -1))
    row = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    packed = torch.tensor([row] * len(SCALES), dtype=torch.uint8)
    scale = torch.tensor([[s] for s in SCALES], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale, torch.float32)
    for r, s in enumerate(SCALES):
        for i, c in enumerate(codes):
            want = _hand_value(c, s)
            want32 = torch.tensor(want, dtype=torch.float64).float().item()  # overflow → inf, like any fp32 product
            got = w[r, i].item()
            assert got == want32 or (math.isinf(want32) and got == want32), (s, c, got, want)
            assert math.copysign(1, got) == math.copysign(1, want32), (s, c)  # −0 stays −0
    # spot values, written out
    assert w[SCALES.index(127), 7].item() == 6.0 and w[SCALES.index(127), 15].item() == -6.0
    assert w[SCALES.index(0), 1].item() == 2.0 ** -128  # 0.5 · 2^-127: an fp32 subnormal, not flushed
    assert w[SCALES.index(254), 3].item() == 1.5 * 2.0 ** 127
    assert w[SCALES.index(254), 4].item() == math.inf  # 2 · 2^127 overflows fp32
    # bf16 keeps the same exponent range: the table survives the cast exactly (where finite)
    wb = dequantize_mxfp4(packed, scale, torch.bfloat16)
    assert torch.equal(wb.float(), w)


def test_nibble_order_low_first():
    packed = torch.tensor([[0x71, 0x00] * 8], dtype=torch.uint8)  # byte 0x71: low nibble 1 (0.5), high 7 (6)
    w = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8), torch.float32)
    assert w[0, :4].tolist() == [0.5, 6.0, 0.0, 0.0]


def test_e8m0_values_and_nan():
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = e8m0_to_float(s)
    for i in list(range(0, 255, 17)) + [0, 1, 127, 254]:
        assert v[i].item() == math.ldexp(1.0, i - 127)
    assert math.isnan(v[255].item())
    assert math.isnan(dequantize_mxfp4(torch.zeros(1, 16, dtype=torch.uint8),
                                       torch.tensor([[255]], dtype=torch.uint8), torch.float32)[0, 0].item())


def test_quantize_round_to_nearest_and_grid_values_exact():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 7, 96, generator=g) * torch.logspace(-6, 6, 7).view(1, 7, 1)
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (3, 7, 48) and scale.shape == (3, 7, 3) and packed.dtype == scale.dtype == torch.uint8
    d = dequantize_mxfp4(packed, scale, torch.float32)
    # round to nearest: the grid step (units of 2^e) is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
    unit = e8m0_to_float(scale).unsqueeze(-1)  # [3, 7, 3, 1]
    err = (d - w).abs().reshape(3, 7, 3, 32)
    a = w.abs().reshape(3, 7, 3, 32) / unit
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)) * unit
    assert (err <= half_step).all()
    # no clipping: the group max is ≤ 6·2^e, and 2^e is the smallest power of two that allows that
    amax = a.amax(-1)
    assert (amax <= 6).all() and (amax > 3).all()
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(d), torch.float32), d)  # grid values are fixed points
    # exact ties go to the smaller magnitude; zeros give scale 0 and code 0
    p, s = quantize_mxfp4(torch.tensor([[5.0, -2.5, 0.25] + [0.0] * 28 + [6.0]]))
    assert dequantize_mxfp4(p, s, torch.float32)[0, :3].tolist() == [4.0, -2.0, 0.0]
    p, s = quantize_mxfp4(torch.zeros(2, 32))
    assert s.eq(0).all() and p.eq(0).all()


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="packed must be a uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 33))
    with pytest.raises(ValueError, match="finite"):
        quantize_mxfp4(torch.full((1, 32), float("inf")))


# --- W4A16 grouped GEMM ------------------------------------------------------------------------------------------
def _problem(E: int, N: int, K: int, counts: list[int], tail: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    R = sum(counts) + tail
    x = (torch.randn(R, K, generator=g)).to(dtype)
    w = [quantize_mxfp4(torch.randn(E, N, K, generator=g) / math.sqrt(K)) for _ in range(2)]
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return x, w[0], w[1], offs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype, counts, tail", [
    (torch.float32, [5, 0, 17, 1], 3),  # empty experts, tail rows of no expert
    (torch.float16, [5, 0, 17, 1], 3),
    (torch.float32, [1], 0),  # one row
    (torch.float32, [0, 0, 40], 0),  # all rows in the last expert, several row tiles
])
def test_triton_grouped_mm_matches_dequantise_then_multiply(monkeypatch, dtype, counts, tail):
    monkeypatch.setenv("K3_MXFP4_BACKEND", "triton")
    E, N, K = len(counts), 40, 96  # N not a multiple of the tile: masked columns; K = 3 scale groups
    x, (p1, s1), (p3, s3), offs = _problem(E, N, K, counts, tail, dtype)
    out = torch.full((x.shape[0], N), float("nan"), dtype=dtype)  # poisoned: every row must be written
    y = mxfp4_grouped_mm(x, p1, s1, offs, out=out)
    ref = mxfp4_grouped_mm_reference(x, p1, s1, offs)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    assert y[offs[-1]:].eq(0).all()  # rows of no expert are zeros
    assert _rel(y, ref) < (1e-6 if dtype == torch.float32 else 2e-3)
    out = torch.full((x.shape[0], N), float("nan"), dtype=dtype)
    h = mxfp4_grouped_glu(x, (p1, s1), (p3, s3), offs, 4.0, 25.0, out=out)
    assert torch.isfinite(h).all()
    assert _rel(h, mxfp4_grouped_glu_reference(x, (p1, s1), (p3, s3), offs, 4.0, 25.0)) < (
        1e-5 if dtype == torch.float32 else 2e-3)


def test_triton_extreme_scales_and_large_values(monkeypatch):
    """Scales near both ends of the fp32 range and saturated codes go through the kernel exactly (fp32, K = 32)."""
    monkeypatch.setenv("K3_MXFP4_BACKEND", "triton")
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (2, 8, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.tensor([[[1], [20], [100], [127], [140], [150], [160], [2]]] * 2, dtype=torch.uint8)
    x = torch.zeros(3, 32)
    x[0, 5] = 1.0  # picks one weight column: y = W[:, 5] exactly
    x[1, 30] = -2.0
    x[2] = torch.randn(32, generator=g)
    offs = torch.tensor([2, 3], dtype=torch.int32)
    y = mxfp4_grouped_mm(x, packed, scale, offs)
    W = dequantize_mxfp4(packed, scale, torch.float32)
    assert torch.equal(y[0], W[0][:, 5]) and torch.equal(y[1], -2.0 * W[0][:, 30])
    assert _rel(y[2:], mxfp4_grouped_mm_reference(x, packed, scale, offs)[2:]) < 1e-6


def test_bad_gemm_inputs_raise():
    x, (p, s), _, offs = _problem(2, 8, 32, [1, 2], 0, torch.float32)
    with pytest.raises(ValueError, match="offs must be an int32"):
        mxfp4_grouped_mm(x, p, s, offs.long())
    with pytest.raises(ValueError, match="non-decreasing"):
        mxfp4_grouped_mm(x, p, s, torch.tensor([2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="K = 64"):
        mxfp4_grouped_mm(torch.zeros(3, 64), p, s, offs)
    with pytest.raises(ValueError, match="x must be"):
        mxfp4_grouped_mm(x.double(), p, s, offs)


# --- the experts module ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mxfp4_experts_match_grouped_experts(monkeypatch, backend):
    monkeypatch.setenv("K3_MXFP4_BACKEND", backend)
    g = torch.Generator().manual_seed(2)
    E, Lat, Fw = 4, 64, 32
    dense = GroupedExperts(E, Lat, Fw)
    with torch.no_grad():
        for w in (dense.w1, dense.w3, dense.w2):
            w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[-1]))
    q = MXFP4GroupedExperts.from_dense(dense.w1, dense.w3, dense.w2)
    with torch.no_grad():  # the dense module on the MXFP4 grid: the same weights
        for name in ("w1", "w3", "w2"):
            getattr(dense, name).copy_(q.dequantized(name, torch.float32))
    x = torch.randn(13, Lat, generator=g)
    offs = torch.tensor([3, 3, 10, 13], dtype=torch.int32)
    with torch.no_grad():
        got, want = q(x, offs), dense(x, offs)
    assert _rel(got, want) < 1e-5
    with pytest.raises(ValueError, match="x_sorted must be"):
        q(torch.zeros(2, Lat + 1), offs)
    with pytest.raises(ValueError, match="multiple of 32"):
        MXFP4GroupedExperts(2, 48, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_bf16_grouped_gemm_matches_dequantise_then_multiply():
    E, N, K = 8, 384, 512
    counts = [0, 1, 7, 64, 200, 3, 0, 33]
    x, (p1, s1), (p3, s3), offs = _problem(E, N, K, counts, 5, torch.bfloat16)
    x, p1, s1, p3, s3, offs = (t.cuda() for t in (x, p1, s1, p3, s3, offs))
    y = mxfp4_grouped_mm(x, p1, s1, offs)
    ref = mxfp4_grouped_mm_reference(x, p1, s1, offs)
    assert _rel(y, ref) < 1e-2 and y[offs[-1]:].eq(0).all()
    h = mxfp4_grouped_glu(x, (p1, s1), (p3, s3), offs)
    assert _rel(h, mxfp4_grouped_glu_reference(x, (p1, s1), (p3, s3), offs)) < 1e-2
