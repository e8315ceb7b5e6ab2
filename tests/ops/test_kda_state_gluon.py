"""The Gluon state pass of the 16-token flow (``k3/ops/kda/triton/state_gluon.py``, ``GluonStateConfig``) against
the fp64 token recurrence, through the public ``k3.ops.kda.chunk_kda``.

GPU (skipped without CUDA): bf16 / fp16 at K = V = 128, odd lengths, varlen with empty and one-token sequences,
extreme gates and β, several windows bitwise the single window's result, bitwise causality, every ring depth, and
a spy that the Gluon kernel ran. CPU: the kernel compiles for sm_90 (Triton's compiler and ptxas, no GPU) with its
products on wgmma and its tiles copied asynchronously; the dispatch and the knob's check.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from k3.ops.kda.triton import chunk16 as c16  # noqa: E402
from k3.ops.kda.triton import chunk_fwd as cf  # noqa: E402
from k3.ops.kda.triton import state_gluon as sg  # noqa: E402
from tests.ops.test_kda_chunk16 import EXTREMES, check, run  # noqa: E402
from tests.ops.test_kda_prep_variants import _causality as causality  # noqa: E402
from tests.ops.test_kda_prep_variants import make_inputs  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
needs_gluon = pytest.mark.skipif(not sg.HAVE_GLUON, reason="Gluon of the tested Triton release")


@pytest.fixture(autouse=True)
def gluon_state(monkeypatch, nan_empty):
    """The 16-token flow (mode 2, the default) through the Triton backend with the Gluon state pass, NaN-poisoned
    torch.empty/empty_like, and a count of the Gluon launches."""
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setenv("K3_KDA_SPLITS", "1")
    monkeypatch.setattr(cf.FwdConfig, "inference_flow", "c16")
    monkeypatch.setattr(sg.GluonStateConfig, "enabled", True)
    launches = []
    real = sg.launch
    monkeypatch.setattr(sg, "launch", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    return launches


@gpu
@needs_gluon
@pytest.mark.parametrize("stages,chains,warps", [(2, 2, 4), (8, 2, 4), (10, 2, 4), (8, 1, 4), (8, 1, 8), (3, 1, 8)])
@pytest.mark.parametrize("T,cu", [(1, None), (63, None), (1000, None), (1000, [0, 1, 100, 100, 613, 1000])])
def test_gpu_gluon_state_matches_recurrence(monkeypatch, gluon_state, stages, chains, warps, T, cu):
    monkeypatch.setattr(sg.GluonStateConfig, "stages", stages)
    monkeypatch.setattr(sg.GluonStateConfig, "chains", chains)
    monkeypatch.setattr(sg.GluonStateConfig, "warps", warps)
    check(make_inputs(T, 4, 128, 128, N=len(cu) - 1 if cu else 1, seed=T), 2e-2, dtype=torch.bfloat16, cu=cu)
    assert gluon_state, "the Gluon state pass did not run"


@gpu
@needs_gluon
@pytest.mark.parametrize("kw", list(EXTREMES.values()), ids=list(EXTREMES))
def test_gpu_gluon_state_extremes(gluon_state, kw):
    check(make_inputs(300, 2, 128, 128, **kw), 2e-2, dtype=torch.bfloat16)
    assert gluon_state


@gpu
@needs_gluon
def test_gpu_gluon_state_fp16_and_no_initial_state(gluon_state):
    check(make_inputs(300, 2, 128, 128), 2e-2, dtype=torch.float16)
    check(make_inputs(257, 3, 128, 128, seed=5), 2e-2, dtype=torch.bfloat16, h0=False)
    assert gluon_state


@gpu
@needs_gluon
def test_gpu_gluon_state_equals_triton_state_pass(monkeypatch):
    """The same buffers through both state passes: equal to bf16 rounding of the outputs (the products' order of
    accumulation differs), the final states to fp32 accumulation."""
    x = make_inputs(5000, 4, 128, 128, N=2, seed=2)
    cu = [0, 1777, 5000]
    o_g, h_g = run(x, torch.bfloat16, cu)
    monkeypatch.setattr(sg.GluonStateConfig, "enabled", False)
    o_t, h_t = run(x, torch.bfloat16, cu)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert rel(o_g, o_t) < 1e-2 and rel(h_g, h_t) < 1e-2, (rel(o_g, o_t), rel(h_g, h_t))


@gpu
@needs_gluon
def test_gpu_gluon_state_windows_and_causality(monkeypatch, gluon_state):
    """Several windows (the state carried between them, a sequence across windows): bitwise the single window's
    result; then bitwise causality."""
    x = make_inputs(5000, 2, 128, 128, N=3)
    cu = [0, 1500, 1501, 5000]
    o_ref, h_ref = run(x, torch.bfloat16, cu)
    monkeypatch.setattr(cf.FwdConfig, "window_bytes", 1 << 20)
    o, h = run(x, torch.bfloat16, cu)
    assert torch.equal(o, o_ref) and torch.equal(h, h_ref)
    causality(1000, 2, 128, torch.bfloat16, (1, 17, 100, 511, 999))
    assert gluon_state


@gpu
@needs_gluon
def test_gpu_gluon_state_not_used_for_other_head_dims(gluon_state):
    """V ≠ 128 keeps the Triton state pass (the Gluon tiles are unmasked)."""
    check(make_inputs(300, 2, 128, 100), 2e-2, dtype=torch.bfloat16)
    assert not gluon_state


def test_gluon_state_dispatch_and_knob(monkeypatch):
    """Only CUDA buffers of mode 2 at K = V = 128 take the kernel; a bad ring depth names the knob."""
    bufs = {"X": torch.empty(1, 1, 128, 128, dtype=torch.bfloat16), "U": torch.empty(1, 1, 128, 128,
                                                                                       dtype=torch.bfloat16)}
    assert not sg.usable(bufs, None, 1, 128, 128, 2, True, True, 0)  # CPU tensors
    monkeypatch.setattr(sg.GluonStateConfig, "stages", 1)
    with pytest.raises(ValueError, match="GluonStateConfig.stages"):
        sg.launch(bufs, None, None, None, 0, 1, 1, 128, 128, 64, 16)
    monkeypatch.setattr(sg.GluonStateConfig, "stages", 8)
    monkeypatch.setattr(sg.GluonStateConfig, "chains", 3)
    with pytest.raises(ValueError, match="GluonStateConfig.chains"):
        sg.launch(bufs, None, None, None, 0, 1, 1, 128, 128, 64, 16)
    monkeypatch.setattr(sg.GluonStateConfig, "chains", 2)
    monkeypatch.setattr(sg.GluonStateConfig, "warps", 8)  # two warpgroups hold one chain each
    with pytest.raises(ValueError, match="GluonStateConfig.warps"):
        sg.launch(bufs, None, None, None, 0, 1, 1, 128, 128, 64, 16)


_COMPILE = r"""
import os, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import k3.ops.kda.triton.state_gluon as sg
fn = sg._c16_state_gluon
t = dict(X="*bf16", KG="*bf16", GAM="*fp32", U="*bf16", o="*bf16", ht="*fp32", cu="*i32", chunk_off="*i32",
         c0="i32", c1="i32", NCw="i32", T="i32", NT="i32", H="i32")
