"""The fused RMSNorm Triton kernels (interpreter fp32 on CPU; CUDA when present) against the fp32 reference."""

import pytest
import torch

from k3.layers.norm import RMSNorm
from k3.ops.norm import rms_norm, rms_norm_fused, rms_norm_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("shape", [(5, 24), (3, 7, 100), (1, 64), (37, 33)])
def test_fused_matches_reference(shape, nan_empty) -> None:
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(DEV).requires_grad_()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(DEV).requires_grad_()
    y = rms_norm_fused(x, w, 1e-5)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w], dy)
    y_ref = rms_norm_reference(x, w, 1e-5)
    want = torch.autograd.grad(y_ref, [x, w], dy)
    assert y.shape == x.shape and rel(y, y_ref) < 1e-6
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5


def test_layer_uses_it_and_bad_input() -> None:
    norm = RMSNorm(16)
    x = torch.randn(2, 3, 16)
    assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, 1e-5))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(15), 1e-5)
    with pytest.raises(ValueError, match="x"):
        rms_norm(3.0, None, 1e-5)


def test_registered_ops_pass_opcheck() -> None:
    x = torch.randn(5, 16, device=DEV, requires_grad=True)
    w = torch.rand(16, device=DEV, requires_grad=True)
    torch.library.opcheck(torch.ops.k3.rms_norm_fwd.default, (x, w, 1e-5),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
