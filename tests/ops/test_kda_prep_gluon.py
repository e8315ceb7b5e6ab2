"""The Gluon prep of the 16-token flow (``k3/ops/kda/triton/prep_gluon.py``, ``GluonPrepConfig.enabled``, on by
default for the K3 setting on CUDA).

GPU (skipped without CUDA): its window buffers against the Triton prep's on the same inputs (dense, varlen with
empty and one-token sequences, extreme gates and β), and ``chunk_kda`` through it against the fp64 recurrence (odd
lengths, varlen, with and without an initial state, extremes, the split prefill, several windows bitwise, bitwise
causality), outputs poisoned with NaN, with a spy that the Gluon prep ran. CPU: it compiles for sm_90 without
spills, and the dispatch takes only the K3 setting.
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
from k3.ops.kda.triton import prep_gluon as pg  # noqa: E402
from k3.ops.kda.triton._common import make_chunk_table  # noqa: E402
from tests.ops.kernel_spy import KernelSpy  # noqa: E402
from tests.ops.test_kda_chunk16 import EXTREMES  # noqa: E402
from tests.ops.test_kda_prep_variants import _causality as causality  # noqa: E402
from tests.ops.test_kda_prep_variants import check as check_rows  # noqa: E402
from tests.ops.test_kda_prep_variants import make_inputs, rel  # noqa: E402
from tests.ops.test_kda_prep_variants import run as run_rows  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not (CUDA and pg.HAVE_GLUON), reason="needs CUDA and Gluon")
needs_gluon = pytest.mark.skipif(not pg.HAVE_GLUON, reason="this Triton has no Gluon")
K3 = dict(use_gate=True, l2norm=True, beta_sigmoid=True, exact_diag=False)


@pytest.fixture
def gluon_prep(monkeypatch, nan_empty):
    """The 16-token flow through the Triton backend, the Gluon prep on, and a count of its launches."""
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setenv("K3_KDA_SPLITS", "1")
    monkeypatch.setattr(cf.FwdConfig, "inference_flow", "c16")
    monkeypatch.setattr(pg.GluonPrepConfig, "enabled", True)
    calls = []
    real = pg.launch_prep_gluon

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(pg, "launch_prep_gluon", spy)
    return calls


def _buffers(x: dict, cu: list[int] | None, gluon: bool, monkeypatch) -> dict:
    """One window of the c16 prep's buffers (NaN-filled first) from either prep, bf16 inputs."""
    dev = "cuda"
    q, k, v, g = (x[n].to(dev, torch.bfloat16).contiguous() for n in ("q", "k", "v", "g"))
    beta = x["beta"].to(dev, torch.bfloat16).contiguous()
    A_log, dt = x["A"].to(dev, torch.float32), x["dt"].to(dev, torch.float32)
    T, H = q.shape[1], q.shape[2]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev) if cu else None
    tab = make_chunk_table(1, T, cu_t, q.device)
    bufs = c16.alloc_c16_buffers(H, tab.NC, 128, 128, torch.bfloat16, q.device, decay_bound=True)
    for b in bufs.values():
        b.fill_(float("nan"))
    monkeypatch.setattr(pg.GluonPrepConfig, "enabled", gluon)
    c16.launch_c16_prep(q, k, v, g, beta, A_log, dt, bufs, tab, 0, tab.NC, 128 ** -0.5, -5.0, K3)
    torch.cuda.synchronize()
    return bufs


@gpu
@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("case", ["dense_1000", "dense_63", "varlen", *EXTREMES])
def test_gpu_buffers_match_triton_prep(monkeypatch, case, mode):
    """Every window buffer the state and span passes read agrees with the Triton prep's (same algebra, other
    rounding order: bf16 outputs) and is written everywhere (the buffers start as NaN); mode 2's buffers and mode
    3's (the default: U alone and [I | A_qkᵀ]), with the split's decay bounds ("DEC")."""
    monkeypatch.setattr(c16.C16Config, "mode", mode)
    cu = None
    if case == "varlen":
        x, cu = make_inputs(1000, 3, 128, 128, N=5, seed=3), [0, 1, 100, 100, 613, 1000]
    elif case in EXTREMES:
        x = make_inputs(300, 2, 128, 128, **EXTREMES[case])
    else:
        T = int(case.split("_")[1])
        x = make_inputs(T, 3, 128, 128, seed=T)
    ref = _buffers(x, cu, False, monkeypatch)
    got = _buffers(x, cu, True, monkeypatch)
    assert set(ref) == set(got) == ({"X", "U", "KG", "GAM", "DEC"} | ({"AQ"} if mode == 3 else set()))
    for name in ref:
        r, o = ref[name], got[name]
        assert not torch.isnan(o).any(), f"{name}: NaN (a part left unwritten)"
        assert torch.equal(torch.isnan(r), torch.isnan(o))
        assert rel(o, r) <= 1e-2, f"{name}: relative RMS {rel(o, r):.2e}"


