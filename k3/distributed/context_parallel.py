"""Context parallel for the whole K3 model: each of W ranks holds an equal contiguous slice of every sequence.

``apply_context_parallel(model, cp_mesh)`` changes the model in place, from outside; afterwards it takes
``input_ids / labels [B, T/W]`` — this rank's slice ``[r·T/W, (r+1)·T/W)`` of every row (``ContextParallel.shard``)
— and every layer sees exactly what the one-process model computes for those positions:

- KDA layers: the short convolutions prepend a halo of the previous rank's last ``conv_size − 1`` inputs
  (``cp_conv_halo``: one all-gather of ``[3, B, H·K]`` per conv) and the recurrence runs with
  ``chunk_kda(..., cp_context=…)``: each rank summarises its slice as the affine map of the state (``[H, K, K+V]``
  fp32), one all-gather shares the summaries, each rank folds the earlier ranks' into its exact entry state.
  Bytes per layer and rank: ``H·K·(K+V)·4`` + the halos, independent of T.
- MLA layers: the small per-token latent ``c_kv ‖ k_pe`` (kv_lora + rope values) is all-gathered; rank r attends
  with its own queries over the latents of ranks 0…r (causal: queries sit at the last T/W of the (r+1)·T/W keys).
  The backward reduce-scatters the latents' gradients to their owners. Bytes: ``B·T/W·(kv_lora+rope)·itemsize``
  per rank, the one O(T) exchange of the model.
- AttnRes, norms, MLP and MoE are per token: nothing changes (expert parallel composes: its ranks hold different
  tokens, whatever slice they are).
- Loss: next-token targets cross the slice edge (the last position of rank r is scored on rank r+1's first label:
  one all-gather of ``[B]`` ids). ``output.loss`` is the mean over all non-ignored targets of all W ranks (the same
  value on every rank); its gradient is W · (local sum) / (global count), so that the usual MEAN reduction of
  gradients over the data × context ranks (FSDP over ``dp_shard_cp``) gives exactly the one-process gradient.
- Quantile Balancing: pass the group of every rank that sees different tokens (data × context) to
  ``model.qb_step``.

Host syncs per forward: one all-gather of ``(B, T/W)`` checks that the ranks agree (a mismatch raises
``ValueError`` on every rank instead of hanging), and the KDA op reads its headers. Decode states (``state=``) are
refused: context parallel is for training and long prefills.

Load balance: causal MLA gives rank r work ∝ r + 1 (the contiguous layout KDA needs rules out zig-zag
re-ordering); KDA layers are balanced.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import k3.ops.kda as kda_ops
from k3.distributed.comm import all_gather_rows, gather_tensor
from k3.layers.kda import KimiDeltaAttention
from k3.layers.mla import GatedMLA
from k3.model import IGNORE_INDEX
from k3.ops.kda import build_cp_context, cp_conv_halo
from k3.ops.mla import attention, expand_latent

__all__ = ["ContextParallel", "apply_context_parallel"]


class ContextParallel:
    """The handle of a context-parallel model: its group, this rank's slice, and the last forward's bytes."""

    def __init__(self, model: nn.Module, mesh_or_group: Any = None) -> None:
        if isinstance(mesh_or_group, DeviceMesh):
            if mesh_or_group.ndim != 1:
                raise ValueError(f"cp_mesh must be a 1-D DeviceMesh, got {mesh_or_group.ndim} dimensions")
            mesh_or_group = mesh_or_group.get_group()
        self.group = mesh_or_group if mesh_or_group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.model = model
        self.kda_context: Any = None
        self._contexts: dict[int, Any] = {}
        self.bytes: dict[str, int] = {}
        self.T_local = 0
        self.pending_labels: torch.Tensor | None = None  # taken by the model pre-hook, scored after the forward

    # --- slicing ---------------------------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous slice of ``x`` along ``dim`` (the sequence), which must divide by the group size."""
        T = x.shape[dim]
        if T % self.world:
            raise ValueError(f"--cp {self.world} must divide the sequence length ({T}): each rank holds an equal "
                             "contiguous slice")
        n = T // self.world
        return x.narrow(dim, self.rank * n, n)

    # --- per forward -------------------------------------------------------------------------------------------------
    def _begin(self, input_ids: torch.Tensor) -> None:
        """Check that every rank holds ``[B, T/W]`` of the same shape and build the KDA context of this length."""
        shape = torch.tensor(list(input_ids.shape), device=input_ids.device)
        every = gather_tensor(shape, self.group).tolist()
        if any(s != every[0] for s in every):
            raise ValueError(f"context parallel needs input_ids of one shape [B, T/cp] on every rank, got {every}")
        self.T_local = int(input_ids.shape[1])
        T = self.T_local * self.world
        if T not in self._contexts:
            cfg = self.model.config
            self._contexts[T] = build_cp_context(torch.tensor([0, T]), self.group,
                                                 conv1d_kernel_size=cfg.kda_conv_size)
        self.kda_context = self._contexts[T]
        self.bytes = {"kda_states": 0, "conv_halos": 0, "mla_latents": 0, "labels": 0}

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy over every non-ignored target of all W ranks (see the module docstring
        for its gradient scale). ``labels [B, T/W]``: this rank's slice of the (unshifted) labels."""
        B, T, V = logits.shape
        firsts = gather_tensor(labels[:, 0].contiguous(), self.group)  # [W, B]: each rank's first label
        self.bytes["labels"] = labels.shape[0] * labels.element_size()
        nxt = firsts[self.rank + 1] if self.rank + 1 < self.world else torch.full_like(firsts[0], IGNORE_INDEX)
        targets = torch.cat([labels[:, 1:], nxt[:, None]], 1).reshape(-1)
        local = F.cross_entropy(logits.reshape(-1, V).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        totals = torch.stack([local.detach(), (targets != IGNORE_INDEX).sum().to(local.dtype)])
        dist.all_reduce(totals, group=self.group)
        scaled = local * self.world
        return (scaled - scaled.detach() + totals[0]) / totals[1].clamp(min=1)


# ---------------------------------------------------------------------------------------------------- model hooks
def _pre_forward(cp: ContextParallel, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Model pre-hook: check the slice shapes, build the KDA context, and take the labels (the loss is computed
    after the forward, across ranks)."""
    bound = dict(zip(("input_ids", "labels", "state"), args))
    bound.update(kwargs)
    if bound.get("state") is not None:
        raise ValueError("context parallel runs training and prefill forwards without a decode state (state=…)")
    input_ids, labels = bound["input_ids"], bound.pop("labels", None)
    if labels is not None and (not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape):
        raise ValueError(f"labels must be a tensor shaped like input_ids {tuple(input_ids.shape)}")
    if labels is not None and bound.get("logits_to_keep"):
        raise ValueError("logits_to_keep: context parallel scores every position of the slice; pass 0 with labels")
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        cp._begin(input_ids)
    cp.pending_labels = labels
    return (), bound


def _post_forward(cp: ContextParallel, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    labels, cp.pending_labels = cp.pending_labels, None
    if labels is not None:
        output.loss = cp.loss(output.logits, labels)
    return output


def _conv_halo(cp: ContextParallel, conv: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """ShortConv pre-hook: the previous rank's last ``kernel − 1`` inputs become the convolution's tail."""
    x = args[0] if args else kwargs["x"]
    tail = args[1] if len(args) > 1 else kwargs.get("tail")
    if tail is not None:
        raise ValueError("context parallel runs without decode states: ShortConv got a tail")
    halo = cp_conv_halo(x.transpose(0, 1)[None], cp.kda_context, conv.kernel_size)[0].transpose(0, 1)
    cp.bytes["conv_halos"] += cp.kda_context.last_halo_bytes
    return (x, halo), {}


def _kda_core(cp: ContextParallel, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              f: torch.Tensor, b: torch.Tensor, S0: torch.Tensor | None, output_final_state: bool
              ) -> tuple[torch.Tensor, None]:
    """``KimiDeltaAttention._core`` under context parallel: the same chunked op and flags, with the context; one
    call per batch row (the op's context describes one packed stream)."""
    if S0 is not None or output_final_state:
        raise ValueError("context parallel runs without decode states")
    if layer.impl != "auto":
        raise ValueError(f"context parallel needs the chunked KDA op (impl 'auto'), got impl {layer.impl!r}")
    outs = []
    for i in range(q.shape[0]):
        o, _ = kda_ops.chunk_kda(
            q[i:i + 1], k[i:i + 1], v[i:i + 1], f[i:i + 1], b[i:i + 1], scale=layer.head_dim ** -0.5,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
            lower_bound=layer.lower_bound, A_log=layer.A_log, dt_bias=layer.dt_bias, cp_context=cp.kda_context)
        cp.bytes["kda_states"] += cp.kda_context.last_bytes_sent
        outs.append(o)
    return torch.cat(outs), None


def _mla_forward(cp: ContextParallel, layer: nn.Module, x: torch.Tensor, state: Any = None) -> torch.Tensor:
    """``GatedMLA.forward`` under context parallel: the queries of this slice over the latents of ranks 0…r, i.e.
    the T queries at the last T of the (r+1)·T keys (key j visible to query i iff j ≤ i + r·T)."""
    if state is not None:
        raise ValueError("context parallel runs without decode states")
    B, T, _ = x.shape
    H = layer.num_heads
    q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(B, T, H, layer.nope + layer.rope)
    lat = layer.latent(x)
    every = all_gather_rows(lat, cp.group)  # [W, B, T, c + r]
    cp.bytes["mla_latents"] += lat.numel() * lat.element_size()
    mine = every[:cp.rank + 1].permute(1, 0, 2, 3).reshape(B, (cp.rank + 1) * T, lat.shape[-1])
    k, v = expand_latent(mine, layer.kv_b_proj.weight, H, layer.nope, layer.v_dim)
    shift = torch.full((B,), cp.rank * T, dtype=torch.int32, device=x.device)
    o, _ = attention(q, k, v, layer.scale, shift)
    return layer.o_proj(o.reshape(B, T, H * layer.v_dim) * torch.sigmoid(layer.g_proj(x)))


def apply_context_parallel(model: nn.Module, cp_mesh: Any = None) -> ContextParallel:
    """Make ``model`` (a ``K3ForCausalLM``) context parallel over ``cp_mesh`` (a 1-D DeviceMesh or a process group;
    None = the world), in place. Returns the handle (``shard``, ``bytes``)."""
    if getattr(model, "context_parallel", None) is not None:
        raise ValueError("this model is already context parallel")
    cp = ContextParallel(model, cp_mesh)
    model.context_parallel = cp
    model.register_forward_pre_hook(functools.partial(_pre_forward, cp), with_kwargs=True)
    model.register_forward_hook(functools.partial(_post_forward, cp), with_kwargs=True)
    for m in model.modules():
        if isinstance(m, KimiDeltaAttention):
            for conv in (m.q_conv1d, m.k_conv1d, m.v_conv1d):
                conv.register_forward_pre_hook(functools.partial(_conv_halo, cp), with_kwargs=True)
            m._core = functools.partial(_kda_core, cp, m)
        elif isinstance(m, GatedMLA):
            m.forward = functools.partial(_mla_forward, cp, m)
    return cp
