"""Where `small`'s training step holds its peak memory (one GPU, batch 8 × 4,096, AdamW): the fast path's step issued
eagerly, split into forward / backward / optimizer with the allocator's peak of each, and the tensors the forward
saves for the backward by dtype and shape (counted through ``saved_tensors_hooks``: views of one buffer count once
each, so the sum overstates). From the repository root: ``PYTHONPATH=. python bench/gpu/train_memory.py`` (~2 min);
the committed output is ``bench/results/train/memory.txt``."""

import types

import torch

from k3.bench import train as T
from k3.config import K3Config
from k3.distributed.data_parallel import init_distributed
from k3.distributed.parallel_dims import ParallelDims
from k3.train.optim import clipped_step

G = 2 ** 30
a = types.SimpleNamespace(seed=0, ac="none", optimizer="adamw", lr=2e-3, warmup_lr=10, batch_size=8, seq_len=4096)
dev = torch.device("cuda")
d = init_distributed(dev, ParallelDims())
config = K3Config.from_preset("small")
loader = T.RandomTokens(config.vocab_size, 8, 4096, 0)
run = T._build_run("fast-eager", config, a, loader, d, 20)
for i in range(2):
    run.step(i)
torch.cuda.synchronize()
m, opt = run.model, run.opt
print(f"resident after steps: {torch.cuda.memory_allocated() / G:.2f} GiB")
x, y = (t.to(dev) for t in loader.next_batch())
torch.cuda.reset_peak_memory_stats()
loss = m(x, targets=y).loss
torch.cuda.synchronize()
print(f"forward: now {torch.cuda.memory_allocated() / G:.2f}, peak {torch.cuda.max_memory_allocated() / G:.2f} GiB")
torch.cuda.reset_peak_memory_stats()
loss.backward()
torch.cuda.synchronize()
print(f"backward: now {torch.cuda.memory_allocated() / G:.2f}, peak {torch.cuda.max_memory_allocated() / G:.2f} GiB")
torch.cuda.reset_peak_memory_stats()
clipped_step(opt, list(m.parameters()), 1.0)
opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
print(f"optimizer: now {torch.cuda.memory_allocated() / G:.2f}, peak {torch.cuda.max_memory_allocated() / G:.2f} GiB")

sizes: dict[tuple, int] = {}


def pack(t: torch.Tensor) -> torch.Tensor:
    k = (str(t.dtype), tuple(t.shape))
    sizes[k] = sizes.get(k, 0) + t.numel() * t.element_size()
    return t


with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    loss = m(x, targets=y).loss
print(f"saved by autograd hooks (outside compiled regions' own saving): {sum(sizes.values()) / G:.2f} GiB")
for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:25]:
    print(f"  {v / G:7.3f} GiB  {k}")
print(f"forward again: now {torch.cuda.memory_allocated() / G:.2f} GiB")
