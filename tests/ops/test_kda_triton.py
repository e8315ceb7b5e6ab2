"""Triton KDA kernels (k3.ops.kda.triton) against the fp64 token recurrence.

CPU: the kernels run in Triton's interpreter (TRITON_INTERPRET=1, fp32/fp16; small K, H, T to fit the budget).
GPU (skipped without CUDA): bf16 at K = V = 128, tolerance 2e-2, and a T = 1M no-NaN run.
Every torch.empty/empty_like inside the calls is poisoned with NaN, so any element a kernel forgets to write (or
reads before writing) shows up as NaN in the compared results.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from k3.ops.kda import naive_recurrent_kda  # noqa: E402
from k3.ops.kda.triton import (  # noqa: E402
    chunk_kda_triton,
    fused_recurrent_kda_triton,
    span_summaries_triton,
)
from k3.ops.kda.triton.chunk_bwd import BwdConfig  # noqa: E402
from k3.ops.kda.triton.chunk_fwd import FwdConfig  # noqa: E402
from tests.ops.kernel_spy import KernelSpy  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter-sized cases (CPU)")
pytestmark = pytest.mark.usefixtures("nan_empty")  # every output the kernels must write starts as NaN


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))



def _pre(q, k, g, beta, A, dt, l2, gate, bsig, lb):
    """The fused pre-processing in fp64: L2 norm, gate activation, β sigmoid."""
    H, K = q.shape[-2], q.shape[-1]
    if l2:
        q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    if gate:
        x = g + dt.view(H, K)
        g = lb * torch.sigmoid(x * A.exp()[:, None]) if lb is not None else \
            -A.exp()[:, None] * torch.nn.functional.softplus(x)
    return q, k, g, (beta.sigmoid() if bsig else beta)


def reference(x: dict, scale, l2, gate, bsig, lb, cu):
    """fp64 token recurrence per sequence → (o, final state)."""
    q, k, g, beta = _pre(x["q"], x["k"], x["g"], x["beta"], x.get("A"), x.get("dt"), l2, gate, bsig, lb)
    v, s0 = x["v"], x.get("s0")
    if cu is None:
        return naive_recurrent_kda(q, k, v, g, beta, scale, s0, True)
    outs, states = [], []
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        o, s = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale,
                                   None if s0 is None else s0[i:i + 1], True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


def make_inputs(B, T, H, K, V, N=None, h0=True, gate=True, seed=0, g_override=None, beta_logit=None,
                repeat_keys=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=r(B, T, H, K) if gate else -r(B, T, H, K).abs(),
             beta=r(B, T, H), A=r(H) * 0.5, dt=r(H * K) * 0.5)
    if repeat_keys:
        x["k"] = x["k"][:, :1].expand_as(x["k"]).clone()
    if g_override is not None:
        x["g"] = torch.full_like(x["g"], g_override)
    if beta_logit is not None:
        x["beta"] = torch.full_like(x["beta"], beta_logit)
    if h0:
        x["s0"] = r(N if N is not None else B, H, K, V)
    return x


def run_chunk(x: dict, dtype, l2=True, gate=True, bsig=True, lb=-5.0, cu=None, grad=True, out_final=True):
    """chunk_kda_triton on a copy of x in ``dtype`` (states fp32); returns (o, ht, grads dict, do, dht)."""
    dev_x = {}
    for n, t in x.items():
        dt = torch.float32 if n in ("A", "dt", "s0") else dtype
        dev_x[n] = t.to(DEV, dt).requires_grad_(grad)
    K = x["q"].shape[-1]
    cus = torch.tensor(cu, device=DEV) if cu is not None else None
    o, ht = chunk_kda_triton(dev_x["q"], dev_x["k"], dev_x["v"], dev_x["g"], dev_x["beta"], K ** -0.5,
                             dev_x.get("s0"), out_final, l2, gate, bsig, lb, cus,
                             dev_x["A"] if gate else None, dev_x["dt"] if gate else None)
    if not grad:
        return o, ht, {}, None, None
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    ((o.double() * do.to(DEV)).sum() + (ht.double() * dht.to(DEV)).sum()).backward()
    grads = {n: t.grad for n, t in dev_x.items() if t.grad is not None}
    return o, ht, grads, do, dht


def errors_against_reference(x, dtype=torch.float32, l2=True, gate=True, bsig=True, lb=-5.0, cu=None) -> dict:
    """Relative RMS error of the output, the final state and every gradient against the fp64 recurrence."""
    o, ht, grads, do, dht = run_chunk(x, dtype, l2, gate, bsig, lb, cu)
    xr = {n: t.clone().requires_grad_() for n, t in x.items()}
    ro, rh = reference(xr, x["q"].shape[-1] ** -0.5, l2, gate, bsig, lb, cu)
    ((ro * do).sum() + (rh * dht).sum()).backward()
    errs = {"o": rel(o, ro), "ht": rel(ht, rh)}
    for n, t in xr.items():
        if n in ("A", "dt") and not gate:
            continue
        assert n in grads, f"no gradient for {n}"
        errs["d" + n] = rel(grads[n], t.grad)
    return errs


def check_against_reference(x, tol, dtype=torch.float32, l2=True, gate=True, bsig=True, lb=-5.0, cu=None,
                            tol_params=None):
    errs = errors_against_reference(x, dtype, l2, gate, bsig, lb, cu)
    limit = {"dA": tol_params or tol, "dt": tol_params or tol}
    bad = {n: e for n, e in errs.items() if not e <= limit.get(n, tol)}  # NaN fails too
    assert not bad, f"relative RMS error above {tol}: {bad} (all: {errs})"


# ---------------------------------------------------------------------------------------------- CPU (interpreter)

CASES = [  # (B, T, H, K, V, kwargs, reference kwargs)
    (1, 1, 1, 16, 16, {}, {}),
    (2, 63, 2, 32, 16, {"h0": False}, {}),
    (1, 100, 1, 16, 32, {}, {}),
    (1, 100, 1, 16, 16, {}, {"lb": None}),  # unbounded softplus gate (exact diagonal path)
    (1, 100, 2, 16, 16, {"gate": False}, {"gate": False, "lb": None}),  # log-decay given directly, unbounded
    (1, 100, 1, 16, 16, {"gate": False, "g_override": -5.0}, {"gate": False}),  # every log-decay at the bound
    (1, 100, 1, 16, 16, {"beta_logit": -12.0}, {}),  # β ≈ 6e-6
    # β ≈ 1 with identical keys. dA_log here is a sum whose terms cancel ~250-fold (|Σ| ≪ Σ|·|), so its relative
    # error is the dg error (~5e-6, within 1e-4) times that factor: checked at 1e-3 (seed-dependent: 2e-8..2e-4).
    (1, 100, 1, 16, 16, {"beta_logit": 12.0, "repeat_keys": True}, {"tol_params": 1e-3}),
    (1, 100, 1, 16, 16, {}, {"l2": False, "bsig": False}),
    (1, 100, 2, 24, 40, {}, {}),  # head dims that are not powers of two (padded tiles, masked columns)
]


@cpu_only
@pytest.mark.parametrize("B,T,H,K,V,kw,rkw", CASES)
def test_chunk_fwd_bwd_matches_recurrence(B, T, H, K, V, kw, rkw):
    x = make_inputs(B, T, H, K, V, **kw)
    if not rkw.get("bsig", True):
        x["beta"] = x["beta"].sigmoid()
        x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    check_against_reference(x, 1e-4, **rkw)


@cpu_only
def test_backward_with_broadcast_output_gradients():
    """``(o.sum() + ht.sum()).backward()`` hands the backward stride-0 (expanded) gradients of o and the final
    state: the gradients equal those from dense tensors of ones."""
    x = make_inputs(1, 70, 2, 16, 16)

    def grads(dense: bool) -> list[torch.Tensor]:
        xs = {n: t.float().clone().requires_grad_() for n, t in x.items()}
        o, ht = chunk_kda_triton(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 0.25, xs["s0"], True, True, True,
                                 True, -5.0, None, xs["A"], xs["dt"])
        if dense:
            torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
        else:
            (o.sum() + ht.sum()).backward()
        return [xs[n].grad for n in ("q", "k", "v", "g", "beta", "s0", "A", "dt")]

    for a, b in zip(grads(False), grads(True)):
        assert torch.equal(a, b)


@cpu_only
def test_chunk_varlen_with_empty_and_tiny_sequences():
    cu = [0, 1, 64, 64, 130, 200]
    x = make_inputs(1, 200, 2, 16, 16, N=5)
    check_against_reference(x, 1e-4, cu=cu)


@cpu_only
def test_chunk_two_column_slices_k128():
    """K = V = 128 takes the two-slice path of the prep kernel (BKS = 64)."""
    x = make_inputs(1, 70, 1, 128, 128)
    check_against_reference(x, 1e-4)


@cpu_only
def test_chunk_long_tiny():
    x = make_inputs(1, 1000, 1, 16, 16, seed=3)
    check_against_reference(x, 1e-4)


@cpu_only
@pytest.mark.parametrize("bad", [1, 0, 2.5, "2"])
def test_window_buffers_validated(monkeypatch, bad):
    """The overlapped windows' ring needs at least two buffers: anything else is a ValueError naming the knob."""
    monkeypatch.setattr(FwdConfig, "window_buffers", bad)
    x = make_inputs(1, 100, 1, 16, 16)
    with pytest.raises(ValueError, match="FwdConfig.window_buffers"):
        run_chunk(x, torch.float32, grad=False)


