"""The training step as one CUDA graph (k3.train.graph; skipped without a GPU): replays train exactly as the
eager step does — both optimizers, a changing lr, evaluation forwards between replays — and a batch of another
shape runs eagerly."""

import pytest
import torch

from k3.bench.train import RandomTokens, _build
from k3.config import K3Config
from k3.distributed.data_parallel import destroy_distributed, init_distributed
from k3.distributed.parallel_dims import ParallelDims
from k3.distributed.parallelize import parallelize_k3
from k3.train.graph import StepGraph
from k3.train.optim import build_optimizer
from k3.train.trainer import Stepper, TrainArgs, _Data, use_cuda_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _config() -> K3Config:
    return K3Config.from_preset("tiny", dtype="bfloat16", vocab_size=512, hidden_size=128, n_experts=16, top_k=4)


class _OneBatch:
    """The same batch every step: the loss must fall."""

    def __init__(self, vocab: int) -> None:
        self.batch = RandomTokens(vocab, 4, 96).next_batch()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch


def _train(cuda_graph: str, optimizer: str, steps: int = 7) -> tuple[list[float], list[float], bool]:
    """Losses of ``steps`` steps (lr warming up throughout) and eval losses after steps 3 and 5."""
    config = _config()
    d = init_distributed(torch.device("cuda"), ParallelDims())
    try:
        model = _build(config, d.device, 0)
        parallelize_k3(model, d.dims, d.mesh, mixed_precision=torch.bfloat16)
        args = TrainArgs(preset="tiny", batch_size=4, seq_len=96, steps=steps, warmup=steps, optimizer=optimizer,
                         lr=3e-3, cuda_graph=cuda_graph)
        opt = build_optimizer(model, optimizer, args.lr, capturable=use_cuda_graph(args, d, config))
        stepper = Stepper(model, opt, _Data(_OneBatch(config.vocab_size), None, None), args, d)
        xv, yv = (t.cuda() for t in RandomTokens(config.vocab_size, 4, 96, seed=9).next_batch())
        losses, evals = [], []
        for i in range(steps):
            losses.append(stepper(i)["loss"])
            if i in (3, 5):
                model.eval()
                with torch.no_grad():
                    evals.append(float(model(xv, targets=yv).loss))
                model.train()
                stepper.eager_forwards_done()
        return losses, evals, stepper.graph is not None and stepper.graph.captured
    finally:
        destroy_distributed(d)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_replayed_steps_train_as_the_eager_step(optimizer: str) -> None:
    eager, eager_evals, captured = _train("off", optimizer)
    graph, graph_evals, graph_captured = _train("auto", optimizer)
    assert not captured and graph_captured
    for a, b in zip(graph + graph_evals, eager + eager_evals):
        assert abs(a - b) <= 1e-3 * abs(b), (graph, eager, graph_evals, eager_evals)
    assert graph[-1] < 0.9 * graph[0]  # it trains: the lr warms up through every replay


def test_step_graph_replays_its_inputs_and_runs_other_shapes_eagerly() -> None:
    acc = torch.zeros((), device="cuda")

    def fn(x: torch.Tensor) -> tuple[torch.Tensor]:
        acc.add_(x.sum())
        return (acc * 2,)

    g = StepGraph(fn, warmup=1)
    total = 0.0
    for i, n in enumerate([4, 4, 4, 5, 4]):
        x = torch.full((n,), float(i + 1), device="cuda")
        total += float(x.sum())
        (out,) = g(x)
        assert float(out) == 2 * total and float(acc) == total
    assert g.captured
