"""``parallelize_k3``: turn the single-device ``K3ForCausalLM`` into the distributed one, from outside.

The order is torchtitan's: expert parallel (the MoE layers' experts split over ``mesh["ep"]``), context parallel
(KDA ``cp_context`` and the MLA latent all-gather over ``mesh["cp"]``), activation checkpointing (a policy per
decoder layer), ``torch.compile`` of each decoder layer's two sublayers (regional), then FSDP2:
``fully_shard`` per decoder layer and once at the root, over ``mesh["fsdp"]`` (HSDP when dp_replicate > 1), with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the optimizer sees fp32 master weights and fp32
gradients, the forward and backward run on bf16 copies that FSDP casts once per layer and step — no per-op casts.

One GPU with bf16 compute (a world-size-1 process group) takes the same policy without FSDP: there FSDP's unshard
would be a cast and two copies of every weight and its reduce-scatter a cast of every gradient, moving nothing
between ranks. The parameters become the bf16 compute weights and keep their fp32 masters beside them
(``k3.distributed.master_weights``), which the optimizer updates and rounds back in one pass. A one-rank group
with fp32 compute keeps FSDP (its reduce-scatter the gradients' copy-in alone, see ``OneRankReduceScatter``), and a
single CPU process (``mesh is None``) the plain fp32 module: no process group, nothing to shard.

Parameters that K3 keeps in fp32 (``k3.model.keeps_fp32``: KDA's ``A_log``, ``dt_bias``, short-conv kernels and
``o_norm``) are left out of FSDP (``ignored_params``): a bf16 copy would round the gate constants. They are tiny and
replicated; :func:`sync_replicated_grads` averages their gradients over the data ranks once per optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from k3.distributed.context_parallel import apply_context_parallel
from k3.distributed.expert_parallel import apply_expert_parallel
from k3.distributed.master_weights import apply_master_weights
from k3.distributed.parallel_dims import ParallelDims, ParallelMesh
from k3.model import AC_POLICIES, keeps_fp32

__all__ = ["AC_POLICIES", "ParallelModel", "parallelize_k3", "sync_replicated_grads", "replicated_params"]

EXPERTS_AC_WITH_EP = ("--activation-checkpointing experts recomputes the routed experts inside the MoE layer; with "
                      "--ep > 1 they run behind an all-to-all that would run again in the backward: use full or "
                      "selective")


@dataclass
class ParallelModel:
    """What ``parallelize_k3`` did to a model (kept on the model as ``model.parallel``)."""

    dims: ParallelDims
    mesh: ParallelMesh | None
    param_dtype: torch.dtype | None
    replicated: list[nn.Parameter] = field(default_factory=list)  # outside FSDP: grads averaged by hand
    fsdp: bool = False
    master_weights: bool = False  # one rank: bf16 parameters, fp32 masters beside them (no FSDP)
    compiled: bool = False


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters K3 keeps in fp32 (never cast to a bf16 compute copy)."""
    return [p for n, p in model.named_parameters() if keeps_fp32(n)]


def parallelize_k3(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh | None = None, *,
                   compile: bool | str = False, activation_checkpointing: str = "none",
                   mixed_precision: torch.dtype | None = None) -> nn.Module:
    """Apply expert/context parallel, activation checkpointing, regional compile and FSDP2 to ``model`` in place (on
    a one-rank group with low-precision compute, master weights instead of FSDP2: see the module docstring).

    ``model``: a ``K3ForCausalLM`` in fp32 (the master weights) on this rank's device, the same initial weights on
    every rank. ``mesh``: ``dims.build_mesh(device_type)``, or None for a single process without a process group
    (then only checkpointing and compile apply). ``mixed_precision``: the compute dtype (bf16 on CUDA) or None
    (fp32 compute, CPU). ``compile``: True (inductor) or a ``torch.compile`` backend name. Returns ``model`` (its
    parameters become DTensor shards when sharded, bf16 weights with fp32 masters on one GPU).
    """
    if activation_checkpointing not in AC_POLICIES:
        raise ValueError(f"activation_checkpointing must be one of {AC_POLICIES}, got {activation_checkpointing!r}")
    if activation_checkpointing == "experts" and dims.ep > 1:
        raise ValueError(EXPERTS_AC_WITH_EP)
    if mesh is None and dims.world_size > 1:
        raise ValueError(f"a {dims.world_size}-rank layout needs its mesh: pass dims.build_mesh(device_type)")
    state = ParallelModel(dims=dims, mesh=mesh, param_dtype=mixed_precision)
    if dims.ep > 1:
        apply_expert_parallel(model, mesh["ep"])
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"])
    if activation_checkpointing != "none":
        model.gradient_checkpointing_enable(activation_checkpointing)
    if compile:
        _compile_layers(model, "inductor" if compile is True else compile)
        state.compiled = True
    if mesh is not None and dims.world_size == 1 and mixed_precision not in (None, torch.float32):
        apply_master_weights(model, mixed_precision)  # FSDP2's one-rank gather and reduce would only copy
        state.master_weights = True
    elif mesh is not None:
        state.replicated = replicated_params(model)
        _apply_fsdp(model, dims, mesh, mixed_precision, state.replicated)
        state.fsdp = True
    model.parallel = state
    return model


