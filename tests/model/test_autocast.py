"""The eager reference trainer's step — fp32 master weights, the forward under bf16 autocast — through the fused
kernels' code paths (Triton backends forced, the interpreter on CPU): the custom ops' backward formulas see bf16
activations beside fp32 weights and gradients, and must neither fail on a dtype mix nor hand a parameter a gradient
of another dtype. (The interpreter's bf16 values are not meaningful; the dtypes are what this checks.)"""

import pytest
import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.model import K3ForCausalLM

pytest.importorskip("triton")


def test_autocast_step_through_the_kernels_backward(monkeypatch):
    for op in ("MOE", "MLA", "KDA"):
        monkeypatch.setenv(f"K3_{op}_BACKEND", "triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny")).float().to(dev).train()
    x = torch.randint(0, 256, (1, 17), device=dev)
    with torch.autocast(dev, dtype=torch.bfloat16):
        logits = model(x[:, :-1]).logits
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) > 0.9 * len(list(model.parameters()))
    assert {n for n, g in grads.items() if g.dtype != torch.float32} == set()
    if dev == "cuda":  # real bf16 arithmetic: the gradients are finite
        assert all(torch.isfinite(g).all() for g in grads.values())
