"""The two-kernel ``rows`` prep of the Triton chunked KDA forward (``FwdConfig.prep_mode = "rows"``,
k3/ops/kda/triton/chunk_prep.py) against the fp64 token recurrence, through the public ``k3.ops.kda.chunk_kda``.

CPU: kernels in Triton's interpreter (fp32 / fp16). Inference (no grad, the windowed path): output and final state;
training: output, final state and every input gradient (the backward consumes the prep's buffers W, U, T, qg, kg,
A_qk, γ). Uninitialised memory is poisoned with NaN. GPU (skipped without CUDA): bf16 at K = V = 128.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from k3.ops.kda import chunk_kda, naive_recurrent_kda  # noqa: E402
from k3.ops.kda.triton import chunk_fwd as cf  # noqa: E402
from k3.ops.kda.triton._common import make_chunk_table  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter-sized cases (CPU)")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def rows_mode(monkeypatch, nan_empty):
    """Every test runs the ``rows`` prep through the Triton backend, with NaN-poisoned torch.empty/empty_like (and
    inference through the 64-token flow, whose prep this is; the 16-token flow has tests of its own)."""
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(cf.FwdConfig, "prep_mode", "rows")
    monkeypatch.setattr(cf.FwdConfig, "inference_flow", "c64")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def make_inputs(T: int, H: int, K: int, V: int, N: int = 1, seed: int = 0, g_const: float | None = None,
                beta_logit: float | None = None, repeat_keys: bool = False, mild: float | None = None) -> dict:
    """fp64 inputs for B = 1 (or a packed batch of N sequences): raw gate pre-activations f, β logits.
    ``mild``: g = −mild·|N(0,1)| instead, a log-decay for ``gate=False`` slow enough that every block of the chunk
    reaches every later one (the activated random gates decay ~e^{−2.5} per step, which hides the far blocks)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V), g=r(1, T, H, K), beta=r(1, T, H),
             A=r(H) * 0.5, dt=r(H * K) * 0.5, s0=r(N, H, K, V))
    if repeat_keys:
        x["k"] = x["k"][:, :1].expand_as(x["k"]).clone()
    if mild is not None:
        x["g"] = -mild * x["g"].abs()
    if g_const is not None:
        x["g"] = torch.full_like(x["g"], g_const)
    if beta_logit is not None:
        x["beta"] = torch.full_like(x["beta"], beta_logit)
    return x


