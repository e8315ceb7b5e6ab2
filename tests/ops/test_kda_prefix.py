"""Span summaries, their composition, and the split prefill: exact against the unsplit path."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before triton is imported (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3.ops.kda import chunk_kda, naive_recurrent_kda
from k3.ops.kda import prefix as pf
from tests.ops.kernel_spy import KernelSpy


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    monkeypatch.delenv("K3_KDA_SPLITS", raising=False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape and torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def make(B, T, H, K, V, dtype=torch.float32, seed=0, N=None, gmax=0.02, bmax=0.3):
    """Mild gates and small β so a state carries across many segments (else every entry state is ~0 and a
    split test could not tell a wrong fold from a right one)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    xs = (r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V), -gmax * u(B, T, H, K),
          bmax * u(B, T, H), r(N or B, H, K, V))
    return [x.to(dtype) if i < 5 else x.to(torch.float64 if dtype == torch.float64 else torch.float32)
            for i, x in enumerate(xs)]


def _args(q, k, v, g, b, cu=None):
    return (q, k, v, g, b, q.shape[-1] ** -0.5, False, False, False, None, cu, None, None)


@pytest.mark.parametrize("via", ["torch", "forward"])
def test_summary_is_the_affine_map(via):
    lens = [100, 1, 64, 37]
    cu = torch.tensor([0, 100, 101, 165, 202])
    q, k, v, g, b, S0 = make(1, 202, 2, 8, 6, dtype=torch.float64, N=4, bmax=0.1)
    fn = pf._span_summaries_torch if via == "torch" else (lambda *a: pf._span_summaries_via_forward("torch", *a))
    M, E = fn(*_args(q, k, v, g, b, cu))
    assert M.shape == (4, 2, 8, 8) and E.shape == (4, 2, 8, 6) and M.dtype == torch.float64
    assert M.norm() > 0.1  # the map has not decayed to nothing: the check below tests M, not just E
    for n in range(len(lens)):
        s = slice(int(cu[n]), int(cu[n + 1]))
        _, S = naive_recurrent_kda(q[:, s], k[:, s], v[:, s], g[:, s], b[:, s], initial_state=S0[n:n + 1],
                                   output_final_state=True)
        assert rel(M[n] @ S0[n] + E[n], S[0]) < 1e-12


def test_compose_matches_concatenated_span():
    q, k, v, g, b, S0 = make(1, 150, 2, 8, 6, dtype=torch.float64, bmax=0.1)
    M, E = pf._span_summaries_torch(*_args(q, k, v, g, b, torch.tensor([0, 70, 150])))
    Mw, Ew = pf._span_summaries_torch(*_args(q, k, v, g, b))
    M2, E2 = pf.compose(M[1], E[1], M[0], E[0])
    assert rel(M2, Mw[0]) < 1e-12 and rel(E2, Ew[0]) < 1e-12
    # associativity: ((3∘2)∘1) == (3∘(2∘1)) on random spans
    Ms, Es = torch.randn(3, 2, 8, 8, dtype=torch.float64), torch.randn(3, 2, 8, 6, dtype=torch.float64)
    a = pf.compose(*pf.compose(Ms[2], Es[2], Ms[1], Es[1]), Ms[0], Es[0])
    c = pf.compose(Ms[2], Es[2], *pf.compose(Ms[1], Es[1], Ms[0], Es[0]))
    assert rel(a[0], c[0]) < 1e-12 and rel(a[1], c[1]) < 1e-12
    entry = pf.fold_entry_states(M[None], E[None], S0)
    assert torch.equal(entry[0, 0], S0[0].double()) and rel(entry[0, 1], M[0] @ S0[0] + E[0]) < 1e-14


def test_split_plan():
    assert pf.split_plan([1000], 7) == [[192, 192, 128, 128, 128, 128, 104]]
    assert pf.split_plan([100, 64, 1, 0], 3) == [[64, 36], [64], [1], [0]]
    assert all(sum(s) == L for s, L in zip(pf.split_plan([5000, 4096, 777], 5), [5000, 4096, 777]))
    assert pf.split_plan([10, 3], 0, align=1, seg_len=4) == [[4, 3, 3], [3]]
    assert pf.balanced_cut([16, 5, 1], 4) == [[4, 4, 4, 4], [3, 2], [1]]


def test_cost_model_choice():
    """The automatic rule splits where the serial state pass leaves SMs idle (B=1, H=8: 16 programs at BV 64 on 132
    SMs) and not where the prep dominates (H=32) or where a split cannot amortise (short T)."""
    m = pf.SplitCostModel()
    n = (1 << 20) // 64
    assert pf.choose_splits(1, 8, 1 << 20, 132) == 5 and pf.choose_splits(1, 8, 1 << 17, 132) == 5
    assert pf.choose_splits(1, 32, 1 << 20, 132) == 1 and pf.choose_splits(1, 16, 1 << 20, 132) == 3
    assert pf.choose_splits(8, 32, 1 << 20, 132) == 1 and pf.choose_splits(1, 8, 4096, 132) == 1
    # 4 segments: span 32 + 2·64 programs on 264 slots, state 64 programs (BV 64) on 132: one wave each
    assert m.predict_us([[n]], 8, 128, 128) == pytest.approx(n * 1.55)
    four = pf.balanced_cut([n], 4)
    assert m.predict_us(four, 8, 128, 128) == pytest.approx(n / 4 * (1.55 + 1.6) + m.window_us + 2 * m.fold_step_us)
    # 9 segments need a second wave of the state pass (144 programs): slower than 8
    assert m.predict_us(pf.balanced_cut([n], 9), 8, 128, 128) > m.predict_us(pf.balanced_cut([n], 8), 8, 128, 128)
    # 8 segments (the span pass needs a second wave) are predicted less than tie_margin faster than 5 over the
    # whole call (prep included): the fewer segments win
    prep = m.prep_us([n], 8)
    assert prep + m.predict_us(pf.balanced_cut([n], 8), 8, 128, 128) > (1 - m.tie_margin) * (
        prep + m.predict_us(pf.balanced_cut([n], 5), 8, 128, 128))
    assert m.best([n], 8, 128, 128, 32) == 5
    # against the overlapped unsplit path (measured on an H200: 47.9 ms; prep and state pass compete for the SMs,
    # ~65 % of the shorter one stays exposed) the split (measured 40.0 ms) still wins at H=8; at H=32 nothing splits
    assert pf.choose_splits(1, 8, 1 << 20, 132, overlap=11) == 5
    assert pf.choose_splits(1, 32, 1 << 20, 132, overlap=40) == 1
    prep, serial = m.prep_us([n], 8), m.predict_us([[n]], 8, 128, 128)
    side = max(prep, serial) + m.overlap_exposed * min(prep, serial)
    assert m.unsplit_total_us([n], 8, 128, 128, windows=11) == pytest.approx(
        (m.unsplit_total_us([n], 8, 128, 128) + 10 * side) / 11)
    # few windows: the first prep and the last state pass stay alone, so less is hidden
    assert m.unsplit_total_us([n], 8, 128, 128, windows=2) > m.unsplit_total_us([n], 8, 128, 128, windows=11)
    assert pf._list_schedule_us([2.0] * 5, 2) == 6.0 and pf._list_schedule_us([5.0, 1.0, 1.0, 1.0], 2) == 5.0


