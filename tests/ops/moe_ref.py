"""What the MoE kernel tests share: the device, the GPU-only mark, NaN-poisoned kernel outputs, the relative error."""

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Kernel outputs start as NaN (K3_MOE_POISON=1): an element a kernel forgets to write fails the comparison.
    Autouse in every module that imports it."""
    monkeypatch.setenv("K3_MOE_POISON", "1")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of ``a`` against ``b``, on the CPU (fp64 ground truths live there); ``a`` must be finite."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "non-finite values (an unwritten or broken output)"
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
