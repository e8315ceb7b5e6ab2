"""Optimizers (AdamW; Muon with AdamW for the non-matrix parameters) and learning-rate schedules.

Muon (momentum orthogonalised by a Newton–Schulz iteration) updates every weight matrix — including the stacked
expert weights ``[E, F, ℓ]``, treated as E matrices — with ``O = NS5(nesterov momentum)``. The update is rescaled by
``0.2 · sqrt(max(rows, cols))`` so its RMS matches a typical AdamW update (the "Muon is scalable" recipe that Kimi's
optimizer builds on); one learning rate then serves both halves. Embeddings, the LM head, norms, gate constants,
convolution kernels and the AttnRes pseudo-queries go to AdamW.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

__all__ = ["Muon", "build_optimizer", "lr_factor", "newton_schulz", "SCHEDULES", "is_matrix"]

SCHEDULES = ("cosine", "wsd", "constant")
_NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic iteration that pushes singular values towards ~1 in 5 steps


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise the trailing 2 dims of ``g`` ``[..., m, n]`` (≈ U Vᵀ of its SVD), in fp32."""
    if g.dim() < 2:
        raise ValueError(f"g must have at least 2 dims, got shape {tuple(g.shape)}")
    a, b, c = _NS_COEFFS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.mT if tall else x


def is_matrix(name: str, p: torch.Tensor) -> bool:
    """Parameters Muon orthogonalises: weight matrices and stacked expert matrices, not embeddings or the head."""
    if "embed_tokens" in name or "lm_head" in name:
        return False
    if p.dim() == 2:
        return min(p.shape) > 1  # [1, d] AttnRes pseudo-query projections are vectors
    return p.dim() == 3 and name.rsplit(".", 1)[-1] in ("w1", "w2", "w3")


class Muon(torch.optim.Optimizer):
    """Muon for groups with ``use_muon=True``; AdamW (decoupled weight decay) for the others."""

    def __init__(self, params: Iterable[dict], lr: float = 1e-3, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 ns_steps: int = 5) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        defaults = dict(lr=lr, momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay,
                        ns_steps=ns_steps, use_muon=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon if group["use_muon"] else self._adamw)(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            buf = state["momentum_buffer"]
            g = p.grad.float()
            buf.mul_(mu).add_(g)
            o = newton_schulz(g.add(buf, alpha=mu), group["ns_steps"])  # Nesterov look-ahead
            scale = 0.2 * math.sqrt(max(p.shape[-2], p.shape[-1]))
            p.mul_(1 - lr * wd)
            p.add_(o.to(p.dtype), alpha=-lr * scale)

    def _adamw(self, group: dict) -> None:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            t = float(state["step"])
            g = p.grad.float()
            state["exp_avg"].lerp_(g, 1 - b1)
            state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(eps)
            p.mul_(1 - lr * wd)
            p.add_((state["exp_avg"] / (1 - b1**t) / denom).to(p.dtype), alpha=-lr)


def _groups(model: torch.nn.Module, weight_decay: float, split_muon: bool) -> list[dict]:
    """Parameter groups: (Muon matrices), AdamW with decay (≥2-D), AdamW without decay (vectors, norms, gates)."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if split_muon and is_matrix(name, p):
            muon.append(p)
        elif p.dim() >= 2 and min(p.shape[-2:]) > 1:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "adamw_decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "adamw_no_decay"}]
    if split_muon:
        groups.insert(0, {"params": muon, "weight_decay": weight_decay, "use_muon": True, "name": "muon"})
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.Optimizer:
    """``name``: ``"adamw"`` (torch's AdamW) or ``"muon"`` (our Muon + AdamW). Every group remembers its base lr."""
    if name not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be 'adamw' or 'muon', got {name!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    groups = _groups(model, weight_decay, split_muon=name == "muon")
    if name == "muon":
        opt: torch.optim.Optimizer = Muon(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    else:
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False)
    for g in opt.param_groups:
        g["base_lr"] = lr
    return opt


def lr_factor(step: int, total: int, warmup: int, schedule: str = "cosine", min_ratio: float = 0.1,
              decay_fraction: float = 0.2) -> float:
    """Multiplier of the base lr at 0-based ``step`` of ``total``.

    Linear warmup over ``warmup`` steps, then ``cosine`` (to ``min_ratio`` at the last step), ``wsd``
    (warmup-stable-decay: flat, then linear to ``min_ratio`` over the last ``decay_fraction`` of the steps) or
    ``constant``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if total <= 0 or warmup < 0:
        raise ValueError(f"total must be > 0 and warmup >= 0, got total={total}, warmup={warmup}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    last = max(total - 1, 1)
    if schedule == "cosine":
        span = max(last - warmup, 1)
        t = min(max(step - warmup, 0) / span, 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    decay_start = max(warmup, int(total * (1 - decay_fraction)))
    if step < decay_start:
        return 1.0
    t = min((step - decay_start) / max(last - decay_start, 1), 1.0)
    return 1.0 - (1 - min_ratio) * t