@cpu_only
@pytest.mark.parametrize("flow", ["c16", "c64"])
def test_inference_windows_match_training_path(monkeypatch, flow):
    """No-grad prefill runs in windows of chunks (bounded memory), by either inference flow: the same result as the
    training path's one window."""
    monkeypatch.setattr(FwdConfig, "inference_flow", flow)
    x = make_inputs(1, 300, 2, 16, 16, N=3)
    cu = [0, 130, 131, 300]
    o_ref, h_ref, *_ = run_chunk(x, torch.float32, cu=cu, grad=False)
    monkeypatch.setattr(FwdConfig, "window_bytes", 1)  # one chunk per window
    o, h, *_ = run_chunk(x, torch.float32, cu=cu, grad=False)
    assert rel(o, o_ref) < 1e-6 and rel(h, h_ref) < 1e-6


@cpu_only
def test_fp16_forward():
    x = make_inputs(1, 100, 1, 32, 32)
    o, ht, *_ = run_chunk(x, torch.float16, grad=False)
    ro, rh = reference(x, 32 ** -0.5, True, True, True, -5.0, None)
    assert rel(o, ro) < 2e-2 and rel(ht, rh) < 2e-2


@cpu_only
@pytest.mark.parametrize("safe_gate,glo,fast", [(False, -12.0, False), (True, -5.0, True), (True, -3.0, True)])
def test_public_precomputed_gate_with_lower_bound(monkeypatch, safe_gate, glo, fast):
    """The public ``chunk_kda`` with a precomputed g and ``lower_bound`` set (fla's meaning): without safe_gate the
    bound promises nothing, so log-decays far below it (−12 here: e^{12·15} overflows fp32 in the fast diagonal
    blocks) take the exact path; with safe_gate the caller promises g ≥ bound and the fast path runs. Output, final
    state and every gradient against the fp64 recurrence."""
    from k3.ops.kda import chunk_kda
    from k3.ops.kda.triton import chunk as tchunk

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    seen = []
    real = tchunk._flags
    monkeypatch.setattr(tchunk, "_flags", lambda *a: seen.append(real(*a)) or seen[-1])
    x = make_inputs(1, 100, 1, 16, 16, gate=False)
    gen = torch.Generator().manual_seed(3)
    x["g"] = glo * torch.rand(x["g"].shape, generator=gen, dtype=torch.float64)  # in (glo, 0]
    xt = {n: t.float().requires_grad_() for n, t in x.items() if n not in ("A", "dt")}
    o, ht = chunk_kda(xt["q"], xt["k"], xt["v"], xt["g"], xt["beta"], initial_state=xt["s0"],
                      output_final_state=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      safe_gate=safe_gate, lower_bound=-5.0 if glo < -5 else glo)
    assert [f["exact_diag"] for f in seen] == [not fast]
    xr = {n: t.clone().requires_grad_() for n, t in x.items() if n not in ("A", "dt")}
    ro, rh = reference(xr, 16 ** -0.5, True, False, True, None, None)
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(ro.shape, generator=gen, dtype=torch.float64), torch.randn(rh.shape, generator=gen,
                                                                                     dtype=torch.float64)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((ro * do).sum() + (rh * dht).sum()).backward()
    errs = {"o": rel(o, ro), "ht": rel(ht, rh), **{"d" + n: rel(xt[n].grad, xr[n].grad) for n in xt}}
    assert all(e <= 1e-4 for e in errs.values()), errs


