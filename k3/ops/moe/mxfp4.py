"""MXFP4 weights as the released K3 checkpoint stores its routed experts (compressed-tensors ``mxfp4-pack-quantized``).

Layout of one ``[out, in]`` weight W:

- ``weight_packed`` uint8 ``[out, in/2]``: two 4-bit E2M1 codes per byte, the LOW nibble is the even (first) input
  element, the high nibble the odd one.  Codes 0–7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8–15 are the same values
  negated (8 is −0).
- ``weight_scale`` uint8 ``[out, in/32]``: one E8M0 exponent per group of 32 consecutive inputs, value 2^(s − 127).
  s = 255 is NaN in the OCP MX spec and decodes to NaN here.

W[o, i] = E2M1(code[o, i]) · 2^(scale[o, i // 32] − 127).  Both functions accept leading batch dimensions, so the
stacked expert buffers ``[E, out, in/2]`` / ``[E, out, in/32]`` go through unchanged.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "GROUP", "dequantize_mxfp4", "e8m0_to_float", "quantize_mxfp4", "check_mxfp4"]

GROUP = 32  # inputs per E8M0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = E2M1_VALUES[:8]


def check_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """Validate a packed/scale pair; return ``(out, in)``.  ``ValueError`` names the argument that is wrong."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a uint8 tensor [..., out, in/2], got {getattr(packed, 'dtype', type(packed))}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        raise ValueError(f"scale must be a uint8 tensor [..., out, in/32], got {getattr(scale, 'dtype', type(scale))}")
    if packed.dim() < 2 or scale.dim() != packed.dim():
        raise ValueError(
            f"packed [..., out, in/2] and scale [..., out, in/32] must have the same rank >= 2, "
            f"got {tuple(packed.shape)} and {tuple(scale.shape)}"
        )
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != scale.shape[-1] * (GROUP // 2):
        raise ValueError(
            f"scale must be [..., out, in/32] for packed [..., out, in/2] = {tuple(packed.shape)}, "
            f"got {tuple(scale.shape)}"
        )
    return packed.shape[-2], packed.shape[-1] * 2


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes → fp32 powers of two 2^(s − 127), built from the bit pattern so every value is exact.

    s ≥ 1 is the normal float with biased exponent s; s = 0 is 2^−127, the fp32 subnormal 0x00400000; s = 255 → NaN.
    """
    s = scale.to(torch.int32)
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    out = bits.view(torch.float32)
    return torch.where(s == 255, torch.full_like(out, float("nan")), out)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``packed [..., out, in/2]`` u8, ``scale [..., out, in/32]`` u8 → W ``[..., out, in]`` in ``dtype``.

    Computed in fp32 (a 4-bit value times a power of two is exact there unless it over/underflows), then cast.
    """
    out_f, in_f = check_mxfp4(packed, scale)
    lead = packed.shape[:-2]
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)  # [..., out, in/2, 2]: low nibble first
    vals = lut[codes.long()].reshape(*lead, out_f, in_f // GROUP, GROUP)
    w = vals * e8m0_to_float(scale).unsqueeze(-1)
    return w.reshape(*lead, out_f, in_f).to(dtype)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` (already divided by its group scale, |y| ≤ 6) to the nearest E2M1 code (ties → smaller)."""
    mags = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=y.device)
    a = y.abs().clamp(max=6.0)
    # Midpoints between neighbouring magnitudes; searchsorted(right=False) sends an exact tie to the smaller one.
    mids = (mags[1:] + mags[:-1]) / 2
    idx = torch.searchsorted(mids, a.contiguous(), right=False)
    return (idx + 8 * ((y < 0) & (idx > 0)).to(idx.dtype)).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W ``[..., out, in]`` (in % 32 == 0) → ``(packed [..., out, in/2] u8, scale [..., out, in/32] u8)``.

    Per group of 32 the scale is the smallest power of two 2^e with max|w|/2^e ≤ 6 (no clipping; e clamped to
    [−127, 127]; an all-zero group gets s = 0); each element is rounded to the nearest E2M1 value.  Meant for writing
    test checkpoints: values already on the MXFP4 grid come back exactly.
    """
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 2:
        raise ValueError(f"w must be a floating tensor [..., out, in], got {getattr(w, 'shape', type(w))}")
    if w.shape[-1] % GROUP:
        raise ValueError(f"w's last dimension (in) must be a multiple of {GROUP}, got {w.shape[-1]}")
    if not torch.isfinite(w).all():
        raise ValueError("w must be finite")
    lead, (out_f, in_f) = w.shape[:-2], w.shape[-2:]
    g = w.float().reshape(*lead, out_f, in_f // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    # frexp gives amax/6 = m·2^k with m in [0.5, 1): the smallest e with amax/6 ≤ 2^e is k, or k−1 when m == 0.5.
    m, k = torch.frexp(amax / 6.0)
    e = torch.where(m == 0.5, k - 1, k).clamp(-127, 127)
    s = torch.where(amax > 0, e + 127, torch.zeros_like(e))
    codes = _e2m1_codes(g / e8m0_to_float(s.to(torch.uint8)).unsqueeze(-1))
    codes = codes.reshape(*lead, out_f, in_f // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.contiguous(), s.to(torch.uint8).contiguous()
