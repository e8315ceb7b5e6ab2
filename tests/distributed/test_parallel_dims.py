"""ParallelDims: degrees validated against the world size (errors name the flag), and the named mesh views."""

import importlib.util
import pathlib

import pytest
import torch.distributed as dist

from k3.distributed.parallel_dims import ParallelDims

_spec = importlib.util.spec_from_file_location("k3_tests_gloo", pathlib.Path(__file__).with_name("_gloo.py"))
_gloo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gloo)
run_ranks = _gloo.run_ranks


def test_fill_and_derived_degrees() -> None:
    d = ParallelDims(world_size=8, ep=4, cp=2)
    assert (d.dp_shard, d.dp, d.dp_cp, d.dp_shard_in_ep, d.dp_shard_mod_ep) == (4, 4, 8, 2, 2)
    d = ParallelDims(world_size=8, dp_replicate=2)
    assert (d.dp_shard, d.dp, d.dp_shard_mod_ep) == (4, 8, 4)
    assert ParallelDims().describe() == "one rank"
    assert ParallelDims(world_size=4, ep=2).describe() == "dp_shard 4 × ep 2"


@pytest.mark.parametrize("kw, flag", [
    (dict(world_size=4, dp_shard=3), "--dp-shard"),  # product ≠ world size
    (dict(world_size=1, dp_shard=2), "torchrun"),  # a parallel flag outside torchrun
    (dict(world_size=4, cp=3), "--cp"),  # cp does not divide the world
    (dict(world_size=4, ep=3), "--ep"),  # ep does not divide dp_shard × cp
    (dict(world_size=4, cp=2, ep=1, dp_shard=2, dp_replicate=2), "--dp-replicate"),
    (dict(world_size=4, cp=4, ep=2), "--ep 2 must be a multiple of --cp"),
    (dict(world_size=2, dp_shard=0), "--dp-shard must be a positive integer or -1"),
    (dict(world_size=2, ep=True), "--ep must be a positive integer"),
    (dict(world_size=2, tp=2), "--tp"),
])
def test_bad_degrees_name_the_flag(kw, flag) -> None:
    with pytest.raises(ValueError, match=flag.replace("(", r"\(")):
        ParallelDims(**kw)


def test_run_checks() -> None:
    d = ParallelDims(world_size=4, cp=2, ep=2)
    d.check_run(n_experts=8, seq_len=16, batch_size=4)
    with pytest.raises(ValueError, match="--ep 2 must divide the model's n_experts"):
        d.check_run(n_experts=7, seq_len=16, batch_size=4)
    with pytest.raises(ValueError, match="--cp 2 must divide --seq-len"):
        d.check_run(n_experts=8, seq_len=15, batch_size=4)
    with pytest.raises(ValueError, match="--batch-size 3"):
        d.check_run(n_experts=8, seq_len=16, batch_size=3)
    with pytest.raises(ValueError, match="needs a model with routed experts"):
        d.check_run(n_experts=0, seq_len=16, batch_size=4)


def _views(rank: int, world: int) -> None:
    mesh = ParallelDims(world_size=world, cp=2, ep=2).build_mesh("cpu")
    want = {  # rank layout [dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp] = [1, 2, 1, 2]
        "dp": [[0, 2], [1, 3]], "cp": [[0, 1], [2, 3]], "ep": [[0, 1], [2, 3]], "dp_shard_mod_ep": [[0, 2], [1, 3]],
        "dp_cp": [[0, 1, 2, 3]], "dp_shard_cp": [[0, 1, 2, 3]], "fsdp": [[0, 1, 2, 3]],
        "expert_fsdp": [[0, 2], [1, 3]]}
    for name, groups in want.items():
        mine = next(g for g in groups if rank in g)
        assert mesh[name].mesh.flatten().tolist() == mine, (name, mesh[name])
    assert mesh.local_rank("cp") == rank % 2 and mesh.local_rank("dp") == rank // 2
    dist.barrier()  # no rank tears the store down while another still builds its groups


def test_mesh_views_on_four_gloo_ranks() -> None:
    run_ranks(_views, 4)