def reference(x: dict, lb: float | None, gate: bool, cu: list[int] | None, h0: bool = True):
    """fp64 recurrence on the activated inputs, per sequence → (o, final state); ``h0``: from ``x["s0"]``, else
    from zero states."""
    H, K = x["q"].shape[-2:]
    q = x["q"] / (x["q"].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    k = x["k"] / (x["k"].pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    g = x["g"]
    if gate:
        f = g + x["dt"].view(H, K)
        g = lb * torch.sigmoid(f * x["A"].exp()[:, None]) if lb is not None else \
            -x["A"].exp()[:, None] * torch.nn.functional.softplus(f)
    beta = x["beta"].sigmoid()
    cu = cu or [0, q.shape[1]]
    outs, states = [], []
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        o, s = naive_recurrent_kda(q[:, sl], k[:, sl], x["v"][:, sl], g[:, sl], beta[:, sl], K ** -0.5,
                                   x["s0"][i:i + 1] if h0 else None, True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


def run(x: dict, dtype: torch.dtype, lb: float | None, gate: bool, cu: list[int] | None, grad: bool,
        h0: bool = True):
    """chunk_kda on a copy of x (states, A_log, dt_bias fp32); with ``grad`` also backward of a random projection;
    ``h0``: from ``x["s0"]``, else without an initial state."""
    dx = {n: t.to(DEV, torch.float32 if n in ("A", "dt", "s0") else dtype).requires_grad_(grad)
          for n, t in x.items()}
    K = x["q"].shape[-1]
    o, ht = chunk_kda(dx["q"], dx["k"], dx["v"], dx["g"], dx["beta"], scale=K ** -0.5,
                      initial_state=dx["s0"] if h0 else None,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate,
                      use_beta_sigmoid_in_kernel=True, safe_gate=lb is not None, lower_bound=lb,
                      cu_seqlens=torch.tensor(cu, device=DEV) if cu is not None else None,
                      A_log=dx["A"] if gate else None, dt_bias=dx["dt"] if gate else None)
    if not grad:
        return o, ht, None, {}
    gen = torch.Generator().manual_seed(1)
    proj = (torch.randn(o.shape, generator=gen, dtype=torch.float64),
            torch.randn(ht.shape, generator=gen, dtype=torch.float64))
    ((o.double() * proj[0].to(DEV)).sum() + (ht.double() * proj[1].to(DEV)).sum()).backward()
    return o, ht, proj, {n: t.grad for n, t in dx.items() if t.grad is not None}


def check(x: dict, tol: float, dtype=torch.float32, lb: float | None = -5.0, gate: bool = True,
          cu: list[int] | None = None, grad: bool = True, tol_params: float | None = None, h0: bool = True) -> None:
    o, ht, proj, grads = run(x, dtype, lb, gate, cu, grad, h0)
    xr = {n: t.clone().requires_grad_(grad) for n, t in x.items()}
    ro, rh = reference(xr, lb, gate, cu, h0)
    errs = {"o": rel(o, ro), "ht": rel(ht, rh)}
    if grad:
        ((ro * proj[0]).sum() + (rh * proj[1]).sum()).backward()
        for n, t in xr.items():
            if n in ("A", "dt") and not gate:
                continue
            assert n in grads, f"no gradient for {n}"
            errs["d" + n] = rel(grads[n], t.grad)
    limit = {"dA": tol_params or tol, "ddt": tol_params or tol}
    bad = {n: e for n, e in errs.items() if not e <= limit.get(n, tol)}  # NaN fails too
    assert not bad, f"relative RMS error above {tol}: {bad} (all: {errs})"


# ---------------------------------------------------------------------------------------------- CPU (interpreter)


@cpu_only
@pytest.mark.parametrize("T", [1, 63, 100, 300])
def test_rows_inference_matches_recurrence(T):
    """No grad: the windowed inference path, output and final state (H = 2, K = 16, V = 32)."""
    check(make_inputs(T, 2, 16, 32, seed=T), 1e-4, grad=False)


@cpu_only
@pytest.mark.parametrize("T", [1, 63, 100])
def test_rows_training_matches_recurrence(T):
    """Training: output, final state and every gradient (q, k, v, f, β, A_log, dt_bias, initial state)."""
    check(make_inputs(T, 1, 16, 16, seed=10 + T), 1e-4)


@cpu_only
@pytest.mark.parametrize("lb", [-5.0, None])
def test_rows_slow_decay_training(lb):
    """Slow decay (log-decay given directly, |g| ~ 0.02): the far off-diagonal blocks and every term of the block
    merge matter; with and without a lower bound (reference-row and exact diagonal blocks). β ≈ 1, so T is far
    from the identity."""
    check(make_inputs(128, 1, 16, 16, seed=12, mild=0.02, beta_logit=4.0), 1e-4, lb=lb, gate=False)


@cpu_only
@pytest.mark.parametrize("case", ["gates_at_bound", "unbounded_exact_diag", "beta_near_0", "beta_near_1_same_keys"])
def test_rows_extremes_training(case):
    """Gates at the bound (every log-decay −5), no lower bound (softplus gate, exact diagonal blocks), β ≈ 6e-6,
    β ≈ 1 with identical keys (T = 100 spans two chunks)."""
    if case == "gates_at_bound":
        check(make_inputs(100, 1, 16, 16, g_const=-5.0), 1e-4, gate=False)
    elif case == "unbounded_exact_diag":
        check(make_inputs(100, 1, 16, 16, seed=4), 1e-4, lb=None)
    elif case == "beta_near_0":
        check(make_inputs(100, 1, 16, 16, beta_logit=-12.0), 1e-4)
    else:
        # dA_log is a sum whose terms cancel ~250-fold here, so its relative error is the dg error times that
        # factor (same allowance as tests/ops/test_kda_triton.py)
        check(make_inputs(100, 1, 16, 16, beta_logit=12.0, repeat_keys=True), 1e-4, tol_params=1e-3)


@cpu_only
def test_rows_varlen_training_and_windows(monkeypatch):
    """Packed batch with an empty and a one-token sequence: training vs the recurrence; then the windowed inference
    with one chunk per window equals the one-window result and the reference."""
    cu = [0, 1, 64, 64, 130, 200]
    x = make_inputs(200, 2, 16, 16, N=5, seed=5)
    check(x, 1e-4, cu=cu)
    o1, h1, *_ = run(x, torch.float32, -5.0, True, cu, False)
    monkeypatch.setattr(cf.FwdConfig, "window_bytes", 1)
    o2, h2, *_ = run(x, torch.float32, -5.0, True, cu, False)
    assert rel(o2, o1) < 1e-6 and rel(h2, h1) < 1e-6
    ro, rh = reference(x, -5.0, True, cu)
    assert rel(o2, ro) < 1e-4 and rel(h2, rh) < 1e-4


@cpu_only
@pytest.mark.parametrize("case", ["varlen", "slow_bounded"])
def test_rows_without_block_prepass(monkeypatch, case):
    """``rows_pre = False``: the rows kernel recomputes each earlier block's gate and norm itself and the solve
    recomputes the chunk's gate (no ``_prep_blocks`` buffers)."""
    monkeypatch.setattr(cf.FwdConfig, "rows_pre", False)
    if case == "varlen":
        check(make_inputs(200, 2, 16, 16, N=5, seed=5), 1e-4, cu=[0, 1, 64, 64, 130, 200])
    else:
        check(make_inputs(128, 1, 16, 16, seed=12, mild=0.02, beta_logit=4.0), 1e-4, gate=False)


@cpu_only
@pytest.mark.parametrize("per", [2, 4])
def test_rows_block_prepass_blocks_per_program(monkeypatch, per):
    """The block pre-pass with 2 or 4 sixteen-row blocks per program (a varlen batch with a ragged last chunk and
    an empty sequence, training) equals the recurrence; a count that does not divide the 4 blocks is refused."""
    monkeypatch.setattr(cf.FwdConfig, "blocks_per_program", per)
    check(make_inputs(200, 2, 16, 16, N=5, seed=5), 1e-4, cu=[0, 1, 64, 64, 130, 200])
    monkeypatch.setattr(cf.FwdConfig, "blocks_per_program", 3)
    with pytest.raises(ValueError, match="blocks_per_program"):
        run(make_inputs(70, 1, 16, 16), torch.float32, -5.0, True, None, False)


@cpu_only
@pytest.mark.parametrize("case", ["T1", "T100", "varlen_windows", "gates_at_bound", "unbounded", "split3", "k128"])
def test_rows_folded_output_inference(monkeypatch, case):
    """``fold_output``: the solve stores qw = qg − A_qk W and A_qk U, the state pass computes O = qw S + A_qk U —
    inference only (windows, the split prefill); output and final state against the recurrence. Training in the
    same configuration keeps the unfolded buffers (its gradients are checked too)."""
    monkeypatch.setattr(cf.FwdConfig, "fold_output", True)
    if case == "T1":
        check(make_inputs(1, 2, 16, 32, seed=1), 1e-4, grad=False)
    elif case == "T100":
        check(make_inputs(100, 2, 16, 32, seed=2), 1e-4, grad=False)
        check(make_inputs(100, 1, 16, 16, seed=2), 1e-4)  # training: not folded
    elif case == "varlen_windows":
        monkeypatch.setattr(cf.FwdConfig, "window_bytes", 1)  # one chunk per window: many folded windows
        check(make_inputs(200, 2, 16, 16, N=5, seed=5), 1e-4, cu=[0, 1, 64, 64, 130, 200], grad=False)
    elif case == "gates_at_bound":
        check(make_inputs(150, 1, 16, 16, g_const=-5.0), 1e-4, gate=False, grad=False)
    elif case == "unbounded":
        check(make_inputs(150, 1, 16, 16, seed=4), 1e-4, lb=None, grad=False)
    elif case == "split3":
        monkeypatch.setenv("K3_KDA_SPLITS", "3")
        check(make_inputs(400, 2, 16, 16, seed=7, mild=0.02), 1e-4, gate=False, grad=False)
    else:
        check(make_inputs(130, 1, 128, 128, seed=6), 1e-4, grad=False)


@cpu_only
def test_rows_k128_training():
    """K = V = 128 (the production head size), two chunks."""
    check(make_inputs(70, 1, 128, 128, seed=6), 1e-4)


@cpu_only
def test_rows_fp16():
    """fp16 inputs (half intermediates, tf32 products): forward and gradients within 2e-2, gates at the bound."""
    check(make_inputs(100, 1, 32, 32, seed=8), 2e-2, dtype=torch.float16)
    check(make_inputs(100, 1, 16, 16, g_const=-5.0), 2e-2, dtype=torch.float16, gate=False, grad=False)


def _training_buffers(x: dict, gate: bool) -> dict:
    """The training prep's buffers (W, U, kg, qg, A_qk, γ, T) of one dense sequence, fp32 on the CPU (interpreter),
    with the K3 flags and the bounded gate (or ``gate=False``: x's g as the log-decay)."""
    T, K = x["q"].shape[1], x["q"].shape[-1]
    tab = make_chunk_table(1, T, None, "cpu")
    a = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [x["A"].float(), x["dt"].float()]
    flags = dict(l2norm=True, use_gate=gate, beta_sigmoid=True, exact_diag=False)
    return cf.prep_all(*a, K ** -0.5, tab, -5.0, flags)


@cpu_only
@pytest.mark.parametrize("gate", [True, False])
def test_rows_buffers_match_v3(monkeypatch, gate):
    """The buffers every consumer reads (W, U, kg, qg, A_qk, γ, T) equal the v3 prep's to fp32 rounding (activated
    gate; slow decay given directly)."""
    x = make_inputs(150, 2, 16, 32, seed=9, mild=None if gate else 0.02)
    out = {}
    for mode in ("v3", "rows"):
        monkeypatch.setattr(cf.FwdConfig, "prep_mode", mode)
        out[mode] = _training_buffers(x, gate)
    for key in ("W", "U", "KG", "QG", "AQK", "GAM", "TM"):
        assert rel(out["rows"][key], out["v3"][key]) < 1e-5, key


def _causality(T: int, H: int, K: int, dtype: torch.dtype, ts: tuple[int, ...]) -> None:
    """Changing every input at positions ≥ t leaves the outputs before t bitwise unchanged."""
    x = make_inputs(T, H, K, K, seed=7)
    o, *_ = run(x, dtype, -5.0, True, None, False)
    for t in ts:
        y = {n: v.clone() for n, v in x.items()}
        gen = torch.Generator().manual_seed(t)
        for n in ("q", "k", "v", "g", "beta"):
            y[n][:, t:] = torch.randn(y[n][:, t:].shape, generator=gen, dtype=torch.float64) * 3
        o2, *_ = run(y, dtype, -5.0, True, None, False)
        assert torch.equal(o2[:, :t], o[:, :t]), f"outputs before t={t} changed"
        assert not torch.equal(o2[:, t:], o[:, t:])


@cpu_only
def test_rows_causality_bitwise():
    """t inside a sub-block, at sub-block and chunk edges (fp32, interpreter)."""
    _causality(130, 1, 16, torch.float32, (1, 17, 37, 64, 70, 127))


@cpu_only
@pytest.mark.parametrize("case", ["slow_bounded", "slow_exact", "k128_wide_slices"])
def test_rows_unstacked_variant(monkeypatch, case):
    """``rows_stack=False`` (separate q and k products, ``_prep_rows``) and one-slice W/kg (``solve_bkw=128``)."""
    monkeypatch.setattr(cf.FwdConfig, "rows_stack", False)
    if case == "k128_wide_slices":
        monkeypatch.setattr(cf.FwdConfig, "solve_bkw", 128)
        check(make_inputs(70, 1, 128, 128, seed=6), 1e-4)
    else:
        check(make_inputs(128, 1, 16, 16, seed=12, mild=0.02, beta_logit=4.0), 1e-4,
              lb=-5.0 if case == "slow_bounded" else None, gate=False)


def _prep_case(monkeypatch, case: str) -> None:
    """One of the prep-variant tests' shared cases against the fp64 recurrence: training (every gradient) on a varlen
    batch with empty and one-token sequences; every gate at the bound with β ≈ 0, or every log-decay at the bound with
    β ≈ 1 and repeated keys (the largest A_kk entries); unbounded gates (exact diagonal); fp16 with every log-decay
    at the bound; K = V = 128 inference over one-chunk windows; bitwise causality."""
    if case == "varlen_training":
        check(make_inputs(200, 2, 16, 16, N=5, seed=7), 1e-4, cu=[0, 1, 64, 64, 130, 200])
    elif case == "gates_at_bound_beta_0":
        check(make_inputs(100, 1, 16, 16, seed=3, g_const=40.0, beta_logit=-12.0), 1e-4)
    elif case == "gates_at_bound_beta_1_same_keys":
        check(make_inputs(100, 1, 16, 16, seed=3, g_const=-5.0, beta_logit=12.0, repeat_keys=True), 1e-4, gate=False)
    elif case == "unbounded":
        check(make_inputs(150, 2, 16, 16, seed=4), 1e-4, lb=None)
    elif case == "fp16_at_bound":
        check(make_inputs(100, 1, 16, 16, seed=3, g_const=-5.0), 2e-2, torch.float16, gate=False)
    elif case == "k128_windows":
        monkeypatch.setattr(cf.FwdConfig, "window_bytes", 1)
        check(make_inputs(150, 1, 128, 128, seed=6), 1e-4, grad=False)
    elif case == "causality":
        _causality(130, 1, 16, torch.float32, (1, 17, 37, 64, 70, 127))
    else:
        raise AssertionError(f"unknown case {case!r}")


@cpu_only
@pytest.mark.parametrize("knob", ["prep_fast_gate", "rows_pre_e"])
@pytest.mark.parametrize("case", ["varlen_training", "gates_at_bound", "causality", "unbounded", "fp16_at_bound"])
def test_rows_knob(monkeypatch, knob, case):
    """Two prep knobs against the recurrence: ``prep_fast_gate`` (the bounded gate and β sigmoid of the pre-pass and
    rows kernels as rsqrt(1 + 2^u)²) and ``rows_pre_e`` (the rows kernel reads E = e^s from the pre-pass, through
    the qg rows, instead of recomputing its block's gate; fp16 buffers keep the recomputation, they would flush E
    to zero). Cases: training (every gradient) on a varlen batch with empty and one-token sequences — which also
    checks the knob-off path and that the knob reaches the kernels (outputs differ in the last bits) —, every gate
    at the bound with β near 0, bitwise causality, unbounded gates (exact diagonal), fp16 with every log-decay at
    the bound."""
    x = make_inputs(200, 2, 16, 16, N=5, seed=7)
    cu = [0, 1, 64, 64, 130, 200]
    if case == "varlen_training":
        monkeypatch.setattr(cf.FwdConfig, knob, False)
        check(x, 1e-4, cu=cu)
        ref, *_ = run(x, torch.float32, -5.0, True, cu, False)
    monkeypatch.setattr(cf.FwdConfig, knob, True)
    if case == "varlen_training":
        check(x, 1e-4, cu=cu)
        o, *_ = run(x, torch.float32, -5.0, True, cu, False)
        assert not torch.equal(o, ref)
    elif case == "causality":
        _causality(130, 1, 16, torch.float32, (17, 64, 127))
    else:
        _prep_case(monkeypatch, "gates_at_bound_beta_0" if case == "gates_at_bound" else case)


@cpu_only
@pytest.mark.parametrize("kg_rows,prefetch", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("case", ["varlen_training", "gates_at_bound_beta_0", "unbounded", "causality", "fp16_at_bound",
                                  "k128_windows"])
def test_rows_kg_where_formed(monkeypatch, kg_rows, prefetch, case):
    """kg and γ formed by the rows kernel's last-block programs with kr through its own scratch (``rows_kg``, the
    default) or by the solve in place over kr, against the fp64 recurrence: training (every gradient) on a varlen
    batch with empty and one-token sequences; every gate at the bound with β near 0; unbounded gates (exact
    diagonal); bitwise causality; fp16 with every log-decay at the bound; K = V = 128 inference over one-chunk
    windows. The scratch exists exactly when the knob is on. With and without ``rows_prefetch`` (the rows kernel's
    earlier-block loads one loop step ahead)."""
    monkeypatch.setattr(cf.FwdConfig, "rows_kg", kg_rows)
    monkeypatch.setattr(cf.FwdConfig, "rows_prefetch", prefetch)
    assert ("KR" in cf.alloc_chunk_buffers(1, 1, 16, 16, torch.float32, "cpu", False)) == kg_rows
    if kg_rows:  # U's memory when V = K (the solve writes U after the rows kernel has read kr), its own otherwise
        same = cf.alloc_chunk_buffers(1, 1, 16, 16, torch.float32, "cpu", False)
        assert same["KR"].data_ptr() == same["U"].data_ptr()
        wide = cf.alloc_chunk_buffers(1, 1, 16, 32, torch.float32, "cpu", False)
        assert wide["KR"].data_ptr() != wide["U"].data_ptr() and wide["KR"].shape[-1] == 16
    _prep_case(monkeypatch, case)


@cpu_only
@pytest.mark.parametrize("case", ["varlen_training", "gates_at_bound_beta_1_same_keys", "unbounded", "causality",
                                  "k128_windows"])
def test_solve_inverse_by_products(monkeypatch, case):
    """``solve_inverse = "pow"``: the solve's diagonal 16×16 inverses as (I − L)(I + L²)(I + L⁴)(I + L⁸) instead of
    forward substitution, against the fp64 recurrence: training (every gradient) on a varlen batch with empty and
    one-token sequences; gates at the bound with β ≈ 1 and repeated keys (the largest L entries); unbounded gates;
    bitwise causality; K = V = 128 inference over one-chunk windows. The T it forms equals the substitution's."""
    if case == "varlen_training":  # T itself, both ways (training stores it)
        x = make_inputs(150, 2, 16, 16, seed=9, beta_logit=8.0, repeat_keys=True)
        ts = {}
        for mode in ("subst", "pow"):
            monkeypatch.setattr(cf.FwdConfig, "solve_inverse", mode)
            ts[mode] = _training_buffers(x, True)["TM"]
        assert rel(ts["pow"], ts["subst"]) < 1e-6
    monkeypatch.setattr(cf.FwdConfig, "solve_inverse", "pow")
    _prep_case(monkeypatch, case)
    monkeypatch.setattr(cf.FwdConfig, "solve_inverse", "lu")
    with pytest.raises(ValueError, match="solve_inverse"):
        run(make_inputs(8, 1, 16, 16), torch.float32, -5.0, True, None, False)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_solve_inverse_by_products(monkeypatch, dtype):
    """``solve_inverse = "pow"`` on the GPU (tf32x3 products; K = V = 128, a varlen batch with a ragged chunk,
    training): against the fp64 recurrence (bf16 2e-2, fp32 1e-4), and β ≈ 1 with repeated keys."""
    monkeypatch.setattr(cf.FwdConfig, "solve_inverse", "pow")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    check(make_inputs(1000, 4, 128, 128, N=3), tol, dtype, cu=[0, 333, 334, 1000])
    check(make_inputs(1000, 4, 128, 128, beta_logit=12.0, repeat_keys=True), tol, dtype)


def test_bad_prep_mode(monkeypatch):
    monkeypatch.setattr(cf.FwdConfig, "prep_mode", "nope")
    x = make_inputs(8, 1, 16, 16)
    with pytest.raises(ValueError, match="prep_mode"):
        run(x, torch.float32, -5.0, True, None, False)


# ---------------------------------------------------------------------------------------------- GPU (bf16)


@gpu
@pytest.mark.parametrize("ab_bf16", [False, True])
@pytest.mark.parametrize("case", ["random", "gates_at_bound", "beta_near_1_same_keys", "unbounded"])
def test_gpu_rows_bf16(monkeypatch, ab_bf16, case):
    monkeypatch.setattr(cf.FwdConfig, "prep_ab_bf16", ab_bf16)
    if case == "gates_at_bound":
        check(make_inputs(1000, 4, 128, 128, g_const=-5.0), 2e-2, torch.bfloat16, gate=False)
    elif case == "beta_near_1_same_keys":
        check(make_inputs(1000, 4, 128, 128, beta_logit=12.0, repeat_keys=True), 2e-2, torch.bfloat16)
    elif case == "unbounded":
        check(make_inputs(1000, 4, 128, 128), 2e-2, torch.bfloat16, lb=None)
    else:
        check(make_inputs(1000, 4, 128, 128, N=3), 2e-2, torch.bfloat16, cu=[0, 333, 334, 1000])


@gpu
@pytest.mark.parametrize("per,pre", [(1, False), (2, True), (4, True)])
def test_gpu_rows_block_prepass_variants(monkeypatch, per, pre):
    """bf16 on the GPU: without the block pre-pass, and with 2 or 4 blocks per pre-pass program, against the fp64
    recurrence (training: every gradient; a varlen batch with a ragged chunk)."""
    monkeypatch.setattr(cf.FwdConfig, "rows_pre", pre)
    monkeypatch.setattr(cf.FwdConfig, "blocks_per_program", per)
    check(make_inputs(1000, 4, 128, 128, N=3), 2e-2, torch.bfloat16, cu=[0, 333, 334, 1000])


@gpu
def test_gpu_rows_fast_gate(monkeypatch):
    """``prep_fast_gate`` in bf16 on the GPU: training against the fp64 recurrence (varlen, ragged chunk) and
    bitwise causality."""
    monkeypatch.setattr(cf.FwdConfig, "prep_fast_gate", True)
    check(make_inputs(1000, 4, 128, 128, N=3), 2e-2, torch.bfloat16, cu=[0, 333, 334, 1000])
    _causality(300, 2, 128, torch.bfloat16, (1, 17, 64, 127, 200))


@pytest.mark.gpu_quick
@gpu
def test_gpu_rows_pre_e(monkeypatch):
    """``rows_pre_e`` in bf16 on the GPU (E rounded to bf16 in the qg buffer): training against the fp64 recurrence
    (varlen, ragged chunk), every log-decay at the bound (−5 per token, so E reaches 2^-115 within a block), and
    bitwise causality."""
    monkeypatch.setattr(cf.FwdConfig, "rows_pre_e", True)
    check(make_inputs(1000, 4, 128, 128, N=3), 2e-2, torch.bfloat16, cu=[0, 333, 334, 1000])
    check(make_inputs(1000, 4, 128, 128, g_const=-5.0), 2e-2, torch.bfloat16, gate=False)
    _causality(300, 2, 128, torch.bfloat16, (1, 17, 64, 127, 200))


@gpu
@pytest.mark.parametrize("splits", ["1", "3"])
def test_gpu_rows_folded_output(monkeypatch, splits):
    """bf16 on the GPU, inference with ``fold_output`` (unsplit and a forced 3-way split): output and final state
    against the fp64 recurrence, a varlen batch with a ragged chunk, many windows."""
    monkeypatch.setattr(cf.FwdConfig, "fold_output", True)
    monkeypatch.setattr(cf.FwdConfig, "window_bytes", 1 << 20)
    monkeypatch.setenv("K3_KDA_SPLITS", splits)
    check(make_inputs(3000, 4, 128, 128, N=3), 2e-2, torch.bfloat16, cu=[0, 1333, 1334, 3000], grad=False)


@gpu
@pytest.mark.parametrize("ab_bf16,stack", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("case", ["random", "gates_at_bound", "beta_near_0"])
def test_gpu_rows_buffers_match_v3(monkeypatch, ab_bf16, stack, case):
    """Kernel by kernel on the GPU (bf16, K = V = 128, T = 1000: a ragged last chunk): every buffer of the rows prep
    (A_qk, qg from ``_prep_rows_qk`` / ``_prep_rows``; T, W, U, kg, γ from ``_prep_solve``) against the v3 prep's,
    so a failure names the kernel (the end-to-end tests only show the output or a gradient)."""
    monkeypatch.setattr(cf.FwdConfig, "prep_ab_bf16", ab_bf16)
    monkeypatch.setattr(cf.FwdConfig, "rows_stack", stack)
    x = make_inputs(1000, 4, 128, 128, seed=3, g_const=20.0 if case == "gates_at_bound" else None,
                    beta_logit=-12.0 if case == "beta_near_0" else None)
    tab = make_chunk_table(1, 1000, None, torch.device(DEV))
    a = [x[n].to(DEV, torch.bfloat16) for n in ("q", "k", "v", "g", "beta")]
    a += [x["A"].to(DEV, torch.float32), x["dt"].to(DEV, torch.float32)]
    flags = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)
    out = {}
    for mode in ("v3", "rows"):
        monkeypatch.setattr(cf.FwdConfig, "prep_mode", mode)
        out[mode] = cf.prep_all(*a, 128 ** -0.5, tab, -5.0, flags)
    torch.cuda.synchronize()
    for key in ("AQK", "QG", "TM", "W", "U", "KG", "GAM"):
        assert torch.isfinite(out["rows"][key]).all(), key
        assert rel(out["rows"][key], out["v3"][key]) < 2e-2, key


@pytest.mark.gpu_quick
@gpu
def test_gpu_rows_one_million_tokens_matches_v3(monkeypatch):
    """T = 2^20 (windowed inference, bf16, K = V = 128): finite, and the rows prep's output equals the v3 prep's
    within bf16 noise."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    T, H, K = 1 << 20, 2, 128
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, f, b = r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H)
    A, dt = torch.zeros(H, device=DEV), torch.zeros(H * K, device=DEV)
    kw = dict(scale=K ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=A, dt_bias=dt)
    with torch.no_grad():
        o, h = chunk_kda(q, k, v, f, b, **kw)
        monkeypatch.setattr(cf.FwdConfig, "prep_mode", "v3")
        o3, h3 = chunk_kda(q, k, v, f, b, **kw)
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    assert rel(o, o3) < 2e-2 and rel(h, h3) < 2e-2


@pytest.mark.gpu_quick
@gpu
@pytest.mark.parametrize("ab_bf16", [False, True])
def test_gpu_rows_causality_bitwise(monkeypatch, ab_bf16):
    monkeypatch.setattr(cf.FwdConfig, "prep_ab_bf16", ab_bf16)
    _causality(300, 2, 128, torch.bfloat16, (1, 17, 37, 64, 70, 127, 200))