sig = {n: t.get(n, "constexpr") for n in fn.arg_names}
ptrs = [n for n in fn.arg_names if t.get(n, "").startswith("*")]
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
for varlen, chains, w in ((False, 2, 4), (True, 2, 4), (False, 1, 4), (True, 1, 8)):
    const = dict(K=128, V=128, BT=64, BC=16, BK=128, BVP=128, IS_VARLEN=varlen, STAGES=8, CHAINS=chains, W=w)
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
                         attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=w)).asm["ptx"]
    # both chains' products on wgmma, a wait that leaves the other chain's update in flight, tiles by cp.async
    assert ptx.count("wgmma.mma_async") >= 10 * chains, (varlen, w)
    assert chains == 1 or "wgmma.wait_group.sync.aligned 1" in ptx, varlen
    assert "cp.async.cg.shared.global" in ptx, varlen
    # ptxas keeps the products asynchronous: it serialises every wgmma (C7514) when a non-wgmma instruction may read
    # an accumulator in flight — which a wrong wait count would cause
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    assert r.returncode == 0 and "C7514" not in r.stderr + r.stdout, r.stderr
print("compiled", flush=True)
"""


@needs_gluon
@pytest.mark.skipif(CUDA, reason="the CPU check of what the GPU tests run")
def test_gluon_state_compiles_for_sm90():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
