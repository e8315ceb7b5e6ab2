"""The whole training step as one CUDA graph: forward, backward, gradient clipping, optimizer and QB, replayed.

Why: at ``small``'s size the host cannot issue a step's thousands of kernels (the compiled regions' wrappers, the
Triton launchers, the optimizer's per-parameter updates; FSDP2's per-layer hooks on several GPUs) as fast as the GPU
runs them: on an H200 the eager step takes 211 ms where its replay takes 164 ms — its kernel time. Replaying a
captured graph issues the step in one call. torch.compile's ``mode="reduce-overhead"`` graphs each compiled region
on its own; it cannot reach the hooks, the AttnRes mixes between the regions, or the optimizer.

What a captured step needs (all of it holds for ``k3.train.trainer``'s step): device work only — no host reads
(``.item()``, boolean-mask indexing), the same shapes every step, learning rates and optimizer step counts as
device tensors (``build_optimizer(capturable=True)``), and every lazy initialisation (compile, Triton autotuning,
optimizer state, communicators) done by the eager steps before the capture.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["StepGraph", "reshard"]


class StepGraph:
    """Run ``fn(*inputs) -> outputs`` (device tensors in and out) eagerly for ``warmup`` calls, then capture it
    once over static copies of the inputs and replay it on every later call.

    The capture records the call it is made for and then replays it, so every call trains on its own inputs. The
    returned tensors are the graph's static outputs: read them before the next call. A call whose inputs differ in
    shape, dtype or device from the captured ones runs eagerly (e.g. a shorter last batch).
    """

    def __init__(self, fn: Callable[..., Any], warmup: int = 2) -> None:
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (lazy initialisation happens in eager calls), got {warmup}")
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._static: list[torch.Tensor] = []
        self._outputs: Any = None
        self._side: torch.cuda.Stream | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup:
            return self._eager(inputs)
        if self.graph is None:
            self._capture(inputs)
        elif not self._fits(inputs):
            return self._eager(inputs)
        else:
            for s, x in zip(self._static, inputs):
                s.copy_(x, non_blocking=True)
        self.graph.replay()
        return self._outputs

    def _fits(self, inputs: Sequence[torch.Tensor]) -> bool:
        return len(inputs) == len(self._static) and all(
            x.shape == s.shape and x.dtype == s.dtype and x.device == s.device for x, s in zip(inputs, self._static))

    def _eager(self, inputs: Sequence[torch.Tensor]) -> Any:
        # on a side stream, as torch.cuda.graphs asks of the iterations before a capture (autograd and the
        # communicators set up their streams there); the caller's stream waits for it
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            out = self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(self._side)
        return out

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        self._static = [x.clone() for x in inputs]  # torch.cuda.graph synchronizes before it starts capturing
        graph = torch.cuda.CUDAGraph()
        # thread-local: the NCCL watchdog thread keeps querying its events during the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._outputs = self.fn(*self._static)
        self.graph = graph


def reshard(model: torch.nn.Module) -> None:
    """Free the unsharded parameters of every FSDP2 module of ``model`` after an eager forward between replays.

    A replayed step gathers its parameters into the graph's own buffers and leaves FSDP's bookkeeping as the
    capture left it (resharded). An eager forward (evaluation) gathers into new buffers, and on one rank they stay
    gathered: the next eager forward would reuse them, with the weights of before the steps replayed since."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
