"""``parallelize_k3`` over every kind of layout on 4 gloo ranks (preset tiny, fp32): one forward + backward of each
rank's part of a global batch, with the trainer's loss scaling, gives every parameter the one-process gradient,
and the clipped norm is the one-process norm — FSDP, HSDP, expert parallel (its experts FSDP-sharded over what
is left, including HSDP), context parallel, and expert × context parallel."""

import copy
import functools
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from k3.config import K3Config
from k3.distributed.data_parallel import Distributed, local_batch
from k3.distributed.parallel_dims import ParallelDims
from k3.distributed.parallelize import parallelize_k3, sync_replicated_grads
from k3.model import K3ForCausalLM
from k3.train.optim import build_optimizer, clip_grad_norm, clipped_step

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


def _fused_adamw(rank: int, world: int, layout: dict) -> None:
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny")).float()
    dims = ParallelDims(world_size=world, **layout)
    parallelize_k3(model, dims, dims.build_mesh("cpu"))
    groups = build_optimizer(model, "adamw", 1e-3).param_groups
    layouts = [{(type(p), getattr(p, "device_mesh", None)) for p in g["params"]} for g in groups]
    assert all(len(k) == 1 for k in layouts), layouts  # one tensor type and mesh per group
    assert DTensor in {t for k in layouts for t, _ in k} and torch.nn.Parameter in {t for k in layouts for t, _ in k}
    # the CUDA trainer's optimizer; torch's fused AdamW runs on CPU too. The groups carry the CPU build's own
    # fused / foreach settings, which would override the constructor's: drop them
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in groups]
    opt = torch.optim.AdamW(groups, fused=True)
    assert all(g["fused"] for g in opt.param_groups)
    t = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1 + rank))
    model(t[:, :-1], targets=t[:, 1:]).loss.backward()
    local = [(p, g["weight_decay"]) for g in groups for p in g["params"]]
    lo = [p.to_local() if isinstance(p, DTensor) else p for p, _ in local]
    # Adam's first step: m̂ = g, v̂ = g², so p ← p·(1 − lr·wd) − lr·g / (|g| + eps)
    want = []
    for (p, wd), x in zip(local, lo):
        gr = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        want.append(x.detach().clone() if gr is None else x.detach() * (1 - 1e-3 * wd) - 1e-3 * gr / (gr.abs() + 1e-8))
    opt.step()
    for x, w in zip(lo, want):
        torch.testing.assert_close(x.detach(), w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, {"ep": 2})], ids=["one-rank", "ep2"])
def test_fused_adamw_steps_every_group_of_a_sharded_model(world: int, layout: dict) -> None:
    """Under FSDP2 the parameters kept fp32 are plain tensors beside DTensor shards, and under expert parallel the
    experts live on their own mesh; torch's fused AdamW refuses either mix in one group."""
    _gloo.run_ranks(_fused_adamw, world, layout)


def _clipped(rank: int, world: int, layout: dict) -> None:
    torch.manual_seed(0)
    base = K3ForCausalLM(K3Config.from_preset("tiny")).float()
    models, opts = [], []
    for fused in (True, False):
        model = copy.deepcopy(base)
        dims = ParallelDims(world_size=world, **layout)
        parallelize_k3(model, dims, dims.build_mesh("cpu"))
        groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")}
                  for g in build_optimizer(model, "adamw", 1e-2).param_groups]
        models.append(model)
        opts.append(torch.optim.AdamW(groups, fused=fused, foreach=False))
    for step in range(3):
        t = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank))
        norms = []
        for model, opt in zip(models, opts):
            model.zero_grad(set_to_none=True)
            model(t[:, :-1], targets=t[:, 1:]).loss.backward()
            if opt.param_groups[0]["fused"]:
                norms.append(clipped_step(opt, model.parameters(), 0.05))
            else:  # the reference: scale the gradients, then a plain AdamW step
                norms.append(clip_grad_norm(model.parameters(), 0.05))
                opt.step()
        assert float(norms[0]) > 0.5 and abs(float(norms[0]) - float(norms[1])) <= 1e-6 * float(norms[1])
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            la, lb = (x.to_local() if isinstance(x, DTensor) else x for x in (a, b))
            ga, gb = (x.grad.to_local() if isinstance(x.grad, DTensor) else x.grad for x in (a, b))
            assert (ga is None) == (gb is None), (step, name)
            for what, x, y in (("grad", ga, gb), ("param", la.detach(), lb.detach())):
                if x is None:
                    continue
                err = float((x - y).norm() / y.norm().clamp(min=1e-12))
                assert err < 1e-5, (step, name, what, err)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, {"ep": 2})], ids=["one-rank", "ep2"])
