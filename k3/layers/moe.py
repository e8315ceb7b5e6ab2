"""Latent MoE (docs/architecture.md#latent-moe) with Quantile Balancing, released parameter names.

Letters: m tokens, d hidden, n experts, k top-k, ℓ latent width, F expert width, R = m·k expert rows.

    idx, p = route(x)                        fp32 sigmoid scores on the full-d x; top-k of s + b; p from unbiased s
    z      = routed_expert_down_proj(x)      [m, ℓ]
    u      = Σ_{j∈T} p_j E_j(z)              E_j(z) = W2_j SiTU-GLU(W1_j z, W3_j z)   (GroupedExperts, grouped GEMM)
    y      = routed_expert_up_proj(RMSNorm(u; routed_expert_norm)) + shared_experts(x)

Quantile Balancing: ``gate.e_score_correction_bias`` (fp32 buffer, persistent, no gradient) is the selection
bias. Training forwards (``module.training and torch.is_grad_enabled()``) add the step's required-bias histogram to
``gate.qb_hist`` (int32 ``[n, qb_num_bins]``, a non-persistent buffer: not in state_dict) in place, inside a
registered op, so a compiled forward records it without a graph break; ``K3ForCausalLM.qb_step`` turns the pooled
histograms into new biases. Eval / no-grad forwards touch neither. ``last_load`` (int64 ``[n]``, non-persistent)
holds the rows per expert of the last training forward, also written in place.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3.config import K3Config
from k3.layers.fused import FusedProjections
from k3.layers.mlp import SiTUMLP
from k3.layers.norm import RMSNorm
from k3.ops.gemv import linear
from k3.ops.moe.combine import combine_norm_rows
from k3.ops.moe.grouped import expert_rows, grouped_ffn, permute_rows
from k3.ops.moe.qb import qb_bias_from_histogram
from k3.ops.moe.router import route

__all__ = ["MoEGate", "GroupedExperts", "LatentMoE"]


class MoEGate(nn.Module):
    """Router weight ``[n, d]`` and the QB bias buffer ``e_score_correction_bias [n]`` (fp32)."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, num_bins: int, scaling: float = 1.0) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.num_bins, self.scaling = n_experts, top_k, num_bins, float(scaling)
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32), persistent=True)
        # accumulated by training forwards, reset by qb_step
        self.register_buffer("qb_hist", torch.zeros(n_experts, num_bins, dtype=torch.int32), persistent=False)

    def histogram(self, device: torch.device) -> torch.Tensor:
        """The accumulating QB histogram (moved to ``device`` if the module is elsewhere)."""
        if self.qb_hist.device != device:
            self.qb_hist = self.qb_hist.to(device)
        return self.qb_hist

    def forward(self, x: torch.Tensor, record: bool = False, count: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [m, d]`` → ``(idx [m, k] int64, p [m, k] fp32)``; adds ``count`` (int32 ``[1]``, default 1) per token
        and expert to the QB histogram when ``record``."""
        hist = self.histogram(x.device) if record else None
        return route(x, self.weight, self.e_score_correction_bias, self.top_k, hist=hist, scaling=self.scaling,
                     count=count)

    @torch.no_grad()
    def apply_histogram(self, hist: torch.Tensor) -> None:
        """Set the bias from a pooled histogram (no change when it holds no tokens); no host sync."""
        new = qb_bias_from_histogram(hist, self.e_score_correction_bias, self.top_k)
        has_tokens = hist[0].sum() > 0
        self.e_score_correction_bias.copy_(torch.where(has_tokens, new, self.e_score_correction_bias))

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, top_k={self.top_k}, qb_num_bins={self.num_bins}"


class GroupedExperts(nn.Module):
    """E stacked SiTU-GLU experts on the latent: ``w1, w3 [E, F, ℓ]`` (gate, up), ``w2 [E, ℓ, F]`` (down).

    ``forward(x_sorted [R, ℓ], offs [E] int32 cumulative group ends) → [R, ℓ]``: rows of group e go through expert
    e. Replacements (MXFP4, expert parallel, fused kernels) keep this signature.
    """

    def __init__(self, n_experts: int, latent_dim: int, expert_dim: int, beta1: float = 4.0,
                 beta2: float = 25.0) -> None:
        super().__init__()
        self.n_experts, self.latent_dim, self.expert_dim = n_experts, latent_dim, expert_dim
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.w1 = nn.Parameter(torch.empty(n_experts, expert_dim, latent_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, expert_dim, latent_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, latent_dim, expert_dim))

    def forward(self, x_sorted: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows grouped by expert ``[R, ℓ]`` (or tokens ``[m, ℓ]`` with ``rows [R]``, the token of each sorted row),
        ``offs [E]`` → ``[R, ℓ]``. Three grouped GEMMs + SiTU-GLU; inference calls with few rows (decode) two fused
        kernels instead, which read the tokens in place."""
        return grouped_ffn(x_sorted, offs, self.w1, self.w3, self.w2, self.beta1, self.beta2, rows)

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, latent_dim={self.latent_dim}, expert_dim={self.expert_dim}"


class LatentMoE(nn.Module):
    """The ``block_sparse_moe`` of layers ≥ first_k_dense."""

    def __init__(self, config: K3Config, layer_idx: int = 0) -> None:
        super().__init__()
        d, l = config.hidden_size, config.latent_dim
        self.layer_idx, self.eps = layer_idx, float(config.rms_norm_eps)
        self.gate = MoEGate(d, config.n_experts, config.top_k, config.qb_num_bins, config.routed_scaling_factor)
        self.routed_expert_down_proj = nn.Linear(d, l, bias=False)
        self.experts = GroupedExperts(config.n_experts, l, config.expert_dim, config.situ_beta1, config.situ_beta2)
        self.routed_expert_norm = RMSNorm(l, eps=config.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(l, d, bias=False)
        self.shared_experts = (SiTUMLP(d, config.shared_dim, config.situ_beta1, config.situ_beta2)
                               if config.n_shared_experts > 0 else None)
        # what each training forward adds to the QB histogram: 1, and 0 while activation checkpointing recomputes
        # the forward (``qb_count`` and ``qb_zero`` swap places). A device value rather than a Python flag: the
        # compiled forward and its recompute run one graph, and no op is issued to switch it.
        self.register_buffer("qb_count", torch.ones(1, dtype=torch.int32), persistent=False)
        self.register_buffer("qb_zero", torch.zeros(1, dtype=torch.int32), persistent=False)
        # [n] token-expert rows per expert of the last training forward (all zero before the first)
        self.register_buffer("last_load", torch.zeros(config.n_experts, dtype=torch.int64), persistent=False)
        self.fused: FusedProjections | None = None  # serving: the down projection and the shared gate/up as one GEMM
        # activation checkpointing policy "experts": keep only z for the routed experts' backward and recompute their
        # expert-sorted rows (top_k per token: the largest activations of the layer)
        self.recompute_experts = False

    def fuse_projections(self) -> None:
        """Inference forwards run routed_expert_down_proj and the shared experts' gate and up projections from one
        GEMM (``k3.layers.fused``; the router keeps its own fp32-output GEMM)."""
        sh = self.shared_experts
        self.fused = FusedProjections(self.routed_expert_down_proj, *((sh.gate_proj, sh.up_proj) if sh else ()))

    def recording(self) -> bool:
        """Whether this forward is a training forward that feeds Quantile Balancing (by ``qb_count``)."""
        return self.training and torch.is_grad_enabled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., d]`` (post_attention_layernorm output) → ``[..., d]``."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        record = self.recording()
        idx, p = self.gate(xf, record=record, count=self.qb_count)
        inference = not torch.is_grad_enabled()
        if self.fused is not None and inference:
            z, *shared = self.fused(xf)
        else:
            z, shared = self.routed_expert_down_proj(xf), None
        r = self.routed(z, idx, p, record)
        y = linear(r, self.routed_expert_up_proj.weight) if inference else self.routed_expert_up_proj(r)
        if shared:  # serving: the shared experts' output added inside their down GEMM
            y = self.shared_experts.act_down(*shared, add=y)
        elif self.shared_experts is not None:
            y = y + self.shared_experts(xf)
        return y.reshape(shape)

    def routed(self, z: torch.Tensor, idx: torch.Tensor, p: torch.Tensor, record: bool = False) -> torch.Tensor:
        """``z [m, ℓ]``, ``idx/p [m, k]`` → ``RMSNorm(Σ_j p_j E_j(z)) [m, ℓ]``."""
        row_of, token_of_row, offs = expert_rows(idx, self.experts.n_experts)
        if self.recompute_experts and self.training and torch.is_grad_enabled():
            rows = checkpoint(self._expert_rows, z, token_of_row, row_of, offs, use_reentrant=False)
        else:
            rows = self._expert_rows(z, token_of_row, row_of, offs)
        if record:
            self.last_load.copy_(torch.diff(offs, prepend=offs.new_zeros(1)))
        return combine_norm_rows(rows, row_of, p, self.routed_expert_norm.weight, self.eps)

    def _expert_rows(self, z: torch.Tensor, token_of_row: torch.Tensor, row_of: torch.Tensor, offs: torch.Tensor
                     ) -> torch.Tensor:
        """Each token's k expert outputs ``[m·k, ℓ]``, expert-sorted (no routing weights yet)."""
        if not torch.is_grad_enabled():  # the experts read each row's token in place
            return self.experts(z, offs, rows=token_of_row)
        return self.experts(permute_rows(z, token_of_row, row_of), offs)
