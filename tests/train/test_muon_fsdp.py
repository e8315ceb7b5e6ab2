"""Muon under FSDP2 (2 gloo ranks) makes the same update as one process: a sharded 2-D matrix is gathered whole for
Newton–Schulz, stacked experts sharded along the expert dim are orthogonalised in place (an uneven split included),
experts sharded along a matrix dim are gathered; AdamW parameters and the clipped norm agree too."""

import copy
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from k3.train.optim import Muon, clip_grad_norm

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", Path(__file__).parents[1] / "distributed" / "_gloo.py")
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w3 = nn.Parameter(torch.randn(4, 6, 6) * 0.3)  # sharded along a matrix dim (below) → gathered

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return torch.einsum("beo,fop->bp", e, self.w3)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(10, 6, bias=False)  # [6, 10]: FSDP cuts its rows → gathered
        self.w1 = nn.Parameter(torch.randn(3, 6, 6) * 0.3)  # 3 experts on 2 ranks: 2 + 1 whole matrices
        self.inner = _Inner()
        self.gain = nn.Parameter(torch.ones(6))  # AdamW

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) * self.gain
        e = torch.einsum("bi,eio->beo", h, self.w1).tanh()
        return self.inner(e).pow(2).mean()


def _groups(model: nn.Module) -> list[dict]:
    muon = [p for n, p in model.named_parameters() if p.dim() >= 2]
    return [{"params": muon, "use_muon": True, "weight_decay": 0.1},
            {"params": [model.gain], "weight_decay": 0.0}]


def _steps(model: nn.Module, opt: Muon) -> list[float]:
    norms = []
    for i in range(3):
        x = torch.randn(8, 10, generator=torch.Generator().manual_seed(i))
        model(x).backward()
        norms.append(float(clip_grad_norm(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    return norms


def _compare(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    ref = _Toy()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.inner, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
    fully_shard(model, mesh=mesh)
    n_ref = _steps(ref, Muon(_groups(ref), lr=0.02))
    n_par = _steps(model, Muon(_groups(model), lr=0.02))
    assert max(abs(a - b) for a, b in zip(n_ref, n_par)) < 1e-5, (n_ref, n_par)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.full_tensor(), q, atol=1e-5), name
    dist.barrier()


def test_muon_on_two_fsdp_ranks_equals_one_process() -> None:
    _gloo.run_ranks(_compare, 2)
