"""Compilation: the KDA ops inside ``torch.compile(fullgraph=True)`` (registered ops, ``k3/ops/kda/library.py``) give
the eager outputs and gradients; and the kernels the interpreter cannot run (Gluon) or whose sm_90 code matters
(the 16-token state and span passes on wgmma) compile for an H200 on this CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3.ops.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_pool  # noqa: E402
from tests.ops.kda_ref import DEV, K3, assert_close, errors, make_inputs, on_device, public_call, rel  # noqa: E402
from tests.ops.sm90 import run_script  # noqa: E402

CUDA = torch.cuda.is_available()
# aot_eager: Dynamo's full-graph capture and AOTAutograd's fake-tensor trace of the registered ops and their backward,
# without inductor's code generation (which would only add compile time here)
COMPILE = dict(fullgraph=True, backend="aot_eager")


def _layer(cu: torch.Tensor | None):
    """What a decoder layer does with the op: the K3 call, then a loss on the output and the final state."""
    def f(q, k, v, g, beta, A, dt, s0):
        o, ht = chunk_kda(q, k, v, g, beta, A_log=A, dt_bias=dt, initial_state=s0, output_final_state=True,
                          cu_seqlens=cu, **K3)
        return (o * o).sum() + 0.1 * (ht * ht).sum()
    return f


def _grads(fn, x: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    xs = {n: t.float().clone().requires_grad_() for n, t in x.items()}
    loss = fn(**xs)
    loss.backward()
    return loss.detach(), [xs[n].grad for n in x]


@pytest.mark.parametrize("varlen", [False, True])
def test_compiled_chunk_kda_reference_backend(monkeypatch, varlen):
    """The PyTorch backend (CPU) in a full graph: the same loss and gradients as eager (its backward recomputes the
    reference under torch.func)."""
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    cu = torch.tensor([0, 30, 30, 70]) if varlen else None
    x = make_inputs(1, 70, 2, 16, 16, N=3 if varlen else 1)
    torch._dynamo.reset()
    l0, g0 = _grads(_layer(cu), x)
    l1, g1 = _grads(torch.compile(_layer(cu), **COMPILE), x)
    assert rel(l1, l0) < 1e-6 and all(rel(a, b) < 1e-6 for a, b in zip(g1, g0))


def test_compiled_decode_reference_backend(monkeypatch):
    """Decode in a full graph: a dense step with a final state, and the pool updated in place."""
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    x = {n: t.float() for n, t in make_inputs(3, 1, 2, 16, 16).items()}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A"], x["dt"])

    def step(q, k, v, g, beta, A, dt, s0):
        return fused_recurrent_kda(q, k, v, g, beta, A, dt, initial_state=s0, output_final_state=True, **K3)

    def pool_step(q, k, v, g, beta, A, dt, pool, idx):
        return fused_recurrent_kda_pool(q, k, v, g, beta, pool, idx, A_log=A, dt_bias=dt, **K3)

    torch._dynamo.reset()
    with torch.no_grad():
        o0, s0 = step(*args, x["s0"])
        o1, s1 = torch.compile(step, **COMPILE)(*args, x["s0"])
        assert torch.equal(o1, o0) and torch.equal(s1, s0)
        pools = [torch.zeros(5, 2, 16, 16) for _ in range(2)]
        idx = torch.tensor([4, -1, 1])
        p0 = pool_step(*args, pools[0], idx)
        p1 = torch.compile(pool_step, **COMPILE)(*args, pools[1], idx)
    assert torch.equal(p1, p0) and torch.equal(pools[1], pools[0]) and pools[0].abs().sum() > 0


@pytest.mark.skipif(CUDA, reason="the interpreter case; on a GPU the test below")
def test_compiled_chunk_kda_triton_interpreter(monkeypatch):
    """The Triton backend (interpreter) in a full graph on a varlen batch: the registered op keeps the training
    forward's buffers (an unbacked chunk count) for its backward; loss and gradients against the fp64 recurrence."""
    pytest.importorskip("triton")
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    cu = [0, 17, 17, 40]
    x = make_inputs(1, 40, 1, 16, 16, N=3)
    torch._dynamo.reset()
    run = torch.compile(public_call(cu), **COMPILE)
    assert_close(errors(run, x, cu=cu), 1e-4)


@pytest.mark.gpu_quick
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_compiled_training_step(monkeypatch):
    """The K3 call in a compiled function on the GPU (inductor), bf16 varlen: the same loss and gradients as eager
    (the same kernels)."""
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    cu = torch.tensor([0, 700, 701, 2000], device=DEV)
    x = on_device(make_inputs(1, 2000, 4, 128, 128, N=3), torch.bfloat16, False)
    f = _layer(cu)
    torch._dynamo.reset()
    l0, g0 = _grads(f, x)
    l1, g1 = _grads(torch.compile(f, fullgraph=True), x)
    assert rel(l1, l0) < 1e-5 and all(rel(a, b) < 1e-5 for a, b in zip(g1, g0))


