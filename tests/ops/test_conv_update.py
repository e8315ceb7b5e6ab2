"""The short-conv decode update against a pool of tails: the reference equals ShortConv on a one-token piece, the
Triton kernel (interpreter on CPU) equals the reference, tails are updated in place at the given slots only."""

import pytest
import torch

from k3.layers.conv import ShortConv
from k3.ops.conv import short_conv_update_reference
from k3.ops.conv.update_triton import short_conv_update_triton


def _setup(B=3, P=5, C=40, W=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, generator=g).to(dtype)
    tails = torch.randn(P, W - 1, C, generator=g).to(dtype)
    conv = ShortConv(C, W)
    slots = torch.tensor([4, 0, 2][:B])
    return x, tails, slots, conv


@pytest.mark.parametrize("activation", [True, False])
def test_reference_equals_short_conv(activation):
    x, tails, slots, conv = _setup()
    conv.activation = activation
    want, want_tail = conv(x[:, None], tails[slots].clone())
    pool = tails.clone()
    y = short_conv_update_reference(x, pool, slots, conv.weight, activation)
    assert torch.allclose(y, want[:, 0], atol=1e-6, rtol=1e-6)
    assert torch.equal(pool[slots], want_tail)
    untouched = [i for i in range(5) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], tails[untouched])


@pytest.mark.parametrize("dtype,C", [(torch.float32, 40), (torch.float16, 1100)])
def test_triton_kernel_equals_reference(dtype, C):
    """On CUDA tensors with a GPU, else in the interpreter."""
    x, tails, slots, conv = _setup(C=C, dtype=dtype, seed=1)
    if torch.cuda.is_available():
        x, tails, slots, conv = x.cuda(), tails.cuda(), slots.cuda(), conv.cuda()
    a, b = tails.clone(), tails.clone()
    y_ref = short_conv_update_reference(x, a, slots, conv.weight)
    y = short_conv_update_triton(x, b, slots, conv.weight)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert torch.allclose(y.float(), y_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(a, b)


def test_bad_shapes():
    x, tails, slots, conv = _setup()
    with pytest.raises(ValueError, match="x"):
        short_conv_update_reference(x[:, None], tails, slots, conv.weight)
    with pytest.raises(ValueError, match="tails"):
        short_conv_update_reference(x, tails[..., :3], slots, conv.weight)
    with pytest.raises(ValueError, match="slots"):
        short_conv_update_reference(x, tails, slots.float(), conv.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel needs a GPU")
def test_triton_kernel_bf16_on_gpu():
    x, tails, slots, conv = _setup(C=1024, dtype=torch.bfloat16, seed=2)
    x, tails, slots, conv = x.cuda(), tails.cuda(), slots.cuda(), conv.cuda()
    a, b = tails.clone(), tails.clone()
    y_ref = short_conv_update_reference(x, a, slots, conv.weight)
    y = short_conv_update_triton(x, b, slots, conv.weight)
    assert torch.allclose(y.float(), y_ref.float(), atol=1e-2, rtol=1e-2) and torch.equal(a, b)
