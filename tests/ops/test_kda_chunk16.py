"""The 16-token inference flow of the Triton chunked KDA (``k3/ops/kda/triton/chunk16.py``,
``FwdConfig.inference_flow = "c16"``) against the fp64 token recurrence, through the public ``k3.ops.kda.chunk_kda``.

Every mode of ``C16Config`` (what the prep hands the state pass) and both 16×16 inverses. CPU: the kernels in
Triton's interpreter (fp32 / fp16), uninitialised memory poisoned with NaN. GPU (skipped without CUDA): bf16 at
K = V = 128, odd lengths, varlen, extreme gates and β, bitwise causality, several windows.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from k3.ops.kda import chunk_kda  # noqa: E402
from k3.ops.kda.triton import chunk16 as c16  # noqa: E402
from k3.ops.kda.triton import chunk_fwd as cf  # noqa: E402
from tests.ops.test_kda_prep_variants import _causality as causality  # noqa: E402
from tests.ops.test_kda_prep_variants import check as check_rows  # noqa: E402
from tests.ops.test_kda_prep_variants import make_inputs  # noqa: E402
from tests.ops.test_kda_prep_variants import run as run_rows  # noqa: E402

CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter-sized cases (CPU)")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# every gate at the bound; β ≈ 6e-6; β ≈ 1 with identical keys, also with no decay (raw gate −30: g → 0, so the 16×16
# block is all ones below the diagonal, where the product form of the inverse has its largest partial terms)
EXTREMES = {"gates_at_bound": dict(g_const=30.0), "beta_0": dict(beta_logit=-12.0),
            "beta_1_repeated_keys": dict(beta_logit=12.0, repeat_keys=True),
            "no_decay_beta_1_repeated": dict(beta_logit=12.0, repeat_keys=True, g_const=-30.0)}
VARIANTS = {"m0": dict(mode=0, prep_inv_pow=False), "m1": dict(mode=1), "m2": dict(mode=2),
            "m1_subst": dict(mode=1, prep_inv_pow=False), "m2_head_major": dict(mode=2, prep_head_major=True),
            # mode 2's state pass with per-step addresses; the prep with its loads in program order and the inverse's
            # products at 'ieee'; a register cap on the prep
            "m2_plain_addresses": dict(mode=2, state_ptr_inc=False),
            "m2_late_loads_ieee": dict(mode=2, prep_early_loads=False, prep_inv_prec="ieee"),
            "m1_maxnreg": dict(mode=1, prep_maxnreg=144),
            # [U; A_qk U] stored transposed (the default: row-major), entering the accumulator by an identity product
            # or converted in registers
            "m2_u_eye": dict(mode=2, u_rowmajor=False, state_u_eye=True),
            "m2_u_transposed": dict(mode=2, u_rowmajor=False, prep_inv_prec="tf32x3"),
            # the inverse's products at tf32x3 (the default: fp16 hi + lo splits)
            "m2_inv_tf32x3": dict(mode=2, prep_inv_prec="tf32x3"),
            # A_qk U formed by the state pass: Uᵀ [I | A_qkᵀ], one product from the loaded U and [I | A_qkᵀ] tiles
            "m3": dict(mode=3)}


@pytest.fixture(autouse=True)
def c16_flow(monkeypatch, nan_empty):
    """Every test runs the 16-token flow through the Triton backend, with NaN-poisoned torch.empty/empty_like."""
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setenv("K3_KDA_SPLITS", "1")
    monkeypatch.setattr(cf.FwdConfig, "inference_flow", "c16")


def use(monkeypatch, variant: str) -> None:
    for name, val in VARIANTS[variant].items():
        monkeypatch.setattr(c16.C16Config, name, val)


def check(x: dict, tol: float, dtype=torch.float32, cu: list[int] | None = None, h0: bool = True) -> None:
    """No-grad call (the 16-token flow) with the K3 gate, output and final state against the fp64 recurrence."""
    check_rows(x, tol, dtype, cu=cu, grad=False, h0=h0)


def run(x: dict, dtype: torch.dtype, cu: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad chunk_kda with the K3 gate → (o, final state)."""
    return run_rows(x, dtype, -5.0, True, cu, False)[:2]