_SM90 = r"""
import os, re, subprocess, tempfile, triton
import k3.ops.kda.triton.decode_gluon as dg
import k3.ops.kda.triton.inference_prep_gluon as ipg
import k3.ops.kda.triton.inference_state as ist
import k3.ops.kda.triton.split as sp
from tests.ops.sm90 import compile_sm90

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def spills(ptx, cap=None):
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", *(["--maxrregcount", str(cap)] if cap else []),
                            os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes spill stores", r.stderr)
    assert m, r.stderr[-1500:]
    return int(m.group(1))


# the Gluon decode step: the K3 flags at the shipped register cap without spills and with its L2 prefetch; the pool
# without a state and an unbounded gate at other head dims type-checks and lowers
dec = dict(q="*bf16", k="*bf16", v="*bf16", g="*bf16", beta="*bf16", A_log="*fp32", dt_bias="*fp32", o="*bf16",
           s_in="*fp32", s_out="*fp32", idx="*i64", H="i32", scale="fp32", lb="fp32")
k3 = dict(K=128, V=128, BK=128, BV=32, NV=4, USE_GATE=True, HAS_LB=True, HAS_A=True, HAS_DT=True, L2NORM=True,
          BETA_SIGMOID=True, USE_IDX=False, USE_S0=True, STORE_S=True, PF=264, PF_MODE=1)
c = compile_sm90(dg._kda_decode_gluon, dec, k3, 2, gluon=True, maxnreg=128)
assert "prefetch.global.L2::evict_last" in c.asm["ptx"]
assert spills(c.asm["ptx"], 128) == 0, "decode spills"
for pool, s0, lb in ((True, False, None),):
    const = dict(k3, K=100, V=72, NV=3, USE_IDX=pool, USE_S0=s0, HAS_LB=lb is not None,
                 PF=264 if s0 and not pool else 0)
    assert "st.global" in compile_sm90(dg._kda_decode_gluon, dec, const, 2, gluon=True, maxnreg=128).asm["ptx"]

# the Gluon prefill prep (varlen, no A_log / dt_bias, with the decay bound): mma.sync, no spills
prep = {n: "*bf16" for n in ("q", "k", "v", "g", "beta", "X", "KG", "U", "AQ")}
prep.update(A_log="*fp32", dt_bias="*fp32", GAM="*fp32", cu="*i32", chunk_seq="*i32", chunk_off="*i32", c0="i32",
            NCw="i32", T="i32", NT="i32", H="i32", scale="fp32", lb="fp32")
for varlen, has, dec_out in ((True, False, True),):
    const = dict(K=128, BT=64, BC=16, HAS_A=has, HAS_DT=has, IS_VARLEN=varlen, DEC_OUT=dec_out)
    types = dict(prep, DEC="*fp32") if dec_out else prep
    if not dec_out:
        const["DEC"] = None
    c = compile_sm90(ipg._c16_prep_gluon, types, const, 2, gluon=True)
    assert "mma.sync" in c.asm["ptx"] and spills(c.asm["ptx"]) == 0, (varlen, has)

# the 16-token state pass and the split's span rows: products on wgmma (M = the 64-row block), step loads async
st = {n: "*bf16" for n in ("X", "KG", "AQ", "U", "o")}
st.update(GAM="*fp32", ht="*fp32", cu="*i32", chunk_off="*i32", c0="i32", c1="i32", NCw="i32", T="i32", NT="i32",
          H="i32")
c = compile_sm90(ist._c16_state, st, dict(K=128, V=128, BT=64, BC=16, BK=128, BV=64, BVP=128, IS_VARLEN=True,
                                          PREC="tf32", STAGES=8), 4)
assert "wgmma.mma_async" in c.asm["ptx"] and "cp.async" in c.asm["ptx"]
span = dict(X="*bf16", KG="*bf16", GAM="*fp32", U="*bf16", SE="*fp32", M="*fp32", row_cs="*i32", row_ce="*i32",
            row_m="*i32", c0="i32", NCw="i32", H="i32", DEC="*fp32", lim="fp32")
c = compile_sm90(sp._split_span_rows, span, dict(K=128, V=128, BT=64, BC=16, BK=128, BV=64, BVP=128, BR=64,
                                                  PREC="tf32", STAGES=4, FORGET=True, SB=256), 4)
assert "wgmma.mma_async" in c.asm["ptx"] and c.asm["ptx"].count("cp.async.cg") >= 4
print("compiled", flush=True)
"""


@pytest.mark.skipif(CUDA, reason="a CPU-only check (on a GPU the kernels themselves run)")
def test_kernels_compile_for_sm90():
    """The Gluon decode step (the K3 flags without register spills at its 128-register cap, with its L2 prefetch;
    another flag set), the Gluon prefill prep (mma.sync, no spills) and the 16-token state and span passes (wgmma,
    asynchronous step loads) compile to sm_90 code without a GPU — what the interpreter cannot check. In a
    subprocess: the interpreter is on in this process."""
    triton = pytest.importorskip("triton")
    from k3.ops.kda.triton._common import HAVE_GLUON

    if not HAVE_GLUON:
        pytest.skip(f"this Triton ({triton.__version__}) has no Gluon the kernels are written for")
    r = run_script(_SM90)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