@cpu_only
@pytest.mark.parametrize("K,bk", [(16, 64), (32, 16)])  # K in one K-slice (dq, dk finish in registers) or in two
@pytest.mark.parametrize("fast", [False, True])
def test_dg_accurate_with_every_decay_at_the_bound(monkeypatch, fast, K, bk):
    """Every log-decay at −5: dg is small against the shares of dG it is summed from, so rounding that cancels
    to zero mathematically shows. A_qk's diagonal (decay e^0, dG shares that cancel exactly) stays out of the
    products. dg's relative RMS here (exact diagonal blocks / bounded fast path): K = 16 4.9e-6 / 7.2e-6, K = 32
    in two slices 6.8e-6 / 7.4e-6; with the diagonal in the products 6.0e-5 / 8.5e-5 and 2.4e-5 / 3.6e-5."""
    from k3.ops.kda.triton.chunk_bwd import BwdConfig

    monkeypatch.setattr(BwdConfig, "intra_split_bk", bk)
    x = make_inputs(1, 130, 1, K, 16, gate=False, g_override=-5.0, beta_logit=7.0)
    check_against_reference(x, 1.5e-5, gate=False, lb=-5.0 if fast else None)


def _causality(T, H, K, V, dtype, ts):
    x = make_inputs(1, T, H, K, V, seed=7)
    o, *_ = run_chunk(x, dtype, grad=False, out_final=False)
    for t in ts:
        y = {n: v.clone() for n, v in x.items()}
        gen = torch.Generator().manual_seed(t)
        for n in ("q", "k", "v", "g", "beta"):
            y[n][:, t:] = torch.randn(y[n][:, t:].shape, generator=gen, dtype=torch.float64) * 3
        o2, *_ = run_chunk(y, dtype, grad=False, out_final=False)
        assert torch.equal(o2[:, :t], o[:, :t]), f"outputs before t={t} changed"
        assert not torch.equal(o2[:, t:], o[:, t:])