# ---------------------------------------------------------------------------------------------- CPU (interpreter)


@cpu_only
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,H,K,V,h0", [(1, 1, 16, 16, True), (63, 2, 16, 32, False), (100, 2, 24, 40, True),
                                        (37, 2, 40, 20, True), (20, 1, 8, 8, True)])
def test_c16_matches_recurrence(monkeypatch, variant, T, H, K, V, h0):
    """Odd lengths, no initial state, head dims that are not powers of two (padded tiles, masked columns), K > V,
    head dims below the 16-wide tiles."""
    use(monkeypatch, variant)
    check(make_inputs(T, H, K, V, seed=T), 1e-4, h0=h0)


@cpu_only
@pytest.mark.parametrize("variant", ["m0", "m1", "m2", "m2_inv_tf32x3", "m3"])
@pytest.mark.parametrize("kw", list(EXTREMES.values()), ids=list(EXTREMES))
def test_c16_extremes(monkeypatch, variant, kw):
    use(monkeypatch, variant)
    check(make_inputs(100, 1, 16, 16, **kw), 1e-4)


@cpu_only
@pytest.mark.parametrize("variant", ["m0", "m1", "m2", "m3"])
def test_c16_varlen_with_empty_and_tiny_sequences(monkeypatch, variant):
    use(monkeypatch, variant)
    cu = [0, 1, 64, 64, 130, 200]
    check(make_inputs(200, 2, 16, 16, N=5), 1e-4, cu=cu)


@cpu_only
@pytest.mark.parametrize("variant", ["m1", "m2", "m2_u_transposed"])
def test_c16_fp16(monkeypatch, variant):
    """fp16 storage (the interpreter's half dtype): the buffers in fp16, [U; A_qk U] row-major or transposed."""
    use(monkeypatch, variant)
    check(make_inputs(100, 1, 32, 32), 2e-3, dtype=torch.float16)


@cpu_only
@pytest.mark.parametrize("variant", ["m1", "m2"])
def test_c16_windows_bitwise(monkeypatch, variant):
    """One chunk per window (the state carried between windows, a sequence across windows): bitwise the result of
    one window — the same kernels on the same blocks."""
    use(monkeypatch, variant)
    x = make_inputs(300, 2, 16, 16, N=3)
    cu = [0, 130, 131, 300]
    o_ref, h_ref = run(x, torch.float32, cu)
    monkeypatch.setattr(cf.FwdConfig, "window_bytes", 1)
    o, h = run(x, torch.float32, cu)
    assert torch.equal(o, o_ref) and torch.equal(h, h_ref)


@cpu_only
@pytest.mark.parametrize("variant", ["m0", "m1", "m2", "m3"])
def test_c16_causality_bitwise(monkeypatch, variant):
    use(monkeypatch, variant)
    causality(70, 1, 16, torch.float32, (1, 17, 37, 64))


