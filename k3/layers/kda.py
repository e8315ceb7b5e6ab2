"""Kimi Delta Attention layer (docs/architecture.md#kimi-delta-attention) with the released parameter names.

    q, k, v = SiLU(ShortConv(W_{q,k,v} x))              (conv fp32, kernel 4, no bias)
    q, k    ← L2Norm(q), L2Norm(k)                       (in the kernel; x / sqrt(Σx² + 1e-6))
    g       = lb · σ(exp(A_log_h) · (f_b(f_a(x)) + dt_bias))   ∈ (lb, 0), lb = config.kda_gate_lower_bound
    β       = σ(b_proj x)                                (fp32)
    o       = KDA(q, k, v, g, β)                         (state S [B, H, K, V] fp32)
    y       = o_proj[ σ(g_proj x) ⊙ RMSNorm_head(o; o_norm) ]

Prefill / training runs ``k3.ops.kda.chunk_kda``; decode (T == 1 with a state, no gradient) runs
``fused_recurrent_kda_pool``. With a state (a ``KDAState`` pool, see ``k3.state``) the forward works on the pool
rows ``state.slots``: decode updates them in place; a longer piece gathers their states, runs the chunked op from
them and scatters the final states back; the conv tails are gathered and scattered the same way.
With ``impl="reference"`` the gate, L2 norm and sigmoid are computed here and the fp32 token loop
``naive_recurrent_kda`` runs instead: same math, the layer tests' ground truth.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import k3.ops.kda as kda_ops
from k3.config import K3Config
from k3.layers.conv import ShortConv
from k3.layers.fused import FusedProjections
from k3.layers.norm import RMSNorm
from k3.ops.conv import short_conv_update
from k3.ops.kda.gate import kda_gate
from k3.ops.gemv import linear, norm_gate_linear
from k3.state import KDAState

__all__ = ["KimiDeltaAttention", "l2norm", "kda_reference"]

L2_EPS = 1e-6  # on the sum of squares, as fla's in-kernel L2 norm


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def kda_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The in-kernel preprocessing done by hand, then the fp32 token loop.

    q, k, v ``[B, T, H, K]`` (post conv+SiLU, not normalised), f ``[B, T, H, K]`` raw gate input, b ``[B, T, H]``
    β logits → ``(o [B, T, H, V] in v.dtype, final state [B, H, K, V] fp32 or None)``.
    """
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(b.float())
    o, S = kda_ops.naive_recurrent_kda(l2norm(q), l2norm(k), v.float(), g, beta, scale=q.shape[-1] ** -0.5,
                                       initial_state=initial_state, output_final_state=output_final_state)
    return o.to(v.dtype), S