def test_clipped_step_with_fused_adamw_on_a_sharded_model(world: int, layout: dict) -> None:
    """The trainer's clip folded into torch's fused AdamW (``clipped_step``) steps a sharded model as scaling its
    gradient shards and then a plain AdamW step do: the clip bites (norm ≫ 0.05) and every shard and its clipped
    gradient agree over three steps."""
    _gloo.run_ranks(_clipped, world, layout)


def _record(allocate, handed: list, *args, **kwargs) -> torch.Tensor:
    buf = allocate(*args, **kwargs)
    handed.append(buf.untyped_storage().data_ptr())
    return buf


def _one_rank(rank: int, world: int) -> None:
    from k3.distributed.parallelize import OneRankReduceScatter

    torch.manual_seed(0)
    ref = K3ForCausalLM(K3Config.from_preset("tiny")).float()
    t = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    for step in range(2):  # the second backward reuses nothing stale from the first
        ref.zero_grad(set_to_none=True)
        ref(t[:, :-1], targets=t[:, 1:]).loss.backward()
        if step == 0:
            model = copy.deepcopy(ref)
            dims = ParallelDims(world_size=1)
            parallelize_k3(model, dims, dims.build_mesh("cpu"))
            comms = [m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm for m in model.modules()
                     if hasattr(m, "set_custom_reduce_scatter") and m._get_fsdp_state()._fsdp_param_group]
            assert comms and all(isinstance(c, OneRankReduceScatter) for c in comms)
            handed: list[int] = []
            for c in comms:  # record the storage of every buffer the comms hand out
                c.allocate = functools.partial(_record, c.allocate, handed)
        handed.clear()
        model.zero_grad(set_to_none=True)
        model(t[:, :-1], targets=t[:, 1:]).loss.backward()
        # each reduce-scatter asked twice and got one buffer: input and output are the same memory
        assert handed and len(handed) == 2 * len(comms) and handed[0::2] == handed[1::2], handed
        flats = {}
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            assert (g is None) == (q.grad is None), (step, name)
            if g is None:
                continue
            err = float((g - q.grad).norm() / q.grad.norm().clamp(min=1e-12))
            assert err < 1e-6, (step, name, err)
            if isinstance(p.grad, DTensor):  # the gradients of one FSDP group: views of one flat buffer
                flats.setdefault(name.rsplit(".layers.", 1)[-1].split(".")[0], set()).add(
                    g.untyped_storage().data_ptr())
        assert all(len(ptrs) == 1 and ptrs <= set(handed) for ptrs in flats.values()), flats


def test_one_rank_reduce_scatter_hands_back_its_input() -> None:
    """On one rank FSDP's reduce-scatter is a copy of each layer's flat gradient into an output buffer;
    ``OneRankReduceScatter`` gives the input buffer back as that output, so the copy is a no-op. The gradients stay
    the one-process ones, over two steps."""
    _gloo.run_ranks(_one_rank, 1)


def test_one_rank_reduce_scatter_buffers() -> None:
    """The input request gets a fresh buffer, the output request of its size that same buffer, and a request of
    another size a fresh one again."""
    from k3.distributed.parallelize import OneRankReduceScatter

    comm = OneRankReduceScatter()
    a = comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
    assert comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu")).data_ptr() == a.data_ptr()
    b = comm.allocate((12,), dtype=torch.float32, device=torch.device("cpu"))
    assert b.data_ptr() != a.data_ptr()  # a new input after a completed pair
    c = comm.allocate((5,), dtype=torch.float32, device=torch.device("cpu"))
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr()) and c.numel() == 5
    assert comm.allocate((5,), dtype=torch.bfloat16, device=torch.device("cpu")).dtype == torch.bfloat16
    with pytest.raises(RuntimeError):
        comm(c, c, None, None)