@cpu_only
def test_c16_dispatch(monkeypatch):
    """The 16-token flow runs for bounded gates without grad only; other calls keep the 64-token kernels; bad knob
    values name the knob."""
    flags = dict(l2norm=True, use_gate=True, beta_sigmoid=True)
    bounded, unbounded = dict(flags, exact_diag=False), dict(flags, exact_diag=True)
    assert cf.use_c16(-5.0, bounded, 1, 16)
    assert not cf.use_c16(None, unbounded, 1 << 20, 128)
    monkeypatch.setattr(cf.FwdConfig, "inference_flow", "auto")  # by the state pass's program count
    n, bv = c16.C16Config.min_programs, c16.C16Config.state_bv
    assert cf.use_c16(-5.0, bounded, n // 2, 2 * bv) and not cf.use_c16(-5.0, bounded, n // 2 - 1, 2 * bv)
    assert cf.use_c16(-5.0, bounded, n, bv // 2) and not cf.use_c16(-5.0, bounded, n - 1, 16)  # one block per head
    assert not cf.use_c16(None, unbounded, n, bv)
    monkeypatch.setattr(cf.FwdConfig, "inference_flow", "c64")
    assert not cf.use_c16(-5.0, bounded, n, bv)
    monkeypatch.setattr(cf.FwdConfig, "inference_flow", "fast")
    with pytest.raises(ValueError, match="FwdConfig.inference_flow"):
        cf.use_c16(-5.0, bounded, n, bv)
    monkeypatch.setattr(c16.C16Config, "mode", 4)
    with pytest.raises(ValueError, match="C16Config.mode"):
        c16.alloc_c16_buffers(1, 1, 16, 16, torch.float32, "cpu")


@cpu_only
def test_c16_probe_ring_wraps_stores_and_loads(monkeypatch):
    """``C16Config.probe_ring`` (the L2 probe's ring of R chunks): the prep leaves slot s holding the last chunk
    c ≡ s (mod R), bitwise as the full buffers hold it; the state pass reading the ring equals it reading full
    buffers whose chunk c is the ring's slot c mod R."""
    from k3.ops.kda.triton._common import make_chunk_table
    from k3.ops.kda.triton.chunk_fwd import alloc_output_state

    monkeypatch.setattr(c16.C16Config, "mode", 2)  # the ring wraps mode 2's pointer loop only
    T, H, D, R = 64 * 5 + 7, 2, 16, 2
    x = {n: t.float() for n, t in make_inputs(T, H, D, D, seed=3).items()}
    tab = make_chunk_table(1, T, None, x["q"].device)
    flags = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)
    full = c16.alloc_c16_buffers(H, tab.NC, D, D, torch.float32, "cpu")
    ring = c16.alloc_c16_buffers(H, R, D, D, torch.float32, "cpu")
    for bufs, r in ((full, 0), (ring, R)):
        monkeypatch.setattr(c16.C16Config, "probe_ring", r)
        c16.launch_c16_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A"], x["dt"], bufs, tab, 0, tab.NC,
                            D ** -0.5, -5.0, flags)
    last = [max(c for c in range(tab.NC) if c % R == s) for s in range(R)]
    for name in full:
        assert torch.equal(ring[name], full[name][:, last]), name
    tiled = {n: b[:, [c % R for c in range(tab.NC)]].contiguous() for n, b in ring.items()}
    outs = []
    for bufs, r in ((tiled, 0), (ring, R)):
        monkeypatch.setattr(c16.C16Config, "probe_ring", r)
        o, ht = alloc_output_state(x["q"], x["v"], None, tab)
        c16.launch_c16_state(bufs, x["v"], o, ht, tab, 0, tab.NC, H, D, D)
        outs.append((o, ht))
    assert not outs[0][0].isnan().any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    monkeypatch.setattr(c16.C16Config, "state_ptr_inc", False)  # the per-step-address loop has no wrap
    with pytest.raises(ValueError, match="C16Config.probe_ring"):
        c16.launch_c16_state(ring, x["v"], o, ht, tab, 0, tab.NC, H, D, D)
    monkeypatch.setattr(c16.C16Config, "probe_ring", -1)
    with pytest.raises(ValueError, match="C16Config.probe_ring"):
        c16.launch_c16_prep(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A"], x["dt"], ring, tab, 0, tab.NC,
                            D ** -0.5, -5.0, flags)


def test_c16_fp16x3_inverse_only_for_bounded_calls(monkeypatch):
    """The fp16-split inverse needs |β A_kk| ≤ 1 (partial sums ≤ 2^14 < fp16's 65504): any call without the in-kernel
    L2 norm, β sigmoid or bounded gate falls back to 'tf32x3'; an unknown precision is a ValueError."""
    k3_call = dict(l2norm=True, beta_sigmoid=True, use_gate=True)
    monkeypatch.setattr(c16.C16Config, "prep_inv_prec", "fp16x3")
    assert c16._inv_prec(k3_call, -5.0) == "fp16x3"
    assert c16._inv_prec(k3_call, None) == "tf32x3"
    for off in k3_call:
        assert c16._inv_prec({**k3_call, off: False}, -5.0) == "tf32x3"
    monkeypatch.setattr(c16.C16Config, "prep_inv_prec", "ieee")
    assert c16._inv_prec({**k3_call, "l2norm": False}, None) == "ieee"
    monkeypatch.setattr(c16.C16Config, "prep_inv_prec", "fp16")
    with pytest.raises(ValueError, match="C16Config.prep_inv_prec"):
        c16._inv_prec(k3_call, -5.0)