@cpu_only
@pytest.mark.parametrize("flow", ["c16", "c64"])
def test_causality_bitwise(monkeypatch, flow):
    monkeypatch.setattr(FwdConfig, "inference_flow", flow)
    _causality(130, 1, 16, 16, torch.float32, [1, 17, 37, 64, 70, 127])


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a buffer twice as long)."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    buf[..., ::2] = t
    return buf[..., ::2]


def test_public_strided_inputs(monkeypatch):
    """Every tensor argument as a strided view (q…beta, the initial state, A_log, dt_bias) through the public entry
    points on the Triton backend: outputs, final states and every gradient against the fp64 recurrence. A strided
    initial_state or gate parameter gave wrong results before the entry points made them contiguous."""
    from k3.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: PLC0415

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.delenv("K3_KDA_SPLITS", raising=False)
    x = make_inputs(2, 21, 2, 16, 16, seed=6)
    leaves = {n: t.to(DEV, torch.float32).requires_grad_() for n, t in x.items()}
    views = {n: _strided(t) for n, t in leaves.items()}
    assert not any(t.is_contiguous() for t in views.values())
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
              lower_bound=-5.0, output_final_state=True)
    args = [views[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = chunk_kda(*args, initial_state=views["s0"], A_log=views["A"], dt_bias=views["dt"], **kw)
    gen = torch.Generator().manual_seed(1)
    do, dht = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, ht))
    ((o.double() * do.to(DEV)).sum() + (ht.double() * dht.to(DEV)).sum()).backward()
    xr = {n: t.clone().requires_grad_() for n, t in x.items()}
    ro, rh = reference(xr, 16 ** -0.5, True, True, True, -5.0, None)
    ((ro * do).sum() + (rh * dht).sum()).backward()
    errs = {"o": rel(o, ro), "ht": rel(ht, rh), **{"d" + n: rel(leaves[n].grad, xr[n].grad) for n in x}}
    assert all(e <= 1e-4 for e in errs.values()), errs
    with torch.no_grad():
        od, hd = fused_recurrent_kda(*args, views["A"], views["dt"], initial_state=views["s0"], **kw)
    assert rel(od, ro) <= 1e-4 and rel(hd, rh) <= 1e-4


