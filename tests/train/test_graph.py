"""When the trainer captures its step in a CUDA graph, and the knob's validation (CPU; the replays themselves are
tested in test_graph_gpu.py)."""

import pytest
import torch

from k3.config import K3Config
from k3.distributed.data_parallel import Distributed
from k3.distributed.parallel_dims import ParallelDims
from k3.train.graph import StepGraph
from k3.train.trainer import TrainArgs, use_cuda_graph


BF16 = K3Config.from_preset("tiny", dtype="bfloat16")
FP32 = K3Config.from_preset("tiny")


@pytest.mark.parametrize("value,device,world,config,expected", [
    ("auto", "cuda", 1, BF16, True), ("auto", "cuda", 2, BF16, False), ("auto", "cpu", 1, BF16, False),
    ("auto", "cuda", 1, FP32, False), ("on", "cuda", 4, BF16, True), ("off", "cuda", 1, BF16, False),
])
def test_use_cuda_graph(value, device, world, config, expected):
    d = Distributed(dims=ParallelDims(world_size=world), device=torch.device(device))
    assert use_cuda_graph(TrainArgs(cuda_graph=value), d, config) is expected


@pytest.mark.parametrize("device,config", [("cpu", BF16), ("cuda", FP32)])
def test_on_refuses_what_cannot_be_captured(device, config):
    """fp32 experts read their group sizes on the host; a CPU has no graphs."""
    d = Distributed(dims=ParallelDims(), device=torch.device(device))
    with pytest.raises(ValueError, match="--cuda-graph on needs a CUDA device and bf16 compute"):
        use_cuda_graph(TrainArgs(cuda_graph="on"), d, config)


def test_bad_values():
    with pytest.raises(ValueError, match="--cuda-graph must be one of auto, on, off"):
        TrainArgs(cuda_graph="sometimes").validate()
    with pytest.raises(ValueError, match="warmup"):
        StepGraph(lambda x: x, warmup=0)