@cpu_only
def test_c16_not_used_for_unbounded_gates_or_training(monkeypatch):
    """A spy on the prep launch: an unbounded gate and a call that needs gradients never reach the 16-token flow."""
    calls = []
    real = c16.launch_c16_prep
    monkeypatch.setattr(c16, "launch_c16_prep", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = make_inputs(40, 1, 16, 16)
    run(x, torch.float32, None)
    assert calls, "the bounded-gate inference call did not take the 16-token flow"
    calls.clear()
    dx = {n: t.float() for n, t in x.items()}
    with torch.no_grad():
        chunk_kda(dx["q"], dx["k"], dx["v"], dx["g"], dx["beta"], use_gate_in_kernel=True, A_log=dx["A"],
                  dt_bias=dx["dt"], use_qk_l2norm_in_kernel=True)  # unbounded softplus gate
    q = dx["q"].clone().requires_grad_()
    chunk_kda(q, dx["k"], dx["v"], dx["g"], dx["beta"], use_gate_in_kernel=True, A_log=dx["A"], dt_bias=dx["dt"],
              use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)[0].sum().backward()
    assert not calls


# ---------------------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,cu", [(1, None), (63, None), (1000, None), (1000, [0, 1, 100, 100, 613, 1000])])
def test_gpu_c16_bf16_matches_recurrence(monkeypatch, variant, T, cu):
    use(monkeypatch, variant)
    check(make_inputs(T, 4, 128, 128, N=len(cu) - 1 if cu else 1, seed=T), 2e-2, dtype=torch.bfloat16, cu=cu)


@gpu
@pytest.mark.parametrize("variant", ["m0", "m1", "m2", "m2_inv_tf32x3", "m2_u_eye", "m3"])
@pytest.mark.parametrize("kw", list(EXTREMES.values()), ids=list(EXTREMES))
def test_gpu_c16_extremes(monkeypatch, variant, kw):
    use(monkeypatch, variant)
    check(make_inputs(300, 2, 128, 128, **kw), 2e-2, dtype=torch.bfloat16)


@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.float32, 1e-4)])
def test_gpu_c16_other_dtypes(monkeypatch, dtype, tol):
    use(monkeypatch, "m1")
    check(make_inputs(300, 2, 128, 128), tol, dtype=dtype)


@gpu
@pytest.mark.parametrize("variant", ["m1", "m2", "m3"])
def test_gpu_c16_windows_and_causality(monkeypatch, variant):
    """Several windows with the prep overlapped on its own stream (and the state pass on a high-priority one):
    bitwise the single-window result; then bitwise causality."""
    use(monkeypatch, variant)
    x = make_inputs(5000, 2, 128, 128, N=3)
    cu = [0, 1500, 1501, 5000]
    o_ref, h_ref = run(x, torch.bfloat16, cu)
    monkeypatch.setattr(cf.FwdConfig, "window_bytes", 1 << 20)
    o, h = run(x, torch.bfloat16, cu)
    assert torch.equal(o, o_ref) and torch.equal(h, h_ref)
    causality(1000, 2, 128, torch.bfloat16, (1, 17, 100, 511, 999))


_COMPILE = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import k3.ops.kda.triton.chunk16 as c16

def compile_sm90(fn, types, const, warps):
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    # pointers 16-byte aligned, as the launcher's specialisation sees them (else no vectorised, asynchronous loads)
    ptrs = [n for n in fn.arg_names if types.get(n, "").startswith("*")]
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))