def test_public_grouped_value_attention(monkeypatch):
    """fla's GVA through the public entry points on the Triton backend (q/k with H heads, the rest with 2H):
    outputs, final states and every gradient against the fp64 recurrence with value head j reading head j // 2."""
    from k3.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: PLC0415

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.delenv("K3_KDA_SPLITS", raising=False)
    B, T, H, HV, K, V = 1, 37, 2, 4, 16, 16
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K), beta=r(B, T, HV),
             s0=r(B, HV, K, V), A=r(HV) * 0.5, dt=r(HV * K) * 0.5)
    ins = {n: t.to(DEV, torch.float32).requires_grad_() for n, t in x.items()}
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
              lower_bound=-5.0, output_final_state=True)
    o, ht = chunk_kda(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], initial_state=ins["s0"], A_log=ins["A"],
                      dt_bias=ins["dt"], **kw)
    do, dht = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(ht.shape, generator=gen,
                                                                                   dtype=torch.float64)
    ((o.double() * do.to(DEV)).sum() + (ht.double() * dht.to(DEV)).sum()).backward()
    xr = {n: t.clone().requires_grad_() for n, t in x.items()}
    head = torch.arange(HV) // (HV // H)
    xg = dict(xr, q=xr["q"][:, :, head], k=xr["k"][:, :, head])
    ro, rh = reference(xg, K ** -0.5, True, True, True, -5.0, None)
    ((ro * do).sum() + (rh * dht).sum()).backward()
    errs = {"o": rel(o, ro), "ht": rel(ht, rh), **{"d" + n: rel(ins[n].grad, xr[n].grad) for n in x}}
    assert all(e <= 1e-4 for e in errs.values()), errs
    with torch.no_grad():
        od, hd = fused_recurrent_kda(*(ins[n] for n in ("q", "k", "v", "g", "beta", "A", "dt")),
                                     initial_state=ins["s0"], **kw)
    assert rel(od, ro) <= 1e-4 and rel(hd, rh) <= 1e-4


@cpu_only
def test_decode_matches_recurrence_and_pool_in_place():
    B, T, H, K, V = 3, 4, 2, 16, 32
    x = make_inputs(B, T, H, K, V)
    ro, rh = reference(x, K ** -0.5, True, True, True, -5.0, None)
    f = {n: t.float() for n, t in x.items()}
    args = (f["q"], f["k"], f["v"], f["g"], f["beta"], K ** -0.5)
    o, h = fused_recurrent_kda_triton(*args, f["s0"], True, True, True, True, -5.0, None, f["A"], f["dt"])
    assert rel(o, ro) < 1e-5 and rel(h, rh) < 1e-5
    # pool: slots 4, -1 (no state, nothing written), 1; other slots bitwise untouched
    pool = torch.randn(6, H, K, V)
    pool[4], pool[1] = f["s0"][0], f["s0"][2]
    before = pool.clone()
    o2, p2 = fused_recurrent_kda_triton(*args, pool, False, True, True, True, -5.0, None, f["A"], f["dt"],
                                        ssm_state_indices=torch.tensor([4, -1, 1]))
    assert p2 is pool
    assert rel(pool[4], rh[0]) < 1e-5 and rel(pool[1], rh[2]) < 1e-5
    assert torch.equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
    x0 = dict(x, s0=torch.zeros_like(x["s0"]))
    ro0, _ = reference(x0, K ** -0.5, True, True, True, -5.0, None)
    assert rel(o2[1], ro0[1]) < 1e-5 and rel(o2[[0, 2]], ro[[0, 2]]) < 1e-5


@cpu_only
def test_decode_varlen_unbounded_gate():
    cu = [0, 2, 2, 7]
    x = make_inputs(1, 7, 2, 16, 16, N=3)
    ro, rh = reference(x, 16 ** -0.5, True, True, True, None, cu)
    f = {n: t.float() for n, t in x.items()}
    o, h = fused_recurrent_kda_triton(f["q"], f["k"], f["v"], f["g"], f["beta"], 0.25, f["s0"], True, True, True,
                                      True, None, torch.tensor(cu), f["A"], f["dt"])
    assert rel(o, ro) < 1e-5 and rel(h, rh) < 1e-5


@cpu_only
def test_span_summaries_affine_map():
    cu = [0, 70, 70, 150]
    x = make_inputs(1, 150, 2, 16, 32, N=3)
    f = {n: t.float() for n, t in x.items()}
    M, E = span_summaries_triton(f["q"], f["k"], f["v"], f["g"], f["beta"], 0.25, True, True, True, -5.0,
                                 torch.tensor(cu), f["A"], f["dt"])
    _, rh = reference(x, 0.25, True, True, True, -5.0, cu)
    _, rh0 = reference(dict(x, s0=torch.zeros_like(x["s0"])), 0.25, True, True, True, -5.0, cu)
    assert rel(E, rh0) < 1e-5
    assert rel(M.double() @ x["s0"] + E.double(), rh) < 1e-5
    assert torch.equal(M[1], torch.eye(16).expand(2, 16, 16))


