"""AdamW on fp32 masters with a low-precision model copy: the Triton kernel (CUDA, or the interpreter on CPU with
fp16 copies) against its reference, and the reference against torch's own AdamW."""

import pytest
import torch

from k3.ops.optim import adamw_master_reference, adamw_master_step

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LOW = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter reads no bf16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _state(n: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g).to(DEV)
    grad = (torch.randn(n, generator=g) * scale).to(DEV, LOW)
    m = (torch.randn(n, generator=g) * 0.1 * scale).to(DEV)
    v = (torch.rand(n, generator=g) * 0.01 * scale * scale).to(DEV)
    return master, grad, m, v


@pytest.mark.parametrize("n", [1, 37, 4097, 10_000])
@pytest.mark.parametrize("with_copy,with_scale", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("size", ["unit", "large", "tiny"])
def test_kernel_matches_reference(n: int, with_copy: bool, with_scale: bool, size: str) -> None:
    # extremes of the gradient's dtype (fp16 under the interpreter: ±65,504, subnormals below 6e-5)
    scale = {"unit": 1.0, "large": 1e15 if LOW == torch.bfloat16 else 1e4, "tiny": 1e-20 if LOW == torch.bfloat16
             else 1e-6}[size]
    master, grad, m, v = _state(n, n, scale)
    step = torch.tensor(3.0, device=DEV)
    lr = torch.tensor(2e-3, device=DEV)
    gs = torch.tensor(1.7, device=DEV) if with_scale else None
    want = [t.clone() for t in (master, m, v)]
    if not with_copy:
        grad = grad.float()  # the master is the parameter: an fp32 gradient
    adamw_master_reference(want[0], None, grad, want[1], want[2], step, lr, 0.9, 0.95, 1e-8, 0.1, gs)
    copy = torch.full((n,), float("nan"), device=DEV, dtype=LOW) if with_copy else None
    adamw_master_step(master, copy, grad, m, v, step, lr, 0.9, 0.95, 1e-8, 0.1, gs)
    for got, ref in zip((master, m, v), want):
        assert torch.isfinite(got).all()
        assert rel(got, ref) < 1e-6
    if with_copy:
        assert torch.equal(copy, master.to(LOW))  # rounded from the new master, every element written


def test_reference_is_torch_adamw() -> None:
    """Three steps on the same fp32 gradients: the master follows torch.optim.AdamW (decoupled weight decay)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, device=DEV))
    opt = torch.optim.AdamW([p], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    master, m, v = p.detach().clone(), torch.zeros(300, device=DEV), torch.zeros(300, device=DEV)
    step = torch.zeros((), device=DEV)
    for _ in range(3):
        g = torch.randn(300, device=DEV)
        p.grad = g.clone()
        opt.step()
        step += 1
        adamw_master_step(master, None, g, m, v, step, 3e-3, 0.9, 0.95, 1e-8, 0.1)
    assert rel(master, p.detach()) < 1e-6
    assert rel(m, opt.state[p]["exp_avg"]) < 1e-6 and rel(v, opt.state[p]["exp_avg_sq"]) < 1e-6


def test_non_contiguous_tensors_take_the_reference() -> None:
    master, grad, m, v = _state(64, 1)
    master2 = master.view(8, 8).t()  # strided: not the kernel's layout
    ref = [t.clone() for t in (master2, m.view(8, 8).t(), v.view(8, 8).t())]
    adamw_master_reference(ref[0], None, grad.view(8, 8).t(), ref[1], ref[2], torch.ones((), device=DEV), 1e-3,
                           0.9, 0.95, 1e-8, 0.0)
    adamw_master_step(master2, None, grad.view(8, 8).t(), m.view(8, 8).t(), v.view(8, 8).t(),
                      torch.ones((), device=DEV), 1e-3, 0.9, 0.95, 1e-8, 0.0)
    assert rel(master2, ref[0]) < 1e-7


def test_bad_inputs_name_the_argument() -> None:
    master, grad, m, v = _state(10, 2)
    one = torch.ones((), device=DEV)
    with pytest.raises(ValueError, match="master"):
        adamw_master_step(master.to(LOW), None, grad, m, v, one, 1e-3, 0.9, 0.95, 1e-8, 0.0)
    with pytest.raises(ValueError, match="grad"):
        adamw_master_step(master, None, grad[:5], m, v, one, 1e-3, 0.9, 0.95, 1e-8, 0.0)
    with pytest.raises(ValueError, match="copy"):
        adamw_master_step(master, torch.empty(3, device=DEV, dtype=LOW), grad, m, v, one, 1e-3, 0.9, 0.95, 1e-8, 0.0)
    with pytest.raises(ValueError, match="step"):
        adamw_master_step(master, None, grad, m, v, torch.ones(2, device=DEV), 1e-3, 0.9, 0.95, 1e-8, 0.0)