def test_auto_rule_on_cuda(monkeypatch):
    """``_auto_splits`` on a (pretended) CUDA device: on by default, ``K3_KDA_SPLITS=1`` and ``AUTO_SPLIT`` off
    disable it; the torch backend never splits on its own."""
    monkeypatch.setattr("k3.ops.kda.triton._common.sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    P, model = pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton")
    assert P == 5 and model is not None
    assert pf._auto_splits([1 << 20], 32, 128, 128, cuda, "triton")[0] == 1
    assert pf._auto_splits([1 << 20] + [100] * 40, 8, 128, 128, cuda, "triton")[0] == 1  # SMs full already
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "torch")[0] == 1
    from k3.ops.kda.triton.chunk_fwd import FwdConfig

    monkeypatch.setattr(FwdConfig, "overlap_windows", True, raising=False)  # the unsplit path would overlap
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton")[0] == 5  # (31.2 ms measured vs 25–27 split)
    # a bounded gate: the split runs the 16-token kernels and their model (measured best: P = 8, 15.2 ms)
    P, model = pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton", lower_bound=-5.0)
    assert P == 8 and model == pf.SplitCostModel.c16(132)
    assert pf._auto_splits([1 << 20], 32, 128, 128, cuda, "triton", lower_bound=-5.0)[0] == 1
    perfect = pf.SplitCostModel(overlap_exposed=0.0)  # were the overlap perfect, no split would pay
    assert perfect.best([(1 << 20) // 64], 8, 128, 128, 32, overlap=11) == 1
    monkeypatch.setattr(FwdConfig, "overlap_windows", False, raising=False)
    monkeypatch.setattr(pf, "AUTO_SPLIT", False)
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton")[0] == 1
    monkeypatch.setenv("K3_KDA_SPLITS", "auto")
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton")[0] == 5
    monkeypatch.setenv("K3_KDA_SPLITS", "1")
    assert pf._auto_splits([1 << 20], 8, 128, 128, cuda, "triton") == (1, None)


@pytest.mark.parametrize("P", [2, 3, 7])
def test_forced_split_matches_unsplit(P, monkeypatch):
    q, k, v, g, b, S0 = make(2, 480, 2, 8, 6)
    ref = chunk_kda(q, k, v, g, b, initial_state=S0, output_final_state=True)
    monkeypatch.setenv("K3_KDA_SPLITS", str(P))
    calls = []
    real = pf.split_chunk_kda
    monkeypatch.setattr(pf, "split_chunk_kda", lambda *a: calls.append(a[1]) or real(*a))
    with torch.no_grad():
        out = chunk_kda(q, k, v, g, b, initial_state=S0, output_final_state=True)
    assert calls == [P]
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5


@pytest.mark.parametrize("P", [3, 7])
def test_forced_split_varlen_fused_gate(P, monkeypatch):
    lens = [460, 5, 64, 130]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, b, S0 = make(1, sum(lens), 2, 8, 6, N=4)
    kw = dict(initial_state=S0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0,
              A_log=torch.zeros(2), dt_bias=torch.full((16,), -6.5))  # g ≈ −0.01: long memory
    ref = chunk_kda(q * 2, k, v, g, b - 1.5, **kw)
    monkeypatch.setenv("K3_KDA_SPLITS", str(P))
    with torch.no_grad():
        out = chunk_kda(q * 2, k, v, g, b - 1.5, **kw)
        cold = chunk_kda(q * 2, k, v, g, b - 1.5, **{**kw, "initial_state": None})
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5
    assert rel(cold[0], ref[0]) > 1e-2  # the states carry far: a wrong entry state would show


def test_split_test_detects_a_wrong_fold(monkeypatch):
    """The split tests can fail: with entry states forced to zero the split output is far from the unsplit."""
    q, k, v, g, b, S0 = make(1, 300, 2, 8, 6)
    ref, _ = chunk_kda(q, k, v, g, b)
    monkeypatch.setenv("K3_KDA_SPLITS", "4")
    monkeypatch.setattr(pf, "fold_entry_states", lambda M, E, S0: torch.zeros_like(E))
    with torch.no_grad():
        out, _ = chunk_kda(q, k, v, g, b)
    assert rel(out, ref) > 1e-2


def test_no_split_when_grad_or_cpu_auto(monkeypatch):
    q, k, v, g, b, _ = make(1, 200, 2, 8, 6)
    monkeypatch.setattr(pf, "split_chunk_kda", lambda *a: (_ for _ in ()).throw(AssertionError("split")))
    with torch.no_grad():
        chunk_kda(q, k, v, g, b)  # CPU, nothing forced: never split
        monkeypatch.setenv("K3_KDA_SPLITS", "auto")
        chunk_kda(q, k, v, g, b)  # the automatic SM rule is for CUDA only
    monkeypatch.setenv("K3_KDA_SPLITS", "3")
    o, _ = chunk_kda(q.requires_grad_(), k, v, g, b)  # gradients needed: the autograd path, unsplit
    assert o.requires_grad
    monkeypatch.setenv("K3_KDA_SPLITS", "zero")
    with pytest.raises(ValueError, match="K3_KDA_SPLITS"), torch.no_grad():
        chunk_kda(q, k, v, g, b)


def _triton_kernels():
    from k3.ops.kda.chunk import _triton_module

    return _triton_module(required=False)


# the Triton tests below run the kernels on CPU tensors in the interpreter; on a CUDA machine the GPU variants
# (``test_split_gpu_*``) cover the same paths
triton_only = pytest.mark.skipif(_triton_kernels() is None or torch.cuda.is_available(),
                                 reason="interpreter cases: k3.ops.kda.triton importable, no CUDA")


def _fp64_reference(q, k, v, g, b, cu, S0, **kw):
    """fp64 token recurrence per sequence (after the same in-kernel activations, in fp64)."""
    from k3.ops.kda.chunk import _preprocess

    lb = kw.get("lower_bound")
    qp, kp, gp, bp = _preprocess(q.double(), k.double(), g.double(), b.double(),
                                 kw.get("use_qk_l2norm_in_kernel", False), kw.get("use_gate_in_kernel", False),
                                 kw.get("use_beta_sigmoid_in_kernel", False), lb,
                                 None if kw.get("A_log") is None else kw["A_log"].double(),
                                 None if kw.get("dt_bias") is None else kw["dt_bias"].double())
    outs, states = [], []
    for n in range(len(cu) - 1):
        s = slice(int(cu[n]), int(cu[n + 1]))
        o, S = naive_recurrent_kda(qp[:, s], kp[:, s], v[:, s].double(), gp[:, s], bp[:, s],
                                   initial_state=None if S0 is None else S0[n:n + 1].double(),
                                   output_final_state=True)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1), torch.cat(states, 0)


_LENS = [200, 3, 130, 64, 0, 70]  # some shorter than a segment, one empty, one exactly a chunk


@pytest.fixture(scope="module")
def varlen_case():
    """Inputs, the unsplit Triton result (fp32) and the fp64 reference, computed once for the module."""
    os.environ["K3_KDA_BACKEND"] = "triton"
    os.environ.pop("K3_KDA_SPLITS", None)
    try:
        cu = torch.tensor([0] + torch.tensor(_LENS).cumsum(0).tolist())
        q, k, v, g, b, S0 = make(1, sum(_LENS), 1, 16, 16, N=len(_LENS))
        kw = dict(initial_state=S0, output_final_state=True, cu_seqlens=cu)
        with torch.no_grad():
            ref = chunk_kda(q, k, v, g, b, **kw)
        exact = _fp64_reference(q, k, v, g, b, cu, S0)
    finally:
        os.environ.pop("K3_KDA_BACKEND", None)
    return (q, k, v, g, b), kw, ref, exact


def _spy_split(monkeypatch) -> list:
    """Record calls of the Triton split prefill (so a test knows the one-prep path ran)."""
    from k3.ops.kda.triton import span

    calls = []
    real = span.split_prefill_triton
    monkeypatch.setattr(span, "split_prefill_triton", lambda cut, *a: calls.append(cut) or real(cut, *a))
    return calls


@triton_only
@pytest.mark.parametrize("P,fold", [(2, "triton"), (3, "triton"), (7, "triton"), (7, "torch")])
def test_split_triton_matches_unsplit(P, fold, varlen_case, monkeypatch, nan_empty):
    """Forced splits on the one-prep Triton path: outputs and final states equal the unsplit Triton path to fp32
    rounding and the fp64 token recurrence to 1e-4 (varlen: long, short, empty sequences; initial states), with the
    fold by its kernel or by fp64 torch products."""
    from k3.ops.kda.triton import span

    (q, k, v, g, b), kw, ref, exact = varlen_case
    monkeypatch.setattr(span.SplitConfig, "fold", fold)
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setenv("K3_KDA_SPLITS", str(P))
    calls = _spy_split(monkeypatch)
    with torch.no_grad():
        out = chunk_kda(q, k, v, g, b, **kw)
    assert len(calls) == 1 and calls[0]([4, 1], 1) == pf.split_plan([4, 1], P, align=1)
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5
    assert rel(out[0], exact[0]) <= 1e-4 and rel(out[1], exact[1]) <= 1e-4
    assert rel(ref[0], out[0] * 0 + exact[0]) <= 1e-4  # (the unsplit path itself is exact)


@triton_only
@pytest.mark.parametrize("K,V,bv", [(16, 20, 32), (16, 16, 16), (32, 48, 32)])
def test_fold_rows_matches_fp64(K, V, bv, monkeypatch, nan_empty):
    """``_fold_rows`` on random maps: two pieces of 4 and 2 segments (rows padded to 3, the padded row's result
    not stored), entry states scattered by the row table; against the fp64 left fold, and rows with no destination
    leave their entry slots as they were (NaN-poisoned)."""
    import triton

    from k3.ops.kda.triton import span

    monkeypatch.setattr(span.SplitConfig, "fold_bv", bv)
    Q, R, H = 2, 3, 2
    gen = torch.Generator().manual_seed(K + V)
    SE = torch.randn(Q, R, H, K, V, generator=gen)
    Mt = torch.eye(K) + 0.3 * torch.randn(Q, R, H, K, K, generator=gen) / K**0.5
    row_dst = torch.tensor([1, 2, 3, 5, -1, -1], dtype=torch.int32)  # piece 1: one fold row (2 segments)
    ent = torch.full((7, H, K, V), float("nan"))
    se = SE.clone()  # the kernel overwrites its rows
    span._fold_rows[(triton.cdiv(V, bv), Q, H)](se, Mt, ent, row_dst, R, H, K, V, BK=max(16, K), BV=bv, BKB=16)
    for q in range(Q):
        S = SE[q, 0].double()
        for j in range(R):
            if j:
                S = Mt[q, j].double() @ S + SE[q, j].double()
            d = int(row_dst[q * R + j])
            if d >= 0:
                assert rel(ent[d], S.float()) <= 1e-6, (q, j)
    assert torch.isnan(ent[[0, 4, 6]]).all()


@triton_only
def test_split_fold_validated(monkeypatch):
    from k3.ops.kda.triton import span

    monkeypatch.setattr(span.SplitConfig, "fold", "fp16")
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setenv("K3_KDA_SPLITS", "3")
    q, k, v, g, b, _ = make(1, 300, 1, 16, 16)
    with pytest.raises(ValueError, match="SplitConfig.fold"), torch.no_grad():
        chunk_kda(q, k, v, g, b)


@triton_only
def test_split_triton_detects_a_wrong_fold(varlen_case, monkeypatch):
    """The comparison above can fail: entry states of segments after the first left at zero give a large error."""
    from k3.ops.kda.triton import span

    (q, k, v, g, b), kw, ref, _ = varlen_case
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setenv("K3_KDA_SPLITS", "3")
    real = span._span_and_fold

    def wrong(bufs, ht, w, K, V, prec):
        e = real(bufs, ht, w, K, V, prec)
        e[w.i64["dst"]] = 0.0
        return e

    monkeypatch.setattr(span, "_span_and_fold", wrong)
    with torch.no_grad():
        out = chunk_kda(q, k, v, g, b, **kw)
    assert rel(out[0], ref[0]) > 1e-2


@triton_only
def test_split_triton_windows_extreme_gates(monkeypatch, nan_empty):
    """Sequences crossing several small windows (the state carried between windows, a piece per window), the K3
    activations in the kernel, no initial state; gates at the bound and β near 0 / 1 (logits ±12), and a batch
    with mild gates so states carry: split 3 equals unsplit and the fp64 recurrence."""
    from k3.ops.kda.triton import span
    from k3.ops.kda.triton._common import next_pow2, store_dtype
    from k3.ops.kda.triton.chunk_fwd import chunk_bytes

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(span.SplitConfig, "window_bytes", 5 * chunk_bytes(1, next_pow2(16), next_pow2(16),
                                                                           store_dtype(torch.float32)))
    lens = [400, 20, 150]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, b, _ = make(1, sum(lens), 1, 16, 16)
    sign = torch.where(torch.arange(sum(lens)) % 3 == 0, 12.0, -12.0)[None, :, None]
    cases = {"bound": (torch.full((16,), 30.0), b * 0 + sign),  # g = lb·σ(30) = lb; β = σ(±12)
             "mild": (torch.full((16,), -6.5), b - 1.5)}  # g ≈ −0.01: long memory
    for name, (dt_bias, beta) in cases.items():
        kw = dict(output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=torch.zeros(1), dt_bias=dt_bias)
        with torch.no_grad():
            monkeypatch.setenv("K3_KDA_SPLITS", "1")
            ref = chunk_kda(q, k, v, g, beta, **kw)
            monkeypatch.setenv("K3_KDA_SPLITS", "3")
            calls = _spy_split(monkeypatch)
            out = chunk_kda(q, k, v, g, beta, **kw)
        exact = _fp64_reference(q, k, v, g, beta, cu, None, **kw)
        assert len(calls) == 1, name
        assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5, name
        assert rel(out[0], exact[0]) <= 1e-4 and rel(out[1], exact[1]) <= 1e-4, name


def _k3_call_case(lens: list[int], seed: int = 0, D: int = 16, V: int | None = None):
    """fp32 inputs and the K3 call's keywords (bounded gate fused, in-kernel norms and β), mild gates so states carry
    across segments, initial states: the 16-token flow's domain. Head dims K = D, V (default D)."""
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k, v, g, b, S0 = make(1, sum(lens), 2, D, V or D, N=len(lens), seed=seed)
    kw = dict(initial_state=S0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=torch.zeros(2),
              dt_bias=torch.full((2 * D,), -6.5))  # g ≈ −0.01 per token: long memory
    return (q, k, v, g, b - 1.5), kw


@triton_only
@pytest.mark.parametrize("P,u_rowmajor,mode", [(2, True, None), (3, True, None), (7, True, None), (2, True, 2),
                                              (7, True, 2), (2, False, 2), (3, False, 2), (7, False, 2)])
def test_split_c16_matches_unsplit(P, u_rowmajor, mode, monkeypatch, nan_empty):
    """``SplitConfig.flow = "c16"``: the 16-token prep, span pass (its backward chain, ``_c16_span_rows_rev``, the
    default) and segmented state pass. Forced splits over small windows (a sequence crossing several, one shorter than a
    segment, one empty) equal the unsplit path to fp32 rounding and the fp64 recurrence to 1e-4; a spy checks that
    the 16-token span pass ran. The library's mode (3), and mode 2 for the split alone (``SplitConfig.c16_mode``;
    the unsplit reference in the library's mode) with both of its storages of U (row-major, transposed)."""
    from k3.ops.kda.triton import chunk16, span

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(chunk16.C16Config, "u_rowmajor", u_rowmajor)
    monkeypatch.setattr(span.SplitConfig, "c16_mode", mode)
    default_mode = chunk16.C16Config.mode
    monkeypatch.setattr(span.SplitConfig, "window_bytes", 5 * chunk16.c16_chunk_bytes(2, 16, 16, torch.float32))
    (q, k, v, g, b), kw = _k3_call_case([400, 20, 0, 150])
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(q, k, v, g, b, **kw)
        monkeypatch.setenv("K3_KDA_SPLITS", str(P))
        monkeypatch.setattr(span.SplitConfig, "flow", "c16")
        spans = []
        real = chunk16.launch_c16_span
        monkeypatch.setattr(chunk16, "launch_c16_span", lambda *a: spans.append(chunk16._mode()) or real(*a))
        out = chunk_kda(q, k, v, g, b, **kw)
    exact = _fp64_reference(q, k, v, g, b, kw["cu_seqlens"], kw["initial_state"], **kw)
    want = mode or chunk16.C16Config.mode
    assert spans and set(spans) == {want}, f"the 16-token span pass did not run (in mode {want}): {spans}"
    assert chunk16.C16Config.mode == default_mode  # the split's mode was set for its call only
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5
    assert rel(out[0], exact[0]) <= 1e-4 and rel(out[1], exact[1]) <= 1e-4


@triton_only
@pytest.mark.parametrize("span_bv,rev_rows,blocks", [(16, None, 4), (128, None, 2), (16, 16, 2), (128, 64, 1)])
def test_split_c16_span_column_blocks(span_bv, rev_rows, blocks, monkeypatch, nan_empty):
    """The span pass's blocks, K = V = 32, forced 3 segments over a varlen batch, equal to the unsplit path to fp32
    rounding. The forward chain (``span_reverse`` off): [S_ext | M] at ``C16Config.span_bv`` 16 (two S_ext and two M
    programs per row) and 128 (capped at the head dims: one of each, the H200 default's layout at K = V = 128).
    The backward chain: ``span_rev_rows`` 16 (two programs of 16 rows of (M, S_ext) per affine row, two of 16 S_ext
    columns for a piece's first row) and 64 (capped: one program per row)."""
    from k3.ops.kda.triton import chunk16, span

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    monkeypatch.setattr(chunk16.C16Config, "span_bv", span_bv)
    monkeypatch.setattr(chunk16.C16Config, "span_reverse", rev_rows is not None)
    if rev_rows is not None:
        monkeypatch.setattr(chunk16.C16Config, "span_rev_rows", rev_rows)
    name = "_c16_span_rows" if rev_rows is None else "_c16_span_rows_rev"
    (q, k, v, g, b), kw = _k3_call_case([230, 90], D=32)
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(q, k, v, g, b, **kw)
        monkeypatch.setenv("K3_KDA_SPLITS", "3")
        spy = KernelSpy(getattr(chunk16, name))
        monkeypatch.setattr(chunk16, name, spy)
        out = chunk_kda(q, k, v, g, b, **kw)
    assert spy.grids and {gr[0] for gr in spy.grids} == {blocks}, spy.grids
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5


@triton_only
@pytest.mark.parametrize("K,V,rev_rows", [(32, 16, 16), (16, 48, 64), (24, 40, 16)])
def test_split_c16_backward_chain_head_dims(K, V, rev_rows, monkeypatch, nan_empty):
    """The span pass's backward chain at K ≠ V, with padded head dims (24 → 32, 40 / 48 → 64: rows of M and S_ext
    past K and columns past V are masked) and several row blocks per affine row (``span_rev_rows`` 16 at K = 32):
    forced 3 segments over a varlen batch equal the unsplit path to fp32 rounding and the fp64 recurrence to 1e-4."""
    from k3.ops.kda.triton import chunk16, span

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    monkeypatch.setattr(chunk16.C16Config, "span_rev_rows", rev_rows)
    (q, k, v, g, b), kw = _k3_call_case([230, 90], D=K, V=V)
    spy = KernelSpy(chunk16._c16_span_rows_rev)
    monkeypatch.setattr(chunk16, "_c16_span_rows_rev", spy)
    ref, out, _ = _unsplit_then_split(monkeypatch, 3, (q, k, v, g, b), kw)
    exact = _fp64_reference(q, k, v, g, b, kw["cu_seqlens"], kw["initial_state"], **kw)
    assert spy.grids, "the backward chain did not run"
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5
    assert rel(out[0], exact[0]) <= 1e-4 and rel(out[1], exact[1]) <= 1e-4


@triton_only
def test_split_c16_fp16(monkeypatch, nan_empty):
    """fp16 storage through the 16-token split (the span pass's identity product on fp16 U): forced 3 equals unsplit
    to fp16 rounding."""
    from k3.ops.kda.triton import span

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    (q, k, v, g, b), kw = _k3_call_case([300, 100])
    q, k, v, g, b = (x.half() for x in (q, k, v, g, b))
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(q, k, v, g, b, **kw)
        monkeypatch.setenv("K3_KDA_SPLITS", "3")
        out = chunk_kda(q, k, v, g, b, **kw)
    assert rel(out[0], ref[0]) <= 5e-3 and rel(out[1], ref[1]) <= 5e-3


@triton_only
def test_split_c16_detects_a_wrong_span(monkeypatch):
    """The comparison above can fail: M left at the identity in the 16-token span rows gives a large error."""
    from k3.ops.kda.triton import chunk16, span

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    (q, k, v, g, b), kw = _k3_call_case([400, 150])
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(q, k, v, g, b, **kw)
        monkeypatch.setenv("K3_KDA_SPLITS", "3")
        real = chunk16.launch_c16_span

        def s_only(bufs, SE, Mt, rows, *a):
            real(bufs, SE, Mt, {**rows, "row_m": torch.zeros_like(rows["row_m"])}, *a)  # M never updated

        monkeypatch.setattr(chunk16, "launch_c16_span", s_only)
        out = chunk_kda(q, k, v, g, b, **kw)
    assert rel(out[0], ref[0]) > 1e-2


def _forgetting(kw: dict, heads: int = 2) -> dict:
    """The benchmark's gates (BASELINES: A_log = dt_bias = 0 on N(0, 1) inputs) on the first ``heads`` heads: every
    channel there forgets within a few tokens (each block's decay bound is ~2^−7 at these head dims); the other
    heads keep ``_k3_call_case``'s long memory."""
    dt = kw["dt_bias"].clone().view(kw["A_log"].numel(), -1)
    dt[:heads] = 0.0
    return {**kw, "dt_bias": dt.flatten()}


def _unsplit_then_split(monkeypatch, P: int, args: tuple, kw: dict, spy_m: bool = False) -> tuple:
    """``chunk_kda`` unsplit, then forced into P segments (no grad): (unsplit result, split result, and with
    ``spy_m`` the (head, M) rows the split's span pass stored)."""
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(*args, **kw)
        monkeypatch.setenv("K3_KDA_SPLITS", str(P))
        m_rows = _span_m_rows(monkeypatch) if spy_m else None
        out = chunk_kda(*args, **kw)
    return ref, out, m_rows


def _span_m_rows(monkeypatch) -> list:
    """Spy on the 16-token span pass: (head, M) of every row that has an M (``row_m``), as stored after the call."""
    from k3.ops.kda.triton import chunk16

    seen = []
    real = chunk16.launch_c16_span

    def spy(bufs, SE, Mt, rows, *a):
        real(bufs, SE, Mt, rows, *a)
        has_m = rows["row_m"].view(Mt.shape[:2]).bool()
        seen.extend((h, Mt[q, r, h]) for q, r in has_m.nonzero().tolist() for h in range(Mt.shape[2]))

    monkeypatch.setattr(chunk16, "launch_c16_span", spy)
    return seen


@triton_only
@pytest.mark.parametrize("P,windows", [(3, True), (7, False)])
@pytest.mark.parametrize("gates", ["mixed", "long_memory"])
def test_split_c16_forget_is_exact(P, windows, gates, monkeypatch, nan_empty):
    """``SplitConfig.forget_log2``: where a row's suffix provably scales its history by ≤ 2^−40, its M is stored as
    0 and S_ext runs over the suffix alone — on a head whose gates forget (the benchmark's) some rows do so, on a
    head with long memory none may (its M stay nonzero), and the result still equals the unsplit path to fp32
    rounding and the fp64 recurrence to 1e-4 (varlen, initial states, a sequence shorter than a segment; with
    ``windows``, windows of 5 chunks that the sequences cross, so rows also start from carried states)."""
    from k3.ops.kda.triton import chunk16, span

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    monkeypatch.setattr(span.SplitConfig, "forget_log2", 40.0)
    if windows:
        monkeypatch.setattr(span.SplitConfig, "window_bytes", 5 * chunk16.c16_chunk_bytes(2, 16, 16, torch.float32))
    (q, k, v, g, b), kw = _k3_call_case([400, 20, 0, 270], seed=P)
    if gates == "mixed":
        kw = _forgetting(kw, heads=1)
    ref, out, m_rows = _unsplit_then_split(monkeypatch, P, (q, k, v, g, b), kw, spy_m=True)
    exact = _fp64_reference(q, k, v, g, b, kw["cu_seqlens"], kw["initial_state"], **kw)
    zero = [(h, bool((m == 0).all())) for h, m in m_rows]
    assert m_rows and not any(z for h, z in zero if h == 1), zero  # head 1 remembers
    assert any(z for h, z in zero if h == 0) == (gates == "mixed"), zero
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5
    assert rel(out[0], exact[0]) <= 1e-4 and rel(out[1], exact[1]) <= 1e-4


@triton_only
@pytest.mark.parametrize("beta_logit", [20.0, -20.0])
def test_split_c16_forget_extremes(beta_logit, monkeypatch, nan_empty):
    """Every gate at the bound (decay e^−5 per token), β near 1 or near 0, repeated keys: every row with an M drops
    it (both heads), and the split still equals the unsplit path and the fp64 recurrence."""
    from k3.ops.kda.triton import span

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    (q, k, v, g, b), kw = _k3_call_case([300, 0, 200])
    g = torch.full_like(g, 30.0)  # σ(e^A (g + dt)) = 1: log-decay at the lower bound
    b = torch.full_like(b, beta_logit)
    k = k.clone()
    k[:, 1::2] = k[:, 0::2][:, : k[:, 1::2].shape[1]]  # each key repeated at the next token
    ref, out, m_rows = _unsplit_then_split(monkeypatch, 3, (q, k, v, g, b), kw, spy_m=True)
    exact = _fp64_reference(q, k, v, g, b, kw["cu_seqlens"], kw["initial_state"], **kw)
    assert m_rows and all(bool((M == 0).all()) for _, M in m_rows)
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5
    assert rel(out[0], exact[0]) <= 1e-4 and rel(out[1], exact[1]) <= 1e-4


@triton_only
def test_split_c16_forget_detects_a_loose_bound(monkeypatch):
    """The comparison above can fail: a bound of 2^−0.05 on long-memory gates drops history that still counts (a
    large error). Without the in-kernel L2 norm (the bound's premise) the same bound is not applied: exact."""
    from k3.ops.kda.triton import span

    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    monkeypatch.setattr(span.SplitConfig, "forget_log2", 0.05)
    (q, k, v, g, b), kw = _k3_call_case([400, 150])
    for norm, bad in ((True, True), (False, False)):
        ref, out, _ = _unsplit_then_split(monkeypatch, 3, (q, k, v, g, b), {**kw, "use_qk_l2norm_in_kernel": norm})
        assert (rel(out[0], ref[0]) > 1e-2) == bad, (norm, rel(out[0], ref[0]))


@triton_only
def test_prep_decay_bound(monkeypatch):
    """The prep's per-block bound ("DEC", log2) is 16 × the block's largest log2 decay of the gate the kernels apply,
    0 for a block with rows past its sequence's end (those claim no decay) and for blocks past it; the buffer
    exists only when asked for."""
    from k3.ops.kda.chunk import _preprocess
    from k3.ops.kda.triton import chunk16
    from k3.ops.kda.triton._common import make_chunk_table

    lens = [37, 64]
    (q, k, v, g, b), kw = _k3_call_case(lens)
    kw = _forgetting(kw)
    cu = kw["cu_seqlens"].to(torch.int32)
    tab = make_chunk_table(1, sum(lens), cu, q.device)
    assert "DEC" not in chunk16.alloc_c16_buffers(2, tab.NC, 16, 16, torch.float32, "cpu")
    bufs = chunk16.alloc_c16_buffers(2, tab.NC, 16, 16, torch.float32, "cpu", decay_bound=True)
    bufs["DEC"].fill_(float("nan"))
    flags = dict(l2norm=True, use_gate=True, beta_sigmoid=True, exact_diag=False)
    chunk16.launch_c16_prep(q, k, v, g, b, kw["A_log"], kw["dt_bias"], bufs, tab, 0, tab.NC, 0.25, -5.0, flags)
    gate = _preprocess(q, k, g, b, True, True, True, -5.0, kw["A_log"], kw["dt_bias"])[2][0] / math.log(2)
    want = torch.zeros(2, tab.NC * 4)  # [H, blocks]
    for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for j in range(-(-(e - a) // 16)):
            rows = gate[a + 16 * j:min(a + 16 * (j + 1), e)]  # [≤16, H, K]
            m = rows.amax(dim=(0, 2)) * 16
            want[:, int(tab.chunk_off_cpu[n]) * 4 + j] = m if rows.shape[0] == 16 else 0.0
    got = bufs["DEC"].flatten(1)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got, want)


def test_split_forget_validated(monkeypatch):
    """``SplitConfig.forget_log2`` must be None or a number > 0, and the span pass needs the prep's bounds."""
    from k3.ops.kda.triton import chunk16, span

    flags = dict(l2norm=True, beta_sigmoid=True)
    for bad in (0, -1.0, True, "128"):
        monkeypatch.setattr(span.SplitConfig, "forget_log2", bad)
        with pytest.raises(ValueError, match="SplitConfig.forget_log2"):
            span._forget_log2(flags)
    monkeypatch.setattr(span.SplitConfig, "forget_log2", 64)
    assert span._forget_log2(flags) == 64.0
    assert span._forget_log2(dict(l2norm=True, beta_sigmoid=False)) is None  # the premise β ∈ (0, 1) unmet
    bufs = chunk16.alloc_c16_buffers(1, 1, 16, 16, torch.float32, "cpu")
    rows = {n: torch.zeros(1, dtype=torch.int32) for n in ("row_cs", "row_ce", "row_m")}
    with pytest.raises(ValueError, match="forget_log2"):
        chunk16.launch_c16_span(bufs, None, None, rows, 0, 1, 16, 16, forget_log2=128.0)


def test_split_flow_validated_and_falls_back(monkeypatch):
    """An unknown ``SplitConfig.flow`` is a ValueError; "c16" without a bounded gate or in another mode runs "c64"."""
    from k3.ops.kda.triton import chunk16, span

    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    assert span.split_flow(-5.0) == "c16"
    assert span.split_flow(None) == "c64"
    monkeypatch.setattr(chunk16.C16Config, "mode", 1)
    assert span.split_flow(-5.0) == "c64"
    monkeypatch.setattr(span.SplitConfig, "c16_mode", 3)  # the split's own mode overrides the library's
    assert span.split_flow(-5.0) == "c16"
    monkeypatch.setattr(span.SplitConfig, "c16_mode", 1)
    with pytest.raises(ValueError, match="SplitConfig.c16_mode"):
        span.split_flow(-5.0)
    monkeypatch.setattr(span.SplitConfig, "c16_mode", None)
    monkeypatch.setattr(span.SplitConfig, "flow", "c64")
    assert span.split_flow(-5.0) == "c64"
    monkeypatch.setattr(span.SplitConfig, "flow", "fast")
    with pytest.raises(ValueError, match="SplitConfig.flow"):
        span.split_flow(-5.0)


@triton_only
def test_split_triton_dense_batch_model_cut(monkeypatch, nan_empty):
    """A fixed-length batch (B = 2, no cu_seqlens) through the cost-model cut with a model made to favour
    splitting (slow state steps), V = 32 with the split's state pass at BV 16 (``SplitConfig.state_bv``): the cut
    is real (≥ 2 segments) and the result equals unsplit."""
    from k3.ops.kda.triton import span
    from k3.ops.kda.triton.chunk_fwd import FwdConfig

    bv_before = FwdConfig.state_bv
    monkeypatch.setenv("K3_KDA_BACKEND", "triton")
    q, k, v, g, b, S0 = make(2, 300, 1, 16, 32)
    model = pf.SplitCostModel(sm_count=64, state_step_us=100.0, span_step_us=1.0, window_us=0.0, fold_step_us=0.0,
                              min_gain=0.0)
    assert model.best([5, 5], 1, 16, 32, 8) > 1
    args = (q, k, v, g, b, 16 ** -0.5, S0, True, False, False, False, None, None, None, None)
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(q, k, v, g, b, initial_state=S0, output_final_state=True)
        calls = _spy_split(monkeypatch)
        monkeypatch.setattr(span.SplitConfig, "state_bv", 16)
        out = pf.split_chunk_kda("triton", 0, *args, model=model)
    assert len(calls) == 1 and max(len(s) for s in calls[0]([5, 5], 1)) > 1
    assert rel(out[0], ref[0]) <= 1e-5 and rel(out[1], ref[1]) <= 1e-5
    assert FwdConfig.state_bv == bv_before  # the override was for the split's launch only


def _gpu_k3_case(lens: list[int], dt_bias: torch.Tensor, dtype: torch.dtype, seed: int) -> tuple[dict, dict]:
    """GPU inputs (K = V = 128, heads = dt_bias.shape[0]) and the K3 call's keywords: a varlen batch with initial
    states, the bounded gate fused with A_log = 0 and the given dt_bias [H, 128]."""
    H = dt_bias.shape[0]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    T = sum(lens)
    x = dict(q=r(1, T, H, 128).to(dtype), k=r(1, T, H, 128).to(dtype), v=r(1, T, H, 128).to(dtype),
             g=r(1, T, H, 128).to(dtype), beta=r(1, T, H).to(dtype))
    kw = dict(initial_state=r(len(lens), H, 128, 128), output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              lower_bound=-5.0, A_log=torch.zeros(H, device="cuda"), dt_bias=dt_bias.flatten())
    return x, kw


@pytest.mark.gpu_quick
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flow", ["c64", "c16"])
def test_split_gpu_matches_unsplit(dtype, flow, monkeypatch):
    """GPU, K = V = 128, the K3 activations, varlen with initial states and long memory: forced 2, 3, 7, the
    automatic rule (made to consider these short sequences) and forced 3 over many windows with the prep
    overlapped equal unsplit (fp32: 1e-5; bf16 storage: 2e-2), with the split's 64-token or 16-token kernels."""
    from k3.ops.kda.triton import span

    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    monkeypatch.setattr(span.SplitConfig, "flow", flow)
    H = 4
    x, kw = _gpu_k3_case([20000, 3, 9000, 777], torch.full((H, 128), -6.5, device="cuda"), dtype, seed=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(**x, **kw)
        for P in ("2", "3", "7", "auto"):
            monkeypatch.setenv("K3_KDA_SPLITS", P)
            if P == "auto":
                monkeypatch.setattr(pf, "_MIN_SEG", 1024)
                monkeypatch.setattr("k3.ops.kda.triton._common.sm_count", lambda device: 132)
                assert pf.SplitCostModel().best([313, 1, 141, 13], H, 128, 128, 32) > 1
                calls = _spy_split(monkeypatch)
            out = chunk_kda(**x, **kw)
            if P == "auto":
                assert len(calls) == 1
            assert torch.isfinite(out[0]).all(), P
            assert rel(out[0].float(), ref[0].float()) <= tol and rel(out[1], ref[1]) <= tol, P
        # many small windows with the next window's prep on a side stream: the same result
        from k3.ops.kda.triton.chunk_fwd import chunk_bytes

        monkeypatch.setenv("K3_KDA_SPLITS", "3")
        monkeypatch.setattr(span.SplitConfig, "window_bytes", 40 * chunk_bytes(H, 128, 128, span.store_dtype(dtype)))
        monkeypatch.setattr(span.SplitConfig, "overlap_prep", True)
        for priority in (False, True):  # the serial passes on the caller's stream / a high-priority one
            monkeypatch.setattr(span.SplitConfig, "serial_priority", priority)
            out = chunk_kda(**x, **kw)
            assert rel(out[0].float(), ref[0].float()) <= tol and rel(out[1], ref[1]) <= tol, priority


@pytest.mark.gpu_quick
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_gpu_forget(dtype, monkeypatch):
    """GPU, K = V = 128, the K3 call (bf16: the Gluon prep): with the default ``SplitConfig.forget_log2`` the rows of
    the heads whose gates forget (the benchmark's) store M = 0 while the long-memory heads' do not, and forced
    splits (3, 7, and 3 over many windows with the prep overlapped) equal unsplit and the split without the bound
    (fp32: 1e-5; bf16 storage: 2e-2)."""
    from k3.ops.kda.triton import span

    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    monkeypatch.setattr(span.SplitConfig, "flow", "c16")
    H = 4
    dt = torch.zeros(H, 128, device="cuda")
    dt[2:] = -6.5  # heads 2, 3 remember (g ≈ −0.01 per token); heads 0, 1 forget within a few tokens
    x, kw = _gpu_k3_case([30000, 3, 9000, 777], dt, dtype, seed=1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(**x, **kw)
        for P in ("3", "7"):
            monkeypatch.setenv("K3_KDA_SPLITS", P)
            with monkeypatch.context() as mp:
                mp.setattr(span.SplitConfig, "forget_log2", None)
                full = chunk_kda(**x, **kw)
            with monkeypatch.context() as mp:
                m_rows = _span_m_rows(mp)
                out = chunk_kda(**x, **kw)
            zero = {(h, bool((M == 0).all())) for h, M in m_rows}
            assert (0, True) in zero and (1, True) in zero and (2, True) not in zero and (3, True) not in zero, zero
            assert torch.isfinite(out[0]).all(), P
            for a in (ref, full):
                assert rel(out[0].float(), a[0].float()) <= tol and rel(out[1], a[1]) <= tol, P
        from k3.ops.kda.triton.chunk16 import c16_chunk_bytes

        monkeypatch.setenv("K3_KDA_SPLITS", "3")
        window = 40 * c16_chunk_bytes(H, 128, 128, span.store_dtype(dtype))
        monkeypatch.setattr(span.SplitConfig, "window_bytes", window)
        monkeypatch.setattr(span.SplitConfig, "overlap_prep", True)
        out = chunk_kda(**x, **kw)
        assert rel(out[0].float(), ref[0].float()) <= tol and rel(out[1], ref[1]) <= tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K,V", [(16, 128), (128, 16), (100, 72), (64, 64)])
def test_split_gpu_head_dims_bf16(K, V, monkeypatch):
    """GPU, bf16, head dims other than K = V = 128 (the 64-token split kernels): forced 2, 3 and 7 segments of a
    varlen batch with initial states equal the unsplit call (2e-2: bf16 storage)."""
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    lens = [3000, 5, 1700]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    T, H = sum(lens), 2
    x = dict(q=r(1, T, H, K).bfloat16(), k=r(1, T, H, K).bfloat16(), v=r(1, T, H, V).bfloat16(),
             g=r(1, T, H, K).bfloat16(), beta=r(1, T, H).bfloat16())
    kw = dict(initial_state=r(len(lens), H, K, V), output_final_state=True, cu_seqlens=cu,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
              lower_bound=-5.0, A_log=torch.zeros(H, device="cuda"), dt_bias=torch.full((H * K,), -6.5, device="cuda"))
    with torch.no_grad():
        monkeypatch.setenv("K3_KDA_SPLITS", "1")
        ref = chunk_kda(**x, **kw)
        for P in ("2", "3", "7"):
            monkeypatch.setenv("K3_KDA_SPLITS", P)
            calls = _spy_split(monkeypatch)
            out = chunk_kda(**x, **kw)
            assert len(calls) == 1 and torch.isfinite(out[0]).all(), P
            assert rel(out[0].float(), ref[0].float()) <= 2e-2 and rel(out[1], ref[1]) <= 2e-2, P