@gpu
@pytest.mark.parametrize("T,cu,h0", [(1, None, True), (63, None, False), (1000, None, True),
                                     (1000, [0, 1, 100, 100, 613, 1000], True), (1000, [0, 999, 1000], False)])
def test_gpu_matches_recurrence(gluon_prep, T, cu, h0):
    x = make_inputs(T, 4, 128, 128, N=len(cu) - 1 if cu else 1, seed=T)
    check_rows(x, 2e-2, torch.bfloat16, cu=cu, grad=False, h0=h0)
    assert gluon_prep, "the Gluon prep did not run"


@gpu
@pytest.mark.parametrize("cu", [None, [0, 1, 100, 100, 613, 1000]])
def test_gpu_triton_prep_still_matches_recurrence(gluon_prep, monkeypatch, cu):
    """With the Gluon prep off, the K3 calls take the Triton prep again (the fallback for every other setting)."""
    monkeypatch.setattr(pg.GluonPrepConfig, "enabled", False)
    check_rows(make_inputs(1000, 3, 128, 128, N=len(cu) - 1 if cu else 1, seed=13), 2e-2, torch.bfloat16, cu=cu,
               grad=False)
    assert not gluon_prep


@gpu
@pytest.mark.parametrize("kw", list(EXTREMES.values()), ids=list(EXTREMES))
def test_gpu_extremes(gluon_prep, kw):
    check_rows(make_inputs(300, 2, 128, 128, **kw), 2e-2, torch.bfloat16, grad=False)
    assert gluon_prep


@gpu
@pytest.mark.parametrize("splits,mode", [(2, None), (3, None), (7, None), (3, 2), (7, 2)])
def test_gpu_split_prefill(gluon_prep, monkeypatch, splits, mode):
    """The split prefill on the 16-token kernels runs the same prep: forced splits against the recurrence, in the
    library's mode (3) and in mode 2 for the split (``SplitConfig.c16_mode``)."""
    from k3.ops.kda.triton import span

    monkeypatch.setattr(span.SplitConfig, "c16_mode", mode)
    monkeypatch.setenv("K3_KDA_SPLITS", str(splits))
    check_rows(make_inputs(2000, 2, 128, 128, seed=splits), 2e-2, torch.bfloat16, grad=False)
    assert gluon_prep


@gpu
def test_gpu_windows_bitwise_and_causality(gluon_prep, monkeypatch):
    x = make_inputs(5000, 2, 128, 128, N=3)
    cu = [0, 1500, 1501, 5000]
    o_ref, h_ref = run_rows(x, torch.bfloat16, -5.0, True, cu, False)[:2]
    monkeypatch.setattr(cf.FwdConfig, "window_bytes", 1 << 20)
    o, h = run_rows(x, torch.bfloat16, -5.0, True, cu, False)[:2]
    assert torch.equal(o, o_ref) and torch.equal(h, h_ref)
    causality(1000, 2, 128, torch.bfloat16, (1, 17, 100, 511, 999))
    assert gluon_prep


