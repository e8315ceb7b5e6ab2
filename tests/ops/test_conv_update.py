"""The short-conv decode update against a pool of tails: the reference equals ShortConv on a one-token piece, the
Triton kernel (interpreter on CPU, CUDA with a GPU) equals the reference for one, two and three convolutions per
launch, tails are updated in place at the given slots only."""

import pytest
import torch

from k3.layers.conv import ShortConv
from k3.ops.conv import short_conv_update_reference
from k3.ops.conv.update_triton import short_conv_update_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _setup(n=3, B=3, P=5, C=40, W=4, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, C, generator=g).to(dtype).to(device) for _ in range(n)]
    tails = torch.randn(n, P, W - 1, C, generator=g).to(dtype).to(device)
    convs = [ShortConv(C, W).to(device) for _ in range(n)]
    slots = torch.tensor([4, 0, 2][:B], device=device)
    return xs, tails, slots, convs


@pytest.mark.parametrize("activation", [True, False])
def test_reference_equals_short_conv(activation):
    xs, tails, slots, convs = _setup()
    pool = tails.clone()
    y = short_conv_update_reference(xs, pool, slots, [c.weight for c in convs], activation)
    for i, (x, c) in enumerate(zip(xs, convs)):
        c.activation = activation
        want, want_tail = c(x[:, None], tails[i][slots].clone())
        assert torch.allclose(y[i], want[:, 0], atol=1e-6, rtol=1e-6)
        assert torch.equal(pool[i][slots], want_tail)
    untouched = [i for i in range(5) if i not in slots.tolist()]
    assert torch.equal(pool[:, untouched], tails[:, untouched])


@pytest.mark.parametrize("n,dtype,C", [(3, torch.float32, 40), (1, torch.float16, 1100), (2, torch.float32, 64)])
def test_triton_kernel_equals_reference(n, dtype, C):
    xs, tails, slots, convs = _setup(n=n, C=C, dtype=dtype, seed=n, device=DEV)
    ws = [c.weight for c in convs]
    a, b = tails.clone(), tails.clone()
    y_ref = short_conv_update_reference(xs, a, slots, ws)
    y = short_conv_update_triton(xs, b, slots, ws)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert torch.allclose(y.float(), y_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(a, b)


def test_triton_kernel_reads_column_slices_of_one_projection():
    """q, k, v as column slices of one [B, 3C + 5] projection output (FusedProjections): read in place."""
    xs, tails, slots, convs = _setup(C=40, seed=4, device=DEV)
    packed = torch.cat([*xs, torch.randn(3, 5, device=DEV)], dim=1)
    sliced = list(packed.split([40, 40, 40, 5], dim=1)[:3])
    assert sliced[0].stride() == (125, 1)
    ws = [c.weight for c in convs]
    a, b = tails.clone(), tails.clone()
    y_ref = short_conv_update_reference(xs, a, slots, ws)
    y = short_conv_update_triton(sliced, b, slots, ws)
    assert torch.allclose(y, y_ref, atol=1e-6, rtol=1e-6) and torch.equal(a, b)


def test_bad_shapes():
    xs, tails, slots, convs = _setup()
    ws = [c.weight for c in convs]
    with pytest.raises(ValueError, match="xs"):
        short_conv_update_reference([x[:, None] for x in xs], tails, slots, ws)
    with pytest.raises(ValueError, match="tails"):
        short_conv_update_reference(xs, tails[..., :3], slots, ws)
    with pytest.raises(ValueError, match="slots"):
        short_conv_update_reference(xs, tails, slots.float(), ws)
    with pytest.raises(ValueError, match="weights"):
        short_conv_update_reference(xs, tails, slots, ws[:2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel needs a GPU")
def test_triton_kernel_bf16_on_gpu():
    xs, tails, slots, convs = _setup(C=1024, dtype=torch.bfloat16, seed=2, device="cuda")
    ws = [c.weight for c in convs]
    a, b = tails.clone(), tails.clone()
    y_ref = short_conv_update_reference(xs, a, slots, ws)
    y = short_conv_update_triton(xs, b, slots, ws)
    assert torch.allclose(y.float(), y_ref.float(), atol=1e-2, rtol=1e-2) and torch.equal(a, b)


def test_op_is_registered():
    """``k3::short_conv_update`` (mutates the tails): schema, fake tensor and tracing checks of torch.library."""
    from k3.ops.conv.update_triton import _conv_update_op

    xs, tails, slots, convs = _setup(n=2, C=16, seed=7, device=DEV)
    ws = [c.weight.detach() for c in convs]  # forward only (decode)
    torch.library.opcheck(_conv_update_op, (xs, tails, slots, ws, True))