ptr = lambda dt: "*" + dt  # noqa: E731
for mode in eval(sys.argv[1]):
    t = {n: ptr("bf16") for n in ("q", "k", "v", "g", "beta", "X", "QG", "KG", "TB", "AQ", "U", "o")}
    t.update(A_log="*fp32", dt_bias="*fp32", GAM="*fp32", ht="*fp32", cu="*i32", chunk_seq="*i32",
             chunk_off="*i32", c0="i32", c1="i32", NCw="i32", T="i32", NT="i32", H="i32", K="i32", V="i32",
             scale="fp32", lb="fp32")
    prep = compile_sm90(c16._c16_prep, t, dict(
        BT=64, BC=16, BK=128, BVP=128, USE_GATE=True, HAS_LB=True, HAS_A=True, HAS_DT=True, L2NORM=True,
        BETA_SIGMOID=True, IS_VARLEN=False, FAST_GATE=True, PREC="tf32", AB_BF16=True, MODE=mode, INV_POW=True,
        INV_PREC="fp16x3" if mode == 2 else "tf32x3", HEAD_MAJOR=False, EARLY_LOADS=True, U_RM=mode == 2,
        RING=0), 2)
    t.pop("K"), t.pop("V")
    state = compile_sm90(c16._c16_state, t, dict(
        K=128, V=128, BT=64, BC=16, BK=128, BV=64, BVP=128, IS_VARLEN=True, PREC="tf32", STAGES=8, MODE=mode,
        PTR_INC=mode in (2, 3), U_EYE=mode == 2, U_RM=mode == 2, RING=0), 4)
    # the state pass's products run on wgmma (M = the 64-column V-block), its step loads are copied asynchronously
    assert "wgmma.mma_async" in state.asm["ptx"] and "cp.async" in state.asm["ptx"], mode
    if mode == 2:  # [U; A_qk U] reaches the accumulator through the identity product, not a register conversion
        assert state.asm["ptx"].count("wgmma.mma_async") > 9, mode
        # the L2 probe's ring (``C16Config.probe_ring``) keeps the step loads asynchronous
        ringed = compile_sm90(c16._c16_state, t, dict(
            K=128, V=128, BT=64, BC=16, BK=128, BV=64, BVP=128, IS_VARLEN=False, PREC="tf32", STAGES=8, MODE=2,
            PTR_INC=True, U_EYE=True, U_RM=True, RING=8), 4)
        assert ringed.asm["ptx"].count("cp.async") == state.asm["ptx"].count("cp.async")
    if mode in (2, 3):  # the split prefill's span pass on mode 2's / 3's buffers: wgmma, tiles copied asynchronously
        span = compile_sm90(c16._c16_span_rows, dict(t, SE="*fp32", M="*fp32", row_cs="*i32", row_ce="*i32",
                                                         row_m="*i32"),
                            dict(K=128, V=128, BT=64, BC=16, BK=128, BV=64, BVP=128, PREC="tf32", STAGES=8,
                                 U_RM=True, U_ROWS=32 if mode == 2 else 16), 4)
        assert "wgmma.mma_async" in span.asm["ptx"] and span.asm["ptx"].count("cp.async.cg") >= 3
        rev = compile_sm90(c16._c16_span_rows_rev, dict(t, SE="*fp32", M="*fp32", row_cs="*i32", row_ce="*i32",
                                                            row_m="*i32"),
                           dict(K=128, V=128, BT=64, BC=16, BK=128, BV=64, BVP=128, BR=64, PREC="tf32", STAGES=4,
                                U_RM=True, U_ROWS=32 if mode == 2 else 16), 4)
        assert "wgmma.mma_async" in rev.asm["ptx"] and rev.asm["ptx"].count("cp.async.cg") >= 4
    assert "st.global" in prep.asm["ptx"], mode
print("compiled", flush=True)
"""


@cpu_only
def test_c16_kernels_compile_for_sm90():
    """Modes 1, 2 and 3 (the default) compile to sm_90 code without a GPU (Triton's compiler and ptxas), with the
    state pass on wgmma and its loads pipelined — what the interpreter cannot check. In a subprocess: the
    interpreter is on in this process."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, repr([1, 2, 3])], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
