"""The fused RMSNorm × sigmoid gate: reference = the KDA layer's op-by-op output stage, Triton kernel = reference
(interpreter on CPU, CUDA with a GPU), ragged row counts and head dims that are not powers of two."""

import pytest
import torch

from k3.layers.norm import RMSNorm
from k3.ops.norm_gate import rms_norm_gate_reference
from k3.ops.norm_gate.norm_gate_triton import rms_norm_gate_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = (torch.randn(rows, K, generator=g) * 3).to(dtype)
    gl = (torch.randn(rows, K, generator=g) * 4).to(dtype)
    w = torch.rand(K, generator=g) + 0.5
    return o, gl, w


def test_reference_is_the_layer_output_stage():
    o, gl, w = _inputs(7, 32, torch.float32)
    norm = RMSNorm(32, eps=1e-5, dtype=torch.float32)
    norm.weight.data.copy_(w)
    want = (norm(o.float()) * torch.sigmoid(gl.float())).to(torch.float32)
    assert torch.allclose(rms_norm_gate_reference(o, gl, w, 1e-5, torch.float32), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows,K,dtype", [(5, 32, torch.float32), (37, 48, torch.float16), (3, 128, torch.float32)])
def test_kernel_equals_reference(rows, K, dtype):
    o, gl, w = (t.to(DEV) for t in _inputs(rows, K, dtype, seed=rows))
    want = rms_norm_gate_reference(o, gl, w, 1e-5, dtype)
    got = rms_norm_gate_triton(o, gl, w, 1e-5, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


def test_kernel_reads_a_gate_sliced_from_a_wider_projection():
    """o [B, T, H, K] contiguous, g a column slice of a [B, T, H·K + 9] projection (FusedProjections): in place."""
    B, T, H, K = 3, 2, 4, 24
    o, gl, w = (t.to(DEV) for t in _inputs(B * T * H, K, torch.float32, seed=9))
    o = o.view(B, T, H, K)
    wide = torch.cat([gl.view(B, T, H * K), torch.randn(B, T, 9, device=DEV)], dim=-1)
    g = wide[..., :H * K].view(B, T, H, K)
    assert not g.is_contiguous()
    want = rms_norm_gate_reference(o, g, w, 1e-5, torch.float32)
    assert torch.allclose(rms_norm_gate_triton(o, g, w, 1e-5, torch.float32), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel needs a GPU")
def test_kernel_bf16_on_gpu():
    o, gl, w = (t.cuda() for t in _inputs(64 * 8, 128, torch.bfloat16))
    want = rms_norm_gate_reference(o, gl, w, 1e-5, torch.bfloat16)
    assert torch.allclose(rms_norm_gate_triton(o, gl, w, 1e-5, torch.bfloat16).float(), want.float(), atol=2e-2,
                          rtol=2e-2)


def test_op_is_registered():
    """``k3::rms_norm_gate``: schema, fake tensor and tracing checks of torch.library."""
    o, gl, w = (t.to(DEV) for t in _inputs(6, 16, torch.float32, seed=3))
    torch.library.opcheck(rms_norm_gate_triton, (o.view(2, 3, 16), gl.view(2, 3, 16), w, 1e-5, torch.float32))