# kernel variants (bench/kda_sweep.py times them; the defaults are its fastest correct choice). The bf16-operand
# variant only differs from fp32 operands for bf16 inputs, which the interpreter cannot load: GPU tests below.
PREP_VARIANTS = {
    "reduction_inverse": dict(prep_inv_scratch=False, prep_split=False),
    "scratch_inverse": dict(prep_inv_scratch=True, prep_split=False),
    "split_prep": dict(prep_inv_scratch=True, prep_split=True),
}


def _set_variant(monkeypatch, variant: str) -> None:
    for name, val in PREP_VARIANTS[variant].items():
        monkeypatch.setattr(FwdConfig, name, val)


@cpu_only
@pytest.mark.parametrize("variant", list(PREP_VARIANTS))
@pytest.mark.parametrize("B,T,H,K,V,kw,rkw", [CASES[5], CASES[7], (1, 70, 1, 128, 128, {}, {})])
def test_prep_variants_match_recurrence(monkeypatch, variant, B, T, H, K, V, kw, rkw):
    """Every prep-kernel variant: gates at the bound, β ≈ 1 with identical keys, K = V = 128."""
    _set_variant(monkeypatch, variant)
    x = make_inputs(B, T, H, K, V, **kw)
    check_against_reference(x, 1e-4, **rkw)


@cpu_only
@pytest.mark.parametrize("B,T,H,K,V,kw,rkw", [CASES[5], CASES[7], (1, 70, 1, 128, 128, {}, {})])
def test_intra_backward_recompute_variant(monkeypatch, B, T, H, K, V, kw, rkw):
    """The intra-chunk backward that reloads k̂ and recomputes the gate factors instead of keeping them live."""
    monkeypatch.setattr(BwdConfig, "intra_recompute", True)
    x = make_inputs(B, T, H, K, V, **kw)
    check_against_reference(x, 1e-4, **rkw)


@cpu_only
@pytest.mark.parametrize("variant", ["scratch_inverse", "split_prep"])
def test_prep_variants_windows_varlen_causality(monkeypatch, variant):
    """Windowed inference over a varlen batch (one chunk per window) equals the training path; bitwise causality."""
    _set_variant(monkeypatch, variant)
    x = make_inputs(1, 300, 2, 16, 16, N=3)
    cu = [0, 130, 131, 300]
    o_ref, h_ref, *_ = run_chunk(x, torch.float32, cu=cu, grad=False)
    xr = {n: t.clone().requires_grad_() for n, t in x.items()}
    ro, rh = reference(xr, 16 ** -0.5, True, True, True, -5.0, cu)
    assert rel(o_ref, ro) < 1e-4 and rel(h_ref, rh) < 1e-4
    monkeypatch.setattr(FwdConfig, "window_bytes", 1)
    o, h, *_ = run_chunk(x, torch.float32, cu=cu, grad=False)
    assert rel(o, o_ref) < 1e-6 and rel(h, h_ref) < 1e-6
    _causality(130, 1, 16, 16, torch.float32, [17, 64, 127])


# ---------------------------------------------------------------------------------------------- GPU (bf16)


GPU_VARIANTS = {
    "scratch_inverse": (dict(prep_inv_scratch=True), {}),
    "bf16_operands": (dict(prep_inv_scratch=True, prep_ab_bf16=True), {}),
    "split_bf16_4w": (dict(prep_inv_scratch=True, prep_ab_bf16=True, prep_split=True, prep_warps=4), {}),
    "intra_bf16x3": ({}, dict(intra_prec_half="bf16x3")),
    "intra_recompute_bf16x3": ({}, dict(intra_prec_half="bf16x3", intra_recompute=True)),
}


@gpu
@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
@pytest.mark.parametrize("kw,rkw", [({}, {}), ({"gate": False, "g_override": -5.0}, {"gate": False}),
                                    ({"beta_logit": 12.0, "repeat_keys": True}, {}), ({"beta_logit": -12.0}, {})])
