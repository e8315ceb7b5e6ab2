"""Optimizers (AdamW; Muon with AdamW for the non-matrix parameters) and learning-rate schedules.

Muon (momentum orthogonalised by a Newton–Schulz iteration) updates every weight matrix — including the stacked
expert weights ``[E, F, ℓ]``, treated as E matrices — with ``O = NS5(nesterov momentum)``. The update is rescaled by
``0.2 · sqrt(max(rows, cols))`` so its RMS matches a typical AdamW update (the "Muon is scalable" recipe that Kimi's
optimizer builds on); one learning rate then serves both halves. Embeddings, the LM head, norms, gate constants,
convolution kernels and the AttnRes pseudo-queries go to AdamW.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from k3.distributed.master_weights import grad_of, has_masters, master_of, release_grads, sync_from_masters
from k3.model import keeps_fp32
from k3.ops.optim import adamw_master_step

__all__ = ["Muon", "MasterAdamW", "build_optimizer", "set_lr", "lr_factor", "newton_schulz", "SCHEDULES",
           "is_matrix", "clip_grad_norm", "clipped_step"]

SCHEDULES = ("cosine", "wsd", "constant")
_NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic iteration that pushes singular values towards ~1 in 5 steps
_NS_BATCH_ELEMENTS = 1 << 27  # matrices stacked per batched Newton–Schulz call (bounds its temporary memory)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """Approximately orthogonalise the trailing 2 dims of ``g`` ``[..., m, n]`` (≈ U Vᵀ of its SVD).

    The normalisation is fp32; the iteration runs in ``dtype`` (fp32, or bf16 on GPUs as in Muon's reference: the
    iteration is self-correcting and bf16 matmuls run ~10× faster). Returns ``dtype``."""
    if g.dim() < 2:
        raise ValueError(f"g must have at least 2 dims, got shape {tuple(g.shape)}")
    a, b, c = _NS_COEFFS
    x = g.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + eps)).to(dtype)  # spectral norm <= Frobenius norm <= 1
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: an FSDP/EP shard's local part, or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _weight(p: torch.Tensor) -> torch.Tensor:
    """What an update writes: the parameter's fp32 master (one GPU, bf16 compute), else its local part."""
    m = master_of(p)
    return m if m is not None else _local(p)


def _splits(pl: Any) -> bool:
    """Whether placement ``pl`` splits the tensor over its mesh dim (``Shard``, and the ``_StridedShard`` that FSDP
    puts over an expert-parallel ``Shard``, which does not report ``is_shard()``)."""
    return not (pl.is_replicate() or pl.is_partial())


def _needs_gather(p: torch.Tensor) -> bool:
    """Whether ``p``'s local part is not made of whole matrices: a DTensor cut along one of its trailing two dims
    (or along dim 0 of a 2-D matrix) over more than one rank. Stacked experts sharded along the expert dim, and
    any shard on a one-rank mesh, are orthogonalised as they are."""
    if not isinstance(p, DTensor):
        return False
    for i, pl in enumerate(p.placements):
        if _splits(pl) and p.device_mesh.size(i) > 1 and not (p.dim() == 3 and pl.dim == 0):
            return True
    return False