def test_dispatch_takes_only_the_k3_setting(monkeypatch):
    """``usable``: off by the knob, off CPU tensors, off other dtypes, head dims, flags, modes and inverses."""
    q = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16)
    args = dict(K=128, V=128, flags=K3, lower_bound=-5.0, inv_prec="fp16x3", mode=2, u_rm=True, ring=0,
                head_major=False, fast_gate=True)
    monkeypatch.setattr(pg.GluonPrepConfig, "enabled", True)
    assert not pg.usable(q, **args)  # CPU tensor

    class FakeCuda:
        is_cuda = True
        dtype = torch.bfloat16
        device = "cuda:0"

    cuda_q = FakeCuda()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert pg.usable(cuda_q, **args) == pg.HAVE_GLUON
    assert pg.usable(cuda_q, **{**args, "mode": 3, "u_rm": False}) == pg.HAVE_GLUON
    for change in (dict(K=64), dict(V=96), dict(flags=dict(K3, l2norm=False)), dict(flags=dict(K3, use_gate=False)),
                   dict(flags=dict(K3, beta_sigmoid=False)), dict(lower_bound=None), dict(inv_prec="tf32x3"),
                   dict(mode=1), dict(u_rm=False), dict(ring=8), dict(head_major=True), dict(fast_gate=False)):
        assert not pg.usable(cuda_q, **{**args, **change}), change
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # no bf16 mma.sync
    assert not pg.usable(cuda_q, **args)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda_q.dtype = torch.float16
    assert not pg.usable(cuda_q, **args)
    monkeypatch.setattr(pg.GluonPrepConfig, "enabled", False)
    cuda_q.dtype = torch.bfloat16
    assert not pg.usable(cuda_q, **args)


_COMPILE = r"""
import os, re, subprocess, sys, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import k3.ops.kda.triton.prep_gluon as pg
fn = pg._c16_prep_gluon
types = {n: "*bf16" for n in ("q", "k", "v", "g", "beta", "X", "KG", "U")}
types.update(A_log="*fp32", dt_bias="*fp32", GAM="*fp32", cu="*i32", chunk_seq="*i32", chunk_off="*i32", c0="i32",
             NCw="i32", T="i32", NT="i32", H="i32", scale="fp32", lb="fp32")
sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
for varlen, mode3 in ((False, False), (True, False), (False, True)):
    for has_a, has_dt in ((True, True), (False, False)):
        const = dict(K=128, BT=64, BC=16, HAS_A=has_a, HAS_DT=has_dt, IS_VARLEN=varlen, MODE3=mode3)
        types["AQ"] = "*bf16" if mode3 else "constexpr"
        if not mode3:
            const["AQ"] = None
        sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
        ptrs = [n for n, t in types.items() if t.startswith("*")]
        src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
                             attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2))
        ptx = c.asm["ptx"]
        assert "mma.sync" in ptx and "ld.global" in ptx and "st.global" in ptx, const
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "k.ptx"), "w").write(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                                os.path.join(d, "k.cubin")], capture_output=True, text=True)
        assert re.search(r"\b0 bytes spill stores", r.stderr), (const, r.stderr[-1500:])
print("compiled", flush=True)
"""


@needs_gluon
def test_gluon_prep_compiles_for_sm90_without_spills():
    """Dense and varlen, with and without A_log / dt_bias, mode 2's and mode 3's stores: sm_90 code on mma.sync, no
    register spills (ptxas on this machine). In a subprocess: the interpreter, on in this process, replaces the
    Gluon helpers."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


@needs_gluon
@pytest.mark.parametrize("mode", [2, 3])
def test_launch_passes_knobs_and_mode(monkeypatch, mode):
    """``launch_prep_gluon`` hands the kernel the register cap and ptxas flags of ``GluonPrepConfig`` and, in mode 3,
    the [I | A_qkᵀ] buffer with MODE3 set (a recording stand-in for the kernel: CPU, nothing runs)."""
    spy = KernelSpy()
    monkeypatch.setattr(pg, "_c16_prep_gluon", spy)
    monkeypatch.setattr(c16.C16Config, "mode", mode)
    monkeypatch.setattr(pg.GluonPrepConfig, "maxnreg", 144)
    monkeypatch.setattr(pg.GluonPrepConfig, "ptxas_options", "--register-usage-level=0")
    q = torch.zeros(1, 100, 2, 128, dtype=torch.bfloat16)
    tab = make_chunk_table(1, 100, None, q.device)
    bufs = c16.alloc_c16_buffers(2, tab.NC, 128, 128, torch.bfloat16, q.device)
    pg.launch_prep_gluon(q, q, q, q, q[..., 0], None, None, bufs, tab, 0, tab.NC, 0.1, -5.0, 64, 16)
    (grid, _, kw), = spy.launches
    seen = dict(kw, grid=grid)
    assert seen["maxnreg"] == 144 and "--register-usage-level=0" in str(seen)
    assert seen["MODE3"] == (mode == 3) and (seen["AQ"] is bufs["AQ"] if mode == 3 else seen["AQ"] is None)
    assert seen["grid"] == (tab.NC * 4, 2) and seen["num_warps"] == 2