class KimiDeltaAttention(nn.Module):
    """KDA token mixer. ``impl``: "auto" (chunk / fused-recurrent ops) or "reference" (token loop)."""

    def __init__(self, config: K3Config, layer_idx: int = 0) -> None:
        super().__init__()
        d, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, H, K
        self.lower_bound = float(config.kda_gate_lower_bound)
        self.impl = "auto"
        P = H * K
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        self.q_conv1d = ShortConv(P, config.kda_conv_size)
        self.k_conv1d = ShortConv(P, config.kda_conv_size)
        self.v_conv1d = ShortConv(P, config.kda_conv_size)
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.b_proj = nn.Linear(d, H, bias=False)
        self.g_proj = nn.Linear(d, P, bias=False)
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(P, d, bias=False)
        self.fused: FusedProjections | None = None  # serving: the six input projections as one GEMM
        self.reset_gate_parameters()

    def fuse_projections(self) -> None:
        """Inference forwards run q, k, v, g, f_a and b from one GEMM (``k3.layers.fused``)."""
        self.fused = FusedProjections(*self._inputs())

    def _inputs(self) -> tuple[nn.Linear, ...]:
        return self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.f_a_proj, self.b_proj

    def reset_gate_parameters(self) -> None:
        """A_log = 0 (the safe gate's init); dt_bias = softplus⁻¹(dt), dt ~ logU(1e-3, 1e-1) clamped ≥ 1e-4."""
        nn.init.zeros_(self.A_log)
        with torch.no_grad():
            u = torch.rand_like(self.dt_bias)
            dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def init_state(self, pool_size: int, dtype: torch.dtype, device: torch.device | str | None = None) -> KDAState:
        """A state pool of ``pool_size`` rows, all bound (``slots = arange(pool_size)``)."""
        return KDAState.zeros(pool_size, self.num_heads, self.head_dim, self.q_conv1d.kernel_size, dtype, device)

    def forward(self, x: torch.Tensor, state: KDAState | None = None) -> torch.Tensor:
        """``x [B, T, d]`` (normed layer input) → ``[B, T, d]``; updates the pool rows ``state.slots`` in place."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        inference = not torch.is_grad_enabled()
        if self.fused is not None and inference:
            xq, xk, xv, g, fa, b = self.fused(x)
        else:
            xq, xk, xv, g, fa, b = (lin(x) for lin in self._inputs())
        q, k, v = (t.view(B, T, H, K) for t in self._convs(xq, xk, xv, state))
        f = (linear(fa, self.f_b_proj.weight) if inference else self.f_b_proj(fa)).view(B, T, H, K)
        o = self._recurrent(q, k, v, f, b, state)  # b: β logits (the ops take their sigmoid in fp32)
        g = g.view(B, T, H, K)
        if inference:  # the norm, gate and o_proj in one kernel for a decode row, two otherwise (k3.ops.gemv)
            return norm_gate_linear(o, g, self.o_norm.weight, self.o_norm.eps, self.o_proj.weight)
        o = (self.o_norm(o.float()) * torch.sigmoid(g.float())).to(x.dtype)  # o_norm weight fp32 → fp32
        return self.o_proj(o.reshape(B, T, H * K))

    def _convs(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, state: KDAState | None
               ) -> tuple[torch.Tensor, ...]:
        """The q, k, v short convs of ``[B, T, H·K]`` inputs, continuing pool rows ``state.slots``: a one-token step
        updates their tails in place (one kernel for all three); a longer piece gathers them and scatters the new
        tails back."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        xs = (xq, xk, xv)
        if state is None:
            return tuple(c(x)[0] for c, x in zip(convs, xs))
        if xq.shape[1] == 1 and not torch.is_grad_enabled():
            y = short_conv_update([x[:, 0] for x in xs], state.tails, state.slots, [c.weight for c in convs],
                                  self.q_conv1d.activation)
            return tuple(y[:, :, None].unbind(0))
        out = []
        for i, (c, x) in enumerate(zip(convs, xs)):
            y, tail = c(x, state.tails[i].index_select(0, state.slots))
            state.tails[i].index_copy_(0, state.slots, tail)
            out.append(y)
        return tuple(out)

    def _recurrent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                   state: KDAState | None) -> torch.Tensor:
        """The KDA recurrence from (and back into) the pool rows ``state.slots``, or from zero without a state."""
        if state is None:
            return self._core(q, k, v, f, b, None, output_final_state=False)[0]
        # fused_recurrent_kda is forward-only: decode steps that need gradients take the chunked path.
        if q.shape[1] == 1 and self.impl == "auto" and not torch.is_grad_enabled():
            return kda_ops.fused_recurrent_kda_pool(q, k, v, f, b, state.recurrent, state.slots, **self._op_kwargs())
        o, S = self._core(q, k, v, f, b, state.recurrent.index_select(0, state.slots), output_final_state=True)
        state.recurrent.index_copy_(0, state.slots, S)
        return o

    def _op_kwargs(self) -> dict:
        return dict(scale=self.head_dim ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=self.lower_bound, A_log=self.A_log,
                    dt_bias=self.dt_bias)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
              S0: torch.Tensor | None, output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunked op (in-kernel L2 norm, gate and β sigmoid) or the reference token loop."""
        if self.impl == "reference":
            return kda_reference(q, k, v, f, b, self.A_log, self.dt_bias, self.lower_bound, S0, output_final_state)
        return kda_ops.chunk_kda(q, k, v, f, b.float(), initial_state=S0, output_final_state=output_final_state,
                                 **self._op_kwargs())
