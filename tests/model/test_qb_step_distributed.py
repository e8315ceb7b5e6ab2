"""``K3ForCausalLM.qb_step(group)`` on 2 gloo ranks: one collective for all MoE layers, and every rank ends with
the biases one process gets from all ranks' training forwards."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.config import K3Config
from k3.model import K3ForCausalLM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.from_preset("tiny")).train()


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))


def _biases(model: K3ForCausalLM) -> torch.Tensor:
    return torch.stack([m.gate.e_score_correction_bias for m in model.moe_layers()])


def _rank(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, ids = _model(), _ids()
        model(ids[2 * rank: 2 * rank + 2], labels=ids[2 * rank: 2 * rank + 2])  # this rank's half of the batch
        calls = []
        real = dist.all_reduce
        dist.all_reduce = lambda t, *a, **kw: (calls.append(t.numel()), real(t, *a, **kw))[1]
        try:
            model.qb_step(group=dist.group.WORLD)
        finally:
            dist.all_reduce = real
        n_moe = len(model.moe_layers())
        assert calls == [n_moe * 8 * model.config.qb_num_bins], calls  # ONE collective for all layers
        torch.save(_biases(model), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_qb_step_over_a_group_equals_one_process(tmp_path) -> None:
    mp.start_processes(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    model, ids = _model(), _ids()
    model(ids[:2], labels=ids[:2])  # the same two halves, accumulated in one process
    model(ids[2:], labels=ids[2:])
    model.qb_step()
    want = _biases(model)
    assert not torch.equal(want, torch.zeros_like(want))
    for r in range(2):
        assert torch.equal(torch.load(tmp_path / f"rank{r}.pt"), want), r
