"""The ops launch their kernels on the GPU that holds the tensors, not on whichever GPU is current.

Triton launches on the current device; the KDA entry points and the MoE ops make the tensors' GPU current while
they launch (``k3.ops._device.on_device_of``). Checked on a machine with two GPUs: every output (and gradient) of a
call on ``cuda:1`` tensors with ``cuda:0`` current equals the same call with ``cuda:1`` current, bitwise.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from k3.ops._device import on_device_of
from k3.ops.kda import chunk_kda, fused_recurrent_kda
from k3.ops.moe.combine import combine_norm
from k3.ops.moe.mxfp4 import quantize_mxfp4
from k3.ops.moe.mxfp4_gemm import mxfp4_grouped_mm
from k3.ops.moe.router import route
from k3.ops.moe.situ import situ_glu

two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two GPUs")
K3 = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
          lower_bound=-5.0)


def test_cpu_tensors_need_no_device_switch():
    assert isinstance(on_device_of(torch.zeros(1)), contextlib.nullcontext)


def _inputs(B: int, T: int, H: int, D: int, dev: str, grad: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dev, torch.bfloat16)  # noqa: E731
    x = dict(q=mk(B, T, H, D), k=mk(B, T, H, D), v=mk(B, T, H, D), g=mk(B, T, H, D), beta=mk(B, T, H))
    for n in x:
        x[n].requires_grad_(grad)
    x.update(A_log=torch.zeros(H, device=dev), dt_bias=torch.zeros(H * D, device=dev),
             h0=torch.randn(B, H, D, D, generator=gen).to(dev))
    return x


def _chunk(x: dict) -> list[torch.Tensor]:
    for n in ("q", "k", "v", "g", "beta"):
        x[n].grad = None
    o, s = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                     A_log=x["A_log"], dt_bias=x["dt_bias"], **K3)
    (o.float().square().sum() + s.square().sum()).backward()
    return [o, s] + [x[n].grad for n in ("q", "k", "v", "g", "beta")]


def _decode(x: dict) -> list[torch.Tensor]:
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o, s = fused_recurrent_kda(*args, initial_state=x["h0"], output_final_state=True, A_log=x["A_log"],
                               dt_bias=x["dt_bias"], **K3)
    pool = torch.zeros(2 * x["q"].shape[0], *x["h0"].shape[1:], device=x["q"].device)
    idx = torch.arange(x["q"].shape[0], device=x["q"].device) * 2
    o2, _ = fused_recurrent_kda(*args, initial_state=pool, ssm_state_indices=idx, A_log=x["A_log"],
                                dt_bias=x["dt_bias"], **K3)
    return [o, s, o2, pool]


def _moe(x: dict) -> list[torch.Tensor]:
    """The router, SiTU-GLU, the combine + norm and the MXFP4 grouped GEMM on small inputs."""
    dev = x["q"].device
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen).to(dev)  # noqa: E731
    idx, p = route(r(9, 8), r(12, 8), torch.zeros(12, device=dev), 3)
    h = situ_glu(r(9, 16).bfloat16(), r(9, 16).bfloat16())
    y = combine_norm(r(12, 8), torch.randperm(12, generator=gen).to(dev), torch.rand(6, 2, generator=gen).to(dev),
                     torch.ones(8, device=dev), 1e-5)
    packed, scale = quantize_mxfp4(torch.randn(2, 16, 64, generator=gen))
    z = mxfp4_grouped_mm(r(5, 64).bfloat16(), packed.to(dev), scale.to(dev),
                         torch.tensor([2, 5], dtype=torch.int32, device=dev))
    return [idx, p, h, y, z]


@two_gpus
@pytest.mark.parametrize("case", ["chunk", "decode", "moe"])
def test_kernels_run_on_the_tensors_gpu(monkeypatch, case):
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    fn, (B, T, grad) = {"chunk": (_chunk, (2, 100, True)), "decode": (_decode, (3, 1, False)),
                        "moe": (_moe, (1, 1, False))}[case]
    with torch.cuda.device(1):
        ref = [t.clone() for t in fn(_inputs(B, T, 2, 64, "cuda:1", grad))]
    torch.cuda.set_device(0)
    got = fn(_inputs(B, T, 2, 64, "cuda:1", grad))
    assert torch.cuda.current_device() == 0
    for a, b in zip(got, ref):
        assert a.device == b.device == torch.device("cuda", 1)
        assert torch.equal(a, b)
