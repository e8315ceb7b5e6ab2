"""When the trainer captures its step in a CUDA graph, and the knob's validation (CPU; the replays themselves are
tested in test_graph_gpu.py)."""

import pytest
import torch

from k3.distributed.data_parallel import Distributed
from k3.distributed.parallel_dims import ParallelDims
from k3.train.graph import StepGraph
from k3.train.trainer import TrainArgs, use_cuda_graph


@pytest.mark.parametrize("value,device,world,expected", [
    ("auto", "cuda", 1, True), ("auto", "cuda", 2, False), ("auto", "cpu", 1, False),
    ("on", "cuda", 4, True), ("on", "cpu", 1, False), ("off", "cuda", 1, False),
])
def test_use_cuda_graph(value, device, world, expected):
    dims = ParallelDims(world_size=world)
    d = Distributed(dims=dims, device=torch.device(device))
    assert use_cuda_graph(TrainArgs(cuda_graph=value), d) is expected


def test_bad_values():
    with pytest.raises(ValueError, match="--cuda-graph must be one of auto, on, off"):
        TrainArgs(cuda_graph="sometimes").validate()
    with pytest.raises(ValueError, match="warmup"):
        StepGraph(lambda x: x, warmup=0)
