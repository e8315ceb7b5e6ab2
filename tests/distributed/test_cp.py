"""Whole-model context parallel on 2 gloo ranks (preset tiny, fp32) against one process: logits, loss and every
gradient (averaged over the cp ranks, as FSDP's mean reduction does), alone and with expert parallel over the same
ranks under full activation checkpointing; the bytes each forward moves; the ValueError cases on every rank (no
hang)."""

import copy
import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch._dynamo  # noqa: F401  (DTensor imports it on first use: once here, not after the fork in every rank)
import torch.distributed.tensor  # noqa: F401

from k3.config import K3Config
from k3.distributed.context_parallel import apply_context_parallel
from k3.distributed.expert_parallel import apply_expert_parallel
from k3.model import IGNORE_INDEX, K3ForCausalLM

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", pathlib.Path(__file__).with_name("_gloo.py"))
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)
run_ranks = _gloo.run_ranks

B, T = 2, 24


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _model() -> K3ForCausalLM:
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny"))
    with torch.no_grad():  # AttnRes pseudo-queries start at zero; make every path carry signal
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.5)
    return model.train()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (B, T), generator=g)
    labels = ids.clone()
    labels[0, 5] = labels[1, T // 2] = IGNORE_INDEX  # one ignored target inside a slice, one at the slice edge
    return ids, labels


def _compare(rank: int, world: int, ep: bool) -> None:
    ids, labels = _batch()
    ref = _model()
    out_ref = ref(ids, labels=labels)
    out_ref.loss.backward()
    model = copy.deepcopy(_model())
    if ep:  # with expert parallel also under activation checkpointing: the backward re-runs every collective
        model.gradient_checkpointing_enable("full")
    if ep:  # expert parallel over the same two ranks (each holds different tokens: its slices)
        from torch.distributed.device_mesh import init_device_mesh

        apply_expert_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    cp = apply_context_parallel(model, dist.group.WORLD)
    out = model(cp.shard(ids), labels=cp.shard(labels))
    b = dict(cp.bytes)  # the forward's (a checkpointed backward re-runs the collectives and adds to the counts)
    out.loss.backward()
    assert abs(out.loss.item() - out_ref.loss.item()) <= 1e-5 * abs(out_ref.loss.item())
    assert rel(out.logits, cp.shard(out_ref.logits)) <= 1e-5
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if ref_params[name].grad is None:  # unused by the model itself (layer 0's first AttnRes mix)
            assert p.grad is None, name
            continue
        want = ref_params[name].grad
        if hasattr(p.grad, "to_local"):  # an expert shard (experts [r·M, (r+1)·M)): its gradient already sums
            g = p.grad.to_local()        # every rank's tokens; FSDP divides it by the data × context size too
            M = g.shape[0]
            g, want = g / world, want[rank * M:(rank + 1) * M]
        else:
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= world  # FSDP's mean over the data × context ranks
        # 5e-5: the ranks sum each gradient over other token partitions in another order; the AttnRes mixes'
        # norm and pseudo-query gradients are sums that largely cancel (up to 1.6e-5 seen on one CPU type, ~5e-6
        # elsewhere), while a lost slice, halo or state would be off by O(1/world)
        assert rel(g, want) <= 5e-5, name
    if rank == 0:
        print(f"\ncp {world}{' × ep' if ep else ''}: bytes sent per rank per forward {b}")
    assert b["kda_states"] > 0 and b["mla_latents"] == B * (T // world) * 40 * 4 and b["conv_halos"] > 0
    # KDA traffic does not grow with T: the same model on a 3x longer sequence sends the same KDA bytes
    model(torch.randint(0, 256, (B, 3 * T // world)))
    assert cp.bytes["kda_states"] == b["kda_states"] and cp.bytes["conv_halos"] == b["conv_halos"]


def _cases(rank: int, world: int) -> None:
    _compare(rank, world, ep=False)
    _compare(rank, world, ep=True)
    model = _model()
    cp = apply_context_parallel(model, dist.group.WORLD)
    with pytest.raises(ValueError, match="--cp"):
        cp.shard(torch.zeros(1, 7))
    with pytest.raises(ValueError, match="one shape"):  # raised on every rank: nobody waits in a collective
        model(torch.zeros(1, 4 + rank, dtype=torch.long))
    with pytest.raises(ValueError, match="already"):
        apply_context_parallel(model, dist.group.WORLD)


def test_cp_whole_model_equals_one_process():
    ids, labels = _batch()
    _model()(ids, labels=labels).loss.backward()  # first call's lazy imports once here, not in every forked rank
    run_ranks(_cases, 2)
