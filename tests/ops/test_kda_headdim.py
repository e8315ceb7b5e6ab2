"""Head dims above 128 on the Triton paths (fla allows K, V ≤ 256; K3's 128 is the tuned case): K = V = 256 and
K = 192, V = 256 (padded blocks) against the fp64 token recurrence, through training (every backward stage, K walked
in two 128-column slices), both inference flows (64-token, and the 16-token one of the bounded gate), the split
prefill and decode. CPU: the interpreter (fp32) at tiny T. GPU: bf16 and fp16 at the same head dims, where the block
sizes must fit the 227 KiB of shared memory per block (``triton/_common.py`` says how they are chosen).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from k3.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: E402
from k3.ops.kda.triton import chunk_kda as chunk_kda_triton  # noqa: E402
from k3.ops.kda.triton.inference import InferencePlan  # noqa: E402
from tests.ops.kda_ref import (  # noqa: E402
    CUDA,
    assert_close,
    backend_call,
    cpu_only,
    errors,
    gpu,
    make_inputs,
    public_call,
)

pytestmark = pytest.mark.usefixtures("nan_empty")
DIMS = [(256, 256), (192, 256)]


@pytest.fixture(autouse=True)
def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.delenv("K3_KDA_SPLITS", raising=False)


@cpu_only
@pytest.mark.parametrize("K,V,cu", [(256, 256, [0, 1, 67]), (192, 256, None)])
def test_training(K, V, cu):
    """fwd + bwd, softplus gate in the kernel: varlen with a one-token sequence and one across two chunks; a dense
    one-chunk batch with K padded to 256."""
    T = cu[-1] if cu else 21
    x = make_inputs(1, T, 1, K, V, N=len(cu) - 1 if cu else None)
    assert_close(errors(public_call(cu, lb=None), x, cu=cu, lb=None), 1e-4)


@cpu_only
@pytest.mark.parametrize("K,V", DIMS)
def test_inference_flows(K, V):
    """No grad: the 64-token flow (unbounded gate) and the 16-token flow (bounded gate, forced at any size)."""
    x = make_inputs(1, 40, 1, K, V)
    assert_close(errors(public_call(lb=None), x, grad=False, lb=None), 1e-4)
    c16 = backend_call(chunk_kda_triton, inference=InferencePlan(c16_min_programs=0))
    assert_close(errors(c16, x, grad=False), 1e-4)


@cpu_only
def test_split_and_decode(monkeypatch):
    """The split prefill (two segments, bounded gate) and decode (two tokens per sequence) at K = 192, V = 256."""
    x = make_inputs(1, 40, 1, 192, 256)
    monkeypatch.setenv("K3_KDA_SPLITS", "2")
    assert_close(errors(public_call(), x, grad=False), 1e-4)
    monkeypatch.delenv("K3_KDA_SPLITS")
    xd = make_inputs(2, 2, 1, 192, 256)

    def run(d):
        return fused_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], d["A"], d["dt"], None, d["s0"], True,
                                   True, True, True, lower_bound=-5.0)
    assert_close(errors(run, xd, grad=False), 1e-5)


def test_head_dim_limit():
    """Above 256 the Triton path refuses (fla's limit, its exception types) and names the dims."""
    x = make_inputs(1, 2, 1, 264, 8)
    d = {n: t.float().to("cuda" if CUDA else "cpu") for n, t in x.items()}
    with pytest.raises(ValueError, match="K=264") as e:
        chunk_kda(d["q"], d["k"], d["v"], -d["g"].abs(), d["beta"].sigmoid())
    assert isinstance(e.value, AssertionError)


@gpu
@pytest.mark.parametrize("K,V", DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_head_dims(K, V, dtype, monkeypatch):
    """Every path at K, V up to 256 on the GPU: training (softplus gate, varlen), both inference flows, the split
    prefill, decode; 2% relative RMS for half inputs."""
    cu = [0, 1, 300, 700]
    x = make_inputs(1, 700, 4, K, V, N=3)
    assert_close(errors(public_call(cu, lb=None), x, dtype, cu=cu, lb=None), 2e-2)
    assert_close(errors(public_call(cu), x, dtype, grad=False, cu=cu), 2e-2)
    c16 = backend_call(chunk_kda_triton, cu, inference=InferencePlan(c16_min_programs=0))
    assert_close(errors(c16, x, dtype, grad=False, cu=cu), 2e-2)
    monkeypatch.setenv("K3_KDA_SPLITS", "3")
    assert_close(errors(public_call(cu), x, dtype, grad=False, cu=cu), 2e-2)
    monkeypatch.delenv("K3_KDA_SPLITS")
    xd = make_inputs(8, 1, 4, K, V)

    def run(d):
        return fused_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], d["A"], d["dt"], None, d["s0"], True,
                                   True, True, True, lower_bound=-5.0)
    assert_close(errors(run, xd, dtype, grad=False), 2e-2)