def test_gpu_bf16_variants(monkeypatch, variant, kw, rkw):
    fwd, bwd = GPU_VARIANTS[variant]
    for name, val in fwd.items():
        monkeypatch.setattr(FwdConfig, name, val)
    for name, val in bwd.items():
        monkeypatch.setattr(BwdConfig, name, val)
    x = make_inputs(1, 300, 2, 128, 128, **kw)
    check_against_reference(x, 2e-2, dtype=torch.bfloat16, **rkw)



@gpu
@pytest.mark.parametrize("T,cu,lb", [(1, None, -5.0), (63, None, -5.0), (1000, None, -5.0), (1000, None, None),
                                     (1000, [0, 1, 100, 100, 613, 1000], -5.0)])
def test_gpu_bf16_matches_recurrence(T, cu, lb):
    N = len(cu) - 1 if cu else 2
    B = 1 if cu else 2
    x = make_inputs(B, T, 4, 128, 128, N=N)
    check_against_reference(x, 2e-2, dtype=torch.bfloat16, lb=lb, cu=cu)


@pytest.mark.gpu_quick
@gpu
@pytest.mark.parametrize("kw,rkw", [({"gate": False, "g_override": -5.0}, {"gate": False}),
                                    ({"beta_logit": 12.0, "repeat_keys": True}, {}), ({"beta_logit": -12.0}, {})])
def test_gpu_bf16_extremes(kw, rkw):
    x = make_inputs(1, 300, 2, 128, 128, **kw)
    check_against_reference(x, 2e-2, dtype=torch.bfloat16, **rkw)


@gpu
def test_gpu_fp16_gates_at_bound():
    """Same extreme case in fp16 (tf32 intra-chunk dots like bf16, 3 more mantissa bits in storage)."""
    x = make_inputs(1, 300, 2, 128, 128, gate=False, g_override=-5.0)
    check_against_reference(x, 2e-2, dtype=torch.float16, gate=False)


@pytest.mark.gpu_quick
@gpu
@pytest.mark.parametrize("flow,priority,nbuf", [("c16", True, 2), ("c16", False, 2), ("c64", True, 2),
                                                ("c64", False, 2), ("c16", True, 3), ("c64", True, 4)])
def test_gpu_overlapped_windows_bitwise(monkeypatch, flow, priority, nbuf):
    """Prep on a side stream up to ``window_buffers`` − 1 windows ahead of the state pass (itself on a high-priority
    stream or on the caller's): the same kernels in the same order per window, so the result is bitwise that of the
    serial windows (several windows, varlen, a sequence across windows), twice in a row."""
    monkeypatch.setattr(FwdConfig, "inference_flow", flow)
    monkeypatch.setattr(FwdConfig, "state_priority", priority)
    monkeypatch.setattr(FwdConfig, "window_buffers", nbuf)
    x = make_inputs(1, 5000, 2, 128, 128, N=3)
    cu = [0, 1500, 1501, 5000]
    monkeypatch.setattr(FwdConfig, "window_bytes", 1 << 20)
    monkeypatch.setattr(FwdConfig, "overlap_windows", False)
    o_ref, h_ref, *_ = run_chunk(x, torch.bfloat16, cu=cu, grad=False)
    monkeypatch.setattr(FwdConfig, "overlap_windows", True)
    for _ in range(2):
        o, h, *_ = run_chunk(x, torch.bfloat16, cu=cu, grad=False)
        assert torch.equal(o, o_ref) and torch.equal(h, h_ref)


@pytest.mark.gpu_quick
@gpu
def test_gpu_fp32_k128():
    """fp32 at K = V = 128: its state-pass buffers need twice the shared memory per pipeline stage (the 3-stage
    bf16 setting did not fit an H200 SM)."""
    x = make_inputs(1, 300, 2, 128, 128)
    check_against_reference(x, 1e-4, dtype=torch.float32)


@gpu
def test_gpu_fp32_tight():
    x = make_inputs(1, 300, 2, 64, 64)
    check_against_reference(x, 1e-4, dtype=torch.float32)


