"""Several bias-free projections of one input as one GEMM, for serving.

A decode step multiplies a handful of token vectors by each weight matrix: every projection is a small GEMM whose
time is mostly its launch. ``FusedProjections(a, b, c)(x)`` returns ``(a(x), b(x), c(x))`` — column slices of one
GEMM against the weights stacked along the output dimension. The stacked weight is a copy (the checkpoint's
parameters stay as they are, under their own names): made on first use and made again whenever one of the weights
was replaced (``p.data = …``, ``.to()``) or changed in place (PyTorch's version counter), so it never computes with
stale values. A CUDA graph captured over it reads the copy of that moment: change weights, then make a new
``ModelRunner``.

Inference only: no autograd through the copy. ``K3ForCausalLM.fuse_projections()`` turns it on (the serving
runner does); a layer uses it only when no gradient is being recorded, so training never builds it.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.gemv import linear

__all__ = ["FusedProjections"]


class FusedProjections:
    """``(l_1(x), …, l_n(x))`` for bias-free ``nn.Linear`` layers of one input width, from one GEMM."""

    def __init__(self, *linears: nn.Linear) -> None:
        if not linears or any(lin.bias is not None for lin in linears):
            raise ValueError("FusedProjections takes one or more bias-free nn.Linear layers")
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError(f"the layers must share the input width, got {[lin.in_features for lin in linears]}")
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self._key: tuple | None = None
        self.weight: torch.Tensor | None = None

    def stacked_weight(self) -> torch.Tensor:
        """``[Σ out, in]``: the weights one below the other (remade when any of them changed)."""
        ws = [lin.weight for lin in self.linears]
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        if key != self._key:
            self.weight = None  # drop the old copy before making the new one
            with torch.no_grad():
                self.weight = torch.cat([w.detach() for w in ws])
            self._key = key
        assert self.weight is not None
        return self.weight

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., in]`` → one ``[..., out_i]`` per layer (column views of one ``[..., Σ out]`` result)."""
        return linear(x, self.stacked_weight()).split(self.sizes, dim=-1)

    def nbytes(self) -> int:
        return 0 if self.weight is None else self.weight.numel() * self.weight.element_size()
