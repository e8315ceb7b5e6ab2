"""KDA's forget gates, g = log α.

Bounded ("safe") gate, the one K3 uses:  g = lower_bound · sigmoid(exp(A_log_h) · (f + dt_bias_h)) ∈ (lower_bound, 0).
α = exp(g) ∈ (e^lower_bound, 1): the bound is what keeps 16-token decay products representable in bf16.
Unbounded gate (fla's default, Kimi-Linear-48B):  g = −exp(A_log_h) · softplus(f + dt_bias_h).
Never run a checkpoint trained with one gate through the other (it degrades to repetition).
Shapes: f ``[..., H, K]``, A_log ``[H]``, dt_bias ``[H*K]``. Computed in fp32 (fp64 when f is fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["kda_gate", "kda_softplus_gate", "kda_gate_fused", "fused_kda_gate", "check_lower_bound"]


def check_lower_bound(lower_bound: float) -> float:
    """Return ``lower_bound`` as a float; ``ValueError`` unless it lies in [−5, 0)."""
    try:
        lb = float(lower_bound)
    except (TypeError, ValueError):
        raise ValueError(f"lower_bound must be a float in [-5, 0), got {lower_bound!r}") from None
    if not (-5.0 <= lb < 0.0):
        raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    return lb


def _biased(f: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """``f + dt_bias`` in the accumulation dtype (fp32, or fp64 for fp64 f)."""
    H, K = f.shape[-2], f.shape[-1]
    x = f.double() if f.dtype == torch.float64 else f.float()
    if dt_bias is None:
        return x
    if dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must have H*K = {H * K} elements, got shape {tuple(dt_bias.shape)}")
    return x + dt_bias.to(x.dtype).reshape(H, K)


def _rate(A_log: torch.Tensor, H: int, dtype: torch.dtype) -> torch.Tensor:
    """``exp(A_log)`` as ``[H, 1]``."""
    if A_log.numel() != H:
        raise ValueError(f"A_log must have H = {H} elements, got shape {tuple(A_log.shape)}")
    return A_log.to(dtype).reshape(H, 1).exp()


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Bounded log-decay g from raw gate pre-activations ``f [..., H, K]``; without A_log,
    g = lb·sigmoid(f + dt_bias)."""
    lb = check_lower_bound(lower_bound)
    x = _biased(f, dt_bias)
    if A_log is not None:
        x = x * _rate(A_log, f.shape[-2], x.dtype)
    return lb * torch.sigmoid(x)


def kda_softplus_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Unbounded log-decay g = −exp(A_log_h) · softplus(f + dt_bias_h)."""
    x = _biased(f, dt_bias)
    return -_rate(A_log, f.shape[-2], x.dtype) * F.softplus(x)


def kda_gate_fused(
    f: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """The gate ``chunk_kda(use_gate_in_kernel=True)`` applies: bounded form when ``lower_bound`` is set, else the
    softplus form (which needs ``A_log``)."""
    if lower_bound is not None:
        return kda_gate(f, A_log, dt_bias, lower_bound)
    if A_log is None:
        raise ValueError("A_log must be given when use_gate_in_kernel=True and lower_bound is None (softplus gate)")
    return kda_softplus_gate(f, A_log, dt_bias)


def fused_kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fla's ``fused_kda_gate`` (same signature and meaning), differentiable by autograd: −exp(A_log)·softplus(g +
    dt_bias), or with ``lower_bound`` lower_bound·sigmoid(exp(A_log)·(g + dt_bias)) (A_log may then be None:
    lower_bound·sigmoid(g + dt_bias)). Here the torch form (``torch.compile`` fuses it); inside ``chunk_kda`` and
    ``fused_recurrent_kda`` (``use_gate_in_kernel=True``) the kernels compute it themselves. ``lower_bound`` is
    taken as given, as in fla (``chunk_kda``'s own check keeps it in [−5, 0))."""
    x = _biased(g, dt_bias)
    if lower_bound is None:
        if A_log is None:
            raise ValueError("A_log must be given when lower_bound is None (the softplus gate)")
        y = -_rate(A_log, g.shape[-2], x.dtype) * F.softplus(x)
    else:
        if A_log is not None:
            x = x * _rate(A_log, g.shape[-2], x.dtype)
        y = float(lower_bound) * torch.sigmoid(x)
    return y.to(output_dtype)