@gpu
@pytest.mark.parametrize("K,V", [(64, 128), (128, 64), (32, 32), (100, 72), (16, 128)])
@pytest.mark.parametrize("kw,rkw", [({}, {}), ({"gate": False}, {"gate": False, "lb": None})])
def test_gpu_bf16_head_dims(K, V, kw, rkw):
    """Head dims other than K = V = 128 in bf16 (K ≠ V, not powers of two), varlen with initial states, the K3
    flags and an unbounded precomputed gate: outputs, states and every gradient, forward with and without grad."""
    cu = [0, 5, 70, 71, 200]
    x = make_inputs(1, 200, 2, K, V, N=len(cu) - 1, **kw)
    check_against_reference(x, 2e-2, dtype=torch.bfloat16, cu=cu, **rkw)
    o, ht, _, _, _ = run_chunk(x, torch.bfloat16, cu=cu, grad=False, gate=rkw.get("gate", True),
                               lb=rkw.get("lb", -5.0))
    ro, rh = reference(x, K ** -0.5, True, rkw.get("gate", True), True, rkw.get("lb", -5.0), cu)
    assert rel(o, ro) <= 2e-2 and rel(ht, rh) <= 2e-2


@gpu
@pytest.mark.parametrize("flow", ["c16", "c64"])
def test_gpu_causality_bitwise(monkeypatch, flow):
    monkeypatch.setattr(FwdConfig, "inference_flow", flow)
    _causality(1000, 2, 128, 128, torch.bfloat16, [1, 17, 100, 511, 999])


@pytest.mark.gpu_quick
@gpu
def test_gpu_decode_pool():
    B, H, K, V = 64, 8, 128, 128
    x = make_inputs(B, 1, H, K, V)
    ro, rh = reference(x, K ** -0.5, True, True, True, -5.0, None)
    c = {n: t.to(DEV, torch.bfloat16 if n in ("q", "k", "v", "g", "beta") else torch.float32) for n, t in x.items()}
    pool = torch.zeros(2 * B, H, K, V, device=DEV)
    idx = torch.arange(B, device=DEV) * 2
    pool[idx] = c["s0"]
    o, p = fused_recurrent_kda_triton(c["q"], c["k"], c["v"], c["g"], c["beta"], K ** -0.5, pool, False, True, True,
                                      True, -5.0, None, c["A"], c["dt"], ssm_state_indices=idx)
    assert rel(o.cpu(), ro) < 2e-2 and rel(pool[idx].cpu(), rh) < 2e-2
    assert torch.count_nonzero(pool[1::2]) == 0


@gpu
def test_gpu_span_summaries():
    x = make_inputs(1, 2000, 4, 128, 128, N=2)
    cu = [0, 700, 2000]
    c = {n: t.to(DEV, torch.bfloat16 if n in ("q", "k", "v", "g", "beta") else torch.float32) for n, t in x.items()}
    M, E = span_summaries_triton(c["q"], c["k"], c["v"], c["g"], c["beta"], 128 ** -0.5, True, True, True, -5.0,
                                 torch.tensor(cu, device=DEV), c["A"], c["dt"])
    _, rh = reference(x, 128 ** -0.5, True, True, True, -5.0, cu)
    assert rel(M.double().cpu() @ x["s0"] + E.double().cpu(), rh) < 2e-2


@gpu
def test_gpu_one_million_tokens_no_nan():
    T, H, K = 1 << 20, 2, 128
    gen = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    q, k, v, g = r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H, K) * 4
    beta = r(1, T, H)
    A, dt = torch.zeros(H, device=DEV), torch.zeros(H * K, device=DEV)
    with torch.no_grad():
        o, ht = chunk_kda_triton(q, k, v, g, beta, K ** -0.5, None, True, True, True, True, -5.0, None, A, dt)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert o.abs().max() > 0


@pytest.mark.parametrize("K,V", [(16, 128), (128, 16), (32, 128), (128, 128)])
def test_prep_solve_one_slice_width(monkeypatch, K, V):
    """The rows prep's solve multiplies its T operand by U's and W's column slices at ONE width: two widths (64 and
    16 at K = 16, V = 128) made Triton 3.6's 16-bit build read shared memory out of range on the H200 (v24). The
    GPU test ``test_gpu_bf16_head_dims`` covers the fault itself; this pins the launch on any machine."""
    from k3.ops.kda.triton import chunk_prep  # noqa: PLC0415

    spy = KernelSpy(chunk_prep._prep_solve)
    monkeypatch.setattr(chunk_prep, "_prep_solve", spy)
    x = make_inputs(1, 20, 1, K, V)
    o, *_ = run_chunk(x, torch.float32, grad=False)
    seen = [(kw["BKW"], kw["BVW"]) for _, _, kw in spy.launches]
    assert seen and all(bkw == bvw for bkw, bvw in seen), seen
    assert torch.isfinite(o).all()
