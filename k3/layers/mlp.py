"""Dense SiTU-GLU MLP (docs/architecture.md#situ-glu): y = down_proj( SiTU-GLU(gate_proj x, up_proj x) ).

Layer 0's MLP (width ``dense_intermediate_size``) and the fused shared experts of every MoE layer (width
``n_shared_experts · expert_dim``: two experts stored as one MLP, which is exactly their sum).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.layers.fused import FusedProjections
from k3.ops.gemv import situ_linear
from k3.ops.moe.situ import situ_glu

__all__ = ["SiTUMLP"]


class SiTUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, beta1: float = 4.0, beta2: float = 25.0) -> None:
        super().__init__()
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.fused: FusedProjections | None = None  # serving: gate and up as one GEMM

    def fuse_projections(self) -> None:
        """Inference forwards run gate_proj and up_proj from one GEMM (``k3.layers.fused``)."""
        self.fused = FusedProjections(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., d]`` → ``[..., d]``."""
        if self.fused is not None and not torch.is_grad_enabled():
            return self.act_down(*self.fused(x))
        return self.act_down(self.gate_proj(x), self.up_proj(x))

    def act_down(self, gate: torch.Tensor, up: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """``down_proj(SiTU-GLU(gate, up))`` from the two projections of the input; ``+ add`` (2-D ``[m, d]``)
        inside the GEMM when given (one launch less). Without autograd the SiTU-GLU, the product and the sum are
        one kernel for a decode row (``k3.ops.gemv``)."""
        if not torch.is_grad_enabled():
            return situ_linear(gate, up, self.down_proj.weight, self.beta1, self.beta2, add=add)
        h = situ_glu(gate, up, self.beta1, self.beta2)
        if add is None:
            return self.down_proj(h)
        return torch.addmm(add, h, self.down_proj.weight.t())
