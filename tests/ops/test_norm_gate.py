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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel needs a GPU")
def test_kernel_bf16_on_gpu():
    o, gl, w = (t.cuda() for t in _inputs(64 * 8, 128, torch.bfloat16))
    want = rms_norm_gate_reference(o, gl, w, 1e-5, torch.bfloat16)
    assert torch.allclose(rms_norm_gate_triton(o, gl, w, 1e-5, torch.bfloat16).float(), want.float(), atol=2e-2,
                          rtol=2e-2)