def _orthogonalise(params: list[torch.Tensor], looks: list[torch.Tensor], steps: int, dtype: torch.dtype
                   ) -> list[torch.Tensor]:
    """``NS(look)`` per parameter, as this rank's local part (fp32). ``looks``: the local parts of the momentum
    look-ahead, laid out like ``params``.

    A matrix cut across ranks is gathered whole (``full_tensor``), orthogonalised, and this rank's shard taken back
    (``distribute_tensor`` with no source rank slices locally): the same update as one process. Matrices of one
    shape are stacked and orthogonalised in one batched call."""
    gathered = [_needs_gather(p) for p in params]
    mats = [DTensor.from_local(look, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            if g else look for p, look, g in zip(params, looks, gathered)]
    out: list[torch.Tensor | None] = [None] * len(looks)
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(mats):
        by_shape.setdefault(tuple(m.shape[-2:]), []).append(i)
    for shape, idx in by_shape.items():
        per = max(1, _NS_BATCH_ELEMENTS // (shape[0] * shape[1]))
        flat = [(i, mats[i].reshape(-1, *shape)) for i in idx]
        stack = torch.cat([m for _, m in flat]) if len(flat) > 1 else flat[0][1]
        ortho = torch.cat([newton_schulz(stack[j:j + per], steps, dtype=dtype).float()
                           for j in range(0, stack.shape[0], per)]) if stack.shape[0] else stack.float()
        offset = 0
        for i, m in flat:
            out[i] = ortho[offset:offset + m.shape[0]].view(mats[i].shape)
            offset += m.shape[0]
    for i, p in enumerate(params):
        if gathered[i]:
            out[i] = distribute_tensor(out[i], p.device_mesh, p.placements, src_data_rank=None).to_local()
    return out  # type: ignore[return-value]


def _closure_loss(closure: Any) -> Any:
    """torch's optimizer contract: a given closure re-evaluates the loss, with gradients on, before the step."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _Fp32State:
    """Optimizer state stays fp32 beside bf16 parameters through ``load_state_dict`` (torch casts every floating
    state tensor but ``step`` to its parameter's dtype there): the moments of a parameter with an fp32 master are
    taken back from the state dict as they were saved."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        for i, p in zip(ids, params):
            if master_of(p) is None:
                continue
            for k, v in saved.get(i, {}).items():
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                    self.state[p][k] = v.to(device=_local(p).device, dtype=torch.float32)  # type: ignore[attr-defined]


class Muon(_Fp32State, torch.optim.Optimizer):
    """Muon for groups with ``use_muon=True``; AdamW (decoupled weight decay) for the others.

    Works on plain tensors and on FSDP2/EP DTensor shards alike: momentum and AdamW state live in each parameter's
    layout, updates are ``torch._foreach_*`` over the local shards, and Newton–Schulz sees whole matrices.
    ``ns_dtype``: the iteration's dtype (None: bf16 on CUDA, fp32 elsewhere).
    """

    def __init__(self, params: Iterable[dict], lr: float = 1e-3, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 ns_steps: int = 5, ns_dtype: torch.dtype | None = None) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        defaults = dict(lr=lr, momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay,
                        ns_steps=ns_steps, use_muon=False)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = _closure_loss(closure)
        for group in self.param_groups:
            (self._muon if group["use_muon"] else self._adamw)(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        params = [p for p in group["params"] if grad_of(p) is not None]
        if not params:
            return
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        # everything on the local shards: one foreach kernel per op, no DTensor dispatch per parameter
        grads = [_local(grad_of(p)).float() for p in params]
        bufs = [_local(self.state[p]["momentum_buffer"]) for p in params]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        looks = torch._foreach_add(grads, bufs, alpha=mu)  # Nesterov look-ahead
        dtype = self.ns_dtype or (torch.bfloat16 if params[0].is_cuda else torch.float32)
        updates = _orthogonalise(params, looks, group["ns_steps"], dtype)
        # the update's RMS matched to AdamW's: 0.2·sqrt(max(rows, cols)) of the full matrix
        torch._foreach_mul_(updates, [-0.2 * math.sqrt(max(p.shape[-2], p.shape[-1])) for p in params])
        torch._foreach_mul_(updates, lr)
        local = [_weight(p) for p in params]
        torch._foreach_mul_(local, 1 - lr * wd)
        torch._foreach_add_(local, [u.to(x.dtype) for u, x in zip(updates, local)])
        sync_from_masters(params)
        release_grads(params)

    def _adamw(self, group: dict) -> None:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        params = [p for p in group["params"] if grad_of(p) is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            dev = _local(p).device
            if "step" not in state:
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            # per parameter, on its device: the bias corrections are device math (no host read, so a CUDA graph
            # replays them), and a parameter that missed steps keeps its own count
            if "step" not in state or state["step"].device != dev:
                state["step"] = torch.as_tensor(state.get("step", 0.0), dtype=torch.float32).to(dev)
        steps = [self.state[p]["step"] for p in params]
        P = [_weight(p) for p in params]
        G = [_local(grad_of(p)).float() for p in params]
        M = [_local(self.state[p]["exp_avg"]) for p in params]
        V = [_local(self.state[p]["exp_avg_sq"]) for p in params]
        torch._foreach_add_(steps, 1.0)
        bc1 = torch._foreach_pow(b1, steps)  # 1 − β^t, per parameter
        bc2 = torch._foreach_pow(b2, steps)
        for bc in (bc1, bc2):
            torch._foreach_neg_(bc)
            torch._foreach_add_(bc, 1.0)
        torch._foreach_lerp_(M, G, 1 - b1)
        torch._foreach_mul_(V, b2)
        torch._foreach_addcmul_(V, G, G, value=1 - b2)
        denom = torch._foreach_div(V, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        torch._foreach_mul_(P, 1 - lr * wd)
        upd = torch._foreach_div(M, bc1)
        torch._foreach_div_(upd, denom)
        torch._foreach_mul_(upd, -lr)
        torch._foreach_add_(P, [u.to(x.dtype) for u, x in zip(upd, P)])
        sync_from_masters(params)
        release_grads(params)


class MasterAdamW(_Fp32State, torch.optim.AdamW):
    """torch's AdamW — its groups, options, state names and checkpoints — stepping each parameter's fp32 master and
    writing the parameter's bf16 copy in one pass (``k3.ops.optim.adamw_master_step``), from the bf16 gradient or
    the fp32 micro-batch sum (``k3.distributed.master_weights``). Parameters without a master (kept in fp32) are
    updated in place. ``grad_scale`` (set by :func:`clipped_step`) divides every gradient as it is read."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = _closure_loss(closure)
        scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if grad_of(p) is not None]
            for p in params:
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            if not params:
                continue
            torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)
            b1, b2 = group["betas"]
            for p in params:
                state, m = self.state[p], master_of(p)
                adamw_master_step(m if m is not None else p, p if m is not None else None, grad_of(p),
                                  state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"], b1, b2,
                                  group["eps"], group["weight_decay"], scale)
            release_grads(params)
        return loss


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping."""
    return _clip(params, max_norm, scale=True)[0]


def _clip(params: Iterable[torch.Tensor], max_norm: float, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients' global L2 norm and the clip coefficient ``min(1, max_norm / (norm + 1e-6))`` (0-dim tensors
    on the device); ``scale`` multiplies every gradient by the coefficient in place.

    Plain gradients (on one device; a bf16 parameter's fp32 micro-batch sum where it has one): one fp32 norm.
    DTensor gradients (FSDP2 / expert parallel, possibly on different meshes): each rank sums the squares of its
    local shards, each divided by how many ranks hold a copy of that shard, and one all-reduce over the world gives
    the exact global sum.
    """
    grads = [g for p in params if (g := grad_of(p)) is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        total = _total_norm(grads)
        coef = _coefficient(total, max_norm)
        if scale and grads:
            torch._foreach_mul_(grads, coef)
        return total, coef
    world = dist.get_world_size()
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        copies = world  # a plain tensor: every rank holds the same one
        if isinstance(g, DTensor):  # ranks outside its mesh hold copies, and so do the mesh dims it is replicated on
            mesh = g.device_mesh
            copies = world // mesh.size() * math.prod(mesh.size(i) for i, pl in enumerate(g.placements)
                                                       if not _splits(pl))
        by_copies.setdefault(copies, []).append(_local(g))
    local = [g for gs in by_copies.values() for g in gs]
    dev = local[0].device
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for copies, gs in by_copies.items():
        norms = torch._foreach_norm([g.float() for g in gs])
        sq += torch.stack(norms).pow(2).sum() / copies
    dist.all_reduce(sq)
    total = sq.sqrt()
    coef = _coefficient(total, max_norm)
    if scale:
        torch._foreach_mul_(local, coef)
    return total, coef


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of plain gradients on one device, accumulated in fp32 whatever their dtype (bf16
    gradients' per-tensor norms would otherwise be rounded to bf16)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    norms = [n for gs in by_dtype.values() for n in torch._foreach_norm(gs, 2.0, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms))


def _coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip coefficient (``clip_grads_with_norm_``'s): ``min(1, max_norm / (norm + 1e-6))``."""
    return (max_norm / (total + 1e-6)).clamp(max=1.0)


def _takes_grad_scale(opt: torch.optim.Optimizer) -> bool:
    """torch's fused AdamW on every group, or ours: its kernel can divide each gradient by a device scalar as it
    reads it."""
    return isinstance(opt, MasterAdamW) or (isinstance(opt, torch.optim.AdamW)
                                            and all(g.get("fused") for g in opt.param_groups))


@torch.no_grad()
def clipped_step(opt: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients' global norm to ``max_norm``, then ``opt.step()``; returns the norm before clipping.

    With torch's fused AdamW or :class:`MasterAdamW` the clip rides in the step: the optimizer's ``grad_scale``
    (GradScaler's hook, a divisor) is set to ``1 / coefficient``, so the fused kernel scales each gradient as it
    reads it (torch's also writes the clipped gradient back, as a separate scaling pass would leave it) instead of a
    pass of its own over every gradient before the step. Other optimizers get the scaled gradients."""
    fold = _takes_grad_scale(opt)
    total, coef = _clip(list(params), max_norm, scale=not fold)
    if not fold:
        opt.step()
        return total
    opt.grad_scale = coef.reciprocal()  # type: ignore[attr-defined]
    try:
        opt.step()
    finally:
        opt.grad_scale = None  # type: ignore[attr-defined]
    return total


def _groups(model: torch.nn.Module, weight_decay: float, split_muon: bool) -> list[dict]:
    """Parameter groups: (Muon matrices), AdamW with decay (≥2-D), AdamW without decay (vectors, norms, gates) —
    each split by where the parameter lives under FSDP2: the stacked routed experts (their own mesh under expert
    parallel), the parameters K3 keeps in fp32 (replicated plain tensors beside the shards), and the rest. torch's
    fused AdamW refuses plain tensors and DTensors, or two meshes, in one group. The split goes by parameter name, so
    the groups are the same on every layout and an optimizer state saved on one layout loads on another."""
    kinds = ("muon", "adamw_decay", "adamw_no_decay")
    parts: dict[tuple[str, str], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if split_muon and is_matrix(name, p):
            kind = "muon"
        elif p.dim() >= 2 and min(p.shape[-2:]) > 1:
            kind = "adamw_decay"
        else:
            kind = "adamw_no_decay"
        where = "fp32" if keeps_fp32(name) else "experts" if ".experts." in name else ""
        parts.setdefault((kind, where), []).append(p)
    groups = []
    for kind in kinds:
        for where in ("", "experts", "fp32"):
            params = parts.get((kind, where))
            if params:
                g = {"params": params, "weight_decay": 0.0 if kind == "adamw_no_decay" else weight_decay,
                     "name": kind + (f"_{where}" if where else "")}
                if kind == "muon":
                    g["use_muon"] = True
                groups.append(g)
    return groups


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), capturable: bool = False) -> torch.optim.Optimizer:
    """``name``: ``"adamw"`` (torch's AdamW: fused on CUDA) or ``"muon"`` (our Muon + AdamW). Every group remembers
    its base lr (``base_lr``); :func:`set_lr` applies a schedule.

    ``capturable``: the step can be captured in a CUDA graph (``k3.train.graph``) — each group's lr is a 0-dim fp32
    tensor on the parameters' device, updated in place by :func:`set_lr`, and AdamW keeps its step counts there too.
    ``state_dict()`` still holds plain-float lrs, so checkpoints are the same either way."""
    if name not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be 'adamw' or 'muon', got {name!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    groups = _groups(model, weight_decay, split_muon=name == "muon")
    device = _local(next(model.parameters())).device
    if capturable:
        for g in groups:  # one tensor per group: set_lr writes each in place, the captured graph reads it
            g["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
    if name == "muon":
        opt: torch.optim.Optimizer = Muon(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    else:
        cuda = device.type == "cuda"
        # bf16 parameters with fp32 masters (one GPU): the same AdamW, stepping the masters (fused options kept,
        # so its checkpoints and FSDP2's fused AdamW's hold the same groups)
        cls = MasterAdamW if has_masters(list(model.parameters())) else torch.optim.AdamW
        opt = cls(groups, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False,
                  fused=True if cuda else None, capturable=capturable)
    for g in opt.param_groups:
        g["base_lr"] = float(lr)
    if capturable:
        _keep_lr_tensors(opt)
    return opt


def _keep_lr_tensors(opt: torch.optim.Optimizer) -> None:
    """Saved state holds float lrs; a loaded state writes its lrs into the groups' tensors (the objects a captured
    graph reads) instead of replacing them."""
    tensors = [g["lr"] for g in opt.param_groups]

    def to_floats(_opt: torch.optim.Optimizer, sd: dict) -> dict:
        for g in sd["param_groups"]:
            if isinstance(g.get("lr"), torch.Tensor):
                g["lr"] = float(g["lr"])
        return sd

    def to_tensors(_opt: torch.optim.Optimizer) -> None:
        for g, t in zip(opt.param_groups, tensors):
            if g["lr"] is not t:
                t.fill_(float(g["lr"]))
                g["lr"] = t

    opt.register_state_dict_post_hook(to_floats)
    opt.register_load_state_dict_post_hook(to_tensors)


def set_lr(opt: torch.optim.Optimizer, factor: float) -> float:
    """Set every group's lr to ``base_lr · factor`` (in place for the tensors of a capturable optimizer); returns
    the first group's value."""
    value = 0.0
    for i, g in enumerate(opt.param_groups):
        lr = g["base_lr"] * factor
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr
        if i == 0:
            value = lr
    return value


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