def _compile_layers(model: nn.Module, backend: str) -> None:
    """``torch.compile`` the two sublayers of every decoder layer in place (``Module.compile``: module names and
    state-dict keys unchanged; FSDP's hooks, registered on the decoder layers, stay outside the compiled regions).

    Regional, at the sublayer: every KDA, MLA, MoE and MLP sublayer of the model runs the same code on same-shaped
    parameters, so the whole model compiles into about four graphs (shared by the layers of a kind), where whole
    decoder layers differ by their AttnRes block bookkeeping and would compile once each. Between the sublayers run
    the AttnRes mixes and norms, fused ops of their own."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    for layer in model.model.layers:
        layer.self_attn.compile(backend=backend)
        layer.ffn.compile(backend=backend)


class OneRankReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter when the group is one rank, where nothing is reduced.

    FSDP then asks this object for the flat input buffer (which it fills with the layer's gradients, cast to the
    reduce dtype), asks for an output buffer of the same size, and copies the one into the other; the sharded
    gradients are views of the output. Handing it the input buffer again as the output turns that copy into a
    self-copy, which ``Tensor.copy_`` skips: each layer's flat gradient is written once instead of twice (one fp32
    copy of every parameter a step) and one buffer is held instead of two. Never called to communicate."""

    def __init__(self) -> None:
        self._input: torch.Tensor | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # noqa: ANN001
        buf, self._input = self._input, None
        if buf is not None and buf.dtype == dtype and buf.device == device and buf.numel() == math.prod(size):
            return buf.view(*size)  # the output request that follows an input of its size
        self._input = torch.empty(*size, dtype=dtype, device=device)
        return self._input

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN204
        raise RuntimeError("a one-rank FSDP group copies its gradients instead of reducing them")


def _apply_fsdp(model: nn.Module, dims: ParallelDims, mesh: ParallelMesh, param_dtype: torch.dtype | None,
                ignored: list[nn.Parameter]) -> None:
    # No input casting: activations are bf16 already (the embedding is), and a decode state passed to the forward
    # (fp32 KDA states, updated in place) must reach the layers as it is, not as a cast copy.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    ignored_set = set(ignored)
    # One rank holds everything anyway: keep the bf16 copies from forward to backward instead of casting twice.
    last = len(model.model.layers) - 1
    common: dict[str, Any] = dict(mesh=mesh["fsdp"], mp_policy=mp, ignored_params=ignored_set)
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if dims.ep > 1 and moe is not None:
            experts = fully_shard(moe.experts, mesh=mesh["expert_fsdp"], mp_policy=mp,
                                  reshard_after_forward=dims.world_size > 1, ignored_params=ignored_set)
            # expert gradients arrive summed over the ep ranks by the all-to-all's backward: divide by every data
            # rank, not only the expert-FSDP ones, to get the global batch's mean
            experts.set_gradient_divide_factor(float(dims.dp_cp))
            # gloo has no PREMUL_SUM for the experts' reduce-scatter: sum, then divide. Only when that reduce-scatter
            # runs over more than one rank: over one, torch skips it and would divide twice.
            if mesh["expert_fsdp"].device_type == "cpu" and dims.dp_shard_mod_ep > 1:
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, reshard_after_forward=dims.world_size > 1 and i < last, **common)
    fully_shard(model, reshard_after_forward=False, **common)
    if dims.world_size == 1:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(OneRankReduceScatter())


@torch.no_grad()
def sync_replicated_grads(model: nn.Module) -> None:
    """Average the gradients of the parameters outside FSDP over the ranks that saw different tokens (one packed
    all-reduce; call once per optimizer step, after the last micro-batch's backward, on every rank)."""
    state: ParallelModel | None = getattr(model, "parallel", None)
    if state is None or state.mesh is None or not state.replicated or state.dims.dp_cp == 1:
        return
    # which parameters have a gradient is fixed by the model's structure: the same list on every rank
    params = [p for p in state.replicated if p.grad is not None]
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1).float() for p in params])
    dist.all_reduce(flat, group=state.mesh.group("dp_cp"))
    flat /= state.dims.dp_cp
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n
