"""Routed experts kept in MXFP4, a drop-in for the model's ``GroupedExperts``.

Letters: E experts, F expert width (``expert_dim``), L latent width (``latent_dim``), R sorted token-expert rows.

Buffers (persistent, stacked over experts, exactly the released checkpoint's per-expert bytes):
  ``w1_packed`` [E,F,L/2] u8, ``w1_scale`` [E,F,L/32] u8   gate (latent → F)
  ``w3_packed`` [E,F,L/2] u8, ``w3_scale`` [E,F,L/32] u8   up
  ``w2_packed`` [E,L,F/2] u8, ``w2_scale`` [E,L,F/32] u8   down (F → latent)

``forward(x_sorted [R,L], offs [E] int32 cumulative ends) -> [R,L]`` = W2·SiTU-GLU(W1 x, W3 x) per expert group.
On CUDA the W4A16 Triton kernels run (gate and up fused with the SiTU-GLU epilogue); on CPU each expert is
dequantised to the activation dtype and multiplied.  Rows past ``offs[-1]`` come back as zeros.  Inference only:
the packed weights take no gradient (the release's experts were trained with MXFP4 QAT; fine-tuning them needs the
dequantised ``GroupedExperts``).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.moe.mxfp4 import GROUP, check_mxfp4, dequantize_mxfp4, quantize_mxfp4
from k3.ops.moe.mxfp4_gemm import check_grouped_inputs, mxfp4_grouped_glu, mxfp4_grouped_mm, use_triton
from k3.ops.moe.situ import situ_glu

__all__ = ["MXFP4GroupedExperts", "mxfp4_ffn"]

_NAMES = ("w1", "w3", "w2")


class MXFP4GroupedExperts(nn.Module):
    """E routed SiTU-GLU experts at latent width L and expert width F, weights in MXFP4 (see module docstring)."""

    def __init__(self, n_experts: int, latent_dim: int, expert_dim: int, beta1: float = 4.0, beta2: float = 25.0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        for name, v in (("n_experts", n_experts), ("latent_dim", latent_dim), ("expert_dim", expert_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name, v in (("latent_dim", latent_dim), ("expert_dim", expert_dim)):
            if v % GROUP:
                raise ValueError(f"{name} must be a multiple of {GROUP} for MXFP4, got {v}")
        if not (beta1 > 0 and beta2 > 0):
            raise ValueError(f"beta1 and beta2 must be > 0, got {beta1}, {beta2}")
        self.n_experts, self.latent_dim, self.expert_dim = n_experts, latent_dim, expert_dim
        self.beta1, self.beta2 = float(beta1), float(beta2)
        for name in _NAMES:
            out_f, in_f = self.weight_shape(name)
            self.register_buffer(f"{name}_packed", torch.zeros(n_experts, out_f, in_f // 2, dtype=torch.uint8,
                                                               device=device))
            self.register_buffer(f"{name}_scale", torch.zeros(n_experts, out_f, in_f // GROUP, dtype=torch.uint8,
                                                              device=device))

    def weight_shape(self, name: str) -> tuple[int, int]:
        """Logical ``(out, in)`` of one expert's ``w1``/``w3`` (F, L) or ``w2`` (L, F)."""
        if name not in _NAMES:
            raise ValueError(f"name must be one of {_NAMES}, got {name!r}")
        return (self.latent_dim, self.expert_dim) if name == "w2" else (self.expert_dim, self.latent_dim)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, latent_dim={self.latent_dim}, expert_dim={self.expert_dim}, mxfp4"

    # --- conversions -------------------------------------------------------------------------------------------
    def pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, scale)`` buffers of ``w1``/``w3``/``w2``."""
        self.weight_shape(name)
        return getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")

    def dequantized(self, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Stacked dense weight ``[E, out, in]`` of ``w1``/``w3``/``w2`` in ``dtype`` (the GroupedExperts layout)."""
        return dequantize_mxfp4(*self.pair(name), dtype=dtype)

    @classmethod
    def from_dense(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, beta1: float = 4.0,
                   beta2: float = 25.0) -> "MXFP4GroupedExperts":
        """Quantise stacked dense weights w1, w3 [E,F,L] and w2 [E,L,F] (round to nearest; for tests and tools)."""
        if w1.dim() != 3 or w1.shape != w3.shape or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1]):
            raise ValueError(f"w1, w3 must be [E,F,L] and w2 [E,L,F], got {tuple(w1.shape)}, {tuple(w3.shape)}, "
                             f"{tuple(w2.shape)}")
        mod = cls(w1.shape[0], w1.shape[2], w1.shape[1], beta1, beta2, device=w1.device)
        with torch.no_grad():
            for name, w in zip(_NAMES, (w1, w3, w2)):
                packed, scale = quantize_mxfp4(w.detach())
                mod.pair(name)[0].copy_(packed)
                mod.pair(name)[1].copy_(scale)
        return mod

    def check(self) -> None:
        """``ValueError`` if a buffer was replaced by one of the wrong shape or dtype."""
        for name in _NAMES:
            packed, scale = self.pair(name)
            out_f, in_f = check_mxfp4(packed, scale)
            if packed.shape[0] != self.n_experts or (out_f, in_f) != self.weight_shape(name):
                raise ValueError(f"{name}: expected packed [{self.n_experts}, {self.weight_shape(name)[0]}, "
                                 f"{self.weight_shape(name)[1] // 2}], got {tuple(packed.shape)}")

    # --- forward -------------------------------------------------------------------------------------------------
    def forward(self, x_sorted: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x_sorted [R,L]`` (rows grouped by expert), ``offs [E]`` int32 cumulative ends → ``[R,L]``; with
        ``rows [R]`` the row r is ``x_sorted[rows[r]]`` (the tokens, as ``GroupedExperts`` takes them)."""
        if x_sorted.dim() != 2 or x_sorted.shape[1] != self.latent_dim:
            raise ValueError(f"x_sorted must be [R, {self.latent_dim}], got {tuple(x_sorted.shape)}")
        if rows is not None:
            x_sorted = x_sorted.index_select(0, rows)
        return mxfp4_ffn(x_sorted, offs, self.pair("w1"), self.pair("w3"), self.pair("w2"), self.beta1, self.beta2)


Pair = tuple[torch.Tensor, torch.Tensor]


def mxfp4_ffn(x: torch.Tensor, offs: torch.Tensor, w1: Pair, w3: Pair, w2: Pair, beta1: float, beta2: float
              ) -> torch.Tensor:
    """W2·SiTU-GLU(W1 x, W3 x) per expert group with ``(packed, scale)`` weights of any expert count (the module's
    own, or replicas received by expert parallel). W4A16 Triton kernels on CUDA, else per-expert dequantisation."""
    check_grouped_inputs(x, *w1, offs)
    if use_triton(x):
        h = mxfp4_grouped_glu(x, w1, w3, offs, beta1, beta2)
        return mxfp4_grouped_mm(h, *w2, offs)
    return _ffn_dequantized(x, offs, w1, w3, w2, beta1, beta2)


def _ffn_dequantized(x: torch.Tensor, offs: torch.Tensor, w1: Pair, w3: Pair, w2: Pair, beta1: float, beta2: float
                     ) -> torch.Tensor:
    """CPU path: one expert at a time, dequantised to x.dtype (never all experts at once)."""
    y = torch.zeros_like(x)
    start = 0
    for e, end in enumerate(offs.long().tolist()):
        if end > start:
            xe = x[start:end]
            a, b, c = (dequantize_mxfp4(w[0][e], w[1][e], x.dtype) for w in (w1, w3, w2))
            y[start:end] = situ_glu(xe @ a.T, xe @ b.T, beta1, beta2) @ c.T
        start = max(start, end)
    return y
