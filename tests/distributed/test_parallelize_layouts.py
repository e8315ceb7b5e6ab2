"""``parallelize_k3`` over every kind of layout on 4 gloo ranks (preset tiny, fp32): one forward + backward of each
rank's part of a global batch, with the trainer's loss scaling, gives every parameter the one-process gradient,
and the clipped norm is the one-process norm — FSDP, HSDP, expert parallel (its experts FSDP-sharded over what
is left, including HSDP), context parallel, and expert × context parallel."""

import copy
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from k3.config import K3Config
from k3.distributed.data_parallel import Distributed, local_batch
from k3.distributed.parallel_dims import ParallelDims
from k3.distributed.parallelize import parallelize_k3, sync_replicated_grads
from k3.model import K3ForCausalLM
from k3.train.optim import build_optimizer, clip_grad_norm

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", Path(__file__).with_name("_gloo.py"))
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)

LAYOUTS = [dict(), dict(dp_replicate=2), dict(ep=2), dict(ep=4), dict(dp_replicate=2, ep=2), dict(cp=2, ep=2)]


def _layouts(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ref = K3ForCausalLM(K3Config.from_preset("tiny")).float()
    t = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = t[:, :-1], t[:, 1:]
    ref(x, targets=y).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    for kw in LAYOUTS:
        dims = ParallelDims(world_size=world, **kw)
        mesh = dims.build_mesh("cpu")
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        parallelize_k3(model, dims, mesh)
        d = Distributed(dims=dims, device=torch.device("cpu"), mesh=mesh, rank=rank)
        xl, yl = local_batch(x, d), local_batch(y, d)
        n = (yl != -100).sum().float()
        n_all = n.clone()
        dist.all_reduce(n_all, group=mesh.group("dp_cp"))
        (model(xl, targets=yl).loss * n * dims.dp_cp / n_all).backward()
        sync_replicated_grads(model)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            assert (g is None) == (q.grad is None), (kw, name)
            if g is not None:
                err = float((g - q.grad).norm() / q.grad.norm().clamp(min=1e-12))
                assert err < 1e-4, (kw, name, err)
        got = clip_grad_norm(model.parameters(), 1e9)
        assert abs(float(got) - float(want)) < 1e-5 * float(want), (kw, float(got), float(want))
    dist.barrier()


def test_every_layout_gives_the_one_process_gradients_and_norm() -> None:
    _gloo.run_ranks(_layouts, 4)


def _fused_adamw_one_rank(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny")).float()
    dims = ParallelDims(world_size=world)
    parallelize_k3(model, dims, dims.build_mesh("cpu"))
    groups = build_optimizer(model, "adamw", 1e-3).param_groups
    kinds = [{type(p) for p in g["params"]} for g in groups]
    assert all(len(k) == 1 for k in kinds), kinds  # one layout per group: FSDP shards and replicated fp32 apart
    assert {DTensor, torch.nn.Parameter} <= set().union(*kinds), kinds
    opt = torch.optim.AdamW(groups, fused=True)  # the CUDA trainer's optimizer; torch's fused AdamW runs on CPU too
    t = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    model(t[:, :-1], targets=t[:, 1:]).loss.backward()
    before = [p.detach().clone() for g in groups for p in g["params"]]
    opt.step()
    after = [p.detach() for g in groups for p in g["params"]]
    assert all(not torch.equal(a, b) for a, b in zip(after, before) if a.requires_grad)


def test_fused_adamw_steps_fsdp_shards_and_replicated_params_together() -> None:
    """One rank under FSDP2, as the trainer runs on one GPU: the parameters kept fp32 outside FSDP are plain tensors
    beside DTensor shards, and torch's fused AdamW refuses the two in one group."""
    _gloo.run_ranks(_fused_adamw_one_rank, 1)
