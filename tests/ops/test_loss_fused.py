"""Fused linear + cross-entropy (chunked, Triton CE step in the interpreter on CPU) against the plain reference:
the loss and the gradients of the hidden states and the lm_head weight, ignored targets, odd token counts."""

import pytest
import torch

from k3.ops.loss import linear_cross_entropy, linear_cross_entropy_fused, linear_cross_entropy_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("N,d,V,use_triton,chunk", [
    (37, 16, 50, True, 16), (37, 16, 50, False, 0), (5, 8, 300, True, 2), (3, 8, 8200, True, 0),
])
def test_fused_matches_reference(N, d, V, use_triton, chunk, nan_empty) -> None:
    g = torch.Generator().manual_seed(N + V)
    h = torch.randn(N, d, generator=g).to(DEV).requires_grad_()
    W = torch.randn(V, d, generator=g).to(DEV).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(DEV)
    t[::3] = -100
    loss = linear_cross_entropy_fused(h, W, t, use_triton=use_triton, chunk=chunk)
    got = torch.autograd.grad(loss * 1.7, [h, W])
    ref = linear_cross_entropy_reference(h, W, t)
    want = torch.autograd.grad(ref * 1.7, [h, W])
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5


def test_all_targets_ignored_gives_zero_and_no_nan() -> None:
    h = torch.randn(4, 8, device=DEV, requires_grad=True)
    W = torch.randn(10, 8, device=DEV, requires_grad=True)
    t = torch.full((4,), -100, device=DEV)
    loss = linear_cross_entropy_fused(h, W, t, use_triton=True)
    gh, gw = torch.autograd.grad(loss, [h, W])
    assert float(loss) == 0.0 and torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_entry_checks_and_cpu_reference() -> None:
    h, W = torch.randn(2, 3, 8), torch.randn(10, 8)
    t = torch.randint(0, 10, (2, 3))
    assert torch.equal(linear_cross_entropy(h, W, t), linear_cross_entropy_reference(h.view(6, 8), W, t.view(6)))
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, torch.randn(10, 7), t)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, W, t.float())
    with pytest.raises(ValueError, match="hidden"):
        linear_cross_entropy(t, W, t)
